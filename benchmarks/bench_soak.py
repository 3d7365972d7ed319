"""Does memory level off? `tieredkv serve` on the default model under a fixed request mix for a long while, its
resident memory sampled throughout, then idle.

    .venv/bin/python benchmarks/bench_soak.py                     # 30 minutes of load, then 2 idle
    .venv/bin/python benchmarks/bench_soak.py --minutes 5 --out /tmp/soak.json

The server runs with a cold tier (a temporary folder), a small hot pool (--num-blocks, default 512: long prompts
evict, so blocks go down to warm and cold all along) and a warm tier of 256 MiB (--warm-mib), which fills within the
first minutes: what grows after that is not a tier filling up to its budget. Eight clients cycle through one mix,
each starting at another place in it: chat turns on a shared 1,000-token system prompt, long documents of their own
(~1,500 tokens), n=4 samples, beam search, json_schema, logprobs, streams the client drops after five chunks, and
refused requests. The server's resident memory (from /proc) is read every 5 s, anonymous (heap, tensors, the hot
pool and warm tier) and file-backed (the cold tier's LMDB pages, which the kernel may drop) apart, its cold tier
capped at 1 GiB (--cold-mib). The report, for each: at the start, after the first half, at the end of the load, its
least-squares slope over the second half (MiB per minute), its peak, and after the idle minutes; requests by kind
and outcome; with --out, every sample as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = (ROOT / "tieredkv" / "data" / "demo_system_prompt.txt").read_text()
WORDS = ("cache block tier page memory token prompt model answer engine request stream layer weight hash disk "
         "server client batch decode prefill queue thread kernel vector matrix").split()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "year": {"type": "integer"}},
          "required": ["city", "year"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) resident MiB: the heap, tensors and tiers in memory; the cold tier's LMDB pages."""
    fields = {}
    for line in open(f"/proc/{pid}/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return round(fields["RssAnon"], 1), round(fields["RssFile"], 1)


def document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def mix(rng: random.Random) -> list[tuple[str, dict, int]]:
    """(kind, body, chunks to read before dropping the stream or 0) for one pass of the mix."""
    chat = lambda q: [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]  # noqa: E731
    return [
        ("shared_chat", {"messages": chat(f"Question {rng.randrange(10**6)}: what is a {rng.choice(WORDS)}?"),
                         "max_tokens": 32, "stream": True}, 0),
        ("long_document", {"prompt": "Summarise: " + document(rng, 1200), "max_tokens": 16}, 0),
        ("n4_samples", {"prompt": document(rng, 60), "max_tokens": 24, "n": 4, "temperature": 0.8}, 0),
        ("beam_search", {"prompt": document(rng, 40), "max_tokens": 16, "use_beam_search": True, "best_of": 3,
                         "n": 2}, 0),
        ("json_schema", {"messages": chat("Name a city and a year, as JSON."), "max_tokens": 48,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "c",
                                                                                   "schema": SCHEMA}}}, 0),
        ("logprobs", {"prompt": document(rng, 80), "max_tokens": 16, "logprobs": 5}, 0),
        ("dropped_stream", {"prompt": document(rng, 100), "max_tokens": 200, "stream": True,
                            "ignore_eos": True}, 5),
        ("refused", {"prompt": document(rng, 10), "max_tokens": 4, "use_beam_search": True, "n": 2,
                     "length_penalty": 1100}, 0),
    ]


async def send(session: aiohttp.ClientSession, url: str, kind: str, body: dict, drop_after: int) -> str:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with session.post(url + path, json={"model": "default", **body}) as r:
        if drop_after:
            chunks = 0
            async for _ in r.content.iter_any():
                chunks += 1
                if chunks >= drop_after:
                    r.close()  # the client goes away mid-stream
                    return "dropped"
        text = await r.text()
        if r.status != 200:
            return f"http {r.status}"
        return "error event" if '"error"' in text else "ok"


