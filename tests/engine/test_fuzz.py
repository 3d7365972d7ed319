"""Fuzzing the request path: whatever a caller passes is served or rejected with a clear error, and the
engine serves a normal request afterwards with its pool intact."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from helpers import check_pool_clean, check_pool_consistent, drive, make_config
from tieredkv import RequestError, SamplingParams, TieredKVError

CLEAR = (RequestError, TypeError, ValidationError)
extreme_ints = st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**63, 2**64 - 1, 2**64]))
extreme_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                           st.sampled_from([0.0, 1e-300, 5e-324, 1e-5, 1e300, -0.0]))
params_strategy = st.fixed_dictionaries({}, optional={
    "max_tokens": extreme_ints, "temperature": extreme_floats, "top_k": extreme_ints, "top_p": extreme_floats,
    "seed": st.one_of(st.none(), extreme_ints), "n": st.integers(-2, 300), "stop": st.lists(st.text(max_size=3)),
    "stop_token_ids": st.lists(extreme_ints, max_size=3), "ignore_eos": st.booleans()})
prompts = st.one_of(
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), max_size=80),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\x00\x01\x1b[31m\x7f", "\u202e\ufeff", "", " " * 3]),
    st.lists(extreme_ints, max_size=40),
    st.lists(st.fixed_dictionaries({}, optional={"role": st.one_of(st.text(max_size=5), st.integers()),
                                                 "content": st.one_of(st.text(max_size=20), st.none())}),
             max_size=3),
    st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=5)),
)


@pytest.fixture(scope="module")
def core(engines, llama_dir):
    return engines.core(make_config(model=str(llama_dir), num_blocks=48, max_num_seqs=8, max_model_len=256,
                                    warm_bytes=0))


def run(core, prompt, params) -> list:
    """Everything the request produced, until it ended."""
    try:
        req = core.factory.make(prompt, params)
    except CLEAR:
        return []
    return drive(core, [req], lambda *_: check_pool_consistent(core), max_steps=400)


def ended_clearly(outputs) -> None:
    for _, item in outputs:
        if isinstance(item, BaseException):
            assert isinstance(item, TieredKVError), repr(item)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=params_strategy)
def test_sampling_params_over_extreme_values(core, kwargs):
    try:
        params = SamplingParams(**{"max_tokens": 4, **kwargs})
    except ValidationError:
        return
    if params.max_tokens > 16:
        params = params.model_copy(update={"max_tokens": 16})
    ended_clearly(run(core, [5, 6, 7, 8, 9], params))
    check_pool_clean(core)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=prompts)
def test_prompts_of_any_shape(core, prompt):
    ended_clearly(run(core, prompt, SamplingParams(max_tokens=3)))
    check_pool_clean(core)


def test_the_engine_serves_normally_after_the_fuzz(core):
    outputs = run(core, [5, 6, 7, 8, 9], SamplingParams(max_tokens=5, ignore_eos=True))
    finals = [c for _, c in outputs if not isinstance(c, BaseException) and c.finish_reason]
    assert len(finals) == 1 and finals[0].usage.completion_tokens == 5
    check_pool_clean(core)
