"""Cold tier: KV blocks in LMDB on disk, surviving restarts, shared safely between processes.

Layout (one LMDB environment, five named databases):
  blocks: key -> value, where key = fingerprint digest (8 bytes) || block hash (32 bytes) and the
          value is an authenticated entry (cold_format.py): any mismatch is a miss plus a failure
          count, never an exception and never a wrong block.
  lru:    key -> u64 access sequence number;  order: u64 sequence || key -> b"" (oldest first)
  meta:   b"used_bytes", b"seq" -> u64; b"key" -> the fingerprint of the key entries are written under
  aside:  u64 sequence || key -> an entry that failed its checks, kept for inspection (the last 256)
The store is checked before it is mapped (lmdb_check.py). All writes go through one writer thread that
batches queued operations into one write transaction; the disk budget counts whole LMDB pages and is
enforced inside each write transaction by evicting the oldest entries, so it holds across processes
(LMDB serialises their writers). The map, and so the file, never outgrows the budget by more than
a margin: a batch that does not fit is written in smaller transactions instead. Reads use short read
transactions and copy the payload out before the transaction ends. The writer never dies silently: a
failed batch counts failures, and a caller never waits on a writer that has stopped.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Iterator, Sequence

import lmdb
import torch

from tieredkv.errors import ColdTierError
from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import NO_VICTIMS, BlockKey, KVTier, Victims, next_batch
from tieredkv.tiers.cold_format import ColdFormat, default_secret_path, key_fingerprint
from tieredkv.tiers.cold_txn import ColdTxnOps, disk_cost
from tieredkv.tiers.lmdb_env import close_env, open_env

log = logging.getLogger("tieredkv")

_MAX_BATCH = 256
_MIN_MAP = 64 << 20
MAX_PENDING = 256 << 20  # bytes of queued block writes; beyond that new ones are dropped (counted as failures)

__all__ = ["ColdTier", "ColdTierError", "disk_cost"]


class ColdTier(ColdFormat, ColdTxnOps, KVTier):
    """LMDB store with a byte budget and LRU eviction recorded in the database."""

    name = "cold"
    medium = "DISK"  # (KV events)
    blocking = True
    durable = True

    def __init__(self, path: str | Path, budget_bytes: int, fingerprint: str, block_shape: tuple[int, ...],
                 dtype: torch.dtype, secret_path: str | Path | None = None):
        self.path = Path(path)
        self.budget = budget_bytes
        self._init_format(fingerprint, block_shape, dtype, secret_path)
        self.map_limit = budget_bytes + max(budget_bytes // 4, _MIN_MAP)  # the file never grows past this
        try:
            self.handle = open_env(self.path, map_size=min(max(_MIN_MAP, budget_bytes // 4), self.map_limit))
        except (lmdb.Error, OSError) as e:
            raise ColdTierError(f"cannot open the cold tier at {self.path}: {e}") from None
        self.env = self.handle.env
        self.page_size = self.env.stat()["psize"]
        self.db_blocks = self.env.open_db(b"blocks")
        self.db_lru = self.env.open_db(b"lru")
        self.db_order = self.env.open_db(b"order")
        self.db_meta = self.env.open_db(b"meta")
        self.db_aside = self.env.open_db(b"aside")
        try:
            self._check_key(secret_path)
        except ColdTierError:
            close_env(self.handle)
            raise
        super().__init__(budget_bytes)
        self._used = 0  # bytes (whole pages) stored, as of the writer's last transaction
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # bytes of blocks queued for the writer (bounded by MAX_PENDING)
        self._room = threading.Condition()  # guards _pending; the writer notifies as it takes bytes off
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="tieredkv-lmdb-writer", daemon=True)
        self._writer.start()
        self._queue.put(("register", fingerprint, None))
        self._refresh_used()

    def _check_key(self, secret_path) -> None:
        """Records the key's fingerprint in a new store; refuses a store written under another key, whose
        every entry would fail here (and be set aside, one by one) while the other engine goes on
        writing them."""
        mine = key_fingerprint(self.secret)
        with self.handle.transaction(write=True, db=self.db_meta) as txn:
            stored = txn.get(b"key")
            if stored is None:
                txn.put(b"key", mine)
        if stored is not None and bytes(stored) != mine:
            raise ColdTierError(
                f"the cold tier at {self.path} was written under another key (key fingerprint "
                f"{bytes(stored).decode(errors='replace')}; this engine's key, {secret_path or default_secret_path()}, "
                f"is {mine.decode()}). Engines sharing a cold_path must share cold_secret_path; give this one "
                "that key, or a cold_path of its own")

    def _set_aside(self, key: BlockKey) -> None:
        self._queue.put(("set_aside", [self._key(key)], None))

    def cost(self, value_bytes: int) -> int:
        return disk_cost(value_bytes, self.page_size)

    # -- reads (any thread) ------------------------------------------------------------------------

    def contains_sync(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        with self.handle.transaction(db=self.db_blocks, buffers=True) as txn:
            for key in keys:
                value = txn.get(self._key(key))
                if value is None:
                    break
                try:
                    self._header(key, value)
                except Exception:  # the payload is authenticated on get
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
            with self.handle.transaction(db=self.db_blocks, buffers=True) as txn:
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
        return self._blocks(data, found)

    def export_sync(self, batch: int) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
        """Every usable entry of this fingerprint, read in short transactions of up to `batch` entries."""
        after, more = self.prefix, True
        while more:
            keys: list[BlockKey] = []
            data, more = bytearray(), False
            with self.handle.transaction(db=self.db_blocks, buffers=True) as txn:
                cur = txn.cursor()
                found = cur.set_range(after)
                while found and bytes(cur.key()[:8]) == self.prefix:
                    if len(keys) == batch:
                        more = True
                        break
                    raw, value = bytes(cur.key()), cur.value()
                    after = raw + b"\0"
                    try:
                        key = BlockKey(BlockHash(raw[8:]), tuple(self._header(None, value)[0]["tokens"]))
                    except Exception:  # unreadable: _payload below would count it; skip it here
                        key = None
                    payload = None if key is None else self._payload(key, value)
                    if payload is not None:
                        keys.append(key)
                        data += payload  # copied out before the read transaction ends
                    found = cur.next()
            if keys:
                yield keys, self._blocks(data, len(keys))

    # -- writes (through the writer thread) --------------------------------------------------------

    def admit(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> tuple[int, Victims]:
        """Queues the blocks for the writer thread (which encodes them) and returns at once; what the
        byte budget evicts is dropped (nothing lies below cold). Blocks on disk already are only touched (their LRU
        position renewed), not encoded and written again. When more than MAX_PENDING bytes already wait
        (a disk slower than the demotions), the blocks are dropped and counted as a failure: the queue stays
        bounded."""
        return self._queue_blocks(keys, blocks, wait=False), NO_VICTIMS

    def persist_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        """As admit, but when MAX_PENDING bytes already wait it waits for the writer to make room (shutdown's
        write-back: a disk slower than the pool's export slows the close; nothing is dropped)."""
        return self._queue_blocks(keys, blocks, wait=True)

    def _queue_blocks(self, keys: Sequence[BlockKey], blocks: torch.Tensor, wait: bool) -> int:
        keys = list(keys)
        with self.handle.transaction(db=self.db_blocks, buffers=True) as txn:  # a block on disk already is not
            present = [txn.get(self._key(k)) is not None for k in keys]  # encoded and written again: touched
        if any(present):
            if self._writer.is_alive():
                self._queue.put(("touch", [self._key(k) for k, p in zip(keys, present) if p], None))
            new = [i for i, p in enumerate(present) if not p]
            if not new:
                return len(keys)
            blocks = blocks[torch.tensor(new)]
            keys = [keys[i] for i in new]
        size = blocks.numel() * blocks.element_size()
        with self._room:
            while wait and self._pending and self._pending + size > MAX_PENDING and self._writer.is_alive():
                self._room.wait(0.5)  # (a batch larger than the bound goes alone, once nothing else waits)
            queued = self._writer.is_alive() and (self._pending + size <= MAX_PENDING or wait)
            self._pending += size if queued else 0
        if not queued:
            if self._writer.is_alive():
                log.warning("cold tier: %d MiB of writes wait for the disk; %d blocks dropped", self._pending >> 20,
                            len(keys))
                self.count(failures=1)
            return 0
        self._queue.put(("put_blocks", (keys, blocks), None))
        self.report_stored(keys)  # (queued: reported as written, as a router needs no more precision)
        return len(keys) + sum(present)

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        stored = self._wait("put", [(self._key(k), self._encode(k, b)) for k, b in zip(keys, blocks)])
        self.report_stored(keys)
        return stored

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        return self._wait("remove", [self._key(k) for k in keys])

    def clear_sync(self) -> int:
        """Drops every entry of this model's fingerprint."""
        return self._wait("clear", None)

    def flush_sync(self) -> None:
        """Waits until everything queued so far is written."""
        self._wait("noop", None)

    def _wait(self, kind: str, payload) -> int:
        """Queues one operation and waits for its result, never for a writer that has stopped."""
        done: Future = Future()
        if self._writer.is_alive():
            self._queue.put((kind, payload, done))
        while True:
            try:
                return done.result(timeout=0.5)
            except TimeoutError:
                if not self._writer.is_alive() and not done.done():
                    raise ColdTierError("the cold tier's writer thread has stopped") from None

    def close_sync(self) -> None:
        if self._closed:
            return
        self._queue.put(None)
        self._writer.join()
        self._closed = True
        close_env(self.handle)

    def _write_loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            batch = next_batch(self._queue, op, _MAX_BATCH)
            try:
                results = self._apply(self._encoded(batch))
            except Exception:  # never die: count, answer every waiter, take the next batch
                log.exception("cold tier: a write batch failed")
                self.count(failures=1)
                results = [0] * len(batch)
            finally:
                done_bytes = sum(p[1].numel() * p[1].element_size() for kind, p, _ in batch if kind == "put_blocks")
                with self._room:
                    self._pending -= done_bytes
                    self._room.notify_all()
            for (_, _, done), result in zip(batch, results):
                if done is not None and not done.done():
                    done.set_result(result)

    def _encoded(self, batch: list) -> list:
        """Queued demotions encoded (copy + MAC) outside the write transaction."""
        return [("put", [(self._key(k), self._encode(k, b)) for k, b in zip(*payload)], done)
                if kind == "put_blocks" else (kind, payload, done) for kind, payload, done in batch]

    def _apply(self, batch: list) -> list[int]:
        """Runs the batch in one write transaction. When the map is full: grow it up to map_limit, then
        write the batch in halves, down to halves of one operation's entries (pages that a transaction's
        evictions free serve only the transactions after it commits)."""
        while True:
            try:
                with self.handle.transaction(write=True) as txn:
                    results = [getattr(self, f"_txn_{kind}")(txn, payload) for kind, payload, _ in batch]
                self._refresh_used()
                return results
            except lmdb.MapFullError:
                size = self.env.info()["map_size"]
                if size < self.map_limit:
                    log.info("cold tier: growing the LMDB map to %d bytes", min(size * 2, self.map_limit))
                    self.handle.resize(min(size * 2, self.map_limit))
                elif len(batch) > 1:
                    half = len(batch) // 2
                    return self._apply(batch[:half]) + self._apply(batch[half:])
                elif isinstance(batch[0][1], list) and len(batch[0][1]) > 1:  # one operation on many entries
                    kind, items, _ = batch[0]
                    half = len(items) // 2
                    parts = [self._apply([(kind, part, None)])[0] for part in (items[:half], items[half:])]
                    return [sum(parts)]
                else:
                    log.warning("cold tier: the store is full at its size limit; an operation was dropped")
                    self.count(failures=1)
                    return [0]

    def _used_bytes(self) -> int:
        return self._used
