"""Choices the processor decides, made by a short measurement once per processor and kept in the cache.

Flags alone do not say which of two ways is faster: on the AVX2 machines the int kernels beat dequantize + fp32
GEMM up to ~16 activation rows, on an AMD EPYC with AVX-512 (Zen 5), whose fp32 GEMM is twice as wide, up to
~6. So such a choice is measured where it is first needed and kept in a JSON file of the cache directory, under
a key of the processor (model name and flags), torch's version and threads, and what the caller measured.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import torch

from tieredkv.cache_dir import write_json
from tieredkv.runner.cpu_features import cpu_info

STREAM_BYTES = 96 << 20  # a measurement's weights: more than a processor's last-level cache, as a decode reads
MAX_COPIES = 32  # of a layer's projections (a small model's layers fit in cache anyway: its calls' cost decides)


def measured(path: Path | None, identity: tuple, measure: Callable[[], dict]) -> dict:
    """`measure()`'s answer for this processor and `identity`, from `path` where it was measured before (with
    path None: measured every time)."""
    info = cpu_info()
    key = repr((info.model_name, sorted(info.flags), torch.__version__, torch.get_num_threads(), *identity))
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    known = _read_json(path)
    if key not in known:
        known[key] = measure()
        if path is not None:
            try:
                write_json(path, {**_read_json(path), key: known[key]})
            except OSError:
                pass  # measured again next time
    return known[key]


def best_ms(run: Callable[[], object], passes: int = 5) -> float:
    """The fastest of `passes` runs, in milliseconds."""
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _read_json(path: Path | None) -> dict:
    try:
        return json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        return {}
