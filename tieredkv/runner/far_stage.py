"""Staging far blocks for attention where the warm tier is not the accelerator's memory (CUDA).

On CPU the warm slab is the tail of the cache tensor and attention reads far blocks in place. On
CUDA it is pinned host memory, which the kernels cannot index. There, a step whose batch holds far
blocks stages, layer by layer, every block its block tables name into one buffer of that layer
[2, T, block_size, kv_heads, head_dim]: far blocks by the block-copy kernel reading the pinned slab in
place (or, without Triton, a host gather and a host-to-device copy), read one layer ahead on a copy
stream while the layer before computes; hot blocks by a device gather at their layer (after this step's
K/V are stored). The block tables of such a step index that buffer (see `plan_stage`), so the same
attention kernels run unchanged. Two such buffers exist at a time (the layer computing, the next one
filling), each 1/num_layers of the batch's KV. A step whose sequences hold more far
blocks than the runner's cap runs as several forwards, over groups that fit (`stage_groups`), so the
buffer stays bounded while every scheduled sequence still advances this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, TypeVar

import torch

T = TypeVar("T")

STAGE_RESERVE = 4  # the staging buffers take up to this many layers' worth of the hot pool


def pool_share(budget: int, staged_layers: int) -> int:
    """Of a device's KV budget, the hot pool's part beside the staging buffers where a step stages the far blocks
    of `staged_layers` layers (0: nothing is staged, the pool takes it all). Two buffers of one layer each (the
    layer computing and the next one, whose far blocks are read ahead), each at most a pool's worth of hot blocks
    and as many far ones: STAGE_RESERVE layers of the pool in all, so the pool takes
    budget * layers / (layers + STAGE_RESERVE)."""
    if staged_layers == 0 or budget <= 0:
        return budget
    return budget * staged_layers // (staged_layers + STAGE_RESERVE)


def staging_bytes(hot_blocks: int, block_bytes: int, staged_layers: int) -> int:
    """The staging buffers' most bytes beside a hot pool of `hot_blocks` blocks (pool_share); 0 with nothing staged."""
    return STAGE_RESERVE * hot_blocks * block_bytes // staged_layers if staged_layers else 0


@dataclass
class StagePlan:
    """Where each staged block comes from: far_slots (slab slots, on the host) -> positions 0..F-1 of the
    staged buffer (far_dst), hot_src (device ids) -> hot_dst, after them; `num_blocks` positions in all.

    Double-buffered: once a layer's buffer is gathered, the next layer's far blocks are copied into a second
    buffer on `stream` (the runner's staging stream on CUDA) while this layer's attention and the rest of the
    layer compute; the next gather waits for that copy on the device, not on the host. Far blocks are never
    written during a step (its K/V go to hot blocks), so they can be read ahead; hot blocks are gathered at
    their layer, after the step's K/V are stored. Without a stream (CPU) the read-ahead runs inline."""

    num_blocks: int
    hot_src: torch.Tensor
    hot_dst: torch.Tensor
    far_slots: torch.Tensor
    far_dst: torch.Tensor
    slab: torch.Tensor  # the warm tier's block-major slab [capacity, layers, 2, block_size, kv_heads, head_dim]
    far_slots_dev: torch.Tensor | None = None  # far_slots on the device: the kernel reads the slab in place
    stream: torch.cuda.Stream | None = None  # torch.cuda.Stream the read-ahead copies run on; None: inline
    read_ahead_layers: int = 0  # layers whose far blocks were read ahead of their gather
    late_layers: int = 0  # layers whose far blocks were copied at their gather (out of order: none expected)
    _ahead: tuple | None = field(default=None, repr=False)  # (layer_id, buffer, event) read ahead

    def gather(self, layer_cache: torch.Tensor, layer_id: int) -> torch.Tensor:
        """This layer's staged blocks [2, num_blocks, block_size, kv_heads, head_dim] on the cache's device;
        starts reading the next layer's far blocks ahead."""
        out = self._take(layer_id)
        out[:, self.hot_dst] = layer_cache[:, self.hot_src]
        if layer_id + 1 < self.slab.shape[1]:
            self.read_ahead(layer_id + 1)
        return out

    def _buffer(self) -> torch.Tensor:
        shape = (2, self.num_blocks, *self.slab.shape[3:])
        return torch.empty(shape, dtype=self.slab.dtype, device=self.hot_dst.device)

    def _take(self, layer_id: int) -> torch.Tensor:
        """The buffer read ahead for this layer (the device's queue waits for its copy), or a new one whose far
        blocks are copied now (a call out of order)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == layer_id:
            if ahead[2] is not None:
                torch.cuda.current_stream(ahead[1].device).wait_event(ahead[2])
            return ahead[1]
        out = self._buffer()
        self._copy_far(out, layer_id)
        self.late_layers += 1
        return out

    def read_ahead(self, layer_id: int) -> None:
        """Starts copying this layer's far blocks into the next buffer (plan_stage starts layer 0's, the
        gather of each layer the next one's)."""
        if not self.far_slots.numel():
            return
        out = self._buffer()
        if self.stream is None:
            self._copy_far(out, layer_id)
            self._ahead = (layer_id, out, None)
        else:
            # the buffer was allocated on the compute stream, whose earlier work may still use its memory:
            # the copy starts after that work; record_stream keeps the memory from reuse until the copy is done
            self.stream.wait_stream(torch.cuda.current_stream(out.device))
            with torch.cuda.stream(self.stream):
                self._copy_far(out, layer_id)
            out.record_stream(self.stream)
            self._ahead = (layer_id, out, self.stream.record_event())
        self.read_ahead_layers += 1

    def _copy_far(self, out: torch.Tensor, layer_id: int) -> None:
        """out[:, :F] = this layer's far blocks, in far_slots' order."""
        if self.far_slots_dev is not None:
            # the block-copy kernel reads the far blocks where they lie: pinned host memory is mapped into the
            # device's address space (unified addressing), so no host gather and no staging copy on the host.
            # The slots stay untouched until the step's end: the tiers write the slab only between steps, and
            # a step ends in a synchronisation (its sampled tokens come to the host).
            from tieredkv.kernels.triton_ops import gather_from_slab

            gather_from_slab(self.slab[:, layer_id], self.far_slots_dev, out, self.far_dst)
            return
        # one host gather, K and V apart, straight into pinned memory on CUDA (reused by torch's pinned-memory
        # cache once the asynchronous copy out of it is done), then one host-to-device copy per half into the
        # buffer's leading positions (contiguous: no device-side temporary)
        layer = self.slab[:, layer_id].transpose(0, 1)  # [2, capacity, block_size, kv_heads, head_dim], a view
        n = self.far_slots.numel()
        if not n:
            return
        far = torch.empty((2, n, *layer.shape[2:]), dtype=layer.dtype, pin_memory=out.is_cuda)
        torch.index_select(layer, 1, self.far_slots, out=far)
        for half in range(2):
            out[half, :n].copy_(far[half], non_blocking=True)


