"""Weights that several engines of one process share: loaded once, each engine with a cache, tiers and scheduler of
its own over them (as llama.cpp's contexts share one llama_model).

`EngineCore(config, shared)` and `AsyncEngine.start(config, shared_weights=shared)` look the config's weights up in
`shared` (a `SharedWeights`) before loading: an engine whose model an earlier engine of the process loaded in the
same form takes that model as it is (held in its kernels' layout, 4-bit keys' shifts set). What decides the form
is the key: the model's folder, the device and dtype, the quantization settings, the KV formats (4-bit keys shift
each layer's key mean into the model), the attention backend (the kernel set the shifts were measured with), the
dense layout (`cpu_linear`, and whether decode is compiled), the cache directory (where the layout and the int8
tiles were measured) and the build of the CPU kernels in use. Everything else an engine keeps (cache tensor,
tiers, scheduler, runner and its kernel-call counts, compiled graph, adapters) is its own, so two engines over one
model share no state but the weights, which nothing changes after the load.

Not with tensor parallelism (each rank loads its own share, in its own process) nor a core process (another
process's memory). Level-2 sleep releases the weights' memory, so it is refused while another live engine uses
the same model."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tieredkv.config import EngineConfig
from tieredkv.kernels.kv_format import KVLayout
from tieredkv.kernels.quant_cpu import CPU
from tieredkv.models.llama import LlamaModel
from tieredkv.models.loader import QuantSettings


@dataclass
class _Entry:
    model: LlamaModel
    memory: Any  # rank_build.RankMemory of the load that made it
    users: int = 0  # live engines over it


class SharedWeights:
    """Loaded models by key, with how many live engines use each. Thread-safe; the load itself runs under the lock,
    so two engines that start at once over the same weights load them once."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(cfg: EngineConfig, model_dir: Path, device: torch.device, dtype: torch.dtype, quant: QuantSettings | None,
            kv: KVLayout, compiled: bool, cache_dir: Path) -> tuple:
        """What decides the weights in memory (the module docstring); ValueError for a config that cannot share."""
        if cfg.tensor_parallel_size > 1:
            raise ValueError("shared weights need tensor_parallel_size=1: each rank loads its own share")
        cpu = getattr(CPU.lib, "_name", None) if device.type == "cpu" else None  # the build quantized weights were
        # laid out for (tiles where it has VNNI)
        return (str(model_dir.resolve()), str(device), str(dtype), repr(quant), repr(kv), cfg.attention_backend,
                cfg.cpu_linear, compiled, compiled and cfg.native_decode, str(cache_dir), cpu)

    def take(self, key: tuple, load: Callable[[], tuple[LlamaModel, Any, Any]]) -> tuple[LlamaModel, Any]:
        """The model and RankMemory under `key`, from `load()` (model, kernel set, RankMemory) the first time."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                model, _, memory = load()
                entry = self._entries[key] = _Entry(model, memory)
            return entry.model, entry.memory

    def hold(self, model: LlamaModel) -> None:
        """An engine over `model` is built (EngineCore counts itself once its build succeeded)."""
        self._count(model, 1)

    def give_back(self, model: LlamaModel) -> None:
        """An engine over `model` closed (the model stays loaded for the next one)."""
        self._count(model, -1)

    def _count(self, model: LlamaModel, change: int) -> None:
        with self._lock:
            for entry in self._entries.values():
                if entry.model is model:
                    entry.users = max(0, entry.users + change)  # (a core closed twice counts once)

    def users(self, model: LlamaModel) -> int:
        """Live engines over `model` (0 for a model not held here)."""
        with self._lock:
            return sum(e.users for e in self._entries.values() if e.model is model)

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        """Forgets every model (engines still open keep theirs)."""
        with self._lock:
            self._entries.clear()
