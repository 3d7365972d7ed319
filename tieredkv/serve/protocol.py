"""OpenAI's request and response shapes: requests parsed into a prompt and SamplingParams (a bad field is a
400 naming it), engine output turned into chat.completion / text_completion objects and chunks."""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

from pydantic import ValidationError

from tieredkv.config import SamplingParams
from tieredkv.engine.outputs import TokenLogprob, Usage

# Parameters passed to SamplingParams as they are; the last five are extensions (as vLLM accepts them).
_PASSED = ("temperature", "top_p", "n", "stop", "seed", "presence_penalty", "frequency_penalty",
           "top_k", "min_p", "min_tokens", "repetition_penalty", "ignore_eos", "speculative")
_UNSUPPORTED = ("functions", "function_call", "suffix", "audio", "modalities")


class BadRequest(Exception):
    """An OpenAI-shaped error: HTTP status, message, the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type_, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bias_and_logprobs(body: dict[str, Any], chat: bool, kw: dict[str, Any], names: dict[str, str]) -> None:
    """logit_bias (token ids as the JSON object's keys) and logprobs (chat: a flag and top_logprobs; completions:
    a count) into `kw`."""
    if body.get("logit_bias") is not None:
        bias = body["logit_bias"]
        if not isinstance(bias, dict):
            raise BadRequest("logit_bias must map token ids to numbers", "logit_bias")
        try:
            kw["logit_bias"] = {int(t): b for t, b in bias.items()}
        except (TypeError, ValueError):
            raise BadRequest("logit_bias keys must be token ids", "logit_bias") from None
    if chat:
        if body.get("top_logprobs") is not None and not body.get("logprobs"):
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        if body.get("logprobs"):
            kw["logprobs"] = body.get("top_logprobs") or 0
            names["logprobs"] = "top_logprobs"
    elif body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]


def sampling_params(body: dict[str, Any], chat: bool, constraint: tuple[str, Any] | None = None,
                    skip_special_tokens: bool = True) -> SamplingParams:
    """The request's SamplingParams; `constraint` ("json_schema" or "grammar", source): what its tools demand."""
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise BadRequest(f"{name} is not supported by this server", name)
    if body.get("echo"):
        raise BadRequest("echo is not supported by this server", "echo")
    kw: dict[str, Any] = {k: body[k] for k in _PASSED if body.get(k) is not None}
    if not skip_special_tokens:
        kw["skip_special_tokens"] = False
    schema = _response_schema(body.get("response_format"))
    names: dict[str, str] = {}  # SamplingParams field -> the request's name for it, for error messages
    if schema is not None and constraint is not None:
        raise BadRequest("response_format cannot be combined with tools: their calls follow a grammar of their "
                         "own", "response_format")
    if schema is not None:
        kw["json_schema"] = schema
        names = {"json_schema": "response_format"}
    elif constraint is not None:
        kw[constraint[0]] = constraint[1]
        names = {constraint[0]: "tools"}
    for name in ("max_completion_tokens", "max_tokens"):
        if body.get(name) is not None:
            kw.setdefault("max_tokens", body[name])
            names.setdefault("max_tokens", name)
    kw.update(_beam_fields(body))
    names["beam_width"] = "best_of"
    _bias_and_logprobs(body, chat, kw, names)
    try:
        return SamplingParams(**kw)
    except ValidationError as e:
        err = e.errors()[0]
        field = str(err["loc"][0]) if err["loc"] else None
        param = names.get(field, field)
        raise BadRequest(f"{param}: {err['msg']}" if param else err["msg"], param) from None


def _response_schema(fmt: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as a JSON schema: {"type": "json_object"} is any JSON object;
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} is that schema; "text" is none."""
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format json_schema needs json_schema.schema, an object", "response_format")
        return schema
    raise BadRequest('response_format type must be "text", "json_object" or "json_schema"', "response_format")


def _beam_fields(body: dict[str, Any]) -> dict[str, Any]:
    """Beam search as vLLM's clients ask for it: use_beam_search with best_of beams (default n), and
    length_penalty / early_stopping; best_of without beam search (sample and keep the best) is refused."""
    use, best_of = body.get("use_beam_search"), body.get("best_of")
    if use is not None and not isinstance(use, bool):
        raise BadRequest("use_beam_search must be true or false", "use_beam_search")
    if best_of is not None and (not isinstance(best_of, int) or isinstance(best_of, bool) or best_of < 1):
        raise BadRequest("best_of must be a positive integer", "best_of")
    n = body.get("n") if isinstance(body.get("n"), int) else 1
    if not use:
        if best_of is not None and best_of > n:
            raise BadRequest("best_of above n needs use_beam_search: true (sampling best_of and keeping the n most "
                             "likely is not supported)", "best_of")
        return {}
    kw: dict[str, Any] = {"beam_width": best_of or n}
    kw.update({k: body[k] for k in ("length_penalty", "early_stopping") if body.get(k) is not None})
    return kw


def stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage), checked before anything runs."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    if options is None:
        return bool(stream), False
    if not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", "stream_options")
    if not stream:
        raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise BadRequest("stream_options.include_usage must be true or false", "stream_options")
    return True, usage


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages as the engine takes them: role and text content; an assistant's tool_calls (content may then
    be null) and a tool message's tool_call_id kept (serve/tools.py renders them)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string role", "messages")
        content = text_content(m.get("content"), f"messages[{i}].content", "messages", ("text",))
        calls = m.get("tool_calls")
        if content is None and not calls:
            raise BadRequest(f"messages[{i}].content must be a string or text parts", "messages")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise BadRequest(f"messages[{i}].tool_calls: only an assistant message carries a list of calls",
                                 "messages")
            msg["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": c.get("function")}
                                 if isinstance(c, dict) else c for c in calls]
        if m["role"] == "tool":
            msg["tool_call_id"] = m.get("tool_call_id")
        out.append(msg)
    return out


def text_content(content: Any, where: str, param: str, kinds: tuple[str, ...]) -> str | None:
    """A message's content as one string: a string as it is, text parts (of the given types) joined; None as
    None; anything else a 400 naming `param`."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadRequest(f"{where}: only a string or text parts ({', '.join(kinds)}) are supported", param)


