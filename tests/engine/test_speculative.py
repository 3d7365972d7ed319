"""Speculative decoding (engine/speculative.py): greedy output token for token what plain decoding gives (and
transformers), alone, batched, under preemption and offloading; every request option holds; sampled output keeps
its distribution; rejected drafts leave nothing behind in the cache; bad input is refused at start."""

import asyncio
import json
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from helpers import check_pool_clean, check_pool_consistent, drive, hf_greedy, make_config
from test_engine_matches_hf import make_prompts
from tieredkv import AsyncEngine, EngineConfig, RequestError, SamplingParams
from tieredkv.config import SpeculativeConfig
from tieredkv.engine.engine_core import EngineCore
from tieredkv.engine.sampler import sample_row
from tieredkv.engine.speculative import NgramIndex, NgramProposer, SpecState
from tieredkv.runner.step_plan import describe, rebuild

MAX_NEW = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


class Oracle:
    """A proposer that knows each prompt's continuation (`expected`, by prompt) and spoils one draft token in
    every `spoil` proposals (at a position that moves), so that verifications accept all, some and none."""

    name = "oracle"

    def __init__(self, expected: dict[tuple, list[int]], vocab: int, spoil: int = 3):
        self.expected, self.vocab, self.spoil, self.calls = expected, vocab, spoil, 0

    def propose(self, seqs, lengths):
        drafts = []
        for seq, k in zip(seqs, lengths):
            full = self.expected.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), [])
            at = seq.num_output_tokens
            draft = list(full[at : at + k])
            self.calls += 1
            if draft and self.calls % self.spoil == 0:
                j = self.calls % len(draft)
                draft[j] = (draft[j] + 1) % self.vocab
            drafts.append(draft)
        return drafts


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def case(request, llama_dir, qwen2_dir):
    model_dir = llama_dir if request.param == "llama" else qwen2_dir
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab)
    return model_dir, prompts, hf_greedy(model_dir, prompts, MAX_NEW), vocab


async def run(engines, model_dir, prompts, params, batched=True, proposer=None, **cfg):
    """Outputs (tokens, finish reasons, logprobs), stats and usages of one engine over the prompts."""
    async with await engines.start(make_config(model=str(model_dir), **cfg)) as engine:
        if proposer is not None:
            engine.core.parts.speculator.proposer = proposer
        if batched:
            results = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        else:
            results = [await engine.generate(p, params) for p in prompts]
        await engine.run_in_worker(check_pool_clean, engine.core)
        outs = [[(o.token_ids, o.finish_reason, o.logprobs, o.text) for o in r.outputs] for r in results]
        return outs, engine.stats(), [r.usage for r in results]


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
@pytest.mark.parametrize("batched", [False, True], ids=["one-at-a-time", "batched"])
async def test_greedy_matches_transformers_with_drafts(engines, case, proposer, batched):
    """Drafts accepted in full, in part and not at all: the output is transformers' greedy output, and the
    counters add up (stats, usage, per position)."""
    model_dir, prompts, expected, vocab = case
    oracle = Oracle({tuple(p): e for p, e in zip(prompts, expected)}, vocab) if proposer == "oracle" else None
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outs, stats, usage = await run(engines, model_dir, prompts, params, batched, oracle, num_blocks=256,
                                   max_num_batched_tokens=64, speculative=NGRAM)
    assert [o[0][0] for o in outs] == expected
    spec = stats.speculative
    assert spec.num_draft_tokens == sum(u.draft_tokens for u in usage) > 0
    assert spec.num_accepted_tokens == sum(u.accepted_draft_tokens for u in usage) > 0
    assert spec.accepted_per_position[0] >= spec.accepted_per_position[-1]
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    if proposer == "oracle":
        assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # some drafts were rejected


@pytest.mark.parametrize("squeeze", [dict(offload="off"), dict(warm_bytes=1 << 20)], ids=["preempt", "offload"])
async def test_drafts_under_a_dry_pool(engines, case, squeeze):
    """A pool too small for the batch: drafts never take blocks another sequence needs, and preemption or
    offloading still give transformers' output."""
    model_dir, prompts, expected, vocab = case
    oracle = Oracle({tuple(p): e for p, e in zip(prompts, expected)}, vocab)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outs, stats, _ = await run(engines, model_dir, prompts, params, True, oracle, num_blocks=16,
                               max_num_batched_tokens=128, speculative=NGRAM, **squeeze)
    assert [o[0][0] for o in outs] == expected
    assert stats.num_preemptions + stats.blocks_offloaded > 0 and stats.speculative.num_accepted_tokens > 0


