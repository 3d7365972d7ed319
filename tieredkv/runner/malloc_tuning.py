"""glibc malloc settings for CPU inference.

Each engine step allocates and frees tensors of many megabytes (gathered K/V, activations, logits).
With glibc's defaults such blocks are mmap'ed fresh or trimmed back to the OS after every free, so
every step pays page faults on tens of megabytes: that can double a decode step on CPU. Raising
the mmap and trim thresholds keeps that memory in the heap for reuse. The settings are process-wide;
`EngineConfig(cpu_malloc_tuning=False)` leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import platform

log = logging.getLogger("tieredkv")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
_TRIM_THRESHOLD = 1 << 30


def tune_glibc_malloc() -> bool:
    """Returns True when the thresholds were set (Linux with glibc), False elsewhere."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    except (OSError, AttributeError):
        return False
    if not ok:
        log.debug("mallopt refused the thresholds")
    return bool(ok)


def release_free_memory(collect: bool = True) -> bool:
    """Hands the heap's free memory back to the OS (glibc's malloc_trim, every arena), after work that
    freed much of it (loading the weights, the decode graph's compile, a burst of requests once the engine
    is idle): with the trim threshold above, it would stay resident. `collect` runs Python's garbage
    collector first. Returns True where it ran."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if collect:
        gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def process_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM", "RssAnon", ...) in bytes; 0 where it is not
    there (no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
