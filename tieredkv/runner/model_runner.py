"""Turns a scheduler decision into one batched forward pass over the paged KV cache."""

from __future__ import annotations

import time
from collections import Counter
from typing import Callable, NamedTuple
from typing import Sequence as Seq

import torch

from tieredkv.core.scheduler import SchedulerOutput
from tieredkv.core.sequence import Sequence
from tieredkv.errors import EngineClosedError, RankLostError
from tieredkv.kernels import KernelOps
from tieredkv.kernels.calls import counting, record
from tieredkv.kernels.cascade import MIN_PREFIX_TOKENS, shared_prefixes
from tieredkv.models.batch import AttentionMetadata, ForwardBatch, scratch_block
from tieredkv.models.llama import LlamaModel
from tieredkv.models.lora import LoRAAdapter, LoRABatch, LoRAStack
from tieredkv.runner.compiled_decode import CompiledDecode
from tieredkv.runner.far_stage import StagePlan, plan_stage, reads_slab_in_place, stage_groups
from tieredkv.runner.native_decode import NativeDecode
from tieredkv.runner.step_plan import StandIn, adapter_of, describe


STACK_ROWS = 256  # steps of at most this many rows over several adapters take the stacked products (models/lora.py)


def warmup_steps(block_size: int) -> tuple:
    """The warm-up's steps as (decode context lengths, prefill chunks as (tokens, context)): a decode of
    one split beside a prefill chunk; two decodes over shared full blocks, enough to be a cascade (the
    prefix kernel, split-K and the merge)."""
    n, shared = min(block_size, 4), -(-MIN_PREFIX_TOKENS // block_size) * block_size
    return (([1], [(n, n)]), ([shared + 1] * 2, []))


class _TokenRows(NamedTuple):
    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    logits_rows: list[int]
    sampled: list[Sequence]


class ModelRunner:
    """Builds each step's batch and runs the forward over the engine's KV cache tensor
    [num_layers, 2, num_blocks (+ far slots on CPU), block_size, num_kv_heads, head_dim], which the
    engine allocates and the tiers and the model write into (the runner reads block ids, nothing more)."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, ops: KernelOps,
                 cascade: bool = True, compiled: CompiledDecode | NativeDecode | None = None,
                 far: tuple[int, torch.Tensor] | None = None, leader=None):
        self.model = model
        # rank 0 of a tensor-parallel group (engine/ranks.py LeaderGroup): each forward's plan and the warm-up
        # are sent to the other ranks, which run them on their shares in lockstep
        self.leader = leader
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.ops = ops
        # what attention computes in: the cache's dtype, unless it stores K/V in a format of its own (ops.kv)
        self.dtype = ops.kv.dtype if ops.kv is not None else kv_cache.dtype
        self.device = kv_cache.device
        self.cascade = cascade
        self.compiled = compiled  # what runs a step that decodes one sequence (compiled graph or native step), if on
        # (adapters) -> their LoRAStack (engine/adapters.py), when the engine serves adapters
        self.lora_stack: Callable[[list[LoRAAdapter]], LoRAStack] | None = None
        self.warmed_up = False
        # far: where far blocks (ids >= base) are not in the cache tensor, the first far id and the warm slab;
        # steps that use them stage them (far_stage.py), at most a hot pool's worth (base) of far blocks
        # per forward: a step that holds more runs as several
        self.far_base, self.far_slab = far if far is not None else (None, None)
        # whether the copy kernel reads far blocks from the (pinned) slab in place: decided once, the slab is fixed
        self.far_in_place = far is not None and reads_slab_in_place(self.far_slab, self.device)
        # the next layer's far blocks are copied on this stream while a layer computes (far_stage.StagePlan)
        self.stage_stream = torch.cuda.Stream(self.device) if far is not None and self.device.type == "cuda" else None
        self.staged_steps = 0
        self.read_ahead_layers = self.late_layers = 0  # staged layers read ahead / copied at their gather
        self.peak_staged_blocks = 0  # the largest staging buffer a step used, in blocks of one layer
        self.kernel_calls: Counter = Counter()  # (kind, implementation) -> calls in its forwards (kernels/calls.py)
        self._c_attention = False  # attention in the CPU kernels, once seen (same_bits_on_fewer_threads)

    def _table_ids(self, seqs: list[Sequence]) -> tuple[list[list[int]], StagePlan | None]:
        """Each sequence's block ids as the kernels index them, and the staging plan when they need one."""
        tables = [[b.block_id for b in s.block_table] for s in seqs]
        if self.far_base is None or all(i < self.far_base for t in tables for i in t):
            return tables, None
        stage, tables = plan_stage(tables, self.far_base, self.far_slab, self.device, self.far_in_place,
                                   self.stage_stream)
        self.staged_steps += 1
        self.peak_staged_blocks = max(self.peak_staged_blocks, stage.num_blocks)
        return tables, stage

    def prepare(self, scheduled: list[tuple[Sequence, int]],
                with_plan: bool = True) -> tuple[ForwardBatch, list[Sequence]]:
        """Builds the batch; returns it with the sequences whose next token is sampled this step, in the order
        of the logits rows (a sequence with drafts once per row: after its last token, then after each draft).
        `with_plan=False` leaves out the decode plan (the compiled path
        has none)."""
        # decodes sorted by context length, so that the torch decode attention's length groups are runs
        decodes = sorted(((s, n) for s, n in scheduled if n == 1), key=lambda sn: sn[0].num_computed_tokens)
        prefills = [(s, n) for s, n in scheduled if n > 1]
        tokens = self._token_rows(decodes + prefills)
        ids, stage = self._table_ids([s for s, _ in decodes + prefills])
        attn = self._attention(decodes, prefills, ids[: len(decodes)], ids[len(decodes) :], with_plan, stage)
        batch = ForwardBatch(
            input_ids=self._tensor(tokens.input_ids, torch.int64),
            positions=self._tensor(tokens.positions, torch.int64),
            slot_mapping=self._tensor(tokens.slots, torch.int64),
            logits_indices=self._tensor(tokens.logits_rows, torch.int64),
            attn=attn,
            lora=self._lora(decodes + prefills),
        )
        return batch, tokens.sampled

    def _lora(self, rows: list[tuple[Sequence, int]]) -> LoRABatch | None:
        """The step's adapters and the token rows of each (rows in the order _token_rows lays them out)."""
        groups: dict[int, tuple[LoRAAdapter, list[int]]] = {}
        at = 0
        for seq, n in rows:
            adapter = adapter_of(seq)
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].extend(range(at, at + n))
            at += n
        if not groups:
            return None
        if len(groups) > 1 and at <= STACK_ROWS and self.lora_stack is not None:
            stack = self.lora_stack([adapter for adapter, _ in groups.values()])
            per_row = [adapter_of(seq) for seq, n in rows for _ in range(n)]
            return LoRABatch([], stack, stack.layout(per_row, self.device))
        return LoRABatch([(adapter, None if len(ids) == at else self._tensor(ids, torch.int64))
                          for adapter, ids in groups.values()])

    def _token_rows(self, scheduled: list[tuple[Sequence, int]]) -> "_TokenRows":
        """Each scheduled token's id, position and cache slot, in order, and the rows whose logits are sampled."""
        bs, rows = self.block_size, _TokenRows([], [], [], [], [])
        for seq, n in scheduled:
            start, table, at = seq.num_computed_tokens, seq.block_table, len(rows.input_ids)
            rows.input_ids.extend(seq.step_token_ids(n))
            rows.positions.extend(range(start, start + n))
            rows.slots.extend(table[p // bs].block_id * bs + p % bs for p in range(start, start + n))
            # a row from the sequence's last token on: its next token, then after each draft the one that follows
            for p in range(max(start, seq.num_tokens - 1), start + n):
                rows.logits_rows.append(at + p - start)
                rows.sampled.append(seq)
        return rows

    def _attention(self, decodes: list[tuple[Sequence, int]], prefills: list[tuple[Sequence, int]],
                   decode_ids: list[list[int]], prefill_ids: list[list[int]], with_plan: bool,
                   stage: StagePlan | None) -> AttentionMetadata:
        query_start = [0]
        for _, n in prefills:
            query_start.append(query_start[-1] + n)
        decode_tables = self._block_tables(decode_ids)
        host_lens = [s.num_computed_tokens + 1 for s, _ in decodes]
        decode_lens = self._tensor(host_lens, torch.int32)
        plan = None
        if with_plan and decodes and self.ops.plan_decode is not None:
            prefixes = self._prefixes(decodes, decode_ids) or None
            plan = self.ops.plan_decode(decode_tables, decode_lens, self.block_size, self.dtype, prefixes,
                                        host_lens=host_lens, host_tables=decode_ids)
        meta = AttentionMetadata(
            num_decode_tokens=len(decodes),
            decode_block_tables=decode_tables,
            decode_context_lens=decode_lens,
            decode_plan=plan,
            max_decode_context_len=max(host_lens, default=0),
            prefill_block_tables=self._block_tables(prefill_ids),
            prefill_query_start_loc=self._tensor(query_start, torch.int32),
            prefill_context_lens=self._tensor([s.num_computed_tokens + n for s, n in prefills], torch.int32),
            max_prefill_query_len=max((n for _, n in prefills), default=0),
            prefill_plan=self._prefixes(prefills, prefill_ids) or None,
            stage=stage,
        )
        if stage is not None:  # attention reads the buffer the tables' far blocks are staged into
            meta.read = stage.gather
        return meta

    def compile_now(self, background: bool = False) -> None:
        """Compiles what would otherwise compile on the first request: every Triton kernel variant a step
        uses, and the compiled decode graph (with `background`, on a thread of its own while the eager
        forward serves: CompiledDecode.start_background)."""
        if self.ops.name == "triton":
            if self.leader is not None:
                self.leader.step(warmup=True)
            self.warmup()
        if self.compiled is not None:
            if background:
                self.compiled.start_background()
            else:
                self.compiled.warmup()

    @property
    def decode_path(self) -> str:
        """What runs a step that decodes one sequence: "native" (runner/native_decode.py), "compiled",
        "compiling" (the eager forward until the graph is ready) or "eager"."""
        return "eager" if self.compiled is None else self.compiled.state

    @torch.inference_mode()
    def warmup(self) -> None:
        """Runs every kernel variant a step can ask for, so that all are compiled before the first request:
        the Triton kernels' compile-time parameters are fixed per model and device (triton_ops.py), so two
        forwards over the scratch block (warmup_steps) and the block copies cover them.
        tests/kernels/test_kernel_variants.py checks that no workload asks for another."""
        for decode_lens, prefills in warmup_steps(self.block_size):
            batch = self.synthetic_step(decode_lens, prefills)
            self.model.forward(batch, self.kv_cache, self.ops)  # not __call__: llama.py, FORWARD_ONLY
        kv, ids = self.kv_cache, torch.tensor([scratch_block(self.kv_cache)], device=self.device)
        out = torch.empty((1, kv.shape[0], 2, *kv.shape[3:]), dtype=kv.dtype, device=kv.device)
        self.ops.gather_blocks(kv, ids, out)  # as HotTier calls them
        self.ops.scatter_blocks(kv, ids, out)
        self.ops.copy_blocks(kv, ids, ids)
        self.warmed_up = True

    @torch.inference_mode()
    def time_prefill(self, tokens: int) -> tuple[int, float]:
        """(tokens, seconds) of one forward of a `tokens`-long prompt chunk over the scratch block (no request's
        KV): the prefill rate before any request has been measured."""
        batch = self.synthetic_step([], [(tokens, tokens)])
        self.model.forward(batch, self.kv_cache, self.ops)  # once to warm up, then timed
        t0 = time.perf_counter()
        self.model.forward(batch, self.kv_cache, self.ops)
        return tokens, time.perf_counter() - t0

    def synthetic_step(self, decode_lens: list[int], prefills: Seq[tuple[int, int]] = ()) -> ForwardBatch:
        """A batch shaped like a step with these decodes (context lengths, >= 1) and prefill chunks (tokens,
        context after the chunk), built by the same code as a real step's, every block in it the scratch
        block (no sequence's; its contents are garbage, and so is what the forward computes from it)."""
        bs, scratch = self.block_size, scratch_block(self.kv_cache)

        def seq(num_computed: int, n: int):
            total = num_computed + n
            return StandIn(num_computed, total, [0] * total, [scratch] * -(-total // bs))

        decodes = [(seq(n - 1, 1), 1) for n in sorted(decode_lens)]
        chunks = [(seq(ctx - n, n), n) for n, ctx in prefills]
        tokens = self._token_rows(decodes + chunks)
        ids = [[scratch] * len(s.block_table) for s, _ in decodes + chunks]
        attn = self._attention(decodes, chunks, ids[: len(decodes)], ids[len(decodes) :], True, None)
        return ForwardBatch(input_ids=self._tensor(tokens.input_ids, torch.int64),
                            positions=self._tensor(tokens.positions, torch.int64),
                            slot_mapping=self._tensor(tokens.slots, torch.int64),
                            logits_indices=self._tensor(tokens.logits_rows, torch.int64), attn=attn)

    def _prefixes(self, scheduled: list[tuple[Sequence, int]], ids: list[list[int]]) -> list[tuple[list[int], int]]:
        """Rows (of `scheduled`; `ids` their tables) that share leading cached blocks, for cascade
        attention: blocks wholly before the first position each row computes this step."""
        if not self.cascade or len(scheduled) < 2:
            return []
        return shared_prefixes(ids, [s.num_computed_tokens + 1 for s, _ in scheduled], self.block_size)

    def same_bits_on_fewer_threads(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """Whether this step's forward gives the same bits on fewer threads than the engine's (platform/cpu_share.py):
        its attention in the CPU kernels (splits follow the engine's count) and its products each output one
        thread's sum. Not where torch's own reductions would serve a part, whose partition follows the team: the
        torch references, cascade attention over a shared prefix (two decodes that share their first block may
        take it), LoRA rows."""
        if not self._c_attention:  # (asked again until true: the operators may be bound after the first steps)
            from tieredkv.kernels.decode_attention import paged_decode_usable

            spec = self.model.spec
            query = torch.empty(1, spec.num_heads, spec.head_dim)
            self._c_attention = self.ops.name == "cpu" and paged_decode_usable(query, self.kv_cache[0][0], self.ops.kv)
        if not self._c_attention or any(adapter_of(s) is not None for s, _ in scheduled):
            return False
        if self.cascade:
            firsts = [s.block_table[0].block_id for s, _ in scheduled if s.block_table and s.num_computed_tokens]
            if len(set(firsts)) < len(firsts):
                return False
        return True

    def _tensor(self, values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _block_tables(self, ids: list[list[int]]) -> torch.Tensor:
        width = max((len(t) for t in ids), default=0)
        rows = [t + [0] * (width - len(t)) for t in ids]
        return torch.tensor(rows, dtype=torch.int32).reshape(len(ids), width).to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs the forward (block moves were carried out before); returns fp32 logits [S, vocab] and
        their sequences. Where far blocks are staged, the step runs as one forward per group of sequences
        whose far blocks fit the staging cap (far_stage.stage_groups)."""
        if self.far_base is None:
            return self.forward_rows(out.scheduled)
        base = self.far_base
        groups = stage_groups(out.scheduled, lambda s: sum(b.block_id >= base for b in s.block_table), base)
        if len(groups) == 1:
            return self.forward_rows(groups[0])
        parts = [self.forward_rows(group) for group in groups]
        return torch.cat([logits for logits, _ in parts]), [seq for _, seqs in parts for seq in seqs]

    @torch.inference_mode()
    def forward_rows(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor | None, list[Sequence]]:
        """One forward over these (sequence, tokens this step) rows (on a tensor-parallel rank other than 0:
        stand-ins rebuilt from rank 0's plan, and no logits come back). On rank 0, a forward that fails once
        the other ranks run the step leaves them inside its collectives: the group is then broken
        (RankLostError), the engine closes rather than send them the next command out of step."""
        if self.leader is None:
            return self._forward_rows(scheduled)
        self.leader.step(describe(scheduled))
        try:
            return self._forward_rows(scheduled)
        except EngineClosedError:
            raise
        except Exception as e:
            self.leader.broken = e
            raise RankLostError(f"rank 0's forward failed while the other ranks ran it ({e!r}): the "
                                "tensor-parallel ranks are out of step") from e

    def _forward_rows(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor | None, list[Sequence]]:
        with counting(self.kernel_calls):
            return self._counted_forward(scheduled)

    def _counted_forward(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor | None, list[Sequence]]:
        compiled = (self.compiled is not None and self.compiled.accepts(scheduled)  # (adapters: the eager forward)
                    and all(adapter_of(s) is None for s, _ in scheduled))
        batch, sampled = self.prepare(scheduled, with_plan=not compiled)
        logits = None
        if compiled and batch.attn.stage is None:
            # one decode; (the native step) one sequence's last token and drafts, or a few sequences' rows (decodes,
            # verifications, short prompt chunks), a table a row
            a = batch.attn
            if len(scheduled) > 1 and a.max_prefill_query_len:
                tables, lens = a.row_tables(), None
            elif a.num_decode_tokens:
                tables, lens = a.decode_block_tables, a.decode_context_lens
            else:
                tables, lens = a.prefill_block_tables, a.prefill_context_lens
            with counting(None):  # the graph's or the C step's calls: counted as its forward
                logits = self.compiled.run(batch.input_ids, batch.positions, batch.slot_mapping, tables, lens)
            if logits is not None:
                record("forward", "native step" if self.compiled.state == "native" else "compiled graph")
                if logits.shape[0] != batch.logits_indices.shape[0]:  # a prompt chunk: its last
                    logits = logits[batch.logits_indices]
        if logits is None:
            record("forward", "eager")
            logits = self.model.forward(batch, self.kv_cache, self.ops)  # not __call__: llama.py, FORWARD_ONLY
        stage = batch.attn.stage
        if stage is not None:
            self.read_ahead_layers += stage.read_ahead_layers
            self.late_layers += stage.late_layers
        return logits, sampled
