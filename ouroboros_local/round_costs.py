"""What rounds really cost here: each round's measured seconds against the calibrated curve c(n), per
batch size (docs/design.md#cost-model), and what the plain steps after a drafted round lose (a new batch
shape: on a CUDA build those steps run without their graph). The scheduler prices rounds with it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .calibration import SWITCH_STEPS, CostModel

SWITCH_SAMPLES = 9      # drafted rounds whose wake ``RoundCosts.switch`` is the median of
END_SAMPLES = 32        # drafted rounds ``RoundCosts.end_share`` counts, after END_PRIOR that ended a run
END_PRIOR = 2
STALE_KEEP = 0.5        # a drafted size not measured in a request keeps this share of its factor's excess
                        # over the plain steps' into the next (``RoundCosts.begin_request``)
SPEED_WEIGHT = 0.3      # the machine's speed follows every round this fast (its sizes' factors: ``WEIGHT``)
SPEED_STEP = 2.0        # one round moves the speed as if it were at most this many times faster or slower
SPEED_DRIFT = 0.05      # prices follow the speed once it moved this much (it scales them all alike)


class RoundCosts:
    """What each batch size n costs against the calibrated c(n): the machine's speed now (the plain steps'
    factor) times n's factor relative to a plain step (EMAs).

    Every round measures the speed, each against its own size's factor: a VM's speed moves by 20-30%
    from one few-second spell to the next, and factors that moved only when their own size ran priced one
    size at one spell's speed against another's. Seen on SmolLM2's gsm8k: plain steps timed in a slow spell
    (11.5 ms against 8.6), then drafted rounds in a fast one looked a quarter cheaper than a plain step
    made them; every round of eleven requests was drafted (0.6-0.9x each), and with no plain step left
    to time, nothing corrected it. A drafted size seen fewer than ``MIN_ROUNDS`` times borrows from the
    nearest measured drafted sizes (interpolated; outside them, the nearest one's factor), or where none
    is measured costs a plain step's share of the calibrated curve. With nothing measured the
    calibration stands (factor 1)."""

    WEIGHT = 0.1
    MIN_ROUNDS = 3
    DRIFT = 0.02   # a size's factor moved this much (relative) since the table was drawn, or ``switch`` this
                   # share of a step: redraw

    def __init__(self) -> None:
        self._ema: dict[int, float] = {}    # drafted sizes: measured cost / c(n), over the speed then
        self._seen: dict[int, int] = {}
        self._speed: float | None = None    # plain steps' measured cost / c(1), followed by every round
        self._speed_seen = 0
        self._version = 0       # bumped by what must show at once: a size now measured, a drafted size's
                                # factor or ``switch`` moved DRIFT
        self._cache: tuple[int, tuple[float, ...]] | None = None   # (version, the factors drawn then)
        self._priced_speed = 1.0   # the speed prices use (``priced_plain``)
        self._prices: _Prices | None = None   # ``seconds``
        self.switch: float | None = None   # seconds the plain steps after a drafted round lose (median)
        self._switches: deque[float] = deque(maxlen=SWITCH_SAMPLES)
        self._ends: deque[int] = deque(maxlen=END_SAMPLES)   # 1: a drafted round had a plain step next
        self._ends_seen = 0     # rounds appended to ``_ends``
        self._after = 0         # plain steps still to come in the current drafted round's wake
        self._lost = 0.0        # what they lost so far
        self._measured: set[int] = set()   # drafted sizes measured in this request

    def observe(self, n_tokens: int, seconds: float, calibrated: float) -> None:
        """A round of ``n_tokens`` took ``seconds`` where the curve says ``calibrated``. The SWITCH_STEPS
        plain steps after a drafted round are the drafted round's cost (see ``measure_costs``): what they
        take beyond a plain step goes to ``switch``, not to the speed. ``switch`` is the median of the
        last SWITCH_SAMPLES: one step slowed by another process must not stop drafting, since only
        drafted rounds could then correct it."""
        if self._after == SWITCH_STEPS:   # the round after a drafted one: did the drafting stop?
            self._ends.append(int(n_tokens == 1))
            self._ends_seen += 1
        if n_tokens == 1 and self._after:
            self._lost += seconds - calibrated * self.plain_factor()
            self._after -= 1
            if not self._after:
                self._switches.append(self._lost)
                if len(self._switches) >= self.MIN_ROUNDS:
                    switch = float(np.median(self._switches))
                    if self.switch is None or abs(switch - self.switch) > self.DRIFT * calibrated:
                        self.switch = switch
                        self._version += 1
            return
        ratio = seconds / calibrated
        if n_tokens == 1:
            self._move_speed(ratio)
            return
        self._after, self._lost = SWITCH_STEPS, 0.0
        self._measured.add(n_tokens)
        old = self._ema.get(n_tokens)
        seen = self._seen[n_tokens] = self._seen.get(n_tokens, 0) + 1
        if old is not None and seen > self.MIN_ROUNDS:
            self._move_speed(ratio / old)
        factor = ratio / (self._speed or 1.0)
        ema = self._ema[n_tokens] = factor if old is None else old + self.WEIGHT * (factor - old)
        if seen <= self.MIN_ROUNDS or self._drifted(n_tokens, ema):
            self._version += 1

    def _move_speed(self, speed: float) -> None:
        """A round ran as if the machine's speed were ``speed`` (its factor taken out)."""
        if self._speed is None:
            self._speed = speed
        else:
            speed = min(max(speed, self._speed / SPEED_STEP), self._speed * SPEED_STEP)
            self._speed += SPEED_WEIGHT * (speed - self._speed)
        self._speed_seen += 1

    def begin_request(self) -> None:
        """A new request: each drafted size not measured in the last one forgets half of what its factor
        exceeds the plain steps' by. A size measured dear in a slow spell (another process busy) is drafted
        no more, so nothing else would measure it again: on SmolLM2's code edits, a few drafted rounds
        timed while a test suite ran beside the benchmark stopped all drafting for the 23 prompts left.
        A size that really costs more is drafted again once forgiven enough, measured dear again, and so
        costs a drafted round now and then; one measured in every request keeps its factor."""
        changed = False
        for size in self._drafted_sizes():
            excess = self._ema[size] - 1.0
            if size not in self._measured and excess > self.DRIFT:
                self._ema[size] = 1.0 + STALE_KEEP * excess
                changed = True
        self._measured.clear()
        if changed:
            self._version += 1

    def _drifted(self, n_tokens: int, factor: float) -> bool:
        """Has a measured drafted size's factor moved DRIFT from the table drawn last?"""
        cached = self._cache
        if cached is None or n_tokens > len(cached[1]):
            return True
        drawn = cached[1][n_tokens - 1]
        return abs(factor - drawn) > self.DRIFT * drawn

    def factor(self, n_tokens: int) -> float:
        return float(self.factors(n_tokens)[n_tokens - 1])

    def end_share(self) -> float:
        """How often a drafted round is the last of a run of drafted rounds (END_PRIOR rounds' worth of
        "always" before any is seen): only then do the plain steps after it lose their graph, and a
        copy drafted round after round pays the switch once."""
        return (sum(self._ends) + END_PRIOR) / (len(self._ends) + END_PRIOR)

    def plain_factor(self) -> float:
        """The machine's speed: a plain step's measured cost / c(1) (1 until MIN_ROUNDS rounds measured it)."""
        return self._speed if self._speed is not None and self._speed_seen >= self.MIN_ROUNDS else 1.0

    def factors(self, n_max: int) -> np.ndarray:
        """The factors of sizes 1..n_max as priced (a fresh array: callers scale it in place)."""
        return np.array(self.shared_table(n_max)[:n_max]) * self.priced_plain()

    def shared_table(self, n_max: int) -> tuple[float, ...]:
        """The factors of sizes 1..max(n_max, 64) against a plain step's (1 first) as last drawn; a new
        tuple each time it is drawn: once a size is measured, or a drafted size's factor or ``switch``
        moved DRIFT (``_version``); the speed scales them apart (``priced_plain``). Plain floats, drawn as
        rarely as that: with the caches cold after a decode, a table redrawn every 8 plain steps cost an
        idle run 10-15 µs a round; after every drafted round, 29 µs a round of SmolLM2's code edits; on
        each drift of the plain steps' (step times wander a few percent: every 4-10 reads), 10-30 µs a
        round of gsm8k, where a draw in numpy, and the seconds derived from it, took ~150 µs."""
        cached = self._cache
        if cached is None or cached[0] != self._version or len(cached[1]) < n_max:
            self._cache = cached = (self._version, self._draw(max(n_max, 64)))
        return cached[1]

    def _draw(self, n: int) -> tuple[float, ...]:
        """Factors of sizes 1..n against a plain step's: 1 first; a drafted size's measured, else
        interpolated between the nearest measured drafted sizes (outside them, the nearest one's); 1
        where no drafted size is measured."""
        sizes = self._drafted_sizes()
        if not sizes:
            return (1.0,) * n
        table, i = [1.0], 0
        for size in range(2, n + 1):
            while i < len(sizes) - 1 and sizes[i + 1] <= size:
                i += 1
            lo = sizes[i]
            if size <= lo or i == len(sizes) - 1:
                table.append(self._ema[lo])
            else:
                hi = sizes[i + 1]
                table.append(self._ema[lo] + (self._ema[hi] - self._ema[lo]) * (size - lo) / (hi - lo))
        return tuple(table)

    def priced_plain(self) -> float:
        """The speed as rounds are priced: moved to the measured one once that moved SPEED_DRIFT from it
        (checked at the read). It scales every price alike, so only what is added to them (``switch``, a
        draft model's own cost) sees the difference."""
        speed = self.plain_factor()
        if abs(speed - self._priced_speed) > SPEED_DRIFT * self._priced_speed:
            self._priced_speed = speed
        return self._priced_speed

    def _drafted_sizes(self) -> list[int]:
        """The drafted sizes measured MIN_ROUNDS times, ascending."""
        return sorted(n for n, seen in self._seen.items() if seen >= self.MIN_ROUNDS and n > 1)

    def seconds(self, curve: CostModel, limit: int) -> list[float]:
        """Seconds a round verifying k = 0..limit draft tokens costs on ``curve`` (at least that many
        entries; not to be written to): the calibrated c(k + 1) times the factors and the speed, plus, for
        a drafted round, what the plain steps after it lose (``switch``, else the curve's figure) when
        they follow it (``end_share``); where every round has one size (``CostModel.round_size``), only a
        larger one changes shape. Plain floats, computed again when the table is drawn, the priced speed
        moved, or that loss moved DRIFT of a step (~5 µs, where drawing the table and the seconds in
        numpy took ~150 µs with the caches cold)."""
        table = self.shared_table(limit + 1)
        speed = self.priced_plain()
        prices = self._prices
        if prices is None or prices.curve is not curve or prices.table is not table \
                or prices.plain != speed or self._switch_moved(curve, prices):
            switch = self._switch_seconds(curve)
            start = max(curve.round_size, 1)
            floats = [c * f * speed + (switch if k >= start else 0.0)
                      for k, (c, f) in enumerate(zip(curve.costs(len(table)), table))]
            floats[0] = curve.cost(1) * speed
            prices = self._prices = _Prices(curve, table, switch, self._ends_seen, speed, floats)
        return prices.floats

    def seconds_array(self, curve: CostModel, limit: int) -> np.ndarray:
        """``seconds`` as a read-only array (made once per change, for the callers that price in numpy)."""
        floats = self.seconds(curve, limit)
        prices = self._prices
        if prices.array is None:
            prices.array = np.array(floats)
            prices.array.flags.writeable = False
        return prices.array

    def _switch_seconds(self, curve: CostModel) -> float:
        return max(curve.switch_seconds if self.switch is None else self.switch, 0.0) * self.end_share()

    def _switch_moved(self, curve: CostModel, prices: "_Prices") -> bool:
        """Has the drafted rounds' share of the switch moved DRIFT of a step since ``prices``?"""
        if prices.ends_seen == self._ends_seen:
            return False
        prices.ends_seen = self._ends_seen
        return abs(self._switch_seconds(curve) - prices.switch) > self.DRIFT * curve.cost(1)


@dataclass(slots=True)
class _Prices:
    """``RoundCosts.seconds`` and what they were priced from."""

    curve: CostModel
    table: tuple[float, ...]    # the factors drawn
    switch: float               # the drafted rounds' share of the switch
    ends_seen: int              # ``RoundCosts._ends_seen`` when ``switch`` was last compared
    plain: float                # the speed priced
    floats: list[float]
    array: np.ndarray | None = None
