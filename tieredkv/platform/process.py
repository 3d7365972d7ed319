"""What engines change in the process they run in, through one object a process (`PROCESS`): torch's thread count,
and the GIL's switch interval while a graph compiles beside the steps. The first engine that asks for a setting
applies it (logged once), later ones share it, and the process's own value comes back when the last lets go, so
engines in one process (or one started twice) leave it as they found it, whatever order they end in. glibc
malloc's thresholds (platform/malloc_tuning.py) cannot be read back, so they stay once set.

`exit_without_teardown` ends the processes that exist only to run the engine (the core process, tensor-parallel
ranks, the command line) without the interpreter's teardown."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import Callable, Iterator, NoReturn

import torch

log = logging.getLogger("tieredkv")


class Hold:
    """One holder's claim on a setting; `release()` lets go (once: calling it again does nothing)."""

    def __init__(self, settings: "ProcessSettings", name: str, write: Callable) -> None:
        self._settings, self._name, self._write = settings, name, write
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._settings._let_go(self._name, self._write)


class ProcessSettings:
    """The process's settings as engines use them. Thread-safe. Invariant: while `holders(name)` > 0 the setting
    holds the value its first holder set, and the value before it is kept; at 0 that value is back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, int] = {}
        self._saved: dict[str, object] = {}
        self._values: dict[str, object] = {}
        self._logged: set[str] = set()
        # whether an engine core owns this process (engine/core_process.py): no application code shares its cores'
        # threads or its torch settings, and what else runs on the machine is another process's
        self.engine_owned = False

    def holders(self, name: str) -> int:
        with self._lock:
            return self._holders.get(name, 0)

    def hold(self, name: str, read: Callable, write: Callable, value) -> Hold:
        """`name` at `value` (read/write get and set it) until the Hold is released; while another holder has it,
        the value stays the first holder's (a different one asked for is logged)."""
        with self._lock:
            if self._holders.get(name, 0) == 0:
                self._saved[name], self._values[name] = read(), value
                write(value)
                if name not in self._logged:
                    self._logged.add(name)
                    log.debug("process setting %s: %r (was %r)", name, value, self._saved[name])
            elif self._values[name] != value:
                log.warning("%s stays %r, as the engine that set it first in this process asked (%r asked now)",
                            name, self._values[name], value)
            self._holders[name] = self._holders.get(name, 0) + 1
        return Hold(self, name, write)

    def _let_go(self, name: str, write: Callable) -> None:
        with self._lock:
            self._holders[name] -= 1
            if self._holders[name] == 0:
                write(self._saved.pop(name))
                del self._values[name]

    def threads(self, count: int) -> Hold:
        """torch's intra-op threads at `count` (they are the process's, whichever thread sets them)."""
        return self.hold("torch threads", torch.get_num_threads, torch.set_num_threads, count)

    @contextlib.contextmanager
    def switch_interval(self, seconds: float) -> Iterator[None]:
        """The GIL's switch interval at most `seconds` while inside (for a compile on one thread beside steps on
        another, which drop and retake the GIL around every torch call)."""
        held = self.hold("switch interval", sys.getswitchinterval, sys.setswitchinterval,
                         min(sys.getswitchinterval(), seconds))
        try:
            yield
        finally:
            held.release()


PROCESS = ProcessSettings()


def exit_without_teardown(code: int) -> NoReturn:
    """Ends this process with `code` once its work is done and closed: the atexit handlers run (logging's flush among
    them) and the standard streams are flushed, then the process exits at once, without the interpreter's teardown
    of every module and object, which only frees memory the exit frees anyway: 0.4 s for a process that imported
    torch, 1.0-1.5 s for one that ran an engine (AMD EPYC Zen 3, 2 cores), time that an application closing its
    engine, or a shell waiting on the command, would wait. Only for processes whose every file and connection the
    engine closed itself (an object's __del__ does not run); never in an application's own process."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
