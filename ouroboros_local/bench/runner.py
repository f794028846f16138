"""Run every method (and peer) on the same prompts in one process, interleaved, and compare outputs.

A *contender* is anything with ``label``, ``kind``, ``run(prompt, max_tokens) -> Outcome``,
``warmup(prompt)`` and ``close()``: our methods through ``Engine.generate`` (`EngineContender`),
a Python callable (`FnContender`, used to inject methods, e.g. in tests), or a peer (see peers.py).

For each prompt every contender runs once, in an order that changes per prompt (a Williams design:
each contender in every position, and right after every other, equally often), so slow drifts of the
machine (thermal, background load) and what one run leaves for the next spread over all methods.
Outputs are compared with the reference (vanilla) token by token; a difference is recorded at its first
position and, with a tolerance margin, classified as a tie-flip when plain decoding preferred its token
over the method's by less than that many logits there (ouroboros_local.compare, docs/design.md#exactness).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

from ..cpu_load import LoadMeter
from ..errors import OuroborosError, ParameterError, PoolError
from ..engine import Learning
from ..history import History
from .prompts import BuiltPrompt

log = logging.getLogger("ouroboros_local")

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..generation import GenerationResult
    from ..sampling import SamplingParams


REFERENCE = "vanilla"
CUT_CHARACTER = "\ufffd"   # what decoding leaves of a character whose bytes the token budget cut

STAT_KEYS = ("method", "tokens", "timed_tokens", "prompt_tokens", "prefill_seconds", "decode_seconds",
             "tokens_per_second", "target_passes", "drafted", "accepted", "accepted_per_pass", "tokens_per_pass",
             "finish_reason", "extra")

RECORD_KEYS = ("set", "id", "task", "label", "kind", "method", "max_tokens", "prompt_tokens", "tokens",
               "timed_tokens", "prefill_seconds", "decode_seconds", "tokens_per_second", "target_passes", "drafted",
               "accepted", "accepted_per_pass", "tokens_per_pass", "finish_reason", "extra", "match",
               "compare", "first_diff", "ref_token", "got_token", "margin", "error", "order")

# Extra methods by name: a callable (engine, prompt: BuiltPrompt, max_tokens, sampling, options) ->
# GenerationResult | Outcome. `--methods NAME` picks them up like built-in methods. Tests register a
# deliberately lossy method here to check that the report flags it.
CUSTOM_METHODS: dict[str, Callable[..., Any]] = {}


@dataclass
class Outcome:
    """What one contender produced for one prompt."""
    tokens: list[int] | None          # None when only text is known (llama.cpp binaries)
    text: str
    stats: dict[str, Any]
    compare: str = "tokens"           # how to compare with the reference: tokens | text

    @classmethod
    def from_result(cls, result: "GenerationResult") -> "Outcome":
        return cls(tokens=list(result.tokens), text=result.text, stats=result.stats.to_dict())


def empty_stats(method: str) -> dict[str, Any]:
    return {"method": method, "tokens": 0, "prompt_tokens": 0, "prefill_seconds": 0.0,
            "decode_seconds": 0.0, "tokens_per_second": 0.0, "target_passes": 0, "drafted": 0,
            "accepted": 0, "accepted_per_pass": 0.0, "tokens_per_pass": 0.0, "finish_reason": "",
            "extra": {}}


class Contender:
    label: str = ""
    kind: str = "ours"              # ours | peer
    method: str = ""
    options: dict[str, Any]
    baseline: str = REFERENCE       # label whose speed this one is compared with ("own vanilla")

    def run(self, prompt: BuiltPrompt, max_tokens: int) -> Outcome:  # pragma: no cover - interface
        raise NotImplementedError

    def warmup(self, prompt: BuiltPrompt) -> None:
        self.run(prompt, min(8, prompt.max_tokens))

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"label": self.label, "kind": self.kind, "method": self.method,
                "options": dict(getattr(self, "options", {}) or {}), "baseline": self.baseline}


def cold_start(engine: "Engine") -> None:
    """Forget the cached prompt (target and draft KV), so every generation pays its own prefill."""
    engine.kv.reset()
    if engine.draft is not None:
        engine.draft_kv().reset()


class EngineContender(Contender):
    """One of our methods, run through Engine.generate on the prompt's token ids."""

    def __init__(self, engine: "Engine", label: str, method: str, options: dict[str, Any] | None,
                 sampling: "SamplingParams", stop: Sequence[str] = (), reset_shared: bool = False,
                 cold: bool = True):
        self.engine = engine
        self.cold = cold
        self.label = label
        self.method = method
        self.options = dict(options or {})
        self.sampling = sampling
        self.stop = list(stop)
        self.reset_shared = reset_shared
        # this contender's learned state (phrase pools, suffix tries): kept across its own prompts, never
        # seen by another method, which would otherwise draft from this method's answer to the same prompt
        self.history = History(engine.target)
        # and its own scheduler estimates and round costs: a row must not learn from another's rounds
        self.learning = Learning()

    def run(self, prompt: BuiltPrompt, max_tokens: int) -> Outcome:
        if self.reset_shared:
            self.history.clear()
        if self.cold:
            cold_start(self.engine)
        engine_history, self.engine.history = self.engine.history, self.history
        engine_learning = self.engine.swap_learning(self.learning)
        try:
            result = self.engine.generate(prompt.tokens, max_tokens=max_tokens, method=self.method,
                                          sampling=self.sampling, stop=self.stop, options=self.options)
        finally:
            self.engine.history = engine_history
            self.learning = self.engine.swap_learning(engine_learning)
            if self.history.pending:   # a history file's save that was not yet due (outside the timing)
                try:
                    self.history.save()
                except PoolError as exc:   # as the engine's own save: a warning, the run goes on
                    log.warning("warning: %s", exc)
        return Outcome.from_result(result)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "reset_pool": self.reset_shared}   # a --variant's may differ from the run's


