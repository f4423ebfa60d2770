"""Read one tool call's body as it is written: its name as soon as it is known, then its arguments
in fragments, as OpenAI's and vLLM's streams send them.

A reader is fed the body in pieces (never its end tag) and emits `ToolCallPiece`s: first the header
(the name, with the model's own id where it writes one), then argument text. The arguments are the
JSON that `json.dumps(args, ensure_ascii=False)` writes, built in the order the model wrote them
(a key written twice is kept twice, as a JSON parser then takes the last), so that what a reader has
emitted is never taken back: the fragments of a call that is cut off are its arguments. A lone
surrogate (JSON's unpaired \\uD800-\\uDFFF escape, which no reply can carry) is written as that
escape. Before its header a call may still turn out to be none (`end` returns None); after it, it is a
call, whose arguments stop where the model's writing stops making sense.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from deltaserve.engine.requests.chat_prompt import MAX_ARGUMENTS_DEPTH

from .reasoning import partial_tag_len


@dataclass(frozen=True)
class ToolCallPiece:
    """A part of a call: its header (`name` set, `arguments` empty), a fragment of its arguments, or
    its end (`end`: the model ended it; a call cut off has none)."""

    arguments: str
    name: str | None = None
    call_id: str | None = None  # the model's own id (Kimi's `functions.NAME:IDX`), in the header
    end: bool = False


_WS = " \t\n\r"  # JSON's whitespace
_DELIMITERS = set(_WS + ',:[]{}"')
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = set("0123456789abcdefABCDEF")
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")


def _lone(unit: int) -> str:
    return f"\\u{unit:04x}"


def escape_text(text: str) -> str:
    """`text` as it stands inside a JSON string that json.dumps(ensure_ascii=False) writes, a lone
    surrogate as its escape."""
    return re.sub("[\ud800-\udfff]", lambda m: _lone(ord(m[0])), json.dumps(text, ensure_ascii=False)[1:-1])


class JsonValue:
    """One JSON value read from text fed in pieces, written out as json.dumps(json.loads(value),
    ensure_ascii=False) writes it. `raw`: a string value is written as its text, unquoted."""

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw
        self.out: list[str] = []
        self.stack: list[str] = []  # the open containers' closing brackets
        self.expect = "value"  # value | first_value | key | first_key | colon | next | done
        self.in_string = ""  # "" outside a string, else "key", "value" or "raw"
        self.escape = ""  # an escape read in part, from its backslash
        self.high: int | None = None  # a high surrogate's escape: a low one may follow
        self.word = ""  # a number or a literal read in part
        self.failed = False
        self.is_string = False  # the value is a string
        self.lone = False  # a string holds a lone surrogate

    @property
    def done(self) -> bool:
        return self.expect == "done"

    def take(self) -> str:
        text = "".join(self.out)
        self.out.clear()
        return text

    def feed(self, text: str, i: int = 0) -> int:
        """Read `text` from `i` on; returns where reading stopped: at its end, or past the value's."""
        while i < len(text) and not (self.done or self.failed):
            c = text[i]
            if self.in_string:
                self._string_char(c)
            elif self.word and c not in _DELIMITERS:
                self.word += c
            elif self.word:
                self._end_word()
                continue  # `c` comes after the word
            elif c not in _WS:
                self._token(c)
            i += 1
        return i

    def end(self) -> None:
        """The text ended: a number or literal at its end is whole."""
        if self.word and not self.failed:
            self._end_word()

    def _token(self, c: str) -> None:
        expect = self.expect
        if expect in ("value", "first_value"):
            if c == "]" and expect == "first_value":
                self._close(c)
            elif c in "{[" and len(self.stack) >= MAX_ARGUMENTS_DEPTH:
                self.failed = True  # deeper than the next turn's template takes (and json reads)
            elif c in "{[":
                self.out.append(c)
                self.stack.append("}" if c == "{" else "]")
                self.expect = "first_key" if c == "{" else "first_value"
            elif c == '"':
                self.is_string = not self.stack
                self.in_string = "raw" if self.raw and not self.stack else "value"
                self.out.append("" if self.in_string == "raw" else '"')
            elif c in _DELIMITERS:
                self.failed = True
            else:
                self.word = c
        elif expect in ("key", "first_key"):
            if c == "}" and expect == "first_key":
                self._close(c)
            elif c == '"':
                self.in_string = "key"
                self.out.append('"')
            else:
                self.failed = True
        elif expect == "colon" and c == ":":
            self.out.append(": ")
            self.expect = "value"
        elif expect == "next" and c == ",":
            self.out.append(", ")
            self.expect = "key" if self.stack[-1] == "}" else "value"
        elif expect == "next" and c == self.stack[-1]:
            self._close(c)
        else:
            self.failed = True

    def _close(self, bracket: str) -> None:
        self.stack.pop()
        self.out.append(bracket)
        self._after_value()

    def _after_value(self) -> None:
        self.expect = "next" if self.stack else "done"

    def _end_word(self) -> None:
        if _INTEGER.fullmatch(self.word):  # as json writes it, at any length (int() stops at 4300 digits)
            self.out.append("0" if self.word == "-0" else self.word)
        else:
            try:
                self.out.append(json.dumps(json.loads(self.word)))
            except (ValueError, RecursionError):
                self.failed = True
                return
        self.word = ""
        self._after_value()

    def _string_char(self, c: str) -> None:
        if self.escape:
            self.escape += c
            if self.escape[1] != "u":
                if c not in _ESCAPES:
                    self.failed = True
                    return
                self.escape = ""
                self._unit(ord(_ESCAPES[c]))
            elif len(self.escape) > 2 and c not in _HEX:
                self.failed = True
            elif len(self.escape) == 6:
                unit, self.escape = int(self.escape[2:], 16), ""
                self._unit(unit)
            return
        if c == "\\":
            self.escape = c
            return
        if c == '"':
            self._flush_high()
            kind, self.in_string = self.in_string, ""
            self.out.append("" if kind == "raw" else '"')
            if kind == "key":
                self.expect = "colon"
            else:
                self._after_value()
            return
        if c < " ":  # a control character must be escaped inside a JSON string
            self.failed = True
            return
        self._flush_high()
        self._char(c)

    def _unit(self, unit: int) -> None:
        """A UTF-16 code unit from an escape: surrogate pairs make one character, as json reads them."""
        if self.high is not None and 0xDC00 <= unit <= 0xDFFF:
            self._char(chr(0x10000 + ((self.high - 0xD800) << 10) + unit - 0xDC00))
            self.high = None
            return
        self._flush_high()
        if 0xD800 <= unit <= 0xDBFF:
            self.high = unit
        elif 0xDC00 <= unit <= 0xDFFF:
            self._lone(unit)
        else:
            self._char(chr(unit))

    def _flush_high(self) -> None:
        if self.high is not None:
            self._lone(self.high)
            self.high = None

    def _lone(self, unit: int) -> None:
        self.lone = True
        self.out.append(_lone(unit))

    def _char(self, c: str) -> None:
        plain = self.in_string == "raw" or (c >= " " and c not in '"\\')
        self.out.append(c if plain else json.dumps(c)[1:-1])


