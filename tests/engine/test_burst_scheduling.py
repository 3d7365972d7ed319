"""Bursts on shared prompts: in-flight prefix sharing (a prefix that requests bring at once is computed once)
and the shortest-prefill admission order."""

import random

import pytest

from helpers import check_pool_clean, drive, make_config
from tieredkv import SamplingParams

BS = 16


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 300) for _ in range(n)]


def run(core, prompts, max_tokens=6, abort_after=None):
    """All prompts added in one tick, stepped to the end: greedy outputs by request id, and the prompt
    tokens the forwards computed."""
    reqs = [core.factory.make(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{i}")
            for i, p in enumerate(prompts)]
    outputs = {r.request_id: [] for r in reqs}
    for r in reqs:
        core.add_request(r)
    before = core.stats().prompt_tokens_computed

    def each_step(n, _):
        if n == abort_after:
            core.abort("r0")

    for _, chunk in drive(core, each_step=each_step):
        outputs[chunk.request_id] += chunk.token_ids
    return outputs, core.stats().prompt_tokens_computed - before


@pytest.fixture(scope="module")
def reference(engines, llama_dir):
    """Each conversation alone, with no prefix cache: what the shared runs must produce."""
    core = engines.core(make_config(model=str(llama_dir), num_blocks=256, enable_prefix_caching=False,
                                    compile_decode=False))

    def answer(prompt):
        return run(core, [prompt])[0]["r0"]
    yield answer
    core.close()


def make_core(engines, llama_dir, **kw):
    kw = {"num_blocks": 256, "block_size": BS, "max_num_batched_tokens": 64, "compile_decode": False, **kw}
    return engines.core(make_config(model=str(llama_dir), **kw))


def test_followers_wait_for_the_chunk_that_computes_their_prefix(engines, llama_dir, reference):
    """The first prompt's last chunk computes shared blocks 12-14 in the step where budget is left for
    the others: they wait one step and take those blocks from the cache instead of computing them too."""
    system, n = ids(240, 1), 4  # 15 full blocks
    prompts = [system + ids(8, 100 + i) for i in range(n)]  # 248 tokens: chunks of 64, 64, 64 and 56
    core = make_core(engines, llama_dir)
    outputs, computed = run(core, prompts)
    s = core.stats()
    assert computed == 248 + (n - 1) * 8  # without waiting: + 48, blocks 12-14 computed twice
    assert s.prefix_cache_queries - s.prefix_cache_hits == computed
    assert s.prefix_blocks_joined == (n - 1) * 3
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(p)
    check_pool_clean(core)
    core.close()


@pytest.mark.parametrize("budget", [48, 100])
def test_interleaved_system_prompts_each_computed_once(engines, llama_dir, reference, budget):
    systems = [ids(100, 2), ids(130, 3), ids(64, 4)]
    prompts = [systems[i % 3] + ids(10, 200 + i) for i in range(12)]
    core = make_core(engines, llama_dir, max_num_batched_tokens=budget)
    outputs, computed = run(core, prompts)
    necessary = sum(len(x) + 10 for x in systems) + sum(len(p) - (len(p) - 10) // BS * BS for p in prompts[3:])
    assert computed == necessary
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == reference(p)
    check_pool_clean(core)
    core.close()


def test_sharer_aborted_mid_prefill(engines, llama_dir, reference):
    """The request computing the shared prefix is aborted half way: the next one takes what was
    computed and computes the rest (once); all answer as they would alone."""
    system = ids(256, 5)
    prompts = [system + ids(12, 300 + i) for i in range(4)]  # 268 tokens
    core = make_core(engines, llama_dir)
    outputs, computed = run(core, prompts, abort_after=2)  # r0 computed 2 chunks of 64
    assert computed == 128 + (268 - 128) + 2 * (268 - 256)
    for i, p in enumerate(prompts[1:], 1):
        assert outputs[f"r{i}"] == reference(p)
    check_pool_clean(core)
    core.close()


def test_without_prefix_caching_nobody_waits(engines, llama_dir):
    system = ids(100, 6)
    core = make_core(engines, llama_dir, enable_prefix_caching=False)
    _, computed = run(core, [system + ids(8, 400 + i) for i in range(3)])
    assert computed == 3 * 108
    assert core.stats().prefix_blocks_joined == 0
    check_pool_clean(core)
    core.close()


def first_token_steps(core, prompts, max_tokens=2):
    """Adds the prompts in order, in one tick; the step at which each request's first token came."""
    reqs = [core.factory.make(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"q{i}")
            for i, p in enumerate(prompts)]
    first = {}

    def each_step(n, out):
        for _, chunk in out:
            first.setdefault(chunk.request_id, n)

    drive(core, reqs, each_step)
    return [first[r.request_id] for r in reqs]


@pytest.mark.parametrize("policy", ["shortest_prefill", "fcfs"])
def test_a_conversation_on_a_cached_prompt_starts_beside_a_long_new_one(engines, llama_dir, policy):
    system = ids(160, 7)
    core = make_core(engines, llama_dir, scheduling_policy=policy)
    run(core, [system + ids(4, 500)])  # the system prompt is cached
    long_new, follow_up = ids(300, 8), system + ids(12, 501)  # the long one arrives first
    steps = first_token_steps(core, [long_new, follow_up])
    if policy == "fcfs":
        assert steps == [5, 5]  # 300 tokens in chunks of 64; the follow-up is admitted beside the last one
    else:
        assert steps == [5, 1]  # its 12 tokens after the cached system prompt go first
    check_pool_clean(core)
    core.close()


def test_a_long_prompt_is_overtaken_a_bounded_number_of_times(engines, llama_dir):
    """max_num_seqs 2: the policy orders 4 waiting requests, and a request overtaken by 4 later arrivals
    goes first from the next step on; short prompts that keep coming never hold a long one back longer."""
    core = make_core(engines, llama_dir, max_num_seqs=2, max_num_batched_tokens=32)
    reqs = [core.factory.make(ids(200, 9), SamplingParams(max_tokens=1), "long")]
    reqs += [core.factory.make(ids(20, 600 + i), SamplingParams(max_tokens=1), f"s{i}") for i in range(10)]
    drive(core, reqs)
    order = [r.request_id for r in sorted(reqs, key=lambda r: r.seqs[0].admit_order)]
    # overtaken 4 times by the end of step 3 (s0, s1, s2, s3), and once more in that step (s4): first at step 4
    assert order == ["s0", "s1", "s2", "s3", "s4", "long", "s5", "s6", "s7", "s8", "s9"]
    check_pool_clean(core)
    core.close()
