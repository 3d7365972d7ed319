"""Frames between an application's AsyncEngine and its engine-core process (core_process.py, core_client.py).

A frame is a 4-byte little-endian length and a msgpack body: a list of messages, each a list whose first item
names it. Values msgpack has no type for (stream chunks, usage, stats, sampling parameters, errors) travel pickled
inside msgpack's ext type 1, as vLLM's engine-core messages carry theirs; both ends are the same installation of
tieredkv, started by the same user, so nothing crosses a trust boundary. An error that cannot be pickled (one that
holds a lock, say) arrives as a RuntimeError with its type's name and its message."""

from __future__ import annotations

import asyncio
import pickle
import struct
from typing import Any

PICKLED = 1
HEADER = struct.Struct("<I")


def _default(value: Any):
    import msgpack

    try:
        return msgpack.ExtType(PICKLED, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        if isinstance(value, BaseException):
            stand_in = RuntimeError(f"{type(value).__name__}: {value}")
            return msgpack.ExtType(PICKLED, pickle.dumps(stand_in, protocol=pickle.HIGHEST_PROTOCOL))
        raise TypeError(f"{type(value).__name__} cannot be sent to or from the engine's core process: {e}") from e


def _ext(code: int, data: bytes) -> Any:
    import msgpack

    if code == PICKLED:
        return pickle.loads(data)
    return msgpack.ExtType(code, data)


def encode(messages: list) -> bytes:
    import msgpack  # on first use: an application that runs its core in its own process only

    body = msgpack.packb(messages, default=_default, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> list:
    import msgpack

    return msgpack.unpackb(body, ext_hook=_ext, raw=False, strict_map_key=False)


async def read_frame(reader: asyncio.StreamReader) -> list | None:
    """The next frame's messages; None at the end of the stream (the other process closed it or died)."""
    try:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        return decode(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
