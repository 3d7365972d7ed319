"""The compiled decode path (compiled_decode.py): its ops match the references, it is what runs for a
step that decodes one sequence, and its graph is compiled once, at start-up."""

import asyncio
import os

import pytest
import torch

from helpers import check_pool_clean, fresh_cache, hf_greedy, make_config, native_takes_fp32, run_to_end
from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.engine.engine_core import EngineCore
from tieredkv.kernels.decode_attention import decode_attention_dense, decode_attention_ref
from tieredkv.kernels.store_kv import store_kv_dense, store_kv_ref
from tieredkv.runner.compiled_decode import compile_wanted

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("batch, width", [(1, 1), (1, 5), (3, 4), (5, 2)])
def test_dense_decode_attention_matches_reference(dtype, atol, batch, width):
    g = torch.Generator().manual_seed(batch * 10 + width)
    num_blocks, bs, kv_heads, group, d = 24, 8, 2, 3, 16
    kv = torch.randn(2, num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:width] for _ in range(batch)]).to(torch.int32)
    lens = torch.randint(1, width * bs + 1, (batch,), generator=g).to(torch.int32)
    lens[0] = width * bs  # one row fills its table
    q = torch.randn(batch, kv_heads * group, d, generator=g).to(dtype)
    got = decode_attention_dense(q, kv[0], kv[1], tables, lens, d**-0.5)
    want = decode_attention_ref(q, kv[0], kv[1], tables, lens, d**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=0)
    # blocks past a row's length do not matter: the same answer with them replaced by other blocks
    padded = torch.cat([tables, tables[:, :1].repeat(1, 2)], dim=1)
    torch.testing.assert_close(decode_attention_dense(q, kv[0], kv[1], padded, lens, d**-0.5).float(), want.float(),
                               atol=atol, rtol=0)


def test_dense_store_matches_reference():
    g = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 6, 4, 2, 8, generator=g)
    ref = kv.clone()
    key, value = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    slots = torch.tensor([3, 17, 0, 23, 9])
    store_kv_ref(key, value, ref, slots)
    store_kv_dense(key, value, kv, slots)
    assert torch.equal(kv, ref)


def test_compile_setting_and_the_command_lines_environment(monkeypatch):
    """The package reads no environment variable for the setting; the command line maps TIEREDKV_<FIELD>."""
    import pydantic

    monkeypatch.setenv("TIEREDKV_COMPILE_DECODE", "1")
    assert compile_wanted(None, CPU) and not compile_wanted(None, torch.device("cuda"))
    assert not compile_wanted(False, CPU) and compile_wanted(True, torch.device("cuda"))
    assert EngineConfig(model="m").compile_decode is None  # the environment is not read here
    assert make_config().compile_decode is False and make_config(compile_decode=None).compile_decode is None
    env = {"TIEREDKV_COMPILE_DECODE": "0", "TIEREDKV_WARM_BYTES": "none", "TIEREDKV_MAX_NUM_SEQS": "8"}
    cfg = EngineConfig.from_env(env, max_num_seqs=4, cold_path=None)
    assert (cfg.compile_decode, cfg.warm_bytes, cfg.max_num_seqs, cfg.cold_path) == (False, None, 4, None)
    with pytest.raises(pydantic.ValidationError, match="compile_decode"):
        EngineConfig.from_env({"TIEREDKV_COMPILE_DECODE": "yes please"})


def test_compiled_path_is_what_runs_and_compiles_once(llama_dir):
    """One graph at start-up (one decode, any table width); steps that decode one sequence run it with no
    further compile; a step with a prefill chunk, or more decodes, runs the eager forward; outputs equal
    transformers'."""
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=128, compile_decode=True, native_decode=False))
    compiled = core.runner.compiled
    assert compiled is not None and compiled.graphs == 1 and compiled.steps == 0
    prompt = list(range(5, 12))  # 7 tokens: the first decodes read a table of one block
    new = 40
    assert run_to_end(core, [prompt], [new]) == hf_greedy(llama_dir, [prompt], new)
    assert compiled.steps == new - 1  # every step but the prefill, which samples the first token
    steps = compiled.steps
    prompts = [list(range(3 + i, 20 + 3 * i)) for i in range(3)]
    lengths = [4, 7, 12]  # the batch shrinks to one sequence
    want = [out[:n] for out, n in zip(hf_greedy(llama_dir, prompts, 12), lengths)]
    assert run_to_end(core, prompts, lengths) == want
    # the decode steps that held 3 or 2 sequences ran eager, the 12 - 7 after them compiled
    assert compiled.steps == steps + 12 - 7
    assert compiled.graphs == 1
    # every compiled step called the graph directly, past torch.compile's frame (direct_graph.py)
    assert compiled.direct_calls == compiled.steps
    check_pool_clean(core)


