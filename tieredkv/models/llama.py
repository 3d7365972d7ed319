"""One Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) reading and writing a paged KV cache."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tieredkv.kernels import KernelOps
from tieredkv.kernels.dense import DenseLayout, DenseWeight, PackedWeight
from tieredkv.kernels.quant import QuantizedParts, QuantizedWeight, quant_embedding
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


class Projection(nn.Module):
    """A dense layer, x @ W.T (+ b). The checkpoint's weight is loaded into `weight` (None where it is stored
    quantized, or for a tied LM head, which multiplies by the embedding table); `hold` then gives the layer its
    weight in one format (kernels/dense.py: DenseWeight), which every product goes through, and `weight` is
    dropped. `forward(x, graph)`: the format's product, or the one a compiled graph takes."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tied: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = None if tied else nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.format: DenseWeight | None = None

    def hold(self, weight: DenseWeight) -> None:
        """Serves from `weight` (the loaded one dropped)."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(f"a {weight.out_features}x{weight.in_features} weight for a "
                             f"{self.out_features}x{self.in_features} layer")
        self.format = weight
        self.weight = None

    def forward(self, x: torch.Tensor, graph: bool = False) -> torch.Tensor:
        return self.format.graph_forward(x, self.bias) if graph else self.format.forward(x, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, bias={self.bias is not None}"


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
        self.qkv_proj = Projection(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.attention_bias)
        self.o_proj = Projection(self.q_size, spec.hidden_size)
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        # [kv_heads, head_dim] taken from every key before it is stored, where the cache stores keys at 4 bits
        # (runner/key_shift.py: the softmax does not change); None: stored as computed
        self.register_buffer("k_shift", None, persistent=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        batch: ForwardBatch,
        rotary: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, D]
        layer_cache: torch.Tensor,  # this layer's [2, num_blocks, block_size, Hkv, D]: K then V
        ops: KernelOps,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj.forward(x, ops.graph)
        if batch.lora is not None:
            qkv = batch.lora.add(qkv, x, self.layer_id, "qkv")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = ops.rotary(q, *rotary), ops.rotary(k, *rotary)
        ops.store_kv(k if self.k_shift is None else k - self.k_shift, v, layer_cache, batch.slot_mapping)
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
        o = self.o_proj.forward(out, ops.graph)
        if batch.lora is not None:
            o = batch.lora.add(o, out, self.layer_id, "o")
        return self.tp.all_reduce(o)


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: TPGroup, layer_id: int = 0):
        super().__init__()
        self.tp = tp
        self.layer_id = layer_id
        self.intermediate = spec.intermediate_size
        self.gate_up_proj = Projection(spec.hidden_size, 2 * spec.intermediate_size)
        self.down_proj = Projection(spec.intermediate_size, spec.hidden_size)

    def forward(self, x: torch.Tensor, ops: KernelOps, lora=None) -> torch.Tensor:
        """`lora`: the step's LoRABatch (models/lora.py), when adapters run in it."""
        gate_up = self.gate_up_proj.forward(x, ops.graph)
        if lora is not None:
            gate_up = lora.add(gate_up, x, self.layer_id, "gate_up")
        gate, up = gate_up.split(self.intermediate, dim=-1)
        h = F.silu(gate).mul_(up)  # (in place: one activation-sized tensor fewer a layer; the same bits)
        down = self.down_proj.forward(h, ops.graph)
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
        # a tied head multiplies by the embedding table (held in its format at hold_weights); quantized, it is the
        # table too (lookups dequantize its rows)
        self.lm_head = Projection(spec.hidden_size, local.vocab_size, tied=spec.tie_word_embeddings)
        self.rotary = RotaryEmbedding(spec)

    def projections(self) -> list[Projection]:
        """Every dense layer: each layer's projections, then the LM head."""
        return [m for m in self.layers.modules() if isinstance(m, Projection)] + [self.lm_head]

    @property
    def quantization(self) -> str | None:
        """The scheme of the projections' weights ("int8", "int4", "gguf:Q4_1", ...; a GGUF file's types in
        the order met, "gguf:Q5_0+Q8_0+Q4_K+Q6_K", where they differ), None when not quantized."""
        schemes = [m.format.scheme for m in self.projections()[:-1]
                   if isinstance(m.format, (QuantizedWeight, QuantizedParts))]
        if not schemes:
            return None
        kinds = list(dict.fromkeys(t for s in schemes for t in s.removeprefix("gguf:").split("+")))
        return schemes[0] if len(kinds) == 1 else "gguf:" + "+".join(kinds)

    @property
    def quantized_head(self) -> QuantizedWeight | None:
        """The LM head's weight where it is quantized (then the embedding table too, if tied), else None."""
        head = self.lm_head.format
        return head if isinstance(head, QuantizedWeight) else None

    def dense_formats(self) -> dict[str, str]:
        """Each kind of dense layer (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head) -> the format its products
        read (DenseWeight.label): "q4 g32 (gguf:Q4_1)", "q8 g16 + q4 g32" for pieces in two formats, "float32
        packed" (oneDNN's layout), "float32"; kinds whose layers differ list each format once, joined by " / "."""
        return self._by_kind("label")

    def dense_arithmetic(self) -> dict[str, str]:
        """Each kind of dense layer -> what its products multiply on, on this processor (DenseWeight.arithmetic):
        "float32", "int16 rows x q4 to 16 rows, int8 blocks x q4 (AVX2) above", ..."""
        return self._by_kind("arithmetic")

    def _by_kind(self, attribute: str) -> dict[str, str]:
        found: dict[str, list[str]] = {}
        for name, module in [*self.layers.named_modules(), ("lm_head", self.lm_head)]:
            if isinstance(module, Projection):
                found.setdefault(name.rsplit(".", 1)[-1], []).append(getattr(module.format, attribute))
        return {kind: " / ".join(dict.fromkeys(values)) for kind, values in found.items()}

    def weight_bytes(self) -> int:
        """The bytes the weights take, in their own formats (a packed copy and a plain one kept beside it both
        count; a tensor two formats share counts once)."""
        formats = [m.format for m in self.projections() if m.format is not None]
        inside = {t.data_ptr() for f in formats for t in f.parameters()}
        rest = sum(t.numel() * t.element_size() for t in self.parameters() if t.data_ptr() not in inside)
        return rest + sum(f.nbytes for f in {id(f): f for f in formats}.values())

    def quantize_weights(self, quantize: Callable[[torch.Tensor], QuantizedWeight],
                         head: Callable[[torch.Tensor], QuantizedWeight]) -> None:
        """Holds every projection's weight as quantize(weight), and the LM head's as head(weight) (when the head
        is the embedding table, the table is held once, quantized, and lookups dequantize its rows). Each
        full-precision weight is dropped as soon as its quantized form exists."""
        for module in self.projections()[:-1]:
            module.hold(quantize(module.weight))
        self.set_quantized_head(head(self.embed_tokens.weight if self.spec.tie_word_embeddings
                                     else self.lm_head.weight))

    def set_quantized_head(self, qw: QuantizedWeight) -> None:
        self.lm_head.hold(qw)
        if self.spec.tie_word_embeddings:
            self.embed_tokens.weight = None

    def hold_weights(self, layout: DenseLayout) -> None:
        """Every dense layer not yet held (the quantized ones are) in `layout` (kernels/dense.py: choose_layout),
        the tied LM head over the embedding table, which stays plain: lookups need it."""
        for module in self.projections():
            if module.format is None:
                tied = module is self.lm_head and self.spec.tie_word_embeddings
                module.hold(layout.hold(self.embed_tokens.weight if tied else module.weight))

    def packed_weights(self) -> list[torch.Tensor]:
        """Every packed copy hold_weights made (the projections', the LM head's)."""
        return [m.format.packed for m in self.projections() if isinstance(m.format, PackedWeight)]

    def linear_shapes(self) -> list[tuple[int, int]]:
        """The distinct [out, in] shapes of one layer's full-precision weights as loaded, before hold_weights (none
        where they are quantized)."""
        return sorted({(m.out_features, m.in_features) for m in self.layers[0].modules()
                       if isinstance(m, Projection) and m.weight is not None})

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
            x = quant_embedding(self.lm_head.format, ids, self.norm.weight.dtype)
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
        logits = self.lm_head.forward(h, ops.graph).float()
        return self.tp.gather_last(logits, self.tp.shard.sizes(self.spec.vocab_size))
