"""In rounds of one size (``EngineConfig.round_size`` K), whether the next round decodes K tokens or a
plain one-token step (``EngineConfig.round_switch``).

A round of K keeps a CUDA graph but costs more than a plain step (on an H200, SmolLM2: 1.33 steps), so it
pays only where the root and its K - 1 guesses write more tokens than that on average. Where text does
not repeat (SmolLM2's mt_bench: 1.31 tokens a round of 4, 0.95x of plain decoding), plain steps write as
much for less. The sizer counts what each round of K writes, and while plain steps decode, what one would
have written (its guesses against the tokens that followed), so both sizes are judged on one measure. A
change of size costs decodes without their graph on both sides (on that H200 a plain step after a round
of 4 took 4.2 ms against 1.4), so the size changes only once the other size would have gained more than
a change there and back costs: a CUSUM of the gain, in plain steps' time (docs/design.md#cost-model).

What a round of K costs against a plain step is timed here, as this loop decodes them (its drafting
during the decode included): the median of each size's last TIMED_WINDOW decodes past a change of size,
once TIMED_MIN are timed; rounds of K timed before any plain step are set against the calibration's
plain step, and before that the calibration's ratio stands. Rounds of K are not left before they are
timed, and a size not timed in a request is forgiven half of what it exceeds the calibration by (as
``round_costs.RoundCosts`` does), so that a slow spell does not stop rounds of K for good. The
calibration decodes both back to back on a short context; on an H200 with flash attention the 1.5B's
rounds of 4 cost 1.6-1.7 of its plain steps in the loop, and the sizer, sizing by the calibrated ratio,
kept a third to a half of its rounds in rounds of 4 that wrote 1.6 tokens, at 0.90-0.94x of plain
decoding (docs/reports/h200-h).
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Sequence

from .calibration import SWITCH_STEPS
from .round_costs import STALE_KEEP   # the share of its excess a size not timed in a request keeps

# what the sizer must see gained beyond a change there and back before it changes size: a guard against
# noise where changes cost little (a CPU)
NOISE_STEPS = 1.0
TIMED_MIN = 3         # decodes of a size timed before its time replaces the calibrated one
TIMED_WINDOW = 9      # the last decodes of a size whose median is its time (one slow decode is not)


class RoundSizer:
    """``size()``: the next round's size; ``observe``: what the last round decoded and wrote. One per
    method and engine: a request begins (``begin_request``) at the size the last one left, since a
    request's first decode has no graph to keep either way."""

    def __init__(self, round_size: int, cost_ratio: float, switch_steps: float = 0.0,
                 plain_seconds: float | None = None):
        """``cost_ratio``: a round of ``round_size`` over a plain step, both decoded back to back (the
        calibration's, until both are timed here); ``switch_steps``: what the decodes after a change of
        size lose, in plain steps; ``plain_seconds``: the calibration's plain step, which rounds of K
        timed here are set against until plain steps are (None: the ratio waits for both)."""
        self.round_size = round_size
        self.calibrated_ratio = cost_ratio
        self.calibrated_plain = plain_seconds
        self.threshold = 2 * switch_steps + NOISE_STEPS   # a change, and the change back
        self.plain = False            # starts in rounds of K, as without the sizer
        self.balance = 0.0            # plain steps' time the other size would have saved (CUSUM, >= 0)
        self.plain_rounds = 0
        self.changes = 0
        self._pending: list[list] = []    # [guesses, matched]: rounds of K that plain steps stand for
        self._timed: dict[int, deque[float]] = {size: deque(maxlen=TIMED_WINDOW) for size in (1, round_size)}
        self._timed_now: set[int] = set()   # the sizes timed in this request
        self._timing = False          # seconds were given (callers that time nothing size as calibrated)
        self._run_size = 0            # the size of the decodes in a row so far, and how many
        self._run_length = 0

    def begin_request(self) -> None:
        """A new request: what it counts starts afresh, and a round of K not timed in the last one is
        forgiven part of what it exceeds the calibrated ratio by (rounds given up after a slow spell are
        not timed again, so only this brings them back)."""
        self.plain_rounds = self.changes = 0
        self._pending.clear()
        self._run_size = 0            # after the prompt's decode: another shape
        ratio = self._ratio()
        if self.round_size not in self._timed_now and ratio is not None and ratio > self.calibrated_ratio:
            keep = (self.calibrated_ratio + STALE_KEEP * (ratio - self.calibrated_ratio)) / ratio
            timed = self._timed[self.round_size]
            scaled = [seconds * keep for seconds in timed]
            timed.clear()
            timed.extend(scaled)
        self._timed_now.clear()

    @property
    def timed_ratio(self) -> float | None:
        """A round of K over a plain step as timed here (at most K: K plain steps write as much), or None
        while rounds of K are not timed."""
        ratio = self._ratio()
        return None if ratio is None else min(ratio, float(self.round_size))

    @property
    def cost_ratio(self) -> float:
        """The ratio the sizer counts with: the timed one, else the calibrated one."""
        timed = self.timed_ratio
        return self.calibrated_ratio if timed is None else timed

    def _ratio(self) -> float | None:
        rounds, plains = self._timed[self.round_size], self._timed[1]
        if len(rounds) < TIMED_MIN:
            return None
        plain = statistics.median(plains) if len(plains) >= TIMED_MIN else self.calibrated_plain
        return statistics.median(rounds) / plain if plain else None

    def size(self) -> int:
        return 1 if self.plain else self.round_size

    def observe(self, decoded: int, guesses: Sequence[int], written: Sequence[int],
                seconds: float | None = None) -> None:
        """A round that decoded ``decoded`` tokens in ``seconds`` wrote ``written``; ``guesses``, for a
        plain step: the K - 1 tokens the round of K it replaced would have checked after the root (a
        round of K's own count is what it wrote, so it passes none)."""
        if seconds is not None:
            self._time(decoded, seconds)
        for token in written:    # the plain steps' stand-ins, judged on the tokens that followed them
            self._pending = [entry for entry in self._pending if self._advance(entry, token)]
        if decoded > 1:
            self._count(len(written))
        else:
            self.plain_rounds += 1
            stand_in = [list(guesses[:self.round_size - 1]), 0]
            if self._advance(stand_in, written[0]):   # its first guess meets the token this step wrote
                self._pending.append(stand_in)
        # rounds of K are left only once timed: a calibration that overprices them is then corrected
        leave = self.plain or not self._timing or len(self._timed[self.round_size]) >= TIMED_MIN
        if self.balance > self.threshold and leave:
            self.plain, self.balance, self.changes = not self.plain, 0.0, self.changes + 1

    def _time(self, decoded: int, seconds: float) -> None:
        """Keep the seconds of plain steps and rounds of K, past the SWITCH_STEPS decodes after a change of
        shape (those run without their CUDA graph: the switch's cost, counted apart)."""
        self._timing = True
        if decoded != self._run_size:
            self._run_size, self._run_length = decoded, 0
        self._run_length += 1
        timed = self._timed.get(decoded)
        if timed is None or self._run_length <= SWITCH_STEPS:
            return
        timed.append(seconds)
        self._timed_now.add(decoded)

    def _advance(self, stand_in: list, token: int) -> bool:
        """One more token written after a stand-in's root: False once it is judged (and counted)."""
        guesses, matched = stand_in
        if matched < len(guesses) and guesses[matched] == token:
            stand_in[1] = matched = matched + 1
            if matched < len(guesses):
                return True
        self._count(1 + matched)
        return False

    def _count(self, tokens: int) -> None:
        """A round of K that wrote (or would have written) ``tokens``: what it saved against plain steps."""
        saved = tokens / self.cost_ratio - 1
        self.balance = max(0.0, self.balance + (saved if self.plain else -saved))