async def test_async_engine_defaults_to_a_decode_path_on_cpu(llama_dir):
    """compile_decode=None is on for CPU: fp32 weights go to the native C step where it takes them (builds with
    AVX-512), else to the compiled graph."""
    config = make_config(model=str(llama_dir), num_blocks=64, compile_decode=None)
    async with await AsyncEngine.start(config) as engine:
        out = await engine.generate([7, 8, 9, 3], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 6
        native = native_takes_fp32()
        assert engine.stats().decode_path == ("native" if native else "compiled")
        assert engine.core.runner.compiled.steps == 5 + native  # (the native step takes the 4-token prompt too)


async def test_requests_are_served_while_the_graph_compiles_in_the_background(llama_dir):
    """With compile_in_background (the default outside the tests), start() returns before the graph is
    ready: requests are served by the eager forward meanwhile (the background decode writes only the
    scratch block), and once it is ready, between two steps, the compiled graph serves with the same tokens."""
    from tieredkv.runner import compiled_decode

    prompt, want = [5, 6, 7, 8], None
    cfg = make_config(model=str(llama_dir), num_blocks=64, compile_decode=True, native_decode=False,
                      compile_in_background=True)
    with compiled_decode._ONE_COMPILE:  # holds the background compile back until the first answers are in
        engine = await AsyncEngine.start(cfg)
        assert engine.stats().decode_path == "compiling"
        outs = await asyncio.gather(*(engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, n=n))
                                      for n in (1, 2)))
        want = outs[0].outputs[0].token_ids
        assert [o.token_ids for o in outs[1].outputs] == [want, want]
        compiled = engine.core.runner.compiled
        assert compiled.steps == 0 and engine.stats().decode_path == "compiling"
    async with engine:
        assert await asyncio.to_thread(compiled.wait_ready, 600)
        again = await engine.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        assert again.outputs[0].token_ids == want == hf_greedy(llama_dir, [prompt], 8)[0]
        assert compiled.steps == 7 and engine.stats().decode_path == "compiled"
        await engine.run_in_worker(check_pool_clean, engine.core)


def test_a_compiler_failure_leaves_the_eager_forward_serving(llama_dir, monkeypatch, caplog):
    """Where inductor cannot compile (no C++ compiler, say), the engine still starts and serves."""
    from tieredkv.runner.compiled_decode import CompiledDecode

    def refuse(self, gm, example_inputs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(CompiledDecode, "_backend", refuse)
    caplog.set_level("INFO", logger="tieredkv")
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=64, compile_decode=True, native_decode=False))
    compiled = core.runner.compiled
    assert compiled.disabled and "no compiler" in compiled.disabled and "compiled decode is off" in caplog.text
    assert "trying again" in caplog.text and "compile_decode=False" in caplog.text
    assert "emptied cache" not in caplog.text  # a compiler that refuses is no broken cache: nothing deleted
    prompt = [5, 6, 7, 8]
    assert run_to_end(core, [prompt], [10]) == hf_greedy(llama_dir, [prompt], 10)
    assert compiled.steps == 0


def test_the_eager_forward_never_goes_through_module_call(llama_dir, monkeypatch):
    """While the decode graph compiles in the background, torch.fx's tracers replace nn.Module.__call__
    process-wide with a wrapper that fails for any module outside the traced one; the eager forward serving
    meanwhile must not go through it (llama.py, FORWARD_ONLY). Prefill chunks, batched decodes and a
    shared prefix, with __call__ refusing."""
    prompts = [list(range(5, 60)), list(range(5, 60)) + [9, 8], [4, 5, 6]]
    want = hf_greedy(llama_dir, prompts, 8)
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=64, max_num_batched_tokens=32))

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{type(self).__name__}.__call__ during a step")

    monkeypatch.setattr(torch.nn.Module, "__call__", refuse)
    assert run_to_end(core, prompts, [8] * 3) == want


