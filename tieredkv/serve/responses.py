"""OpenAI's Responses API (`POST /v1/responses`) over the same engine and tool formats as chat completions:
input items (messages, function calls and their outputs) turned into chat messages, the output into message and
function_call items, whole or as the SDK's stream of typed events, and stored responses that a later request
continues with `previous_response_id` (the conversation kept here; its KV is what the prefix cache holds)."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tieredkv.models.tokenizer import message_chars
from tieredkv.serve.protocol import BadRequest, text_content
from tieredkv.serve.tools import ToolFormat, ToolStream

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, instructions left out (they are not carried over)
    chars: int


class ResponseStore:
    """Responses kept for `previous_response_id` and GET, at most `max_items` and `max_chars` of conversation
    in all; the least recently used go first."""

    def __init__(self, max_items: int, max_chars: int):
        self.max_items, self.max_chars = max_items, max_chars
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            got = self._items.get(rid)
            if got is not None:
                self._items.move_to_end(rid)
            return got

    def put(self, rid: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = message_chars(conversation)
        if self.max_items <= 0 or chars > self.max_chars:
            return
        with self._lock:
            self._items[rid] = Stored(response, conversation, chars)
            self._chars += chars
            while len(self._items) > self.max_items or self._chars > self.max_chars:
                _, old = self._items.popitem(last=False)
                self._chars -= old.chars

    def delete(self, rid: str) -> bool:
        with self._lock:
            old = self._items.pop(rid, None)
            if old is not None:
                self._chars -= old.chars
            return old is not None


def input_messages(raw: Any) -> list[dict[str, Any]]:
    """The Responses API's `input` (a string, or a list of items) as chat messages: message items by role
    (developer as system), function_call items as an assistant's tool_calls (consecutive ones, and the assistant
    message before them, in one message), function_call_output items as tool messages."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("input must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise BadRequest(f"input[{i}].role must be user, system, developer or assistant", "input")
            content = text_content(item.get("content"), f"input[{i}].content", "input", _TEXT_PARTS)
            if content is None:
                raise BadRequest(f"input[{i}].content must be a string or text parts", "input")
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            name, args, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) for v in (name, args, call_id)):
                raise BadRequest(f"input[{i}]: a function_call needs name, arguments and call_id strings", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = text_content(output, f"input[{i}].output", "input", _TEXT_PARTS)
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise BadRequest(f"input[{i}]: a function_call_output needs call_id and output strings", "input")
            out.append({"role": "tool", "content": output, "tool_call_id": item["call_id"]})
        elif kind == "reasoning":
            continue  # a model without reasoning items: another model's are not shown to this one
        else:
            raise BadRequest(f"input[{i}]: items of type {kind!r} are not supported", "input")
    for m in out:
        if m["role"] == "assistant" and m.get("tool_calls") and m["content"] == "":
            m["content"] = None
    return out


def conversation_of(body: dict[str, Any], store: ResponseStore) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the messages the model is shown, the conversation to keep): the stored conversation of
    previous_response_id, then the new input; instructions (not kept) as the first system message."""
    prior: list[dict[str, Any]] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise BadRequest(f"previous_response_id {previous!r}: no stored response has this id (responses made "
                             "with store: false, or dropped for room, are not kept)", "previous_response_id",
                             status=404, code="not_found")
        prior = [dict(m) for m in stored.conversation]
    conversation = prior + input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", "instructions")
    shown = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    return shown, conversation


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The Responses request's sampling fields under chat completions' names (one sample, no logprobs)."""
    out = {k: body[k] for k in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                                "presence_penalty", "frequency_penalty") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.get("name"),
                                                                         "schema": fmt.get("schema")}}
    elif fmt is not None:
        out["response_format"] = fmt
    return out


