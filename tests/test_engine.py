"""The decoding loop on generated tiny models: losslessness, KV cleanup, stop conditions."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ouroboros_local.engine import Engine
from ouroboros_local.generation import StopMatcher
from ouroboros_local.errors import ContextOverflowError, OuroborosError, ParameterError
from ouroboros_local.proposers import method_names
from ouroboros_local.sampling import SamplingParams
from ouroboros_local.testing.engines import tiny_engine as make_engine
from ouroboros_local.testing.lossless import (assert_first_pairs_follow_the_target, assert_greedy_equals_vanilla,
                                              assert_seeded_equals_vanilla, copyable, target_pair_distribution)

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "héllo wörld ✓ 日本 <|im_start|>user\nhi<|im_end|>\n",
]

@pytest.fixture(scope="module")
def pair_engine(tiny_target, tiny_draft):
    engine = make_engine(tiny_target, tiny_draft)
    yield engine
    engine.close()


def draft_free_methods() -> list[str]:
    return [m for m in method_names() if m not in ("vanilla", "speculative")]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_speculative_greedy_equals_vanilla(pair_engine: Engine, prompt: str) -> None:
    base = pair_engine.generate(prompt, max_tokens=40, method="vanilla")
    for gamma in (1, 3, 6):
        spec = pair_engine.generate(prompt, max_tokens=40, method="speculative", options={"gamma": gamma})
        assert spec.tokens == base.tokens, f"gamma={gamma}"
        assert spec.text == base.text
        assert spec.stats.target_passes <= base.stats.target_passes
    assert base.stats.target_passes == base.stats.tokens or base.stats.finish_reason == "stop"


def test_self_draft_accepts_everything(tiny_target, tiny_self_draft) -> None:
    with make_engine(tiny_target, tiny_self_draft) as engine:
        res = engine.generate(PROMPTS[1], max_tokens=30, method="speculative", options={"gamma": 4})
        assert res.stats.drafted > 0
        assert res.stats.accepted == res.stats.drafted or res.stats.finish_reason == "stop"
        assert res.stats.tokens_per_pass > 3


@pytest.mark.parametrize("method", ["vanilla", "speculative"] + draft_free_methods())
def test_every_method_is_greedy_lossless_and_keeps_the_kv_clean(pair_engine: Engine, method: str) -> None:
    assert_greedy_equals_vanilla(pair_engine, PROMPTS, method)


@pytest.fixture(scope="module")
def sentencepiece_engine(tiny_sentencepiece, tiny_models_dir):
    """A Llama-2-style SentencePiece pair (vocab "s"): byte-fallback pieces, BOS, a space before the text."""
    from ouroboros_local.testing import write_tiny_model
    draft = write_tiny_model(tiny_models_dir / "sentencepiece_draft.gguf", vocab="s", seed=5, base_seed=4,
                             noise=0.02)
    engine = make_engine(tiny_sentencepiece, draft)
    yield engine
    engine.close()


@pytest.mark.parametrize("method", ["speculative"] + draft_free_methods())
def test_every_method_is_greedy_lossless_with_a_sentencepiece_vocabulary(sentencepiece_engine: Engine,
                                                                         method: str) -> None:
    # its answers end at an end token within 32 tokens: a drafted one stays in the cache
    assert_greedy_equals_vanilla(sentencepiece_engine, PROMPTS, method)


def test_prefix_reuse_across_generations(pair_engine: Engine) -> None:
    a = pair_engine.generate(PROMPTS[0], max_tokens=10)
    cached_before = list(pair_engine.kv.cached)
    b = pair_engine.generate(PROMPTS[0], max_tokens=10)
    assert a.tokens == b.tokens
    assert b.stats.prefill_seconds <= a.stats.prefill_seconds * 5 + 0.05
    assert cached_before[:5] == pair_engine.kv.cached[:5]


def test_max_tokens_and_stop_strings(pair_engine: Engine) -> None:
    res = pair_engine.generate(PROMPTS[1], max_tokens=7, method="speculative")
    assert len(res.tokens) == 7 and res.finish_reason == "length"
    full = pair_engine.generate(PROMPTS[1], max_tokens=30)
    if len(full.text) > 6:
        stop = full.text[3:6]
        res = pair_engine.generate(PROMPTS[1], max_tokens=30, stop=[stop], method="speculative")
        assert res.text == full.text[:full.text.find(stop)]
        assert res.finish_reason == "stop"
    assert pair_engine.generate(PROMPTS[1], max_tokens=0).tokens == []


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(["END"])
    assert m.push("abc E") == "abc "
    assert m.push("N") == ""
    assert m.push("Dxyz") == ""
    assert m.stopped and m.text == "abc E"[:4]
    m = StopMatcher(["END"])
    assert m.push("abE") == "ab"
    assert m.push("x") == "Ex"
    assert m.flush() == ""


@pytest.mark.parametrize("prefix_set", [True, False])
def test_stop_matcher_releases_all_but_what_may_begin_a_stop_string(prefix_set: bool, monkeypatch) -> None:
    """One search over every stop string, and their prefixes in a set (1,000 stop strings: 2.4 ms a token,
    16: 49 µs; long ones keep the loop): the text released after each piece is the text so far up to its
    first stop string, less its longest end that begins one."""
    import random

    import ouroboros_local.generation as generation

    if not prefix_set:
        monkeypatch.setattr(generation, "PREFIX_SET_CHARS", 0)
    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 5))]
        m, text, released = StopMatcher(stops), "", ""
        for _ in range(rng.randint(1, 12)):
            text += "".join(rng.choice("ab\n") for _ in range(rng.randint(1, 3)))
            released += m.push(text[len(m.text) + len(m.pending) if not m.stopped else len(text):])
            hits = [text.find(s) for s in stops if s and s in text]
            if hits:
                assert m.stopped and released == text[:min(hits)]
                break
            hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            assert released == text[:len(text) - hold] and not m.stopped


def test_streaming_yields_the_same_text(pair_engine: Engine) -> None:
    pieces = []
    result = None
    for ev in pair_engine.stream(PROMPTS[2], max_tokens=25, method="speculative"):
        pieces.append(ev.text)
        result = ev.result or result
    assert "".join(pieces) == result.text


def _read_slowly(engine: Engine, max_tokens: int) -> tuple[int, float]:
    """A stream read 0.1 s per event (a slow terminal): its events and the decode seconds it reports."""
    import time

    events = 0
    result = None
    for ev in engine.stream(PROMPTS[2], max_tokens=max_tokens, method="vanilla"):
        events += ev.result is None
        result = ev.result or result
        time.sleep(0.1)
    return events, result.stats.decode_seconds


def test_a_stream_readers_own_time_is_not_the_decodes(pair_engine: Engine) -> None:
    """generate --compare timed the method's answer with its printing (a slow terminal made it 0.42x of
    vanilla, which generate() timed without): the reader's time between events is not the engine's."""
    quick = pair_engine.generate(PROMPTS[2], max_tokens=12, method="vanilla").stats.decode_seconds
    events, seconds = _read_slowly(pair_engine, 12)
    assert events >= 5 and seconds < quick + 0.2 < 0.1 * events


def test_a_readers_time_while_a_drafter_thread_works_stays_the_decodes(pair_engine: Engine, monkeypatch) -> None:
    """PEARL drafts the next round in its thread while the reader holds an event: leaving the reader's time
    out reported 22 tok/s for a slow reader where a fast one measured 13."""
    from ouroboros_local.proposers.base import NoDraft

    monkeypatch.setattr(NoDraft, "drafts_while_read", True)   # as PEARL's while its job runs
    events, seconds = _read_slowly(pair_engine, 8)
    assert events >= 4 and seconds >= 0.1 * events
    from ouroboros_local.proposers import pearl

    assert isinstance(pearl.PearlProposer.__dict__["drafts_while_read"], property)


def test_the_last_text_is_heard_before_the_history_is_saved(pair_engine: Engine, monkeypatch) -> None:
    """The final event carried the last held-back text and was yielded after the save: a failed save's
    warning landed inside the answer on a terminal ("The United Stateswarning: cannot save ...")."""
    plain = pair_engine.generate(PROMPTS[2], max_tokens=25).text
    held = plain[-1] + "\x00\x01"   # a stop string its last character begins: held back to the end
    heard: list[str] = []
    at_save: list[str] = []
    save = pair_engine._save_history
    monkeypatch.setattr(pair_engine, "_save_history",
                        lambda *a, **kw: (at_save.append("".join(heard)), save(*a, **kw))[1])
    for ev in pair_engine.stream(PROMPTS[2], max_tokens=25, method="vanilla", stop=[held]):
        heard.append(ev.text)
        if ev.result is not None:
            assert ev.text == "" and ev.tokens == []
            result = ev.result
    assert at_save == [result.text] == [plain] and "".join(heard) == result.text


def test_cancellation(pair_engine: Engine) -> None:
    calls = {"n": 0}

    def cancel() -> bool:
        calls["n"] += 1
        return calls["n"] > 2

    res = pair_engine.generate(PROMPTS[0], max_tokens=50, cancel=cancel)
    assert res.finish_reason == "cancelled" and 0 < len(res.tokens) < 50
    # the engine is usable and exact afterwards
    assert pair_engine.generate(PROMPTS[0], max_tokens=8).tokens == \
        pair_engine.generate(PROMPTS[0], max_tokens=8, method="speculative").tokens


def test_a_proposer_whose_begin_raises_is_ended(pair_engine: Engine, monkeypatch) -> None:
    """end() undoes what begin() started (PEARL splits the cores and starts a prefill thread), so it
    follows a begin() that raised too (Ctrl-C during it)."""
    from ouroboros_local.proposers.prompt_lookup import PromptLookupProposer

    ended = []
    begin = PromptLookupProposer.begin

    def failing_begin(self, prompt, setup) -> None:
        begin(self, prompt, setup)
        raise KeyboardInterrupt

    monkeypatch.setattr(PromptLookupProposer, "begin", failing_begin)
    monkeypatch.setattr(PromptLookupProposer, "end", lambda self: ended.append(self))
    with pytest.raises(KeyboardInterrupt):
        pair_engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup")
    assert len(ended) == 1
    monkeypatch.undo()
    assert pair_engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup").tokens == \
        pair_engine.generate(PROMPTS[0], max_tokens=8).tokens


@pytest.mark.parametrize("method, nth", [("speculative", 0), ("speculative", 3), ("ouroboros", 1), ("pearl", 0),
                                         ("auto", 0)])
def test_a_ctrl_c_just_after_a_draft_decode_leaves_the_engine_whole(tiny_target, tiny_draft, monkeypatch,
                                                                     method: str, nth: int) -> None:
    """Python raises a Ctrl-C that came during llama_decode once the call returns: the draft's cells were
    written and not recorded, and every later draft method on the engine failed in llama_decode."""
    from ouroboros_local.llama import Context

    with make_engine(tiny_target, tiny_draft) as engine:
        want = engine.generate(PROMPTS[0], max_tokens=24).tokens
        draft_ctx, decode, calls = engine.draft_kv().ctx, Context.decode, iter(range(10**6))

        def interrupted(self, batch) -> None:
            decode(self, batch)
            if self is draft_ctx and next(calls) == nth:
                raise KeyboardInterrupt

        monkeypatch.setattr(Context, "decode", interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPTS[0], max_tokens=24, method=method)
        monkeypatch.undo()
        for _ in range(2):
            assert engine.generate(PROMPTS[0], max_tokens=24, method=method).tokens == want


def test_a_ctrl_c_just_after_a_sequence_copy_leaves_the_cache_as_recorded(tiny_target, tiny_draft) -> None:
    """A sequence copied but not yet recorded as holding the cells (``synced``) failed the KV invariant
    at the next round."""
    with make_engine(tiny_target, tiny_draft) as engine:
        engine.check_kv = True
        want = engine.generate(PROMPTS[0], max_tokens=24, method="speculative").tokens
        copy = engine.target_ctx.seq_cp

        def interrupted(*args) -> None:
            copy(*args)
            raise KeyboardInterrupt

        engine.target_ctx.seq_cp = interrupted
        with pytest.raises(KeyboardInterrupt):
            engine.generate(PROMPTS[0], max_tokens=40, method="lookahead")
        engine.target_ctx.seq_cp = copy
        assert engine.generate(PROMPTS[0], max_tokens=24, method="speculative").tokens == want


def test_a_cancel_stops_a_long_prefill_between_its_batches(tiny_target) -> None:
    """A client that hung up during a long prompt's prefill was heard only once all of it was decoded
    (minutes on a CPU for a long prompt)."""
    with make_engine(tiny_target, n_batch=16) as engine:
        prompt = engine.tokenize("one two three four five six seven eight nine ten " * 12)
        calls = {"n": 0}

        def cancel() -> bool:
            calls["n"] += 1
            return calls["n"] > 1

        res = engine.generate(prompt, max_tokens=8, cancel=cancel)
        assert res.finish_reason == "cancelled" and res.tokens == []
        assert 16 <= engine.kv.n_past <= 32 < len(prompt)          # one or two batches, not the whole prompt
        engine.kv.check()
        for method in ("vanilla", "prompt-lookup"):                # usable and exact afterwards
            assert engine.generate(prompt, max_tokens=8, method=method).tokens == \
                engine.generate(prompt[:], max_tokens=8, method="vanilla").tokens


def test_a_prefill_cancelled_leaves_the_drafts_own_prefill_undone(tiny_target, tiny_other_vocab) -> None:
    """speculative with another vocabulary prefills the draft in begin(): after a cancelled prefill it ran
    all the same (uncancellable)."""
    with make_engine(tiny_target, tiny_other_vocab, n_batch=16) as engine:
        prompt = engine.tokenize("one two three four five six seven eight nine ten " * 12)
        calls = {"n": 0}

        def cancel() -> bool:
            calls["n"] += 1
            return calls["n"] > 1

        res = engine.generate(prompt, max_tokens=8, method="speculative", cancel=cancel)
        assert res.finish_reason == "cancelled" and res.tokens == [] and res.stats.prefill_seconds > 0
        assert engine.draft_kv().n_past == 0
        base = engine.generate(prompt, max_tokens=8, method="vanilla")
        assert engine.generate(prompt, max_tokens=8, method="speculative").tokens == base.tokens


def test_bad_parameters_raise_clear_errors(pair_engine: Engine) -> None:
    with pytest.raises(ParameterError, match="temperature"):
        pair_engine.generate("x", sampling=SamplingParams(temperature=-1))
    with pytest.raises(ParameterError, match="max_tokens"):
        pair_engine.generate("x", max_tokens=-1)
    with pytest.raises(ParameterError, match="unknown method"):
        pair_engine.generate("x", method="nope")
    with pytest.raises(ParameterError, match="gamma"):
        pair_engine.generate("x", method="speculative", options={"gamma": 0})
    with pytest.raises(ContextOverflowError, match="context"):
        pair_engine.generate("word " * 2000, max_tokens=4)
    # token ids outside the vocabulary: llama.cpp's own error says only "failed to decode"
    n_vocab = pair_engine.target.n_vocab
    for bad in (n_vocab, -1):
        with pytest.raises(ParameterError, match=f"prompt token {bad} is not in the vocabulary"):
            pair_engine.generate([1, 2, bad], max_tokens=2)
    # ids far past the context are counted, not each checked first (4M ids took 17 s of a server's CPU)
    import ouroboros_local.engine as engine_mod

    checked = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_mod, "is_integer", lambda t: checked.append(t) or True)
        with pytest.raises(ContextOverflowError, match="the prompt has 1000000 tokens"):
            pair_engine.generate([5] * 10**6, max_tokens=2)
    assert len(checked) < 10   # max_tokens, not a million ids
    # sampling as a dict of SamplingParams' fields (once an AttributeError)
    as_dict = pair_engine.generate("x y", max_tokens=4, sampling={"temperature": 0.8, "seed": 3})
    assert as_dict.tokens == pair_engine.generate("x y", max_tokens=4,
                                                  sampling=SamplingParams(temperature=0.8, seed=3)).tokens
    with pytest.raises(ParameterError, match="sampling takes the fields"):
        pair_engine.generate("x", sampling={"temp": 0.8})
    with pytest.raises(ParameterError, match="sampling must be"):
        pair_engine.generate("x", sampling=0.8)
    with pytest.raises(ParameterError, match="chat must be True or False"):   # "no" applied the template
        pair_engine.generate("x", chat="no")
    with pytest.raises(TypeError, match="Engine.generate"):   # a typo named Engine.stream, behind **kwargs
        pair_engine.generate("x", max_token=4)
    # still fine afterwards
    assert len(pair_engine.generate("x y z", max_tokens=3).tokens) == 3


def test_speculative_without_draft_is_refused(tiny_target) -> None:
    with make_engine(tiny_target) as engine:
        with pytest.raises(ParameterError, match="draft"):
            engine.generate("x", method="speculative")
        with pytest.raises(ParameterError, match=r"needs a draft model: Engine.load\(TARGET, DRAFT\)"):
            engine.draft_kv()   # what a registered method's factory asks for, NEEDS_DRAFT or not


SMALL_BATCH_SCRIPT = """
import sys
from ouroboros_local.errors import ParameterError
from ouroboros_local.testing.engines import tiny_engine
target, draft, n_ctx, n_batch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
with tiny_engine(target, draft, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=16) as engine:
    print(engine.target_ctx.n_batch, engine.target_ctx.n_seq_max, engine.draft_kv().ctx.n_seq_max)
    base = engine.generate("one two three one two three one", max_tokens=24, method="vanilla").tokens
    for method in ("auto", "speculative", "prompt-lookup", "suffix", "ouroboros"):
        try:
            tokens = engine.generate("one two three one two three one", max_tokens=24, method=method).tokens
        except ParameterError as exc:   # a window that does not fit the batch says so
            assert method == "ouroboros" and "batch" in str(exc), (method, exc)
            continue
        assert tokens == base, method
