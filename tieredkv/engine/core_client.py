"""AsyncEngine with its core in a process of its own (EngineConfig.core_process, the default).

The application's process keeps the front: streams, their channels, the tokenizer for checks and `tokenize`,
telemetry (spans and metrics, fed by the core's records), the last stats. The core process (core_process.py) runs
an engine as core_process=False runs it, with its own event loop, tokenizer thread and worker thread; its Python
shares no GIL with the application's, and its OpenMP threads no team with any torch work the application does.

One socket between them carries frames (wire.py). To the core: "open" a stream, "abort" one (its final chunk
says so), "forget" one (its consumer left), "call" a public method by name, "close". From the core: "started"
(or "failed"), stream chunks and errors, call results, progress, the adapters loaded, telemetry records, stats
(before the outputs they count), "closed". The core ends when the application closes the engine, when its end of
the socket closes (the application exited, however: no core outlives it for long) or on SIGTERM; it writes the
cold tier's blocks back first. The application sees a core that died (OOM, SIGKILL) within the moment its socket
closes: every open stream and pending call ends with EngineClosedError, and the next `start` starts afresh.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from typing import Any, Callable

from tieredkv.config import EngineConfig
from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.engine.explain import BlockReport
from tieredkv.engine.outputs import EngineInfo
from tieredkv.engine.stream import Channel
from tieredkv.engine.telemetry import Telemetry
from tieredkv.engine.wire import FrameProtocol, encode
from tieredkv.errors import EngineClosedError

log = logging.getLogger("tieredkv")
JOIN_TIMEOUT_S = 30.0  # after close, how long the core has to write back and exit before it is killed


class CoreLink:
    """The application's end of the socket, in the shape AsyncEngine reads of its worker: `loop`, `closed` (a
    future of the loop), `close_reason`, `snapshot`, `call_loop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, process: subprocess.Popen):
        self.loop, self.process = loop, process
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future = loop.create_future()
        self.close_reason: EngineClosedError | None = None
        self.snapshot = None
        self.telemetry = Telemetry()
        self.sinks: dict[str, Channel] = {}  # open streams by request id
        self.spans: dict[str, Any] = {}
        self.calls: dict[int, tuple[asyncio.Future, Callable | None]] = {}
        self.adapters: dict[str, str] = {}
        self._ids = itertools.count()
        self.serials = itertools.count()  # each stream's number, which its chunks carry back
        self._first: asyncio.Future = loop.create_future()
        self._reason: EngineClosedError | None = None  # what the core's "closed" said

    async def connect(self, sock: socket.socket) -> None:
        self.transport, _ = await self.loop.create_unix_connection(lambda: FrameProtocol(self._frames), sock=sock)

    def call_loop(self, fn: Callable, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def send(self, *message) -> bool:
        """Queues one message for the core; False once the link is down."""
        if self.closed.done() or self.transport.is_closing():
            return False
        self.transport.write(encode([list(message)]))
        return True

    def call(self, name: str, args: tuple, kwargs: dict, progress: Callable | None = None) -> asyncio.Future:
        future = self.loop.create_future()
        cid = next(self._ids)
        if not self.send("call", cid, name, list(args), kwargs, progress is not None):
            future.set_exception(self.close_reason or EngineClosedError("engine closed"))
            return future
        self.calls[cid] = (future, progress)
        return future

    async def first(self) -> list:
        """The core's first message: "started" or "failed" (None: it exited before it said)."""
        return await self._first

    def _frames(self, messages: list | BaseException | None) -> None:
        """A frame from the core (wire.FrameProtocol, in the callback that read it), its end (None), or bytes
        that did not decode."""
        if isinstance(messages, BaseException):
            log.error("reading from the engine's core process failed: %r", messages)
            messages, self._reason = None, EngineClosedError(
                f"the link to the engine's core process failed: {messages!r}")
            self.transport.close()
        if not self._first.done():  # "started" or "failed" comes alone in its frame
            self._first.set_result(messages[0] if messages else None)
            if messages:
                return
        if messages is None:
            self._down(self._reason)
            return
        for message in messages:
            self._reason = self._handle(message) or self._reason

    def _handle(self, message: list) -> EngineClosedError | None:
        kind = message[0]
        if kind == "chunk":
            sink = self.sinks.get(message[1])
            if sink is not None and sink.serial == message[3]:  # not a late chunk of a stream forgotten under its id
                sink.push(message[2])
        elif kind == "stats":
            self.snapshot = self.telemetry.snapshot = message[1]
        elif kind == "result":
            future, _ = self.calls.pop(message[1], (None, None))
            if future is not None and not future.done():
                future.set_result(message[3]) if message[2] else future.set_exception(message[3])
        elif kind == "tel":
            for record in message[1]:
                self.telemetry.replay(record, self.spans)
        elif kind == "progress":
            _, progress = self.calls.get(message[1], (None, None))
            if progress is not None:
                progress(message[2])
        elif kind == "adapters":
            self.adapters = message[1]
        elif kind == "closed":
            return message[1]
        return None

    def _down(self, reason: EngineClosedError | None) -> None:
        """The core is gone (closed, or died): every pending call ends, and `closed` settles (AsyncEngine ends
        every open stream on it)."""
        if reason is None:
            code = self.process.poll()
            reason = EngineClosedError("the engine's core process ended" +
                                       (f" (exit status {code})" if code is not None else ""))
        self.close_reason = reason
        self.telemetry.snapshot = None  # a closed engine reports no gauges (stats() keeps the last)
        for future, _ in self.calls.values():
            if not future.done():
                future.set_exception(reason)
        self.calls.clear()
        self.transport.close()
        if not self.closed.done():
            self.closed.set_result(None)

    async def join(self) -> None:
        """Waits for the core process to exit (killing it after JOIN_TIMEOUT_S), and for the reader."""
        try:
            await asyncio.wait_for(asyncio.to_thread(self.process.wait), JOIN_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("the engine's core process did not exit %.0f s after close: killed", JOIN_TIMEOUT_S)
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        await asyncio.shield(self.closed)  # the socket's end read, and every call and stream ended


def _spawn(config: EngineConfig) -> tuple[subprocess.Popen, socket.socket]:
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen([sys.executable, "-m", "tieredkv.engine.core_process", str(theirs.fileno())],
                                   pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()  # the core's copy is the only one left: its exit closes the socket
    return process, ours


class ProcessEngine(AsyncEngine, process_front=True):
    """AsyncEngine whose core runs in a process of its own (module docstring). Made by AsyncEngine.start."""

    def __init__(self, link: CoreLink, info: EngineInfo, factory):
        super().__init__(link)
        self._link = link
        self._info = info
        self._factory_copy = factory

    @classmethod
    async def launch(cls, config: EngineConfig) -> "ProcessEngine":
        loop = asyncio.get_running_loop()
        process, sock = _spawn(config)
        link = CoreLink(loop, process)
        try:
            await link.connect(sock)
        except BaseException:
            process.kill()
            sock.close()
            raise
        link.send("config", config.model_copy(update={"core_process": False}),
                  logging.getLogger("tieredkv").getEffectiveLevel())
        try:
            first = await link.first()
        except BaseException:  # cancelled while the core starts: it must not outlive this
            link.transport.close()
            process.kill()
            await asyncio.to_thread(process.wait)
            raise
        if first is None or first[0] != "started":
            link.transport.close()
            code = await asyncio.to_thread(process.wait)
            if first is not None and first[0] == "failed":
                raise first[1]
            raise EngineClosedError(f"the engine's core process exited (status {code}) before it started")
        _, info, factory, adapters, snapshot = first
        link.adapters, link.snapshot = adapters, snapshot
        link.telemetry.snapshot = snapshot
        return cls(link, info, factory)

    # -- what the front reads of the core -------------------------------------------------------------------

    @property
    def core(self):
        raise RuntimeError("the engine core runs in a process of its own (EngineConfig.core_process): use "
                           "AsyncEngine's methods and `info`, or start the engine with core_process=False to reach "
                           "its core")

    @property
    def info(self) -> EngineInfo:
        return self._info

    @property
    def _factory(self):
        return self._factory_copy

    @property
    def _telemetry(self) -> Telemetry:
        return self._link.telemetry

    def _adapter_paths(self) -> dict[str, str]:
        return self._link.adapters

    def _stop_core(self) -> None:
        self._link.send("close")

    async def _join_core(self) -> None:
        await self._link.join()

    # -- streams ---------------------------------------------------------------------------------------------

    def _start(self, channel: Channel, prompt, params, flags: dict[str, bool]):
        span = self._telemetry.start_request_span(channel.request_id, params)
        self._link.sinks[channel.request_id] = channel
        self._link.spans[channel.request_id] = span
        channel.serial = next(self._link.serials)
        if not self._link.send("open", channel.request_id, prompt, params, flags, channel.serial):
            channel.push(self._link.close_reason or EngineClosedError("engine closed"))
        elif channel.aborted:  # abort() came before the first iteration: the core aborts it as it arrives
            self._link.send("abort", channel.request_id)
        return span

    def _release(self, channel: Channel, abort: bool) -> None:
        rid = channel.request_id
        if self._link.sinks.get(rid) is channel:
            del self._link.sinks[rid]
            self._link.spans.pop(rid, None)
            if abort:
                self._link.send("forget", rid)

    def _abort(self, request_id: str, channel: Channel) -> None:
        if request_id in self._link.sinks:  # started; else _start sends it after the request
            self._link.send("abort", request_id)

    # -- every other call: the same method, run by the core process's engine ----------------------------------

    async def _call(self, name: str, *args, progress: Callable | None = None, **kwargs) -> Any:
        self._check_open()
        return await self._link.call(name, args, kwargs, progress)

    async def check_pin(self, token_ids: list[int], cache_salt: str | None = None, adapter: str | None = None) -> None:
        return await self._call("check_pin", token_ids, cache_salt, adapter)

    async def pins(self) -> list[dict[str, Any]]:
        return await self._call("pins")

    async def load_adapter(self, name: str, path) -> dict[str, Any]:
        return await self._call("load_adapter", name, str(path))

    async def unload_adapter(self, name: str) -> None:
        return await self._call("unload_adapter", name)

    async def share_prefix(self, token_ids: list[int], timeout: float, adapter: str | None = None,
                           cache_salt: str | None = None) -> tuple[int, bool]:
        return tuple(await self._call("share_prefix", token_ids, timeout, adapter, cache_salt))

    async def wait_shared(self, token_ids: list[int], num_blocks: int, timeout: float, adapter: str | None = None,
                          cache_salt: str | None = None) -> int:
        return await self._call("wait_shared", token_ids, num_blocks, timeout, adapter, cache_salt)

    async def explain(self, prompt) -> list[BlockReport]:
        return await self._call("explain", prompt)

    async def export_cache(self, path, prompts=None, progress=None) -> int:
        return await self._call("export_cache", os.fspath(path), prompts, progress=progress)

    async def import_cache(self, path, progress=None) -> dict[str, int | bool]:
        return await self._call("import_cache", os.fspath(path), progress=progress)

    async def sleep(self, level: int = 1) -> dict[str, Any]:
        return await self._call("sleep", level)

    async def wake(self) -> dict[str, Any]:
        return await self._call("wake")

    async def unpin(self, prompt, cache_salt: str | None = None) -> int:
        return await self._call("unpin", prompt, cache_salt)

    async def clear_cache(self, tier: str = "all", demote: bool = False) -> int:
        return await self._call("clear_cache", tier, demote)

    async def run_in_worker(self, fn, *args):
        """Runs fn(*args) on the core process's worker thread: `fn`, its arguments and its result must pickle (a
        function defined at a module's top level, not a lambda); it runs where the engine's state is, not here."""
        return await self._call("run_in_worker", fn, *args)


for _name in ("check_pin", "pins", "load_adapter", "unload_adapter", "share_prefix", "wait_shared", "explain",
              "export_cache", "import_cache", "sleep", "wake", "unpin", "clear_cache"):
    getattr(ProcessEngine, _name).__doc__ = getattr(AsyncEngine, _name).__doc__
