"""scripts/replay_auto.py: method auto replayed on recorded answers, with a cost curve as the clock."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ouroboros_local.calibration import CostModel

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "replay_auto.py"
spec = importlib.util.spec_from_file_location("replay_auto", SCRIPT)
replay_auto = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_auto)

GPU_LIKE = CostModel(sizes=[1, 64], seconds=[1.0, 1.2])           # verification nearly free
CPU_STEEP = CostModel(sizes=[1, 2, 17], seconds=[1.0, 2.0, 17.0])  # n tokens cost n steps: nothing pays
MID = CostModel(sizes=[1, 2, 17], seconds=[1.0, 1.6, 5.0])         # verifying 16 tokens costs 5 steps


def answers() -> list[dict]:
    prompt = list(range(1000, 1100))
    copy = {"set": "copy", "id": "c", "prompt": prompt, "answer": prompt[10:70]}   # the answer copies the prompt
    fresh = {"set": "fresh", "id": "f", "prompt": prompt, "answer": list(range(2000, 2060))}   # nothing to copy
    return [copy, fresh]


def test_a_replay_writes_the_recorded_answers_and_pays_where_they_copy() -> None:
    out = replay_auto.replay(answers(), ["copy", "fresh"], GPU_LIKE, noise=0.0, seed=0, limit=16,
                             max_tokens=128, max_draft=16)
    speedup, counts = out["copy"]
    assert speedup > 3 and counts["accepted"] > 40          # long copies, verified almost for free
    speedup, counts = out["fresh"]
    assert counts["accepted"] == 0 and 0.8 < speedup <= 1.0  # nothing to copy: plain steps, a few probes


def test_where_verification_costs_what_it_checks_nothing_is_drafted_for_long() -> None:
    out = replay_auto.replay(answers(), ["fresh", "copy"], CPU_STEEP, noise=0.1, seed=1, limit=16,
                             max_tokens=128, max_draft=16)
    for speedup, counts in out.values():
        assert speedup > 0.9 and counts["drafted"] < 20


def test_a_set_replayed_twice_is_labelled_by_pass() -> None:
    out = replay_auto.replay(answers(), ["copy", "copy"], GPU_LIKE, noise=0.0, seed=0, limit=16,
                             max_tokens=128, max_draft=16)
    assert list(out) == ["copy (pass 1)", "copy (pass 2)"]


@pytest.mark.parametrize("method", ["prompt-lookup", "suffix"])
def test_a_scheduled_method_is_replayed_through_the_scheduler(method: str) -> None:
    out = replay_auto.replay(answers(), ["copy", "fresh"], GPU_LIKE, noise=0.0, seed=0, limit=16,
                             max_tokens=128, max_draft=16, method=method)
    assert out["copy"][0] > 3 and out["fresh"][1]["accepted"] == 0
    out = replay_auto.replay(answers(), ["fresh", "copy"], CPU_STEEP, noise=0.0, seed=0, limit=16,
                             max_tokens=128, max_draft=16, method=method)
    assert all(speedup > 0.9 and counts["drafted"] < 20 for speedup, counts in out.values())


def mid_copies() -> list[dict]:
    """Four answers that copy 60 tokens of their prompts (each prompt its own tokens)."""
    return [{"set": "copy", "id": f"c{i}", "prompt": list(range(1000 + 200 * i, 1100 + 200 * i)),
             "answer": list(range(1010 + 200 * i, 1070 + 200 * i))} for i in range(4)]


def test_a_session_that_starts_from_learned_estimates_drafts_sooner() -> None:
    # what a later process gets (learned.py): estimates learned on other copies, no shared history
    copies = mid_copies()
    run = dict(curve=MID, noise=0.0, seed=0, limit=16, max_tokens=128, max_draft=16, priors=0.0)
    cold = replay_auto.replay(copies, ["copy:2"], **run)["copy:2"]
    learned: dict = {}
    replay_auto.replay(copies, ["copy:1"], **run, learned=learned)
    assert {"prompt-lookup", "suffix"} <= set(learned["estimates"])
    warm = replay_auto.replay(copies, ["copy:2"], **run, learned=learned)["copy:2"]
    assert warm[1]["rounds"] < cold[1]["rounds"] and warm[0] > 1.05 * cold[0]


def test_a_fresh_process_per_answer_learns_nothing_from_the_last() -> None:
    run = dict(curve=MID, noise=0.0, seed=0, limit=16, max_tokens=128, max_draft=16)
    copies = mid_copies()
    alone = [replay_auto.replay([c], ["copy"], **run)["copy"][1]["rounds"] for c in copies]
    assert replay_auto.replay(copies, ["copy"], **run, fresh_each=True)["copy"][1]["rounds"] == sum(alone)
    assert replay_auto.replay(copies, ["copy"], **run)["copy"][1]["rounds"] < sum(alone)


def test_the_copy_priors_make_a_fresh_process_draft_sooner() -> None:
    run = dict(curve=MID, noise=0.0, seed=0, limit=16, max_tokens=128, max_draft=16, fresh_each=True)
    generic = replay_auto.replay(mid_copies(), ["copy"], **run, priors=0.0)["copy"]
    shipped = replay_auto.replay(mid_copies(), ["copy"], **run)["copy"]
    assert shipped[1]["rounds"] < generic[1]["rounds"] and shipped[0] > generic[0]


def test_the_scheduler_sees_proposals_at_the_python_scale_asked() -> None:
    # --python-scale: a real run's Python runs with the caches cold; proposals that look dear enough to
    # the scheduler are drafted less (here a lookup of microseconds made to look like seconds: at 1e6 a
    # draft token ~2.5 s against a 1 s step; at 1e5, ~0.25 s, a 16-token copy still pays, 5 s + 4 s of
    # drafting against 17 steps, and is drafted once an early look finds it)
    sets = answers()[1:] + mid_copies()                  # text with nothing to copy first: lookups timed
    run = dict(curve=MID, noise=0.0, seed=0, limit=16, max_tokens=128, max_draft=16)
    as_timed = replay_auto.replay(sets, ["fresh", "copy"], **run)["copy"]
    dear = replay_auto.replay(sets, ["fresh", "copy"], **run, python_scale=1e6)["copy"]
    assert dear[1]["drafted"] < as_timed[1]["drafted"] / 2 and dear[0] < as_timed[0]


def test_charged_python_counts_on_the_clock() -> None:
    run = dict(curve=GPU_LIKE, noise=0.0, seed=0, limit=16, max_tokens=128, max_draft=16, python_scale=1e4)
    free = replay_auto.replay(answers(), ["fresh"], **run)["fresh"][0]
    charged = replay_auto.replay(answers(), ["fresh"], **run, charge_python=True)["fresh"][0]
    assert charged < 0.9 * free


def test_the_gpu_clock_charges_shape_changes_and_prices_as_told() -> None:
    h200 = {"sizes": [1, 2, 8], "seconds": [4.2, 4.7, 4.7], "step": 1.35}
    clock = replay_auto.ShapeClock(CostModel(sizes=h200["sizes"], seconds=h200["seconds"]), h200["step"])
    # a drafted round, then plain steps: two without the CUDA graph, then with it
    assert [clock(n) for n in (1, 1, 1, 8, 1, 1, 1)] == pytest.approx([4.2, 4.2, 1.35, 4.7, 4.2, 4.2, 1.35])
    assert clock.priced(old=True).cost(1) == 4.2
    new = clock.priced(old=False)
    assert new.cost(1) == 1.35 and new.switch_seconds == pytest.approx(2 * (4.2 - 1.35))
    old = replay_auto.replay(answers(), ["fresh"], GPU_LIKE, noise=0.0, seed=0, limit=16, max_tokens=128,
                             max_draft=16, gpu={**h200, "old": True})
    assert old["fresh"][0] < 1.0     # fresh text, probes priced as nearly free: each costs ~3 plain steps


def test_a_rounds_cost_noise_averages_to_the_curve() -> None:
    # exp(N(0, sigma)) averages exp(sigma^2 / 2): 1.011 at sigma 0.15, a replayed speed-up read 1% low
    rng = np.random.default_rng(0)
    factors = [replay_auto.round_noise(rng, 0.15) for _ in range(200_000)]
    assert abs(np.mean(factors) - 1.0) < 0.002
    assert replay_auto.round_noise(rng, 0.0) == 1.0


def test_a_replay_on_the_stand_in_clock_decides_alike_every_time() -> None:
    # --clock-step: what the scheduler times of its drafting no longer moves between runs, so two versions
    # of the code that decide alike print the same table (how a refactor is checked to change nothing)
    import time

    run = dict(curve=MID, noise=0.1, seed=3, limit=16,
               max_tokens=128, max_draft=16, python_scale=1e3, charge_python=True)   # timed: 1.81x, 1.93x
    outs = []
    for _ in range(2):
        with replay_auto.stand_in_clock(2e-5):
            outs.append(replay_auto.replay(answers(), ["copy", "fresh", "copy"], **run))
    assert outs[0] == outs[1]
    assert time.perf_counter() > 1.0 and time.perf_counter() != time.perf_counter()   # the real clock is back
