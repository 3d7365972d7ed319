"""The speed an application gets: batch-1 decode through `AsyncEngine.stream` while the application around the
engine does its own work, with the engine core in a process of its own (core_process=True, the default) and on a
thread of the application's process (core_process=False), beside the engine core alone on the main thread.

    .venv/bin/python benchmarks/bench_app.py [--rounds 3] [--tokens 48] [--cases clean "torch op" ...]
        [--modes thread process "process, cores not shared"] [--out F]

Cases (each run in a fresh process, the cases and modes alternating within a round, ratios from medians, and from
the fastest round of each, as the machines these ran on drift between a quiet and a loaded state):
  core alone   EngineCore.step on the main thread, nothing else (the figure the other benchmarks time)
  clean        AsyncEngine.stream, nothing else in the application
  torch op     the application ran one parallel torch op on its main thread before starting the engine
  loop 13%     the application's event loop: JSON round trips of ~0.7 ms, then 5 ms asleep
  loop 40%     the same with 1 ms asleep
  loop busy    JSON round trips with `await asyncio.sleep(0)` between them, all the time; 4 streams at once
Modes: "thread" (core_process=False), "process" (the default engine), "process, cores not shared" (the core in its
own process with share_cores=False: every step on all threads, however busy the application keeps the cores).
The prompt is 64 tokens, then --tokens new tokens (the default model, fp32 or --quantization, prefix caching off;
the first tokens after the prompt are not timed). Busy cases stop after --limit seconds and report the tokens they got.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from child import report, run_child as child_run, save  # noqa: E402

CASES = ["core alone", "clean", "torch op", "loop 13%", "loop 40%", "loop busy"]
PROMPT = list(range(1000, 1064))


def _json_work(doc: dict) -> None:
    """About 0.7 ms of an application's Python: a JSON round trip of a mid-sized document."""
    json.loads(json.dumps(doc))


DOC = {"items": [{"id": i, "name": f"item {i}", "tags": ["a", "b", "c"], "price": i * 1.5} for i in range(300)]}


async def _application(kind: str, stop: asyncio.Event) -> int:
    """The application's own work on its event loop; returns the rounds it did."""
    rounds = 0
    while not stop.is_set():
        _json_work(DOC)
        rounds += 1
        if kind == "loop 13%":
            await asyncio.sleep(0.005)
        elif kind == "loop 40%":
            await asyncio.sleep(0.001)
        else:
            await asyncio.sleep(0)
    return rounds


async def _decode(engine, n: int, streams: int, limit: float) -> dict:
    from tieredkv import SamplingParams

    params = SamplingParams(max_tokens=n + 4, ignore_eos=True)
    stamps: list[list[float]] = [[] for _ in range(streams)]

    async def one(i: int):
        async for chunk in engine.stream([t + i for t in PROMPT], params):
            stamps[i].extend([time.perf_counter()] * len(chunk.token_ids))

    done, pending = await asyncio.wait([asyncio.ensure_future(one(i)) for i in range(streams)], timeout=limit)
    for task in pending:
        task.cancel()
    tokens = sum(len(s) for s in stamps)
    timed = [s[4:] for s in stamps if len(s) > 5]  # after the prompt and the first tokens
    ms = statistics.median((s[-1] - s[0]) / (len(s) - 1) * 1000 for s in timed) if timed else None
    return {"ms_per_token": ms, "tokens": tokens, "finished": not pending}


MODES = ("thread", "process", "process, cores not shared")


async def _run_case(case: str, mode: str, n: int, limit: float, quantization: str | None) -> dict:
    import torch

    from tieredkv import AsyncEngine, EngineConfig, SamplingParams

    if case == "torch op":
        torch.ones(1 << 22).sum()  # a parallel op: the main thread's OpenMP team now exists
    config = EngineConfig(core_process=mode != "thread", enable_prefix_caching=False, warm_bytes=0,
                          compile_in_background=False, share_cores=mode != "process, cores not shared",
                          quantization=quantization)
    t0 = time.perf_counter()
    engine = await AsyncEngine.start(config)
    started = time.perf_counter() - t0
    await engine.generate(PROMPT, SamplingParams(max_tokens=8))  # warm
    stop = asyncio.Event()
    app = asyncio.ensure_future(_application(case, stop)) if case.startswith("loop") else None
    out = await _decode(engine, n, 4 if case == "loop busy" else 1, limit)
    stop.set()
    if app is not None:
        out["app_rounds"] = await app
    out["step_threads"] = {k.split(": ", 1)[1]: v for k, v in engine.stats().kernel_calls.items()
                           if k.startswith("step threads")}  # steps per thread count (share_cores)
    await engine.close()
    return {**out, "start_s": started}


