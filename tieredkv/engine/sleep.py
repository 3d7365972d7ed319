"""An idle engine gives its memory back: `sleep(level)` and `wake()` (EngineCore), in the spirit of vLLM's sleep
mode and llama.cpp's --sleep-idle-seconds.

Level 1: pins are released, the cached blocks in this process's memory go to the tiers outside it (hot's and warm's
to cold and remote, written before sleep returns; with neither, hot's go to warm, which keeps its memory, and
without warm they are dropped), and that memory goes back to the system: on CPU its pages are handed back in place
(madvise MADV_DONTNEED on the cache tensor's hot range, and on warm's slab where its entries went below it too, in
its own memory or as the cache tensor's tail; every address stays valid, and a page reads as zeros until written
again), on CUDA the cache tensor's storage is freed and allocated again on wake. Level 2: the weights as well,
written to a file under the cache directory first and read back into the same memory on wake (on CUDA: into storage
allocated again), so every kernel handle and the native step's pointers stay valid. Nothing is rebuilt either way;
waking level 1 on CPU costs nothing (pages come back as blocks are written).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tieredkv.platform.malloc_tuning import PAGE, _libc, process_status_bytes, release_free_memory

if TYPE_CHECKING:
    from tieredkv.tiers.warm import WarmTier

log = logging.getLogger("tieredkv")

_MADV_DONTNEED = 4


def release_pages(address: int, nbytes: int) -> int:
    """Hands the whole pages of [address, address + nbytes) back to the system (anonymous private memory: they
    read as zeros when touched again). Returns the bytes released (0 where madvise is not available)."""
    start, end = -(-address // PAGE) * PAGE, (address + nbytes) // PAGE * PAGE
    if end <= start:
        return 0
    try:
        libc = _libc()
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED) != 0:
            return 0
    except (OSError, AttributeError):
        return 0
    return end - start


def memory_runs(t: torch.Tensor) -> list[tuple[int, int]]:
    """The (address, bytes) ranges a tensor's elements occupy: one per index of its leading dimensions, the
    trailing ones being contiguous (the whole tensor when it is; a layer-major range of blocks, one per layer and
    K/V)."""
    lead = next(i for i in range(t.dim() + 1) if t[(0,) * i].is_contiguous())
    return [(part.data_ptr(), part.numel() * part.element_size())
            for part in (t[index] for index in itertools.product(*map(range, t.shape[:lead])))]


def writable_private(regions: list[tuple[int, int]]) -> list[bool]:
    """For each (address, bytes): whether it lies in a writable private mapping of no file (the heap, an anonymous
    mapping), the memory whose pages can be handed back and written again; False where /proc/self/maps cannot
    tell (a read-only file mapping must be neither released nor written)."""
    try:
        with open("/proc/self/maps") as f:
            maps = []
            for line in f:
                fields = line.split()
                start, end = (int(x, 16) for x in fields[0].split("-"))
                path = fields[5] if len(fields) > 5 else ""
                maps.append((start, end, fields[1].startswith("rw") and fields[1][3] == "p" and
                             (not path or path.startswith("["))))
    except (OSError, ValueError, IndexError):
        return [False] * len(regions)
    out = []
    for address, nbytes in regions:
        inside = [ok for start, end, ok in maps if start <= address and address + nbytes <= end]
        out.append(bool(inside) and inside[0])
    return out


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over a storage's bytes (on its device)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _host_bytes(address: int, nbytes: int) -> memoryview:
    """Process memory [address, address + nbytes) as a writable buffer."""
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def weight_memory(model: torch.nn.Module) -> list[tuple[int, int, torch.Tensor]]:
    """The distinct memory the model's weights take in every form it holds them, as (address, bytes, a tensor that
    keeps it alive): parameters, buffers, tensors kept as attributes of its modules (packed and quantized
    layouts, oneDNN's opaque blocked tensors included). This model's only: the process-wide table of packed
    weights' handles (kernels/linear.py) names other engines' weights too, which a sleeping engine must neither
    release nor, closed asleep, leave released."""
    seen: dict[int, tuple[int, int, torch.Tensor]] = {}

    def add(t) -> None:
        if not isinstance(t, torch.Tensor) or not t.numel():
            return
        if t.is_mkldnn:
            address, nbytes = torch.ops.mkldnn.data_ptr(t), torch.ops.mkldnn._nbytes(t)
        else:
            storage = t.untyped_storage()
            address, nbytes = storage.data_ptr(), storage.nbytes()
        seen.setdefault(address, (address, nbytes, t))

    for module in model.modules():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            add(t)
        for value in vars(module).values():
            for t in value if isinstance(value, (list, tuple)) else (value,):
                add(t)
    return list(seen.values())


class Sleeper:
    """What a sleeping engine released and how to take it back. Owned by the EngineCore's thread."""

    def __init__(self, kv_cache: torch.Tensor, num_blocks: int, spill_dir: Path):
        self.kv_cache = kv_cache
        self.num_blocks = num_blocks
        self.spill_dir = spill_dir
        self.level = 0  # 0: awake
        self._kv_bytes = 0  # CUDA: the cache storage's size, to allocate again
        self._spill: Path | None = None
        self._weights: list[tuple[int, int, torch.Tensor]] = []  # (address, bytes, the tensor keeping it)
        self.last: dict = {}

    @property
    def asleep(self) -> bool:
        return self.level > 0

    def release_cache(self, warm: "WarmTier | None" = None) -> int:
        """The hot pool's memory, and `warm`'s slab (their blocks must hold nothing anyone reads: all demoted, none
        in use), wherever the slab lies (its own memory or the cache tensor's tail). A pinned (CUDA) warm slab
        stays: page-locked memory cannot be handed back this way."""
        cache = self.kv_cache
        slab = warm.slab if warm is not None and warm.slab.device.type == "cpu" and not warm.slab.is_pinned() else None
        released = sum(release_pages(*run) for run in memory_runs(slab)) if slab is not None else 0
        if cache.device.type == "cuda":
            storage = cache.untyped_storage()
            self._kv_bytes = storage.nbytes()
            storage.resize_(0)
            torch.cuda.empty_cache()
            return self._kv_bytes + released
        return released + sum(release_pages(*run) for run in memory_runs(cache[:, :, : self.num_blocks]))

    def restore_cache(self) -> None:
        if self.kv_cache.device.type == "cuda" and self._kv_bytes:
            self.kv_cache.untyped_storage().resize_(self._kv_bytes)
            self.kv_cache.zero_()
            self._kv_bytes = 0

    def release_weights(self, model: torch.nn.Module) -> int:
        """Writes the weights' memory to a file, then releases it; returns the bytes."""
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="weights-", suffix=".bin", dir=self.spill_dir)
        regions = weight_memory(model)
        host = writable_private([(a, n) for a, n, t in regions if t.device.type != "cuda"])
        ok = iter(host)  # a weight in a file's mapping stays where it is: its pages are the page cache's
        self._spill, self._weights = Path(name), [r for r in regions if r[2].device.type == "cuda" or next(ok)]
        try:
            with os.fdopen(fd, "wb") as f:
                for address, nbytes, t in self._weights:
                    if t.device.type == "cuda":
                        f.write(memoryview(_bytes_of(t.untyped_storage()).cpu().numpy()))
                    else:
                        f.write(_host_bytes(address, nbytes))
            for address, nbytes, t in self._weights:
                if t.device.type == "cuda":
                    t.untyped_storage().resize_(0)
                else:
                    release_pages(address, nbytes)
        except BaseException:
            self._spill.unlink(missing_ok=True)
            self._spill, self._weights = None, []
            raise
        if self.kv_cache.device.type == "cuda":
            torch.cuda.empty_cache()
        return sum(nbytes for _, nbytes, _ in self._weights)

    def restore_weights(self) -> None:
        if self._spill is None:
            return
        with open(self._spill, "rb") as f:
            for address, nbytes, t in self._weights:
                if t.device.type == "cuda":
                    host = torch.empty(nbytes, dtype=torch.uint8)
                    f.readinto(memoryview(host.numpy()))
                    t.untyped_storage().resize_(nbytes)
                    _bytes_of(t.untyped_storage()).copy_(host)
                else:
                    f.readinto(_host_bytes(address, nbytes))
        self._spill.unlink(missing_ok=True)
        self._spill, self._weights = None, []

    def discard(self) -> None:
        """At close: the weights' file goes (what it held is not needed any more)."""
        if self._spill is not None:
            self._spill.unlink(missing_ok=True)
            self._spill, self._weights = None, []

    def settle(self, level: int, released: dict) -> dict:
        """Records a finished sleep: its level, what it released, the process's resident memory now."""
        release_free_memory()
        self.level = level
        self.last = {"level": level, **released, "rss_bytes": process_status_bytes("VmRSS"),
                     "asleep_since": time.time()}
        log.info("engine asleep (level %d): %s", level, ", ".join(f"{k}={v}" for k, v in released.items()))
        return self.last
