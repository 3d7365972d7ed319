"""Block data: every read and write of KV bytes in the hot pool and the warm slab is a `BlockOp`, plain data that
names block ids and slots, run by `BlockIO` in the order it was recorded.

The tiers decide (indexes, LRU, lent slots) and record ops; the ops move the bytes. Under tensor parallelism every
rank holds its heads of every hot block and of every warm slot, and the ops are what makes one data plane of them:
rank 0 records the ops a step's moves need and sends them with the step's rows in one message (engine/ranks.py);
every rank runs the same ops on its own shard, in the same order, before the forward. A move between a rank's pool
and its slab (a swap, an offload, a demotion to warm, a promotion from it, a copy-on-write) stays on the rank; only
what reaches or leaves the tiers that hold whole blocks (cold, remote, snapshots, publishing) gathers each rank's
heads to rank 0 (`GATHER`, `READ`) or scatters them from it (`SCATTER`, `WRITE`). With one process the ops run as
they are recorded, and the same code is the whole data path.

A gather's data reaches rank 0 through the callback given with it (`then`): while rank 0 holds the ops of a step
(`hold`), they run only when the step's message goes out, and what is done with their data (admission to cold) waits
for that. Outside a step (an export, an import, a publish) an op runs at once: under tensor parallelism that is a
step message of its own without rows.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Callable, Iterator, NamedTuple

import torch

from tieredkv.kernels import KernelOps
from tieredkv.models.tp_group import TPGroup

GATHER = "gather"  # hot blocks -> whole blocks on rank 0
SCATTER = "scatter"  # whole blocks on rank 0 -> hot blocks
COPY = "copy"  # hot blocks -> hot blocks, on every rank (copy-on-write)
READ = "read"  # warm slots -> whole blocks on rank 0
WRITE = "write"  # whole blocks on rank 0 -> warm slots
HOT_TO_SLAB = "hot_to_slab"  # hot blocks -> warm slots, on every rank
SLAB_TO_HOT = "slab_to_hot"  # warm slots -> hot blocks, on every rank
EXCHANGES = (GATHER, SCATTER, READ, WRITE)  # the kinds whose data crosses processes under tensor parallelism


class BlockOp(NamedTuple):
    """One op: `ids` are block ids (hot kinds, the source of a copy) or slots (READ, WRITE); `to` the copy's
    destination block ids, or the slots of HOT_TO_SLAB / SLAB_TO_HOT."""

    kind: str
    ids: list[int]
    to: list[int] | None = None


class Slab:
    """A process's warm slab: block-major [capacity, layers, 2, block_size, kv_heads, head_dim], or layer-major
    [layers, 2, capacity, ...] (the tail of the cache tensor on CPU: far blocks read in place)."""

    def __init__(self, tensor: torch.Tensor, layer_major: bool):
        self.tensor, self.layer_major = tensor, layer_major
        shape = tuple(tensor.shape)
        self.block_shape = (*shape[:2], *shape[3:]) if layer_major else shape[1:]

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        """Copies blocks [len(slots), ...] from any device straight into the slots, run by run (from CUDA:
        asynchronous on the current stream; the caller synchronizes before the host reads)."""
        for offset, first, n in slot_runs(slots):
            self._run(first, n).copy_(blocks[offset : offset + n], non_blocking=True)

    def read(self, slots: list[int]) -> torch.Tensor:
        """A copy of the slots' blocks [len(slots), ...]."""
        index = torch.tensor(slots)
        if self.layer_major:
            return self.tensor[:, :, index].permute(2, 0, 1, 3, 4, 5).contiguous()
        return self.tensor[index]

    def read_runs(self, slots: list[int]) -> list[tuple[int, torch.Tensor]]:
        """(offset in slots, view [n, ...]) per run of consecutive slots: no copy (pinned on CUDA: a device copy
        from there is a real asynchronous transfer)."""
        return [(offset, self._run(first, n)) for offset, first, n in slot_runs(slots)]

    def buffer(self, n: int) -> torch.Tensor:
        return torch.empty((n, *self.block_shape), dtype=self.tensor.dtype)

    def _run(self, first: int, n: int) -> torch.Tensor:
        if self.layer_major:
            return self.tensor[:, :, first : first + n].permute(2, 0, 1, 3, 4, 5)
        return self.tensor[first : first + n]


