"""Where a generation's decode time went, by kind of round (``GenerationStats.extra["time_split"]``,
``bench``'s "Where the decode time goes"): which rounds make a method slower than plain decoding. On a
GPU it tells a drafted round's own cost from what it costs the plain steps after it (a new batch shape:
no CUDA graph) and from the Python that runs while the GPU waits."""

from __future__ import annotations

from .calibration import SWITCH_STEPS

# decodes, each with its verification: plain steps (``after_draft``: the SWITCH_STEPS after a round of
# another shape; ``ahead``: the rest of those a draft was made during), rounds drafted before their
# decode, and the rest of a draft that a plain step began (``carried``)
DECODE_PARTS = ("plain", "after_draft", "ahead", "drafted", "carried")
# Python in the open: asking the proposer (and the scheduler) before a decode, and observing a round after it
PYTHON_PARTS = ("propose", "observe")
PARTS = DECODE_PARTS + PYTHON_PARTS + ("other",)   # other: the loop, the output, the caller's handling


class TimeSplit:
    """Seconds and rounds per part of one generation; a few additions per round."""

    def __init__(self) -> None:
        self.rounds = dict.fromkeys(DECODE_PARTS, 0)
        self.seconds = dict.fromkeys(DECODE_PARTS + PYTHON_PARTS, 0.0)
        self._wake = 0   # plain steps still to come in the wake of a round of another shape

    def add_round(self, plain: bool, ahead: bool, carried: bool, seconds: float, propose_seconds: float) -> None:
        """A round: a plain step (``ahead``: one that drafted during its decode) or a drafted one
        (``carried``: the rest of a draft a plain step began), its decode and verification taking
        ``seconds`` and the proposal before it ``propose_seconds``."""
        if not plain:
            part = "carried" if carried else "drafted"
            self._wake = SWITCH_STEPS
        elif self._wake:
            part = "after_draft"
            self._wake -= 1
        else:
            part = "ahead" if ahead else "plain"
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
