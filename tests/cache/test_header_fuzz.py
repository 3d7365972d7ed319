"""Fuzzing the two on-disk formats a process reads from others: a snapshot file and a cold-tier entry.
Whatever the bytes, reading raises only the project's own error (SnapshotError) or counts a miss, and
never returns a block that was not written as it is."""

import asyncio
import struct

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cold_writer import FINGERPRINT, SHAPE, block, key, open_tier
from tieredkv.engine.snapshot import MAGIC, read_snapshot
from tieredkv.errors import SnapshotError

msgpack_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=8)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["fp", "dtype", "shape", "h", "t", "d", "v", "tokens", "x"]), inner, max_size=4),
    max_leaves=10)


def framed(value) -> bytes:
    raw = msgpack.packb(value)
    return struct.pack("<I", len(raw)) + raw


snapshot_bodies = st.one_of(
    st.binary(max_size=200),  # anything at all after the magic
    st.builds(lambda v, tail: framed(v) + tail, msgpack_values, st.binary(max_size=64)),  # a header of any shape
    st.builds(lambda lengths, tail: b"".join(struct.pack("<I", n) for n in lengths) + tail,
              st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=3), st.binary(max_size=32)),  # wild lengths
    st.builds(lambda v, e, tail: framed({"fp": "f", "dtype": "torch.float32", "shape": [2, 2]}) + framed(e) + tail,
              st.none(), msgpack_values, st.binary(max_size=40)),  # a good header, then entries of any shape
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=snapshot_bodies)
def test_any_snapshot_bytes_raise_only_snapshot_error(tmp_path, body):
    path = tmp_path / "fuzz.tkv"
    path.write_bytes(MAGIC + body)

    async def read():
        batches, report = read_snapshot(path, "f", torch.float32, (2, 2))
        blocks = [b async for _, b in batches]
        return blocks, report

    try:
        blocks, report = asyncio.run(read())
    except SnapshotError:
        return
    assert blocks == [] or all(b.shape[1:] == (2, 2) for b in blocks)
    assert set(report) == {"corrupt", "complete"}


@pytest.fixture(scope="module")
def tier(tmp_path_factory):
    tier = open_tier(tmp_path_factory.mktemp("cold-fuzz"))
    tier.put_sync([key(1)], block(1)[None])
    yield tier
    tier.close_sync()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prefix=st.binary(max_size=12), header=st.one_of(msgpack_values, st.fixed_dictionaries(
    {"v": st.just(2), "fp": st.just(FINGERPRINT), "dtype": st.just("float32"), "shape": st.just(list(SHAPE))},
    optional={"tokens": msgpack_values})), tail=st.binary(max_size=64), cut=st.integers(0, 400))
def test_any_cold_entry_bytes_are_a_counted_miss(tier, prefix, header, tail, cut):
    """An entry of any bytes under a block's key: contains, get and export never raise and never return
    it; the good entry beside it still reads back exactly."""
    raw = msgpack.packb(header)
    value = (b"TKV2" + struct.pack("<I", len(raw)) + raw + tail)[:cut] if prefix == b"" else prefix + raw + tail
    tier.flush_sync()  # the last example's bad entry has been set aside: its key is free
    with tier.env.begin(write=True, db=tier.db_blocks) as txn:
        txn.put(tier._key(key(2)), value or b"\0")
    failures = tier.stats().failures
    assert tier.contains_sync([key(2)]) == 0
    assert tier.get_sync([key(2)]) is None and tier.stats().failures == failures + 1
    assert all(key(2) not in keys for keys, _ in tier.export_sync(16))
    got = tier.get_sync([key(1)])
    assert got is not None and torch.equal(got[0], block(1))
