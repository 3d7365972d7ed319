"""Remote tier: KV blocks on a Valkey or Redis server, shared by every engine that points at it.

One server (or cluster) serves a fleet of replicas: a block one engine computed is a hit for all the
others. Entries are the cold tier's (cold_format.py): magic || msgpack header || keyed MAC || raw
payload, the MAC keyed by the secret at `cold_secret_path` (engines sharing a server share that file)
and covering the entry's key; nothing is pickled. A foreign, tampered or wrong-sized entry is a miss
plus a failure count, never served; the engine that computes the block again overwrites it.

Keys: `tieredkv:<fingerprint digest, hex>:<block hash, hex>`, one string per block, with a TTL
(`remote_ttl_s`, refreshed on every read; None: none) and the server's own maxmemory policy as the budget
(`allkeys-lru` is what a cache wants; with `noeviction` a full server refuses writes, which are then
counted failures). A cluster is found by itself: give any node's URL, the same form as for one server.

Nothing here is on an engine step's critical path: reads run in the tier manager's reader thread (the
scheduler passes over a request until its read lands), writes are queued and sent in pipelined batches
by a writer thread (write-behind), and newly computed blocks are offered as they fill (`shared`). Every
call has a timeout; a connection error or timeout opens a circuit breaker for `retry_s`, during which
every lookup is a miss and every write is dropped (counted) without touching the network.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Iterator, Sequence

import torch

from tieredkv.errors import RemoteTierError
from tieredkv.hashing import BlockHash
from tieredkv.tiers.base import NO_VICTIMS, BlockKey, KVTier, Victims, next_batch
from tieredkv.tiers.cold_format import ColdFormat, key_fingerprint

log = logging.getLogger("tieredkv")

_CHUNK = 64  # blocks per pipelined round trip
_MAX_PENDING = 512 << 20  # bytes of queued writes; beyond that new writes are dropped (counted)
_KNOWN = 1 << 17  # block hashes remembered as stored on the server (written or read by this engine)
_REFRESH_S = 5.0  # how often the writer thread reads the server's memory use when idle
_WRITER_NICE = 10  # the writer thread's niceness (Linux: per thread)
_HEAD = 1 << 16  # bytes of an entry that hold its header, and more (a header names a block's token ids)


def client_module():
    """The `valkey` package; RemoteTierError when it is not installed."""
    try:
        import valkey
    except ImportError:
        raise RemoteTierError("remote_url needs the valkey client: pip install 'tieredkv[remote]'") from None
    return valkey


def check_url(url: str) -> None:
    """Raises RemoteTierError (without the password) when the client cannot take the URL."""
    client_module()
    from valkey.connection import parse_url

    try:
        parse_url(url)
    except ValueError as e:
        raise RemoteTierError(f"remote_url {redact(url)}: {e}") from None


def connect(url: str, timeout_s: float):
    """A client for `url` (redis://, rediss://, valkey://, valkeys:// or unix://), with per-call timeouts
    and no retries of its own; a cluster node's URL gives a cluster client. Raises the client's errors
    when the server cannot be reached."""
    valkey = client_module()
    from valkey.backoff import NoBackoff
    from valkey.retry import Retry

    options = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    client = valkey.Valkey.from_url(url, **options)
    try:
        cluster = client.info("cluster").get("cluster_enabled") == 1
    except Exception:
        client.close()
        raise
    if cluster:
        from valkey.cluster import ValkeyCluster

        client.close()
        client = ValkeyCluster.from_url(url, cluster_error_retry_attempts=1, **options)
    return client


def redact(url: str) -> str:
    """The URL without its password, for logs and errors."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    return scheme + sep + rest


class RemoteTier(ColdFormat, KVTier):
    """A Valkey/Redis store of authenticated KV blocks; see the module docstring."""

    name = "remote"
    blocking = True
    shared = True

    def __init__(self, url: str, fingerprint: str, block_shape: tuple[int, ...], dtype: torch.dtype,
                 secret_path=None, timeout_s: float = 0.5, retry_s: float = 10.0, ttl_s: int | None = 86400):
        check_url(url)
        errors = client_module().exceptions
        self.url = redact(url)
        self._init_format(fingerprint, block_shape, dtype, secret_path)
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._namespace = f"tieredkv:{self.prefix.hex()}:".encode()
        self._down = (errors.ConnectionError, errors.TimeoutError, OSError)
        self._server_errors = errors.ValkeyError
        super().__init__(0)
        self._used = 0
        self._down_until = 0.0  # the circuit breaker: no call before this (monotonic) time
        self._state_lock = threading.Lock()  # held for dict updates only: the worker thread takes it
        self._connect_lock = threading.Lock()  # held while connecting (network calls): never by the worker
        self._known: OrderedDict[bytes, float] = OrderedDict()  # block hash -> when seen on the server
        self._outages = 0  # breaker trips so far: what a call saw before one is not remembered after it
        self._pending = 0  # bytes queued for the writer
        self._queue: queue.Queue = queue.Queue()
        self._url, self._timeout_s = url, timeout_s
        # a valkey.Valkey, made by the first call that finds the server (here, or after an outage)
        self.client: Any = None
        self._refresh()
        self._writer = threading.Thread(target=self._write_loop, name="tieredkv-remote-writer", daemon=True)
        self._writer.start()

    # -- the server connection: timeouts, the circuit breaker, counters --------------------------------

    def _key(self, key: BlockKey) -> bytes:
        return self._namespace + key.block_hash.hex().encode()

    @property
    def available(self) -> bool:
        """Whether calls go to the server now (the circuit breaker is closed)."""
        return time.monotonic() >= self._down_until

    def _connected(self) -> bool:
        """Whether there is a client (made now if need be: the server answered and its key was checked);
        a server that cannot be reached opens the breaker."""
        if self.client is not None:
            return True
        if not self.available:
            return False
        with self._connect_lock:
            if self.client is not None:
                return True
            if not self.available:  # another thread's attempt failed while this one waited
                return False
            try:
                client = connect(self._url, self._timeout_s)
                self._check_key(client)
            except Exception as e:  # refused, timed out, a cluster that cannot be mapped, a bad URL
                self._trip(e)
                return False
            self.client = client
        return True

    def _trip(self, error: BaseException) -> None:
        """The server is down or slow: no calls for retry_s; what this engine knew it held is forgotten
        (a restarted server comes back empty)."""
        with self._state_lock:
            was_up = time.monotonic() >= self._down_until
            self._down_until = time.monotonic() + self.retry_s
            self._known.clear()
            self._outages += 1
        self.count(failures=1)
        if was_up:
            log.warning("remote tier %s unreachable (%s): lookups are misses and writes are dropped; retrying in "
                        "%g s", self.url, error or "timeout", self.retry_s)

    def _pipeline(self, commands: list[tuple]) -> list | None:
        """Sends the commands in one round trip; their replies (a failed command's is its exception,
        counted), or None when the server is not available (then nothing was sent) or the call failed."""
        if not commands or not self._connected():
            return None
        try:
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = pipe.execute(raise_on_error=False)
        except self._down as e:
            self._trip(e)
            return None
        except self._server_errors as e:
            log.warning("remote tier %s: %s", self.url, e)
            self.count(failures=1, round_trips=1)
            return None
        errors = [r for r in replies if isinstance(r, Exception)]
        self.count(round_trips=1, failures=len(errors))
        if errors:
            log.warning("remote tier %s: %d of %d commands failed: %s", self.url, len(errors), len(replies), errors[0])
        return replies

    def _check_key(self, client) -> None:
        """Entries written under another secret would all fail here: say so once, when connecting."""
        meta = b"tieredkv-meta:" + self.prefix.hex().encode() + b":key"
        mine = key_fingerprint(self.secret)
        stored = client.get(meta)
        if stored is None:
            client.set(meta, mine, nx=True)
        elif bytes(stored) != mine:
            log.warning("remote tier %s: this model's entries there were written under another key (fingerprint "
                        "%s, this engine's is %s); they will be misses. Engines sharing a server must share "
                        "cold_secret_path", self.url, bytes(stored).decode(errors="replace"), mine.decode())

    def _refresh(self) -> None:
        """The server's memory use and budget (maxmemory; 0 when unlimited)."""
        if not self._connected():
            return
        try:
            info = self.client.info("memory")
        except self._down as e:
            self._trip(e)
            return
        if "used_memory" not in info:  # a cluster client answers per node
            info = {k: sum(node.get(k, 0) for node in info.values()) for k in ("used_memory", "maxmemory")}
        with self._counter_lock:
            self._used = int(info.get("used_memory", 0))
            self._counters.capacity_bytes = int(info.get("maxmemory", 0))

    def _used_bytes(self) -> int:
        return self._used

    # -- what this engine knows the server holds -------------------------------------------------------

    def _remember(self, keys: Sequence[BlockKey], outages: int) -> None:
        """Notes keys as held by the server, seen by a call that started after `outages` trips. A trip since
        (another thread's call failed: the server may have restarted empty) makes what the call saw stale:
        remembering it would keep those blocks from being written again."""
        now = time.monotonic()
        with self._state_lock:
            if outages != self._outages:
                return
            for key in keys:
                self._known[key.block_hash] = now
                self._known.move_to_end(key.block_hash)
            while len(self._known) > _KNOWN:
                self._known.popitem(last=False)

    def _forget(self, keys: Sequence[BlockKey]) -> None:
        with self._state_lock:
            for key in keys:
                self._known.pop(key.block_hash, None)

    def _set_aside(self, key: BlockKey) -> None:
        self._forget([key])  # computed again, the block is written over the bad entry

    def wanted(self, keys: Sequence[BlockKey]) -> list[int]:
        """The keys this engine has not seen on the server lately (within half the TTL)."""
        stale = time.monotonic() - self.ttl_s / 2 if self.ttl_s else -float("inf")  # seen before: may be gone
        with self._state_lock:
            return [i for i, k in enumerate(keys) if self._known.get(k.block_hash, stale) <= stale]

    # -- reads (the reader thread, or any thread) -------------------------------------------------------

    def _get_command(self, key: BlockKey) -> tuple:
        return ("GETEX", self._key(key), "EX", self.ttl_s) if self.ttl_s else ("GET", self._key(key))

    def contains_sync(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys whose entry's header matches (only the head of each entry is read; the payload is
        authenticated when read)."""
        n, deadline = 0, time.monotonic() + self._timeout_s
        for start in range(0, len(keys), _CHUNK):
            if start and time.monotonic() > deadline:  # remote_timeout_s bounds the whole call, not each read
                self.count(failures=1)
                return n
            chunk = keys[start : start + _CHUNK]
            replies = self._pipeline([("GETRANGE", self._key(k), 0, _HEAD - 1) for k in chunk]) or [None]
            for key, value in zip(chunk, replies):
                try:
                    self._header(key, memoryview(value))
                except Exception:  # absent (b"" or None), or not this block
                    return n
                n += 1
        return n

    def get_sync(self, keys: Sequence[BlockKey]) -> torch.Tensor | None:
        """The blocks of the longest present prefix of keys, [n, *block_shape], or None; read in pipelined
        chunks, stopping at the first miss. Assembled with plain memory copies, as the cold tier's."""
        data, found, deadline, outages = bytearray(), 0, time.monotonic() + self._timeout_s, self._outages
        for start in range(0, len(keys), _CHUNK):
            if start and time.monotonic() > deadline:  # remote_timeout_s bounds the whole call: what came is served
                self.count(failures=1)
                break
            chunk = keys[start : start + _CHUNK]
            replies = self._pipeline([self._get_command(k) for k in chunk])
            if replies is None:
                break
            self.count(bytes_read=sum(len(r) for r in replies if isinstance(r, bytes)))
            for key, value in zip(chunk, replies):
                payload = self._payload(key, memoryview(value)) if isinstance(value, bytes) else None
                if payload is None:
                    self._forget([key])
                    break
                data += payload
                found += 1
            if found < start + len(chunk):
                break
        if not found:
            return None
        self._remember(keys[:found], outages)
        return self._blocks(data, found)

    def export_sync(self, batch: int) -> Iterator[tuple[list[BlockKey], torch.Tensor]]:
        """Every usable entry of this model on the server (a SCAN), in batches of at most `batch`."""
        names = self._scan()
        for start in range(0, len(names), batch):
            chunk = names[start : start + batch]
            replies = self._pipeline([("GET", n) for n in chunk]) or []
            keys, data = [], bytearray()
            for name, value in zip(chunk, replies):
                if not isinstance(value, bytes):
                    continue
                try:
                    tokens = self._header(None, memoryview(value))[0]["tokens"]
                    key = BlockKey(BlockHash(bytes.fromhex(name[len(self._namespace):].decode())), tuple(tokens))
                except Exception:  # not an entry of this format (its header does not parse): a failure
                    self.count(failures=1)
                    continue
                payload = self._payload(key, memoryview(value))
                if payload is not None:
                    keys.append(key)
                    data += payload
            if keys:
                yield keys, self._blocks(data, len(keys))

    def _scan(self) -> list[bytes]:
        if not self._connected():
            return []
        try:
            names = [bytes(n) for n in self.client.scan_iter(match=self._namespace + b"*", count=1000)]
        except self._down as e:
            self._trip(e)
            return []
        self.count(round_trips=1 + len(names) // 1000)
        return names

    # -- writes ----------------------------------------------------------------------------------------

    def _set_command(self, key: BlockKey, value: bytes) -> tuple:
        ttl = ("EX", self.ttl_s) if self.ttl_s else ()
        return ("SET", self._key(key), value, *ttl)

    def _write(self, keys: Sequence[BlockKey], blocks: Sequence[torch.Tensor]) -> int:
        """Encodes and sends the blocks in pipelined chunks; returns how many the server stored."""
        stored = 0
        for start in range(0, len(keys), _CHUNK):
            if not self.available:
                break
            chunk = keys[start : start + _CHUNK]
            values = [self._encode(k, b) for k, b in zip(chunk, blocks[start : start + _CHUNK])]
            outages = self._outages
            replies = self._pipeline([self._set_command(k, v) for k, v in zip(chunk, values)])
            if replies is None:
                break
            ok = [k for k, r in zip(chunk, replies) if r is True or r == b"OK"]
            self.count(bytes_written=sum(len(v) for v in values))
            self._remember(ok, outages)
            stored += len(ok)
        return stored

    def put_sync(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> int:
        stored = self._write(keys, blocks)
        self._refresh()
        return stored

    def admit(self, keys: Sequence[BlockKey], blocks: torch.Tensor) -> tuple[int, Victims]:
        """Queues the blocks this engine has not seen on the server for the writer thread and returns at
        once. Dropped while the server is unavailable (its outage was counted), or when more than
        _MAX_PENDING bytes wait to be sent (a failure). Nothing goes on below: the manager passes what
        a shared tier admits to the tier below as well."""
        want = self.wanted(keys)
        size = len(want) * self.payload_bytes
        with self._state_lock:
            queued = bool(want) and self.available and self._pending + size <= _MAX_PENDING
            self._pending += size if queued else 0
        if not queued:  # nothing new; or the server is out (counted when it went); or too much is waiting
            if want and self.available:
                log.warning("remote tier %s: %d MiB of writes wait to be sent; %d blocks dropped", self.url,
                            self._pending >> 20, len(want))
                self.count(failures=1)
            return len(keys) - len(want), NO_VICTIMS
        new_keys = [keys[i] for i in want]
        self._queue.put(("put", (new_keys, blocks if len(want) == len(keys) else blocks[want], size), None))
        return len(keys), NO_VICTIMS

    def remove_sync(self, keys: Sequence[BlockKey]) -> int:
        self._forget(keys)
        return self._unlink([self._key(k) for k in keys])

    def clear_sync(self) -> int:
        """Drops every entry of this model's fingerprint on the server (every engine sharing it loses them)."""
        with self._state_lock:
            self._known.clear()
        return self._unlink(self._scan())

    def _unlink(self, names: list[bytes]) -> int:
        """Deletes the keys in pipelined chunks; returns how many existed."""
        n = 0
        for start in range(0, len(names), _CHUNK):
            replies = self._pipeline([("UNLINK", name) for name in names[start : start + _CHUNK]]) or []
            n += sum(r for r in replies if isinstance(r, int))
        return n

    def flush_sync(self) -> None:
        """Waits until every queued write has been sent (or dropped)."""
        done: Future = Future()
        if self._writer.is_alive():
            self._queue.put(("flush", None, done))
            done.result()

    def close_sync(self) -> None:
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if self.client is not None:
            self.client.close()
            self.client = None

    def _write_loop(self) -> None:
        try:  # below the engine's threads: where cores are few, encoding and sending yields to the forward
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)
        except (AttributeError, OSError):  # not Linux, or not allowed
            pass
        last_refresh = time.monotonic()
        while True:
            try:
                op = self._queue.get(timeout=_REFRESH_S)
            except queue.Empty:
                op = ("refresh", None, None)
            if op is None:
                return
            batch = next_batch(self._queue, op, _CHUNK)
            puts = [payload for kind, payload, _ in batch if kind == "put"]
            try:
                if puts:  # no torch op in this thread (it would start an OpenMP pool of its own: see AsyncEngine)
                    self._write([k for ks, _, _ in puts for k in ks], [b for _, bs, _ in puts for b in bs])
                if self.available and time.monotonic() - last_refresh > _REFRESH_S / 5:
                    last_refresh = time.monotonic()
                    self._refresh()
            except self._down as e:
                self._trip(e)
            except Exception:  # never die: count, and go on with the next batch
                log.exception("remote tier: a write batch failed")
                self.count(failures=1)
            with self._state_lock:
                self._pending -= sum(size for _, _, size in puts)
            for kind, _, done in batch:
                if done is not None:
                    done.set_result(None)
