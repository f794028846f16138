"""KV-cache bookkeeping: the one place that decides positions, sequence ids and rollback.

Invariant between rounds: sequence 0 holds exactly ``cached`` (positions 0..len-1). Other sequences are
synced lazily: ``synced[s]`` cells of sequence s equal sequence 0's first ``synced[s]`` cells, and s
holds nothing beyond them. Before a batch uses sequence s it is brought up to date with a cheap,
metadata-only ``seq_cp`` (the cache is unified).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from .errors import ContextOverflowError
from .llama import Batch, Context
from .tree import BatchLayout


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0, end: int | None = None) -> int:
    """Length of the common prefix of a and b (of their first ``end`` items), given that their first
    ``start`` items are known to agree (a watermark the caller keeps: the walk then costs only the
    items after it)."""
    n = min(len(a), len(b)) if end is None else min(len(a), len(b), end)
    i = min(start, n)
    if i > 0 and a[i - 1] != b[i - 1]:   # an O(1) sanity check of the watermark
        i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVCache:
    def __init__(self, ctx: Context, max_seqs_per_token: int | None = None):
        self.ctx = ctx
        self.batch = Batch(ctx.n_batch, max_seqs_per_token or ctx.n_seq_max)
        self.cached: list[int] = []
        self.synced = [0] * ctx.n_seq_max

    @property
    def n_past(self) -> int:
        return len(self.cached)

    @property
    def room(self) -> int:
        return self.ctx.n_ctx - self.n_past

    def reset(self) -> None:
        self.ctx.clear()
        self.cached = []
        self.synced = [0] * self.ctx.n_seq_max

    def truncate(self, n: int) -> None:
        """Forget every cell at position >= n in every sequence."""
        if n < self.n_past:
            self.ctx.seq_rm(-1, n, -1)
            del self.cached[n:]
            self.synced = [min(s, n) for s in self.synced]

    def discard_uncommitted(self) -> None:
        """Drop the cells a decode wrote past the committed tokens without committing any (a timing's)."""
        self.ctx.seq_rm(-1, self.n_past, -1)

    def repair(self) -> None:
        """After an exception (a Ctrl-C that Python raises just after a llama.cpp call returned): drop the
        cells past the committed tokens, and those a sequence was copied but not yet recorded to hold."""
        self.discard_uncommitted()
        for s, synced in enumerate(self.synced):
            if s and synced < self.n_past:
                self.ctx.seq_rm(s, synced, -1)

    def feed(self, tokens: Sequence[int], logits_last: bool = False,
             stop: Callable[[], bool] | None = None) -> np.ndarray | None:
        """Append tokens to sequence 0 in n_batch chunks; returns the last token's logits row if asked.
        ``stop``: asked before each chunk after the first; when it says so, the cache keeps the chunks
        decoded so far (a prefix: consistent) and None is returned (a long prompt's prefill can be
        cancelled)."""
        if not tokens:
            return None
        if self.n_past + len(tokens) > self.ctx.n_ctx:
            raise ContextOverflowError(
                f"{self.n_past + len(tokens)} tokens do not fit the context of {self.ctx.n_ctx}")
        self._sync_seq(0)
        step = self.ctx.n_batch
        for start in range(0, len(tokens), step):
            if start and stop is not None and stop():
                return None
            chunk = tokens[start:start + step]
            last_chunk = start + step >= len(tokens)
            self.batch.clear()
            self.batch.add_sequence(chunk, self.n_past, (0,), logits_last and last_chunk)
            self.ctx.decode(self.batch)
            self.cached.extend(map(int, chunk))
            self.synced[0] = self.n_past
        return self.ctx.logits(1)[0] if logits_last else None

    def sync_to(self, tokens: Sequence[int], logits_last: bool = False, agreed: int = 0,
                stop: Callable[[], bool] | None = None, end: int | None = None) -> np.ndarray | None:
        """Make the cache hold exactly ``tokens`` (their first ``end``: no O(context) slice), reusing the
        longest common prefix.

        ``agreed``: a length the caller knows the cache and ``tokens`` share (see ``common_prefix``).
        ``stop``: as ``feed``'s (the cache then holds a prefix of ``tokens``)."""
        n = len(tokens) if end is None else min(end, len(tokens))
        keep = common_prefix(self.cached, tokens, agreed, n)
        if logits_last and keep == n and keep > 0:
            keep -= 1  # re-decode the last token to get its logits
        self.truncate(keep)
        return self.feed(list(tokens[keep:n]), logits_last=logits_last, stop=stop)

    def _sync_seq(self, s: int) -> None:
        if self.synced[s] < self.n_past:
            if s != 0:
                self.ctx.seq_cp(0, s, self.synced[s], self.n_past)
            self.synced[s] = self.n_past

    # ---- token trees ------------------------------------------------------------------------------
    def decode_layout(self, lay: BatchLayout) -> np.ndarray:
        """Decode a tree layout whose root goes at position n_past; returns all output rows."""
        self.begin_layout(lay)
        return self.layout_rows()

    def begin_layout(self, lay: BatchLayout) -> None:
        """``decode_layout`` without waiting for its rows (``layout_rows`` waits): on a GPU the decode
        runs while the caller works."""
        if lay.n_seqs > self.ctx.n_seq_max:
            raise ValueError(f"tree needs {lay.n_seqs} sequences, context has {self.ctx.n_seq_max}")
        if len(lay.tokens) > self.ctx.n_batch:
            raise ValueError(f"tree of {len(lay.tokens)} tokens exceeds n_batch {self.ctx.n_batch}")
        # every batch token takes a cell (branches share positions, not cells)
        if self.n_past + len(lay.tokens) > self.ctx.n_ctx:
            raise ContextOverflowError(f"the context of {self.ctx.n_ctx} tokens is full")
        for s in range(lay.n_seqs):
            self._sync_seq(s)
        base = self.n_past
        if lay.chain:
            self.batch.set_chain(lay.tokens, base)
        else:
            self.batch.clear()
            self.batch.add_tokens(lay.tokens, [base + off for off in lay.pos_offsets], lay.seq_ids, lay.logits)
        self.ctx.decode(self.batch)

    def layout_rows(self) -> np.ndarray:
        """The output rows of the layout ``begin_layout`` began (waits for them)."""
        return self.ctx.logits(self.batch.n_outputs)

    def decode_step(self, token: int) -> np.ndarray:
        """Decode ``token`` at position n_past on sequence 0 and keep it (a plain step, which never needs
        rolling back); returns its logits (one row). The same cells as ``decode_layout`` + ``commit_tree`` of
        a tree that is the root alone, without the layout."""
        self.begin_step(token)
        return self.ctx.logits(1)

    def step_logits(self) -> np.ndarray:
        """The logits row of the step ``begin_step`` began (waits for it)."""
        return self.ctx.logits(1)

    def begin_step(self, token: int) -> None:
        """``decode_step`` without waiting for its logits (``ctx.logits(1)`` waits): on a GPU the decode
        runs while the caller works."""
        p = len(self.cached)
        if p >= self.ctx.n_ctx:
            raise ContextOverflowError(f"the context of {self.ctx.n_ctx} tokens is full")
        if self.synced[0] < p:
            self._sync_seq(0)
        self.batch.set_chain((token,), p)
        self.ctx.decode(self.batch)
        self.cached.append(int(token))
        self.synced[0] = p + 1

    def commit_tree(self, root_token: int, accepted: Sequence[int], winner_seq: int, n_seqs: int,
                    n_cells: int | None = None) -> None:
        """Keep the root and the accepted path's cells; drop every other cell of this round.
        ``n_cells``: how many cells the round decoded (None: unknown), so a round that kept them all
        (a plain step, a fully accepted chain) makes no call to drop nothing."""
        p = self.n_past
        a = len(accepted)
        ctx = self.ctx
        if n_cells is None or n_cells > a + 1:
            ctx.seq_rm(-1, p + a + 1, -1)
        if n_seqs > 1:
            for s in range(n_seqs):
                if s != winner_seq:
                    ctx.seq_rm(s, p + 1, -1)
            if winner_seq != 0:
                ctx.seq_cp(winner_seq, 0, p + 1, -1)
        self.cached.append(int(root_token))
        self.cached.extend(map(int, accepted))
        for s in range(n_seqs):
            self.synced[s] = p + 1
        self.synced[0] = self.n_past
        self.synced[winner_seq] = self.n_past

    def check(self) -> None:
        """Assert the invariant against llama.cpp's own view (used by tests)."""
        for s, n in enumerate(self.synced):
            got = self.ctx.pos_max(s)
            assert got == n - 1, f"seq {s}: pos_max {got}, expected {n - 1}"
