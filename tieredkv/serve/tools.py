"""Tool calling: the tools a request offers rendered into the prompt, the model's calls constrained by a grammar
and parsed back into OpenAI's `tool_calls`, whole or streamed.

A format is how one family of models writes a call. Where the model's chat template renders tools (transformers'
`apply_chat_template(tools=...)`), the template's own format is used: Hermes/Qwen `<tool_call>` JSON blocks, Llama
3.x JSON objects with "parameters", Mistral's `[TOOL_CALLS]` array, named as vLLM's `--tool-call-parser` names
them. A template that renders no tools gets the generic format, as llama.cpp's server does: the tools described in
the system turn and the whole answer one JSON object, `{"tool_calls": [...]}` or `{"response": "..."}`.

Every call is constrained by a grammar (engine/grammar.py, llguidance): a function's arguments always validate
against its parameter schema, `tool_choice` "required" or a named function forces a call, "auto" lets the model
write text or calls (in the native formats, text that never starts a call outside the grammar), "none" leaves the
output free. The JSON layout is json.dumps's (", " and ": "), so a call the client sends back renders as the
model wrote it and the agent's next turn finds its history in the prefix cache."""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any

from tieredkv.engine.grammar import JSON_LAYOUT, bounded
from tieredkv.models.tokenizer import Chat

NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
PARSERS = ("auto", "generic", "hermes", "llama3_json", "mistral")


class ToolError(ValueError):
    """A request's tools, tool_choice or tool messages are malformed; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    def as_openai(self) -> dict[str, Any]:  # the shape chat templates take (transformers' tools=...)
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass
class Call:
    name: str
    arguments: str  # the JSON text the model wrote (a prefix while it is still being written)
    complete: bool = True
    id: str = ""


@dataclass
class Parsed:
    content: str
    calls: list[Call]


def parse_tools(raw: Any, param: str = "tools") -> list[Tool]:
    """OpenAI's tools, in chat's shape ({"type": "function", "function": {...}}) or the Responses API's flat one
    ({"type": "function", "name": ...}); a ToolError naming `param` for anything else."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolError(f"{param} must be a list of tools", param)
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise ToolError(f'{param}[{i}]: only tools of type "function" are supported', param)
        fn = t.get("function", t)
        if not isinstance(fn, dict):
            raise ToolError(f"{param}[{i}].function must be an object", param)
        name, params = fn.get("name"), fn.get("parameters")
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{param}[{i}]: the function's name must be 1-64 letters, digits, '_', '.' or '-'", param)
        if any(x.name == name for x in tools):
            raise ToolError(f"{param}[{i}]: the function name {name!r} is given twice", param)
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError(f"{param}[{i}].parameters must be a JSON schema of type object", param)
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise ToolError(f"{param}[{i}].description must be a string", param)
        tools.append(Tool(name, description, params))
    return tools


def parse_tool_choice(raw: Any, tools: list[Tool], param: str = "tool_choice") -> str:
    """"none", "auto", "required", or the name of the one function the model must call."""
    if raw is None:
        return "auto" if tools else "none"
    if raw in ("none", "auto", "required"):
        if raw == "required" and not tools:
            raise ToolError('tool_choice "required" needs tools', param)
        return raw
    if isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw.get("function", raw)
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise ToolError("tool_choice names no function", param)
        if not any(t.name == name for t in tools):
            raise ToolError(f"tool_choice names the function {name!r}, which is not among the tools", param)
        return name
    raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}', param)


def one_call(choice: str, parallel: bool) -> bool:
    """Whether the output holds at most one call: parallel calls turned off, or one named function forced."""
    return not parallel or choice not in ("auto", "required")


def chosen(tools: list[Tool], choice: str) -> list[Tool]:
    """The tools the model may call under `choice`."""
    if choice == "none":
        return []
    if choice in ("auto", "required"):
        return tools
    return [t for t in tools if t.name == choice]


def new_call_id(fmt) -> str:
    if fmt.name == "mistral":  # Mistral's templates take ids of exactly nine letters and digits
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


# --- JSON text, read as it is written ---------------------------------------------------------------------------

