"""Cold tier: KV blocks in LMDB on disk, surviving restarts, shared safely between processes.

Layout (one LMDB environment, four named databases):
  blocks: key -> value, where key = fingerprint digest (8 bytes) || block hash (32 bytes) and
          value = b"TKV1" || u32 header length || msgpack header || raw payload bytes;
          the header holds format version, model fingerprint, dtype, shape, token ids and a crc32
          of the payload. Any mismatch is a miss plus a failure count, never an exception.
  lru:    key -> u64 access sequence number;  order: u64 sequence || key -> b"" (oldest first)
  meta:   b"used_bytes", b"seq" -> u64
All writes go through one writer thread that batches queued operations into one write transaction
and doubles the map size on MapFullError. Reads use short read transactions and copy the payload
out before the transaction ends. The disk budget is enforced inside each write transaction by
evicting the oldest entries, so it holds across processes (LMDB serialises their writers).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import struct
import threading
import zlib
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

import lmdb
import msgpack
import torch

from tieredkv.tiers.base import BlockKey, KVTier, TierStats
from tieredkv.tiers.cold_txn import ColdTxnOps
from tieredkv.tiers.lmdb_env import close_env, open_env

log = logging.getLogger("tieredkv")

FORMAT_VERSION = 1
_MAGIC = b"TKV1"
_U32 = struct.Struct("<I")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MAX_BATCH = 256

class ColdTier(ColdTxnOps, KVTier):
    """LMDB store with a byte budget and LRU eviction recorded in the database."""

    name = "cold"
    blocking = True

    def __init__(self, path: str | Path, budget_bytes: int, fingerprint: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype):
        self.path = Path(path)
        self.budget = budget_bytes
        self.fingerprint = fingerprint
        self.prefix = hashlib.sha256(fingerprint.encode()).digest()[:8]
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.dtype_name = str(dtype).removeprefix("torch.")
        self.env = open_env(self.path, map_size=max(64 << 20, min(budget_bytes * 2, 1 << 40)))
        self.db_blocks = self.env.open_db(b"blocks")
        self.db_lru = self.env.open_db(b"lru")
        self.db_order = self.env.open_db(b"order")
        self.db_meta = self.env.open_db(b"meta")
        self.counters = TierStats("cold", budget_bytes)
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="tieredkv-lmdb-writer", daemon=True)
        self._writer.start()
        self._refresh_used()

    @staticmethod
    def entry_size(block_shape: tuple[int, ...], dtype: torch.dtype, fingerprint: str, num_tokens: int) -> int:
        """Bytes one entry takes against the budget (small token ids; larger ids add a few bytes)."""
        header = msgpack.packb({"v": FORMAT_VERSION, "fp": fingerprint, "dtype": str(dtype).removeprefix("torch."),
                                "shape": list(block_shape), "tokens": [0] * num_tokens, "crc": 2**32 - 1})
        payload = torch.empty(block_shape, dtype=dtype).numel() * dtype.itemsize
        return len(_MAGIC) + _U32.size + len(header) + payload

    # -- keys and values ---------------------------------------------------------------------------

    def _key(self, key: BlockKey) -> bytes:
        return self.prefix + key.block_hash

    def _encode(self, key: BlockKey, block: torch.Tensor) -> bytes:
        payload = block.to(self.dtype).contiguous().view(torch.uint8).numpy().tobytes()
        header = msgpack.packb({
            "v": FORMAT_VERSION, "fp": self.fingerprint, "dtype": self.dtype_name, "shape": list(self.block_shape),
            "tokens": list(key.token_ids), "crc": zlib.crc32(payload),
        })
        return _MAGIC + _U32.pack(len(header)) + header + payload

    def _header(self, key: BlockKey, value: memoryview) -> tuple[dict, int]:
        """The entry's header and where its payload starts; raises ValueError on any mismatch."""
        if bytes(value[:4]) != _MAGIC:
            raise ValueError("bad magic")
        (hlen,) = _U32.unpack(value[4:8])
        header = msgpack.unpackb(bytes(value[8 : 8 + hlen]))
        if (header["v"] != FORMAT_VERSION or header["fp"] != self.fingerprint
                or header["dtype"] != self.dtype_name or tuple(header["shape"]) != self.block_shape
                or tuple(header["tokens"]) != key.token_ids):
            raise ValueError("header mismatch")
        return header, 8 + hlen

    def _payload(self, key: BlockKey, value: memoryview) -> memoryview | None:
        """The entry's checked payload, or None (counted as a failure) when anything does not match."""
        try:
            header, start = self._header(key, value)
            payload = value[start:]
            if zlib.crc32(payload) != header["crc"]:
                raise ValueError("checksum mismatch")
        except Exception as e:  # any corrupt entry is a miss
            log.warning("cold tier: unusable entry %s: %s", key.block_hash.hex()[:12], e)
            self.counters.failures += 1
            self._queue.put(("remove", [self._key(key)], None))
            return None
        return payload

    # -- reads (any thread) ------------------------------------------------------------------------

    def contains_sync(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        with self.env.begin(db=self.db_blocks, buffers=True) as txn:
            for key in keys:
                value = txn.get(self._key(key))
                if value is None:
                    break
                try:
                    self._header(key, value)
                except Exception:  # the payload's checksum is verified on get
                    break
                n += 1
        return n

    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        """The blocks of the longest present prefix of keys, [n, *block_shape], or None.

        Runs in the tier manager's reader thread, so the blocks are assembled with plain memory
        copies: a torch copy of this size would start an OpenMP pool in this thread as well, which
        slows every engine step on CPU (see AsyncEngine)."""
        data, found = bytearray(), 0
        try:
            with self.env.begin(db=self.db_blocks, buffers=True) as txn:
                for key in keys:
                    value = txn.get(self._key(key))
                    payload = None if value is None else self._payload(key, value)
                    if payload is None:
                        break
                    data += payload  # copied out before the read transaction ends
                    found += 1
        except lmdb.Error as e:
            log.warning("cold tier read failed: %s", e)
            self.counters.failures += 1
        if not found:
            return None
        self._queue.put(("touch", [self._key(k) for k in keys[:found]], None))
        return torch.frombuffer(data, dtype=self.dtype).view(found, *self.block_shape)

    # -- writes (through the writer thread) --------------------------------------------------------

    def put_nowait(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> None:
        """Queues the blocks for writing and returns at once (the demotion path). `blocks` must not
        change afterwards: the writer thread encodes them."""
        self._queue.put(("put_blocks", (list(keys), blocks), None))

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        done: Future = Future()
        self._queue.put(("put", [(self._key(k), self._encode(k, b)) for k, b in zip(keys, blocks)], done))
        return done.result()

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        done: Future = Future()
        self._queue.put(("remove", [self._key(k) for k in keys], done))
        return done.result()

    def clear(self) -> int:
        """Drops every entry of this model's fingerprint."""
        done: Future = Future()
        self._queue.put(("clear", None, done))
        return done.result()

    def flush(self) -> None:
        """Waits until everything queued so far is written."""
        done: Future = Future()
        self._queue.put(("noop", None, done))
        done.result()

    def close_sync(self) -> None:
        if self._closed:
            return
        self._queue.put(None)
        self._writer.join()
        self._closed = True
        close_env(self.env)

    def _write_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            batch = [op]
            while len(batch) < _MAX_BATCH:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)
                    break
                batch.append(nxt)
            self._apply(batch)

    def _apply(self, batch: list) -> None:
        batch = [  # encode (copy + checksum) outside the write transaction
            ("put", [(self._key(k), self._encode(k, b)) for k, b in zip(*payload)], done)
            if kind == "put_blocks" else (kind, payload, done)
            for kind, payload, done in batch
        ]
        for attempt in range(8):
            try:
                results = []
                with self.env.begin(write=True) as txn:
                    for kind, payload, _ in batch:
                        results.append(getattr(self, f"_txn_{kind}")(txn, payload))
                break
            except lmdb.MapFullError:
                new_size = self.env.info()["map_size"] * 2
                log.info("cold tier: growing the LMDB map to %d bytes", new_size)
                self.env.set_mapsize(new_size)
            except lmdb.Error as e:
                log.warning("cold tier write failed: %s", e)
                self.counters.failures += 1
                results = [0] * len(batch)
                break
        else:
            results = [0] * len(batch)
        self._refresh_used()
        for (_, _, done), result in zip(batch, results):
            if done is not None:
                done.set_result(result)

    def stats(self) -> TierStats:
        return self.counters
