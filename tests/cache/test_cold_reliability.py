"""The cold tier survives SIGKILL mid-write, turns corruption into counted misses, and is shared
between processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cold_writer import block, key, open_tier, start_writer
from helpers import ROOT
from tieredkv.errors import ColdTierError

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}


def test_sigkill_during_writes_never_serves_a_corrupt_block(tmp_path):
    writer = start_writer(tmp_path, 0, -1)
    for _ in range(5):  # five batches committed, more in flight
        assert writer.next_batch() is not None
    writer.kill()
    tier = open_tier(tmp_path)
    present = 0
    for i in range(0, 50 * 200):
        got = tier.get_sync([key(i)])
        if got is None:
            continue
        assert torch.equal(got[0], block(i))
        present += 1
    assert present >= 250 and tier.stats().failures == 0
    # the tier keeps working after the crash
    assert tier.put_sync([key(10**6)], block(10**6)[None]) == 1
    assert torch.equal(tier.get_sync([key(10**6)])[0], block(10**6))
    tier.close_sync()


def test_corrupt_payload_is_a_counted_miss(tmp_path):
    tier = open_tier(tmp_path)
    tier.put_sync([key(1), key(2)], torch.stack([block(1), block(2)]))
    k = tier._key(key(2))
    with tier.env.begin(write=True, db=tier.db_blocks) as txn:
        value = bytearray(txn.get(k))
        value[-3] ^= 0xFF  # flip bits in the payload
        txn.put(k, bytes(value))
    got = tier.get_sync([key(1), key(2)])
    assert got.shape[0] == 1 and torch.equal(got[0], block(1))  # stops at the corrupt one
    assert tier.stats().failures == 1
    tier.flush_sync()
    assert tier.contains_sync([key(2)]) == 0  # the bad entry left the blocks ...
    with tier.env.begin(db=tier.db_aside) as txn:  # ... for the aside database, as it was
        assert [(bytes(k)[8:], bytes(v)) for k, v in txn.cursor()] == [(k, bytes(value))]
    assert tier.put_sync([key(2)], block(2)[None]) == 1  # and a good one takes its place
    assert torch.equal(tier.get_sync([key(2)])[0], block(2))
    tier.close_sync()


def test_a_store_written_under_another_key_is_refused_at_start_and_left_whole(tmp_path):
    """Two engines with different keys on one cold_path: the second is refused with both key fingerprints
    named, instead of failing (and once deleting) every entry of the first."""
    store, other_key = tmp_path / "store", tmp_path / "other.key"
    tier = open_tier(store)
    tier.put_sync([key(i) for i in range(20)], torch.stack([block(i) for i in range(20)]))
    tier.close_sync()
    with pytest.raises(ColdTierError, match="written under another key") as refused:
        open_tier(store, secret_path=other_key)
    assert str(other_key) in str(refused.value)
    tier = open_tier(store)  # the first key's entries are all there, none failed
    got = tier.get_sync([key(i) for i in range(20)])
    assert got.shape[0] == 20 and torch.equal(got[7], block(7)) and tier.stats().failures == 0
    tier.close_sync()


def test_two_processes_share_one_path(tmp_path):
    """Both may read and write: LMDB serialises the writers, entries are keyed by content, and the
    byte budget is kept inside each write transaction, so it holds for both together."""
    tier = open_tier(tmp_path)
    tier.put_sync([key(i) for i in range(100_000, 100_050)], torch.stack([block(i) for i in range(100_000, 100_050)]))
    other = start_writer(tmp_path, 0, 4)  # the other process writes 200 blocks while this one works
    mine = range(200_000, 200_200)
    for i in mine:
        tier.put_sync([key(i)], block(i)[None])
    assert other.wait(timeout=120) == 0
    for i in list(range(0, 200)) + list(mine) + list(range(100_000, 100_050)):
        got = tier.get_sync([key(i)])
        assert got is not None and torch.equal(got[0], block(i))
    # the other process reads what this one wrote
    check = subprocess.run([sys.executable, "-c", (
        "import sys, torch; from cold_writer import *; t = open_tier(sys.argv[1]);"
        "assert all(torch.equal(t.get_sync([key(i)])[0], block(i)) for i in range(200_000, 200_200));"
        "t.close_sync()"), str(tmp_path)], env=ENV, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    tier.close_sync()


def test_disk_budget_is_kept_and_the_map_grows(tmp_path):
    probe = open_tier(tmp_path / "probe")
    entry = len(probe._encode(key(0), block(0)))
    probe.close_sync()
    tier = open_tier(tmp_path / "small", budget=40 * entry)
    env_size = tier.env.info()["map_size"]
    for start in range(0, 2000, 100):
        ids = range(start, start + 100)
        tier.put_sync([key(i) for i in ids], torch.stack([block(i) for i in ids]))
    assert tier.stats().used_bytes <= 40 * entry
    assert tier.stats().evictions >= 2000 - 40
    assert tier.contains_sync([key(1999)]) == 1 and tier.contains_sync([key(0)]) == 0
    assert tier.env.info()["map_size"] >= env_size
    tier.close_sync()


def test_map_full_grows_the_map(tmp_path):
    tier = open_tier(tmp_path)
    tier.flush_sync()  # the writer registers the fingerprint at start: resizing needs no write under way
    tier.env.set_mapsize(1 << 20)  # far too small for what follows
    ids = range(0, 1000)
    assert tier.put_sync([key(i) for i in ids], torch.stack([block(i) for i in ids])) == 1000
    assert tier.env.info()["map_size"] > 1 << 20
    assert torch.equal(tier.get_sync([key(999)])[0], block(999))
    tier.close_sync()
