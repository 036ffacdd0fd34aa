"""Incremental detokenization with text-level stop strings.

Each new token decodes only a short window (the tokens since the last
emitted text, plus a few before for context), so the cost per token is
constant. Text is appended only once the window decodes without a trailing
U+FFFD, so half a UTF-8 character is never emitted. Stop strings are
searched in the text, so one that spans several tokens is found; the text
is cut before it. While a stop string could still be completing, its
possible start (the last max_len-1 characters) is held back from deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output, so leading spaces come out right


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Feed one output token; True if a stop string completed (text is then cut before it)."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete UTF-8 sequence or nothing visible yet
        search_from = max(0, len(self.text) - self._hold)
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._find_stop(search_from)

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; holds back a possible stop-string start unless finished."""
        end = len(self.text)
        if not finished and not self.stopped:
            end = max(self._emitted, end - self._hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self, search_from: int) -> bool:
        cut = -1
        for s in self._stop:
            i = self.text.find(s, search_from)
            if i != -1 and (cut == -1 or i < cut):
                cut = i
        if cut == -1:
            return False
        self.text = self.text[:cut]
        self.stopped = True
        return True
