"""Which part of a model one tensor-parallel rank holds (Megatron-style): q/k/v and gate/up split by output rows
(column-parallel), o and down by input columns (row-parallel), the embedding table and the LM head by vocabulary
rows; norms whole on every rank.

KV heads are split in contiguous runs, each rank taking the query heads of its KV heads (their GQA groups), so a
rank's attention needs no other rank's heads. Sizes that do not divide evenly are split as evenly as they can be,
the first ranks taking one more: the default model's 3 KV heads (9 query heads) are 2 + 1 at two ranks. More ranks
than KV heads is an error (vLLM replicates KV heads there; not built here)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from tieredkv.models.spec import ModelSpec

Ranges = list[tuple[int, int]]  # [start, stop) runs of a tensor's dimension, concatenated in order


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`; Shard() is the whole model."""

    rank: int = 0
    world: int = 1

    def split(self, n: int, rank: int | None = None) -> tuple[int, int]:
        """[start, stop) of n items that `rank` (default: this one) holds: contiguous, the sizes differing
        by at most one, the first ranks the larger."""
        rank = self.rank if rank is None else rank
        base, extra = divmod(n, self.world)
        start = rank * base + min(rank, extra)
        return start, start + base + (rank < extra)

    def sizes(self, n: int) -> list[int]:
        """Each rank's share of n items, rank order."""
        return [b - a for a, b in (self.split(n, r) for r in range(self.world))]

    def kv_heads(self, spec: ModelSpec) -> tuple[int, int]:
        return self.split(spec.num_kv_heads)

    def q_heads(self, spec: ModelSpec) -> tuple[int, int]:
        group = spec.num_heads // spec.num_kv_heads
        start, stop = self.kv_heads(spec)
        return start * group, stop * group

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec this rank's model is built from: its heads, its share of the MLP and of the vocabulary."""
        if self.world == 1:
            return spec
        check_shardable(spec, self.world)
        (k0, k1), (q0, q1), (i0, i1), (v0, v1) = (self.kv_heads(spec), self.q_heads(spec),
                                                  self.split(spec.intermediate_size), self.split(spec.vocab_size))
        return replace(spec, num_kv_heads=k1 - k0, num_heads=q1 - q0, intermediate_size=i1 - i0, vocab_size=v1 - v0)

    def ranges(self, name: str, spec: ModelSpec) -> tuple[int, Ranges] | None:
        """(dimension, runs) of the checkpoint tensor `name` (without the "model." prefix) this rank reads;
        None: the whole tensor (norms, and everything at world 1)."""
        if self.world == 1:
            return None
        d, q, kv, inter = spec.head_dim, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, \
            spec.intermediate_size
        (q0, q1), (k0, k1), (i0, i1) = self.q_heads(spec), self.kv_heads(spec), self.split(inter)
        qr, kr, ir = (q0 * d, q1 * d), (k0 * d, k1 * d), (i0, i1)
        rows = {
            "self_attn.q_proj": [qr], "self_attn.k_proj": [kr], "self_attn.v_proj": [kr],
            "self_attn.qkv_proj": [qr, _shift(kr, q), _shift(kr, q + kv)],  # stored fused (Phi-3)
            "mlp.gate_proj": [ir], "mlp.up_proj": [ir], "mlp.gate_up_proj": [ir, _shift(ir, inter)],
        }
        cols = {"self_attn.o_proj": [qr], "mlp.down_proj": [ir]}
        module, _, kind = name.rpartition(".")
        if module in ("embed_tokens", "lm_head"):
            return 0, [self.split(spec.vocab_size)]
        for table, dim in ((rows, 0), (cols, 1)):
            for suffix, runs in table.items():
                if module.endswith(suffix):
                    return (0 if kind == "bias" else dim), runs
        return None


    def shape(self, name: str, shape: tuple[int, ...], spec: ModelSpec) -> tuple[int, ...]:
        """The shape of this rank's part of checkpoint tensor `name` (whole: `shape`)."""
        where = self.ranges(name, spec)
        if where is None:
            return tuple(shape)
        dim, runs = where
        return tuple(sum(b - a for a, b in runs) if i == dim else n for i, n in enumerate(shape))


def _shift(r: tuple[int, int], by: int) -> tuple[int, int]:
    return r[0] + by, r[1] + by


def check_shardable(spec: ModelSpec, world: int) -> None:
    """A clear error where `world` ranks cannot split the model."""
    from tieredkv.errors import UnsupportedModelError

    if spec.num_kv_heads < world:
        raise UnsupportedModelError(
            f"tensor_parallel_size {world} is more than the model's num_key_value_heads ({spec.num_kv_heads}): "
            f"every rank needs at least one KV head (replicating KV heads across ranks is not supported); "
            f"use at most {spec.num_kv_heads}")
