"""Random interleavings of add / step / abort / n>1 on a small pool never leak or double-book a block."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import check_pool_clean, check_pool_consistent, drive, make_config
from tieredkv import RequestError, SamplingParams


@pytest.fixture(scope="module", params=[(True, "auto"), (False, "auto"), (True, "off"), (True, "staged")],
                ids=["cache", "nocache", "cache-nooffload", "cache-staged"])
def core(engines, request, llama_dir):
    # a warm tier of 20 blocks: evictions demote, hits promote; sequences that outgrow the pool keep old
    # blocks there (offload; staged: only what preemption cannot solve), or without offloading,
    # preemptions swap (up to 10 blocks)
    caching, offload = request.param
    return engines.core(make_config(model=str(llama_dir), num_blocks=12, block_size=4, max_num_seqs=5,
                                    max_num_batched_tokens=16, enable_prefix_caching=caching, offload=offload,
                                    warm_bytes=20 * 3 * 2 * 4 * 2 * 16 * 4))


add = st.tuples(st.just("add"), st.integers(1, 22), st.integers(1, 8), st.integers(1, 3), st.booleans(),
                st.booleans())
step = st.tuples(st.just("step"))
abort = st.tuples(st.just("abort"), st.integers(0, 50))
ops_strategy = st.lists(st.one_of(add, step, step, step, abort), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops_strategy)
def test_random_interleavings_keep_the_pool_consistent(core, ops):
    shared = list(range(10, 40))
    ids = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, n, use_shared, sample = op
            prompt = shared[:length] if use_shared else [(7 * i + length) % 200 + 3 for i in range(length)]
            params = SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True,
                                    temperature=0.7 if sample else 0.0, seed=1)
            free_before = core.pool.num_free
            try:
                req = core.factory.make(prompt, params)
            except RequestError:
                assert core.pool.num_free == free_before
                continue
            core.add_request(req)
            ids.append(req.request_id)
        elif op[0] == "step":
            core.step()
        elif ids:
            core.abort(ids[op[1] % len(ids)])
        check_pool_consistent(core)
    drive(core, each_step=lambda *_: check_pool_consistent(core), max_steps=500)
    check_pool_clean(core)


def test_a_squeeze_offloads_or_preempts(core):
    """Three requests of 8 blocks each on a pool of 12: old blocks go to the warm tier (or, with
    offloading off or staged far blocks, the newest request is preempted first); every step keeps the
    pool consistent."""
    before = core.scheduler.room.offloaded_blocks, core.scheduler.num_preemptions
    for i in range(3):
        prompt = [(5 * j + i) % 200 + 3 for j in range(22)]
        core.add_request(core.factory.make(prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
    drive(core, each_step=lambda *_: check_pool_consistent(core))
    check_pool_clean(core)
    offloaded, preempted = core.scheduler.room.offloaded_blocks - before[0], core.scheduler.num_preemptions - before[1]
    if core.config.offload == "off":
        assert offloaded == 0 and preempted > 0
    elif core.runner.far_base is None:  # far blocks read in place: offload, never preempt
        assert offloaded > 0 and preempted == 0
    else:  # staged: preemption first; one that cannot fit beside the scheduled others offloads its own
        assert preempted > 0
