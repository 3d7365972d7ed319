"""Why a prompt would be served from where it would: for each of its blocks, the tier a request would
take it from, or the reason it would be computed. Reads every tier, changes none."""

from __future__ import annotations

from dataclasses import dataclass

from tieredkv.hashing import chain_keys, root_hash
from tieredkv.tiers.base import BlockKey


@dataclass(frozen=True)
class BlockReport:
    """One block of a prompt, as `AsyncEngine.explain` reports it.

    Attributes:
        index: the block's position in the prompt (0 first).
        start: its first token position.
        end: one past its last token position.
        source: where a request would take it from ("hot", "warm", "remote" or "cold"); None: it would be computed.
        reason: why it would be computed (never computed here, evicted, another fingerprint, ...).
    """

    index: int
    start: int  # token positions [start, end)
    end: int
    source: str | None  # "hot", "warm", "remote" or "cold": where a request would take it from; None: computed
    reason: str | None = None  # why it would be computed


def explain(core, token_ids: list[int]) -> list[BlockReport]:
    """One report per block of token_ids (the last one may be partial). Runs on the engine's worker."""
    bs = core.block_size
    keys = core.index.keys(token_ids)
    lookup = (len(token_ids) - 1) // bs  # full blocks a lookup may cover: never the last token
    reports, served = [], True
    for i, where in enumerate(core.index.where(keys, verify=True)):
        if not core.kv.enable_caching:
            source, reason = None, "prefix caching is off"
        elif i >= lookup:
            source, reason = None, "it holds the prompt's last token, which is always computed"
        elif not served:
            source, reason = None, "an earlier block is computed, and a prefix stops at its first miss" + (
                f" (this one is in {where})" if where else "")
        elif where is not None:
            source, reason = where, None
        else:
            source, reason = None, _why(core, keys, i)
        served = served and source is not None
        reports.append(BlockReport(i, i * bs, (i + 1) * bs, source, reason))
    reports = _load_or_recompute(core, reports)
    if len(token_ids) % bs:
        n = len(keys)
        reports.append(BlockReport(n, n * bs, len(token_ids), None, "a partial block is never cached"))
    return reports


def _load_or_recompute(core, reports: list[BlockReport]) -> list[BlockReport]:
    """The blocks a blocking tier (cold, remote) holds, computed instead where reading them is expected to take
    longer than computing them (tiers/rates.py), with both estimates in the reason."""
    blocking = [t.name for t in core.tiers.lower if t.blocking]
    below = [r for r in reports if r.source in blocking]
    if not below:
        return reports
    rates = core.tiers.rates
    tiers = list(dict.fromkeys(r.source for r in below))
    load, compute = rates.estimate(tiers, len(below))
    if not rates.skip(load, compute) or rates.probe_due(tiers[0]):
        return reports
    why = (f"reading {len(below)} blocks from {tiers[0]} would take {load:.2f} s (measured), computing them "
           f"{compute:.2f} s: they are computed")
    return [BlockReport(r.index, r.start, r.end, None, why) if r.source in blocking else r for r in reports]


def _why(core, keys: list[BlockKey], i: int) -> str:
    key = keys[i]
    cold = core.tiers.cold
    if cold is not None and cold.inspect_sync(key) == "failed":
        return "its cold entry failed authentication (damaged or changed), so it is not used"
    for tier in reversed([core.tiers.hot, *core.tiers.lower]):
        if tier.dropped(key.block_hash):
            refused = tier.refused_why(key.block_hash)
            if refused is not None:
                return f"{tier.name} did not admit it: {refused}"
            return f"it was evicted from {tier.name}, and no tier below kept it"
    if cold is not None:
        tokens = [t for k in keys[: i + 1] for t in k.token_ids]
        for fingerprint in cold.known_fingerprints():
            if fingerprint == core.fingerprint:
                continue
            other = _chain(core, fingerprint, tokens)
            if other is not None and cold.inspect_sync(other, fingerprint) == "ok":
                return f"it is stored under another fingerprint ({_difference(core.fingerprint, fingerprint)})"
    return "it was never computed here"


def _difference(ours: str, theirs: str) -> str:
    """What tells two fingerprints (identity.model_fingerprint) apart, in words."""
    def kv_format(fingerprint: str) -> str:
        part = next((p for p in fingerprint.split("|") if p.startswith("kv=")), None)
        return part[3:].split("/")[0] if part else "the compute dtype"

    if kv_format(ours) != kv_format(theirs):
        return f"its KV is stored as {kv_format(theirs)}; this engine stores {kv_format(ours)}"
    return "model, dtype, block size, layout or weights' quantization differ"


def _chain(core, fingerprint: str, tokens: list[int]) -> BlockKey | None:
    """The last full block's key under another fingerprint (its block size is part of it)."""
    try:
        bs = int(fingerprint.split("|bs=")[1].split("|")[0])
    except (IndexError, ValueError):
        return None
    keys = chain_keys(root_hash(fingerprint), tokens, bs)
    return keys[-1] if keys else None
