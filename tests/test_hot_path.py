"""The per-round hot path: each fast formula equals the formula it replaced, on random logits.

The reference functions below are the formulas the runtime used before (dense float64 distribution,
argmax over every tree row, a full-vocabulary softmax for the draft's confidence, a Python walk for
the common prefix), kept here as the definition the fast paths must reproduce.
"""

from __future__ import annotations

import numpy as np
import pytest

from ouroboros_local.kv import common_prefix
from ouroboros_local.proposers.draft_model import top_probability
from ouroboros_local.sampling import SamplingParams, Sparse, residual, support, top_k_ids
from ouroboros_local.testing.lossless import assert_follows
from ouroboros_local.tree import TokenTree
from ouroboros_local.llama import Batch, TextStream
from ouroboros_local.verify import (Predictions, is_plain_step, verify_greedy, verify_round, verify_sampling,
                                     verify_step)


# ---- reference formulas (the code before the hot-path rewrite) ---------------------------------
def reference_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    n = logits.shape[-1]
    row = np.asarray(logits, dtype=np.float64)
    if params.top_k and params.top_k < n:
        keep = np.argpartition(row, n - params.top_k)[n - params.top_k:]
    else:
        keep = np.arange(n)
    kept = row[keep]
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        mask = np.ones(len(keep), dtype=bool)
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            n_keep = int(np.searchsorted(cum, params.top_p)) + 1
            top = np.zeros(len(keep), dtype=bool)
            top[order[:n_keep]] = True
            mask &= top
        if params.min_p > 0.0:
            mask &= probs >= params.min_p * probs.max()
        keep, kept = keep[mask], kept[mask]
    temp = params.temperature if params.temperature > 0 else 1.0
    weights = np.exp((kept - kept.max()) / temp)
    out = np.zeros(n, dtype=np.float64)
    out[keep] = weights / weights.sum()
    return out


def reference_sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    cum = np.cumsum(probs)
    return min(int(np.searchsorted(cum, rng.random() * cum[-1], side="right")), len(probs) - 1)


def reference_top_probability(logits: np.ndarray) -> float:
    x = np.asarray(logits, dtype=np.float32)
    return 1.0 / float(np.sum(np.exp(np.maximum(x - x.max(), -80.0))))


def reference_common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def llm_like_logits(rng: np.random.Generator, vocab: int, rows: int = 1, spread: float = 3.0) -> np.ndarray:
    """float32 rows with a heavy head: a few dozen tokens well above a broad background."""
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * np.float32(spread)
    for r in range(rows):
        hot = rng.choice(vocab, size=30, replace=False)
        x[r, hot] += rng.uniform(4, 14, size=30).astype(np.float32)
    return x


def realistic_logits(rng: np.random.Generator, vocab: int, rows: int = 1) -> np.ndarray:
    """Shaped like a real model's rows (Qwen2.5 at vocabulary 151936: a bulk around -5 with spread
    2.7, the top token near 20 and a few dozen within 10 of it)."""
    x = (rng.standard_normal((rows, vocab)) * 2.7 - 5.0).astype(np.float32)
    for r in range(rows):
        hot = rng.choice(vocab, size=40, replace=False)
        x[r, hot] = rng.uniform(5, 20, size=40).astype(np.float32)
        x[r, hot[0]] = np.float32(20.0 + rng.uniform(0, 3))
    return x


PARAMS = [SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
          SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0),
          SamplingParams(temperature=1.3, top_k=5, top_p=0.5, min_p=0.0),
          SamplingParams(temperature=0.5, top_k=100, top_p=1.0, min_p=0.2),
          SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
          SamplingParams(temperature=0.7, top_k=0, top_p=1.0, min_p=0.1),
          SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
          SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.05)]


# ---- sampling ---------------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [50, 5000, 151936])
@pytest.mark.parametrize("k", [1, 7, 40, 300])
def test_top_k_ids_are_the_k_largest(vocab: int, k: int) -> None:
    rng = np.random.default_rng(vocab + k)
    x = llm_like_logits(rng, vocab)[0]
    got = top_k_ids(x, k)
    assert np.all(np.diff(got) > 0)
    want = np.sort(np.argsort(-x, kind="stable")[:k])
    assert np.array_equal(got, want)


