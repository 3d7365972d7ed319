"""The native decode step: on CPU, a step that decodes one sequence of a model whose projections and LM head
are quantized, or fp32 in oneDNN's packed layout (builds with AVX-512), runs whole in C (kernels/decode_cpu.c), one
call a token, in place of the compiled graph; so do a verification of its drafts and a batch of a few decodes.

Why: at batch 1 the quantized products are a minority of the compiled graph's step. Measured on an Intel Xeon
(KVM guest, 2 cores), the default model's Q4_1 file: 6.8 ms a token, of which the 4-bit products ~2.6 ms and
the Q8_0 LM head ~1.1 ms; the rest was ~150 kernel calls through inductor's wrapper and torch's dispatcher,
the fused loops between them, and Python (see docs/guide/quantization.md for the measurements). decode_cpu.c
runs every layer in one OpenMP parallel region with the same product kernels, nothing allocated. fp32 weights:
the graph decodes one row only, so a verification of 8 drafts ran the eager forward, ~13 ms of its step Python,
torch's dispatch and small parallel regions; on an AMD EPYC (Zen 4, 2 cores), the default model, 128 tokens of
context, both engines in one process: a decode 15.1-16.9 ms against the graph's 16.7-18.2, a verification of 8
drafts 23.3-24.8 against the eager forward's 33.4-34.3 (the products alone: ~18 ms for 9 rows).

What: `NativeDecode.make` lays out the model for the C step once (ctypes structures pointing at the
weights, the norms and each layer's K and V caches; the tensors stay the model's and the cache's) where the
step can take it: fp32 activations and cache, one rank, every projection and the LM head quantized in a
format the kernels read or fp32 packed (kernels/dense.py: PackedWeight; a build without AVX-512 would read each
packed block again for every row of a step: not taken there). Else it says why not, and the compiled graph (or the
eager forward) serves. It offers what the model runner and engine call of CompiledDecode (accepts, run, state,
start_background, warmup, finish, steps), with nothing to compile; what its warm-up does is bind the C++ operators
(decode attention, the quantized one-row products) that the eager forward's steps run, the ones this step does not
take (many sequences, long chunks), as the compiled graph's warm-up does before its trace.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from tieredkv.config import MAX_SPECULATIVE_TOKENS
from tieredkv.kernels.kv_format import CPU_FORMATS, KVLayout
from tieredkv.kernels.dense import PackedWeight
from tieredkv.kernels.linear import FEW_PACKED_ROWS
from tieredkv.kernels.quant import QuantizedParts, QuantizedWeight, int16_rows_most
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.models.llama import LlamaModel, Projection

log = logging.getLogger("tieredkv")

MAX_PARTS = 3  # decode_cpu.c: TKV_MAX_PARTS
FORMATS = {"q8": 0, "q4": 1, "q8t": 2, "q4t": 3, "f32p": 4}  # cpu_kernels.h: TKV_Q8 ... TKV_F32P

_I, _P = ctypes.c_int64, ctypes.c_void_p


class _Weight(ctypes.Structure):  # cpu_kernels.h: tkv_qw
    _fields_ = [("fmt", _I), ("q", _P), ("d", _P), ("mn", _P), ("g", _I), ("N", _I), ("K", _I), ("bias", _P),
                ("kp", _I)]


class _Proj(ctypes.Structure):  # decode_cpu.c: tkv_proj
    _fields_ = [("parts", _I), ("part", _Weight * MAX_PARTS)]


class _Layer(ctypes.Structure):  # decode_cpu.c: tkv_layer
    _fields_ = [("attn_norm", _P), ("mlp_norm", _P), ("q_norm", _P), ("k_norm", _P), ("k_shift", _P),
                ("qkv", _Proj), ("o", _Proj), ("gate_up", _Proj), ("down", _Proj), ("k_cache", _P), ("v_cache", _P)]


class _Model(ctypes.Structure):  # decode_cpu.c: tkv_model
    _fields_ = [("layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("block_size", _I), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("inv_freq", _P),
                ("layer", ctypes.POINTER(_Layer)), ("final_norm", _P), ("head", _Proj), ("embed", _P),
                ("kv_fmt", _I), ("kv_row", _I)]


class Unfit(Exception):
    """Why the native step cannot take a model."""


def _ptr(t: torch.Tensor | None, what: str) -> int | None:
    if t is None:
        return None
    if t.device.type != "cpu" or not t.is_contiguous():
        raise Unfit(f"{what} is not a contiguous CPU tensor")
    return t.data_ptr()


def _fp32(t: torch.Tensor | None, what: str) -> int | None:
    if t is not None and t.dtype != torch.float32:
        raise Unfit(f"{what} is {t.dtype}, not float32")
    return _ptr(t, what)


def _proj(qw, bias: torch.Tensor | None, what: str) -> _Proj:
    if isinstance(qw, PackedWeight):
        return _packed(qw, bias, what)
    parts = list(qw.parts) if isinstance(qw, QuantizedParts) else [qw]
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        raise Unfit(f"{what} is neither quantized nor packed ({qw.label})")
    if len(parts) > MAX_PARTS:
        raise Unfit(f"{what} has {len(parts)} parts")
    proj, at = _Proj(parts=len(parts)), 0
    for i, p in enumerate(parts):
        if p.fmt not in FORMATS:
            raise Unfit(f"{what} is held as {p.fmt}")
        b = None if bias is None else _fp32(bias[at : at + p.out_features], f"{what}'s bias")
        proj.part[i] = _Weight(FORMATS[p.fmt], _ptr(p.codes, what), _ptr(p.scales, what), _ptr(p.offsets, what),
                               p.group_size, p.out_features, p.in_features, b)
        at += p.out_features
    return proj


def _packed(w: PackedWeight, bias: torch.Tensor | None, what: str) -> _Proj:
    """An fp32 weight in oneDNN's packed layout, as the one-row and several-row kernels read it (TKV_F32P)."""
    if w.packed.dtype != torch.float32 or w.row_layout is None:
        raise Unfit(f"{what} is {w.label}, not in a layout the kernels read")
    if not CPU.f32_rows:  # (the one-row kernel alone would read the weight again for each of a step's rows)
        raise Unfit("the kernels multiply several fp32 rows only on AVX-512 builds")
    block, stored, address = w.row_layout
    proj = _Proj(parts=1)
    proj.part[0] = _Weight(FORMATS["f32p"], address, None, None, block, w.out_features, w.in_features,
                           _fp32(bias, f"{what}'s bias"), stored)
    return proj


