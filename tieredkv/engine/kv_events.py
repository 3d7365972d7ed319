"""KV cache events in vLLM's format (vllm/distributed/kv_events.py), for KV-aware routers.

The block pool and the tiers below it report their own transitions to an `EventRecorder`: a block becomes
cached in the hot pool (`BlockStored`, medium "GPU", with its parent's hash and its token ids) or leaves it
(`BlockRemoved`), enters or leaves the warm tier ("CPU") or the cold tier ("DISK"). The shared remote tier is not
reported: no replica owns it. The worker hands what was recorded since its last step or command to the publisher
as one batch (`flush`); `ZmqEventPublisher` sends each on a ZMQ PUB socket from a thread of its own, as vLLM's does:

    multipart [topic, sequence number (8 bytes, big-endian), msgpack payload]
    payload   [timestamp, [event, ...], data_parallel_rank]

An event is a map tagged under "type" (current vLLM: `{"type": "BlockStored", "block_hashes": [...], ...}`)
or, with `event_encoding="array"`, the older positional array (`["BlockStored", block_hashes, parent, ...]`).
Block hashes go out as vLLM's integer form of a hash: its last 8 bytes, big-endian. With a replay endpoint,
a ROUTER socket answers a request of 8 bytes (a sequence number) with every buffered batch from it on, then
an end marker (sequence -1), as vLLM's publisher does.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from typing import Any

from tieredkv.errors import KVEventsError
from tieredkv.tiers.block_pool import MEDIUM_HOT

log = logging.getLogger("tieredkv")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
PARENTS = 1 << 17  # chain links the recorder keeps for blocks reported below hot (~130k blocks, ~2M tokens)


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES): its last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")


class EventRecorder:
    """Collects the transitions between two flushes, merging runs: blocks stored one after the other in a chain
    become one BlockStored (parent of the first, token ids of all), removals of one medium one BlockRemoved.

    A block reaches the tiers below hot as a key (hash and token ids) without its parent; the recorder keeps the
    link it saw when the block was cached in hot (the last PARENTS of them), and a block below hot whose link it
    does not know (one read from a cold store written before this engine started) is not reported stored there:
    a router anchors a block on its parent. Thread-safe: the cold tier reports from its writer thread."""

    def __init__(self, block_size: int, publisher: "ZmqEventPublisher", lora_name: str | None = None):
        self.block_size = block_size
        self.publisher = publisher
        self.lora_name = lora_name
        self.events: list[dict[str, Any]] = []
        self.parents: OrderedDict[int, int | None] = OrderedDict()
        self._lock = threading.Lock()

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids: tuple[int, ...],
               medium: str = MEDIUM_HOT) -> None:
        """A block cached in the block pool (a far block's medium is the warm tier's); `parent` is the chain's
        previous block (None at its start)."""
        h, p = external_hash(block_hash), None if parent is None else external_hash(parent)
        with self._lock:
            self.parents[h] = p
            self.parents.move_to_end(h)
            if len(self.parents) > PARENTS:
                self.parents.popitem(last=False)
            self._stored(h, p, token_ids, medium)

    def stored_below(self, keys, medium: str) -> None:
        """Blocks (BlockKeys) a tier below hot took in."""
        with self._lock:
            for key in keys:
                h = external_hash(key.block_hash)
                if h in self.parents:  # (a parent of None: the first block)
                    self._stored(h, self.parents[h], key.token_ids, medium)

    def _stored(self, h: int, parent: int | None, token_ids, medium: str) -> None:
        last = self.events[-1] if self.events else None
        if (last is not None and last["type"] == "BlockStored" and last["medium"] == medium and parent is not None
                and last["block_hashes"][-1] == parent):
            last["block_hashes"].append(h)
            last["token_ids"].extend(token_ids)
            return
        self.events.append({"type": "BlockStored", "block_hashes": [h], "parent_block_hash": parent,
                            "token_ids": list(token_ids), "block_size": self.block_size, "lora_id": None,
                            "medium": medium, "lora_name": self.lora_name})

    def removed(self, block_hashes, medium: str = MEDIUM_HOT) -> None:
        """Blocks (their hashes) that left a tier."""
        with self._lock:
            for block_hash in block_hashes:
                last = self.events[-1] if self.events else None
                if last is not None and last["type"] == "BlockRemoved" and last["medium"] == medium:
                    last["block_hashes"].append(external_hash(block_hash))
                else:
                    self.events.append({"type": "BlockRemoved", "block_hashes": [external_hash(block_hash)],
                                        "medium": medium})

    def cleared(self) -> None:
        with self._lock:
            self.events.append({"type": "AllBlocksCleared"})

    def flush(self) -> None:
        """Hands what was recorded since the last flush to the publisher, as one batch."""
        with self._lock:
            events, self.events = self.events, []
        if events:
            self.publisher.publish(events)


_FIELDS = {  # vLLM's field order, for the positional (array) encoding
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def encode_batch(ts: float, events: list[dict[str, Any]], rank: int, encoding: str = "map") -> bytes:
    """The msgpack payload of one batch: `[ts, events, data_parallel_rank]`, each event a map tagged under
    "type" ("map", current vLLM) or a positional array with the tag first ("array", vLLM before its maps)."""
    import msgpack  # (only an engine that publishes loads it)

    if encoding == "array":
        return msgpack.packb([ts, [[e["type"], *(e[f] for f in _FIELDS[e["type"]])] for e in events], rank],
                             use_bin_type=True)
    return msgpack.packb([ts, events, rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A payload back as (ts, events as maps, rank), from either encoding: for subscribers and tests."""
    import msgpack

    ts, events, *rest = msgpack.unpackb(payload, raw=False)
    out = []
    for e in events:
        if isinstance(e, list):
            e = {"type": e[0], **dict(zip(_FIELDS[e[0]], e[1:]))}
        out.append(e)
    return ts, out, rest[0] if rest else None


