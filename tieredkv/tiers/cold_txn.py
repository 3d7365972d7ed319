"""The cold tier's operations inside one LMDB write transaction: budget, LRU order, removal."""

from __future__ import annotations

import mmap
import struct
from typing import Any

import msgpack

from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import BlockKey, KVTier
from tieredkv.tiers.cold_format import fingerprint_prefix
from tieredkv.tiers.lmdb_env import EnvHandle

_U64 = struct.Struct(">Q")  # big-endian, so the order database sorts by sequence number
ASIDE_MAX = 256  # entries kept in `aside` for inspection


def disk_cost(value_bytes: int, page_size: int = mmap.PAGESIZE) -> int:
    """Disk bytes an entry takes: LMDB keeps a small value in a shared leaf page, a large one in whole
    pages of its own (behind a 16-byte page header)."""
    if value_bytes + 16 <= page_size // 2:
        return value_bytes + 16
    return -(-(value_bytes + 16) // page_size) * page_size


class ColdTxnOps(KVTier):
    """Mixed into ColdTier: needs `handle`, `db_blocks`, `db_lru`, `db_order`, `db_meta`, `db_aside`, `budget`,
    `prefix`, `cost` (bytes an entry takes on disk) and the KVTier counters. Each `_txn_<kind>(txn,
    payload)` applies one queued operation of the writer thread. The byte budget is enforced here, by
    evicting the oldest entries, so it holds across processes."""

    handle: EnvHandle  # the LMDB environment, shared by the process (tiers/lmdb_env.py)
    db_blocks: Any
    db_lru: Any
    db_order: Any
    db_meta: Any
    db_aside: Any
    budget: int
    prefix: bytes
    _used: int

    def cost(self, value_bytes: int) -> int:
        raise NotImplementedError

    def _verified(self, key: BlockKey, value: memoryview) -> memoryview:
        raise NotImplementedError

    def known_fingerprints(self) -> list[str]:
        """Every model fingerprint that has stored blocks in this folder."""
        with self.handle.transaction() as txn:
            return self._fingerprints(txn)

    def inspect_sync(self, key, fingerprint: str | None = None) -> str:
        """"ok", "missing" or "failed" (present but would not authenticate) for the key under this
        tier's fingerprint, or whether another fingerprint stores it; changes nothing."""
        prefix = self.prefix if fingerprint is None else fingerprint_prefix(fingerprint)
        with self.handle.transaction(db=self.db_blocks, buffers=True) as txn:
            value = txn.get(prefix + key.block_hash)
            if value is None or fingerprint is not None:
                return "missing" if value is None else "ok"
            try:
                self._verified(key, value)
            except Exception:
                return "failed"
            return "ok"

    def _meta(self, txn, name: bytes) -> int:
        raw = txn.get(name, db=self.db_meta)
        return _U64.unpack(raw)[0] if raw else 0

    def _set_meta(self, txn, name: bytes, value: int) -> None:
        txn.put(name, _U64.pack(value), db=self.db_meta)

    def _next_seq(self, txn) -> bytes:
        seq = self._meta(txn, b"seq") + 1
        self._set_meta(txn, b"seq", seq)
        return _U64.pack(seq)

    def _touch(self, txn, key: bytes) -> None:
        old = txn.get(key, db=self.db_lru)
        if old is not None:
            txn.delete(old + key, db=self.db_order)
        seq = self._next_seq(txn)
        txn.put(key, seq, db=self.db_lru)
        txn.put(seq + key, b"", db=self.db_order)

    def _delete(self, txn, key: bytes) -> int:
        value = txn.pop(key, db=self.db_blocks)
        if value is None:
            return 0
        if key.startswith(self.prefix):  # (KV events: this engine's entries, never another model's)
            self.report_removed([key[len(self.prefix):]])
        seq = txn.pop(key, db=self.db_lru)
        if seq is not None:
            txn.delete(seq + key, db=self.db_order)
        self._set_meta(txn, b"used_bytes", max(self._meta(txn, b"used_bytes") - self.cost(len(value)), 0))
        return 1

    def _txn_put(self, txn, items) -> int:
        stored = 0
        for key, value in items:
            if txn.get(key, db=self.db_blocks) is not None:
                self._touch(txn, key)
                stored += 1
                continue
            cost = self.cost(len(value))
            if cost > self.budget:
                continue
            used = self._meta(txn, b"used_bytes")
            while used + cost > self.budget:
                with txn.cursor(db=self.db_order) as cur:
                    if not cur.first():
                        break
                    oldest = bytes(cur.key())[8:]
                self._delete(txn, oldest)
                self.count(evictions=1)
                self.note_dropped([BlockHash(oldest[8:])])
                used = self._meta(txn, b"used_bytes")
            txn.put(key, value, db=self.db_blocks)
            self._set_meta(txn, b"used_bytes", used + cost)
            self._touch(txn, key)
            stored += 1
        return stored

    def _txn_touch(self, txn, keys) -> int:
        for key in keys:
            if txn.get(key, db=self.db_blocks) is not None:
                self._touch(txn, key)
        return 0

    def _txn_remove(self, txn, keys) -> int:
        return sum(self._delete(txn, key) for key in keys)

    def _txn_set_aside(self, txn, keys) -> int:
        """Moves entries that failed their checks out of `blocks` into `aside`, as they are, for
        inspection; at most ASIDE_MAX are kept (the oldest go first)."""
        moved = 0
        for key in keys:
            value = txn.get(key, db=self.db_blocks)
            if value is None:
                continue
            txn.put(self._next_seq(txn) + key, bytes(value), db=self.db_aside)
            moved += self._delete(txn, key)
        with txn.cursor(db=self.db_aside) as cur:
            extra = txn.stat(self.db_aside)["entries"] - ASIDE_MAX
            while extra > 0 and cur.first():
                cur.delete()
                extra -= 1
        return moved

    def _txn_clear(self, txn, _) -> int:
        with txn.cursor(db=self.db_blocks) as cur:
            mine = [bytes(k) for k in cur.iternext(values=False) if bytes(k).startswith(self.prefix)]
        return sum(self._delete(txn, key) for key in mine)

    def _txn_noop(self, txn, _) -> int:
        return 0

    def _txn_register(self, txn, fingerprint: str) -> int:
        """Records a fingerprint that stores blocks here (explain() checks the others' chains)."""
        known = self._fingerprints(txn)
        if fingerprint not in known:
            txn.put(b"fingerprints", msgpack.packb(known + [fingerprint]), db=self.db_meta)
        return 0

    def _fingerprints(self, txn) -> list[str]:
        raw = txn.get(b"fingerprints", db=self.db_meta)
        try:
            known = msgpack.unpackb(raw) if raw else []
        except Exception:
            return []
        return [f for f in known if isinstance(f, str)] if isinstance(known, list) else []

    def _refresh_used(self) -> None:
        with self.handle.transaction() as txn:
            self._used = self._meta(txn, b"used_bytes")
