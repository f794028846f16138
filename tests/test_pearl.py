"""PEARL (method "pearl"): parallel draft/target on the tiny generated models.

Greedy output equals plain decoding, sampling keeps the target distribution (and, because PEARL's
drafts are greedy and checked by sample-and-match, a seeded run equals plain seeded decoding), the
draft's background thread never outlives a generation, thread settings are restored, and the
automatic fallback picks sequential speculative decoding when PEARL measures slower.
"""

from __future__ import annotations

import threading
import time

import pytest
from llama_cpp import llama_cpp as lc

from ouroboros_local.errors import ParameterError
from ouroboros_local.llama.binding import usable_cores
from ouroboros_local.proposers import _METHODS
from ouroboros_local.proposers import pearl as pearl_mod
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.lossless import assert_first_pairs_follow_the_target

from test_engine import PROMPTS, make_engine

# Until the lead registers the method in proposers/__init__.py (no-op once it is there).
_METHODS.setdefault("pearl", "ouroboros_local.proposers.pearl:create")

TWO_CORES = usable_cores() >= 2
needs_two_cores = pytest.mark.skipif(not TWO_CORES, reason="PEARL's parallel mode needs 2 cores")
# the engines in these tests use 1 thread per context; PEARL runs them 1 + 1 at once
PAR = {"mode": "parallel", "threads_target": 1, "threads_draft": 1}


@pytest.fixture(scope="module")
def engine(tiny_target, tiny_draft):
    eng = make_engine(tiny_target, tiny_draft)
    yield eng
    eng.close()


def check_draft_kv(engine) -> None:
    kv = engine.draft_kv()
    assert kv.ctx.pos_max(0) == len(kv.cached) - 1


def ctx_threads(ctx) -> tuple[int, int]:
    return int(lc.llama_n_threads(ctx.ptr)), int(lc.llama_n_threads_batch(ctx.ptr))


# ---- greedy losslessness ------------------------------------------------------------------------

@needs_two_cores
@pytest.mark.parametrize("prompt", PROMPTS)
def test_parallel_greedy_equals_vanilla(engine, prompt) -> None:
    base = engine.generate(prompt, max_tokens=48, method="vanilla")
    for gamma in (2, 3, 5, 8, "auto"):
        res = engine.generate(prompt, max_tokens=48, method="pearl", options={**PAR, "gamma": gamma})
        assert res.tokens == base.tokens, gamma
        assert res.text == base.text
        extra = res.stats.extra
        assert extra["pearl_mode"] == "parallel" and extra["pearl_rounds_parallel"] > 0
        assert extra["pearl_threads"] == "1+1"
        assert res.stats.target_passes <= base.stats.target_passes
        check_draft_kv(engine)


@pytest.mark.parametrize("mode", ["sequential", "auto"])
def test_other_modes_greedy_equal_vanilla(engine, mode) -> None:
    opts = {"mode": mode, "probe_rounds": 2}
    if TWO_CORES:
        opts.update(threads_target=1, threads_draft=1)
    for prompt in PROMPTS:
        base = engine.generate(prompt, max_tokens=40, method="vanilla")
        res = engine.generate(prompt, max_tokens=40, method="pearl", options=opts)
        assert res.tokens == base.tokens, (mode, prompt)
        check_draft_kv(engine)


@needs_two_cores
def test_post_verify_chains_with_a_perfect_draft(tiny_target, tiny_self_draft) -> None:
    with make_engine(tiny_target, tiny_self_draft) as eng:
        base = eng.generate(PROMPTS[1], max_tokens=60)
        res = eng.generate(PROMPTS[1], max_tokens=60, method="pearl", options={**PAR, "gamma": 4})
        assert res.tokens == base.tokens
        extra = res.stats.extra
        # one pre-verify round, then every continuation is kept: post-verify never stops
        assert extra["pearl_pre_rounds"] == 1
        assert extra["pearl_continuations_dropped"] == 0
        assert extra["pearl_continuations_kept"] >= extra["pearl_post_rounds"]
        assert res.stats.tokens_per_pass > 3   # gamma-1 draft tokens + the matched continuation token