class ResponseBuilder:
    """One response's output items, built as the text comes (whole or as stream events)."""

    def __init__(self, rid: str, model: str, body: dict[str, Any], fmt: ToolFormat | None, tools: list[dict]):
        self.rid, self.model, self.body, self.fmt = rid, model, body, fmt
        self.tools = tools
        self.created = int(time.time())
        self.text, self.finish, self.usage = "", None, None
        self.seq = 0
        self.final: dict[str, Any] | None = None  # the response once the output ended
        self.items: list[dict[str, Any]] = []  # the output items in order, as far as written
        self._message: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # the ToolStream's call index -> its item
        self._stream = ToolStream(fmt) if fmt is not None else None

    def response(self, status: str) -> dict[str, Any]:
        b = self.body
        incomplete = None
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens" if self.finish == "length" else self.finish}
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": [dict(i) for i in self.items] if status != "in_progress" else [],
                "error": None, "incomplete_details": incomplete, "instructions": b.get("instructions"),
                "metadata": b.get("metadata") or {}, "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "temperature": b.get("temperature"), "top_p": b.get("top_p"),
                "max_output_tokens": b.get("max_output_tokens"), "previous_response_id": b.get("previous_response_id"),
                "tool_choice": b.get("tool_choice", "auto"), "tools": self.tools,
                "text": b.get("text") or {"format": {"type": "text"}}, "truncation": "disabled",
                "store": b.get("store", True) is not False, "usage": self._usage()}

    def _usage(self) -> dict[str, Any] | None:
        if self.usage is None:
            return None
        u = self.usage
        return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
                "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    @property
    def status(self) -> str:
        return "completed" if self.finish == "stop" else "incomplete"

    def assistant_message(self) -> dict[str, Any]:
        """The output as the chat message a later turn is shown."""
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        msg: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        return msg

    # -- the events, as the text comes --------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        first = self.response("in_progress")
        return [self._event("response.created", response=first), self._event("response.in_progress", response=first)]

    def add(self, chunk) -> list[dict[str, Any]]:
        """The events a chunk of output makes (its text, and its end)."""
        events: list[dict[str, Any]] = []
        final = chunk.finish_reason is not None
        self.text += chunk.text
        if self._stream is None:
            deltas = [{"content": chunk.text}] if chunk.text else []
        else:
            deltas = self._stream.feed(chunk.text, final=final)
        for d in deltas:
            if "content" in d:
                events.extend(self._text_delta(d["content"]))
            for c in d.get("tool_calls", []):
                events.extend(self._call_delta(c))
        if final:
            self.finish, self.usage = chunk.finish_reason, chunk.usage
            events.extend(self._close())
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message = {"type": "message", "id": item_id("msg"), "status": "in_progress", "role": "assistant",
                             "content": []}
            self.items.append(self._message)
            index = len(self.items) - 1
            added = dict(self._message, content=[])
            events.append(self._event("response.output_item.added", output_index=index, item=added))
            self._message["content"] = [{"type": "output_text", "text": "", "annotations": []}]
            events.append(self._event("response.content_part.added", item_id=self._message["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self._message["content"][0]["text"] += text
        events.append(self._event("response.output_text.delta", item_id=self._message["id"],
                                  output_index=self.items.index(self._message), content_index=0, delta=text,
                                  logprobs=[]))
        return events

    def _call_delta(self, c: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        item = self._calls.get(c["index"])
        if item is None:
            item = {"type": "function_call", "id": item_id("fc"), "call_id": c["id"], "name": c["function"]["name"],
                    "arguments": "", "status": "in_progress"}
            self._calls[c["index"]] = item
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=dict(item)))
        frag = c["function"].get("arguments") or ""
        if frag:
            item["arguments"] += frag
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=frag))
        return events

    def _close(self) -> list[dict[str, Any]]:
        events = []
        done = self.finish == "stop"
        complete_calls = {i: c for i, c in enumerate(self._stream.calls)} if self._stream is not None else {}
        for index, item in enumerate(list(self.items)):
            if item["type"] == "message":
                item["status"] = "completed" if done else "incomplete"
                part = item["content"][0]
                events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                          content_index=0, text=part["text"], logprobs=[]))
                events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                          content_index=0, part=dict(part)))
            else:
                call = next((c for c in complete_calls.values() if c.id == item["call_id"]), None)
                item["status"] = "completed" if call is not None and call.complete else "incomplete"
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, arguments=item["arguments"], name=item["name"]))
            events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        if self.items and not done:  # a call cut before it closed is not handed on to be run
            self.items = [i for i in self.items if i["type"] == "message" or i["status"] == "completed"]
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        self.final = self.response(self.status)
        events.append(self._event(kind, response=self.final))
        return events
