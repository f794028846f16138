"""Lookahead decoding (LADE), target only: a Jacobi window rides along in the target's verify batch.

Geometry (docs/design.md#lookahead-geometry), with ``u`` = the root (last committed token) at offset 0:

* level 0 holds W-1 guesses ``a0[1..W-1]`` at offsets 1..W-1 (column 0 of level 0 is ``u`` itself);
* level l = 1..N-2 holds W guesses ``al[0..W-1]``, column i at offset l+i;
* column i reads the chain ``u a0[1..i] a1[i] .. al[i]`` at consecutive positions.

As tree extras, column i is extra sequence i. A level-0 token ``a0[i]`` carries sequences i..W-1 (every
column to its right reads it), a level-l token only its own column, and the root carries every extra
sequence (the engine adds them). So each sequence is gap-free (root, a0[1..i], then i+1..i+N-2) and a
multi-sequence level-0 token sees the same cells through each of its ids: the only cells below its
position in those sequences are ``u`` and ``a0[1..i-1]`` (column tokens sit above position i).
Only the last level asks for logits; their argmax is the next Jacobi iterate ``new[0..W-1]``.

After each pass: harvest one phrase per column, key = the column's level-0 token, phrase =
``(a1[i], .., a_{N-2}[i], new[i])`` (N-1 tokens on the diagonal), then shift the levels by one
(LADE's ALWAYS_FWD_ONE): level 0 = level 1 without its first column, level l = level l+1, the last
level = new. The engine drops the window's cells after every round, so it is decoded afresh each pass,
as in llama.cpp's example. Pool phrases keyed by the root (at most G) are the verification branches.
With ``pool_from_prompt`` the pool is also fed with the n-grams of the prompt and the output (LADE's
POOL_FROM_PROMPT), which makes it a prompt-lookup as well.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from .. import options as opt
from ..drafting import JacobiWindow, hang_phrases
from ..errors import MethodOptionError, ParameterError
from ..pool import PhrasePool, harvest_strategy, harvest_verification
from ..tree import ExtraToken, TokenTree
from .base import DraftingContext, Proposer, ProposeSetup

if TYPE_CHECKING:  # pragma: no cover
    from ..verify import VerifyResult


def window_tokens(W: int, N: int) -> int:
    """The tokens a W x N window adds to a verify batch: W-1 of level 0, W of each of the N-2 others."""
    return (W - 1) + W * (N - 2)


def check_window_fits(W: int, N: int, max_branches: int, max_tree_nodes: int) -> None:
    """MethodOptionError where the target's batch cannot hold the window (``ProposeSetup``'s bounds; the
    factories ask from the target's context before the prompt's prefill, minutes on a long prompt)."""
    if max_branches < W + 1:
        raise MethodOptionError(f"lookahead window W={W} needs {W + 1} sequence ids, the context has "
                                f"{max_branches} (at most its batch of {max_tree_nodes + 1} tokens); lower the "
                                "window, or raise --seqs and --batch-size")
    n_extras = window_tokens(W, N)
    if max_tree_nodes < n_extras:
        raise MethodOptionError(f"lookahead window W={W}, N={N} needs {n_extras + 1} batch tokens, the batch "
                                f"holds {max_tree_nodes + 1}")


def check_window_fits_target(ctx: DraftingContext, W: int, N: int) -> None:
    check_window_fits(W, N, ctx.target_context.n_seq_max, ctx.target_context.n_batch - 1)


class LookaheadProposer(Proposer):
    name = "lookahead"

    def __init__(self, window: int = 4, ngram: int = 3, guess: int = 4, pool: PhrasePool | None = None,
                 pool_from_prompt: bool = True, harvest: str | None = "none", seed: int = 0):
        if window < 1:
            raise ParameterError(f"lookahead window must be >= 1 (got {window})")
        if ngram < 3:
            raise ParameterError(f"lookahead ngram size N must be >= 3 (got {ngram})")
        if guess < 0:
            raise ParameterError(f"lookahead guess set size must be >= 0 (got {guess})")
        self.W, self.N, self.G = window, ngram, guess
        self.pool = pool if pool is not None else PhrasePool(key_len=1, max_per_key=max(guess, 1),
                                                              phrase_len=ngram - 1)
        self.pool_from_prompt = pool_from_prompt
        self.harvest = harvest_strategy(harvest)
        self.seed = seed
        # Static window geometry: (level, column, pos_offset, extra seqs, wants logits) in batch order.
        W, N = window, ngram
        self._geometry: list[tuple[int, int, int, tuple[int, ...], bool]] = \
            [(0, i, i, tuple(range(i, W)), False) for i in range(1, W)]
        self._geometry += [(lev, i, lev + i, (i,), lev == N - 2) for lev in range(1, N - 1) for i in range(W)]
        self.n_extras = len(self._geometry)          # window_tokens(W, N)
        self.window_depth = W - 1 + N - 2            # largest position offset of a window token
        self.window = JacobiWindow(window, ngram)
        self._pending: tuple[TokenTree, list[int]] | None = None
        self._fed = 0
        self._stats: dict[str, int] = {}

    # ---- generation lifecycle ---------------------------------------------------------------------
    def begin(self, prompt: Sequence[int], setup: ProposeSetup) -> None:
        super().begin(prompt, setup)
        check_window_fits(self.W, self.N, setup.max_branches, setup.max_tree_nodes)
        # Random prompt tokens (LADE) rather than llama.cpp's dummy ids: plausible tokens converge faster.
        self.window.reset(prompt, self.seed, level_by_level=True)
        self._pending = None
        # an earlier call's text this one continues (a chat's earlier turns) is in the pool already
        self._fed = self.pool.fed_before(prompt, self.N) if self.pool_from_prompt else 0
        self._feed(prompt)
        self._stats = {"rounds": 0, "window_rounds": 0, "window_phrases": 0, "branch_nodes": 0,
                       "branch_accepted": 0, "verify_phrases": 0}

    def _feed(self, committed: Sequence[int]) -> None:
        if self.pool_from_prompt:
            self.pool.add_ngrams(committed, self.N, start=self._fed)
            self._fed = len(committed)

    # ---- one round --------------------------------------------------------------------------------
    def window_extras(self) -> list[ExtraToken]:
        """The current window as tree extras (see the module docstring for the layout)."""
        cells = self.window.cells.tolist()
        return [ExtraToken(cells[lev][i], off, seqs, want) for lev, i, off, seqs, want in self._geometry]

    def propose(self, committed: Sequence[int], budget: int) -> TokenTree:
        tree = TokenTree.rooted_at(committed[-1])
        self._pending = None
        if budget <= 0:
            return tree
        self._stats["rounds"] += 1
        # The window needs room for its positions and tokens; near the end of a generation it pauses.
        with_window = budget >= self.window_depth
        n_extra = self.n_extras if with_window else 0
        max_nodes = min(budget, self.setup.max_tree_nodes - n_extra)
        max_leaves = min(self.G, self.setup.max_branches - (self.W if with_window else 0))
        if max_nodes > 0 and max_leaves >= 1:
            phrases = self.pool.lookup(committed, k=self.G, max_len=self.N - 1)
            hang_phrases(tree, 0, ((p, "lookahead") for p in phrases), max_nodes, max_leaves,
                         stop_after_skips=3)
            self._stats["branch_nodes"] += tree.n_candidates
        if with_window:
            tree.extras = self.window_extras()
            tree.n_extra_seqs = self.W
            self._pending = (tree, [int(t) for t in committed[-self.pool.key_len:]])
            self._stats["window_rounds"] += 1
        return tree

    def observe(self, committed: Sequence[int], result: "VerifyResult") -> None:
        pending, self._pending = self._pending, None
        self._stats["branch_accepted"] += getattr(result, "accepted_by_source", {}).get("lookahead", 0)
        if pending is not None and pending[0] is result.tree and result.extra_predictions is not None:
            new = list(result.extra_predictions)
            if len(new) != self.W:
                raise RuntimeError(f"lookahead: expected {self.W} window rows, got {len(new)}")
            self._stats["window_phrases"] += self.window.harvest(self.pool, pending[1], new)
            self.window.shift(new)
        if self.harvest != "none":
            root = len(committed) - len(result.tokens) - 1
            ctx = committed[max(0, root - self.pool.key_len + 1):max(root, 0)]
            self._stats["verify_phrases"] += harvest_verification(
                self.pool, result.tree, result.predictions, result.path, self.harvest, context=ctx)
        self._feed(committed)

    def stats(self) -> dict[str, Any]:
        return {"la_" + k: v for k, v in self._stats.items()}


WINDOW = replace(opt.WINDOW, lo=1, help="lookahead window columns (W)")   # never 0 (ouroboros's may be)
OPTIONS: tuple[opt.Option, ...] = (WINDOW, opt.LEVEL, opt.GUESS_SET, opt.POOL, opt.WARM_START,
                                   opt.POOL_FROM_PROMPT, opt.HARVEST.with_default("none"), opt.SEED)


def create(ctx: DraftingContext, options: dict[str, Any]) -> Proposer:
    """``options``: checked against ``OPTIONS`` (``level`` is N, ``guess_set`` is G)."""
    W, N, G = options["window"], options["level"], options["guess_set"]
    check_window_fits_target(ctx, W, N)   # before a history file is named
    if options["pool"] is not None:   # the engine's history pool, persisted to that file
        pool: PhrasePool | None = ctx.history.pool(N - 1, max(G, 1), options["pool"])
    elif options["warm_start"]:
        # Warm start: one pool per engine and geometry survives across requests (docs/design.md#warm-start).
        pool = ctx.history.kept(("lookahead", N, G),
                                lambda: PhrasePool(key_len=1, max_per_key=max(G, 1), phrase_len=N - 1))
    else:
        pool = None
    return LookaheadProposer(window=W, ngram=N, guess=G, pool=pool, pool_from_prompt=options["pool_from_prompt"],
                             harvest=options["harvest"], seed=options["seed"])
