"""The measured verify-cost curve: measuring it, caching it on disk, and checking a cached one.

A curve is cached per model file and settings (``calibration_key``). A cached curve can still be wrong:
measured while another process held the CPU (one such curve said 3.6 s per token where a quiet machine
takes 0.068 s, and ``auto`` then ran below plain decoding on every later start). So

* each measurement records how many cores other processes kept busy meanwhile (``cpu_load``); a curve
  measured while they competed with our threads is *provisional*: it is used under the same load, and
  measured again at the first start on a quiet machine;
* each start checks a cached curve cheaply: a few single-token decodes (well under a second) against the
  curve's single-step time; off by more than ``CHECK_TOLERANCE`` times, the curve is measured again.
"""

from __future__ import annotations

import logging

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
from tqdm.auto import tqdm

from .catalogue import default_cache_dir
from .cpu_load import LoadMeter, busy_cores_now, contended, usable_cores
from .environment import env_path
from .errors import PoolError
from .filestore import finite_number, put_json_entry, read_json_object, warn_not_saved
from .tree import TokenTree, layout

if TYPE_CHECKING:  # pragma: no cover
    from .kv import KVCache

log = logging.getLogger("ouroboros_local")

# Every size a default draft can verify (max_length 16 + the root), then a sparse tail for wider trees and
# windows. Every size, because the curve is not smooth: llama.cpp's CPU kernels for repacked Q4_K weights
# multiply 4 rows at a time, so on 2 cores 16 tokens cost less than 15 (the 1.5B target: 5.2 against 6.4
# steps; 17 cost 6.2) and 8 about what 7 cost. Sampling 1-4, 6, 8, 12, 16 and interpolating hid both.
CALIBRATION_SIZES = (*range(1, 18), 24, 32)
CALIBRATION_METHOD = 6   # bump when measure_costs changes: cached curves of the old method are re-measured
CHECK_TOLERANCE = 3.0    # a cached curve whose single step is off by more than this factor is re-measured
CHECK_NOISE_SECONDS = 2e-5   # differences below this are scheduling jitter, whatever the ratio
CHECK_DECODES = 4        # timed single-token decodes of the start-up check (after one warm-up)
CHECK_PREFIX = 8         # tokens in the context during the check
SWITCH_SIZE = 8          # the decode whose switch cost is timed (the largest calibrated size up to it)
SWITCH_STEPS = 2         # plain steps that may run slower after it (CUDA: one without a graph, one capturing)
SWITCH_SETTLE = 3        # plain steps in a row, the last timed (``_settled_step``; more than SWITCH_STEPS)
SWITCH_REPEATS = 5
MAX_CURVES = 64          # curves kept in the file (the least recently measured go first)


