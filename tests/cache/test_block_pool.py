"""The block pool's free queue, reference counts, hash map and eviction order."""

import pytest

from tieredkv.hashing import BlockHash, encode_token_ids, hash_block, root_hash
from tieredkv.tiers.block_pool import BlockPool, FreeBlockQueue, KVBlock


def test_free_queue_o1_operations_keep_order():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_allocate_free_touch_and_eviction():
    pool = BlockPool(4)
    (a, b), evicted = pool.allocate(2)
    assert evicted == []
    assert (a.ref_cnt, b.ref_cnt, pool.num_free) == (1, 1, 2)
    h = hash_block(root_hash("m"), [1, 2])
    pool.cache(a, h, (1, 2))
    assert pool.get_cached(h, (1, 2)) is a
    assert pool.get_cached(h, (1, 3)) is None  # same hash, other tokens: a miss
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a, a, b])
    assert pool.num_free == 4 and a.ref_cnt == 0
    assert pool.get_cached(h, (1, 2)) is a  # freed but still cached
    pool.touch([a])  # revive from the middle of the free queue
    assert pool.num_free == 3
    pool.free([a])
    got, evicted = pool.allocate(4)  # a is last in LRU order, so it is evicted last
    assert got[-1] is a and evicted == [(a.block_id, h, (1, 2))] and not pool.cached
    with pytest.raises(MemoryError):
        pool.allocate(1)


def test_hash_chain_is_stable_and_position_dependent():
    root = root_hash("model|float32|bs=2")
    h1 = hash_block(root, [1, 2])
    assert h1 == hash_block(root, [1, 2]) and len(h1) == 32
    assert hash_block(h1, [3, 4]) != hash_block(root, [3, 4])
    assert hash_block(root_hash("other model"), [1, 2]) != h1
    assert encode_token_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert isinstance(h1, bytes) and BlockHash(h1) == h1


def test_hashes_do_not_depend_on_the_process(tmp_path):
    import subprocess
    import sys

    # hashing.py loaded by its path: it needs nothing of the package, so the interpreters start in a blink
    import tieredkv.hashing as hashing

    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('h', sys.argv[1]); "
            "h = importlib.util.module_from_spec(spec); spec.loader.exec_module(h); "
            "print(h.hash_block(h.root_hash('x'), [1,2,3]).hex())")
    outs = {subprocess.run([sys.executable, "-c", code, hashing.__file__], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2)}
    assert outs == {hash_block(root_hash("x"), [1, 2, 3]).hex() + "\n"}
