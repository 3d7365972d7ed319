"""The engine core's own process: `python -m tieredkv.engine.core_process FD`, started by AsyncEngine.start
(core_client.py), which holds the other end of the socket FD. It runs an engine as core_process=False runs it
and serves the application's messages (core_client.py says which) until the application closes it, its end of
the socket closes, or SIGTERM; then it closes the engine (the cold tier's write-back included) and exits.

Outgoing messages of one turn of the loop go in one frame, the stats first when they changed: what a step
produced for every stream, and the counters that include it."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import sys
from typing import Any

from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.engine.wire import encode, read_frame

log = logging.getLogger("tieredkv")
STATS_INTERVAL_S = 0.05  # stats that changed without any output (a prefill chunk, a sleep) go out this often
CALLS = frozenset({"check_pin", "pins", "load_adapter", "unload_adapter", "share_prefix", "wait_shared", "explain",
                   "export_cache", "import_cache", "sleep", "wake", "unpin", "clear_cache", "run_in_worker"})


class Outbox:
    """Messages for the application, sent once a turn of the loop. Telemetry records come from the worker thread
    too (a deque takes them from any thread)."""

    def __init__(self, writer: asyncio.StreamWriter):
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.pending: list[list] = []
        self.records: collections.deque = collections.deque()
        self.engine: AsyncEngine | None = None
        self._sent_stats = None
        self._scheduled = False

    def send(self, *message) -> None:
        self.pending.append(list(message))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def record(self, record: tuple) -> None:  # any thread (Telemetry.relay)
        self.records.append(record)

    def flush(self) -> None:
        self._scheduled = False
        head = []
        stats = None if self.engine is None else self.engine.stats()
        if stats is not None and stats is not self._sent_stats:
            head.append(["stats", stats])
            self._sent_stats = stats
        if self.records:
            records = []
            while self.records:
                records.append(self.records.popleft())
            head.append(["tel", records])
        messages, self.pending = head + self.pending, []
        if messages and not self.writer.is_closing():
            self.writer.write(encode(messages))


class Host:
    """Serves one application's messages on its engine."""

    def __init__(self, engine: AsyncEngine, out: Outbox):
        self.engine, self.out = engine, out
        self.streams: dict[str, asyncio.Task] = {}
        self.tasks: set[asyncio.Task] = set()

    def handle(self, message: list) -> bool:
        """Applies one message; False for "close"."""
        kind = message[0]
        if kind == "open":
            self._open(*message[1:])
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "forget":
            task = self.streams.pop(message[1], None)
            if task is not None:
                task.cancel()  # the stream's wait is cancelled: it aborts its request (RequestStream)
        elif kind == "call":
            self._spawn(self._call(*message[1:]))
        elif kind == "close":
            return False
        return True

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _open(self, request_id: str, prompt, params, flags: dict[str, Any]) -> None:
        try:
            stream = self.engine._open(prompt, params, request_id, flags)
        except Exception as e:  # checked in the application already: only a state it could not see (closing)
            self.out.send("chunk", request_id, e)
            return
        self.streams[request_id] = self._spawn(self._pump(request_id, stream))

    async def _pump(self, request_id: str, stream) -> None:
        try:
            async for chunk in stream:
                self.out.send("chunk", request_id, chunk)
        except asyncio.CancelledError:
            return
        except Exception as e:
            self.out.send("chunk", request_id, e)
        finally:
            if self.streams.get(request_id) is asyncio.current_task():
                del self.streams[request_id]

    async def _call(self, cid: int, name: str, args: list, kwargs: dict, with_progress: bool) -> None:
        try:
            if name not in CALLS:
                raise AttributeError(f"AsyncEngine has no method {name!r} to call in the core process")
            if with_progress:
                kwargs["progress"] = lambda n: self.out.send("progress", cid, n)
            value, ok = await getattr(self.engine, name)(*args, **kwargs), True
        except Exception as e:
            value, ok = e, False
        if name in ("load_adapter", "unload_adapter"):
            self.out.send("adapters", dict(self.engine.core.adapters.paths))
        self.out.send("result", cid, ok, value)


async def _stats_ticks(out: Outbox) -> None:
    while True:
        await asyncio.sleep(STATS_INTERVAL_S)
        if out.engine.stats() is not out._sent_stats:
            out.flush()


async def serve(sock: socket.socket) -> int:
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    out = Outbox(writer)
    messages = await read_frame(reader)
    if not messages or messages[0][0] != "config":
        return 2  # the application went away before it said what to run
    _, config, level = messages[0]
    logging.getLogger("tieredkv").setLevel(level)
    try:
        engine = await AsyncEngine.start(config)
    except BaseException as e:
        out.send("failed", e)
        out.flush()
        await writer.drain()
        writer.close()
        return 1
    engine.core.telemetry.relay(out.record)
    engine.close_on_signals(grace=0.0, signals=(signal.SIGTERM,))
    out._sent_stats = engine.stats()
    out.send("started", engine.info, engine._factory, dict(engine.core.adapters.paths), out._sent_stats)
    out.flush()  # alone in its frame: the application reads it before anything else
    out.engine = engine
    host = Host(engine, out)
    ticks = asyncio.get_running_loop().create_task(_stats_ticks(out))
    incoming = asyncio.get_running_loop().create_task(_serve_messages(reader, host))
    closed = asyncio.get_running_loop().create_task(engine.closed())
    await asyncio.wait([incoming, closed], return_when=asyncio.FIRST_COMPLETED)
    incoming.cancel()
    ticks.cancel()
    await engine.close()  # the application closed it, went away, or the engine closed itself
    out.send("closed", engine._worker.close_reason)
    out.flush()
    try:
        await writer.drain()
    except ConnectionError:
        pass
    writer.close()
    return 0


async def _serve_messages(reader: asyncio.StreamReader, host: Host) -> None:
    while (messages := await read_frame(reader)) is not None:
        for message in messages:
            if not host.handle(message):
                return


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    os.set_inheritable(fd, False)  # processes this one starts (tensor-parallel ranks) must not hold the socket
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the application, which closes this engine
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s (core process): %(message)s")
    return asyncio.run(serve(socket.socket(fileno=fd)))


if __name__ == "__main__":
    sys.exit(main(sys.argv))