def test_a_broken_compile_cache_is_emptied_and_the_graph_rebuilt(llama_dir, tmp_path, monkeypatch, caplog):
    """A compiled module that cannot be loaded (a 0-byte .so left by a killed compile: "file too short") is a
    broken cache: it is emptied, the graph compiled again, and the compiled path serves."""
    from tieredkv.runner.compiled_decode import CompiledDecode

    calls = []

    def first_load_fails(self, gm, example_inputs):  # then the traced graph as it is (no inductor: seconds less)
        calls.append(1)
        if len(calls) == 1:
            raise ImportError(f"{self.cache_dir}/xy/cxy.main.so: file too short")
        self.graphs += 1
        return gm.forward

    monkeypatch.setattr(CompiledDecode, "_backend", first_load_fails)
    caplog.set_level("INFO", logger="tieredkv")
    leftover = tmp_path / "inductor" / "xy" / "cxy.main.so"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"")
    core = EngineCore(make_config(model=str(llama_dir), cache_dir=str(fresh_cache(tmp_path)), num_blocks=64,
                                  compile_decode=True, native_decode=False))
    compiled = core.runner.compiled
    assert "on an emptied cache" in caplog.text and not leftover.exists()
    assert compiled.ready and compiled.disabled is None and len(calls) == 2
    prompt = [5, 6, 7, 8]
    assert run_to_end(core, [prompt], [6]) == hf_greedy(llama_dir, [prompt], 6)
    assert compiled.steps == 5