class ObjectPrefix(JsonValue):
    """A call's arguments read from their fragments, passed on (`take`) only as far as they stay the
    start of a JSON object that a reply can carry and a partial JSON parser reads (Anthropic's SDK
    parses each streamed prefix): another value at the top, a lone surrogate, NaN, an infinity or a
    number json cannot read, or text after the object, ends it there (`failed`)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: int | None = None  # where the output stops, once a lone surrogate ended it

    def feed(self, text: str, i: int = 0) -> int:
        i = super().feed(text, i)
        if self.done and text[i:].strip(_WS):
            self.failed = True
        return i

    def take(self) -> str:
        if self.kept is not None:
            del self.out[self.kept :]
            self.kept = 0
        return super().take()

    def _token(self, c: str) -> None:
        if not self.stack and c != "{":
            self.failed = True
            return
        super()._token(c)

    def _end_word(self) -> None:
        try:  # as json.loads reads the whole (which stops at 4300 digits)
            value = json.loads(self.word)
        except (ValueError, RecursionError):
            value = math.nan
        if isinstance(value, float) and not math.isfinite(value):
            self.failed = True
            return
        super()._end_word()

    def _lone(self, unit: int) -> None:
        self.failed = True
        if self.kept is None:  # what the same character adds after it is dropped too
            self.kept = len(self.out)


class CallReader:
    """One call's body, fed in pieces: `feed` returns the pieces a piece of body adds, `end` those the
    end of the body adds (`release`: the call ended, not cut off), or None where it was no call."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        self.tools = tools
        self.name: str | None = None  # set once the header is out
        self.pieces: list[ToolCallPiece] = []
        self.early: list[str] = []  # arguments written before the name (JSON with "name" last)

    def commit(self, name: str, call_id: str | None = None) -> None:
        self.name = name
        self.pieces.append(ToolCallPiece("", name, call_id))
        self.write("".join(self.early))

    def write(self, arguments: str) -> None:
        if not arguments:
            return
        if self.name is None:
            self.early.append(arguments)
        elif self.pieces and self.pieces[-1].name is None:
            self.pieces[-1] = ToolCallPiece(self.pieces[-1].arguments + arguments)
        else:
            self.pieces.append(ToolCallPiece(arguments))

    def taken(self) -> list[ToolCallPiece]:
        pieces, self.pieces = self.pieces, []
        return pieces

    def feed(self, text: str) -> list[ToolCallPiece]:
        raise NotImplementedError

    def end(self, release: bool) -> list[ToolCallPiece] | None:
        raise NotImplementedError


