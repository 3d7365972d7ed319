"""Beam search against transformers' generate(num_beams=k, do_sample=False) on the tiny checkpoints, and the
block sharing that makes it cheap."""

import asyncio
import collections
import json
import random

import pytest
import torch

from helpers import check_pool_clean, check_pool_consistent, drive, make_config
from tieredkv import RequestError, SamplingParams
from tieredkv.core.kv_manager import cdiv

MAX_NEW = 16
VARIANTS = [{}, {"length_penalty": -1.0}, {"length_penalty": 2.0, "early_stopping": "never"},
            {"length_penalty": 0.0, "early_stopping": True}]


def make_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 40)] + [shared + [5, 9]]


class Reference:
    """transformers' beam search on one checkpoint. The model's own EOS and one more token the model often
    produces end a beam (our stop_token_ids), so beams finish early and the finished-hypothesis rules are
    exercised, not only the length limit."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id
        self.prompts = make_prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        greedy = self.generate(self.prompts[0], 1, 30, stop=[])[0][0]
        self.extra_stop = collections.Counter(greedy).most_common(1)[0][0]
        self.cache: dict = {}

    @torch.no_grad()
    def generate(self, prompt, k, max_new, stop=None, **kw):
        stops = [self.eos, self.extra_stop] if stop is None else [self.eos, *stop]
        x = torch.tensor([prompt])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), num_beams=k, num_return_sequences=k,
                                  do_sample=False, max_new_tokens=max_new, eos_token_id=stops, pad_token_id=0,
                                  output_scores=True, return_dict_in_generate=True, **kw)
        beams = []
        for seq in out.sequences[:, len(prompt):].tolist():  # cut the padding after a beam's stop token
            end = next((i + 1 for i, t in enumerate(seq) if t in stops), len(seq))
            beams.append(seq[:end])
        scores = out.sequences_scores.tolist() if k > 1 else None
        return beams, scores

    def expected(self, k, variant):
        key = (k, tuple(sorted(variant.items())))
        if key not in self.cache:
            self.cache[key] = [self.generate(p, k, MAX_NEW, **variant) for p in self.prompts]
        return self.cache[key]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def ref(request, llama_dir, qwen2_dir):
    model_dir = llama_dir if request.param == "llama" else qwen2_dir
    return model_dir, Reference(model_dir)


async def run_beams(engine, ref, k, variant):
    params = SamplingParams(max_tokens=MAX_NEW, beam_width=k, n=k, stop_token_ids=[ref.extra_stop], **variant)
    return await asyncio.gather(*(engine.generate(p, params) for p in ref.prompts))


def check_against(results, expected, variant):
    for out, (beams, scores) in zip(results, expected):
        assert [o.token_ids for o in out.outputs] == beams
        lp = variant.get("length_penalty", 1.0)
        ours = [o.cumulative_logprob / len(o.token_ids) ** lp for o in out.outputs]
        assert ours == pytest.approx(scores, rel=1e-5, abs=1e-4)
        assert [o.index for o in out.outputs] == list(range(len(beams)))


@pytest.mark.parametrize("k", [2, 4, 8])
async def test_beam_search_matches_transformers(engines, ref, k):
    model_dir, reference = ref
    async with await engines.start(make_config(model=str(model_dir), num_blocks=256)) as engine:
        for variant in VARIANTS:
            check_against(await run_beams(engine, reference, k, variant), reference.expected(k, variant), variant)
        stats = engine.stats()
        assert stats.cow_copies > 0  # beams forked mid-block and wrote their own copy of the shared block
        await engine.run_in_worker(check_pool_clean, engine.core)


@pytest.mark.parametrize("squeeze", ["preempt", "offload", "split"])
async def test_beam_search_matches_transformers_under_pressure(engines, ref, squeeze):
    """A pool too small for every beam of every prompt at once (beams preempted with their group and
    recomputed, or their old blocks offloaded), or a step budget smaller than a group (beams of one
    request computed over several steps, the search waiting for all of them)."""
    model_dir, reference = ref
    cfg = {"preempt": dict(num_blocks=14, offload="off"), "offload": dict(num_blocks=14, warm_bytes=1 << 20),
           "split": dict(num_blocks=256, max_num_batched_tokens=5)}[squeeze]
    async with await engines.start(make_config(model=str(model_dir), **cfg)) as engine:
        variant = VARIANTS[0]
        check_against(await run_beams(engine, reference, 4, variant), reference.expected(4, variant), variant)
        stats = engine.stats()
        if squeeze == "preempt":
            assert stats.num_preemptions > 0
        if squeeze == "offload":
            assert stats.blocks_offloaded > 0
        await engine.run_in_worker(check_pool_clean, engine.core)


async def test_stop_strings_end_beams_as_transformers_does(engines, llama_dir):
    """A stop string ends a beam (transformers' stop_strings); the text is cut before it."""
    from transformers import AutoTokenizer

    reference = Reference(llama_dir)
    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    prompt = reference.prompts[2]
    plain, _ = reference.generate(prompt, 4, MAX_NEW, stop=[])
    text = tok.decode(plain[0], skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]  # two characters from the middle of the best beam
    expected, _ = reference.generate(prompt, 4, MAX_NEW, stop=[], stop_strings=[stop], tokenizer=tok)
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=256)) as engine:
        out = await engine.generate(prompt, SamplingParams(max_tokens=MAX_NEW, beam_width=4, n=4, stop=[stop]))
    assert [o.token_ids for o in out.outputs] == expected
    assert out.outputs[0].finish_reason == "stop" and stop not in out.outputs[0].text


