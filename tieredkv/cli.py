"""Command line (`tieredkv ...` or `python -m tieredkv ...`): demo, generate, chat, serve, plan, explain,
cache inspect|clear|export|import, bench. Every command has --help. Commands that start an engine take
every EngineConfig field as an option (`--block-size 32`, `--warm-bytes 2GiB`, `--no-offload`: generated
from the pydantic model, tools/config_flags.py), or from the environment as TIEREDKV_<FIELD>; options win."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from importlib.resources import files

from pydantic import ValidationError

from tieredkv.config import SamplingParams
from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.errors import TieredKVError
from tieredkv.tools.cli_tools import add_parsers
from tieredkv.tools.config_flags import add_engine_options, engine_config, flag

DEMO_QUESTIONS = [
    "How long does it take to charge the Volt battery, and how should I store it over winter?",
    "I want to return a helmet I wore once. Is that possible?",
]


async def _stream_answer(engine: AsyncEngine, messages, params: SamplingParams) -> None:
    t0 = time.perf_counter()
    first = None
    async for chunk in engine.stream(messages, params):
        if first is None:
            first = time.perf_counter() - t0
        print(chunk.text, end="", flush=True)
        if chunk.usage is not None:
            u = chunk.usage
            elapsed = time.perf_counter() - t0
            print(f"\n\n[{u.cached_prompt_tokens:,} of {u.prompt_tokens:,} prompt tokens served from cache; "
                  f"first token after {first:.2f} s; {u.completion_tokens} tokens in {elapsed:.2f} s]\n")


async def demo(args: argparse.Namespace) -> None:
    system = files("tieredkv").joinpath("data/demo_system_prompt.txt").read_text()
    config = engine_config(args)
    print(f"starting tieredkv on model={config.model!r} (on CPU the first start on a machine also compiles "
          "the batch-1 decode graph, in the background: about two minutes, while answers stream at about half "
          "speed; later starts load it)...", flush=True)
    t0 = time.perf_counter()
    async with await AsyncEngine.start(config) as engine:
        info = engine.info
        print(f"{Path(info.model_dir).name}: {info.dtype} on {info.device}, {info.num_blocks} KV blocks "
              f"of {info.block_size} tokens, ready in {time.perf_counter() - t0:.1f} s\n")
        params = SamplingParams(max_tokens=args.max_tokens)
        for question in DEMO_QUESTIONS:
            print(f">>> {question}\n")
            await _stream_answer(engine, [{"role": "system", "content": system},
                                          {"role": "user", "content": question}], params)
        s = engine.stats()
        print(f"prefix cache: {s.prefix_cache_hits:,} of {s.prefix_cache_queries:,} prompt tokens hit; "
              f"{s.blocks_cached} blocks cached of {s.blocks_total}")


async def generate(args: argparse.Namespace) -> None:
    async with await AsyncEngine.start(engine_config(args)) as engine:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        await _stream_answer(engine, prompt, params)


async def serve(args: argparse.Namespace) -> None:
    try:
        from tieredkv.serve import ServerSettings, install_prometheus, serve_until_signal
    except ImportError:
        sys.exit("tieredkv serve needs the serve extra: pip install 'tieredkv[serve]'")
    metrics = install_prometheus()
    config = engine_config(args)
    settings = ServerSettings(model_name=args.served_model_name or config.model,
                              api_key=args.api_key or os.environ.get("TIEREDKV_API_KEY"),
                              max_queued=args.max_queued, metrics=metrics, write_timeout=args.write_timeout,
                              shutdown_grace=args.shutdown_grace, tool_call_parser=args.tool_call_parser,
                              max_stored_responses=args.max_stored_responses, load_format=args.load_format,
                              kv_transfer_timeout=args.kv_transfer_timeout,
                              disaggregation_mode=args.disaggregation_mode,
                              require_cache_salt=args.require_cache_salt)

    def ready(port: int) -> None:
        print(f"serving {settings.model_name!r} on http://{args.host}:{port}/v1"
              f"{' (metrics on /metrics)' if metrics else ''}", flush=True)

    async with await AsyncEngine.start(config) as engine:
        await serve_until_signal(engine, settings, args.host, args.port, ready)
    print("stopped", flush=True)


class _StderrHandler(logging.StreamHandler):
    """Writes each record to whatever sys.stderr is when it comes."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _) -> None:
        pass


