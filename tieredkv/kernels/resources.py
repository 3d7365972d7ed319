"""What each Triton kernel variant needs on each GPU generation, found without a GPU.

Triton's compiler targets any NVIDIA architecture from the CPU, and its wheel ships `ptxas`: every variant
the engine compiles for a model (the warm-up set, triton_ops.py) is compiled here for sm_75 (T4), sm_80
(A100), sm_86 (A10, RTX 3090), sm_89 (L4, L40S, RTX 4090) and sm_90 (H100, H200), and `ptxas -v` reports
registers and spills; shared memory is the compiler's own figure. A variant over 255 registers, with more
than a few spilled bytes, or over a target's shared memory per block would fail (OutOfResources) or crawl
on that card. tests/kernels/test_kernel_resources.py asserts the limits; `python -m tieredkv.kernels.resources`
prints the table in docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tieredkv.cache_dir import default_cache_dir, write_json
from tieredkv.kernels import triton_ops as T
from tieredkv.kernels.cascade import MIN_PREFIX_TOKENS
from tieredkv.kernels.kv_format import KVLayout

# shared memory a block may use (the opt-in maximum), by compute capability
SHARED_LIMIT = {75: 64 << 10, 80: 163 << 10, 86: 99 << 10, 89: 99 << 10, 90: 227 << 10}
MAX_REGISTERS = 255
MAX_SPILL_BYTES = 0  # spills to local memory: none allowed


@dataclass(frozen=True)
class KernelResources:
    """One variant compiled for one target.

    Attributes:
        kernel: the Triton kernel's name.
        constexprs: its compile-time parameters, as text.
        cc: the target's compute capability (75 for sm_75, ...).
        registers: registers per thread (ptxas).
        spill_bytes: bytes spilled to local memory, stores and loads (ptxas).
        shared_bytes: shared memory per block (Triton's metadata).
        num_warps: warps per block.
    """

    kernel: str
    constexprs: str
    cc: int
    registers: int
    spill_bytes: int
    shared_bytes: int
    num_warps: int

    @property
    def fits(self) -> bool:
        return (self.registers <= MAX_REGISTERS and self.spill_bytes <= MAX_SPILL_BYTES
                and self.shared_bytes <= SHARED_LIMIT[self.cc])


# KV formats whose kernels the table compiles beside the cache in the compute dtype: int8 K with int4 V covers both
# integer codecs in one variant of each kernel; fp8 (e4m3) where the card converts it (sm_89 on)
KV_LAYOUTS = (("int8", "int4", 75), ("fp8", "fp8", 89))


def model_variants(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                   cc: int) -> set:
    """The variant keys (triton_ops.variant_key) of a model with this attention shape on sm_<cc>: its
    warm-up's kernels, launched in a dry run over small tensors laid out as the model's forward lays them
    out (q and k fresh after the rotary embedding, v a view of the fused q/k/v output), with the tiles
    chosen for that target, for the cache in the compute dtype and in the KV formats of KV_LAYOUTS; and the
    quantized dense layers' kernel in both formats."""
    seen = _attention_variants(num_heads, num_kv_heads, head_dim, block_size, dtype, cc, None)
    for k, v, least in KV_LAYOUTS:
        if cc >= least:
            kv = KVLayout.resolve(k, v, head_dim, dtype, torch.device("cuda"))
            seen |= _attention_variants(num_heads, num_kv_heads, head_dim, block_size, dtype, cc, kv)
    return seen


def _attention_variants(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                        cc: int, kv: KVLayout | None) -> set:
    tokens, blocks = 6, 16
    row, storage = (head_dim, dtype) if kv is None else (kv.row, kv.storage_dtype)
    qkv = torch.zeros(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = torch.zeros(tokens, num_heads, head_dim, dtype=dtype)
    k = torch.zeros(tokens, num_kv_heads, head_dim, dtype=dtype)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    kv_cache = torch.zeros(1, 2, blocks, block_size, num_kv_heads, row, dtype=storage)
    key_cache, value_cache = kv_cache[0, 0], kv_cache[0, 1]
    shared = -(-MIN_PREFIX_TOKENS // block_size)
    tables = torch.zeros(2, shared + 1, dtype=torch.int32)
    lens = torch.tensor([shared * block_size + 1] * 2, dtype=torch.int32)
    with T.for_target(cc), T.recording(dry_run=True) as seen:
        T.store_kv(k, v, kv_cache[0], torch.zeros(tokens, dtype=torch.int64), kv=kv)
        first = torch.ones(1, dtype=torch.int32)  # one key: one split, which writes the output itself
        T.decode_attention(q[:1], key_cache, value_cache, tables[:1], first, 0.1,
                           plan=T.plan_decode(tables[:1], first, block_size, dtype), kv=kv)
        cascade = T.plan_decode(tables, lens, block_size, dtype, [([0, 1], shared)])
        T.decode_attention(q[:2], key_cache, value_cache, tables, lens, 0.1, plan=cascade, kv=kv)
        T.prefill_attention(q[2:], key_cache, value_cache, tables[:1], torch.tensor([0, 4], dtype=torch.int32),
                            torch.tensor([4], dtype=torch.int32), 0.1, 4, kv=kv)
        if kv is not None:  # the block copies and the dense layers do not depend on the KV format
            return seen
        ids = torch.tensor([1])
        out = torch.empty((1, 1, 2, block_size, num_kv_heads, head_dim), dtype=dtype)
        T.gather_blocks(kv_cache, ids, out)
        T.copy_blocks(kv_cache, ids, ids)
        # the quantized dense layers (quantization="int8" / "int4", GGUF's types): one variant per format, q8
        # with offsets (GGUF's 5-bit and 2-bit asymmetric types) too
        width, n = num_heads * head_dim, num_kv_heads * head_dim
        x = torch.zeros(tokens, width, dtype=dtype)
        scales = torch.zeros(n, width // 32, dtype=torch.float16)
        T.quant_linear(x, torch.zeros(n, width, dtype=torch.int8), scales, None, 32)
        T.quant_linear(x, torch.zeros(n, width, dtype=torch.int8), scales, scales, 32)
        T.quant_linear(x, torch.zeros(n, width // 2, dtype=torch.uint8), scales, scales, 32)
    return seen


def compile_variant(key: tuple, cc: int) -> KernelResources:
    """Compiles one variant (a variant_key) for sm_<cc> with Triton, offline, and reads its resources."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    name, spec = key
    fn = T.jit_function(getattr(T, name))
    target = GPUTarget("cuda", cc, 32)
    backend = make_backend(target)
    signature = {p.name: s[0] for p, s in zip(fn.params, spec)}
    constexprs = {(i,): s[1] for i, s in enumerate(spec) if s[0] == "constexpr"}
    attrs = {(i,): backend.parse_attr(s[1]) for i, s in enumerate(spec)
             if s[0] != "constexpr" and isinstance(s[1], str)}
    options = backend.parse_options({})

    def compile_logged(always: bool):
        log, dump, again = io.StringIO(), knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, always  # Triton prints ptxas -v's report
        try:
            with contextlib.redirect_stdout(log):
                return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__), log.getvalue()
        finally:
            knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = dump, again

    kernel, report = compile_logged(False)
    if "registers" in report:
        _keep_report(kernel.asm["ptx"], cc, report)
    else:  # Triton's cache served the kernel, and ptxas did not run: its report as kept, else compiled again
        report = _kept_report(kernel.asm["ptx"], cc)
        if report is None:
            kernel, report = compile_logged(True)
            _keep_report(kernel.asm["ptx"], cc, report)
    registers = max(int(n) for n in re.findall(r"Used (\d+) registers", report))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))
    shown = ", ".join(f"{fn.params[i].name}={s[1]}" for i, s in enumerate(spec) if s[0] == "constexpr")
    return KernelResources(name, shown, cc, registers, spills, int(kernel.metadata.shared),
                           int(kernel.metadata.num_warps))


def _report_file(ptx: str, cc: int) -> Path:
    """Where ptxas's report on this PTX for sm_<cc> is kept: under the cache directory, named by the PTX, the
    target, Triton's version (its ptxas flags) and the ptxas binary (its bytes), so a report is only ever read for
    what produced it. The PTX's `.file` directives (the source's path, for line info) are left out of the name: a
    checkout at another path, or another environment with the same Triton, produces the same code and reads the
    same report (Triton's own cache is shared by them and serves a kernel compiled in either)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    found = get_ptxas(cc)
    made_by = f"{triton.__version__}\0{_binary_digest(str(getattr(found, 'path', found)))}\0{cc}"
    code = re.sub(r"(?m)^\s*\.file\s.*$", "", ptx)
    key = hashlib.sha256(f"{made_by}\0{code}".encode()).hexdigest()[:32]
    return default_cache_dir() / "ptxas" / f"{key}.json"


@functools.lru_cache(maxsize=None)
def _binary_digest(path: str) -> str:
    """A digest of the file's bytes (ptxas: ~30 MB, read once a process)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _keep_report(ptx: str, cc: int, report: str) -> None:
    """Keeps Triton's ptxas report for the next time Triton's cache serves the same variant (ptxas does not run
    then, and compiling every variant again for its report costs the table tens of seconds); a cache that cannot
    take it is skipped."""
    with contextlib.suppress(OSError):
        write_json(_report_file(ptx, cc), {"report": report})


def _kept_report(ptx: str, cc: int) -> str | None:
    """The report Triton's ptxas gave on this PTX for sm_<cc> (with Triton's own flags: what the GPU runs), as
    kept the last time it ran, or None."""
    with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
        text = json.loads(_report_file(ptx, cc).read_text())["report"]
        if "registers" in text:
            return text
    return None


# Attention shapes the table covers: heads, KV heads, head dim (the default model; Llama-3 8B and 70B)
SHAPES = {"SmolLM2-135M (9/3 heads, d=64)": (9, 3, 64), "Llama-3-8B (32/8, d=128)": (32, 8, 128),
          "Llama-3-70B (64/8, d=128)": (64, 8, 128)}


def kv_label(constexprs: str) -> str:
    """The K/V formats a variant reads, from its constexprs ("-": the cache in the compute dtype, or no cache)."""
    from tieredkv.kernels.kv_format import FORMATS

    names = {f.code: f.name for f in FORMATS.values()}
    found = dict(part.split("=") for part in constexprs.split(", ") if part.startswith(("K_FMT=", "V_FMT=")))
    if not found or found.get("K_FMT") == "-1":
        return "-"
    return f"{names[int(found['K_FMT'])]}/{names[int(found['V_FMT'])]}"


def auto_dtype(cc: int) -> torch.dtype:
    """What dtype "auto" picks on such a card (resolve.resolve_dtype)."""
    return torch.bfloat16 if cc >= 80 else torch.float16


def main(argv: list[str] | None = None) -> None:
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", choices=list(SHAPES), help="(repeatable; default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("run without TRITON_INTERPRET=1: the interpreter's language functions cannot be compiled")
    rows = []
    for label in args.shape or SHAPES:
        heads, kv_heads, head_dim = SHAPES[label]
        for cc in SHARED_LIMIT:
            for key in sorted(model_variants(heads, kv_heads, head_dim, 16, auto_dtype(cc), cc), key=str):
                rows.append((label, compile_variant(key, cc)))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(model=label, fits=r.fits, limit=SHARED_LIMIT[r.cc],
                                                    **dataclasses.asdict(r)) for label, r in rows], indent=1))
    print("| model | kernel | sm | dtype | KV (K/V) | registers | spilled bytes | shared memory | limit | fits |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r in rows:
        dtype = str(auto_dtype(r.cc)).removeprefix("torch.")
        print(f"| {label} | {r.kernel.strip('_')} | {r.cc} | {dtype} | {kv_label(r.constexprs)} | {r.registers} | "
              f"{r.spill_bytes} | {r.shared_bytes / 1024:.1f} KiB | {SHARED_LIMIT[r.cc] >> 10} KiB | "
              f"{'yes' if r.fits else 'NO'} |")


if __name__ == "__main__":
    main()