def _linear(layer: Projection, what: str) -> _Proj:
    return _proj(layer.format, layer.bias, what)


# the most tokens of one sequence a native step takes: a verification (the last token and its drafts) or the
# short prompt chunk a draft model computes each call (a partial block and the tokens accepted since). Each row
# costs the products' arithmetic again. Measured on 2 Zen 5 cores, the default model's Q4_1 file, 200 tokens of
# context: with int16 activation rows about half a one-row step a row (5 rows 0.92x the eager forward's time, 9
# 1.02x, 17 1.14x, 32 1.28x): longer chunks go eager; with int8 activations on VNNI tiles (int8_activations) a
# fifth to a quarter of one (1 row 1.9 ms, 9 rows 6.3, 17 10.3: 0.57x / 0.72x the eager forward's; 32 0.88x).
MAX_ROWS = 9
MAX_ROWS_TILED = 2 * (MAX_SPECULATIVE_TOKENS + 1)
# fp32 weights in oneDNN's packed layout: each block read once for up to six rows, so that 2-6 rows cost the one-row
# read and 9 rows some 1.3x it (kernels/linear.py: FEW_PACKED_ROWS, the rows the eager forward sends there too). Also
# the most rows of several sequences: a batched decode step of fp32 streams runs in C up to 32 of them. On an AMD EPYC
# (Zen 4, 2 threads), the default model, 300 tokens of context: 16 rows 37.8 ms against the eager forward's 67.1, 24
# rows 52.2 against 75.5, 32 rows 69.2 against 99.6; a prompt chunk of 32 tokens 90.0 against 100.8 (1,000 of context)
FP32_ROWS = FEW_PACKED_ROWS
# the most sequences whose decodes one native step takes together (a row each, every product reading its weight
# once for all): the eager forward's ~150 calls a step, each a parallel region and a dispatch, are what a batch of a
# few decodes spent most of its time on. The default model's Q4_1 file on an AMD EPYC Zen 3 (2 threads, 64-token
# prompts and 64 new tokens each, the two alternated on one engine): 2 streams 2.18x the eager forward's output
# tok/s, 4 1.80x, 8 1.40x, 12 1.40x; at 16 (int8 blocks in the eager forward there) 0.96x
MAX_BATCH = 16