class FnContender(Contender):
    """A method given as a Python callable (see CUSTOM_METHODS). It gets the engine as it is: such rows
    share the engine's own history and scheduler (tests and experiments, not published rows)."""

    def __init__(self, engine: "Engine", label: str, fn: Callable[..., Any], sampling: "SamplingParams",
                 options: dict[str, Any] | None = None, method: str | None = None):
        self.engine = engine
        self.label = label
        self.method = method or label
        self.fn = fn
        self.sampling = sampling
        self.options = dict(options or {})

    def run(self, prompt: BuiltPrompt, max_tokens: int) -> Outcome:
        out = self.fn(self.engine, prompt, max_tokens, self.sampling, self.options)
        return out if isinstance(out, Outcome) else Outcome.from_result(out)


# ---- comparison --------------------------------------------------------------------------------
def first_difference(ref: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (a length difference counts at the shorter length)."""
    n = min(len(ref), len(got))
    for i in range(n):
        if ref[i] != got[i]:
            return i
    return None if len(ref) == len(got) else n


def compare_text(ref: str, got: str, ref_tokens: int, got_tokens: int, ref_finish: str | None = None
                 ) -> int | None:
    """First differing character between texts (a length difference counts at the shorter length).
    llama.cpp binaries overshoot -n by a token: where the token budget stopped the reference (``ref_finish``
    "length") a peer that generated at least as many tokens is compared up to the reference's length only,
    less the replacement character ending it: the budget may cut a character's bytes, which the peer's
    extra token completes. Where the reference stopped by itself, text past its end is a difference."""
    if ref_finish == "length" and got_tokens >= ref_tokens:
        ref = ref.removesuffix(CUT_CHARACTER)   # one: the cut character; others are the model's
        got = got[:len(ref)]
    pos = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
    if pos is None and len(ref) != len(got):
        pos = min(len(ref), len(got))
    return pos


def classify(engine: "Engine | None", prompt: BuiltPrompt, ref: Outcome, got: Outcome,
             tolerance_margin: float | None) -> dict[str, Any]:
    """match = identical | mismatch | tie-flip, with the first differing position."""
    info: dict[str, Any] = {"match": "identical", "compare": got.compare, "first_diff": None,
                            "ref_token": None, "got_token": None, "margin": None}
    if got.compare == "tokens" and ref.tokens is not None and got.tokens is not None:
        pos = first_difference(ref.tokens, got.tokens)
        if pos is None:
            return info
        info["first_diff"] = pos
        info["ref_token"] = ref.tokens[pos] if pos < len(ref.tokens) else None
        info["got_token"] = got.tokens[pos] if pos < len(got.tokens) else None
        info["match"] = "mismatch"
        if tolerance_margin is not None and engine is not None:
            from ..compare import compare_greedy  # the project's tolerance rule (docs/design.md#exactness)

            try:
                cold_start(engine)   # the reference row from a clean prefill, whatever ran before
                rep = compare_greedy(engine, prompt.tokens, ref.tokens, got.tokens, tolerance=tolerance_margin,
                                     max_tokens=prompt.max_tokens, reference_finish=ref.stats.get("finish_reason"))
            except OuroborosError:
                return info
            info["margin"] = rep.margin
            if rep.tie_flip:
                info["match"] = "tie-flip"
        return info
    info["compare"] = "text"
    pos = compare_text(ref.text, got.text, ref.stats.get("tokens", 0), got.stats.get("tokens", 0),
                       ref.stats.get("finish_reason"))
    if pos is not None:
        info.update(match="mismatch", first_diff=pos)
    return info


# ---- the run -----------------------------------------------------------------------------------
@dataclass
class BenchRun:
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)      # label -> why it did not run
    contenders: list[dict[str, Any]] = field(default_factory=list)
    wall_seconds: float = 0.0
    interrupted: bool = False     # Ctrl-C: the records hold the prompts completed before it
    # how the run was stopped, as its exit status: 130 Ctrl-C, 128 + N the signal N (SIGTERM, SIGHUP:
    # the command line ends a command with SystemExit on them)
    exit_status: int = 130
    failed: str | None = None     # why the reference stopped the run early (the records: prompts before it)


class ReferenceFailed(ParameterError):
    """The reference refused a prompt (a configuration problem): the run stops there."""


class _ProgressLines:
    """Progress for a log file or a pipe: a line at most every ``every`` seconds, not a bar redrawn with
    carriage returns (a line of them per generation in a log)."""

    def __init__(self, total: int, desc: str, every: float = 60.0):
        self.total, self.desc, self.every = total, desc, every
        self.done = 0
        self.last = time.monotonic()
        self.doing = ""

    def update(self, n: int) -> None:
        self.done += n
        if time.monotonic() - self.last >= self.every:
            self.last = time.monotonic()
            print(f"{self.desc}: {self.done}/{self.total} generations done{self.doing}", file=sys.stderr,
                  flush=True)

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.doing = f", now {text}"

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool, desc: str = "bench"):
    if not enabled:
        return None
    try:
        terminal = sys.stderr.isatty()
    except (OSError, ValueError):   # closed
        terminal = False
    if not terminal:
        return _ProgressLines(total, desc)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, desc=desc, unit="gen", file=sys.stderr, dynamic_ncols=True, leave=True)


def learn_first(prompts: Sequence[BuiltPrompt], contenders: Sequence[Contender], progress: bool,
                log: Callable[[str], None]) -> int:
    """Each of our drafting methods answers ``prompts`` untimed and unrecorded (``bench --learn-first``):
    the scheduler's estimates and each method's history then start where a user's would after such
    requests, not from the priors. Returns the answers made."""
    learners = [c for c in contenders if c.kind == "ours" and c.label != REFERENCE]
    bar = _progress(len(prompts) * len(learners), progress, desc="learning")
    made = 0
    try:
        for i, prompt in enumerate(prompts):
            for c in balanced(learners, i):
                try:
                    c.run(prompt, prompt.max_tokens)
                    made += 1
                except (OuroborosError, OSError, RuntimeError, ValueError) as exc:
                    log(f"bench: {c.label} failed while learning on {prompt.set_name}/{prompt.id}: {exc}")
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return made


def balanced(items: Sequence[Any], k: int) -> list[Any]:
    """Row ``k`` of a Williams design: over n rows (2n when n is odd) every item runs once in each
    position and right after every other item equally often. A plain rotation always puts the same item
    after a given one, so whatever a run leaves behind (a peer process's freed memory, which a VM reports
    to its host while the next run decodes; a cache warmed for its own model) fell on one contender."""
    n = len(items)
    if not n:
        return []
    first = [0] + [(j + 1) // 2 if j % 2 else n - j // 2 for j in range(1, n)]   # 0, 1, n-1, 2, n-2, ...
    k %= n if n % 2 == 0 else 2 * n
    row = [items[(j + k) % n] for j in first]
    return row if k < n else row[::-1]


def _record(prompt: BuiltPrompt, c: Contender, order: int) -> dict[str, Any]:
    rec = {k: None for k in RECORD_KEYS}
    rec.update({"set": prompt.set_name, "id": prompt.id, "task": prompt.task, "label": c.label, "kind": c.kind,
                "method": c.method, "max_tokens": prompt.max_tokens, "prompt_tokens": len(prompt.tokens),
                "order": order})
    return rec


def _classified(prompt: BuiltPrompt, recs: dict[str, dict[str, Any]], outcomes: dict[str, Outcome],
                engine: "Engine | None", greedy: bool, tolerance_margin: float | None,
                log: Callable[[str], None]) -> list[dict[str, Any]]:
    """One prompt's records, each with its match against the reference's outcome."""
    ref = outcomes.get(REFERENCE)
    for label, rec in recs.items():
        if rec["match"] == "error":
            pass
        elif label == REFERENCE:
            rec.update(match="reference", compare="tokens")
        elif ref is None:
            rec.update(match="no-reference")
        elif not greedy:
            rec.update(match="n/a", compare="sampled")
        else:
            rec.update(classify(engine, prompt, ref, outcomes[label], tolerance_margin))
            if rec["match"] != "identical":
                log(f"bench: {label} differs from vanilla on {prompt.set_name}/{prompt.id} "
                    f"at {'token' if rec['compare'] == 'tokens' else 'char'} {rec['first_diff']} "
                    f"({rec['match']})")
    return list(recs.values())


DISTURBED_CORES = 0.05   # others' mean busy cores during our runs above which ``disturbed_note`` speaks


def disturbed_note(records: Sequence[dict[str, Any]]) -> str | None:
    """A note when other processes, or the host's steal, took CPU while our methods ran: a peer process's
    exit cost the next few seconds of this 2-core VM 4-16 ticks of steal (the 1.5B: our runs right after
    a peer 4% slower than after our own), which the peer, starting afresh, never pays in its timing."""
    loads = [r["extra"]["others_busy_cores"] for r in records
             if r.get("kind") == "ours" and "others_busy_cores" in (r.get("extra") or {})]
    if not loads or sum(loads) / len(loads) <= DISTURBED_CORES:
        return None
    against = ("ratios against peers may lean against us" if any(r.get("kind") == "peer" for r in records)
               else "their speeds may read low")
    return (f"other processes or the host (steal) kept {sum(loads) / len(loads):.2f} cores busy on average "
            f"(at most {max(loads):.2f}) while our methods ran: {against}")


def _kept(records: Sequence[dict[str, Any]]) -> str:
    """What a run stopped early keeps: the CLI writes nothing where no prompt was measured."""
    done = len({(r["set"], r["id"]) for r in records})
    return f" after {done} prompt(s); writing what was measured" if done else " before any prompt was measured"


def run_benchmark(prompts: Sequence[BuiltPrompt], contenders: Sequence[Contender], *,
                  engine: "Engine | None" = None, warmup_prompt: BuiltPrompt | None = None,
                  warmup: bool = True, greedy: bool = True, tolerance_margin: float | None = None,
                  progress: bool = True, save_text: bool = False,
                  log: Callable[[str], None] | None = None,
                  learn_prompts: Sequence[BuiltPrompt] = ()) -> BenchRun:
    """Run every contender on every prompt (rotating order), compare with the reference, return records;
    our drafting methods first answer ``learn_prompts`` untimed (``learn_first``)."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    labels = [c.label for c in contenders]
    if len(set(labels)) != len(labels):
        raise ParameterError(f"duplicate method labels: {labels}")
    if REFERENCE not in labels:
        raise ParameterError("the benchmark needs the vanilla method as its reference")
    run = BenchRun()
    t_start = time.perf_counter()
    active: list[Contender] = []
    for c in contenders:
        if warmup and warmup_prompt is not None:
            try:
                c.warmup(warmup_prompt)
            except (OuroborosError, OSError, RuntimeError, ValueError) as exc:
                run.skipped[c.label] = f"{type(exc).__name__}: {exc}"
                log(f"bench: skipping {c.label}: {exc}")
                if c.label == REFERENCE:
                    raise
                continue
        active.append(c)
    run.contenders = [c.describe() for c in active]
    if learn_prompts:
        learn_first(learn_prompts, active, progress, log)

    bar = _progress(len(prompts) * len(active), progress)
    try:
        dropped: set[str] = set()
        for i, prompt in enumerate(prompts):
            outcomes: dict[str, Outcome] = {}
            recs: dict[str, dict[str, Any]] = {}
            order = 0
            for c in balanced(active, i):
                if c.label in dropped:
                    if bar is not None:
                        bar.update(1)
                    continue
                rec = _record(prompt, c, order)
                order += 1
                if bar is not None:   # shown now: a long generation must not show the one that finished
                    bar.set_postfix_str(f"{prompt.set_name}/{prompt.id} {c.label}", refresh=True)
                meter = LoadMeter()
                try:
                    with meter:
                        out = c.run(prompt, prompt.max_tokens)
                except ParameterError as exc:
                    # a configuration problem (e.g. no draft model): it would fail on every prompt
                    if c.label == REFERENCE:
                        raise ReferenceFailed(f"{REFERENCE} failed on {prompt.set_name}/{prompt.id}: {exc}") from None
                    run.skipped[c.label] = f"{type(exc).__name__}: {exc}"
                    log(f"bench: skipping {c.label}: {exc}")
                    dropped.add(c.label)
                    if bar is not None:
                        bar.update(1)
                    continue
                except (OuroborosError, OSError, RuntimeError, ValueError) as exc:
                    rec.update(match="error", error=f"{type(exc).__name__}: {exc}")
                    log(f"bench: {c.label} failed on {prompt.set_name}/{prompt.id}: {exc}")
                else:
                    outcomes[c.label] = out
                    stats = {**{k: v for k, v in out.stats.items() if k != "method"}}
                    stats.setdefault("prompt_tokens", len(prompt.tokens))
                    if not stats.get("prompt_tokens"):
                        stats["prompt_tokens"] = len(prompt.tokens)
                    if stats.get("timed_tokens") is None:   # ours: every token is a timed decode step
                        stats["timed_tokens"] = stats.get("tokens", 0)
                    rec.update({k: stats.get(k) for k in STAT_KEYS if k != "method"})
                    rec["extra"] = dict(stats.get("extra") or {})
                    if c.kind == "ours" and meter.busy_cores is not None:
                        # other processes' CPU and the host's steal while ours ran (``disturbed_note``)
                        rec["extra"]["others_busy_cores"] = round(meter.busy_cores, 3)
                    if save_text:
                        rec["prompt"] = prompt.text
                        rec["text"] = out.text
                recs[c.label] = rec
                if bar is not None:
                    bar.update(1)
            # all of a prompt's records or none: Ctrl-C during its classification (the tie rule's replay
            # is long) must not leave it measured for some contenders only
            run.records.extend(_classified(prompt, recs, outcomes, engine, greedy, tolerance_margin, log))
    except (KeyboardInterrupt, SystemExit) as exc:   # SIGTERM (timeout, kill) wrote nothing, Ctrl-C did
        run.interrupted = True
        if isinstance(exc, SystemExit):
            run.exit_status = exc.code if isinstance(exc.code, int) else 1
        log(f"bench: interrupted{_kept(run.records)}")
    except ReferenceFailed as exc:
        run.failed = str(exc)
        log(f"bench: error: {exc}; stopped{_kept(run.records)}")
    finally:
        if bar is not None:
            bar.close()
    if dropped:
        run.records = [r for r in run.records if r["label"] not in dropped]
        run.contenders = [c for c in run.contenders if c["label"] not in dropped]
    run.wall_seconds = time.perf_counter() - t_start
    return run


def parse_value(text: str) -> Any:
    """'4' -> 4, '0.5' -> 0.5, 'true' -> True, 'none' -> None, anything else stays a string."""
    t = text.strip()
    low = t.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def parse_sweep(spec: str, methods: Iterable[str], has_option: Callable[[str, str], bool] = lambda m, name: True
                ) -> tuple[list[str], str, list[Any]]:
    """`[METHOD[,METHOD...]:]NAME=v1,v2,...` -> (methods swept, option name, values). Without METHOD
    every non-vanilla method that has the option (``has_option(method, name)``) is swept."""
    if "=" not in spec:
        raise ParameterError(f"--sweep takes [METHOD:]NAME=v1,v2,... (got {spec!r})")
    key, _, values = spec.partition("=")
    method, _, name = key.rpartition(":")
    name = name.strip().replace("-", "_")
    vals = [parse_value(v) for v in values.split(",") if v.strip()]
    if not name or not vals:
        raise ParameterError(f"--sweep takes [METHOD:]NAME=v1,v2,... (got {spec!r})")
    methods = list(methods)
    if method:
        swept = [m.strip() for m in method.split(",") if m.strip()]
        for m in swept:
            if m == REFERENCE:
                raise ParameterError(f"--sweep cannot sweep {REFERENCE}: it is the reference every value is "
                                     "measured against")
            if m not in methods:
                raise ParameterError(f"--sweep method {m!r} is not in --methods")
    else:
        swept = [m for m in methods if m != REFERENCE and has_option(m, name)]
        if not swept and any(m != REFERENCE for m in methods):
            raise ParameterError(f"--sweep: no method of this run has the option {name!r}")
    if not swept:
        raise ParameterError("--sweep needs a method other than vanilla")
    return swept, name, vals


def sweep_label(method: str, name: str, value: Any) -> str:
    return f"{method}[{name}={value}]"
