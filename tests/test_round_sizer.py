"""Rounds of one size or plain steps (round_sizer.py, EngineConfig.round_switch): the sizer on its own,
and an engine whose rounds of 4 give way to plain steps and back, its outputs unchanged."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from ouroboros_local.engine import Engine
from ouroboros_local.calibration import SWITCH_STEPS, CostModel
from ouroboros_local.round_sizer import NOISE_STEPS, TIMED_MIN, TIMED_WINDOW, RoundSizer
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.lossless import assert_greedy_equals_vanilla, assert_seeded_equals_vanilla

K = 4


def rounds_of_k(sizer: RoundSizer, written: int, n: int, seconds: float | None = None) -> None:
    for _ in range(n):
        sizer.observe(K, [], list(range(written)), seconds)


def test_rounds_that_lose_give_way_once_the_loss_passes_a_change_there_and_back() -> None:
    """A round of 4 writing 1 token for 1.33 steps loses 0.25 of a step; with a change costing 2 steps,
    plain steps begin once the rounds have lost 2 x 2 + NOISE_STEPS = 5 steps."""
    sizer = RoundSizer(K, cost_ratio=1.33, switch_steps=2.0)
    assert sizer.size() == K and sizer.threshold == 4.0 + NOISE_STEPS   # as without the sizer
    rounds_of_k(sizer, 1, 20)                       # 20 x 0.248 = 4.96 steps lost
    assert sizer.size() == K
    rounds_of_k(sizer, 1, 1)
    assert sizer.size() == 1 and sizer.changes == 1 and sizer.balance == 0.0
    paying = RoundSizer(K, cost_ratio=1.33, switch_steps=2.0)
    for _ in range(30):                             # losses and gains in turn: what they save absorbs it
        rounds_of_k(paying, 1, 1)
        rounds_of_k(paying, 2, 1)
    assert paying.size() == K and paying.changes == 0


def test_a_plain_step_counts_what_its_round_would_have_written() -> None:
    """A stand-in's guesses meet the tokens written after its root: its round would have written one
    token more than the leading guesses that match them, at most K."""
    sizer = RoundSizer(K, cost_ratio=1.0, switch_steps=10.0)
    sizer.plain = True
    sizer.observe(1, [7, 8, 9], [7])                # the first guess meets this step's token
    assert sizer._pending and sizer.balance == 0.0   # not judged until a guess misses or all three match
    sizer.observe(1, [1, 1, 1], [8])                # this one misses at once: 1 token, nothing saved
    sizer.observe(1, [2, 2, 2], [5])                # the first misses 9: 3 tokens, 2 steps saved
    assert sizer.balance == pytest.approx(2.0)
    assert sizer.plain_rounds == 3 and not sizer._pending and sizer.size() == 1


def test_a_copy_resumes_rounds_of_k_once_its_stand_ins_would_have_saved_a_change_there_and_back() -> None:
    sizer = RoundSizer(K, cost_ratio=4 / 3, switch_steps=1.0)   # a whole stand-in saves 2 steps; 3 needed
    sizer.plain = True
    for token in (1, 2, 3):                         # a text copied: each stand-in guesses what follows
        sizer.observe(1, [token, token + 1, token + 2], [token])
    assert sizer.size() == 1 and sizer.balance == pytest.approx(2.0)    # one stand-in judged, whole
    sizer.observe(1, [4, 5, 6], [4])                # a second: 4 steps saved
    assert sizer.size() == K and sizer.changes == 1


def test_a_new_request_keeps_the_size_and_forgets_its_stand_ins() -> None:
    sizer = RoundSizer(K, cost_ratio=1.33)
    rounds_of_k(sizer, 1, 12)
    sizer.observe(1, [3, 3, 3], [3])
    sizer.begin_request()
    assert sizer.size() == 1 and not sizer._pending and sizer.plain_rounds == sizer.changes == 0


def test_rounds_timed_dearer_than_calibrated_give_way_to_plain_steps() -> None:
    """The H200's 1.5B: calibrated, a round of 4 cost 1.3 plain steps; in the loop it took 1.7, and rounds
    writing 1.6 tokens went on at 0.90-0.94x of plain decoding. Timed, they give way; the decodes after a
    change of shape (no CUDA graph yet) are not timed."""
    calibrated = RoundSizer(K, cost_ratio=1.3, plain_seconds=1.0)
    rounds_of_k(calibrated, 2, SWITCH_STEPS, seconds=9.0)            # a new shape: the switch's cost
    assert calibrated.size() == K and calibrated.cost_ratio == 1.3
    for _ in range(40):                                             # 1.6 tokens a round of 1.7 steps
        rounds_of_k(calibrated, 2, 3, seconds=1.7)
        rounds_of_k(calibrated, 1, 2, seconds=1.7)
    assert calibrated.cost_ratio == pytest.approx(1.7)              # against the calibrated plain step
    assert calibrated.size() == 1 and calibrated.changes == 1
    # plain steps timed in turn: the ratio is both sizes' own
    for token in range(SWITCH_STEPS + TIMED_MIN):
        calibrated.observe(1, [0, 0, 0], [token + 1], 0.85)
    assert calibrated.cost_ratio == pytest.approx(2.0)
    # without a calibrated plain step, rounds timed alone keep the calibrated ratio
    alone = RoundSizer(K, cost_ratio=1.3)
    rounds_of_k(alone, 2, 20, seconds=1.7)
    assert alone.cost_ratio == 1.3 and alone.size() == K


def test_one_slow_round_does_not_stop_rounds_that_pay() -> None:
    """A 30 ms stall (a pause, another process) among the first rounds timed made the ratio 20 and put a
    copying method into plain steps for the engine's life: the median of the last rounds ignores it, and
    a round of K never counts as dearer than K plain steps."""
    sizer = RoundSizer(K, cost_ratio=1.3, switch_steps=2.0, plain_seconds=0.001)
    for seconds in [0.0013] * SWITCH_STEPS + [0.030] + [0.0013] * 40:
        sizer.observe(K, [], [1, 2, 3, 4], seconds)
    assert sizer.size() == K and sizer.changes == 0 and sizer.timed_ratio == pytest.approx(1.3)
    stalled = RoundSizer(K, cost_ratio=1.3, plain_seconds=0.001)
    rounds_of_k(stalled, 4, SWITCH_STEPS + TIMED_MIN, seconds=0.030)
    assert stalled.timed_ratio == K


def test_rounds_of_k_are_timed_before_they_are_left() -> None:
    """A calibration that overprices rounds (3 steps where they take 1.3) put the sizer in plain steps
    after four rounds, none of them timed, and nothing timed them again."""
    sizer = RoundSizer(K, cost_ratio=3.0, plain_seconds=1.0)
    rounds_of_k(sizer, 2, 20, seconds=1.3)
    assert sizer.size() == K and sizer.changes == 0 and sizer.cost_ratio == pytest.approx(1.3)
    untimed = RoundSizer(K, cost_ratio=3.0)     # a caller that times nothing sizes as calibrated
    rounds_of_k(untimed, 2, 4)
    assert untimed.size() == 1 and untimed.timed_ratio is None


def test_rounds_given_up_in_a_slow_spell_come_back() -> None:
    """Rounds of K timed in a slow spell (30 steps each, counted as K) give way; while plain steps decode they are not
    timed again, and each request forgives half of what they exceed the calibration by, until stand-ins
    that would have written K tokens bring them back."""
    sizer = RoundSizer(K, cost_ratio=1.3, plain_seconds=1.0)
    rounds_of_k(sizer, 1, SWITCH_STEPS + TIMED_WINDOW, seconds=30.0)
    assert sizer.size() == 1 and sizer.timed_ratio == K
    for request in range(8):
        sizer.begin_request()
        for token in range(40):                   # a copy: every stand-in's guesses come true
            sizer.observe(1, [token, token + 1, token + 2], [token], 1.0)
        if sizer.size() == K:
            break
    assert sizer.size() == K and request == 4      # the ratio forgiven: 30, 15.7, 8.5, 4.9, 3.1
    few = RoundSizer(K, cost_ratio=1.3, plain_seconds=1.0)    # fewer rounds timed than the window holds
    rounds_of_k(few, 1, SWITCH_STEPS + TIMED_MIN, seconds=30.0)
    few.begin_request()
    few.begin_request()
    assert few._ratio() == pytest.approx(1.3 + 0.5 * (30 - 1.3))   # each of its times scaled, once


def test_a_request_begins_a_new_shape_and_other_sizes_are_not_timed() -> None:
    sizer = RoundSizer(K, cost_ratio=1.3, plain_seconds=1.0)
    rounds_of_k(sizer, 2, SWITCH_STEPS + TIMED_MIN, seconds=2.0)
    assert sizer.cost_ratio == pytest.approx(2.0)
    sizer.begin_request()                                           # after the prompt's decode
    rounds_of_k(sizer, 2, SWITCH_STEPS, seconds=50.0)
    sizer.observe(3, [], [1, 2], 50.0)                               # the answer's last round: 3 tokens
    assert sizer.cost_ratio == pytest.approx(2.0)


@pytest.fixture(scope="module")
def switching_engine(tiny_target):
    """Rounds of 4 drafting while they decode, a sizer that finds them dear (3 steps a round; what they
    take here is not timed)."""
    engine = tiny_engine(tiny_target, overlap=True, round_size=K)
    sizers: dict[str, RoundSizer] = {}

    def sizer(proposer) -> RoundSizer | None:
        if proposer.name == "vanilla":
            return None
        if proposer.name not in sizers:
            sizers[proposer.name] = RoundSizer(K, cost_ratio=3.0)
            sizers[proposer.name]._time = lambda decoded, seconds: None
        return sizers[proposer.name]

    engine._round_sizer = sizer
    yield engine
    engine.close()


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "Once upon a time"]


@pytest.mark.parametrize("method", ["prompt-lookup", "suffix", "auto"])
def test_plain_steps_between_rounds_of_k_leave_greedy_output_unchanged(switching_engine: Engine,
                                                                       method: str) -> None:
    # (not the third prompt: a round of 4 can decode the end-of-generation token its answer stops at,
    # which then stays in the cache past the answer, as in rounds of 4 without plain steps)
    assert_greedy_equals_vanilla(switching_engine, PROMPTS[:2], method, max_tokens=48)
    # text not answered before (auto and suffix copy whole earlier answers, in rounds of 4 throughout)
    fresh = f"Seven notes on {method}:"
    answer = switching_engine.generate(fresh, max_tokens=48, method=method)
    assert answer.tokens == switching_engine.generate(fresh, max_tokens=48).tokens
    assert 0 < answer.stats.extra["round_switch"]["plain_rounds"] <= answer.stats.target_passes


def test_the_engine_sizes_rounds_from_the_calibrated_costs(tiny_target) -> None:
    """Only where both costs were measured back to back: a flat stand-in curve, or round_switch off,
    leave every round K tokens."""
    auto = SimpleNamespace(name="auto", drafts_ahead=True)
    vanilla = SimpleNamespace(name="vanilla", drafts_ahead=True)
    with tiny_engine(tiny_target, overlap=True, round_size=K) as flat:
        assert flat._round_sizer(auto) is None                  # calibration off
    with tiny_engine(tiny_target, overlap=True, round_size=K, calibration="auto") as engine:
        curve = CostModel(sizes=[1, 8], seconds=[1.0, 2.0], switch_seconds=0.5)
        engine.scheduler().costs = curve.with_rounds_of(K, 1.5)
        sizer = engine._round_sizer(auto)
        assert sizer is not None and sizer.cost_ratio == pytest.approx(1.5) and sizer.calibrated_plain == 1.0
        assert sizer.threshold == pytest.approx(2 * 0.5 + NOISE_STEPS)
        assert engine._round_sizer(auto) is sizer               # one per method, kept across requests
        assert engine._round_sizer(vanilla) is None
        engine.config = replace(engine.config, round_switch=False)
        assert engine._round_sizer(auto) is None


def test_the_engine_times_its_rounds_for_the_sizer(tiny_target) -> None:
    """A curve that calls rounds of 4 as cheap as a plain step, whose plain step takes a microsecond: the
    rounds the loop times cost far more, and plain steps take over (with the calibrated ratio alone,
    every round of 4 would pay)."""
    with tiny_engine(tiny_target, overlap=True, round_size=K, calibration="auto") as engine:
        engine.scheduler().costs = CostModel(sizes=[1, 8], seconds=[1e-6, 1e-6]).with_rounds_of(K, 1e-6)
        answer = engine.generate(PROMPTS[1], max_tokens=48, method="prompt-lookup")
        switch = answer.stats.extra["round_switch"]
        # (the ratio in the end is both sizes' own: near 1 for a tiny model, whose steps are all Python)
        assert switch["calibrated_ratio"] == 1.0 and switch["timed_ratio"] not in (None, 1.0)
        assert switch["plain_rounds"] > 0
        assert answer.tokens == engine.generate(PROMPTS[1], max_tokens=48).tokens


def test_a_curve_in_rounds_of_k_keeps_how_it_was_got() -> None:
    """bench's settings.cost_curves said origin "" in rounds of one size, the mode it was added for."""
    curve = CostModel(sizes=[1, 8], seconds=[1.0, 2.0])
    curve.__dict__["_origin"] = "cached, checked"
    assert curve.with_rounds_of(K, 1.5).origin == "cached, checked"


