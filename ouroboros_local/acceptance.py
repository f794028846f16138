"""What the scheduler learns from verification: acceptance per proposer (a geometric model with
per-depth estimates) and per confidence class (``ConfidenceTable``); the policy that uses them is in
scheduler.py, the cost curve in calibration.py (docs/design.md#cost-model)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np


@dataclass
class Acceptance:
    """Acceptance estimate with forgetting: pooled (geometric model) and per draft depth.

    ``alpha_at(d)`` is the chance that the draft token at depth d + 1 is accepted given the d before it
    were. Copy-like proposers (prompt lookup, phrase pools) are right in long runs or not at all, so their
    conditional acceptance grows with depth, which the pooled geometric model underestimates. Each
    depth's estimate is shrunk towards the pooled alpha with the weight of ``prior`` observations, so
    depths seldom reached fall back to the geometric model.
    """

    successes: float = 1.0   # prior: alpha ~ 0.5 with the weight of two observations
    failures: float = 1.0
    decay: float = 0.98
    prior: float = 4.0
    depth_successes: list[float] = field(default_factory=list)
    depth_failures: list[float] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def depth_alphas(self, k: int) -> np.ndarray:
        """alpha_at(0), ..., alpha_at(k - 1) (``depth_list`` as a fresh array)."""
        return np.array(self.depth_list(k), dtype=float)

    def depth_list(self, k: int) -> list[float]:
        """alpha_at(0), ..., alpha_at(k - 1) as plain floats, kept until the next ``update``: the scheduler
        reads them every round it prices a chain, where numpy's per-call cost on a few numbers is most of
        the work. Each depth's counts are shrunk towards the pooled alpha with ``prior`` observations."""
        cached = self.__dict__.get("_depth_list")   # not a dataclass field
        if cached is None or len(cached) < k:
            n, pooled, prior = max(k, 32), self.alpha, self.prior
            cached = [(s + prior * pooled) / (s + f + prior)
                      for s, f in zip(self.depth_successes[:n], self.depth_failures[:n])]
            cached += [pooled] * (n - len(cached))
            self.__dict__["_depth_list"] = cached
        return cached[:k]

    def alpha_at(self, depth: int) -> float:
        return float(self.depth_alphas(depth + 1)[depth])

    def expected_all(self, k: int) -> np.ndarray:
        """Expected tokens of rounds that draft 0, 1, ..., k, in one pass."""
        return np.concatenate(([1.0], 1.0 + np.cumsum(np.cumprod(self.depth_alphas(k)))))

    def update(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.__dict__.pop("_depth_list", None)
        self.successes = self.successes * self.decay + accepted
        self.failures = self.failures * self.decay + (1.0 if accepted < drafted else 0.0)
        grow = drafted - len(self.depth_successes)
        if grow > 0:
            self.depth_successes.extend([0.0] * grow)
            self.depth_failures.extend([0.0] * grow)
        ds, df = self.depth_successes, self.depth_failures
        for d in range(len(ds)):
            ds[d] *= self.decay
            df[d] *= self.decay
        for d in range(accepted):
            ds[d] += 1.0
        if accepted < drafted:
            df[accepted] += 1.0

    def to_dict(self) -> dict[str, Any]:
        """The learned counts (``from_dict``); the decay and prior are the code's."""
        return {"successes": self.successes, "failures": self.failures,
                "depth_successes": list(self.depth_successes), "depth_failures": list(self.depth_failures)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], weight: float = math.inf) -> "Acceptance":
        """Counts saved by ``to_dict``, scaled down to at most ``weight`` observations' worth so that what
        a new session's text says soon outweighs them. Raises ValueError on anything malformed."""
        acc = cls()
        pooled = _counts([data["successes"], data["failures"]])
        ds, df = _counts(data["depth_successes"]), _counts(data["depth_failures"])
        if len(ds) != len(df) or len(ds) > MAX_SAVED_DEPTHS:
            raise ValueError("depth counts of different lengths, or too many")
        scale = _scale(sum(pooled), weight)
        acc.successes, acc.failures = (max(c * scale, 1e-3) for c in pooled)
        depth_scale = min([_scale(s + f, weight) for s, f in zip(ds, df)], default=1.0)
        acc.depth_successes = [c * depth_scale for c in ds]
        acc.depth_failures = [c * depth_scale for c in df]
        return acc


MAX_SAVED_DEPTHS = 64     # per-depth counts kept in saved estimates (drafts are at most a batch deep)
MAX_SAVED_CLASSES = 512   # confidence classes per proposer in saved estimates (the proposers have < 100)


def _counts(values: Any) -> list[float]:
    """Decayed observation counts read back from a file: finite and non-negative, or ValueError."""
    try:
        out = [float(v) for v in values]
    except OverflowError:   # an integer no float holds (1 and 400 zeros: valid JSON)
        raise ValueError("a count is too large") from None
    if not all(math.isfinite(v) and v >= 0.0 for v in out):
        raise ValueError("a count is negative or not finite")
    return out


