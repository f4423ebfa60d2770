"""Incremental detokenization that never splits a multi-byte character."""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    """Decodes a growing list of token ids into a growing string.

    Fast tokenizers go through the `tokenizers` library's DecodeStream (one Rust call per
    token, holding back bytes of an unfinished UTF-8 character). Other tokenizers decode a
    short window of already-shown tokens again with each new token, so that byte-level
    pieces join correctly, and hold back text ending in U+FFFD until the character is whole.
    """

    def __init__(self, tokenizer: Any | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0  # ids before this have been shown
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer is not None else None
        self._stream: Any = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return ""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if delta is None:
                return ""
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still held back (a genuinely incomplete byte sequence)."""
        if self.tokenizer is None or self._read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        if self._stream is not None:
            delta = decode(self.ids[self._read_offset :], skip_special_tokens=skip)
        else:
            prefix = decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
            full = decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
            delta = full[len(prefix) :] if full.startswith(prefix) else ""
        self._prefix_offset = self._read_offset = len(self.ids)
        self.text += delta
        return delta
