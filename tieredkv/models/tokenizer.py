"""Tokenizer and chat template from transformers, with the engine's input checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class Chat:
    """Chat messages with the tools the template is to render (transformers' `apply_chat_template(tools=...)`):
    a prompt of its own kind, since a list of messages alone cannot carry them.

    Attributes:
        messages: the chat; an assistant message may carry `tool_calls` (then `content` may be None), a `tool`
            message its `tool_call_id`, as transformers' templates take them.
        tools: the tools in OpenAI's shape (`{"type": "function", "function": {...}}`), or None.
        template_kwargs: more variables for the template (`apply_chat_template(**template_kwargs)`).
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)


PromptType = str | list[int] | list[dict[str, Any]] | Chat


def check_messages(messages: Sequence) -> None:
    """Raises ValueError unless every message is a dict with string 'role' and 'content' (None where the
    message carries tool_calls), and every string in it, at any depth, is valid Unicode (a chat template
    renders roles, names and calls as they are, not only the content)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r:.200}")
        content = m.get("content")
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r:.200}")
        stack = [(f"message {i} {k}", v) for k, v in m.items()]
        while stack:
            what, value = stack.pop()
            if isinstance(value, str):
                check_text(value, what)
            elif isinstance(value, dict):
                stack.extend((f"{what}.{k}", v) for k, v in value.items())
            elif isinstance(value, list):
                stack.extend((what, v) for v in value)


def message_chars(messages: Sequence) -> int:
    """Characters in everything a chat template may render from the messages: every string, at any depth
    (roles, names and content alike); other values count one each. Never tokenizes, never formats a value."""
    stack, chars = list(messages), 0
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            chars += len(value)
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        else:
            chars += 1
    return chars


def check_text(text: str, what: str = "text") -> None:
    """Raises ValueError naming the position of a lone surrogate (text that is not valid Unicode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate at position {e.start}") from None


def _plain_config(model_dir: Path):
    """config.json as transformers' generic config (model_type and all), or None to let AutoTokenizer read it.
    AutoTokenizer reads only names from the config; loading it through the architecture's own config class
    imports a good part of transformers' modelling code (Llama's: ~640 modules, 1-2 s and ~40 MB a process)."""
    import json

    from transformers import PretrainedConfig

    try:
        config = PretrainedConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    except (OSError, ValueError, TypeError):
        return None
    config._name_or_path = str(model_dir)
    return config


class Tokenizer:
    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir), config=_plain_config(model_dir))
        except Exception as e:  # transformers raises several types for a missing or broken tokenizer
            raise ValueError(f"cannot load a tokenizer from {model_dir}: {e}") from e

    @property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: no token covers more of a prompt."""
        return max(map(len, self.hf.get_vocab()), default=1)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        check_text(text)
        return list(self.hf(text).input_ids)

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                            **template_kwargs) -> list[int]:
        check_messages(messages)
        return list(self.hf(self.render_chat(messages, tools, **template_kwargs), add_special_tokens=False).input_ids)

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    **template_kwargs) -> str:
        """The chat template's text for the messages (and tools), ending in the assistant's turn."""
        if getattr(self.hf, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass a string or token ids")
        try:
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                               **template_kwargs)
        except ValueError:
            raise
        except Exception as e:  # jinja2's TemplateError (raise_exception in a template), a template's TypeError
            raise ValueError(f"the chat template cannot render these messages: {e}") from None

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_token_ids(self, prompt: PromptType) -> list[int]:
        """str -> encoded; list of ints -> as is; list of chat messages or a Chat -> chat template applied."""
        if isinstance(prompt, Chat):
            return self.apply_chat_template(list(prompt.messages), prompt.tools, **prompt.template_kwargs)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is empty")
            items: list[Any] = list(prompt)
            if all(isinstance(t, int) and not isinstance(t, bool) for t in items):
                return items
            if all(isinstance(m, dict) for m in items):
                return self.apply_chat_template(items)
        raise TypeError("prompt must be a str, a list of token ids, or a list of chat messages")
