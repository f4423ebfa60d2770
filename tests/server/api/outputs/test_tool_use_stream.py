"""The Messages API's tool_use blocks as a stream builds them (`_Blocks`), fed the chat stream's parts
of fixed Qwen outputs one character at a time: the block opens at the call's name, its input streams
as `input_json_delta` fragments that Anthropic's SDK parses as partial JSON, and calls that are cut or
whose arguments are no object end as documented (docs/api.md, Messages API)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jiter import from_json

from deltaserve.server.api.messages import _Blocks
from deltaserve.server.text.chat_output import ChatOutputParser, ChatStreamState

TOOLS = {
    "write_file": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}}}
}
BODY = r"line one\nline two \"quoted\" é\n" * 6  # JSON string text: escapes and all
JSON_CALL = (
    f'<tool_call>\n{{"name": "write_file", "arguments": {{"path": "a.txt", "text": "{BODY}"}}}}\n</tool_call>'
)
XML_CALL = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
    f"<parameter=text>\n{'a long line of text, ' * 8}\n</parameter>\n</function>\n</tool_call>"
)


def events(blocks: _Blocks, text: str, cut: bool = False) -> list[dict[str, Any]]:
    """The events of `text` fed one character a step, then the reply's end (`cut`: at max_tokens)."""
    state, out = ChatStreamState(ChatOutputParser(tools=TOOLS)), []
    for i, c in enumerate(text):
        final = i == len(text) - 1
        out += blocks.feed(*state.feed_in_order(c, final, cut and final))
    out += blocks.finish()
    return [json.loads(e.split("data: ", 1)[1]) for e in out]


def streamed() -> _Blocks:
    return _Blocks(lambda cached: {})


def sent_input(evs: list[dict[str, Any]], index: int) -> str:
    return "".join(
        e["delta"]["partial_json"]
        for e in evs
        if e["type"] == "content_block_delta"
        and e["index"] == index
        and e["delta"]["type"] == "input_json_delta"
    )


@pytest.mark.parametrize(
    "call,text",
    [(JSON_CALL, json.loads(f'"{BODY}"')), (XML_CALL, "a long line of text, " * 8)],
    ids=["qwen3-json", "qwen35-xml"],
)
def test_a_tool_use_opens_at_its_name_and_streams_its_input(call: str, text: str) -> None:
    """Text, then a call: the text block stops, the tool_use block starts (id, name, input {}) before
    any of its input, the input comes in many fragments whose join is the whole reply's input as JSON
    (each prefix one the SDK's partial parser reads), and the block stops at the call's end."""
    whole = _Blocks()
    events(whole, "Writing it.\n" + call)
    want = whole.blocks[1]["input"]
    assert [b["type"] for b in whole.blocks] == ["text", "tool_use"] and want == {
        "path": "a.txt",
        "text": text,
    }
    evs = events(streamed(), "Writing it.\n" + call)
    kinds = [(e["type"], e.get("index")) for e in evs]
    start = kinds.index(("content_block_start", 1))
    assert kinds[start - 1] == ("content_block_stop", 0)
    assert evs[start]["content_block"]["type"] == "tool_use" and evs[start]["content_block"]["input"] == {}
    assert evs[start]["content_block"]["name"] == "write_file"
    assert evs[start]["content_block"]["id"].startswith("toolu_")
    deltas = [e["delta"]["partial_json"] for e in evs[start + 1 :] if e["type"] == "content_block_delta"]
    assert len(deltas) > 20 and set(kinds[start + 1 : start + 1 + len(deltas)]) == {
        ("content_block_delta", 1)
    }
    assert kinds[start + 1 + len(deltas)] == ("content_block_stop", 1)
    assert json.loads("".join(deltas)) == want
    for n in range(1, len(deltas) + 1):
        from_json("".join(deltas[:n]).encode(), partial_mode=True)


def test_a_call_cut_after_its_name_keeps_its_block_with_the_input_sent() -> None:
    """max_tokens inside the call: the stream, which sent the block's start and input so far, stops
    the block at the reply's end with a prefix the SDK reads; the whole reply has that block too,
    its input what the SDK makes of that prefix (the string written in part is left out)."""
    half = XML_CALL[: XML_CALL.index("<parameter=text>")] + "<parameter=text>\na long line of text, a long li"
    evs = events(streamed(), half, cut=True)
    start = evs[0]
    assert start["type"] == "content_block_start" and start["content_block"]["type"] == "tool_use"
    assert evs[-1] == {"type": "content_block_stop", "index": 0}
    sent = sent_input(evs, 0)
    assert sent == '{"path": "a.txt", "text": "a long line of text, a long li'
    assert from_json(sent.encode(), partial_mode=True) == {"path": "a.txt"}
    whole = _Blocks()
    events(whole, half, cut=True)
    assert [(b["type"], b["name"], b["input"]) for b in whole.blocks] == [
        ("tool_use", "write_file", {"path": "a.txt"})
    ]
    # cut before any of its input: no input sent, {} in both
    evs = events(streamed(), '<tool_call>\n{"name": "write_file", "arguments": ', cut=True)
    assert [e["type"] for e in evs] == ["content_block_start", "content_block_stop"]
    whole = _Blocks()
    events(whole, '<tool_call>\n{"name": "write_file", "arguments": ', cut=True)
    assert [(b["type"], b["input"]) for b in whole.blocks] == [("tool_use", {})]


@pytest.mark.parametrize(
    "arguments,sent",
    [
        ('"not json"', "{}"),  # a string: nothing of it is an object's start
        ("[1, 2]", "{}"),
        ('{"a": 1, "b": NaN}', '{"a": 1, "b": '),  # no reply carries NaN; the SDK reads {"a": 1}
        ('{"a": 1, "b": 1e999}', '{"a": 1, "b": '),  # an infinity
        ('{"a": "x\\ud800y"}', '{"a": "x'),  # a lone surrogate, which the SDK's parser refuses
        ('"{\\"a\\": 1} and more"', '{"a": 1}'),  # a string of an object and text after it
    ],
)
def test_arguments_that_are_no_object_send_what_is_one(arguments: str, sent: str) -> None:
    """The whole reply's input is {} for arguments that are no object a reply can carry; the stream
    sends their start as far as it is one (the SDK's partial parser reads every prefix it sends), and
    {} where none of it is."""
    call = f'<tool_call>\n{{"name": "write_file", "arguments": {arguments}}}\n</tool_call>'
    whole = _Blocks()
    events(whole, call)
    assert [(b["type"], b["input"]) for b in whole.blocks] == [("tool_use", {})]
    evs = events(streamed(), call)
    assert sent_input(evs, 0) == sent and [e["type"] for e in evs][-1] == "content_block_stop"
    from_json(sent.encode(), partial_mode=True)


def test_a_call_with_no_arguments_streams_an_empty_object() -> None:
    evs = events(streamed(), '<tool_call>\n{"name": "write_file"}\n</tool_call>')
    assert sent_input(evs, 0) == "{}"
