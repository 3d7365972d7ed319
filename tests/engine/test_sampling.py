"""Seeded sampling is reproducible whatever else is batched; top-k / top-p behave."""

import asyncio
import random

import pytest
import torch

from helpers import make_config
from tieredkv import SamplingParams
from tieredkv.engine.sampler import apply_top_k_top_p


@pytest.fixture(scope="module")
async def engine(engines, llama_dir):
    engine = await engines.start(make_config(model=str(llama_dir), num_blocks=256))
    yield engine
    await engine.close()


def prompt(seed, n=30):
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


async def test_same_seed_same_output_whatever_is_batched(engine):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = await engine.generate(prompt(1), params)
    others = [engine.generate(prompt(i, 10 + i), SamplingParams(max_tokens=20, temperature=1.2, seed=i))
              for i in range(2, 8)]
    batched, *_ = await asyncio.gather(engine.generate(prompt(1), params), *others)
    assert batched.outputs[0].token_ids == alone.outputs[0].token_ids
    different = await engine.generate(prompt(1), params.model_copy(update={"seed": 99}))
    assert different.outputs[0].token_ids != alone.outputs[0].token_ids


async def test_top_k_1_is_greedy(engine):
    greedy = await engine.generate(prompt(3), SamplingParams(max_tokens=12, ignore_eos=True))
    k1 = await engine.generate(prompt(3), SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=5,
                                                         ignore_eos=True))
    assert k1.outputs[0].token_ids == greedy.outputs[0].token_ids


async def test_stop_token_ids_and_max_tokens(engine):
    greedy = await engine.generate(prompt(4), SamplingParams(max_tokens=12, ignore_eos=True))
    ids = greedy.outputs[0].token_ids
    assert greedy.outputs[0].finish_reason == "length"
    stop_at = ids[5]
    out = await engine.generate(prompt(4), SamplingParams(max_tokens=12, stop_token_ids=[stop_at]))
    assert out.outputs[0].token_ids == ids[: ids.index(stop_at) + 1]
    assert out.outputs[0].finish_reason == "stop"


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = apply_top_k_top_p(logits, 0, 0.75).isfinite().tolist()
    assert kept == [True, True, False, False]
    kept = apply_top_k_top_p(logits, 0, 0.45).isfinite().tolist()
    assert kept == [True, False, False, False]
    kept = apply_top_k_top_p(logits, 3, 1.0).isfinite().tolist()
    assert kept == [True, True, True, False]


def test_rows_with_a_nan_a_posinf_or_nothing_finite_fail_alone():
    """The bad-row rule (a row's max is not finite) on each kind of bad row, beside rows that are fine,
    including one whose every token but one is -inf."""
    from tieredkv.errors import SamplingError
    from tieredkv.engine.logits_processors import RowState
    from tieredkv.engine.sampler import Sampled, sample

    logits = torch.randn(6, 50)
    logits[0, 7] = float("nan")
    logits[1, 3] = float("inf")
    logits[2] = float("-inf")
    logits[3] = float("-inf")
    logits[3, 11] = -5.0
    logits[4, :] = float("-inf")
    logits[4, 2] = float("nan")
    rows = [RowState(SamplingParams(), [1, 2], 1, frozenset()) for _ in range(6)]
    out = sample(logits, rows, [None] * 6)
    assert [isinstance(o, SamplingError) for o in out] == [True, True, True, False, True, False]
    assert out[3] == Sampled(11) and out[5] == Sampled(int(logits[5].argmax()))
