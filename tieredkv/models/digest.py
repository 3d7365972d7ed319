"""The weights' identity: SHA-256 over every byte of each weight file, computed once per file and kept in the
engine's cache directory, keyed by the file's real path and checked against its size, modification and
change times, inode and device.

Why every byte: the cold tier, the shared remote tier and snapshots serve a block to any engine whose
fingerprint matches, and two checkpoints that differ anywhere compute other keys and values (a fine-tune
of some layers has the same config.json and file sizes as its base). Why it stays cheap: a later start
reads one small JSON file and stats the weights; a file rewritten in place has a new change time (which no
tool can set back, unlike the modification time), so it is read again. Files are hashed on a thread each,
at most one per core (hashlib releases the GIL), in blocks read into one buffer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tieredkv.cache_dir import default_cache_dir, long_work, write_json
from tieredkv.errors import CheckpointError

log = logging.getLogger("tieredkv")

DIGEST_VERSION = 1
_BLOCK = 16 << 20
MAX_RECORDS = 512  # digest records kept before those of deleted files are dropped


def _stamp(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _record_path(real: str, cache_dir: Path) -> Path:
    return cache_dir / "digests" / f"{hashlib.sha256(real.encode()).hexdigest()[:32]}.json"


def cached_digest(path: Path, cache_dir: Path) -> str | None:
    """The file's digest as recorded, when the record's stamp is the file's now; else None."""
    real = os.path.realpath(path)
    try:
        record = json.loads(_record_path(real, cache_dir).read_text())
        if record.get("v") == DIGEST_VERSION and record.get("path") == real and \
                record.get("stamp") == _stamp(os.stat(real)) and isinstance(record.get("sha256"), str):
            return record["sha256"]
    except (OSError, ValueError, AttributeError):
        pass
    return None


def file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of the file's bytes (hex): the recorded one while the file is unchanged, else read whole and
    recorded. A file that changes while it is read is not recorded (the next start reads it again)."""
    known = cached_digest(path, cache_dir)
    if known is not None:
        return known
    real = os.path.realpath(path)
    h, buf = hashlib.sha256(), bytearray(_BLOCK)
    view = memoryview(buf)
    try:
        before = _stamp(os.stat(real))
        with open(real, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
        after = _stamp(os.stat(real))
    except OSError as e:
        raise CheckpointError(f"cannot read {Path(path).name}: {e}") from None
    digest = h.hexdigest()
    if before == after:
        try:
            record = _record_path(real, cache_dir)
            write_json(record, {"v": DIGEST_VERSION, "path": real, "stamp": after, "sha256": digest})
            _prune(record.parent)
        except OSError as e:  # a read-only cache: the digest is still right, only not kept
            log.debug("cannot record the digest of %s: %s", real, e)
    return digest


def _prune(folder: Path) -> None:
    """Past MAX_RECORDS records, those of files that no longer exist go."""
    records = list(folder.glob("*.json"))
    if len(records) <= MAX_RECORDS:
        return
    for record in records:
        try:
            if not os.path.exists(json.loads(record.read_text()).get("path", "")):
                record.unlink()
        except (OSError, ValueError, AttributeError):
            record.unlink(missing_ok=True)


def weights_digest(files: list[Path], cache_dir: Path | None = None) -> str:
    """One digest over the files' names, sizes and contents, in the order given."""
    cache_dir = cache_dir or default_cache_dir()
    digests = {f: cached_digest(f, cache_dir) for f in files}
    missing = [f for f, known in digests.items() if known is None]
    if missing:
        total = sum(f.stat().st_size for f in missing)
        with long_work(f"hashing the weights ({total / 2**30:.2f} GiB, once per checkpoint)"), \
                ThreadPoolExecutor(max_workers=max(1, min(len(missing), os.cpu_count() or 1))) as pool:
            digests.update(zip(missing, pool.map(lambda f: file_digest(f, cache_dir), missing)))
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{f.stat().st_size}:{digests[f]}\n".encode())
    return h.hexdigest()
