"""The KV cache in fewer bytes (EngineConfig.kv_cache_dtype, kernels/kv_format.py): each format's rows and their
error, the engine's outputs in each format against the torch reference path, every tier holding the same bytes,
the fingerprint keeping formats apart, sizing and the errors at start."""

import asyncio

import pytest
import torch
from pydantic import ValidationError

from helpers import check_pool_clean, drive, fresh_cache, make_checkpoint, make_config, rand_ids
from tieredkv import AsyncEngine, SamplingParams
from tieredkv.errors import SnapshotError
from tieredkv.kernels.kv_format import FORMATS, KVLayout, hadamard, rotates
from tieredkv.tools.plan import plan

BS = 16
TINY = dict(layers=3, kv_heads=2, head_dim=16)  # helpers.make_checkpoint's llama
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


SYSTEMS = [rand_ids(96, seed=s) for s in range(3)]  # 6 blocks each
PROMPTS = [SYSTEMS[i % 3] + rand_ids(7 + i, seed=50 + i) for i in range(6)]


def token_bytes(fmt_k, fmt_v=None, layers=TINY["layers"], kv_heads=TINY["kv_heads"], head_dim=TINY["head_dim"]):
    return KVLayout.resolve(fmt_k, fmt_v or fmt_k, head_dim, torch.float32).bytes_per_token(layers, kv_heads)


# -- the formats -------------------------------------------------------------------------------------


def test_bytes_per_token_of_the_default_model_in_each_format():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64; the targets: int8 <= 12.5 KiB, int4 <= 7 KiB
    sizes = {f: token_bytes(f, layers=30, kv_heads=3, head_dim=64) for f in ("float32", "bfloat16", "int8", "int4")}
    # int8: 64 codes and a scale; int4: 32 bytes of codes and a scale per 32 values
    assert sizes == {"float32": 46_080, "bfloat16": 23_040, "int8": 30 * 2 * 3 * 66, "int4": 30 * 2 * 3 * 36}
    assert sizes["int8"] <= 12.5 * 1024 and sizes["int4"] <= 7 * 1024
    # K and V of different widths: the narrower side's rows are padded to the wider's
    assert token_bytes("int8", "int4", layers=30, kv_heads=3, head_dim=64) == sizes["int8"]
    assert KVLayout.resolve("int8", "int4", 64, torch.float32).label == "k=int8,v=int4"


def test_the_fingerprint_names_int4s_levels_and_the_key_shift():
    # a block's bytes mean what the formats, int4's levels and the key shift say: rows of Q4_0's levels (earlier
    # versions) or unshifted keys are another fingerprint, never read as these
    ids = {(k, v): KVLayout.resolve(k, v, 64, torch.float32).identity
           for k, v in (("int4", "int4"), ("int8", "int4"), ("int4", "int8"), ("int8", "int8"))}
    assert ids == {("int4", "int4"): "int4/36/iq4_nl/k-mean", ("int8", "int4"): "k=int8,v=int4/66/iq4_nl",
                   ("int4", "int8"): "k=int4,v=int8/66/iq4_nl/k-mean", ("int8", "int8"): "int8/66"}


@pytest.mark.parametrize("name", ["bfloat16", "float16", "int8", "int4", "fp8"])
def test_each_format_holds_a_row_within_its_rounding(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.logspace(-3, 2, 5)[:, None, None]
    x[0, 0, 7] = 40.0  # an outlier in one row
    fmt = FORMATS[name]
    rows = fmt.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 3, fmt.row_bytes(64))
    back = fmt.decode(rows, 64, torch.float32)
    if name == "int4":  # rounding happens on the turned row, in groups of 32: the error's length is what it was
        turned = hadamard(x).view(5, 3, 2, 32)
        step = turned.abs().amax(-1) / 8  # each group's scale: half a step off at most, a step where clamped at +7
        assert ((back - x).norm(dim=-1) <= (32 * step**2).sum(-1).sqrt() * 1.01).all()
        assert rotates(fmt, 64) and not rotates(fmt, 48) and not rotates(FORMATS["int8"], 64)
        return
    amax = x.abs().amax(-1, keepdim=True)
    bound = {"bfloat16": x.abs() * 2**-8, "float16": x.abs() * 2**-11 + 1e-7, "int8": amax / 127 * 0.5 * 1.001,
             "fp8": x.abs() * 2**-4 + amax * 1e-3}
    assert ((back - x).abs() <= bound[name]).all()
    assert torch.equal(fmt.decode(fmt.encode(back), 64, torch.float32), back)  # stable


