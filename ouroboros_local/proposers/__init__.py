"""Drafting strategies behind one interface (base.Proposer), and the method registry."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from importlib import import_module
from typing import Any, Callable, Mapping

from ..errors import DrafterError, IncompatiblePairError, MethodOptionError, ParameterError
from ..options import KEEP_UNSTABLE, MAP_SPECIALS, Option
from ..options import parse as parse_options
from .base import DraftingContext, NoDraft, ProposeSetup, Proposer

Factory = Callable[[DraftingContext, dict[str, Any]], Proposer]

# method name -> "module:factory"; factories take (context, options) and return a fresh Proposer. The
# module's OPTIONS (a tuple of options.Option) declares what the method accepts; options are checked
# and completed with their defaults before the factory sees them.
_METHODS: dict[str, str] = {
    "vanilla": "ouroboros_local.proposers:_vanilla",
    "speculative": "ouroboros_local.proposers.draft_model:create",
    "prompt-lookup": "ouroboros_local.proposers.prompt_lookup:create",
    "lookahead": "ouroboros_local.proposers.lookahead:create",
    "ouroboros": "ouroboros_local.proposers.ouroboros:create",
    "pearl": "ouroboros_local.proposers.pearl:create",
    "auto": "ouroboros_local.proposers.auto:create",
    "suffix": "ouroboros_local.proposers.suffix:create",
}
# A draft whose vocabulary differs from the target's runs these instead (text-level bridging).
_CROSS_VOCAB_METHODS: dict[str, str] = {
    "speculative": "ouroboros_local.proposers.cross_vocab:create",
    "ouroboros": "ouroboros_local.proposers.cross_vocab:create_ouroboros",
}


OPTIONS: tuple[Option, ...] = ()   # vanilla's


_BUILT_IN = frozenset(_METHODS)


def register_method(name: str, factory: str) -> None:
    """Add a method from outside the package: ``factory`` is "module:function" (the module declares its
    ``OPTIONS``), e.g. ``register_method("bigram", "bigram_drafter:create")`` (examples/bigram_drafter.py).
    ``name`` is letters, digits, '-' and '_' (it goes in ``--methods a,b`` lists), and not a built-in's:
    a plug-in registered as "vanilla" made plain decoding draft. Registering a name again replaces it."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]*", name):
        raise ParameterError(f"method name {name!r}: letters, digits, '-' and '_', starting with a letter or digit")
    if name in _BUILT_IN:
        raise ParameterError(f"method name {name!r} is a built-in method's; choose another")
    module_name, _, attr = factory.partition(":") if isinstance(factory, str) else ("", "", "")
    try:
        module = import_module(module_name) if module_name and attr else None
    except (ImportError, TypeError, ValueError) as exc:   # a typo, a relative name: not a bare ImportError
        raise ParameterError(f"method {name!r}: cannot import {module_name!r} ({exc})") from None
    if module is None or not callable(getattr(module, attr, None)):
        raise ParameterError(f"method {name!r}: {factory!r} names no factory function (module:function)")
    declared = getattr(module, "OPTIONS", None)
    if not (isinstance(declared, (tuple, list)) and all(isinstance(o, Option) for o in declared)):
        raise ParameterError(f"method {name!r}: module {module_name!r} must declare OPTIONS, a tuple of "
                             f"ouroboros_local.options.Option (() for none; got {type(declared).__name__})")
    _METHODS[name] = factory


