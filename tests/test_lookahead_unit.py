"""Lookahead proposer without llama.cpp: window layout, shift and harvest, and greedy equality on a fake
target whose attention follows llama.cpp's sequence-id rule (ouroboros_local.testing.sim)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ouroboros_local.errors import ParameterError
from ouroboros_local.history import History
from ouroboros_local.proposers import check_options
from ouroboros_local.pool import PhrasePool
from ouroboros_local.proposers.lookahead import LookaheadProposer, create
from ouroboros_local.testing.engines import E2E_PROMPTS
from ouroboros_local.testing.sim import FakeTarget, assert_greedy_under_budgets, make_setup, simulate
from ouroboros_local.tree import check_layout, layout


def started(prop: LookaheadProposer, prompt: list[int], **setup_kw) -> LookaheadProposer:
    prop.begin(prompt, make_setup(**setup_kw))
    return prop


def visible(lay, i: int) -> list[int]:
    """Tokens batch entry i attends to (through its first seq id), ordered by position."""
    s = lay.seq_ids[i][0]
    cells = sorted((p, j) for j, (p, ss) in enumerate(zip(lay.pos_offsets, lay.seq_ids))
                   if s in ss and p <= lay.pos_offsets[i])
    return [lay.tokens[j] for _, j in cells]


@pytest.mark.parametrize("W,N", [(1, 3), (4, 3), (5, 4), (3, 6)])
@pytest.mark.parametrize("with_branches", [False, True])
def test_window_layout_is_valid_and_reads_the_column_chains(W: int, N: int, with_branches: bool) -> None:
    pool = PhrasePool(max_per_key=4, phrase_len=N - 1)
    prop = started(LookaheadProposer(window=W, ngram=N, guess=3, pool=pool, pool_from_prompt=False),
                   [1, 2, 3])
    # distinct window tokens so that every chain can be read back
    prop.window.levels = [[100 + i for i in range(1, W)]] + [[100 * lev + 10 + i for i in range(W)]
                                                             for lev in range(1, N - 1)]
    if with_branches:
        pool.add([3], (7, 8))
        pool.add([3], (7, 9))
        pool.add([3], (6,))
    tree = prop.propose([1, 2, 3], budget=40)
    assert tree.n_extra_seqs == W
    assert len(tree.extras) == prop.n_extras == (W - 1) + W * (N - 2)
    assert sum(e.want_logits for e in tree.extras) == W
    lay = layout(tree)
    check_layout(lay)
    n_leaves = len(tree.leaves())
    assert n_leaves == (3 if with_branches else 1)
    assert lay.n_seqs == n_leaves + W
    # the root carries every sequence id; each window token reads u, a0[1..i], a1[i], .., al[i]
    assert set(lay.seq_ids[0]) == set(range(lay.n_seqs))
    for k, extra in enumerate(tree.extras):
        b = lay.n_tree + k
        lev_col = [(lev, i) for lev in range(N - 1) for i in range(W) if not (lev == 0 and i == 0)][k]
        lev, i = lev_col
        chain = [3] + [100 + j for j in range(1, i + 1)] + [100 * m + 10 + i for m in range(1, lev + 1)]
        assert visible(lay, b) == chain
        assert extra.pos_offset == lev + i
        assert extra.want_logits == (lev == N - 2)
    # branches never see the window and vice versa
    for node in range(1, len(tree)):
        assert all(t < 100 for t in visible(lay, node))


def test_shift_and_harvest_from_hand_made_logits() -> None:
    pool = PhrasePool(max_per_key=4, phrase_len=2)
    prop = started(LookaheadProposer(window=3, ngram=3, guess=2, pool=pool, pool_from_prompt=False),
                   [1, 2, 5])
    prop.window.levels = [[11, 12], [20, 21, 22]]        # level 0: columns 1, 2; level 1: columns 0..2
    tree = prop.propose([1, 2, 5], budget=10)
    assert [e.token for e in tree.extras] == [11, 12, 20, 21, 22]
    new = [30, 31, 32]
    result = SimpleNamespace(tree=tree, path=[0], accepted=[], bonus=6, tokens=[6],
                             predictions=np.array([6]), extra_predictions=list(new), winner_seq=0)
    prop.observe([1, 2, 5, 6], result)
    # harvest: column i -> key = level-0 token (u = 5 for column 0), phrase = (a1[i], new[i])
    assert pool.lookup([5]) == [(20, 30)]
    assert pool.lookup([11]) == [(21, 31)]
    assert pool.lookup([12]) == [(22, 32)]
    # shift by one: level 0 = level 1 without column 0, level 1 = new
    assert prop.window.levels == [[21, 22], [30, 31, 32]]
    assert prop.stats()["la_window_phrases"] == 3
    # the next round: the harvested phrase keyed by the new root is a branch
    pool.add([6], (21, 31))
    tree2 = prop.propose([1, 2, 5, 6], budget=10)
    assert tree2.tokens == [6, 21, 31]
    assert [e.token for e in tree2.extras] == [21, 22, 30, 31, 32]
    assert set(tree2.sources.values()) == {"lookahead"}


def test_window_harvest_with_two_token_keys() -> None:
    pool = PhrasePool(key_len=2, max_per_key=4, phrase_len=2)
    prop = started(LookaheadProposer(window=2, ngram=3, pool=pool, pool_from_prompt=False), [1, 2, 5])
    prop.window.levels = [[11], [20, 21]]
    tree = prop.propose([1, 2, 5], budget=10)
    result = SimpleNamespace(tree=tree, path=[0], accepted=[], bonus=6, tokens=[6],
                             predictions=np.array([6]), extra_predictions=[30, 31])
    prop.observe([1, 2, 5, 6], result)
    assert pool.lookup([2, 5]) == [(20, 30)]
    assert pool.lookup([5, 11]) == [(21, 31)]


def test_window_pauses_without_room_and_ignores_foreign_results() -> None:
    prop = started(LookaheadProposer(window=4, ngram=3, pool_from_prompt=False), [1, 2, 3])
    levels = [list(lv) for lv in prop.window.levels]
    assert prop.propose([1, 2, 3], budget=0).extras == []
    small = prop.propose([1, 2, 3], budget=prop.window_depth - 1)
    assert small.extras == [] and small.n_extra_seqs == 0
    result = SimpleNamespace(tree=small, path=[0], accepted=[], bonus=4, tokens=[4],
                             predictions=np.array([4]), extra_predictions=None)
    prop.observe([1, 2, 3, 4], result)
    assert prop.window.levels == levels
    # a result for another tree (e.g. the engine replaced it) does not move the window either
    prop.propose([1, 2, 3, 4], budget=20)
    other = SimpleNamespace(tree=small, path=[0], accepted=[], bonus=5, tokens=[5],
                            predictions=np.array([5]), extra_predictions=[1, 2, 3, 4])
    prop.observe([1, 2, 3, 4, 5], other)
    assert prop.window.levels == levels


def test_limits_on_sequences_batch_and_branches() -> None:
    with pytest.raises(ParameterError, match="sequence ids"):
        started(LookaheadProposer(window=8), [1, 2], max_branches=8)
    with pytest.raises(ParameterError, match="batch"):
        started(LookaheadProposer(window=4, ngram=4), [1, 2], max_tree_nodes=8)
    with pytest.raises(ParameterError):
        LookaheadProposer(ngram=2)
    pool = PhrasePool(max_per_key=8, phrase_len=2)
    for a in range(8):
        pool.add([3], (a, 50 + a))
    prop = started(LookaheadProposer(window=4, ngram=3, guess=6, pool=pool, pool_from_prompt=False),
                   [1, 2, 3], max_branches=7, max_tree_nodes=12)
    tree = prop.propose([1, 2, 3], budget=12)
    assert len(tree.leaves()) == 3                 # 7 sequence ids - 4 window columns
    assert tree.n_candidates + len(tree.extras) <= 12
    check_layout(layout(tree))


def test_factory_shares_a_pool_per_engine() -> None:
    # the part of a DraftingContext these factories use
    engine = SimpleNamespace(history=History(None), target_context=SimpleNamespace(n_seq_max=16, n_batch=256))
    a = create(engine, check_options("lookahead", {"window": 5, "level": 4, "guess_set": 3}))
    b = create(engine, check_options("lookahead", {"window": 2, "ngram": 4, "guess": 3}))   # old names
    assert isinstance(a, LookaheadProposer) and (a.W, a.N, a.G) == (5, 4, 3)
    assert a.pool is b.pool and a.pool.phrase_len == 3
    assert create(engine, check_options("lookahead", {"warm_start": False})).pool is not a.pool
    with pytest.raises(ParameterError):
        check_options("lookahead", {"harvest": "nope"})


# ---- end to end on a fake target ----------------------------------------------------------------------

def repetitive_corpus(seed: int = 0, vocab: int = 40, length: int = 500) -> list[int]:
    rng = np.random.default_rng(seed)
    motifs = [rng.integers(0, vocab, int(rng.integers(4, 9))).tolist() for _ in range(5)]
    out: list[int] = []
    while len(out) < length:
        out += motifs[int(rng.integers(len(motifs)))]
    return out


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("kw", [{}, {"window": 5, "ngram": 4, "guess": 3},
                                {"harvest": "predicted-tail"}, {"harvest": "agreeing-runs", "ngram": 4},
                                {"window": 1, "guess": 1}])
def test_greedy_equality_on_a_fake_target(seed: int, kw: dict) -> None:
    corpus = repetitive_corpus(seed)
    target = FakeTarget(corpus, 40)
    prompt = corpus[:40]
    out, st = simulate(LookaheadProposer(**kw), target, prompt, 80)
    assert out == target.greedy(prompt, 80)
    assert st.accepted > 0


@pytest.mark.parametrize("seed", range(3))
def test_the_window_alone_finds_accepted_ngrams(seed: int) -> None:
    # No pool from the prompt: every accepted token comes from n-grams the Jacobi window produced.
    corpus = repetitive_corpus(seed)
    target = FakeTarget(corpus, 40)
    prompt = corpus[:40]
    prop = LookaheadProposer(window=4, ngram=3, guess=4, pool_from_prompt=False)
    out, st = simulate(prop, target, prompt, 120)
    assert out == target.greedy(prompt, 120)
    assert st.accepted > 10
    stats = prop.stats()
    assert stats["la_window_phrases"] > 0 and stats["la_branch_accepted"] == st.accepted


def test_sampling_setup_and_tight_limits_stay_lossless() -> None:
    corpus = repetitive_corpus(9)
    target = FakeTarget(corpus, 40)
    prompt = corpus[:30]
    assert_greedy_under_budgets(LookaheadProposer, target, prompt, 50, ((7, 5), (10, 6), (63, 16)))


# ---- end to end through the engine on a tiny generated GGUF (llama.cpp) ---------------------------------



@pytest.fixture(scope="module")
def engine(tiny_target):
    pytest.importorskip("llama_cpp")
    from ouroboros_local.engine import Engine, EngineConfig
    from ouroboros_local.llama import Model

    eng = Engine(Model(tiny_target), None, EngineConfig(n_ctx=512, n_batch=64, n_seq_max=8))
    eng.check_kv = True   # the window's cells must be gone from every sequence after each round
    yield eng
    eng.close()


@pytest.mark.parametrize("options", [
    {"warm_start": False},
    {"warm_start": False, "pool_from_prompt": False},
    {"warm_start": False, "window": 3, "ngram": 4, "guess": 2, "harvest": "agreeing-runs"},
    {"warm_start": False, "window": 2, "ngram": 5, "guess": 3, "harvest": "predicted-tail"},
])
def test_engine_greedy_equality(engine, options: dict) -> None:
    for prompt in E2E_PROMPTS:
        base = engine.generate(prompt, max_tokens=40)
        res = engine.generate(prompt, max_tokens=40, method="lookahead", options=dict(options))
        assert res.tokens == base.tokens
        assert res.stats.extra["la_window_rounds"] > 0
        assert res.stats.target_passes + res.stats.accepted == base.stats.target_passes


def test_engine_warm_start_reuses_the_pool(engine) -> None:
    prompt = E2E_PROMPTS[0]
    engine.history.clear()
    first = engine.generate(prompt, max_tokens=40, method="lookahead")
    second = engine.generate(prompt, max_tokens=40, method="lookahead")
    assert first.tokens == second.tokens
    assert second.stats.accepted > first.stats.accepted   # the first run's n-grams are in the pool