def test_the_turn_is_its_own_inverse_and_keeps_products():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 7, 128, generator=g)
    torch.testing.assert_close(hadamard(hadamard(k)), k, atol=1e-6, rtol=0)
    torch.testing.assert_close((hadamard(q) * hadamard(k)).sum(-1), (q * k).sum(-1), atol=1e-5, rtol=1e-5)


def test_bad_formats_are_refused_at_start_naming_what_is_supported(llama_dir, tmp_path):
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        make_config(kv_cache_dtype="int2")
    with pytest.raises(ValueError, match="fp8 runs on CUDA only.*supported here: auto, float32, bfloat16"):
        asyncio.run(AsyncEngine.start(make_config(model=str(llama_dir), kv_cache_dtype="fp8", device="cpu")))
    odd = make_checkpoint(tmp_path / "odd", hidden_size=60, num_attention_heads=6, num_key_value_heads=2)  # head 10
    with pytest.raises(ValueError, match="int4 packs two values a byte and needs head_dim divisible by 4; the "
                                         "model's is 10"):
        asyncio.run(AsyncEngine.start(make_config(model=str(odd), kv_cache_dtype_v="int4")))
    with pytest.raises(ValueError, match="int4"):
        plan(str(odd), device="cpu", kv_cache_dtype="int4")


# -- the engine in each format -----------------------------------------------------------------------


async def outputs(engines, model_dir, prompts, params=PARAMS, **cfg):
    config = make_config(model=str(model_dir), num_blocks=cfg.pop("num_blocks", 128), warm_bytes=cfg.pop(
        "warm_bytes", 0), **cfg)
    async with await engines.start(config) as engine:
        res = [await engine.generate(p, params) for p in prompts]
        await engine.run_in_worker(check_pool_clean, engine.core)
        return [[o.token_ids for o in r.outputs] for r in res], [r.usage for r in res], engine.stats()


FORMAT_CONFIGS = {"bfloat16": dict(kv_cache_dtype="bfloat16"), "float16": dict(kv_cache_dtype="float16"),
                  "int8": dict(kv_cache_dtype="int8"), "int4": dict(kv_cache_dtype="int4"),
                  "k=int8,v=int4": dict(kv_cache_dtype="int8", kv_cache_dtype_v="int4")}


@pytest.fixture(scope="module")
def reference(engines, llama_dir):
    """Each format's outputs through the torch references (the caches gathered, then dequantized)."""
    return {name: asyncio.run(outputs(engines, llama_dir, PROMPTS, attention_backend="torch", **cfg))
            for name, cfg in FORMAT_CONFIGS.items()}


@pytest.mark.parametrize("name", list(FORMAT_CONFIGS))
async def test_the_cpu_kernels_read_each_format_as_the_torch_reference(engines, llama_dir, reference, name):
    # the C decode kernel reads the codes where they lie; greedy outputs, prefix hits and the pool's use are the
    # reference's, and the stats say the format and its bytes
    got, usage, stats = await outputs(engines, llama_dir, PROMPTS, **FORMAT_CONFIGS[name])
    want, want_usage, _ = reference[name]
    assert got == want
    assert [u.cached_tokens_by_tier for u in usage] == [u.cached_tokens_by_tier for u in want_usage]
    assert sum(u.cached_prompt_tokens for u in usage) == 3 * 96  # each system prompt computed once
    k, v = name.removeprefix("k=").split(",v=") if "," in name else (name, name)
    assert (stats.kv_format, stats.kv_bytes_per_token) == (name, token_bytes(k, v))


async def test_a_smaller_kv_stays_close_to_fp32_kv(engines, llama_dir):
    # the next-token distribution after a prompt, against fp32 KV: 16-bit nearly equal, int8 close, int4 near
    prompt = SYSTEMS[0] + rand_ids(40, seed=9)
    params = SamplingParams(max_tokens=1, logprobs=5)
    top = {}
    for name in ("float32", "bfloat16", "int8", "int4"):
        async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0,
                                                   kv_cache_dtype=name)) as engine:
            out = await engine.generate(prompt, params)
            top[name] = dict(out.outputs[0].logprobs[0].top)
    for name, tol in (("bfloat16", 0.02), ("int8", 0.05), ("int4", 0.5)):
        for token, logprob in top["float32"].items():
            assert abs(top[name].get(token, -99.0) - logprob) < tol, (name, token)


