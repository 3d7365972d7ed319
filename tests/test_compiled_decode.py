"""The compiled decode path (compiled_decode.py): its ops match the references, it is what runs for a
step that decodes one sequence, and its graph is compiled once, at start-up."""

import pytest
import torch

from helpers import check_pool_clean, hf_greedy
from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.runner.compiled_decode import COMPILE_ENV, compile_wanted
from tieredkv.engine_core import EngineCore
from tieredkv.kernels.decode_attention import decode_attention_dense, decode_attention_ref
from tieredkv.kernels.store_kv import store_kv_dense, store_kv_ref

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


def test_compile_setting_and_environment(monkeypatch):
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert compile_wanted(None, CPU) and not compile_wanted(None, torch.device("cuda"))
    assert not compile_wanted(False, CPU) and compile_wanted(True, torch.device("cuda"))
    monkeypatch.setenv(COMPILE_ENV, "0")
    assert not compile_wanted(None, CPU) and compile_wanted(True, CPU)
    monkeypatch.setenv(COMPILE_ENV, "yes")
    with pytest.raises(ValueError, match=COMPILE_ENV):
        compile_wanted(None, CPU)


def run_to_end(core: EngineCore, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    reqs = [core.factory.make(p, SamplingParams(max_tokens=n, ignore_eos=True), f"r{i}")
            for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    for r in reqs:
        assert core.add_request(r) == []
    while core.has_work():
        core.step()
    return [r.seqs[0].output_token_ids for r in reqs]


def test_compiled_path_is_what_runs_and_compiles_once(llama_dir):
    """One graph at start-up (one decode, any table width); steps that decode one sequence run it with no
    further compile; a step with a prefill chunk, or more decodes, runs the eager forward; outputs equal
    transformers'."""
    core = EngineCore(EngineConfig(model=str(llama_dir), num_blocks=128, compile_decode=True))
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
    check_pool_clean(core)


async def test_async_engine_defaults_to_compiled_decode_on_cpu(llama_dir, monkeypatch):
    monkeypatch.delenv(COMPILE_ENV)
    async with await AsyncEngine.start(EngineConfig(model=str(llama_dir), num_blocks=64)) as engine:
        out = await engine.generate([7, 8, 9, 3], SamplingParams(max_tokens=6, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 6
        assert engine.core.runner.compiled.steps == 5


def test_a_compiler_failure_leaves_the_eager_forward_serving(llama_dir, monkeypatch, caplog):
    """Where inductor cannot compile (no C++ compiler, say), the engine still starts and serves."""
    from tieredkv.runner.compiled_decode import CompiledDecode

    def refuse(self, gm, example_inputs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(CompiledDecode, "_backend", refuse)
    core = EngineCore(EngineConfig(model=str(llama_dir), num_blocks=64, compile_decode=True))
    compiled = core.runner.compiled
    assert compiled.disabled and "no compiler" in compiled.disabled and "compiled decode turned off" in caplog.text
    prompt = [5, 6, 7, 8]
    assert run_to_end(core, [prompt], [10]) == hf_greedy(llama_dir, [prompt], 10)
    assert compiled.steps == 0


@pytest.mark.parametrize("num_layers, run", [(2, 2), (30, 30), (64, 32), (60, 30), (37, 1)])
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
    core = EngineCore(EngineConfig(model=str(llama_dir), num_blocks=64, compile_decode=True))
    compiled = core.runner.compiled
    assert len(compiled._groups) == core.spec.num_layers > 1
    prompt = list(range(9, 30))
    assert run_to_end(core, [prompt], [20]) == hf_greedy(llama_dir, [prompt], 20)
    assert compiled.steps == 19 and compiled.graphs == 1
