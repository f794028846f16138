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
In rounds of one size (``--round-size``) a draft that fits costs what a round without one does: prompt
lookup and the suffix tries both draft every round, unpriced, and the chain expected to keep more tokens
is verified; only the draft model is priced as above, where neither drafted.

Every draft is deterministic (prompt lookup, greedy draft-model chains), so with sampling the verifier
uses sample-and-match: each emitted token consumes exactly one uniform of the seeded generator, and a
seeded ``auto`` run gives the same text as seeded plain decoding, however the rounds were drafted, up to
the batch shape's floating-point effects on the rows (on quantised models often within a few tokens:
docs/design.md#exactness).

The scheduler (scheduler.py) holds an acceptance estimate per proposer and the measured verify-cost
curve, so on a CPU where verification is expensive ``auto`` drafts short or not at all, and on a GPU
it drafts long. Every sub-proposer observes every round so its state (index, draft KV) stays current.
"""

from __future__ import annotations

from typing import Any

from .. import options as opt
from . import cross_vocab, draft_model, prompt_lookup, suffix
from .base import DraftingContext, Proposer
from .pick import AutoProposer

# auto runs prompt lookup and, with a draft model, speculative: it takes their options
OPTIONS: tuple[opt.Option, ...] = tuple(o for o in opt.merge(prompt_lookup.OPTIONS, draft_model.OPTIONS)
                                        if o.name not in ("adaptive", "greedy_draft"))


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """``options``: checked against ``OPTIONS``."""
    # free drafts first: the context's n-grams, then the suffix tries (this request and earlier answers,
    # asked when their measured acceptance promises more than the prompt-lookup draft in hand)
    history = suffix.earlier_answers(ctx, options["pool"])
    # a history file named by an earlier call keeps the phrase pool as it keeps the suffix trie (README)
    candidates: list[Proposer] = [prompt_lookup.create(ctx, options, named_history=True), history]
    if ctx.draft is not None:
        # greedy drafts: seeded sampling then reproduces plain seeded decoding, whatever the scheduler chose
        options = {**options, "greedy_draft": True}
        if ctx.pair_compatible is False:   # a draft model that is never asked costs nothing: no prefill
            candidates.append(cross_vocab.create(ctx, options, prefill_in_begin=False))
        else:
            candidates.append(draft_model.create(ctx, options))
    return AutoProposer(ctx.scheduler(), candidates)
