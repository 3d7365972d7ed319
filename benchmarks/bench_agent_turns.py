"""An agent's turns over the OpenAI-compatible server, with and without the prefix cache: how much of each turn's
prompt (tools, history, tool results) is served from cache, and the time to each turn's answer.

Each turn forces one tool call (alternating two tools), sends the result back, and the last turn answers in text,
as an agent loop does. Both engines run in this process one after the other, on the same machine.

    .venv/bin/python benchmarks/bench_agent_turns.py [--turns 5] [--model default] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time

import openai

from tieredkv import AsyncEngine, EngineConfig, SamplingParams
from tieredkv.serve import ServerSettings, start_server

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"],
           "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Adds two integers.", "parameters": ADD}}]
SYSTEM = ("You are a careful assistant for a travel company. Use the tools to look up what you do not know, "
          "and keep answers short. ") * 6


async def run_turns(model: str, turns: int, prefix_caching: bool) -> list[dict]:
    # the eager forward in both (no decode graph compiling beside the first engine), and one request first that
    # shares nothing with the turns, so that neither engine's first turn pays for warming up
    engine = await AsyncEngine.start(EngineConfig(model=model, enable_prefix_caching=prefix_caching,
                                                  compile_decode=False))
    await engine.generate("Warm up: name a colour.", SamplingParams(max_tokens=8))
    runner, port = await start_server(engine, ServerSettings(model_name="m"), port=0)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    chat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the weather in Oslo and in Lima, and what is 4 plus 5?"}]
    rows = []
    try:
        for turn in range(turns):
            last = turn == turns - 1
            fn = TOOLS[turn % 2]["function"]["name"]
            choice = "none" if last else {"type": "function", "function": {"name": fn}}
            t0 = time.perf_counter()
            got = await client.chat.completions.create(model="m", messages=chat, tools=TOOLS, tool_choice=choice,
                                                       max_tokens=24 if last else 48)
            seconds = time.perf_counter() - t0
            u = got.usage
            rows.append({"turn": turn + 1, "prompt_tokens": u.prompt_tokens,
                         "cached_tokens": u.prompt_tokens_details.cached_tokens,
                         "output_tokens": u.completion_tokens, "seconds": round(seconds, 3)})
            if last:
                break
            call = got.choices[0].message.tool_calls[0]
            args = json.loads(call.function.arguments)
            result = f"Cloudy, 4 degrees in {args['city']}." if fn == "get_weather" else str(args["a"] + args["b"])
            chat += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    finally:
        await client.close()
        await runner.cleanup()
        await engine.close()
    return rows


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--model", default="default")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cached = await run_turns(args.model, args.turns, True)
    plain = await run_turns(args.model, args.turns, False)
    print(f"machine: {_cpu_name()}; model {args.model}")
    print("turn  prompt  cached (share)   s with cache   s without   ratio")
    for a, b in zip(cached, plain):
        share = a["cached_tokens"] / a["prompt_tokens"]
        print(f"{a['turn']:>4}  {a['prompt_tokens']:>6}  {a['cached_tokens']:>6} ({share:5.1%})"
              f"   {a['seconds']:>12.3f}   {b['seconds']:>9.3f}   {b['seconds'] / a['seconds']:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "with_prefix_cache": cached, "without": plain}, f, indent=1)


if __name__ == "__main__":
    asyncio.run(main())
