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
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator, Sequence

import lmdb
import torch

from tieredkv.tiers.base import NO_VICTIMS, BlockKey, KVTier, Victims
from tieredkv.tiers.cold_format import ColdFormat
from tieredkv.tiers.cold_txn import ColdTxnOps
from tieredkv.tiers.lmdb_env import close_env, open_env

log = logging.getLogger("tieredkv")

_MAX_BATCH = 256


class ColdTier(ColdFormat, ColdTxnOps, KVTier):
    """LMDB store with a byte budget and LRU eviction recorded in the database."""

    name = "cold"
    blocking = True
    durable = True

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
        super().__init__(budget_bytes)
        self._used = 0  # payload bytes stored, as of the writer's last transaction
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="tieredkv-lmdb-writer", daemon=True)
        self._writer.start()
        self._refresh_used()

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
            self.count(failures=1)
        if not found:
            return None
        self._queue.put(("touch", [self._key(k) for k in keys[:found]], None))
        return torch.frombuffer(data, dtype=self.dtype).view(found, *self.block_shape)

    # -- writes (through the writer thread) --------------------------------------------------------

    def admit(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> tuple[int, Victims]:
        """Queues the blocks for the writer thread (which encodes them) and returns at once; what the
        byte budget evicts is dropped (nothing lies below cold)."""
        self._queue.put(("put_blocks", (list(keys), blocks), None))
        return len(keys), NO_VICTIMS

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        done: Future = Future()
        self._queue.put(("put", [(self._key(k), self._encode(k, b)) for k, b in zip(keys, blocks)], done))
        return done.result()

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        done: Future = Future()
        self._queue.put(("remove", [self._key(k) for k in keys], done))
        return done.result()

    def clear_sync(self) -> int:
        """Drops every entry of this model's fingerprint."""
        done: Future = Future()
        self._queue.put(("clear", None, done))
        return done.result()

    def export_sync(self, batch: int) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
        """Every usable entry of this fingerprint, read in short transactions of up to `batch` entries."""
        after, more = self.prefix, True
        while more:
            keys, data, more = [], bytearray(), False
            with self.env.begin(db=self.db_blocks, buffers=True) as txn:
                cur = txn.cursor()
                found = cur.set_range(after)
                while found and bytes(cur.key()[:8]) == self.prefix:
                    if len(keys) == batch:
                        more = True
                        break
                    raw, value = bytes(cur.key()), cur.value()
                    after = raw + b"\0"
                    try:
                        key = BlockKey(raw[8:], tuple(self._header(None, value)[0]["tokens"]))
                    except Exception:  # unreadable: _payload below would count it; skip it here
                        key = None
                    payload = None if key is None else self._payload(key, value)
                    if payload is not None:
                        keys.append(key)
                        data += payload  # copied out before the read transaction ends
                    found = cur.next()
            if keys:
                yield keys, torch.frombuffer(data, dtype=self.dtype).view(len(keys), *self.block_shape)

    def flush_sync(self) -> None:
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
                self.count(failures=1)
                results = [0] * len(batch)
                break
        else:
            results = [0] * len(batch)
        self._refresh_used()
        for (_, _, done), result in zip(batch, results):
            if done is not None:
                done.set_result(result)

    def _used_bytes(self) -> int:
        return self._used
