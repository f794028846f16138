"""Looks: when a cheap labelling drafter whose drafts do not pay is asked anyway, for ``Scheduler.trim`` to
judge the classes it actually drafts (docs/design.md, "Looks at cheap drafters").

The scheduler decides from the mix of first classes its drafts were seen to start with; once that mix
says "does not pay" few drafts are made and it stays stale: on the 1.5B target, suffix proposed once in 16
repeated requests whose answers it held word for word (0.96x, where the same code had reached 1.48x). So a
drafter that costs little (``Scheduler._looks_at``: one that runs no model, or one measured cheap) is
looked at every round while its last proposal kept nodes (copyable text comes in runs), else every
LOOK_EVERY idle rounds, less often on text whose looks keep finding nothing, and never so often that looks
cost more than LOOK_SHARE of the time. A look first peeks at the class its proposal would start with
(``Proposer.first_class``) and goes on to propose only now and then for a class whose looks ``trim`` kept
cutting to nothing. This module holds that bookkeeping; the scheduler asks it and acts.
"""

from __future__ import annotations

import math
from typing import Iterable

LOOK_EVERY = 4          # idle rounds between looks at a cheap labelling drafter's proposal (``Looks.due``)
LOOK_SHARE = 0.005      # ... and looks that find nothing worth verifying take at most this share of the time
DRY_LOOKS_EVERY_MAX = 16   # looks in a request that kept nothing: the idle rounds between looks double
                           # after every DRY_LOOKS_PER_DOUBLING of them, up to this (``Looks.every``)
DRY_LOOKS_PER_DOUBLING = 2
LOOK_BACKOFF_MAX = 16   # a first class whose looks were cut to nothing n times running: looked at every
                        # min(2^(n-1), this)-th time it comes (``Looks.promising``)


