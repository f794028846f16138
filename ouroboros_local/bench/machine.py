"""What a benchmark records about where it ran: CPU, cores, memory and its copy bandwidth, GPUs, library
versions, and the model files (size, sha256)."""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from ..cpu_load import cpu_model


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def physical_cores() -> int | None:
    info = _read("/proc/cpuinfo")
    cores = set(re.findall(r"physical id\s*:\s*(\d+)[\s\S]*?core id\s*:\s*(\d+)", info))
    return len(cores) or None


def memory_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def gpus() -> list[str]:
    """The GPUs, each as "NAME, MEMORY, ...": nvidia-smi's (name, memory, driver), else those llama.cpp's
    backends offload to (a Mac's Metal GPU, Vulkan's, ROCm's), whose results once named only the CPU."""
    return _nvidia_gpus() or _llama_gpus()


def _nvidia_gpus() -> list[str]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        done = subprocess.run([exe, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    if done.returncode != 0:   # a driver it cannot reach, no device: its message is on stdout, not a GPU
        return []
    return [ln.strip() for ln in done.stdout.splitlines() if ln.strip()]


def _llama_gpus() -> list[str]:
    try:
        from ..llama import devices, offload_gpus

        found = offload_gpus(devices())
    except Exception:   # llama.cpp not importable, or no device API in its library: the rest is reported
        return []
    return [f"{d.description or d.name}, {d.memory_total // 2**20} MiB, llama.cpp device {d.name}" for d in found]


def measure_memory_bandwidth(mib: int = 128, repeats: int = 5) -> float | None:
    """Best-of-N numpy copy bandwidth in GB/s (bytes read + bytes written), a rough ceiling for CPU decoding."""
    try:
        import numpy as np

        a = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
        b = np.empty_like(a)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            np.copyto(b, a)
            best = min(best, time.perf_counter() - t0)
        return 2 * a.nbytes / best / 1e9
    except MemoryError:  # pragma: no cover
        return None


def machine_info(measure_bandwidth: bool = True) -> dict[str, Any]:
    info: dict[str, Any] = {
        "cpu": cpu_model(), "logical_cores": os.cpu_count(), "physical_cores": physical_cores(),
        "memory_bytes": memory_bytes(), "os": platform.platform(), "machine": platform.machine(),
        "python": platform.python_version(), "gpus": gpus(), "memory_bandwidth_gbs": None,
        "llama_system_info": None, "gpu_offload": None, "load_average": None,
    }
    try:
        info["load_average"] = list(os.getloadavg())
    except (OSError, AttributeError):
        pass
    try:
        from ..llama import binding

        info["llama_system_info"] = binding.system_info()
        info["gpu_offload"] = binding.supports_gpu_offload()
    except Exception:  # llama.cpp not importable: still report the rest
        pass
    if measure_bandwidth:
        info["memory_bandwidth_gbs"] = measure_memory_bandwidth()
    return info


def versions() -> dict[str, Any]:
    from importlib import metadata

    from .. import __version__

    out: dict[str, Any] = {"ouroboros_local": __version__}
    for dist in ("llama-cpp-python", "numpy", "matplotlib", "tqdm"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    root = Path(__file__).resolve().parents[2]
    head = _read(str(root / ".git" / "HEAD")).strip()
    if head.startswith("ref: "):
        head = _read(str(root / ".git" / head[5:])).strip()
    out["git_commit"] = head if re.fullmatch(r"[0-9a-f]{40}", head or "") else None
    return out


def sha256_file(path: str | Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def model_info(model: Any, hash_limit: int = 256 << 20, force_hash: bool = False) -> dict[str, Any] | None:
    """Path, file size, weight bytes (what one target pass reads), parameters; sha256 when cheap."""
    if model is None:
        return None
    path = Path(model.path)
    size = path.stat().st_size if path.is_file() else None
    info: dict[str, Any] = {"path": str(path), "file": path.name, "file_bytes": size, "sha256": None}
    for key in ("size_bytes", "n_params", "description", "arch", "n_layer"):
        try:
            info[key] = getattr(model, key)
        except Exception:
            info[key] = None
    try:
        info["name"] = model.meta("general.name")
    except Exception:
        info["name"] = None
    if size is not None and (force_hash or size <= hash_limit):
        info["sha256"] = sha256_file(path)
    return info


# ---- output files ------------------------------------------------------------------------------
