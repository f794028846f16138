"""Drafting helpers shared by several proposers: phrases cut at an end-of-generation token, phrases hung
into a token tree within node and leaf budgets, and the Jacobi window of lookahead and Ouroboros."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .errors import ParameterError
from .pool import PhrasePool
from .tree import TokenTree


def cut_at_eog(tokens: Sequence[int], eog: frozenset[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-generation token: nothing after one is emitted."""
    for i, tok in enumerate(tokens):
        if tok in eog:
            return [int(t) for t in tokens[:i + 1]]
    return [int(t) for t in tokens]


def would_add_leaf(tree: TokenTree, tokens: Sequence[int], node: int = 0) -> bool | None:
    """Would ``tree.add_path(node, tokens)`` add a leaf? None if the tree already holds the whole path."""
    for tok in tokens:
        child = tree.child_with_token(node, int(tok))
        if child is None or child in tree.draft_probs:
            # diverges here: a new leaf unless it extends a current leaf
            return any(tree.parents[i] == node for i in range(node + 1, len(tree.tokens)))
        node = child
    return None


def hang_phrases(tree: TokenTree, node: int, phrases: Iterable[tuple[Sequence[int], str]], max_nodes: int,
                 max_leaves: int, stop_after_skips: int | None = None) -> int:
    """Hang distinct ``(phrase, source)`` below ``node`` until the tree holds ``max_nodes`` candidates.

    Shared prefixes merge (``TokenTree.add_path``). A phrase that would need a leaf beyond ``max_leaves``
    is skipped; at the ``stop_after_skips``-th skip the remaining phrases are not looked at (prompt
    lookup's later phrases are older or shorter matches, rarely an extension worth the scan). Returns the
    number of nodes added.
    """
    added = 0
    skipped = 0
    leaves = len(tree.leaves())
    for phrase, source in phrases:
        if tree.n_candidates >= max_nodes:
            break
        grows = would_add_leaf(tree, phrase, node)
        if grows is None:
            continue
        if grows:
            if leaves >= max_leaves:
                skipped += 1
                if stop_after_skips is not None and skipped >= stop_after_skips:
                    break
                continue
            leaves += 1
        before = tree.n_candidates
        tree.add_path(node, phrase, source=source, max_nodes=max_nodes)
        added += tree.n_candidates - before
    return added


class JacobiWindow:
    """The 2-D Jacobi window: ``cells[l, i]`` = level l, column i; ``cells[0, 0]`` is unused (it is ``u``).

    Level 0 holds W-1 guesses (columns 1..W-1), levels 1..N-2 hold W each. After a forward whose last
    level predicted ``new`` (W tokens), column i offers the phrase ``(a1[i], .., a_{N-2}[i], new[i])``
    under the key "level-0 token of column i" and the window shifts by one position (LADE's
    ALWAYS_FWD_ONE). Lookahead rides it in the target's batch, Ouroboros in the draft's.
    """

    def __init__(self, width: int, level: int):
        if width < 0:
            raise ParameterError(f"Jacobi window width must be >= 0 (got {width})")
        if level < 3:
            raise ParameterError(f"Jacobi window level N must be >= 3 (got {level}): phrases hold N-1 tokens")
        self.W = width
        self.N = level
        self.K = level - 1
        self.cells = np.zeros((level - 1, width), dtype=np.int64)
        self.age = 0          # shifts since reset

    @property
    def n_nodes(self) -> int:
        """Window tokens in a batch."""
        return max(self.W - 1, 0) + (self.N - 2) * self.W

    @property
    def depth(self) -> int:
        """Deepest window token below ``u``."""
        return self.W - 1 + self.N - 2 if self.W else 0

    @property
    def ready(self) -> bool:
        """Every key and phrase token is a model output (not a random initial guess)."""
        return self.age >= self.N - 1

    @property
    def levels(self) -> list[list[int]]:
        """The guesses level by level: level 0 without its unused column 0, then levels 1..N-2."""
        rows = self.cells.tolist()
        return [rows[0][1:]] + rows[1:]

    @levels.setter
    def levels(self, levels: Sequence[Sequence[int]]) -> None:
        self.cells[0, 1:] = levels[0]
        self.cells[1:] = levels[1:]

    def reset(self, prompt: Sequence[int], seed: int = 0, level_by_level: bool = False) -> None:
        """Fill every level with tokens drawn from the prompt (LADE's initialisation, no warm-up).

        An own generator keeps the sampler's random stream untouched. The two draw orders are both
        kept so that seeded drafts stay as they were: the whole grid at once (Ouroboros, unused cell
        included) or level 0's W-1 guesses, then each level's W (lookahead, ``level_by_level``).
        """
        if self.W:
            rng = np.random.default_rng(seed)
            src = np.asarray(prompt, dtype=np.int64)
            if not src.size:   # a draft of another vocabulary may see no text yet (a prompt of a BOS alone)
                src = np.zeros(1, dtype=np.int64)
            if level_by_level:
                self.cells[0, 1:] = rng.choice(src, size=self.W - 1)
                for lev in range(1, self.N - 1):
                    self.cells[lev] = rng.choice(src, size=self.W)
            else:
                self.cells[:] = rng.choice(src, size=self.cells.shape)
        self.age = 0

    def phrases(self, u: int, new: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(keys[W], phrases[W, K]): key = level-0 token of each column, phrase = its diagonal + new."""
        keys = self.cells[0].copy()
        keys[0] = u
        return keys, self._diagonals(new)

    def _diagonals(self, new: Sequence[int]) -> np.ndarray:
        return np.vstack([self.cells[1:], np.asarray(new, dtype=np.int64)[None, :]]).T

    def harvest(self, pool: PhrasePool, key_context: Sequence[int], new: Sequence[int]) -> int:
        """Add each column's phrase to ``pool`` under its key context: ``key_context`` (ending with
        ``u``) followed by level 0 up to the column. Returns the number of phrases added."""
        level0 = list(key_context) + self.cells[0, 1:].tolist()
        base = len(key_context)
        added = 0
        for i, phrase in enumerate(self._diagonals(new).tolist()):
            added += pool.add(level0[:base + i], phrase)
        return added

    def shift(self, new: Sequence[int]) -> None:
        """Advance by one position: level 0 = level 1 without column 0, level l = level l+1, last = new."""
        c = self.cells
        c[0, 1:] = c[1, 1:]
        c[1:-1] = c[2:]
        c[-1] = new
        self.age += 1


__all__ = ["JacobiWindow", "cut_at_eog", "hang_phrases", "would_add_leaf"]
