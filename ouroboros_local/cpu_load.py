"""How many of this process's cores other processes keep busy right now (no llama.cpp import).

llama.cpp's threads wait for each other at every graph node; when another process holds one of the cores
they run on, each wait can last a scheduler time slice, and decoding collapses (SmolLM2-135M: 0.3 tok/s
with 2 threads next to another decode loop, 55 tok/s with 1). So the default thread count leaves out the
cores that are busy now, and a cost curve measured while other processes were busy is not trusted.

The measure: the busy share of the usable CPUs in /proc/stat over a short window (steal time counts as
busy: on a VM it is another guest's work), minus the CPU time this process used itself (os.times counts
all of its threads), in cores. Where /proc/stat is missing, the 1-minute load average stands in.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

SAMPLE_SECONDS = 0.15       # long enough for ~15 clock ticks per CPU, short enough for every start
MIN_TICKS = 8               # fewer clock ticks (all CPUs together) say too little about the load
REUSE_SECONDS = 2.0         # a target and a draft context created together share one sample

_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)   # user nice system irq softirq steal (guest is inside user)
_IDLE_FIELDS = (3, 4)               # idle iowait


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - macOS / Windows
        return max(1, os.cpu_count() or 1)


class MathCores(NamedTuple):
    count: int
    kind: str   # what was counted, for doctor: "physical cores", "performance cores" or "usable cores"


@functools.lru_cache(maxsize=1)
def math_cores() -> MathCores:
    """The usable cores worth a llama.cpp thread, counted as llama.cpp's own default counts them: one
    per physical core (a hyperthread shares its core's arithmetic units and memory bandwidth: decoding
    gains nothing from it, and every thread waits for the slowest at each graph node), and on Apple
    Silicon and Intel's hybrid CPUs only the performance cores. Windows: the usable cores."""
    usable = usable_cores()
    if sys.platform == "darwin":
        for name, kind in (("hw.perflevel0.physicalcpu", "performance cores"), ("hw.physicalcpu", "physical cores")):
            count = _sysctl_int(name)
            if count:
                return MathCores(min(count, usable), kind)
        return MathCores(usable, "usable cores")
    ids = _usable_cpu_ids()
    return linux_math_cores(ids, Path("/sys/devices")) if ids else MathCores(usable, "usable cores")


def linux_math_cores(cpu_ids: set[int], sysfs: Path) -> MathCores:
    """``cpu_ids``' physical cores, from sysfs's sibling lists; the performance ones where the kernel
    names an Intel hybrid CPU's (``cpu_core/cpus``). All of ``cpu_ids`` where sysfs says nothing."""
    kind = "physical cores"
    performance = _cpu_list(sysfs / "cpu_core" / "cpus") & cpu_ids
    if performance and _cpu_list(sysfs / "cpu_atom" / "cpus") & cpu_ids:
        cpu_ids, kind = performance, "performance cores"
    siblings = {i: frozenset(_cpu_list(sysfs / "system" / "cpu" / f"cpu{i}" / "topology" / "thread_siblings_list"))
                for i in cpu_ids}
    if not any(siblings.values()):
        return MathCores(max(1, len(cpu_ids)), "usable cores")
    return MathCores(len({group or frozenset([i]) for i, group in siblings.items()}), kind)


def _cpu_list(path: Path) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as numbers; empty where unreadable."""
    try:
        text = path.read_text(encoding="ascii").strip()
        out: set[int] = set()
        for part in filter(None, text.split(",")):
            low, _, high = part.partition("-")
            out.update(range(int(low), int(high or low) + 1))
        return out
    except (OSError, ValueError):
        return set()


def _sysctl_int(name: str) -> int | None:
    try:
        run = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
        return int(run.stdout.strip()) if run.returncode == 0 else None
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _usable_cpu_ids() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return None


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative CPU time of the usable CPUs (clock ticks) and of this process (seconds)."""

    busy: int
    total: int
    own_seconds: float
    n_cpus: int


@functools.cache
def cpu_model() -> str:
    """The CPU's model name, as /proc/cpuinfo (or macOS's sysctl) gives it."""
    try:
        info = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        info = ""
    m = re.search(r"^model name\s*:\s*(.+)$", info, re.MULTILINE) or \
        re.search(r"^(?:Hardware|Processor|cpu model)\s*:\s*(.+)$", info, re.MULTILINE)
    if m:
        return m.group(1).strip()
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def read_proc_stat(path: str = "/proc/stat") -> str | None:
    try:
        with open(path) as fh:
            return fh.read()
    except OSError:
        return None


