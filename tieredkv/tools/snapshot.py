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
from tieredkv.tiers.base import BlockKey

MAGIC = b"TKVSNAP1"
VERSION = 1
BATCH = 64
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def blocks_to_export(core, prompts: list[list[int]] | None) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
    """Batches of (keys, blocks on the host): every cached block, or the full blocks of `prompts`; each
    block once, from the highest tier that has it. Advance it on the engine's worker only."""
    seen: set[bytes] = set()
    tiers = [core.tiers.hot, *core.tiers.lower]
    if prompts is None:
        for tier in tiers:
            for keys, data in tier.export_sync(BATCH):
                keep = [i for i, k in enumerate(keys) if k.block_hash not in seen]
                seen.update(keys[i].block_hash for i in keep)
                if keep:
                    yield [keys[i] for i in keep], data[keep]
        return
    wanted = [k for p in prompts for k in core.kv.chain_keys(p)]
    for start in range(0, len(wanted), BATCH):
        keys, rows = [], []
        for key in wanted[start : start + BATCH]:
            if key.block_hash in seen:
                continue
            block = core.pool.get_cached(key.block_hash, key.token_ids)
            data = core.tiers.hot.gather([block.block_id]).cpu() if block is not None else None
            for tier in core.tiers.lower if data is None else ():
                data = tier.get_sync([key])
                if data is not None:
                    break
            if data is not None:
                seen.add(key.block_hash)
                keys.append(key)
                rows.append(data[0])
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
    SnapshotError for another model's snapshot; `report` counts corrupt entries and says whether the
    file's end was found (False: truncated)."""
    payload_bytes = torch.Size(shape).numel() * dtype.itemsize
    report = {"corrupt": 0, "complete": False}

    async def batches():
        async with aiofiles.open(path, "rb") as f:
            if await f.read(len(MAGIC)) != MAGIC:
                raise SnapshotError(f"{path} is not a tieredkv cache snapshot")
            (n,) = _U32.unpack(await f.read(4))
            header = msgpack.unpackb(await f.read(n))
            if header.get("fp") != fingerprint or header.get("dtype") != str(dtype) or \
                    tuple(header.get("shape", ())) != tuple(shape):
                raise SnapshotError(f"{path} holds blocks of another model, dtype, block size or layout "
                                    f"({header.get('fp')!r}, {header.get('dtype')}); this engine is {fingerprint!r}")
            keys, rows = [], []
            while True:
                raw = await f.read(4)
                if len(raw) < 4:
                    break  # truncated
                (n,) = _U32.unpack(raw)
                if n == 0:
                    report["complete"] = len(await f.read(8)) == 8
                    break
                try:
                    meta = msgpack.unpackb(await f.read(n))
                    payload = await f.read(payload_bytes)
                    ok = len(payload) == payload_bytes and _digest(payload) == meta["d"]
                    key = BlockKey(bytes(meta["h"]), tuple(int(t) for t in meta["t"]))
                except Exception:
                    break  # the framing itself is damaged: nothing after it can be trusted
                if not ok:
                    report["corrupt"] += 1
                    continue
                keys.append(key)
                rows.append(torch.frombuffer(bytearray(payload), dtype=dtype).view(shape))
                if len(keys) == BATCH:
                    yield keys, torch.stack(rows)
                    keys, rows = [], []
            if keys:
                yield keys, torch.stack(rows)

    return batches(), report