def test_rejected_drafts_leave_the_cache_exact(engines, llama_dir):
    """Step by step: block tables cover the computed tokens and no more once a step is over, reference counts
    match the tables, and every cached block holds the tokens its hash names (never a rejected draft)."""
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, seed=5)[:4]
    expected = hf_greedy(llama_dir, prompts, MAX_NEW)
    core = engines.core(make_config(model=str(llama_dir), num_blocks=64, block_size=4, max_num_batched_tokens=64,
                                    speculative=NGRAM))
    try:
        core.parts.speculator.proposer = Oracle({tuple(p): e for p, e in zip(prompts, expected)}, vocab, spoil=2)
        reqs = [core.factory.make(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), f"r{i}")
                for i, p in enumerate(prompts)]
        for r in reqs:
            assert core.add_request(r) == []

        def check(*_):
            check_pool_consistent(core)
            for seq in core.scheduler.running:
                assert len(seq.block_table) == -(-seq.num_computed_tokens // 4) and not seq.spec_tokens
            for block in core.pool.cached.values():
                assert block.token_ids is None or len(block.token_ids) == 4

        drive(core, each_step=check)
        assert [r.seqs[0].output_token_ids for r in reqs] == expected
        bs, seqs = 4, [r.seqs[0] for r in reqs]
        for seq in seqs:  # every full block of every output was cached under the hash of its real tokens
            keys = core.kv.chain_keys(seq.token_ids)
            assert len(core.index.pool_prefix(keys)) >= (len(seq.token_ids) - 1) // bs - 1
        check_pool_clean(core)
        assert core.stats().speculative.num_accepted_tokens < core.stats().speculative.num_draft_tokens
    finally:
        core.close()


async def test_every_request_option_holds_with_drafts(engines, llama_dir):
    """Stop strings and tokens, max and min tokens, logit bias, penalties, logprobs, n > 1, a json_schema grammar:
    the same outputs, finish reasons and log-probabilities with drafts as without (drafts that run past a stop
    are cut there; a draft the grammar forbids is rejected by the masked row)."""
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, seed=3)[:5]
    plain_params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    base, _, _ = await run(engines, llama_dir, prompts, plain_params, num_blocks=256)
    texts = [o[0][3] for o in base]
    stop = next(t[5:8] for t in texts if len(t) > 8)  # a string some output contains
    cases = [dict(stop=[stop]), dict(stop_token_ids=[base[0][0][0][6]]), dict(max_tokens=3),
             dict(logit_bias={base[1][0][0][2]: -5.0, 7: 3.0}), dict(repetition_penalty=1.3),
             dict(frequency_penalty=0.8, presence_penalty=0.4), dict(logprobs=3), dict(n=2),
             dict(min_tokens=10, stop_token_ids=[base[0][0][0][1]]),
             dict(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})]
    for extra in cases:
        params = SamplingParams(**{"max_tokens": MAX_NEW, "ignore_eos": True, **extra})
        want, _, _ = await run(engines, llama_dir, prompts, params, num_blocks=256)
        oracle = Oracle({tuple(p): w[0][0] for p, w in zip(prompts, want)}, vocab, spoil=4)
        got, stats, _ = await run(engines, llama_dir, prompts, params, True, oracle, num_blocks=256, speculative=NGRAM)
        for g, w in zip(got, want):
            for (gt, gr, gl, gx), (wt, wr, wl, wx) in zip(g, w):
                assert (gt, gr, gx) == (wt, wr, wx), extra
                if wl is not None:
                    assert [lp.token_id for lp in gl] == [lp.token_id for lp in wl]
                    assert max(abs(a.logprob - b.logprob) for a, b in zip(gl, wl)) < 1e-4, extra
        assert stats.speculative.num_drafts > 0, extra


