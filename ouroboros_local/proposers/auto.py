"""Method ``auto``: pick, round by round, the proposer with the best expected speed on this machine.

Candidates, cheapest first: prompt lookup (free drafts, copied from the prompt, the output and the
shared phrase pool), the suffix tries (free drafts from this request and from earlier answers, method
``suffix``) and, when a draft model is loaded, the draft model (through the cross-vocabulary proposer
when its vocabulary differs from the target's). A later candidate is asked when its measured acceptance
promises more than the draft in hand. Each round:

1. prompt lookup proposes up to the scheduler's best length for it, trimmed by its confidence classes
   (scheduler.trim); if something is left, that is the round's tree (a free draft beats a paid one of
   similar acceptance), unless the draft model's expected tokens per second is higher: then the
   draft model is asked too and the better of the two drafts is verified;
2. otherwise the draft model drafts, if drafting pays at all (its measured per-token cost included),
   and stops as soon as one more token cannot pay (scheduler.extend_pays);
3. otherwise the tree is the root alone: a plain decoding step.

Every draft is deterministic (prompt lookup, greedy draft-model chains), so with sampling the verifier
uses sample-and-match: each emitted token consumes exactly one uniform of the seeded generator, and a
seeded ``auto`` run gives the same text as seeded plain decoding, however the rounds were drafted.

The scheduler (scheduler.py) holds an acceptance estimate per proposer and the measured verify-cost
curve, so on a CPU where verification is expensive ``auto`` drafts short or not at all, and on a GPU
it drafts long. Every sub-proposer observes every round so its state (index, draft KV) stays current.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from .. import options as opt
from ..tree import TokenTree
from . import check_options, cross_vocab, draft_model, prompt_lookup, suffix
from .base import ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..scheduler import Scheduler
    from ..verify import VerifyResult


class AutoProposer(Proposer):
    name = "auto"

    def __init__(self, scheduler: "Scheduler", candidates: list[Proposer], name: str = "auto"):
        self.name = name
        self.scheduler = scheduler
        self.candidates = candidates
        self._last: Proposer | None = None
        self.rounds: dict[str, int] = {}

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        sched = self.scheduler
        setup = replace(setup, extend_pays=sched.extend_rule())
        super().begin(prompt, setup)
        for proposer in self.candidates:
            proposer.begin(prompt, setup)
            if proposer.confidence_classes:
                sched.labels(proposer.name)
        self.rounds = {}

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        self._last = None
        sched = self.scheduler
        fallback: tuple[Proposer, TokenTree] | None = None   # a draft passed over for a better promise
        for i, proposer in enumerate(self.candidates):
            k = sched.best_length(proposer.name, sched.draft_cost(proposer.name), limit=budget)
            if k <= 0:
                continue
            t0 = time.perf_counter()
            tree = proposer.propose(committed, k)
            sched.note_draft(proposer.name, time.perf_counter() - t0, tree.n_candidates,
                             catch_up=proposer.catch_up_seconds)
            if tree.n_candidates:
                tree = sched.trim(proposer.name, tree)
            if not tree.n_candidates:
                continue
            if fallback is None and self._later_is_better(proposer, tree, self.candidates[i + 1:], budget):
                fallback = (proposer, tree)
                continue
            if fallback is not None and (sched.chain_rate(fallback[0].name, fallback[1])
                                         >= sched.chain_rate(proposer.name, tree)):
                break
            return self._use(proposer, tree)
        if fallback is not None:
            return self._use(*fallback)
        self.rounds["plain"] = self.rounds.get("plain", 0) + 1
        return TokenTree.rooted_at(committed[-1])

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
            self.scheduler.update(self._last.name, result.tree.max_depth, len(result.accepted))
            self.scheduler.update_classes(self._last.name, result.tree, len(result.accepted))
        for proposer in self.candidates:
            proposer.observe(committed, result)

    def end(self) -> None:
        for proposer in self.candidates:
            proposer.end()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"auto_rounds": dict(self.rounds),
                               "auto_alpha": {p.name: round(self.scheduler.estimate(p.name).alpha, 3)
                                              for p in self.candidates}}
        for proposer in self.candidates:
            out.update(proposer.stats())
        return out


# auto runs prompt lookup and, with a draft model, speculative: it takes their options
OPTIONS: tuple[opt.Option, ...] = tuple(o for o in opt.merge(prompt_lookup.OPTIONS, draft_model.OPTIONS)
                                        if o.name not in ("adaptive", "greedy_draft"))


def create(engine: "Engine", options: dict[str, Any]) -> Proposer:
    """``options``: checked against ``OPTIONS``."""
    # free drafts first: the context's n-grams, then the suffix tries (this request and earlier answers,
    # asked when their measured acceptance promises more than the prompt-lookup draft in hand); one
    # branch, so the scheduler trims it by confidence class like any chain (a tree it cannot trim lost
    # up to 12% on a fast target, SmolLM2 on 2 cores)
    history = suffix.create(engine, check_options("suffix", {"pool": options["pool"], "max_branches": 1}))
    candidates: list[Proposer] = [prompt_lookup.create(engine, options), history]
    if engine.draft is not None:
        module = draft_model if engine.pair_compatible is not False else cross_vocab
        # greedy drafts: seeded sampling then reproduces plain seeded decoding, whatever the scheduler chose
        drafter = module.create(engine, {**options, "greedy_draft": True})
        drafter.prefill_in_begin = False   # a draft model that is never asked costs nothing
        candidates.append(drafter)
    return AutoProposer(engine.scheduler(), candidates)
