"""Tool calling and the Responses API, driven by the clients people use: the `openai` SDK (chat tools, streamed
tool calls, the Responses API), OpenAI's Agents SDK and pydantic-ai running agent loops against the server. The
default model has no tool format in its template (the generic JSON format); a tiny model with a Hermes-style
template tests a native one; every parser's grammar and reader are checked on text of their own. Also: a json_schema
fuzz where every answer parses and validates, or says it was cut."""

import asyncio
import json
import random

import aiohttp
import jsonschema
import openai
import pytest

from helpers import check_pool_clean, make_checkpoint, make_config
from tieredkv import AsyncEngine
from tieredkv.engine.grammar import grammars_of
from tieredkv.serve import ServerSettings, start_server
from tieredkv.serve.tools import FORMATS, ToolStream, format_for, parse_tools

NAME = "m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape
# A chat template with a native tool format (Hermes/Qwen's <tool_call> blocks), written for these tests.
HERMES_TEMPLATE = (
    "{%- if tools %}<s>system: {% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}\n"
    "Tools:\n{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}\n"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <arguments>}\n</tool_call>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and tools %}"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}<s>assistant: {{ m['content'] or '' }}"
    "{%- for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}\n"
    "{%- elif m['role'] == 'tool' %}<s>tool: {{ m['content'] }}\n"
    "{%- else %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<s>assistant: {% endif %}")
# Llama 3.1's way (a JSON object with "parameters"; results in the ipython role), written for these tests.
LLAMA3_TEMPLATE = (
    "{%- if tools %}<s>system: Call a function by answering {\"name\": function name, \"parameters\": its arguments}."
    "{%- for t in tools %}\n{{ t | tojson }}{% endfor %}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and m.get('tool_calls') %}<s>assistant: "
    "{%- for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": "
    "{{ c['function']['arguments'] | tojson }}}{% endfor %}\n"
    "{%- elif m['role'] == 'tool' %}<s>ipython: {{ m['content'] }}\n"
    "{%- else %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<s>assistant: {% endif %}")
# Mistral's way ([TOOL_CALLS], a special token, then a JSON array; tools before the last user turn).
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m['content'] }}[/INST]"
    "{%- elif m['role'] == 'assistant' and m.get('tool_calls') %}[TOOL_CALLS]["
    "{%- for c in m['tool_calls'] %}{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]</s>"
    "{%- elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{%- else %}{{ m['content'] }}{% endif %}{%- endfor %}")
NATIVE = {"hermes": (HERMES_TEMPLATE, ()), "llama3_json": (LLAMA3_TEMPLATE, ()),
          "mistral": (MISTRAL_TEMPLATE, ("[TOOL_CALLS]",))}


async def _served(engine):
    runner, port = await start_server(engine, ServerSettings(model_name=NAME, max_stored_responses=64), port=0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    return runner, client, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
async def default_server():
    # the default model's own Q4_1 file with its native decode step, as served for speed: these tests check the
    # protocol and the grammars on a real model's answers (test_default_model.py checks its arithmetic)
    engine = await AsyncEngine.start(make_config(model="default", quantization="gguf", compile_decode=True,
                                                 num_blocks=256, max_num_seqs=16))
    runner, client, url = await _served(engine)
    yield engine, client, url
    await client.close()
    await runner.cleanup()
    await engine.close()


def native_dir(tmp_path_factory, name: str):
    """A tiny model whose chat template writes tool calls in format `name`."""
    from transformers import AutoTokenizer

    template, special = NATIVE[name]
    path = make_checkpoint(tmp_path_factory.mktemp(f"tiny-{name}"), "llama", extra_special=special)
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory):
    return native_dir(tmp_path_factory, "hermes")


@pytest.fixture(scope="module", params=sorted(NATIVE))
async def native_server(request, tmp_path_factory):
    engine = await AsyncEngine.start(make_config(model=str(native_dir(tmp_path_factory, request.param)),
                                                 num_blocks=256, max_num_seqs=8))
    runner, client, url = await _served(engine)
    yield request.param, engine, client, url
    await client.close()
    await runner.cleanup()
    await engine.close()


def check_call(call) -> dict:
    """A returned tool call: a known function and arguments that validate against its parameter schema."""
    assert call.type == "function" and call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


# -- the formats on text of their own ---------------------------------------------------------------------------

