"""One chat choice's text -> reasoning, content and tool calls, whole or as stream deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..protocol import DeltaToolCall, ToolCall, ToolCallFunction
from .call_readers import ToolCallPiece
from .reasoning import ReasoningStream, split_reasoning
from .tool_calls import ParsedToolCall, ToolCallFormat, ToolCallStream, extract_tool_calls


@dataclass(frozen=True)
class CallEnd:
    """In a stream's parts: the model ended the call it was writing (one cut off gets none)."""

    index: int


@dataclass
class ParsedChat:
    reasoning: str | None
    content: str
    tool_calls: list[ParsedToolCall]


@dataclass(frozen=True)
class ChatOutputParser:
    """How to read one request's outputs: whether they start inside `<think>` (the prompt opened it),
    whether to split reasoning at all, and the tools (name -> parameter schema) when calls are expected."""

    starts_in_reasoning: bool = False
    parse_reasoning: bool = True
    tools: dict[str, dict[str, Any]] | None = None
    tool_format: ToolCallFormat | None = None  # the model family's call markup (Qwen's by default)
    # parallel_tool_calls false: the reply's first call only, the later ones dropped (vLLM's filter)
    max_calls: int | None = None

    def parse(self, text: str, final: bool, cut: bool = False) -> ParsedChat:
        """`cut`: the output ended early (`ended_early`): an unfinished call at its end is dropped,
        unless its name was written (a stream has sent it): it keeps the arguments written so far."""
        reasoning, content = (
            split_reasoning(text, self.starts_in_reasoning, final) if self.parse_reasoning else (None, text)
        )
        calls: list[ParsedToolCall] = []
        if self.tools is not None:
            content, calls = extract_tool_calls(content, self.tools, final, self.tool_format, cut)
            calls = calls[: self.max_calls]
        return ParsedChat(reasoning, content, calls)


def ended_early(finish_reason: str | None) -> bool:
    """Whether an output stopped before the model ended it: at the length limit, or aborted. A call
    it was writing then is half of one, neither content nor a call to make."""
    return finish_reason in ("length", "abort")


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def to_openai_tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [
        ToolCall(
            id=c.call_id or tool_call_id(), function=ToolCallFunction(name=c.name, arguments=c.arguments)
        )
        for c in calls
    ]


class ChatStreamState:
    """One streamed choice: `feed` turns the text a step adds into that step's deltas, reading the
    piece once (`ReasoningStream`, `ToolCallStream`); together they add up to `parse` of the whole
    text. A call's first delta carries its index, id and name, the next ones fragments of its
    arguments, as OpenAI streams them."""

    def __init__(self, parser: ChatOutputParser) -> None:
        self.reasoning = ReasoningStream(parser.starts_in_reasoning, parser.parse_reasoning)
        self.tools = ToolCallStream(parser.tools, parser.tool_format) if parser.tools is not None else None
        self.max_calls = parser.max_calls
        self.calls_sent = 0
        self.skipping = False  # the call being read is past max_calls

    def feed(
        self, piece: str, final: bool, cut: bool = False
    ) -> tuple[str | None, str | None, list[DeltaToolCall]]:
        reasoning, ordered = self.feed_in_order(piece, final, cut)
        content = "".join(s for s in ordered if isinstance(s, str))
        return reasoning, content or None, [s for s in ordered if isinstance(s, DeltaToolCall)]

    def feed_in_order(
        self, piece: str, final: bool, cut: bool = False
    ) -> tuple[str | None, list[str | DeltaToolCall | CallEnd]]:
        """As `feed`: the reasoning, then the content (non-empty pieces), the calls' deltas and
        their ends in the order they were written. `cut`: the output ended early (`ended_early`)."""
        reasoning, content = self.reasoning.feed(piece, final)
        if self.tools is None:
            return reasoning or None, [content] if content else []
        ordered: list[str | DeltaToolCall | CallEnd] = []
        for part in self.tools.feed_in_order(content, final, cut):
            if isinstance(part, str):
                ordered.append(part)
            elif part.end:
                if not self.skipping:
                    ordered.append(CallEnd(self.calls_sent - 1))
            elif part.name is not None:
                self.skipping = self.max_calls is not None and self.calls_sent >= self.max_calls
                if not self.skipping:
                    function = ToolCallFunction(name=part.name, arguments="")
                    call_id = part.call_id or tool_call_id()
                    ordered.append(
                        DeltaToolCall(index=self.calls_sent, id=call_id, type="function", function=function)
                    )
                    self.calls_sent += 1
            elif not self.skipping:
                self._add_arguments(ordered, part)
        return reasoning or None, ordered

    def _add_arguments(self, ordered: list[str | DeltaToolCall | CallEnd], part: ToolCallPiece) -> None:
        """A fragment of the last call's arguments: joined to its delta where this step has one."""
        last = ordered[-1] if ordered else None
        if isinstance(last, DeltaToolCall) and last.index == self.calls_sent - 1:
            last.function.arguments = (last.function.arguments or "") + part.arguments
            return
        function = ToolCallFunction(arguments=part.arguments)
        ordered.append(DeltaToolCall(index=self.calls_sent - 1, function=function))
