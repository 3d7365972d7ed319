"""Fault injection on the cold tier: damaged, truncated, zeroed, poisoned or shared stores, a full
disk budget, a failing writer. Never a crash, never a wrong block; a damaged store is moved aside."""

import os
import random
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cold_writer
from cold_writer import FINGERPRINT, SHAPE, block, in_child, key, open_tier, start_writer
from helpers import ROOT
from tieredkv.tiers.cold import ColdTier, ColdTierError
from tieredkv.tiers.lmdb_check import meta_problem

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(Path(__file__).parent)])}


def filled(path, n=200):
    tier = open_tier(path)
    for start in range(0, n, 50):
        ids = range(start, min(start + 50, n))
        tier.put_sync([key(i) for i in ids], torch.stack([block(i) for i in ids]))
    tier.close_sync()
    return path / "data.mdb"


def read_back(path, n=200) -> int:
    """Opens a damaged store in a child and reads every block back: the child must exit 0 (no SIGBUS);
    returns how many blocks came back intact (a wrong block fails it)."""
    code, good = in_child(cold_writer.read_back, str(path), n)
    assert code == 0, code
    return good


@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.3, 0.7, 0.99])
def test_a_truncated_store_is_moved_aside_not_mapped(tmp_path, fraction):
    data = filled(tmp_path)
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(int(size * fraction))
    if fraction:
        assert meta_problem(data) is not None
    assert read_back(tmp_path) == 0  # served as misses from a fresh store; the process lives
    assert any(p.name.startswith("corrupt-") for p in tmp_path.iterdir()) or fraction == 0.0


def test_a_zeroed_store_is_moved_aside(tmp_path):
    data = filled(tmp_path)
    data.write_bytes(bytes(data.stat().st_size))
    assert read_back(tmp_path) == 0
    assert any(p.name.startswith("corrupt-") for p in tmp_path.iterdir())


