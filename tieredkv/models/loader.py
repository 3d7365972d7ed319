"""Load a Llama-family Hugging Face checkpoint (config.json + safetensors) into `LlamaModel`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from tieredkv.errors import CheckpointError, UnsupportedModelError
from tieredkv.kernels.quant import QuantizedParts, QuantizedWeight, cat_rows, quantize_int4, quantize_int8
from tieredkv.models.checks import check_layer_count, check_tensors, tensor_headers
from tieredkv.models.files import read_json
from tieredkv.models.gguf_convert import gguf_tensors, read_gguf_weights
from tieredkv.models.llama import LlamaModel, RotaryEmbedding
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_group import TPGroup
from tieredkv.models.tp_shard import Ranges, Shard


@dataclass(frozen=True)
class QuantSettings:
    """EngineConfig's quantization settings, resolved: the scheme, int4's groups, the GGUF file to read."""
    scheme: str  # "int8" | "int4" | "gguf"
    group_size: int = 32
    symmetric: bool = False
    gguf_path: Path | None = None
    cache_dir: Path | None = None  # where the GGUF file's header index is kept (gguf_convert.gguf_index)
    int8_activations: bool | None = None  # EngineConfig.int8_activations: always, for many rows (None), never

    @property
    def label(self) -> str:
        """What the weights are, for stats() and the start-up line ("+a8": int8 activations in every step)."""
        if self.scheme == "int4":
            label = f"int4-g{self.group_size}-{'sym' if self.symmetric else 'asym'}"
        else:
            label = self.scheme if self.gguf_path is None else f"gguf:{self.gguf_path.name}"
        return f"{label}+a8" if self.int8_activations else label

    @property
    def fingerprint(self) -> str:
        """The label, and where products of many rows round the activations to int8 (the default), that too: the
        keys and values computed differ."""
        return self.label + ("+a8p" if self.int8_activations is None else "")


_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def weight_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors shards, from the index when there is one."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
        except (UnsupportedModelError, KeyError, AttributeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index: {e}") from None
        files = [model_dir / n for n in names]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index.name} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_dir} (pickled .bin checkpoints are not loaded)")
    return files


def load_model(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               quant: QuantSettings | None = None, tp: TPGroup | None = None) -> LlamaModel:
    """Checks the config against the weights' headers, builds the model without initialising it, then fills
    every parameter from the checkpoint; with `quant`, the projections and the LM head are quantized as each
    is loaded ("int8", "int4"), or read quantized as they are from a GGUF file ("gguf"). Under tensor
    parallelism (`tp`) only this rank's slices are read (models/tp_shard.py)."""
    tp = tp or TPGroup()
    if quant is not None and quant.scheme == "gguf":
        if tp.world > 1:
            raise CheckpointError("GGUF weights are not split across tensor-parallel ranks; use the safetensors "
                                  "checkpoint (with quantization int8 or int4) or tensor_parallel_size 1")
        return _load_gguf(quant.gguf_path, spec, dtype, device, quant.cache_dir)
    model = _load_full(model_dir, spec, dtype, device, tp)
    if quant is not None:
        if quant.scheme == "int8":
            model.quantize_weights(quantize_int8, head=quantize_int8)
        else:
            model.quantize_weights(partial(quantize_int4, group_size=quant.group_size, symmetric=quant.symmetric),
                                   head=quantize_int8)
    return model


def _load_full(model_dir: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               tp: TPGroup) -> LlamaModel:
    files = weight_files(model_dir)
    headers = tensor_headers(files)
    check_layer_count(spec, headers)
    check_tensors(spec, headers)
    with torch.device("meta"):
        model = LlamaModel(spec, tp)
    parts = _read_tensors(files, spec, dtype, device, tp.shard)
    state = _fuse(parts, [name for name, _ in model.named_parameters()])
    unused = [k for k in parts if not k.endswith("rotary_emb.inv_freq")]
    if unused:
        raise CheckpointError(f"checkpoint has tensors this architecture does not use: {', '.join(sorted(unused)[:5])}")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"checkpoint tensors do not match config.json: {e}") from None
    model.rotary = RotaryEmbedding(spec).to(device)
    return model.eval()


