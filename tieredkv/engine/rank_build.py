"""What every rank builds for itself, rank 0 and the tensor-parallel followers alike (engine/ranks.py): the
process's settings, its share of the weights in the layout its kernel set reads, its KV cache tensor and
model runner."""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tieredkv.config import EngineConfig
from tieredkv.core.far_blocks import FAR_POLICY
from tieredkv.engine.resolve import quant_settings, resolve_cache_dir, resolve_device, resolve_dtype, resolve_kv_layout
from tieredkv.errors import RankStartError
from tieredkv.kernels import KernelOps, select_kernels
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.kernels.dense import choose_layout
from tieredkv.kernels.linear import packed_range
from tieredkv.kernels.quant import (QuantizedWeight, gather_quantized_weights, int8_fewest_rows, int8_many_rows_win,
                                    many_rows_int8, tile_quantized_weights)
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.models.llama import LlamaModel
from tieredkv.models.loader import load_model
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_group import TPGroup
from tieredkv.platform.malloc_tuning import (anonymous_memory, collapse_into_huge_pages, process_status_bytes,
                                             release_free_memory, tune_glibc_malloc)
from tieredkv.platform.process import PROCESS, Hold
from tieredkv.runner.key_shift import load_key_shift, measure_key_shift, save_key_shift, shift_file
from tieredkv.runner.model_runner import ModelRunner
from tieredkv.tiers.block_io import BlockIO
from tieredkv.tiers.warm import WarmTier

log = logging.getLogger("tieredkv")


def weights_label(model: LlamaModel, dtype: torch.dtype) -> str:
    """The weights' format for stats() and the start-up line: "float32", or "int4 (float32 activations)", with
    "; int8 blocks in tiled products" where EngineConfig.int8_activations tiled them."""
    dt = str(dtype).removeprefix("torch.")
    if model.quantization is None:
        return dt
    tiled = any(isinstance(m, QuantizedWeight) and m.fmt in ("q4t", "q8t") for m in model.modules())
    return f"{model.quantization} ({dt} activations{'; int8 blocks in tiled products' if tiled else ''})"


def many_rows_arithmetic(model: LlamaModel, setting: bool | None, cache_dir: Path) -> None:
    """Whether products of many rows on the model's quantized weights take int8 activation blocks (where the
    kernels can: q4 and q8 in groups of 32 or more, AVX2): with EngineConfig.int8_activations True, yes; False,
    no; None (the default) where that is clearly faster on this processor than the fp32 product
    (quant.int8_many_rows_win, measured once per processor on the first layer's shapes). Where they do, and the
    int8 blocks also beat the one-row kernels' int16 rows from some number of rows up to the kernels' most
    (quant.int8_fewest_rows: batched decode steps), they start there, with speculative decoding or without: the
    scheduler keeps a step with drafts below that count (int16_rows_most), so that its rows are multiplied as
    plain decoding multiplies them."""
    weights = [w for w in model.modules() if isinstance(w, QuantizedWeight)]
    layer = [w for w in model.layers[0].modules() if isinstance(w, QuantizedWeight) and
             many_rows_int8(w.codes, w.group_size)]
    use = bool(layer) and (setting is True or (setting is None and int8_many_rows_win(layer, cache_dir)))
    many = [w for w in weights if many_rows_int8(w.codes, w.group_size)]
    fewest = int8_fewest_rows(many, cache_dir) if use else 0
    for w in weights:
        w.int8_rows = (fewest or -1) if use else 0
    if layer and setting is None:
        log.info("products of many rows on quantized weights: %s", (
            f"int8 activation blocks from {fewest} rows (measured faster here)" if fewest else
            "int8 activation blocks (measured faster here)") if use else
            "the fp32 product (int8 blocks not clearly faster on this processor)")


def make_kv_cache(spec: ModelSpec, block_size: int, num_blocks: int, num_far: int, kv: KVLayout,
                  device: torch.device) -> torch.Tensor:
    """[layers, 2, num_blocks + num_far + 1, block_size, kv_heads, row] of the K/V formats' storage dtype (row:
    head_dim values, or a row's bytes; kernels/kv_format.py): the hot pool, zeroed, then the
    far tail when far blocks are read in place (the warm tier's slab, and far_extent's address space beyond
    it), then one scratch block that no sequence is given: warm-ups and the background compile decode
    into it while requests are served (scratch_block). On CPU the tensor lies in an anonymous mapping,
    whose pages the kernel zero-fills on first touch: memory is taken as blocks are written, not for the
    whole pool at start-up."""
    shape = (spec.num_layers, 2, num_blocks + num_far + 1, block_size, spec.num_kv_heads, kv.row)
    if device.type == "cpu":
        return _zero_pages(shape, kv.storage_dtype)
    return torch.zeros(shape, dtype=kv.storage_dtype, device=device)


