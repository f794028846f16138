"""Looks at cheap drafters whose drafts do not pay (looks.py): when they are due, how they thin out on
text that keeps finding nothing, and which first classes go on to propose."""

import pytest

from ouroboros_local.looks import (DRY_LOOKS_EVERY_MAX, DRY_LOOKS_PER_DOUBLING, LOOK_BACKOFF_MAX, LOOK_EVERY,
                                   LOOK_SHARE, Looks)

STEP = 0.01   # a target step's seconds


def dues(looks: Looks, rounds: int) -> list[int]:
    """The idle rounds (1-based) at which a look at "x" was due."""
    return [r for r in range(1, rounds + 1) if looks.due("x", STEP)]


def test_a_look_is_due_every_few_idle_rounds_and_every_round_while_looks_keep_nodes() -> None:
    looks = Looks()
    assert dues(looks, 3 * LOOK_EVERY) == [LOOK_EVERY, 2 * LOOK_EVERY, 3 * LOOK_EVERY]
    looks.proposed("x", kept=True)                     # copyable text comes in runs
    assert dues(looks, 3) == [1, 2, 3]
    looks.proposed("x", kept=False)
    looks.begin_request(["x"])                         # a new request: looked at in its first round
    assert dues(looks, 1) == [1]
    looks.dry("x", 0.0)
    assert looks.rounds_to_next("x", STEP) == LOOK_EVERY
    looks.count_idle("x", LOOK_EVERY - 1)              # foreseen idle rounds count as asked ones
    assert dues(looks, 1) == [1]


def test_looks_thin_out_on_dry_text_unless_one_kept_nodes_or_they_are_hidden() -> None:
    looks = Looks()
    everies = []
    for _ in range(10 * DRY_LOOKS_PER_DOUBLING):
        everies.append(looks.every("x", STEP))
        looks.dry("x", 0.0)
    assert everies[0] == LOOK_EVERY and everies[DRY_LOOKS_PER_DOUBLING] == 2 * LOOK_EVERY
    assert max(everies) == DRY_LOOKS_EVERY_MAX == everies[-1]
    looks.dry("x", 0.0, early=True)                    # an early look (a probe's) leaves the backoff
    assert looks.every("x", STEP) == DRY_LOOKS_EVERY_MAX
    looks.kept("x", 0.0)                               # the text copies: no backoff for the rest of it
    looks.dry("x", 0.0)
    assert looks.every("x", STEP) == LOOK_EVERY
    looks.hidden = True                                # drafted while a plain step decodes: free
    assert looks.every("x", STEP) == 1
    looks.hidden = False
    looks.begin_request(["x"])
    assert looks.every("x", STEP) == LOOK_EVERY


def test_dear_looks_are_spaced_to_cost_a_share_of_the_time() -> None:
    looks = Looks()
    looks.note_seconds("x", 0.2 * STEP)                # a look costs a fifth of a step
    assert looks.seconds("x") == pytest.approx(0.2 * STEP)
    assert 0.2 / LOOK_SHARE <= looks.every("x", STEP) <= 0.2 / LOOK_SHARE + 1   # 40 rounds for LOOK_SHARE
    looks.note_seconds("x", 0.0)                       # a running mean: one cheap look moves it a fifth
    assert looks.seconds("x") == pytest.approx(0.8 * 0.2 * STEP)


def test_a_first_class_cut_to_nothing_proposes_ever_more_rarely_until_a_look_keeps_it() -> None:
    looks = Looks()
    assert looks.promising("x", None) and not looks.promising("x", "")   # unknown: propose; nothing: not
    proposed = []
    for look in range(1, 80):
        if looks.promising("x", "c"):
            proposed.append(look)
            looks.outcome("x", "c", kept=False)
    gaps = [b - a for a, b in zip(proposed, proposed[1:])]
    assert gaps[:5] == [1, 2, 4, 8, LOOK_BACKOFF_MAX] and set(gaps[5:]) == {LOOK_BACKOFF_MAX}
    assert looks.promising("x", "other")               # another class is not held back
    looks.outcome("x", "c", kept=False)                # cut once more: next proposed LOOK_BACKOFF_MAX looks on
    looks.begin_request(["x"])                         # a new text: halved, sooner again
    tries = [looks.promising("x", "c") for _ in range(LOOK_BACKOFF_MAX)]
    assert tries.index(True) < LOOK_BACKOFF_MAX - 1
    looks.outcome("x", "c", kept=True)                 # kept: the record is gone
    assert looks.promising("x", "c")
