"""Steps on fewer threads while other processes want the cores (platform/cpu_share.py): the choice per step size,
from measured times, only while others are busy; and outputs the same to the bit whichever count runs a step."""

import os
import time

import pytest
import torch

from helpers import make_config, rand_ids, run_to_end
from tieredkv import SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.platform.cpu_share import CpuShare, busy_ticks

HZ = 100


class Machine:
    """/proc's busy ticks as a test sets them: `others` cores busy besides this process, as time goes."""

    def __init__(self, others: float):
        self.others, self.ticks, self.t = others, 0.0, time.monotonic()

    def __call__(self):
        now = time.monotonic()
        self.ticks += self.others * HZ * (now - self.t)
        self.t = now
        return self.ticks, 0


def share(machine, **kw) -> tuple[CpuShare, list[int]]:
    calls: list[int] = []
    s = CpuShare(threads=2, cores=2, read=machine, set_threads=calls.append, interval_s=0.0, **kw)
    s._hz = HZ
    for _ in range(2):  # the first steps read /proc (busy for two intervals running: contended)
        s.before(2)
        time.sleep(0.01)
    return s, calls


def test_quiet_machine_every_step_on_all_threads():
    s, calls = share(Machine(0.05))
    for rows in (1, 1, 512, 1):
        assert s.before(rows) == 2
        time.sleep(0.02)
        s.after(rows, 0.01)
    assert s.active and not s.contended and calls == []


def test_one_busy_interval_is_a_blip_not_contention():
    machine = Machine(0.05)
    s, calls = share(machine)
    machine.others = 1.0
    time.sleep(0.01)
    assert s.before(1) == 2 and s.others > 0.5 and not s.contended  # one interval busy
    machine.others = 0.0
    time.sleep(0.01)
    assert s.before(1) == 2 and not s.contended and calls == []


def test_busy_machine_each_size_runs_on_the_count_measured_faster_and_tries_the_other():
    machine = Machine(0.6)
    s, calls = share(machine, explore=4)
    # decode 1.2x faster on one thread: the other tried every 4th step; a prefill 1.76x faster on two: every 16th;
    # a long prefill (0.25 s or more on two threads) never tried on one
    cost = {(1, 1): 0.010, (1, 2): 0.012, (512, 1): 0.300, (512, 2): 0.170, (4096, 1): 0.5, (4096, 2): 0.3}
    picked = {1: [], 512: [], 4096: []}
    for _ in range(16):
        for rows in (1, 512, 4096):
            time.sleep(0.002)
            n = s.before(rows)
            picked[rows].append(n)
            s.after(rows, cost[rows, n])
    assert s.contended and 0.3 < s.others < 1.2
    # the first steps of a size try both counts (all threads first), then the faster runs, the other every 4th step
    # of that size (every 16th where it was 25% slower or more)
    assert picked[1] == [2, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 2, 1, 1, 1, 2]
    assert picked[512] == [2, 1] + [2] * 13 + [1]
    assert picked[4096] == [2] * 16
    assert calls and calls[-1] == s.now and all(c in (1, 2) for c in calls)
    assert s.before(1, exact=lambda: False) == 2  # a step whose bits follow the team (torch's reductions): all threads
    s.after(1, 0.012)
    machine.others = 0.0  # the others went quiet: all threads again
    time.sleep(0.01)
    assert s.before(1) == 2 and not s.contended
    s.close()
    assert s.now == 2


def test_nothing_is_chosen_without_a_thread_per_core_or_proc():
    for kw in (dict(threads=1, cores=1), dict(threads=2, cores=4)):
        s = CpuShare(read=Machine(2.0), set_threads=pytest.fail, interval_s=0.0, **kw)
        assert s.before(1) == kw["threads"] and not s.active
    s = CpuShare(threads=2, cores=2, read=lambda: None, set_threads=pytest.fail)
    assert s.before(1) == 2 and not s.active
    ticks = busy_ticks()  # this machine's /proc, as the engine reads it
    assert ticks is None or (ticks[0] >= 0 and 0 <= ticks[1])