"""


@pytest.mark.parametrize("n_ctx, n_batch", [(512, 8), (4, 64), (512, 1)])
def test_a_batch_smaller_than_the_sequences_runs(tiny_target, tiny_draft, n_ctx: int, n_batch: int) -> None:
    """More sequences than a batch holds outputs made llama.cpp abort the process (`-b 8`, or `-c 8`,
    which cuts the batch to the context, with the default 16 sequences): now the context takes as many
    as its batch holds, and the rounds fit the batch llama.cpp gave it. In a subprocess: an abort there
    fails this test instead of killing the test run."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", SMALL_BATCH_SCRIPT, str(tiny_target), str(tiny_draft), str(n_ctx),
                          str(n_batch)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    batch, seqs, draft_seqs = map(int, run.stdout.split()[-3:])
    assert batch == min(n_ctx, n_batch) and seqs == draft_seqs == min(16, batch)


def test_a_context_of_the_trained_size_keeps_its_sequences(tiny_target) -> None:
    """n_ctx=0 asks llama.cpp for the model's trained context: the sequences are not cut to it."""
    with make_engine(tiny_target, n_ctx=0, n_batch=64, n_seq_max=8) as engine:
        assert engine.target_ctx.n_ctx > 0 and engine.target_ctx.n_seq_max == 8


