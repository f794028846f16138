"""A pure-Python stand-in for the target model and the engine loop, for proposer tests without llama.cpp.

``FakeTarget`` is a deterministic next-token function of the visible context. ``decode_layout`` gives every
token of a ``BatchLayout`` the context llama.cpp would show it (the committed prefix plus the batch cells
whose sequence set contains the token's sequence id, at positions up to its own), and asserts that all
of a token's sequence ids give the same context (docs/design.md#token-trees). ``simulate`` runs
propose -> greedy verify -> observe with the engine's own round function (``verify.verify_round``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..proposers.base import Proposer, ProposeSetup
from ..sampling import SamplingParams
from ..tree import BatchLayout, check_layout
from ..verify import verify_round


class FakeTarget:
    """Order-``order`` n-gram model of a corpus: the next token is what followed the context's last
    ``order`` tokens at their first occurrence in the corpus, else a hash of them."""

    def __init__(self, corpus: Sequence[int], vocab: int, order: int = 2):
        self.vocab = vocab
        self.order = order
        self.table: dict[tuple[int, ...], int] = {}
        for i in range(order, len(corpus)):
            self.table.setdefault(tuple(corpus[i - order:i]), int(corpus[i]))
        self.calls = 0

    def next_token(self, context: Sequence[int]) -> int:
        self.calls += 1
        key = tuple(int(t) for t in context[-self.order:])
        tok = self.table.get(key)
        if tok is None:
            tok = (sum((k + 1) * 1_000_003 ** j for j, k in enumerate(key)) >> 3) % self.vocab
        return tok

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        seq = list(prompt)
        for _ in range(n):
            seq.append(self.next_token(seq))
        return seq[len(prompt):]

    def decode_layout(self, prefix: Sequence[int], lay: BatchLayout) -> list[int]:
        """Argmax for every batch token; ``prefix`` = committed tokens before the root."""
        preds = []
        for i, (pos, seqs) in enumerate(zip(lay.pos_offsets, lay.seq_ids)):
            views = []
            for s in seqs:
                cells = sorted((p, j) for j, (p, ss) in enumerate(zip(lay.pos_offsets, lay.seq_ids))
                               if s in ss and p <= pos)
                views.append([lay.tokens[j] for _, j in cells])
            assert all(v == views[0] for v in views), f"token {i}: seq ids give different views"
            preds.append(self.next_token(list(prefix) + views[0]))
        return preds


@dataclass
class SimStats:
    passes: int = 0
    drafted: int = 0
    accepted: int = 0


def one_hot(tokens: Sequence[int], vocab: int) -> np.ndarray:
    rows = np.zeros((len(tokens), vocab), dtype=np.float32)
    rows[np.arange(len(tokens)), np.asarray(tokens, dtype=np.int64)] = 1.0
    return rows


def make_setup(max_tree_nodes: int = 63, max_branches: int = 16,
               eog: frozenset[int] = frozenset()) -> ProposeSetup:
    return ProposeSetup(sampling=SamplingParams(), rng=np.random.default_rng(0),
                        max_tree_nodes=max_tree_nodes, max_branches=max_branches, eog_tokens=eog)


def simulate(proposer: Proposer, target: FakeTarget, prompt: Sequence[int], max_new: int,
             setup: ProposeSetup | None = None) -> tuple[list[int], SimStats]:
    """Greedy generation of ``max_new`` tokens through the proposer; checks every tree it proposes."""
    setup = setup or make_setup()
    committed = list(prompt)

    def decode(lay: BatchLayout) -> np.ndarray:
        """One-hot output rows, as llama.cpp returns them: a row per batch token that wants logits."""
        preds = target.decode_layout(committed[:-1], lay)
        return one_hot([p for p, wanted in zip(preds, lay.logits) if wanted], target.vocab)

    proposer.begin(committed, setup)
    stats = SimStats()
    out: list[int] = []
    while len(out) < max_new:
        budget = max(0, min(setup.max_tree_nodes, max_new - len(out) - 1))
        tree = proposer.propose(committed, budget)
        assert tree.tokens[0] == committed[-1]
        assert tree.n_candidates <= budget
        result, lay = verify_round(tree, decode, setup.sampling, setup.rng)
        check_layout(lay)
        assert lay.n_seqs <= setup.max_branches, (lay.n_seqs, setup.max_branches)
        assert len(lay.tokens) <= setup.max_tree_nodes + 1
        stats.passes += 1
        stats.drafted += tree.n_candidates
        stats.accepted += len(result.accepted)
        committed.extend(result.tokens)
        out.extend(result.tokens)
        proposer.observe(committed, result)
    proposer.end()
    return out[:max_new], stats


def assert_greedy_under_budgets(make_proposer: Callable[[], Proposer], target: FakeTarget, prompt: Sequence[int],
                                n: int, budgets: Sequence[tuple[int, int]]) -> None:
    """The proposer writes the target's greedy text under each (tree nodes, sequences) budget."""
    for nodes, seqs in budgets:
        out, _ = simulate(make_proposer(), target, prompt, n, make_setup(max_tree_nodes=nodes, max_branches=seqs))
        assert out == target.greedy(prompt, n), (nodes, seqs)