@dataclass
class CostModel:
    """Seconds for one target decode of n tokens (n = root + draft tokens)."""

    sizes: list[int]
    seconds: list[float]
    measured_at: float = field(default_factory=time.time)
    key: str = ""
    busy_cores: float | None = None  # cores other processes kept busy while it was measured
    provisional: bool = False        # measured while others competed for our cores: re-measure when quiet
    switch_seconds: float = 0.0      # what the plain steps after a decode of another size lose (below)
    round_size: int = 0              # every round decodes this many tokens (``with_rounds_of``); 0: any
    plain_seconds: float = 0.0       # with ``round_size``: a plain step's seconds, steps back to back

    def cost(self, n_tokens: int) -> float:
        cached = self.__dict__.get("_table")   # the tabulated curve (see ``table``), when there is one
        if cached is not None and 1 <= n_tokens <= len(cached):
            return cached[n_tokens - 1]
        xs, ys = self.sizes, self.seconds
        if n_tokens <= xs[-1]:
            return float(np.interp(n_tokens, xs, ys))
        # beyond the curve: its last stretch's slope (a dip at the last size must not make it fall)
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0) if len(xs) > 1 else ys[-1]
        return ys[-1] + slope * (n_tokens - xs[-1])

    def ratio(self, n_tokens: int) -> float:
        return self.cost(n_tokens) / self.cost(1)

    def table(self, n_max: int) -> np.ndarray:
        """cost(1), ..., cost(n_max) as a fresh array (``costs``)."""
        return np.array(self.costs(n_max))

    def costs(self, n_max: int) -> list[float]:
        """cost(1), ..., cost(n_max) as plain floats; the curve is tabulated once (the scheduler asks
        every round, and per-size interpolation in Python costs more than a GPU decode step). Plain
        floats: ``cost`` reads the table after every round, where a numpy scalar's read, with the caches
        cold after a decode, cost twice a list's."""
        cached = self.__dict__.get("_table")   # not a dataclass field: never saved with the curve
        if cached is None or len(cached) < n_max:
            self.__dict__.pop("_table", None)
            cached = [float(self.cost(n)) for n in range(1, max(n_max, 64) + 1)]
            self.__dict__["_table"] = cached
        return cached[:n_max]

    @property
    def origin(self) -> str:
        """How this process got the curve: measured, cached, or re-measured (and why)."""
        return self.__dict__.get("_origin", "")

    @property
    def unsaved(self) -> str | None:
        """Why the curve this process measured is not in the cache file (None: it is, or was read there)."""
        return self.__dict__.get("_unsaved")

    def to_dict(self) -> dict:
        return asdict(self)

    def with_rounds_of(self, size: int, seconds: float) -> "CostModel":
        """The curve when every round decodes ``size`` tokens, a plain step included
        (``EngineConfig.round_size``): a round of up to ``size`` tokens costs ``seconds`` (the shape
        never changes, ``measure_round``); a larger tree costs what the curve says, and a switch."""
        larger = [(n, max(s, seconds)) for n, s in zip(self.sizes, self.seconds) if n > size]
        rounds = replace(self, sizes=[1, size] + [n for n, _ in larger],
                         seconds=[seconds, seconds] + [s for _, s in larger], round_size=size,
                         plain_seconds=self.cost(1))
        for note in ("_origin", "_unsaved"):   # how this process got the curve (not dataclass fields)
            if note in self.__dict__:
                rounds.__dict__[note] = self.__dict__[note]
        return rounds

    @classmethod
    def flat(cls) -> "CostModel":
        """An uncalibrated stand-in: verification as cheap as one step (the GPU-like optimum)."""
        return cls(sizes=[1, 64], seconds=[1.0, 1.0])


