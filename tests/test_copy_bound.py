"""scripts/copy_bound.py: the replay that bounds what copying drafts can gain on a cost curve."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "copy_bound.py"
spec = importlib.util.spec_from_file_location("copy_bound", SCRIPT)
copy_bound = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copy_bound)

FLAT = lambda n: 1.0            # noqa: E731  verification as cheap as a step
LINEAR = lambda n: float(n)     # noqa: E731  verification as dear as n steps: nothing can pay


def test_longest_match_prefers_the_longest_then_the_most_recent() -> None:
    assert copy_bound.longest_match([1, 2, 3, 9, 2, 3, 7, 1, 2, 3]) == (3, 2)
    assert copy_bound.longest_match([5, 3, 4, 3]) == (1, 1)
    assert copy_bound.longest_match([1, 2, 3]) == (0, -1)


def test_copy_events_count_how_far_a_copy_is_right() -> None:
    prompt = [10, 11, 12, 13, 14]
    answer = [11, 12, 13, 99]
    events = copy_bound.copy_events(prompt, answer)
    # at t=1 the context ends "...11" (a 1-token match at prompt[1]); the copy 12, 13, 14 is right twice
    assert events[1] == (1, 2)
    assert events[3][1] == 0            # 99 follows nowhere


def test_replay_bounds() -> None:
    prompt = list(range(100, 140))
    answers = [copy_bound.copy_events(prompt, list(range(101, 131)))]   # the answer copies the prompt
    oracle = lambda bucket, run: min(run, 8)  # noqa: E731
    assert copy_bound.replay(answers, FLAT, oracle) > 5        # long right copies, near-free verification
    assert copy_bound.replay(answers, LINEAR, oracle) == pytest.approx(1.0, abs=0.05)
    assert copy_bound.replay(answers, LINEAR, lambda bucket, run: 0) == 1.0
    policy = copy_bound.fit(answers, LINEAR)
    assert all(k == 0 for k in policy.values())                # when nothing pays, the fit drafts nothing
    assert max(copy_bound.fit(answers, FLAT).values()) == copy_bound.MAX_DRAFT


def test_fit_drafts_up_to_the_longest_draft_asked() -> None:
    prompt = list(range(100, 160))
    answers = [copy_bound.copy_events(prompt, list(range(101, 151)))]  # a 50-token copy
    assert max(copy_bound.fit(answers, FLAT).values()) == copy_bound.MAX_DRAFT
    assert max(copy_bound.fit(answers, FLAT, max_draft=15).values()) == 15
