"""The engine core's own process: `python -m tieredkv.engine.core_process FD`, started by AsyncEngine.start
(core_client.py), which holds the other end of the socket FD. It runs an engine as core_process=False runs it
and serves the application's messages (core_client.py says which) until the application closes it, its end of
the socket closes, or SIGTERM; then it closes the engine (the cold tier's write-back included) and exits.

What a step produced for every stream goes in one frame from the worker thread as the step publishes it, the
step's stats first (the counters that include it): a token reaches the application without waking this process's
event loop. The loop's own messages (call results, progress) go once a turn of the loop, in one frame."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import select
import signal
import socket
import sys
import threading
from typing import Any

from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.engine.outputs import EngineStats
from tieredkv.engine.stream import Channel
from tieredkv.engine.wire import FrameProtocol, encode
from tieredkv.platform.process import PROCESS

log = logging.getLogger("tieredkv")
STATS_INTERVAL_S = 0.05  # stats that changed without any output (a prefill chunk, a sleep) go out this often
CALLS = frozenset({"check_pin", "pins", "load_adapter", "unload_adapter", "share_prefix", "wait_shared", "explain",
                   "export_cache", "import_cache", "sleep", "wake", "unpin", "clear_cache", "run_in_worker"})


class Outbox:
    """Messages for the application. The loop's own (call results, progress, errors, the stats ticks) go once a turn
    of the loop; the streams' chunks go from the worker thread as each step publishes them, with that step's stats,
    without waking the loop (Host.forward). Writes from either thread go whole, in order, under one lock, straight
    to the socket (the asyncio transport only reads). Telemetry records come from the worker thread too (a deque
    takes them from any thread) and ride along with the next frame."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.pending: list[list] = []
        self.records: collections.deque = collections.deque()
        self.engine: AsyncEngine | None = None
        self._sent_stats: EngineStats | None = None
        self._scheduled = False
        self._lock = threading.Lock()

    def send(self, *message) -> None:  # the loop thread
        self.pending.append(list(message))
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.flush)

    def record(self, record: tuple) -> None:  # any thread (Telemetry.relay)
        self.records.append(record)

    def flush(self) -> None:  # the loop thread
        self._scheduled = False
        messages, self.pending = self.pending, []
        self.write(messages)

    def write(self, messages: list[list]) -> None:
        """One frame: the stats first where they changed since the last frame, the telemetry records, then
        `messages`; any thread. The stats are read under the lock, so frames never carry them out of order (the
        worker publishes a step's stats before its outputs)."""
        with self._lock:
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
            if head or messages:
                self._send(encode(head + messages))

    def _send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:  # the application has not read yet: wait until it does
                select.select([], [self.sock], [], 1.0)
            except OSError:  # the application is gone: its end reads nothing more
                return


class Forward(Channel):
    """A stream the core process forwards to the application chunk by chunk: from the worker thread as steps
    publish (Host.forward), or from the loop for what ends it there (an error before the worker took the request,
    the engine closing). `done` once its last chunk (or error) went; `closed` once the application forgot it."""

    def __init__(self, request_id: str, n: int, host: "Host"):
        super().__init__(request_id, n)
        self.host, self.span, self.done = host, None, False

    def take(self, item) -> bool:
        """False where the stream ended or was forgotten (the item is dropped); counts its ends."""
        if self.done or self.closed:
            return False
        if isinstance(item, BaseException):
            self.done = True
        elif item.finish_reason is not None:
            self.remaining -= 1
            self.done = self.remaining == 0
        return True

    def push(self, item) -> None:  # the loop thread
        if self.take(item):
            self.host.out.send("chunk", self.request_id, item, self.serial)
            if self.done:
                self.host.end(self, abort=False)


