"""Structured output (engine/grammar.py): every output parses and validates against its JSON schema (checked
with `jsonschema`), sampled or greedy, with n > 1 and prefix caching, beside requests without a schema; the
OpenAI server's response_format; schemas the grammar engine refuses, and beam search, are refused up front."""

import asyncio
import json

import jsonschema
import pytest

from helpers import check_pool_clean, make_config
from tieredkv import RequestError, SamplingParams

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "sizes": {"type": "array", "items": {"type": "integer", "minimum": 1,
                                                                           "maximum": 99},
                                                "minItems": 1, "maxItems": 4}},
     "required": ["colour", "sizes"], "additionalProperties": False},
    {"type": "object", "properties": {"owner": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999}, "admin": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["id", "admin", "tags"], "additionalProperties": False}},
     "required": ["owner"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"],
                                "additionalProperties": False}, "minItems": 2, "maxItems": 3},
]
PROMPT = list(range(5, 60))  # 55 tokens: 3 full blocks, served from the cache after the first request


@pytest.fixture(scope="module")
async def engine(engines, llama_dir):
    async with await engines.start(make_config(model=str(llama_dir), num_blocks=128, max_num_seqs=16)) as e:
        yield e


@pytest.mark.parametrize("schema", SCHEMAS, ids=["scalars", "enum-array", "nested", "top-array"])
async def test_outputs_validate_against_their_schema(engine, schema):
    plain = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = await asyncio.gather(
        engine.generate(PROMPT, SamplingParams(max_tokens=300, json_schema=schema)),
        engine.generate(PROMPT, SamplingParams(max_tokens=300, json_schema=schema, n=3, temperature=1.0, seed=7)),
        engine.generate(PROMPT + [3], plain),  # beside them, unconstrained
    )
    outputs = runs[0].outputs + runs[1].outputs
    assert len(outputs) == 4
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert len(runs[2].outputs[0].token_ids) == 24
    assert engine.stats().prefix_cache_hits > 0
    await engine.run_in_worker(check_pool_clean, engine.core)


async def test_any_json_object(engine):
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=300, json_schema={"type": "object"},
                                                       temperature=1.0, seed=3))
    assert out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.text), dict)


async def test_the_greedy_output_is_the_first_allowed_choice_of_the_plain_logits(engine):
    """A schema that allows exactly one document leaves the model nothing to choose: the output is it."""
    schema = {"enum": [{"a": [1, 2]}]}
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=100, json_schema=schema))
    assert json.loads(out.text) == {"a": [1, 2]} and out.outputs[0].finish_reason == "stop"


async def test_refused_up_front(engine):
    with pytest.raises(RequestError, match="json_schema"):
        await engine.generate(PROMPT, SamplingParams(json_schema={"type": "object", "required": 5}))
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(json_schema={"type": "object"}, beam_width=2)
    await engine.run_in_worker(check_pool_clean, engine.core)


async def test_response_format_on_the_openai_server(engine):
    import openai

    from tieredkv.serve import ServerSettings, start_server

    runner, port = await start_server(engine, ServerSettings(model_name="tiny"), port=0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        messages = [{"role": "user", "content": "a person"}]
        got = await client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMAS[0]}})
        jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMAS[0])
        got = await client.completions.create(model="tiny", prompt="x", max_tokens=300,
                                              extra_body={"response_format": {"type": "json_object"}})
        assert isinstance(json.loads(got.choices[0].text), dict)
        for bad in ({"type": "yaml"}, {"type": "json_schema", "json_schema": {"name": "x"}}):
            with pytest.raises(openai.BadRequestError, match="response_format"):
                await client.chat.completions.create(model="tiny", messages=messages, response_format=bad)
    finally:
        await client.close()
        await runner.cleanup()


@pytest.mark.parametrize("maximum, digits", [(None, 16), (10**18 - 1, 18)])
async def test_an_integer_without_bounds_of_its_own_closes_after_16_digits(engine, maximum, digits):
    """A model that would write the digit 1 forever (its logit raised far above every other): the schema's
    integer ends after 16 digits, as llama.cpp's grammars bound them, and the document closes; a maximum the
    schema sets itself is kept. Unbounded, the output ran until max_tokens and was no JSON."""
    one = engine.tokenizer.hf.convert_tokens_to_ids("1")
    field = {"type": "integer"} if maximum is None else {"type": "integer", "maximum": maximum}
    schema = {"type": "object", "properties": {"n": field}, "required": ["n"], "additionalProperties": False}
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=80, json_schema=schema, logit_bias={one: 100}))
    assert out.outputs[0].finish_reason == "stop", out.text
    assert json.loads(out.text) == {"n": int("1" * digits)}


@pytest.mark.parametrize("field", [{"type": "number"}, {"type": "number", "minimum": 0, "maximum": 2}])
async def test_a_number_closes_after_16_digits_a_part(engine, field):
    """The same model on a number: its integer part and its fraction each end after 16 digits in a row, and the
    document closes (a bounded value alone does not bound its fraction's digits)."""
    one = engine.tokenizer.hf.convert_tokens_to_ids("1")
    schema = {"type": "object", "properties": {"x": field}, "required": ["x"], "additionalProperties": False}
    out = await engine.generate(PROMPT, SamplingParams(max_tokens=120, json_schema=schema, logit_bias={one: 100}))
    assert out.outputs[0].finish_reason == "stop", out.text
    value = json.loads(out.text)["x"]
    text = out.text.split(":", 1)[1]
    runs = [len(r) for r in "".join(c if c.isdigit() else " " for c in text).split()]
    assert runs and max(runs) <= 16, out.text
    jsonschema.validate({"x": value}, schema)
    await engine.run_in_worker(check_pool_clean, engine.core)
