"""Sampler settings and the target's processed distribution, in numpy.

Plain decoding and every speculative verifier use the same ``support`` function, so "the target's
distribution" is one well-defined thing. The order follows llama.cpp's default chain: top-k, then top-p
and min-p on the untempered probabilities, then temperature over the survivors.

The distribution is kept on its support (``Sparse``: a few token ids and their probabilities): one pass
over the vocabulary finds the candidates, the rest works on a few dozen tokens, and draws, draft
probabilities and rejection residuals stay sparse. ``distribution`` gives the dense vector (tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .errors import ParameterError
from .options import is_integer, is_real


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

    def __post_init__(self) -> None:
        self._check()   # when made (a bad value was refused only at the first generation with it)

    def validated(self) -> "SamplingParams":
        """These settings as the engine runs them: numpy's numbers as Python's, -1 as off (top_k) and as
        random (seed). (Checked when made, and the copy is checked again as it is made.)"""
        # numpy's numbers as Python's: a seed of np.uint32 and a top_k of np.int64 behave as their ints;
        # -1 is random, as on the command line and the server (llama.cpp's default seed)
        return replace(self, temperature=float(self.temperature), top_p=float(self.top_p),
                       min_p=float(self.min_p), top_k=max(0, int(self.top_k)),   # -1: off, as vLLM's
                       seed=None if self.seed is None or self.seed == -1 else int(self.seed))

    def _check(self) -> None:
        def bad(name: str, value: object, rule: str) -> ParameterError:
            said = repr(value)
            return ParameterError(f"{name} must be {rule} (got {said if len(said) <= 40 else said[:37] + '...'})")

        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not is_real(value) or not _finite(value):
                raise bad(name, value, "a finite number")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise bad("min_p", self.min_p, "in [0, 1)")
        if not is_integer(self.top_k) or self.top_k < -1:
            raise bad("top_k", self.top_k, "an integer >= 0, or 0 or -1 for off")
        if self.seed is not None and (not is_integer(self.seed) or self.seed < -1):
            raise bad("seed", self.seed, "an integer >= 0, or None or -1 for a random one")

    def rng(self) -> np.random.Generator:
        return np.random.default_rng(self.seed)


def _finite(value: float) -> bool:
    """math.isfinite, where an int too large for a float (10**400) is not finite, not an OverflowError."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# Vocabularies at least this large find their top-k through column maxima (``top_k_by_value``);
# smaller ones are simply sorted.
_COLUMN_ROWS = 64
_SMALL_VOCAB = 4096


