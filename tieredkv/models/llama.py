"""One Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) reading and writing a paged KV cache."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tieredkv.kernels import KernelOps
from tieredkv.kernels.linear import packed_handle, with_row_layout
from tieredkv.kernels.quant import QuantizedWeight, quant_embedding, quant_linear
from tieredkv.models.batch import ForwardBatch
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_group import TPGroup


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], fp32, with linear or llama3 scaling applied. Computed on the CPU
    whatever the default device: under the loader's meta device these ops would run torch's Python
    references, whose first use imports torch._dynamo (seconds a start)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin [T, 1, D] of the batch's positions, computed once per forward from the inverse
    frequencies: no table sized by the model's maximum length (which a config may set to anything).
    `positions * inv_freq` in fp32 is the same product a precomputed table would hold, bit for bit."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def dense(ops: KernelOps, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) through the kernel set's dense function, reading the weight in the layout that function
    takes: the packed copy (LlamaModel.pack_linear_weights) when the kernel set packs, else the plain one;
    a quantized weight (LlamaModel.quantize_weights) through the quantized op."""
    qweight = getattr(layer, "qweight", None)
    if qweight is not None:
        return quant_linear(x, qweight, layer.bias)
    weight = layer.weight if ops.pack_linear_weight is None else getattr(layer, ops.packed_attr)
    return ops.linear(x, weight, layer.bias)


def _dense_format(layer: nn.Linear, ops: KernelOps) -> str:
    qweight = getattr(layer, "qweight", None)
    if qweight is not None:
        return qweight.format_label
    return _float_format(layer.weight, ops)


def _float_format(weight: torch.Tensor, ops: KernelOps) -> str:
    """ "float32", or "float32 packed" where the kernel set reads oneDNN's packed layout."""
    return str(weight.dtype).removeprefix("torch.") + (" packed" if ops.pack_linear_weight is not None else "")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


# FORWARD_ONLY: the forward pass calls its submodules' `forward` methods, never `Module.__call__`. While the
# decode graph compiles on a thread of its own (compiled_decode.py), torch.fx's tracers replace
# `torch.nn.Module.__call__` process-wide with a wrapper that fails for modules outside the traced one
# ("module is not installed as a submodule"), and the eager forward serves meanwhile on the worker thread.
# (No hooks are registered on these modules, so `__call__` would add nothing.)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class Attention(nn.Module):
    """`spec` is this rank's (Shard.local_spec): its heads only; o_proj's partial sums are all-reduced."""

    def __init__(self, spec: ModelSpec, layer_id: int, tp: TPGroup):
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        self.qkv_proj = nn.Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = nn.Linear(self.q_size, spec.hidden_size, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D]
        layer_cache: torch.Tensor,  # this layer's [2, num_blocks, block_size, Hkv, D]: K then V
        ops: KernelOps,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = dense(ops, self.qkv_proj, x)
        if batch.lora is not None:
            qkv = batch.lora.add(qkv, x, self.layer_id, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        ops.store_kv(k, v, layer_cache, batch.slot_mapping)
        meta = batch.attn
        layer_cache = meta.cache_to_read(layer_cache, self.layer_id)
        key_cache, value_cache = layer_cache[0], layer_cache[1]

        nd = meta.num_decode_tokens
        parts = []
        if nd:
            parts.append(
                ops.decode_attention(
                    q[:nd], key_cache, value_cache, meta.decode_block_tables, meta.decode_context_lens,
                    self.scale, meta.max_decode_context_len, plan=meta.decode_plan,
                )
            )
        if nd < num_tokens:
            parts.append(
                ops.prefill_attention(
                    q[nd:], key_cache, value_cache, meta.prefill_block_tables, meta.prefill_query_start_loc,
                    meta.prefill_context_lens, self.scale, meta.max_prefill_query_len, plan=meta.prefill_plan,
                )
            )
        out = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)).reshape(num_tokens, self.q_size)
        o = dense(ops, self.o_proj, out)
        if batch.lora is not None:
            o = batch.lora.add(o, out, self.layer_id, "o")
        return self.tp.all_reduce(o)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, layer_id: int = 0):
        super().__init__()
        self.tp = tp
        self.layer_id = layer_id
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: KernelOps, lora=None) -> torch.Tensor:
        """`lora`: the step's LoRABatch (models/lora.py), when adapters run in it."""
        gate_up = dense(ops, self.gate_up_proj, x)
        if lora is not None:
            gate_up = lora.add(gate_up, x, self.layer_id, "gate_up")
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate) * up
        down = dense(ops, self.down_proj, h)
        if lora is not None:
            down = lora.add(down, h, self.layer_id, "down")
        return self.tp.all_reduce(down)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int, tp: TPGroup):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec, tp, layer_id)

    def forward(self, x, batch, rotary, layer_cache, ops):
        """Reads no per-layer Python value (the layer's cache comes in), so that one compiled graph serves
        every layer (compiled_decode.py). Submodules are called through `forward` (FORWARD_ONLY)."""
        x = x + self.self_attn.forward(self.input_layernorm.forward(x), batch, rotary, layer_cache, ops)
        return x + self.mlp.forward(self.post_attention_layernorm.forward(x), ops, batch.lora)


