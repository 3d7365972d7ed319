"""LoRA adapters in PEFT's format: greedy output equal to peft's PeftModel on transformers, alone and in one mixed batch
with the base model; blocks never shared across adapters or cache salts; bad adapters refused clearly."""

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from helpers import make_checkpoint, make_config
from tieredkv import AsyncEngine, LoRAError, RequestError, SamplingParams

ADAPTERS = {  # name -> peft LoraConfig arguments
    "qv": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 8, "lora_alpha": 16, "use_rslora": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}
NEW = 12


def make_adapter(base: Path, out: Path, seed: int, **lora) -> Path:
    """A PEFT adapter of random low-rank weights (B is not zero: the adapter changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    model.save_pretrained(str(out))
    return out


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=NEW,
                               min_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
            out.append(y[0, len(ids):].tolist())
    return out


def prompts(n: int, seed: int, length: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length + 7 * i)] for i in range(n)]


@pytest.fixture(scope="module")
def adapter_dirs(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(llama_dir, root / name, seed=i + 1, **cfg) for i, (name, cfg) in
            enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def references(llama_dir, adapter_dirs):
    ps = prompts(3, seed=7)
    return ps, {name: peft_greedy(llama_dir, adapter_dirs.get(name), ps) for name in (None, *ADAPTERS)}


@pytest.fixture(scope="module")
async def engine(llama_dir, adapter_dirs):
    cfg = make_config(model=str(llama_dir), num_blocks=128, max_num_seqs=8,
                      lora_adapters={name: str(path) for name, path in adapter_dirs.items()})
    async with await AsyncEngine.start(cfg) as engine:
        yield engine


PARAMS = SamplingParams(max_tokens=NEW, ignore_eos=True)


async def check_alone_and_mixed(engine, ps: list[list[int]], want: dict) -> None:
    """Every prompt under the base model and each adapter of `want`, one request at a time and then all in one
    batch (the cache emptied in between): each gives want[adapter][prompt]."""
    jobs = [(name, i) for name in want for i in range(len(ps))]
    alone = [await engine.generate(ps[i], PARAMS, adapter=name) for name, i in jobs]
    await engine.clear_cache("hot")
    mixed = await asyncio.gather(*(engine.generate(ps[i], PARAMS, adapter=name) for name, i in jobs))
    for (name, i), a, m in zip(jobs, alone, mixed):
        assert a.outputs[0].token_ids == want[name][i], (name, i)
        assert m.outputs[0].token_ids == want[name][i], (name, i)


async def test_each_adapter_alone_and_in_one_mixed_batch_matches_peft(engine, references):
    """Each prompt under the base model and both adapters, one at a time, then all at once: one step holds rows of
    all three."""
    ps, want = references
    assert want["qv"] != want[None] and want["all"] != want[None]  # the adapters change the output
    await engine.clear_cache("hot")
    await check_alone_and_mixed(engine, ps, want)


async def test_blocks_never_cross_adapters_or_salts(engine):
    system = prompts(1, seed=99, length=96)[0]  # 6 full blocks
    await engine.clear_cache("hot")

    async def cached(**kw) -> int:
        out = await engine.generate(system + [5, 6, 7], SamplingParams(max_tokens=1), **kw)
        return out.usage.cached_prompt_tokens

    assert await cached(adapter="qv") == 0
    assert await cached(adapter="all") == 0  # the same prompt under another adapter: computed again
    assert await cached() == 0  # and under the base model
    assert await cached(adapter="qv") == 96  # under the same adapter: every full block from cache
    assert await cached(adapter="all") == 96
    assert await cached(cache_salt="tenant-1") == 0  # a salt: a chain of its own
    assert await cached(cache_salt="tenant-2") == 0
    assert await cached(cache_salt="tenant-1") == 96
    assert await cached(adapter="qv", cache_salt="tenant-1") == 0
    assert await cached(adapter="qv", cache_salt="tenant-1") == 96
    assert await cached() == 96


async def test_bad_adapters_and_names(engine, llama_dir, adapter_dirs, tmp_path):
    with pytest.raises(RequestError, match="no LoRA adapter named 'nope'"):
        await engine.generate([1, 2, 3], PARAMS, adapter="nope")
    with pytest.raises(RequestError, match="cache_salt"):
        await engine.generate([1, 2, 3], PARAMS, cache_salt="")
    with pytest.raises(LoRAError, match="not a folder"):
        await engine.load_adapter("x", tmp_path / "missing")
    with pytest.raises(LoRAError, match="loaded already"):
        await engine.load_adapter("qv", adapter_dirs["qv"])
    bad = tmp_path / "bad"
    shutil.copytree(adapter_dirs["qv"], bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(LoRAError, match="DoRA"):
        await engine.load_adapter("bad", bad)
    other = make_adapter(llama_dir, tmp_path / "wide", seed=5, r=4, lora_alpha=8, target_modules=["lm_head"])
    with pytest.raises(LoRAError, match="lm_head"):
        await engine.load_adapter("wide", other)
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    (bad / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="cannot read"):
        await engine.load_adapter("bad", bad)
    narrow_base = make_checkpoint(tmp_path / "narrow-llama", "llama", hidden_size=32, intermediate_size=64)
    narrow = make_adapter(narrow_base, tmp_path / "narrow", seed=6, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(LoRAError, match="this model needs"):
        await engine.load_adapter("narrow", narrow)
    assert sorted(engine.adapters()) == ["all", "qv"]  # nothing half-loaded
    got = await engine.generate([1, 2, 3], PARAMS, adapter="qv")  # and the engine serves on
    assert len(got.outputs[0].token_ids) == NEW


async def test_load_and_unload_at_run_time(engine, adapter_dirs, references):
    ps, want = references
    info = await engine.load_adapter("qv2", adapter_dirs["qv"])
    assert info["rank"] == 4 and info["modules"] == ["q_proj", "v_proj"]
    got = await engine.generate(ps[0], PARAMS, adapter="qv2")
    assert got.outputs[0].token_ids == want["qv"][0]
    await engine.unload_adapter("qv2")
    with pytest.raises(RequestError):
        await engine.generate(ps[0], PARAMS, adapter="qv2")
    with pytest.raises(LoRAError):
        await engine.unload_adapter("qv2")


async def test_the_server_serves_adapters_by_model_name(engine, adapter_dirs, references):
    """`model` picks an adapter; /v1/models lists them; vLLM's load/unload endpoints; cache_salt per request."""
    import aiohttp
    import openai

    from tieredkv.serve import ServerSettings, start_server

    ps, _ = references
    want = {name: (await engine.generate(ps[0], PARAMS, adapter=name)).outputs[0].text  # (tokens: checked above)
            for name in (None, "qv", "all")}
    runner, port = await start_server(engine, ServerSettings(model_name="base", api_key="k"), port=0)
    url = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    try:
        models = {m.id: m for m in (await client.models.list()).data}
        assert set(models) == {"base", "qv", "all"} and models["qv"].parent == "base"
        for name in ("base", "qv", "all"):
            got = await client.completions.create(model=name, prompt=ps[0], max_tokens=NEW, temperature=0,
                                                  extra_body={"ignore_eos": True})
            assert got.model == name
            assert got.choices[0].text == want[None if name == "base" else name]
        with pytest.raises(openai.NotFoundError):
            await client.completions.create(model="nope", prompt="hi", max_tokens=1)
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer k"}) as s:
            async with s.post(url + "/v1/load_lora_adapter", json={"lora_name": "late",
                                                                   "lora_path": str(adapter_dirs["qv"])}) as r:
                assert r.status == 200 and "late" in await r.text()
            async with s.post(url + "/v1/load_lora_adapter", json={"lora_name": "late2", "lora_path": "/nope"}) as r:
                assert r.status == 400 and "not a folder" in (await r.json())["error"]["message"]
            async with aiohttp.ClientSession() as anonymous:  # behind the API key
                async with anonymous.post(url + "/v1/load_lora_adapter",
                                          json={"lora_name": "x", "lora_path": "y"}) as r:
                    assert r.status == 401
            got = await client.completions.create(model="late", prompt=ps[0], max_tokens=NEW, temperature=0,
                                                  extra_body={"ignore_eos": True})
            assert got.choices[0].text == want["qv"]
            async with s.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}) as r:
                assert r.status == 200
            async with s.post(url + "/v1/unload_lora_adapter", json={"lora_name": "late"}) as r:
                assert r.status == 404
        system = prompts(1, seed=5, length=64)[0]
        cached = []
        for salt in ("a", "b", "a"):
            got = await client.completions.create(model="base", prompt=system + [9], max_tokens=1,
                                                  extra_body={"cache_salt": salt})
            cached.append(got.usage.prompt_tokens_details.cached_tokens)
        assert cached == [0, 0, 64]
        with pytest.raises(openai.BadRequestError, match="cache_salt"):
            await client.completions.create(model="base", prompt="hi", max_tokens=1, extra_body={"cache_salt": 5})
    finally:
        await client.close()
        await runner.cleanup()
    runner, port = await start_server(engine, ServerSettings(model_name="base", require_cache_salt=True), port=0)
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 1}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "cache_salt"
    finally:
        await runner.cleanup()


