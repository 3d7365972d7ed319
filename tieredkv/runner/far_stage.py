"""Staging far blocks for attention where the warm tier is not the accelerator's memory (CUDA).

On CPU the warm slab is the tail of the cache tensor and attention reads far blocks in place. On
CUDA it is pinned host memory, which the kernels cannot index. There, a step whose batch holds far
blocks stages, layer by layer, every block its block tables name into one buffer of that layer
[2, T, block_size, kv_heads, head_dim]: hot blocks by a device gather (after this step's K/V are
stored), far blocks by the block-copy kernel reading the pinned slab in place (or, without Triton, a host
gather and a host-to-device copy). The block tables of such a step index
that buffer (see `plan_stage`), so the same attention kernels run unchanged. The buffer holds one
layer of the batch's context at a time: 1/num_layers of its KV. A step whose sequences hold more far
blocks than the runner's cap runs as several forwards, over groups that fit (`stage_groups`), so the
buffer stays bounded while every scheduled sequence still advances this step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


@dataclass
class StagePlan:
    """Where each staged block comes from: hot_src (device ids) -> hot_dst, far_slots (slab slots, on
    the host) -> far_dst; positions are indices into the staged buffer of `num_blocks` blocks."""

    num_blocks: int
    hot_src: torch.Tensor
    hot_dst: torch.Tensor
    far_slots: torch.Tensor
    far_dst: torch.Tensor
    slab: torch.Tensor  # the warm tier's block-major slab [capacity, layers, 2, block_size, kv_heads, head_dim]
    far_slots_dev: torch.Tensor | None = None  # far_slots on the device: the kernel reads the slab in place

    def gather(self, layer_cache: torch.Tensor, layer_id: int) -> torch.Tensor:
        """This layer's staged blocks [2, num_blocks, block_size, kv_heads, head_dim] on the cache's device."""
        out = layer_cache.new_empty((2, self.num_blocks, *layer_cache.shape[2:]))
        out[:, self.hot_dst] = layer_cache[:, self.hot_src]
        if self.far_slots.numel() and self.far_slots_dev is not None:
            # the block-copy kernel reads the far blocks where they lie: pinned host memory is mapped into the
            # device's address space (unified addressing), so no host gather and no staging copy on the host.
            # The slots stay untouched until the step's end: the tiers write the slab only between steps, and
            # a step ends in a synchronisation (its sampled tokens come to the host).
            from tieredkv.kernels.triton_ops import gather_from_slab

            gather_from_slab(self.slab[:, layer_id], self.far_slots_dev, out, self.far_dst)
        elif self.far_slots.numel():
            layer = self.slab[:, layer_id]  # [capacity, 2, block_size, kv_heads, head_dim], a view
            # one host gather, straight into pinned memory on CUDA (reused by torch's pinned-memory cache once
            # the asynchronous copy out of it is done), then one host-to-device copy
            far = torch.empty((self.far_slots.numel(), *layer.shape[1:]), dtype=layer.dtype, pin_memory=out.is_cuda)
            torch.index_select(layer, 0, self.far_slots, out=far)
            out[:, self.far_dst] = far.to(out.device, non_blocking=True).transpose(0, 1)
        return out


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
               in_place: bool) -> tuple[StagePlan, list[list[int]]]:
    """The staging plan for a step's block tables (ids >= base are far: slot id - base), and the
    tables rewritten to index the staged buffer. Each block is staged once, however many rows name it.
    With `in_place` (the runner's reads_slab_in_place) the kernel reads far blocks from the slab directly."""
    position: dict[int, int] = {}
    for table in tables:
        for block_id in table:
            position.setdefault(block_id, len(position))
    hot = [(b, i) for b, i in position.items() if b < base]
    far = [(b - base, i) for b, i in position.items() if b >= base]

    def column(pairs, j, dev):
        return torch.tensor([p[j] for p in pairs], dtype=torch.int64).to(dev, non_blocking=True)

    plan = StagePlan(len(position), column(hot, 0, device), column(hot, 1, device), column(far, 0, "cpu"),
                     column(far, 1, device), slab, column(far, 0, device) if in_place else None)
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
