"""How an engine is set up (``EngineConfig``), and the defaults that depend on where the target runs: rounds
of one size and flash attention on a CUDA GPU, neither on a CPU."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import ParameterError
from .llama import Device, Model, devices, supports_gpu_offload
from .llama.binding import KV_CACHE_TYPES
from .options import is_integer

log = logging.getLogger("ouroboros_local")

# ``EngineConfig.round_size`` left to None: rounds of this size where every layer of the target is on a
# CUDA device. There a decode of a new shape runs without llama.cpp's CUDA graph (on an H200 a plain step
# after a larger decode cost 4.2 ms against 1.4), and rounds of 4 beat rounds of their draft's size on
# seven of eight sets of two models (docs/benchmarks.md, sixth H200 run). Elsewhere a round costs what its
# tokens do (a CPU: four tokens about three steps), so rounds take their draft's size.
CUDA_ROUND_SIZE = 4


def has_cuda_gpu(found: Sequence[Device]) -> bool:
    """Is one of llama.cpp's devices a CUDA GPU (a build that replays CUDA graphs)?"""
    return any(d.kind == "gpu" and d.name.startswith("CUDA") for d in found)


def default_round_size(target: Model, n_batch: int) -> int:
    """``EngineConfig.round_size`` when left to None: ``CUDA_ROUND_SIZE`` where the whole target is on a
    CUDA device (the GPU build's graphs) and a batch holds a round, else 0 (each round its draft's size)."""
    layers = target.n_gpu_layers
    if layers == 0 or 0 < layers <= target.n_layer or n_batch < CUDA_ROUND_SIZE or not supports_gpu_offload():
        return 0
    try:
        found = devices()
    except (ImportError, AttributeError, OSError, RuntimeError) as exc:   # no ggml device API found
        log.warning("llama.cpp's devices are unknown (%s): rounds take their draft's size "
                    "(--round-size %d keeps a CUDA GPU's graphs)", exc, CUDA_ROUND_SIZE)
        return 0
    return CUDA_ROUND_SIZE if has_cuda_gpu(found) else 0


UNQUANTISED_CACHE = ("f32", "f16")   # KV cache types llama.cpp runs without flash attention


def default_flash_attn(model: Model, type_v: str = "f16") -> str:
    """``EngineConfig.flash_attn`` when left to None: llama.cpp's default (auto: on where its backend
    supports it) for a model with layers on a GPU, as plain llama.cpp runs it there (an H200 decoded
    SmolLM2-135M 13% faster with it); off on a CPU, where flash attention would change the logits with
    the batch's shape (docs/design.md#exactness) and gains little at these context sizes; auto wherever
    the V cache is quantised, which llama.cpp runs only with flash attention."""
    if type_v not in UNQUANTISED_CACHE:
        return "auto"
    return "auto" if model.n_gpu_layers != 0 and supports_gpu_offload() else "off"


MAX_CTX = 2**24        # tokens: a context, a batch (llama.cpp: 32-bit; 16M cells is already ~TBs of KV)
MAX_SEQS = 256         # llama.cpp's LLAMA_MAX_SEQ
MAX_THREADS = 512      # ggml's GGML_MAX_N_THREADS