def _bind(socket, endpoint: str, what: str) -> None:
    import zmq

    try:
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            socket.bind(endpoint)  # vLLM's rule: a wildcard binds, an address connects
        else:
            socket.connect(endpoint)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        raise KVEventsError(f"kv_events_config {what} {endpoint!r}: {e}") from e


class ZmqEventPublisher:
    """Sends event batches on a PUB socket from a thread of its own, numbered from 0, keeping the last
    `buffer_steps` for replay. `publish` never blocks the engine: past `max_queue_size` waiting batches, a
    batch is dropped and counted (`dropped`); a subscriber sees the gap in the sequence numbers."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, buffer_steps: int = 10_000,
                 hwm: int = 100_000, max_queue_size: int = 100_000, topic: str = "", encoding: str = "map",
                 data_parallel_rank: int = 0):
        try:
            import zmq
        except ImportError as e:
            raise KVEventsError("kv_events_config needs pyzmq: pip install 'tieredkv[fleet]'") from e
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        _bind(self._pub, endpoint, "endpoint")
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            try:
                _bind(self._replay, replay_endpoint, "replay_endpoint")
            except KVEventsError:
                self._pub.close(linger=0)
                raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self.topic = topic.encode()
        self.encoding = encoding
        self.rank = data_parallel_rank
        self.published = 0
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="tieredkv-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            log.warning("kv events: %d batches wait to be sent; one dropped", self._queue.qsize())

    def close(self, timeout: float = 1.0) -> None:
        """Sends what is queued (for at most `timeout` seconds) and closes the sockets."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def _loop(self) -> None:
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            try:
                payload = encode_batch(ts, events, self.rank, self.encoding)
                self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.published += 1
            except Exception:  # never die: the batch is lost, the next goes out
                log.exception("kv events: sending a batch failed")
                self.dropped += 1

    def _serve_replay(self) -> None:
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: a replay request of %d frames ignored", len(frames))
                return
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", END_SEQ, b""))
        except Exception:
            log.exception("kv events: a replay request failed")


def make_recorder(config, block_size: int) -> EventRecorder | None:
    """The recorder (and its publisher) for EngineConfig.kv_events_config, or None when events are off."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    publisher = ZmqEventPublisher(config.endpoint, config.replay_endpoint, config.buffer_steps, config.hwm,
                                  config.max_queue_size, config.topic, config.event_encoding)
    log.info("kv events: publishing on %s (topic %r, %s encoding)", publisher.endpoint, config.topic,
             config.event_encoding)
    recorder = EventRecorder(block_size, publisher)
    recorder.cleared()  # a replica that starts again on the same endpoint holds nothing of what it held before
    recorder.flush()
    return recorder
