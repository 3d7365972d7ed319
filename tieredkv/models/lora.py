"""LoRA adapters in PEFT's format on a Llama-family model: loading, checking against the base model, and the
low-rank products of a mixed batch.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` (what `PeftModel.save_pretrained`
writes). Its tensors `...layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and `...lora_B.weight` [out, r] change
one projection: `y = x W^T + scale * (x A^T) B^T`, with scale `lora_alpha / r` (`lora_alpha / sqrt(r)` under
rsLoRA; `rank_pattern` and `alpha_pattern` per module). The engine's projections are fused (q, k and v in one
`qkv_proj`, gate and up in one `gate_up_proj`), so an adapter's modules of one fused projection are kept as one
stacked A and one block-diagonal B^T whose columns are the fused output's (FusedDelta).

In a step, the rows of each adapter take their low-rank products beside the shared base product, which every row
takes whatever its adapter (as S-LoRA and Punica batch them); rows of the base model take none. `LoRABatch` groups
the rows per adapter, or for a step of few rows lays them out over a `LoRAStack` of the step's adapters and takes
one batched product for all (kernels/lora_rows.py; on CUDA kernels/lora_triton.py). The base weights may be in
any format (quantized included): the adapter adds to what the base product gives.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tieredkv.errors import LoRAError
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tp_shard import Shard

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MODULES = {  # PEFT's module name -> (the fused projection it is part of, its part's index)
    "q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0),
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass
class FusedDelta:
    """One adapter's change to one fused projection of one layer: `a` stacks the A of its modules [sum r, in],
    `bt` their B (scale folded in) transposed into one block-diagonal [sum r, lo:hi of the fused output]: module
    j's rows of `bt` are its ranks, its columns its slice of the output, so two products and one add serve every
    module of the projection."""

    a: torch.Tensor
    bt: torch.Tensor
    lo: int  # the output columns the adapter's modules cover: [lo, hi)
    hi: int

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None) -> None:
        """out[rows] += the adapter's product of x[rows] (rows None: every row)."""
        delta = ((x if rows is None else x.index_select(0, rows)) @ self.a.t()) @ self.bt
        if rows is None:
            out[:, self.lo:self.hi] += delta
        else:
            out[:, self.lo:self.hi].index_add_(0, rows, delta)


@dataclass
class LoRAAdapter:
    """An adapter loaded for one base model: its deltas per (layer, fused projection)."""

    name: str
    path: str
    digest: str  # SHA-256 of its config and weights: part of its block-hash chain
    rank: int  # the largest of its modules' ranks
    modules: list[str]
    deltas: dict[tuple[int, str], FusedDelta] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(d.a.nbytes + d.bt.nbytes for d in self.deltas.values())


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that names the module (a suffix match)."""
    for key, value in (patterns or {}).items():
        if re.search(rf"(^|\.){key}$", module_path):
            return value
    return default


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise LoRAError(f"{folder} has no {CONFIG}: not a PEFT adapter folder") from None
    except ValueError as e:
        raise LoRAError(f"{folder / CONFIG} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{folder}: only LoRA adapters are served (peft_type {config.get('peft_type')!r})")
    for key, bad, why in (("use_dora", True, "DoRA"), ("fan_in_fan_out", True, "fan_in_fan_out weights")):
        if config.get(key) == bad:
            raise LoRAError(f"{folder}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{folder}: adapters that train biases (bias={config['bias']!r}) are not supported")
    if config.get("modules_to_save"):
        raise LoRAError(f"{folder}: modules_to_save ({config['modules_to_save']}) replaces whole layers; only "
                        "low-rank deltas are supported")
    return config


def _spec_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each module's [out, in] in the whole (unsharded) model."""
    h, q, kv, i = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
        spec.intermediate_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h),
            "up_proj": (i, h), "down_proj": (h, i)}


def load_adapter(name: str, path: str | Path, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                 max_rank: int, shard: Shard = Shard()) -> LoRAAdapter:
    """Reads and checks a PEFT adapter folder against the base model (`spec`: the whole model's); LoRAError names
    what does not fit. Under tensor parallelism (`shard`) a rank keeps its part, as it does of the layer the
    adapter changes: B's rows of its outputs for q, k, v, gate and up (column-parallel), A's columns of its inputs
    for o and down (row-parallel: its partial sums are all-reduced with the layer's)."""
    folder = Path(path).expanduser()
    config, parts, digest = _read_folder(name, folder, spec)
    shapes = _spec_shapes(spec)
    fused: dict[tuple[int, str], list] = {}
    rank = 0
    for (layer, module), ab in sorted(parts.items()):
        a, b = _module_pair(name, layer, module, ab, shapes[module], max_rank, config, spec, shard)
        rank = max(rank, ab["A"].shape[0])
        group, index = MODULES[module]
        fused.setdefault((layer, group), []).append((index, a.to(device, dtype), b.to(device, dtype)))
    adapter = LoRAAdapter(name, str(folder), digest, rank, sorted({m for _, m in parts}))
    _fuse(adapter, fused, _spec_shapes(shard.local_spec(spec)), dtype, device)  # the outputs as this rank holds them
    return adapter


