"""Split Qwen's `<think>...</think>` output into reasoning and content, for whole texts and streams.

`split_reasoning(text, ..., final=False)` holds back what could still turn into a tag, so both
parts of a growing text only ever grow. `ReasoningStream` gives the same split for a text that
arrives in pieces, reading each piece once: its outputs are the growth of `split_reasoning`'s parts
(so concatenated stream deltas equal the non-streamed split of the same text), at a cost that does
not depend on the text's length.
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


class ReasoningStream:
    """`split_reasoning` over a text fed in pieces: `feed` returns what each piece adds to the
    reasoning and to the content."""

    def __init__(self, starts_in_reasoning: bool, enabled: bool = True) -> None:
        # "open": may still start with <think>; "reasoning"; "after": right after </think>,
        # where newlines are dropped; "content": everything else is content as it comes
        self.mode = "content" if not enabled else ("reasoning" if starts_in_reasoning else "open")
        self.buf = ""  # text read but not yet given out (a partial tag, or what "open" holds)
        self.reasoning_started = False

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        buf = self.buf + piece
        self.buf = ""
        reasoning = ""
        if self.mode == "open":
            stripped = buf.lstrip()
            if stripped.startswith(THINK_START):
                self.mode, buf = "reasoning", stripped[len(THINK_START) :]
            elif not final and (not stripped or THINK_START.startswith(stripped)):
                self.buf = buf  # whitespace or a partial "<think>": could still open reasoning
                return "", ""
            else:
                self.mode = "content"  # no reasoning: the text as it is, leading whitespace too
        if self.mode == "reasoning":
            # A tag can only start inside the held partial tag or the new piece: whatever came
            # before was given out because it could not begin one.
            end = buf.find(THINK_END)
            if end < 0:
                keep = 0 if final else partial_tag_len(buf, THINK_END)
                self.buf = buf[len(buf) - keep :]
                return self._reasoning(buf[: len(buf) - keep]), ""
            reasoning = self._reasoning(buf[:end])
            buf, self.mode = buf[end + len(THINK_END) :], "after"
        if self.mode == "after":
            buf = buf.lstrip("\n")
            if buf:
                self.mode = "content"
        return reasoning, buf

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_started:  # the reasoning's leading newlines are formatting
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        return text