def _fit(model: LlamaModel, kv_cache: torch.Tensor, kv: KVLayout | None) -> tuple[int, int]:
    """The K and V format codes the C step reads the cache in; Unfit when it cannot run this model on it."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise Unfit(f"the KV cache is not a contiguous tensor on the CPU ({kv_cache.device})")
    if kv is None and kv_cache.dtype != torch.float32:
        raise Unfit(f"the KV cache is {kv_cache.dtype}, not float32")
    codes = kv.codes if kv is not None else (0, 0)
    if max(codes) > CPU_FORMATS:
        raise Unfit(f"the kernels do not read KV stored as {kv.label}")
    if model.tp.world > 1:
        raise Unfit("the model is split over ranks")
    if model.rotary.inv_freq.numel() * 2 != model.spec.head_dim:
        raise Unfit("the rotary embedding does not turn the whole head")
    return codes


class NativeDecode:
    """Runs steps that decode one sequence, or verify its drafts (speculative decoding: up to MAX_ROWS rows), or decode
    a few sequences at once (up to MAX_BATCH), through decode_cpu.c's tkv_decode_rows."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, lib: ctypes.CDLL, kv: KVLayout | None = None,
                 cache_dir: Path | None = None):
        self.lib = lib
        self.steps = 0  # steps this path ran
        self.cache_dir = cache_dir  # where the C++ operators are built (None: not bound here)
        self._binding: threading.Thread | None = None
        spec = model.spec
        codes = _fit(model, kv_cache, kv)
        layers = (_Layer * len(model.layers))()
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            cache = kv_cache[attn.layer_id]
            layers[i] = _Layer(
                _fp32(layer.input_layernorm.weight, "a norm"), _fp32(layer.post_attention_layernorm.weight, "a norm"),
                _fp32(attn.q_norm.weight, "a norm") if attn.qk_norm else None,
                _fp32(attn.k_norm.weight, "a norm") if attn.qk_norm else None,
                _fp32(attn.k_shift, "the key shift"),
                _linear(attn.qkv_proj, "the q/k/v projection"), _linear(attn.o_proj, "the output projection"),
                _linear(mlp.gate_up_proj, "the gate/up projection"), _linear(mlp.down_proj, "the down projection"),
                cache[0].data_ptr(), cache[1].data_ptr())
        table = model.embed_tokens.weight
        self._model = _Model(
            len(model.layers), spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.intermediate_size, kv_cache.shape[3], spec.rms_norm_eps, model.layers[0].self_attn.scale,
            _fp32(model.rotary.inv_freq, "the rotary frequencies"), layers, _fp32(model.norm.weight, "a norm"),
            _linear(model.lm_head, "the LM head"), _fp32(table, "the embedding table"),
            codes[0] | codes[1] << 4, kv_cache.shape[-1] * kv_cache.element_size())
        self._layers = layers  # the structure points into it
        self._held = (model, kv_cache)  # every pointer above is into these
        self.vocab = model.lm_head.out_features
        formats = {proj.part[j].fmt for layer in layers for proj in (layer.qkv, layer.o, layer.gate_up, layer.down)
                   for j in range(proj.parts)}
        fp32 = formats == {FORMATS["f32p"]}
        # the longest chunk it takes (see MAX_ROWS and FP32_ROWS)
        self.max_rows = (FP32_ROWS if fp32 else
                         MAX_ROWS_TILED if formats <= {FORMATS["q8t"], FORMATS["q4t"]} else MAX_ROWS)
        # the most rows of several sequences it takes together: fp32 weights FP32_ROWS; quantized ones MAX_BATCH, and
        # fewer than the rows from which their products take int8 blocks (quant.QuantizedWeight.int8_rows), whose
        # arithmetic it does not run
        self.max_batch = FP32_ROWS if fp32 else min(MAX_BATCH, int16_rows_most(model))
        if not lib.tkv_decode_fits(ctypes.byref(self._model)):
            raise Unfit("the kernels do not take a projection's shape or the attention's heads")

    @classmethod
    def make(cls, model: LlamaModel, kv_cache: torch.Tensor, kv: KVLayout | None = None,
             cache_dir: Path | None = None) -> "NativeDecode | None":
        """The native step for this model and cache, or None (logged, with the reason) where it cannot serve;
        `cache_dir`: the engine's cache, where warmup finds or builds the C++ operators."""
        lib = CPU.lib
        if kv_cache.device.type != "cpu":
            return None
        if lib is None:
            log.info("native decode step off: the CPU kernels are not built")
            return None
        try:
            return cls(model, kv_cache, lib, kv, cache_dir)
        except Unfit as e:
            log.info("native decode step off, the compiled graph serves: %s", e)
            return None

    def accepts(self, scheduled: list) -> bool:
        """True for a step that runs one sequence and nothing else, at most max_rows tokens: a decode, its last
        token and its drafts, or a short chunk of its prompt (the tail a cached prefix leaves; a draft model's
        next call); or one of several sequences with at most max_batch rows in all, at most max_rows each: decodes,
        verifications of drafts and short prompt chunks side by side. So a verification row is computed as a
        decode of the same batch is (the same kernels, its attention a decode's), whatever else the step holds."""
        if len(scheduled) == 1:
            return scheduled[0][1] <= self.max_rows
        return sum(n for _, n in scheduled) <= self.max_batch and all(n <= self.max_rows for _, n in scheduled)

    state = "native"

    def warmup(self, ticker: bool = True) -> None:
        """Nothing to compile (the kernels were built with the library); binds the C++ operators to them for the
        steps the eager forward serves (without them a batch's decode attention runs torch's reference: ~30% of a
        mixed batch's step time on the default model's Q4_1 file, AMD EPYC Zen 3). Loaded from the engine's cache,
        or built there once per torch build (seconds); where they cannot be had, a warning says so."""
        if self.cache_dir is not None:
            CPU.bind_operators(self.cache_dir)

    def start_background(self) -> None:
        """warmup on a thread of its own, so that no start waits for a first build of the operators."""
        self._binding = threading.Thread(target=self.warmup, name="tieredkv-operators", daemon=True)
        self._binding.start()

    def finish(self) -> None:
        """Waits for start_background's thread, if one runs."""
        if self._binding is not None:
            self._binding.join()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [R, vocab] for R rows (CompiledDecode.run's arguments): R consecutive tokens of one sequence
        (block_tables [1, W]), or rows of several sequences (block_tables [R, W], a row each: a decode's, or a
        chunk's repeated for each of its rows); row r's context is positions[r] + 1 (every row's K/V is stored
        before any row attends). Their K/V rows are written."""
        tables = block_tables
        if tables.dtype != torch.int32 or not tables.is_contiguous():
            tables = tables.to(torch.int32).contiguous()
        rows = input_ids.shape[0]
        tokens = input_ids.to(torch.int64).contiguous()
        slots = slot_mapping.to(torch.int64).contiguous()
        at = positions.to(torch.int64).contiguous()
        logits = torch.empty(rows, self.vocab)
        stride = tables.shape[1] if tables.shape[0] > 1 else 0  # one table a row, or one for every row
        status = self.lib.tkv_decode_rows(ctypes.byref(self._model), rows, tokens.data_ptr(), at.data_ptr(),
                                          slots.data_ptr(), tables.data_ptr(), stride, logits.data_ptr())
        if status != 0:
            raise MemoryError("native decode step: no memory for its activations")
        self.steps += 1
        return logits
