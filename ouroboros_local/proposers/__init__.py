"""Drafting strategies behind one interface (base.Proposer), and the method registry."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, Callable

from ..errors import IncompatiblePairError, ParameterError
from .base import NoDraft, ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine

# method name -> "module:factory"; factories take (engine, options) and return a fresh Proposer.
_METHODS: dict[str, str] = {
    "vanilla": "ouroboros_local.proposers:_vanilla",
    "speculative": "ouroboros_local.proposers.draft_model:create",
    "prompt-lookup": "ouroboros_local.proposers.prompt_lookup:create",
    "lookahead": "ouroboros_local.proposers.lookahead:create",
    "ouroboros": "ouroboros_local.proposers.ouroboros:create",
    "pearl": "ouroboros_local.proposers.pearl:create",
    "auto": "ouroboros_local.proposers.auto:create",
}
# A draft whose vocabulary differs from the target's runs these instead (text-level bridging).
_CROSS_VOCAB_METHODS: dict[str, str] = {
    "speculative": "ouroboros_local.proposers.cross_vocab:create",
    "ouroboros": "ouroboros_local.proposers.cross_vocab:create_ouroboros",
}


def _vanilla(engine: "Engine", options: dict[str, Any]) -> Proposer:
    return NoDraft()


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


def create_proposer(method: str, engine: "Engine", options: dict[str, Any]) -> Proposer:
    target = _METHODS.get(method)
    if target is None:
        raise ParameterError(f"unknown method {method!r}; choose one of {', '.join(method_names())}")
    if engine.draft is not None and engine.pair_compatible is False:
        if method in _CROSS_VOCAB_METHODS:
            target = _CROSS_VOCAB_METHODS[method]
        elif method == "pearl":
            raise IncompatiblePairError(
                f"pearl needs a draft with the target's vocabulary ({engine.pair_reason}); "
                "--method speculative or ouroboros bridge different vocabularies through text")
    adaptive = options.get("adaptive", True)
    if not isinstance(adaptive, bool):
        raise ParameterError(f"option 'adaptive' must be true or false (got {adaptive!r})")
    if not adaptive and method == "auto":
        raise ParameterError("auto is the scheduler itself: it has no fixed-parameter mode (adaptive=false)")
    module, _, attr = target.partition(":")
    factory: Callable[["Engine", dict[str, Any]], Proposer] = getattr(import_module(module), attr)
    proposer = factory(engine, options)
    if not adaptive:
        # this generation runs the method's fixed hyperparameters every round, as
        # EngineConfig(adaptive=False) does for every method (e.g. to benchmark against the scheduler)
        proposer.adaptive = False
    return proposer


__all__ = ["NoDraft", "ProposeSetup", "Proposer", "create_proposer", "method_names"]
