"""The CPU kernels for quantized weights (quant_cpu.c), built once per processor and loaded through ctypes.

Why our own: torch's packed weight-only ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) have
vectorized paths for AVX-512 and AMX only. Measured on an AVX2-only AMD EPYC (Zen 1) at batch 1 over the
default model's projections, they were 2.5x (int8) and 20x (int4) slower than fp32 `F.linear`, and inductor's
fusion of a dequantize into a reduction was 3x slower too. quant_cpu.c multiplies int8 or 4-bit codes by
int16-quantized activations with vpmaddwd where the processor has AVX2, in plain C elsewhere.

The library is compiled with the system's C compiler for this very processor (-march=native) into the
engine's cache directory, under a name made of the source's hash and the processor's identity, so a
different machine sharing the directory builds its own; a second process waits for the first one's build.
Without a compiler, or where the build fails, `load()` returns None and the dense layers run the torch
reference (dequantize, then F.linear): correct, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tieredkv.cache_dir import artifact_lock
from tieredkv.runner.cpu_features import cpu_info

log = logging.getLogger("tieredkv")

SOURCE = Path(__file__).with_name("quant_cpu.c")
BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared")
NATIVE = ("-march=native",)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "tkv_q8_linear": ([_P, _I, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q4_linear": ([_P, _I, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q8_gemv": ([_P, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q4_gemv": ([_P, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q8_rows": ([_P, _P, _P, _I, _I, _P, _I, _P], None),
    "tkv_q4_rows": ([_P, _P, _P, _I, _I, _P, _I, _P], None),
}


def compiler() -> str | None:
    """The C compiler: $CC, else cc, gcc or clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def library_path(cache_dir: Path, flags: tuple[str, ...] = NATIVE) -> Path:
    info = cpu_info()
    identity = repr((SOURCE.read_bytes(), info.model_name, sorted(info.flags), flags, compiler()))
    return cache_dir / "kernels" / f"quant_cpu-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.so"


def build(cache_dir: Path, flags: tuple[str, ...] = NATIVE) -> Path:
    """Compiles quant_cpu.c with `flags` into the cache unless it is there; returns the library's path.
    Raises RuntimeError with the compiler's message when it cannot."""
    out = library_path(cache_dir, flags)
    if out.exists():
        return out
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    with artifact_lock(out.parent / ".quant_cpu.lock", "building the quantized-weight kernels"):
        if out.exists():
            return out
        fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
        os.close(fd)
        try:
            res = subprocess.run([cc, *BASE_FLAGS, *flags, str(SOURCE), "-o", tmp, "-lm"],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed: {res.stderr.strip()[-600:]}")
            os.replace(tmp, out)  # whole or absent, even if the process is killed mid-build
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return out


def open_library(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@functools.cache
def load(cache_dir: Path, flags: tuple[str, ...] = NATIVE) -> ctypes.CDLL | None:
    """The library for this processor, built on first use; None (with a warning) where it cannot be."""
    try:
        return open_library(build(cache_dir, flags))
    except (RuntimeError, OSError) as e:
        log.warning("quantized-weight CPU kernels unavailable, the torch reference serves (correct, slower): %s", e)
        return None