def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value that starts at text[i], or None when the text ends inside it."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j = 0, i
        while j < len(text):
            ch = text[j]
            if ch == '"':
                end = value_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    m = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(text, i)
    if m is None or m.end() == len(text):  # a scalar at the text's end may go on
        return None
    return m.end()


def partial_string(text: str, i: int) -> tuple[str, bool]:
    """The decoded JSON string that starts at text[i] (a '"'), as far as it is written, and whether it closed.
    An escape cut in the middle is left for the next piece."""
    out: list[str] = []
    j = i + 1
    while j < len(text):
        ch = text[j]
        if ch == '"':
            return "".join(out), True
        if ch == "\\":
            if j + 1 >= len(text):
                break
            if text[j + 1] == "u":
                if j + 6 > len(text):
                    break
                code = int(text[j + 2:j + 6], 16)
                if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves or nothing
                    if j + 12 > len(text):
                        break
                    low = int(text[j + 8:j + 12], 16)
                    out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                    j += 12
                    continue
                out.append(chr(code))
                j += 6
                continue
            out.append(json.loads('"\\' + text[j + 1] + '"'))
            j += 2
            continue
        out.append(ch)
        j += 1
    return "".join(out), False


def _literal(text: str, i: int, lit: str) -> int | None:
    """i past `lit` (whitespace before it skipped), -1 when the text ends inside it, None when it is not there."""
    i = _skip_ws(text, i)
    if text.startswith(lit, i):
        return i + len(lit)
    if lit.startswith(text[i:]):
        return -1
    return None


def read_call(text: str, i: int, args_key: str) -> tuple[Call | None, int | None]:
    """The call object {"name": ..., args_key: {...}} that starts at text[i] (whitespace first), as far as it is
    written: (None, None) before its name is whole, (call, None) while it goes on, (call, end) once it closed."""
    j = _literal(text, i, "{")
    if j is None or j < 0:
        return None, None
    j = _literal(text, j, '"name"')
    j = j if j is None or j < 0 else _literal(text, j, ":")
    if j is None or j < 0:
        return None, None
    j = _skip_ws(text, j)
    end = value_end(text, j)
    if end is None:
        return None, None
    name = json.loads(text[j:end])
    j = _literal(text, end, ",")
    j = j if j is None or j < 0 else _literal(text, j, f'"{args_key}"')
    j = j if j is None or j < 0 else _literal(text, j, ":")
    if j is None or j < 0:
        return Call(str(name), "", False), None
    j = _skip_ws(text, j)
    end = value_end(text, j)
    if end is None:
        return Call(str(name), text[j:], False), None
    close = _literal(text, end, "}")
    call = Call(str(name), text[j:end], close is not None and close >= 0)
    return call, (close if call.complete else None)