def slot_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(offset in slots, first slot, length) of each run of consecutive slots."""
    out: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if out and out[-1][1] + out[-1][2] == slot:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((i, slot, 1))
    return out


class _Recorded(NamedTuple):
    op: BlockOp
    data: torch.Tensor | None  # SCATTER / WRITE on rank 0: the whole blocks
    then: Callable[[torch.Tensor], None] | None  # GATHER / READ on rank 0: what to do with the whole blocks


class BlockIO:
    """Runs block ops on this process's pool (`kv_cache`, moved by `ops`) and slab, as this rank of `group`
    (a group of one: no communication). `kv_heads`: every rank's KV heads, for whole blocks.

    Rank 0 of a larger group sends what it recorded through `send` (set by the engine: one step message, with
    the step's rows when a forward follows; engine/ranks.py), which runs it here with `run`; the other ranks
    `run` the ops of each message they receive. Counts ops by kind (`counts`), and those whose data crossed
    processes (`exchanged`)."""

    def __init__(self, kv_cache: torch.Tensor | None, ops: KernelOps | None, slab: Slab | None = None,
                 group: TPGroup | None = None, kv_heads: list[int] | None = None):
        self.kv_cache, self.ops, self.slab = kv_cache, ops, slab
        self.group = group if group is not None else TPGroup()
        self.kv_heads = kv_heads if kv_heads is not None else [0]
        self.send: Callable[[], None] | None = None
        self.pending: list[_Recorded] = []
        self._holding = 0
        self.counts: Counter[str] = Counter()
        self.exchanged: Counter[str] = Counter()

    @property
    def replicated(self) -> bool:
        return self.group.world > 1

    def whole_bytes(self, local_bytes: int) -> int:
        """Bytes of whole blocks (every rank's heads) whose share here takes local_bytes."""
        if not self.replicated:
            return local_bytes
        return local_bytes * sum(self.kv_heads) // self.kv_heads[self.group.rank]

    # -- recording ----------------------------------------------------------------------------------

    def gather(self, block_ids: list[int], then: Callable[[torch.Tensor], None]) -> None:
        """Whole blocks [n, layers, 2, block_size, kv_heads, head_dim], on the pool's device, to `then`."""
        self._record(BlockOp(GATHER, block_ids), then=then)

    def scatter(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        self._record(BlockOp(SCATTER, block_ids), data=blocks)

    def copy(self, src_ids: list[int], dst_ids: list[int]) -> None:
        self._record(BlockOp(COPY, src_ids, dst_ids))

    def read(self, slots: list[int], then: Callable[[torch.Tensor], None]) -> None:
        """Whole blocks of warm slots (a copy, on the host) to `then`."""
        self._record(BlockOp(READ, slots), then=then)

    def write(self, slots: list[int], blocks: torch.Tensor) -> None:
        self._record(BlockOp(WRITE, slots), data=blocks)

    def hot_to_slab(self, block_ids: list[int], slots: list[int]) -> None:
        self._record(BlockOp(HOT_TO_SLAB, block_ids, slots))

    def slab_to_hot(self, block_ids: list[int], slots: list[int]) -> None:
        self._record(BlockOp(SLAB_TO_HOT, block_ids, slots))

    def gather_now(self, block_ids: list[int]) -> torch.Tensor:
        """`gather`, its result returned (outside a held step)."""
        return self._now(self.gather, block_ids)

    def read_now(self, slots: list[int]) -> torch.Tensor:
        """`read`, its result returned (outside a held step)."""
        return self._now(self.read, slots)

    def _now(self, record, ids: list[int]) -> torch.Tensor:
        assert not self._holding, "a result now, inside a step whose ops wait for its message"
        box: list[torch.Tensor] = []
        record(ids, box.append)
        return box[0]

    def _empty(self, kind: str) -> torch.Tensor:
        """No whole blocks (an op over no ids runs nowhere): [0, layers, 2, block_size, all ranks' heads, row]."""
        like = self.slab.buffer(0) if kind == READ else block_buffer(self.kv_cache, 0)
        shape = list(like.shape)
        shape[-2] = sum(self.kv_heads) if self.replicated else shape[-2]
        return like.new_empty(shape)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Ops recorded inside wait for the next step message (under tensor parallelism; with one process they
        run as recorded)."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1

    def _record(self, op: BlockOp, data: torch.Tensor | None = None,
                then: Callable[[torch.Tensor], None] | None = None) -> None:
        if not op.ids:
            if then is not None:
                then(self._empty(op.kind))
            return
        item = _Recorded(op, data, then)
        if not self.replicated:
            self._run(item)
            return
        self.pending.append(item)
        if not self._holding:
            self.flush()

    def flush(self) -> None:
        """Sends what is pending in a step message of its own (rank 0 under tensor parallelism)."""
        if self.pending:
            assert self.send is not None, "a rank 0 without a group to send to"
            self.send()

    def take(self) -> list[_Recorded]:
        """The pending ops, for the step message (rank 0)."""
        taken, self.pending = self.pending, []
        return taken

    # -- running ------------------------------------------------------------------------------------

    def run(self, items: list[_Recorded] | list[BlockOp]) -> None:
        """Runs ops in order: rank 0 the ones it recorded (with their data and callbacks), the other ranks those
        of a message (BlockOps)."""
        for item in items:
            self._run(item if isinstance(item, _Recorded) else _Recorded(item, None, None))
        if self.kv_cache is not None and self.kv_cache.device.type == "cuda" and items:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()  # device-to-host copies have landed

    def _run(self, item: _Recorded) -> None:
        op, kind, group, heads = item.op, item.op.kind, self.group, self.kv_heads
        self.counts[kind] += 1
        if self.replicated and kind in EXCHANGES:
            self.exchanged[kind] += 1
        kv, ops, slab = self.kv_cache, self.ops, self.slab
        out = None
        if kind == GATHER:
            out = group.gather_heads(gather_blocks(kv, ops, op.ids), heads)
        elif kind == READ:
            out = group.gather_heads(slab.read(op.ids), heads)
        elif kind == SCATTER:
            scatter_blocks(kv, ops, op.ids, group.scatter_heads(item.data, heads, block_buffer(kv, len(op.ids))))
        elif kind == WRITE:
            slab.write(op.ids, group.scatter_heads(item.data, heads, slab.buffer(len(op.ids))))
        elif kind == COPY:
            ops.copy_blocks(kv, torch.tensor(op.ids, device=kv.device), torch.tensor(op.to, device=kv.device))
        elif kind == HOT_TO_SLAB:
            slab.write(op.to, gather_blocks(kv, ops, op.ids))
        elif kind == SLAB_TO_HOT:
            for offset, view in slab.read_runs(op.to):
                scatter_blocks(kv, ops, op.ids[offset : offset + view.shape[0]], view)
        else:
            raise ValueError(f"unknown block op {kind!r}")
        if item.then is not None:
            item.then(out)


def block_buffer(kv: torch.Tensor, n: int) -> torch.Tensor:
    """An uninitialised [n, layers, 2, block_size, kv_heads, head_dim] of kv's dtype and device."""
    return torch.empty((n, kv.shape[0], 2, *kv.shape[3:]), dtype=kv.dtype, device=kv.device)


def gather_blocks(kv: torch.Tensor, ops: KernelOps, block_ids: list[int]) -> torch.Tensor:
    """The blocks' data [n, layers, 2, block_size, kv_heads, head_dim], on kv's device."""
    out = block_buffer(kv, len(block_ids))
    ops.gather_blocks(kv, torch.tensor(block_ids, device=kv.device), out)
    return out


def scatter_blocks(kv: torch.Tensor, ops: KernelOps, block_ids: list[int], blocks: torch.Tensor) -> None:
    src = blocks.to(kv.device, kv.dtype, non_blocking=True).contiguous()
    ops.scatter_blocks(kv, torch.tensor(block_ids, device=kv.device), src)
