"""The one object that carries a step's data from the scheduler's decisions to the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from tieredkv.models.lora import LoRABatch


def own_cache(layer_cache: torch.Tensor, layer_id: int) -> torch.Tensor:
    """What attention reads where no block table indexes a staged block: each layer's own cache."""
    return layer_cache


@dataclass
class AttentionMetadata:
    """Tokens are ordered decodes first (one per sequence), then prefill chunks packed back to back."""

    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int32
    decode_context_lens: torch.Tensor  # [Bd] int32
    max_decode_context_len: int
    prefill_block_tables: torch.Tensor  # [Bp, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [Bp + 1] int32 offsets, relative to the first prefill token
    prefill_context_lens: torch.Tensor  # [Bp] int32
    max_prefill_query_len: int
    decode_plan: object = None  # the kernel set's per-step decode plan (KernelOps.plan_decode), if it has one
    prefill_plan: list | None = None  # prefill chunks that follow the same cached blocks (cascade.shared_prefixes)
    stage: Any = None  # far_stage.StagePlan when the tables index staged blocks instead of the cache
    read: Callable[[torch.Tensor, int], torch.Tensor] = own_cache  # what cache_to_read reads: the stage's gather

    def row_tables(self) -> torch.Tensor:
        """Each token row's block table [T, W] int32, in the rows' order: a decode's own, a prefill chunk's once for
        each of its rows (for a kernel that attends row by row: row r's context is its position + 1)."""
        decode, chunks = self.decode_block_tables, self.prefill_block_tables
        if chunks.shape[0]:
            chunks = chunks.repeat_interleave(self.prefill_query_start_loc.diff(), dim=0)
        width = max(decode.shape[1], chunks.shape[1])
        tables = decode.new_zeros(decode.shape[0] + chunks.shape[0], width)
        tables[: decode.shape[0], : decode.shape[1]] = decode
        tables[decode.shape[0] :, : chunks.shape[1]] = chunks
        return tables

    def cache_to_read(self, layer_cache: torch.Tensor, layer_id: int) -> torch.Tensor:
        """What this layer's attention reads through the block tables: its own cache, or where the tables index
        staged far blocks (runner/far_stage.py, never in a compiled graph) the buffer they were staged into."""
        return self.read(layer_cache, layer_id)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding
    logits_indices: torch.Tensor  # [S] int64: rows whose next-token logits are needed
    attn: AttentionMetadata
    lora: LoRABatch | None = None  # the adapters of the step's rows, when any row has one

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def scratch_block(kv_cache: torch.Tensor) -> int:
    """The cache tensor's last block, which no sequence is given (rank_build.make_kv_cache): what a
    warm-up or the background compile writes, at any time, without touching a request's KV."""
    return kv_cache.shape[2] - 1