@pytest.mark.parametrize("adaptive", [False, True])
def test_context_full_ends_generation_cleanly(tiny_target, tiny_draft, adaptive: bool) -> None:
    """Every method stops cleanly at a full context, lookahead's window and a draft model's context too
    (they once ended with "the context is full"), and the text up to there is the plain text."""
    with make_engine(tiny_target, tiny_draft, n_ctx=256, adaptive=adaptive) as engine:
        prompt = "one two three " * 10
        base = engine.generate(prompt, max_tokens=1000, method="vanilla")
        for method in method_names():
            res = engine.generate(prompt, max_tokens=1000, method=method)
            assert res.finish_reason in ("length", "stop"), method
            assert len(engine.prompt_tokens(prompt)) + len(res.tokens) <= 256, method
            assert res.tokens == base.tokens, method


# ---- sampling losslessness on the tiny vocabulary ------------------------------------------------

@pytest.mark.parametrize("method", ["speculative"] + draft_free_methods())
def test_sampling_is_lossless(pair_engine: Engine, tiny_target, method: str) -> None:
    """The first two of 4 tokens, on a prompt the copying drafters draft from: drafts of several tokens
    are verified, accepted and rejected (of 2 tokens on the plain prompt, prompt lookup drafted 1 at
    most, and had none accepted)."""
    params = SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    results = assert_first_pairs_follow_the_target(pair_engine, tiny_target, copyable(pair_engine, PROMPTS[1]),
                                                   params, 1500, max_tokens=4, method=method)
    assert sum(r.stats.accepted for r in results) > 50


@pytest.mark.parametrize("method", ["speculative"] + draft_free_methods())
def test_seeded_sampling_gives_seeded_vanillas_tokens(pair_engine: Engine, method: str) -> None:
    """Every method drafts deterministically when seeded (a draft model greedily), so each emitted token
    consumes one uniform as in plain decoding: the same seed gives the same answer."""
    answers = assert_seeded_equals_vanilla(pair_engine, PROMPTS, method=method)
    assert sum(a.stats.accepted for a in answers) > 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0),
                                    SamplingParams(temperature=1.5, top_k=0, top_p=0.9, min_p=0.02)])
@pytest.mark.parametrize("stop", [None, "adaedl", "p_min"])
def test_sampled_drafts_are_lossless(tiny_target, tiny_noisy_draft, params: SamplingParams, stop: str | None) -> None:
    """The rejection sampling an unseeded request runs: the draft samples its tokens (a seed makes it
    greedy, checked by sample-and-match, as in the tests above), each with its distribution q, and a
    rejection draws from the residual (p - q)+. A noisy draft rejects often enough for a wrong residual
    to show; 4 tokens let the first two come from a draft of several. Drafts stopped early (AdaEDL's
    entropy, p_min's confidence: decided before the draw, as a token dropped for its own q would bias)."""
    options = {"greedy_draft": False, "adaptive": False, "gamma": 4, "adaedl": stop == "adaedl",
               **({"adaedl_lambda": 0.5} if stop == "adaedl" else {}), **({"p_min": 0.6} if stop == "p_min" else {})}
    with make_engine(tiny_target, tiny_noisy_draft) as engine:
        results = assert_first_pairs_follow_the_target(engine, tiny_target, PROMPTS[1], params, 1500,
                                                       max_tokens=4, method="speculative", options=options)
    drafted = sum(r.stats.drafted for r in results)
    assert 0.2 * drafted < sum(r.stats.accepted for r in results) < 0.9 * drafted   # both branches taken
    if stop == "adaedl":
        assert sum(r.stats.extra["adaedl_early_stops"] for r in results) > 0
    if stop == "p_min":   # it was ignored for sampled drafts: ~2 drafted tokens a pass, as without it
        assert drafted < 1.6 * sum(r.stats.target_passes for r in results)


@pytest.mark.parametrize("method", ["vanilla", "speculative"])
def test_the_reference_distribution_ends_answers_at_an_end_token(pair_engine: Engine, tiny_target,
                                                                 method: str) -> None:
    """Hot and untruncated, an answer may end at once: the reference once went on decoding after the end
    token (never emitted), and failed plain decoding itself with "outcomes of zero target probability"."""
    params = SamplingParams(temperature=2.0, top_k=0, top_p=0.9, min_p=0.0)
    joint = target_pair_distribution(tiny_target, pair_engine.prompt_tokens(PROMPTS[1]), params)
    assert any(len(answer) < 2 for answer in joint) and abs(sum(joint.values()) - 1) < 1e-9
    assert_first_pairs_follow_the_target(pair_engine, tiny_target, PROMPTS[1], params, 1500, method=method)


