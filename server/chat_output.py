"""One chat choice's text -> reasoning, content and tool calls, whole or as stream deltas."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from .protocol import DeltaToolCall, ToolCall, ToolCallFunction
from .reasoning import split_reasoning
from .tool_calls import ParsedToolCall, extract_tool_calls


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

    def parse(self, text: str, final: bool) -> ParsedChat:
        reasoning, content = (
            split_reasoning(text, self.starts_in_reasoning, final) if self.parse_reasoning else (None, text)
        )
        calls: list[ParsedToolCall] = []
        if self.tools is not None:
            content, calls = extract_tool_calls(content, self.tools, final)
        return ParsedChat(reasoning, content, calls)


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def to_openai_tool_calls(calls: list[ParsedToolCall]) -> list[ToolCall]:
    return [
        ToolCall(id=tool_call_id(), function=ToolCallFunction(name=c.name, arguments=c.arguments))
        for c in calls
    ]


@dataclass
class ChatStreamState:
    """What one choice has streamed so far; `advance` turns a newer parse into the next deltas."""

    reasoning_sent: int = 0
    content_sent: int = 0
    calls_sent: int = 0
    text_len: int = 0
    token_count: int = 0
    finished: bool = False
    call_ids: list[str] = field(default_factory=list)

    def advance(self, parsed: ParsedChat) -> tuple[str | None, str | None, list[DeltaToolCall]]:
        reasoning = None
        if parsed.reasoning is not None and len(parsed.reasoning) > self.reasoning_sent:
            reasoning = parsed.reasoning[self.reasoning_sent :]
            self.reasoning_sent = len(parsed.reasoning)
        content = None
        if len(parsed.content) > self.content_sent:
            content = parsed.content[self.content_sent :]
            self.content_sent = len(parsed.content)
        new_calls = []
        for index in range(self.calls_sent, len(parsed.tool_calls)):
            call = parsed.tool_calls[index]
            self.call_ids.append(tool_call_id())
            function = ToolCallFunction(name=call.name, arguments=call.arguments)
            new_calls.append(DeltaToolCall(index=index, id=self.call_ids[index], function=function))
        self.calls_sent = len(parsed.tool_calls)
        return reasoning, content, new_calls
