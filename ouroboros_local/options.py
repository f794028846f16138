"""Typed method options: each option is defined once, with its type and bounds.

One parser (``parse``) serves the Python API, the CLI and the server, so a bad value gets the same
one-line error everywhere and nothing is allocated before every value is checked. The bounds are sane
caps (a lookahead window of 100000 would allocate O(W^2) cells); the proposers clamp again to the
batch and the context they are given.

A method declares its options as a tuple of ``Option`` (``OPTIONS`` in its module, see
``proposers/__init__.py``); the CLI's flags are generated from ``ALL`` below.
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping

from .errors import MethodOptionError

_INT_LIMIT = 2**63 - 1


def is_integer(value: object) -> bool:
    """An int or a numpy integer (numpy registers its numbers with ``numbers``, so numpy is not imported
    here); not a bool (True is 1 to Python, never a count here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """An int, a float or a numpy number; not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Option:
    name: str
    kind: str                 # int, float, bool, choice, path, int_or_auto
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None
    choices: tuple[str, ...] = ()
    flag: bool | str = True   # exposed on the command line as --NAME (underscores as dashes) or --FLAG
    per_request: bool = True  # False: set when the engine or server starts, never by one request
    aliases: tuple[str, ...] = ()
    open_bounds: str = ""     # "lo", "hi" or "lo,hi": that bound itself is refused (AdaEDL's lambda < 1)
    # (a bool option, what it switches on): this one takes effect only with that on, and is refused
    # without it, where it would be ignored as if it had taken effect
    needs: tuple[str, str] = ()
    at_most: str = ""         # another option this one may not exceed (min_ngram, max_ngram)

    def with_default(self, default: Any) -> "Option":
        return replace(self, default=default)

    @property
    def flag_name(self) -> str | None:
        if not self.flag:
            return None
        return "--" + (self.flag if isinstance(self.flag, str) else self.name.replace("_", "-"))

    def check(self, value: Any) -> Any:
        """The value converted to this option's type, or MethodOptionError naming the option."""
        if value is None:
            return None
        kind = self.kind
        if kind == "int_or_auto" and value == "auto":
            return value
        if kind in ("int", "int_or_auto"):
            return self._bounded(self._integer(value))
        if kind == "float":
            if not is_real(value):   # numpy's numbers too, as max_tokens and the sampler settings take them
                raise self._error(f"must be a number (got {value!r})")
            if not math.isfinite(value):
                raise self._error(f"must be a finite number (got {value!r})")
            return self._bounded(float(value))
        if kind == "bool":
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            raise self._error(f"must be true or false (got {value!r})")
        if kind == "choice":
            if not isinstance(value, str) or value not in self.choices:
                raise self._error(f"must be one of {', '.join(self.choices)} (got {value!r})")
            return value
        if kind == "path":
            if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
                raise self._error(f"must be a file path (got {value!r})")
            return str(value)
        raise AssertionError(f"unknown option kind {kind!r}")  # pragma: no cover

    def _integer(self, value: Any) -> int:
        if is_real(value) and not is_integer(value) and float(value).is_integer():   # 5.0: 5
            value = int(value)
        if not is_integer(value):
            wanted = "an integer or auto" if self.kind == "int_or_auto" else "an integer"
            raise self._error(f"must be {wanted} (got {value!r})")
        return int(value)

    def _bounded(self, value: float) -> Any:
        lo = -_INT_LIMIT if self.lo is None else self.lo
        hi = _INT_LIMIT if self.hi is None else self.hi
        open_lo, open_hi = "lo" in self.open_bounds, "hi" in self.open_bounds
        if not ((lo < value if open_lo else lo <= value) and (value < hi if open_hi else value <= hi)):
            if open_lo or open_hi:
                interval = f"in {'(' if open_lo else '['}{_show(lo)}, {_show(hi)}{')' if open_hi else ']'}"
                raise self._error(f"must be {interval} (got {value!r})")
            raise self._error(f"must be between {_show(lo)} and {_show(hi)} (got {value!r})")
        return value

    def _error(self, what: str) -> MethodOptionError:
        return MethodOptionError(f"option {self.name!r} {what}")


def _show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ---- every option, defined once (methods pick theirs and may change the default) -----------------
GAMMA = Option("gamma", "int", None, "draft tokens per round (default: the method's)", 1, 64)
WINDOW = Option("window", "int", 4, "lookahead window columns (W; ouroboros: 0 = no window)", 0, 64)
LEVEL = Option("level", "int", 3, "lookahead n-gram size (N)", 3, 16, aliases=("ngram",))
GUESS_SET = Option("guess_set", "int", 4, "pool phrases verified per round (G)", 0, 64, aliases=("guess",))
TOPK = Option("topk", "int", 2, "pool phrases hung after a draft", 0, 64)
# 16: a match counts as 16 tokens at most (prompt_lookup.MATCH_CAP), and every n-gram size is indexed at
# every position (64 took 400 MB and 10 s more on a 16k-token prompt)
MAX_NGRAM = Option("max_ngram", "int", 3, "prompt-lookup: longest n-gram matched", 1, 16)
MIN_NGRAM = Option("min_ngram", "int", 1, "prompt-lookup: shortest n-gram matched", 1, 16, flag=False,
                   at_most="max_ngram")
MAX_BRANCHES = Option("max_branches", "int", 1, "prompt-lookup: matches drafted as branches", 1, 16,
                      flag=False)
P_MIN = Option("p_min", "float", 0.0, "stop drafting where the draft's top probability is below this", 0.0, 1.0)
POOL = Option("pool", "path", None, "history file: the phrase pool in FILE and, for auto, suffix and ouroboros, the "
              "suffix trie of earlier answers in FILE.suffix; loaded at start, saved after answers (history reuse)",
              per_request=False)
FEED_POOL = Option("feed_pool", "bool", True, "prompt-lookup: add the text's phrases to the pool", flag=False)
HARVEST = Option("harvest", "choice", "predicted-tail", "phrases taken from verification",
                 choices=("none", "predicted-tail", "agreeing-runs", "off", "specbench", "spec-bench", "core"),
                 flag=False)
POOL_FROM_PROMPT = Option("pool_from_prompt", "bool", True, "seed the pool with the prompt's n-grams", flag=False)
WARM_START = Option("warm_start", "bool", True, "lookahead: keep the pool across requests", flag=False)
OVERSHOOT = Option("overshoot", "bool", True, "ouroboros: draft past the budget and trim", flag=False)
SEED = Option("seed", "int", 0, "seed of the method's own random choices", 0, 2**32 - 1, flag=False)
ADAPTIVE = Option("adaptive", "bool", True, "schedule draft lengths by the cost model (false: fixed "
                  "hyperparameters every round)", flag=False)
ADAEDL = Option("adaedl", "bool", False, "speculative: stop drafting early when the draft's entropy is "
                "high (AdaEDL)")
ADAEDL_LAMBDA = Option("adaedl_lambda", "float", None, "AdaEDL's initial threshold, in [0, 1)", 0.0, 1.0,
                       open_bounds="hi", needs=("adaedl", "AdaEDL"))
# AdaEDL refuses gamma_e 0 and the others at 1
ADAEDL_TUNING = tuple(Option(f"adaedl_{name}", "float", None, f"AdaEDL {name}", 0.0, hi, flag=False,
                             open_bounds=bounds, needs=("adaedl", "AdaEDL"))
                      for name, hi, bounds in (("gamma_e", 1.0, "lo"), ("alpha", 1.0, "hi"), ("beta1", 1.0, "hi"),
                                               ("beta2", 1.0, "hi"), ("eps", 1.0, "hi")))
GREEDY_DRAFT = Option("greedy_draft", "bool", None, "draft with the draft's argmax even when sampling "
                      "(default: when the request has a seed, so that it repeats plain seeded decoding)",
                      flag=False)
MAP_SPECIALS = Option("map_specials", "bool", True, "cross-vocabulary drafts: map special tokens by text",
                      flag=False)
KEEP_UNSTABLE = Option("keep_unstable", "bool", False, "cross-vocabulary drafts: keep a re-tokenized tail "
                       "that may still change", flag=False)
PEARL_MODE = Option("mode", "choice", "auto", "pearl: draft and target at the same time, one after the "
                    "other, or measure both and keep the faster", choices=("auto", "parallel", "sequential"),
                    flag="pearl-mode")
# pearl's gamma 1 would leave nothing to post-verify (pearl.GAMMA_MIN): refused by its bounds, before loading
PEARL_GAMMA = Option("gamma", "int_or_auto", "auto", "pearl: draft tokens per round, or auto", 2, 64)
PEARL_TUNING = (Option("seq_gamma", "int", 4, "pearl: draft tokens per sequential round", 1, 64, flag=False),
                Option("probe_rounds", "int", 8, "pearl: rounds per mode while measuring", 1, 1000, flag=False),
                Option("threads_target", "int", None, "pearl: target threads", 1, 1024, flag=False),
                Option("threads_draft", "int", None, "pearl: draft threads", 1, 1024, flag=False))

ALL: tuple[Option, ...] = (GAMMA, WINDOW, LEVEL, GUESS_SET, TOPK, MAX_NGRAM, MIN_NGRAM, MAX_BRANCHES, P_MIN,
                           POOL, FEED_POOL, HARVEST, POOL_FROM_PROMPT, WARM_START, OVERSHOOT, SEED, ADAPTIVE,
                           ADAEDL, ADAEDL_LAMBDA, *ADAEDL_TUNING, GREEDY_DRAFT, MAP_SPECIALS, KEEP_UNSTABLE,
                           PEARL_MODE, *PEARL_TUNING)


def merge(*groups: Iterable[Option]) -> tuple[Option, ...]:
    """Options of several groups, the first definition of a name winning."""
    seen: dict[str, Option] = {}
    for group in groups:
        for option in group:
            seen.setdefault(option.name, option)
    return tuple(seen.values())


def parse(method: str, declared: Iterable[Option], raw: Mapping[str, Any] | None, *,
          per_request: bool = False) -> dict[str, Any]:
    """Checked options with defaults filled in, or MethodOptionError naming the first bad one.

    ``per_request``: the options come from one request (the server), so options that must be set when
    the engine starts (a pool file path) are refused; a switch they need (``Option.needs``) may be the
    server's, so that rule waits for the request's options merged with the server's.
    """
    by_name: dict[str, Option] = {}
    for option in declared:
        by_name[option.name] = option
        for alias in option.aliases:
            by_name[alias] = option
    out: dict[str, Any] = {option.name: option.default for option in by_name.values()}
    given: dict[str, str] = {}
    for key, value in (raw or {}).items():
        option = by_name.get(key)
        if option is None:   # a request is told only the options it may set
            known = ", ".join(sorted({o.name for o in by_name.values() if o.per_request or not per_request}))
            raise MethodOptionError(f"{method} has no option {key!r} (its options: {known or 'none'})")
        if given.setdefault(option.name, key) != key:   # else the later one won, unsaid
            raise MethodOptionError(f"{given[option.name]!r} and {key!r} are one option of {method}: give one")
        if per_request and not option.per_request:
            where = (f"it is set when the server starts (ouroboros-local serve {option.flag_name} ...)"
                     if option.flag_name else "it holds for every request the server answers")
            raise MethodOptionError(f"option {key!r} cannot be set per request: {where}")
        checked = option.check(value)
        out[option.name] = option.default if checked is None else checked
    if not per_request:
        _refuse_switched_off(by_name, raw or {}, out)
        _refuse_crossed(by_name, out)
    return out


def _refuse_crossed(by_name: dict[str, Option], out: dict[str, Any]) -> None:
    """MethodOptionError for an option above the one it may not exceed (``Option.at_most``): checked with
    the others, not when the drafter is made, so that a server's setting and a request's are weighed together."""
    for option in by_name.values():
        bound = out.get(option.at_most) if option.at_most else None
        value = out.get(option.name)
        if bound is not None and value is not None and value > bound:
            raise MethodOptionError(f"option {option.name!r} ({value}) must not exceed {option.at_most!r} ({bound})")


def _refuse_switched_off(by_name: dict[str, Option], raw: Mapping[str, Any], out: dict[str, Any]) -> None:
    """MethodOptionError for options given whose switch (``Option.needs``) is off."""
    off: dict[tuple[str, str], list[str]] = {}
    for key, value in raw.items():
        option = by_name[key]
        if option.needs and value is not None and not out.get(option.needs[0]):
            off.setdefault(option.needs, []).append(option.name)
    for (switch, what), names in off.items():
        names = sorted(names)
        flag = by_name[switch].flag_name if switch in by_name else None
        raise MethodOptionError(f"{', '.join(names)} {'tunes' if len(names) == 1 else 'tune'} {what}, which is "
                                f"off: add {switch}=true" + (f" ({flag})" if flag else ""))


__all__ = ["ALL", "Option", "merge", "parse"]