def test_a_draft_keeps_the_sampled_distribution():
    """Rejection sampling against a one-token draft: the draft is taken with probability p(draft), else a token
    from p without it; the token frequencies over 10,000 draws match p (chi-square, 7 degrees of freedom, below
    its 0.9999 quantile 29.9), for a draft the distribution favours, one outside the nucleus and one it does not
    favour. (A fallback that kept the draft in p would put the expected statistic near 460 at the least likely
    draft here, 2,400 at the likeliest.)"""
    params = SamplingParams(temperature=0.8, top_p=0.95)
    logits = torch.tensor([2.0, 1.5, 0.2, -0.3, 1.0, -2.0, 0.5, 0.0])
    from tieredkv.engine.sampler import apply_top_k_top_p

    p = apply_top_k_top_p(logits / params.temperature, 0, params.top_p).softmax(-1)
    n = 10_000
    for draft in (0, 5, 2):
        gen = torch.Generator().manual_seed(draft)
        counts = torch.bincount(torch.tensor([sample_row(logits, params, gen, draft) for _ in range(n)]),
                                minlength=8).double()
        keep = p > 0
        chi2 = ((counts[keep] - n * p[keep]) ** 2 / (n * p[keep])).sum()
        assert chi2 < 29.9, (draft, counts, p)
        assert counts[~keep].sum() == 0  # nothing outside the nucleus, even as a draft


async def test_sampled_outputs_keep_their_distribution_with_drafts(engines, llama_dir):
    """In the engine: 300 seeded samples of the first 3 output tokens with drafts (the greedy continuation,
    which rejection sampling takes or refuses) and 300 without: each position's token histogram passes a
    two-sample chi-square test (p > 0.001; categories under 5 expected pooled)."""
    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    prompt = make_prompts(vocab, seed=9)[3]
    greedy = hf_greedy(llama_dir, [prompt], 4)[0]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.4, seed=s) for s in range(300)]

    async def sample(spec):
        cfg = dict(model=str(llama_dir), num_blocks=512, max_num_seqs=300)
        if spec:
            cfg["speculative"] = {**NGRAM, "disable_by_batch_size": 300}
        async with await engines.start(make_config(**cfg)) as engine:
            if spec:
                engine.core.parts.speculator.proposer = Oracle({tuple(prompt): greedy}, vocab, spoil=10**9)
            results = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
            return [r.outputs[0].token_ids for r in results], engine.stats()

    plain, _ = await sample(False)
    drafted, stats = await sample(True)
    assert 0 < stats.speculative.num_accepted_tokens < stats.speculative.num_draft_tokens  # taken and refused
    for pos in range(3):
        a = torch.bincount(torch.tensor([t[pos] for t in plain]), minlength=vocab).double()
        b = torch.bincount(torch.tensor([t[pos] for t in drafted]), minlength=vocab).double()
        total = a + b
        big = total >= 10
        a = torch.cat([a[big], a[~big].sum().unsqueeze(0)])
        b = torch.cat([b[big], b[~big].sum().unsqueeze(0)])
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expect_a = (a + b) * a.sum() / (a.sum() + b.sum())
        expect_b = (a + b) * b.sum() / (a.sum() + b.sum())
        chi2 = float(((a - expect_a) ** 2 / expect_a + (b - expect_b) ** 2 / expect_b).sum())
        df = len(a) - 1
        # the 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty)
        z = 3.09
        limit = df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3 if df else 0.0
        assert chi2 <= limit, (pos, chi2, limit, df)


def test_ngram_index_finds_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2]
    index = NgramIndex(1, 3)
    index.extend(tokens)
    assert index.lookup(tokens, 3) == [3, 4, 5]  # "1 2" last seen at 4..5, followed by 3 4 5
    grown = NgramIndex(1, 3)
    for n in range(1, len(tokens) + 1):
        grown.extend(tokens[:n])
    assert grown.last == index.last
    assert index.lookup(tokens + [7], 4) == []  # nothing before ever followed 7
    assert index.lookup([5, 6], 2) == []