class Looks:
    """Per drafter: whether its last proposal kept nodes, its idle rounds since the last look, this
    request's looks that kept nothing, what a look costs, and per first class its looks cut to nothing."""

    def __init__(self) -> None:
        # Set while a draft is asked during a plain step's decode (``EngineConfig.overlap``, on a GPU):
        # looks cost no time there, so a cheap drafter is looked at every such round (``every``); the
        # rounds drafted before their decode keep the usual spacing.
        self.hidden = False
        self._kept_last: set[str] = set()       # drafters whose last proposal kept nodes after ``trim``
        self._unlooked: dict[str, int] = {}     # idle rounds since the last look
        self._dry: dict[str, int] = {}          # this request's looks that kept nothing; -1 once one kept nodes
        self._seconds: dict[str, float] = {}    # what a look costs (EMA; ``note_seconds``)
        # first class -> [its looks cut to nothing running, looks skipped since] (``promising``)
        self._records: dict[str, dict[str, list[int]]] = {}

    def begin_request(self, sources: Iterable[str]) -> None:
        """A new request: every one of ``sources`` is looked at in its first round (a repeated request is
        copyable from its first token, and waiting LOOK_EVERY rounds cost 3 of the 5-9 target passes such
        a request takes on SmolLM2); classes cut to nothing are looked at sooner again (a new text may copy
        where the last did not)."""
        self._kept_last = set(sources)
        self._unlooked.clear()
        self._dry.clear()
        for records in self._records.values():
            for record in records.values():
                record[0] = max(1, record[0] // 2)

    def due(self, source: str, step: float) -> bool:
        """Is a look at ``source`` due this idle round (``step``: a target step's seconds)? Every round while
        its last proposal kept nodes, else every ``every`` idle rounds (this round counted)."""
        if source in self._kept_last:
            return True
        every = self.every(source, step)
        idle = self._unlooked.get(source, 0) + 1
        self._unlooked[source] = 0 if idle >= every else idle
        return idle >= every

    def rounds_to_next(self, source: str, step: float) -> int:
        """Idle rounds until a look at ``source`` is due by the count (``due``)."""
        return self.every(source, step) - self._unlooked.get(source, 0)

    def count_idle(self, source: str, rounds: int) -> None:
        """``rounds`` idle rounds went by without ``due`` being asked (foreseen quiet): counted as it would."""
        self._unlooked[source] = self._unlooked.get(source, 0) + rounds

    def every(self, source: str, step: float) -> int:
        """Idle rounds between looks at ``source``: LOOK_EVERY, doubled after every
        DRY_LOOKS_PER_DOUBLING looks in this request that kept nothing (up to DRY_LOOKS_EVERY_MAX), or
        more where its looks cost more than LOOK_SHARE of that many steps of ``step`` seconds; 1 while looks
        are hidden in a plain step's decode (``hidden``).

        A look costs more than its proposal: the peek, the "does drafting pay" check, the trim, the
        scoring of what it held (~75 µs a round for auto's two drafters on SmolLM2 here, ~1.2% of a step;
        on an H200 auto's extra Python was 3-5% of SmolLM2's step, the whole gap to plain decoding). On
        text with nothing to copy, looks keep finding nothing; a request whose looks keep nodes is looked
        at every LOOK_EVERY rounds again (and every round while they do). In a real run, with the caches
        cold after each decode, a look took 0.25 ms against SmolLM2's 8 ms step, and looks every 4 rounds
        on text with nothing to copy cost 0.8% of the time."""
        if self.hidden:
            return 1
        look = self._seconds.get(source, 0.0)
        doublings = min(max(self._dry.get(source, 0), 0) // DRY_LOOKS_PER_DOUBLING, 8)
        every = min(LOOK_EVERY << doublings, DRY_LOOKS_EVERY_MAX)
        return max(every, math.ceil(look / (LOOK_SHARE * step)))

    def seconds(self, source: str) -> float:
        """What a look at ``source`` costs (0 before one was timed)."""
        return self._seconds.get(source, 0.0)

    def promising(self, source: str, peeked: str | None) -> bool:
        """Should a look at ``source``, whose proposal would start with a node of class ``peeked``
        (``Proposer.first_class``; None: unknown), go on to propose? Not when it would draft nothing, and
        only now and then (LOOK_BACKOFF_MAX) for a class whose looks ``trim`` kept cutting to nothing: on
        SmolLM2 ~97% of looks were (a 1-token copy, a trie's short or rare match), each a proposal and a
        trim (~0.25 ms, caches cold) plus the scoring that followed."""
        if peeked is None:
            return True
        if not peeked:
            return False
        record = self._records.setdefault(source, {}).get(peeked)
        if record is None:
            return True
        record[1] += 1
        if record[1] >= min(1 << (record[0] - 1), LOOK_BACKOFF_MAX):
            record[1] = 0
            return True
        return False

    def proposed(self, source: str, kept: bool) -> None:
        """``source`` proposed (a look or not), and ``trim`` kept nodes of it (``kept``) or none."""
        if kept:
            self._kept_last.add(source)
        else:
            self._kept_last.discard(source)

    def outcome(self, source: str, peeked: str | None, kept: bool) -> None:
        """A look whose first class was ``peeked`` kept nodes after ``trim`` (``kept``) or none."""
        if not peeked:
            return
        records = self._records.setdefault(source, {})
        if kept:
            records.pop(peeked, None)
        else:
            record = records.setdefault(peeked, [0, 0])
            record[0] += 1   # looks cut to nothing running
            record[1] = 0    # looks at it skipped since

    def kept(self, source: str, seconds: float) -> None:
        """A look at ``source`` kept nodes after ``seconds``: no backoff for the rest of the request
        (restarting it instead missed humaneval's copies, which come back after dry spells)."""
        self._dry[source] = -1
        self.note_seconds(source, seconds)

    def dry(self, source: str, seconds: float, early: bool = False) -> None:
        """A look that kept nothing after ``seconds`` (stopped before its proposal by ``promising``, or its
        draft cut to nothing by ``trim``): idle until the next one is due. An early look (a probe's, see
        ``Scheduler.best_length``) leaves the looks' own backoff as it was."""
        self._kept_last.discard(source)
        if not early:
            self._unlooked[source] = 0
            if self._dry.get(source, 0) >= 0:
                self._dry[source] = self._dry.get(source, 0) + 1
        self.note_seconds(source, seconds)

    def note_seconds(self, source: str, seconds: float) -> None:
        """A look at ``source`` took ``seconds``, its proposal and trim (EMA), less its catch-up on the
        rounds since it was last asked (the suffix tries index those tokens when asked): that work is owed
        however often it is asked, and counting it made looks dearer the rarer they were. The suffix
        tries' looks on SmolLM2, replayed with real runs' Python costs, came every 40-90 rounds, and a
        repeated set of code edits ran 1.28-2.01x (mean 1.69x); without it, 1.96-2.05x."""
        seconds = max(seconds, 0.0)
        old = self._seconds.get(source)
        self._seconds[source] = seconds if old is None else old + 0.2 * (seconds - old)


__all__ = ["DRY_LOOKS_EVERY_MAX", "DRY_LOOKS_PER_DOUBLING", "LOOK_BACKOFF_MAX", "LOOK_EVERY", "LOOK_SHARE",
           "Looks"]
