"""Replicas behind a router from PyPI, against one replica: a trace of chats over several long system prompts,
sent through vllm-router with each policy; the share of prompt tokens served from the replicas' caches, and the
output throughput. `kv_aware` routes by the KV events the replicas publish (--kv-events-config). With --pd, also a
prefill/decode split (--vllm-pd-disaggregation, the KV through a shared Valkey server) against one replica doing
both: time to first token and each request's decode speed, streamed.

The replicas are `tieredkv serve` processes on loopback (one compute thread each, so that two fit two cores; the
single replica gets them all); the router is vllm-router (the `fleet` extra). All in one run, one after another.

    .venv/bin/python benchmarks/bench_fleet.py [--chats 64] [--systems 8] [--policies round_robin kv_aware] [--pd]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
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


def replica(port: int, model: str, threads: int, *extra: str) -> tuple[list[str], str, str]:
    cmd = [sys.executable, "-m", "tieredkv", "serve", "--model", model, "--port", str(port), "--served-model-name",
           NAME, "--num-threads", str(threads), "--max-num-seqs", "16", "--no-compile-decode", *extra]
    return cmd, f"http://127.0.0.1:{port}", f"replica :{port}"


def events_flag(port: int) -> list[str]:
    return ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": f"tcp://*:{port}"})]


def router_cmd(port: int, *args: str) -> tuple[list[str], str, str]:
    return ([sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(free_port()), *args], f"http://127.0.0.1:{port}", "vllm-router")


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


async def send_streams(url: str, chats: list[list[dict]], max_tokens: int, concurrency: int) -> dict:
    """Streamed: each request's time to first token and its decode speed after it (median over requests)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)
    ttfts, speeds, outputs = [], [], []

    async def one(messages):
        async with gate:
            t0 = time.perf_counter()
            first = last = None
            n = 0
            async for c in await client.chat.completions.create(model=NAME, messages=messages, temperature=0,
                                                                max_tokens=max_tokens, stream=True):
                if c.choices and c.choices[0].delta.content:
                    last = time.perf_counter()
                    first = first or last
                    n += 1
            ttfts.append(first - t0)
            if n > 1:
                speeds.append((n - 1) / (last - first))
            outputs.append(n)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(m) for m in chats))
    seconds = time.perf_counter() - t0
    await client.close()
    return {"seconds": round(seconds, 2), "ttft_median_s": round(statistics.median(ttfts), 4),
            "ttft_p90_s": round(sorted(ttfts)[int(0.9 * (len(ttfts) - 1))], 4),
            "decode_tokens_per_s_median": round(statistics.median(speeds), 1),
            "output_tokens_per_s": round(sum(outputs) / seconds, 1)}


async def pd_split(args, chats) -> dict:
    """One replica doing both, then a prefill and a decode replica behind vllm-router, sharing a Valkey server."""
    from tieredkv.tools.local_valkey import LocalValkey

    out = {}
    port = free_port()
    async with processes([replica(port, args.model, os.cpu_count() or 2)]):
        out["one replica"] = await send_streams(f"http://127.0.0.1:{port}", chats, args.pd_max_tokens,
                                                args.concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        server = LocalValkey(os.path.join(tmp, "valkey"), maxmemory="2gb", maxmemory_policy="allkeys-lru").start()
        try:
            shared = ["--remote-url", server.url, "--cold-secret-path", os.path.join(tmp, "fleet.key")]
            ports, router_port = [free_port(), free_port()], free_port()
            urls = [f"http://127.0.0.1:{q}" for q in ports]
            router = router_cmd(router_port, "--vllm-pd-disaggregation", "--prefill", urls[0], "--decode", urls[1],
                                "--policy", "round_robin")
            async with processes([replica(q, args.model, 1, *shared) for q in ports] + [router]):
                out["prefill + decode replicas"] = await send_streams(router[1], chats, args.pd_max_tokens,
                                                                      args.concurrency)
        finally:
            server.stop()
    return out


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware", "power_of_two"])
    p.add_argument("--warmed", nargs="*", default=["cache_aware", "kv_aware"],
                   help="policies also run after each system prompt was asked once directly of one replica, "
                   "alternating (traffic the router did not route: another router, a restart)")
    p.add_argument("--pd", action="store_true", help="also the prefill/decode split against one replica")
    p.add_argument("--pd-chats", type=int, default=16)
    p.add_argument("--pd-max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    chats = trace(args.chats, args.systems, args.seed)
    results = {}
    port = free_port()
    async with processes([replica(port, args.model, os.cpu_count() or 2)]):
        results["one replica"] = await send(f"http://127.0.0.1:{port}", chats, args.max_tokens, args.concurrency)
    runs = [(policy, False) for policy in args.policies] + [(policy, True) for policy in args.warmed]
    for policy, warmed in runs:
        ports, event_ports = [free_port(), free_port()], [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{q}" for q in ports]
        kv = policy == "kv_aware"
        events = [a for u, e in zip(urls, event_ports) for a in ("--kv-event-source", f"{u}=tcp://127.0.0.1:{e}")]
        router = router_cmd(free_port(), "--worker-urls", *urls, "--policy", policy,
                            *(["--kv-event-model", NAME, *events] if kv else []))
        async with processes([replica(q, args.model, 1, *(events_flag(e) if kv else []))
                              for q, e in zip(ports, event_ports)] + [router]):
            await asyncio.sleep(1.0)  # (kv_aware: the router's subscriptions join)
            if warmed:
                systems = list(dict.fromkeys(c[0]["content"] for c in chats))
                for i, system in enumerate(systems):
                    first = [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]
                    await send(urls[i % 2], [first], 1, 1)
                await asyncio.sleep(0.5)
            name = f"2 replicas, {policy}" + (", warmed directly" if warmed else "")
            results[name] = await send(router[1], chats, args.max_tokens, args.concurrency)
    base = results["one replica"]["output_tokens_per_s"]
    print(f"{args.chats} chats over {args.systems} system prompts, max_tokens {args.max_tokens}, "
          f"concurrency {args.concurrency}, model {args.model}")
    print(f"{'setup':<44} {'cached share':>12} {'output tok/s':>13} {'vs one':>7}")
    for name, r in results.items():
        print(f"{name:<44} {r['cached_share']:>12.1%} {r['output_tokens_per_s']:>13.1f} "
              f"{r['output_tokens_per_s'] / base:>6.2f}x")
    pd = None
    if args.pd:
        pd_chats = trace(args.pd_chats, args.pd_chats, args.seed + 1)  # every prompt new: all of it is prefilled
        pd = await pd_split(args, pd_chats)
        base = pd["one replica"]
        print(f"\nprefill/decode split: {args.pd_chats} chats, each a new system prompt, max_tokens "
              f"{args.pd_max_tokens}, concurrency {args.concurrency}, streamed")
        print(f"{'setup':<28} {'TTFT median':>12} {'TTFT p90':>9} {'decode tok/s':>13} {'output tok/s':>13}")
        for name, r in pd.items():
            print(f"{name:<28} {r['ttft_median_s']:>11.3f}s {r['ttft_p90_s']:>8.3f}s "
                  f"{r['decode_tokens_per_s_median']:>13.1f} {r['output_tokens_per_s']:>13.1f}")
        split = pd["prefill + decode replicas"]
        print(f"split vs one: TTFT {split['ttft_median_s'] / base['ttft_median_s']:.2f}x, decode "
              f"{split['decode_tokens_per_s_median'] / base['decode_tokens_per_s_median']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "pd_split": pd}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
