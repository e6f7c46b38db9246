"""Memory readings: CUDA caching-allocator statistics and the host process's resident set.

No I/O, no collectives: these read counters the allocator and the OS keep anyway. Byte counts
are converted to GB as ``bytes / 1e9`` (decimal gigabytes, as Composer's ``MemoryMonitor`` and
Megatron-Bridge's ``report_memory`` do); counts stay counts.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

import torch

__all__ = [
    "BYTES_PER_GB",
    "CUDA_STATS",
    "HOST_KEYS",
    "REDUCTIONS",
    "cuda_memory_readings",
    "host_memory_readings",
]

BYTES_PER_GB = 1e9

# Our key (under ``memory/``) -> (torch.cuda.memory_stats() key, is a byte count).
# Megatron-Bridge / Composer names in comments; see docs/callbacks.md for the deviations.
CUDA_STATS: dict[str, tuple[str, bool]] = {
    "allocated_gb": ("allocated_bytes.all.current", True),  # mem-allocated-gigabytes
    "active_gb": ("active_bytes.all.current", True),  # mem-active-gigabytes
    "inactive_gb": ("inactive_split_bytes.all.current", True),  # mem-inactive-gigabytes
    "reserved_gb": ("reserved_bytes.all.current", True),  # mem-reserved-gigabytes
    "peak_allocated_gb": ("allocated_bytes.all.peak", True),  # mem-max-allocated-gigabytes
    "peak_active_gb": ("active_bytes.all.peak", True),  # mem-max-active-gigabytes
    "peak_inactive_gb": ("inactive_split_bytes.all.peak", True),  # mem-max-inactive-gigabytes
    "peak_reserved_gb": ("reserved_bytes.all.peak", True),  # mem-max-reserved-gigabytes
    "alloc_retries": ("num_alloc_retries", False),  # mem-alloc-retires (sic)
    "ooms": ("num_ooms", False),
}

# Statistics the cudaMallocAsync backend (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)
# leaves at 0 in memory_stats: it fills allocated, active and reserved bytes from the driver's
# pool and no others (torch's c10/cuda/CUDAMallocAsyncAllocator.cpp, getDeviceStats; measured
# on an H100 with torch 2.11: 0 for these four while the native backend counted 264 MB of
# inactive split blocks for the same allocations). Not measured, so NaN, not 0.
NATIVE_ONLY_STATS = frozenset({"inactive_gb", "peak_inactive_gb", "alloc_retries", "ooms"})

# The keys (under ``memory/``) of host_memory_readings, in this order.
HOST_KEYS = ("rss_gb", "peak_rss_gb")

# Reductions over ranks a MemoryMonitor can report.
REDUCTIONS = ("max", "min", "mean")


def _allocator_backend() -> str:
    """``torch.cuda.get_allocator_backend()``; "native" where it cannot say (a faked CUDA API,
    a torch built without CUDA, whose call raises AttributeError)."""
    try:
        return str(torch.cuda.get_allocator_backend())
    except Exception:
        return "native"


def cuda_memory_readings(device: torch.device | int | None = None) -> dict[str, float]:
    """The :data:`CUDA_STATS` of ``device`` (GB for byte counts), from
    ``torch.cuda.memory_stats``. Host-side counters: no synchronisation, no device transfer.

    A statistic that ``memory_stats`` does not have is NaN ("not measured"), never 0: an older
    torch, or a device whose allocator was never initialised (``memory_stats`` is ``{}``
    then), has not measured a zero; nor has the cudaMallocAsync backend, which leaves
    :data:`NATIVE_ONLY_STATS` at 0. Raises what ``memory_stats`` raises (a
    ``CUDAPluggableAllocator``, RMM's for one, has no statistics: ``RuntimeError``)."""
    stats = torch.cuda.memory_stats(device)
    backend = _allocator_backend()
    out: dict[str, float] = {}
    for key, (stat, is_bytes) in CUDA_STATS.items():
        value = stats.get(stat)
        if backend == "cudaMallocAsync" and key in NATIVE_ONLY_STATS:
            out[key] = math.nan  # present, always 0: not counted by this backend
        elif value is None:
            # (Composer's MemoryMonitor also keeps only the statistics memory_stats has)
            out[key] = math.nan
        else:
            out[key] = float(value) / BYTES_PER_GB if is_bytes else float(value)
    return out


def _proc_status_bytes(pid: int, field: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (Linux) in bytes, or ``None``."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak_rss_bytes(pid: int) -> int | None:
    # Linux: the high-water mark of the process's own address space (VmHWM, since its last
    # exec). Not ru_maxrss there: the kernel carries it over exec, so a worker started by
    # fork+exec (subprocess, torch.multiprocessing "spawn", Lightning's launcher) reports its
    # launcher's peak when that was higher (measured: 1.5 GB for a 14 MB child).
    peak = _proc_status_bytes(pid, "VmHWM:")
    if peak is not None:
        return peak
    if sys.platform == "linux" or pid != os.getpid():
        return None
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # macOS reports bytes, the BSDs KiB.
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def host_memory_readings(process: Any = None) -> dict[str, float]:
    """The process's resident set size and its peak since the process started, in GB.

    ``rss_gb`` from ``psutil`` (``memory_info().rss``; without psutil, ``VmRSS`` of
    ``/proc/self/status`` on Linux, the same counters); ``peak_rss_gb`` from ``VmHWM`` of
    ``/proc/<pid>/status`` on Linux, ``getrusage(RUSAGE_SELF).ru_maxrss`` on other POSIX
    systems and ``peak_wset`` on Windows, never below ``rss_gb``. ``process``: a
    ``psutil.Process`` (default: this process). Raises ``ImportError`` when psutil is missing
    and the platform has no ``/proc`` to read instead.
    """
    if process is None:
        try:
            import psutil
        except ImportError:
            # psutil is a dependency, but an environment installed with --no-deps may lack
            # it; Linux keeps the same counters in /proc (psutil reads them there too).
            pid = os.getpid()
            rss = _proc_status_bytes(pid, "VmRSS:")
            if rss is None:
                raise ImportError(
                    "reading the resident set size needs psutil on this platform "
                    "(pip install psutil)"
                ) from None
            peak = _peak_rss_bytes(pid) or rss
            return {"rss_gb": rss / BYTES_PER_GB, "peak_rss_gb": max(peak, rss) / BYTES_PER_GB}
        process = psutil.Process()
    info = process.memory_info()
    rss = int(info.rss)
    peak = getattr(info, "peak_wset", None) or _peak_rss_bytes(process.pid) or rss
    return {"rss_gb": rss / BYTES_PER_GB, "peak_rss_gb": max(peak, rss) / BYTES_PER_GB}
