"""The sampling options an OpenAI-style API carries, against transformers' logits processors (where one
exists) and against transformers' greedy generation on the same checkpoint."""

import random

import pytest
import torch
from pydantic import ValidationError
from transformers.generation.logits_process import (MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from helpers import check_pool_clean, make_config
from tieredkv import RequestError, SamplingParams
from tieredkv.engine.logits_processors import RowState, apply_min_p, apply_processors

V = 50


def rows_and_logits(params_list, seed=0):
    rng = random.Random(seed)
    rows = []
    for params in params_list:
        tokens = [rng.randrange(V) for _ in range(rng.randrange(3, 12))]
        rows.append(RowState(params, tokens, rng.randrange(1, len(tokens)), frozenset({7, 9})))
    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(seed)) * 3
    return rows, logits


def test_processors_match_transformers_row_by_row_in_one_batch():
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(), SamplingParams(repetition_penalty=0.7),
              SamplingParams(logit_bias={3: 5.0, 11: -100.0}), SamplingParams(min_tokens=4, max_tokens=8),
              SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3)]
    rows, logits = rows_and_logits(params)
    got = apply_processors(logits.clone(), rows)
    for r, (row, p) in enumerate(zip(rows, params)):
        ids = torch.tensor([row.token_ids])
        want = logits[r : r + 1].clone()
        if p.repetition_penalty != 1.0:
            want = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, want)
        if p.logit_bias:
            want = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(ids, want)
        if p.min_tokens:
            want = MinNewTokensLengthLogitsProcessor(row.num_prompt_tokens, p.min_tokens, sorted(row.stop_ids))(
                ids, want)
        if p.frequency_penalty or p.presence_penalty:  # OpenAI's formula; transformers has no processor
            for t in set(row.output_ids):
                c = row.output_ids.count(t)
                want[0, t] -= p.frequency_penalty * c + p.presence_penalty
        assert torch.allclose(got[r : r + 1], want, atol=1e-6), (r, p)


def test_min_tokens_stops_masking_once_reached():
    row = RowState(SamplingParams(min_tokens=2, max_tokens=4), [1, 2, 3, 4], 2, frozenset({7}))
    logits = torch.zeros(1, V)
    assert apply_processors(logits.clone(), [row])[0, 7] == 0.0  # two output tokens already


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_matches_transformers(min_p):
    logits = torch.randn(V, generator=torch.Generator().manual_seed(1)) * 2
    want = MinPLogitsWarper(min_p)(None, logits[None].clone())[0] if min_p else logits
    assert torch.equal(apply_min_p(logits.clone(), min_p).isinf(), want.isinf())


@pytest.mark.parametrize("kwargs", [{"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                                    {"min_p": 1.5}, {"min_tokens": 9, "max_tokens": 4}, {"logit_bias": {1: 101}},
                                    {"logprobs": 21}])
def test_out_of_range_options_are_rejected(kwargs):
    with pytest.raises(ValidationError):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=128))
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
def hf(llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


PROMPT = [random.Random(5).randrange(3, 300) for _ in range(23)]


def hf_generate(hf, prompt=PROMPT, n=16, **kwargs):
    x = torch.tensor([prompt])
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                        **kwargs)
    return y[0, len(prompt):].tolist()


async def greedy(engine, n=16, **kwargs):
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=n, ignore_eos=True, **kwargs))
    return out.outputs[0]


async def test_repetition_penalty_matches_transformers_generate(engine, hf):
    for penalty in (1.5, 0.8):
        got = (await greedy(engine, repetition_penalty=penalty)).token_ids
        assert got == hf_generate(hf, repetition_penalty=penalty)


async def test_logit_bias_matches_transformers_sequence_bias(engine, hf):
    plain = hf_generate(hf)
    bias = {plain[2]: -8.0, plain[5]: -4.0, 17: 3.0}
    want = hf_generate(hf, sequence_bias=[[[t], b] for t, b in bias.items()])
    assert want != plain
    assert (await greedy(engine, logit_bias=bias)).token_ids == want


async def test_min_tokens_matches_transformers_min_new_tokens(engine, hf):
    plain = hf_generate(hf)
    first = max(i for i in range(len(plain)) if plain[i] not in plain[:i])  # the token seen first the latest
    stop = plain[first]
    early = await engine.generate(PROMPT, SamplingParams(max_tokens=16, stop_token_ids=[stop]))
    assert early.outputs[0].token_ids == plain[: first + 1]
    want = hf_generate(hf, eos_token_id=stop, min_new_tokens=6)
    got = await engine.generate(PROMPT, SamplingParams(max_tokens=16, stop_token_ids=[stop], min_tokens=6))
    assert got.outputs[0].token_ids == want[: len(got.outputs[0].token_ids)]
    assert len(got.outputs[0].token_ids) >= 6 and stop not in got.outputs[0].token_ids[:6]
    assert got.outputs[0].token_ids != early.outputs[0].token_ids


async def test_frequency_and_presence_penalties_match_a_reference_decoder(engine, hf):
    freq, pres = 0.7, 0.4
    ids, out = list(PROMPT), []
    with torch.no_grad():
        for _ in range(16):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            for t in set(out):
                logits[t] -= freq * out.count(t) + pres
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    assert (await greedy(engine, frequency_penalty=freq, presence_penalty=pres)).token_ids == out


async def test_logprobs_are_the_models_raw_log_probabilities(engine, hf):
    got = await greedy(engine, n=8, logprobs=3)
    assert len(got.logprobs) == 8
    with torch.no_grad():
        full = hf(torch.tensor([PROMPT + got.token_ids])).logits[0].log_softmax(-1)
    for i, lp in enumerate(got.logprobs):
        ref = full[len(PROMPT) - 1 + i]
        assert lp.token_id == got.token_ids[i]
        assert abs(lp.logprob - float(ref[lp.token_id])) < 1e-4
        assert [t for t, _ in lp.top] == ref.topk(3).indices.tolist()
        assert lp.top[0][0] == lp.token_id  # greedy took the most likely token


async def test_logprobs_in_stream_chunks_one_per_token(engine):
    count = 0
    async for chunk in engine.stream(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0)):
        assert len(chunk.logprobs) == len(chunk.token_ids)
        assert all(lp.top == [] and lp.logprob <= 0 for lp in chunk.logprobs)
        count += len(chunk.token_ids)
    assert count == 5


async def test_min_p_of_one_samples_the_top_token(engine):
    got = await greedy(engine, temperature=1.0, min_p=1.0, seed=3)
    assert got.token_ids == (await greedy(engine)).token_ids


async def test_logit_bias_outside_the_vocabulary_is_a_request_error(engine):
    with pytest.raises(RequestError, match="logit_bias"):
        engine.stream(PROMPT, SamplingParams(logit_bias={10**6: 1.0}))
    await engine.run_in_worker(check_pool_clean, engine.core)
