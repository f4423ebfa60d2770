"""How many characters of a prompt one token can stand for, so that a prompt too long for the
context is refused by its length alone, before it is tokenized.

Byte-level BPE (Qwen's tokenizer.json, Kimi's tiktoken as transformers converts it) loses no
byte of the text: each token covers at least one byte of the normalized text, and at most its
vocabulary entry's bytes (an added token: its own characters). A Unicode normalizer may compose
characters, at most 4 into 1 (the longest canonical decomposition); ASCII text it leaves alone.
Tokenizers that may drop text (whitespace splitting, a Removed split, a replacing normalizer,
WordPiece's unknown words) have no such bound."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# the most characters Unicode normalization composes into one (U+1F82 decomposes into 4)
COMPOSED_AT_MOST = 4
_NORMALIZERS = {"NFC": COMPOSED_AT_MOST, "NFKC": COMPOSED_AT_MOST, "NFD": 1, "NFKD": 1}


@dataclass(frozen=True)
class CharsPerToken:
    """The most prompt characters a token stands for: `ascii` for ASCII text, `other` for the rest."""

    ascii: int
    other: int

    def of(self, text: str) -> int:
        return self.ascii if text.isascii() else self.other  # isascii reads a flag: O(1)


def chars_per_token(tokenizer: Any) -> CharsPerToken | None:
    """The bound for a transformers fast tokenizer whose backend is byte-level BPE under at most
    a Unicode normalizer; None for any other (its prompts are tokenized to be measured)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(getattr(backend, "model", None)).__name__ != "BPE":
        return None
    try:
        shrink = _normalizer_shrink(_state(backend.normalizer))
        keeps = _keeps_every_byte(_state(backend.pre_tokenizer))
    except (AttributeError, TypeError, ValueError):  # a backend that does not describe itself: no bound
        return None
    if shrink is None or not keeps:
        return None
    longest = max((len(entry) for entry in backend.get_vocab(with_added_tokens=True)), default=0)
    if longest < 1:
        return None
    return CharsPerToken(ascii=longest, other=longest * shrink)


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(state: dict[str, Any] | None) -> int | None:
    """At most how many characters the normalizer turns into one; None if it may delete text."""
    if state is None:
        return 1
    if state.get("type") == "Sequence":
        most = 1
        for part in state.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            most = max(most, shrink)
        return most
    return _NORMALIZERS.get(state.get("type", ""))


def _keeps_every_byte(state: dict[str, Any] | None) -> bool:
    """Whether the pre-tokenizer is byte-level and drops nothing (a Split that keeps its matches)."""
    parts = state.get("pretokenizers", []) if state and state.get("type") == "Sequence" else [state]
    kinds = [(p or {}).get("type") for p in parts]
    kept = all(
        kind == "ByteLevel" or (kind == "Split" and (p or {}).get("behavior") != "Removed")
        for kind, p in zip(kinds, parts)
    )
    return "ByteLevel" in kinds and kept