@needs_two_cores
def test_a_perfect_drafts_continuation_survives_rounds_of_one_size(tiny_target, tiny_self_draft) -> None:
    """In rounds of one size (a CUDA GPU's default) the engine fills a short chain with guesses; when
    some were accepted, the continuation was once placed after them, its tokens off by those, and the
    target rejected a perfect draft's tokens."""
    with make_engine(tiny_target, tiny_self_draft, round_size=8) as eng:
        for prompt in PROMPTS:
            base = eng.generate(prompt, max_tokens=60)
            res = eng.generate(prompt, max_tokens=60, method="pearl", options={**PAR, "gamma": 3})
            assert res.tokens == base.tokens
            assert res.stats.extra["pearl_continuations_dropped"] == 0, prompt


@needs_two_cores
@pytest.mark.parametrize("round_size, overlap", [(4, True), (4, False)])
def test_a_perfect_draft_fills_every_round_of_four(tiny_target, tiny_self_draft, round_size, overlap) -> None:
    """A chain that filled a round of one size left its background job nothing to draft for the next
    round, a plain one: 2.00 tokens a pass where 3.75 are possible (CUDA's defaults)."""
    with make_engine(tiny_target, tiny_self_draft, round_size=round_size, overlap=overlap) as eng:
        base = eng.generate(PROMPTS[1], max_tokens=60)
        res = eng.generate(PROMPTS[1], max_tokens=60, method="pearl", options={**PAR, "gamma": 4})
        assert res.tokens == base.tokens
        assert res.stats.tokens_per_pass > 3.5 and res.stats.extra["pearl_pre_rounds"] == 1


def test_the_drafts_prompt_read_stops_with_the_answer(tiny_target, tiny_draft, monkeypatch) -> None:
    """The draft read a long prompt in the background to its end: closing a stream after its first token
    waited for it (12.9 s with the 0.5B pair and a 613-token prompt)."""
    from ouroboros_local.kv import KVCache

    calls: list[tuple[object, object]] = []
    real = KVCache.sync_to

    def sync_to(self, tokens, *args, **kwargs):
        calls.append((self, kwargs.get("stop")))
        return real(self, tokens, *args, **kwargs)

    monkeypatch.setattr(KVCache, "sync_to", sync_to)
    monkeypatch.setattr(pearl_mod, "usable_cores", lambda: 2)
    with make_engine(tiny_target, tiny_draft) as eng:
        stream = eng.stream(PROMPTS[0] * 8, max_tokens=8, method="pearl", options=PAR)
        next(stream)
        stream.close()
        draft_reads = [stop for kv, stop in calls if kv is eng.draft_kv()]
    assert draft_reads and callable(draft_reads[0])   # the draft's read of the prompt hears the stop