CACHE_TTLS = {"5m": 300.0, "1h": 3600.0}  # Anthropic's cache_control lifetimes


class Breakpoint(NamedTuple):
    """A `cache_control` mark: the prompt up to the end of messages[message] (of its first `parts` text parts,
    when its content is a list) is to be kept for `ttl` seconds."""

    message: int
    parts: int | None
    ttl: float


def cache_breakpoints(body: dict[str, Any]) -> list[Breakpoint]:
    """Anthropic-style `cache_control` marks on messages or on their text parts ({"type": "ephemeral", "ttl":
    "5m" | "1h"}, ttl "5m" when left out), in prompt order; a malformed one is a 400."""
    out = []
    for i, m in enumerate(body.get("messages") or []):
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("cache_control") is not None:
                out.append(Breakpoint(i, j + 1, _ttl(part["cache_control"], f"messages[{i}].content[{j}]")))
        if m.get("cache_control") is not None:
            out.append(Breakpoint(i, None, _ttl(m["cache_control"], f"messages[{i}]")))
    return out


def _ttl(mark: Any, where: str) -> float:
    if not isinstance(mark, dict) or mark.get("type") != "ephemeral":
        raise BadRequest(f'{where}.cache_control must be {{"type": "ephemeral"}} with an optional "ttl" of '
                         f'{" or ".join(map(repr, CACHE_TTLS))}', "messages")
    ttl = mark.get("ttl", "5m")
    if ttl not in CACHE_TTLS:
        raise BadRequest(f"{where}.cache_control.ttl must be one of {', '.join(map(repr, CACHE_TTLS))}; got {ttl!r}",
                         "messages")
    return CACHE_TTLS[ttl]


def prompt_cache_key(body: dict[str, Any]) -> str | None:
    """OpenAI's `prompt_cache_key`: requests that share one share a prefix; a string or nothing."""
    key = body.get("prompt_cache_key")
    if key is not None and (not isinstance(key, str) or not key):
        raise BadRequest("prompt_cache_key must be a non-empty string", "prompt_cache_key")
    return key


def completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        return prompt
    raise BadRequest("prompt must be one string or one list of token ids", "prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_body(usages: list[Usage]) -> dict[str, Any]:
    """OpenAI's usage; cached prompt tokens in its own field, their split by tier as an extension."""
    first = usages[0]
    completion = sum(u.completion_tokens for u in usages)
    body: dict[str, Any] = {"prompt_tokens": first.prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.cached_prompt_tokens,
                                      "cached_tokens_by_tier": dict(first.cached_tokens_by_tier)}}
    if first.cache_decision is not None:
        body["prompt_tokens_details"]["cache_decision"] = first.cache_decision
    last = usages[-1]  # speculative decoding's counts are the request's, as of its last sample's end
    if last.draft_tokens:  # OpenAI's names for predicted tokens that were (not) used
        body["completion_tokens_details"] = {"accepted_prediction_tokens": last.accepted_draft_tokens,
                                             "rejected_prediction_tokens": last.draft_tokens
                                             - last.accepted_draft_tokens}
    return body


def chat_logprobs(logprobs: list[TokenLogprob] | None, decode) -> dict[str, Any] | None:
    if logprobs is None:
        return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


def completion_logprobs(logprobs: list[TokenLogprob] | None, decode, offset: int) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    tokens = [decode(lp.token_id) for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{decode(t): v for t, v in lp.top} for lp in logprobs], "text_offset": offsets}


def envelope(kind: str, rid: str, model: str, created: int) -> dict[str, Any]:
    return {"id": rid, "object": kind, "created": created, "model": model}
