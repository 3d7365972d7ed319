"""The architecture facts the engine needs, read from a checkpoint's config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tieredkv.errors import UnsupportedModelError
from tieredkv.models.files import read_json

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",  # q and k normalised per head (q_norm, k_norm)
    "Phi3ForCausalLM": "phi3",  # q/k/v and gate/up stored fused, as here
}
_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norms), Phi-3 and SmolLM share it."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    attention_bias: bool
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None = None
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before the rotary embedding (Qwen3)
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements one token takes across all layers (times the dtype size for bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelSpec":
        model_type = _model_type(cfg)
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            spec = cls(
                model_type=model_type,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or (hidden // heads if heads > 0 else 0)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rope_theta=_rope_theta(cfg),
                rope_scaling=_rope_scaling(cfg),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
                sliding_window=_sliding_window(cfg, model_type),
                qk_norm=model_type == "qwen3",
                raw=cfg,
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError, OverflowError) as e:
            raise UnsupportedModelError(f"config.json has a field of the wrong kind: {e}") from None
        spec._check(cfg)
        return spec

    def _check(self, cfg: dict[str, Any]) -> None:
        spec = self
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(spec, name) < 1:
                raise UnsupportedModelError(
                    f"config.json: {name} must be a positive integer, got {getattr(spec, name)}")
        if spec.head_dim % 2:
            raise UnsupportedModelError(
                f"config.json: head_dim must be even for rotary embeddings, got {spec.head_dim}")
        if spec.num_heads % spec.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({spec.num_heads}) is not a multiple of num_key_value_heads ({spec.num_kv_heads})"
            )
        if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
            raise UnsupportedModelError(f"unsupported partial_rotary_factor {cfg['partial_rotary_factor']}; only 1.0")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        _positive("rope_theta", spec.rope_theta)  # 0 or below: every rotary angle is NaN or inf
        _positive("rms_norm_eps", spec.rms_norm_eps)
        if spec.sliding_window is not None and spec.sliding_window < 1:
            raise UnsupportedModelError(f"config.json: sliding_window must be a positive integer, got "
                                        f"{spec.sliding_window}")
        if spec.rope_scaling is not None:
            _check_rope_scaling(spec.rope_scaling)

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelSpec":
        path = Path(path)
        try:
            cfg = read_json(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json in {path.parent}") from None
        return cls.from_dict(cfg)


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    return cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}


def _rope_theta(cfg: dict[str, Any]) -> float:
    return float(_rope_params(cfg).get("rope_theta", cfg.get("rope_theta", 10000.0)))


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    params = dict(_rope_params(cfg))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
    params["rope_type"] = kind
    return params


def _positive(name: str, value: Any) -> float:
    """config.json's `name` as a finite number above 0, or UnsupportedModelError naming it."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not (math.isfinite(number) and number > 0):
        raise UnsupportedModelError(f"config.json: {name} must be a finite number above 0, got {value!r}")
    return number


def _check_rope_scaling(params: dict[str, Any]) -> None:
    """Values rope_inv_freq (models/llama.py) can compute with: a factor above 0, and for llama3 a low
    frequency factor below the high one and an original length of at least one position."""
    if "factor" not in params:
        raise UnsupportedModelError(f"config.json: {params['rope_type']} rope scaling needs a factor")
    _positive("rope scaling factor", params["factor"])
    if params["rope_type"] == "llama3":
        low = _positive("rope scaling low_freq_factor", params.get("low_freq_factor", 1.0))
        high = _positive("rope scaling high_freq_factor", params.get("high_freq_factor", 4.0))
        if high <= low:
            raise UnsupportedModelError(f"config.json: rope scaling high_freq_factor ({high}) must exceed "
                                        f"low_freq_factor ({low})")
        if _positive("rope scaling original_max_position_embeddings",
                     params.get("original_max_position_embeddings", 8192)) < 1:
            raise UnsupportedModelError("config.json: rope scaling original_max_position_embeddings must be at "
                                        "least 1")


def _eos_ids(v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, list) else (int(v),)


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        return None
    return int(window)


def _model_type(cfg: dict[str, Any]) -> str:
    """The family of a config.json (by its architectures, else its model_type), or UnsupportedModelError."""
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
    if known:
        return known[0]
    if archs or model_type not in _MODEL_TYPES:
        what = ", ".join(archs) if archs else f"model_type={model_type!r}"
        raise UnsupportedModelError(
            f"unsupported architecture {what}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return model_type
