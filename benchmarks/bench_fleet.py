"""Replicas behind a router from PyPI, against one replica: a trace of chats over several long system prompts,
sent through vllm-router with each policy; the share of prompt tokens served from the replicas' caches, and the
output throughput.

The replicas are `tieredkv serve` processes on loopback (one compute thread each, so that two fit two cores; the
single replica gets them all); the router is vllm-router (the `fleet` extra). All in one run, one after another.

    .venv/bin/python benchmarks/bench_fleet.py [--chats 64] [--systems 8] [--policies round_robin cache_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import subprocess
import sys
import time

import aiohttp
import openai

NAME = "m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_up(url: str, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{what} exited: {proc.stdout.read().decode()[-2000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"{what} did not come up in {timeout:.0f} s")
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/v1/models") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)


@contextlib.asynccontextmanager
async def processes(cmds: list[tuple[list[str], str, str]]):
    """Starts each (command, url, name), waits until each answers, yields; then stops them all."""
    procs = []
    try:
        for cmd, url, what in cmds:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          env={**os.environ, "NO_COLOR": "1"}))
            await wait_up(url, procs[-1], what)
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
            p.stdout.close()


def replica(port: int, model: str, threads: int) -> tuple[list[str], str, str]:
    cmd = [sys.executable, "-m", "tieredkv", "serve", "--model", model, "--port", str(port), "--served-model-name",
           NAME, "--num-threads", str(threads), "--max-num-seqs", "16", "--no-compile-decode"]
    return cmd, f"http://127.0.0.1:{port}", f"replica :{port}"


def trace(chats: int, systems: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    topics = ["trains", "rivers", "bread", "castles", "comets", "violins", "glaciers", "bees", "ports", "maps"]
    prompts = [f"You are the assistant of a museum about {topics[i % len(topics)]} (wing {i}). " * 24
               for i in range(systems)]
    order = [i % systems for i in range(chats)]
    rng.shuffle(order)
    return [[{"role": "system", "content": prompts[i]}, {"role": "user", "content": f"Question {n}: what is new?"}]
            for n, i in enumerate(order)]


async def send(url: str, chats: list[list[dict]], max_tokens: int, concurrency: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    usage = []

    async def one(messages):
        async with gate:
            got = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                                       temperature=0)
            usage.append(got.usage)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(m) for m in chats))
    seconds = time.perf_counter() - t0
    await client.close()
    prompt = sum(u.prompt_tokens for u in usage)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usage)
    output = sum(u.completion_tokens for u in usage)
    return {"seconds": round(seconds, 2), "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_share": round(cached / prompt, 4), "output_tokens_per_s": round(output / seconds, 1)}


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "power_of_two"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    chats = trace(args.chats, args.systems, args.seed)
    results = {}
    port = free_port()
    async with processes([replica(port, args.model, os.cpu_count() or 2)]):
        results["one replica"] = await send(f"http://127.0.0.1:{port}", chats, args.max_tokens, args.concurrency)
    for policy in args.policies:
        ports = [free_port(), free_port()]
        router_port = free_port()
        router = ([sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port",
                   str(router_port), "--prometheus-port", str(free_port()), "--worker-urls",
                   *[f"http://127.0.0.1:{q}" for q in ports], "--policy", policy],
                  f"http://127.0.0.1:{router_port}", "vllm-router")
        async with processes([replica(q, args.model, 1) for q in ports] + [router]):
            results[f"2 replicas, {policy}"] = await send(router[1], chats, args.max_tokens, args.concurrency)
    base = results["one replica"]["output_tokens_per_s"]
    print(f"{args.chats} chats over {args.systems} system prompts, max_tokens {args.max_tokens}, "
          f"concurrency {args.concurrency}, model {args.model}")
    print(f"{'setup':<28} {'cached share':>12} {'output tok/s':>13} {'vs one':>7}")
    for name, r in results.items():
        print(f"{name:<28} {r['cached_share']:>12.1%} {r['output_tokens_per_s']:>13.1f} "
              f"{r['output_tokens_per_s'] / base:>6.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
