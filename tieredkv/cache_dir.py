"""The engine's on-disk cache (converted models, the compiled decode graph): where it is, how one of
several processes produces an artifact there while the others wait for it, and how the long one-time
work of producing one is shown."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("tieredkv")


def write_json(path: Path, data) -> None:
    """`data` as JSON at `path`, whole or absent: written to a file beside it, then renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def default_cache_dir() -> Path:
    """$TIEREDKV_CACHE_DIR, else $XDG_CACHE_HOME/tieredkv, else ~/.cache/tieredkv."""
    if os.environ.get("TIEREDKV_CACHE_DIR"):
        return Path(os.environ["TIEREDKV_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tieredkv"


@contextlib.contextmanager
def artifact_lock(path: Path, what: str) -> Iterator[None]:
    """Holds an exclusive lock on `path` (a lock file beside an artifact) while the caller checks for the
    artifact and produces it when missing: a second process blocks here until the first is done, then
    finds the artifact. The lock is the kernel's (flock), so a killed holder releases it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish %s (%s)", what, path.parent)
            t0 = time.perf_counter()
            fcntl.flock(f, fcntl.LOCK_EX)
            log.info("the other process finished %s after %.1f s", what, time.perf_counter() - t0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def long_work(what: str, ticker: bool = True) -> Iterator[None]:
    """Shows one-time work that takes a while: a log line (INFO) as it starts and one with its time as it
    ends, and meanwhile, where stderr is a terminal and `ticker` (not for work in the background, whose
    line would run into the output), a line counting the seconds."""
    log.info("%s ...", what)
    t0 = time.perf_counter()
    stop, show = threading.Event(), ticker
    thread: threading.Thread | None = None
    if show and sys.stderr.isatty():
        def tick() -> None:
            while not stop.wait(1.0):
                sys.stderr.write(f"\r{what}: {time.perf_counter() - t0:.0f} s")
                sys.stderr.flush()
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

        thread = threading.Thread(target=tick, name="tieredkv-progress", daemon=True)
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        log.info("%s: done in %.1f s", what, time.perf_counter() - t0)
