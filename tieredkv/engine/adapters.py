"""The engine's LoRA adapters by name, and the block-hash chain seed of each request (an adapter, a cache salt).

Adapters are registered by name and folder (at start, `EngineConfig.lora_adapters`; at run time, `register`).
At most `max_loras` are held in memory; using another reads it from its folder again, dropping the least recently
used one (a request that holds an adapter keeps it until it ends). Everything here runs on the engine's thread.

Isolation: a request's blocks hash in a chain seeded by the engine's root, the adapter's name and weight digest,
and the request's cache salt (`root_for`), so blocks computed under two adapters, or two salts, never match, in
any tier; the same adapter and salt give the same seed in every process, so cold and remote entries serve again.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import torch

from tieredkv.errors import LoRAError
from tieredkv.hashing import BlockHash
from tieredkv.models.lora import LoRAAdapter, LoRAStack, load_adapter
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_shard import Shard

log = logging.getLogger("tieredkv")

STACKS = 2  # stacked adapter sets kept (each holds a copy of its adapters' deltas)


class Adapters:
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, root: BlockHash | None,
                 max_loras: int, max_rank: int, shard: Shard = Shard(), leader=None):
        """`spec`: the whole model's; `shard`: this rank's part under tensor parallelism; `leader`: rank 0's
        group, which tells the other ranks to register and unregister adapters as this one does."""
        self.spec, self.dtype, self.device, self.root = spec, dtype, device, root
        self.max_loras, self.max_rank, self.shard, self.leader = max_loras, max_rank, shard, leader
        self.paths: dict[str, str] = {}  # every registered adapter's folder
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # in memory, least recently used first
        self.loads = 0  # reads of adapter folders (at registration and again after an eviction)
        self._stacks: OrderedDict[tuple[int, ...], LoRAStack] = OrderedDict()  # by the adapters a step holds

    def stack(self, adapters: list[LoRAAdapter]) -> LoRAStack:
        """These adapters' deltas stacked (models/lora.py), for steps of few rows over several adapters; the last
        STACKS sets are kept, so that a run of steps over the same adapters builds theirs once."""
        key = tuple(sorted(id(a) for a in adapters))
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = LoRAStack(sorted(adapters, key=id), self.spec.num_layers)
            while len(self._stacks) > STACKS:
                self._stacks.popitem(last=False)
        self._stacks.move_to_end(key)
        return stack

    def names(self) -> list[str]:
        return list(self.paths)

    def register(self, name: str, path: str) -> LoRAAdapter:
        """Reads and checks the adapter, then serves it under `name` (LoRAError when it cannot be)."""
        if not isinstance(name, str) or not name or name == "default":
            raise LoRAError(f"adapter name {name!r} is empty or the default model's")
        if name in self.paths:
            raise LoRAError(f"an adapter named {name!r} is loaded already (unload it first)")
        adapter = self._read(name, path)
        self.paths[name] = str(path)
        self._keep(adapter)
        if self.leader is not None:  # checked here first: the other ranks read the same folder
            self.leader.step(control=[("lora", "register", name, str(path))])
        log.info("LoRA adapter %r loaded from %s: modules %s, rank %d, %.1f MiB", name, path,
                 ",".join(adapter.modules), adapter.rank, adapter.nbytes / 2**20)
        return adapter

    def unregister(self, name: str) -> None:
        if not isinstance(name, str) or name not in self.paths:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        del self.paths[name]
        self.loaded.pop(name, None)  # requests running with it keep their reference until they end
        self._stacks.clear()
        if self.leader is not None:
            self.leader.step(control=[("lora", "unregister", name)])

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter a new request runs with, read from its folder again when it was evicted."""
        adapter = self.loaded.get(name)
        if adapter is not None:
            self.loaded.move_to_end(name)
            return adapter
        if name not in self.paths:
            raise LoRAError(f"no adapter named {name!r} is loaded")
        adapter = self._read(name, self.paths[name])
        self._keep(adapter)
        return adapter

    def _read(self, name: str, path: str) -> LoRAAdapter:
        self.loads += 1
        return load_adapter(name, path, self.spec, self.dtype, self.device, self.max_rank, self.shard)

    def _keep(self, adapter: LoRAAdapter) -> None:
        self.loaded[adapter.name] = adapter
        while len(self.loaded) > self.max_loras:
            name, _ = self.loaded.popitem(last=False)
            self._stacks.clear()
            log.info("LoRA adapter %r evicted from memory (max_loras %d); read again when used", name,
                     self.max_loras)

    def root_for(self, adapter: LoRAAdapter | None, cache_salt: str | None) -> BlockHash | None:
        """The block-hash chain seed of a request under this adapter and salt (None: the engine's own)."""
        if adapter is None and cache_salt is None:
            return None
        h = hashlib.sha256(self.root)
        if adapter is not None:
            h.update(b"\x00lora\x00" + adapter.name.encode() + b"\x00" + adapter.digest.encode())
        if cache_salt is not None:
            h.update(b"\x00salt\x00" + cache_salt.encode())
        return BlockHash(h.digest())
