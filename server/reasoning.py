"""Split Qwen's `<think>...</think>` output into reasoning and content, for whole texts and streams.

Streaming works on the cumulative text: `split_reasoning(text, ..., final=False)` holds back what
could still turn into a tag, so both parts only ever grow and a stream's deltas are plain suffixes.
Concatenated stream deltas therefore equal the non-streamed split of the same text.
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """True when the prompt leaves a `<think>` open, as Qwen3.5's generation prompt always does:
    the model's output then starts inside reasoning, without a `<think>` of its own."""
    start = prompt_text.rfind(THINK_START)
    return start >= 0 and prompt_text.rfind(THINK_END) < start


def partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (what to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def split_reasoning(text: str, starts_in_reasoning: bool, final: bool) -> tuple[str | None, str]:
    """Return (reasoning, content). Reasoning is None when the output has no reasoning section."""
    if not starts_in_reasoning:
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):
            text = stripped[len(THINK_START) :]
        elif not final and (not stripped or THINK_START.startswith(stripped)):
            return None, ""  # whitespace or a partial "<think>": could still open reasoning
        else:
            return None, text
    end = text.find(THINK_END)
    if end < 0:
        reasoning = text if final else text[: len(text) - partial_tag_len(text, THINK_END)]
        return reasoning.lstrip("\n"), ""
    return text[:end].lstrip("\n"), text[end + len(THINK_END) :].lstrip("\n")
