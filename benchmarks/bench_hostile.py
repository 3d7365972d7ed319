"""`tieredkv serve` under hostile clients and container life, as a subprocess on the default model:

1. a small chat request alone, then sent right after three oversized ones (a 7 MB role each, under the
   8 MiB body limit), then right after three that are just under the engine's character limit (they are
   tokenized, then refused for their token count): the small request's time in each case, as a ratio
   to its time alone;
2. SIGTERM with 32 streams in flight: time to exit, how the streams ended, the exit code, and the
   cached prompt blocks lost (each prompt asked again of a fresh engine on the same cold store: blocks
   not served from cold).

    .venv/bin/python benchmarks/bench_hostile.py
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from tieredkv import AsyncEngine, EngineConfig, SamplingParams

SMALL = {"model": "default", "messages": [{"role": "user", "content": "Say hello in five words."}],
         "max_tokens": 16, "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(port: int, cold: Path, key_home: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "tieredkv", "serve", "--port", str(port), "--cold-path", str(cold),
                             "--shutdown-grace", "30"], env={**os.environ, "XDG_CONFIG_HOME": str(key_home)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "serving" in line:
            return proc
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


async def timed(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as r:
        await r.read()
        return time.perf_counter() - t0, r.status


async def small_behind(session, url, flood: list[dict] | None) -> tuple[float, list]:
    """The small request's time, sent 0.1 s after the flood (if any), and the flood's (time, status)."""
    if flood is None:
        return (await timed(session, url, SMALL))[0], []
    floods = [asyncio.create_task(timed(session, url, body)) for body in flood]
    await asyncio.sleep(0.1)
    small, _ = await timed(session, url, SMALL)
    return small, await asyncio.gather(*floods)


async def fairness(base: str) -> None:
    url = base + "/v1/chat/completions"
    rng = random.Random(0)
    words = ["lamp", "river", "quiet", "seven", "orbit", "paper", "field", "glass"]
    near = " ".join(rng.choice(words) for _ in range(45_000))  # ~250k characters: under the character limit
    oversized = [{**SMALL, "messages": [{"role": "x" * 7_000_000, "content": "hi"}]} for _ in range(3)]
    tokenized = [{**SMALL, "messages": [{"role": "user", "content": near + str(i)}]} for i in range(3)]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await small_behind(session, url, None)  # warm
        alone = min([(await small_behind(session, url, None))[0] for _ in range(3)])
        print(f"small request alone: {alone:.2f} s")
        for name, flood in (("3 oversized roles (7 MB)", oversized), ("3 prompts just under the limit", tokenized)):
            small, floods = await small_behind(session, url, flood)
            print(f"behind {name}: small {small:.2f} s = {small / alone:.2f}x alone; theirs: "
                  + ", ".join(f"{status} in {t:.2f} s" for t, status in floods))


async def shutdown(base: str, proc: subprocess.Popen) -> list[list[int]]:
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randrange(64, 160))] for _ in range(32)]
    ends: dict[str, int] = {}

    async def one(session, prompt):
        body = {"model": "default", "prompt": prompt, "max_tokens": 32, "ignore_eos": True, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as r:
            text = (await r.read()).decode()
        kind = ("finished" if '"finish_reason": "length"' in text else "error event" if '"error"' in text
                else "cut")
        ends[kind] = ends.get(kind, 0) + 1

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = [asyncio.create_task(one(session, p)) for p in prompts]
        await asyncio.sleep(2.0)  # all admitted, some mid-decode
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*tasks)
        code = await asyncio.to_thread(proc.wait, 120)
        print(f"SIGTERM with 32 streams in flight: exit {code} after {time.perf_counter() - t0:.2f} s; streams: "
              + ", ".join(f"{n} {kind}" for kind, n in sorted(ends.items())))
    return prompts


async def lost(cold: Path, key: Path, prompts: list[list[int]]) -> None:
    config = EngineConfig(cold_path=str(cold), cold_secret_path=str(key), warm_bytes=0, compile_decode=False)
    async with await AsyncEngine.start(config) as engine:
        expected = found = 0
        for p in prompts:
            out = await engine.generate(p, SamplingParams(max_tokens=1))
            expected += (len(p) - 1) // 16
            found += out.usage.cached_tokens_by_tier.get("cold", 0) // 16
    print(f"prompt blocks cached before SIGTERM: {expected}; served from cold after: {found}; lost: {expected - found}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        port = free_port()
        proc = start(port, tmp / "cold", tmp)
        try:
            base = f"http://127.0.0.1:{port}"
            asyncio.run(fairness(base))
            prompts = asyncio.run(shutdown(base, proc))
        finally:
            if proc.poll() is None:
                proc.kill()
        asyncio.run(lost(tmp / "cold", tmp / "tieredkv" / "cold.key", prompts))


if __name__ == "__main__":
    main()
