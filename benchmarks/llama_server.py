"""llama.cpp's server beside the engine, as the benchmarks start it: on a free port, with the engine's thread
count and the given flags, ready once /health answers; stopped when the block ends."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess

import torch


@contextlib.asynccontextmanager
async def llama_server(binary: str, gguf: str, *flags: str, context: int = 8 * 2048, parallel: int = 8):
    """Yields (an aiohttp session, the server's base URL)."""
    import aiohttp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "-m", gguf, "-t", str(torch.get_num_threads()), "-c", str(context),
                             "--parallel", str(parallel), "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"{url}/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
            yield session, url
    finally:
        proc.terminate()
        proc.wait()


async def complete(session, url: str, prompt: list[int], n: int, **body) -> dict:
    """One /completion of `n` new tokens on a prompt of token ids, greedy, EOS ignored, nothing kept from an earlier
    request (cache_prompt off unless `body` says otherwise): the server's answer (tokens_predicted, timings)."""
    body = {"prompt": prompt, "n_predict": n, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False, **body}
    async with session.post(f"{url}/completion", json=body) as r:
        return await r.json()