async def test_samples_beams_and_swaps_work_unchanged_on_int8_blocks(engines, llama_dir):
    # n > 1 shares the prompt's int8 blocks (CoW of the partial one), beams fork them, preemption swaps them to
    # warm and back: each gives what the roomy engine in the same format gives
    params = SamplingParams(max_tokens=6, n=3, temperature=0.8, seed=7, ignore_eos=True)
    beams = SamplingParams(max_tokens=5, beam_width=3, n=2)
    want_n, _, _ = await outputs(engines, llama_dir, PROMPTS[:2], params, kv_cache_dtype="int8")
    want_b, _, _ = await outputs(engines, llama_dir, PROMPTS[:2], beams, kv_cache_dtype="int8")
    got_n, _, stats = await outputs(engines, llama_dir, PROMPTS[:2], params, kv_cache_dtype="int8", num_blocks=20)
    assert got_n == want_n and stats.cow_copies > 0
    got_b, _, _ = await outputs(engines, llama_dir, PROMPTS[:2], beams, kv_cache_dtype="int8",
                                attention_backend="torch")
    assert got_b == want_b
    long = [rand_ids(40 + 9 * i, seed=i) for i in range(5)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    block = token_bytes("int8") * BS
    roomy, _, _ = await outputs(engines, llama_dir, long, params, kv_cache_dtype="int8")
    async with await engines.start(make_config(
            model=str(llama_dir), kv_cache_dtype="int8", num_blocks=12, warm_bytes=64 * block,
            enable_prefix_caching=False, offload="off")) as engine:
        res = await asyncio.gather(*(engine.generate(p, params) for p in long))
        assert [[r.outputs[0].token_ids] for r in res] == roomy
        assert engine.stats().num_swaps > 0


async def test_native_step_writes_and_reads_each_format_as_the_eager_forward(engines, llama_dir):
    # quantized weights on CPU: the native C step stores its K/V rows in the cache's format (tkv_kv_store) and
    # attends over them; its tokens are the eager forward's
    for name in ("int8", "int4", "bfloat16"):
        eager, _, _ = await outputs(engines, llama_dir, PROMPTS[:3], kv_cache_dtype=name, quantization="int8")
        native, _, stats = await outputs(engines, llama_dir, PROMPTS[:3], kv_cache_dtype=name, quantization="int8",
                                         compile_decode=True)
        assert stats.decode_path == "native" and native == eager, name


async def test_the_compiled_decode_graph_reads_int4_rows(engines, llama2_dir):
    # fp32 weights: one-sequence decodes run through the inductor graph, whose attention is the CPU kernel's
    # operator on the turned int4 rows and whose store quantizes in the graph; its tokens are the eager forward's
    # (two layers: the compile is most of the test's time; the cache's shape is the store-path test's below, so
    # the two share one graph, compiled once into the default cache)
    eager, _, _ = await outputs(engines, llama2_dir, PROMPTS[:2], kv_cache_dtype="int4", num_blocks=32)
    compiled, _, stats = await outputs(engines, llama2_dir, PROMPTS[:2], kv_cache_dtype="int4", compile_decode=True,
                                       native_decode=False, num_blocks=32)
    assert stats.decode_path == "compiled" and compiled == eager


def stored_keys(core, prompt, decodes):
    """The keys every layer's cache holds for a sequence of `prompt` and `decodes` tokens generated after it (read
    while it runs, then aborted), as values [layers, tokens, kv_heads, head_dim], and its token ids."""
    req = core.factory.make(prompt, SamplingParams(max_tokens=decodes + 4, ignore_eos=True))
    seen = {}

    def read(step, outputs):
        seq = req.seqs[0]
        if seen or seq.num_computed_tokens < len(prompt) + decodes:
            return
        pos = torch.arange(seq.num_computed_tokens)
        table = torch.tensor([b.block_id for b in seq.block_table])
        rows = core.parts.runner.kv_cache[:, 0][:, table[pos // BS], pos % BS]  # [layers, tokens, kv_heads, row]
        kv = core.parts.runner.ops.kv
        seen["keys"] = rows if kv is None else kv.decode(0, rows)
        seen["ids"] = list(seq.token_ids[: len(pos)])
        core.abort(req.request_id)

    drive(core, [req], each_step=read)
    return seen["keys"], seen["ids"]


@pytest.mark.parametrize("path", ["eager", "native", "compiled"])
def test_every_path_stores_int4_keys_less_each_layers_key_mean(llama2_dir, path):
    # int4 keys are stored less a vector per layer and KV head (runner/key_shift.py), which the softmax ignores:
    # the prefill's store, the native C step's and the compiled graph's all take the layer's own vector (one graph
    # serves every layer: each must read its own). Set to large distinct vectors, the stored keys are the fp32
    # engine's keys less them, within int4's rounding, at every layer and position (engines of their own: the test
    # changes the shifts their weights hold, which the `engines` fixture would share with other tests)
    from tieredkv.engine.engine_core import EngineCore

    cfg = dict(model=str(llama2_dir), num_blocks=32, warm_bytes=0, quantization="int8" if path == "native" else None,
               compile_decode=path != "eager", native_decode=path == "native", compile_in_background=False,
               enable_prefix_caching=False)
    core = EngineCore(make_config(kv_cache_dtype="int4", **cfg))
    try:
        g = torch.Generator().manual_seed(4)
        shifts = []
        for layer in core.parts.model.layers:
            shift = layer.self_attn.k_shift
            assert shift is not None and shift.shape == (2, 16) and torch.isfinite(shift).all()
            shift.copy_(torch.randn(shift.shape, generator=g) * 4)  # in place: the native step and graph hold it
            shifts.append(shift.clone())
        got, ids = stored_keys(core, rand_ids(40, seed=3), 8)
        assert core.stats().decode_path == path
    finally:
        core.close()
    ref = EngineCore(make_config(**{**cfg, "compile_decode": False}))
    try:
        assert all(layer.self_attn.k_shift is None for layer in ref.parts.model.layers)  # fp32 KV: no shift
        want, _ = stored_keys(ref, ids, 0)
    finally:
        ref.close()
    shifted = want - torch.stack(shifts)[:, None]
    err = (got - shifted).norm(dim=-1) / shifted.norm(dim=-1)
    assert err.max() < 0.25, err.amax(dim=(1, 2))  # int4's rounding (and later layers' drift from it)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).min() > 0.5  # the keys as computed are not what it holds


def test_the_key_shift_is_measured_once_then_read_from_the_cache(llama2_dir, tmp_path, monkeypatch, caplog):
    # the first start measures each layer's key mean and keeps it under the cache directory; a restart reads the
    # same bits without a forward; a file it cannot read is measured again (one process), with a warning, and so
    # is one it cannot write
    import tieredkv.engine.rank_build as rank_build
    from tieredkv.engine.engine_core import EngineCore

    measured = []
    inner = rank_build.measure_key_shift
    monkeypatch.setattr(rank_build, "measure_key_shift", lambda *a: (measured.append(1), inner(*a)))
    cfg = make_config(model=str(llama2_dir), num_blocks=16, warm_bytes=0, kv_cache_dtype="int4",
                      compile_decode=False, cache_dir=str(fresh_cache(tmp_path)))

    def shifts():
        core = EngineCore(cfg)
        try:
            return [layer.self_attn.k_shift.clone() for layer in core.parts.model.layers]
        finally:
            core.close()

    first = shifts()
    kept = list((tmp_path / "key-shift").glob("*-rank0of1.pt"))
    assert len(measured) == 1 and len(kept) == 1
    again = shifts()
    assert len(measured) == 1 and all(torch.equal(a, b) for a, b in zip(first, again))
    kept[0].write_bytes(b"not a tensor file")
    with caplog.at_level("WARNING"):
        third = shifts()
    assert len(measured) == 2 and "measuring it again" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(first, third))  # the same forward, the same bits
    kept[0].unlink()
    (tmp_path / "key-shift").rmdir()
    (tmp_path / "key-shift").write_text("")  # a place it cannot write (a file where its folder goes): it serves
    with caplog.at_level("WARNING"):
        fourth = shifts()
    assert len(measured) == 3 and "cannot keep the key shift" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(first, fourth))


@pytest.mark.parametrize("far", ["in_place", "staged"])
async def test_a_document_past_the_hot_pool_reads_its_int4_far_blocks(engines, llama_dir, far):
    # a 700-token document on a hot pool of 8 blocks: its older blocks kept in the warm tier as int4 rows, read
    # in place (the slab is the cache tensor's tail) or staged per layer, as the roomy pool's output
    doc = [rand_ids(700, seed=77)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want, _, _ = await outputs(engines, llama_dir, doc, params, kv_cache_dtype="int4")
    got, _, stats = await outputs(engines, llama_dir, doc, params, kv_cache_dtype="int4", num_blocks=8, offload=far,
                                  warm_bytes=80 * token_bytes("int4") * BS, max_num_batched_tokens=256)
    assert got == want and stats.blocks_offloaded >= 700 // BS - 8


# -- every tier holds the same bytes -----------------------------------------------------------------


async def test_warm_and_cold_hold_int8_blocks_and_a_restart_serves_them(engines, llama_dir, tmp_path):
    path = str(tmp_path / "cold")
    block = token_bytes("int8") * BS
    want, _, _ = await outputs(engines, llama_dir, PROMPTS, kv_cache_dtype="int8")
    cfg = make_config(model=str(llama_dir), kv_cache_dtype="int8", num_blocks=14, warm_bytes=8 * block,
                      cold_path=path)
    async with await engines.start(cfg) as engine:
        tiers = engine.core.tiers
        assert tiers.warm.block_bytes == block and tiers.cold.payload_bytes == block  # unconverted bytes
        assert tiers.warm.slab.dtype == torch.uint8 and tiers.cold.dtype == torch.uint8
        got = [(await engine.generate(p, PARAMS)).outputs[0].token_ids for p in PROMPTS]
        stats = engine.stats()
    assert [[g] for g in got] == want
    warm, cold = stats.tiers["warm"], stats.tiers["cold"]
    assert warm.demotions > 0 and cold.demotions > 0 and warm.capacity_bytes == 8 * block
    again, usage, stats = await outputs(engines, llama_dir, PROMPTS[:3], kv_cache_dtype="int8", cold_path=path)
    assert again == want[:3] and [u.cached_tokens_by_tier["cold"] for u in usage] == [96] * 3
    # an fp32 engine on the same path is never served the int8 blocks, and explain says why
    _, usage, _ = await outputs(engines, llama_dir, PROMPTS[:1], cold_path=path)
    assert usage[0].cached_tokens_by_tier["cold"] == 0
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=0,
                                               cold_path=path, kv_cache_dtype="int4")) as engine:
        report = await engine.explain(SYSTEMS[1])
        assert report[0].source is None
        assert "its KV is stored as int8; this engine stores int4" in report[0].reason