@dataclass(frozen=True)
class Sparse:
    """A probability distribution over a few token ids: the processed distribution's support.

    ``ids`` ascend, so the cumulative sums of ``probs`` equal those of the dense vector at the same
    tokens: ``sample`` draws the very token a dense draw with the same uniform would draw.
    """

    ids: np.ndarray      # int64 token ids, ascending
    probs: np.ndarray    # float64, > 0, sums to 1

    def __len__(self) -> int:
        return len(self.ids)

    def prob(self, token: int) -> float:
        i = int(np.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and self.ids[i] == token else 0.0

    def at(self, tokens: np.ndarray) -> np.ndarray:
        """Probabilities of several token ids (0 off the support)."""
        pos = np.minimum(np.searchsorted(self.ids, tokens), len(self.ids) - 1)
        return np.where(self.ids[pos] == tokens, self.probs[pos], 0.0)

    def sample(self, rng: np.random.Generator) -> int:
        cum = np.cumsum(self.probs)
        i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
        return int(self.ids[min(i, len(self.ids) - 1)])

    def entropy(self) -> float:
        """Entropy in nats."""
        return max(0.0, float(-np.dot(self.probs, np.log(self.probs))))

    def dense(self, n: int) -> np.ndarray:
        out = np.zeros(n, dtype=np.float64)
        out[self.ids] = self.probs
        return out

    @classmethod
    def from_dense(cls, probs: np.ndarray) -> "Sparse":
        ids = np.flatnonzero(probs > 0)
        return cls(ids, np.asarray(probs[ids], dtype=np.float64))


def top_k_by_value(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, largest first (equal values: the lowest id first).

    Without partitioning the whole vocabulary: viewed as a 64-row array, the k-th largest column
    maximum t is at most the k-th largest logit (k columns each hold a value >= t), so every top-k id
    lies in a column whose maximum is >= t. One vectorized max pass leaves ~64 k candidates.
    """
    x = logits
    n = len(x)
    k = min(k, n)
    n_cols = n // _COLUMN_ROWS
    if n < _SMALL_VOCAB or n_cols <= k:
        cand = np.arange(n)
    else:
        body = n_cols * _COLUMN_ROWS
        grid = x[:body].reshape(_COLUMN_ROWS, n_cols)
        col_max = grid.max(axis=0)
        t = np.partition(col_max, n_cols - k)[n_cols - k]
        cols = np.flatnonzero(col_max >= t)
        if len(cols) <= 2 * k:   # about k columns: their values >= t
            rows, at = np.nonzero(grid[:, cols] >= t)
            cand = rows * n_cols + cols[at]
            if body < n:
                cand = np.concatenate([cand, np.arange(body, n)])
        else:   # many columns tie at t (a flat row): the values above it, then the lowest ids at it
            cols = np.flatnonzero(col_max > t)   # fewer than k columns
            rows, at = np.nonzero(grid[:, cols] > t)
            cand = np.concatenate([rows * n_cols + cols[at], body + np.flatnonzero(x[body:] > t)])
            cand = np.concatenate([cand, np.flatnonzero(x == t)[:max(k - len(cand), 0)]])
    order = np.lexsort((cand, -x[cand]))[:k]   # by value, equal values by ascending id
    return cand[order]


def top_k_ids(logits: np.ndarray, k: int) -> np.ndarray:
    """Ascending ids of the k largest logits (ties at the k-th value: the lowest ids win)."""
    return np.sort(top_k_by_value(logits, k))


def _top_p_min_p_cut(e: np.ndarray, total: float, params: SamplingParams) -> int:
    """How many of the top-k set's tokens (``e`` = exp(logit - max), by value; ``total`` their sum)
    top-p and min-p keep: both keep a prefix, top-p the shortest one reaching top_p, min-p the one
    with probabilities >= min_p times the largest."""
    probs = e / total
    n_keep = len(e)
    if params.top_p < 1.0:
        n_keep = min(n_keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        n_keep = min(n_keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
    return n_keep


def _cut_top_k_set(ids: np.ndarray, kept: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """top-p and min-p on the top-k set (``ids`` by value, ``kept`` their float64 logits)."""
    if params.top_p >= 1.0 and params.min_p <= 0.0:
        return ids, kept
    e = np.exp(kept - kept[0])
    n_keep = _top_p_min_p_cut(e, e.sum(), params)
    return ids[:n_keep], kept[:n_keep]


def _top_k_support(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, float64 logits) kept by top-k, then top-p and min-p on the top-k set's probabilities."""
    ids = top_k_by_value(x, params.top_k)
    return _cut_top_k_set(ids, np.asarray(x[ids], dtype=np.float64), params)


def _nucleus_and_min_p(ids: np.ndarray, kept: np.ndarray, top_p: float, min_p: float,
                       total: float | None = None) -> np.ndarray:
    """Mask of ``ids`` kept by top-p and min-p, on probabilities normalized over ``total``
    (default: the sum over ``ids``, which then are the whole top-k set)."""
    e = np.exp(kept - kept.max())
    probs = e / (e.sum() if total is None else total)
    mask = np.ones(len(ids), dtype=bool)
    if top_p < 1.0:
        order = np.lexsort((ids, -probs))          # descending probability, then ascending id
        cum = np.cumsum(probs[order])
        n_keep = int(np.searchsorted(cum, top_p)) + 1  # smallest prefix reaching top_p
        top = np.zeros(len(ids), dtype=bool)
        top[order[:n_keep]] = True
        mask &= top
    if min_p > 0.0:
        mask &= probs >= min_p * probs.max()
    return mask


def _untruncated_support(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """(ids, float64 logits) kept by top-p / min-p when top-k keeps the whole vocabulary."""
    n = len(x)
    top_p, min_p = params.top_p, params.min_p
    if top_p >= 1.0 and min_p <= 0.0:
        return np.arange(n), np.asarray(x, dtype=np.float64)
    m = float(x.max())
    if top_p >= 1.0:
        # min-p alone keeps exp(x - m) >= min_p; the float32 slack only widens the candidates
        cand = np.flatnonzero(x >= m + math.log(min_p) - 1e-3 * (1.0 + abs(m)))
        kept = np.asarray(x[cand], dtype=np.float64)
        mask = _nucleus_and_min_p(cand, kept, 1.0, min_p)
        return cand[mask], kept[mask]
    # top-p needs the normalizer over the whole vocabulary (O(V), as a sampler without top-k must);
    # the nucleus is found among the largest probabilities only
    e = np.exp(np.asarray(x, dtype=np.float64) - m)
    total = float(e.sum())
    for floor in (1e-3, 1e-6, 1e-10, 0.0):
        cand = np.flatnonzero(e >= floor) if floor > 0.0 else np.arange(n)
        if floor == 0.0 or e[cand].sum() >= top_p * total * (1.0 + 1e-9):
            break
    kept = np.asarray(x[cand], dtype=np.float64)
    mask = _nucleus_and_min_p(cand, kept, top_p, min_p, total=total)
    return cand[mask], kept[mask]


def support(logits: np.ndarray, params: SamplingParams) -> Sparse:
    """The processed target distribution on its support: top-k, then top-p and min-p on the
    untempered probabilities of the top-k set, then temperature over the survivors.

    Per call: one pass over the vocabulary (``top_k_ids``) and work on the survivors only; no
    vocabulary-sized float64 array unless top-k is off."""
    x = np.asarray(logits)
    n = x.shape[-1]
    if params.top_k and params.top_k < n:
        ids, kept = _top_k_support(x, params)
        if len(ids) > 1:
            by_id = np.argsort(ids)
            ids, kept = ids[by_id], kept[by_id]
    else:
        ids, kept = _untruncated_support(x, params)
    temp = params.temperature if params.temperature > 0 else 1.0
    with np.errstate(over="ignore"):   # a temperature near 0 (5e-324) sends the tail to -inf: weight 0
        weights = np.exp((kept - kept.max()) / temp)
    probs = weights / weights.sum()
    positive = probs > 0
    if not positive.all():
        ids, probs = ids[positive], probs[positive]
    return Sparse(ids, probs)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Dense probability vector (float64, sums to 1) of the processed target distribution."""
    return support(logits, params).dense(np.asarray(logits).shape[-1])


def sample(probs: np.ndarray | Sparse, rng: np.random.Generator) -> int:
    """Draw one token id from a dense probability vector or a ``Sparse`` distribution."""
    if isinstance(probs, Sparse):
        return probs.sample(rng)
    cum = np.cumsum(probs)
    idx = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return min(idx, len(probs) - 1)


def prob_of(dist: np.ndarray | Sparse, token: int) -> float:
    return dist.prob(token) if isinstance(dist, Sparse) else float(dist[token])


def residual(p: np.ndarray | Sparse, q: np.ndarray | Sparse) -> np.ndarray | Sparse | None:
    """norm(max(0, p - q)): what to sample from after rejecting a draft token drawn from q.

    Dense in, dense out; a ``Sparse`` p gives a ``Sparse`` residual on the union of the supports."""
    if not isinstance(p, Sparse):
        dense_q = q.dense(len(p)) if isinstance(q, Sparse) else q
        r = np.maximum(p - dense_q, 0.0)
        total = r.sum()
        return None if total <= 0.0 else r / total
    q_sparse = q if isinstance(q, Sparse) else Sparse.from_dense(q)
    ids = np.union1d(p.ids, q_sparse.ids)
    r = np.maximum(p.at(ids) - q_sparse.at(ids), 0.0)
    total = r.sum()
    if total <= 0.0:
        return None
    keep = r > 0
    return Sparse(ids[keep], r[keep] / total)
