"""Turn Qwen's `<tool_call>` output into OpenAI tool calls, for whole texts and streams.

Two forms exist: Qwen3's JSON body, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and
Qwen3.5's XML body, `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
Kimi's form (`KIMI`) wraps calls in a section, `<|tool_calls_section_begin|>`, then per call
`<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}<|tool_call_end|>`, then
`<|tool_calls_section_end|>`: the calls parse the same way, the section markers are dropped.
As in reasoning.py, parsing a growing text with `final=False` holds back every unfinished call, so
content and the list of calls only ever grow; `ToolCallStream` gives the same result for a text fed
in pieces, reading each piece once (each call's body is parsed once, when its end tag arrives).
An output cut off by the length limit or an abort (`cut`) ends with no markup: an unfinished call, or start
tag, at its end is dropped, being neither content nor a whole call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from deltaserve.engine.requests.chat_prompt import SURROGATE

from .reasoning import partial_tag_len

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it
    # the call's id as the model wrote it (Kimi's `functions.NAME:IDX`, which its chat template
    # writes back as the only record of the function called); None: the server makes one up
    call_id: str | None = None


@dataclass(frozen=True)
class ToolCallFormat:
    """A model family's tool-call markup: each call between `start` and `end`, its body read by
    `parse`; `drop` are markers around calls that are neither content nor calls (each one
    token, so they never arrive split)."""

    start: str
    end: str
    parse: Callable[[str, dict[str, dict[str, Any]]], ParsedToolCall | None]
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
    forced: bool = False,
) -> tuple[str, list[ParsedToolCall]]:
    """Return (content outside the calls, calls). `tools` maps function name to its JSON schema,
    used to give XML parameter values their declared types. `fmt`: Qwen's form by default.
    `forced`: a grammar wrote the calls (`_parsed`)."""
    fmt = fmt or QWEN
    release = final and not cut  # what is held back is shown at the end, unless cut off
    text, _ = fmt.without_markers(text, release)
    open_tag, close_tag = fmt.start, fmt.end
    parts: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            tail = text[pos:]
            parts.append(tail if release else tail[: len(tail) - partial_tag_len(tail, open_tag)])
            break
        parts.append(text[pos:start])
        end = text.find(close_tag, start)
        body_end = len(text) if end < 0 else end
        if end < 0 and not release:
            break  # an unfinished call: hold it back
        call = _parsed(fmt, text[start + len(open_tag) : body_end], tools, forced)
        raw = text[start : body_end + (0 if end < 0 else len(close_tag))]
        if call is not None:
            calls.append(call)
        else:
            parts.append(raw)  # not a call after all: show it
        if end < 0:
            break
        pos = end + len(close_tag)
    # Whitespace around calls is formatting; trailing whitespace is held back until it is inner.
    return "".join(parts).strip(), calls


class ToolCallStream:
    """`extract_tool_calls` over a content text fed in pieces: `feed` returns the content that a
    piece adds and the calls it completes."""

    def __init__(
        self, tools: dict[str, dict[str, Any]], fmt: ToolCallFormat | None = None, forced: bool = False
    ) -> None:
        self.tools = tools
        self.fmt = fmt or QWEN
        self.forced = forced
        self.held = ""  # a partial section marker (Kimi), read with the next piece
        self.buf = ""  # unread text: a partial <tool_call>, or an unfinished call from its tag on
        self.in_call = False
        self.search_from = 0  # where </tool_call> may still start in an unfinished call
        self.started = False  # content's leading whitespace is dropped, as strip() does
        self.trailing = ""  # whitespace held until content follows it (strip() drops it at the end)

    def feed(self, piece: str, final: bool, cut: bool = False) -> tuple[str, list[ParsedToolCall]]:
        ordered = self.feed_in_order(piece, final, cut)
        calls = [s for s in ordered if isinstance(s, ParsedToolCall)]
        return "".join(s for s in ordered if isinstance(s, str)), calls

    def feed_in_order(self, piece: str, final: bool, cut: bool = False) -> list[str | ParsedToolCall]:
        """As `feed`: the content (non-empty pieces) and the calls in the order they were written."""
        fmt = self.fmt
        open_tag, close_tag = fmt.start, fmt.end
        release = final and not cut  # what is held back is shown at the end, unless cut off
        text, self.held = fmt.without_markers(self.held + piece, release)
        buf = self.buf + text
        out: list[str | ParsedToolCall] = []

        def show(content: str) -> None:
            content = self._strip(content)
            if content:
                out.append(content)

        while True:
            if not self.in_call:
                start = buf.find(open_tag)
                if start < 0:
                    keep = 0 if release else partial_tag_len(buf, open_tag)
                    show(buf[: len(buf) - keep])
                    buf = buf[len(buf) - keep :]
                    break
                show(buf[:start])
                buf, self.in_call, self.search_from = buf[start:], True, len(open_tag)
            end = buf.find(close_tag, self.search_from)
            if end < 0 and not release:
                self.search_from = max(len(open_tag), len(buf) - len(close_tag) + 1)
                break  # an unfinished call: hold it back
            body_end = len(buf) if end < 0 else end
            raw_end = len(buf) if end < 0 else end + len(close_tag)
            call = _parsed(fmt, buf[len(open_tag) : body_end], self.tools, self.forced)
            if call is not None:
                out.append(call)
            else:
                show(buf[:raw_end])  # not a call after all: show it
            buf, self.in_call = buf[raw_end:], False
        self.buf = "" if final else buf  # at the end, what is still held is dropped (cut off)
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


def _parsed(
    fmt: ToolCallFormat, body: str, tools: dict[str, dict[str, Any]], forced: bool = False
) -> ParsedToolCall | None:
    """`fmt.parse` of a call's body, None also where its name or arguments hold a lone surrogate
    (JSON's unpaired \\uD800-\\uDFFF escape, which json decodes): no reply can carry one. A
    `forced` call (one a grammar wrote: tool_choice named a function or "required", or a strict tool
    under "auto") stays a call, as vLLM's named one does (its text passed on as written): its
    arguments write each lone surrogate as a JSON escape."""
    call = fmt.parse(body, tools)
    if call is None or SURROGATE.search(call.name + call.arguments) is None:
        return call
    if forced and SURROGATE.search(call.name) is None:
        return replace(call, arguments=SURROGATE.sub(lambda m: f"\\u{ord(m[0]):04x}", call.arguments))
    return None


def parse_tool_call_body(body: str, tools: dict[str, dict[str, Any]]) -> ParsedToolCall | None:
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml(body, tools)
    try:
        obj = json.loads(body)
    # nested past the recursion limit, or an integer past int()'s 4300 digits: unreadable too
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(obj["name"], arguments)


def _parse_xml(body: str, tools: dict[str, dict[str, Any]]) -> ParsedToolCall | None:
    match = _FUNCTION.match(body)
    if match is None:
        return None
    # structured.py imports torch: this parser is loaded without it until a call is parsed
    from deltaserve.engine.sampling.structured import resolved_ref

    name = match.group(1).strip()
    params = tools.get(name) or {}
    properties = resolved_ref(params, params).get("properties") or {}  # a root model's, behind a $ref
    args: dict[str, Any] = {}
    for param in _PARAMETER.finditer(match.group(2)):
        key = param.group(1).strip()
        value = param.group(2)
        # The template puts each value on its own line; those newlines are not part of it.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        # a $ref's type is its definition's, as the forced call's grammar reads it
        schema = properties.get(key)
        args[key] = _typed(
            value, resolved_ref(schema, params).get("type") if isinstance(schema, dict) else None
        )
    return ParsedToolCall(name, json.dumps(args, ensure_ascii=False))


def _typed(value: str, schema_type: Any) -> Any:
    if schema_type == "string":
        return value
    try:
        if schema_type == "integer":
            return int(value)
        if schema_type == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
        if schema_type == "boolean":
            return {"true": True, "false": False}[value.strip().lower()]
        return json.loads(value)
    except (ValueError, KeyError, RecursionError):
        return value


def parse_kimi_call_body(body: str, tools: dict[str, dict[str, Any]]) -> ParsedToolCall | None:
    """`functions.NAME:IDX<|tool_call_argument_begin|>{JSON}` (Kimi's call id names the function
    and its index in the turn); None when it is not that."""
    head, sep, args = body.partition("<|tool_call_argument_begin|>")
    if not sep:
        return None
    head = head.strip()
    name = head.removeprefix("functions.")
    stem, colon, index = name.rpartition(":")
    if colon and index.isdigit():
        name = stem
    try:
        obj = json.loads(args)
    except (ValueError, RecursionError):
        return None
    if not name or not isinstance(obj, dict):
        return None
    call_id = head if is_model_call_id(head) else None  # as vLLM's and SGLang's Kimi parsers keep it
    return ParsedToolCall(name, json.dumps(obj, ensure_ascii=False), call_id)


def is_model_call_id(call_id: str | None) -> bool:
    """Kimi's call ids, `functions.NAME:IDX`: kept as the model wrote them, in every API's reply."""
    if call_id is None or not call_id.startswith("functions."):
        return False
    stem, colon, index = call_id.rpartition(":")
    return bool(colon and index.isdigit() and len(stem) > len("functions."))


QWEN = ToolCallFormat(TOOL_START, TOOL_END, parse_tool_call_body)
KIMI = ToolCallFormat(
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    parse_kimi_call_body,
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
