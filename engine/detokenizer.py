"""Incremental detokenization that never splits a multi-byte character."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into a growing string.

    A short window of already-shown tokens is decoded again with each new token so that
    byte-level BPE pieces join correctly; text ending in U+FFFD (an incomplete UTF-8
    sequence) is held back until the rest of the character arrives.
    """

    def __init__(self, tokenizer: Any | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(self.ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (a genuinely invalid byte sequence)."""
        if self.tokenizer is None or self._read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(
            self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(self.ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        self._prefix_offset = self._read_offset = len(self.ids)
        delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self.text += delta
        return delta
