"""Where a generation's decode time went, by kind of round (``GenerationStats.extra["time_split"]``,
``bench``'s "Where the decode time goes"): which rounds make a method slower than plain decoding. On a
GPU it tells a drafted round's own cost from what it costs the plain steps after it (a new batch shape:
no CUDA graph) and from the Python that runs while the GPU waits."""

from __future__ import annotations

from .calibration import SWITCH_STEPS

# decodes, each with its verification: rounds that verified no draft (``plain``; ``after_draft``: the
# SWITCH_STEPS one-token steps after a larger decode; ``ahead``: the rest of those that drafted while they
# decoded), rounds that verified a draft made before their decode, and the rest of a draft that a plain
# step began (``carried``). A round filled to ``--round-size`` with guesses but no draft is ``plain``.
DECODE_PARTS = ("plain", "after_draft", "ahead", "drafted", "carried")
# Python in the open: asking the proposer (and the scheduler) before a decode, and observing a round after it
PYTHON_PARTS = ("propose", "observe")
PARTS = DECODE_PARTS + PYTHON_PARTS + ("other",)   # other: the loop, the output, the caller's handling


class TimeSplit:
    """Seconds and rounds per part of one generation; a few additions per round."""

    def __init__(self) -> None:
        self.rounds = dict.fromkeys(DECODE_PARTS, 0)
        self.seconds = dict.fromkeys(DECODE_PARTS + PYTHON_PARTS, 0.0)
        self._wake = 0   # one-token steps still to come in the wake of a larger decode

    def add_round(self, size: int, drafted: bool, ahead: bool, carried: bool, seconds: float,
                  propose_seconds: float) -> None:
        """A round that decoded ``size`` tokens and verified a draft made before it (``drafted``), the
        rest of a carried draft (``carried``), or no draft (``ahead``: it drafted while decoding), its
        decode and verification taking ``seconds`` and the proposal before it ``propose_seconds``."""
        if carried:
            part = "carried"
        elif drafted:
            part = "drafted"
        elif self._wake and size == 1:
            part = "after_draft"
        else:
            part = "ahead" if ahead else "plain"
        self._wake = SWITCH_STEPS if size > 1 else max(self._wake - 1, 0)
        self.rounds[part] += 1
        self.seconds[part] += seconds
        self.seconds["propose"] += propose_seconds

    def add_observe(self, seconds: float) -> None:
        self.seconds["observe"] += seconds

    def to_dict(self, decode_seconds: float) -> dict[str, list[float]]:
        """{part: [rounds, seconds]} (Python parts and ``other``: rounds 0); ``other`` is what the parts
        leave of ``decode_seconds``."""
        out: dict[str, list[float]] = {p: [self.rounds.get(p, 0), round(s, 6)] for p, s in self.seconds.items()}
        out["other"] = [0, round(max(decode_seconds - sum(self.seconds.values()), 0.0), 6)]
        return out