def test_parallel_mode_on_one_core_is_refused_before_the_models_load(tiny_target, tiny_draft, capsys) -> None:
    """It ran sequentially, said only in --json's stats, with advice naming options no flag sets."""
    from ouroboros_local.cli import main

    assert main(["generate", "-m", str(tiny_target), "-d", str(tiny_draft), "--method", "pearl",
                 "--pearl-mode", "parallel", "-t", "1", "-p", "x", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert "needs 2 cores or more" in err and "-t/--threads 2 or more" in err and "loading" not in err


@needs_two_cores
def test_limits_stop_strings_and_small_budgets(engine) -> None:
    for n in (1, 2, 3, 5):
        base = engine.generate(PROMPTS[0], max_tokens=n)
        res = engine.generate(PROMPTS[0], max_tokens=n, method="pearl", options={**PAR, "gamma": 4})
        assert res.tokens == base.tokens and len(res.tokens) == n
    full = engine.generate(PROMPTS[1], max_tokens=30)
    if len(full.text) > 6:
        stop = full.text[3:6]
        res = engine.generate(PROMPTS[1], max_tokens=30, stop=[stop], method="pearl", options=PAR)
        assert res.text == full.text[:full.text.find(stop)] and res.finish_reason == "stop"
    assert engine.generate(PROMPTS[1], max_tokens=0, method="pearl", options=PAR).tokens == []


@needs_two_cores
def test_context_full_ends_cleanly(tiny_target, tiny_draft) -> None:
    with make_engine(tiny_target, tiny_draft, n_ctx=64) as eng:
        prompt = "a b c d e f g h"
        base = eng.generate(prompt, max_tokens=500)
        res = eng.generate(prompt, max_tokens=500, method="pearl", options={**PAR, "gamma": 6})
        assert res.tokens == base.tokens
        assert len(eng.prompt_tokens(prompt)) + len(res.tokens) <= 64


# ---- sampling -----------------------------------------------------------------------------------

@needs_two_cores
def test_sampling_is_lossless(engine, tiny_target) -> None:
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    assert_first_pairs_follow_the_target(engine, tiny_target, PROMPTS[1], params, 1200, method="pearl",
                                         options=PAR)


@needs_two_cores
def test_seeded_sampling_equals_plain_seeded_decoding(engine) -> None:
    # greedy drafts + sample-and-match: each emitted token uses one uniform, as in plain decoding
    for seed in range(6):
        for temperature in (0.5, 1.2):
            sp = SamplingParams(temperature=temperature, seed=seed)
            base = engine.generate(PROMPTS[seed % 3], max_tokens=30, sampling=sp)
            for opts in (PAR, {**PAR, "gamma": 6}, {"mode": "sequential"}):
                res = engine.generate(PROMPTS[seed % 3], max_tokens=30, sampling=sp, method="pearl",
                                      options=opts)
                assert res.tokens == base.tokens, (seed, temperature, opts)


# ---- threads ------------------------------------------------------------------------------------

@needs_two_cores
def test_no_thread_leaks_and_threads_restored(tiny_target, tiny_draft) -> None:
    baseline = threading.active_count()
    eng = make_engine(tiny_target, tiny_draft)
    target_threads = ctx_threads(eng.target_ctx)
    draft_threads = ctx_threads(eng.draft_kv().ctx)
    for gamma in (2, 5):
        eng.generate(PROMPTS[0], max_tokens=40, method="pearl", options={**PAR, "gamma": gamma})
        assert threading.active_count() == baseline
        assert ctx_threads(eng.target_ctx) == target_threads
        assert ctx_threads(eng.draft_kv().ctx) == draft_threads
    # a stream abandoned half-way (the background job may be running) cleans up when closed
    stream = eng.stream(PROMPTS[1], max_tokens=40, method="pearl", options=PAR)
    next(stream)
    stream.close()
    assert threading.active_count() == baseline
    assert ctx_threads(eng.target_ctx) == target_threads
    eng.close()
    assert threading.active_count() == baseline


@needs_two_cores
def test_threads_are_split_while_running(engine, monkeypatch) -> None:
    seen = []
    original = pearl_mod.PearlProposer._draft

    def spy(self, seq, n):
        seen.append((ctx_threads(self.target_ctx), ctx_threads(self.kv.ctx)))
        return original(self, seq, n)

    monkeypatch.setattr(pearl_mod.PearlProposer, "_draft", spy)
    engine.generate(PROMPTS[0], max_tokens=20, method="pearl", options=PAR)
    assert seen and all(t == ((1, 1), (1, 1)) for t in seen)


def test_thread_split_never_oversubscribes() -> None:
    assert pearl_mod.thread_split(1, False, False) is None
    for cores in range(2, 65):
        for tg in (False, True):
            for dg in (False, True):
                nt, nd = pearl_mod.thread_split(cores, tg, dg)
                assert nt >= 1 and nd >= 1 and nt + nd <= cores, (cores, tg, dg)
    assert pearl_mod.thread_split(2, False, False) == (1, 1)
    assert pearl_mod.thread_split(16, True, False) == (2, 14)   # GPU target: the CPU goes to the draft


def test_one_core_runs_sequentially(tiny_target, tiny_draft) -> None:
    # the tests' engines use 1 thread per context: the automatic split refuses to double it
    with make_engine(tiny_target, tiny_draft) as eng:
        base = eng.generate(PROMPTS[2], max_tokens=20)
        res = eng.generate(PROMPTS[2], max_tokens=20, method="pearl")
        assert res.tokens == base.tokens
        assert res.stats.extra["pearl_decision"] == "sequential"
        assert res.stats.extra["pearl_rounds_parallel"] == 0
        assert "oversubscribe" in res.stats.extra["pearl_reason"]


# ---- cancellation, errors -----------------------------------------------------------------------

@needs_two_cores
def test_cancellation_leaves_the_engine_usable(engine) -> None:
    baseline = threading.active_count()
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return calls["n"] > 3

    res = engine.generate(PROMPTS[0], max_tokens=60, method="pearl", options=PAR, cancel=cancel)
    assert res.finish_reason == "cancelled" and 0 < len(res.tokens) < 60
    assert threading.active_count() == baseline
    check_draft_kv(engine)
    # cancelled from another thread mid-generation
    event = threading.Event()
    timer = threading.Timer(0.005, event.set)
    timer.start()
    engine.generate(PROMPTS[1], max_tokens=400, method="pearl", options=PAR, cancel=event)
    timer.join()
    assert threading.active_count() == baseline
    base = engine.generate(PROMPTS[0], max_tokens=30)
    assert engine.generate(PROMPTS[0], max_tokens=30, method="pearl", options=PAR).tokens == base.tokens


@needs_two_cores
def test_background_error_surfaces_and_engine_recovers(engine, monkeypatch) -> None:
    original = pearl_mod.PearlProposer._draft
    state = {"n": 0}

    def flaky(self, seq, n):
        if threading.current_thread() is not threading.main_thread():
            state["n"] += 1
            if state["n"] == 3:
                raise RuntimeError("draft exploded")
        return original(self, seq, n)

    monkeypatch.setattr(pearl_mod.PearlProposer, "_draft", flaky)
    baseline = threading.active_count()
    with pytest.raises(RuntimeError, match="draft exploded"):
        engine.generate(PROMPTS[0], max_tokens=40, method="pearl", options=PAR)
    assert threading.active_count() == baseline
    monkeypatch.setattr(pearl_mod.PearlProposer, "_draft", original)
    base = engine.generate(PROMPTS[0], max_tokens=30)
    assert engine.generate(PROMPTS[0], max_tokens=30, method="pearl", options=PAR).tokens == base.tokens
    check_draft_kv(engine)


def test_bad_options_and_missing_draft(engine, tiny_target) -> None:
    for opts, match in (({"gamma": 1}, "gamma"), ({"mode": "fast"}, "mode"),
                        ({"seq_gamma": 0}, "seq_gamma"), ({"probe_rounds": 0}, "probe_rounds"),
                        ({"threads_target": usable_cores(), "threads_draft": 1}, "threads")):
        with pytest.raises(ParameterError, match=match):
            engine.generate("x", max_tokens=2, method="pearl", options=opts)
    with make_engine(tiny_target) as eng:
        with pytest.raises(ParameterError, match="draft"):
            eng.generate("x", method="pearl")


# ---- automatic fallback -------------------------------------------------------------------------

@needs_two_cores
def test_auto_falls_back_to_sequential_when_parallel_is_slower(tiny_target, tiny_draft, monkeypatch) -> None:
    original = pearl_mod.PearlProposer._draft

    def slow_in_background(self, seq, n):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.02)   # a draft that competes for the CPU: PEARL rounds get slow
        return original(self, seq, n)

    monkeypatch.setattr(pearl_mod.PearlProposer, "_draft", slow_in_background)
    with make_engine(tiny_target, tiny_draft) as eng:
        base = eng.generate(PROMPTS[1], max_tokens=80)
        opts = {"threads_target": 1, "threads_draft": 1, "probe_rounds": 3}
        res = eng.generate(PROMPTS[1], max_tokens=80, method="pearl", options=opts)
        assert res.tokens == base.tokens
        extra = res.stats.extra
        assert extra["pearl_rounds_parallel"] >= 6 and extra["pearl_rounds_sequential"] >= 6
        assert extra["pearl_decision"] == "sequential" and extra["pearl_reason"].startswith("measured")
        assert extra["pearl_tok_s_parallel"] < extra["pearl_tok_s_sequential"]
        # the decision is kept for the next generation on this engine: no more probing
        res2 = eng.generate(PROMPTS[0], max_tokens=30, method="pearl", options=opts)
        assert res2.stats.extra["pearl_rounds_parallel"] == 0
        assert res2.tokens == eng.generate(PROMPTS[0], max_tokens=30).tokens


@needs_two_cores
def test_auto_gamma_stays_in_range(engine) -> None:
    res = engine.generate(PROMPTS[0], max_tokens=60, method="pearl", options={**PAR, "gamma": "auto"})
    assert pearl_mod.GAMMA_MIN <= res.stats.extra["pearl_gamma"] <= pearl_mod.GAMMA_MAX


@needs_two_cores
def test_stress_many_rounds(tiny_target, tiny_draft) -> None:
    # many concurrent rounds on two contexts: a stress test of two threads in ctypes at once
    with make_engine(tiny_target, tiny_draft, n_ctx=1024) as eng:
        for prompt in PROMPTS:
            base = eng.generate(prompt, max_tokens=300)
            res = eng.generate(prompt, max_tokens=300, method="pearl", options={**PAR, "gamma": 3})
            assert res.tokens == base.tokens
            assert res.stats.extra["pearl_rounds_parallel"] > 50


@pytest.mark.parametrize("mode", ["parallel", "sequential"])
def test_a_prompt_longer_than_the_drafts_context_decodes_plainly(tiny_target, tiny_draft, mode: str) -> None:
    # parallel mode prefilled the draft in the background and raised ContextOverflowError at the first round
    from ouroboros_local.testing.engines import tiny_engine

    with tiny_engine(tiny_target, tiny_draft, n_ctx=512, draft_n_ctx=256, threads=2) as engine:
        prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 40)[:300]
        base = engine.generate(prompt, max_tokens=20, method="vanilla").tokens
        assert engine.generate(prompt, max_tokens=20, method="pearl", options={"mode": mode}).tokens == base


def test_the_chain_is_the_committed_list_plus_its_tail_without_a_copy() -> None:
    committed = [1, 2, 3]
    chain = pearl_mod._Extended(committed, 3, [4, 5, 6])
    assert list(chain) == [1, 2, 3, 4, 5, 6] and len(chain) == 6
    assert chain[2:5] == [3, 4, 5] and chain[::2] == [1, 3, 5] and chain[-1] == 6 and chain[4:] == [5, 6]
    with pytest.raises(IndexError):
        chain[6]
    committed += [4, 5]         # the engine accepted two of the chain's tokens: the view does not change
    assert list(chain) == [1, 2, 3, 4, 5, 6]
    assert chain.starts_with(committed)
    committed.append(9)         # and then a token of its own
    assert not chain.starts_with(committed)
    assert chain.starts_with([1, 2, 3, 4]) and not chain.starts_with([1, 2, 7])   # another list: in full
    assert not chain.starts_with([1, 2, 3, 4, 5, 6, 7])
    assert list(chain.extended([7])) == [1, 2, 3, 4, 5, 6, 7] and list(chain) == [1, 2, 3, 4, 5, 6]
