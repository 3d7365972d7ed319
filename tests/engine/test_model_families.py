"""Families beside Llama/Mistral/Qwen2: Qwen3 (q/k norms per head, head_dim apart from hidden_size / heads)
and Phi-3 (q/k/v and gate/up stored fused), token-identical to transformers on tiny random checkpoints built
from transformers' own config classes: batched with prefix caching, and one at a time through the compiled
decode path: the compiled graph, and the native C step (fp32 weights, on builds with AVX-512)."""

import pytest

from helpers import hf_greedy, make_checkpoint, make_config, native_takes_fp32, run_to_end

PROMPTS = [list(range(5, 25)), list(range(5, 21)) + [7, 9, 11], [3, 4, 5, 6]]  # the first block shared
NEW = 12


@pytest.fixture(scope="module", params=["qwen3", "phi3"])
def family(request, tmp_path_factory):
    kind = request.param
    path = make_checkpoint(tmp_path_factory.mktemp(kind), kind, num_hidden_layers=2)
    return kind, path, hf_greedy(path, PROMPTS, NEW)


@pytest.mark.parametrize("variant", [dict(), dict(compile_decode=True, native_decode=False),
                                     dict(compile_decode=True)], ids=["eager", "compiled", "native"])
def test_greedy_matches_transformers(engines, family, variant):
    """(The attention kernels are the same for every family: the Triton ones are tested on Llama and Qwen2.)"""
    kind, path, expected = family
    core = engines.core(make_config(model=str(path), num_blocks=32, **variant))
    assert core.spec.model_type == kind and core.spec.qk_norm == (kind == "qwen3")
    if variant.get("compile_decode"):  # one at a time: every decode through the graph or the C step
        native = variant.get("native_decode", True) and native_takes_fp32()
        assert core.stats().decode_path == ("native" if native else "compiled")
        assert [run_to_end(core, [p], [NEW])[0] for p in PROMPTS] == expected
        # (the C step takes a prompt chunk as long as its rows too: the second prompt's 3 tokens past its cached
        # block, the third's 4, and on fp32 weights' 32 rows the first's 20)
        chunks = [len(PROMPTS[0]), len(PROMPTS[1]) - core.config.block_size, len(PROMPTS[2])]
        step = core.runner.compiled
        prompt_steps = sum(n <= step.max_rows for n in chunks) if native else 0
        assert step.steps == len(PROMPTS) * (NEW - 1) + prompt_steps
    else:  # all at once, the shared prefix from the cache
        assert run_to_end(core, PROMPTS, [NEW] * len(PROMPTS)) == expected


@pytest.mark.parametrize("variant", [dict(), dict(quantization="int8", compile_decode=True)], ids=["eager", "native"])
def test_greedy_matches_transformers_with_drafts(engines, family, variant):
    """Speculative decoding on these families: every draft a proposer that knows the answer offers, spoiled now
    and then, verified as a chunk (eager) or as the native step's rows; the output is transformers'."""
    from test_speculative import Oracle

    kind, path, expected = family
    core = engines.core(make_config(model=str(path), num_blocks=32, speculative={
        "method": "ngram", "num_speculative_tokens": 4, "adaptive": False}, **variant))
    try:
        core.parts.speculator.proposer = Oracle({tuple(p): e for p, e in zip(PROMPTS, expected)}, 100, spoil=3)
        got = [run_to_end(core, [p], [NEW])[0] for p in PROMPTS]
        if variant:  # int8 weights: the native step's own greedy tokens, with and without drafts
            plain = engines.core(make_config(model=str(path), num_blocks=32, **variant))
            expected = [run_to_end(plain, [p], [NEW])[0] for p in PROMPTS]
            plain.close()
        assert got == expected
        counters = core.stats().speculative
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    finally:
        core.close()
