"""Cache snapshots: cached blocks with their hashes, token ids and the model fingerprint in one portable
file, written and read with aiofiles so the event loop never blocks on the disk; the blocks themselves
are gathered and stored on the engine's worker, a batch at a time, between steps.

Layout: b"TKVSNAP1" || u32 n || msgpack header {v, fp, dtype, shape} || entries || trailer, where each
entry is u32 n || msgpack {h: block hash, t: token ids, d: blake2b-128 of the payload} || payload, and the
trailer is u32 0 || u64 entry count. Every entry is checked on import: a corrupt one is skipped, a
truncated file imports the entries before the cut, and nothing wrong is ever stored. Import only
snapshots you trust: the checksums catch damage, not a forged file.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Iterator

import aiofiles
import msgpack
import torch

from tieredkv.errors import SnapshotError
from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import BlockKey

MAGIC = b"TKVSNAP1"
VERSION = 1
MAX_HEADER_BYTES = 1 << 20  # a header names a fingerprint, a dtype and a shape: far less
BATCH = 64
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def blocks_to_export(core, prompts: list[list[int]] | None) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
    """Batches of (keys, blocks on the host): every block this engine's tiers cache (the shared remote
    tier's are the fleet's, not copied), or the full blocks of `prompts` from any tier; each block once,
    from the highest tier that has it. Advance it on the engine's worker only."""
    seen: set[bytes] = set()
    tiers = [core.tiers.hot, *(t for t in core.tiers.lower if not t.shared)]  # this engine's own cache
    if prompts is None:
        for tier in tiers:
            for keys, data in tier.export_sync(BATCH):
                keep = [i for i, k in enumerate(keys) if k.block_hash not in seen]
                seen.update(keys[i].block_hash for i in keep)
                if keep:
                    yield [keys[i] for i in keep], data[keep]
        return
    wanted = [k for p in prompts for k in core.index.keys(p)]
    for start in range(0, len(wanted), BATCH):
        keys, rows = [], []
        for key in wanted[start : start + BATCH]:
            if key.block_hash in seen:
                continue
            data = core.index.read(key)
            if data is not None:
                seen.add(key.block_hash)
                keys.append(key)
                rows.append(data)
        if keys:
            yield keys, torch.stack(rows)


async def write_snapshot(path, fingerprint: str, dtype: torch.dtype, shape: tuple, next_batch, progress=None) -> int:
    """Writes batches from `await next_batch()` (None at the end); returns the number of blocks."""
    count = 0
    async with aiofiles.open(path, "wb") as f:
        header = msgpack.packb({"v": VERSION, "fp": fingerprint, "dtype": str(dtype), "shape": list(shape)})
        await f.write(MAGIC + _U32.pack(len(header)) + header)
        while (batch := await next_batch()) is not None:
            keys, data = batch
            parts = []
            for key, block in zip(keys, data):
                payload = block.contiguous().view(torch.uint8).numpy().tobytes()
                meta = msgpack.packb({"h": key.block_hash, "t": list(key.token_ids), "d": _digest(payload)})
                parts += [_U32.pack(len(meta)), meta, payload]
            await f.write(b"".join(parts))
            count += len(keys)
            if progress is not None:
                progress(len(keys))
        await f.write(_U32.pack(0) + _U64.pack(count))
    return count


def read_snapshot(path, fingerprint: str, dtype: torch.dtype, shape: tuple):
    """(async iterator of (keys, blocks) batches of the entries that check out, report): iterating raises
    SnapshotError for another model's snapshot or a damaged header; `report` counts corrupt entries and
    says whether the file's end was found (False: truncated)."""
    payload_bytes = torch.Size(shape).numel() * dtype.itemsize
    report = {"corrupt": 0, "complete": False}

    async def batches():
        async with aiofiles.open(path, "rb") as f:
            await _check_header(f, path, fingerprint, dtype, shape)
            keys, rows = [], []
            while True:
                entry = await _read_entry(f, payload_bytes, report)
                if entry is None:
                    break
                if not entry[2]:
                    report["corrupt"] += 1
                    continue
                keys.append(entry[0])
                rows.append(torch.frombuffer(bytearray(entry[1]), dtype=dtype).view(shape))
                if len(keys) == BATCH:
                    yield keys, torch.stack(rows)
                    keys, rows = [], []
            if keys:
                yield keys, torch.stack(rows)

    return batches(), report


async def _check_header(f, path, fingerprint: str, dtype: torch.dtype, shape: tuple) -> None:
    """Reads the magic and the header; SnapshotError unless they are whole and name this engine's blocks."""
    if await f.read(len(MAGIC)) != MAGIC:
        raise SnapshotError(f"{path} is not a tieredkv cache snapshot")
    raw = await f.read(4)
    n = _U32.unpack(raw)[0] if len(raw) == 4 else 0
    body = await f.read(n) if 0 < n <= MAX_HEADER_BYTES else b""
    try:
        header = msgpack.unpackb(body) if len(body) == n and body else None
    except Exception:  # msgpack raises several kinds for damaged bytes
        header = None
    if not isinstance(header, dict):
        raise SnapshotError(f"{path}: the snapshot header is damaged (length {n}, {len(body)} bytes read)")
    stored_shape = header.get("shape")
    if header.get("fp") != fingerprint or header.get("dtype") != str(dtype) or \
            not isinstance(stored_shape, list) or tuple(stored_shape) != tuple(shape):
        raise SnapshotError(f"{path} holds blocks of another model, dtype, block size or layout "
                            f"({header.get('fp')!r}, {header.get('dtype')}); this engine is {fingerprint!r}")


async def _read_entry(f, payload_bytes: int, report: dict) -> tuple[BlockKey, bytes, bool] | None:
    """The next entry (key, payload, whether its digest checks out), or None at the end: the end marker
    (report["complete"] then says whether the trailer is whole), a truncation, or damaged framing, after
    which nothing can be trusted."""
    raw = await f.read(4)
    if len(raw) < 4:
        return None
    (n,) = _U32.unpack(raw)
    if n == 0:
        report["complete"] = len(await f.read(8)) == 8
        return None
    try:
        meta = msgpack.unpackb(await f.read(n))
        payload = await f.read(payload_bytes)
        ok = len(payload) == payload_bytes and _digest(payload) == meta["d"]
        return BlockKey(BlockHash(bytes(meta["h"])), tuple(int(t) for t in meta["t"])), payload, ok
    except Exception:
        return None
