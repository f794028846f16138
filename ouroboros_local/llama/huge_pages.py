"""Model weights in 2 MiB pages (Linux transparent huge pages), for faster CPU decoding.

A decode streams every weight once. llama.cpp maps a GGUF file in 4 KiB pages (or, reading it, puts the
weights in 4 KiB anonymous pages), so each step walks tens of thousands of page-table entries; in a VM
each miss of the TLB costs a two-level walk. Read into memory that asked for transparent huge pages
(``madvise(MADV_HUGEPAGE)``), the same weights take a few hundred pages. Measured on a 2-vCPU Zen 4 VM
with one process holding both kinds of engine and alternating per prompt: generation 1-3% faster
(SmolLM2-135M, Qwen2.5-Coder-1.5B), a bare decode loop 4-6% (docs/benchmarks.md, thirty-first session).

How: llama.cpp allocates the weight buffers before it reads the first tensor, and calls the progress
callback before each tensor. At its first call the anonymous mappings that appeared since the load began
are the weight buffers: they are advised then, before any page of them is written, so the kernel backs
them with huge pages as they fill (no copying). The model is read (``LLAMA_LOAD_MODE_NONE``) instead of
mapped: a mapped file's pages stay 4 KiB. Advice only; where the kernel has no huge page to give, pages
stay small and nothing else changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger("ouroboros_local")

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14                   # linux/mman.h
_THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
MEMORY_SHARE = 0.5                    # only models within this share of the available memory are read in


def setting() -> str:
    """The kernel's THP mode (always, madvise or never), or "unavailable" (not Linux, no THP)."""
    if not sys.platform.startswith("linux"):
        return "unavailable"
    try:
        text = _THP_SETTING.read_text()
    except OSError:
        return "unavailable"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else text.strip()


def available() -> bool:
    """Can this process ask for transparent huge pages (Linux, THP not switched off)?"""
    return setting() not in ("never", "unavailable")


def memory_available() -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo says nothing); ``doctor`` prints it too."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def worth_it(model_bytes: int) -> bool:
    """Read a model of ``model_bytes`` into huge pages? Where THP can be asked for and the model fits well
    within the available memory: read in, its weights cannot be paged back to the file under pressure
    as mapped ones can."""
    free = memory_available()
    return available() and free is not None and model_bytes <= MEMORY_SHARE * free


def anonymous_regions() -> set[tuple[int, int]]:
    """This process's writable anonymous mappings (start, end), from /proc/self/maps."""
    out = set()
    with open("/proc/self/maps") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) >= 5 and "w" in fields[1] and (len(fields) == 5 or fields[5] == "[heap]"):
                start, end = fields[0].split("-")
                out.add((int(start, 16), int(end, 16)))
    return out


def new_parts(now: set[tuple[int, int]], before: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The address ranges in ``now`` that no region of ``before`` covered (the kernel merges a new
    mapping with an adjacent one of the same kind: only its new part is new)."""
    out = []
    for start, end in sorted(now):
        pieces = [(start, end)]
        for b_start, b_end in before:
            if b_end <= start or b_start >= end:
                continue
            pieces = [part for lo, hi in pieces
                      for part in ((lo, min(hi, b_start)), (max(lo, b_end), hi)) if part[1] > part[0]]
        out += pieces
    return out


def advise(regions: Iterable[tuple[int, int]]) -> int:
    """MADV_HUGEPAGE over the whole 2 MiB pages inside each region; returns the bytes advised."""
    pages = [(low, high) for start, end in regions
             if (high := end // HUGE_PAGE * HUGE_PAGE) > (low := -(-start // HUGE_PAGE) * HUGE_PAGE)]
    if not pages:
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return sum(high - low for low, high in pages if madvise(low, high - low, _MADV_HUGEPAGE) == 0)


class WeightAdvice:
    """A load's progress callback that advises the weight buffers at its first call (module docstring).
    Keep the object alive until the load returns: llama.cpp holds a pointer to ``callback``."""

    def __init__(self, callback_type: type, keep_going: Callable[[], bool] = lambda: True) -> None:
        self.before = anonymous_regions()
        self.advised = 0
        self._done = False
        self._keep_going = keep_going   # False stops the load (a Ctrl-C, llama/interrupts.py)
        self.callback = callback_type(self._on_progress)

    def _on_progress(self, progress: float, user: ctypes.c_void_p) -> bool:
        if not self._done:
            self._done = True
            try:
                self.advised = advise(new_parts(anonymous_regions(), self.before))
            except (OSError, ValueError, AttributeError) as exc:   # advice only: the load goes on
                log.debug("huge pages not advised: %s", exc)
        return self._keep_going()    # False aborts the load
