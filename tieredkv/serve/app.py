"""An OpenAI-compatible HTTP server over one AsyncEngine, built on aiohttp.

aiohttp because it is one asyncio-native package that is both the server and (in the tests and the
benchmark) a raw client, with streamed responses and disconnect-driven cancellation built in; FastAPI
would add Starlette, uvicorn and a second validation layer next to the engine's pydantic models.

One engine serves every connection. A client that goes away cancels its handler, which leaves the
request's `async with engine.stream(...)`, so the request is aborted and its blocks freed at once.
Limits a public endpoint needs: body size, prompt size (before tokenizing), requests waiting beyond
what runs (429 with Retry-After), and an optional API key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any, Sequence

from aiohttp import web

from tieredkv.config import SamplingParams
from tieredkv.engine.async_engine import AsyncEngine
from tieredkv.engine.outputs import Usage
from tieredkv.errors import EngineClosedError, LoRAError, RequestError, TieredKVError
from tieredkv.models.tokenizer import message_chars
from tieredkv.serve import disagg
from tieredkv.serve.protocol import (BadRequest, cache_breakpoints, chat_logprobs, chat_messages,
                                     completion_logprobs, completion_prompt, envelope, new_id, prompt_cache_key,
                                     sampling_params, stream_flags, usage_body)
from tieredkv.serve.responses import ResponseBuilder, ResponseStore, chat_body, conversation_of
from tieredkv.serve.tools import (Call, ToolError, ToolFormat, ToolStream, check_tool_messages, format_for,
                                  new_call_id, parse_tool_choice, parse_tools)

log = logging.getLogger("tieredkv")
access_log = logging.getLogger("tieredkv.access")  # one line per request (INFO; /health and /metrics at DEBUG)


@dataclass(frozen=True)
class ServerSettings:
    """The server's own settings (the engine's are its `EngineConfig`); `tieredkv serve` sets each from an option.

    Attributes:
        model_name: the name `/v1/models` lists and requests' `model` must give (`--served-model-name`).
        api_key: when set, every request needs `Authorization: Bearer <key>` (401 without it).
        max_body_bytes: the largest request body (413 beyond it).
        max_prompt_chars: characters over every field a prompt or the chat template renders, checked before
            tokenizing (400 beyond it).
        max_queued: requests allowed to wait beyond the engine's `max_num_seqs`; more get 429 with
            `Retry-After: 1`.
        metrics: serve `GET /metrics` (the prometheus extra, after `telemetry.install_prometheus()`).
        write_timeout: seconds a stream may wait for its client to read; then it is aborted and its blocks freed.
        shutdown_grace: on SIGTERM or SIGINT, seconds running requests have to finish.
        tool_call_parser: how the model writes tool calls (`--tool-call-parser`, vLLM's names): "auto" takes
            the chat template's own format ("hermes", "llama3_json", "mistral"), or "generic" where the template
            renders no tools.
        max_stored_responses: Responses API objects kept for `previous_response_id` and GET (oldest dropped
            first); `store: false` keeps none.
        max_stored_chars: characters those stored conversations may take in all (oldest dropped first).
        load_format: the shape `GET /get_load` answers in (`--load-format`): "vllm" (`{"load": N}`, what
            vllm-router reads) or "sglang" (a list of `{dp_rank, num_reqs, num_waiting_reqs, num_tokens}`, what
            sglang-router reads); a request's `?format=` chooses for itself.
        kv_transfer_timeout: seconds a prefill/decode split waits for the KV to reach the shared tier: the prefill
            replica before it answers, the decode replica before it computes what has not arrived (serve/disagg.py).
        require_cache_salt: every completion request must carry a `cache_salt` (`--require-cache-salt`): on a
            server that tenants share, none can learn from cached tokens or timing what another one sent.
        disaggregation_mode: this replica's part in sglang-router's prefill/decode pairs (`--disaggregation-mode`,
            SGLang's flag): "prefill", "decode", or "null" (requests with bootstrap fields are served whole).
    """

    model_name: str = "default"
    api_key: str | None = None
    max_body_bytes: int = 8 << 20
    max_prompt_chars: int = 1 << 20  # checked before tokenizing
    max_queued: int = 256  # requests allowed to wait beyond the engine's max_num_seqs; more get 429
    metrics: bool = False  # GET /metrics (needs the prometheus extra and telemetry.install_prometheus())
    write_timeout: float = 30.0  # seconds a stream may wait for its client to read; then it is aborted
    shutdown_grace: float = 30.0  # on SIGTERM/SIGINT: seconds running requests have to finish
    tool_call_parser: str = "auto"
    max_stored_responses: int = 1024
    max_stored_chars: int = 16 << 20
    load_format: str = "vllm"
    kv_transfer_timeout: float = 5.0
    disaggregation_mode: str = "null"
    require_cache_salt: bool = False


_ENGINE = web.AppKey("engine", AsyncEngine)
_SETTINGS = web.AppKey("settings", ServerSettings)
_ACTIVE = web.AppKey("active", list)
_DRAINING = web.AppKey("draining", list)
_TOOLS = web.AppKey("tools", ToolFormat)
_STORE = web.AppKey("responses", ResponseStore)
_SERVED = web.RequestKey("output", object)  # the request's _Output, for the access log
_GONE = web.RequestKey("gone", bool)  # the client closed its connection before the response was written


def create_app(engine: AsyncEngine, settings: ServerSettings | None = None) -> web.Application:
    """The aiohttp application that serves `engine` with OpenAI's API: chat and text completions, models,
    health, vLLM's tokenize and detokenize, and `/metrics` when `settings.metrics`. Run it with
    `start_server` or `serve_until_signal`, or mount it in an aiohttp program of your own."""
    settings = settings or ServerSettings()
    app = web.Application(middlewares=[_access, _errors, _draining, _auth], client_max_size=settings.max_body_bytes)
    app[_ENGINE], app[_SETTINGS], app[_ACTIVE], app[_DRAINING] = engine, settings, [0], [False]
    app[_TOOLS] = format_for(engine.tokenizer, settings.tool_call_parser)
    app[_STORE] = ResponseStore(settings.max_stored_responses, settings.max_stored_chars)
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/load_lora_adapter", _load_lora)
    app.router.add_post("/v1/unload_lora_adapter", _unload_lora)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/responses", _responses)
    app.router.add_get("/v1/responses/{id}", _get_response)
    app.router.add_delete("/v1/responses/{id}", _delete_response)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    # what the routers people run in front of replicas call (vllm-router, sglang-router), in their shapes
    app.router.add_post("/v1/chat/completions/render", _render_chat)
    app.router.add_post("/v1/completions/render", _render_completion)
    app.router.add_get("/health_generate", _health_generate)
    app.router.add_get("/get_load", _get_load)
    app.router.add_get("/load", _load)
    for path in ("/get_server_info", "/server_info"):
        app.router.add_get(path, _server_info)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, _model_info)
    for path in ("/flush_cache", "/reset_prefix_cache"):
        app.router.add_post(path, _flush_cache)
    app.router.add_post("/sleep", _sleep)
    app.router.add_post("/wake_up", _wake_up)
    app.router.add_get("/is_sleeping", _is_sleeping)
    if settings.metrics:
        app.router.add_get("/metrics", _metrics)
    return app


@web.middleware
async def _access(request: web.Request, handler):
    """The access log: method, path, status, then for a completion its prompt, cached and output tokens
    and time to first token, and the duration. 499: the client went away first."""
    t0, status = time.perf_counter(), 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except asyncio.CancelledError:
        status = 499
        raise
    finally:
        if request.get(_GONE):
            status = 499
        out: _Output | None = request.get(_SERVED)
        tokens = "" if out is None else out.log_fields(t0)
        level = logging.DEBUG if request.path in _POLLED else logging.INFO
        access_log.log(level, "%s %s %d%s %.3fs", request.method, request.path, status, tokens,
                       time.perf_counter() - t0)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as e:
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[_SETTINGS].max_body_bytes
        return web.json_response(BadRequest(f"the request body is larger than {limit} bytes", status=413).body(),
                                 status=413)
    except RequestError as e:
        return web.json_response(BadRequest(str(e), e.param).body(), status=400)
    except EngineClosedError as e:
        return web.json_response(BadRequest(str(e), status=503, type_="server_error").body(), status=503)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        # the router's 404 and 405, and the like: the same JSON error body as every other failure
        allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
        error = BadRequest(f"{request.method} {request.path}: {e.reason}", status=e.status,
                           type_="invalid_request_error" if e.status < 500 else "server_error",
                           code="not_found" if e.status == 404 else None)
        return web.json_response(error.body(), status=e.status, headers=allow)
    except asyncio.CancelledError:
        raise
    except ConnectionError:  # the client closed its connection while the response was written: nobody to answer
        request[_GONE] = True
        return web.Response(status=499)
    except TieredKVError as e:  # a failure of the request's own computation, or of the step it was in
        return web.json_response(BadRequest(str(e), status=500, type_="server_error").body(), status=500)
    except Exception:
        log.exception("request failed")
        return web.json_response(BadRequest("internal error", status=500, type_="server_error").body(), status=500)


@web.middleware
async def _draining(request: web.Request, handler):
    """While the server shuts down: /health fails, so a load balancer stops sending, and new requests get
    503 with Retry-After; the running ones go on."""
    if request.app[_DRAINING][0]:
        if request.path == "/health":
            return web.json_response({"status": "draining"}, status=503)
        raise BadRequest("the server is shutting down", status=503, type_="server_error",
                         headers={"Retry-After": "1"})
    return await handler(request)


# Open without the API key: liveness, and the load routers poll (vllm-router and sglang-router send no key on
# their load checks, as vLLM and SGLang guard only their API); numbers only, nothing a request carried.
_OPEN = frozenset({"/health", "/get_load", "/load"})
_POLLED = _OPEN | {"/metrics"}  # logged at DEBUG: load balancers and routers call them every few seconds


@web.middleware
async def _auth(request: web.Request, handler):
    key = request.app[_SETTINGS].api_key
    if key is not None and request.path not in _OPEN:
        given = request.headers.get("Authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise BadRequest("invalid or missing API key", status=401, type_="authentication_error",
                             code="invalid_api_key")
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    """200 while the engine serves; asleep it still serves (the next request wakes it), and says so."""
    level = request.app[_ENGINE].stats().sleep_level
    return web.json_response({"status": "ok", **({"sleeping": True, "sleep_level": level} if level else {})})


async def _sleep(request: web.Request) -> web.Response:
    """vLLM's POST /sleep?level=1|2: the engine gives its memory back until the next request or /wake_up."""
    try:
        level = int(request.query.get("level", "1"))
    except ValueError:
        raise BadRequest("level must be 1 or 2", "level") from None
    released = await request.app[_ENGINE].sleep(level)
    return web.json_response({"status": "ok", **released})


async def _wake_up(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", **await request.app[_ENGINE].wake()})


async def _is_sleeping(request: web.Request) -> web.Response:
    return web.json_response({"is_sleeping": request.app[_ENGINE].stats().sleep_level > 0})


def _model_card(name: str, parent: str | None = None, root: str | None = None) -> dict[str, Any]:
    """A /v1/models entry; a LoRA adapter's names its base model (`parent`) and its folder (`root`), as vLLM's."""
    card = {"id": name, "object": "model", "created": 0, "owned_by": "tieredkv"}
    return card if parent is None else {**card, "parent": parent, "root": root}


def _cards(request: web.Request) -> dict[str, dict[str, Any]]:
    """The base model's card and each loaded LoRA adapter's, by name."""
    name, engine = request.app[_SETTINGS].model_name, request.app[_ENGINE]
    return {name: _model_card(name), **{a: _model_card(a, name, engine.adapter_path(a)) for a in engine.adapters()}}


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": list(_cards(request).values())})


async def _model(request: web.Request) -> web.Response:
    """GET /v1/models/{model}: the served model or one of its adapters, or a 404 naming what is served."""
    cards, asked = _cards(request), request.match_info["model"]
    if asked not in cards:
        raise BadRequest(f"model {asked!r} is not served here; this server serves {', '.join(map(repr, cards))}",
                         "model", status=404, code="model_not_found")
    return web.json_response(cards[asked])


def _adapter(request: web.Request, body: dict[str, Any]) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model)."""
    model = body.get("model")
    return None if model in (None, request.app[_SETTINGS].model_name) else model


async def _load_lora(request: web.Request) -> web.Response:
    """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: serves the adapter from the next request on."""
    body = await _body(request)
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str):
        raise BadRequest("lora_name and lora_path must be strings", "lora_name" if not isinstance(name, str)
                         else "lora_path")
    try:
        await request.app[_ENGINE].load_adapter(name, path)
    except LoRAError as e:
        raise BadRequest(str(e), "lora_path") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def _unload_lora(request: web.Request) -> web.Response:
    """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: stops serving it (running requests finish with it)."""
    body = await _body(request)
    name = body.get("lora_name")
    if not isinstance(name, str):
        raise BadRequest("lora_name must be a string", "lora_name")
    try:
        await request.app[_ENGINE].unload_adapter(name)
    except LoRAError as e:
        raise BadRequest(str(e), "lora_name", status=404, code="model_not_found") from None
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def _metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _body(request: web.Request) -> dict[str, Any]:
    if request.content_length is not None and request.content_length > request.app[_SETTINGS].max_body_bytes:
        raise web.HTTPRequestEntityTooLarge(max_size=request.app[_SETTINGS].max_body_bytes,
                                            actual_size=request.content_length)
    try:
        body = json.loads(await request.read())
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None
    except ValueError as e:  # not JSON, not UTF-8, or an integer past Python's digit limit
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    name, engine = request.app[_SETTINGS].model_name, request.app[_ENGINE]
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise BadRequest("model must be a string", "model")
    if body.get("model") not in (None, name) and body.get("model") not in engine.adapters():
        served = ", ".join(map(repr, [name, *engine.adapters()]))
        raise BadRequest(f"model {body.get('model')!r} is not served here; this server serves {served}", "model",
                         status=404, code="model_not_found")
    return body


async def _tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: {"prompt": str} or {"messages": [...]} (chat template applied) -> the token ids, their
    count and max_model_len. Tokenized on the engine's tokenizer thread."""
    body = await _body(request)
    prompt = chat_messages(body) if "messages" in body else completion_prompt(body)
    _check_size(request, message_chars(prompt) if "messages" in body else len(prompt))
    engine = request.app[_ENGINE]
    try:
        ids = await engine.tokenize(prompt, check=False)
    except (ValueError, UnicodeError) as e:
        raise BadRequest(f"cannot tokenize the prompt: {e}", "messages" if "messages" in body else "prompt") from None
    return web.json_response({"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_model_len})


async def _detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens": [ids]} -> {"prompt": text}; ids outside the vocabulary are a 400."""
    body = await _body(request)
    ids, vocab = body.get("tokens"), request.app[_ENGINE].info.vocab_size
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                            for t in ids):
        raise BadRequest(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
    text = await asyncio.to_thread(request.app[_ENGINE].tokenizer.decode, ids, False)
    return web.json_response({"prompt": text})


async def _render_chat(request: web.Request) -> web.Response:
    """vLLM's render: the chat as the model is shown it (template, tools) and its token ids, without running it."""
    body = await _body(request)
    messages = chat_messages(body)
    _check_size(request, message_chars([messages, body.get("tools") or []]))
    prompt, _, _ = _with_tools(request, messages, body.get("tools"), body.get("tool_choice"),
                               body.get("parallel_tool_calls"))
    return await _rendered(request, prompt)


async def _render_completion(request: web.Request) -> web.Response:
    body = await _body(request)
    prompt = completion_prompt(body)
    _check_size(request, len(prompt))
    return await _rendered(request, prompt)


async def _rendered(request: web.Request, prompt) -> web.Response:
    engine = request.app[_ENGINE]
    ids = await engine.tokenize(prompt)
    text = await asyncio.to_thread(engine.tokenizer.decode, ids, False)
    return web.json_response({"model": request.app[_SETTINGS].model_name, "token_ids": ids, "prompt": text,
                              "num_tokens": len(ids), "features": None})


async def _health_generate(request: web.Request) -> web.Response:
    """Healthy only if the engine computes: one token of a one-token prompt."""
    engine = request.app[_ENGINE]
    try:
        await asyncio.wait_for(engine.generate([engine.tokenizer.eos_token_id or 0],
                                               SamplingParams(max_tokens=1, ignore_eos=True)), 30)
    except (asyncio.TimeoutError, TieredKVError) as e:
        raise BadRequest(f"the engine did not generate: {e or 'timed out'}", status=503, type_="server_error")
    return web.json_response({"status": "ok"})


def _load_now(engine: AsyncEngine) -> dict[str, int]:
    s = engine.stats()
    return {"running": s.num_running, "waiting": s.num_waiting,
            "tokens": s.blocks_used * engine.info.block_size}


async def _get_load(request: web.Request) -> web.Response:
    """The load in the shape the router asks for: vllm-router's `{"load": N}` or sglang-router's list per rank."""
    shape = request.query.get("format", request.app[_SETTINGS].load_format)
    if shape not in ("vllm", "sglang"):
        raise BadRequest('format must be "vllm" or "sglang"', "format")
    load = _load_now(request.app[_ENGINE])
    if shape == "sglang":
        return web.json_response([{"dp_rank": 0, "num_reqs": load["running"] + load["waiting"],
                                   "num_waiting_reqs": load["waiting"], "num_tokens": load["tokens"]}])
    return web.json_response({"load": load["running"] + load["waiting"]})


async def _load(request: web.Request) -> web.Response:
    """vLLM's /load: the requests being served."""
    load = _load_now(request.app[_ENGINE])
    return web.json_response({"server_load": load["running"] + load["waiting"]})


def _info(request: web.Request) -> dict[str, Any]:
    from tieredkv import __version__

    engine, settings = request.app[_ENGINE], request.app[_SETTINGS]
    info = engine.info
    config = info.config
    return {"engine": "tieredkv", "version": __version__, "served_model_name": settings.model_name,
            "model_path": config.model, "tokenizer_path": config.model, "is_generation": True,
            "max_model_len": info.max_model_len, "block_size": config.block_size,
            "page_size": config.block_size, "max_num_seqs": config.max_num_seqs, "dp_size": 1,
            "kv_cache_dtype": config.kv_cache_dtype, "num_blocks": engine.stats().blocks_total}


async def _server_info(request: web.Request) -> web.Response:
    """Both routers' server info: sglang's flat fields and vLLM's `vllm_config` (model, block size) as JSON."""
    info = _info(request)
    info["vllm_config"] = {"model_config": {"model": info["served_model_name"],
                                            "max_model_len": info["max_model_len"]},
                           "cache_config": {"block_size": info["block_size"], "num_gpu_blocks": info["num_blocks"]},
                           "scheduler_config": {"max_num_seqs": info["max_num_seqs"]}}
    return web.json_response(info)


async def _model_info(request: web.Request) -> web.Response:
    info = _info(request)
    return web.json_response({k: info[k] for k in ("model_path", "tokenizer_path", "is_generation",
                                                   "served_model_name", "max_model_len")})


async def _flush_cache(request: web.Request) -> web.Response:
    """Empties the prefix cache of the hot and warm tiers (cached blocks no request holds; those in use stay)."""
    engine = request.app[_ENGINE]
    removed = await engine.clear_cache("hot") + await engine.clear_cache("warm")
    return web.json_response({"status": "ok", "blocks_removed": removed})


def _check_size(request: web.Request, chars: int) -> None:
    limit = request.app[_SETTINGS].max_prompt_chars
    if chars > limit:
        raise BadRequest(f"the prompt has {chars:,} characters; this server takes at most {limit:,}", "prompt")


async def _chat(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    messages = chat_messages(body)
    _check_size(request, message_chars([messages, body.get("tools") or []]))  # roles too: the template renders them
    tool_fields = (body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
    prompt, fmt, constraint = _with_tools(request, messages, *tool_fields)
    keep = []  # (the prompt up to each cache_control mark, its time to live)
    for mark in cache_breakpoints(body):
        part = messages[: mark.message + 1]
        if mark.parts is not None:
            content = body["messages"][mark.message]["content"][: mark.parts]
            part[-1] = {**part[-1], "content": "".join(p.get("text", "") for p in content)}
        try:
            keep.append((_with_tools(request, part, *tool_fields)[0], mark.ttl))
        except BadRequest:  # a cut the tool rules refuse (a call without its result): nothing to keep there
            continue
    return await _serve(request, body, prompt, chat=True, fmt=fmt, constraint=constraint, keep=keep)


def _with_tools(request: web.Request, messages: list[dict[str, Any]], tools_field: Any, choice_field: Any,
                parallel: Any, messages_param: str = "messages"):
    """(the prompt, the tool format when the model may call tools, the constraint its calls follow)."""
    try:
        tools = parse_tools(tools_field)
        choice = parse_tool_choice(choice_field, tools)
        if parallel is not None and not isinstance(parallel, bool):
            raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        if not tools and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return messages, None, None
        check_tool_messages(messages, messages_param)
    except ToolError as e:
        raise BadRequest(str(e), e.param) from None
    fmt = request.app[_TOOLS]
    # tools are shown under "none" too (the grammar then keeps calls out), so every turn shares one prefix
    constraint = fmt.grammar(tools, choice, parallel is not False)
    if constraint is not None:  # a parameter schema the grammar engine refuses (one by one: in a choice of
        from tieredkv.engine.grammar import grammars_of  # several, one that cannot be met would just drop out)

        engine = request.app[_ENGINE]
        grammars = grammars_of(engine.tokenizer, engine.info.vocab_size)
        for tool in tools:
            try:
                grammars.grammar("json_schema", tool.parameters)
            except RequestError as e:
                raise BadRequest(f"tools: the parameters of {tool.name!r} cannot be used as a schema: {e}",
                                 "tools") from None
        grammars.grammar(*constraint)
    return fmt.chat(messages, tools), (fmt if tools else None), constraint


async def _responses(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses: OpenAI's Responses API (serve/responses.py), one output, tools as in chat."""
    body = await _body(request)
    settings, engine = request.app[_SETTINGS], request.app[_ENGINE]
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise BadRequest("store must be true or false", "store")
    shown, conversation = conversation_of(body, request.app[_STORE])
    _check_size(request, message_chars([shown, body.get("tools") or []]))
    prompt, fmt, constraint = _with_tools(request, shown, body.get("tools"), body.get("tool_choice"),
                                          body.get("parallel_tool_calls"), "input")
    fields = chat_body(body)
    params = sampling_params(fields, True, constraint, skip_special_tokens=not (fmt and fmt.keeps_special_tokens))
    streaming = body.get("stream", False)
    if not isinstance(streaming, bool):
        raise BadRequest("stream must be true or false", "stream")
    rid = new_id("resp").replace("-", "_")
    adapter = _adapter(request, body)
    out = _Output(rid, adapter or settings.model_name, True, 1, engine)  # (the access log's counts)
    request[_SERVED] = out
    builder = ResponseBuilder(rid, adapter or settings.model_name, body, fmt, body.get("tools") or [])

    def keep() -> None:  # once the output ended
        if store:
            request.app[_STORE].put(rid, builder.final, conversation + [builder.assistant_message()])

    with _admitted(request):
        engine.precheck(prompt, params)
        ids = await engine.tokenize(prompt)
        _check_room(engine, len(ids), params, fields)
        async with engine.stream(ids, params, request_id=rid, adapter=adapter,
                                 cache_salt=_salt(request, body)) as stream:
            first = await stream.__anext__()
            if streaming:
                return await _response_events(request, builder, _chain(first, stream), out, keep)
            async for chunk in _chain(first, stream):
                out.add(chunk)
                builder.add(chunk)
            keep()
            return web.json_response(builder.final)


def _response_events(request, builder: ResponseBuilder, chunks, out: "_Output", keep):
    """The Responses API's stream: `event: <type>` and its JSON for each event, as the SDK reads them."""

    def encoded(events: list[dict[str, Any]]) -> bytes:
        return b"".join(f"event: {e['type']}\n".encode() + _event(e) for e in events)

    async def events():
        yield encoded(builder.start())
        async for chunk in chunks:
            out.add(chunk)
            yield encoded(builder.add(chunk))
        keep()

    def failed(message: str) -> bytes:
        response = builder.response("failed")
        response["error"] = {"code": "server_error", "message": message}
        return encoded([builder._event("response.failed", response=response)])

    return _sse(request, out.rid, events(), failed)


async def _get_response(request: web.Request) -> web.Response:
    stored = request.app[_STORE].get(request.match_info["id"])
    if stored is None:
        raise BadRequest(f"no stored response has the id {request.match_info['id']!r}", "id", status=404,
                         code="not_found")
    return web.json_response(stored.response)


async def _delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    if not request.app[_STORE].delete(rid):
        raise BadRequest(f"no stored response has the id {rid!r}", "id", status=404, code="not_found")
    return web.json_response({"id": rid, "object": "response", "deleted": True})


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await _body(request)
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if body.get(name) is not None:
            raise BadRequest(f"{name} is for chat completions and responses, not text completions", name)
    prompt = completion_prompt(body)
    _check_size(request, len(prompt))
    return await _serve(request, body, prompt, chat=False)


def _check_room(engine: AsyncEngine, num_prompt_tokens: int, params, body: dict[str, Any]) -> None:
    """A max_tokens (or max_completion_tokens) the request set that the context cannot hold is a 400
    naming the numbers, as vLLM answers; left unset, generation stops at the context's end."""
    field = next((f for f in ("max_completion_tokens", "max_tokens") if body.get(f) is not None), None)
    limit = engine.info.max_model_len
    if field is not None and num_prompt_tokens + params.max_tokens > limit:
        raise BadRequest(f"this model's context holds {limit} tokens and the prompt takes {num_prompt_tokens}, so "
                         f"at most {limit - num_prompt_tokens} can be generated; {field} asks for "
                         f"{params.max_tokens}", field)


@contextlib.contextmanager
def _admitted(request: web.Request):
    """Counts the requests being served; beyond what runs plus max_queued, a 429 with Retry-After."""
    active, engine = request.app[_ACTIVE], request.app[_ENGINE]
    if active[0] >= engine.info.config.max_num_seqs + request.app[_SETTINGS].max_queued:
        raise BadRequest("the server is busy; retry shortly", status=429, type_="rate_limit_error",
                         headers={"Retry-After": "1"})
    active[0] += 1
    try:
        yield
    finally:
        active[0] -= 1


async def _serve(request: web.Request, body: dict[str, Any], prompt, chat: bool, fmt: ToolFormat | None = None,
                 constraint=None, keep: Sequence[tuple[Any, float]] = ()) -> web.StreamResponse:
    engine, settings = request.app[_ENGINE], request.app[_SETTINGS]
    params = sampling_params(body, chat, constraint, skip_special_tokens=not (fmt and fmt.keeps_special_tokens))
    streaming, include_usage = stream_flags(body)
    transfer = disagg.transfer_params(body)
    rid = new_id("chatcmpl" if chat else "cmpl")
    adapter, salt = _adapter(request, body), _salt(request, body)
    marked = prompt_cache_key(body) is not None
    out = _Output(rid, adapter or settings.model_name, chat, params.n, engine, fmt, params.constraint is not None)
    request[_SERVED] = out
    with _admitted(request):
        engine.precheck(prompt, params)  # before tokenizing: what a prompt's size alone rules out
        ids = await engine.tokenize(prompt)
        _check_room(engine, len(ids), params, body)
        pins = await _pins(engine, ids, keep, salt, adapter) if keep else None
        chain = {"adapter": adapter, "cache_salt": salt}  # (what seeds the request's block hashes)
        if transfer is not None:  # a decode replica: the prefill replica's blocks first
            await disagg.before_decode(engine, ids, transfer, settings.kv_transfer_timeout, chain)
        elif disagg.bootstrapped(body) and settings.disaggregation_mode == "prefill":  # sglang-router's pairs
            await disagg.prefill_for_pair(engine, ids, settings.kv_transfer_timeout, chain)
            params = params.model_copy(update={"max_tokens": 1, "min_tokens": 0})
        elif disagg.bootstrapped(body) and settings.disaggregation_mode == "decode":
            await disagg.decode_for_pair(engine, ids, settings.kv_transfer_timeout, chain)
        async with engine.stream(ids, params, request_id=rid, keep=pins, mark_prompt=marked, **chain) as stream:
            first = await stream.__anext__()  # a request refused once tokenized is still a clean 400
            if streaming:
                return await _stream_events(request, stream, first, out, include_usage)
            async for chunk in _chain(first, stream):
                out.add(chunk)
        whole = out.whole()
        if transfer is not None and transfer.get("do_remote_decode"):  # a prefill replica: leave the KV for decode
            whole[disagg.FIELD] = await disagg.after_prefill(engine, ids, settings.kv_transfer_timeout, chain)
        return web.json_response(whole)


async def _pins(engine: AsyncEngine, ids: list[int], keep: Sequence[tuple[Any, float]], salt: str | None,
                adapter: str | None) -> list[tuple[int, float]]:
    """The prefixes of `ids` that cache_control marks end (each mark's prompt tokenized: where it agrees with the
    whole prompt), with their times to live; a 400 when pinning them would pass the pinned budget or the client's
    share (RequestError)."""
    out = []
    for prompt, ttl in keep:
        part = await engine.tokenize(prompt, check=False)
        n = next((i for i, (a, b) in enumerate(zip(part, ids)) if a != b), min(len(part), len(ids)))
        if n >= engine.info.block_size:
            out.append((n, ttl))
    if out:
        await engine.check_pin(ids[: max(n for n, _ in out)], salt, adapter)
    return out


def _salt(request: web.Request, body: dict[str, Any]) -> str | None:
    """vLLM's `cache_salt`: the request shares cached blocks only with requests of the same salt."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise BadRequest("cache_salt must be a non-empty string", "cache_salt")
    if salt is None and request.app[_SETTINGS].require_cache_salt:
        raise BadRequest("this server requires a cache_salt in every request (one per tenant)", "cache_salt")
    return salt


async def _chain(first, stream):
    yield first
    async for chunk in stream:
        yield chunk


def _stream_events(request, stream, first, out: "_Output", include_usage: bool):
    """Chat and text completions' stream: a `data:` event per chunk, usage last when asked for, then [DONE]."""

    def usage_and_done() -> bytes:
        usage = b""
        if include_usage and out.usages:
            usage = _event({**out.envelope(out.kind + ".chunk" if out.chat else out.kind), "choices": [],
                            "usage": usage_body(out.usages)})
        return usage + b"data: [DONE]\n\n"

    async def events():
        async for chunk in _chain(first, stream):
            yield _event(out.chunk(chunk))
        yield usage_and_done()

    def failed(message: str) -> bytes:
        return _event(BadRequest(message, status=500, type_="server_error").body()) + usage_and_done()

    return _sse(request, out.rid, events(), failed)


async def _sse(request: web.Request, rid: str, events, failed) -> web.StreamResponse:
    """Writes the bytes `events` yields as server-sent events, each write bounded by write_timeout. When `events`
    raises (the status line is gone), `failed(message)` is written instead, then the body ends. A client that reads
    nothing for write_timeout is dropped; one that went away ends the request (leaving here aborts it)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    timeout = request.app[_SETTINGS].write_timeout

    async def send(data: bytes | None) -> None:  # None: the end of the body
        if data is None:
            await asyncio.wait_for(response.write_eof(), timeout)
        elif data:
            await asyncio.wait_for(response.write(data), timeout)

    try:
        try:
            async for data in events:
                await send(data)
        except (asyncio.TimeoutError, ConnectionError):
            raise
        except Exception as e:  # report the error as an event, then end the stream
            if not isinstance(e, TieredKVError):
                log.exception("request %s failed while streaming", rid)
            await send(failed(str(e) if isinstance(e, TieredKVError) else "internal error"))
        await send(None)
    except asyncio.TimeoutError:  # the client stopped reading: drop it, and the request with it
        log.warning("request %s: the client read nothing for %.0f s; the stream was aborted", rid, timeout)
        if request.transport is not None:
            request.transport.abort()
    except ConnectionError:  # the client went away mid-write: leaving here aborts the request
        request[_GONE] = True
        log.debug("request %s: the client closed its connection", rid)
    return response


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class _Output:
    """Accumulates one request's chunks into OpenAI objects: the whole response or stream chunks."""

    def __init__(self, rid: str, model: str, chat: bool, n: int, engine: AsyncEngine, fmt: ToolFormat | None = None,
                 constrained: bool = False):
        self.rid, self.model, self.chat = rid, model, chat
        self.fmt, self.constrained = fmt, constrained
        self.tool_streams = [ToolStream(fmt) for _ in range(n)] if fmt is not None else None
        self.created = int(time.time())  # one value for the whole response, every stream chunk included
        self.first_token_at: float | None = None  # perf_counter
        self.kind = "chat.completion" if chat else "text_completion"
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.logprobs: list[list | None] = [None] * n
        self.finish: list[str | None] = [None] * n
        self.offsets = [0] * n
        self.role_sent = [False] * n
        self.usages: list[Usage] = []
        tokenizer = engine.tokenizer
        self.decode = lambda t: tokenizer.decode([t], skip_special_tokens=False)

    def log_fields(self, t0: float) -> str:
        """The access log's token counts and TTFT (from t0) for this response, as far as it went."""
        ttft = "-" if self.first_token_at is None else f"{self.first_token_at - t0:.3f}s"
        if not self.usages:
            return f" {self.rid} ttft={ttft}"
        u = usage_body(self.usages)
        return (f" {self.rid} prompt={u['prompt_tokens']} cached={u['prompt_tokens_details']['cached_tokens']} "
                f"output={u['completion_tokens']} ttft={ttft}")

    def _seen(self, chunk) -> None:
        if self.first_token_at is None and chunk.token_ids:
            self.first_token_at = time.perf_counter()

    def add(self, chunk) -> None:
        self._seen(chunk)
        i = chunk.index
        self.texts[i].append(chunk.text)
        if chunk.logprobs is not None:
            self.logprobs[i] = (self.logprobs[i] or []) + chunk.logprobs
        if chunk.finish_reason is not None:
            self.finish[i] = chunk.finish_reason
            self.usages.append(chunk.usage)

    def _logprobs(self, logprobs, i: int) -> dict | None:
        if self.chat:
            return chat_logprobs(logprobs, self.decode)
        return completion_logprobs(logprobs, self.decode, self.offsets[i])

    def whole(self) -> dict[str, Any]:
        choices = []
        for i, parts in enumerate(self.texts):
            text = "".join(parts)
            choice = {"index": i, "logprobs": self._logprobs(self.logprobs[i], i), "finish_reason": self.finish[i]}
            if not self.chat:
                choice["text"] = text
            elif self.fmt is None:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                parsed = self.fmt.parse(text, final=True)
                calls = [c for c in parsed.calls if c.complete]
                message: dict[str, Any] = {"role": "assistant", "content": parsed.content
                                           if parsed.content.strip() or not calls else None}
                if calls:
                    message["tool_calls"] = [_tool_call(c, new_call_id(self.fmt)) for c in calls]
                choice["message"] = message
                choice["finish_reason"] = _finish_with_calls(self.finish[i], calls)
            choice.update(self._incomplete(i))
            choices.append(choice)
        return {**self.envelope(self.kind), "choices": choices, "usage": usage_body(self.usages)}

    def _incomplete(self, i: int) -> dict[str, Any]:
        """Structured output (a schema, or tool calls) cut before its document closed: said in so many words."""
        if not self.constrained or self.finish[i] in (None, "stop"):
            return {}
        return {"incomplete_details": {"reason": self.finish[i], "structured_output": "incomplete: the output "
                                       "ended before its JSON document (or tool call) closed"}}

    def envelope(self, kind: str) -> dict[str, Any]:
        return envelope(kind, self.rid, self.model, self.created)

    def chunk(self, chunk) -> dict[str, Any]:
        self._seen(chunk)
        i = chunk.index
        if chunk.finish_reason is not None:
            self.usages.append(chunk.usage)
        if chunk.finish_reason is not None:
            self.finish[i] = chunk.finish_reason
        choice = {"index": i, "logprobs": self._logprobs(chunk.logprobs, i), "finish_reason": chunk.finish_reason}
        if self.chat:
            delta = {"content": chunk.text}
            if self.tool_streams is not None:  # content and call deltas as the calls are written
                stream = self.tool_streams[i]
                delta = {}
                for d in stream.feed(chunk.text, final=chunk.finish_reason is not None):
                    if "content" in d:
                        delta["content"] = delta.get("content", "") + d["content"]
                    else:
                        delta.setdefault("tool_calls", []).extend(d["tool_calls"])
                if chunk.finish_reason is not None:
                    choice["finish_reason"] = _finish_with_calls(chunk.finish_reason,
                                                                 [c for c in stream.calls if c.complete])
            if not self.role_sent[i]:
                delta, self.role_sent[i] = {"role": "assistant", **delta}, True
            choice["delta"] = delta
            if chunk.finish_reason is not None:
                choice.update(self._incomplete(i))
            kind = self.kind + ".chunk"
        else:
            choice["text"] = chunk.text
            kind = self.kind
        self.offsets[i] += len(chunk.text)
        return {**self.envelope(kind), "choices": [choice]}


def _tool_call(call: Call, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish_with_calls(finish: str | None, calls: list[Call]) -> str | None:
    """OpenAI's finish_reason: "tool_calls" when the output ended by itself with calls in it."""
    return "tool_calls" if calls and finish == "stop" else finish


async def serve_until_signal(engine: AsyncEngine, settings: ServerSettings, host: str = "127.0.0.1",
                             port: int = 8000, on_ready=None) -> None:
    """Serves until SIGTERM or SIGINT, then shuts down gracefully: new requests get 503 and /health fails,
    the running ones have settings.shutdown_grace seconds to finish, the rest end with a final error
    event (or a 503), the engine closes (writing its cached blocks to the cold tier) and the server
    stops. `on_ready(port)` is called once it listens. A second signal acts as it would without this."""
    loop = asyncio.get_running_loop()
    runner, port = await start_server(engine, settings, host, port)
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        if on_ready is not None:
            on_ready(port)
        await stop.wait()
        for sig in signals:
            loop.remove_signal_handler(sig)
        runner.app[_DRAINING][0] = True
        log.info("shutting down: %d requests in flight get up to %.0f s", runner.app[_ACTIVE][0],
                 settings.shutdown_grace)
        await engine.close(grace=settings.shutdown_grace)
    finally:
        await runner.cleanup()


class _Http2Probes(logging.Filter):
    """sglang-router probes every replica for gRPC (HTTP/2 with prior knowledge) as it joins, beside HTTP; aiohttp
    answers the HTTP/2 preface with a 400 and logs it as an error with a traceback. It is one DEBUG line here."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "PRI/Upgrade" not in str(error):
            return True
        log.debug("refused an HTTP/2 connection (a router's gRPC probe): this server speaks HTTP/1.1")
        return False


_HTTP2_PROBES = _Http2Probes()


async def start_server(engine: AsyncEngine, settings: ServerSettings, host: str = "127.0.0.1",
                       port: int = 8000) -> tuple[web.AppRunner, int]:
    """Serves `engine` on host:port (0: any free port) until `await runner.cleanup()`; returns the port."""
    logging.getLogger("aiohttp.server").addFilter(_HTTP2_PROBES)  # (once: a filter is added once)
    runner = web.AppRunner(create_app(engine, settings), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