async def client(i: int, url: str, deadline: float, outcomes: Counter) -> None:
    rng = random.Random(i)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        step = i
        while time.monotonic() < deadline:
            batch = mix(rng)
            kind, body, drop = batch[step % len(batch)]
            step += 1
            try:
                outcomes[(kind, await send(session, url, kind, body, drop))] += 1
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                outcomes[(kind, type(e).__name__)] += 1


async def sampler(pid: int, t0: float, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        samples.append((round(time.monotonic() - t0, 1), *rss_mib(pid)))
        try:
            await asyncio.wait_for(stop.wait(), 5)
        except asyncio.TimeoutError:
            pass


def slope(points: list[tuple[float, float]]) -> float:
    """Least squares, MiB per minute, over (seconds, MiB) points."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    return 60 * sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else 0.0


def at(samples, t: float, column: int) -> float:
    return min(samples, key=lambda s: abs(s[0] - t))[column]


def summary(samples, loaded_until: float, column: int, idle_minutes: float) -> dict:
    loaded = [s for s in samples if s[0] <= loaded_until]
    second_half = [(s[0], s[column]) for s in loaded if s[0] >= loaded_until / 2]
    return {"start": loaded[0][column], "first_half_end": at(loaded, loaded_until / 2, column),
            "load_end": loaded[-1][column], "peak": max(s[column] for s in loaded),
            "second_half_slope_mib_per_min": round(slope(second_half), 2),
            f"after_{idle_minutes:g}_idle_min": samples[-1][column]}


async def main(args) -> dict:
    port = free_port()
    folder = Path(tempfile.mkdtemp(prefix="soak-"))
    env = {**os.environ, "XDG_CONFIG_HOME": str(folder / "config")}
    server = subprocess.Popen([sys.executable, "-m", "tieredkv", "serve", "--port", str(port), "--cold-path",
                               str(folder / "cold"), "--num-blocks", str(args.num_blocks),
                               "--warm-bytes", str(args.warm_mib << 20), "--cold-bytes", str(args.cold_mib << 20)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in server.stdout:
        if "serving" in line:
            break
    else:
        raise SystemExit(f"the server did not start (exit {server.wait()})")
    drain = asyncio.get_running_loop().run_in_executor(None, lambda: [None for _ in server.stdout])
    url = f"http://127.0.0.1:{port}"
    outcomes: Counter = Counter()
    samples: list = []
    stop = asyncio.Event()
    t0 = time.monotonic()
    watch = asyncio.create_task(sampler(server.pid, t0, samples, stop))
    load_s = args.minutes * 60
    await asyncio.gather(*[client(i, url, t0 + load_s, outcomes) for i in range(args.clients)])
    loaded_until = time.monotonic() - t0
    await asyncio.sleep(args.idle_minutes * 60)
    stop.set()
    await watch
    server.terminate()
    server.wait(60)
    await drain
    shutil.rmtree(folder, ignore_errors=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    report = {
        "machine": f"{cpu}, {os.cpu_count()} cores", "minutes_of_load": round(loaded_until / 60, 1),
        "clients": args.clients, "num_blocks": args.num_blocks, "warm_mib": args.warm_mib, "cold_mib": args.cold_mib,
        "requests": sum(outcomes.values()),
        "outcomes": {f"{k} / {o}": n for (k, o), n in sorted(outcomes.items())},
        "rss_anon_mib": summary(samples, loaded_until, 1, args.idle_minutes),
        "rss_file_mib": summary(samples, loaded_until, 2, args.idle_minutes),
    }
    if args.out:
        Path(args.out).write_text(json.dumps({**report, "samples_s_anon_file_mib": samples}, indent=1))
    return report


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--idle-minutes", type=float, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--num-blocks", type=int, default=512)
    ap.add_argument("--warm-mib", type=int, default=256, help="the warm tier's budget: full within minutes, so "
                    "that what grows after it is not the tier filling")
    ap.add_argument("--cold-mib", type=int, default=1024, help="the cold tier's disk budget (its pages the process "
                    "maps count as file-backed resident memory)")
    ap.add_argument("--out", default=None)
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=1))