def test_seeded_sampling_is_unchanged_by_plain_steps_between_rounds_of_k(switching_engine: Engine) -> None:
    """Each emitted token consumes one uniform, whether a plain step or a round of 4 wrote it."""
    answers = assert_seeded_equals_vanilla(switching_engine, PROMPTS[:2])
    assert sum(a.stats.extra["round_switch"]["plain_rounds"] for a in answers) > 0


def test_a_first_generation_measures_the_costs_before_it_takes_the_engine(tiny_target) -> None:
    """The sizer needs the calibrated costs; measuring them takes the engine's lock, which a generation
    holds: a fresh engine's first generation in rounds of 4 (a method without a scheduler of its own)
    must measure first, not wait for itself."""
    import threading

    engine = tiny_engine(tiny_target, overlap=True, round_size=K, calibration="auto")
    answers = []
    worker = threading.Thread(target=lambda: answers.append(
        engine.generate(PROMPTS[0], max_tokens=16, method="prompt-lookup")), daemon=True)
    worker.start()
    worker.join(timeout=120)
    if not answers:   # the engine stays open: closing it would wait for the same lock
        pytest.fail("the generation waited for the engine's lock, which it held")
    engine.close()
    assert "round_switch" in answers[0].stats.extra


def test_a_draft_model_runs_in_rounds_of_k_under_the_calibrated_costs(tiny_target, tiny_draft) -> None:
    """The GPU defaults (rounds of 4, drafting while they decode, costs calibrated, the round switch on)
    with a draft model: whether its drafts ride a plain step depends on the request's sampling, which
    the proposer learns only when its generation begins, after the sizer was asked. ``speculative``
    raised there (AttributeError) on every request; now greedy runs equal plain decoding with the
    sizer, and sampled ones without a seed run without it (a sampled draft does not draft ahead; with
    a seed the draft is greedy, so that the text repeats)."""
    with tiny_engine(tiny_target, tiny_draft, overlap=True, round_size=K, calibration="auto") as engine:
        prompt = PROMPTS[1]
        greedy = engine.generate(prompt, max_tokens=24, method="speculative")
        assert greedy.tokens == engine.generate(prompt, max_tokens=24).tokens
        assert "round_switch" in greedy.stats.extra
        sampled = engine.generate(prompt, max_tokens=24, method="speculative", sampling={"temperature": 0.8})
        # (unseeded, it may draw the end token: 20 tokens once in ~10 runs)
        assert sampled.finish_reason in ("length", "stop") and "round_switch" not in sampled.stats.extra
        seeded = {"temperature": 0.8, "seed": 7}
        sampled = engine.generate(prompt, max_tokens=24, method="speculative", sampling=seeded)
        # (its text is seeded plain decoding's up to the batch shapes' rounding, which the switch picks
        # by timings here: tests/test_engine.py checks it where the shapes are fixed)
        assert sampled.stats.tokens == 24 and "round_switch" in sampled.stats.extra
