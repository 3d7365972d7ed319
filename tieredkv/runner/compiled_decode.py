"""The compiled decode path: a step that decodes one sequence and does nothing else runs the same
LlamaModel layers through a graph compiled by inductor, with compile-friendly ops.

Why: at batch 1 a CPU decode step reads every weight once (the floor: the weights' bytes over the
memory bandwidth), and the eager forward adds a fixed cost on top: some 40 small torch operations
per layer, each with its dispatch, allocation and Python around it. Inductor fuses the norms, rotary
embedding, residual adds, the K/V store and the attention's gather and softmax into a few generated
C++ loops, and keeps the dense layers as library calls: on the plain weights where MKL's one-row product
reads them faster than oneDNN's packed layout (the AVX2 machines), else on the packed weights through their
handles (kernels/linear.py: graph_reads_packed measures which, once per processor). The graph's wrapper is
C++ (inductor's cpp_wrapper), which calls each kernel and library op without Python in between; quantized
weights' one-row products are a C++ operator too (kernels/quant_ops.cpp), so a call costs the dispatcher's
microseconds. Measured on an AMD EPYC (Zen 5, 2 cores), int4 default model, interleaved in one process:
6.87 -> 6.41 ms/token with both; the Python wrapper alone gave 1-9% of that, the operator alone about half.
Once a graph has served one call, each run of layers calls it past torch.compile's frame (direct_graph.py):
its guards and input-gathering bytecode cost 80-190 us a call (int4 7.87 -> 7.15 ms/token, fp32 17.16 ->
16.58, interleaved in one process).

What: one graph for a run of layers (the whole stack, with the embedding and the logits, up to
MAX_LAYERS_PER_GRAPH layers; the default model's 30 as 5 runs of 6), which every run of that length calls: a
layer reads no per-layer Python value, its weights and cache come in as inputs. Where layers differ (a GGUF
file that mixes block types), each distinct run of layers gets a graph of its own. Runs of layers, rather than
one graph per layer, save torch.compile's ~0.1 ms wrapper around each call (3 ms a token for 30 single-layer
graphs) and fuse each layer's last residual add into the next one's norm; runs rather than the whole stack
keep the trace, paid at every start, short.
The engine compiles it on a thread of its own from start-up (`start_background`) while the eager forward
serves, and switches to it between two steps once it is ready, so no request waits for a compile; and
inductor keeps it in its on-disk cache under the engine's cache directory, so a restart loads it.
Processes that start at once on one cache take turns: the first compiles under a file lock, the others
then load its graph. Steps with more sequences run the eager forward: measured here, a graph dynamic
in the batch was no faster at 2 decodes and twice as slow at 8 (its attention loops and the plain
weights' products lose to the eager grouping and oneDNN's packed weights).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from tieredkv.cache_dir import artifact_lock, long_work
from tieredkv.kernels import KernelOps
from tieredkv.kernels.decode_attention import decode_attention_compiled
from tieredkv.kernels.kernel_ops import with_kv
from tieredkv.kernels.store_kv import store_kv_dense
from tieredkv.models.batch import AttentionMetadata, ForwardBatch, scratch_block
from tieredkv.models.llama import LlamaModel
from tieredkv.platform.malloc_tuning import release_free_memory
from tieredkv.platform.process import PROCESS
from tieredkv.runner.direct_graph import BoundGraph, DirectGraph, Unsupported

log = logging.getLogger("tieredkv")

MIN_TABLE_WIDTH = 2  # tables are padded to this width: a width of 1 would be a graph of its own
# The graph's trace and compile time grow with its layers, and the trace is paid at every start (the caches
# skip only what follows it): the default model's 30 layers as one graph took 25-31 s to load at each start
# and ~2 min to compile once, as 5 runs of 6 layers 13 s, at the same decode speed (72.6-77.5 against
# 76.3-79.2 ms/token, AMD EPYC, AVX2)
MAX_LAYERS_PER_GRAPH = 8
RECOMPILE_LIMIT = 3  # 1 is expected; past this the path turns itself off rather than compile every step
GIL_SWITCH_S = 1e-4  # while compiling in the background (start_background)
_ONE_COMPILE = threading.Lock()  # engines of one process compile one at a time (inductor's settings are global)


def compile_wanted(setting: bool | None, device: torch.device) -> bool:
    """EngineConfig.compile_decode: None means on for CPU (on CUDA the Triton kernels already fuse the
    attention)."""
    return setting if setting is not None else device.type == "cpu"


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """The same memory as `t` (contiguous, on CPU) under a storage object of its own."""
    return torch.from_numpy(t.view(torch.uint8).numpy()).view(t.dtype).view(t.shape)


def layer_signature(layer: torch.nn.Module) -> tuple:
    """What a graph traced on one layer takes for granted of another it runs: each module's kind and settings,
    each weight's shape and dtype. Layers of one model differ where a GGUF file mixes block types (a Q4_K_M
    file keeps some layers' value and down projections in Q6_K)."""
    return (tuple((type(m).__name__, m.extra_repr()) for m in layer.modules()),
            tuple((name, tuple(t.shape), t.dtype) for name, t in [*layer.named_parameters(), *layer.named_buffers()]
                  if t is not None))


