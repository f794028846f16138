"""Sampler settings and the target's processed distribution, in numpy.

Plain decoding and every speculative verifier use the same ``distribution`` function, so "the target's
distribution" is one well-defined thing. The order follows llama.cpp's default chain: top-k, then top-p
and min-p on the untempered probabilities, then temperature over the survivors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .errors import ParameterError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0      # 0 = greedy
    top_k: int = 40               # 0 = off
    top_p: float = 0.95           # 1 = off
    min_p: float = 0.05           # 0 = off
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def validated(self) -> "SamplingParams":
        def bad(name: str, value: object, rule: str) -> ParameterError:
            return ParameterError(f"{name} must be {rule} (got {value!r})")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(name, value, "a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise bad("min_p", self.min_p, "in [0, 1)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", self.seed, "an integer")
        return replace(self, temperature=float(self.temperature), top_p=float(self.top_p),
                       min_p=float(self.min_p))

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Dense probability vector (float64, sums to 1) of the processed target distribution."""
    n = logits.shape[-1]
    row = np.asarray(logits, dtype=np.float64)
    if params.top_k and params.top_k < n:
        keep = np.argpartition(row, n - params.top_k)[n - params.top_k:]
    else:
        keep = np.arange(n)
    kept = row[keep]
    if params.top_p < 1.0 or params.min_p > 0.0:
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        mask = np.ones(len(keep), dtype=bool)
        if params.top_p < 1.0:
            order = np.argsort(-probs, kind="stable")
            cum = np.cumsum(probs[order])
            n_keep = int(np.searchsorted(cum, params.top_p)) + 1  # smallest prefix reaching top_p
            top = np.zeros(len(keep), dtype=bool)
            top[order[:n_keep]] = True
            mask &= top
        if params.min_p > 0.0:
            mask &= probs >= params.min_p * probs.max()
        keep, kept = keep[mask], kept[mask]
    temp = params.temperature if params.temperature > 0 else 1.0
    scaled = (kept - kept.max()) / temp
    weights = np.exp(scaled)
    out = np.zeros(n, dtype=np.float64)
    out[keep] = weights / weights.sum()
    return out


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a dense probability vector."""
    cum = np.cumsum(probs)
    idx = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return min(idx, len(probs) - 1)


def residual(p: np.ndarray, q: np.ndarray) -> np.ndarray | None:
    """norm(max(0, p - q)): what to sample from after rejecting a draft token drawn from q."""
    r = np.maximum(p - q, 0.0)
    total = r.sum()
    if total <= 0.0:
        return None
    return r / total
