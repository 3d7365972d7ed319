"""Cache snapshots: export, then import into a fresh engine (another replica), served from warm/cold;
another model's snapshot refused; a damaged or truncated file imports nothing wrong."""

import random

import pytest

from helpers import check_pool_clean, make_config
from tieredkv import SamplingParams, SnapshotError

BS = 16
BLOCK_BYTES = 3 * 2 * BS * 2 * 16 * 4
SYSTEMS = [[random.Random(s).randrange(3, 300) for _ in range(96)] for s in range(3)]  # 6 blocks each
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def cfg(llama_dir, **kw):
    return make_config(model=str(llama_dir), num_blocks=64, warm_bytes=64 * BLOCK_BYTES, **kw)


async def answers(engine, prompts):
    outs = [await engine.generate(p, PARAMS) for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.usage for o in outs]


@pytest.fixture(scope="module")
async def snapshot(engines, llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("snap") / "cache.tkv"
    async with await engines.start(cfg(llama_dir)) as engine:
        expected, _ = await answers(engine, [s + [7, 8] for s in SYSTEMS])
        seen = []
        n = await engine.export_cache(path, prompts=SYSTEMS, progress=seen.append)
        assert n == 3 * 6 and sum(seen) == n
        everything = await engine.export_cache(path.with_suffix(".all"))
        assert everything >= n
    return path, expected


async def test_a_fresh_replica_serves_imported_prompts_from_warm(engines, llama_dir, snapshot):
    path, expected = snapshot
    async with await engines.start(cfg(llama_dir)) as engine:
        report = await engine.import_cache(path)
        assert report == {"imported": 18, "corrupt": 0, "complete": True}
        got, usage = await answers(engine, [s + [7, 8] for s in SYSTEMS])
        assert got == expected
        assert [u.cached_tokens_by_tier["warm"] for u in usage] == [96] * 3
        await engine.run_in_worker(check_pool_clean, engine.core)


async def test_into_cold_when_there_is_no_warm_tier(engines, llama_dir, snapshot, tmp_path):
    path, expected = snapshot
    config = make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0, cold_path=str(tmp_path / "c"))
    async with await engines.start(config) as engine:
        assert (await engine.import_cache(path))["imported"] == 18
        await engine.run_in_worker(engine.core.tiers.cold.flush_sync)
        got, usage = await answers(engine, [s + [7, 8] for s in SYSTEMS])
        assert got == expected and [u.cached_tokens_by_tier["cold"] for u in usage] == [96] * 3


async def test_another_models_snapshot_is_refused(engines, llama_dir, snapshot):
    path, _ = snapshot
    async with await engines.start(cfg(llama_dir, dtype="bfloat16")) as engine:
        with pytest.raises(SnapshotError, match="another model"):
            await engine.import_cache(path)
        with pytest.raises(SnapshotError, match="not a tieredkv"):
            await engine.import_cache(__file__)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_a_damaged_snapshot_imports_nothing_wrong(engines, llama_dir, snapshot, tmp_path, damage):
    path, expected = snapshot
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        for i in range(len(raw) // 3, len(raw) - 20, len(raw) // 7):
            raw[i] ^= 0xFF
    else:
        raw = raw[: len(raw) * 2 // 3]
    bad = tmp_path / "bad.tkv"
    bad.write_bytes(bytes(raw))
    async with await engines.start(cfg(llama_dir)) as engine:
        report = await engine.import_cache(bad)
        assert report["imported"] < 18
        assert report["corrupt"] > 0 if damage == "flip" else not report["complete"]
        got, _ = await answers(engine, [s + [7, 8] for s in SYSTEMS])
        assert got == expected  # whatever was imported is exact; the rest is recomputed


@pytest.mark.parametrize("damage", ["cut after 5 bytes of header", "length 0xFFFFFFF0", "a list for a header",
                                    "a number for a shape", "no header at all"])
async def test_a_damaged_snapshot_header_is_a_snapshot_error(tmp_path, damage):
    """Header bytes that msgpack cannot read, or reads as the wrong kind, raise SnapshotError (nothing else)."""
    import struct

    import msgpack
    import torch

    from tieredkv.engine.snapshot import MAGIC, read_snapshot

    good = msgpack.packb({"fp": "f", "dtype": "torch.float32", "shape": [2, 2]})
    bad_shape = msgpack.packb({"fp": "f", "dtype": "torch.float32", "shape": 3})
    body = {
        "cut after 5 bytes of header": struct.pack("<I", len(good)) + good[:5],
        "length 0xFFFFFFF0": struct.pack("<I", 0xFFFFFFF0) + good,
        "a list for a header": struct.pack("<I", len(msgpack.packb([1, 2]))) + msgpack.packb([1, 2]),
        "a number for a shape": struct.pack("<I", len(bad_shape)) + bad_shape,
        "no header at all": b"",
    }[damage]
    path = tmp_path / "damaged.tkv"
    path.write_bytes(MAGIC + body)
    batches, _ = read_snapshot(path, "f", torch.float32, (2, 2))
    with pytest.raises(SnapshotError):
        async for _ in batches:
            pass
