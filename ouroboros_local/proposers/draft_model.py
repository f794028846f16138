"""Vanilla speculative decoding: a small draft model writes ``gamma`` tokens, the target checks them.

Greedy: the draft's argmax chain (deterministic). Sampling: each draft token is drawn from the draft's
processed distribution q, which travels with the node so the verifier can do rejection sampling.
The draft's KV cache is kept in step with the committed text by prefix reuse: only tokens the draft has
not seen (the target's bonus, a corrected token) are decoded again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ..errors import ParameterError
from ..kv import KVCache, common_prefix
from ..sampling import distribution, sample
from ..tree import TokenTree
from .base import ProposeSetup, Proposer

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine
    from ..verify import VerifyResult


class DraftModelProposer(Proposer):
    name = "speculative"
    needs_draft_model = True
    adaptive = True  # the engine may cap gamma by the cost model

    def __init__(self, kv: KVCache, n_target_vocab: int, gamma: int = 4, p_min: float = 0.0):
        if gamma < 1:
            raise ParameterError(f"gamma must be >= 1 (got {gamma})")
        if not 0.0 <= p_min < 1.0:
            raise ParameterError(f"p_min must be in [0, 1) (got {p_min})")
        self.kv = kv
        self.gamma = gamma
        self.p_min = p_min
        self.n_target_vocab = n_target_vocab
        self.draft_steps = 0

    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        self.draft_steps = 0

    def _row(self, logits: np.ndarray) -> np.ndarray:
        # Tokens the target does not have can never be accepted: keep q on the target's vocabulary.
        n = self.n_target_vocab
        if len(logits) == n:
            return logits
        out = np.full(n, -np.inf, dtype=np.float32)
        m = min(n, len(logits))
        out[:m] = logits[:m]
        return out

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        tree = TokenTree.rooted_at(committed[-1])
        n = min(self.gamma, budget)
        if n <= 0:
            return tree
        logits = self.kv.sync_to(committed, logits_last=True)
        self.draft_steps += 1
        sampling = self.setup.sampling
        node = 0
        for i in range(n):
            row = self._row(logits)
            if sampling.greedy:
                token = int(np.argmax(row))
                q = None
                if self.p_min > 0.0:
                    top = float(np.max(row))
                    conf = 1.0 / float(np.sum(np.exp(row - top)))
                    if conf < self.p_min and i > 0:
                        break
            else:
                q = distribution(row, sampling)
                token = sample(q, self.setup.rng)
            node = tree.add(node, token, draft_probs=q, source="draft")
            if token in self.setup.eog_tokens or i == n - 1:
                break
            logits = self.kv.feed([token], logits_last=True)
            self.draft_steps += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        # Drop the draft's cells past what the target accepted; the next propose() decodes the
        # missing tokens (a corrected token, the bonus) in one batch.
        self.kv.truncate(common_prefix(self.kv.cached, committed))

    def stats(self) -> dict[str, Any]:
        return {"draft_steps": self.draft_steps}


def create(engine: "Engine", options: dict[str, Any]) -> Proposer:
    return DraftModelProposer(engine.draft_kv(), engine.target.n_vocab,
                              gamma=int(options.get("gamma", 4)),
                              p_min=float(options.get("p_min", 0.0)))