def test_ngram_index_follows_the_passage_being_copied():
    """While the output goes on as the passage its last match found, the draft continues that passage, though the
    latest occurrence of the suffix lies elsewhere (a line of notes copied whose ", led by" every line has); once
    the output leaves it, the lookup starts again."""
    tokens = [10, 1, 2, 11, 12, 1, 2, 13, 14, 99, 10]
    index = NgramIndex(1, 2)
    index.extend(tokens)
    assert index.lookup(tokens, 3) == [1, 2, 11]  # "10" occurred at 0
    tokens += [1, 2]  # the draft's first two accepted
    index.extend(tokens)
    assert index.lookup(tokens, 3) == [11, 12, 1]  # on the passage of the first "10", not the latest "1 2"
    fresh = NgramIndex(1, 2)
    fresh.extend(tokens)
    assert fresh.lookup(tokens, 3) == [13, 14, 99]  # what the latest "1 2" alone would give
    tokens += [11, 7]  # the output leaves the passage: 7 never occurred before
    index.extend(tokens)
    assert index.lookup(tokens, 3) == [] and index.follow is None
    tokens += [1]
    index.extend(tokens)
    assert index.lookup(tokens, 2) == [2, 11]  # a new match: the latest "1" (in the copied output)


def test_ngram_proposer_reads_prompt_and_output(engines, llama_dir):
    core = engines.core(make_config(model=str(llama_dir), num_blocks=32, speculative=NGRAM))
    try:
        req = core.factory.make([5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=4))
        seq = core.lifecycle._new_sequence(req, 0, req.prompt_token_ids)
        seq.spec_state = SpecState()
        assert NgramProposer(2, 3).propose([seq], [3]) == [[7, 8, 9]]
    finally:
        core.close()


def test_the_plan_other_ranks_rebuild_carries_the_drafts():
    """Tensor parallelism: rank 0's step plan gives the other ranks the drafts as the step's tokens."""
    class Seq:
        num_computed_tokens, num_tokens, token_ids, spec_tokens = 5, 6, [1, 2, 3, 4, 5, 6], [7, 8]
        block_table = []

        def step_token_ids(self, n):
            from tieredkv.core.sequence import step_tokens
            return step_tokens(self.token_ids, self.spec_tokens, self.num_computed_tokens, n)

    (stand, n), = rebuild(describe([(Seq(), 3)]))
    assert n == 3 and stand.step_token_ids(3) == [6, 7, 8] and stand.num_tokens == 6


async def test_bad_speculative_settings_are_refused(llama_dir):
    with pytest.raises(ValidationError, match="ngram"):
        make_config(speculative={"method": "eagle9"})
    for bad in ({"num_speculative_tokens": 0}, {"num_speculative_tokens": 17},
                {"prompt_lookup_min": 5, "prompt_lookup_max": 2}):
        with pytest.raises(ValidationError):
            make_config(speculative={"method": "ngram", **bad})
    with pytest.raises(ValidationError, match="draft model"):
        make_config(speculative={"method": "draft"})
    with pytest.raises(ValidationError, match="apply to method"):
        make_config(speculative={"method": "ngram", "model": "default"})
    with pytest.raises(ValidationError, match="JSON"):
        make_config(speculative="{method: ngram")
    assert EngineConfig.from_env({"TIEREDKV_SPECULATIVE": '{"method": "ngram", "num_speculative_tokens": 6}'}
                                 ).speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=6)
    with pytest.raises(ValidationError, match="beam search"):
        SamplingParams(beam_width=2, speculative=True)
    async with await AsyncEngine.start(make_config(model=str(llama_dir), num_blocks=32)) as engine:
        with pytest.raises(RequestError, match="speculative") as err:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, speculative=True))
        assert err.value.param == "speculative"
        assert (await engine.generate([5, 6, 7], SamplingParams(max_tokens=2, speculative=False))).outputs


async def test_a_request_can_turn_drafts_off(engines, llama_dir):
    prompts = make_prompts(448, seed=2)[:3]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, speculative=False)
    _, stats, usage = await run(engines, llama_dir, prompts, params, num_blocks=64, speculative=NGRAM)
    assert stats.speculative.num_drafts == 0 and all(u.draft_tokens == 0 for u in usage)


@pytest.fixture(scope="module")
def other_vocab_dir(tmp_path_factory):
    """A checkpoint whose vocabulary is larger than the tiny tokenizer's (rows no token maps to)."""
    from helpers import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny-llama-600"), "llama", vocab_size=600)