def _zero_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are taken only when written (the tensor keeps the mapping alive)."""
    return anonymous_memory(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


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
    kv = resolve_kv_layout(cfg, spec, dtype, device)  # a bad format fails before the weights load
    quant = quant_settings(cfg, model_dir)
    before = process_status_bytes("RssAnon")
    model = load_model(model_dir, spec, dtype, device, quant, tp)
    if device.type == "cpu":  # the CPU kernels; their C++ operators are bound here for the eager forward, or by
        # the compiled path before its trace, on its own thread (a first build takes seconds)
        CPU.use(resolve_cache_dir(cfg), operators=not compiled)
        if quant is not None and quant.int8_activations:
            tiled = tile_quantized_weights(model)  # where the kernels multiply tiles with AVX-512 VNNI
            log.info("int8 activations: %d quantized weights held in tiles of 16 rows%s", tiled,
                     "" if tiled else " (none: no build of the CPU kernels with AVX-512 VNNI here)")
        if quant is not None:
            many_rows_arithmetic(model, quant.int8_activations, resolve_cache_dir(cfg))
        gather_quantized_weights(model)  # one stream in the order they are read
    ops = _kernels_and_weights(cfg, model, device, dtype, compiled, kv)
    if device.type == "cpu":
        release_free_memory(collect=False)  # the copies that loading, fusing and packing the weights freed
    return model, ops, RankMemory(model.weight_bytes(), process_status_bytes("RssAnon") - before)


def load_share(cfg: EngineConfig, model_dir: Path, device: torch.device, tp: TPGroup,
               compiled: bool = False) -> tuple[LlamaModel, KernelOps, "RankMemory | list[RankMemory]"]:
    """load_rank_model, then, under tensor parallelism, the first step every rank takes in lockstep: each reports
    its load to rank 0 (a gather all take part in, so that a rank that failed ends the start everywhere). Rank 0
    gets every rank's RankMemory, rank order, and raises its own error or names the first rank that failed; the
    others raise their own error."""
    if tp.world == 1:
        return load_rank_model(cfg, model_dir, device, tp, compiled)
    model = ops = memory = error = None
    try:
        model, ops, memory = load_rank_model(cfg, model_dir, device, tp, compiled)
    except Exception as e:  # told to rank 0 first
        error = e
    results = tp.gather_objects((None if error is None else f"{type(error).__name__}: {error}", memory))
    if error is not None:
        raise error if tp.rank == 0 else RankStartError(f"{type(error).__name__}: {error}")
    if results is None:
        return model, ops, memory
    for rank, (failed, _) in enumerate(results):
        if failed is not None:
            raise RankStartError(f"tensor-parallel rank {rank} could not load its share of the model: {failed}")
    return model, ops, [m for _, m in results]


def shift_keys(cfg: EngineConfig, model: LlamaModel, device: torch.device, tp: TPGroup,
               plan: Callable[[], tuple[str, list[int]]] | None = None) -> None:
    """Where the cache stores keys at 4 bits, each layer's key mean (runner/key_shift.py): read from the cache
    directory where every rank's is kept, else measured over rank 0's calibration token ids, which it sends the
    other ranks. Every rank calls this at the same point of its start (after load_share); rank 0 with `plan`,
    which gives the shift's key (key_shift.shift_key) and the calibration ids."""
    dtype = resolve_dtype(cfg.dtype, device)
    if not resolve_kv_layout(cfg, model.spec, dtype, device).shifts_keys:
        return
    cache_dir = resolve_cache_dir(cfg)
    decided = None
    if plan is not None:
        key, ids = plan()
        kept = all(shift_file(cache_dir, key, r, tp.world).exists() for r in range(tp.world))
        decided = (key, None if kept else ids)
    if tp.world > 1:
        decided = tp.broadcast(decided)
    key, tokens = decided
    path = shift_file(cache_dir, key, tp.rank, tp.world)
    if tokens is None:
        try:
            return load_key_shift(model, path, dtype, device)
        except Exception as e:  # one process measures again; ranks cannot (the others would not join its forward)
            if tp.world > 1:
                raise RankStartError(f"tensor-parallel rank {tp.rank} cannot read its key shift from {path} "
                                     f"({e}): remove the file") from e
            log.warning("cannot read the key shift from %s (%s): measuring it again", path, e)
            tokens = plan()[1] if plan is not None else None
    measure_key_shift(model, select_kernels(cfg.attention_backend, device), cfg.block_size, tokens, dtype, device)
    try:
        save_key_shift(model, path)
    except OSError as e:  # a cache directory it cannot write: the next start measures again
        log.warning("cannot keep the key shift in %s (%s): the next start measures it again", path, e)


