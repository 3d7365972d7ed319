"""Is an LMDB store whole before this process maps it? A truncated or damaged data file makes the process
that maps it die of SIGBUS, so the check reads the meta pages with plain file reads, then walks every
entry in a child process, where a crash costs nothing. A store that fails is moved aside (kept for
inspection) with a warning, and a fresh one is made in its place."""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("tieredkv")

_META_MAGIC = 0xBEEFC0DE
_WALK = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, max_dbs=16, readahead=False)
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
for name in names:
    db = env.open_db(name, create=False)
    with env.begin(db=db, buffers=True) as txn:
        for _, value in txn.cursor():
            if len(value):
                value[0], value[len(value) - 1]
print("whole")
"""


def meta_problem(data_file: Path) -> str | None:
    """What is wrong with the file's meta pages and size, or None. Plain reads: never maps the file."""
    size = data_file.stat().st_size
    if size == 0:
        return None  # LMDB initialises an empty file
    with open(data_file, "rb") as f:
        first = f.read(160)
        if len(first) < 160 or struct.unpack_from("<I", first, 16)[0] != _META_MAGIC:
            return "no LMDB meta page at the start of the file"
        page = struct.unpack_from("<I", first, 40)[0]
        if page < 512 or page & (page - 1):
            return f"impossible page size {page}"
        f.seek(page)
        second = f.read(160)
    metas = [m for m in (first, second) if len(m) == 160 and struct.unpack_from("<I", m, 16)[0] == _META_MAGIC]
    newest = max(metas, key=lambda m: struct.unpack_from("<Q", m, 144)[0])
    needed = (struct.unpack_from("<Q", newest, 136)[0] + 1) * page
    if size < needed:
        return f"the file has {size:,} bytes but its pages need {needed:,} (truncated)"
    return None


def walk_problem(path: Path, timeout: float) -> str | None:
    """Reads every entry of every database in a child process; what went wrong, or None."""
    try:
        done = subprocess.run([sys.executable, "-c", _WALK, str(path)], capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        log.warning("cold tier: checking %s took over %.0f s; using it unchecked", path, timeout)
        return None
    if done.returncode == 0 and done.stdout.strip() == "whole":
        return None
    if done.returncode < 0:
        return f"reading it killed a checking process (signal {-done.returncode})"
    return f"reading it failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}"


def ensure_whole(path: Path, timeout: float = 120.0) -> str | None:
    """Checks the store in `path` (if any); moves a bad one aside. Returns the problem found, or None."""
    data = path / "data.mdb"
    if not data.exists():
        return None
    problem = meta_problem(data) or walk_problem(path, timeout)
    if problem is None:
        return None
    aside = path / f"corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6}"
    aside.mkdir(mode=0o700)
    for name in ("data.mdb", "lock.mdb"):
        if (path / name).exists():
            (path / name).rename(aside / name)
    log.warning("cold tier: the store in %s is damaged (%s); moved it to %s and started a fresh one",
                path, problem, aside.name)
    return problem
