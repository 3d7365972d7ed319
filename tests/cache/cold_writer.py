"""Writer processes for the cold-tier reliability tests: each writes deterministic blocks in batches forever
(or `count` batches), reporting each committed batch number.

`start_writer` forks them from a fork server that imported torch and the tier once (multiprocessing's
"forkserver"), so a test that kills twenty writers pays that import once, not twenty times. Each writer
opens its own LMDB environment after the fork, as a separate process would. Run as a script, it is one
writer that prints batch numbers (for a plain subprocess)."""

import multiprocessing
import sys

import torch

from tieredkv.hashing import hash_block, root_hash
from tieredkv.tiers.base import BlockKey
from tieredkv.tiers.cold import ColdTier

SHAPE = (2, 2, 4, 2, 8)
FINGERPRINT = "fp-reliability"


def key(i: int) -> BlockKey:
    tokens = (i, i + 1, i + 2, i + 3)
    return BlockKey(hash_block(root_hash(FINGERPRINT), tokens), tokens)


def block(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i)) + torch.arange(SHAPE[-1], dtype=torch.float32)


def open_tier(path: str, budget: int = 1 << 30, secret_path=None) -> ColdTier:
    return ColdTier(path, budget, FINGERPRINT, SHAPE, torch.float32, secret_path)


def write(path: str, start: int, count: int, report) -> None:
    """Writes batches of 50 blocks from `start` (forever when count < 0), calling report(batch) after each."""
    tier = open_tier(path)
    batch = 0
    while count < 0 or batch < count:
        ids = range(start + batch * 50, start + batch * 50 + 50)
        tier.put_sync([key(i) for i in ids], torch.stack([block(i) for i in ids]))
        report(batch)
        batch += 1
    tier.close_sync()


def _write_to(path: str, start: int, count: int, conn) -> None:
    write(path, start, count, conn.send)


def read_back(path: str, n: int) -> int:
    """Opens the store at `path`, reads blocks 0..n-1 (each present one must be right), writes and reads one
    more; returns how many came back."""
    tier = open_tier(path)
    good = 0
    for i in range(n):
        got = tier.get_sync([key(i)])
        if got is not None:
            assert torch.equal(got[0], block(i)), i
            good += 1
    tier.put_sync([key(10**6)], block(10**6)[None])
    assert torch.equal(tier.get_sync([key(10**6)])[0], block(10**6))
    tier.close_sync()
    return good


def _call_into(fn, args, conn) -> None:
    conn.send(fn(*args))


def _context():
    if Writer._context is None:
        Writer._context = multiprocessing.get_context("forkserver")
        Writer._context.set_forkserver_preload(["torch", "cold_writer"])
    return Writer._context


def _fork(target, args: tuple):
    """A process forked from the fork server running target(*args, conn): (process, the reading end)."""
    parent, child = _context().Pipe(duplex=False)
    process = _context().Process(target=target, args=(*args, child), daemon=True)
    process.start()
    child.close()
    return process, parent


def in_child(fn, *args, timeout: float = 120):
    """fn(*args) in a process forked from the fork server: (exit code, its result or None). A child that
    dies by a signal (SIGBUS from a damaged memory map, say) has a negative exit code."""
    process, parent = _fork(_call_into, (fn, args))
    try:
        result = parent.recv() if parent.poll(timeout) else None
    except EOFError:  # it died before answering
        result = None
    process.join(timeout)
    return process.exitcode, result


class Writer:
    """A writer process: `next_batch()` waits for its next committed batch (None once it has ended)."""

    _context = None

    def __init__(self, path, start: int, count: int):
        self.process, self._conn = _fork(_write_to, (str(path), start, count))

    def next_batch(self, timeout: float = 120) -> int | None:
        if not self._conn.poll(timeout):
            raise TimeoutError("the writer reported nothing")
        try:
            return self._conn.recv()
        except EOFError:
            return None

    def kill(self) -> None:
        self.process.kill()  # SIGKILL
        self.process.join()

    def wait(self, timeout: float = 120) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


def start_writer(path, start: int, count: int) -> Writer:
    return Writer(path, start, count)


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), lambda batch: print(batch, flush=True))
