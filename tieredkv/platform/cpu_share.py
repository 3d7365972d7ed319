"""How many threads a step runs on while other processes want the engine's cores.

An engine on CPU runs each step on torch's threads, one a core. When another process runs on those cores too (the
application around the engine, whose core runs in a process of its own: its event loop, its own torch work), the
kernel's scheduler takes one of the step's threads off its core now and then, and every parallel region of the step
(hundreds a step) waits at its end for that thread. A decode step of the default model on 2 cores took 1.2-1.4x its
time beside an event loop 40% busy, and 1.1x on one thread fewer, which leaves the other process a core of its own
(AMD EPYC Zen 4, fp32). A prefill of many tokens is the other way round: bound by arithmetic, it loses more with a
thread fewer than it loses to the waits.

So the choice is measured, per step size. `CpuShare` reads how busy the other processes keep the machine's cores
(/proc/stat's busy time less this process's own, every `interval_s`); once that is `busy_cores` or more for two
intervals running, each step of a size class (its rows, by powers of two) runs on the thread count whose measured
time for that class is lower (all threads first, then one fewer), and every `explore`-th step of the class on the
other, so that a change is seen (every 4 x `explore`-th where the other was measured 25% slower or more). A class
whose steps take `long_s` or more on all threads (a prefill of many tokens: arithmetic, not waits) stays on them:
one such step on a thread fewer would cost more than the waits could save; once the others go quiet, every
step runs on all threads again. The outputs do not change with the count, to the bit: decode attention splits a
sequence's positions for the engine's count whatever team runs it (kernels/attention_cpu.c: tkv_split_threads), and
each output of a product is one thread's sum whatever the team's size (checked by tests/engine/test_cpu_share.py).
A step that would run torch's own reductions (the torch references, cascade attention, LoRA rows: their partition
follows the team) runs on all threads (ModelRunner.same_bits_on_fewer_threads).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable

import torch

log = logging.getLogger("tieredkv")

_ALPHA = 0.25  # weight of a step's time in its class's average


def busy_ticks() -> tuple[int, int] | None:
    """(the machine's busy clock ticks, this process's), both since boot; None where /proc cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            cpu = f.readline().split()
        with open("/proc/self/stat", "rb") as f:
            own = f.read().rsplit(b")", 1)[1].split()  # after the command's name, which may hold spaces
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in cpu[1:8])
    return user + nice + system + irq + softirq, int(own[11]) + int(own[12])  # utime + stime, every thread


class CpuShare:
    """Sets torch's threads before each step (`before`, on the thread that steps) and times the step (`after`).
    `threads`: the engine's count, the most a step uses (None: torch's on the stepping thread, read at the first
    step); `fewer`: the count tried while others are busy. It does nothing (`active` False) where the engine has
    fewer threads than the cores it may run on (the others have cores to spare), a single thread, or no /proc.
    `on_start(threads)` is called once it is active (the kernels' split count: see the module's docstring)."""

    def __init__(self, threads: int | None = None, busy_cores: float = 0.25, interval_s: float = 0.1,
                 explore: int = 16, read: Callable[[], tuple[int, int] | None] = busy_ticks,
                 set_threads: Callable[[int], None] = torch.set_num_threads, cores: int | None = None,
                 on_start: Callable[[int], None] | None = None, long_s: float = 0.25):
        self.threads, self.fewer, self.now = threads or 0, 0, 0
        self.busy_cores, self.interval_s, self.explore, self.long_s = busy_cores, interval_s, explore, long_s
        self.active: bool | None = None  # None: decided at the first step
        self.others = 0.0  # cores the other processes kept busy over the last interval
        self.contended = False
        self._read, self._set, self._cores, self._on_start = read, set_threads, cores, on_start
        self._hz = os.sysconf("SC_CLK_TCK")
        self._last: tuple[float, tuple[int, int] | None] = (0.0, None)
        self._times: dict[tuple[int, int], float] = {}  # (size class, threads) -> seconds a step, averaged
        self._steps: dict[int, int] = {}  # size class -> steps while contended
        self._logged = False
        self._busy_samples = 0  # intervals in a row with others at busy_cores or more

    def _start(self) -> None:
        self.threads = self.threads or torch.get_num_threads()
        cores = self._cores or len(os.sched_getaffinity(0))
        self._last = (time.monotonic(), self._read())
        self.active = self.threads >= 2 and self.threads >= cores and self._last[1] is not None
        self.now, self.fewer = self.threads, self.threads - 1
        if self.active and self._on_start is not None:
            self._on_start(self.threads)

    @staticmethod
    def size_class(rows: int) -> int:
        return max(rows, 1).bit_length()

    def _sample(self) -> None:
        now = time.monotonic()
        if now - self._last[0] < self.interval_s:
            return
        ticks = self._read()
        t0, before = self._last
        self._last = (now, ticks)
        if ticks is None or before is None:
            return
        others = max(0, (ticks[0] - before[0]) - (ticks[1] - before[1]))
        self.others = others / (self._hz * (now - t0))
        self._busy_samples = self._busy_samples + 1 if self.others >= self.busy_cores else 0
        if not self.contended and self._busy_samples >= 2:  # busy for two intervals running: not a blip
            self.contended = True
            self.fewer = max(1, self.threads - max(1, math.floor(self.others + 0.5)))
            self._times.clear()  # a new contention: measure afresh
            self._steps.clear()
            if not self._logged:
                self._logged = True
                log.info("other processes keep %.2f cores busy: steps run on %d or %d threads, whichever is "
                         "measured faster for their size", self.others, self.fewer, self.threads)
        elif self.contended and self.others < self.busy_cores / 2:
            self.contended = False

    def _pick(self, size: int) -> int:
        full, fewer = self._times.get((size, self.threads)), self._times.get((size, self.fewer))
        n = self._steps[size] = self._steps.get(size, 0) + 1
        if full is None or full >= self.long_s:  # all threads first; and always for long steps
            return self.threads
        if fewer is None:
            return self.fewer
        best, other = (self.fewer, self.threads) if fewer < full else (self.threads, self.fewer)
        # the other count is tried again every `explore` steps of the size, 4x less often where it was far slower
        every = self.explore if max(fewer, full) < 1.25 * min(fewer, full) else 4 * self.explore
        return other if n % every == 0 else best

    def before(self, rows: int, exact: Callable[[], bool] | None = None) -> int:
        """Sets the threads for a step of `rows` rows; returns the count. `exact()`, asked only while others are
        busy: whether the step gives the same bits on fewer threads (else it runs on all of them)."""
        if self.active is None:
            self._start()
        if not self.active:
            return self.threads
        self._sample()
        fewer_ok = self.contended and (exact is None or exact())
        want = self._pick(self.size_class(rows)) if fewer_ok else self.threads
        if want != self.now:
            self._set(want)
            self.now = want
        return want

    def after(self, rows: int, seconds: float) -> None:
        """The step of `rows` rows that `before` set up took `seconds`."""
        if not self.active or not self.contended:
            return
        key = (self.size_class(rows), self.now)
        old = self._times.get(key)
        self._times[key] = seconds if old is None else old + _ALPHA * (seconds - old)

    def close(self) -> None:
        """All threads again (the process's count as the engine had it)."""
        if self.active and self.now != self.threads:
            self._set(self.threads)
            self.now = self.threads