@dataclass(frozen=True)   # checked once: a field changed afterwards skipped the checks (10**11 threads aborted)
class EngineConfig:
    """How ``Engine.load`` makes the contexts and how generations run; the command line's flags set the
    same fields (``-c`` n_ctx, ``-b`` n_batch, ``--seqs`` n_seq_max, ``-t`` threads, ``--gpu-layers``,
    ...). Frozen and checked when made: ``dataclasses.replace`` gives a changed copy.

    n_ctx, n_batch, n_seq_max: the target's context in tokens, the most tokens one decode takes (a draft
        tree, a prefill chunk), the sequence ids per context (branches and a lookahead window).
    threads, threads_batch: llama.cpp's threads for single steps and for larger decodes; None: the cores
        other processes leave idle, and ``threads``.
    flash_attn: "off", "on" or "auto"; None: off on a CPU (bit-reproducible greedy output), auto on a GPU.
    gpu_layers, draft_gpu_layers: layers on the GPU (-1: all); None: all where llama.cpp has a GPU backend.
    main_gpu: the whole of both models on this GPU; None: their layers split across every GPU.
    type_k, type_v, draft_type_k, draft_type_v: the KV caches' types (f16, q8_0, q4_0, ...).
    draft_n_ctx: the draft's context; None: n_ctx.
    adaptive: draft lengths priced by the measured cost model (False: each method's fixed settings).
    calibration: "auto" (the cached or measured cost curve) or "off" (verification priced as one step).
    max_draft: the longest draft the scheduler prices, in tokens.
    learned: start from what earlier sessions learned of acceptance, and save what this one learns.
    huge_pages: weights kept on the CPU read into 2 MiB pages.
    round_size: every drafting round decodes this many tokens (0: the draft's size; None: 4 where the whole
        target is on a CUDA device, else 0).
    overlap: draft while the target decodes a plain step; None: where the device lets it (a GPU).
    round_switch: with round_size, plain steps where its rounds would write fewer tokens than they cost.
    """

    n_ctx: int = 4096             # the target's context, in tokens
    n_batch: int = 256            # largest tree / prefill chunk in one decode
    n_seq_max: int = 16           # sequence ids per context (branches + lookahead window)
    threads: int | None = None    # None: the cores other processes leave idle (cpu_load.py)
    threads_batch: int | None = None   # threads of decodes of more than a token; None: ``threads``
    # off | on | auto; None: ``default_flash_attn`` per model (off on a CPU: bit-reproducible greedy
    # output, docs/design.md#exactness; on a GPU llama.cpp's own default, auto)
    flash_attn: str | None = None
    # layers on the GPU (-1: all); None: all where llama.cpp has a GPU backend, else 0 (the CLI's auto)
    gpu_layers: int | None = None
    draft_gpu_layers: int | None = None
    # the whole of both models on this GPU; None: llama.cpp's default, their layers split across every GPU
    main_gpu: int | None = None
    type_k: str = "f16"           # the KV cache's types (q8_0, q4_0, ...: llama.cpp's), target and draft
    type_v: str = "f16"
    draft_type_k: str = "f16"
    draft_type_v: str = "f16"
    draft_n_ctx: int | None = None   # the draft's context; None: n_ctx
    adaptive: bool = True         # cap draft lengths by the measured cost model (scheduler.py)
    calibration: str = "auto"     # auto: cached or measured cost curve; off: assume flat costs
    max_draft: int = 16           # the longest draft the scheduler prices (tokens)
    learned: bool = True          # start from the estimates earlier sessions learned, and save them (learned.py)
    huge_pages: bool = True       # weights kept on the CPU read into 2 MiB pages (llama/huge_pages.py)
    # every round of a drafting method decodes this many tokens, a plain step too (0: the draft's size):
    # drafts are cut to it and a shorter chain is filled with guesses (``filled``). A decode of an
    # unchanged shape reuses llama.cpp's graph, and on a CUDA build its CUDA graph (docs/design.md#cost-model).
    # None: ``default_round_size`` (4 where the whole target is on a CUDA device, else 0)
    round_size: int | None = None
    # draft while the target decodes a plain step (the draft's first level is checked by that step, the
    # rest verified next round): free on a GPU, where llama_decode returns before the decode ends, and a
    # pass more per draft on a CPU, where it does not. None: where plain steps were seen to wait for their
    # logits after llama_decode returned (ASYNC_WAIT_SHARE), and until one is timed, on a GPU
    overlap: bool | None = None
    # in rounds of one size that draft while they decode: plain one-token steps where rounds of
    # ``round_size`` would write fewer tokens than they cost, and back (round_sizer.py)
    round_switch: bool = True

    def __post_init__(self) -> None:
        """Every value checked here, in one line each: a bad one once failed deep in a generation (a
        numpy error from the scheduler for max_draft=0) or was taken silently (round_size=-1)."""
        for name in ("gpu_layers", "draft_gpu_layers"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, -1 if supports_gpu_offload() else 0)
        # llama.cpp takes these as 32-bit integers: 2**32 + 512 became a context of 512, a batch of
        # 2**32 + 2 failed an assertion, 10**11 threads aborted the process
        bounds = {"n_ctx": (0, MAX_CTX), "n_batch": (1, MAX_CTX), "n_seq_max": (1, MAX_SEQS),
                  "threads": (0, MAX_THREADS), "threads_batch": (0, MAX_THREADS), "gpu_layers": (-1, 2**31 - 1),
                  "draft_gpu_layers": (-1, 2**31 - 1), "main_gpu": (0, 2**31 - 1), "draft_n_ctx": (0, MAX_CTX),
                  "max_draft": (1, MAX_CTX), "round_size": (0, MAX_CTX)}
        optional = {"threads", "threads_batch", "draft_n_ctx", "round_size", "main_gpu"}
        for name, (low, high) in bounds.items():
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not is_integer(value) or not low <= value <= high:
                raise ParameterError(f"EngineConfig.{name} must be an integer from {low} to {high}"
                                     f"{' or None' if name in optional else ''} (got {value!r})")
            object.__setattr__(self, name, int(value))   # numpy's integers too
        if self.round_size == 1:   # the command line's --round-size refuses it too
            raise ParameterError("EngineConfig.round_size must be 0 (every round its draft's size) or 2 and more: "
                                 "a round of 1 token checks no draft")
        if self.round_size and (self.round_size > self.n_batch or 0 < self.n_ctx < self.round_size):
            raise ParameterError(f"EngineConfig.round_size ({self.round_size}) must fit the batch ({self.n_batch}) "
                                 f"and the context ({self.n_ctx})")
        choices = {"flash_attn": (None, "on", "off", "auto"), "calibration": ("auto", "off"),
                   "overlap": (None, True, False)}
        for name in ("adaptive", "learned", "huge_pages", "round_switch"):
            choices[name] = (True, False)
        for name in ("type_k", "type_v", "draft_type_k", "draft_type_v"):   # refused before the weights load
            choices[name] = tuple(KV_CACHE_TYPES)
        for name, allowed in choices.items():
            value = getattr(self, name)
            if isinstance(value, np.bool_):
                value = bool(value)
                object.__setattr__(self, name, value)
            # ``is`` for None/True/False: 1 == True must not pass for a flag
            if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
                raise ParameterError(f"EngineConfig.{name} must be one of {', '.join(map(repr, allowed))} "
                                     f"(got {value!r})")
        quantised_v = [n for n in ("type_v", "draft_type_v") if getattr(self, n) not in UNQUANTISED_CACHE]
        if self.flash_attn == "off" and quantised_v:   # llama.cpp refused it after the weights loaded
            raise ParameterError(f"EngineConfig.{quantised_v[0]}={getattr(self, quantised_v[0])!r} needs flash "
                                 "attention (llama.cpp quantises the V cache only with it): flash_attn 'on', "
                                 "'auto' or None (--flash-attn), or an f16 V cache")
