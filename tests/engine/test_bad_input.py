"""Bad input gets a clear error before anything is allocated, and the engine keeps serving."""

import asyncio
import json
import shutil

import pytest
from pydantic import ValidationError

from helpers import check_pool_clean, make_config
from tieredkv import (CheckpointError, RequestError, SamplingParams,
                      UnsupportedModelError)


@pytest.fixture(scope="module")
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=64, max_model_len=256, warm_bytes=0))
    yield engine
    await engine.close()


@pytest.mark.parametrize(
    "prompt, match",
    [
        ("", "empty"),
        ([], "empty"),
        ([5] * 256, "max_model_len"),
        ([5, 10**6], "outside the vocabulary"),
        ([5, -1], "outside the vocabulary"),
        ([{"role": "user"}], "content"),
    ],
)
async def test_bad_prompts(engine, prompt, match):
    with pytest.raises(RequestError, match=match):
        engine.stream(prompt, SamplingParams(max_tokens=4))
    assert engine.stats().blocks_used == 0 and engine.stats().num_waiting == 0
    out = await engine.generate([5, 6, 7], SamplingParams(max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


async def test_wrong_prompt_type(engine):
    with pytest.raises(TypeError, match="prompt must be"):
        engine.stream(42)
    with pytest.raises(TypeError, match="prompt must be"):
        engine.stream([1.5, 2.5])


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -1}, "top_k"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"no_such_field": 1}, "no_such_field"),
        ({"offload": "sideways"}, "offload"),
        ({"far_blocks": "staged"}, "far_blocks"),  # one field says it now: offload="staged"
    ],
)
def test_bad_engine_config(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        make_config(**kwargs)


def test_offload_is_one_field_that_also_takes_a_switch():
    """`offload` names how far blocks are read, or "off"; True and False (and the environment's 1/0) are the
    device's way and off."""
    assert [make_config(offload=v).offload for v in (True, False, "1", "false", "staged")] == \
        ["auto", "off", "auto", "off", "staged"]
    assert make_config().offload == "auto"


async def test_request_too_big_for_the_pool(engine):
    with pytest.raises(RequestError, match="KV blocks"):
        engine.stream([5] * 100, SamplingParams(max_tokens=150, n=8))
    check_pool_clean(engine.core)


async def test_duplicate_request_id(engine):
    stream = engine.stream([5, 6], SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
    async for _ in stream:
        with pytest.raises(RequestError, match="already in use"):
            engine.stream([5, 6], request_id="dup")
        break


async def test_unknown_model_path(engines, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        await engines.start(make_config(model=str(tmp_path / "no-such-model")))


async def test_truncated_safetensors(engines, llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        await engines.start(make_config(model=str(broken)))


async def test_unsupported_architecture(engines, llama_dir, tmp_path):
    other = tmp_path / "gpt2ish"
    shutil.copytree(llama_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        await engines.start(make_config(model=str(other)))


async def test_missing_weights(engines, llama_dir, tmp_path):
    empty = tmp_path / "noweights"
    shutil.copytree(llama_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        await engines.start(make_config(model=str(empty)))


async def test_max_model_len_beyond_the_model(engines, llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        await engines.start(make_config(model=str(llama_dir), max_model_len=10**6))


def _copy_with_config(llama_dir, tmp_path, name, **changes):
    out = tmp_path / name
    shutil.copytree(llama_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("changes, error, match", [
    ({"num_hidden_layers": 10**6}, CheckpointError, "num_hidden_layers=1000000; the weights: 3 layers"),
    ({"num_attention_heads": 0}, UnsupportedModelError, "num_heads must be a positive integer"),
    ({"hidden_size": 4096}, CheckpointError, "has shape"),
    ({"vocab_size": 10**7}, CheckpointError, "vocab_size"),
    ({"intermediate_size": "lots"}, UnsupportedModelError, "wrong kind"),
    ({"head_dim": 15}, UnsupportedModelError, "even"),
])
async def test_a_hostile_config_is_refused_before_anything_is_built(engines, llama_dir, tmp_path, changes, error,
                                                                   match):
    model = _copy_with_config(llama_dir, tmp_path, "hostile", **changes)
    with pytest.raises(error, match=match):
        await asyncio.wait_for(engines.start(make_config(model=str(model), num_blocks=16)), 20)


async def test_a_huge_max_position_embeddings_allocates_nothing_for_it(engines, llama_dir, tmp_path):
    model = _copy_with_config(llama_dir, tmp_path, "longctx", max_position_embeddings=10**9)
    async with await asyncio.wait_for(engines.start(make_config(model=str(model), num_blocks=16)), 20) as e:
        out = await e.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
        assert not any(b.numel() > 10**6 for b in e.core.model.buffers())


@pytest.mark.parametrize("target", ["config.json", "model.safetensors", "tokenizer.json"])
@pytest.mark.parametrize("kind", ["device", "fifo"])
async def test_files_that_never_end_are_refused(engines, llama_dir, tmp_path, target, kind):
    import os

    model = tmp_path / "odd"
    shutil.copytree(llama_dir, model)
    (model / target).unlink()
    if kind == "device":
        os.symlink("/dev/zero", model / target)
    else:
        os.mkfifo(model / target)
    with pytest.raises(CheckpointError, match=f"{target}.* not a regular file"):
        await asyncio.wait_for(engines.start(make_config(model=str(model), num_blocks=16)), 20)