async def test_a_snapshot_keeps_the_format_and_is_refused_by_another(engines, llama_dir, tmp_path):
    path = tmp_path / "int4.tkv"
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=1 << 20,
                                               kv_cache_dtype="int4")) as engine:
        want = [(await engine.generate(p, PARAMS)).outputs[0].token_ids for p in PROMPTS[:3]]
        assert await engine.export_cache(path, prompts=SYSTEMS) == 18
    assert path.stat().st_size < 18 * token_bytes("int4") * BS * 1.1  # int4 bytes, not fp32
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=1 << 20,
                                               kv_cache_dtype="int4")) as engine:
        assert (await engine.import_cache(path))["imported"] == 18
        res = [await engine.generate(p, PARAMS) for p in PROMPTS[:3]]
        assert [r.outputs[0].token_ids for r in res] == want
        assert [r.usage.cached_tokens_by_tier["warm"] for r in res] == [96] * 3
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, warm_bytes=1 << 20,
                                               kv_cache_dtype="int8")) as engine:
        with pytest.raises(SnapshotError, match="another model"):
            await engine.import_cache(path)


# -- sizing --------------------------------------------------------------------------------------------


async def test_the_same_budget_holds_proportionally_more_blocks(engines, llama_dir):
    budget = 1 << 20
    for name in ("float32", "bfloat16", "int8", "int4"):
        cfg = make_config(model=str(llama_dir), kv_cache_bytes=budget, warm_bytes=budget, kv_cache_dtype=name)
        async with await engines.start(cfg) as engine:
            block = token_bytes(name) * BS
            assert engine.core.num_blocks == budget // block
            assert engine.core.tiers.warm.capacity == budget // block
            p = plan(str(llama_dir), device="cpu", kv_cache_dtype=name, warm_bytes=budget)
            assert (p.kv_format, p.kv_bytes_per_token, p.kv_bytes_per_block, p.warm_blocks) == \
                (name, token_bytes(name), block, budget // block)
