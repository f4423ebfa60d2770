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

    # The text is kept as chunks joined on demand: `self.text += delta` copies the whole text
    # for every token (a str attribute is never extended in place), a cost that grows with the
    # output. The newest pieces are merged into one chunk every MERGE appends, so an append
    # costs O(1) amortised and the chunk list stays short.
    MERGE = 64
    # Tokens held back (their text ends in an unfinished character) before the settled part of
    # their text is released (`_release`), and the tokens of context the window path decodes
    # before the first held-back one when it takes over from DecodeStream.
    HELD_LIMIT = 16
    CONTEXT = 5

    def __init__(
        self, tokenizer: Any | None, skip_special_tokens: bool = True, deferred: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # deferred: nobody reads the text while the request runs (a final-only output without
        # stop strings), so tokens are only collected and decoded in one call when the text is
        # first asked for; `length` is 0 until then
        self.deferred = deferred and tokenizer is not None
        self._decoded = 0  # deferred: ids covered by the text
        self.ids: list[int] = []
        self._chunks: list[str] = []
        self._pieces = 0  # trailing chunks that are single appends, not yet merged
        self.length = 0  # characters of text
        self._prefix_offset = 0
        self._read_offset = 0  # ids before this have been shown
        self._backend = getattr(tokenizer, "backend_tokenizer", None) if tokenizer is not None else None
        self._stream: Any = None
        if self._backend is not None and not self.deferred:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def _catch_up(self) -> None:
        """Deferred: decode the ids collected since the last call, in one call. The text is the
        whole decode of the ids, which the incremental paths also give
        (tests/engine/requests/test_text.py)."""
        if self.deferred and self._decoded != len(self.ids) and self.tokenizer is not None:
            text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            self._chunks, self._pieces, self.length = [text], 0, len(text)
            self._decoded = len(self.ids)

    @property
    def text(self) -> str:
        """The whole text so far (joined once, then kept as one chunk until the next append)."""
        self._catch_up()
        if len(self._chunks) != 1:
            self._chunks = ["".join(self._chunks)]
            self._pieces = 0
        return self._chunks[0]

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters (a stop string was found)."""
        self._chunks = [self.text[:length]]
        self._pieces = 0
        self.length = len(self._chunks[0])

    def tail(self, n: int) -> str:
        """The last `n` characters (all of them if the text is shorter), without joining it."""
        if n <= 0:
            return ""
        self._catch_up()
        return self.slice(max(0, self.length - n), self.length)

    def slice(self, start: int, end: int) -> str:
        """`text[start:end]` read from the chunks that hold it: a slice near the end costs its own
        length, not the text's (stream deltas and stop-string searches read only the tail)."""
        self._catch_up()
        end = min(end, self.length)
        if start >= end:
            return ""
        picked: list[str] = []
        chunk_end = self.length
        for chunk in reversed(self._chunks):
            chunk_start = chunk_end - len(chunk)
            if chunk_start < end:
                picked.append(chunk[max(0, start - chunk_start) : end - chunk_start])
            if chunk_start <= start:
                break
            chunk_end = chunk_start
        return "".join(reversed(picked))

    def _add(self, delta: str) -> None:
        if not delta:
            return
        self._chunks.append(delta)
        self.length += len(delta)
        self._pieces += 1
        if self._pieces >= self.MERGE:
            self._chunks[-self._pieces :] = ["".join(self._chunks[-self._pieces :])]
            self._pieces = 0

    def append(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty; always, when deferred)."""
        self.ids.append(token_id)
        if self.tokenizer is None or self.deferred:
            return ""
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if delta is None:
                if len(self.ids) - self._read_offset <= self.HELD_LIMIT:
                    return ""
                # DecodeStream decodes everything it holds back again with every token: from
                # here on the window path, which can release the settled part
                self._stream = None
                self._prefix_offset = max(0, self._read_offset - self.CONTEXT)
                return self._release()
            self._read_offset = len(self.ids)
            self._add(delta)
            return delta
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        full = decode(self.ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self._add(delta)
            return delta
        if len(self.ids) - self._read_offset > self.HELD_LIMIT:
            return self._release()
        return ""

    def _release(self) -> str:
        """Text held back for more than HELD_LIMIT tokens (a run of bytes that are no UTF-8, as
        random weights or a derailed model emit) would be decoded again with every token, its
        cost growing with the run. A UTF-8 character is at most 4 bytes and every token at least
        one, so what the tokens before the last four decode to is settled once the whole window
        agrees with it (no character spans the cut): release that, keep the last four back."""
        decode = self.tokenizer.decode  # type: ignore[union-attr]
        skip = self.skip_special_tokens
        p, r, cut = self._prefix_offset, self._read_offset, len(self.ids) - 4
        shown = decode(self.ids[p:r], skip_special_tokens=skip)
        head = decode(self.ids[p:cut], skip_special_tokens=skip)
        full = decode(self.ids[p:], skip_special_tokens=skip)
        if not (head.startswith(shown) and full.startswith(head)):
            return ""  # a character spans the cut: the next token moves it
        delta = head[len(shown) :]
        self._prefix_offset, self._read_offset = r, cut
        self._add(delta)
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (a genuinely incomplete byte sequence)."""
        if self.deferred:
            before = self.length
            self._catch_up()
            return self.text[before:]
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
        self._add(delta)
        return delta