class QwenReader(CallReader):
    """Qwen's bodies: Qwen3's JSON or Qwen3.5's XML, told apart by their first character."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        super().__init__(tools)
        self.inner: CallReader | None = None
        self.bad = False

    def feed(self, text: str) -> list[ToolCallPiece]:
        if self.inner is None and not self.bad:
            text = text.lstrip()
            if not text:
                return []
            if text[0] not in "{<":
                self.bad = True
                return []
            self.inner = JsonCallReader(self.tools) if text[0] == "{" else XmlCallReader(self.tools)
        return [] if self.inner is None else self.inner.feed(text)

    def end(self, release: bool) -> list[ToolCallPiece] | None:
        return None if self.inner is None else self.inner.end(release)


class JsonCallReader(CallReader):
    """`{"name": ..., "arguments": {...}}` ("parameters" too): the name, then the arguments as written,
    or the string they are where they are one."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        super().__init__(tools)
        self.state = "open"  # open | first_key | key | colon | value | next | done | bad
        self.value: JsonValue | None = None  # the key or value being read
        self.role = ""  # what `value` is: "key", "name", "arguments" or "skip"
        self.key = ""
        self.arguments_seen = False

    def feed(self, text: str) -> list[ToolCallPiece]:
        i = 0
        while i < len(text) and self.state not in ("done", "bad"):
            if self.value is not None:
                i = self.value.feed(text, i)
                if self.role == "arguments":
                    self.write(self.value.take())
                if self.value.failed:
                    self.state = "bad"
                elif self.value.done:
                    self._value_read()
                continue
            c = text[i]
            i += 1
            if c in _WS:
                continue
            state = self.state
            if state == "open" and c == "{":
                self.state = "first_key"
            elif state in ("first_key", "key") and c == '"':
                self._read("key")
                i -= 1
            elif (state == "first_key" or state == "next") and c == "}":
                self.state = "done"
            elif state == "colon" and c == ":":
                self.state = "value"
            elif state == "value":
                if self.key == "name" and self.name is None:
                    self._read("name")
                elif self.key in ("arguments", "parameters") and not self.arguments_seen:
                    self.arguments_seen = True
                    self._read("arguments")
                else:
                    self._read("skip")
                i -= 1
            elif state == "next" and c == ",":
                self.state = "key"
            else:
                self.state = "bad"
        return self.taken()

    def _read(self, role: str) -> None:
        self.role = role
        self.value = JsonValue(raw=role != "skip")

    def _value_read(self) -> None:
        assert self.value is not None
        value, self.value = self.value, None
        if self.role == "key":
            self.key, self.state = value.take(), "colon"
            return
        if self.role == "name":
            if not value.is_string or value.lone:  # a name no reply can carry: no call
                self.state = "bad"
                return
            self.commit(value.take())
        self.state = "next"

    def end(self, release: bool) -> list[ToolCallPiece] | None:
        if release and self.value is not None and self.role == "arguments":
            self.value.end()
            self.write(self.value.take())
        if self.name is None:
            return None
        if release and not self.arguments_seen:
            self.write("{}")
        return self.taken()