class LlamaModel(nn.Module):
    """Weights use Hugging Face names, except that q/k/v and gate/up are stored fused (see loader).

    Under tensor parallelism (`tp` of more than one rank) the same definition holds one rank's share
    (models/tp_shard.py): its heads and MLP columns, whose outputs are all-reduced, and its rows of the
    vocabulary, whose embeddings are all-reduced and whose logits are gathered on rank 0."""

    def __init__(self, spec: ModelSpec, tp: TPGroup | None = None):
        super().__init__()
        self.spec = spec
        self.tp = tp = tp or TPGroup()
        local = tp.shard.local_spec(spec)
        self.vocab_start = tp.shard.split(spec.vocab_size)[0]
        # given its (uninitialised) weight, the table skips nn.Embedding's random init: under the loader's meta
        # device that init imports torch._dynamo (2.5-5 s a start where nothing compiles)
        self.embed_tokens = nn.Embedding(local.vocab_size, spec.hidden_size,
                                         _weight=torch.empty(local.vocab_size, spec.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(local, i, tp) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, local.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec)
        self.packed_lm_head: torch.Tensor | None = None
        self.packed_handles = False  # pack_linear_weights gave the packed weights handles
        self.quantized_head: QuantizedWeight | None = None  # the LM head, when quantized (the table too, if tied)

    @property
    def quantization(self) -> str | None:
        """The scheme of the projections' weights ("int8", "int4", "gguf:Q4_1", ...; a GGUF file's types in
        the order met, "gguf:Q5_0+Q8_0+Q4_K+Q6_K", where they differ), None when not quantized."""
        schemes = [m.qweight.scheme for m in self.layers.modules() if getattr(m, "qweight", None) is not None]
        if not schemes:
            return None
        kinds = list(dict.fromkeys(t for s in schemes for t in s.removeprefix("gguf:").split("+")))
        return schemes[0] if len(kinds) == 1 else "gguf:" + "+".join(kinds)

    def dense_formats(self, ops: KernelOps) -> dict[str, str]:
        """Each kind of dense layer (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) -> the format its products
        read, as `dense` and `head` choose it with this kernel set: "q4 g32 (gguf:Q4_1)", "q8 g16 + q4 g32" for
        pieces in two formats, "float32 packed" (oneDNN's layout), "float32"; kinds whose layers differ list
        each format once, joined by " / "."""
        found: dict[str, list[str]] = {}
        for name, module in self.layers.named_modules():
            if isinstance(module, nn.Linear):
                found.setdefault(name.rsplit(".", 1)[-1], []).append(_dense_format(module, ops))
        head = self.quantized_head  # a float head is in the table's dtype (it is the table, when tied)
        found["lm_head"] = [head.format_label if head is not None else
                            _float_format(self.embed_tokens.weight, ops)]
        return {kind: " / ".join(dict.fromkeys(formats)) for kind, formats in found.items()}

    def weight_bytes(self) -> int:
        """The bytes the weights take, in their own formats (quantized ones included), the LM head counted once."""
        quantized = sum(m.nbytes for m in self.modules() if isinstance(m, QuantizedWeight))
        return quantized + sum(t.numel() * t.element_size() for t in self.parameters())

    def quantize_weights(self, quantize: Callable[[torch.Tensor], QuantizedWeight],
                         head: Callable[[torch.Tensor], QuantizedWeight]) -> None:
        """Replaces every projection's weight by quantize(weight), and the LM head's by head(weight) (when the
        head is the embedding table, the table is held once, quantized, and lookups dequantize its rows). Each
        full-precision weight is dropped as soon as its quantized form exists."""
        for module in self.layers.modules():
            if isinstance(module, nn.Linear):
                module.qweight = quantize(module.weight)
                module.weight = None
        self.set_quantized_head(head(self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight))

    def set_quantized_head(self, qw: QuantizedWeight) -> None:
        self.quantized_head = qw
        if self.lm_head is None:
            self.embed_tokens.weight = None
        else:
            self.lm_head.weight = None

    def lm_head_weight(self, ops: KernelOps) -> torch.Tensor:
        if ops.pack_linear_weight is not None:
            return self.packed_lm_head if ops.packed_attr == "packed_weight" else self.packed_lm_head_handle
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def pack_linear_weights(self, pack: Callable[[torch.Tensor], torch.Tensor], keep_plain: bool = False,
                            handles: bool = False) -> None:
        """Gives every projection, and the LM head, a `packed_weight`: pack(weight), a layout only the
        packing kernel set's `linear` reads (see kernels/linear.py), in place of the plain weight, so the
        weights are held once; with `keep_plain` the plain weights stay too (twice the memory), for the
        compiled decode path where it reads them. With `handles` each also gets a `packed_handle` buffer
        (and the model a `packed_lm_head_handle`): the plain tensor through which a compiled graph reads
        the packed weight (kernels/linear.py: dense_by_handle). The embedding table stays plain: lookups
        need it."""
        self.packed_handles = handles
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not None:
                module.packed_weight = with_row_layout(pack(module.weight))
                if not keep_plain:
                    module.weight = nn.Parameter(module.packed_weight, requires_grad=False)
                if handles:
                    module.register_buffer("packed_handle", packed_handle(module.packed_weight), persistent=False)
        if self.quantized_head is None:
            self.packed_lm_head = (self.lm_head.packed_weight if self.lm_head is not None
                                   else with_row_layout(pack(self.embed_tokens.weight)))
            if handles:
                self.register_buffer("packed_lm_head_handle", packed_handle(self.packed_lm_head), persistent=False)

    def packed_weights(self) -> list[torch.Tensor]:
        """Every packed weight pack_linear_weights gave (the projections', the LM head's), each once."""
        found = [getattr(m, "packed_weight", None) for m in self.modules()] + [getattr(self, "packed_lm_head", None)]
        return list({id(t): t for t in found if t is not None}.values())

    def linear_shapes(self) -> list[tuple[int, int]]:
        """The distinct [out, in] shapes of one layer's projections (plain weights: before packing)."""
        return sorted({tuple(m.weight.shape) for m in self.layers[0].modules()
                       if isinstance(m, nn.Linear) and m.weight is not None})

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor, ops: KernelOps) -> torch.Tensor | None:
        """Runs every token of the batch and returns fp32 logits [S, vocab] for batch.logits_indices (None on
        a tensor-parallel rank other than 0)."""
        x, rotary = self.embed(batch)
        for layer in self.layers:
            x = layer.forward(x, batch, rotary, kv_cache[layer.self_attn.layer_id], ops)
        return self.logits(x, batch, ops)

    def embed(self, batch: ForwardBatch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The first hidden states [T, hidden] and the rotary cos/sin of the batch's positions."""
        x = self.token_embedding(batch.input_ids)
        return x, self.rotary.forward(batch.positions, x.dtype)

    def token_embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows of `ids`: [T, hidden]."""
        outside = None
        if self.tp.world > 1:  # this rank's rows of the vocabulary; the others' tokens are zeros here
            ids = ids - self.vocab_start
            outside = (ids < 0) | (ids >= self.local_vocab)
            ids = ids.masked_fill(outside, 0)
        if self.embed_tokens.weight is None:  # the table is the quantized LM head
            x = quant_embedding(self.quantized_head, ids, self.norm.weight.dtype)
        else:
            x = self.embed_tokens.forward(ids)
        if outside is not None:
            x = self.tp.all_reduce(x.masked_fill(outside[:, None], 0))
        return x

    @property
    def local_vocab(self) -> int:
        """The vocabulary rows this rank holds (all of them outside tensor parallelism)."""
        return self.tp.shard.split(self.spec.vocab_size)[1] - self.vocab_start

    def logits(self, x: torch.Tensor, batch: ForwardBatch, ops: KernelOps) -> torch.Tensor | None:
        """fp32 logits [S, vocab] of the rows batch.logits_indices of the last hidden states; under tensor
        parallelism each rank computes its vocabulary rows and rank 0 gathers them (others: None)."""
        return self.head(self.norm.forward(x[batch.logits_indices]), ops)

    def head(self, h: torch.Tensor, ops: KernelOps) -> torch.Tensor | None:
        """`logits` from the final norm's output h [S, hidden] on."""
        if self.quantized_head is not None:
            logits = quant_linear(h, self.quantized_head).float()
        else:
            logits = ops.linear(h, self.lm_head_weight(ops)).float()
        return self.tp.gather_last(logits, self.tp.shard.sizes(self.spec.vocab_size))
