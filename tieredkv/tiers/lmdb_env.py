"""One LMDB environment per process and path (LMDB's rule), shared by reference count."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import lmdb

_ENVS: dict[str, tuple[lmdb.Environment, int]] = {}  # one environment per process and path (LMDB's rule)
_ENVS_LOCK = threading.Lock()


def open_env(path: Path, map_size: int) -> lmdb.Environment:
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        if key in _ENVS:
            env, refs = _ENVS[key]
            _ENVS[key] = (env, refs + 1)
            return env
        path.mkdir(parents=True, exist_ok=True)
        env = lmdb.open(str(path), map_size=map_size, max_dbs=4, readahead=True, max_readers=256)
        _ENVS[key] = (env, 1)
        return env


def close_env(env: lmdb.Environment) -> None:
    with _ENVS_LOCK:
        for key, (e, refs) in list(_ENVS.items()):
            if e is env:
                if refs > 1:
                    _ENVS[key] = (e, refs - 1)
                else:
                    del _ENVS[key]
                    env.close()
                return