def data_plane(kv_cache: torch.Tensor, ops: KernelOps, num_blocks: int, num_warm_blocks: int, spec: ModelSpec,
               tp: TPGroup | None = None) -> tuple[WarmTier | None, BlockIO]:
    """What every rank builds over its cache tensor to hold and move block bytes: its warm slab (in a warm tier
    whose blocks are the whole model's: rank 0 keeps the index, the other ranks use only the slab) and the block
    ops over the pool and the slab (tiers/block_io.py). `spec`: the whole model's."""
    block_shape = (spec.num_layers, 2, kv_cache.shape[3], spec.num_kv_heads, kv_cache.shape[-1])  # rows as stored
    warm = WarmTier.over_cache(num_warm_blocks, kv_cache, num_blocks, block_shape)
    io = BlockIO(kv_cache, ops, warm.store if warm is not None else None, tp,
                 tp.shard.sizes(spec.num_kv_heads) if tp is not None else None)
    return warm, io


def rank_runner(cfg: EngineConfig, model: LlamaModel, ops: KernelOps, setup: tuple, device: torch.device,
                tp: TPGroup) -> tuple[ModelRunner, BlockIO]:
    """The model runner of a tensor-parallel rank other than 0, over its heads of every block id, and its block
    ops (data_plane, as rank 0's). `setup`: rank 0's (num_blocks, far extent, warm blocks, far mode)."""
    num_blocks, extent, num_warm, mode = setup
    far = FAR_POLICY[mode]
    kv_cache = make_kv_cache(tp.shard.local_spec(model.spec), cfg.block_size, num_blocks, extent,
                             resolve_kv_layout(cfg, model.spec, resolve_dtype(cfg.dtype, device), device), device)
    warm, io = data_plane(kv_cache, ops, num_blocks, num_warm, model.spec, tp)
    runner = ModelRunner(model, kv_cache, cfg.block_size, ops, cfg.cascade_attention,
                         far=far.stage_from(num_blocks, warm))
    return runner, io


def bind_kernels(cfg: EngineConfig, device: torch.device, compiled: bool, kv: KVLayout) -> KernelOps:
    """The kernel set of an engine over weights already loaded and held (engine/shared_weights.py), with the CPU
    kernels bound as load_rank_model binds them."""
    if device.type == "cpu":
        CPU.use(resolve_cache_dir(cfg), operators=not compiled)
    return select_kernels(cfg.attention_backend, device, kv)


def _kernels_and_weights(cfg: EngineConfig, model: LlamaModel, device: torch.device, dtype: torch.dtype,
                         compiled: bool, kv: KVLayout | None = None) -> KernelOps:
    """The kernel set, with every full-precision weight held in the layout kernels/dense.py chooses for this
    device, dtype and decode path (docs/architecture.md: Kernels), its packed copies moved into huge pages."""
    layout = choose_layout(device, dtype, cfg.cpu_linear, compiled, model.linear_shapes(), resolve_cache_dir(cfg),
                           native=compiled and cfg.native_decode)
    model.hold_weights(layout)
    _collapse(model.packed_weights())
    return select_kernels(cfg.attention_backend, device, kv)


def _collapse(packed: list[torch.Tensor]) -> None:
    """The packed buffers moved into huge pages where they lie (malloc_tuning.collapse_into_huge_pages; oneDNN
    allocated them, so they cannot join an arena uncopied), on a thread of its own: about 1 s for the fp32 default
    model's 538 MB on 2 cores, which no start waits for (the kernel keeps the contents while it moves them, and
    memory freed meanwhile is left as it is or refused)."""
    if not packed:
        return
    ranges = [packed_range(w) for w in packed]

    def collapse() -> None:
        log.debug("packed weights: %d MB in huge pages", collapse_into_huge_pages(ranges) >> 20)

    threading.Thread(target=collapse, name="tieredkv-huge-pages", daemon=True).start()


def prepare_process(cfg: EngineConfig) -> tuple[torch.device, torch.dtype, Hold | None]:
    """The device and dtype, with the thread-level settings they need (this thread's CUDA device), and the hold on
    the process's settings that the engine's close releases."""
    device = resolve_device(cfg.device)
    held = prepare_rank(cfg, device)
    dtype = resolve_dtype(cfg.dtype, device)
    if cfg.dtype == "auto" and dtype == torch.float16:
        log.info("dtype auto: float16 on %s (compute capability %d.%d has no native bfloat16)",
                 torch.cuda.get_device_name(device), *torch.cuda.get_device_capability(device))
    return device, dtype, held


def prepare_rank(cfg: EngineConfig, device: torch.device) -> Hold | None:
    """This process's (or thread's) settings for serving on `device`: torch's threads (under tensor
    parallelism on CPU, by default the cores shared out among the ranks; held through platform/process.py,
    and returned, so that the engine's close gives the process its own count back), the current CUDA device,
    malloc."""
    threads = cfg.num_threads
    if threads is None and cfg.tensor_parallel_size > 1 and device.type == "cpu":
        threads = max(1, torch.get_num_threads() // cfg.tensor_parallel_size)
    held = PROCESS.threads(threads) if threads is not None else None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this (worker) thread's current device: "cuda:N" means N
    if device.type == "cpu" and cfg.cpu_malloc_tuning:
        tune_glibc_malloc()
    return held