def test_seeded_sampling_is_reproducible(pair_engine: Engine) -> None:
    sp = SamplingParams(temperature=0.8, seed=123)
    a = pair_engine.generate(PROMPTS[0], max_tokens=20, method="speculative", sampling=sp)
    b = pair_engine.generate(PROMPTS[0], max_tokens=20, method="speculative", sampling=sp)
    assert a.tokens == b.tokens


def test_an_unseeded_sample_says_its_seed_and_that_seed_repeats_it(pair_engine: Engine) -> None:
    """No seed given: the one drawn was nowhere, so a good sample could not be had again."""
    first = pair_engine.generate(PROMPTS[0], max_tokens=12, sampling=SamplingParams(temperature=1.0))
    seed = first.stats.seed
    assert isinstance(seed, int) and first.stats.to_dict()["seed"] == seed
    again = pair_engine.generate(PROMPTS[0], max_tokens=12, sampling=SamplingParams(temperature=1.0, seed=seed))
    assert again.tokens == first.tokens and again.stats.seed == seed
    assert pair_engine.generate(PROMPTS[0], max_tokens=4).stats.seed is None   # greedy draws nothing


def test_seeded_speculative_repeats_whatever_its_draft_lengths(pair_engine: Engine) -> None:
    # A sampled draft uses as many uniforms as its (timing-scheduled) length: a seeded request drafts
    # greedily instead, so its text is plain seeded decoding's however long the drafts were.
    for seed in range(3):
        sp = SamplingParams(temperature=0.8, seed=seed)
        base = pair_engine.generate(PROMPTS[seed % 3], max_tokens=30, method="vanilla", sampling=sp)
        for options in ({}, {"adaptive": False, "gamma": 2}, {"adaptive": False, "gamma": 4}):
            res = pair_engine.generate(PROMPTS[seed % 3], max_tokens=30, method="speculative", sampling=sp,
                                       options=options)
            assert res.tokens == base.tokens, (seed, options)
    # asked for, sampled drafts still run with a seed (accepted by min(1, p/q), their own uniforms drawn)
    sampled = {"greedy_draft": False, "adaptive": False, "gamma": 4}
    differs = 0
    for seed in range(3):
        sp = SamplingParams(temperature=0.8, seed=seed)
        base = pair_engine.generate(PROMPTS[seed % 3], max_tokens=30, method="vanilla", sampling=sp)
        res = pair_engine.generate(PROMPTS[seed % 3], max_tokens=30, method="speculative", sampling=sp,
                                   options=sampled)
        differs += res.tokens != base.tokens
    assert differs > 0


def test_seeded_auto_equals_seeded_vanilla(pair_engine: Engine) -> None:
    # auto drafts deterministically (sample-and-match), so its scheduler state, which changes from
    # call to call, never changes a seeded run's text
    for seed in range(4):
        sp = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=seed)
        base = pair_engine.generate(PROMPTS[seed % 3], max_tokens=30, method="vanilla", sampling=sp)
        for _ in range(2):
            res = pair_engine.generate(PROMPTS[seed % 3], max_tokens=30, method="auto", sampling=sp)
            assert res.tokens == base.tokens


def test_the_tie_rule_reads_plain_decodings_own_row(pair_engine: Engine) -> None:
    """``compare_greedy`` measures a margin on the row plain decoding chose from: replayed one token per
    step, its argmax is the reference's next token at every position, whatever the cache held before."""
    from ouroboros_local.compare import compare_greedy, plain_decoding_row

    prompt = pair_engine.tokenize("The quick brown fox", add_special=True)
    ref = pair_engine.generate(prompt, max_tokens=12).tokens
    pair_engine.generate("something else entirely", max_tokens=4)   # the cache now holds other text
    for i in (0, 5, len(ref) - 1):
        assert int(plain_decoding_row(pair_engine, prompt, ref[:i]).argmax()) == ref[i]
    other = list(ref)
    other[5] = (ref[5] + 1) % pair_engine.target.n_vocab
    report = compare_greedy(pair_engine, prompt, ref, other)
    assert report.first_difference == 5 and report.margin is not None and report.margin > 0


def test_a_stream_left_open_makes_the_same_threads_next_call_fail_not_hang(pair_engine: Engine) -> None:
    import faulthandler

    from ouroboros_local.errors import OuroborosError

    stream = pair_engine.stream(PROMPTS[0], max_tokens=20)
    next(stream)
    faulthandler.dump_traceback_later(120, exit=True)   # a plain lock waited for itself forever: end the run
    try:
        with pytest.raises(OuroborosError, match="still open"):
            pair_engine.generate(PROMPTS[1], max_tokens=3)
        with pytest.raises(OuroborosError, match="still open"):
            next(pair_engine.stream(PROMPTS[1], max_tokens=3))
    finally:
        faulthandler.cancel_dump_traceback_later()
    stream.close()
    assert pair_engine.generate(PROMPTS[1], max_tokens=3).tokens == \
        pair_engine.generate(PROMPTS[1], max_tokens=3).tokens


def test_an_f16_models_difference_from_plain_decoding_is_a_near_tie(tmp_path) -> None:
    """Batched rows differ from one-token steps even with F32/F16 weights (~1e-4 logits): an F16 model
    whose plain decoding chose between two tokens 0.0003 logits apart parts there, within the tie rule
    (docs/design.md, "Exactness"); the docs once promised identity on F32/F16."""
    from ouroboros_local.compare import compare_greedy
    from ouroboros_local.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "t16.gguf", vocab="a", seed=1, dtype="f16")
    prompt = [44, 442] * 12
    with make_engine(path) as engine:
        plain = engine.generate(prompt, max_tokens=24).tokens
        copied = engine.generate(prompt, max_tokens=24, method="prompt-lookup").tokens
        report = compare_greedy(engine, prompt, plain, copied)
    assert report.ok
    if not report.identical:   # this llama.cpp build and CPU: at token 19, 0.00032 logits
        assert 0 <= report.margin < 0.01, report


def test_a_stream_read_on_in_another_thread_belongs_to_that_thread(pair_engine: Engine) -> None:
    """Started in one thread, read on in this one: this thread's next call waited for itself forever."""
    import faulthandler
    import threading

    from ouroboros_local.errors import OuroborosError

    stream = pair_engine.stream(PROMPTS[0], max_tokens=20)
    starter = threading.Thread(target=lambda: next(stream))
    starter.start()
    starter.join()
    next(stream)
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        with pytest.raises(OuroborosError, match="still open"):
            pair_engine.generate(PROMPTS[1], max_tokens=3)
    finally:
        faulthandler.cancel_dump_traceback_later()
    stream.close()


def test_a_new_thread_waits_for_a_stream_an_ended_thread_read(pair_engine: Engine) -> None:
    """The stream's reader was known by its thread ident, which a new thread often reuses once the old one
    has ended: that thread was refused ("still open") instead of waiting for the stream to be closed."""
    import threading

    expected = pair_engine.generate(PROMPTS[1], max_tokens=3).tokens
    for _ in range(5):   # the ident was reused in about 70% of tries
        stream = pair_engine.stream(PROMPTS[0], max_tokens=20)
        reader = threading.Thread(target=lambda: next(stream))
        reader.start()
        reader.join()
        got: list = []
        later = threading.Thread(target=lambda: got.append(_outcome(pair_engine, PROMPTS[1])))
        later.start()
        later.join(0.3)
        assert later.is_alive() and not got, got    # waiting for the engine, not refused
        stream.close()
        later.join(60)
        assert got == [expected]