def _scale(total: float, weight: float) -> float:
    return 1.0 if total <= weight else weight / total


@dataclass
class ConfidenceTable:
    """Acceptance per confidence class, and how often each class comes first in a draft.

    ``alphas(classes, base)`` gives, for a chain labelled with ``classes``, each node's chance of being
    accepted given its parent was: (successes + prior * base) / (trials + prior), so a class seen
    rarely stays near the proposer's own depth estimate ``base``.
    """

    decay: float = 0.995
    prior: float = 3.0
    # A class tried less than ``explore_trials`` times (decayed) counts as right ``explore_alpha`` of the
    # time: drafts of it are verified until it is measured (optimism in the face of uncertainty; the
    # decay makes rarely seen classes be tried again now and then). Only where exploring costs nothing
    # but verification (``explore``: a free draft, or one already made); a paid draft is not started
    # on optimism: probes, within their budget, measure it.
    explore_trials: float = 0.5
    explore_alpha: float = 0.9
    successes: dict[str, float] = field(default_factory=dict)
    trials: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)   # class of each draft's first node (EMA counts)

    def alphas(self, classes: Sequence[str], base: np.ndarray, explore: bool = True) -> np.ndarray:
        return np.array([self.alpha(c, float(b), explore) for c, b in zip(classes, base)], dtype=float)

    def alpha(self, cls: str, base: float, explore: bool = True) -> float:
        """The estimate of one node of class ``cls`` whose depth estimate is ``base`` (``alphas``)."""
        n = self.trials.get(cls, 0.0)
        if explore and n < self.explore_trials:
            return max(base, self.explore_alpha)
        return (self.successes.get(cls, 0.0) + self.prior * base) / (n + self.prior)

    def best_alpha(self, base: float) -> float:
        """The most optimistic class estimate (what one more draft token could at best be worth)."""
        best = base
        for c, n in self.trials.items():
            if n >= self.explore_trials:
                best = max(best, (self.successes[c] + self.prior * base) / (n + self.prior))
        return best

    def note_first(self, cls: str) -> None:
        """A draft started with a token of class ``cls``. Counted for every draft made, including the
        ones trimmed to nothing: counting only verified drafts would leave out exactly the hopeless
        ones, and the mix would promise more than drafting delivers."""
        for c in self.first:
            self.first[c] *= self.decay
        self.first[cls] = self.first.get(cls, 0.0) + 1.0

    def update(self, classes: Sequence[str], accepted: int) -> None:
        """A chain labelled ``classes`` had its first ``accepted`` nodes accepted."""
        self.update_tried([(c, i < accepted) for i, c in enumerate(classes[:accepted + 1])])

    def to_dict(self) -> dict[str, Any]:
        """The learned counts (``from_dict``)."""
        return {"successes": dict(self.successes), "trials": dict(self.trials), "first": dict(self.first)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], weight: float = math.inf) -> "ConfidenceTable":
        """Counts saved by ``to_dict``; each class's trials scaled down to at most ``weight`` (its estimate
        kept), the first-class mix as saved. Raises ValueError on anything malformed."""
        table = cls()
        trials, successes, first = (dict(data[k]) for k in ("trials", "successes", "first"))
        if max(len(trials), len(first)) > MAX_SAVED_CLASSES or not set(successes) <= set(trials):
            raise ValueError("too many classes, or successes of a class never tried")
        for cls_name, n in zip(trials, _counts(trials.values())):
            ok = _counts([successes.get(cls_name, 0.0)])[0]
            if ok > n + 1e-9:
                raise ValueError(f"class {cls_name!r}: more successes than trials")
            scale = _scale(n, weight)
            table.trials[str(cls_name)], table.successes[str(cls_name)] = n * scale, ok * scale
        table.first = {str(c): v for c, v in zip(first, _counts(first.values()))}
        return table

    def update_tried(self, tried: Sequence[tuple[str, bool]]) -> None:
        """Nodes whose parent was accepted were tried: (class, accepted) for each."""
        if not tried:
            return
        d = self.decay
        for table in (self.successes, self.trials):
            for c in table:
                table[c] *= d
        for c, ok in tried:
            self.trials[c] = self.trials.get(c, 0.0) + 1.0
            self.successes[c] = self.successes.get(c, 0.0) + (1.0 if ok else 0.0)


PROBABILITY_BINS = (0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995)


def probability_class(p: float) -> str:
    """Confidence class of a draft token from the probability the draft model gave it."""
    return "p" + str(int(np.searchsorted(PROBABILITY_BINS, p, side="right")))


__all__ = ["Acceptance", "ConfidenceTable", "PROBABILITY_BINS", "probability_class"]