def calibration_key(file_id: Sequence[Any], settings: dict) -> str:
    """``file_id``: the model file's ``filestore.file_identity``."""
    path, size, mtime = file_id
    payload = json.dumps({"path": path, "size": size, "mtime": mtime,
                          "method": CALIBRATION_METHOD, **settings}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def _random_prefix(kv: "KVCache", rng: np.random.Generator, n_vocab: int, prefix_len: int) -> None:
    kv.reset()
    kv.feed([int(t) for t in rng.integers(0, n_vocab, prefix_len)])


def measure_costs(kv: "KVCache", sizes: Sequence[int] = CALIBRATION_SIZES, repeats: int = 3,
                  prefix_len: int = 32, vocab: int | None = None) -> CostModel:
    """Time chain decodes of each size on the engine's own context (cache is reset afterwards).

    Each size n > 1 is timed against a plain step decoded just before it (``_settled_step``), and the
    curve holds the median of ``repeats`` such ratios times the median plain step: the scheduler needs
    what a decode costs against a step. Timed apart, a machine that slowed down or sped up between the
    plain steps and the larger decodes (a VM's speed moves by 30% from one few-second spell to the next)
    bent the whole curve: eight calibrations of SmolLM2 in a row put c(3) between 1.65 and 2.70 steps
    (now 2.29-2.54), and a cached curve that said 1.92 priced drafts that lost. The median
    of a few (not the minimum, which made 3-4 token decodes look up to 30% cheaper on a busy 2-core
    CPU) is kept as measured, dips included (a larger batch can cost less: see CALIBRATION_SIZES), only
    never below one token's cost. Other processes' CPU use is measured alongside; a curve measured
    while they competed for our cores is marked provisional.

    What the plain steps after a larger decode lose (a new batch shape) is timed apart
    (``_plain_and_switch``)."""
    rng = np.random.default_rng(0)
    n_vocab = vocab or kv.ctx.n_vocab
    sizes = [s for s in sizes if s <= kv.ctx.n_batch]
    larger = [n for n in sizes if n > 1]
    ratios: dict[int, list[float]] = {n: [] for n in larger}
    steps: list[float] = []

    def decode(n: int) -> float:
        return _timed_decode(kv, rng, n_vocab, n)

    # a bar on a terminal (the 1.5B takes ~25 s on 2 cores; a slow laptop, over a minute)
    bar = tqdm(total=(repeats + 1) * sum(larger) + repeats * len(larger) * SWITCH_SETTLE,
               desc="measuring the verify cost", unit="tok", leave=False, disable=None)
    try:   # however it ends (a Ctrl-C just after a decode leaves cells the cache does not record)
        with LoadMeter() as meter, bar:
            _random_prefix(kv, rng, n_vocab, prefix_len)
            # size after size, repeat after repeat: a burst of load then spoils one decode of several
            # sizes, not all decodes of one size (back to back, it made 13 tokens look twice as dear as 12)
            for rep in range(repeats + 1):   # the first pass builds and warms the graph of each shape
                for n in larger:
                    if rep:
                        step = _settled_step(decode)
                        bar.update(SWITCH_SETTLE)
                        steps.append(step)
                        ratios[n].append(decode(n) / step)
                    else:
                        decode(n)
                    bar.update(n)
            step, switch = _plain_and_switch(decode, max((n for n in sizes if n <= SWITCH_SIZE), default=1))
    finally:
        kv.reset()
    if steps:
        step = float(np.median(steps))
    seconds = [step if n == 1 else float(np.median(ratios[n])) * step for n in sizes]
    seconds = [max(s, step) for s in seconds]   # n tokens never cost less than one: timer noise
    return CostModel(sizes=list(sizes), seconds=seconds, busy_cores=meter.busy_cores,
                     provisional=contended(meter.busy_cores, usable_cores(), kv.ctx.n_threads),
                     switch_seconds=switch)


def _settled_step(decode: Callable[[int], float]) -> float:
    """A plain step's seconds, timed after SWITCH_SETTLE - 1 untimed ones (past the steps that a decode
    of another size slows down): what a step costs back to back, at the moment it is timed."""
    for _ in range(SWITCH_SETTLE - 1):
        decode(1)
    return decode(1)


def _timed_decode(kv: "KVCache", rng: np.random.Generator, n_vocab: int, n: int) -> float:
    """Seconds to decode a chain of ``n`` random tokens and read its rows; the cache is left as it was."""
    tree = TokenTree.rooted_at(int(rng.integers(n_vocab)))
    tree.add_path(0, [int(t) for t in rng.integers(0, n_vocab, n - 1)])
    t0 = time.perf_counter()
    kv.decode_layout(layout(tree))
    kv.ctx.logits(n).argmax(axis=1)  # reading rows is part of a verification's cost
    seconds = time.perf_counter() - t0
    kv.discard_uncommitted()
    return seconds


def _plain_and_switch(decode: Callable[[int], float], size: int) -> tuple[float, float]:
    """One token's cost when plain steps run back to back, and what the SWITCH_STEPS plain steps after a
    decode of ``size`` tokens cost beyond that (median of SWITCH_REPEATS; never below zero).

    llama.cpp rebuilds its graph when the batch's shape changes, and a CUDA build runs a new shape
    without its CUDA graph until the shape has held for two decodes. On an H200 (SmolLM2-135M) a plain
    step took 1.35 ms back to back and ~4 ms after another size: a verification costs its own decode
    plus what the plain steps after it lose. On 2 CPU cores the loss is 0.4-0.7 ms against a 6.4-6.9 ms
    step (SmolLM2) and none against 24 ms (Qwen2.5-Coder-1.5B)."""
    steady, lost = [], []
    for rep in range(SWITCH_REPEATS + 1):   # the first round warms both shapes
        step = _settled_step(decode)
        after: list[float] = []
        if size > 1:
            decode(size)
            after = [decode(1) for _ in range(SWITCH_STEPS)]
        if rep:
            steady.append(step)
            lost.append(sum(after) - step * len(after))
    return float(np.median(steady)), max(float(np.median(lost)), 0.0)


def measure_round(kv: "KVCache", size: int, repeats: int = SWITCH_REPEATS, prefix_len: int = 32) -> float:
    """Seconds of a round of ``size`` tokens when every round has that size: decodes of one shape back
    to back, which llama.cpp runs on the graph it built for the first (a CUDA build: one CUDA graph)."""
    rng = np.random.default_rng(3)
    _random_prefix(kv, rng, kv.ctx.n_vocab, prefix_len)
    times = [_timed_decode(kv, rng, kv.ctx.n_vocab, size) for _ in range(repeats + 2)]
    kv.reset()
    return float(np.median(times[2:]))   # the first two build and warm the graph


@dataclass(frozen=True)
class StepCheck:
    """The start-up check: the median single-token decode now, and others' busy cores meanwhile."""

    seconds: float
    busy_cores: float | None
    contended: bool


def check_step(kv: "KVCache", decodes: int = CHECK_DECODES, prefix_len: int = CHECK_PREFIX) -> StepCheck:
    """Time a few single-token decodes back to back, the way ``measure_costs`` times its size-1 point."""
    rng = np.random.default_rng(2)
    n_vocab = kv.ctx.n_vocab
    with LoadMeter() as meter:
        _random_prefix(kv, rng, n_vocab, prefix_len)
        times = [_timed_decode(kv, rng, n_vocab, 1) for _ in range(decodes + 1)]
    kv.reset()
    # a check shorter than the load meter's clock ticks (a small model's) samples the load on its own:
    # an unknown load read as a quiet machine, and a busy one re-measured its curve at every start
    busy = meter.busy_cores if meter.busy_cores is not None else busy_cores_now(reuse=0.0)
    return StepCheck(seconds=float(np.median(times[1:])), busy_cores=busy,
                     contended=contended(busy, usable_cores(), kv.ctx.n_threads))


def stale_reason(cached: CostModel, check: StepCheck) -> str | None:
    """Why a cached curve must be measured again given the check, or None to keep it. A check that
    others' work slowed down keeps the curve: one busy start measured a busy curve over a quiet one
    (minutes, on 2 cores), and the next quiet start measured it back."""
    if check.contended:
        return None
    if cached.provisional and check.busy_cores is not None:
        return "it was measured while other processes were busy, and the machine is quiet now"
    step = cached.seconds[0]
    if abs(check.seconds - step) <= CHECK_NOISE_SECONDS:
        return None
    ratio = check.seconds / step if step > 0 else float("inf")
    if ratio > CHECK_TOLERANCE or ratio < 1.0 / CHECK_TOLERANCE:
        return f"one decode takes {check.seconds:.4g}s now against {step:.4g}s in the cached curve"
    return None


class CalibrationCache:
    """Cost models on disk, keyed by model file + device/offload + threads + batch settings."""

    def __init__(self, path: Path | None = None):
        self.path = path or env_path("OUROBOROS_CALIBRATION_FILE") or default_cache_dir() / "calibration.json"

    def _read(self) -> dict:
        return read_json_object(self.path, "cost curve")

    def get(self, key: str) -> CostModel | None:
        """The cached curve of ``key``; None when there is none, or when it is not a valid curve (a file
        edited by hand: said in one line, and measured again)."""
        raw = self._read().get(key)
        if raw is None:
            return None
        problem = curve_problem(raw)
        if problem is not None:
            log.warning("the cached cost curve %s in %s is not valid (%s): it is measured again", key, self.path,
                        problem)
            return None
        return CostModel(**raw)

    def put(self, model: CostModel) -> None:
        put_json_entry(self.path, model.key, model.to_dict(), keep=MAX_CURVES, stamp_key="measured_at",
                       what="cost curve", indent=1)


MAX_SIZE = 2**31   # a curve's sizes and round size are token counts of one decode: far below this


def _is_number(value: Any) -> bool:
    """A finite JSON number a float holds (1 and 400 zeros, valid JSON, was an OverflowError at every start)."""
    return not math.isnan(finite_number(value, math.nan))


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_SIZE


# What each saved field of a CostModel may hold (a wrong type once crashed later, far from the file).
_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "measured_at": _is_number,
    "key": lambda v: isinstance(v, str),
    "busy_cores": lambda v: v is None or (_is_number(v) and v >= 0),
    "provisional": lambda v: isinstance(v, bool),
    "switch_seconds": lambda v: _is_number(v) and v >= 0,
    "round_size": _is_size,
    "plain_seconds": lambda v: _is_number(v) and v >= 0,
}


