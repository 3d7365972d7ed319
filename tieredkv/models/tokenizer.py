"""Tokenizer and chat template from transformers, with the engine's input checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PromptType = str | list[int] | list[dict[str, Any]]


def check_messages(messages: list) -> None:
    """Raises ValueError unless every message is a dict with string 'role' and 'content', and every string in
    it is valid Unicode (a chat template renders roles and names as they are, not only the content)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r:.200}")
        for field, value in m.items():
            if isinstance(value, str):
                check_text(value, f"message {i} {field}")


def message_chars(messages: list) -> int:
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

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        check_messages(messages)
        if getattr(self.hf, "chat_template", None) is None:
            raise ValueError("this model's tokenizer has no chat template; pass a string or token ids")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.hf(text, add_special_tokens=False).input_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_token_ids(self, prompt: PromptType) -> list[int]:
        """str -> encoded; list of ints -> as is; list of chat messages -> chat template applied."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            return self.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("prompt is empty")
            if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return list(prompt)
            if all(isinstance(m, dict) for m in prompt):
                return self.apply_chat_template(list(prompt))
        raise TypeError("prompt must be a str, a list of token ids, or a list of chat messages")