def parse_cpu_times(stat_text: str, cpu_ids: set[int] | None, own_seconds: float) -> CpuTimes | None:
    """Sum the per-CPU lines of ``cpu_ids`` (all CPUs when None or when none of them is listed)."""
    per_cpu: dict[int, list[int]] = {}
    total_line: list[int] | None = None
    for line in stat_text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *fields = line.split()
        values = [int(v) for v in fields[:8]] + [0] * max(0, 8 - len(fields))
        if name == "cpu":
            total_line = values
        elif name[3:].isdigit():
            per_cpu[int(name[3:])] = values
    chosen = [per_cpu[i] for i in sorted(cpu_ids or ()) if i in per_cpu]
    if not chosen:
        if total_line is None:
            return None
        chosen, n_cpus = [total_line], max(1, len(per_cpu))
    else:
        n_cpus = len(chosen)
    busy = sum(v[i] for v in chosen for i in _BUSY_FIELDS)
    idle = sum(v[i] for v in chosen for i in _IDLE_FIELDS)
    return CpuTimes(busy=busy, total=busy + idle, own_seconds=own_seconds, n_cpus=n_cpus)


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover
        return 100


def read_cpu_times(read_stat: Callable[[], str | None] = read_proc_stat) -> CpuTimes | None:
    text = read_stat()
    if text is None:
        return None
    return parse_cpu_times(text, _usable_cpu_ids(), _own_cpu_seconds())


def others_busy_cores(before: CpuTimes, after: CpuTimes, clock_ticks: int | None = None) -> float | None:
    """Cores kept busy by other processes between two readings (None when too few clock ticks passed)."""
    total = after.total - before.total
    if total < MIN_TICKS:
        return None
    own_ticks = (after.own_seconds - before.own_seconds) * (clock_ticks or _clock_ticks())
    others = max(0.0, (after.busy - before.busy) - own_ticks)
    return min(float(after.n_cpus), others / total * after.n_cpus)


class LoadMeter:
    """Others' busy cores over a stretch of work: ``with LoadMeter() as meter: ...; meter.busy_cores``."""

    def __init__(self, read_stat: Callable[[], str | None] = read_proc_stat):
        self.read_stat = read_stat
        self.busy_cores: float | None = None
        self.readable = False       # False where /proc/stat cannot be read
        self._before: CpuTimes | None = None

    def __enter__(self) -> "LoadMeter":
        self._before = read_cpu_times(self.read_stat)
        return self

    def __exit__(self, *exc: object) -> None:
        after = read_cpu_times(self.read_stat)
        if self._before is not None and after is not None:
            self.readable = True
            self.busy_cores = others_busy_cores(self._before, after)


def _load_average_busy() -> float | None:
    try:
        return max(0.0, os.getloadavg()[0])
    except (AttributeError, OSError):  # pragma: no cover
        return None


_last_sample: tuple[float, float | None] | None = None


def busy_cores_now(seconds: float = SAMPLE_SECONDS, reuse: float = REUSE_SECONDS,
                   read_stat: Callable[[], str | None] = read_proc_stat,
                   sleep: Callable[[float], None] = time.sleep) -> float | None:
    """Cores other processes keep busy, sampled over ``seconds`` (a sample younger than ``reuse``
    seconds is reused); the 1-minute load average where /proc/stat is missing; None if neither."""
    global _last_sample
    now = time.monotonic()
    if _last_sample is not None and now - _last_sample[0] < reuse:
        return _last_sample[1]
    meter = LoadMeter(read_stat)
    with meter:
        sleep(seconds)
    busy = meter.busy_cores if meter.readable else _load_average_busy()
    _last_sample = (time.monotonic(), busy)
    return busy


def idle_threads(cores: int, busy: float | None, limit: int | None = None) -> int:
    """Threads for the cores left idle by ``busy`` other cores' worth of work, at least 1, at most
    ``limit`` (``math_cores``).

    A core counts as taken once others use more than half of it: a thread sharing a core with a busy
    process makes every other thread wait for it at each graph node."""
    cap = min(cores, limit or cores)
    if busy is None:
        return cap
    return max(1, min(cap, cores - int(busy + 0.5)))


def contended(busy: float | None, cores: int, threads: int) -> bool:
    """Whether ``threads`` of ours had to share cores with others' ``busy`` cores of work (threads past
    the cores share them with each other, not with others: a curve of -t 3 on 2 cores was provisional
    for good, waiting for a quiet machine that could never come)."""
    return busy is not None and busy > cores - min(threads, cores) + 0.5
