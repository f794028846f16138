"""Verification of a token tree against the target's logits rows (one row per tree node).

Greedy: walk from the root, following the child whose token is the target's argmax; the first argmax
with no matching child is the bonus token.

Sampling (lossless): at each node the target distribution p is processed from the node's row. A child
that carries its draft distribution q (stochastic draft) is accepted with probability min(1, p(x)/q(x));
on rejection p becomes norm(max(0, p - q)) (Leviathan et al.). Then a token is drawn from the current p
and, if a deterministic child (pool phrase, greedy draft) carries it, the walk continues there
("sample-and-match"); otherwise the drawn token is the bonus. Every emitted token is therefore
distributed exactly as the target's processed distribution given the accepted prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import SamplingParams, distribution, residual, sample
from .tree import TokenTree


@dataclass
class VerifyResult:
    tree: TokenTree
    path: list[int]               # accepted node indices, root first
    accepted: list[int]           # accepted candidate tokens (path without the root)
    bonus: int                    # the target's own token after the accepted path
    predictions: np.ndarray       # target argmax at every tree node (row i predicts the child of node i)
    extra_logits: np.ndarray | None = None
    winner_seq: int = 0
    accepted_by_source: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.accepted + [self.bonus]


def verify_greedy(tree: TokenTree, rows: np.ndarray) -> tuple[list[int], int, np.ndarray]:
    """Returns (path, bonus, predictions) for greedy decoding."""
    predictions = rows.argmax(axis=1)
    path = [0]
    node = 0
    while True:
        token = int(predictions[node])
        child = tree.child_with_token(node, token)
        if child is None:
            return path, token, predictions
        path.append(child)
        node = child


def verify_sampling(tree: TokenTree, rows: np.ndarray, params: SamplingParams,
                    rng: np.random.Generator) -> tuple[list[int], int, np.ndarray]:
    """Returns (path, bonus, predictions); lossless for stochastic and deterministic children."""
    predictions = rows.argmax(axis=1)
    path = [0]
    node = 0
    while True:
        p = distribution(rows[node], params)
        children = tree.children(node)
        chosen = None
        for child in children:
            q = tree.draft_probs.get(child)
            if q is None:
                continue
            x = tree.tokens[child]
            if q[x] > 0 and rng.random() * q[x] < p[x]:  # accept with min(1, p/q)
                chosen = child
                break
            p_next = residual(p, q)
            if p_next is None:  # p == q on the support: cannot happen after a rejection
                continue
            p = p_next
        if chosen is None:
            x = sample(p, rng)
            deterministic = [c for c in children
                             if c not in tree.draft_probs and tree.tokens[c] == x]
            if not deterministic:
                return path, x, predictions
            chosen = deterministic[0]
        path.append(chosen)
        node = chosen


def verify(tree: TokenTree, rows: np.ndarray, params: SamplingParams,
           rng: np.random.Generator) -> tuple[list[int], int, np.ndarray]:
    if params.greedy:
        return verify_greedy(tree, rows)
    return verify_sampling(tree, rows, params, rng)