@pytest.mark.parametrize("draft", [dict(), dict(quantization="int8")], ids=["same-weights", "int8-self-draft"])
async def test_a_draft_model_proposes(engines, case, draft):
    """A draft model (the target's own checkpoint, as it is or quantized): transformers' greedy output, and drafts
    taken (all of them where the draft is the target itself)."""
    model_dir, prompts, expected, _ = case
    spec = {"method": "draft", "model": str(model_dir), "num_speculative_tokens": 3, "adaptive": False, **draft}
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outs, stats, usage = await run(engines, model_dir, prompts[:5], params, True, None, num_blocks=256,
                                   speculative=spec)
    assert [o[0][0] for o in outs] == expected[:5]
    s = stats.speculative
    assert s.method == "draft" and s.num_accepted_tokens > 0
    if not draft:
        assert s.num_accepted_tokens == s.num_draft_tokens  # the same weights on the same path guess right
    assert sum(u.draft_tokens for u in usage) == s.num_draft_tokens


def test_a_draft_model_must_share_the_vocabulary(llama_dir, other_vocab_dir):
    with pytest.raises(ValueError, match="vocabulary of 600 tokens"):
        EngineCore(make_config(model=str(llama_dir), num_blocks=32,
                               speculative={"method": "draft", "model": str(other_vocab_dir)}))


def test_the_server_reports_drafts_as_openai_names_predicted_tokens():
    from tieredkv.engine.outputs import Usage
    from tieredkv.serve.protocol import usage_body

    body = usage_body([Usage(10, 0, 20, draft_tokens=12, accepted_draft_tokens=9)])
    assert body["completion_tokens_details"] == {"accepted_prediction_tokens": 9, "rejected_prediction_tokens": 3}
    assert "completion_tokens_details" not in usage_body([Usage(10, 0, 20)])


async def test_drafts_keep_quantized_steps_on_the_integer_kernels(engines, llama_dir):
    """Quantized weights on CPU: drafts never carry a step past the rows the integer kernels take (past them a
    dequantized fp32 product or int8 blocks, other arithmetic, would serve it), so batched outputs are plain
    decoding's on the same weights (int8_activations=False: a step past those rows without drafts then meets the
    fp32 product, as near the int16 rows as plain decoding's steps need; int8 blocks make greedy output depend
    on what is batched beside it, with or without drafts)."""
    from tieredkv.kernels.quant_cpu import GEMV_MAX_ROWS

    vocab = json.loads((llama_dir / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(vocab, seed=11)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    want, _, _ = await run(engines, llama_dir, prompts, params, num_blocks=256, quantization="int8",
                           int8_activations=False)
    oracle = Oracle({tuple(p): w[0][0] for p, w in zip(prompts, want)}, vocab, spoil=5)
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=256, quantization="int8",
                                               int8_activations=False, speculative=NGRAM)) as engine:
        core = engine.core
        core.parts.speculator.proposer = oracle
        rows, inner = [], core.runner.execute
        core.runner.execute = lambda out: rows.append((out.num_tokens, sum(len(s.spec_tokens) for s, _ in
                                                                           out.scheduled))) or inner(out)
        got = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        await engine.run_in_worker(check_pool_clean, core)
        assert core.scheduler.max_draft_rows == GEMV_MAX_ROWS
    assert [r.outputs[0].token_ids for r in got] == [w[0][0] for w in want]
    drafted = [(n, d) for n, d in rows if d]  # within the kernels' rows, or past them without the drafts too
    assert drafted and all(n <= GEMV_MAX_ROWS or n - d > GEMV_MAX_ROWS for n, d in drafted)
    assert any(n == GEMV_MAX_ROWS for n, _ in drafted)  # drafts were cut to fit


class RandomDrafts:
    """Drafts of every kind from one seed: the right continuation, the right one spoiled at a random place,
    random tokens, empty, of random lengths."""

    name = "random"

    def __init__(self, expected: dict[tuple, list[int]], vocab: int, seed: int):
        self.expected, self.vocab, self.rng = expected, vocab, random.Random(seed)

    def propose(self, seqs, lengths):
        out = []
        for seq, k in zip(seqs, lengths):
            full = self.expected.get(tuple(seq.token_ids[: seq.num_prompt_tokens]), [])
            right = list(full[seq.num_output_tokens : seq.num_output_tokens + self.rng.randint(0, k)])
            kind = self.rng.random()
            if kind < 0.3 and right:
                right[self.rng.randrange(len(right))] = self.rng.randrange(self.vocab)
            elif kind < 0.45:
                right = [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(0, k))]
            out.append(right)
        return out


