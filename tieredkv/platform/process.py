"""What engines change in the process they run in, through one object a process (`PROCESS`): torch's thread count,
glibc malloc's thresholds, and the GIL's switch interval while a graph compiles beside the steps. Each change is
logged once; the ones that can be read back are restored when the last engine that asked for them is done, so
two engines in one process (or one started twice) leave the process as they found it, whatever order they end
in."""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from typing import Iterator

log = logging.getLogger("tieredkv")


class ProcessSettings:
    """The process's settings as engines use them. Thread-safe. Invariant: while `holders(name)` > 0 the setting
    holds the value its first holder set, and `saved` the value before it; at 0 the saved value is back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[str, int] = {}
        self._saved: dict[str, object] = {}
        self._logged: set[str] = set()

    def holders(self, name: str) -> int:
        with self._lock:
            return self._holders.get(name, 0)

    def _enter(self, name: str, read, write, value) -> None:
        with self._lock:
            if self._holders.get(name, 0) == 0:
                self._saved[name] = read()
                write(value)
                if name not in self._logged:
                    self._logged.add(name)
                    log.debug("process setting %s: %r (was %r)", name, value, self._saved[name])
            self._holders[name] = self._holders.get(name, 0) + 1

    def _exit(self, name: str, write) -> None:
        with self._lock:
            self._holders[name] -= 1
            if self._holders[name] == 0:
                write(self._saved.pop(name))

    @contextlib.contextmanager
    def switch_interval(self, seconds: float) -> Iterator[None]:
        """The GIL's switch interval at most `seconds` while inside (for a compile on one thread beside steps on
        another, which drop and retake the GIL around every torch call); the first holder's value while any
        holds it, the process's own once the last leaves."""
        value = min(sys.getswitchinterval(), seconds)
        self._enter("switch_interval", sys.getswitchinterval, sys.setswitchinterval, value)
        try:
            yield
        finally:
            self._exit("switch_interval", sys.setswitchinterval)


PROCESS = ProcessSettings()