async def test_isolation_in_every_tier_and_across_restarts(llama_dir, adapter_dirs, valkey_server, fleet_key,
                                                           tmp_path):
    """The same prompt under two adapters and two salts: computed once per chain, found again in warm, cold and
    remote (another engine, a restart) only under its own adapter and salt."""
    system = prompts(1, seed=123, length=96)[0] + [11, 12]
    full = 96
    loras = {name: str(path) for name, path in adapter_dirs.items()}

    def config(**kw):
        return make_config(**{"model": str(llama_dir), "num_blocks": 64, "max_num_seqs": 4, "lora_adapters": loras,
                               "cold_path": str(tmp_path / "cold"), "cold_secret_path": str(fleet_key),
                               "remote_url": valkey_server.url, **kw})

    async def cached(engine, **kw):
        usage = (await engine.generate(system, SamplingParams(max_tokens=1), **kw)).usage
        return usage.cached_prompt_tokens, {t: n for t, n in usage.cached_tokens_by_tier.items() if n}

    chains = [{"adapter": "qv"}, {"adapter": "all"}, {"cache_salt": "t1"}, {"adapter": "qv", "cache_salt": "t1"}]
    async with await AsyncEngine.start(config()) as engine:
        for kw in chains:
            assert (await cached(engine, **kw))[0] == 0, kw  # each chain computes the prompt once
        await asyncio.to_thread(engine.core.tiers.tier("remote").flush_sync)
        for tier in ("hot", "warm"):
            await engine.clear_cache(tier, demote=True)  # down to cold (and warm on the way)
        await asyncio.to_thread(engine.core.tiers.tier("cold").flush_sync)
        for kw in chains:
            n, tiers = await cached(engine, **kw)
            assert n == full and set(tiers) <= {"cold", "remote"}, (kw, tiers)
    async with await AsyncEngine.start(config()) as again:  # a restart: the cold store serves each chain again
        for kw in chains:
            n, tiers = await cached(again, **kw)
            assert n == full and set(tiers) <= {"cold", "remote"}, (kw, tiers)
        assert (await cached(again, cache_salt="t2"))[0] == 0  # a salt nobody used: nothing to find
    async with await AsyncEngine.start(config(cold_path=None)) as other:  # another replica: the remote tier
        for kw in chains:
            n, tiers = await cached(other, **kw)
            assert n == full and set(tiers) == {"remote"}, (kw, tiers)


