"""What rounds really cost here: each round's measured seconds against the calibrated curve c(n), per
batch size (docs/design.md#cost-model), and what the plain steps after a drafted round lose (a new batch
shape: on a CUDA build those steps run without their graph). The scheduler prices rounds with it."""

from __future__ import annotations

from collections import deque

import numpy as np

from .calibration import SWITCH_STEPS

SWITCH_SAMPLES = 9      # drafted rounds whose wake ``RoundCosts.switch`` is the median of
END_SAMPLES = 32        # drafted rounds ``RoundCosts.end_share`` counts, after END_PRIOR that ended a run
END_PRIOR = 2


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
        self._drawn_plain = 1.0   # the plain steps' factor when the table was drawn
        self._cache: tuple[int, np.ndarray] | None = None
        self.switch: float | None = None   # seconds the plain steps after a drafted round lose (median)
        self._switches: deque[float] = deque(maxlen=SWITCH_SAMPLES)
        self._ends: deque[int] = deque(maxlen=END_SAMPLES)   # 1: a drafted round had a plain step next
        self._after = 0         # plain steps still to come in the current drafted round's wake
        self._lost = 0.0        # what they lost so far

    def observe(self, n_tokens: int, seconds: float, calibrated: float) -> None:
        """A round of ``n_tokens`` took ``seconds`` where the curve says ``calibrated``. The SWITCH_STEPS
        plain steps after a drafted round are the drafted round's cost (see ``measure_costs``): what they
        take beyond a plain step goes to ``switch``, not to the plain steps' factor. ``switch`` is the
        median of the last SWITCH_SAMPLES: one step slowed by another process must not stop drafting,
        since only drafted rounds could then correct it."""
        if self._after == SWITCH_STEPS:   # the round after a drafted one: did the drafting stop?
            self._ends.append(int(n_tokens == 1))
        if n_tokens == 1 and self._after:
            self._lost += seconds - calibrated * self._plain_factor()
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
        factor = seconds / calibrated
        old = self._ema.get(n_tokens)
        ema = self._ema[n_tokens] = factor if old is None else old + self.WEIGHT * (factor - old)
        seen = self._seen[n_tokens] = self._seen.get(n_tokens, 0) + 1
        if seen <= self.MIN_ROUNDS or (n_tokens > 1 and self._drifted(n_tokens, ema)):
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

    def _plain_factor(self) -> float:
        return self._ema[1] if self._seen.get(1, 0) >= self.MIN_ROUNDS else 1.0

    def factors(self, n_max: int) -> np.ndarray:
        """The factors of sizes 1..n_max (a fresh array: callers scale it in place)."""
        return self.shared_table(n_max)[:n_max].copy()

    def shared_table(self, n_max: int) -> np.ndarray:
        """The factors of sizes 1..max(n_max, 64), not to be written to; a new array each time it is
        redrawn: once a size is measured, or a factor or ``switch`` moved DRIFT from the one drawn. Redrawn
        every 8 plain steps, a run that does not draft spent 10-15 µs a round on the table and on the
        seconds derived from it, with the caches cold after the decode; redrawn after every drafted
        round, a redraw came every 4-5 rounds of SmolLM2's code edits (~160 µs each, 29 µs a round)."""
        cached = self._cache
        plain = self._plain_factor()
        if cached is None or cached[0] != self._version or len(cached[1]) < n_max \
                or abs(plain - self._drawn_plain) > self.DRIFT * self._drawn_plain:
            sizes = sorted(n for n, seen in self._seen.items() if seen >= self.MIN_ROUNDS and n > 1)
            n = max(n_max, 64)
            table = np.ones(n)
            if self._seen.get(1, 0) >= self.MIN_ROUNDS:
                table[:] = self._ema[1]
            if sizes:
                table[1:] = np.interp(np.arange(2, n + 1), sizes, [self._ema[k] for k in sizes])
            self._cache = cached = (self._version, table)
            self._drawn_plain = plain
        return cached[1]