class KimiCallReader(CallReader):
    """`functions.NAME:IDX<|tool_call_argument_begin|>{JSON}`: the id names the function."""

    MARKER = "<|tool_call_argument_begin|>"

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        super().__init__(tools)
        self.head = ""
        self.value: JsonValue | None = None
        self.bad = False

    def feed(self, text: str) -> list[ToolCallPiece]:
        if self.bad:
            return []
        if self.value is None:
            self.head += text
            head, sep, text = self.head.partition(self.MARKER)
            text = text.lstrip(_WS)
            if not sep or not text:
                return []
            self.head = head
            if text[0] != "{" or not self._start(head.strip()):
                self.bad = True
                return []
            self.value = JsonValue()
        self.value.feed(text)
        self.write(self.value.take())
        return self.taken()

    def _start(self, head: str) -> bool:
        name = head.removeprefix("functions.")
        stem, colon, index = name.rpartition(":")
        if colon and index.isdigit():
            name = stem
        if not name:
            return False
        self.commit(name, head if is_model_call_id(head) else None)  # as vLLM's and SGLang's keep it
        return True

    def end(self, release: bool) -> list[ToolCallPiece] | None:
        return None if self.name is None else self.taken()


def is_model_call_id(call_id: str | None) -> bool:
    """Kimi's call ids, `functions.NAME:IDX`: kept as the model wrote them, in every API's reply."""
    if call_id is None or not call_id.startswith("functions."):
        return False
    stem, colon, index = call_id.rpartition(":")
    return bool(colon and index.isdigit() and len(stem) > len("functions."))


_FUNCTION_END = "</function>"
_PARAMETER_START = "<parameter="
_PARAMETER_END = "</parameter>"
_VALUE_ENDS = (_PARAMETER_END, _PARAMETER_START, _FUNCTION_END)