def test_a_compiler_failure_while_serving_is_reported_and_the_eager_forward_takes_over(llama_dir, monkeypatch, caplog):
    """The first decode after start-up may hit the compiler (a recompile past the limit, say): the path turns
    itself off with a warning, and that step and the rest run eager, with the same tokens."""
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=64, compile_decode=True, native_decode=False))
    compiled = core.runner.compiled
    assert compiled.disabled is None and compiled.steps == 0

    def refuse(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("recompile refused")

    monkeypatch.setattr(compiled, "_stack_for", lambda kind: refuse)
    # steps the direct call does not take (inputs other than traced) go through torch.compile, which refuses
    monkeypatch.setattr(compiled, "_bound", [lambda step: None] * len(compiled._bound))
    prompt = [5, 6, 7, 8]
    assert run_to_end(core, [prompt], [6]) == hf_greedy(llama_dir, [prompt], 6)
    assert compiled.disabled and "recompile refused" in compiled.disabled and compiled.steps == 0
    assert "compiled decode turned off" in caplog.text


@pytest.mark.parametrize("num_layers, run", [(2, 2), (8, 8), (30, 6), (28, 7), (64, 8), (60, 6), (37, 1)])
def test_layer_runs_are_equal_and_caches_share_memory_not_storage(num_layers, run):
    """One graph serves every run, so runs are equal; each cache is the layer's own memory under a
    storage of its own (inputs sharing a storage would be copied whole by the graph)."""
    from types import SimpleNamespace

    from tieredkv.runner.compiled_decode import layer_groups

    kv = torch.zeros(num_layers, 2, 3, 4, 1, 2)
    groups = layer_groups(SimpleNamespace(layers=list(range(num_layers))), kv)
    assert [len(layers) for layers, _ in groups] == [run] * (num_layers // run)
    assert [layer for layers, _ in groups for layer in layers] == list(range(num_layers))
    caches = [c for _, cs in groups for c in cs]
    layer_bytes = kv[0].numel() * kv.element_size()
    # a view's storage would be the whole cache's; each of these covers its layer alone
    assert all(c.untyped_storage().nbytes() == layer_bytes for c in caches)
    assert [c.data_ptr() for c in caches] == [kv[i].data_ptr() for i in range(num_layers)]
    caches[-1][1, 2, 3, 0, 1] = 7.0  # writes land in the engine's cache
    assert kv[-1, 1, 2, 3, 0, 1] == 7.0 and kv.sum() == 7.0


def test_a_stack_in_several_runs_shares_one_graph(llama_dir, monkeypatch):
    """A stack longer than MAX_LAYERS_PER_GRAPH runs as equal runs of layers through one graph, the
    embedding and logits outside it; outputs equal transformers'."""
    import tieredkv.runner.compiled_decode as cd

    monkeypatch.setattr(cd, "MAX_LAYERS_PER_GRAPH", 1)
    core = EngineCore(make_config(model=str(llama_dir), num_blocks=64, compile_decode=True, native_decode=False))
    compiled = core.runner.compiled
    assert len(compiled._groups) == core.spec.num_layers > 1
    prompt = list(range(9, 30))
    assert run_to_end(core, [prompt], [20]) == hf_greedy(llama_dir, [prompt], 20)
    assert compiled.steps == 19 and compiled.graphs == 1
    assert compiled.direct_calls == 19 * len(compiled._groups)


START = """
import json, sys
from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.engine.engine_core import EngineCore

core = EngineCore(EngineConfig(model=sys.argv[1], cache_dir=sys.argv[2], num_blocks=32, compile_decode=True,
                               native_decode=False))


def answer():
    req = core.factory.make([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    core.add_request(req)
    while core.has_work():
        core.step()
    return req.seqs[0].output_token_ids


first = answer()  # at once, while the graph compiles (or loads) in the background
compiled = core.runner.compiled
ready = compiled.wait_ready(600)
steps = compiled.steps
second = answer()
print(json.dumps({"tokens": [first, second], "disabled": compiled.disabled, "ready": ready,
                  "steps": compiled.steps - steps}))
"""


def _start_engines(llama_dir, cache, home, n):
    """n processes that each start an engine on `cache` at once, decode, and report; HOME and the XDG cache
    point into `home`."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / "xdg")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    home.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", START, str(llama_dir), str(cache)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(n)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        assert "compiled decode is off" not in err and "turned off" not in err, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_engines_starting_at_once_on_an_empty_cache_all_serve_compiled(tmp_path):
    """Two processes on one cache directory empty but for the kernel builds, each compiling in the background
    (the default) while it answers a first request: one compiles under the lock, the other loads its graph; both
    answer at once, and then on the compiled path, and nothing lands in the user's home or XDG cache (inductor keeps
    its precompiled C++ headers in the system's temporary directory whatever it is told; those are shared
    by every program on the machine). (A half-written converted model: test_default_model.py.)"""
    from helpers import make_checkpoint

    llama_dir = make_checkpoint(tmp_path / "model", "llama", num_hidden_layers=1)  # the smallest graph to compile
    cache, home = fresh_cache(tmp_path / "cache"), tmp_path / "home"
    want = hf_greedy(llama_dir, [[5, 6, 7, 8]], 6)[0]
    results = _start_engines(llama_dir, cache, home, 2)
    assert all(r["tokens"] == [want, want] and r["disabled"] is None and r["ready"] and r["steps"] == 5
               for r in results), results
    leaked = [p for p in home.rglob("*") if p.is_file()]
    assert not leaked, leaked[:10]
    assert any(p.suffix == ".so" and p.stat().st_size > 0 for p in (cache / "inductor").rglob("*"))
    assert len(list((cache / "inductor").glob(".compiled-*"))) == 1  # the marker: later starts load at once


def test_a_graph_called_directly_takes_only_the_inputs_it_was_traced_for():
    """direct_graph: the inputs of a module are looked up once, a step's own are passed per call; a step
    whose tensor differs in dtype, a static size or stride, or a call in another grad mode, is not called
    directly (None), and a dynamic size is passed as the step's own."""
    from torch._inductor.compile_fx import compile_fx

    from tieredkv.runner.direct_graph import DirectGraph, Unsupported

    graphs = []

    def backend(gm, example_inputs):
        graph = DirectGraph(gm)
        graph.compiled = compile_fx(gm, example_inputs)
        graphs.append(graph)
        return graph.compiled

    layer = torch.nn.Linear(4, 3)

    def step(layer, x, table):
        return layer(x) * table.shape[1] + table.sum()

    compiled = torch.compile(step, backend=backend, fullgraph=True)
    x, table = torch.randn(2, 4), torch.ones(1, 5)
    torch._dynamo.mark_dynamic(table, 1)
    with torch.inference_mode():
        want = compiled(layer=layer, x=x, table=table)
        bound = graphs[0].bind(dict(layer=layer), frozenset(["x", "table"]))
        assert torch.equal(bound(dict(x=x, table=table)), want)
        wide = torch.ones(1, 9)  # the dynamic size: passed as this step's
        assert torch.allclose(bound(dict(x=x, table=wide)), layer(x) * 9 + 9)
        assert bound(dict(x=x.double(), table=table)) is None
        assert bound(dict(x=torch.randn(3, 4), table=table)) is None
        assert bound(dict(x=torch.randn(4, 2).t(), table=table)) is None  # same sizes, other strides
    assert len(graphs) == 1
    assert bound(dict(x=x, table=table)) is None  # outside inference mode
    # a float attribute that differs between two modules becomes an input on the recompile (a 0-dim tensor):
    # the bound graph passes it as one; an input of the wrong kind is refused at bind, before any call
    layer.scale, other = 0.5, torch.nn.Linear(4, 3)
    other.scale = 0.25

    def scaled(layer, x):
        return layer(x) * layer.scale

    compiled = torch.compile(scaled, backend=backend, fullgraph=True)
    with torch.inference_mode():
        compiled(layer=layer, x=x)
        want = compiled(layer=other, x=x)
        assert len(graphs) == 3 and "L['layer'].scale" in graphs[2].sources
        assert torch.equal(graphs[2].bind(dict(layer=other), frozenset(["x"]))(dict(x=x)), want)
        other.scale = "a string"
        with pytest.raises(Unsupported, match="scale"):
            graphs[2].bind(dict(layer=other), frozenset(["x"]))
        with pytest.raises(Unsupported, match="not the tensor traced"):
            graphs[0].bind(dict(layer=torch.nn.Linear(5, 3)), frozenset(["x", "table"]))
