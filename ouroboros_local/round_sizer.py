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
during the decode included), once each size has been timed TIMED_MIN times past a change of size; until
then the calibration's figure stands, rounds of K timed against its plain step once they are. The
calibration decodes both back to back on a short context; on an H200 with flash attention the 1.5B's
rounds of 4 cost 1.6-1.7 of its plain steps in the loop, and the sizer, sizing by the calibrated ratio,
kept a third to a half of its rounds in rounds of 4 that wrote 1.6 tokens, at 0.90-0.94x of plain
decoding (docs/reports/h200-h).
"""

from __future__ import annotations

from typing import Sequence

from .calibration import SWITCH_STEPS

# what the sizer must see gained beyond a change there and back before it changes size: a guard against
# noise where changes cost little (a CPU)
NOISE_STEPS = 1.0
TIMED_MIN = 3         # decodes of a size timed before its time replaces the calibrated one
TIME_WEIGHT = 0.1     # the timed seconds' moving average


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
        self._timed: dict[int, list[float]] = {1: [0.0, 0], round_size: [0.0, 0]}   # [average, count]
        self._run_size = 0            # the size of the decodes in a row so far, and how many
        self._run_length = 0

    def begin_request(self) -> None:
        self.plain_rounds = self.changes = 0
        self._pending.clear()
        self._run_size = 0            # after the prompt's decode: another shape

    @property
    def cost_ratio(self) -> float:
        """A round of K over a plain step: as timed here, else against the calibrated plain step, else the
        calibrated ratio."""
        (round_seconds, rounds), (plain_seconds, plains) = self._timed[self.round_size], self._timed[1]
        if rounds < TIMED_MIN:
            return self.calibrated_ratio
        if plains >= TIMED_MIN and plain_seconds > 0:
            return round_seconds / plain_seconds
        if self.calibrated_plain:
            return round_seconds / self.calibrated_plain
        return self.calibrated_ratio

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
        if self.balance > self.threshold:
            self.plain, self.balance, self.changes = not self.plain, 0.0, self.changes + 1

    def _time(self, decoded: int, seconds: float) -> None:
        """Average the seconds of plain steps and rounds of K, past the SWITCH_STEPS decodes after a change
        of shape (those run without their CUDA graph: the switch's cost, counted apart)."""
        if decoded != self._run_size:
            self._run_size, self._run_length = decoded, 0
        self._run_length += 1
        timed = self._timed.get(decoded)
        if timed is None or self._run_length <= SWITCH_STEPS:
            return
        timed[0] = seconds if not timed[1] else timed[0] + TIME_WEIGHT * (seconds - timed[0])
        timed[1] += 1

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