def _core_alone(n: int, quantization: str | None) -> dict:
    from tieredkv import EngineConfig, SamplingParams
    from tieredkv.engine.engine_core import EngineCore

    core = EngineCore(EngineConfig(core_process=False, enable_prefix_caching=False, warm_bytes=0,
                                   quantization=quantization, compile_in_background=False))
    for _ in range(2):
        req = core.factory.make(PROMPT, SamplingParams(max_tokens=n + 4, ignore_eos=True))
        req.sink = None
        core.add_request(req)
        stamps = []
        while core.has_work():
            if core.step():
                stamps.append(time.perf_counter())
    core.close()
    stamps = stamps[4:]
    return {"ms_per_token": (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000, "tokens": len(stamps),
            "finished": True}


def child(args) -> None:
    if args.case == "core alone":
        result = _core_alone(args.tokens, args.quantization)
    else:
        result = asyncio.run(_run_case(args.case, args.mode, args.tokens, args.limit, args.quantization))
    report(result)


def run_child(case: str, mode: str, args) -> dict:
    argv = ["--case", case, "--mode", mode, "--tokens", str(args.tokens), "--limit", str(args.limit)]
    if args.quantization:
        argv += ["--quantization", args.quantization]
    return child_run(__file__, argv, timeout=args.limit + 300)


def main(args) -> dict:
    from tieredkv.platform.cpu_features import cpu_info

    cases = [c for c in CASES[1:] if c in args.cases]
    runs = [("core alone", "thread")] + [(c, m) for c in cases for m in args.modes]
    rounds: dict[str, list[dict]] = {}
    for r in range(args.rounds):
        for case, mode in runs if r % 2 == 0 else reversed(runs):
            got = run_child(case, mode, args)
            rounds.setdefault(f"{case} | {mode}", []).append(got)
            print(f"round {r}: {case:10s} {mode:7s} {got}", flush=True)

    def median(key: str, field: str = "ms_per_token"):
        values = [g[field] for g in rounds.get(key, []) if g[field] is not None]
        return statistics.median(values) if values else None

    def best(key: str):  # this machine's speed drifts between two states: the fastest round shows the quiet one
        values = [g["ms_per_token"] for g in rounds.get(key, []) if g["ms_per_token"] is not None]
        return min(values) if values else None

    core, core_best = median("core alone | thread"), best("core alone | thread")
    table = {}
    for case in cases:
        for mode in args.modes:
            key = f"{case} | {mode}"
            ms, fastest = median(key), best(key)
            clean, clean_best = median(f"clean | {mode}"), best(f"clean | {mode}")
            table[key] = {"ms_per_token": ms, "vs_core_alone": ms / core if ms else None,
                          "vs_clean_same_mode": ms / clean if ms and clean else None,
                          "best_ms_per_token": fastest, "best_vs_core_alone": fastest / core_best if fastest else None,
                          "best_vs_clean_same_mode": fastest / clean_best if fastest and clean_best else None,
                          "tokens": median(key, "tokens"), "finished_all": all(g["finished"] for g in rounds[key]),
                          "start_s": median(key, "start_s")}
    result = {"machine": cpu_info().describe(None), "tokens": args.tokens, "rounds": args.rounds,
              "quantization": args.quantization,
              "core_alone_ms_per_token": core, "core_alone_best_ms_per_token": core_best, "cases": table,
              "raw": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=2))
    return save(result, args.out)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--limit", type=float, default=60.0, help="seconds a case may decode before it is cut off")
    p.add_argument("--out", default=None)
    p.add_argument("--cases", nargs="+", choices=CASES[1:], default=CASES[1:], help="the cases beside the core alone")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES[:2]))
    p.add_argument("--quantization", default=None, help='the weights (EngineConfig.quantization: "int8", "int4", '
                   '"gguf" for the default model\'s Q4_1 file); default fp32')
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    child(args) if args.case else main(args)
