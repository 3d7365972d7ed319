"""Incremental detokenization: text deltas that never split a multi-byte character, and stop strings."""

from __future__ import annotations

import copy
from typing import Protocol

_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns one sequence's new tokens into new text.

    Decodes a small window of tokens around the new ones, so tokenizers whose pieces depend on their
    neighbours (leading spaces, byte fallback) give the same text as decoding the whole output; a
    window that ends inside a multi-byte character (ends with U+FFFD) waits for the next token.
    Text is held back while it could still be the start of a stop string.
    """

    def __init__(self, decoder: Decoder, prompt_ids: list[int], stop: list[str], skip_special_tokens: bool = True):
        self._decoder = decoder
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._emitted = 0

    def add(self, token_id: int, check_stop: bool = True) -> bool:
        """Append a token; returns True when a stop string completed (text is then cut before it).
        With check_stop False (min_tokens not reached yet), stop strings are not looked for."""
        self._ids.append(token_id)
        prefix = self._decoder.decode(self._ids[self._prefix_offset : self._read_offset],
                                      skip_special_tokens=self._skip)
        full = self._decoder.decode(self._ids[self._prefix_offset :], skip_special_tokens=self._skip)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return False
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        start = max(len(self.text) - self._hold, 0)
        self.text += delta
        if not self._stop or not check_stop:
            return False
        cut = min((i for i in (self.text.find(s, start) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            return True
        return False

    def fork(self) -> "IncrementalDetokenizer":
        """An independent copy (a beam that continues two ways)."""
        twin = copy.copy(self)
        twin._ids = list(self._ids)
        return twin

    def take(self, final: bool) -> str:
        """New text since the last call; while not final, keeps back what might begin a stop string."""
        end = len(self.text) if final else max(len(self.text) - self._hold, self._emitted)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