def test_a_generation_waiting_its_turn_names_its_files_in_its_turn(tiny_target, tmp_path) -> None:
    """A method's options are taken when its generation holds the engine: a history file one names was
    bound to the engine while another thread's generation ran, and saved by that one."""
    import threading

    pool_file = str(tmp_path / "later.pool")
    with make_engine(tiny_target) as engine:
        stream = engine.stream(PROMPTS[0], max_tokens=20, method="lookahead")
        next(stream)
        later = threading.Thread(target=lambda: engine.generate(PROMPTS[1], max_tokens=3, method="lookahead",
                                                                options={"pool": pool_file}))
        later.start()
        later.join(0.3)
        assert later.is_alive() and engine.history.named_file is None   # waiting, its file not yet taken
        stream.close()
        later.join(60)
        assert engine.history.named_file == pool_file


def _outcome(engine: Engine, prompt: str) -> Any:
    try:
        return engine.generate(prompt, max_tokens=3).tokens
    except Exception as exc:   # noqa: BLE001 - the test reports it
        return exc


def test_close_ends_a_stream_that_an_ended_thread_left_open(tiny_target) -> None:
    """close() waited forever for a stream whose reader had ended without closing it."""
    import faulthandler
    import threading

    engine = make_engine(tiny_target)
    stream = engine.stream(PROMPTS[0], max_tokens=20)
    reader = threading.Thread(target=lambda: next(stream))
    reader.start()
    reader.join()
    faulthandler.dump_traceback_later(120, exit=True)
    try:
        engine.close()
    finally:
        faulthandler.cancel_dump_traceback_later()
    with pytest.raises(OuroborosError, match="closed"):
        engine.generate(PROMPTS[1], max_tokens=2)


def test_close_waits_for_a_stream_whose_thread_is_alive_says_has_ended(tiny_target) -> None:
    """After a Ctrl-C interrupted the main thread's join() of a worker, CPython 3.11's is_alive() said
    False for the running worker: close() closed its stream under it, the answer cut off without a word."""
    import threading
    import time

    engine = make_engine(tiny_target)
    reading, results = threading.Event(), []

    def read() -> None:
        for event in engine.stream(PROMPTS[0], max_tokens=40):
            reading.set()
            time.sleep(0.002)
            if event.result is not None:
                results.append(event.result)

    worker = threading.Thread(target=read)
    worker.start()
    assert reading.wait(30)
    worker.is_alive = lambda: False   # what the interrupted join() left it saying
    engine.close()
    worker.join(30)
    assert results and results[0].stats.finish_reason in ("length", "stop")


def test_history_clear_from_another_thread_waits_for_the_generation(tiny_target, tmp_path) -> None:
    """It raised "dictionary keys changed during iteration" beside a generation naming a pool file, and
    cleared nothing: like every call, it queues."""
    import threading

    engine = make_engine(tiny_target)
    try:
        stream = engine.stream(PROMPTS[0], max_tokens=8, method="suffix", options={"pool": str(tmp_path / "h")})
        next(stream)   # this thread holds the engine until the stream ends
        clearer = threading.Thread(target=engine.history.clear)
        clearer.start()
        clearer.join(0.3)
        assert clearer.is_alive()   # waits for the generation
        assert list(stream)[-1].result is not None
        clearer.join(30)
        assert not clearer.is_alive() and engine.history.named_file is None
        assert (tmp_path / "h.suffix").is_file()   # the answer's history reached its file first
        engine.history.clear()   # this thread, holding nothing: at once
    finally:
        engine.close()


def test_close_waits_for_a_thread_that_is_tokenizing(tiny_target) -> None:
    """close() freed the model under another thread's llama_tokenize (which runs without the GIL): the
    process aborted or segfaulted. Tokenizing takes no engine lock (the server tokenizes a request while
    another generates), so close() waits for such calls, and later ones find the engine closed."""
    import threading

    engine = make_engine(tiny_target)
    entered = _slow_tokenizer(engine, 0.5)   # the model must still be there when the tokenizer runs
    got: list[Any] = []
    worker = threading.Thread(target=lambda: got.append(_tokens_or_error(engine)))
    worker.start()
    assert entered.wait(30)
    engine.close()
    worker.join(30)
    assert got and isinstance(got[0], list) and got[0], got
    with pytest.raises(OuroborosError, match="engine is closed"):
        engine.tokenize("hello")


def test_a_second_closer_returns_only_once_the_engine_is_freed_and_ctrl_c_leaves_it_open(tiny_target) -> None:
    """A second close() returned while the first still waited for a tokenizing thread, with the contexts
    not yet freed; a Ctrl-C in that wait left the engine closed to calls with nothing freed, for good."""
    import threading
    import time

    engine = make_engine(tiny_target)
    entered = _slow_tokenizer(engine, 0.6)
    worker = threading.Thread(target=lambda: _tokens_or_error(engine))
    worker.start()
    assert entered.wait(30)
    first = threading.Thread(target=engine.close)
    first.start()
    time.sleep(0.1)   # the first closer waits for the tokenizing thread
    engine.close()
    assert engine.target_ctx._ptr is None   # freed by the time the second close() returns
    first.join(30)
    worker.join(30)

    engine = make_engine(tiny_target)
    held = threading.Event()
    caller = threading.Thread(target=held.wait, args=(30,))
    caller.start()
    engine._users = {object(): caller}   # a call under way in another thread

    def interrupted(timeout: Any = None) -> bool:
        raise KeyboardInterrupt

    engine._users_left.wait = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.close()
    assert engine.tokenize("hello")   # still open
    engine._users = {}
    del engine._users_left.wait
    held.set()
    caller.join(30)
    engine.close()
    assert engine.target_ctx._ptr is None


def test_a_ctrl_c_inside_the_count_of_calls_does_not_leave_close_waiting(tiny_target, monkeypatch) -> None:
    """A Ctrl-C in the Python-level exit of the condition counting tokenizing calls left the count up:
    close(), and the interpreter's exit that runs it, waited forever (a notebook's kernel hung)."""
    import threading as threading_module

    engine = make_engine(tiny_target)
    real_exit = threading_module.Condition.__exit__
    state = {"armed": True}

    def ctrl_c_on_exit(self, *exc):
        result = real_exit(self, *exc)
        if self is engine._users_left and state["armed"]:
            state["armed"] = False
            raise KeyboardInterrupt
        return result

    monkeypatch.setattr(threading_module.Condition, "__exit__", ctrl_c_on_exit)
    with pytest.raises(KeyboardInterrupt):
        engine.tokenize("hello")
    monkeypatch.setattr(threading_module.Condition, "__exit__", real_exit)
    assert engine.tokenize("hello")
    closer = threading_module.Thread(target=engine.close)
    closer.start()
    closer.join(10)
    assert not closer.is_alive() and engine.target_ctx._ptr is None


def _slow_tokenizer(engine: Engine, seconds: float) -> Any:
    """Make the engine's tokenizer take ``seconds`` more; the event returned is set when a call starts."""
    import threading
    import time

    real, entered = engine.target.tokenize, threading.Event()

    def slow_tokenize(*args: Any, **kwargs: Any) -> list[int]:
        entered.set()
        time.sleep(seconds)
        return real(*args, **kwargs)

    engine.target.tokenize = slow_tokenize
    return entered


def _tokens_or_error(engine: Engine) -> Any:
    try:
        return engine.tokenize("hello world")
    except Exception as exc:   # noqa: BLE001 - the test reports it
        return exc