def curve_problem(raw: Any) -> str | None:
    """What makes a saved curve unusable, or None when ``CostModel(**raw)`` is a valid curve."""
    if not isinstance(raw, dict):
        return "not an object"
    if not _is_curve(raw.get("sizes"), raw.get("seconds")):
        return "sizes and seconds are not a curve"
    unknown = sorted(set(raw) - set(_FIELD_CHECKS) - {"sizes", "seconds"})
    if unknown:
        return f"unknown field {unknown[0]!r}"
    bad = next((name for name, valid in _FIELD_CHECKS.items() if name in raw and not valid(raw[name])), None)
    if bad is None:
        return None
    shown = repr(raw[bad])
    return f"{bad} is {shown if len(shown) <= 40 else shown[:37] + '...'}"   # 1 and 400 zeros: a line of its own


def _is_curve(sizes: Any, seconds: Any) -> bool:
    """Sizes rising from 1 with a positive finite time each, none below one token's, as ``measure_costs``
    makes them: what ``CostModel.cost`` interpolates. (A curve whose 8 tokens cost a hundredth of one made
    ``auto`` draft at 0.6x, unsaid: the start-up check times only single tokens.)"""
    if not isinstance(sizes, list) or not isinstance(seconds, list) or not sizes or len(sizes) != len(seconds):
        return False
    if not all(_is_size(n) for n in sizes) or sizes[0] != 1:
        return False
    if any(b <= a for a, b in zip(sizes, sizes[1:])):
        return False
    return all(_is_number(t) and t > 0 for t in seconds) and all(t >= seconds[0] for t in seconds[1:])


