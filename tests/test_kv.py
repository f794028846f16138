"""KVCache bookkeeping on a real llama.cpp context over the tiny generated target.

The invariant the engine relies on (ouroboros_local/kv.py): between rounds sequence 0 holds exactly
``cached``, and every other sequence holds sequence 0's first ``synced[s]`` cells and nothing more.
Each test checks it two ways: ``check()`` against llama.cpp's own view, and the logits: whatever the
cache went through (shared prefixes, rejected trees, a winning branch on another sequence, a failed
prefill), the next decode gives exactly the logits of a new context that decoded the same tokens.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest

from ouroboros_local.errors import ContextOverflowError
from ouroboros_local.kv import KVCache
from ouroboros_local.llama import Batch, Context, ContextParams, Model
from ouroboros_local.tree import ExtraToken, TokenTree, layout

N_CTX, N_BATCH, N_SEQ = 128, 16, 4
PROMPT = [int(t) for t in np.random.default_rng(0).integers(10, 500, 32)]   # two n_batch chunks
# A tree below PROMPT[-1]: three leaf paths (sequences 0, 1, 2 in leaf order) and a lookahead-like
# extra sequence (3) riding along at positions 1 and 2.
BRANCHES = [[41, 42, 43], [41, 44], [45]]


class Reference:
    """Plain decoding without KVCache: a context of its own, cleared and decoded in one batch."""

    def __init__(self, model: Model):
        self.ctx = Context(model, ContextParams(n_ctx=N_CTX, n_batch=N_CTX, n_seq_max=1, n_threads=1))
        self.batch = Batch(N_CTX, 1)

    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        self.ctx.clear()
        self.batch.clear()
        self.batch.add_sequence(list(tokens), 0, (0,), True)
        self.ctx.decode(self.batch)
        return self.ctx.logits(1)[0].copy()

    def close(self) -> None:
        self.batch.free()
        self.ctx.close()


@pytest.fixture(scope="module")
def model(tiny_target):
    m = Model(tiny_target)
    yield m
    m.close()


@pytest.fixture(scope="module")
def reference(model):
    ref = Reference(model)
    yield ref
    ref.close()


@pytest.fixture
def kv(model):
    ctx = Context(model, ContextParams(n_ctx=N_CTX, n_batch=N_BATCH, n_seq_max=N_SEQ, n_threads=1))
    cache = KVCache(ctx)
    cache.decoded = []           # tokens per llama_decode call: what was reused, what decoded again
    real_decode = ctx.decode

    def counting_decode(batch: Batch) -> None:
        real_decode(batch)
        cache.decoded.append(batch.n_tokens)

    ctx.decode = counting_decode
    yield cache
    ctx.close()


def decoded(kv: KVCache) -> int:
    """Tokens decoded since the last call."""
    n = sum(kv.decoded)
    kv.decoded.clear()
    return n


def assert_same_logits(got: np.ndarray, want: np.ndarray) -> None:
    # same weights, positions and visible cells: equal up to rounding (f16 cells written by batches of
    # other shapes: <= 2e-4); a loser's cell left in view moves the tiny model's logits by ~0.8
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def branchy_tree(root: int, branches: Sequence[Sequence[int]] = BRANCHES, extras: bool = True) -> TokenTree:
    tree = TokenTree.rooted_at(root)
    for branch in branches:
        tree.add_path(0, branch)
    if extras:
        tree.extras = [ExtraToken(token=7, pos_offset=1, seqs=(0,)), ExtraToken(token=8, pos_offset=2, seqs=(0,))]
        tree.n_extra_seqs = 1
    return tree


def assert_rows_follow_each_path(reference: Reference, prefix: Sequence[int], tree: TokenTree,
                                 rows: np.ndarray) -> None:
    """Row i holds the logits of the committed prefix followed by node i's own root-to-node path:
    no sibling branch and no extra token is in its view."""
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        assert_same_logits(rows[node], reference.logits(list(prefix) + path))


def winner_of(tree: TokenTree, node: int) -> int:
    """The sequence the engine keeps when ``node`` ends the accepted path (the lowest leaf id below it)."""
    lay = layout(tree)
    return min(s for s in lay.seq_ids[node] if s < len(lay.leaf_seq))


# ---- linear histories --------------------------------------------------------------------------

def test_sync_to_decodes_only_what_follows_the_shared_prefix(kv: KVCache, reference: Reference) -> None:
    kv.sync_to(PROMPT)
    assert (kv.cached, kv.n_past, kv.decoded) == (PROMPT, 32, [16, 16])   # n_batch chunks
    kv.check()
    decoded(kv)

    edited = PROMPT[:20] + [7, 8, 9, 10]
    assert_same_logits(kv.sync_to(edited, logits_last=True), reference.logits(edited))
    assert decoded(kv) == 4 and kv.cached == edited
    kv.check()

    # the same tokens again: only the last is decoded, for its logits
    assert_same_logits(kv.sync_to(edited, logits_last=True), reference.logits(edited))
    assert decoded(kv) == 1
    kv.sync_to(edited[:10])                                  # a prefix: nothing to decode
    assert decoded(kv) == 0 and kv.n_past == 10 and kv.room == kv.ctx.n_ctx - 10
    kv.check()

    assert_same_logits(kv.sync_to(PROMPT, logits_last=True), reference.logits(PROMPT))
    assert decoded(kv) == 22
    kv.check()

    # the first ``end`` tokens, without slicing the list (a draft's catch-up did, O(context) each time)
    longer = PROMPT + [5, 6, 7]
    assert_same_logits(kv.sync_to(longer, logits_last=True, end=len(PROMPT) + 1), reference.logits(longer[:33]))
    assert decoded(kv) == 1 and kv.cached == longer[:33]
    kv.sync_to(longer, agreed=33, end=32)
    assert decoded(kv) == 0 and kv.cached == PROMPT
    kv.check()


def test_the_agreed_watermark_is_used_and_a_stale_one_is_caught(kv: KVCache, reference: Reference) -> None:
    kv.sync_to(PROMPT)
    decoded(kv)
    longer = PROMPT + [1, 2]
    assert_same_logits(kv.sync_to(longer, logits_last=True, agreed=len(PROMPT)), reference.logits(longer))
    assert decoded(kv) == 2
    # a watermark past the divergence whose last item disagrees: the walk starts over from 0
    edited = PROMPT[:30] + [3, 4, 5, 6]
    assert_same_logits(kv.sync_to(edited, logits_last=True, agreed=len(longer)), reference.logits(edited))
    assert decoded(kv) == 4 and kv.cached == edited
    kv.check()


def test_a_too_long_prompt_is_refused_before_any_decode(kv: KVCache, reference: Reference) -> None:
    kv.sync_to(PROMPT)
    decoded(kv)
    with pytest.raises(ContextOverflowError):
        kv.sync_to(PROMPT[:8] + [5] * kv.ctx.n_ctx)
    assert decoded(kv) == 0 and kv.cached == PROMPT[:8]      # rolled back to the common prefix, consistent
    kv.check()
    assert_same_logits(kv.sync_to(PROMPT, logits_last=True), reference.logits(PROMPT))


# ---- token trees -------------------------------------------------------------------------------

def test_tree_rows_see_only_their_own_path(kv: KVCache, reference: Reference) -> None:
    kv.sync_to(PROMPT[:-1])
    tree = branchy_tree(PROMPT[-1])
    lay = layout(tree)
    assert lay.n_seqs == 4
    rows = kv.decode_layout(lay)
    assert rows.shape == (len(tree) + 2, kv.ctx.n_vocab)
    assert_rows_follow_each_path(reference, PROMPT[:-1], tree, rows)
    with pytest.raises(AssertionError, match="seq 0"):     # decoded but not committed: not a valid state
        kv.check()


@pytest.mark.parametrize("accepted_node", [0, 1, 2, 4, 5])    # root only, a shared prefix, inner, leaves
def test_commit_keeps_the_accepted_path_and_drops_the_rest(kv: KVCache, reference: Reference,
                                                           accepted_node: int) -> None:
    kv.sync_to(PROMPT[:-1])
    tree = branchy_tree(PROMPT[-1])
    lay = layout(tree)
    kv.decode_layout(lay)
    accepted = [tree.tokens[i] for i in tree.path_to(accepted_node)[1:]]
    winner = winner_of(tree, accepted_node)
    kv.commit_tree(tree.tokens[0], accepted, winner, lay.n_seqs)
    assert kv.cached == PROMPT + accepted
    kv.check()
    # the losers' cells (and the extras) are gone: the next step sees the accepted history only
    decoded(kv)
    nxt = kv.cached + [9]
    assert_same_logits(kv.sync_to(nxt, logits_last=True), reference.logits(nxt))
    assert decoded(kv) == 1
    kv.check()


@pytest.mark.parametrize("winning_leaf", [0, 1, 2])
def test_the_winner_s_sequence_becomes_the_history_of_the_next_tree(kv: KVCache, reference: Reference,
                                                                    winning_leaf: int) -> None:
    """A winner on sequence 1 or 2 is copied to sequence 0; the next round uses all four sequences, the
    ones not in the last tree are brought up to date lazily, and every row sees exactly its path."""
    kv.sync_to(PROMPT[:-1])
    first = branchy_tree(PROMPT[-1], extras=False)            # three sequences: 3 is left behind
    lay = layout(first)
    kv.decode_layout(lay)
    leaf = first.leaves()[winning_leaf]
    assert lay.leaf_seq[leaf] == winning_leaf == winner_of(first, leaf)
    accepted = [first.tokens[i] for i in first.path_to(leaf)[1:]]
    kv.commit_tree(first.tokens[0], accepted, winning_leaf, lay.n_seqs)
    kv.check()
    assert kv.synced[3] == 0

    bonus = 11
    history = PROMPT + accepted
    second = branchy_tree(bonus, [[12, 13], [12, 14, 15], [16], [17, 18]], extras=False)
    lay2 = layout(second)
    assert lay2.n_seqs == 4
    rows = kv.decode_layout(lay2)
    assert_rows_follow_each_path(reference, history, second, rows)
    kv.commit_tree(bonus, [17, 18], winner_of(second, len(second) - 1), lay2.n_seqs)
    assert kv.cached == history + [bonus, 17, 18]
    kv.check()


def test_a_new_history_after_trees_truncates_every_sequence(kv: KVCache, reference: Reference) -> None:
    kv.sync_to(PROMPT[:-1])
    tree = branchy_tree(PROMPT[-1])
    lay = layout(tree)
    kv.decode_layout(lay)
    kv.commit_tree(tree.tokens[0], [41, 44], 1, lay.n_seqs)
    assert kv.synced == [34, 34, 32, 32]
    # the next request shares only 12 tokens: every sequence forgets what lies past them
    other = PROMPT[:12] + [60, 61, 62]
    kv.sync_to(other[:-1])
    assert kv.synced == [14, 12, 12, 12]
    kv.check()
    tree2 = branchy_tree(other[-1])
    rows = kv.decode_layout(layout(tree2))
    assert_rows_follow_each_path(reference, other[:-1], tree2, rows)


def test_trees_that_do_not_fit_are_refused_and_leave_the_cache_intact(kv: KVCache) -> None:
    kv.sync_to(PROMPT[:-1])
    decoded(kv)
    too_many_seqs = branchy_tree(PROMPT[-1], [[1], [2], [3], [4]])      # 4 leaves + 1 extra sequence
    with pytest.raises(ValueError, match="sequences"):
        kv.decode_layout(layout(too_many_seqs))
    too_big = branchy_tree(PROMPT[-1], [list(range(100, 100 + N_BATCH))], extras=False)
    with pytest.raises(ValueError, match="n_batch"):
        kv.decode_layout(layout(too_big))
    kv.sync_to(PROMPT + [5] * (kv.ctx.n_ctx - len(PROMPT) - 2))   # llama.cpp may round n_ctx up
    decoded(kv)
    with pytest.raises(ContextOverflowError):
        kv.decode_layout(layout(branchy_tree(5, extras=False)))
    assert decoded(kv) == 0
    kv.check()


# ---- the invariant check and recovery ----------------------------------------------------------

def test_check_catches_cells_the_bookkeeping_does_not_know_about(kv: KVCache) -> None:
    kv.sync_to(PROMPT)
    kv.check()
    kv.ctx.seq_cp(0, 2, 0, 10)                 # sequence 2 is synced to 0 cells but now holds 10
    with pytest.raises(AssertionError, match="seq 2: pos_max 9, expected -1"):
        kv.check()
    kv.ctx.seq_rm(2, -1, -1)
    kv.check()
    kv.ctx.seq_rm(0, 20, -1)                   # sequence 0 lost cells ``cached`` still lists
    with pytest.raises(AssertionError, match="seq 0: pos_max 19, expected 31"):
        kv.check()


def test_reset_recovers_from_a_prefill_that_failed_inside_a_decode(kv: KVCache, reference: Reference) -> None:
    """A decode that wrote its cells and then failed (an interrupt, an error after the fact) leaves
    cells ``cached`` does not list: check() sees it, and reset() (what the engine does after a failed
    prefill) gives a clean cache that decodes exactly like a new context."""
    real_decode = kv.ctx.decode

    def failing_second_chunk(batch: Batch) -> None:
        real_decode(batch)
        if len(kv.decoded) == 2:
            raise KeyboardInterrupt

    kv.ctx.decode = failing_second_chunk
    with pytest.raises(KeyboardInterrupt):
        kv.sync_to(PROMPT)
    kv.ctx.decode = real_decode
    assert kv.cached == PROMPT[:N_BATCH]
    with pytest.raises(AssertionError, match="seq 0"):
        kv.check()
    kv.reset()
    assert kv.n_past == 0 and kv.synced == [0] * N_SEQ
    kv.check()
    decoded(kv)
    assert_same_logits(kv.sync_to(PROMPT, logits_last=True), reference.logits(PROMPT))
    assert decoded(kv) == len(PROMPT)
    kv.check()


def test_logits_without_the_package_s_library_handle(reference: Reference, monkeypatch: pytest.MonkeyPatch) -> None:
    # Context.logits reads the buffer's address through a function object of its own, made from
    # llama_cpp's library handle (``_lib``); a llama-cpp-python that does not expose it gets the same
    # rows through its own llama_get_logits
    from ouroboros_local.llama import binding

    want = reference.logits(PROMPT[:5])
    monkeypatch.delattr(binding.lc, "_lib")
    monkeypatch.setattr(binding, "_logits_address", binding._logits_address_function())
    reference.ctx._logits_addr = None
    assert np.array_equal(reference.logits(PROMPT[:5]), want)
