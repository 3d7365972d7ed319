"""What the processor offers, read from /proc/cpuinfo: its model name and the vector flags that decide
which CPU paths pay (AVX2 only, AVX-512, AVX512_BF16, AMX). Also what benchmark notes quote."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

FLAGS_THAT_MATTER = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]

    def has(self, flag: str) -> bool:
        return flag in self.flags

    def describe(self, threads: int | None = None) -> str:
        """One line for a benchmark note: model name, the flags that matter, cores (and threads used)."""
        wanted = [f for f in FLAGS_THAT_MATTER if f in self.flags] or ["no AVX2"]
        line = f"{self.model_name} ({' '.join(wanted)}), {os.cpu_count()} cores"
        return line if threads is None else f"{line}, {threads} threads"


@functools.cache
def cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's entry (all are alike on the machines this runs on); unknown off Linux."""
    name, flags = "unknown", frozenset[str]()
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown":
                    name = value.strip()
                elif key == "flags":
                    flags = frozenset(value.split())
                    break
    except OSError:
        pass
    return CpuInfo(name, flags)
