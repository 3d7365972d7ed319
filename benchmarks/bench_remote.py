"""Two replicas sharing one Valkey server: time to first token on a 2,000-token system prompt that the
other replica computed, against a replica without the shared tier, in one run.

    .venv/bin/python benchmarks/bench_remote.py             # default model, 3 rounds
    .venv/bin/python benchmarks/bench_remote.py --rounds 1

Three `tieredkv serve` processes on this machine: A and B with `--remote redis://...` on one Valkey server
(started here, on loopback), C without. Each round has a system prompt of its own (~2,000 tokens): A answers
a first question on it (computing it, and writing its blocks to Valkey as they fill); then B and C answer a
second question on it, in alternating order. B finds the prompt in the remote tier (its usage says
"remote"), C computes it. Reported: TTFT of A, B, C per round, C/B (target >= 5x) and A/C (the cost of
writing the blocks out, which should be none: it happens behind the steps), and whether B's and C's greedy
answers are equal.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.resources import files
from pathlib import Path

import openai
import valkey

from tieredkv.tools.local_valkey import LocalValkey, free_port

QUESTIONS = ["How do I reset the charger after a power cut?", "Which batteries can be shipped by air?"]


def system_prompt(r: int) -> str:
    """~2,000 tokens: the demo's store manual twice, under a heading of the round's own (so that no block
    is shared with another round)."""
    manual = files("tieredkv").joinpath("data/demo_system_prompt.txt").read_text()
    return f"Store number {r * 7919 + 11}, branch manual, edition {r}.\n\n{manual}\n\nAppendix (repeated)\n\n{manual}"


def start_server(name: str, port: int, folder: Path, remote: str | None, key: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tieredkv", "serve", "--port", str(port), "--served-model-name", "default",
           "--no-compile-decode", "--cold-secret-path", str(key)]
    if remote:
        cmd += ["--remote", remote]
    log = open(folder / f"{name}.log", "w")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)


def wait_ready(proc: subprocess.Popen, name: str) -> None:
    for line in proc.stdout:
        if line.startswith("serving"):
            return
    raise RuntimeError(f"server {name} exited before it was ready (rc {proc.wait()})")


async def ask(client: openai.AsyncOpenAI, system: str, question: str) -> tuple[float, str, dict]:
    t0, first, text, usage = time.perf_counter(), None, [], None
    stream = await client.chat.completions.create(
        model="default", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=24, temperature=0.0, stream=True, stream_options={"include_usage": True})
    async for event in stream:
        if event.choices and event.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text.append(event.choices[0].delta.content)
        if event.usage is not None:
            usage = event.usage.model_dump()
    return first, "".join(text), usage


def wait_written(client: valkey.Valkey, settle: float = 0.5, limit: float = 60.0) -> int:
    """Waits until the number of keys on the server stops growing (A's write-behind has landed)."""
    deadline, last, since = time.monotonic() + limit, -1, time.monotonic()
    while time.monotonic() < deadline:
        n = client.dbsize()
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > settle:
            return n
        time.sleep(0.05)
    return last


async def main(args) -> None:
    import torch

    from tieredkv.platform.cpu_features import cpu_info

    machine = cpu_info().describe(torch.get_num_threads())
    folder = Path(tempfile.mkdtemp(prefix="tieredkv-bench-remote-"))
    key = folder / "fleet.key"
    print(f"machine: {machine}", flush=True)
    with LocalValkey(folder / "valkey", maxmemory="4gb", maxmemory_policy="allkeys-lru") as server:
        ports = {name: free_port() for name in "ABC"}
        procs = {name: start_server(name, ports[name], folder, server.url if name != "C" else None, key)
                 for name in "ABC"}
        try:
            for name, proc in procs.items():
                wait_ready(proc, name)
            clients = {n: openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="-", timeout=600)
                       for n, p in ports.items()}
            raw = valkey.Valkey.from_url(server.url)
            rows = []
            for r in range(args.rounds):
                system = system_prompt(r)
                ttft_a, _, usage_a = await ask(clients["A"], system, QUESTIONS[0])
                keys = wait_written(raw)
                order = "BC" if r % 2 == 0 else "CB"
                got = {n: await ask(clients[n], system, QUESTIONS[1]) for n in order}
                (ttft_b, text_b, usage_b), (ttft_c, text_c, _) = got["B"], got["C"]
                by_tier = usage_b["prompt_tokens_details"]["cached_tokens_by_tier"]
                rows.append(dict(round=r, prompt_tokens=usage_a["prompt_tokens"], keys=keys, ttft_a=ttft_a,
                                 ttft_b=ttft_b, ttft_c=ttft_c, b_by_tier=by_tier,
                                 equal=text_b == text_c))
                print(f"round {r}: prompt {usage_a['prompt_tokens']} tokens, {keys} keys on the server; TTFT A "
                      f"(computes, writes) {ttft_a:.2f} s, B (remote) {ttft_b:.3f} s, C (computes) {ttft_c:.2f} s;"
                      f" C/B {ttft_c / ttft_b:.1f}x, A/C {ttft_a / ttft_c:.2f}; B's cached tokens by tier "
                      f"{by_tier}; greedy answers equal: {text_b == text_c}", flush=True)
            raw.close()
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=60)
    ratio = statistics.median(r["ttft_c"] / r["ttft_b"] for r in rows)
    print(f"\nmedian TTFT ratio, without / with the shared tier: {ratio:.1f}x (target >= 5x); "
          f"median A/C {statistics.median(r['ttft_a'] / r['ttft_c'] for r in rows):.2f}; "
          f"greedy answers equal in every round: {all(r['equal'] for r in rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rounds": rows, "ratio": ratio}, indent=2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the rows here")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    asyncio.run(main(parser.parse_args()))