class XmlCallReader(CallReader):
    """`<function=NAME><parameter=P>value</parameter>...</function>`: each value typed by the tool's
    schema; a string's text is streamed as it comes, other values once whole. The function's body ends
    at the first </function>; a value at the first </parameter>, the next <parameter= or that end."""

    def __init__(self, tools: dict[str, dict[str, Any]]) -> None:
        super().__init__(tools)
        self.text = ""
        self.pos = 0  # where reading goes on
        self.limit: int | None = None  # where the function's body ends, once its </function> is read
        self.state = "head"  # head | between | value | done | bad
        self.properties: dict[str, Any] = {}
        self.params: dict[str, Any] = {}
        self.count = 0  # parameters begun
        self.kind: Any = None  # the value's type in the schema
        self.is_string = False  # the value being read is a string, streamed as it comes
        self.sent = 0  # the value's characters streamed
        self.scan = 0  # where an end tag of the value may still start

    def feed(self, text: str) -> list[ToolCallPiece]:
        self.text += text
        if self.limit is None and self.state not in ("head", "bad"):
            found = self.text.find(
                _FUNCTION_END, max(self.pos, len(self.text) - len(text) - len(_FUNCTION_END))
            )
            self.limit = None if found < 0 else found
        self._read(release=False)
        return self.taken()

    def end(self, release: bool) -> list[ToolCallPiece] | None:
        if self.name is None:
            return None
        if release:
            self.text = self.text.rstrip()  # the body's trailing whitespace is not the last value's
            self._read(release=True)
        return self.taken()

    def _read(self, release: bool) -> None:
        while True:
            if self.state == "head" and not self._head():
                return
            region = self.text if self.limit is None else self.text[: self.limit]
            whole = release or self.limit is not None  # the region is the function's whole body
            if self.state == "between":
                start = region.find(_PARAMETER_START, self.pos)
                if start < 0:
                    if whole:
                        self._close()
                    return
                name_end = start + len(_PARAMETER_START)
                close, newline = region.find(">", name_end), region.find("\n", name_end)
                if close < 0 and newline < 0:
                    if whole:
                        self._close()
                    return
                if close < 0 or (0 <= newline < close) or not region[name_end:close]:
                    self.pos = start + 1  # no parameter tag: read on past it
                    continue
                self._start_value(region[name_end:close].strip(), close + 1)
            elif self.state == "value":
                if not self._value(region, whole):
                    return
            else:
                return

    def _head(self) -> bool:
        text = self.text.lstrip()
        tag = "<function="
        if not text.startswith(tag[: len(text)]) or (len(text) >= len(tag) and not text.startswith(tag)):
            self.state = "bad"
            return False
        close, newline = text.find(">", len(tag)), text.find("\n", len(tag))
        if 0 <= newline < (close if close >= 0 else len(text)) or close == len(tag):
            self.state = "bad"
            return False
        if close < 0:
            return False
        name = text[len(tag) : close].strip()
        # structured.py imports torch: this reader is loaded without it until a call is read
        from deltaserve.engine.sampling.structured import resolved_ref

        self.params = self.tools.get(name) or {}
        self.properties = resolved_ref(self.params, self.params).get("properties") or {}
        self.text, self.pos, self.state = text, close + 1, "between"
        self.commit(name)
        self.write("{")
        found = text.find(_FUNCTION_END, self.pos)
        self.limit = None if found < 0 else found
        return True

    def _start_value(self, key: str, start: int) -> None:
        from deltaserve.engine.sampling.structured import resolved_ref

        schema = self.properties.get(key)
        # a $ref's type is its definition's, as the forced call's grammar reads it
        kind = resolved_ref(schema, self.params).get("type") if isinstance(schema, dict) else None
        self.kind, self.is_string, self.state = kind, kind == "string", "value"
        self.pos = self.scan = start
        self.sent = 0
        self.write(", " * (self.count > 0) + escape_json_key(key))
        self.count += 1
        if self.is_string:
            self.write('"')

    def _value(self, region: str, whole: bool) -> bool:
        """Read on in the value; True once it is whole."""
        scan = max(self.pos, self.scan)  # no end tag starts before
        ends = [(at, tag) for tag in _VALUE_ENDS if (at := region.find(tag, scan)) >= 0]
        if ends:
            at, tag = min(ends)
            raw = region[self.pos : at]
            after = at + len(_PARAMETER_END) if tag == _PARAMETER_END else at
        elif whole:
            raw, after = region[self.pos :], len(region)
            if self.limit is not None and raw.endswith("\n"):
                raw = raw[:-1]  # the regex's `$` stops before the body's last newline
        else:
            self.scan = max(self.pos, len(region) - max(map(len, _VALUE_ENDS)) + 1)
            if self.is_string and len(region) > self.pos:  # stream what no end tag can take back
                start = self.pos + (region[self.pos] == "\n") + self.sent
                new = region[start:]
                new = new[: len(new) - max(partial_tag_len(new, t) for t in _VALUE_ENDS)].rstrip()
                self.write(escape_text(new))
                self.sent += len(new)  # trailing whitespace waits: the value's last newline is not its
            return False
        value = raw[1:] if raw.startswith("\n") else raw
        value = value[:-1] if value.endswith("\n") else value
        if self.is_string:
            self.write(escape_text(value[self.sent :]) + '"')
        else:
            self.write(escape_text_value(_typed(value, self.kind)))
        self.pos, self.state = after, "between"
        return True

    def _close(self) -> None:
        self.write("}")
        self.state = "done"


def escape_json_key(key: str) -> str:
    return f'"{escape_text(key)}": '


def escape_text_value(value: Any) -> str:
    """json.dumps(value, ensure_ascii=False), its lone surrogates written as escapes."""
    return re.sub("[\ud800-\udfff]", lambda m: _lone(ord(m[0])), json.dumps(value, ensure_ascii=False))


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