WRITTEN = {
    "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"", "unit": '
               '"celsius"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]}',
    "hermes": 'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"", "unit": '
              '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris \\"Nord\\"", "unit": "celsius"}}; '
                   '{"name": "add", "parameters": {"a": 2, "b": 3}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris \\"Nord\\"", "unit": "celsius"}}, '
               '{"name": "add", "arguments": {"a": 2, "b": 3}}]',
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_each_format_reads_calls_whole_and_streamed(name):
    fmt, text = FORMATS[name](), WRITTEN[name]
    parsed = fmt.parse(text, final=True)
    assert [c.name for c in parsed.calls] == ["get_weather", "add"] and all(c.complete for c in parsed.calls)
    assert json.loads(parsed.calls[0].arguments) == {"city": 'Paris "Nord"', "unit": "celsius"}
    assert parsed.content == ("Checking." if name == "hermes" else "")
    for step in (1, 2, 5):  # streamed in pieces of any size: the fragments add up to the same calls
        stream, deltas = ToolStream(fmt), []
        for i in range(0, len(text), step):
            deltas += stream.feed(text[i:i + step])
        deltas += stream.feed("", final=True)
        args, names, content = {}, {}, ""
        for d in deltas:
            content += d.get("content", "")
            for c in d.get("tool_calls", []):
                if "id" in c:
                    assert c["index"] not in names, "a call's header is sent once"
                    names[c["index"]] = c["function"]["name"]
                args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
        assert names == {0: "get_weather", 1: "add"}
        assert [args[0], args[1]] == [c.arguments for c in parsed.calls]
        assert content == parsed.content


def test_text_that_only_looks_like_a_call_start_is_held_then_shown():
    stream = ToolStream(FORMATS["hermes"]())
    assert stream.feed("a <tool") == [{"content": "a "}]  # "<tool" could open a call: held back
    assert stream.feed("box> b", final=True) == [{"content": "<toolbox> b"}]


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_each_format_grammar_takes_its_calls_and_refuses_bad_arguments(name, llama_dir):
    from tieredkv.models.tokenizer import Tokenizer

    tok = Tokenizer(llama_dir)
    grammars = grammars_of(tok, len(tok.hf))
    fmt, tools = FORMATS[name](), parse_tools(TOOLS)

    def takes(text: str, choice: str, parallel: bool = True) -> bool:
        matcher = grammars.matcher(*fmt.grammar(tools, choice, parallel))
        ok = all(matcher.consume_token(t) for t in tok.hf(text, add_special_tokens=False).input_ids)
        return ok and matcher.is_accepting()

    text = WRITTEN[name]
    assert takes(text, "auto") is True
    assert takes(text, "required") is (name != "hermes")  # (required: no text before the first call)
    assert takes(text, "auto", parallel=False) is False  # two calls where one is allowed
    assert takes(text, "add") is False  # a named function: only that one
    assert takes(text.replace('"celsius"', '"kelvin"'), "auto") is False  # arguments outside their schema
    assert takes(text.replace('"b": 3', '"b": 3.5'), "auto") is False
    assert takes("Plain words.", "auto") is (name != "generic")  # (generic: the answer is JSON too)
    assert takes("Plain words.", "none") is (name != "generic")
    assert takes("Plain words.", "required") is False


def test_the_parser_is_taken_from_the_template_or_named(hermes_dir, llama_dir):
    from tieredkv.models.tokenizer import Tokenizer

    assert format_for(Tokenizer(hermes_dir)).name == "hermes"
    assert format_for(Tokenizer(llama_dir)).name == "generic"  # a template that renders no tools
    assert format_for(Tokenizer(llama_dir), "llama3_json").name == "llama3_json"
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        format_for(Tokenizer(llama_dir), "nope")


# -- chat completions with tools, on the default model (generic format) -------------------------------------------

async def test_required_and_named_tool_choice_always_give_valid_calls(default_server):
    _, client, _ = default_server
    chat = [{"role": "user", "content": "What is the weather in Paris, and what is 2 plus 3?"}]
    got = await client.chat.completions.create(model=NAME, messages=chat, tools=TOOLS, tool_choice="required",
                                               max_tokens=80)
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(check_call(c) is not None for c in choice.message.tool_calls)
    named = await client.chat.completions.create(model=NAME, messages=chat, tools=TOOLS, max_tokens=80,
                                                 tool_choice={"type": "function", "function": {"name": "add"}})
    calls = named.choices[0].message.tool_calls
    assert named.choices[0].finish_reason == "tool_calls" and len(calls) == 1 and calls[0].function.name == "add"
    check_call(calls[0])
    one = await client.chat.completions.create(model=NAME, messages=chat, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=80)
    assert len(one.choices[0].message.tool_calls) == 1
    none = await client.chat.completions.create(model=NAME, messages=chat, tools=TOOLS, tool_choice="none",
                                                max_tokens=8)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


async def test_streamed_tool_calls_add_up_to_the_whole_answer(default_server):
    _, client, _ = default_server
    chat = [{"role": "user", "content": "Weather in Rome?"}]
    kw = dict(model=NAME, messages=chat, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
              max_tokens=60)
    whole = (await client.chat.completions.create(**kw)).choices[0]
    stream = await client.chat.completions.create(**kw, stream=True)
    ids, names, args, finish, content = {}, {}, {}, None, ""
    async for event in stream:
        delta = event.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            if c.id:
                ids[c.index], names[c.index] = c.id, c.function.name
            args[c.index] = args.get(c.index, "") + (c.function.arguments or "")
        finish = event.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""
    assert names == {0: whole.message.tool_calls[0].function.name}
    assert args == {0: whole.message.tool_calls[0].function.arguments}
    assert ids[0].startswith("call_")


async def test_tool_results_go_back_and_the_history_is_served_from_cache(default_server):
    """An agent's turns 2..5: each prompt extends the last, so the prefix cache serves nearly all of it."""
    engine, client, _ = default_server
    chat = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Oslo? Then add 4 and 5."}]
    cached = []
    for turn, fn in enumerate(["get_weather", "add", "get_weather", "add", None]):
        choice = {"type": "function", "function": {"name": fn}} if fn else "none"
        got = await client.chat.completions.create(model=NAME, messages=chat, tools=TOOLS, tool_choice=choice,
                                                   max_tokens=40)
        cached.append((got.usage.prompt_tokens_details.cached_tokens, got.usage.prompt_tokens))
        message = got.choices[0].message
        if fn is None:
            assert message.content and not message.tool_calls
            break
        call = message.tool_calls[0]
        args = check_call(call)
        result = f"Cloudy, 4 degrees in {args['city']}." if fn == "get_weather" else str(args["a"] + args["b"])
        chat += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": result}]
    for (hit, total), (_, before) in zip(cached[1:4], cached[:3]):  # turns 2-4 offer the same tools
        assert hit >= (before // 16) * 16 - 16, (hit, before)  # all the last turn's full blocks, but the last
    await asyncio.sleep(0)
    check_pool_clean(engine.core)


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}},
        "required": ["x"]}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]},
     "messages"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