def test_top_k_ids_break_ties_by_lowest_id() -> None:
    x = np.zeros(10000, dtype=np.float32)
    x[[9000, 17, 4000]] = 5.0            # three-way tie for 2 places, then a flat background
    assert top_k_ids(x, 2).tolist() == [17, 4000]
    assert top_k_ids(x, 5).tolist() == [0, 1, 17, 4000, 9000]


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_top_k_ids_of_rows_with_many_ties(levels: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # a flat row (a stub's, or a model's tied logits): every id at the threshold is a candidate, and
    # only the lowest of them can be among the k; taking them all sorted the whole vocabulary
    rng = np.random.default_rng(levels)
    x = rng.integers(0, levels, 151936).astype(np.float32)
    x[[70000, 12, 151935]] = 30.0
    sorted_sizes = []
    lexsort = np.lexsort
    monkeypatch.setattr(np, "lexsort", lambda keys: sorted_sizes.append(len(keys[0])) or lexsort(keys))
    for k in (1, 3, 40, 300):
        want = np.sort(np.argsort(-x, kind="stable")[:k])
        assert np.array_equal(top_k_ids(x, k), want), k
        assert sorted_sizes[-1] <= k + 64, k          # not the ~150k ids at the threshold


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("vocab", [64, 6000, 151936])
def test_support_equals_the_dense_reference(params: SamplingParams, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    for row in np.concatenate([llm_like_logits(rng, vocab, rows=3), realistic_logits(rng, vocab, rows=3)]):
        want = reference_distribution(row, params)
        got = support(row, params)
        assert np.all(np.diff(got.ids) > 0)
        assert np.array_equal(got.ids, np.flatnonzero(want))      # the same support, exactly
        np.testing.assert_allclose(got.probs, want[got.ids], rtol=1e-12, atol=0)
        np.testing.assert_allclose(got.dense(vocab), want, rtol=1e-12, atol=1e-300)


def test_sparse_sample_draws_the_dense_token_for_the_same_uniform() -> None:
    rng = np.random.default_rng(3)
    params = PARAMS[0]
    for row in llm_like_logits(rng, 151936, rows=5):
        dense = reference_distribution(row, params)
        sparse = support(row, params)
        for seed in range(200):
            assert sparse.sample(np.random.default_rng(seed)) == reference_sample(dense, np.random.default_rng(seed))


def test_sparse_residual_equals_the_dense_residual() -> None:
    rng = np.random.default_rng(5)
    vocab = 6000
    target, draft = llm_like_logits(rng, vocab, rows=2)
    draft = (target + rng.standard_normal(vocab).astype(np.float32)).astype(np.float32)
    params = PARAMS[0]
    p_dense, q_dense = reference_distribution(target, params), reference_distribution(draft, params)
    want = np.maximum(p_dense - q_dense, 0.0)
    want /= want.sum()
    for q in (support(draft, params), q_dense):           # a sparse or a dense draft distribution
        got = residual(support(target, params), q)
        assert isinstance(got, Sparse)
        np.testing.assert_allclose(got.dense(vocab), want, rtol=1e-12, atol=1e-15)
    p = support(target, params)
    assert residual(p, p) is None


def test_rejection_sampling_with_sparse_drafts_keeps_the_target_distribution() -> None:
    """One stochastic child: the emitted first token follows p exactly (chi-square), and every draw
    uses sparse p, sparse q and a sparse residual."""
    rng = np.random.default_rng(11)
    vocab = 5000
    params = SamplingParams(temperature=1.0, top_k=12, top_p=0.97, min_p=0.0)
    target = llm_like_logits(rng, vocab, spread=1.0)[0]
    draft = (target + rng.standard_normal(vocab).astype(np.float32) * 1.5).astype(np.float32)
    p = reference_distribution(target, params)
    q = support(draft, params)
    rows = np.stack([target, target])
    counts = np.zeros(vocab)
    for _ in range(6000):
        tree = TokenTree.rooted_at(0)
        tree.add(0, q.sample(rng), draft_probs=q)
        path, bonus, _ = verify_sampling(tree, rows, params, rng)
        counts[tree.tokens[path[1]] if len(path) > 1 else bonus] += 1
    assert_follows(counts, p)


# ---- greedy verification -----------------------------------------------------------------------
def test_lazy_predictions_match_the_full_argmax_and_skip_rows_off_the_path() -> None:
    rng = np.random.default_rng(2)
    rows = llm_like_logits(rng, 151936, rows=8)
    argmax = rows.argmax(axis=1)
    tree = TokenTree.rooted_at(1)
    node = tree.add(0, int(argmax[0]))            # accepted
    tree.add(node, int(argmax[1]) + 1)            # rejected: the bonus is argmax[1]
    for other in range(5):
        tree.add(0, int(argmax[0]) + 1 + other)   # siblings the walk never enters
    path, bonus, predictions = verify_greedy(tree, rows[:len(tree)])
    assert path == [0, 1] and bonus == int(argmax[1])
    assert isinstance(predictions, Predictions)
    assert predictions.computed_rows() == 2       # only the rows along the path (+ the bonus row)
    assert list(predictions) == argmax[:len(tree)].tolist()
    assert predictions[5] == argmax[5] and len(predictions) == len(tree)


def test_released_predictions_refuse_rows_they_never_read() -> None:
    rows = np.eye(4, dtype=np.float32)
    predictions = Predictions(rows)
    assert predictions[1] == 1
    predictions.release()
    assert predictions[1] == 1                    # already known
    with pytest.raises(RuntimeError):
        predictions[2]


# ---- draft confidence ---------------------------------------------------------------------------
@pytest.mark.parametrize("vocab", [100, 49152, 151936])
def test_top_probability_equals_the_full_softmax(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    for spread in (0.5, 3.0, 8.0):
        for row in llm_like_logits(rng, vocab, rows=3, spread=spread):
            want = reference_top_probability(row)
            assert top_probability(row) == pytest.approx(want, rel=2e-6)
            token = int(row.argmax())
            assert top_probability(row, token) == pytest.approx(want, rel=2e-6)
    padded = np.full(vocab, -np.inf, dtype=np.float32)
    padded[:vocab // 2] = llm_like_logits(rng, vocab // 2)[0]
    assert top_probability(padded) == pytest.approx(reference_top_probability(padded), rel=2e-6)


# ---- KV common prefix -------------------------------------------------------------------------
def test_common_prefix_from_a_watermark_equals_the_full_walk() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = rng.integers(0, 5, size=int(rng.integers(0, 30))).tolist()
        b = a[:int(rng.integers(0, len(a) + 1))] + rng.integers(0, 5, size=int(rng.integers(0, 5))).tolist()
        want = reference_common_prefix(a, b)
        assert common_prefix(a, b) == want
        for start in range(0, want + 1):           # any watermark at or below the true prefix
            assert common_prefix(a, b, start) == want


# ---- measuring the round's Python time -----------------------------------------------------------
def test_generation_stats_split_llama_decode_from_python_time(tiny_target, tiny_draft) -> None:
    from test_engine import make_engine

    with make_engine(tiny_target, tiny_draft) as engine:
        for method in ("vanilla", "speculative"):
            stats = engine.generate([1, 5, 9, 13], max_tokens=12, method=method).stats
            extra = stats.extra
            assert 0 < extra["llama_decode_seconds"] <= stats.decode_seconds
            assert extra["python_seconds"] == pytest.approx(stats.decode_seconds - extra["llama_decode_seconds"],
                                                            abs=2e-6)
            # both figures are rounded (seconds to 1 µs, ms per round to 0.1 µs): over 3 rounds the
            # first rounding alone moves the quotient by up to 0.17 µs
            rounding = 1e3 * 0.5e-6 / stats.target_passes + 0.5e-4
            assert extra["python_ms_per_round"] == pytest.approx(
                1e3 * extra["python_seconds"] / stats.target_passes, abs=rounding + 1e-9)


def test_bench_summary_reports_python_ms_per_round() -> None:
    from ouroboros_local.bench.report import python_ms_per_round

    ours = [{"target_passes": 10, "extra": {"python_seconds": 0.002}},
            {"target_passes": 30, "extra": {"python_seconds": 0.006}}]
    assert python_ms_per_round(ours) == pytest.approx(0.2)
    assert python_ms_per_round([{"target_passes": 5, "extra": {}}]) is None     # a peer: not measured


# ---- the plain-step and chain fast paths ---------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_plain_step_gives_what_verify_round_gives(temperature: float) -> None:
    """``verify_step`` (the engine's path for a root-only tree) draws the same token with the same
    random numbers as the general round."""
    params = SamplingParams(temperature=temperature)
    rng = np.random.default_rng(11)
    for row in llm_like_logits(rng, 6000, rows=20):
        rows = row[None].astype(np.float32)
        tree = TokenTree.rooted_at(5)
        general, _ = verify_round(tree, lambda lay: rows, params, np.random.default_rng(3))
        fast = verify_step(tree, rows, params, np.random.default_rng(3))
        assert is_plain_step(tree)
        assert (fast.path, fast.accepted, fast.bonus) == (general.path, general.accepted, general.bonus)


def test_chain_walk_equals_the_indexed_walk() -> None:
    rng = np.random.default_rng(12)
    for _ in range(50):
        rows = rng.standard_normal((6, 50)).astype(np.float32)
        best = rows.argmax(axis=1)
        hits = int(rng.integers(0, 6))
        tree = TokenTree.rooted_at(1)
        tree.add_path(0, [int(best[i]) if i < hits else int(best[i] + 1) % 50 for i in range(5)])
        assert verify_greedy(tree, rows, chain=True)[:2] == verify_greedy(tree, rows)[:2]


def test_add_path_equals_adding_node_by_node() -> None:
    """The bulk append of a new phrase's tail equals adding its tokens one at a time."""
    phrases = [[4, 5, 6, 7], [4, 5, 9], [4, 8, 8, 8, 8], [3]]
    for max_nodes in (None, 2, 5, 9):
        bulk, single = TokenTree.rooted_at(1), TokenTree.rooted_at(1)
        for phrase in phrases:
            bulk.add_path(0, phrase, source="pool", max_nodes=max_nodes)
            node = 0
            for tok in phrase:
                existing = single.child_with_token(node, tok)
                if existing is None:
                    if max_nodes is not None and single.n_candidates >= max_nodes:
                        break
                    existing = single.add(node, tok, source="pool")
                node = existing
        assert (bulk.tokens, bulk.parents, bulk.depths, bulk.sources) == \
               (single.tokens, single.parents, single.depths, single.sources)
        for node in range(len(bulk)):   # the lazy child index sees the bulk-added nodes
            for child in bulk.children(node):
                assert bulk.child_with_token(node, bulk.tokens[child]) == child


def test_plain_batch_metadata_is_rewritten_after_a_general_fill() -> None:
    batch = Batch(8, 2)
    try:
        batch.set_chain([1, 2, 3], 10)
        batch.clear()
        batch.add_tokens([4, 5, 6], [0, 1, 1], [(0, 1), (1,), (0,)], [False, True, False])
        batch.set_chain([7, 8, 9], 20)
        assert batch._n_seq[:3].tolist() == [1, 1, 1] and batch._seq[:3, 0].tolist() == [0, 0, 0]
        assert batch._logits[:3].tolist() == [1, 1, 1] and batch._pos[:3].tolist() == [20, 21, 22]
        batch.clear()
        batch.add_tokens([4], [0], [(1,)], [False])
        batch.set_chain([5], 30)
        assert (batch._n_seq[0], batch._seq[0, 0], batch._logits[0], batch.n_tokens) == (1, 0, 1, 1)
    finally:
        batch.free()


# ---- where the decode time goes --------------------------------------------------------------------
def test_time_split_names_each_kind_of_round() -> None:
    from ouroboros_local.calibration import SWITCH_STEPS
    from ouroboros_local.time_split import TimeSplit

    split = TimeSplit()
    split.add_round(1, drafted=False, ahead=False, carried=False, seconds=1.0, propose_seconds=0.1)
    split.add_round(4, drafted=True, ahead=False, carried=False, seconds=3.0, propose_seconds=0.2)
    for _ in range(SWITCH_STEPS):   # a drafted round's wake, whether its steps draft or not
        split.add_round(1, drafted=False, ahead=True, carried=False, seconds=2.0, propose_seconds=0.0)
    split.add_round(1, drafted=False, ahead=True, carried=False, seconds=1.5, propose_seconds=0.0)
    split.add_round(3, drafted=False, ahead=False, carried=True, seconds=4.0, propose_seconds=0.0)
    # rounds of one size (--round-size): a round filled with guesses but no draft is plain, and no
    # round is in a wake, the shape never changing back to one token
    split.add_round(4, drafted=False, ahead=False, carried=False, seconds=0.5, propose_seconds=0.0)
    split.add_round(4, drafted=False, ahead=False, carried=False, seconds=0.5, propose_seconds=0.0)
    split.add_observe(0.05)
    out = split.to_dict(decode_seconds=20.0)
    assert out["plain"] == [3, 2.0] and out["drafted"] == [1, 3.0] and out["carried"] == [1, 4.0]
    assert out["after_draft"] == [SWITCH_STEPS, 2.0 * SWITCH_STEPS] and out["ahead"] == [1, 1.5]
    assert out["propose"][1] == pytest.approx(0.3) and out["observe"][1] == pytest.approx(0.05)
    assert sum(s for _, s in out.values()) == pytest.approx(20.0)   # ``other`` is the rest


def test_time_split_accounts_for_every_round_and_the_decode_time(tiny_target, tiny_draft) -> None:
    from test_engine import make_engine

    with make_engine(tiny_target, tiny_draft) as engine:
        for method in ("vanilla", "speculative"):
            stats = engine.generate([1, 5, 9, 13], max_tokens=24, method=method).stats
            split = stats.extra["time_split"]
            assert sum(n for n, _ in split.values()) == stats.target_passes
            assert sum(s for _, s in split.values()) == pytest.approx(stats.decode_seconds, abs=1e-5)
            drafted = split["drafted"][0] + split["carried"][0]
            if method == "vanilla":
                assert drafted == 0 and split["after_draft"][0] == 0
            else:
                assert drafted > 0 and split["propose"][1] > 0


def test_bench_pools_the_time_split_per_100_tokens() -> None:
    from ouroboros_local.bench.report import _time_split_lines, time_split_per_100_tokens

    def rec(tokens: int, plain: float, drafted: float) -> dict:
        return {"timed_tokens": tokens, "extra": {"time_split": {"plain": [tokens, plain], "drafted": [1, drafted],
                                                                 "other": [0, 0.001]}}}
    pooled = time_split_per_100_tokens([rec(100, 0.5, 0.02), rec(300, 1.5, 0.06)])
    assert pooled["plain"] == {"ms": pytest.approx(500.0), "rounds": pytest.approx(100.0)}
    assert pooled["drafted"]["ms"] == pytest.approx(20.0) and pooled["drafted"]["rounds"] == pytest.approx(0.5)
    assert pooled["carried"]["ms"] == 0.0 and pooled["other"]["ms"] == pytest.approx(0.5)
    assert time_split_per_100_tokens([{"timed_tokens": 10, "extra": {}}]) is None   # a peer: not measured
    md = "\n".join(_time_split_lines({"s": {"auto": {"label": "auto", "time_split": pooled},
                                            "peer": {"label": "peer", "time_split": None}}}))
    row = next(line for line in md.splitlines() if line.startswith("| s | auto |"))
    assert "500.0 (100.0)" in row and row.endswith("| 520.5 |")
    assert "| s | peer |" not in md


class _Pieces:
    """A model's ``piece`` and its text cache, from a table (counts the lookups that missed the cache)."""

    def __init__(self, table: dict[int, bytes]):
        self.table = table
        self._piece_texts: tuple[dict[int, str], dict[int, str]] = ({}, {})
        self.asked = 0

    def piece(self, token: int, special: bool = False) -> bytes:
        self.asked += 1
        return self.table[token]


def test_text_stream_equals_decoding_the_whole_answer_at_once() -> None:
    """Whole pieces come from the cache; a character split over tokens, stray bytes and a cut-off end
    come out as the one-shot decode of all the bytes, never as a half character."""
    euro = "€".encode()
    table = {0: b"a", 1: b" b\xc3\xa9", 2: euro[:1], 3: euro[1:2], 4: euro[2:], 5: b"\xff", 6: b"", 7: "😀".encode(),
             8: euro[:2], 9: b"x" + euro[:1]}
    rng = np.random.default_rng(0)
    model = _Pieces(table)
    for _ in range(300):
        tokens = [int(t) for t in rng.integers(0, len(table), int(rng.integers(1, 12)))]
        stream = TextStream(model)   # type: ignore[arg-type]
        pieces = [stream.push(t) for t in tokens]
        text = "".join(pieces) + stream.flush()
        assert text == b"".join(table[t] for t in tokens).decode("utf-8", "replace"), tokens
    asked = model.asked
    stream = TextStream(model)   # type: ignore[arg-type]
    assert [stream.push(t) for t in (0, 1, 7, 6)] == ["a", " bé", "😀", ""] and model.asked == asked
