"""What a config names, resolved: the device, the dtype, the cache directory, the model's checkpoint directory,
its context length and EOS tokens, the weights' quantization."""

from __future__ import annotations

from pathlib import Path

import torch

from tieredkv.cache_dir import default_cache_dir
from tieredkv.config import EngineConfig
from tieredkv.errors import ModelNotFoundError
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.models.files import check_regular_files, read_json
from tieredkv.models.gguf_convert import default_gguf_path, default_model_dir
from tieredkv.models.loader import QuantSettings
from tieredkv.models.spec import ModelSpec


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


BF16_CAPABILITY = (8, 0)  # Ampere: the first compute capability with native bf16 tensor cores


def resolve_dtype(name: str, device: torch.device, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The dtype "auto" means: float32 on CPU; on CUDA bfloat16 from compute capability 8.0, float16 below it
    (T4, V100 emulate bf16). `capability` defaults to the device's own, or to 8.0 where no CUDA device is
    present (planning for a card this machine does not have)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    if capability is None:
        capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else BF16_CAPABILITY
    return torch.bfloat16 if tuple(capability) >= BF16_CAPABILITY else torch.float16


def resolve_kv_layout(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device) -> KVLayout:
    """The KV cache's formats (EngineConfig.kv_cache_dtype, _k, _v) for this model's heads computed in `dtype` on
    `device`; ValueError naming what is supported where they cannot hold them."""
    k, v = cfg.kv_cache_dtypes
    return KVLayout.resolve(k, v, spec.head_dim, dtype, device)


def resolve_cache_dir(cfg: EngineConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def resolve_model_dir(model: str, cache_dir: Path | None = None) -> Path:
    """"default" (the converted default model under cache_dir), a local checkpoint directory, or a Hugging Face
    repo id (models/hub.py). A name that starts like a path (/, ., ~) is never looked up on the hub."""
    if model == "default":
        return default_model_dir(cache_dir)
    path = Path(model).expanduser()
    if not path.is_dir():
        if model.startswith(("/", ".", "~")):
            raise ModelNotFoundError(f"model {model!r}: there is no such directory")
        from tieredkv.models.hub import resolve_hub_model

        path = resolve_hub_model(model)
    check_regular_files(path)
    return path


def max_model_len(spec: ModelSpec, wanted: int | None) -> int:
    limit = spec.max_position_embeddings
    if spec.sliding_window is not None:
        limit = min(limit, spec.sliding_window)
    if wanted is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds what the model supports ({limit})")
    return wanted or limit


def eos_token_ids(spec: ModelSpec, model_dir: Path, tokenizer_eos: int | None) -> frozenset[int]:
    ids = set(spec.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = read_json(gen).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)


def quant_settings(cfg: EngineConfig, model_dir: Path) -> QuantSettings | None:
    """EngineConfig's quantization, with the GGUF file it reads for "gguf": the default model's own file, or
    the one *.gguf in the model directory."""
    if cfg.quantization is None:
        return None
    gguf = None
    if cfg.quantization == "gguf":
        found = [default_gguf_path()] if cfg.model == "default" else sorted(model_dir.glob("*.gguf"))
        if len(found) != 1:
            raise FileNotFoundError(f'quantization="gguf" reads the one *.gguf file in {model_dir}; found '
                                    f"{len(found)}{': ' + ', '.join(f.name for f in found) if found else ''}")
        gguf = found[0]
    return QuantSettings(cfg.quantization, cfg.quantization_group_size, cfg.quantization_symmetric, gguf,
                         resolve_cache_dir(cfg), cfg.int8_activations)
