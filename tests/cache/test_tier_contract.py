"""One contract for every storage tier: hot (the block pool), warm (host slab), cold (LMDB), remote (a
real Valkey server, and a one-node Valkey cluster), and a dict-backed tier that only the tests use. No
test here knows which tier it runs against."""

import pytest
import torch

from tieredkv.hashing import hash_block, root_hash
from tieredkv.kernels.dispatch import TORCH_OPS
from tieredkv.tiers.base import BlockKey
from tieredkv.tiers.block_pool import BlockPool
from tieredkv.tiers.cold import ColdTier, disk_cost
from tieredkv.tiers.hot import HotTier
from tieredkv.tiers.warm import WarmTier

from memory_tier import MemoryTier

SHAPE = (2, 2, 4, 2, 8)  # layers, k|v, block_size, kv_heads, head_dim
CAPACITY = 6


def make_keys(n, seed=0):
    keys, parent = [], root_hash(f"contract-{seed}")
    for i in range(n):
        tokens = tuple(range(i * 4 + seed, i * 4 + 4 + seed))
        parent = hash_block(parent, tokens)
        keys.append(BlockKey(parent, tokens))
    return keys


def make_blocks(n, seed=0):
    return torch.randn((n, *SHAPE), generator=torch.Generator().manual_seed(seed))


def make_tier(kind, tmp_path, request):
    if kind == "hot":
        pool = BlockPool(CAPACITY)
        kv = torch.zeros(SHAPE[0], 2, CAPACITY, *SHAPE[2:])
        return HotTier(pool, kv, TORCH_OPS)
    if kind == "warm":
        return WarmTier(CAPACITY, SHAPE, torch.float32, pin=False)
    if kind == "memory":
        return MemoryTier(CAPACITY, make_blocks(1)[0].numel() * 4)
    if kind.startswith("remote"):  # a real server (or cluster); a namespace (model fingerprint) per test
        from tieredkv.tiers.remote import RemoteTier

        server = request.getfixturevalue("valkey_cluster" if kind == "remote-cluster" else "valkey_server")
        return RemoteTier(server.url, f"fp-{request.node.name}", SHAPE, torch.float32, tmp_path / "key")
    entry = disk_cost(ColdTier.entry_bytes(SHAPE, torch.float32, "fp-test", num_tokens=4))
    return ColdTier(tmp_path / "cold", CAPACITY * entry, "fp-test", SHAPE, torch.float32)


@pytest.fixture(params=["hot", "warm", "cold", "memory", "remote", "remote-cluster"])
async def tier(request, tmp_path):
    t = make_tier(request.param, tmp_path, request)
    yield t
    await t.close()


@pytest.fixture(params=["hot", "warm", "cold", "memory"])
async def budgeted_tier(request, tmp_path):
    """The tiers that keep their own byte budget. The remote tier's is the server's (maxmemory and its
    policy): test_remote_tier.py tests a full server."""
    t = make_tier(request.param, tmp_path, request)
    yield t
    await t.close()


async def test_put_then_get_roundtrips_exactly(tier):
    keys, blocks = make_keys(4), make_blocks(4)
    assert await tier.put(keys, blocks) == 4
    assert await tier.contains(keys) == 4
    got = await tier.get(keys)
    assert torch.equal(got, blocks)


async def test_contains_and_get_stop_at_the_first_miss(tier):
    keys, blocks = make_keys(5), make_blocks(5)
    await tier.put(keys[:2] + keys[3:], torch.cat([blocks[:2], blocks[3:]]))
    assert await tier.contains(keys) == 2
    got = await tier.get(keys)
    assert got.shape[0] == 2 and torch.equal(got, blocks[:2])
    assert await tier.contains(keys[2:]) == 0
    assert await tier.get(keys[2:]) is None


async def test_same_hash_other_tokens_is_a_miss(tier):
    keys, blocks = make_keys(1), make_blocks(1)
    await tier.put(keys, blocks)
    forged = [BlockKey(keys[0].block_hash, tuple(t + 1 for t in keys[0].token_ids))]
    assert await tier.contains(forged) == 0


