"""Turn tool-call markup into OpenAI tool calls, for whole texts and streams.

Two Qwen forms exist: Qwen3's JSON body, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`,
and Qwen3.5's XML body, `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
Kimi's form (`KIMI`) wraps calls in a section, `<|tool_calls_section_begin|>`, then per call
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`, then
`<|tool_calls_section_end|>`: the calls read the same way, the section markers are dropped.
`ToolCallStream` reads a text fed in pieces, each piece once: content as it comes (holding back what
could start a call), and each call as it is written (call_readers.py): its header once its name is
known, then fragments of its arguments. `extract_tool_calls` is that stream over a whole text, so a
stream's pieces add up to it. A body that turns out to be no call before its name is known is shown
as content; an output cut off by the length limit or an abort (`cut`) drops such an unfinished one, and
keeps a call whose header is out with the arguments written so far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .call_readers import CallReader, KimiCallReader, QwenReader, ToolCallPiece
from .reasoning import partial_tag_len

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    # the call's id as the model wrote it (Kimi's `functions.NAME:IDX`, which its chat template
    # writes back as the only record of the function called); None: the server makes one up
    call_id: str | None = None


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call markup: each call between `start` and `end`, its body read by a
    `reader`; `drop` are markers around calls that are neither content nor calls (each one
    token, so they never arrive split)."""

    start: str
    end: str
    reader: Callable[[dict[str, dict[str, Any]]], CallReader]
    drop: tuple[str, ...] = ()

    def without_markers(self, text: str, final: bool) -> tuple[str, str]:
        """(`text` without the markers, held back): unless final, a trailing partial marker is
        held back, to be read with what follows."""
        hold = 0 if final else max((partial_tag_len(text, m) for m in self.drop), default=0)
        text, held = text[: len(text) - hold], text[len(text) - hold :]
        for marker in self.drop:
            text = text.replace(marker, "")
        return text, held


def extract_tool_calls(
    text: str,
    tools: dict[str, dict[str, Any]],
    final: bool,
    fmt: ToolCallFormat | None = None,
    cut: bool = False,
) -> tuple[str, list[ParsedToolCall]]:
    """Return (content outside the calls, calls). `tools` maps function name to its JSON schema,
    used to give XML parameter values their declared types. `fmt`: Qwen's form by default."""
    return calls_of(ToolCallStream(tools, fmt).feed_in_order(text, final, cut))


def calls_of(ordered: list[str | ToolCallPiece]) -> tuple[str, list[ParsedToolCall]]:
    """The content and the whole calls that a stream's pieces add up to."""
    calls: list[ParsedToolCall] = []
    for part in ordered:
        if isinstance(part, ToolCallPiece) and part.name is not None:
            calls.append(ParsedToolCall(part.name, "", part.call_id))
        elif isinstance(part, ToolCallPiece):
            calls[-1] = replace(calls[-1], arguments=calls[-1].arguments + part.arguments)
    return "".join(s for s in ordered if isinstance(s, str)), calls


class ToolCallStream:
    """A content text fed in pieces: `feed_in_order` returns the content (non-empty pieces) and the
    calls' pieces that a piece adds, in the order they were written."""

    def __init__(self, tools: dict[str, dict[str, Any]], fmt: ToolCallFormat | None = None) -> None:
        self.tools = tools
        self.fmt = fmt or QWEN
        self.held = ""  # a partial section marker (Kimi), read with the next piece
        self.buf = ""  # unread text: a partial <tool_call>, or an unfinished call from its tag on
        self.reader: CallReader | None = None  # the unfinished call's, while in one
        self.fed = 0  # how much of `buf` its reader has read
        self.search_from = 0  # where </tool_call> may still start in an unfinished call
        self.started = False  # content's leading whitespace is dropped, as strip() does
        self.trailing = ""  # whitespace held until content follows it (strip() drops it at the end)

    def feed_in_order(self, piece: str, final: bool, cut: bool = False) -> list[str | ToolCallPiece]:
        fmt = self.fmt
        open_tag, close_tag = fmt.start, fmt.end
        release = final and not cut  # what is held back is shown at the end, unless cut off
        text, self.held = fmt.without_markers(self.held + piece, release)
        buf = self.buf + text
        out: list[str | ToolCallPiece] = []

        def show(content: str) -> None:
            content = self._strip(content)
            if content:
                out.append(content)

        while True:
            if self.reader is None:
                start = buf.find(open_tag)
                if start < 0:
                    keep = 0 if release else partial_tag_len(buf, open_tag)
                    show(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                show(buf[:start])
                buf, self.search_from = buf[start:], len(open_tag)
                self.reader, self.fed = fmt.reader(self.tools), len(open_tag)
            end = buf.find(close_tag, self.search_from)
            if end < 0 and not release:
                readable = len(buf) - partial_tag_len(buf, close_tag)  # the body so far
                out += self.reader.feed(buf[self.fed : readable])
                self.fed = max(self.fed, readable)
                self.search_from = max(len(open_tag), len(buf) - len(close_tag) + 1)
                if final:  # cut off: a call whose header is out keeps its arguments so far
                    out += self.reader.end(release=False) or []
                break
            body_end = len(buf) if end < 0 else end
            raw_end = len(buf) if end < 0 else end + len(close_tag)
            out += self.reader.feed(buf[self.fed : body_end])
            pieces = self.reader.end(release=True)
            if pieces is None:
                show(buf[:raw_end])  # not a call after all: show it
            else:
                out += [*pieces, ToolCallPiece("", end=True)]
            buf, self.reader = buf[raw_end:], None
        self.buf = "" if final else buf
        return out

    def _strip(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.trailing + text
        shown = text.rstrip()
        self.trailing = text[len(shown) :]
        return shown


QWEN = ToolCallFormat(TOOL_START, TOOL_END, QwenReader)
KIMI = ToolCallFormat(
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    KimiCallReader,
    drop=(
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_section_begin|>",
        "<|tool_call_section_end|>",
    ),
)


def tool_call_format(vocab: dict[str, int]) -> ToolCallFormat:
    """Kimi's markup where the tokenizer has its markers, else Qwen's."""
    return KIMI if "<|tool_call_begin|>" in vocab and "<|tool_call_argument_begin|>" in vocab else QWEN