def test_an_engine_refuses_a_vocabulary_only_model_and_flags_that_are_not_bools(tiny_target) -> None:
    """A vocab_only model was taken and its first decode aborted the process (GGML_ASSERT); tokenize's
    limit=2.5 or "3" was a TypeError, and add_special="no" or add_generation_prompt="no" counted as True."""
    from ouroboros_local.llama import Model

    words = Model(tiny_target, vocab_only=True)
    try:
        with pytest.raises(ParameterError, match="vocab_only=True: it has no weights"):
            Engine(words)
    finally:
        words.close()
    engine = make_engine(tiny_target)
    try:
        for limit in (2.5, "3", -1, True):
            with pytest.raises(ParameterError, match="limit must be None or an integer >= 0"):
                engine.tokenize("hello world", limit=limit)
        assert engine.tokenize("hello world", limit=np.int64(100)) == engine.tokenize("hello world")
        with pytest.raises(ParameterError, match="add_special must be True or False"):
            engine.tokenize("hello", add_special="no")
        with pytest.raises(ParameterError, match="add_generation_prompt must be True or False"):
            engine.chat_tokens([{"role": "user", "content": "hi"}], add_generation_prompt="no")
    finally:
        engine.close()


def test_engine_lifecycle_errors_are_one_line(tiny_target, tmp_path) -> None:
    """After close() every call raised a segfault (tokenize) or read freed memory (detokenize); an id
    outside the vocabulary aborted the process; two engines sharing a model freed it under the other."""
    from ouroboros_local.engine import EngineConfig
    from ouroboros_local.errors import OuroborosError
    from ouroboros_local.llama import Model

    shared = Model(tiny_target)
    first = Engine(shared, None, EngineConfig(n_ctx=256, n_batch=32, threads=1, calibration="off"))
    second = Engine(shared, None, EngineConfig(n_ctx=256, n_batch=32, threads=1, calibration="off"))
    expected = second.generate("hello", max_tokens=4).tokens
    with pytest.raises(ParameterError, match="token 509 is not in the vocabulary"):
        first.detokenize([1, 509])
    with pytest.raises(ParameterError, match="token ids are integers"):
        first.detokenize([1.5])
    first.close()
    first.close()                                    # twice is fine
    assert second.generate("hello", max_tokens=4).tokens == expected   # the model is still the second's
    for call in (lambda: first.generate("hello", max_tokens=2), lambda: first.tokenize("hello"),
                 lambda: first.detokenize([1]), lambda: first.prepare("vanilla"),
                 lambda: next(first.stream([1, 2], max_tokens=2))):
        with pytest.raises(OuroborosError, match="engine is closed"):
            call()
    second.close()
    with pytest.raises(OuroborosError, match="model is closed"):
        shared.tokenize("hello")
    with pytest.raises(OuroborosError, match="engine is closed"):   # not its model's words
        second.chat_tokens([{"role": "user", "content": "hello"}])


def test_leaving_a_with_block_mid_stream_closes_the_stream_and_the_engine(tiny_target) -> None:
    """close() refused (this thread's stream held the lock), hiding the user's own exception."""
    engine = make_engine(tiny_target)
    with pytest.raises(KeyError, match="the user's"):
        with engine:
            for _ in engine.stream(PROMPTS[0], max_tokens=20):
                break
            raise KeyError("the user's own error")
    assert engine.target_ctx._ptr is None


def test_engine_arguments_are_checked(tiny_target) -> None:
    from ouroboros_local.engine import EngineConfig

    with make_engine(tiny_target) as engine:
        plain = engine.generate(PROMPTS[0], max_tokens=12)
        cut = plain.text[3:6]
        assert cut and engine.generate(PROMPTS[0], max_tokens=12, stop=cut).text == \
            engine.generate(PROMPTS[0], max_tokens=12, stop=[cut]).text   # one str is one stop string
        prompt = engine.tokenize(PROMPTS[0])
        assert engine.generate(np.array(prompt), max_tokens=3).tokens == plain.tokens[:3]
        for bad in ([1, 1.9], [1, "5"], [True, 2], b"hello", None, 5):
            with pytest.raises(ParameterError):
                engine.generate(bad, max_tokens=2)
        for kwargs in ({"stop": [1]}, {"cancel": True}):
            with pytest.raises(ParameterError):
                engine.generate(PROMPTS[0], max_tokens=2, **kwargs)
    for bad in ({"max_draft": 0}, {"round_size": -1}, {"round_size": 1}, {"n_ctx": "big"}, {"flash_attn": "yes"},
                {"type_v": "q3"}, {"overlap": 1}, {"calibration": "sometimes"}, {"n_ctx": 2**32 + 512},
                {"n_batch": 2**32 + 2}, {"threads": 10**11}, {"n_seq_max": 257},
                {"round_size": 513, "n_ctx": 512, "n_batch": 1024}):
        with pytest.raises(ParameterError, match=f"EngineConfig.{next(iter(bad))}"):
            EngineConfig(**bad)
    mine = EngineConfig(n_ctx=256, n_batch=32, threads=1, calibration="off")
    with pytest.raises(ParameterError, match="config must be an EngineConfig"):   # was a TypeError in replace()
        Engine.load(str(tiny_target), config={"n_ctx": 256}, progress=False)
    with pytest.raises(ParameterError, match=r"Engine.load\(target_path"):   # was an AttributeError
        Engine(str(tiny_target))
    Engine.load(str(tiny_target), config=mine, progress=False, n_ctx=512).close()
    assert mine.n_ctx == 256                         # the caller's config is not written to


def test_an_answer_whose_history_cannot_be_saved_still_arrives(tiny_target, tmp_path, monkeypatch, caplog) -> None:
    """A full disk at the pool's save discarded the answer: generate --json printed nothing, the chat
    dropped the turn, the server answered 400."""
    from ouroboros_local.errors import PoolError
    from ouroboros_local.pool import PhrasePool

    def full_disk(self, path, fingerprint):
        raise PoolError(f"cannot save the phrase pool to {path}: [Errno 28] No space left on device")

    with make_engine(tiny_target) as engine:
        want = engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup").tokens
        monkeypatch.setattr(PhrasePool, "save", full_disk)
        got = engine.generate(PROMPTS[0], max_tokens=8, method="prompt-lookup",
                              options={"pool": str(tmp_path / "pool.bin")})
        assert got.tokens == want
        assert "No space left" in got.stats.extra["history_not_saved"]
        assert "the answer is kept" in caplog.text


def test_closing_from_two_threads_frees_a_shared_model_once(tiny_target, monkeypatch) -> None:
    """A second close() waiting for the lock ran the whole close again: the shared model's count went
    to 0 under the other engine. An engine that failed to build held its models for ever."""
    import threading
    import time

    from ouroboros_local.engine import EngineConfig
    from ouroboros_local.errors import ModelError
    from ouroboros_local.llama import Model

    from ouroboros_local import engine as engine_mod

    def no_context(*args, **kwargs):
        raise ModelError("llama.cpp could not create a context")

    lonely = Model(tiny_target)
    with monkeypatch.context() as patch:
        patch.setattr(engine_mod, "Context", no_context)
        with pytest.raises(ModelError):
            Engine(lonely, None, EngineConfig(n_ctx=256, n_batch=32, threads=1))
    assert lonely._holders == 0
    lonely.close()
    shared = Model(tiny_target)
    config = EngineConfig(n_ctx=256, n_batch=32, threads=1, calibration="off")
    first, second = Engine(shared, None, config), Engine(shared, None, config)
    monkeypatch.setattr(first, "save_learned", lambda *a: time.sleep(0.3))   # widen the window
    closers = [threading.Thread(target=first.close) for _ in range(2)]
    for t in closers:
        t.start()
    for t in closers:
        t.join()
    assert shared._holders == 1
    assert second.generate("hello", max_tokens=3).tokens    # the model is still the second engine's
    second.close()
    assert shared._ptr is None                               # and freed with it