def _vanilla(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    return NoDraft()


def _factory(method: str) -> tuple[Factory, tuple[Option, ...]]:
    module_name, _, attr = _METHODS[method].partition(":")
    module = import_module(module_name)
    return getattr(module, attr), tuple(getattr(module, "OPTIONS", ()))


def method_options(method: str) -> tuple[Option, ...]:
    """The options ``method`` accepts."""
    if method not in _METHODS:
        raise ParameterError(f"unknown method {method!r}; choose one of {', '.join(method_names())}")
    return _factory(method)[1]


def applicable_options(method: str, options: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``options`` that ``method`` declares (settings shared by several methods, such as
    the server's or the benchmark's flags, go only where they apply)."""
    if method not in _METHODS:
        return dict(options)
    names = {alias for o in method_options(method) for alias in (o.name, *o.aliases)}
    return {k: v for k, v in options.items() if k in names}


def overlaid(method: str, under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of those of ``under`` that apply to ``method`` (the server's or the command line's
    settings under a request's own): an option ``over`` gives under another of its names replaces
    ``under``'s, which would otherwise be the same option given twice."""
    canonical = ({alias: o.name for o in method_options(method) for alias in (o.name, *o.aliases)}
                 if method in _METHODS else {})
    named = {canonical.get(k, k) for k in over}
    kept = {k: v for k, v in applicable_options(method, under).items() if canonical.get(k, k) not in named}
    return {**kept, **over}


# built-in methods that never run a draft model, given one or not
DRAFT_FREE_METHODS = frozenset({"vanilla", "prompt-lookup", "lookahead", "suffix"})


def needs_draft(method: str) -> bool:
    """Does ``method`` run only with a draft model (its module sets ``NEEDS_DRAFT``)? Asked before the
    models load, so that a missing ``-d`` is refused before a large target takes minutes to load."""
    if method not in _METHODS:
        return False
    module, _, _ = _METHODS[method].partition(":")
    return bool(getattr(import_module(module), "NEEDS_DRAFT", False))


def check_options(method: str, options: dict[str, Any] | None, *, per_request: bool = False) -> dict[str, Any]:
    """``options`` checked against the method's declaration, defaults filled in (MethodOptionError)."""
    if options is not None and not isinstance(options, Mapping):
        raise MethodOptionError(f"options must be a dict of option names and values, not {type(options).__name__}")
    raw = dict(options or {})
    if method == "auto" and raw.get("adaptive") is False:
        raise MethodOptionError("auto is the scheduler itself: it has no fixed-parameter mode (adaptive=false)")
    return parse_options(method, method_options(method), raw, per_request=per_request)


def method_names() -> list[str]:
    """Methods whose implementation is importable in this build."""
    names = []
    for name, target in _METHODS.items():
        module, _, attr = target.partition(":")
        try:
            if hasattr(import_module(module), attr):
                names.append(name)
        except ImportError:
            continue
    return names


@dataclass(frozen=True)
class Method:
    """A method ready to run: its proposer, and whether the engine prices its drafts by the cost model."""

    proposer: Proposer
    scheduled: bool


def check_pair_options(method: str, options: dict[str, Any], checked: dict[str, Any], compatible: bool | None,
                       reason: str | None) -> None:
    """What the pair's vocabularies refuse (IncompatiblePairError): pearl and the confidence cuts of a
    same-vocabulary draft with a draft of another vocabulary, the bridge's settings with one of the same
    (an option that would not take effect is an error). ``options``: as given; ``checked``: with defaults.
    The command line asks before the weights load (the GGUF headers decide it), ``create_method`` again."""
    if compatible is False:
        if method == "pearl":
            raise IncompatiblePairError(f"pearl needs a draft with the target's vocabulary ({reason}); "
                                        "speculative or ouroboros (--method, method=) bridge vocabularies through text")
        if method in ("speculative", "auto"):
            from .cross_vocab import refuse_ignored

            refuse_ignored(checked, reason)
    elif compatible and method in ("speculative", "auto"):
        bridge = [o.name for o in (MAP_SPECIALS, KEEP_UNSTABLE) if o.name in options
                  and options[o.name] is not None and options[o.name] != o.default]
        if bridge:
            raise IncompatiblePairError(f"{', '.join(bridge)}: only for a draft of another vocabulary (this pair "
                                        "shares one)", tuple(bridge))


def create_method(method: str, ctx: DraftingContext, options: dict[str, Any]) -> Method:
    """The proposer of ``method`` with ``options`` (checked, defaults filled in) for one generation."""
    target = _METHODS.get(method)
    if target is None:
        raise ParameterError(f"unknown method {method!r}; choose one of {', '.join(method_names())}")
    checked = check_options(method, options)
    if ctx.draft is not None:
        check_pair_options(method, options, checked, ctx.pair_compatible, ctx.pair_reason)
        if ctx.pair_compatible is False and method in _CROSS_VOCAB_METHODS:
            target = _CROSS_VOCAB_METHODS[method]
    # adaptive=false: this generation runs the method's fixed hyperparameters every round, as
    # EngineConfig(adaptive=False) does for every method (e.g. to benchmark against the scheduler)
    ctx = replace(ctx, adaptive=ctx.adaptive and checked.get("adaptive") is not False)
    module, _, attr = target.partition(":")
    factory: Factory = getattr(import_module(module), attr)
    proposer = factory(ctx, checked)   # one that refuses its options raises MethodOptionError (a bug: any other)
    if not isinstance(proposer, Proposer):
        raise DrafterError(f"method {method!r}: its factory returned {type(proposer).__name__}, not a Proposer")
    if proposer.name == Proposer.name:   # a plug-in that named itself not: its stats and estimates go by
        proposer.name = method            # the method's name, not every such plug-in's shared "base"
    return Method(proposer, scheduled=ctx.adaptive and proposer.adaptive)


def create_proposer(method: str, ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    return create_method(method, ctx, options).proposer


__all__ = ["DraftingContext", "Method", "NoDraft", "ProposeSetup", "Proposer", "applicable_options", "check_options",
           "create_method", "create_proposer", "method_names", "method_options", "overlaid", "register_method"]