class Host:
    """Serves one application's messages on its engine."""

    def __init__(self, engine: AsyncEngine, out: Outbox):
        self.engine, self.out = engine, out
        self.streams: dict[str, Forward] = {}
        self.tasks: set[asyncio.Task] = set()

    def handle(self, message: list) -> bool:
        """Applies one message; False for "close"."""
        kind = message[0]
        if kind == "open":
            self._open(*message[1:])
        elif kind == "abort":
            self.engine.abort(message[1])
        elif kind == "forget":
            channel = self.streams.get(message[1])
            if channel is not None:
                self.end(channel, abort=True)
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

    def _open(self, request_id: str, prompt, params, flags: dict[str, Any], serial: int) -> None:
        """`serial`: the application's number for this stream, sent back with each chunk (a stream it opens under
        a request id it forgot a moment ago takes none of the forgotten one's late chunks)."""
        try:
            channel = self.engine._admit(prompt, params, request_id, flags, lambda rid, n: Forward(rid, n, self))
            assert isinstance(channel, Forward)
            channel.serial = serial
        except Exception as e:  # checked in the application already: only a state it could not see (closing)
            self.out.send("chunk", request_id, e, serial)
            return
        self.streams[request_id] = channel
        channel.span = self.engine._start(channel, prompt, params, flags)

    def forward(self, outputs: list) -> list:
        """The worker thread's outputs for forwarded streams, sent at once in one frame after the step's stats;
        returns the others (for the loop). A stream that ended is closed on the loop."""
        frame, ended, rest = [], [], []
        for sink, item in outputs:
            if not isinstance(sink, Forward):
                rest.append((sink, item))
            elif sink.take(item):
                frame.append(["chunk", sink.request_id, item, sink.serial])
                if sink.done:
                    ended.append(sink)
        if frame:
            self.out.write(frame)
        for channel in ended:
            self.out.loop.call_soon_threadsafe(self.end, channel, False)
        return rest

    def end(self, channel: Forward, abort: bool) -> None:
        """A stream is over for the application (its last chunk went, or it forgot the stream): the id is free and,
        if it still runs and `abort`, the request is aborted."""
        if self.streams.get(channel.request_id) is channel:
            del self.streams[channel.request_id]
        if channel.closed:
            return
        channel.closed = True
        self.engine._forget(channel, abort=abort and not channel.done)
        if channel.span is not None:
            channel.span.end()

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
    frames: asyncio.Queue = asyncio.Queue()  # the application's frames (wire.FrameProtocol), None at its end
    transport, _ = await asyncio.get_running_loop().create_unix_connection(
        lambda: FrameProtocol(frames.put_nowait), sock=sock)  # it only reads: Outbox writes to the socket itself
    out = Outbox(sock)
    messages = await _next_frame(frames)
    if not messages or messages[0][0] != "config":
        return 2  # the application went away before it said what to run
    _, config, level = messages[0]
    logging.getLogger("tieredkv").setLevel(level)
    try:
        engine = await AsyncEngine.start(config)
    except BaseException as e:
        out.send("failed", e)
        out.flush()
        transport.close()
        return 1
    engine.core.telemetry.relay(out.record)
    engine.close_on_signals(grace=0.0, signals=(signal.SIGTERM,))
    out._sent_stats = engine.stats()
    out.send("started", engine.info, engine._factory, dict(engine.core.adapters.paths), out._sent_stats)
    out.flush()  # alone in its frame: the application reads it before anything else
    out.engine = engine
    host = Host(engine, out)
    engine._worker.direct = host.forward
    ticks = asyncio.get_running_loop().create_task(_stats_ticks(out))
    incoming = asyncio.get_running_loop().create_task(_serve_messages(frames, host))
    closed = asyncio.get_running_loop().create_task(engine.closed())
    await asyncio.wait([incoming, closed], return_when=asyncio.FIRST_COMPLETED)
    incoming.cancel()
    ticks.cancel()
    await engine.close()  # the application closed it, went away, or the engine closed itself
    out.send("closed", engine._worker.close_reason)
    out.flush()
    transport.close()
    return 0


async def _next_frame(frames: asyncio.Queue) -> list | None:
    """The application's next frame; None once its end closed (or sent bytes that do not decode)."""
    messages = await frames.get()
    if isinstance(messages, BaseException):
        log.error("a frame from the application did not decode: %r", messages)
        return None
    return messages


async def _serve_messages(frames: asyncio.Queue, host: Host) -> None:
    while (messages := await _next_frame(frames)) is not None:
        for message in messages:
            if not host.handle(message):
                return


def main(argv: list[str]) -> int:
    fd = int(argv[1])
    PROCESS.engine_owned = True
    os.set_inheritable(fd, False)  # processes this one starts (tensor-parallel ranks) must not hold the socket
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the application, which closes this engine
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s (core process): %(message)s")
    return asyncio.run(serve(socket.socket(fileno=fd)))


if __name__ == "__main__":
    from tieredkv.platform.process import exit_without_teardown

    exit_without_teardown(main(sys.argv))  # the engine is closed, its cold tier written back
