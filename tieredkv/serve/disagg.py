"""A prefill/decode split behind vllm-router's `--vllm-pd-disaggregation`, its KV carried by the shared tier.

The router sends a request first to a prefill replica with `kv_transfer_params: {"do_remote_decode": true, ...}`
and `max_tokens: 1`, then to a decode replica with the `kv_transfer_params` the prefill replica answered with.
Here the KV moves through the Valkey/Redis tier the replicas share (`remote_url`), in its own entry format and
MAC: the prefill replica computes the prompt, writes its full blocks through to the shared tier (those it lacks)
and answers once they are sent (at most `kv_transfer_timeout` seconds); the decode replica, given the answer,
waits (as long at most) until the shared tier holds the blocks still on their way, then serves the request,
whose prefix lookup reads them there like any other hit. A block that does not arrive in time is computed:
slower, never wrong, never stuck. Through a store both replicas already use, a transfer needs no connection
between replicas and survives either side's restart; NIXL-style direct transfers name a host and port instead.

sglang-router's `--pd-disaggregation` sends the same request to a prefill and a decode replica at once, with
`bootstrap_host`, `bootstrap_port` and `bootstrap_room` added. The same mechanism serves it, each replica told its
part by `--disaggregation-mode` (SGLang's flag): a prefill replica computes the prompt, writes it through and
answers with one token; a decode replica waits (at most `kv_transfer_timeout`) until the shared tier holds the
prompt's full blocks, then serves the request.
"""

from __future__ import annotations

import logging
from typing import Any

from tieredkv.config import SamplingParams
from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.serve.protocol import BadRequest

log = logging.getLogger("tieredkv.serve")

FIELD = "kv_transfer_params"
OURS = "tieredkv"  # our entry inside kv_transfer_params, beside vLLM's fields


def transfer_params(body: dict[str, Any]) -> dict[str, Any] | None:
    """The request's kv_transfer_params (None when absent); a value that is not an object is a 400."""
    value = body.get(FIELD)
    if value is not None and not isinstance(value, dict):
        raise BadRequest(f"{FIELD} must be a JSON object", FIELD)
    return value


def _root(engine: AsyncEngine) -> str:
    return engine.info.kv_root[:32]


async def before_decode(engine: AsyncEngine, ids: list[int], params: dict[str, Any], timeout: float,
                        chain: dict[str, str | None]) -> int:
    """On a decode replica: waits until the shared tier holds the blocks the prefill replica said it sent, at most
    `timeout` seconds. Parameters this engine cannot use (another engine's transfer, another model, values out of
    range) are logged and the prompt is computed. Returns the blocks found."""
    if not params.get("do_remote_prefill"):
        return 0
    ours = params.get(OURS)
    if not isinstance(ours, dict):
        log.info("%s without %r (another engine's transfer?): the prompt is computed", FIELD, OURS)
        return 0
    num_blocks = ours.get("num_blocks")
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
        log.warning("%s: num_blocks %r is not a count: the prompt is computed", FIELD, num_blocks)
        return 0
    if ours.get("root") != _root(engine):
        log.warning("%s: written for another model or cache layout (root %r, this engine's %s): the prompt is "
                    "computed", FIELD, ours.get("root"), _root(engine))
        return 0
    if not engine.info.shared_tier:
        log.warning("%s: this replica has no shared tier (remote_url) to read the prefill's blocks from: the "
                    "prompt is computed", FIELD)
        return 0
    num_blocks = min(num_blocks, len(ids) // engine.info.block_size)
    held = await engine.wait_shared(ids, num_blocks, timeout if not ours.get("ready") else 0.0, **chain)
    if held < num_blocks:
        log.info("%s: %d of %d prefilled blocks on the shared tier after %.1f s; the rest is computed", FIELD, held,
                 num_blocks, timeout)
    return held


MODES = ("null", "prefill", "decode")  # --disaggregation-mode, SGLang's values


def bootstrapped(body: dict[str, Any]) -> bool:
    """Whether sglang-router sent the request to a prefill/decode pair (it adds the bootstrap fields)."""
    return body.get("bootstrap_room") is not None


async def prefill_for_pair(engine: AsyncEngine, ids: list[int], timeout: float, chain: dict[str, str | None]) -> None:
    """sglang-router, on the prefill replica: the prompt computed and written through before it answers (`chain`:
    the request's adapter and cache_salt)."""
    await engine.generate(ids, SamplingParams(max_tokens=1), **chain)
    if not engine.info.shared_tier:
        log.warning("a prefill/decode pair's request, but this replica has no shared tier (remote_url) to leave the "
                    "KV on: the decode replica computes the prompt")
        return
    found, ready = await engine.share_prefix(ids, timeout, **chain)
    if not ready:
        log.warning("the shared tier took longer than %.1f s to receive the prompt's %d blocks", timeout, found)


async def decode_for_pair(engine: AsyncEngine, ids: list[int], timeout: float, chain: dict[str, str | None]) -> int:
    """sglang-router, on the decode replica: waits until the shared tier holds the prompt's full blocks (those a
    lookup may cover), at most `timeout` seconds; what has not arrived is computed."""
    if not engine.info.shared_tier:
        log.warning("a prefill/decode pair's request, but this replica has no shared tier (remote_url) to read the "
                    "prefill's blocks from: the prompt is computed")
        return 0
    want = (len(ids) - 1) // engine.info.block_size
    held = await engine.wait_shared(ids, want, timeout, **chain)
    if held < want:
        log.info("a prefill/decode pair's request: %d of %d prompt blocks on the shared tier after %.1f s; the rest "
                 "is computed", held, want, timeout)
    return held


async def after_prefill(engine: AsyncEngine, ids: list[int], timeout: float,
                        chain: dict[str, str | None]) -> dict[str, Any] | None:
    """On a prefill replica: writes the prompt's blocks through to the shared tier and returns the
    kv_transfer_params for the decode replica (None without a shared tier: the decode replica computes)."""
    if not engine.info.shared_tier:
        log.warning("%s asked for a remote decode, but this replica has no shared tier (remote_url) to leave the "
                    "KV on: the decode replica computes the prompt", FIELD)
        return None
    found, ready = await engine.share_prefix(ids, timeout, **chain)
    if not ready:
        log.warning("%s: the shared tier took longer than %.1f s to receive the prompt's blocks; the decode replica "
                    "waits for them as long, then computes what is missing", FIELD, timeout)
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None,
            OURS: {"via": "shared_tier", "num_blocks": found, "block_size": engine.info.block_size,
                   "root": _root(engine), "ready": ready}}