async def test_adapters_with_quantized_weights_samples_beams_and_speculation(llama_dir, adapter_dirs):
    """A quantized base model's adapter rows; n samples and beams of one adapter share its prompt blocks; prompt
    lookup speculation leaves greedy output as it is."""
    loras = {name: str(path) for name, path in adapter_dirs.items()}
    p = prompts(1, seed=3, length=48)[0]
    # (int8_activations=False: a row's arithmetic the same in a step of any size, so rows batched together are
    # each what they are alone; with int8 blocks for many rows a batch past 16 rows meets other arithmetic)
    async with await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=96, quantization="int8",
                                                   int8_activations=False,
                                                   lora_adapters=loras)) as engine:
        alone = {name: (await engine.generate(p, PARAMS, adapter=name)).outputs[0].token_ids
                 for name in (None, "qv", "all")}
        assert alone["qv"] != alone[None] and alone["all"] != alone[None]
        await engine.clear_cache("hot")
        mixed = await asyncio.gather(*(engine.generate(p, PARAMS, adapter=name) for name in (None, "qv", "all")))
        assert [m.outputs[0].token_ids for m in mixed] == [alone[None], alone["qv"], alone["all"]]
        sampled = await engine.generate(p, SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=1), adapter="qv")
        assert len(sampled.outputs) == 3
        assert sampled.usage.cached_prompt_tokens == 32  # every full block but the one with the last token
        beam = SamplingParams(max_tokens=NEW, beam_width=2, ignore_eos=True)
        beams = (await engine.generate(p, beam, adapter="all")).outputs[0].token_ids
        base_beams = (await engine.generate(p, beam)).outputs[0].token_ids
        assert beams != base_beams  # the beams ran under the adapter
        together = await asyncio.gather(engine.generate(p, beam, adapter="all"), engine.generate(p, beam))
        assert [t.outputs[0].token_ids for t in together] == [beams, base_beams]  # each beam row with its own
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    repeat = p[:24] * 3  # a prompt that repeats itself: prompt lookup has drafts to offer
    plain_cfg = make_config(model=str(llama_dir), num_blocks=96, lora_adapters=loras)
    async with await AsyncEngine.start(plain_cfg) as plain, \
            await AsyncEngine.start(make_config(**{**plain_cfg.model_dump(), "speculative": spec})) as fast:
        for name in ("qv", "all"):
            want = (await plain.generate(repeat, PARAMS, adapter=name)).outputs[0].token_ids
            got = await fast.generate(repeat, PARAMS, adapter=name)
            assert got.outputs[0].token_ids == want, name
        assert fast.stats().speculative.num_drafts > 0


