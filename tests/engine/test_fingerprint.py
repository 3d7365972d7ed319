"""A fingerprint that is the weights' identity: two checkpoints with the same config.json and file sizes whose
weights differ in the middle of a file (a fine-tune of some layers, a checkpoint re-saved in place) never
share cold, remote or snapshot entries; the digest is read once per checkpoint and kept."""

import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_checkpoint, make_config
from tieredkv import AsyncEngine, EngineConfig, SamplingParams, SnapshotError
from tieredkv.engine.identity import model_fingerprint
from tieredkv.models import digest

PROMPT = [3 + (i * 37) % 440 for i in range(90)]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def negate_layers(model_dir, layers=(1, 2)) -> None:
    """The k/v projections of some middle layers negated, the file rewritten at the same size."""
    path = model_dir / "model.safetensors"
    size = path.stat().st_size
    tensors = load_file(str(path))
    for i in layers:
        for p in ("k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{p}.weight"
            tensors[name] = -tensors[name]
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert path.stat().st_size == size


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A checkpoint of ~17 MB (past the first and last MiB of its file, which an identity of samples read)
    and a copy whose layers 1-2 differ."""
    base = make_checkpoint(tmp_path_factory.mktemp("base"), "llama", hidden_size=256, intermediate_size=1024,
                           num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    tuned = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(base, tuned)
    negate_layers(tuned)
    return base, tuned


async def answer(cfg: EngineConfig, prompt=PROMPT):
    async with await AsyncEngine.start(cfg) as engine:
        out = await engine.generate(prompt, PARAMS)
        return out.outputs[0].token_ids, out.usage.cached_prompt_tokens


@pytest.fixture(scope="module")
async def alone(pair):
    """What each model answers with no tier below hot."""
    return [(await answer(make_config(model=str(m), num_blocks=64, warm_bytes=0)))[0] for m in pair]


def test_the_fingerprint_covers_every_byte_of_the_weights(pair, tmp_path):
    base, tuned = pair
    assert model_fingerprint(base, torch.float32, 16, cache_dir=tmp_path) != \
        model_fingerprint(tuned, torch.float32, 16, cache_dir=tmp_path)


async def test_another_checkpoint_of_the_same_size_takes_nothing_from_the_cold_tier(pair, alone, tmp_path):
    base, tuned = pair
    assert alone[0] != alone[1]
    cold = dict(cold_path=str(tmp_path / "cold"), cold_secret_path=str(tmp_path / "key"), num_blocks=64,
                warm_bytes=0)
    assert await answer(make_config(model=str(base), **cold)) == (alone[0], 0)
    assert await answer(make_config(model=str(base), **cold)) == (alone[0], 80)  # the cold tier serves its own
    assert await answer(make_config(model=str(tuned), **cold)) == (alone[1], 0)


async def test_another_checkpoint_of_the_same_size_takes_nothing_from_the_remote_tier(pair, alone, valkey_server,
                                                                                      fleet_key):
    from tieredkv.tiers.remote import RemoteTier

    base, tuned = pair
    remote = dict(remote_url=valkey_server.url, cold_secret_path=str(fleet_key), num_blocks=64, warm_bytes=0)
    async with await AsyncEngine.start(make_config(model=str(base), **remote)) as engine:
        assert (await engine.generate(PROMPT, PARAMS)).outputs[0].token_ids == alone[0]
        tier: RemoteTier = engine.core.tiers.tier("remote")
        await asyncio.to_thread(tier.flush_sync)
    assert await answer(make_config(model=str(base), **remote)) == (alone[0], 80)
    assert await answer(make_config(model=str(tuned), **remote)) == (alone[1], 0)


async def test_another_checkpoints_snapshot_is_refused(pair, tmp_path):
    base, tuned = pair
    path = tmp_path / "base.snapshot"
    async with await AsyncEngine.start(make_config(model=str(base), num_blocks=64, warm_bytes=0)) as engine:
        await engine.generate(PROMPT, PARAMS)
        assert await engine.export_cache(path) >= 5
    async with await AsyncEngine.start(make_config(model=str(tuned), num_blocks=64, warm_bytes=0)) as engine:
        with pytest.raises(SnapshotError, match="another model"):
            await engine.import_cache(path)


def test_the_digest_is_kept_and_a_file_rewritten_in_place_is_read_again(pair, tmp_path, monkeypatch):
    base, _ = pair
    model = tmp_path / "model"
    shutil.copytree(base, model)
    cache = tmp_path / "cache"
    before = model_fingerprint(model, torch.float32, 16, cache_dir=cache)
    weights = model / "model.safetensors"
    assert digest.cached_digest(weights, cache) is not None

    def no_reads(path, cache_dir):
        raise AssertionError("read again although unchanged")

    with monkeypatch.context() as m:  # a second start stats the files and reads the kept digest
        m.setattr(digest, "file_digest", lambda p, c: digest.cached_digest(p, c) or no_reads(p, c))
        assert model_fingerprint(model, torch.float32, 16, cache_dir=cache) == before
    negate_layers(model, layers=(2,))
    assert digest.cached_digest(weights, cache) is None  # its change time moved
    assert model_fingerprint(model, torch.float32, 16, cache_dir=cache) != before
