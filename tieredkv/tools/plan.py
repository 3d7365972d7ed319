"""Capacity planning before deployment: how many KV blocks each tier holds for a model on a machine, how
many sequences run before preemption, how many shared prompts each tier keeps. Exact arithmetic from
the checkpoint's config and tensor headers (no weights are read); `profile` measures one forward."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import torch

from tieredkv.config import EngineConfig
from tieredkv.core.far_blocks import far_policy
from tieredkv.core.kv_manager import cdiv
from tieredkv.engine.identity import model_fingerprint
from tieredkv.engine.resolve import max_model_len, quant_settings, resolve_dtype, resolve_kv_layout, resolve_model_dir
from tieredkv.engine.sizing import kv_block_bytes, kv_pool_bytes, kv_token_bytes, warm_blocks
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.kernels.quant import quantized_bytes
from tieredkv.models.checks import tensor_shapes
from tieredkv.models.gguf_convert import gguf_weight_bytes
from tieredkv.models.loader import QuantSettings, weight_files
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_shard import Shard, check_shardable
from tieredkv.platform.malloc_tuning import process_status_bytes
from tieredkv.runner.far_stage import staging_bytes
from tieredkv.tiers.cold_format import ColdFormat
from tieredkv.tiers.cold_txn import disk_cost
from tieredkv.tools.config_flags import parse_bytes  # noqa: F401 (the command line's sizes, also for plan's callers)


@dataclass(frozen=True)
class Plan:
    """What `plan` computed: the weights, the KV per token and per block, and what each tier holds.

    Attributes:
        model: the checkpoint directory's name.
        dtype: the dtype of activations (and of KV with kv_cache_dtype "auto").
        kv_format: how the cache stores K and V (EngineConfig.kv_cache_dtype, kernels/kv_format.py).
        weights: the weights' format: the dtype, or the quantization.
        block_size: tokens per KV block.
        max_model_len: the longest sequence the engine would accept.
        weight_bytes: the weights' bytes in that format.
        kv_bytes_per_token: K and V of one token over every layer.
        kv_bytes_per_block: the same for one block.
        device_memory: the memory the plan divides (the device's, or the machine's on CPU).
        memory_utilization: CUDA: the share of `device_memory` for weights, activations and the hot pool.
        activation_bytes: reserved for one step's activations (estimated, or measured with `--profile`).
        hot_blocks: blocks of the hot pool, as `AsyncEngine.start` would size it.
        warm_blocks: blocks the warm tier holds.
        cold_blocks: blocks the cold tier's byte budget holds, LMDB pages and headers counted.
        seq_len: the sequence length the next two figures are for.
        seqs_before_preemption: sequences of `seq_len` tokens that fit the hot pool at once.
        seqs_with_offload: the same when their older blocks move to the warm tier (`offload` on).
        longest_sequence: the most tokens one sequence can hold: `max_model_len`, or hot and warm together if
            fewer.
        shared_prompt_len: the shared-prompt length the next figure is for.
        shared_prompts: per tier, the distinct shared prompts of `shared_prompt_len` tokens it keeps.
        measured: whether `activation_bytes` was measured by a forward rather than estimated.
        device: the device type planned for ("cpu" or "cuda").
        staging_bytes: CUDA with far blocks (offload and a warm tier): device memory left beside the hot pool
            for staging them, a layer at a time with the next read ahead (`sizing.kv_pool_bytes`).
        tensor_parallel_size: the processes the model is split across.
        rank_weight_bytes: each rank's share of `weight_bytes`, rank order (one entry without tensor parallelism).
        rank_kv_bytes_per_block: each rank's share of a KV block (its KV heads), rank order.
    """

    model: str
    dtype: str
    weights: str  # the weights' format: the dtype, or the quantization
    block_size: int
    max_model_len: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    device_memory: int
    memory_utilization: float
    activation_bytes: int  # reserved for one step's activations (estimated, or measured with profile)
    hot_blocks: int
    warm_blocks: int
    cold_blocks: int
    seq_len: int
    seqs_before_preemption: int  # sequences of seq_len tokens that fit the hot pool at once
    seqs_with_offload: int  # ... when their older blocks move to the warm tier (offload on)
    longest_sequence: int  # the most tokens one sequence can hold: max_model_len, or hot + warm if fewer
    shared_prompt_len: int
    shared_prompts: dict  # tier -> distinct shared prompts of shared_prompt_len tokens it keeps
    measured: bool = False
    device: str = "cpu"
    staging_bytes: int = 0
    tensor_parallel_size: int = 1
    rank_weight_bytes: list = field(default_factory=list)
    rank_kv_bytes_per_block: list = field(default_factory=list)
    kv_format: str = "float32"

    @property
    def tokens(self) -> dict[str, int]:
        """Tokens each tier holds ("hot", "warm", "cold")."""
        return {t: n * self.block_size for t, n in
                (("hot", self.hot_blocks), ("warm", self.warm_blocks), ("cold", self.cold_blocks))}

    def as_dict(self) -> dict:
        """Every field and `tokens`, as `tieredkv plan --json` prints them."""
        return {**asdict(self), "tokens": self.tokens}


def device_memory(device: str) -> int:
    """The accelerator's memory on CUDA, the machine's RAM elsewhere."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(spec: ModelSpec, shapes: dict[str, tuple[int, ...]], itemsize: int,
                 quant: QuantSettings | None, shard: Shard = Shard()) -> int:
    """The weights' bytes in the format the engine would hold them: quantized projections and LM head (int8
    for int4's head too, as the loader does), everything else at `itemsize`; the GGUF file's own blocks.
    With `shard`, that tensor-parallel rank's part (models/tp_shard.py)."""
    if quant is not None and quant.scheme == "gguf":
        return gguf_weight_bytes(quant.gguf_path, itemsize, spec.tie_word_embeddings, quant.cache_dir)
    head = "embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    total = 0
    for name, shape in shapes.items():
        if spec.tie_word_embeddings and name.startswith("lm_head."):
            continue
        shape = shard.shape(name, shape, spec)
        if quant is not None and len(shape) == 2 and (name.endswith("proj.weight") or name == head):
            total += quantized_bytes("int8" if name == head else quant.scheme, *shape, quant.group_size)
        else:
            total += torch.Size(shape).numel() * itemsize
    return total


