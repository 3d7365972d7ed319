"""A checkpoint that cannot run is refused at start, naming the file and the tensor: each tensor's stored type
and shape against what the architecture reads (safetensors and GGUF), damaged GGUF files as CheckpointError,
config values the model cannot compute with as UnsupportedModelError. Nothing starts and then fails every
request."""

import asyncio
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import fresh_cache, make_config

from tieredkv import AsyncEngine, CheckpointError, SamplingParams, UnsupportedModelError


def copy_of(llama_dir, tmp_path, name="model"):
    out = tmp_path / name
    shutil.copytree(llama_dir, out)
    return out


def rewrite(model_dir, change) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


async def start(model_dir, **cfg):
    return await asyncio.wait_for(AsyncEngine.start(make_config(model=str(model_dir), num_blocks=16,
                                                                warm_bytes=0, **cfg)), 60)


@pytest.mark.parametrize("dtype, stored", [(torch.int8, "I8"), (torch.int32, "I32"), (torch.bool, "BOOL")])
async def test_a_tensor_stored_as_integers_is_refused_naming_it(llama_dir, tmp_path, dtype, stored):
    model = copy_of(llama_dir, tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite(model, lambda t: t.__setitem__(name, (t[name] * 100).to(dtype)))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor 'layers\.0\.self_attn\.q_proj\.weight' "
                                              rf"is stored as {stored}"):
        await start(model)


async def test_a_later_layers_tensor_of_the_wrong_shape_is_refused_naming_it(llama_dir, tmp_path):
    model = copy_of(llama_dir, tmp_path)
    name = "model.layers.2.mlp.down_proj.weight"
    rewrite(model, lambda t: t.__setitem__(name, t[name].t().contiguous()))  # [inter, hidden]: transposed
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'layers\.2\.mlp\.down_proj\.weight' has "
                                              r"shape \(128, 64\), but config\.json implies \(64, 128\)"):
        await start(model)


async def test_half_precision_checkpoints_still_load(llama_dir, tmp_path):
    model = copy_of(llama_dir, tmp_path)
    rewrite(model, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    async with await start(model) as engine:
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3


# -- config values the model cannot compute with ---------------------------------------------------------

def with_config(model_dir, change) -> None:
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def rope(cfg: dict, **values) -> None:
    params = cfg.get("rope_parameters") or {"rope_type": "default"}
    cfg["rope_parameters"] = {**params, **values}


@pytest.mark.parametrize("change, match", [
    (lambda c: rope(c, rope_theta=0), "rope_theta must be a finite number above 0, got 0"),
    (lambda c: rope(c, rope_theta=-10000.0), "rope_theta"),
    (lambda c: rope(c, rope_theta=float("nan")), "rope_theta"),
    (lambda c: rope(c, rope_theta="big"), "rope_theta|wrong kind"),
    (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps"),
    (lambda c: rope(c, rope_type="linear", factor=0), "rope scaling factor"),
    (lambda c: rope(c, rope_type="linear"), "needs a factor"),
    (lambda c: rope(c, rope_type="llama3", factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0,
                    original_max_position_embeddings=8192), "high_freq_factor"),
    (lambda c: c.update(sliding_window=0, model_type="mistral", architectures=["MistralForCausalLM"]),
     "sliding_window"),
])
async def test_config_values_the_model_cannot_run_are_refused_at_start(llama_dir, tmp_path, change, match):
    model = copy_of(llama_dir, tmp_path)
    with_config(model, change)
    with pytest.raises(UnsupportedModelError, match=match):
        await start(model)


# -- damaged GGUF files -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_model(llama_dir, tmp_path_factory):
    """The tiny checkpoint beside a GGUF file of its weights: projections and head as Q8_0, the rest F32."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    from tieredkv.models.gguf_convert import _LAYER_NAMES, _TOP_NAMES

    out = copy_of(llama_dir, tmp_path_factory.mktemp("gguf"))
    names = {f"model.layers.{i}.{hf}.weight": f"blk.{i}.{short}.weight"
             for i in range(3) for short, hf in _LAYER_NAMES.items()}
    names.update({f"{hf}.weight": f"{short}.weight" for short, hf in _TOP_NAMES.items()})
    writer = GGUFWriter(str(out / "tiny.gguf"), "llama")
    writer.add_uint32("llama.attention.head_count", 4)
    writer.add_uint32("llama.attention.head_count_kv", 2)
    for name, w in sorted(load_file(str(out / "model.safetensors")).items()):
        if w.dim() == 1 or name == "model.embed_tokens.weight":
            writer.add_tensor(names[name], w.numpy())
        else:
            raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
            writer.add_tensor(names[name], raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def damaged(gguf_model, tmp_path, damage):
    model = copy_of(gguf_model, tmp_path, "damaged")
    path = model / "tiny.gguf"
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(damage(data)))
    return model


def tensor_count(data: bytearray, count: int) -> bytearray:
    data[8:16] = count.to_bytes(8, "little")  # magic, version (u32 each), then the tensor count (u64)
    return data


async def test_the_intact_gguf_file_serves(gguf_model, tmp_path):
    cache = fresh_cache(tmp_path / "cache")
    async with await start(gguf_model, quantization="gguf", cache_dir=str(cache)) as engine:
        out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("damage, match", [
    (lambda d: d[: len(d) // 2], r"cannot read tiny\.gguf \(truncated|tiny\.gguf: tensor .* lies past the end"),
    (lambda d: d[:4096], r"cannot read tiny\.gguf \(truncated or corrupt GGUF file\)"),
    (lambda d: d[:100], r"cannot read tiny\.gguf"),
    (lambda d: tensor_count(d, 2**60), r"tiny\.gguf"),
    (lambda d: tensor_count(d, 1), r"tiny\.gguf"),
    (lambda d: b"GGUF" + bytes(4) + d[8:], r"cannot read tiny\.gguf"),
])
async def test_a_damaged_gguf_file_is_a_checkpoint_error_naming_it(gguf_model, tmp_path, damage, match):
    model = damaged(gguf_model, tmp_path, damage)
    with pytest.raises(CheckpointError, match=match):
        await start(model, quantization="gguf", cache_dir=str(tmp_path / "cache"))


async def test_a_gguf_tensor_of_the_wrong_shape_is_refused_naming_it(gguf_model, tmp_path):
    from tieredkv.models import gguf_convert

    model = copy_of(gguf_model, tmp_path, "reshaped")
    index = gguf_convert.gguf_index(model / "tiny.gguf", tmp_path / "cache")
    for t in index["tensors"]:  # as if the file declared the norm one element shorter
        if t["name"] == "blk.1.attn_norm.weight":
            t["shape"] = [t["shape"][0] - 1]
    cached = list((tmp_path / "cache" / "gguf-index").glob("tiny-*.json"))
    cached[0].write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"tiny\.gguf: tensor 'layers\.1\.input_layernorm\.weight' has shape "
                                              r"\(63,\), but config\.json implies \(64,\)"):
        await start(model, quantization="gguf", cache_dir=str(tmp_path / "cache"))
