"""Builds an engine's whole object graph from its config and checkpoint (`build_engine`), and the set-up
facts it derives on the way: device, dtype, sizes, fingerprint, tiers."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from tieredkv.core.block_pool import BlockPool
from tieredkv.cache_dir import default_cache_dir
from tieredkv.config import EngineConfig
from tieredkv.core.cache_index import CacheIndex
from tieredkv.core.hashing import root_hash
from tieredkv.core.kv_manager import KVCacheManager
from tieredkv.core.pins import PinTable
from tieredkv.errors import ModelNotFoundError
from tieredkv.core.scheduler import Scheduler
from tieredkv.kernels import KernelOps, select_kernels
from tieredkv.kernels.linear import graph_reads_packed, packed_range
from tieredkv.lifecycle import Lifecycle
from tieredkv.models.llama import LlamaModel
from tieredkv.kernels.quant import QuantizedWeight, gather_quantized_weights, tile_quantized_weights, use_cpu_kernels
from tieredkv.models.loader import QuantSettings, load_model
from tieredkv.models.tokenizer import Tokenizer
from tieredkv.request_factory import RequestFactory
from tieredkv.runner.compiled_decode import CompiledDecode, compile_wanted
from tieredkv.runner.native_decode import NativeDecode
from tieredkv.runner.malloc_tuning import (anonymous_memory, collapse_into_huge_pages, process_status_bytes,
                                           release_free_memory, tune_glibc_malloc)
from tieredkv.runner.model_runner import ModelRunner
from tieredkv.telemetry import Telemetry
from tieredkv.models.files import check_regular_files, read_json
from tieredkv.models.gguf_convert import default_gguf_path, default_model_dir
from tieredkv.models.digest import weights_digest
from tieredkv.models.loader import weight_files
from tieredkv.models.spec import ModelSpec
from tieredkv.parallel.group import TPGroup
from tieredkv.parallel.shard import check_shardable
from tieredkv.tiers.hot import HotTier, ShardedHotTier
from tieredkv.tiers.manager import TierManager
from tieredkv.tiers.warm import ShardedWarmTier, WarmTier

log = logging.getLogger("tieredkv")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_LAYOUT = "L2NBHD"  # kv_cache[layer, k|v, block, slot, kv_head, dim]


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} but CUDA is not available")
    return device


BF16_CAPABILITY = (8, 0)  # Ampere: the first compute capability with native bf16 tensor cores


def resolve_dtype(name: str, device: torch.device, capability: tuple[int, int] | None = None) -> torch.dtype:
    """The dtype "auto" means: float32 on CPU; on CUDA bfloat16 from compute capability 8.0, float16 below it
    (T4, V100 emulate bf16). `capability` defaults to the device's own, or to 8.0 where no CUDA device is
    present (planning for a card this machine does not have)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type != "cuda":
        return torch.float32
    if capability is None:
        capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else BF16_CAPABILITY
    return torch.bfloat16 if tuple(capability) >= BF16_CAPABILITY else torch.float16


WARM_CAP = 4 << 30  # the default warm tier's most bytes
CPU_POOL_CAP = 2 << 30  # the default CPU hot pool's most bytes (and at most an eighth of the memory)


def default_warm_bytes() -> int:
    """10% of the memory available now, at most WARM_CAP."""
    return _share_of_memory("SC_AVPHYS_PAGES")


