"""The thread that owns an engine: it loads the model, applies commands in order between steps, steps,
and closes. One hand-off in (`post`, a thread-safe queue), one out (`loop.call_soon_threadsafe`; or `direct`, on
this thread, for the sinks it takes)."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable

from tieredkv.config import EngineConfig
from tieredkv.core.sequence import Request
from tieredkv.engine.engine_core import EngineCore
from tieredkv.engine.outputs import EngineStats, Output
from tieredkv.engine.shared_weights import SharedWeights
from tieredkv.errors import EngineClosedError, StepError
from tieredkv.platform.malloc_tuning import release_free_memory

log = logging.getLogger("tieredkv")


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if not future.done():
        future.set_result(value) if ok else future.set_exception(value)


def _deliver(outputs: list[Output], settles: list[tuple]) -> None:
    for sink, item in outputs:
        if sink is not None:
            sink.push(item)
    for args in settles:
        _settle(*args)


class EngineWorker:
    """Runs an EngineCore on its own thread; everything that touches engine state runs there.

    `started` and `closed` are futures of the event loop: `started` resolves once the model is loaded
    (or fails with the load's error); `closed` once the core is closed, whether by `stop()` or because
    the loop died. `snapshot` is the core's stats, replaced after every step and command batch: any
    thread may read it at no cost. After the worker ends, `post` refuses, and every request still in
    flight or queued ends with EngineClosedError.
    """

    def __init__(self, config: EngineConfig, loop: asyncio.AbstractEventLoop,
                 shared_weights: SharedWeights | None = None):
        self.loop = loop
        self.config = config
        self.shared_weights = shared_weights
        self.core: EngineCore | None = None
        self.snapshot: EngineStats | None = None
        self.close_reason: EngineClosedError | None = None
        self.started: asyncio.Future = loop.create_future()
        self.closed: asyncio.Future = loop.create_future()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._accepting = True
        self._running = True
        self._last_active = time.monotonic()  # the last step or command (idle_sleep_s counts from it)
        self._outputs: list[Output] = []  # what the current step or command batch produced, sent in one go
        # outputs some sinks take on this thread, as they are published (after the snapshot that counts them):
        # direct(outputs) returns the others, which go to the loop (the core process's streams: Host.forward)
        self.direct: Callable[[list[Output]], list[Output]] | None = None
        self._settles: list[tuple] = []
        self.thread = threading.Thread(target=self._main, name="tieredkv-worker", daemon=True)
        self.thread.start()

    # -- any thread ------------------------------------------------------------------------------

    def post(self, fn: Callable, *args, future: asyncio.Future | None = None) -> bool:
        """Queues fn(*args) to run on the worker between steps; False once the worker has ended.
        With `future` (of the loop), fn's result or exception settles it."""
        with self._lock:
            if not self._accepting:
                return False
            self._inbox.put((fn, args, future))
            return True

    def call_loop(self, fn: Callable, *args) -> None:
        """Runs fn(*args) on the event loop's thread; if that loop is gone, the worker stops."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is left to serve
            self._running = False

    # -- commands (worker thread) ------------------------------------------------------------------

    def add(self, req: Request) -> None:
        outputs = self.core.add_request(req)
        if not outputs and getattr(req.sink, "aborted", False):  # aborted while it was being tokenized
            outputs = self.core.abort(req.request_id, req.sink)
        self.emit(outputs)

    def abort(self, request_id: str, sink: Any = None) -> None:
        self.emit(self.core.abort(request_id, sink))

    def stop(self) -> None:
        self._running = False

    def emit(self, outputs: list[Output]) -> None:
        self._outputs.extend(outputs)

    def _publish(self) -> None:
        """New stats first, then the outputs and command results: a caller that sees a result sees the
        stats of the state that produced it."""
        self.core.flush_events()
        self.snapshot = self.core.stats()
        self.core.telemetry.snapshot = self.snapshot if self._accepting else None  # a closed engine reports nothing
        if self._outputs and self.direct is not None:
            self._outputs = self.direct(self._outputs)
        if self._outputs or self._settles:
            outputs, self._outputs = self._outputs, []
            settles, self._settles = self._settles, []
            self.call_loop(_deliver, outputs, settles)

    # -- the thread --------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            self.core = EngineCore(self.config, self.shared_weights)
            self.snapshot = self.core.stats()
        except BaseException as e:
            with self._lock:
                self._accepting = False
            self.call_loop(_settle, self.started, False, e)
            self.call_loop(_settle, self.closed, True, None)
            return
        self.call_loop(_settle, self.started, True, None)
        error, stepped = None, False
        try:
            while self._running:
                busy = self.core.has_work()
                if stepped and not busy and self.config.cpu_malloc_tuning and self.core.device.type == "cpu":
                    # idle after work: the heap keeps the steps' freed buffers for reuse (malloc_tuning.py)
                    # while requests run; once none does, they go back to the OS
                    release_free_memory(collect=False)
                stepped = busy
                self._run_commands(block=not busy, timeout=None if busy else self._idle_timeout())
                if self._running and self.core.has_work():
                    self._step()
                    self._last_active = time.monotonic()
        except BaseException as e:  # a bug in the engine itself: end cleanly rather than hang callers
            log.exception("engine worker failed")
            error = e
        finally:
            self._shutdown(error)

    def _idle_timeout(self) -> float | None:
        """How long an idle worker waits for a command before it sleeps (None: for good)."""
        after = self.config.idle_sleep_s
        if after is None or self.core.asleep or self.core.parts.tp.world > 1:
            return None
        return max(self._last_active + after - time.monotonic(), 0.0)

    def _sleep_if_idle(self) -> None:
        if self.core.requests or self.core.has_work():
            return
        try:
            self.core.sleep(self.config.idle_sleep_level)
        except Exception:
            log.exception("sleeping after %s s idle failed", self.config.idle_sleep_s)
            self._last_active = time.monotonic()  # not again at once
        self._publish()

    def _run_commands(self, block: bool, timeout: float | None = None) -> None:
        try:
            cmd = self._inbox.get(block=block, timeout=timeout if block else None)
        except queue.Empty:
            if block and timeout is not None:
                self._sleep_if_idle()
            return
        self._last_active = time.monotonic()
        while True:
            fn, args, future = cmd
            try:
                value, ok = fn(*args), True
            except Exception as e:
                value, ok = e, False
                if future is None:
                    log.exception("engine command %s failed", getattr(fn, "__name__", fn))
            if future is not None:
                self._settles.append((future, ok, value))
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
        self._publish()

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except EngineClosedError:  # the engine cannot go on (a tensor-parallel rank is gone): the worker ends
            raise
        except Exception as e:  # the shared step itself (scheduling, block moves, caching) failed: a bug
            log.exception("engine step raised; failing every request in flight")  # fail them all, keep serving
            outputs = self.core.fail_all(StepError(list(self.core.requests), e))
        self.emit(outputs)
        self._publish()

    def _shutdown(self, error: BaseException | None) -> None:
        with self._lock:
            self._accepting = False
        self.close_reason = reason = EngineClosedError(
            "engine closed" if error is None else f"the engine's worker failed: {error!r}")
        while True:
            try:
                fn, args, future = self._inbox.get_nowait()
            except queue.Empty:
                break
            if future is not None:
                self._settles.append((future, False, reason))
            elif fn == self.add:
                self.emit([(args[0].sink, reason)])
        try:
            self.emit(self.core.fail_all(reason))
            self.core.close()
        except Exception:
            log.exception("closing the engine failed")
        self._settles.append((self.closed, True, None))
        self._publish()