def read_calls(text: str, i: int, args_key: str, sep: str = ",") -> tuple[list[Call], int | None]:
    """Calls one after another from text[i], `sep` between them; the index past the last closed one."""
    calls, last = [], i
    while True:
        call, end = read_call(text, i, args_key)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, (last if calls and calls[-1].complete else None)
        last = end
        nxt = _literal(text, end, sep)
        if nxt is None or nxt < 0:
            return calls, last
        i = nxt


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker` (not yet shown as content)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# --- formats ----------------------------------------------------------------------------------------------------

def _call_schema(tool: Tool, args_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, args_key: bounded(tool.parameters)},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_LAYOUT})


def _text_without(marker: str) -> str:
    """A Lark lexeme: any text in which `marker` does not occur."""
    return f"/(.|\\n)*/ & ~/(.|\\n)*{re.escape(marker)}(.|\\n)*/"


class ToolFormat:
    """How one family of models is shown tools and writes calls. `special`: the format's markers that are
    single special tokens of this tokenizer (their ids), which the grammar names by id and the output keeps."""

    name = ""
    args_key = "arguments"
    markers: tuple[str, ...] = ()

    def __init__(self, special: dict[str, int] | None = None):
        self.special = special or {}

    @property
    def keeps_special_tokens(self) -> bool:
        return bool(self.special)

    def _lit(self, marker: str) -> str:
        """A marker in Lark: the special token by id, or the text."""
        return f"<[{self.special[marker]}]>" if marker in self.special else json.dumps(marker)

    def chat(self, messages: list[dict[str, Any]], tools: list[Tool]) -> Chat:
        """The prompt: OpenAI messages (assistant tool_calls, tool results) as the model's template takes them."""
        return Chat(_template_messages(messages), [t.as_openai() for t in tools] or None)

    def grammar(self, tools: list[Tool], choice: str, parallel: bool) -> tuple[str, Any] | None:
        """What the output follows: ("json_schema", schema) or ("grammar", Lark text); None: nothing."""
        raise NotImplementedError

    def _call_rule(self, allowed: list[Tool]) -> str:
        """A Lark rule's body: one call of any of these functions, its arguments under their schema."""
        return _lark_json(_one_of([_call_schema(t, self.args_key) for t in allowed]))

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls with their arguments as objects (transformers' templates index them), tool
    messages with the called function's name beside tool_call_id."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c["function"]
                names[c.get("id", "")] = fn["name"]
                calls.append({"id": c.get("id", ""), "type": "function",
                              "function": {"name": fn["name"], "arguments": json.loads(fn["arguments"] or "{}")}})
            m["tool_calls"] = calls
            if m.get("content") is None:
                m["content"] = ""
        elif m.get("role") == "tool":
            m.setdefault("name", names.get(m.get("tool_call_id", ""), ""))
        out.append(m)
    return out


class GenericFormat(ToolFormat):
    """For templates without tools: the tools described in the system turn; the answer one JSON object."""

    name = "generic"

    def chat(self, messages, tools):
        out: list[dict[str, Any]] = []
        names = {c.get("id"): c["function"]["name"] for m in messages for c in m.get("tool_calls") or []}
        for m in messages:
            if m.get("tool_calls"):
                calls = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                         for c in m["tool_calls"]]
                out.append({"role": "assistant", "content": _dumps({"tool_calls": calls})})
            elif m.get("role") == "assistant" and tools:
                out.append({"role": "assistant", "content": _dumps({"response": m.get("content") or ""})})
            elif m.get("role") == "tool":  # the result beside the name of the function that made it
                name = names.get(m.get("tool_call_id"), "")
                out.append({"role": "tool", "content": _dumps({"tool_response": {"name": name,
                                                                                 "content": m.get("content")}})})
            else:
                out.append({k: v for k, v in m.items() if k in ("role", "content")})
        if tools:
            intro = ("You can call these tools:\n" + "\n".join(_dumps(t.as_openai()["function"]) for t in tools)
                     + '\n\nAnswer with one JSON object: {"tool_calls": [{"name": <tool name>, "arguments": '
                     '<its arguments>}]} to call tools (their results come back as tool_response objects), or '
                     '{"response": <your answer>} to answer the user. Call a tool only for what its results '
                     'do not tell you yet; once they do, answer.')
            if out and out[0]["role"] == "system":
                out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + intro}
            else:
                out.insert(0, {"role": "system", "content": intro})
        return Chat(out)

    def grammar(self, tools, choice, parallel):
        allowed, parallel = chosen(tools, choice), not one_call(choice, parallel)
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        if not allowed:
            return ("json_schema", answer) if tools else None
        calls = {"type": "array", "items": _one_of([_call_schema(t, "arguments") for t in allowed]), "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        schema = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                  "additionalProperties": False}
        if choice == "auto":
            schema = {"anyOf": [schema, answer]}
        return "json_schema", schema

    def parse(self, text, final):
        i = _literal(text, 0, "{")
        if i is None:  # not the format (tool_choice "none", or a model left free): plain content
            return Parsed(text, [])
        key_at = _skip_ws(text, i) if i >= 0 else len(text)
        end = value_end(text, key_at)
        if end is None:
            return Parsed("", [])
        key = json.loads(text[key_at:end]) if text[key_at:end].startswith('"') else None
        j = _literal(text, end, ":")
        if j is None or j < 0:
            return Parsed("", []) if key in ("response", "tool_calls") else Parsed(text, [])
        j = _skip_ws(text, j)
        if key == "response" and text.startswith('"', j):
            return Parsed(partial_string(text, j)[0], [])
        if key == "tool_calls":
            k = _literal(text, j, "[")
            if k is None or k < 0:
                return Parsed("", [])
            return Parsed("", read_calls(text, k, "arguments")[0])
        return Parsed(text, [])


class HermesFormat(ToolFormat):
    """Hermes / Qwen 2.5+ / SmolLM3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks."""

    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def grammar(self, tools, choice, parallel):
        allowed, parallel = chosen(tools, choice), not one_call(choice, parallel)
        if not allowed:  # tool_choice "none": text that never opens a call
            return ("grammar", f"start: TAIL\nTAIL: {_text_without(self.open)}\n") if tools else None
        call = self._call_rule(allowed)
        body = f'"\\n" call "\\n{self.close}"'
        if choice == "auto":  # text, then calls; the text never holds a call the grammar did not check
            more = "tag*" if parallel else "tag?"
            rules = (f"start: {more} tail\ntail: TAIL\nTAIL: {_text_without(self.open)}\n"
                     f'trig[lazy]: /(.|\\n)*/ "{self.open}"\ntag: trig {body}\n')
        else:
            more = '("\\n" tag)*' if parallel else ""
            rules = f'start: tag {more}\ntag: "{self.open}" {body}\n'
        return "grammar", rules + f"call: {call}\n"

    def parse(self, text, final):
        head, sep, rest = text.partition(self.open)
        if not sep:
            keep = 0 if final else _held_back(text, self.open)
            return Parsed(text[:len(text) - keep], [])
        calls = []
        for block in (sep + rest).split(self.open)[1:]:
            call, _ = read_call(block, 0, self.args_key)
            if call is not None:
                calls.append(call)
        return Parsed(head, calls)


class Llama3JsonFormat(ToolFormat):
    """Llama 3.1-3.3: the answer is `{"name": ..., "parameters": {...}}` (calls joined by "; "), optionally after
    `<|python_tag|>`; anything else is text."""

    name = "llama3_json"
    args_key = "parameters"
    tag = "<|python_tag|>"

    def grammar(self, tools, choice, parallel):
        allowed, parallel = chosen(tools, choice), not one_call(choice, parallel)
        text = "TEXT: /([^{<](.|\\n)*)?/\n"  # text that does not start as a call does
        if not allowed:
            return ("grammar", "start: TEXT\n" + text) if tools else None
        call = self._call_rule(allowed)
        calls = 'call ("; " call)*' if parallel else "call"
        if choice == "auto":
            return "grammar", f"start: {calls} | TEXT\n{text}call: {call}\n"
        return "grammar", f"start: {calls}\ncall: {call}\n"

    def parse(self, text, final):
        body = text[len(self.tag):] if text.startswith(self.tag) else text
        if not body.lstrip().startswith("{"):
            if not final and (self.tag.startswith(text) or not body.strip()):
                return Parsed("", [])
            return Parsed(text, [])
        return Parsed("", read_calls(body, 0, self.args_key, ";")[0])


class MistralFormat(ToolFormat):
    """Mistral (v3 tokenizers): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`."""

    name = "mistral"
    tag = "[TOOL_CALLS]"
    markers = (tag,)

    def grammar(self, tools, choice, parallel):
        allowed, parallel = chosen(tools, choice), not one_call(choice, parallel)
        if not allowed:
            return ("grammar", f"start: TAIL\nTAIL: {_text_without(self.tag)}\n") if tools else None
        call = self._call_rule(allowed)
        calls = f'{self._lit(self.tag)} "[" call' + (' (", " call)*' if parallel else "") + ' "]"'
        if choice == "auto":
            return "grammar", (f"start: calls | TAIL\ncalls: {calls}\nTAIL: {_text_without(self.tag)}\n"
                               f"call: {call}\n")
        return "grammar", f"start: {calls}\ncall: {call}\n"

    def parse(self, text, final):
        head, sep, rest = text.partition(self.tag)
        if not sep:
            keep = 0 if final else _held_back(text, self.tag)
            return Parsed(text[:len(text) - keep], [])
        i = _literal(rest, 0, "[")
        if i is None or i < 0:
            return Parsed(head, [])
        return Parsed(head, read_calls(rest, i, self.args_key)[0])


FORMATS = {f.name: f for f in (GenericFormat, HermesFormat, Llama3JsonFormat, MistralFormat)}
_PROBE = Tool("tieredkv_probe_fn", "probe", {"type": "object", "properties": {}})


def format_for(tokenizer, parser: str = "auto") -> ToolFormat:
    """The tool format of a model: `parser` as named (vLLM's --tool-call-parser names), or, for "auto", the one
    its chat template writes (a template that renders no tools: generic)."""
    if parser != "auto":
        if parser not in FORMATS:
            raise ValueError(f"unknown tool-call parser {parser!r}; choose one of {', '.join(PARSERS)}")
        return _made(FORMATS[parser], tokenizer)
    return _made(FORMATS[_detected(tokenizer.hf)], tokenizer)


def _detected(hf) -> str:
    template = getattr(hf, "chat_template", None)
    if not isinstance(template, str):
        return "generic"
    try:
        shown = hf.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE.as_openai()],
                                       tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that cannot take tools at all
        return "generic"
    if _PROBE.name not in shown:
        return "generic"
    for marker, name in (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                         ('"parameters"', "llama3_json")):
        if marker in template:
            return name
    return "generic"


def _made(cls: type[ToolFormat], tokenizer) -> ToolFormat:
    special_ids = set(getattr(tokenizer.hf, "all_special_ids", []) or [])
    special = {}
    for marker in cls.markers:
        ids = tokenizer.hf.convert_tokens_to_ids([marker])
        if ids and ids[0] in special_ids:  # (skipped from the text unless kept, and not text to the grammar)
            special[marker] = ids[0]
    return cls(special)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(str(JSON_LAYOUT["item_separator"]),
                                                           str(JSON_LAYOUT["key_separator"])))


# --- the messages a client sends back -----------------------------------------------------------------------------

def check_tool_messages(messages: list[dict[str, Any]], param: str = "messages") -> None:
    """Every tool message answers a call an earlier assistant message made (by tool_call_id); every assistant
    call has a function name and JSON-object arguments."""
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.get("tool_calls") is not None:
            if not isinstance(m["tool_calls"], list):
                raise ToolError(f"{param}[{i}].tool_calls must be a list", param)
            for c in m["tool_calls"]:
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ToolError(f"{param}[{i}].tool_calls: each call needs function.name", param)
                try:
                    args = json.loads(fn.get("arguments") or "{}")
                except (TypeError, ValueError):
                    raise ToolError(f"{param}[{i}].tool_calls: arguments of {fn['name']!r} are not JSON",
                                    param) from None
                if not isinstance(args, dict):
                    raise ToolError(f"{param}[{i}].tool_calls: arguments of {fn['name']!r} must be a JSON object",
                                    param)
                if isinstance(c.get("id"), str):
                    calls.add(c["id"])
        if m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in calls:
                raise ToolError(f"{param}[{i}]: a tool message's tool_call_id ({cid!r}) must name a call an earlier "
                                "assistant message made", param)


class ToolStream:
    """Turns a growing output text into OpenAI's streamed deltas: content, then for each call its index, id,
    type and name once, then its argument fragments (their concatenation is the call's arguments)."""

    def __init__(self, fmt: ToolFormat):
        self.fmt, self.text, self.content = fmt, "", ""  # the content sent so far
        self.calls: list[Call] = []  # ids given, arguments sent so far

    def feed(self, piece: str, final: bool = False) -> list[dict[str, Any]]:
        self.text += piece
        parsed = self.fmt.parse(self.text, final)
        deltas: list[dict[str, Any]] = []
        if len(parsed.content) > len(self.content) and parsed.content.startswith(self.content):
            deltas.append({"content": parsed.content[len(self.content):]})
            self.content = parsed.content
        for index, call in enumerate(parsed.calls):
            if index == len(self.calls):
                self.calls.append(Call(call.name, "", False, new_call_id(self.fmt)))
                deltas.append({"tool_calls": [{"index": index, "id": self.calls[index].id, "type": "function",
                                               "function": {"name": call.name, "arguments": ""}}]})
            sent = self.calls[index]
            if len(call.arguments) > len(sent.arguments):
                frag = call.arguments[len(sent.arguments):]
                sent.arguments, sent.complete = call.arguments, call.complete
                deltas.append({"tool_calls": [{"index": index, "function": {"arguments": frag}}]})
            sent.complete = call.complete
        return deltas
