"""Which implementation served each kernel call: a count per (kind of call, implementation), kept per engine.

A layer's attention and a quantized weight's product each pick an implementation per call (the CPU kernel or the
torch reference, int16 rows or int8 blocks, ...), from the shapes, the formats and what is bound. The runner
counts the calls of its forwards (`counting`, around each one) and `EngineStats.kernel_calls` reports them, so
that a path nobody meant to take (a fallback to the torch reference, say) shows at once. In a compiled graph the
implementations are chosen once, at its trace: the runner counts that graph's runs instead, as the forward's kind.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from contextvars import ContextVar
from typing import Iterator

import torch

# the counter of the forward running in this thread or task (None: nothing counts)
_COUNTS: ContextVar[Counter | None] = ContextVar("tieredkv_kernel_calls", default=None)


def record(kind: str, impl: str) -> None:
    """One call of `kind` ("decode attention", "quantized product", ...) served by `impl`. Nothing while a
    graph is traced (the call is then the trace's, not a step's) or outside `counting`."""
    if torch.compiler.is_compiling():
        return
    counts = _COUNTS.get()
    if counts is not None:
        counts[kind, impl] += 1


@contextlib.contextmanager
def counting(counts: Counter | None) -> Iterator[None]:
    """The calls made inside, in this thread or task, count in `counts` (None: nowhere)."""
    token = _COUNTS.set(counts)
    try:
        yield
    finally:
        _COUNTS.reset(token)


def labelled(counts: Counter) -> dict[str, int]:
    """`counts` as "kind: implementation" -> calls, sorted (EngineStats.kernel_calls)."""
    return {f"{kind}: {impl}": n for (kind, impl), n in sorted(counts.items())}