def test_stacked_products_equal_the_grouped_ones(llama_dir, adapter_dirs):
    """A step of few rows takes every adapter's product at once (LoRAStack); a large one groups rows by adapter:
    both give the same output, row for row, on every projection."""
    from tieredkv.models.lora import PROJECTIONS, LoRABatch, LoRAStack, load_adapter
    from tieredkv.models.spec import ModelSpec

    spec = ModelSpec.from_file(llama_dir / "config.json")
    adapters = [load_adapter(n, p, spec, torch.float32, torch.device("cpu"), 64) for n, p in adapter_dirs.items()]
    stack = LoRAStack(adapters, spec.num_layers)
    rng = random.Random(0)
    owner = [rng.choice([None, *adapters]) for _ in range(37)]
    grouped = LoRABatch([(a, torch.tensor([i for i, o in enumerate(owner) if o is a])) for a in adapters])
    stacked = LoRABatch([], stack, stack.layout(owner, torch.device("cpu")))
    widths = {"qkv": (64, 128), "o": (64, 64), "gate_up": (64, 256), "down": (128, 64)}  # (in, out) of the tiny model
    for layer in range(spec.num_layers):
        for proj in PROJECTIONS:
            x = torch.randn(len(owner), widths[proj][0])
            base = torch.randn(len(owner), widths[proj][1])
            want = grouped.add(base.clone(), x, layer, proj)
            got = stacked.add(base.clone(), x, layer, proj)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            rows = [i for i, o in enumerate(owner) if o is None]
            assert torch.equal(got[rows], base[rows])  # the base model's rows untouched