@pytest.fixture(scope="module")
def squeezed(engines, llama_dir):
    """A plain engine and a speculative one on a pool small enough to preempt, shared by the examples."""
    cfg = dict(model=str(llama_dir), num_blocks=20, max_num_batched_tokens=48, warm_bytes=0, block_size=8)
    plain = engines.core(make_config(**cfg))
    spec = engines.core(make_config(**cfg, speculative={**NGRAM, "num_speculative_tokens": 6}))
    yield plain, spec
    plain.close()
    spec.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       new=st.integers(1, 20))
def test_any_drafts_leave_greedy_output_and_the_pool_as_plain_decoding(squeezed, seed, sizes, new):
    """Property: whatever a proposer offers, at whatever length, in a pool that preempts, with a request cancelled
    now and then, the outputs are plain decoding's and the pool is consistent after every step and clean at the
    end. (fp32 weights: a verification row is a chunk's row, its sums in another order than a decode's, so where
    plain decoding's best two tokens tie within float rounding either may come out: an output may turn there, to
    plain decoding's runner-up, and nowhere else. A search found such a tie, two logits an ulp apart.)"""
    plain, spec = squeezed
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 440) for _ in range(n)] for n in sizes]
    reqs = [plain.factory.make(p, SamplingParams(max_tokens=new, ignore_eos=True, logprobs=2)) for p in prompts]
    for r in reqs:
        r.sink = object()  # what a request's outputs come with
    out = drive(plain, reqs)
    plain_logprobs = [[lp for sink, chunk in out if sink is r.sink for lp in chunk.logprobs] for r in reqs]
    want = [[lp.token_id for lp in lps] for lps in plain_logprobs]
    spec.parts.speculator.proposer = RandomDrafts({tuple(p): w for p, w in zip(prompts, want)}, 448, seed)
    reqs = [spec.factory.make(p, SamplingParams(max_tokens=new, ignore_eos=True)) for p in prompts]
    abort_at = rng.choice([None, 1, 3])  # a request cancelled mid-way frees what it held, drafts' blocks too

    def each_step(step: int, _) -> None:
        if step == abort_at:
            spec.abort(reqs[0].request_id)
        check_pool_consistent(spec)

    assert not any(isinstance(chunk, BaseException) for _, chunk in drive(spec, reqs, each_step))
    done = [(r.seqs[0].output_token_ids, w) for r, w in zip(reqs, plain_logprobs)
            if r.seqs[0].finish_reason != "abort"]
    assert all(plain_decoding_up_to_a_tie(got, w) for got, w in done), done
    check_pool_clean(spec)


def plain_decoding_up_to_a_tie(got: list[int], plain: list, within: float = 1e-4) -> bool:
    """Whether greedy tokens `got` are plain decoding's (its TokenLogprobs, the top two each), or the same up to a
    token where plain decoding's best two log-probabilities are `within` of each other and `got` took the other."""
    for token, want in zip(got, plain):
        if token != want.token_id:
            (best, best_lp), (second, second_lp) = want.top[:2]
            return token in (best, second) and best_lp - second_lp <= within
    return len(got) == len(plain)


async def test_a_failing_proposer_or_verification_fails_no_request_it_need_not(engines, llama_dir, monkeypatch):
    """A proposer that raises costs its drafts only (the requests decode on, the same tokens); a fault while
    verifying fails the requests that drafted, with a StepError each, and the engine serves the next request."""
    from tieredkv import StepError
    from tieredkv.engine.lifecycle import Lifecycle

    class Broken:
        name = "broken"

        def propose(self, seqs, lengths):
            raise RuntimeError("proposer bug")

    prompts = make_prompts(448, seed=4)[:3]
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    want, _, _ = await run(engines, llama_dir, prompts, params, num_blocks=64)
    got, stats, _ = await run(engines, llama_dir, prompts, params, True, Broken(), num_blocks=64, speculative=NGRAM)
    assert got == want and stats.speculative.proposer_errors > 0 and stats.speculative.num_drafts == 0

    def broken_verify(self, logits, verifying):
        raise RuntimeError("verification bug")

    monkeypatch.setattr(Lifecycle, "_verify", broken_verify)
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=64,
                                               speculative=NGRAM)) as engine:
        engine.core.parts.speculator.proposer = Oracle({tuple(prompts[0]): want[0][0][0]}, 448)
        plain = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, speculative=False)
        results = await asyncio.gather(engine.generate(prompts[0], params), engine.generate(prompts[1], plain),
                                       return_exceptions=True)
        assert isinstance(results[0], StepError) and results[1].outputs[0].token_ids == want[1][0][0]
        monkeypatch.undo()
        assert (await engine.generate(prompts[2], plain)).outputs[0].token_ids == want[2][0][0]
        await engine.run_in_worker(check_pool_clean, engine.core)