async def test_bad_tool_input_is_a_400_naming_the_field(default_server, body, param):
    engine, _, url = default_server
    request = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "max_tokens": 4,
               **body}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/chat/completions", json=request) as r:
            assert r.status == 400, await r.text()
            assert (await r.json())["error"]["param"] == param
        async with s.post(f"{url}/v1/completions", json={"model": NAME, "prompt": "x", "tools": TOOLS}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "tools"
    assert not engine.core.requests  # nothing was admitted


# -- the Responses API ----------------------------------------------------------------------------------------------

async def test_responses_function_round_trip_with_previous_response_id(default_server):
    _, client, url = default_server
    first = await client.responses.create(model=NAME, input="What is the weather in Lima?", tools=FLAT_TOOLS,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          instructions="Be brief.", max_output_tokens=60)
    assert first.status == "completed"
    (call,) = [i for i in first.output if i.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # instructions are not carried over from the previous response (as OpenAI's API): given again, the first
    # turn's prompt is the second's prefix
    second = await client.responses.create(model=NAME, previous_response_id=first.id, tools=FLAT_TOOLS,
                                           tool_choice="none", instructions="Be brief.", max_output_tokens=12,
                                           input=[{"type": "function_call_output", "call_id": call.call_id,
                                                   "output": "Sunny, 24 degrees."}])
    assert second.output_text and second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    await client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(second.id)
    unstored = await client.responses.create(model=NAME, input="Hi", max_output_tokens=2, store=False)
    async with aiohttp.ClientSession() as s:  # nothing kept: continuing it is a 404 naming the field
        async with s.post(f"{url}/v1/responses", json={"model": NAME, "input": "more",
                                                       "previous_response_id": unstored.id}) as r:
            assert r.status == 404 and (await r.json())["error"]["param"] == "previous_response_id"
        async with s.post(f"{url}/v1/responses", json={"model": NAME, "input": [{"type": "image"}]}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "input"
        orphan = [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]
        async with s.post(f"{url}/v1/responses", json={"model": NAME, "input": orphan}) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "input"


async def test_responses_stream_events_as_the_sdk_reads_them(default_server):
    _, client, _ = default_server
    kw = dict(model=NAME, input="Weather in Cairo?", tools=FLAT_TOOLS, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60)
    whole = await client.responses.create(**kw)
    kinds, args, done = [], "", None
    async with client.responses.stream(**kw) as stream:  # the SDK's own accumulating reader
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                args += event.delta
        done = await stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and "response.function_call_arguments.done" in kinds
    (call,) = [i for i in done.output if i.type == "function_call"]
    (want,) = [i for i in whole.output if i.type == "function_call"]
    assert (call.name, call.arguments) == (want.name, want.arguments) and args == call.arguments
    events = await client.responses.create(model=NAME, input="Say hello.", max_output_tokens=6, stream=True)
    text = [e async for e in events]
    assert text[-1].type == "response.incomplete" and text[-1].response.incomplete_details.reason == \
        "max_output_tokens"
    assert "".join(e.delta for e in text if e.type == "response.output_text.delta") == text[-1].response.output_text


# -- agent frameworks ---------------------------------------------------------------------------------------------

def _tools_log():
    """Two tools as Python functions (the frameworks make their schemas), and the log of their calls. The city is
    bounded, as a schema should be for a small model (one with random weights never ends a string)."""
    from typing import Annotated, Literal

    from pydantic import Field

    log = []

    def get_weather(city: Annotated[str, Field(max_length=30)],
                    unit: Literal["celsius", "fahrenheit"] = "celsius") -> str:
        """The current weather in a city."""
        log.append(("get_weather", city))
        return f"Sunny, 21 degrees {unit} in {city}."

    def add(a: int, b: int) -> int:
        """Adds two integers."""
        log.append(("add", a, b))
        return a + b

    return log, get_weather, add


async def test_openai_agents_sdk_runs_a_two_tool_loop_over_the_responses_api(default_server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    _, client, _ = default_server
    log, get_weather, add = _tools_log()
    agent = Agent(name="helper", instructions="You are a helpful assistant.",
                  tools=[function_tool(get_weather), function_tool(add)],
                  model=OpenAIResponsesModel(model=NAME, openai_client=client), tool_use_behavior="stop_on_first_tool")
    items, cached = "What is the weather in Paris, and what is 20 plus 22?", []
    for fn in ("get_weather", "add"):  # one tool a turn, each turn the whole history so far
        turn = agent.clone(model_settings=ModelSettings(tool_choice=fn, max_tokens=60, parallel_tool_calls=False))
        result = await Runner.run(turn, items, max_turns=2)
        cached += [r.usage.input_tokens_details.cached_tokens for r in result.raw_responses]
        items = result.to_input_list()
    final = await Runner.run(agent.clone(model_settings=ModelSettings(tool_choice="none", max_tokens=16)),
                             items + [{"role": "user", "content": "Sum it up."}], max_turns=1)
    cached += [r.usage.input_tokens_details.cached_tokens for r in final.raw_responses]
    assert [entry[0] for entry in log] == ["get_weather", "add"]
    assert isinstance(log[1][1], int) and isinstance(log[1][2], int)
    assert isinstance(final.final_output, str) and final.final_output
    assert all(c > 0 for c in cached[1:]), cached  # turns 2 and 3 find the history in the prefix cache


async def _pydantic_ai_loop(url: str, max_tokens: int = 40, report: bool = False):
    """pydantic-ai's agent loop: step 1 the weather, step 2 the sum, step 3 the answer: text, or with `report`
    its structured output tool (a model with random weights never ends text by itself)."""
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, ToolOutput
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Report(BaseModel):
        summary: str = Field(max_length=24)

    class OneToolAStep(AbstractCapability):
        def get_model_settings(self):
            plan = {1: ["get_weather"], 2: ["add"], 3: ["final_result"] if report else "none"}
            return lambda ctx: {"tool_choice": plan[ctx.run_step], "max_tokens": max_tokens,
                                "parallel_tool_calls": False}

    log, get_weather, add = _tools_log()
    agent = Agent(OpenAIChatModel(NAME, provider=OpenAIProvider(base_url=url + "/v1", api_key="unused")),
                  system_prompt="You are a helpful assistant.", tools=[get_weather, add], capabilities=[OneToolAStep()],
                  output_type=ToolOutput(Report, name="final_result") if report else str)
    result = await agent.run("What is the weather in Lyon, and what is 7 plus 8?")
    return log, result


async def test_pydantic_ai_runs_a_two_tool_loop_over_chat_completions(default_server):
    _, _, url = default_server
    log, result = await _pydantic_ai_loop(url)
    assert [entry[0] for entry in log] == ["get_weather", "add"]
    assert isinstance(result.output, str) and result.output
    assert result.usage.requests == 3


async def test_a_native_tool_format_drives_the_same_loops(native_server):
    """Tiny models whose templates write Hermes <tool_call> blocks, Llama 3 JSON, or Mistral's [TOOL_CALLS] (a
    special token, kept in the output for the parser and named by id in the grammar): calls constrained and read
    in that format, whole and streamed, and pydantic-ai's loop over them. Their weights are random: what they
    write beside the calls means nothing."""
    name, engine, client, url = native_server
    fmt = format_for(engine.tokenizer)
    assert fmt.name == name and fmt.keeps_special_tokens == (name == "mistral")
    kw = dict(model=NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS, max_tokens=200,
              parallel_tool_calls=False)
    got = await client.chat.completions.create(**kw, tool_choice="required")
    assert got.choices[0].finish_reason == "tool_calls"
    for call in got.choices[0].message.tool_calls:
        check_call(call)
        assert len(call.id) == 9 if name == "mistral" else call.id.startswith("call_")
    stream = await client.chat.completions.create(**kw, tool_choice="required", stream=True)
    args: dict[int, str] = {}
    async for event in stream:
        for c in event.choices[0].delta.tool_calls or []:
            args[c.index] = args.get(c.index, "") + (c.function.arguments or "")
    assert list(args.values()) == [c.function.arguments for c in got.choices[0].message.tool_calls]
    auto = await client.chat.completions.create(**kw)
    for call in auto.choices[0].message.tool_calls or []:  # in auto, whatever it calls is still valid
        check_call(call)
    none = await client.chat.completions.create(**{**kw, "max_tokens": 12}, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    log, result = await _pydantic_ai_loop(url, max_tokens=200, report=True)  # (512 tokens: more tokens a call)
    assert [entry[0] for entry in log] == ["get_weather", "add"]
    assert result.usage.requests == 3 and len(result.output.summary) <= 24
    await asyncio.sleep(0)
    check_pool_clean(engine.core)


# -- structured output that closes ------------------------------------------------------------------------------

def _random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "bounded integer", "number", "string", "short string", "boolean", "enum", "array"]
    if depth < 2:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        return {"type": "integer"}
    if kind == "bounded integer":
        low = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 5000)}
    if kind == "number":
        return {"type": "number"}
    if kind == "string":
        return {"type": "string"}
    if kind == "short string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, None, True], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": _random_schema(rng, depth + 1), "maxItems": rng.randint(1, 4)}
    props = {f"f{i}": _random_schema(rng, depth + 1) for i in range(rng.randint(1, 4))}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


async def test_json_schema_fuzz_every_answer_validates_or_says_it_was_cut(default_server):
    _, client, _ = default_server
    rng = random.Random(54)
    schemas = [_random_schema(rng) for _ in range(24)]
    prompts = ["Describe a city as JSON.", "Give me data about a cat.", "A JSON record of a book, please."]

    async def one(i: int, schema: dict):
        got = await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompts[i % len(prompts)]}], max_tokens=8 + 6 * (i % 8),
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})
        return schema, got.choices[0]

    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(schemas)))
    closed = 0
    for schema, choice in results:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
            closed += 1
            assert "incomplete_details" not in (choice.model_extra or {})
        else:
            assert choice.finish_reason == "length"
            assert choice.model_extra["incomplete_details"]["reason"] == "length"
    assert closed >= len(schemas) // 3, closed  # most small schemas fit the tokens asked for


async def test_a_chat_with_tools_from_python(default_server, hermes_dir):
    """`Chat(messages, tools)` is a prompt of its own: the template renders the tools; a message that is neither
    text nor an assistant's calls is refused before anything runs."""
    from tieredkv import Chat, RequestError, SamplingParams
    from tieredkv.models.tokenizer import Tokenizer

    tok = Tokenizer(hermes_dir)
    text = tok.hf.decode(tok.to_token_ids(Chat([{"role": "user", "content": "hi"}], TOOLS)))
    assert "get_weather" in text and "<tool_call>" in text
    engine, _, _ = default_server
    out = await engine.generate(Chat([{"role": "user", "content": "hi"}], TOOLS), SamplingParams(max_tokens=2))
    assert out.usage.prompt_tokens > 0
    with pytest.raises(RequestError, match="message 1"):
        engine.stream(Chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]))