def _share_of_memory(pages: str, part: int = 10) -> int:
    """1/part of the memory sysconf counts in `pages` (available, or physical), at most WARM_CAP."""
    try:
        memory = os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return min(memory // part, WARM_CAP)


def resolve_cache_dir(cfg: EngineConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def resolve_model_dir(model: str, cache_dir: Path | None = None) -> Path:
    """"default" (the converted default model under cache_dir), a local checkpoint directory, or a Hugging Face
    repo id (models/hub.py). A name that starts like a path (/, ., ~) is never looked up on the hub."""
    if model == "default":
        return default_model_dir(cache_dir)
    path = Path(model).expanduser()
    if not path.is_dir():
        if model.startswith(("/", ".", "~")):
            raise ModelNotFoundError(f"model {model!r}: there is no such directory")
        from tieredkv.models.hub import resolve_hub_model

        path = resolve_hub_model(model)
    check_regular_files(path)
    return path


def max_model_len(spec: ModelSpec, wanted: int | None) -> int:
    limit = spec.max_position_embeddings
    if spec.sliding_window is not None:
        limit = min(limit, spec.sliding_window)
    if wanted is not None and wanted > limit:
        raise ValueError(f"max_model_len={wanted} exceeds what the model supports ({limit})")
    return wanted or limit


def eos_token_ids(spec: ModelSpec, model_dir: Path, tokenizer_eos: int | None) -> frozenset[int]:
    ids = set(spec.eos_token_ids)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = read_json(gen).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)


STAGE_RESERVE = 4  # staging far blocks takes up to this many layers' worth of the hot pool (far_stage.py)


def kv_pool_bytes(cfg: EngineConfig, device_type: str, total: int = 0, used: int = 0, token_bytes: int = 0,
                  max_len: int = 0, staged_layers: int = 0) -> int:
    """The hot pool's bytes, for the engine and `tieredkv plan` alike: kv_cache_bytes when given; on CUDA
    gpu_memory_utilization of the device's `total` memory less what is `used` (weights, and what else
    the engine measured or the plan estimated), less the staging buffers when far blocks are staged
    (`staged_layers`: the model's layers; 0 when they are not); elsewhere cpu_kv_cache_bytes, or room for
    max_num_seqs sequences of `max_len` tokens of `token_bytes` each, at most CPU_POOL_CAP and an eighth
    of the memory.

    Staging (far_stage.py) holds two buffers of one layer each (the layer computing and the next one,
    whose far blocks are read ahead), each at most a pool's worth of hot blocks and as many far ones, so
    STAGE_RESERVE layers of the pool in all. The pool takes what leaves room for them:
    budget * layers / (layers + STAGE_RESERVE)."""
    if cfg.kv_cache_bytes is not None:
        return cfg.kv_cache_bytes
    if device_type == "cuda":
        budget = int(total * cfg.gpu_memory_utilization) - used
        if staged_layers and budget > 0:
            return budget * staged_layers // (staged_layers + STAGE_RESERVE)
        return budget
    if cfg.cpu_kv_cache_bytes is not None:
        return cfg.cpu_kv_cache_bytes
    return min(cfg.max_num_seqs * max_len * token_bytes, CPU_POOL_CAP, _share_of_memory("SC_PHYS_PAGES", 8))


def num_kv_blocks(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                  max_len: int, staged: bool = False) -> int:
    """num_blocks when given; else the blocks kv_pool_bytes holds, with the device's memory as measured
    now (the weights loaded), and room for staging far blocks when they are `staged`."""
    if cfg.num_blocks is not None:
        return cfg.num_blocks
    block_bytes = kv_block_bytes(spec, cfg.block_size, dtype)
    total = used = 0
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
    budget = kv_pool_bytes(cfg, device.type, total, used, spec.kv_elements_per_token * dtype.itemsize, max_len,
                           spec.num_layers if staged else 0)
    num = budget // block_bytes
    if num < 2:
        raise ValueError(f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of {block_bytes} bytes")
    return num


def model_identity(model_dir: Path, quant: QuantSettings | None = None, cache_dir: Path | None = None) -> str:
    """What the model computes, as 64 hex digits: config.json's bytes (rope parameters, norms, sizes) and a
    digest of every byte of the weights it reads (models/digest.py: hashed once per checkpoint, then
    kept), the GGUF file's too where the weights come from one."""
    files = weight_files(model_dir)
    if quant is not None and quant.gguf_path is not None:
        files = files + [quant.gguf_path]
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    h.update(weights_digest(files, cache_dir).encode())
    return h.hexdigest()


def model_fingerprint(model_dir: Path, dtype: torch.dtype, block_size: int, quant: QuantSettings | None = None,
                      cache_dir: Path | None = None, identity: str | None = None) -> str:
    """Everything that changes the meaning of a block's bytes: the model's identity (model_identity, unless
    given), dtype, block size, layout, and the weights' quantization (quantized weights compute other keys
    and values). Two engines share cold, remote and snapshot entries only when their fingerprints match."""
    identity = identity or model_identity(model_dir, quant, cache_dir)
    weights = "" if quant is None else f"|w={quant.label}"
    return f"{identity}|{dtype}|bs={block_size}|{KV_LAYOUT}{weights}"


def quant_settings(cfg: EngineConfig, model_dir: Path) -> QuantSettings | None:
    """EngineConfig's quantization, with the GGUF file it reads for "gguf": the default model's own file, or
    the one *.gguf in the model directory."""
    if cfg.quantization is None:
        return None
    gguf = None
    if cfg.quantization == "gguf":
        found = [default_gguf_path()] if cfg.model == "default" else sorted(model_dir.glob("*.gguf"))
        if len(found) != 1:
            raise FileNotFoundError(f'quantization="gguf" reads the one *.gguf file in {model_dir}; found '
                                    f"{len(found)}{': ' + ', '.join(f.name for f in found) if found else ''}")
        gguf = found[0]
    return QuantSettings(cfg.quantization, cfg.quantization_group_size, cfg.quantization_symmetric, gguf,
                         resolve_cache_dir(cfg), cfg.int8_activations)


def weights_label(model: LlamaModel, dtype: torch.dtype) -> str:
    """The weights' format for stats() and the start-up line: "float32", or "int4 (float32 activations)", with
    "; int8 blocks in tiled products" where EngineConfig.int8_activations tiled them."""
    dt = str(dtype).removeprefix("torch.")
    if model.quantization is None:
        return dt
    tiled = any(isinstance(m, QuantizedWeight) and m.fmt in ("q4t", "q8t") for m in model.modules())
    return f"{model.quantization} ({dt} activations{'; int8 blocks in tiled products' if tiled else ''})"


def kv_block_bytes(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    """One block's K and V over every layer."""
    return spec.kv_elements_per_token * block_size * dtype.itemsize


def warm_blocks(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype) -> int:
    """Blocks the warm tier's budget holds (warm_bytes, or default_warm_bytes())."""
    warm_bytes = default_warm_bytes() if cfg.warm_bytes is None else cfg.warm_bytes
    return warm_bytes // kv_block_bytes(spec, cfg.block_size, dtype)


def far_extent(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype) -> int:
    """Blocks the cache tensor's tail spans where far blocks are read in place: what warm_bytes holds, or
    with the default budget its bound from the machine's total memory (10% of it, at most WARM_CAP), so
    the tensor's shape (and the compiled graph that takes it) does not follow the memory free at start-up.
    The span beyond the warm tier is address space only: its pages are never touched."""
    budget = _share_of_memory("SC_PHYS_PAGES") if cfg.warm_bytes is None else cfg.warm_bytes
    return budget // kv_block_bytes(spec, cfg.block_size, dtype)


def far_mode(cfg: EngineConfig, device: torch.device) -> str | None:
    """How attention reaches far blocks (block_pool.py): "in place" on CPU, where the warm slab can be
    the tail of the cache tensor; "staged" on CUDA, where it is pinned host memory (far_stage.py); None
    with offloading off. `far_blocks="staged"` stages on CPU too (it runs the CUDA path's logic)."""
    if not cfg.offload:
        return None
    if device.type != "cpu" or cfg.far_blocks == "staged":
        return "staged"
    return "in place"


def make_kv_cache(spec: ModelSpec, block_size: int, num_blocks: int, num_far: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor:
    """[layers, 2, num_blocks + num_far + 1, block_size, kv_heads, head_dim]: the hot pool, zeroed, then the
    far tail when far blocks are read in place (the warm tier's slab, and far_extent's address space beyond
    it), then one scratch block that no sequence is given: warm-ups and the background compile decode
    into it while requests are served (scratch_block). On CPU the tensor lies in an anonymous mapping,
    whose pages the kernel zero-fills on first touch: memory is taken as blocks are written, not for the
    whole pool at start-up."""
    shape = (spec.num_layers, 2, num_blocks + num_far + 1, block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu":
        return _zero_pages(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are taken only when written (the tensor keeps the mapping alive)."""
    return anonymous_memory(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def build_tiers(cfg: EngineConfig, spec: ModelSpec, num_blocks: int, kv_cache: torch.Tensor, ops: KernelOps,
                fingerprint: str, num_warm_blocks: int, far: bool, tp: TPGroup | None = None) -> TierManager:
    """The block pool (lending warm slots as far blocks when `far`) and hot over it; warm when its budget
    holds a block (the tail of kv_cache when that has room beyond the pool); cold (LMDB, imported only
    then) with a path; remote (Valkey/Redis, imported only then) with a URL."""
    block_shape = (spec.num_layers, 2, cfg.block_size, spec.num_kv_heads, spec.head_dim)
    sharded = tp is not None and tp.world > 1
    warm = local_warm(num_warm_blocks, kv_cache, num_blocks)
    if warm is not None and sharded:  # this rank's heads in its slab, whole blocks in and out (tiers/warm.py)
        warm = ShardedWarmTier(num_warm_blocks, block_shape, warm.slab, warm.layer_major, tp,
                               tp.shard.sizes(spec.num_kv_heads))
    pool = BlockPool(num_blocks, warm if far else None)
    if sharded:  # whole blocks below hot: every rank's heads (tiers/hot.py)
        hot = ShardedHotTier(pool, kv_cache, ops, tp, tp.shard.sizes(spec.num_kv_heads))
    else:
        hot = HotTier(pool, kv_cache, ops)
    cold = None
    if cfg.cold_path is not None:
        from tieredkv.tiers.cold import ColdTier

        cold = ColdTier(cfg.cold_path, cfg.cold_bytes, fingerprint, block_shape, kv_cache.dtype, cfg.cold_secret_path)
    remote = None
    if cfg.remote_url is not None:
        from tieredkv.tiers.remote import RemoteTier

        remote = RemoteTier(cfg.remote_url, fingerprint, block_shape, kv_cache.dtype, cfg.cold_secret_path,
                            cfg.remote_timeout_s, cfg.remote_retry_s, cfg.remote_ttl_s)
        hot.pool.new_cached = []  # new full blocks are written to the remote tier as they are computed
    return TierManager(hot, warm, cold, cfg.block_size, remote)


def local_warm(num_warm_blocks: int, kv_cache: torch.Tensor, num_blocks: int) -> WarmTier | None:
    """The warm tier over this process's cache tensor: its slab is the tensor's tail when that has room beyond
    the pool (far blocks read in place), else a slab of its own (pinned on CUDA); None without a budget."""
    if num_warm_blocks <= 0:
        return None
    in_place = kv_cache.shape[2] > num_blocks + 1  # more than the pool and the scratch block
    tail = kv_cache[:, :, num_blocks : num_blocks + num_warm_blocks] if in_place else None
    block_shape = (kv_cache.shape[0], 2, *kv_cache.shape[3:])
    return WarmTier(num_warm_blocks, block_shape, kv_cache.dtype, pin=kv_cache.device.type == "cuda", slab=tail)


@dataclass
class EngineParts:
    """Everything an EngineCore owns, built once; nothing is set on any of them afterwards."""

    device: torch.device
    dtype: torch.dtype
    model_dir: Path
    spec: ModelSpec
    max_model_len: int
    tokenizer: Tokenizer
    model: LlamaModel
    num_blocks: int
    kv_cache: torch.Tensor
    fingerprint: str
    factory: RequestFactory
    tiers: TierManager
    kv: KVCacheManager
    index: CacheIndex
    scheduler: Scheduler
    runner: ModelRunner
    pins: PinTable
    telemetry: Telemetry
    lifecycle: Lifecycle
    weights: str = "float32"  # weights_label()
    tp: TPGroup = field(default_factory=TPGroup)  # rank 0's group under tensor parallelism (parallel/ranks.py)
    memory: "RankMemory | list[RankMemory] | None" = None  # what loading the weights took, per rank under TP

    @property
    def pool(self) -> BlockPool:
        return self.tiers.hot.pool


def build_engine(cfg: EngineConfig) -> EngineParts:
    """Loads the model and builds the cache, tiers, scheduler, runner and request lifecycle around it;
    compiles what the first request would otherwise wait for. With tensor_parallel_size N > 1, first starts
    ranks 1..N-1 (parallel/ranks.py), which load their shares while this process loads its own."""
    device, dtype = _prepare_process(cfg)
    cache_dir = resolve_cache_dir(cfg)
    model_dir = resolve_model_dir(cfg.model, cache_dir)
    spec = ModelSpec.from_file(model_dir / "config.json")
    limit = max_model_len(spec, cfg.max_model_len)
    tokenizer = Tokenizer(model_dir)
    tp = _start_ranks(cfg, spec, model_dir, device)
    try:
        return _build(cfg, device, dtype, cache_dir, model_dir, spec, limit, tokenizer, tp)
    except BaseException:
        if tp.world > 1:
            tp.abort()
        raise


def _start_ranks(cfg: EngineConfig, spec: ModelSpec, model_dir: Path, device: torch.device) -> TPGroup:
    if cfg.tensor_parallel_size == 1:
        return TPGroup()
    from tieredkv.parallel.ranks import start_ranks

    check_shardable(spec, cfg.tensor_parallel_size)
    return start_ranks(cfg, model_dir, device)


def _build(cfg: EngineConfig, device: torch.device, dtype: torch.dtype, cache_dir: Path, model_dir: Path,
           spec: ModelSpec, limit: int, tokenizer: Tokenizer, tp: TPGroup) -> EngineParts:
    quant = quant_settings(cfg, model_dir)
    # the weights' digest (read once per checkpoint) on a thread of its own while the weights load
    digesting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tieredkv-digest")
    identity = digesting.submit(model_identity, model_dir, quant, cache_dir)
    digesting.shutdown(wait=False)
    compiled = compile_wanted(cfg.compile_decode, device) and tp.world == 1
    model = ops = memory = error = None
    try:
        model, ops, memory = load_rank_model(cfg, model_dir, device, tp, compiled)
    except Exception as e:
        if tp.world == 1:
            raise
        error = e
    leader = tp if tp.world > 1 else None
    if leader is not None:
        memory = leader.join_loads(error, memory)
    num_warm = warm_blocks(cfg, spec, dtype)
    mode = far_mode(cfg, device) if num_warm else None
    # on CPU every rank's share is in the one machine's memory: the budget counts whole blocks
    num_blocks = num_kv_blocks(cfg, spec if device.type == "cpu" else tp.shard.local_spec(spec), dtype, device,
                               limit, staged=mode == "staged")
    num_far = num_warm if mode else 0
    extent = far_extent(cfg, spec, dtype) if mode == "in place" else 0
    if leader is not None:
        leader.broadcast((num_blocks, extent, num_warm, mode))
    kv_cache = make_kv_cache(tp.shard.local_spec(spec), cfg.block_size, num_blocks, extent, dtype, device)
    factory = RequestFactory(tokenizer, spec, cfg, limit, eos_token_ids(spec, model_dir, tokenizer.eos_token_id),
                             num_blocks, num_far)
    fingerprint = model_fingerprint(model_dir, dtype, cfg.block_size, quant, identity=identity.result())
    tiers = build_tiers(cfg, spec, num_blocks, kv_cache, ops, fingerprint, num_warm, far=mode is not None, tp=tp)
    kv = KVCacheManager(tiers.hot.pool, cfg.block_size, cfg.enable_prefix_caching, root_hash(fingerprint))
    index = CacheIndex(tiers.hot.pool, tiers, root_hash(fingerprint), cfg.block_size)
    scheduler = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, tiers, index,
                          offload={"in place": "first", "staged": "last"}.get(mode), policy=cfg.scheduling_policy)
    runner = ModelRunner(model, kv_cache, cfg.block_size, ops, cfg.cascade_attention,
                         _decode_path(model, kv_cache, ops, cache_dir) if compiled else None,
                         far=(num_blocks, tiers.warm.slab) if mode == "staged" else None, leader=leader)
    if leader is not None:
        leader.gather_objects(None)  # every rank has its cache and runner
    runner.compile_now(background=cfg.compile_in_background)
    pins, telemetry = PinTable(index, int(num_blocks * cfg.max_pinned_fraction)), Telemetry()
    lifecycle = Lifecycle(scheduler, kv, factory, tokenizer, pins, telemetry, device, limit)
    block_bytes, weights = kv_block_bytes(spec, cfg.block_size, dtype), weights_label(model, dtype)
    rank_gib = " / ".join(f"{m.weight_bytes / 2**30:.2f}" for m in memory) if tp.world > 1 else ""
    log.info("engine ready: %s, weights %s (%.2f GiB) on %s, %d KV blocks of %d tokens (hot %.2f GiB, "
             "warm %.2f GiB%s), kernels=%s, linear=%s, packed=%s, decode path=%s%s", model_dir.name, weights,
             total_weight_bytes(model, memory) / 2**30, device, num_blocks, cfg.block_size,
             num_blocks * block_bytes / 2**30, num_warm * block_bytes / 2**30,
             "; taken as written" if device.type == "cpu" else "", ops.name, ops.linear.__name__,
             ops.pack_linear_weight is not None, runner.decode_path,
             f", tensor parallel over {tp.world} ranks ({rank_gib} GiB of the weights each)" if tp.world > 1 else "")
    return EngineParts(device, dtype, model_dir, spec, limit, tokenizer, model, num_blocks, kv_cache, fingerprint,
                       factory, tiers, kv, index, scheduler, runner, pins, telemetry, lifecycle, weights, tp, memory)


def _decode_path(model: LlamaModel, kv_cache: torch.Tensor, ops: KernelOps,
                 cache_dir: Path) -> CompiledDecode | NativeDecode:
    """What serves a step that decodes one sequence: the native step where it takes the model (quantized
    weights on CPU: runner/native_decode.py), else the compiled graph."""
    return NativeDecode.make(model, kv_cache) or CompiledDecode(model, kv_cache, ops, cache_dir / "inductor")


@dataclass(frozen=True)
class RankMemory:
    """What loading the weights took on one rank: their bytes in their own formats, and the growth of the
    process's anonymous resident memory from before the load to after it (packing included, the heap's freed
    memory handed back)."""

    weight_bytes: int
    resident_growth: int


def total_weight_bytes(model: LlamaModel, memory) -> int:
    """The weights' bytes over every rank (the model's own outside tensor parallelism)."""
    return sum(m.weight_bytes for m in memory) if isinstance(memory, list) else model.weight_bytes()


def load_rank_model(cfg: EngineConfig, model_dir: Path, device: torch.device, tp: TPGroup,
                    compiled: bool = False) -> tuple[LlamaModel, KernelOps, RankMemory]:
    """This rank's share of the weights (all of them at one rank), in the layout the kernel set reads."""
    spec = ModelSpec.from_file(model_dir / "config.json")
    dtype = resolve_dtype(cfg.dtype, device)
    quant = quant_settings(cfg, model_dir)
    before = process_status_bytes("RssAnon")
    model = load_model(model_dir, spec, dtype, device, quant, tp)
    if device.type == "cpu":  # the CPU kernels; their C++ operators are bound here for the eager forward, or by
        # the compiled path before its trace, on its own thread (a first build takes seconds)
        use_cpu_kernels(resolve_cache_dir(cfg), operators=not compiled)
        if quant is not None and quant.int8_activations:
            tiled = tile_quantized_weights(model)  # where the kernels multiply tiles with AVX-512 VNNI
            log.info("int8 activations: %d quantized weights held in tiles of 16 rows%s", tiled,
                     "" if tiled else " (none: no build of the CPU kernels with AVX-512 VNNI here)")
        gather_quantized_weights(model)  # one stream in the order they are read
    ops = _kernels_and_weights(cfg, model, device, dtype, compiled)
    if device.type == "cpu":
        release_free_memory(collect=False)  # the copies that loading, fusing and packing the weights freed
    return model, ops, RankMemory(model.weight_bytes(), process_status_bytes("RssAnon") - before)


def rank_runner(cfg: EngineConfig, model: LlamaModel, ops: KernelOps, setup: tuple, device: torch.device,
                tp: TPGroup) -> tuple[ModelRunner, WarmTier | None]:
    """The model runner of a tensor-parallel rank other than 0, over its heads of every block id, and the
    warm tier whose slab holds its heads of every warm slot (only its slab is used: rank 0 keeps the index).
    `setup`: rank 0's (num_blocks, far extent, warm blocks, far mode)."""
    num_blocks, extent, num_warm, mode = setup
    kv_cache = make_kv_cache(tp.shard.local_spec(model.spec), cfg.block_size, num_blocks, extent,
                             resolve_dtype(cfg.dtype, device), device)
    warm = local_warm(num_warm, kv_cache, num_blocks)
    runner = ModelRunner(model, kv_cache, cfg.block_size, ops, cfg.cascade_attention,
                         far=(num_blocks, warm.slab) if mode == "staged" else None)
    return runner, warm


def _kernels_and_weights(cfg: EngineConfig, model: LlamaModel, device: torch.device, dtype: torch.dtype,
                         compiled: bool) -> KernelOps:
    """The kernel set, with the weights in the layout its dense layers read, held once (docs/architecture.md:
    Kernels): packed where the kernel set packs; with the compiled decode path, packed too unless its one-row
    products read the plain weights clearly faster on this processor (measured once, kernels/linear.py:
    graph_reads_packed), else plain, for it and for the eager steps. cpu_linear="packed" keeps a packed copy
    beside plain weights."""
    ops = select_kernels(cfg.attention_backend, device, dtype, cfg.cpu_linear)
    if ops.pack_linear_weight is None:
        return ops
    if not compiled:
        _pack_weights(model, ops.pack_linear_weight)
        return ops
    shapes = model.linear_shapes()  # none where the projections are quantized
    graph_packed = bool(shapes) and graph_reads_packed(dtype, shapes, resolve_cache_dir(cfg))
    if not graph_packed and cfg.cpu_linear != "packed":
        return replace(ops, pack_linear_weight=None)
    _pack_weights(model, ops.pack_linear_weight, keep_plain=not graph_packed, handles=graph_packed)
    return ops


def _pack_weights(model: LlamaModel, pack, **options) -> None:
    """model.pack_linear_weights(pack, **options), then the packed buffers moved into huge pages where they lie
    (malloc_tuning.collapse_into_huge_pages; oneDNN allocated them, so they cannot join an arena uncopied), on a
    thread of its own: about 1 s for the fp32 default model's 538 MB on 2 cores, which no start waits for (the
    kernel keeps the contents while it moves them, and memory freed meanwhile is left as it is or refused)."""
    model.pack_linear_weights(pack, **options)
    ranges = [packed_range(w) for w in model.packed_weights()]

    def collapse() -> None:
        log.debug("packed weights: %d MB in huge pages", collapse_into_huge_pages(ranges) >> 20)

    threading.Thread(target=collapse, name="tieredkv-huge-pages", daemon=True).start()


def _prepare_process(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype, with the thread-level settings they need (this thread's CUDA device)."""
    device = resolve_device(cfg.device)
    prepare_rank(cfg, device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.dtype == "auto" and dtype == torch.float16:
        log.info("dtype auto: float16 on %s (compute capability %d.%d has no native bfloat16)",
                 torch.cuda.get_device_name(device), *torch.cuda.get_device_capability(device))
    return device, dtype


def prepare_rank(cfg: EngineConfig, device: torch.device) -> None:
    """This process's (or thread's) settings for serving on `device`: torch's threads (under tensor
    parallelism on CPU, by default the cores shared out among the ranks), the current CUDA device, malloc."""
    threads = cfg.num_threads
    if threads is None and cfg.tensor_parallel_size > 1 and device.type == "cpu":
        threads = max(1, torch.get_num_threads() // cfg.tensor_parallel_size)
    if threads is not None:
        torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this (worker) thread's current device: "cuda:N" means N
    if device.type == "cpu" and cfg.cpu_malloc_tuning:
        tune_glibc_malloc()