async def test_put_is_idempotent_and_remove_drops(tier):
    keys, blocks = make_keys(3), make_blocks(3)
    assert await tier.put(keys, blocks) == 3
    assert await tier.put(keys, blocks) == 3
    assert await tier.remove(keys[1:2]) == 1
    assert await tier.remove(keys[1:2]) == 0
    assert await tier.contains(keys) == 1
    assert await tier.contains(keys[2:]) == 1


async def test_a_full_tier_evicts_least_recently_used_first(budgeted_tier):
    tier = budgeted_tier
    keys, blocks = make_keys(CAPACITY + 3), make_blocks(CAPACITY + 3)
    for i in range(CAPACITY):
        await tier.put(keys[i:i + 1], blocks[i:i + 1])
    await tier.get(keys[:1])  # key 0 becomes the most recently used
    await tier.put(keys[CAPACITY:], blocks[CAPACITY:])
    present = [await tier.contains([k]) for k in keys]
    assert sum(present) <= CAPACITY
    assert present[CAPACITY:] == [1, 1, 1]
    assert present[0] == 1 and present[1] == 0  # key 1 was the oldest untouched
    assert tier.stats().used_bytes <= tier.stats().capacity_bytes


async def test_stats_report_capacity_and_use(tier):
    before = tier.stats().used_bytes
    # a remote tier's use is the server's whole memory, which moves by some kilobytes on its own (a fresh-clone
    # run saw 12 KB less after two 1 KB blocks): there, 256 blocks, beyond that noise
    n = 256 if tier.name.startswith("remote") else 2
    await tier.put(make_keys(n, seed=9), make_blocks(n))
    stats = tier.stats()
    assert stats.capacity_bytes > 0 and stats.used_bytes > before and stats.name == tier.name


async def test_admit_lands_after_flush_and_reports_what_it_evicted(tier):
    keys, blocks = make_keys(CAPACITY + 2, seed=3), make_blocks(CAPACITY + 2, seed=3)
    stored, (victim_keys, victim_blocks) = tier.admit(keys[:CAPACITY], blocks[:CAPACITY])
    assert stored == CAPACITY
    await tier.flush()
    assert await tier.contains(keys[:CAPACITY]) == CAPACITY
    stored, (victim_keys, victim_blocks) = tier.admit(keys[CAPACITY:], blocks[CAPACITY:])
    await tier.flush()
    assert await tier.contains(keys[CAPACITY:]) == 2
    for key, block in zip(victim_keys, victim_blocks if victim_blocks is not None else []):
        assert torch.equal(block, blocks[keys.index(key)])  # an evicted entry comes back intact


async def test_export_returns_every_entry_and_clear_empties(tier):
    keys, blocks = make_keys(5, seed=4), make_blocks(5, seed=4)
    await tier.put(keys, blocks)
    exported = {}
    for part_keys, part_blocks in tier.export_sync(2):
        assert len(part_keys) <= 2 and part_blocks.shape[0] == len(part_keys)
        exported.update(zip(part_keys, part_blocks))
    assert set(exported) == set(keys)
    assert all(torch.equal(exported[k], b) for k, b in zip(keys, blocks))
    assert await tier.clear() == 5
    assert await tier.contains(keys) == 0
    assert list(tier.export_sync(2)) == []


async def test_counters_add_up_from_several_threads(tier):
    import threading

    before = tier.stats().failures
    threads = [threading.Thread(target=lambda: [tier.count(failures=1) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.stats().failures == before + 4000


def test_reading_no_blocks_gives_an_empty_batch(tmp_path, request):
    """The hot pool and the warm slab read by id or slot (block ops): a read of none is an empty batch of their
    block shape, not an error (an op over no ids runs nowhere)."""
    hot, warm = make_tier("hot", tmp_path, request), make_tier("warm", tmp_path, request)
    assert tuple(hot.gather([]).shape) == (0, *SHAPE) and tuple(warm.read([]).shape) == (0, *SHAPE)