def test_the_lora_option_takes_pairs_or_json():
    from tieredkv.cli import build_parser
    from tieredkv.tools.config_flags import engine_config

    args = build_parser().parse_args(["generate", "hi", "--lora", "a=/x/a,b=/x/b", "--max-loras", "2"])
    cfg = engine_config(args)
    assert cfg.lora_adapters == {"a": "/x/a", "b": "/x/b"} and cfg.max_loras == 2
    assert make_config(lora_adapters='{"c": "/x/c"}').lora_adapters == {"c": "/x/c"}
    with pytest.raises(ValueError, match="name=folder"):
        make_config(lora_adapters="just-a-path")


@pytest.mark.slow
async def test_the_default_model_with_adapters_matches_peft(tmp_path):
    """The default model (30 layers, grouped heads, tied embeddings) with two adapters and without, alone and in
    one batch: greedy output equal to peft's PeftModel on transformers."""
    from tieredkv.engine.resolve import resolve_cache_dir, resolve_model_dir

    base = resolve_model_dir("default", resolve_cache_dir(make_config()))
    made = {"attn": make_adapter(base, tmp_path / "attn", seed=11, r=8, lora_alpha=16,
                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
            "mlp": make_adapter(base, tmp_path / "mlp", seed=12, r=4, lora_alpha=4,
                                target_modules=["gate_proj", "up_proj", "down_proj"])}
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "user", "content": "Name three primary colours."}]]
    async with await AsyncEngine.start(make_config(num_blocks=64, lora_adapters={k: str(v) for k, v in made.items()})
                                       ) as engine:
        ids = [await engine.tokenize(c) for c in chats]
        want = {name: peft_greedy(base, made.get(name), ids) for name in (None, *made)}
        assert want["attn"] != want[None] and want["mlp"] != want[None]
        await check_alone_and_mixed(engine, ids, want)


@pytest.mark.parametrize("r, width", [(8, 96), (24, 200)])
def test_the_triton_kernel_matches_its_torch_reference(r, width):
    """The CUDA path's kernel (kernels/lora_triton.py), through Triton's interpreter on CPU, against lora_rows_ref:
    adapters with unequal row counts (one with none), padding rows, an output wider than the adapters write."""
    from tieredkv.kernels.lora_rows import lora_rows_ref
    from tieredkv.kernels.lora_triton import lora_rows

    torch.manual_seed(r)
    rows, num_k, inp = 45, 4, 72
    owner = [random.Random(r + i).randrange(-1, num_k - 1) for i in range(rows)]  # -1: a base-model row
    per = [[i for i, o in enumerate(owner) if o == k] for k in range(num_k)]
    m = max(len(p) for p in per)
    index = torch.tensor([p + [0] * (m - len(p)) for p in per])
    counts = torch.tensor([len(p) for p in per], dtype=torch.int32)
    assert counts[-1] == 0  # an adapter of the stack with no row this step
    x = torch.randn(rows, inp)
    a3, bt3 = torch.randn(num_k, r, inp), torch.randn(num_k, r, width)
    out = torch.randn(rows, width + 16)
    want = lora_rows_ref(out.clone(), x, index, counts, a3, bt3)
    got = lora_rows(out.clone(), x, index, counts, a3, bt3)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-3)
    base_rows = [i for i, o in enumerate(owner) if o == -1]
    assert torch.equal(got[base_rows], out[base_rows]) and torch.equal(got[:, width:], out[:, width:])


async def test_two_ranks_split_each_adapter_as_its_layers(llama_dir, adapter_dirs, references):
    """tensor_parallel_size 2: each rank keeps its part of every adapter (B's rows of its q/k/v/gate/up outputs, A's
    columns of its o/down inputs) and the output is peft's, alone and mixed; an adapter loaded at run time reaches
    the other rank too."""
    ps, want = references
    cfg = make_config(model=str(llama_dir), tensor_parallel_size=2, num_threads=1, num_blocks=64,
                      lora_adapters={"qv": str(adapter_dirs["qv"])})
    async with await AsyncEngine.start(cfg) as engine:
        await engine.load_adapter("all", adapter_dirs["all"])
        await check_alone_and_mixed(engine, ps, want)
        assert engine.core.tp.controls["lora"] == 2
        await engine.unload_adapter("all")
        assert engine.core.tp.controls["lora"] == 3
