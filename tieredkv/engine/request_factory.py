"""Turns what a caller passes into a validated `Request`: cheap checks first, tokenization second."""

from __future__ import annotations

import uuid
from typing import Any

from tieredkv.config import EngineConfig, SamplingParams
from tieredkv.core.far_blocks import Room
from tieredkv.core.kv_manager import cdiv
from tieredkv.core.sequence import Request
from tieredkv.errors import RequestError
from tieredkv.models.spec import ModelSpec
from tieredkv.models.tokenizer import Chat, PromptType, Tokenizer, check_messages, message_chars

# A string of more than this many characters per allowed token cannot fit, whatever it tokenizes to: no
# token is longer than the tokenizer's longest vocabulary entry (x2 for normalizers that expand text).
_CHARS_PER_TOKEN_SLACK = 2


class RequestFactory:
    """Stateless apart from immutable engine facts, so it may run on any thread.

    `precheck` is O(1) in the prompt's size for strings and chat messages (it never tokenizes) and is
    meant for the caller's thread; `make` tokenizes and runs every check, and is meant for a
    tokenizer thread. Both raise RequestError (or TypeError for a wrong type) and allocate nothing.
    """

    def __init__(self, tokenizer: Tokenizer, spec: ModelSpec, config: EngineConfig, max_model_len: int,
                 eos_token_ids: frozenset[int], num_blocks: int, num_warm_blocks: int = 0, far: type[Room] = Room):
        self.tokenizer = tokenizer
        self.block_size = config.block_size
        self.num_blocks = num_blocks
        self.num_far_blocks = far.far_blocks(num_warm_blocks)  # warm blocks a sequence may keep its older KV in
        self.refusal = far.refusal  # why a request's KV cannot fit (core/far_blocks.py: the far-block policy)
        self.vocab_size = spec.vocab_size
        self.max_num_seqs = config.max_num_seqs
        self.speculative = config.speculative is not None  # whether a request may ask for speculation
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.max_chars = max_model_len * tokenizer.max_token_chars * _CHARS_PER_TOKEN_SLACK

    def precheck(self, prompt: Any, params: Any) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.num_seqs > self.max_num_seqs:
            what = f"beam_width={params.beam_width}" if params.beam_search else f"n={params.n}"
            raise RequestError(f"{what} exceeds max_num_seqs={self.max_num_seqs}")
        if params.speculative and not self.speculative:
            raise RequestError("speculative: this engine has no proposer (start it with EngineConfig.speculative, "
                               "--speculative '{\"method\": \"ngram\"}')", "speculative")
        outside = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(f"logit_bias has token ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            if len(prompt) > self.max_chars:
                raise RequestError(f"prompt has {len(prompt):,} characters, more than max_model_len "
                                   f"({self.max_model_len} tokens) can hold; it was not tokenized")
            return
        if isinstance(prompt, Chat):
            chars = message_chars([prompt.messages, prompt.tools or []])
            if not prompt.messages:
                raise RequestError("prompt is empty")
            if chars > self.max_chars:
                raise RequestError(f"messages and tools have {chars:,} characters, more than max_model_len "
                                   f"({self.max_model_len} tokens) can hold; they were not tokenized")
            try:
                check_messages(prompt.messages)
            except ValueError as e:
                raise RequestError(str(e)) from None
            return
        if not isinstance(prompt, (list, tuple)):
            raise TypeError("prompt must be a str, a list of token ids, or a list of chat messages")
        if not prompt:
            raise RequestError("prompt is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            self._check_ids(prompt)
            self.check_fits(len(prompt), params, 0)
        elif all(isinstance(m, dict) for m in prompt):
            chars = message_chars(prompt)  # roles and every other field a template renders, too
            if chars > self.max_chars:
                raise RequestError(f"messages have {chars:,} characters, more than max_model_len "
                                   f"({self.max_model_len} tokens) can hold; they were not tokenized")
            try:
                check_messages(prompt)
            except ValueError as e:
                raise RequestError(str(e)) from None
        else:
            raise TypeError("prompt must be a str, a list of token ids, or a list of chat messages")

    def _check_ids(self, ids) -> None:
        if len(ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                               "(the prompt must leave room for at least one new token)")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams, pinned_blocks: int) -> None:
        """Raises unless the request's most KV (every sample at max_tokens) fits beside the pinned blocks,
        in the hot pool and the warm blocks it may offload to, as the far-block policy says (its refusal: with far
        blocks, each sample's last block and one more must be hot at once)."""
        total = min(num_prompt_tokens + params.max_tokens, self.max_model_len)
        shared = num_prompt_tokens // self.block_size
        needed = shared + params.num_seqs * (cdiv(total, self.block_size) - shared)
        hot = self.num_blocks - pinned_blocks
        what = self.refusal(needed, params.num_seqs, hot, self.num_far_blocks)
        if what is not None:
            where = f" and {pinned_blocks} of them are pinned" if pinned_blocks else ""
            raise RequestError(f"request needs {what} but the pool has {self.num_blocks}{where} and the warm tier "
                               f"lends {self.num_far_blocks} more; lower max_tokens, n or beam_width, unpin, or give "
                               "the engine more KV memory")

    def token_ids(self, prompt: PromptType) -> list[int]:
        """The prompt's token ids, checked; tokenizes strings and applies the chat template to messages."""
        try:
            ids = self.tokenizer.to_token_ids(prompt)
        except (ValueError, UnicodeError) as e:
            raise RequestError(f"cannot tokenize the prompt: {e}") from None
        self._check_ids(ids)
        return ids

    def make(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
             prechecked: bool = False) -> Request:
        """Every check, then the Request; `prechecked` skips what precheck() already did on the caller's
        thread (the async engine prechecks in stream())."""
        if not prechecked:
            self.precheck(prompt, params)
        if params.constraint is not None:  # a schema or grammar the grammar engine refuses fails here, first
            from tieredkv.engine.grammar import grammars_of

            grammars_of(self.tokenizer, self.vocab_size).grammar(*params.constraint)
        if isinstance(prompt, (list, tuple)) and isinstance(prompt[0], int):
            ids = list(prompt)  # token ids: precheck() has checked them and the request's size
        else:
            ids = self.token_ids(prompt)
            self.check_fits(len(ids), params, 0)
        return Request(request_id or uuid.uuid4().hex, ids, params, self.eos_token_ids)
