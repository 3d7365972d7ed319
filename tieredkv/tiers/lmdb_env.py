"""One LMDB environment per process and path (LMDB's rule), shared by reference count, with a gate that
lets the map size change safely while several threads use it."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

import lmdb

from tieredkv.tiers.lmdb_check import ensure_whole

log = logging.getLogger("tieredkv")

_HANDLES: dict[str, "EnvHandle"] = {}
_HANDLES_LOCK = threading.Lock()


class EnvHandle:
    """An open environment. Every transaction goes through `transaction()`, which holds the gate
    shared; `resize` holds it alone, since LMDB changes the map size only while no transaction of
    this process is active. A transaction that finds the map grown by another process
    (MDB_MAP_RESIZED) adopts the new size and begins again."""

    def __init__(self, key: str, env: lmdb.Environment):
        self.key = key
        self.env = env
        self.refs = 1
        self._cond = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextlib.contextmanager
    def transaction(self, write: bool = False, **kwargs):
        self._enter()
        try:
            for attempt in range(8):
                try:
                    txn = self.env.begin(write=write, **kwargs)
                    break
                except lmdb.MapResizedError:
                    self._exit()
                    try:
                        self.resize(0)  # adopt the size another process set
                    finally:
                        self._enter()
            else:
                raise lmdb.MapResizedError("the map kept changing size")
            with txn:
                yield txn
        finally:
            self._exit()

    def resize(self, size: int) -> None:
        """Sets the map size (0: adopt what another process set), waiting for this process's
        transactions to end first."""
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._resizing = True
            while self._active:
                self._cond.wait()
            try:
                self.env.set_mapsize(size)
            finally:
                self._resizing = False
                self._cond.notify_all()

    def _enter(self) -> None:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._active += 1

    def _exit(self) -> None:
        with self._cond:
            self._active -= 1
            self._cond.notify_all()


def open_env(path: Path, map_size: int) -> EnvHandle:
    """The process's handle for path, opened (the folder made owner-only) on first use."""
    key = os.path.realpath(path)
    with _HANDLES_LOCK:
        handle = _HANDLES.get(key)
        if handle is not None:
            handle.refs += 1
            return handle
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        ensure_whole(path)  # never map a damaged file: that is a SIGBUS, not an exception
        env = lmdb.open(str(path), map_size=map_size, max_dbs=8, readahead=True, max_readers=256)
        handle = _HANDLES[key] = EnvHandle(key, env)
        return handle


def close_env(handle: EnvHandle) -> None:
    with _HANDLES_LOCK:
        handle.refs -= 1
        if handle.refs == 0:
            del _HANDLES[handle.key]
            handle.env.close()
