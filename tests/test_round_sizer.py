"""Rounds of one size or plain steps (round_sizer.py, EngineConfig.round_switch): the sizer on its own,
and an engine whose rounds of 4 give way to plain steps and back, its outputs unchanged."""

from __future__ import annotations

import pytest

from ouroboros_local.engine import Engine
from ouroboros_local.round_sizer import RESUME_MARGIN, WEIGHT, RoundSizer
from ouroboros_local.testing.engines import tiny_engine
from ouroboros_local.testing.lossless import assert_greedy_equals_vanilla, assert_seeded_auto_equals_vanilla

K = 4


def rounds_of_k(sizer: RoundSizer, written: int, n: int) -> None:
    for _ in range(n):
        sizer.observe(K, [], list(range(written)))


def test_rounds_that_write_less_than_they_cost_give_way_to_plain_steps() -> None:
    sizer = RoundSizer(K, cost_ratio=1.33)
    assert sizer.size() == K                        # as without the sizer, until rounds are counted
    rounds_of_k(sizer, 1, 2)
    assert sizer.size() == K                        # 4 -> 3.4 -> 2.9 tokens: still above 1.33
    rounds_of_k(sizer, 1, 10)
    assert sizer.size() == 1 and sizer.changes == 1
    cheap = RoundSizer(K, cost_ratio=1.33)
    rounds_of_k(cheap, 2, 30)                       # 2 tokens a round for 1.33 steps: they pay
    assert cheap.size() == K and cheap.changes == 0


def test_a_plain_step_counts_what_its_round_would_have_written() -> None:
    """A stand-in's guesses meet the tokens written after its root: its round would have written one
    token more than the leading guesses that match them, at most K."""
    sizer = RoundSizer(K, cost_ratio=1.0)
    sizer.plain, sizer.tokens = True, 2.0
    sizer.observe(1, [7, 8, 9], [7])                # the first guess meets this step's token
    assert sizer._pending and sizer.tokens == 2.0    # not judged until a guess misses or all three match
    sizer.observe(1, [1, 1, 1], [8])                # this one misses at once: 1; the first matches 8
    sizer.observe(1, [2, 2, 2], [5])                # the first misses 9: 3; this one: 1
    expected = 2.0
    for written in (1, 3, 1):
        expected += WEIGHT * (written - expected)
    assert sizer.tokens == pytest.approx(expected)
    assert sizer.plain_rounds == 3 and not sizer._pending


def test_a_stand_in_that_matches_whole_resumes_rounds_of_k_at_once() -> None:
    sizer = RoundSizer(K, cost_ratio=2.0)
    rounds_of_k(sizer, 1, 20)
    assert sizer.size() == 1
    sizer.observe(1, [5, 6, 7], [5])
    sizer.observe(1, [0, 0, 0], [6])
    assert sizer.size() == 1
    sizer.observe(1, [0, 0, 0], [7])                 # the first stand-in's guesses all matched: the
    assert sizer.size() == K                         # average alone (~1.5 tokens) would keep plain steps
    assert sizer.tokens == pytest.approx(2.0 * (1 + RESUME_MARGIN))


@pytest.mark.parametrize("plain, rate, after", [
    (False, 1.05, K), (False, 0.99, 1),              # rounds of K stop once they write less than they cost
    (True, 1.05, 1), (True, 1.11, K),                # plain steps give way only past RESUME_MARGIN
])
def test_between_the_margins_the_size_holds(plain: bool, rate: float, after: int) -> None:
    sizer = RoundSizer(K, cost_ratio=2.0)
    sizer.plain, sizer.tokens = plain, 2.0 * rate
    sizer._decide()
    assert sizer.size() == after


def test_a_new_request_keeps_the_size_and_forgets_its_stand_ins() -> None:
    sizer = RoundSizer(K, cost_ratio=1.33)
    rounds_of_k(sizer, 1, 12)
    sizer.observe(1, [3, 3, 3], [3])
    sizer.begin_request()
    assert sizer.size() == 1 and not sizer._pending and sizer.plain_rounds == sizer.changes == 0


@pytest.fixture(scope="module")
def switching_engine(tiny_target):
    """Rounds of 4 drafting while they decode, a sizer that finds them dear (3 steps a round)."""
    engine = tiny_engine(tiny_target, overlap=True, round_size=K)
    sizers: dict[str, RoundSizer] = {}

    def sizer(method: str, round_size: int) -> RoundSizer:
        found = sizers.setdefault(method, RoundSizer(round_size, cost_ratio=3.0))
        found.begin_request()
        return found

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
    from ouroboros_local.calibration import CostModel

    with tiny_engine(tiny_target, overlap=True, round_size=K) as flat:
        assert flat._round_sizer("auto", K) is None            # calibration off
    with tiny_engine(tiny_target, overlap=True, round_size=K, calibration="auto") as engine:
        engine.scheduler().costs = CostModel(sizes=[1, 8], seconds=[1.0, 2.0]).with_rounds_of(K, 1.5)
        sizer = engine._round_sizer("auto", K)
        assert sizer is not None and sizer.cost_ratio == pytest.approx(1.5)
        assert engine._round_sizer("auto", K) is sizer          # one per method, kept across requests
        engine.config.round_switch = False
        assert engine._round_sizer("auto", K) is None


def test_seeded_sampling_is_unchanged_by_plain_steps_between_rounds_of_k(switching_engine: Engine) -> None:
    """Each emitted token consumes one uniform, whether a plain step or a round of 4 wrote it."""
    answers = assert_seeded_auto_equals_vanilla(switching_engine, PROMPTS[:2])
    assert sum(a.stats.extra["round_switch"]["plain_rounds"] for a in answers) > 0