def cached_or_measured(kv: "KVCache", key: str, cache: CalibrationCache, refresh: bool = False,
                       measure: Callable[["KVCache"], CostModel] = measure_costs,
                       check: Callable[["KVCache"], StepCheck] = check_step) -> CostModel:
    """The cached curve for ``key`` if the start-up check agrees with it, else a fresh measurement
    (stored in the cache; a provisional one too, so a busy machine does not re-measure every start)."""
    cached = None if refresh else cache.get(key)
    origin = "measured: --refresh asked for it" if refresh else "measured: none cached yet"
    if cached is not None:
        reason = stale_reason(cached, check(kv))
        if reason is None:
            cached.__dict__["_origin"] = "cached, checked"
            return cached
        origin = f"re-measured: {reason}"
    # the file named: with a draft two curves are measured, and a 1.5B at -t 1 took two minutes
    model_path = getattr(getattr(getattr(kv, "ctx", None), "model", None), "path", None)
    logging.getLogger("ouroboros_local").info(
        "measuring this machine's verify cost of %s (%s; seconds to minutes, once: then cached) ...",
        getattr(model_path, "name", "the model"), origin.split(": ", 1)[1])
    model = measure(kv)
    model.key = key
    model.__dict__["_origin"] = origin
    try:
        cache.put(model)
    except (OSError, PoolError) as exc:   # a read-only cache folder: the next start measures again
        model.__dict__["_unsaved"] = str(exc)
        warn_not_saved(cache.path, "cost curve", "OUROBOROS_CALIBRATION_FILE",
                       "every start measures it again (seconds to minutes)", exc)
    return model
