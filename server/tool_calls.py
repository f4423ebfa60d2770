"""Turn Qwen's `<tool_call>` output into OpenAI tool calls, for whole texts and streams.

Two forms exist: Qwen3's JSON body, `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, and
Qwen3.5's XML body, `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`.
As in reasoning.py, parsing the cumulative text with `final=False` holds back every unfinished call,
so content and the list of calls only ever grow while a stream is read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from .reasoning import partial_tag_len

TOOL_START = "<tool_call>"
TOOL_END = "</tool_call>"

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it


def extract_tool_calls(
    text: str, tools: dict[str, dict[str, Any]], final: bool
) -> tuple[str, list[ParsedToolCall]]:
    """Return (content outside the calls, calls). `tools` maps function name to its JSON schema,
    used to give XML parameter values their declared types."""
    parts: list[str] = []
    calls: list[ParsedToolCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_START, pos)
        if start < 0:
            tail = text[pos:]
            parts.append(tail if final else tail[: len(tail) - partial_tag_len(tail, TOOL_START)])
            break
        parts.append(text[pos:start])
        end = text.find(TOOL_END, start)
        body_end = len(text) if end < 0 else end
        if end < 0 and not final:
            break  # an unfinished call: hold it back
        call = parse_tool_call_body(text[start + len(TOOL_START) : body_end], tools)
        raw = text[start : body_end + (0 if end < 0 else len(TOOL_END))]
        if call is not None:
            calls.append(call)
        else:
            parts.append(raw)  # not a call after all: show it
        if end < 0:
            break
        pos = end + len(TOOL_END)
    # Whitespace around calls is formatting; trailing whitespace is held back until it is inner.
    return "".join(parts).strip(), calls


def parse_tool_call_body(body: str, tools: dict[str, dict[str, Any]]) -> ParsedToolCall | None:
    body = body.strip()
    if body.startswith("<function="):
        return _parse_xml(body, tools)
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
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
    name = match.group(1).strip()
    properties = (tools.get(name) or {}).get("properties") or {}
    args: dict[str, Any] = {}
    for param in _PARAMETER.finditer(match.group(2)):
        key = param.group(1).strip()
        value = param.group(2)
        # The template puts each value on its own line; those newlines are not part of it.
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = _typed(value, (properties.get(key) or {}).get("type"))
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
    except (ValueError, KeyError):
        return value
