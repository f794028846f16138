"""The per-round choice among candidate proposers, by expected tokens per second (method ``auto``, and
Ouroboros under the cost model, are made of it): see auto.py for the policy in words."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import ContextOverflowError
from ..tree import TokenTree
from .base import ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..scheduler import Scheduler
    from ..verify import VerifyResult


class AutoProposer(Proposer):
    name = "auto"

    def __init__(self, scheduler: "Scheduler", candidates: list[Proposer], name: str = "auto"):
        self.name = name
        self.scheduler = scheduler
        self.candidates = candidates
        self._names = tuple(p.name for p in candidates)
        self._last: Proposer | None = None
        self.rounds: dict[str, int] = {}
        self.round_size = 0
        self._out_of_room: set[str] = set()

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        sched = self.scheduler
        setup = replace(setup, extend_pays=sched.extend_rule())
        sched.begin_request()
        super().begin(prompt, setup)
        for proposer in self.candidates:
            sched.enroll(proposer)
            # a drafter that cannot pay here is retired now, and said so in the stats: asked only where no
            # free draft was in hand, it went unreported (and unprepared-for) only by chance
            retired = not proposer.free_drafts and sched.hopeless(proposer.name)
            proposer.begin(prompt, replace(setup, retired=retired))
        self.rounds = {}
        self.round_size = setup.round_size
        self._out_of_room = set()   # drafters whose model's own context filled up, this request

    @property
    def drafts_ahead(self) -> bool:   # type: ignore[override]
        return all(p.drafts_ahead for p in self.candidates)

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        self._last = None
        candidates = self.candidates
        sched = self.scheduler
        if self.round_size <= 1 and sched.skips(self._names):
            self.rounds["plain"] = self.rounds.get("plain", 0) + 1
            return TokenTree.rooted_at(committed[-1])
        if self.round_size > 1:
            tree = self._free_draft(committed, budget)
            if tree is not None:
                return tree
            candidates = [p for p in candidates if not p.free_drafts]
        fallback: tuple[Proposer, TokenTree] | None = None   # a draft passed over for a better promise
        for i, proposer in enumerate(candidates):
            if proposer.name in self._out_of_room:
                continue
            try:
                tree = sched.draft_if_any(proposer, committed, budget)
            except ContextOverflowError:   # its draft model's context is full: the others still draft
                self._out_of_room.add(proposer.name)
                continue
            if tree is None or not tree.n_candidates:
                continue
            if fallback is None and self._later_is_better(proposer, tree, candidates[i + 1:], budget):
                fallback = (proposer, tree)
                continue
            if fallback is not None and (sched.chain_rate(fallback[0].name, fallback[1])
                                         >= sched.chain_rate(proposer.name, tree)):
                break
            return self._use(proposer, tree)
        if fallback is not None:
            return self._use(*fallback)
        self.rounds["plain"] = self.rounds.get("plain", 0) + 1
        if self.round_size <= 1:
            sched.foresee_quiet(self._names)
        return TokenTree.rooted_at(committed[-1])

    def _free_draft(self, committed: Sequence[int], budget: int) -> TokenTree | None:
        """In rounds of one size a draft that fits costs what a round without one does: every candidate
        that runs no model drafts, unpriced, and the chain expected to keep the most tokens is verified
        (None where none drafted). Pricing them cost more Python than drafting, and kept fewer tokens."""
        best: tuple[Proposer, TokenTree] | None = None
        best_tokens = 0.0
        for proposer in self.candidates:
            if not proposer.free_drafts:
                continue
            chain = _first_chain(proposer.propose(committed, budget))
            if not chain.n_candidates:
                continue
            tokens = self.scheduler.chain_tokens(proposer.name, chain)
            if best is None or tokens > best_tokens:
                best, best_tokens = (proposer, chain), tokens
        return None if best is None else self._use(*best)

    def _use(self, proposer: Proposer, tree: TokenTree) -> TokenTree:
        self._last = proposer
        self.rounds[proposer.name] = self.rounds.get(proposer.name, 0) + 1
        return tree

    def _later_is_better(self, proposer: Proposer, tree: TokenTree, later: list[Proposer], budget: int) -> bool:
        """Does a later (costlier) candidate promise more tokens per second than this draft?"""
        sched = self.scheduler
        rate = sched.chain_rate(proposer.name, tree)
        return any(sched.best_rate(p.name, sched.draft_cost(p.name), budget) > rate for p in later)

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        if self._last is not None:
            self.scheduler.learn(self._last.name, result.tree, len(result.accepted), result.path)
        for proposer in self.candidates:
            proposer.observe(committed, result)

    def end(self) -> None:
        for proposer in self.candidates:
            proposer.end()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"auto_rounds": dict(self.rounds),
                               "auto_alpha": {p.name: round(self.scheduler.estimate(p.name).alpha, 3)
                                              for p in self.candidates}}
        # drafters that cannot pay here even if always right, with their best case over plain decoding
        retired = self.scheduler.retired
        ceilings = {p.name: retired[p.name] for p in self.candidates if p.name in retired}
        if ceilings:
            out["draft_ceiling"] = ceilings
        if self._out_of_room:   # their draft model's context filled up: not asked for the rest of the answer
            out["draft_context_full"] = sorted(self._out_of_room)
        for proposer in self.candidates:
            out.update(proposer.stats())
        return out


def _first_chain(tree: TokenTree) -> TokenTree:
    """``tree`` itself if a chain, else its main chain (``TokenTree.first_path``): a branch would change
    the round's shape."""
    if tree.is_chain():
        return tree
    return tree.subtree([0, *tree.first_path()])


__all__ = ["AutoProposer"]