def test_numpy_integers_and_any_iterable_are_taken(tiny_target) -> None:
    from ouroboros_local.engine import EngineConfig

    config = EngineConfig(n_ctx=np.int64(256), n_batch=np.int32(32), threads=1, calibration="off",
                          adaptive=np.bool_(False))
    assert type(config.n_ctx) is int and config.n_ctx == 256 and config.adaptive is False
    with Engine.load(str(tiny_target), config=config, progress=False) as engine:
        prompt = engine.tokenize(PROMPTS[0])
        want = engine.generate(prompt, max_tokens=6)
        assert engine.generate(iter(prompt), max_tokens=6).tokens == want.tokens
        assert engine.generate(prompt, max_tokens=6, stop=(s for s in [want.text[2:4]])).text == \
            engine.generate(prompt, max_tokens=6, stop=[want.text[2:4]]).text
        with pytest.raises(ParameterError):
            engine.generate(np.array(3), max_tokens=2)
        # numpy's numbers are numbers: a count, a seed and sampler settings read from an array
        assert engine.generate(prompt, max_tokens=np.int64(6)).tokens == want.tokens
        sampling = {"temperature": 0.5, "top_k": 5, "top_p": 0.9, "seed": 7}
        from_numpy = {"temperature": np.float32(0.5), "top_k": np.int64(5), "top_p": np.float64(0.9),
                      "seed": np.uint32(7)}
        assert engine.generate(prompt, max_tokens=8, sampling=from_numpy).tokens == \
            engine.generate(prompt, max_tokens=8, sampling=sampling).tokens
        for bad in ({"top_k": np.bool_(True)}, {"seed": np.float64(1.0)}, {"temperature": np.bool_(True)}):
            with pytest.raises(ParameterError):
                engine.generate(prompt, max_tokens=2, sampling=bad)


def test_accepted_counts_only_draft_tokens_of_the_answer(tiny_target) -> None:
    """A stop string that ends the answer mid-round left the round's accepted draft tokens in
    stats.accepted: 4 accepted for a 2-token answer in one pass (the token budget was already applied)."""
    engine = make_engine(tiny_target, tiny_target)   # the target as its own draft: every token accepted
    try:
        prompt = "The quick brown fox jumps over the lazy dog. The quick brown"
        full = engine.generate(prompt, max_tokens=40, method="speculative")
        cut = engine.generate(prompt, max_tokens=40, method="speculative", stop=full.text[1:3])
        assert cut.stats.finish_reason == "stop" and full.stats.accepted > 0
        assert cut.stats.accepted <= cut.stats.tokens < full.stats.tokens, (cut.stats.accepted, cut.stats.tokens)
    finally:
        engine.close()


def test_a_quantised_v_cache_turns_flash_attention_on_or_is_refused_before_loading(tiny_target) -> None:
    """llama.cpp quantises the V cache only with flash attention: type_v='q4_0' failed after the weights
    loaded, by default on a CPU (flash attention off there)."""
    from ouroboros_local.engine import EngineConfig

    with pytest.raises(ParameterError, match="type_v='q4_0' needs flash attention"):
        EngineConfig(type_v="q4_0", flash_attn="off")
    from ouroboros_local.engine_config import default_flash_attn
    from ouroboros_local.llama import Model

    model = Model(tiny_target, vocab_only=True)   # (its heads, 16 wide, take no 32-wide quantised block)
    try:
        assert default_flash_attn(model, "q8_0") == "auto" and default_flash_attn(model, "f16") == "off"
    finally:
        model.close()


def test_the_package_imports_lightly_and_lists_its_lazy_names() -> None:
    import subprocess
    import sys

    code = ("import sys, ouroboros_local as o; print('numpy' in sys.modules, "
            "{'Engine', 'EngineConfig', 'SamplingParams'} <= set(dir(o)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]   # the names load on first use, and dir() (tab completion) sees them



EXIT_SCRIPT = """
import sys, threading, time
from ouroboros_local.testing.engines import tiny_engine
target, pool, mode = sys.argv[1:4]
engine = tiny_engine(target, n_ctx=256)
options = {"pool": pool}
if mode in ("pending", "closed"):   # answers quicker than a save: the last ones wait for close()
    for prompt in ("one two three one two", "four five six four", "seven eight nine seven"):
        engine.generate(prompt, max_tokens=24, method="auto", options=options)
    print("pending", engine.history.pending)
    if mode == "closed":
        engine.close()
elif mode == "stream":   # left open mid-answer
    stream = engine.stream("one two three one two", max_tokens=24, method="auto", options=options)
    next(stream)
elif mode == "thread":   # a daemon thread still generating (its cancel check never returns)
    started = threading.Event()
    def stuck() -> bool:
        started.set()
        time.sleep(120)
        return False
    threading.Thread(target=engine.generate, args=("one two three",), daemon=True,
                     kwargs={"max_tokens": 24, "method": "auto", "options": options, "cancel": stuck}).start()
    started.wait(60)
"""


def _exit_run(tiny_target, pool, mode: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(tiny_target), str(pool), mode],
                          capture_output=True, text=True, timeout=100)


def test_a_script_that_exits_without_close_saves_its_history(tiny_target, tmp_path) -> None:
    """Answers whose save was not yet due were saved only by close(): a script that never called it lost
    them; an open stream's own save ran while the interpreter tore its modules down (a traceback)."""
    closed = _exit_run(tiny_target, tmp_path / "closed.pool", "closed")
    left = _exit_run(tiny_target, tmp_path / "left.pool", "pending")
    assert closed.returncode == left.returncode == 0, left.stderr[-2000:]
    assert "pending True" in left.stdout   # else this test would not test the exit's save
    for suffix in ("", ".suffix"):
        assert (tmp_path / f"left.pool{suffix}").read_bytes() == (tmp_path / f"closed.pool{suffix}").read_bytes()
    stream = _exit_run(tiny_target, tmp_path / "stream.pool", "stream")
    assert stream.returncode == 0 and stream.stderr == "", stream.stderr[-2000:]
    assert (tmp_path / "stream.pool").stat().st_size > 0 and (tmp_path / "stream.pool.suffix").stat().st_size > 0


def test_an_exit_does_not_wait_for_a_generation_in_another_thread(tiny_target, tmp_path) -> None:
    """The exit's close skips an engine a daemon thread still generates with, and says so."""
    import time

    started = time.monotonic()
    run = _exit_run(tiny_target, tmp_path / "thread.pool", "thread")
    assert run.returncode == 0 and time.monotonic() - started < 60, run.stderr[-2000:]
    assert "still running in thread" in run.stderr and "not saved" in run.stderr


def _child_status(pid: int, seconds: float = 30) -> int:
    """A forked child's wait status; one still running after ``seconds`` is killed (status -9)."""
    import os
    import time

    for _ in range(int(seconds * 10)):
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            return status
        time.sleep(0.1)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return -9


def test_a_child_forked_while_another_thread_tokenized_closes_at_its_exit(tiny_target) -> None:
    """The child inherited the count of calls under way from a thread it does not have: the close at its
    exit waited for it forever."""
    import os
    import signal
    import threading
    import time

    from ouroboros_local import engine as engine_module

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    engine = make_engine(tiny_target)
    stop = threading.Event()

    def tokenize() -> None:
        while not stop.is_set():
            engine.tokenize(PROMPTS[0] * 200)

    worker = threading.Thread(target=tokenize)
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while not engine._users and time.monotonic() < deadline:   # fork inside a call
            time.sleep(0.001)
        pid = os.fork()
        if pid == 0:   # the child: what its interpreter's exit runs, then out (no pytest teardown here)
            signal.alarm(20)   # a hang ends the child with SIGALRM
            engine_module._close_at_exit()
            os._exit(0 if engine._closed else 3)
        assert os.waitstatus_to_exitcode(_child_status(pid)) == 0
    finally:
        stop.set()
        worker.join(30)
        engine.close()