def peak_blocks(core, requests) -> int:
    peaks = [0]

    def check(*_):
        check_pool_consistent(core)
        peaks.append(core.pool.num_blocks - core.pool.num_free)

    drive(core, requests, check)
    return max(peaks)


def test_beams_share_blocks(engines, llama_dir):
    """Peak blocks of an 8-beam search against 8 independent sequences of the same lengths: the beams
    hold one copy of the prompt and of their common history."""
    prompt_len, new, k, bs = 150, 40, 8, 16
    core = engines.core(make_config(model=str(llama_dir), num_blocks=512, enable_prefix_caching=False,
                                    compile_decode=False, max_num_seqs=k))
    prompt = make_prompts(core.spec.vocab_size)[2] * 4
    prompt = prompt[:prompt_len]
    beam = peak_blocks(core, [core.factory.make(prompt, SamplingParams(max_tokens=new, beam_width=k,
                                                                          ignore_eos=True), "beam")])
    alone = peak_blocks(core, [core.factory.make(prompt, SamplingParams(max_tokens=new, ignore_eos=True), f"s{i}")
                               for i in range(k)])
    assert alone == k * cdiv(prompt_len + new, bs)  # no sharing without the prefix cache: 8 x 12 blocks
    # shared: the prompt's full blocks once; each beam at most its own blocks after them
    assert beam <= prompt_len // bs + k * (cdiv(prompt_len + new, bs) - prompt_len // bs)
    assert beam < alone // 2
    check_pool_clean(core)


def test_beam_search_aborted_mid_search_frees_every_block(engines, llama_dir):
    core = engines.core(make_config(model=str(llama_dir), num_blocks=128, compile_decode=False))
    sink = object()
    req = core.factory.make([5, 6, 7, 8], SamplingParams(max_tokens=40, beam_width=4, n=2, ignore_eos=True), "a")
    req.sink = sink
    core.add_request(req)
    for _ in range(6):
        assert core.step() == []  # nothing streams while the beams change
    assert len(req.seqs) == 4
    outputs = core.abort("a")
    assert [(s, c.index, c.finish_reason) for s, c in outputs] == [(sink, 0, "abort"), (sink, 1, "abort")]
    assert all(len(c.token_ids) == 6 and c.cumulative_logprob < 0 for _, c in outputs)
    check_pool_clean(core)


async def test_stream_delivers_each_returned_beam_whole(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=128)) as engine:
        params = SamplingParams(max_tokens=8, beam_width=3, n=3, ignore_eos=True)
        chunks = [c async for c in engine.stream([5, 6, 7], params)]
        out = await engine.generate([5, 6, 7], params)
    assert sorted(c.index for c in chunks) == [0, 1, 2] and all(c.finish_reason == "length" for c in chunks)
    by_index = {c.index: c for c in chunks}
    assert [by_index[i].token_ids for i in range(3)] == [o.token_ids for o in out.outputs]
    assert [by_index[i].text for i in range(3)] == [o.text for o in out.outputs]
    scores = [o.cumulative_logprob / 8 for o in out.outputs]
    assert scores == sorted(scores, reverse=True)
    assert out.usage.completion_tokens == 24


@pytest.mark.parametrize("kw, message", [
    (dict(beam_width=2, n=3), "exceeds beam_width"),
    (dict(beam_width=2, temperature=0.7), "temperature must be 0"),
    (dict(beam_width=2, logprobs=1), "cumulative_logprob"),
    (dict(beam_width=0), "greater than or equal to 1"),
])
def test_beam_parameters_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


async def test_more_beams_than_max_num_seqs_is_a_request_error(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64, max_num_seqs=4)) as engine:
        with pytest.raises(RequestError, match="beam_width=8 exceeds max_num_seqs=4"):
            await engine.generate([5, 6], SamplingParams(beam_width=8))


@pytest.mark.parametrize("policy", ["fcfs", "shortest_prefill"])
def test_searches_competing_for_a_small_pool_finish(engines, llama_dir, policy):
    """Four searches of 4 beams on a 14-block pool, all added in one tick: preempted beams are admitted
    beside their siblings, never interleaved with another search's (each would hold part of the pool
    and wait for the rest, for ever)."""
    core = engines.core(make_config(model=str(llama_dir), num_blocks=14, offload="off", compile_decode=False,
                                    scheduling_policy=policy))
    drive(core, [core.factory.make(p, SamplingParams(max_tokens=MAX_NEW, beam_width=4, n=4), f"r{i}")
                 for i, p in enumerate(make_prompts(core.spec.vocab_size))], max_steps=1000)
    assert core.stats().num_preemptions > 0
    check_pool_clean(core)
    core.close()
