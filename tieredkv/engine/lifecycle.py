"""The live requests on the engine's worker: how they enter, what happens to them after each forward
(computed tokens, forks, sampling, stop rules), and how they end. Every outcome is an `Output`."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from tieredkv.core.beam import BeamSearch
from tieredkv.core.kv_manager import KVCacheManager, cdiv
from tieredkv.core.pins import PinTable
from tieredkv.core.scheduler import Scheduler, SchedulerOutput
from tieredkv.core.sequence import Request, Sequence
from tieredkv.engine.isolation import isolated, stage_error
from tieredkv.engine.logits_processors import apply_processors
from tieredkv.engine.outputs import Output, StreamChunk, TokenLogprob, beam_chunk, make_chunk
from tieredkv.engine.request_factory import RequestFactory
from tieredkv.engine.sampler import NOT_FINITE, RowState, Sampled, bad_rows, sample
from tieredkv.engine.speculative import Speculator
from tieredkv.engine.telemetry import Telemetry
from tieredkv.errors import RequestError, SamplingError, StepError, TieredKVError
from tieredkv.models.detokenizer import IncrementalDetokenizer
from tieredkv.models.tokenizer import Tokenizer

log = logging.getLogger("tieredkv")


class Lifecycle:
    """`requests` maps each live request id to its request; a request leaves it when its last sample
    finishes, when it is aborted, or when it fails. Not thread-safe: the worker thread owns it."""

    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, factory: RequestFactory, tokenizer: Tokenizer,
                 pins: PinTable, telemetry: Telemetry, device: torch.device, max_model_len: int,
                 speculator: "Speculator | None" = None):
        self.scheduler = scheduler
        self.kv = kv
        self.factory = factory
        self.tokenizer = tokenizer
        self.pins = pins
        self.telemetry = telemetry
        self.device = device
        self.max_model_len = max_model_len
        self.speculator = speculator  # speculative decoding's controller (engine/speculative.py), or None
        self.requests: dict[str, Request] = {}

    # -- entering and ending ------------------------------------------------------------------------

    def add(self, req: Request) -> list[Output]:
        """Queues the request. One that cannot be served here gets its error as its only output;
        nothing else is touched."""
        try:
            if req.request_id in self.requests:
                raise RequestError(f"request id {req.request_id!r} is already in use")
            self.factory.check_fits(len(req.prompt_token_ids), req.params, self.pins.num_blocks)
            seq = self._new_sequence(req, 0, req.prompt_token_ids)
            if req.params.beam_search:
                req.beam = BeamSearch(req.params, req.stop_ids, len(req.prompt_token_ids), self.max_model_len)
        except Exception as e:
            self.telemetry.on_rejected()
            return [(req.sink, e if isinstance(e, TieredKVError) else RequestError(f"cannot admit the request: {e}"))]
        self.telemetry.on_added(req)
        req.seqs.append(seq)
        self.requests[req.request_id] = req
        self.scheduler.add(seq)
        return []

    def abort(self, request_id: str, sink: Any = None) -> list[Output]:
        """Finishes every sample of the request with "abort" and frees its blocks; returns final chunks.
        With `sink`, only the request delivering there is aborted (an id may have been reused since)."""
        req = self.requests.get(request_id)
        if req is None or (sink is not None and req.sink is not sink):
            return []
        del self.requests[request_id]
        self.telemetry.on_ended(req, "abort")
        if req.beam is not None:
            return self._end_beams(req, "abort")
        outputs: list[Output] = []
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                outputs.append((req.sink, make_chunk(seq, [], final=True)))
        return outputs

    def fail(self, req: Request, error: BaseException) -> list[Output]:
        """Ends a request with an error (its blocks freed); the error is its last output."""
        if self.requests.pop(req.request_id, None) is None:
            return []
        self.telemetry.on_ended(req, "error")
        for seq in req.seqs:
            self.scheduler.finish(seq, "error")
        return [(req.sink, error)]

    def fail_all(self, error: BaseException) -> list[Output]:
        return [out for req in list(self.requests.values()) for out in self.fail(req, error)]

    def fail_step(self, out: SchedulerOutput, error: BaseException) -> list[Output]:
        """A forward failed: every request it computed for ends with a StepError."""
        failed = {s.request.request_id: s.request for s, _ in out.scheduled}
        return [o for rid, req in failed.items() for o in self.fail(req, StepError([rid], error))]

    def fail_unschedulable(self, seq: Sequence) -> list[Output]:
        """Nothing runs and the head of the queue still cannot start: it never will, so it fails."""
        bs, pool = self.kv.block_size, self.kv.pool
        return self.fail(seq.request, RequestError(
            f"request {seq.request.request_id!r} cannot be scheduled: it needs {cdiv(seq.num_tokens, bs)}"
            f" KV blocks, the pool has {pool.num_blocks} of which {self.pins.num_blocks} are pinned"))

    # -- after the forward ------------------------------------------------------------------------

    def update(self, out: SchedulerOutput, logits: torch.Tensor, sampled: list[Sequence]) -> list[Output]:
        """Computed tokens and newly full blocks cached, then for each sampled sequence (its first logits row):
        the prompt's end for prefill-only requests, or forks and one sampled token per sample; then the drafts
        of sequences that carried some (_verify)."""
        for seq in out.preempted:
            seq.beam_row = None  # a preempted beam computes its row again
        for seq, n in out.scheduled:  # drafts count once verified (_verify)
            seq.num_computed_tokens += n - max(seq.num_computed_tokens + n - seq.num_tokens, 0)
            self.kv.cache_full_blocks(seq)
            if not seq.spec_tokens:  # (blocks taken for drafts the scheduler then cut: Scheduler._fit_draft_rows)
                self.kv.trim(seq)
        groups = _row_groups(sampled)
        verifying = [(seq, rows, seq.num_tokens) for seq, rows in groups if len(rows) > 1]
        outputs, rows, seqs = [], [], []
        for seq, seq_rows in groups:
            i, req = seq_rows[0], seq.request
            if req.keep is not None or req.mark_prompt:
                failed = self._keep(seq)
                if failed is not None:
                    outputs.extend(failed)
                    continue
            if req.prefill_only:
                try:
                    outputs.extend(self._finish_prefill(seq))
                except Exception as e:
                    outputs.extend(self.fail(req, RequestError(f"finishing the prefill failed: {e!r}")))
                continue
            try:
                family = [seq] + self._fork(seq)
            except Exception as e:
                outputs.extend(self.fail(req, RequestError(f"forking the samples failed: {e}")))
                continue
            rows.extend([i] * len(family))
            seqs.extend(family)
        if seqs:
            first = logits if rows == list(range(len(sampled))) else logits[rows]
            outputs.extend(self._sample(first, seqs, [s.spec_tokens[0] if s.spec_tokens else None for s in seqs]))
        if verifying:
            try:
                outputs.extend(self._verify(logits, verifying))
            except Exception as e:  # a fault in the verification fails the requests that drafted, no others
                log.exception("verifying drafts failed")
                for req in {seq.request.request_id: seq.request for seq, _, _ in verifying}.values():
                    outputs.extend(self.fail(req, StepError([req.request_id], e)))
        return outputs

    def _verify(self, logits: torch.Tensor, verifying: list[tuple[Sequence, list[int], int]]) -> list[Output]:
        """Speculative decoding: each (sequence, its logits rows, its length before the step) sampled its first
        row with the rest; row j + 1 is sampled, exactly as a plain decode step would sample it after the tokens
        so far (grammar, processors, stop rules), only while the token row j gave is draft j. Then the accepted
        drafts count as computed, the blocks past them are freed, and nothing a rejected draft wrote is ever
        read or cached (a block is hashed once full of computed tokens)."""
        outputs, accepted = [], {seq: 0 for seq, _, _ in verifying}
        for seq, _, _ in verifying:  # (accepted drafts are counted as they are taken: _accept)
            seq.request.spec_drafted += len(seq.spec_tokens)
        pending = verifying
        for j in range(max(len(seq.spec_tokens) for seq, _, _ in verifying)):
            pending = [(seq, rows, base) for seq, rows, base in pending if self._took_draft(seq, base, j)]
            for seq, _, _ in pending:
                accepted[seq] = j + 1
            pending = [(seq, rows, base) for seq, rows, base in pending
                       if not seq.is_finished and seq.request.request_id in self.requests]
            if not pending:
                break
            seqs = [seq for seq, _, _ in pending]
            drafts = [seq.spec_tokens[j + 1] if j + 1 < len(seq.spec_tokens) else None for seq in seqs]
            outputs.extend(self._sample(logits[[rows[j + 1] for _, rows, _ in pending]], seqs, drafts))
        for seq, _, _ in verifying:
            if not seq.is_finished:
                seq.num_computed_tokens += accepted[seq]
                self.kv.cache_full_blocks(seq)
                self.kv.trim(seq)
            if self.speculator is not None:
                self.speculator.verified(seq, len(seq.spec_tokens), accepted[seq])
                self.telemetry.on_verified(self.speculator.proposer.name, len(seq.spec_tokens), accepted[seq])
            seq.spec_tokens = []
        return outputs

    @staticmethod
    def _took_draft(seq: Sequence, base: int, j: int) -> bool:
        """Whether seq (`base` tokens long before the step) has a token j and it is its draft j."""
        return (j < len(seq.spec_tokens) and len(seq.token_ids) > base + j
                and seq.token_ids[base + j] == seq.spec_tokens[j])

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence],
                drafts: list[int | None] | None = None) -> list[Output]:
        """One token per sequence (beams: one search step per request). Each stage runs batched; one that
        raises runs again row by row (engine/isolation.py), so that a failure fails only its own request.
        `drafts`: the proposed token each row verifies (speculative decoding), or None."""
        outputs = []
        beams = [i for i, s in enumerate(seqs) if s.request.beam is not None]
        if beams:
            outputs.extend(self._beam_rows(logits[beams], [seqs[i] for i in beams]))
            rest = [i for i, s in enumerate(seqs) if s.request.beam is None]
            logits, seqs = logits[rest], [seqs[i] for i in rest]
            if not seqs:
                return outputs
        guided = [i for i, s in enumerate(seqs) if s.request.params.constraint is not None]
        if guided:  # masking is idempotent: rows a failed batched call masked already are masked again alike
            outputs.extend(self._fail_rows(seqs, guided, isolated(
                "structured output", guided, lambda rows: self._mask_by_grammar(logits, seqs, rows),
                lambda i: seqs[i].request.params)))
        live = [i for i, s in enumerate(seqs) if s.request.request_id in self.requests]
        states, generators = _row_states(seqs, drafts), [s.generator for s in seqs]
        processed = [i for i in live if states[i].has_processors]
        pristine = logits[processed] if processed else None  # a copy: processors change the rows in place

        def restore() -> None:
            if processed:
                with torch.inference_mode():  # (the forward's logits are inference tensors)
                    logits[processed] = pristine

        def run(rows: list[int]) -> list:
            sub = logits if rows == list(range(len(seqs))) else logits[rows]  # (indexing copies the rows)
            return sample(sub, [states[i] for i in rows], [generators[i] for i in rows])

        results = isolated("sampling", live, run, lambda i: seqs[i].request.params, restore) if live else []
        for i, got in zip(live, results):
            seq = seqs[i]
            if not isinstance(got, Sampled):
                outputs.extend(self.fail(seq.request, got))
            elif seq.request.request_id in self.requests:
                outputs.extend(self._accept(seq, got, states[i].draft))
        return outputs

    def _accept(self, seq: Sequence, got: Sampled, draft: int | None = None) -> list[Output]:
        """The sampled token through the grammar (when the request has one) and the stop rules (a token that is
        the row's draft counts as an accepted draft, before the chunk that may end the sample reports usage)."""
        if draft is not None and got.token == draft:
            seq.request.spec_accepted += 1
        stage = "structured output"
        try:
            if seq.matcher is not None and not seq.matcher.consume_token(got.token):
                return self.fail(seq.request, RequestError(
                    f"the output can no longer follow {seq.request.params.constraint[0]}: {seq.matcher.get_error()}"))
            if seq.digits is not None:
                seq.digits.add(got.token)
            done = seq.matcher is not None and seq.matcher.is_stopped()  # the document is complete
            stage = "stop rules"
            return [(seq.request.sink, self._append(seq, got, "stop" if done else None))]
        except Exception as e:
            return self.fail(seq.request, stage_error(stage, seq.request.params, e))

    def _fail_rows(self, seqs: list[Sequence], rows: list[int], results: list) -> list[Output]:
        """Fails the request of each row whose result is an error."""
        return [out for i, got in zip(rows, results) if isinstance(got, TieredKVError)
                for out in self.fail(seqs[i].request, got)]

    def _mask_by_grammar(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> list[None]:
        """Structured output (engine/grammar.py): each of these rows keeps only the tokens its grammar allows."""
        from tieredkv.engine.grammar import DigitRun, digit_limit, grammars_of

        grammars = grammars_of(self.tokenizer, logits.shape[1])
        for i in rows:
            if seqs[i].matcher is None:  # its first sampled token (samples forked from one prompt each get one)
                seqs[i].matcher = grammars.matcher(*seqs[i].request.params.constraint)
                schema = seqs[i].request.params.json_schema
                if schema is not None:
                    seqs[i].digits = DigitRun(grammars, digit_limit(schema))
        grammars.mask(logits, rows, [seqs[i].matcher for i in rows])
        grammars.bound_digits(logits, rows, [seqs[i].digits for i in rows])
        return [None] * len(rows)

    def _keep(self, seq: Sequence) -> list[Output] | None:
        """The prompt is computed: pins the prefixes the request asked to keep and marks its prompt blocks for
        admission below warm (once). A pin that fails fails a prefill-only request (pin()), and is logged for one
        that generates (the server checked the budget before it started)."""
        req = seq.request
        keep, req.keep = req.keep or [], None
        if req.mark_prompt:
            req.mark_prompt = False
            self.kv.pool.popularity.mark(seq.block_hashes[: seq.num_prompt_tokens // self.kv.block_size])
        for tokens, ttl in keep:
            try:
                self.pins.pin(req.prompt_token_ids[:tokens], req.root, ttl, req.cache_salt)
            except RequestError as e:
                if req.prefill_only:
                    return self.fail(req, e)
                log.warning("request %s: its prefix of %d tokens was not pinned: %s", req.request_id, tokens, e)
        return None

    def _finish_prefill(self, seq: Sequence) -> list[Output]:
        req = seq.request
        self.scheduler.finish(seq, "prefill")
        self._finish_request(req)
        return [(req.sink, make_chunk(seq, [], final=True))]

    def _new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        seq = Sequence(req, index, list(token_ids), req.make_generator(index, self.device))
        seq.detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.stop,
                                                req.params.skip_special_tokens)
        return seq

    def _fork(self, seq: Sequence) -> list[Sequence]:
        """When sample 0 finishes its prompt, the other n - 1 samples start, sharing its blocks."""
        req = seq.request
        if seq.index != 0 or req.pending_forks == 0 or req.beam is not None:
            return []
        children = []
        for i in range(len(req.seqs), req.params.n):
            child = self._new_sequence(req, i, seq.token_ids)
            self.kv.fork(seq, child)
            req.seqs.append(child)
            self.scheduler.add_running(child)
            children.append(child)
        return children

    def _append(self, seq: Sequence, got: Sampled, done: str | None = None) -> StreamChunk:
        """Adds the sampled token; the sequence ends when the token ends it, or with reason `done`."""
        self.telemetry.on_token(seq, time.perf_counter())
        reason = seq.append(got.token, self.max_model_len)
        if done is not None and reason in (None, "length"):  # a document that closed on the last token closed
            reason = done
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if seq.request.is_finished:
                self._finish_request(seq.request)
        logprobs = None if got.logprob is None else [TokenLogprob(got.token, got.logprob, got.top)]
        return make_chunk(seq, [got.token], final=reason is not None, logprobs=logprobs)

    # -- beam search (core/beam.py decides, these carry it out) ----------------------------------

    def _beam_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Output]:
        """Keeps each beam's processed log-probabilities; a request whose running beams all have theirs
        takes its step (beams of one request normally run in one forward)."""
        states, logprobs = _row_states(seqs), logits.log_softmax(-1)
        results = isolated("logits processors", list(range(len(seqs))),
                           lambda rows: list(apply_processors(logprobs[list(rows)], [states[i] for i in rows])),
                           lambda i: seqs[i].request.params)
        outputs = self._fail_rows(seqs, list(range(len(seqs))), results)
        for seq, row, is_bad in zip(seqs, results, bad_rows(logits)):
            if isinstance(row, TieredKVError) or seq.request.request_id not in self.requests:
                continue
            if is_bad:
                outputs.extend(self.fail(seq.request, SamplingError(NOT_FINITE)))
            else:
                seq.beam_row = row
        for req in {s.request.request_id: s.request for s in seqs}.values():
            if req.request_id in self.requests and all(s.beam_row is not None for s in req.seqs):
                try:
                    outputs.extend(self._beam_step(req))
                except Exception as e:
                    outputs.extend(self.fail(req, stage_error("beam search", req.params, e)))
        return outputs

    def _beam_step(self, req: Request) -> list[Output]:
        rows = torch.stack([s.beam_row for s in req.seqs])
        for s in req.seqs:
            s.beam_row = None
        survivors = req.beam.step(req.seqs, rows)
        self.telemetry.on_token(req.seqs[0], time.perf_counter())
        if req.beam.done:
            outputs = self._end_beams(req, "length")
            self._finish_request(req)
            return outputs
        self._advance_beams(req, survivors)
        return []

    def _advance_beams(self, req: Request, survivors: list) -> None:
        """The survivors become the running beams, in rank order: a beam chosen more than once forks
        (sharing its blocks), one never chosen is freed."""
        taken: set[Sequence] = set()
        beams = []
        for i, sv in enumerate(survivors):
            if sv.parent in taken:
                beam = self._new_sequence(req, i, sv.parent.token_ids)
                self.kv.fork(sv.parent, beam)
                beam.detokenizer = sv.parent.detokenizer.fork()
                self.scheduler.add_running(beam)
            else:
                beam = sv.parent
                taken.add(beam)
            beams.append(beam)
        for sv, beam in zip(survivors, beams):  # after every fork: a parent's tokens are copied unextended
            beam.token_ids.append(sv.token)
            beam.beam_logprob = sv.cum_logprob
            if sv.detokenizer is not None:
                beam.detokenizer = sv.detokenizer
            else:
                beam.detokenizer.add(sv.token, check_stop=False)
        for seq in req.seqs:
            if seq not in taken:
                self.scheduler.finish(seq, "pruned")
        req.seqs = beams

    def _end_beams(self, req: Request, running_reason: str) -> list[Output]:
        """The search is over: the n best beams go out, best first; every running beam is freed."""
        best = req.beam.results(req.seqs, running_reason)
        for seq in req.seqs:
            self.scheduler.finish(seq, best[0].finish_reason)
        req.beam.done = True
        return [(req.sink, beam_chunk(req, rank, hyp)) for rank, hyp in enumerate(best)]

    def _finish_request(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.telemetry.on_finished(req)


def _row_states(seqs: list[Sequence], drafts: list[int | None] | None = None) -> list[RowState]:
    """What the logits processors (and, with drafts, the sampler) read for each sequence's row."""
    drafts = drafts or [None] * len(seqs)
    return [RowState(s.request.params, s.token_ids, s.num_prompt_tokens, s.request.stop_ids, d)
            for s, d in zip(seqs, drafts)]


def _row_groups(sampled: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
    """The logits rows of each sampled sequence, in order (one, or with drafts one more per draft, in a run)."""
    groups: list[tuple[Sequence, list[int]]] = []
    for i, seq in enumerate(sampled):
        if groups and groups[-1][0] is seq:
            groups[-1][1].append(i)
        else:
            groups.append((seq, [i]))
    return groups
