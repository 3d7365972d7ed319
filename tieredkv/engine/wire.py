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
from typing import Any, Callable

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


class FrameProtocol(asyncio.Protocol):
    """Reads frames as they arrive and hands each one's messages to `deliver` on the loop, in the callback that
    received its bytes (no task in between: one wake of the loop a frame); `deliver(None)` once the other end
    closed, `deliver(error)` for bytes that do not decode (nothing more is read)."""

    def __init__(self, deliver: Callable[[list | BaseException | None], None]):
        self.deliver = deliver
        self.buffer = bytearray()
        self.failed = False

    def data_received(self, data: bytes) -> None:
        if self.failed:
            return
        self.buffer += data
        while len(self.buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self.buffer)
            end = HEADER.size + size
            if len(self.buffer) < end:
                return
            body = bytes(self.buffer[HEADER.size:end])
            del self.buffer[:end]
            try:
                messages = decode(body)
            except Exception as e:
                self.failed = True
                self.deliver(e)
                return
            self.deliver(messages)

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.failed:
            self.deliver(None)