def reads_slab_in_place(slab: torch.Tensor, device: torch.device) -> bool:
    """True where the device's block-copy kernel can read the slab where it lies: a CUDA device and a pinned
    slab (mapped into the device's address space), with Triton to run the kernel."""
    if device.type != "cuda" or not slab.is_pinned():
        return False
    try:
        import tieredkv.kernels.triton_ops  # noqa: F401
    except ImportError:
        return False
    return True


def plan_stage(tables: list[list[int]], base: int, slab: torch.Tensor, device: torch.device,
               in_place: bool, stream=None) -> tuple[StagePlan, list[list[int]]]:
    """The staging plan for a step's block tables (ids >= base are far: slot id - base), and the
    tables rewritten to index the staged buffer: far blocks first, then hot ones, each staged once however
    many rows name it. With `in_place` (the runner's reads_slab_in_place) the kernel reads far blocks from
    the slab directly; `stream` is where the next layer's far blocks are read ahead (None: inline)."""
    seen = dict.fromkeys(b for table in tables for b in table)  # first appearance order
    far = [b for b in seen if b >= base]
    position = {b: i for i, b in enumerate(far + [b for b in seen if b < base])}
    hot = [(b, position[b]) for b in seen if b < base]

    def column(values, dev):
        return torch.tensor(values, dtype=torch.int64).to(dev, non_blocking=True)

    slots = [b - base for b in far]
    plan = StagePlan(len(position), column([b for b, _ in hot], device), column([i for _, i in hot], device),
                     column(slots, "cpu"), column(list(range(len(far))), device), slab,
                     column(slots, device) if in_place else None, stream)
    plan.read_ahead(0)
    return plan, [[position[b] for b in table] for table in tables]


def stage_groups(scheduled: list[tuple[T, int]], num_far: Callable[[T], int], cap: int) -> list[list[tuple[T, int]]]:
    """A step's (sequence, tokens) split into groups whose far blocks together are at most `cap`, in
    order; the sequences without far blocks go in the first group, and a sequence with more than `cap`
    far blocks makes a group of its own. One group when everything fits."""
    counts = [num_far(seq) for seq, _ in scheduled]
    groups: list[list[tuple[T, int]]] = [[item for item, far in zip(scheduled, counts) if far == 0]]
    used = 0
    for item, far in zip(scheduled, counts):
        if far == 0:
            continue
        if used and used + far > cap:
            groups.append([])
            used = 0
        groups[-1].append(item)
        used += far
    return [g for g in groups if g]
