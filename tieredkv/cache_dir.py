"""The engine's on-disk cache (converted models, the compiled decode graph): where it is, and how one of
several processes produces an artifact there while the others wait for it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Iterator

log = logging.getLogger("tieredkv")


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