def estimate_activations(spec: ModelSpec, tokens: int, seqs: int, itemsize: int) -> int:
    """A step's peak activations: one layer's widest tensors for `tokens` tokens, plus fp32 logits."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    per_token = (2 * spec.hidden_size + q + 2 * kv + 3 * spec.intermediate_size) * itemsize
    return tokens * per_token + seqs * spec.vocab_size * 4


def plan(model: str = "default", device: str = "auto", device_memory_bytes: int | None = None,
         memory_utilization: float = 0.9, dtype: str = "auto", block_size: int = 16,
         max_len: int | None = None, warm_bytes: int | None = None, cold_bytes: int = 0, seq_len: int = 4096,
         shared_prompt_len: int = 1024, max_num_batched_tokens: int = 1024, max_num_seqs: int = 64,
         activation_bytes: int | None = None, cpu_kv_cache_bytes: int | None = None,
         quantization: str | None = None, quantization_group_size: int = 32, tensor_parallel_size: int = 1,
         kv_cache_dtype: str = "auto") -> Plan:
    """Plans a deployment from the checkpoint's config.json and tensor headers, without loading weights. The hot
    pool is sized by the engine's own function (`sizing.kv_pool_bytes`) with the engine's defaults, so on a
    machine the plan's `hot_blocks` is what `AsyncEngine.start` builds there.

    Args:
        model, dtype, block_size, warm_bytes, max_num_seqs, cpu_kv_cache_bytes, quantization,
            quantization_group_size, tensor_parallel_size: as the `EngineConfig` fields of those names (under
            tensor parallelism on CUDA the pool is sized on rank 0's device, which holds the largest share).
        max_len, memory_utilization: as `EngineConfig.max_model_len` and `.gpu_memory_utilization`.
        device: "auto" (CUDA when available, as the engine), "cpu", "cuda" or "cuda:N".
        device_memory_bytes: the memory to plan for (another card than this machine's, say); None: this
            machine's device memory, or its RAM on CPU.
        cold_bytes: the cold tier's disk budget (0: no cold tier).
        seq_len, shared_prompt_len: the sequence length to count concurrent sequences for, and the shared-prompt
            length to count distinct cached prompts for.
        max_num_batched_tokens: as `EngineConfig.max_num_batched_tokens` (sizes the activations).
        activation_bytes: one step's activations, measured (`profile_activations`); None: estimated.

    Raises:
        ModelNotFoundError: the model cannot be found.
    """
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device  # as the engine
    model_dir = resolve_model_dir(model)
    cfg = EngineConfig(model=model, dtype=dtype, block_size=block_size, max_model_len=max_len, warm_bytes=warm_bytes,
                       gpu_memory_utilization=memory_utilization, max_num_seqs=max_num_seqs,
                       cpu_kv_cache_bytes=cpu_kv_cache_bytes, quantization=quantization,
                       quantization_group_size=quantization_group_size, tensor_parallel_size=tensor_parallel_size,
                       kv_cache_dtype=kv_cache_dtype)
    return _plan(cfg, model_dir, device, device_memory_bytes, activation_bytes, max_num_batched_tokens, cold_bytes,
                 seq_len, shared_prompt_len)


def _plan(cfg: EngineConfig, model_dir, device: str, memory: int | None, activation_bytes: int | None,
          max_num_batched_tokens: int, cold_bytes: int, seq_len: int, shared_prompt_len: int) -> Plan:
    spec = ModelSpec.from_file(model_dir / "config.json")
    block_size, max_num_seqs, tp_size = cfg.block_size, cfg.max_num_seqs, cfg.tensor_parallel_size
    torch_dtype = resolve_dtype(cfg.dtype, torch.device(device))
    quant = quant_settings(cfg, model_dir)
    kv = resolve_kv_layout(cfg, spec, torch_dtype, torch.device("cuda" if device.startswith("cuda") else "cpu"))
    weights, rank_weights, rank_blocks = _rank_shares(spec, model_dir, torch_dtype, quant, block_size, tp_size, kv)
    memory = memory if memory is not None else device_memory(device)
    measured = activation_bytes is not None
    if activation_bytes is None:
        activation_bytes = estimate_activations(spec, max_num_batched_tokens, max_num_seqs, torch_dtype.itemsize)
    per_token, per_block = kv_token_bytes(spec, kv), kv_block_bytes(spec, block_size, kv)
    hot, staged = _hot_blocks(cfg, spec, torch.device(device), memory, activation_bytes, weights, rank_weights,
                              rank_blocks, kv)
    warm, cold = warm_blocks(cfg, spec, kv), _cold_blocks(spec, model_dir, torch_dtype, quant, block_size, cold_bytes,
                                                          kv)
    prompt_blocks, limit = max(shared_prompt_len // block_size, 1), max_model_len(spec, cfg.max_model_len)
    return Plan(
        model=model_dir.name, dtype=str(torch_dtype).removeprefix("torch."),
        weights=str(torch_dtype).removeprefix("torch.") if quant is None else quant.label, block_size=block_size,
        max_model_len=limit, weight_bytes=weights, kv_bytes_per_token=per_token,
        kv_bytes_per_block=per_block, device_memory=memory, memory_utilization=cfg.gpu_memory_utilization,
        activation_bytes=activation_bytes, hot_blocks=hot, warm_blocks=warm, cold_blocks=cold,
        seq_len=seq_len, seqs_before_preemption=hot // cdiv(seq_len, block_size),
        seqs_with_offload=min((hot + warm) // cdiv(seq_len, block_size), hot),
        longest_sequence=min(limit, (hot + warm) * block_size), shared_prompt_len=shared_prompt_len,
        shared_prompts={t: n // prompt_blocks for t, n in (("hot", hot), ("warm", warm), ("cold", cold))},
        measured=measured, device=torch.device(device).type,
        staging_bytes=staging_bytes(hot, per_block, staged),
        tensor_parallel_size=tp_size, rank_weight_bytes=rank_weights, rank_kv_bytes_per_block=rank_blocks,
        kv_format=kv.label)


def _rank_shares(spec: ModelSpec, model_dir, dtype: torch.dtype, quant, block_size: int,
                 tp_size: int, kv: KVLayout) -> tuple[int, list[int], list[int]]:
    """The weights' bytes, each rank's share of them and each rank's bytes of one KV block."""
    shapes = tensor_shapes(weight_files(model_dir))
    weights = weight_bytes(spec, shapes, dtype.itemsize, quant)
    if tp_size > 1:
        check_shardable(spec, tp_size)
    shards = [Shard(r, tp_size) for r in range(tp_size)]
    rank_weights = [weight_bytes(spec, shapes, dtype.itemsize, quant, s) for s in shards] if tp_size > 1 else [weights]
    per_block = kv_block_bytes(spec, block_size, kv)
    return weights, rank_weights, [per_block * n // spec.num_kv_heads for n in shards[0].sizes(spec.num_kv_heads)]


def _hot_blocks(cfg: EngineConfig, spec: ModelSpec, device: torch.device, memory: int, activation_bytes: int,
                weights: int, rank_weights: list[int], rank_blocks: list[int], kv: KVLayout) -> tuple[int, int]:
    """The hot pool's blocks by the engine's own arithmetic (build._build), and the layers staged far blocks
    reserve (0 when none): on CUDA rank 0's device, its weights and its share of each block; on CPU one
    machine's memory for every rank, whole blocks."""
    per_token, per_block = kv_token_bytes(spec, kv), kv_block_bytes(spec, cfg.block_size, kv)
    staged = far_policy(cfg.offload, device.type, warm_blocks(cfg, spec, kv)).staged_layers(spec.num_layers)
    limit = max_model_len(spec, cfg.max_model_len)
    if device.type == "cuda":
        pool = kv_pool_bytes(cfg, device.type, memory, rank_weights[0] + activation_bytes,
                             per_token * rank_blocks[0] // per_block, limit, staged)
        return max(pool, 0) // rank_blocks[0], staged
    pool = kv_pool_bytes(cfg, device.type, memory, weights + activation_bytes, per_token, limit, staged)
    return max(pool, 0) // per_block, staged


def _cold_blocks(spec: ModelSpec, model_dir, dtype: torch.dtype, quant, block_size: int, cold_bytes: int,
                 kv: KVLayout) -> int:
    """Blocks a cold budget holds, each entry its header (the fingerprint's length) and payload on disk."""
    block_shape = (spec.num_layers, 2, block_size, spec.num_kv_heads, kv.row)
    fingerprint = model_fingerprint(model_dir, dtype, block_size, quant, identity="0" * 64, kv=kv)  # (its length)
    return cold_bytes // disk_cost(ColdFormat.entry_bytes(block_shape, kv.storage_dtype, fingerprint, block_size))


def profile_activations(model: str, device: str, dtype: str, max_num_batched_tokens: int) -> int:
    """The dry run: one prefill forward of max_num_batched_tokens tokens on the real device, measuring
    the memory it needs beyond weights and KV: CUDA's peak allocation, or on Linux CPUs the growth of the
    resident set's high-water mark (reset first through /proc/self/clear_refs). On CPU it runs in a
    fresh process: in one that has done other work, the forward's buffers may come from freed memory
    that is still resident, and the high-water mark would not move."""
    if not device.startswith("cuda"):
        code = ("import sys; from tieredkv.tools.plan import _profile_here; "
                "print(_profile_here(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))")
        out = subprocess.run([sys.executable, "-c", code, model, device, dtype, str(max_num_batched_tokens)],
                             check=True, capture_output=True, text=True).stdout
        return int(out.strip().splitlines()[-1])
    return _profile_here(model, device, dtype, max_num_batched_tokens)


def _profile_here(model: str, device: str, dtype: str, max_num_batched_tokens: int) -> int:
    from tieredkv.config import EngineConfig, SamplingParams
    from tieredkv.engine.engine_core import EngineCore

    blocks = cdiv(max_num_batched_tokens, 16) + 2
    core = EngineCore(EngineConfig(model=model, device=device, dtype=dtype, num_blocks=blocks,
                                   max_num_batched_tokens=max_num_batched_tokens, warm_bytes=0,
                                   compile_decode=False))  # a prefill is measured: nothing to compile
    ids = [(i * 7919) % (core.spec.vocab_size - 10) + 5 for i in range(max_num_batched_tokens)]
    core.add_request(core.factory.make(ids[:-1], SamplingParams(max_tokens=1)))
    if core.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(core.device)
        base = torch.cuda.memory_allocated(core.device)
        core.step()
        return torch.cuda.max_memory_allocated(core.device) - base
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = process_status_bytes("VmRSS")
    core.step()
    return max(process_status_bytes("VmHWM") - base, 0)


def format_plan(p: Plan) -> str:
    """The plan as `tieredkv plan` prints it: a table of tiers, then the sequences that fit."""
    gib = 2**30
    lines = [
        f"model {p.model}, {p.dtype}, KV as {p.kv_format}, block size {p.block_size}, "
        f"max_model_len {p.max_model_len:,}",
        f"weights            {p.weight_bytes / gib:10.2f} GiB ({p.weights})",
        f"KV per token       {p.kv_bytes_per_token / 1024:10.1f} KiB   "
        f"per block {p.kv_bytes_per_block / 2**20:.2f} MiB",
        f"device memory      {p.device_memory / gib:10.2f} GiB x {p.memory_utilization:.2f}" if p.device == "cuda"
        else f"hot pool           {p.hot_blocks * p.kv_bytes_per_block / gib:10.2f} GiB (max_num_seqs x max_model_len, "
             "at most 2 GiB)",
        f"activations        {p.activation_bytes / gib:10.2f} GiB ({'measured' if p.measured else 'estimated'})",
        *([f"far-block staging  {p.staging_bytes / gib:10.2f} GiB (two layers at a time, beside the hot pool)"]
          if p.staging_bytes else []),
        *[f"rank {r:<2} weights   {w / gib:10.2f} GiB   KV per block {b / 2**20:.2f} MiB"
          for r, (w, b) in enumerate(zip(p.rank_weight_bytes, p.rank_kv_bytes_per_block))
          if p.tensor_parallel_size > 1],
        "",
        f"{'tier':<8}{'blocks':>14}{'tokens':>16}{f'prompts of {p.shared_prompt_len}':>20}",
    ]
    for tier, tokens in p.tokens.items():
        blocks = getattr(p, f"{tier}_blocks")
        lines.append(f"{tier:<8}{blocks:>14,}{tokens:>16,}{p.shared_prompts[tier]:>20,}")
    lines += ["", f"sequences of {p.seq_len:,} tokens running at once before preemption: {p.seqs_before_preemption:,}"
              + (f", {p.seqs_with_offload:,} with their older blocks in warm" if p.warm_blocks else ""),
              f"longest sequence: {p.longest_sequence:,} tokens"]
    return "\n".join(lines)