def _serve(core: EngineCore, prompts) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Each prompt's greedy tokens (12, served together) and every step's logits."""
    captured, inner = [], core.runner.execute
    core.runner.execute = lambda out: captured.append(inner(out)) or captured[-1]
    try:
        tokens = run_to_end(core, prompts, [12] * len(prompts))
    finally:
        core.runner.execute = inner
    return tokens, [logits.clone() for logits, _ in captured]


@pytest.mark.parametrize("scheme", [dict(compile_decode=False), dict(quantization="int8", compile_decode=True),
                                    dict(compile_decode=False, enable_prefix_caching=True)],
                         ids=["fp32-eager", "int8-native-step", "cascade"])
def test_steps_on_one_thread_of_two_give_the_same_bits(llama_dir, scheme):
    """A batch of two sequences, one long enough that decode attention splits its positions across the threads,
    served with every step on 2 threads, and with the steps alternating between 1 and 2: the same tokens and the
    same logits to the bit at every step (the splits follow the engine's 2 threads, not the team's). Two that share
    a cached prefix attend to it as a cascade, in torch's reductions: those steps stay on 2 threads (with them on
    1 the logits differed)."""
    cfg = dict(model=str(llama_dir), num_blocks=96, warm_bytes=0, num_threads=2,
               **{"enable_prefix_caching": False, **scheme})
    prompts = [rand_ids(400, seed=1), rand_ids(40, seed=2)]
    if cfg["enable_prefix_caching"]:  # a shared prefix: the rows that share it attend to it as a cascade
        prompts = [prompts[0] + rand_ids(8, seed=3), prompts[0] + rand_ids(8, seed=4)]
    plain = EngineCore(make_config(**cfg, share_cores=False))
    try:
        assert plain.cpu_share is None
        want_tokens, want = _serve(plain, prompts)
    finally:
        plain.close()
    shared = EngineCore(make_config(**cfg))
    try:
        shared.cpu_share = CpuShare(threads=2, cores=2, read=Machine(1.5), interval_s=0.0,
                                    on_start=CPU.set_split_threads)
        shared.cpu_share._hz = HZ
        turns = iter(range(1000))
        shared.cpu_share._pick = lambda size: 1 + next(turns) % 2  # whatever the times: 1, 2, 1, 2, ...
        got_tokens, got = _serve(shared, prompts)
        calls = shared.stats().kernel_calls
        if cfg["enable_prefix_caching"]:  # steps that may attend as a cascade (torch's reductions) on all threads
            assert calls["decode attention: cascade"] > 0 and calls["step threads: 2 of 2"] >= 11, calls
        else:
            assert calls["step threads: 1 of 2"] >= 4 and calls["step threads: 2 of 2"] >= 4, calls
        if scheme.get("quantization"):
            assert calls["forward: native step"] >= 8, calls
    finally:
        shared.close()
    assert CPU.split_threads == 0  # the close gave the kernels their own split count back
    assert got_tokens == want_tokens
    assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))


async def test_the_core_process_chooses_its_steps_threads_and_the_application_process_never(llama_dir):
    """A core in a process of its own with a thread per core counts each step's threads (whichever the machine's
    other work made it choose); an engine core on a thread of the application's process chooses none."""
    from tieredkv import AsyncEngine

    cores = len(os.sched_getaffinity(0))
    cfg = make_config(model=str(llama_dir), num_blocks=32, warm_bytes=0, num_threads=cores, core_process=True)
    async with await AsyncEngine.start(cfg) as engine:
        await engine.generate([5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
        steps = {k: v for k, v in engine.stats().kernel_calls.items() if k.startswith("step threads")}
    if cores >= 2:
        assert sum(steps.values()) == 4 and all(k.endswith(f" of {cores}") for k in steps), steps
    else:
        assert steps == {}
    async with await AsyncEngine.start(cfg.model_copy(update={"core_process": False})) as engine:
        assert engine.core.cpu_share is None
