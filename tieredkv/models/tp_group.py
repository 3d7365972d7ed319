"""The collectives a tensor-parallel model and its KV cache need, over one torch.distributed process group
(gloo on CPU, NCCL on CUDA). `TPGroup(Shard())`, the whole model in one process, does no communication."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tieredkv.errors import RankLostError
from tieredkv.models.tp_shard import Shard


class TPGroup:
    """This rank's place (`shard`) and the collectives over the group. On rank 0 a failed collective marks the
    group broken and raises RankLostError, and every later one raises it at once (no step waits on a rank that
    is gone). Counts the seconds and calls spent in all-reduces (`reduce_s`, `reduces`) for the benchmark."""

    def __init__(self, shard: Shard = Shard(), device: torch.device | None = None):
        self.shard = shard
        self.device = device
        self.reduce_s = 0.0
        self.reduces = 0
        self.broken: BaseException | None = None

    @property
    def world(self) -> int:
        return self.shard.world

    @property
    def rank(self) -> int:
        return self.shard.rank

    def _call(self, fn, *args, **kwargs):
        if self.broken is not None:
            raise RankLostError(f"a tensor-parallel rank is gone: {self.broken}")
        try:
            return fn(*args, **kwargs)
        except (RuntimeError, ValueError, ConnectionError) as e:
            self.broken = e
            raise RankLostError(f"a tensor-parallel rank is gone: {e}") from e

    def abort(self) -> None:
        """Ends every other rank at once (rank 0's group, engine/ranks.py; a group of one has none)."""

    def close(self) -> None:
        """Ends every other rank in order (rank 0's group, engine/ranks.py; a group of one has none)."""

    def drive(self, io) -> None:
        """Rank 0 of a larger group sends the block ops `io` records (tiers/block_io.py) with its step messages
        (engine/ranks.py); a group of one has no one to send them to: they run as recorded."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (in place), after a row-parallel layer: NCCL's all-reduce on CUDA; on CPU an
        exchange of every rank's x with every other (one round of point-to-point sends) summed in rank order,
        the same sum on every rank. Gloo's own all-reduce took 1.5-2 ms for a decode step's 576 floats on a
        2-core machine, the exchange 0.4-0.8 ms (benchmarks/bench_tp.py)."""
        if self.world == 1:
            return x
        t0 = time.perf_counter()
        if x.device.type == "cuda":
            self._call(dist.all_reduce, x)
        else:
            self._call(self._exchange_sum, x)
        self.reduce_s += time.perf_counter() - t0
        self.reduces += 1
        return x

    def _exchange_sum(self, x: torch.Tensor) -> None:
        peers = [r for r in range(self.world) if r != self.rank]
        mine = x.contiguous()
        parts = {r: torch.empty_like(mine) for r in peers}
        ops = [dist.P2POp(dist.isend, mine, r) for r in peers] + [dist.P2POp(dist.irecv, parts[r], r) for r in peers]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        parts[self.rank] = mine
        total = parts[0].clone()
        for r in range(1, self.world):
            total += parts[r]
        x.copy_(total)

    def gather_last(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's x ([..., sizes[r]]) concatenated on the last dimension; others: None."""
        return self._gather(x, sizes, -1)

    def gather_heads(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's KV blocks ([..., sizes[r] heads, head_dim]) as whole blocks; others: None."""
        return self._gather(x, sizes, -2)

    def _gather(self, x: torch.Tensor, sizes: list[int], dim: int) -> torch.Tensor | None:
        """The result on x's device; the collective on the group's (the host's blocks of a warm slab go through
        the GPU under NCCL, which takes device tensors only)."""
        if self.world == 1:
            return x
        home = x.device
        x = _pad(x.to(self._comm_device), max(sizes), dim)  # the collectives take equal shapes
        if self.rank != 0:
            self._call(dist.gather, x, dst=0)
            return None
        parts = [torch.empty_like(x) for _ in sizes]
        self._call(dist.gather, x, parts, dst=0)
        return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim).to(home)

    def scatter_heads(self, blocks: torch.Tensor | None, sizes: list[int], like: torch.Tensor) -> torch.Tensor:
        """This rank's heads of whole KV blocks that rank 0 holds (`blocks`; None elsewhere), on `like`'s
        device and in its dtype; `like`: a tensor of this rank's block shape with n blocks."""
        if self.world == 1:
            return blocks
        top = max(sizes)
        out = _pad(torch.empty_like(like, device=self._comm_device), top, -2)
        if self.rank != 0:
            self._call(dist.scatter, out, src=0)
        else:
            blocks = blocks.to(self._comm_device, like.dtype)
            parts = [_pad(p, top, -2).contiguous() for p in blocks.split(sizes, dim=-2)]
            self._call(dist.scatter, out, parts, src=0)
        return out.narrow(-2, 0, sizes[self.rank]).to(like.device)

    def broadcast(self, obj=None):
        """Rank 0's `obj`, on every rank (pickled)."""
        box = [obj]
        self._call(dist.broadcast_object_list, box, src=0, device=self._object_device())
        return box[0]

    def gather_objects(self, obj) -> list | None:
        """Rank 0: every rank's obj, rank order; others: None."""
        out = [None] * self.world if self.rank == 0 else None
        self._call(dist.gather_object, obj, out, dst=0)
        return out

    def _object_device(self):
        return self.device if self.device is not None and self.device.type == "cuda" else None

    @property
    def _comm_device(self) -> torch.device:
        """Where the group's tensors must be: the rank's GPU under NCCL, the host under gloo."""
        return self._object_device() or torch.device("cpu")


def _pad(x: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    have = x.shape[dim]
    if have == size:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = size - have
    return torch.cat([x, x.new_zeros(shape)], dim=dim)