def _load_gguf(gguf_path: Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
               cache_dir: Path | None) -> LlamaModel:
    """The model with its weights as the GGUF file stores them: quantized projections and LM head keep their
    blocks (QuantizedWeight), float tensors are cast to `dtype`. An embedding table that is quantized but
    not tied to the head is dequantized once (lookups read it as a table)."""
    infos = gguf_tensors(gguf_path, cache_dir)
    check_layer_count(spec, infos, gguf_path.name)
    check_tensors(spec, infos, dtypes=None)  # (each tensor's GGUF type is checked as it is read, by its own name)
    parts = read_gguf_weights(gguf_path, cache_dir)
    with torch.device("meta"):
        model = LlamaModel(spec)
    for name, value in _fuse(parts, [n for n, _ in model.named_parameters()]).items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        head = name == ("embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight")
        if isinstance(value, QuantizedWeight) and head:
            model.set_quantized_head(value.to(device))
        elif isinstance(value, QuantizedWeight) and name == "embed_tokens.weight":
            module.weight = nn.Parameter(value.dequantize().to(device=device, dtype=dtype), requires_grad=False)
        elif isinstance(value, (QuantizedWeight, QuantizedParts)):
            module.hold(value.to(device))
        else:
            setattr(module, attr, nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False))
    unused = sorted(k for k in parts if not (k == "lm_head.weight" and spec.tie_word_embeddings))
    if unused:
        raise CheckpointError(f"{gguf_path.name} has tensors this architecture does not use: {', '.join(unused[:5])}")
    model.rotary = RotaryEmbedding(spec).to(device)
    return model.eval()


def _read_tensors(files: list[Path], spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                  shard: Shard = Shard()) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint (but a tied LM head), named without the "model." prefix, in dtype on
    device, with a progress bar over the bytes read; of a tensor split across ranks, only `shard`'s slices."""
    parts: dict[str, torch.Tensor] = {}
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, desc="loading weights",
              disable=None) as bar:
        for f in files:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as st:
                    for key in st.keys():
                        name = key.removeprefix("model.")
                        if name.startswith("lm_head.") and spec.tie_word_embeddings:
                            continue
                        where = shard.ranges(name, spec)
                        tensor = st.get_tensor(key) if where is None else _read_slices(st.get_slice(key), *where)
                        # a copy of its own: a tensor on the file's mapping would keep every page of the file
                        # read at load resident beside the model's (fused, packed or quantized) copies
                        parts[name] = tensor.to(device=device, dtype=dtype, copy=True)
                        bar.update(tensor.numel() * tensor.element_size())
            except SafetensorError as e:
                raise CheckpointError(f"cannot read {f.name} (truncated or corrupt safetensors file): {e}") from None
    return parts


def _read_slices(part, dim: int, runs: Ranges) -> torch.Tensor:
    """The runs of dimension `dim` of a safetensors slice, concatenated: only those bytes are read."""
    index = (lambda a, b: part[a:b]) if dim == 0 else (lambda a, b: part[:, a:b])
    pieces = [index(a, b) for a, b in runs]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _fuse(parts: dict, expected: list[str]) -> dict:
    """The model's state dict, taking each parameter from `parts` (which keeps what is left over), fused
    projections concatenated from their pieces (tensors, or QuantizedWeight read from a GGUF file)."""
    state: dict = {}
    for name in expected:
        if name in parts:
            state[name] = parts.pop(name)
            continue
        for fused, pieces in _FUSED.items():
            if fused in name:
                try:
                    state[name] = cat_rows([parts.pop(name.replace(fused, p)) for p in pieces], name)
                except KeyError as e:
                    raise CheckpointError(f"checkpoint lacks tensor {e.args[0]!r}") from None
                break
        else:
            raise CheckpointError(f"checkpoint lacks tensor {name!r}")
    return state