def test_a_child_forked_while_another_thread_generated_is_refused_not_hung(tiny_target) -> None:
    """The engine's lock, held by the parent's generating thread, was waited for forever in the child."""
    import os
    import threading

    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    engine = make_engine(tiny_target)
    opened, done = threading.Event(), threading.Event()

    def hold() -> None:   # a stream open in another thread holds the engine
        stream = engine.stream(PROMPTS[0], max_tokens=8)
        next(stream)
        opened.set()
        done.wait(30)
        stream.close()

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert opened.wait(30)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: one line, then out (no pytest teardown here)
            try:
                engine.generate(PROMPTS[1], max_tokens=2)
                os.write(write, b"generated")
            except OuroborosError as exc:
                os.write(write, str(exc).encode()[:200])
            except BaseException:
                os.write(write, b"other error")
            finally:
                engine.close()
                os._exit(0)
        os.close(write)
        status = _child_status(pid)   # the child hung on the lock: ended after 30 s, the test failed
        said = os.read(read, 300).decode()
        os.close(read)
        assert status == 0 and "forked while another thread used this engine" in said, said
    finally:
        done.set()
        holder.join(30)
        engine.close()


def test_a_path_names_a_file_never_a_catalogue_model(tiny_target, tmp_path, monkeypatch) -> None:
    """Engine.load turned a Path into a str, so Path("smollm2-135m-instruct") went to the catalogue (a
    download, online) and a draft Path("auto") meant the target's default draft, not the file ./auto."""
    import shutil
    from pathlib import Path

    from ouroboros_local.errors import ModelError

    monkeypatch.setenv("OUROBOROS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="model file not found"):
        Engine.load(Path("smollm2-135m-instruct"))
    shutil.copy(tiny_target, tmp_path / "auto")
    with Engine.load(tiny_target, Path("auto"), n_ctx=64, calibration="off", threads=1) as engine:
        assert engine.draft is not None
    with pytest.raises(ParameterError, match="the target must be a GGUF path"):
        Engine.load(42)


@pytest.mark.parametrize("method, options", [("ouroboros", {}), ("lookahead", {"window": 8, "level": 5,
                                                                               "guess_set": 8})])
def test_window_methods_draft_to_the_end_of_a_context_sized_to_the_job(tiny_target, tiny_draft, method,
                                                                       options) -> None:
    """A tree (or the draft's window) that no longer fitted the cells left was dropped, and every later
    round was a plain step: at a context sized to prompt + answer, ouroboros took 31 passes for 21."""
    passes, answers = [], []
    for n_ctx in (256, 512):
        with make_engine(tiny_target, tiny_draft, n_ctx=n_ctx, n_batch=256, n_seq_max=16) as engine:
            prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 30, add_special=False)[:156]
            result = engine.generate(prompt, max_tokens=100, method=method, options=options)
            assert result.tokens == engine.generate(prompt, max_tokens=100).tokens
            passes.append(result.stats.target_passes)
            answers.append(result.tokens)
    assert answers[0] == answers[1] and len(answers[0]) == 100
    assert passes[0] <= passes[1] + 3, passes


def test_auto_keeps_copy_drafting_once_its_draft_models_context_is_full(tiny_target, tiny_draft) -> None:
    """The draft model's full context stopped every drafter for the rest of the answer: with the draft
    loaded, auto took more passes than without one."""
    def run(draft, **cfg) -> Any:
        with make_engine(tiny_target, draft, n_ctx=1024, **cfg) as engine:
            prompt = engine.tokenize("def add(a, b):\n    return a + b\n\n" * 100, add_special=False)[:200]
            result = engine.generate(prompt, max_tokens=400, method="auto")
            assert result.tokens == engine.generate(prompt, max_tokens=400).tokens
            return result.stats

    full = run(tiny_draft, draft_n_ctx=256)
    alone = run(None)
    assert full.extra["draft_context_full"] == ["speculative"]
    assert full.target_passes <= alone.target_passes * 1.1, (full.target_passes, alone.target_passes)


def test_the_api_contract_an_app_relies_on(tiny_target, tmp_path) -> None:
    """A config changed after it was built skipped its checks (10**11 threads aborted the process); public
    calls raised AssertionError, AttributeError or pickling's TypeError; to_dict() shared its tokens."""
    import dataclasses
    import pickle
    from pathlib import Path

    import ouroboros_local
    from ouroboros_local.engine import EngineConfig

    config = EngineConfig(n_ctx=256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.threads = 10**11
    assert (Path(ouroboros_local.__file__).parent / "py.typed").is_file()   # type checkers read the hints
    with make_engine(tiny_target) as engine:
        with pytest.raises(ParameterError, match="a sequence of token ids") as exc:
            engine.detokenize("abc")
        assert "a str" not in str(exc.value)   # "must be a str or ... (got str)"
        with pytest.raises(ParameterError, match="no draft model"):
            engine.calibration_settings(draft=True)
        with pytest.raises(ParameterError, match="takes a Learning"):
            engine.swap_learning(None)
        with pytest.raises(OuroborosError, match="load one in each process"):
            pickle.dumps(engine)
        result = engine.generate(PROMPTS[0], max_tokens=4)
        as_dict = result.to_dict()
        as_dict["tokens"].clear()
        assert len(result.tokens) == 4
    with pytest.raises(ParameterError, match="EngineConfig's are n_ctx, n_batch"):
        Engine.load(tiny_target, nctx=512)


def test_an_engine_dropped_without_close_is_freed_at_once_and_saves_its_history(tiny_target, tmp_path) -> None:
    """Its history held it through a bound method: a dropped engine kept its model and KV cache until a
    full garbage collection, and one collected lost the answers whose save was not yet due."""
    import gc
    import weakref

    def answers(engine: Engine, pool: Path) -> None:
        for prompt in PROMPTS:
            engine.generate(prompt, max_tokens=16, method="suffix", options={"pool": str(pool)})
        assert engine.history.pending   # else this test would not test the dropped engine's save

    from pathlib import Path

    with make_engine(tiny_target) as closed:
        answers(closed, tmp_path / "closed.pool")
    gc.disable()
    try:
        engine = make_engine(tiny_target)
        answers(engine, tmp_path / "dropped.pool")
        gone = weakref.ref(engine)
        del engine
        assert gone() is None   # freed by its count, no collection needed
    finally:
        gc.enable()
    assert (tmp_path / "dropped.pool.suffix").read_bytes() == (tmp_path / "closed.pool.suffix").read_bytes()


def test_a_stream_closed_early_saves_when_due_and_close_frees_the_history(tiny_target, tmp_path) -> None:
    """Each early close wrote the whole history (0.7 s for a large pool, every stop button press), where a
    finished answer's save waits until due; a closed engine kept its history's memory."""
    pool = str(tmp_path / "early.pool")
    engine = make_engine(tiny_target)
    engine.generate(PROMPTS[0], max_tokens=8, method="suffix", options={"pool": pool})   # the first save
    engine.history._save_seconds = 3600.0   # as a large pool's save: the next is due in 20 hours
    stream = engine.stream(PROMPTS[1], max_tokens=16, method="suffix", options={"pool": pool})
    next(stream)
    stream.close()
    assert engine.history.pending   # left for close, as a finished answer's would be
    engine.close()
    assert not engine.history.pending and engine.history.suffix_cache is None


def test_reprs_are_bounded_and_say_what_a_notebook_needs(tiny_target) -> None:
    """A notebook cell showing a long answer printed every token id and the whole text (a megabyte for
    100k tokens); an engine's repr named neither its models nor whether it was open."""
    import pydoc

    from ouroboros_local.engine import EngineConfig, GenerationResult, GenerationStats, StreamEvent

    long = GenerationResult("x" * 100_000, list(range(100_000)), GenerationStats(method="auto"))
    assert len(repr(long)) < 400 and "100000 tokens" in repr(long) and "100000 characters" in repr(long)
    assert len(repr(StreamEvent("y" * 5000, list(range(5000)), long))) < 800
    engine = make_engine(tiny_target)
    assert repr(engine) == f"<Engine target={tiny_target.name!r}, n_ctx={engine.config.n_ctx}, open>"
    engine.close()
    assert repr(engine).endswith("closed>")
    described = pydoc.render_doc(EngineConfig)
    assert all(f"{name}:" in described or f"{name}," in described
               for name in ("draft_n_ctx", "max_draft", "threads_batch", "calibration", "round_switch"))
