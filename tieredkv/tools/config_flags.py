"""EngineConfig's fields as command-line options, generated from the pydantic model so that the two never
drift: `--block-size 32`, `--warm-bytes 2GiB`, `--no-enable-prefix-caching`, with each field's description
and default in --help. An option left out takes TIEREDKV_<FIELD> from the environment, else the field's
default (EngineConfig.from_env)."""

from __future__ import annotations

import argparse
import re
import types
import typing
from typing import Any, Callable, Literal

from tieredkv.config import ENV_PREFIX, EngineConfig

ALIASES = {"quantization": ("--weights",), "remote_url": ("--remote",), "lora_adapters": ("--lora",)}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'80GiB', '16 GB', '512MiB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 80GiB, 512MiB, 16GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(annotation: Any) -> Any:
    """The annotation without its `| None`."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return annotation


def _parser(name: str, base: Any, optional: bool) -> tuple[Callable[[str], Any], list | None]:
    """How one option's text becomes the field's value, and its choices (Literal fields). An optional
    field also takes "none" (EngineConfig.from_env makes it None)."""
    if typing.get_origin(base) is Literal:
        return str, list(typing.get_args(base))
    parse = _size if name.endswith("_bytes") else base if base in (int, float) else str
    if not optional or parse is str:
        return parse, None

    def or_none(text: str):
        return "none" if text.strip().lower() == "none" else parse(text)

    or_none.__name__ = parse.__name__  # argparse names it in "invalid int value"
    return or_none, None


def _help(name: str, field) -> str:
    default = field.get_default(call_default_factory=True)
    shown = "unset" if default is None else default
    text = (field.description or "").rstrip(".")
    text = f"{text} [default: {shown}; env {ENV_PREFIX}{name.upper()}]"
    return text.replace("%", "%%").strip()


def add_engine_options(p: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One option per EngineConfig field (but `skip`), in a group of their own."""
    group = p.add_argument_group("engine options (EngineConfig; an option left out takes the environment's "
                                 f"{ENV_PREFIX}<FIELD>, else the default shown)")
    for name, field in EngineConfig.model_fields.items():
        if name in skip:
            continue
        base = _base_type(field.annotation)
        if base is bool:
            group.add_argument(flag(name), dest=name, action=argparse.BooleanOptionalAction, default=None,
                               help=_help(name, field))
            continue
        parse, choices = _parser(name, base, type(None) in typing.get_args(field.annotation))
        metavar = name.upper() if choices is None else "{" + ",".join(choices) + "}"
        group.add_argument(flag(name), *ALIASES.get(name, ()), dest=name, type=parse, choices=choices, default=None,
                           metavar=metavar, help=_help(name, field))


def engine_config(args: argparse.Namespace, **fixed: Any) -> EngineConfig:
    """The config a command starts its engine with: the options given, over `fixed` (what the command sets
    for itself), over the environment, over the defaults."""
    given = {name: getattr(args, name, None) for name in EngineConfig.model_fields}
    return EngineConfig.from_env(**{**fixed, **{k: v for k, v in given.items() if v is not None}})