def _show_engine_log() -> None:
    """The engine's INFO lines (start-up, one-time work and its progress, shutdown) on stderr, once."""
    logger = logging.getLogger("tieredkv")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("tieredkv: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tieredkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="stream two answers that share a long system prompt")
    p.add_argument("--max-tokens", type=int, default=96)
    add_engine_options(p)
    p.set_defaults(func=demo)
    p = sub.add_parser("generate", help="stream one answer")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", dest="chat", action="store_false", help="no chat template")
    add_engine_options(p)
    p.set_defaults(func=generate)
    _add_serve(sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)"))
    add_parsers(sub)
    return parser


def _add_serve(p: argparse.ArgumentParser) -> None:
    """The serve command's options."""
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to listen on; 0.0.0.0 for every interface (in a container, say)")
    p.add_argument("--port", type=int, default=8000, help="the port to listen on (default: 8000; 0: any free one)")
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` (or TIEREDKV_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--max-queued", type=int, default=256,
                   help="requests waiting beyond that get HTTP 429 (default: 256)")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a streaming client may read nothing before its request is aborted "
                   "(default: 30)")
    p.add_argument("--tool-call-parser", default="auto",
                   choices=("auto", "generic", "hermes", "llama3_json", "mistral"),
                   help="how the model writes tool calls (vLLM's names); auto: the chat template's own format, "
                   "or generic (one JSON object, tools described in the system turn) where it renders no tools")
    p.add_argument("--max-stored-responses", type=int, default=1024,
                   help="Responses API objects kept for previous_response_id (oldest dropped first; 0: none)")
    p.add_argument("--load-format", default="vllm", choices=("vllm", "sglang"),
                   help="the shape GET /get_load answers in: vllm-router's {\"load\": N} or sglang-router's list "
                   "per rank (a request's ?format= chooses for itself)")
    p.add_argument("--kv-transfer-timeout", type=float, default=5.0,
                   help="a prefill/decode split (vllm-router --vllm-pd-disaggregation, KV through the shared tier): "
                   "seconds the prefill replica waits for its blocks to reach the shared tier before it answers, "
                   "and the decode replica for them before it computes what is missing (default: 5)")
    p.add_argument("--disaggregation-mode", default="null", choices=("null", "prefill", "decode"),
                   help="this replica's part behind sglang-router --pd-disaggregation (SGLang's flag; the KV goes "
                   "through the shared tier, --remote): prefill computes and writes the prompt through, decode waits "
                   "for it; null serves requests whole (default)")
    p.add_argument("--require-cache-salt", action="store_true",
                   help="refuse completion requests without a cache_salt: on a server tenants share, cached blocks "
                   "are then shared only within a tenant (see the LoRA and tenants guide)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds running requests have to finish before the server stops "
                   "(default: 30)")
    add_engine_options(p)
    p.set_defaults(func=serve)


def main(argv: list[str] | None = None) -> None:
    _show_engine_log()
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    except KeyboardInterrupt:
        sys.exit(130)
    except ValidationError as e:  # a bad option or TIEREDKV_<FIELD> value: one line per field, no traceback
        sys.exit("\n".join(f"tieredkv {args.command}: {flag(str(err['loc'][0])) if err['loc'] else 'config'}: "
                           f"{err['msg']}" for err in e.errors()))
    except (TieredKVError, FileNotFoundError) as e:  # the engine could not start (model, checkpoint, files)
        sys.exit(f"tieredkv {args.command}: {e}")


def run() -> None:
    """The `tieredkv` command and `python -m tieredkv`: main(), then an exit without the interpreter's teardown
    (platform/process.py: every engine main started is closed by then), with main's exit status."""
    from tieredkv.platform.process import exit_without_teardown

    try:
        main()
    except SystemExit as e:  # what sys.exit gives: None or a number is the status, anything else goes to stderr
        if e.code is None or isinstance(e.code, int):
            exit_without_teardown(e.code or 0)
        print(e.code, file=sys.stderr)
        exit_without_teardown(1)
    exit_without_teardown(0)
