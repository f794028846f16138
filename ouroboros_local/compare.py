"""The greedy tolerance rule (docs/design.md#exactness) for comparing a method's output with plain decoding.

Logits depend slightly on batch shape and KV layout, and quantised matmuls amplify that, so a greedy
near-tie can flip between a batched verification and a one-token step. Outputs count as matching when
they are identical, or identical up to a first difference where plain decoding preferred its token
over the method's by less than ``tolerance`` logits either way (a tie-flip). After a tie-flip the texts
legitimately diverge. A margin below -tolerance (the replay clearly prefers the method's token: the reference
is not what plain decoding computes) and an output longer than the token budget allows are mismatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from .engine import Engine

# logits. Measured on SmolLM2-135M Q4_1: one prefill of a text against token-by-token steps moved single
# logits by up to 0.3 and swapped plain decoding's first and fourth choices 0.43 apart (llama.cpp's own
# batched kernels, no tree involved); on F32/F16 models rows differ by about 1e-4.
DEFAULT_TOLERANCE = 0.5


@dataclass
class MatchReport:
    identical: bool
    first_difference: int | None = None   # index into the generated tokens
    margin: float | None = None           # plain decoding's logit(reference) - logit(candidate) there
    tie_flip: bool = False

    @property
    def ok(self) -> bool:
        return self.identical or self.tie_flip

    def to_dict(self) -> dict:
        return {"identical": self.identical, "first_difference": self.first_difference,
                "margin": self.margin, "tie_flip": self.tie_flip, "ok": self.ok}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(row: np.ndarray) -> float:
    top = np.partition(row, -2)[-2:]
    return float(abs(top[1] - top[0]))


def compare_greedy(engine: "Engine", prompt_tokens: Sequence[int], reference: Sequence[int],
                   candidate: Sequence[int], tolerance: float = DEFAULT_TOLERANCE, max_tokens: int | None = None,
                   reference_finish: str | None = None) -> MatchReport:
    """Compare ``candidate`` with the plain-decoding ``reference`` under the tolerance rule. ``max_tokens``:
    the budget both had; ``reference_finish``: why the reference stopped ("length": at the budget)."""
    i = first_difference(reference, candidate)
    if i is None:
        return MatchReport(identical=True)
    if _overran_budget(reference, candidate, max_tokens, reference_finish):
        return MatchReport(identical=False, first_difference=i)
    # One output may be a prefix of the other. With the same token budget the shorter one ended with an
    # end-of-generation token there (stop strings aside): that choice is weighed like a token.
    stopped = i >= min(len(reference), len(candidate))
    eog = sorted(engine.target.eog_tokens)
    if stopped and not eog:
        return MatchReport(identical=False, first_difference=i)
    row = plain_decoding_row(engine, prompt_tokens, reference[:i])
    stop = float(row[eog].max()) if stopped else 0.0
    ref_logit = float(row[reference[i]]) if i < len(reference) else stop
    cand_logit = float(row[candidate[i]]) if i < len(candidate) else stop
    # how much plain decoding preferred its choice over the candidate's at the split
    margin = ref_logit - cand_logit
    # a margin below -tolerance means the replay disagrees with the reference itself: not a near-tie
    return MatchReport(identical=False, first_difference=i, margin=margin, tie_flip=abs(margin) < tolerance)


def _overran_budget(reference: Sequence[int], candidate: Sequence[int], max_tokens: int | None,
                    reference_finish: str | None) -> bool:
    """The candidate went on where the token budget stopped the reference (or past the budget itself):
    no logit can excuse that, so the tie rule must not weigh it like an end-of-generation choice."""
    past_budget = max_tokens is not None and len(candidate) > max_tokens
    past_stopped_reference = reference_finish == "length" and len(candidate) > len(reference)
    return past_budget or past_stopped_reference


def plain_decoding_row(engine: "Engine", prompt_tokens: Sequence[int], generated: Sequence[int]) -> np.ndarray:
    """The logits after ``generated`` as plain decoding computed them: the prompt evaluated as the engine
    does, then one token per step. (One prefill of the whole prefix lays its KV cells out in other
    batches, which alone moved a Q4_1 model's margin from 0.49 to 0.94 logits: not plain decoding's view.)"""
    kv = engine.kv
    kv.sync_to(list(prompt_tokens[:-1]))
    rows = None
    for token in [prompt_tokens[-1], *generated]:
        rows = kv.decode_step(int(token))
    return np.array(rows[0])