class _FreeProposer:
    """Proposals that cost nothing (as prompt lookup's): always k tokens."""

    name, free = "free", True

    def propose(self, seqs, lengths):
        return [[7] * k for k in lengths]


def _adaptive_rate(per_row: float, accept, steps: int = 400) -> tuple[float, int]:
    """A model-free run of the adaptive controller over one decoding sequence: a plain step costs 1 (time unit), a
    verification of k drafts 1 + per_row * k; `accept(step, k)` says how many of k drafts are accepted. Returns the
    tokens a unit of time against plain decoding's (1.0), and the steps that carried drafts."""
    from types import SimpleNamespace

    from tieredkv.engine.speculative import Speculator

    spec = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=8), _FreeProposer(), 8, 100)
    request = SimpleNamespace(beam=None, prefill_only=False,
                              params=SimpleNamespace(speculative=None, max_tokens=10 ** 6))
    seq = SimpleNamespace(num_tokens=1, num_computed_tokens=0, num_output_tokens=0, request=request,
                          spec_state=None, spec_tokens=[])
    tokens = spent = drafting = 0
    for step in range(steps):
        spec.propose([seq], 10 ** 6)
        k = len(seq.spec_tokens)
        seconds = 1.0 + per_row * k
        spec.observe(1, k, seconds)
        accepted = accept(step, k) if k else 0
        if k:
            spec.verified(seq, k, accepted)
            drafting += 1
        tokens, spent = tokens + 1 + accepted, spent + seconds
        seq.num_output_tokens += 1 + accepted
    return tokens / spent, drafting


def test_adaptive_drafts_stop_where_verification_rows_cost_as_much_as_steps():
    """Verification rows as dear as steps (quantized weights on a processor without int8 dot products): not even
    drafts that are all accepted pay, so after measuring that the controller stops drafting, probes included (full
    probes of 8 drafts every few steps, as it once made whenever a probe had anything accepted, ran at 0.49x plain
    decoding in this model); where verification is cheap, it drafts and gains."""
    rng = random.Random(0)

    def mostly(step, k):  # each draft accepted with chance 0.77, up to the first rejection
        n = 0
        while n < k and rng.random() < 0.77:
            n += 1
        return n

    rate, drafting = _adaptive_rate(1.2, mostly)
    assert rate >= 0.95 and drafting <= 12, (rate, drafting)
    rate, drafting = _adaptive_rate(1.0, lambda step, k: k)  # all accepted, rows as dear as steps: no gain to be had
    assert rate >= 0.95 and drafting <= 12, (rate, drafting)
    rate, drafting = _adaptive_rate(0.1, mostly)  # cheap verification (compute to spare): drafting pays
    assert rate >= 1.8 and drafting >= 100, (rate, drafting)


def test_adaptive_probes_find_text_that_starts_being_copied():
    """Nothing to copy for 150 steps (every draft rejected), then everything copied: the back-off's probes find it
    within BACKOFF_LIMIT steps and drafting resumes."""
    from tieredkv.engine.speculative import BACKOFF_LIMIT

    seen = []

    def switch(step, k):
        seen.append(step)
        return 0 if step < 150 else k

    rate, drafting = _adaptive_rate(0.1, switch, steps=400)
    later = [s for s in seen if s >= 150]
    assert later and later[0] <= 150 + BACKOFF_LIMIT + 1, later[:3]
    assert len(later) >= 150, len(later)  # drafting in most steps once it pays
