"""The project's CPU kernels (quant_cpu.c: quantized weights, one-row products; attention_cpu.c: decode
attention over the paged cache), built once per processor into one library and loaded through ctypes.

Why our own: torch's packed weight-only ops (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) have
vectorized paths for AVX-512 and AMX only. Measured on an AVX2-only AMD EPYC (Zen 1) at batch 1 over the
default model's projections, they were 2.5x (int8) and 20x (int4) slower than fp32 `F.linear`, and inductor's
fusion of a dequantize into a reduction was 3x slower too. quant_cpu.c multiplies int8 or 4-bit codes by
int16-quantized activations with vpmaddwd where the processor has AVX2, in plain C elsewhere. It also holds
the one-row products on oneDNN's packed fp32/bf16 weights (kernels/linear.py: packed_row_layout).

The library is compiled with the system's C compiler for this very processor (-march=native) into the
engine's cache directory, under a name made of the source's hash and the processor's identity, so a
different machine sharing the directory builds its own; a second process waits for the first one's build.
Without a compiler, or where the build fails, `load()` returns None and the dense layers run the torch
reference (dequantize, then F.linear; oneDNN for packed weights): correct, slower.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from tieredkv.cache_dir import artifact_lock
from tieredkv.platform.cpu_features import cpu_info

log = logging.getLogger("tieredkv")

SOURCES = tuple(Path(__file__).with_name(n)
                for n in ("quant_cpu.c", "attention_cpu.c", "decode_cpu.c", "kv_cpu.c", "gemm_cpu.c"))
HEADERS = (Path(__file__).with_name("cpu_kernels.h"),)
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
    "tkv_f32_packed_row": ([_P, _I, _P, _I, _I, _I, _P, _P], ctypes.c_int),
    "tkv_f32_packed_rows": ([_P, _I, _I, _P, _I, _I, _I, _P, _P], ctypes.c_int),
    "tkv_f32_packed_rows_native": ([], ctypes.c_int),
    "tkv_bf16_packed_row": ([_P, _I, _P, _I, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q4_max_rows": ([], ctypes.c_int),
    "tkv_q4t_linear": ([_P, _I, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q4t_gemv": ([_P, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q4t_rows": ([_P, _P, _P, _I, _I, _P, _I, _P], None),
    "tkv_q8t_linear": ([_P, _I, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q8t_gemv": ([_P, _I, _P, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_q8t_rows": ([_P, _P, _P, _I, _I, _P, _I, _P], None),
    "tkv_tiles_native": ([], ctypes.c_int),
    "tkv_quant_gemm": ([_P, _I, _I, _P, ctypes.c_int, ctypes.c_int, _P, _P, _I, _I, _P, _P], ctypes.c_int),
    "tkv_quant_gemm_native": ([], ctypes.c_int),
    "tkv_paged_decode": ([_P, _I, _I, _I, _P, _P, ctypes.c_int, _I, _I, _I, _P, _I, _P, ctypes.c_float, _P],
                         ctypes.c_int),
    "tkv_prefill_attention": ([_P, _I, _I, _P, _P, ctypes.c_int, _I, _I, _I, _I, _I, _P, _I, _P, _P, ctypes.c_float,
                               _P], ctypes.c_int),
    "tkv_kv_rows": ([_P, ctypes.c_int, _I, _I, _I, _P], None),
    "tkv_kv_store": ([_P, ctypes.c_int, _I, _P], None),
    "tkv_kv_store_tokens": ([_P, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, ctypes.c_int], None),
    "tkv_kv_values": ([_P, _I, _I, ctypes.c_int, _I, _P], None),
    "tkv_kv_row_bytes": ([ctypes.c_int, _I], _I),
    "tkv_decode_fits": ([_P], ctypes.c_int),
    # one weight as decode_cpu.c reads it (cpu_kernels.h: tkv_qw), for the tests
    "tkv_row_fits": ([_P], ctypes.c_int),
    "tkv_rows_bytes": ([_P, _I], ctypes.c_size_t),
    "tkv_rows_prepare": ([_P, _P, _I, _P], None),
    "tkv_rows_share": ([_P, _P, _I, _I, _P], None),
    "tkv_row_dequantize": ([_P, _P, _I, _P], None),
    "tkv_rotary": ([_P, _I, _I, _I, _I, _P, _P, _P], None),
    "tkv_decode_rows": ([_P, _I, _P, _P, _P, _P, _I, _P], ctypes.c_int),
    "tkv_set_split_threads": ([ctypes.c_int], None),
}


def compiler(cxx: bool = False) -> str | None:
    """The C compiler ($CC, else cc, gcc or clang on PATH), or with `cxx` the C++ one ($CXX, c++, g++, clang++)."""
    names = (os.environ.get("CXX"), "c++", "g++", "clang++") if cxx else (os.environ.get("CC"), "cc", "gcc", "clang")
    for name in names:
        if name and shutil.which(name):
            return name
    return None


def _artifact(cache_dir: Path, stem: str, identity: tuple) -> Path:
    return cache_dir / "kernels" / f"{stem}-{hashlib.sha256(repr(identity).encode()).hexdigest()[:16]}.so"


def library_path(cache_dir: Path, flags: tuple[str, ...] = NATIVE) -> Path:
    info = cpu_info()
    sources = tuple(s.read_bytes() for s in (*SOURCES, *HEADERS))
    return _artifact(cache_dir, "quant_cpu", (*sources, info.model_name, sorted(info.flags), flags,
                                              compiler()))


def build(cache_dir: Path, flags: tuple[str, ...] = NATIVE) -> Path:
    """Compiles quant_cpu.c with `flags` into the cache unless it is there; returns the library's path.
    Raises RuntimeError with the compiler's message when it cannot."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    return _compile(library_path(cache_dir, flags), [cc, *BASE_FLAGS, *flags], SOURCES, ["-lm"],
                    "building the quantized-weight kernels")