def _read_folder(name: str, folder: Path, spec: ModelSpec) -> tuple[dict, dict, str]:
    """The adapter's config, its A and B tensors by (layer, module), and the digest of its files."""
    from safetensors import safe_open

    if not folder.is_dir():
        raise LoRAError(f"adapter {name!r}: {folder} is not a folder")
    config = _read_config(folder)
    weights = folder / WEIGHTS
    if not weights.is_file():
        raise LoRAError(f"adapter {name!r}: {folder} has no {WEIGHTS}")
    digest = hashlib.sha256((folder / CONFIG).read_bytes())
    with open(weights, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights), framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    raise LoRAError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder "
                                    f"layer's projection (targets: {', '.join(MODULES)})")
                layer, module, which = int(m.group(1)), m.group(2), m.group(3)
                if module not in MODULES:
                    raise LoRAError(f"adapter {name!r} targets {module!r}; supported: {', '.join(MODULES)}")
                if layer >= spec.num_layers:
                    raise LoRAError(f"adapter {name!r} changes layer {layer}; the model has {spec.num_layers}")
                parts.setdefault((layer, module), {})[which] = f.get_tensor(key)
    except LoRAError:
        raise
    except Exception as e:
        raise LoRAError(f"adapter {name!r}: cannot read {weights}: {e}") from e
    if not parts:
        raise LoRAError(f"adapter {name!r}: {weights} holds no LoRA weights")
    return config, parts, digest.hexdigest()