@pytest.mark.parametrize("seed", range(6))
def test_byte_flips_anywhere_never_crash_or_serve_a_wrong_block(tmp_path, seed):
    data = filled(tmp_path)
    raw = bytearray(data.read_bytes())
    rng = random.Random(seed)
    page = 4096
    for _ in range(20):  # page headers, B-tree pages and payloads alike
        at = rng.randrange(len(raw)) if seed % 2 else rng.randrange(len(raw) // page) * page + rng.randrange(16)
        raw[at] ^= 1 << rng.randrange(8)
    data.write_bytes(bytes(raw))
    assert 0 <= read_back(tmp_path) <= 200


def test_a_rewritten_entry_with_a_fresh_checksum_is_refused(tmp_path):
    tier = open_tier(tmp_path)
    tier.put_sync([key(1)], block(1)[None])
    k = tier._key(key(1))
    with tier.env.begin(write=True, db=tier.db_blocks) as txn:
        value = bytearray(txn.get(k))
        value[-4:] = torch.tensor([123.0]).view(torch.uint8).numpy().tobytes()  # a poisoned value
        txn.put(k, bytes(value))
    assert tier.get_sync([key(1)]) is None  # the attacker has no key for the MAC
    assert tier.stats().failures == 1
    tier.flush_sync()
    assert tier.contains_sync([key(1)]) == 0  # and the entry is gone
    tier.close_sync()


def test_entries_written_under_another_key_are_misses(tmp_path):
    """The start-up check names the key a store was written under; should that record be rewritten too,
    every entry still fails its MAC under the other key: a counted miss, never a block."""
    from tieredkv.tiers.cold_format import key_fingerprint, load_secret

    tier = open_tier(tmp_path)
    tier.put_sync([key(1)], block(1)[None])
    with tier.env.begin(write=True, db=tier.db_meta) as txn:
        txn.put(b"key", key_fingerprint(load_secret(tmp_path.parent / "other.key")))
    tier.close_sync()
    other = ColdTier(tmp_path, 1 << 30, FINGERPRINT, SHAPE, torch.float32, secret_path=tmp_path.parent / "other.key")
    assert other.get_sync([key(1)]) is None and other.stats().failures == 1
    other.close_sync()


def test_an_oversized_payload_is_set_aside(tmp_path):
    tier = open_tier(tmp_path)
    tier.put_sync([key(2)], block(2)[None])
    k = tier._key(key(2))
    with tier.env.begin(write=True, db=tier.db_blocks) as txn:
        txn.put(k, bytes(txn.get(k)) + bytes(4096))
    assert tier.get_sync([key(2)]) is None
    tier.flush_sync()
    assert tier.contains_sync([key(2)]) == 0
    tier.close_sync()


def test_the_folder_and_the_key_are_owner_only(tmp_path):
    tier = open_tier(tmp_path / "cold")
    assert stat.S_IMODE((tmp_path / "cold").stat().st_mode) == 0o700
    from tieredkv.tiers.cold_format import default_secret_path

    assert stat.S_IMODE(default_secret_path().stat().st_mode) == 0o600
    tier.close_sync()


def test_a_folder_that_cannot_be_written_is_a_clear_error(tmp_path):
    for folder in (Path("/proc/self/tieredkv-cold"), tmp_path / "a-file"):  # read-only even for root; not a folder
        if folder.parent == tmp_path:
            folder.write_bytes(b"")
        with pytest.raises(ColdTierError, match="cannot open the cold tier"):
            open_tier(folder)


def test_a_map_grown_by_another_process_is_adopted(tmp_path):
    tier = open_tier(tmp_path)
    tier.put_sync([key(1)], block(1)[None])
    grow = ("import sys, lmdb; e = lmdb.open(sys.argv[1], max_dbs=4); e.set_mapsize(e.info()['map_size'] * 8);"
            "t = e.begin(write=True); t.put(b'x', b'y'); t.commit(); e.close()")
    subprocess.run([sys.executable, "-c", grow, str(tmp_path)], check=True, env=ENV)
    big = torch.stack([block(i) for i in range(2000, 2400)])  # needs the bigger map: adopt it
    assert tier.put_sync([key(i) for i in range(2000, 2400)], big) == 400
    assert torch.equal(tier.get_sync([key(1)])[0], block(1))
    assert tier._writer.is_alive()
    tier.clear_sync()
    tier.close_sync()


def test_a_failing_write_batch_never_kills_the_writer(tmp_path, monkeypatch):
    tier = open_tier(tmp_path)

    def broken(txn, items):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(tier, "_txn_put", broken)
    assert tier.put_sync([key(1)], block(1)[None]) == 0
    assert tier.stats().failures == 1 and tier._writer.is_alive()
    monkeypatch.undo()
    assert tier.put_sync([key(1)], block(1)[None]) == 1
    tier.close_sync()


def test_nobody_waits_on_a_stopped_writer(tmp_path):
    tier = open_tier(tmp_path)
    tier._queue.put(None)
    tier._writer.join(10)
    with pytest.raises(ColdTierError, match="stopped"):
        tier.flush_sync()
    with pytest.raises(ColdTierError):
        tier.clear_sync()
    tier.close_sync()


def test_a_one_megabyte_budget_bounds_the_file(tmp_path):
    budget = 1 << 20
    tier = open_tier(tmp_path, budget=budget)
    for start in range(0, 3000, 300):
        ids = range(start, start + 300)
        tier.put_sync([key(i) for i in ids], torch.stack([block(i) for i in ids]))
    assert tier.stats().used_bytes <= budget
    assert (tmp_path / "data.mdb").stat().st_size <= tier.map_limit
    assert torch.equal(tier.get_sync([key(2999)])[0], block(2999))
    tier.close_sync()


def test_the_file_stays_near_the_budget_under_churn(tmp_path):
    probe = open_tier(tmp_path / "probe")
    entry = probe.cost(len(probe._encode(key(0), block(0))))
    probe.close_sync()
    budget = 400 * entry
    tier = open_tier(tmp_path / "churn", budget=budget)
    for start in range(0, 20 * 400, 256):  # 20x the budget, in batches of 256
        ids = range(start, start + 256)
        tier.admit([key(i) for i in ids], torch.stack([block(i) for i in ids]))
    tier.flush_sync()
    size = (tmp_path / "churn" / "data.mdb").stat().st_size
    assert tier.stats().used_bytes <= budget
    assert size <= tier.map_limit, (size, budget)
    tier.close_sync()


def test_sigkill_at_random_moments_never_leaves_a_wrong_block(tmp_path):
    rng = random.Random(7)
    for trial in range(20):
        writer = start_writer(tmp_path, trial * 10_000, -1)
        assert writer.next_batch() == 0  # it has started writing
        for _ in range(rng.randrange(0, 4)):
            writer.next_batch()
        writer.kill()
    tier = open_tier(tmp_path)
    present = 0
    for trial in range(20):
        for i in range(trial * 10_000, trial * 10_000 + 400):
            got = tier.get_sync([key(i)])
            if got is not None:
                assert torch.equal(got[0], block(i))
                present += 1
    assert present >= 20 * 50 and tier.stats().failures == 0
    tier.close_sync()


def test_one_put_larger_than_the_maps_margin_is_written_in_parts(tmp_path, monkeypatch):
    """A full store (used bytes at the budget) and one put of more blocks than the map's margin over the
    budget: LMDB reuses the pages that evictions free only after their transaction commits, so the put goes
    in several transactions instead of being dropped as "full at its size limit"."""
    from tieredkv.tiers import cold

    monkeypatch.setattr(cold, "_MIN_MAP", 1 << 20)  # the margin a budget of 8 MiB gets: 2 MiB
    shape = (2, 2, 16, 4, 64)  # 64 KiB a block
    tier = ColdTier(tmp_path, 8 << 20, FINGERPRINT, shape, torch.float32)

    def blocks(ids):
        return torch.stack([torch.full(shape, float(i)) for i in ids])

    for start in range(0, 160, 16):
        ids = range(start, start + 16)
        assert tier.put_sync([key(i) for i in ids], blocks(ids)) == 16
    assert tier.stats().used_bytes > (8 << 20) - 2 * tier.cost(64 << 10)
    ids = range(1000, 1064)  # 4 MiB in one operation
    assert tier.put_sync([key(i) for i in ids], blocks(ids)) == 64
    assert tier.stats().failures == 0 and tier.stats().used_bytes <= 8 << 20
    assert torch.equal(tier.get_sync([key(1063)])[0], blocks([1063])[0])
    assert (tmp_path / "data.mdb").stat().st_size <= tier.map_limit
    tier.close_sync()
