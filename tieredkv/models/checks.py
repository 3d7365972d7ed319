"""Checks that run on a checkpoint before anything is allocated for it: config.json's sizes against the tensor
shapes, and each tensor's stored type and shape, from the safetensors headers (or a GGUF file's index)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from tieredkv.errors import CheckpointError

if TYPE_CHECKING:
    from tieredkv.models.spec import ModelSpec

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class TensorInfo(NamedTuple):
    """One tensor as a checkpoint's file declares it: the file's name, the stored type (safetensors' "F32",
    "BF16", ...; GGUF's "Q4_1", ...) and the shape, rows first."""

    file: str
    dtype: str
    shape: tuple[int, ...]


# the floating-point types a safetensors checkpoint of this engine's architectures may store its weights in
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name (without a leading "model.") -> shape of every tensor, from the files' headers only."""
    return {name: info.shape for name, info in tensor_headers(files).items()}


def tensor_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Name (without a leading "model.") -> file, stored type and shape of every tensor, from the headers only."""
    infos: dict[str, TensorInfo] = {}
    for f in files:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            raw = fh.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (size,)
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"cannot read {f.name} (truncated or corrupt safetensors file)")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CheckpointError(f"cannot read {f.name} (truncated or corrupt safetensors file)") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"cannot read {f.name} (truncated or corrupt safetensors file)")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict) or not isinstance(info.get("shape", ()), list):
                raise CheckpointError(f"{f.name}: the header's entry for tensor {name!r} is not a tensor's")
            infos[name.removeprefix("model.")] = TensorInfo(f.name, str(info.get("dtype")),
                                                            tuple(info.get("shape", ())))
    return infos


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor the architecture reads (names without "model.") -> its shape and the config.json fields that
    set it: q/k/v and gate/up both as pieces and fused (Phi-3 stores them fused), biases where config.json asks
    for them."""
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    vocab, hidden, heads = "vocab_size, hidden_size", "hidden_size", "num_attention_heads, head_dim"
    kv_heads, both, mlp = "num_key_value_heads, head_dim", f"{heads}, num_key_value_heads", "intermediate_size"
    out = {"embed_tokens.weight": ((spec.vocab_size, h), vocab), "lm_head.weight": ((spec.vocab_size, h), vocab),
           "norm.weight": ((h,), hidden)}
    layer = {"input_layernorm.weight": ((h,), hidden), "post_attention_layernorm.weight": ((h,), hidden),
             "self_attn.q_proj.weight": ((q, h), heads), "self_attn.k_proj.weight": ((kv, h), kv_heads),
             "self_attn.v_proj.weight": ((kv, h), kv_heads), "self_attn.qkv_proj.weight": ((q + 2 * kv, h), both),
             "self_attn.o_proj.weight": ((h, q), heads), "mlp.gate_proj.weight": ((inter, h), mlp),
             "mlp.up_proj.weight": ((inter, h), mlp), "mlp.gate_up_proj.weight": ((2 * inter, h), mlp),
             "mlp.down_proj.weight": ((h, inter), mlp)}
    if spec.attention_bias:
        layer.update({"self_attn.q_proj.bias": ((q,), heads), "self_attn.k_proj.bias": ((kv,), kv_heads),
                      "self_attn.v_proj.bias": ((kv,), kv_heads), "self_attn.qkv_proj.bias": ((q + 2 * kv,), both)})
    if spec.qk_norm:
        layer.update({"self_attn.q_norm.weight": ((d,), "head_dim"), "self_attn.k_norm.weight": ((d,), "head_dim")})
    for i in range(spec.num_layers):
        out.update({f"layers.{i}.{name}": expected for name, expected in layer.items()})
    return out


def check_tensors(spec: ModelSpec, infos: dict[str, TensorInfo],
                  dtypes: tuple[str, ...] | None = FLOAT_DTYPES) -> None:
    """Each tensor the architecture reads is stored in one of `dtypes` (None: any) with the shape config.json implies:
    a CheckpointError naming the file and the tensor otherwise (a tensor it does not read is the loader's
    to refuse, by name)."""
    expected = expected_shapes(spec)
    for name, info in infos.items():
        if name not in expected:
            continue
        want, fields = expected[name]
        if dtypes is not None and info.dtype not in dtypes:
            raise CheckpointError(f"{info.file}: tensor {name!r} is stored as {info.dtype}; this architecture reads "
                                  f"it as one of {', '.join(dtypes)}")
        if tuple(info.shape) != want:
            raise CheckpointError(f"{info.file}: tensor {name!r} has shape {tuple(info.shape)}, but config.json "
                                  f"implies {want} ({fields})")


def check_layer_count(spec: ModelSpec, names, source: str = "the weights") -> None:
    """The weights (`source`, for messages) hold layers 0 .. num_hidden_layers - 1 of config.json, no more and no
    fewer: checked before anything of the config's size is built (check_tensors then checks every tensor)."""
    layers = {int(m.group(1)) for name in names for m in [_LAYER.search(name)] if m}
    if layers != set(range(spec.num_layers)):
        found = f"{len(layers)} layers" if layers else "no layers"
        raise CheckpointError(f"config.json says num_hidden_layers={spec.num_layers}; {source}: {found}")
