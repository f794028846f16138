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
GAP_SAMPLES = 9         # requests that timed both kinds of round whose plain-to-drafted ratio ``_gap`` is
                        # the median of


class RoundCosts:
    """Measured round cost / calibrated c(n), per batch size n (EMA). A drafted size seen fewer than
    ``MIN_ROUNDS`` times borrows from the nearest measured drafted sizes (interpolated; outside them, the
    nearest one's factor); plain steps lend theirs only while no drafted size is measured (they may cost
    differently in kind: a CUDA graph), so that a machine running slower or faster than when the curve
    was measured scales every size alike. With nothing measured the calibration stands (factor 1)."""

    WEIGHT = 0.1
    MIN_ROUNDS = 3
    DRIFT = 0.02   # a size's factor moved this much (relative) since the table was drawn, or ``switch`` this
                   # share of a step: redraw

    def __init__(self) -> None:
        self._ema: dict[int, float] = {}
        self._seen: dict[int, int] = {}
        self._version = 0       # bumped by what must show at once: a size now measured, a drafted size's
                                # factor or ``switch`` moved DRIFT
        self._cache: tuple[int, tuple[float, ...]] | None = None   # (version, the factors drawn then)
        self._priced_plain = 1.0   # the plain steps' factor prices use (``priced_plain``)
        self._prices: _Prices | None = None   # ``seconds``
        self.switch: float | None = None   # seconds the plain steps after a drafted round lose (median)
        self._switches: deque[float] = deque(maxlen=SWITCH_SAMPLES)
        self._ends: deque[int] = deque(maxlen=END_SAMPLES)   # 1: a drafted round had a plain step next
        self._ends_seen = 0     # rounds appended to ``_ends``
        self._after = 0         # plain steps still to come in the current drafted round's wake
        self._lost = 0.0        # what they lost so far
        self._measured: set[int] = set()   # drafted sizes measured in this request
        self._plain_timed = 0   # plain steps timed in this request outside a drafted round's wake
        self._gaps: deque[float] = deque(maxlen=GAP_SAMPLES)   # plain factor / drafted sizes' (``_gap``)

    def observe(self, n_tokens: int, seconds: float, calibrated: float) -> None:
        """A round of ``n_tokens`` took ``seconds`` where the curve says ``calibrated``. The SWITCH_STEPS
        plain steps after a drafted round are the drafted round's cost (see ``measure_costs``): what they
        take beyond a plain step goes to ``switch``, not to the plain steps' factor. ``switch`` is the
        median of the last SWITCH_SAMPLES: one step slowed by another process must not stop drafting,
        since only drafted rounds could then correct it."""
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
        if n_tokens > 1:
            self._after, self._lost = SWITCH_STEPS, 0.0
            self._measured.add(n_tokens)
        else:
            self._plain_timed += 1
        factor = seconds / calibrated
        old = self._ema.get(n_tokens)
        ema = self._ema[n_tokens] = factor if old is None else old + self.WEIGHT * (factor - old)
        seen = self._seen[n_tokens] = self._seen.get(n_tokens, 0) + 1
        if seen <= self.MIN_ROUNDS or (n_tokens > 1 and self._drifted(n_tokens, ema)):
            self._version += 1

    def begin_request(self) -> None:
        """A new request of this method: what was not measured in its last one is forgiven in part.

        - Each drafted size not measured forgets half of what its factor exceeds the plain steps' by. A
          size measured dear in a slow spell (another process busy) is drafted no more, so nothing else
          would measure it again: on SmolLM2's code edits, a few drafted rounds timed while a test suite
          ran beside the benchmark stopped all drafting for the 23 prompts left.
        - The mirror image: where fewer than MIN_ROUNDS plain steps were timed, the plain steps' factor
          forgets half of what it exceeds its usual ratio (``_gap``) to the drafted sizes measured by
          (once MIN_ROUNDS requests that timed both measured that ratio). Plain steps timed in a slow spell
          make every drafted round of a fast one look cheap, so every round is drafted and no plain step
          is timed again: on SmolLM2's gsm8k (11.5 ms a plain step against 8.6), eleven requests in a row
          drafted every round, at 0.6-0.9x of plain decoding each.

        A factor that really is that dear is measured dear again once forgiven enough; one measured in
        every request keeps its factor."""
        plain = self.plain_factor()
        sizes = self._drafted_sizes()
        changed = False
        for size in sizes:
            excess = self._ema[size] - plain
            if size not in self._measured and excess > self.DRIFT * plain:
                self._ema[size] = plain + STALE_KEEP * excess
                changed = True
        measured = [self._ema[size] for size in sizes if size in self._measured]
        if measured and self._seen.get(1, 0) >= self.MIN_ROUNDS:
            speed = sum(measured) / len(measured)
            if self._plain_timed >= self.MIN_ROUNDS:
                self._gaps.append(plain / speed)
            elif len(self._gaps) >= self.MIN_ROUNDS:
                usual = speed * self._gap()
                excess = plain - usual
                if excess > self.DRIFT * usual:
                    self._ema[1] = usual + STALE_KEEP * excess
                    changed = True
        self._measured.clear()
        self._plain_timed = 0
        if changed:
            self._version += 1

    def _gap(self) -> float:
        """The plain steps' factor over the drafted sizes' where a request timed both (the median of the
        last GAP_SAMPLES). Near 1 on a CPU (0.94-0.96 for SmolLM2 on 2 cores, forty-fifth session);
        above it where a round's fixed cost (Python, a launch) is a larger share of a plain step's few
        milliseconds than of a drafted round's, as on a GPU, where a request drafted throughout must not
        price plain steps as cheap as drafted ones."""
        return float(np.median(self._gaps))

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
        """The plain steps' factor (1 until MIN_ROUNDS of them were measured)."""
        return self._ema[1] if self._seen.get(1, 0) >= self.MIN_ROUNDS else 1.0

    def factors(self, n_max: int) -> np.ndarray:
        """The factors of sizes 1..n_max as priced (a fresh array: callers scale it in place)."""
        table = np.array(self.shared_table(n_max)[:n_max])
        table[0] = self.priced_plain()
        return table

    def shared_table(self, n_max: int) -> tuple[float, ...]:
        """The factors of sizes 1..max(n_max, 64) as last drawn (the plain steps' is ``priced_plain``); a
        new tuple each time it is drawn: once a size is measured, or a drafted size's factor or ``switch``
        moved DRIFT (``_version``), or, while no drafted size is measured (every size borrows the plain
        steps' factor), the plain steps' factor moved DRIFT. Plain floats, drawn as rarely as that: with
        the caches cold after a decode, a table redrawn every 8 plain steps cost an idle run 10-15 µs a
        round; after every drafted round, 29 µs a round of SmolLM2's code edits; on each plain drift
        (step times wander a few percent: every 4-10 reads), 10-30 µs a round of gsm8k, where a draw in
        numpy, and the seconds derived from it, took ~150 µs."""
        cached = self._cache
        if cached is None or cached[0] != self._version or len(cached[1]) < n_max \
                or (self._plain_drifted() and not self._drafted_sizes()):
            self._cache = cached = (self._version, self._draw(max(n_max, 64)))
            self._priced_plain = cached[1][0]
        return cached[1]

    def _draw(self, n: int) -> tuple[float, ...]:
        """Factors of sizes 1..n: the plain steps' first; a drafted size's measured, else interpolated
        between the nearest measured drafted sizes (outside them, the nearest one's); the plain steps'
        where no drafted size is measured."""
        plain = self.plain_factor()
        sizes = self._drafted_sizes()
        if not sizes:
            return (plain,) * n
        table, i = [plain], 0
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
        """The plain steps' factor as rounds are priced: moved to the measured one once that moved DRIFT
        from it (checked at the read: the EMA of every plain step crosses the band and comes back)."""
        if self._plain_drifted():
            self._priced_plain = self.plain_factor()
        return self._priced_plain

    def _plain_drifted(self) -> bool:
        return abs(self.plain_factor() - self._priced_plain) > self.DRIFT * self._priced_plain

    def _drafted_sizes(self) -> list[int]:
        """The drafted sizes measured MIN_ROUNDS times, ascending."""
        return sorted(n for n, seen in self._seen.items() if seen >= self.MIN_ROUNDS and n > 1)

    def seconds(self, curve: CostModel, limit: int) -> list[float]:
        """Seconds a round verifying k = 0..limit draft tokens costs on ``curve`` (at least that many
        entries; not to be written to): the calibrated c(k + 1) times the factors, plus, for a drafted
        round, what the plain steps after it lose (``switch``, else the curve's figure) when they follow
        it (``end_share``); where every round has one size (``CostModel.round_size``), only a larger one
        changes shape. Plain floats, computed again when the table is drawn or that loss moved DRIFT of a
        step; a plain factor's drift moves the plain step's price alone (~3 µs, where drawing the table
        and the seconds in numpy took ~150 µs with the caches cold)."""
        table = self.shared_table(limit + 1)
        plain = self.priced_plain()
        prices = self._prices
        if prices is None or prices.curve is not curve or prices.table is not table \
                or self._switch_moved(curve, prices):
            switch = self._switch_seconds(curve)
            start = max(curve.round_size, 1)
            floats = [c * f + (switch if k >= start else 0.0)
                      for k, (c, f) in enumerate(zip(curve.costs(len(table)), table))]
            floats[0] = curve.cost(1) * plain
            prices = self._prices = _Prices(curve, table, switch, self._ends_seen, plain, floats)
        elif prices.plain != plain:
            prices.floats = prices.floats.copy()   # a caller may keep the list it was given
            prices.floats[0] = curve.cost(1) * plain
            prices.plain, prices.array = plain, None
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
    plain: float                # the plain steps' factor priced
    floats: list[float]
    array: np.ndarray | None = None