def layer_groups(model: LlamaModel, kv_cache: torch.Tensor) -> list[tuple[tuple, tuple]]:
    """The layers in equal runs, each with its layers' caches, for one graph to serve every run whose layers
    have the same signatures (one graph per distinct run: `CompiledDecode._stack_for`).

    A run is the whole stack when it has at most MAX_LAYERS_PER_GRAPH layers, else the longest run up to
    that which divides it. Each layer's cache is given a storage object of its own: a graph whose inputs
    share one storage and are written copies them whole (that is how inductor keeps aliased inputs
    right), where separate inputs are written in place. Off the CPU (no such alias), one layer a run."""
    num = len(model.layers)
    if kv_cache.device.type != "cpu":
        return [((layer,), (kv_cache[i],)) for i, layer in enumerate(model.layers)]
    size = max(g for g in range(1, min(num, MAX_LAYERS_PER_GRAPH) + 1) if num % g == 0)
    caches = [own_storage(kv_cache[i]) for i in range(num)]
    return [(tuple(model.layers[i:i + size]), tuple(caches[i:i + size])) for i in range(0, num, size)]


class CompiledDecode:
    """Runs steps that decode one sequence through the compiled graph."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, ops: KernelOps, cache_dir: Path):
        self.model = model
        self.kv_cache = kv_cache
        # the dense layers: each weight's graph_forward (kernels/dense.py: a packed weight through its handle, a plain
        # one through F.linear, quantized ones through their op)
        self.ops = with_kv(replace(ops, name=f"{ops.name}+compiled", plan_decode=None, graph=True,
                                   decode_attention=decode_attention_compiled, store_kv=store_kv_dense), ops.kv)
        self.cache_dir = cache_dir  # inductor's on-disk cache for this engine
        self.graphs = 0  # graphs compiled (or loaded from the cache): one per kind of run after warmup
        self.steps = 0  # steps this path ran
        self._warming = False  # warmup reports its own failures
        self.disabled: str | None = None  # why the path turned itself off, if it did
        self.ready = False  # the graph is compiled (or loaded) and serves: set once, by warmup
        self._thread: threading.Thread | None = None
        self._groups = layer_groups(model, kv_cache)
        kinds: dict[tuple, int] = {}
        # each run's kind: runs of one kind share a graph (every run, unless the layers differ)
        self._kinds = [kinds.setdefault(tuple(map(layer_signature, layers)), len(kinds)) for layers, _ in self._groups]
        self._stacks: dict[int, object] = {}
        # each run's graph called without torch.compile's frame (runner/direct_graph.py), once adopted
        self._direct: dict[int, DirectGraph] = {}
        self._bound: list[BoundGraph | None] = [None] * len(self._groups)
        self._compiled_last: DirectGraph | Unsupported | None = None  # what the backend compiled last
        self.direct_calls = 0  # runs of layers called that way

    def _stack_for(self, kind: int):
        """The compiled function for runs of one kind: its own graph, its own guards and recompile count."""
        if kind not in self._stacks:
            self._stacks[kind] = self._compiled()
        return self._stacks[kind]

    def _compiled(self):
        # The layers are not changed after load, so no guard checks their attributes on every call: that
        # would cost more than the layer's fused loops.
        # isolate_recompiles: each engine counts its own graphs (the code object is shared by all engines).
        return torch.compile(self._stack_forward, backend=self._backend, fullgraph=True,
                             recompile_limit=RECOMPILE_LIMIT, isolate_recompiles=True,
                             options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})

    def _backend(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        # a C++ wrapper on CPU (module docstring); on CUDA, where it has not been measured, inductor's default
        cpu = self.kv_cache.device.type == "cpu"
        try:
            graph: DirectGraph | Unsupported = DirectGraph(gm)  # before inductor rewrites the graph
        except Unsupported as e:
            graph = e
        compiled = compile_fx(gm, example_inputs, config_patches={"cpp_wrapper": True} if cpu else {})
        if isinstance(graph, DirectGraph):
            graph.compiled = compiled
        self._compiled_last = graph
        return compiled

    def _stack_forward(self, layers, x, layer_caches, positions, slot_mapping, block_tables, context_lens,
                       input_ids=None):
        """A run of decoder layers (any run of that length: the same graph serves all) over one decode.
        With `input_ids` (the run is the whole stack) the embedding before and the logits after are in
        the graph too, and x is not read; else the output is [2, hidden]: the run's hidden states, then the
        final norm of them, which the last run's caller hands to the LM head. The rotary cos/sin are computed in
        the graph, from the positions, and so is that norm in every run: each is a loop cheaper than the few torch
        calls outside the graphs that did it once a step (four of them, cold in cache after the weights' stream)."""
        batch = self._batch(input_ids, positions, slot_mapping, block_tables, context_lens)
        if input_ids is not None:
            x, rotary = self.model.embed(batch)
        else:
            rotary = self.model.rotary.forward(positions, x.dtype)
        for layer, cache in zip(layers, layer_caches):
            x = layer.forward(x, batch, rotary, cache, self.ops)
        if input_ids is None:
            return torch.cat((x, self.model.norm.forward(x)))
        return self.model.logits(x, batch, self.ops)

    @staticmethod
    def _batch(input_ids, positions, slot_mapping, block_tables, context_lens) -> ForwardBatch:
        """One decode's batch; inside the graph without `input_ids` (a run after the first reads none)."""
        attn = AttentionMetadata(
            num_decode_tokens=1, decode_block_tables=block_tables, decode_context_lens=context_lens,
            max_decode_context_len=0, prefill_block_tables=block_tables[:0], prefill_query_start_loc=context_lens[:1],
            prefill_context_lens=context_lens[:0], max_prefill_query_len=0)
        ids = positions if input_ids is None else input_ids
        return ForwardBatch(ids, positions, slot_mapping, torch.zeros_like(positions), attn)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        """LlamaModel.forward with each run of layers through the compiled graph."""
        a = batch.attn
        step = dict(positions=batch.positions, slot_mapping=batch.slot_mapping,
                    block_tables=a.decode_block_tables, context_lens=a.decode_context_lens)
        if len(self._groups) == 1:
            return self._run(0, dict(step, x=None, input_ids=batch.input_ids))
        out = self.model.token_embedding(batch.input_ids)
        for index in range(len(self._groups)):
            out = self._run(index, dict(step, x=out[:1]))
        return self.model.head(out[1:], self.ops)

    def _run(self, index: int, step: dict) -> torch.Tensor:
        """One run of layers: called directly once its graph is adopted, else through torch.compile."""
        bound = self._bound[index]
        if bound is not None:
            out = bound(step)
            if out is not None:
                self.direct_calls += 1
                return out
        layers, caches = self._groups[index]
        kind = self._kinds[index]
        self._compiled_last = None
        out = self._stack_for(kind)(layers=layers, layer_caches=caches, **step)
        if self._compiled_last is not None and kind not in self._direct:
            self._adopt(index, step, out)
        if bound is None and kind in self._direct:
            self._bound[index] = self._direct[kind].bind(self._run_values(index), frozenset(step))
        return out

    def _run_values(self, index: int) -> dict:
        """The graph's arguments that are not a step's own, for one run of layers."""
        layers, caches = self._groups[index]
        return dict(self=self, layers=layers, layer_caches=caches)

    def _adopt(self, index: int, step: dict, want: torch.Tensor) -> None:
        """Calls the graph just compiled for this run directly on the same inputs, and keeps that way of
        calling it for the kind's runs if the output is bit for bit torch.compile's (the call stores the
        same K/V again, so running it twice changes nothing)."""
        graph = self._compiled_last
        try:
            if isinstance(graph, Unsupported):
                raise graph
            got = graph.bind(self._run_values(index), frozenset(step))(step)
        except Unsupported as e:
            log.info("compiled decode: the graph is called through torch.compile (%s)", e)
            return
        if got is not None and torch.equal(got, want):
            self._direct[self._kinds[index]] = graph
        else:
            log.info("compiled decode: the graph is called through torch.compile (a direct call differed)")

    def accepts(self, scheduled: list) -> bool:
        """True for a step that decodes one sequence (one new token) and nothing else, once the graph is ready."""
        return self.ready and self.disabled is None and len(scheduled) == 1 and scheduled[0][1] == 1

    @property
    def state(self) -> str:
        """"compiled" (serving), "compiling" (in the background; the eager forward serves), or "eager" (off)."""
        if self.disabled is not None:
            return "eager"
        return "compiled" if self.ready else "compiling"

    def start_background(self) -> None:
        """Compiles (or loads) the graph on a thread of its own; the engine's steps run the eager forward
        until `ready` is set, between two of them. The thread ends when the graph is ready (its OpenMP
        threads with it, so they never compete with the worker's)."""
        def work() -> None:
            t0 = time.perf_counter()
            # The compile is Python through and through (tracing, code generation), and the worker's eager
            # step drops and retakes the GIL around each of its ~1,000 torch calls: at the default 5 ms
            # before the compile must yield, a first token took 14 s instead of a fraction of one. (Two engines
            # compiling at once: the process's own interval comes back when the last is done.)
            with PROCESS.switch_interval(GIL_SWITCH_S):
                self.warmup(ticker=False)
            if self.ready:
                log.info("compiled decode serves from now on (ready %.1f s after start-up)", time.perf_counter() - t0)

        self._thread = threading.Thread(target=work, name="tieredkv-compile", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """For the engine's close: waits for a compile still running. A process cannot leave one behind: a
        thread inside torch at interpreter exit aborts the process, and inductor cannot finish once the
        interpreter shuts down. Once finished, the graph is cached for later starts."""
        if self._thread is not None and self._thread.is_alive():
            log.info("finishing the decode graph's compile before closing (once per model and machine; later "
                     "starts load it from %s)", self.cache_dir)
            self._thread.join()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits for a background compile to end; True when the compiled graph serves."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.ready

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor | None:
        """fp32 logits [1, vocab] for one decode; block_tables [1, W] int32 (any W >= 1). None when the
        compiler refuses the step (more graphs than RECOMPILE_LIMIT): the path then turns itself off, with
        a warning, and the caller runs the eager forward (which rewrites the same K/V slot)."""
        width = block_tables.shape[1]
        if width < MIN_TABLE_WIDTH:  # the padding entries repeat the row's block; their positions are masked
            block_tables = block_tables.repeat(1, -(-MIN_TABLE_WIDTH // width))
        torch._dynamo.mark_dynamic(block_tables, 1)
        try:
            logits = self._forward(self._batch(input_ids, positions, slot_mapping, block_tables, context_lens))
        except (torch._dynamo.exc.TorchDynamoException, torch._dynamo.exc.FailOnRecompileLimitHit) as e:
            self.disabled = f"{type(e).__name__}: {_reason(e)}"
            if not self._warming:
                log.warning("compiled decode turned off, the eager forward serves from now on: %s", self.disabled)
            return None
        self.steps += 1
        return logits

    @torch.inference_mode()
    def warmup(self, ticker: bool = True) -> None:
        """Compiles (or loads from the cache) the graph with a decode over the scratch block, in the
        engine's inductor cache. One compile at a time in a process (inductor's cache directory is a
        process-wide setting). The first process to compile a graph does so under the cache's lock,
        and leaves a marker when it is done; processes that find the marker load the graph at once, side by
        side, and those that started meanwhile wait for the lock, then load. A compile that fails is tried
        once more (on an emptied cache when the failure points at a broken file); where it fails again (no
        C++ compiler, say) the path is off, the eager forward serves, and a warning says why and what to do."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        from tieredkv.kernels.quant_cpu import CPU

        if self.kv_cache.device.type == "cpu":  # before the trace, which calls them (quant.py, decode_attention.py)
            CPU.bind_operators(self.cache_dir.parent)
        self._warming = True
        try:
            marker = self.cache_dir / f".compiled-{self._graph_key()}"
            what = ("loading the compiled decode graph" if marker.exists() else
                    f"compiling the decode graph (once per model and machine, into {self.cache_dir})")
            with _ONE_COMPILE, long_work(what, ticker), temporary_cache_dir(str(self.cache_dir)):
                if not marker.exists():
                    with artifact_lock(self.cache_dir.parent / ".inductor.lock", "compiling the decode graph"):
                        if not marker.exists():
                            self._compile_with_retry()
                            if self.disabled is None:
                                marker.touch()
                if self.graphs == 0 and self.disabled is None:
                    self._compile_with_retry()
        finally:
            self._warming = False
        if self.disabled is not None:
            log.warning("compiled decode is off, the eager forward serves (correct, slower per token): %s. "
                        "If this persists, delete %s; compile_decode=False skips compiling.",
                        self.disabled, self.cache_dir)
        self.steps = 0
        release_free_memory()  # what tracing and code generation freed (hundreds of MB) leaves the process
        self.ready = self.disabled is None

    def _compile_with_retry(self) -> None:
        self._decode_scratch()
        if self.disabled is not None:
            broken = any(sign in self.disabled for sign in _BROKEN_CACHE)
            log.info("compiling the decode graph failed (%s); trying again%s", self.disabled,
                     " on an emptied cache" if broken else "")
            if broken:
                shutil.rmtree(self.cache_dir, ignore_errors=True)
            self.disabled, self._stacks, self._direct = None, {}, {}
            self._bound = [None] * len(self._groups)
            self._decode_scratch()

    def _graph_key(self) -> str:
        """What the graph depends on: the model's shape, the cache tensor's shape, dtype and K/V formats (stable
        across starts: sizing.far_extent), torch's version, the runs of layers and their kinds, the weights'
        quantization."""
        kv = self.ops.kv.label if self.ops.kv is not None else None
        identity = repr((self.model.spec, tuple(self.kv_cache.shape), self.kv_cache.dtype, kv, torch.__version__,
                         [len(layers) for layers, _ in self._groups], self._kinds, self.model.quantization))
        return hashlib.sha256(identity.encode()).hexdigest()[:16]

    def _decode_scratch(self) -> None:
        """One decode at position 0 into the scratch block, which no sequence holds."""
        scratch, device = scratch_block(self.kv_cache), self.kv_cache.device
        zeros = torch.zeros(1, dtype=torch.int64, device=device)
        table = torch.full((1, MIN_TABLE_WIDTH), scratch, dtype=torch.int32, device=device)
        slot = torch.full((1,), scratch * self.kv_cache.shape[3], dtype=torch.int64, device=device)
        self.run(zeros, zeros.clone(), slot, table, torch.ones(1, dtype=torch.int32, device=device))


_BROKEN_CACHE = ("ImportError", "EOFError", "UnpicklingError", "file too short", "invalid ELF header")


def _reason(e: BaseException) -> str:
    """An exception's message without torch's advice on logging: its first paragraph on one line, cut at
    a word boundary after 400 characters."""
    first = str(e).strip().split("\n\n")[0]
    text = " ".join(first.split())
    return text if len(text) <= 400 else text[:400].rsplit(" ", 1)[0] + " ..."
