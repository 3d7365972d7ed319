"""glibc malloc settings for CPU inference.

Each engine step allocates and frees tensors of many megabytes (gathered K/V, activations, logits).
With glibc's defaults such blocks are mmap'ed fresh or trimmed back to the OS after every free, so
every step pays page faults on tens of megabytes: that can double a decode step on CPU. Raising
the mmap and trim thresholds keeps that memory in the heap for reuse. The settings are process-wide;
`EngineConfig(cpu_malloc_tuning=False)` leaves malloc alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import mmap
import platform

import torch

log = logging.getLogger("tieredkv")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit
_TRIM_THRESHOLD = 1 << 30


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    """The C library, loaded once (OSError where it cannot be loaded): find_library runs `ldconfig -p` in a
    child process, a fork of the whole engine process, which the worker would otherwise pay every time it turns
    idle (release_free_memory)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    with contextlib.suppress(AttributeError):  # a C library without madvise: its callers say so
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def tune_glibc_malloc() -> bool:
    """Returns True when the thresholds were set (Linux with glibc), False elsewhere."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = _libc()
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
        _libc().malloc_trim(0)
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


HUGE_PAGE = 2 << 20


def anonymous_memory(nbytes: int, huge_pages: bool = False) -> torch.Tensor:
    """`nbytes` of zeros (uint8) in an anonymous private mapping, whose pages the kernel takes when first
    written (the tensor and its views keep the mapping alive); with `huge_pages`, transparent huge pages are
    asked for where the kernel has them."""
    region = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8)[:nbytes]


PAGE = mmap.PAGESIZE  # the pages a buffer's allocation header lies in (4 KB on x86)
MADV_COLLAPSE = 25  # Linux 6.1 on: move a range's pages into transparent huge pages now, contents kept


def huge_page_stretches(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The 2 MB-aligned stretches (address, bytes) that buffers `ranges` ((address, bytes), allocated one after
    another by someone else's allocator) cover whole: each buffer taken from the page before it (its
    allocation's header) to the end of its last page, neighbours merged."""
    spans = sorted((max(0, a - PAGE) // PAGE * PAGE, -(-(a + n) // PAGE) * PAGE) for a, n in ranges if n > 0)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    out = []
    for start, end in merged:
        first, last = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
        if last > first:
            out.append((first, last - first))
    return out


def collapse_into_huge_pages(ranges: list[tuple[int, int]]) -> int:
    """Moves the memory of buffers `ranges` into transparent huge pages where they lie (MADV_COLLAPSE over
    huge_page_stretches): for memory another library allocated, such as oneDNN's packed weights, which cannot
    be put in huge_page_arena without a second copy. Returns the bytes moved: 0 where the kernel cannot (not
    Linux, before 6.1, huge pages off). The fp32 default model's compiled decode took 0.93-0.96x the time with
    its packed weights so (428 of their 513 MiB; an Intel Xeon KVM guest, two engines alternating, two runs),
    bf16 0.99x (162 of 256 MiB); on an AMD EPYC Zen 5 a version that took each buffer's own spans, fp32 0.98x."""
    if platform.system() != "Linux":
        return 0
    try:
        libc = _libc()
    except OSError:
        return 0
    done = 0
    for start, nbytes in huge_page_stretches(ranges):
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes), MADV_COLLAPSE) == 0:
            done += nbytes
    return done


def huge_page_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU `tensors` laid out one after another, in the order given, in one anonymous mapping
    where the kernel is asked for transparent huge pages (Linux's madvise mode; elsewhere plain pages). The
    copies hold the mapping; the originals can be freed. A decode step that reads every weight in turn then
    reads one stream, with a TLB entry for 2 MB rather than 4 KB: the int4 default model's one-row products
    took 13% less that way than as separate tensors (8% of it the layout alone); its decode took 0.96x the
    time, the Q4_1 file's 0.97x (AMD EPYC Zen 5, interleaved in one process)."""
    sizes = [t.numel() * t.element_size() for t in tensors]
    buf = anonymous_memory(sum(-(-n // 64) * 64 for n in sizes) + HUGE_PAGE, huge_pages=True)  # room to align
    offset = -buf.data_ptr() % HUGE_PAGE
    out = []
    for t, n in zip(tensors, sizes):
        out.append(buf[offset:offset + n].view(t.dtype).view(t.shape).copy_(t))
        offset += -(-n // 64) * 64
    return out