def _compile(out: Path, command: list[str], sources: tuple[Path, ...], libs: list[str], what: str) -> Path:
    """`command` over `sources` linked with `libs` into `out`, under a lock (a second process waits, then finds
    it): each source compiled by a compiler process of its own, at once (quant_cpu.c alone takes half of the
    library's ~5 s), then linked; the result renamed into place, whole or absent."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with artifact_lock(out.parent / f".{out.name.split('-')[0]}.lock", what), \
            tempfile.TemporaryDirectory(dir=out.parent, suffix=".build") as work:
        if out.exists():
            return out
        objects = [str(Path(work) / f"{i}.o") for i in range(len(sources))]
        compiling = [subprocess.Popen([*command, "-c", str(src), "-o", obj], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True) for src, obj in zip(sources, objects)]
        failed = [err for proc in compiling for _, err in [proc.communicate()] if proc.returncode != 0]
        if failed:
            raise RuntimeError(f"{command[0]} failed: {failed[0].strip()[-600:]}")
        tmp = str(Path(work) / "out.so")
        res = subprocess.run([*command, *objects, "-o", tmp, *libs], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {res.stderr.strip()[-600:]}")
        os.replace(tmp, out)  # whole or absent, even if the process is killed mid-build
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
        log.warning("CPU kernels for quantized weights and one-row products unavailable; the torch reference and "
                    "oneDNN serve (correct, slower): %s", e)
        return None


# ---- the one-row operator in C++ (quant_ops.cpp) --------------------------------------------------------

OPS_SOURCE = Path(__file__).with_name("quant_ops.cpp")


def build_ops(cache_dir: Path) -> Path:
    """Compiles quant_ops.cpp against the running torch's headers and libraries (once per torch build and
    compiler); RuntimeError with the compiler's message when it cannot."""
    import torch

    cxx = compiler(cxx=True)
    if cxx is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    root = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    out = _artifact(cache_dir, "quant_ops", (OPS_SOURCE.read_bytes(), torch.__version__, str(root), abi, cxx))
    command = [cxx, "-O2", "-std=c++17", "-fPIC", "-shared", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{root / 'include'}", f"-I{root / 'include' / 'torch' / 'csrc' / 'api' / 'include'}"]
    lib = root / "lib"
    return _compile(out, command, (OPS_SOURCE,), [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"],
                    "building the CPU operators")


def _build_quietly(cache_dir: Path) -> None:
    with contextlib.suppress(RuntimeError, OSError):
        build_ops(cache_dir)


def _quant_gemv_shape(x, codes, scales, offsets, group_size, bias):
    return x.new_empty((*x.shape[:-1], codes.shape[0] * (16 if codes.dim() == 3 else 1)))  # tiles of 16 rows


def _paged_decode_shape(query, key_cache, value_cache, block_tables, context_lens, scale, k_format=-1, v_format=-1):
    return query.new_empty(query.shape)


def _store_kv_rows_shape(key, value, kv_cache, slot_mapping, k_format, v_format):
    return None


def _kv_values_shape(rows, fmt, head_dim):
    import torch

    return rows.new_empty((*rows.shape[:-1], head_dim), dtype=torch.float32)


def _packed_gemv_shape(x, packed, bias):
    return x.new_empty((*x.shape[:-1], handle_outputs(packed)))  # the packed buffer is such a handle


def handle_outputs(handle) -> int:
    """The output features of the packed weight a handle stands for (kernels/linear.py packed_handle's two forms:
    the packed buffer [N / B, Kp, B], or a [N, K] stand-in)."""
    import torch

    if handle.dim() == 2:
        return handle.shape[0]
    return handle.shape[0] * (handle.shape[2] // 2 if handle.dtype == torch.bfloat16 else handle.shape[2])


INT8_GEMM_ISA = {0: "", 1: "AVX2", 2: "AVX-512 VNNI"}  # gemm_cpu.c's tkv_quant_gemm_native
GEMV_MAX_ROWS = 16  # measured on an AVX2 EPYC: the int kernels win up to ~16 rows, dequantize + fp32 GEMM above
# (q4 on a build with 512-bit blocks: 32, kernel_rows)


class CpuLibrary:
    """The CPU kernels this process serves with: `lib`, the loaded build of quant_cpu.c (None: torch's reference
    serves); `bound`, the build whose kernels the C++ operators of torch.ops.tieredkv run (quant_ops.cpp);
    `q4_rows`, the most rows the loaded build's q4 kernels take (kernels/quant.py kernel_rows); `int8_gemm`, the
    instructions products of more rows on q4 and q8 weights run on as int8 (gemm_cpu.c: "AVX2", "AVX-512 VNNI"; ""
    where the build has none); `f32_rows`, whether the build multiplies a few fp32 rows on packed weights itself
    (tkv_f32_packed_rows, AVX-512 builds; kernels/linear.py packed_product). One a process
    (`CPU`): a loaded library and torch's operator registry are the process's."""

    def __init__(self) -> None:
        self.lib: ctypes.CDLL | None = None
        self.bound: ctypes.CDLL | None = None
        self.q4_rows = GEMV_MAX_ROWS
        self.f32_rows = False
        self.int8_gemm = ""  # the instructions gemm_cpu.c's int8 products of many rows run on ("": none)
        self.operators: ctypes.CDLL | None = None  # quant_ops.cpp's library, loaded once (it registers the ops)
        self.operators_error: str | None = None  # why it could not be had (then never tried again)
        self.split_threads = 0  # the threads decode attention's splits are chosen for (0: the running team's)

    @property
    def operators_bound(self) -> bool:
        """torch.ops.tieredkv.quant_gemv, .paged_decode and .packed_gemv run the loaded kernels."""
        return self.lib is not None and self.bound is self.lib

    def use(self, cache_dir: Path, operators: bool = True) -> bool:
        """Builds (once per processor) and loads the CPU kernels, and with `operators` the C++ operators over them
        (quant_ops.cpp); False when the torch reference must serve."""
        ahead = None
        if operators and self.operators is None and self.operators_error is None:
            # the operators' build (~6 s, one C++ file) beside the kernels' rather than after it; a failure there
            # is met again, and reported, when serve_with builds them
            ahead = threading.Thread(target=_build_quietly, args=(cache_dir,), name="tieredkv-build-operators",
                                     daemon=True)
            ahead.start()
        lib = load(cache_dir) or self.lib
        if ahead is not None:
            ahead.join()
        if lib is not None:
            self.serve_with(lib, cache_dir, operators)
        return lib is not None

    def set_split_threads(self, threads: int) -> None:
        """Decode attention's positions split for `threads` threads whatever team runs it (0: the running team's):
        a step on fewer threads than an engine started with then gives the same bits (platform/cpu_share.py)."""
        self.split_threads = threads
        if self.lib is not None:
            self.lib.tkv_set_split_threads(threads)

    def bind_operators(self, cache_dir: Path) -> bool:
        """Builds (once per torch build: ~6 s) and binds the C++ operators (the quantized one-row product, decode
        attention) to the loaded kernels; the compiled decode path calls it before it traces, on its own thread,
        so no start waits for the build. False where they cannot be had (Python and torch serve)."""
        if self.lib is not None:
            self.serve_with(self.lib, cache_dir, operators=True)
        return self.operators_bound

    def serve_with(self, lib: ctypes.CDLL | None, cache_dir: Path, operators: bool = True) -> None:
        """Makes `lib` (a build of quant_cpu.c; None: the torch reference) the kernels the ops run, and binds the
        C++ operators to it where they can be built."""
        self.lib = lib
        if lib is not None:
            lib.tkv_set_split_threads(self.split_threads)
        self.q4_rows = GEMV_MAX_ROWS if lib is None else lib.tkv_q4_max_rows()
        self.f32_rows = lib is not None and bool(lib.tkv_f32_packed_rows_native())
        self.int8_gemm = "" if lib is None else INT8_GEMM_ISA[lib.tkv_quant_gemm_native()]
        if lib is None or self.bound is lib or not operators:
            return
        self.bound = lib if self._bind(cache_dir, lib) else None

    def _bind(self, cache_dir: Path, lib: ctypes.CDLL) -> bool:
        """Makes torch.ops.tieredkv.quant_gemv, .paged_decode and .packed_gemv run `lib`'s kernels, building and
        loading the operators' library on first use; False (with one warning a process) where it cannot be had:
        the one-row products then go through the Python operators (a few microseconds slower a call), decode
        attention through torch (kernels/decode_attention.py)."""
        if self.operators is None and self.operators_error is None:
            try:
                path = build_ops(cache_dir)
                from tieredkv.kernels.ops import load_cpp_operators

                load_cpp_operators(path, {"quant_gemv": _quant_gemv_shape, "paged_decode": _paged_decode_shape,
                                          "packed_gemv": _packed_gemv_shape, "store_kv_rows": _store_kv_rows_shape,
                                          "kv_values": _kv_values_shape})
                ops = ctypes.CDLL(str(path))
                ops.tkv_bind.argtypes, ops.tkv_bind.restype = [ctypes.c_void_p] * 10, None
                self.operators = ops
            except (RuntimeError, OSError) as e:
                self.operators_error = str(e)
                log.warning("CPU operators (quantized one-row products, decode attention) unavailable, Python and "
                            "torch serve: %s", e)
        if self.operators is None:
            return False
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        self.operators.tkv_bind(address(lib.tkv_q8_gemv), address(lib.tkv_q4_gemv), address(lib.tkv_paged_decode),
                                address(lib.tkv_f32_packed_row), address(lib.tkv_bf16_packed_row),
                                address(lib.tkv_q4t_gemv), address(lib.tkv_q8t_gemv),
                                address(lib.tkv_kv_store_tokens), address(lib.tkv_kv_values),
                                address(lib.tkv_kv_row_bytes))
        return True


CPU = CpuLibrary()