def _module_pair(name: str, layer: int, module: str, ab: dict[str, torch.Tensor], shape: tuple[int, int],
                 max_rank: int, config: dict, spec: ModelSpec, shard: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's A and B, checked against the layer's shape, this rank's part of them, B scaled by the
    adapter's alpha / r (or alpha / sqrt(r) with rsLoRA), each module's pattern taken into account."""
    if set(ab) != {"A", "B"}:
        raise LoRAError(f"adapter {name!r}: layer {layer} {module} lacks lora_{'A' if 'A' not in ab else 'B'}")
    a, b = ab["A"], ab["B"]
    out, inp = shape
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != inp or b.shape != (out, r):
        raise LoRAError(f"adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                        f"{tuple(b.shape)}; this model needs A [r, {inp}] and B [{out}, r]")
    if r > max_rank:
        raise LoRAError(f"adapter {name!r}: rank {r} exceeds max_lora_rank ({max_rank})")
    block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    module_path = f"model.layers.{layer}.{block}.{module}"
    where = shard.ranges(f"layers.{layer}.{block}.{module}.weight", spec)
    if where is not None:  # this rank's part of the layer: B's output rows, or A's input columns
        dim, runs = where
        if dim == 0:
            b = torch.cat([b[r0:r1] for r0, r1 in runs])
        else:
            a = torch.cat([a[:, c0:c1] for c0, c1 in runs], dim=1)
    r_cfg = _pattern_value(config.get("rank_pattern"), module_path, config.get("r", r))
    alpha = float(_pattern_value(config.get("alpha_pattern"), module_path, config.get("lora_alpha", r_cfg)))
    scale = alpha / math.sqrt(r) if bool(config.get("use_rslora", False)) else alpha / r
    return a, b * scale


def _fuse(adapter: LoRAAdapter, fused: dict[tuple[int, str], list], shapes: dict, dtype: torch.dtype,
          device: torch.device) -> None:
    """Each fused projection's modules as one delta (adapter.deltas): A stacked, B^T placed at each module's
    outputs within the projection's, for `shapes` (this rank's)."""
    offsets = {"qkv": _offsets([shapes["q_proj"][0], shapes["k_proj"][0], shapes["v_proj"][0]]),
               "gate_up": _offsets([shapes["gate_proj"][0], shapes["up_proj"][0]]),
               "o": _offsets([shapes["o_proj"][0]]), "down": _offsets([shapes["down_proj"][0]])}
    for (layer, group), items in fused.items():
        items.sort(key=lambda t: t[0])
        lo, hi = offsets[group][items[0][0]][0], offsets[group][items[-1][0]][1]
        bt = torch.zeros(sum(a.shape[0] for _, a, _ in items), hi - lo, dtype=dtype, device=device)
        r0 = 0
        for index, a, b in items:
            o0, o1 = offsets[group][index]
            bt[r0 : r0 + a.shape[0], o0 - lo : o1 - lo] = b.t()
            r0 += a.shape[0]
        adapter.deltas[(layer, group)] = FusedDelta(torch.cat([a for _, a, _ in items]).contiguous(), bt, lo, hi)


def _offsets(sizes: list[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for n in sizes:
        out.append((at, at + n))
        at += n
    return out


PROJECTIONS = ("qkv", "o", "gate_up", "down")


class LoRAStack:
    """Several adapters' deltas stacked per (layer, projection): A [adapters, rank, in] and B^T [adapters, rank, out
    of the whole fused projection], zero where an adapter's rank is smaller than the largest or where it leaves a
    projection alone. A step of few rows over several adapters lays its rows out per adapter ([adapters, m], m the
    most rows any adapter has, padded) and takes two batched products per projection (as Punica's and S-LoRA's
    kernels gather them), whatever the number of adapters: on CPU each operation costs tens of microseconds however
    small, so four per adapter and projection cost more than the arithmetic."""

    def __init__(self, adapters: list[LoRAAdapter], num_layers: int):
        self.adapters = adapters
        self.index = {id(a): k for k, a in enumerate(adapters)}
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.bt: dict[tuple[int, str], torch.Tensor] = {}
        for proj in PROJECTIONS:
            rank = max((d.a.shape[0] for a in adapters for (_, p), d in a.deltas.items() if p == proj), default=0)
            for layer in range(num_layers):
                deltas = [a.deltas.get((layer, proj)) for a in adapters]
                present = [d for d in deltas if d is not None]
                if not present:
                    continue
                like, width = present[0], max(d.hi for d in present)
                a3 = like.a.new_zeros(len(adapters), rank, like.a.shape[1])
                bt3 = like.bt.new_zeros(len(adapters), rank, width)
                for k, d in enumerate(deltas):
                    if d is not None:
                        a3[k, : d.a.shape[0]] = d.a
                        bt3[k, : d.a.shape[0], d.lo : d.hi] = d.bt
                self.a[(layer, proj)], self.bt[(layer, proj)] = a3, bt3

    def layout(self, row_adapters: list[LoRAAdapter | None],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rows per adapter: indices [adapters, m] (padding: row 0) and each adapter's count of rows
        [adapters] int32, m the most rows one adapter has."""
        per: list[list[int]] = [[] for _ in self.adapters]
        for row, adapter in enumerate(row_adapters):
            if adapter is not None:
                per[self.index[id(adapter)]].append(row)
        m = max(len(rows) for rows in per)
        index = torch.tensor([rows + [0] * (m - len(rows)) for rows in per], dtype=torch.int64)
        counts = torch.tensor([len(rows) for rows in per], dtype=torch.int32)
        return index.to(device), counts.to(device)


class LoRABatch:
    """A step's adapters: (adapter, the token rows it owns; None for every row) for each adapter in the step; or,
    for a step of few rows, a LoRAStack of them all with each projection's row masks."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor | None]], stack: LoRAStack | None = None,
                 layout: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.groups, self.stack = groups, stack
        if layout is not None:
            self.index, self.counts = layout
            if self.index.is_cuda:  # the Triton kernel (kernels/lora_triton.py); its torch reference elsewhere
                from tieredkv.kernels.lora_triton import lora_rows

                self.rows_product = lora_rows
            else:
                from tieredkv.kernels.lora_rows import lora_rows_ref, padding_mask

                keep = {}  # the padding mask by dtype, made once a step

                def rows_product(out, x, index, counts, a3, bt3):
                    if x.dtype not in keep:
                        keep[x.dtype] = padding_mask(index, counts, x.dtype)
                    return lora_rows_ref(out, x, index, counts, a3, bt3, keep[x.dtype])

                self.rows_product = rows_product

    def add(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """out (the base product of x for this projection) plus each adapter's low-rank product on its rows."""
        if self.stack is not None:
            a3 = self.stack.a.get((layer, projection))
            if a3 is not None:
                self.rows_product(out, x, self.index, self.counts, a3, self.stack.bt[(layer, projection)])
            return out
        for adapter, rows in self.groups:
            delta = adapter.deltas.get((layer, projection))
            if delta is not None:
                delta.add_to(out, x, rows)
        return out
