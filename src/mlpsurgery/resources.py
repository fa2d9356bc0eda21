"""Memory a setting needs, checked before it is allocated.

A command given a size that cannot fit (a batch of a billion sequences, a rank of a billion, a config.json edited to a
2^40-wide MLP) would otherwise fail in the allocator with a traceback, or push the machine into swap. Each such size is
turned into bytes before anything is allocated and `check_memory` refuses it, in one line with both numbers and the
setting to change, when it exceeds what the machine has available.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from .errors import MLPSurgeryError


def _meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo (Linux: what can be allocated without swapping), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_available() -> int | None:
    """Free physical memory as the OS reports it (os.sysconf), where /proc/meminfo is missing."""
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES")
        size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _cgroup_available() -> int | None:
    """What the process's memory cgroup (a container's limit) still allows, where it sets one (v2, then v1)."""
    pairs = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
             (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))
    for limit, usage in pairs:
        try:
            text = limit.read_text().strip()
            if text == "max":
                return None
            cap, used = int(text), int(usage.read_text().strip())
        except (OSError, ValueError):
            continue
        if cap >= 1 << 60:  # v1 writes "no limit" as a huge number
            return None
        return max(cap - used, 0)
    return None


def available_memory(device=None) -> int | None:
    """Bytes that new allocations can take now: on a CUDA device, its free memory; else the host's available memory
    (MemAvailable of /proc/meminfo, else os.sysconf's free pages), capped by a container's memory limit. None where
    it cannot be told (nothing is then refused)."""
    if device is not None:
        import torch

        dev = torch.device(device)
        if dev.type == "cuda":
            try:
                return int(torch.cuda.mem_get_info(dev)[0])
            except (RuntimeError, AssertionError):
                return None
        if dev.type == "meta":
            return None
    host = _meminfo_available()
    if host is None:
        host = _sysconf_available()
    cap = _cgroup_available()
    if host is None:
        return cap
    return host if cap is None else min(host, cap)


def human_bytes(n: float) -> str:
    from .report import human_bytes as _human

    return _human(n)


def check_memory(nbytes: int, what: str, fix: str, device=None) -> None:
    """Refuse, before it is allocated, a setting whose memory (`nbytes`, at least) exceeds what is available on
    `device` (default: the host): "WHAT needs 3.2 TiB of memory, this machine has 20.1 GiB available; FIX"."""
    avail = available_memory(device)
    if avail is None or nbytes <= avail:
        return
    where = "this machine has" if device is None or str(device).startswith("cpu") else f"{device} has"
    raise MLPSurgeryError(f"{what} needs {human_bytes(nbytes)} of memory, {where} {human_bytes(avail)} available; "
                          f"{fix}")


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc), so a released layer leaves the resident set."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
