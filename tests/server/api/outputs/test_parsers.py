"""The reasoning and tool-call parsers on fixed Qwen outputs (the tiny model cannot produce them), whole
and streamed: every prefix of an output is parsed as a stream would see it, and the deltas must add
up to the whole-text result."""

from __future__ import annotations

import json

import pytest

from deltaserve.server.text.chat_output import ChatOutputParser, ChatStreamState
from deltaserve.server.text.reasoning import prompt_opens_reasoning, split_reasoning
from deltaserve.server.text.tool_calls import KIMI, QWEN, extract_tool_calls, tool_call_format

WEATHER_TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
        },
    }
}

QWEN3_THINKING = "<think>\nThe user greets me.\nI should greet back.\n</think>\n\nHello! How can I help?"
QWEN3_TOOL = (
    "<think>\nNeed the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
QWEN3_TWO_TOOLS = (
    'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
)
# Qwen3.5: the generation prompt already opened <think>, so the output starts inside reasoning.
QWEN35_TOOL = (
    "Weather needs a tool call.\n</think>\n\n"
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n5\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n</function>\n</tool_call>"
)


def stream(
    parser: ChatOutputParser, text: str, cuts: list[int] | None = None, cut: bool = False
) -> tuple[str, str, list[tuple[str, dict]]]:
    """Feed `text` in pieces (ending at `cuts`, by default one character each) as a stream would,
    and concatenate the deltas. After every piece, what was streamed must equal the parse of the
    text so far: the incremental parsers give what parsing each whole prefix would. `cut`: the
    text ends at the length limit."""
    state = ChatStreamState(parser)
    reasoning, content, calls = "", "", []
    start = 0
    for end in cuts or range(1, len(text) + 1):
        final = end == len(text)
        r, c, new_calls = state.feed(text[start:end], final, cut and final)
        start = end
        reasoning += r or ""
        content += c or ""
        calls += [(call.function.name, json.loads(call.function.arguments)) for call in new_calls]
        assert [call.index for call in new_calls] == list(range(len(calls) - len(new_calls), len(calls)))
        prefix = parser.parse(text[:end], final, cut and final)
        assert (reasoning, content) == (prefix.reasoning or "", prefix.content), text[:end]
        assert calls == [(c.name, json.loads(c.arguments)) for c in prefix.tool_calls]
    return reasoning, content, calls


def test_qwen3_reasoning_split() -> None:
    reasoning, content = split_reasoning(QWEN3_THINKING, starts_in_reasoning=False, final=True)
    assert reasoning is not None and "The user greets me." in reasoning and "<think>" not in reasoning
    assert content == "Hello! How can I help?"


def test_no_reasoning_leaves_content_alone() -> None:
    assert split_reasoning("Just an answer.", starts_in_reasoning=False, final=True) == (
        None,
        "Just an answer.",
    )


def test_unfinished_reasoning_is_all_reasoning() -> None:
    reasoning, content = split_reasoning("<think>\nstill thinking", starts_in_reasoning=False, final=True)
    assert (reasoning, content) == ("still thinking", "")


def test_prompt_that_opens_think() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    # Qwen3 with enable_thinking=False closes the empty think block in the prompt.
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "text,starts_inside", [(QWEN3_THINKING, False), (QWEN35_TOOL.split("<tool_call>")[0], True)]
)
def test_streamed_reasoning_equals_whole(text: str, starts_inside: bool) -> None:
    parser = ChatOutputParser(starts_in_reasoning=starts_inside)
    whole = parser.parse(text, final=True)
    reasoning, content, _ = stream(parser, text)
    assert reasoning == whole.reasoning and content == whole.content
    assert "</think>" not in reasoning + content and "<think>" not in reasoning + content


def test_qwen3_json_tool_call() -> None:
    parser = ChatOutputParser(tools=WEATHER_TOOLS)
    parsed = parser.parse(QWEN3_TOOL, final=True)
    assert parsed.reasoning == "Need the weather.\n"
    assert parsed.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_qwen35_xml_tool_call_with_typed_parameters() -> None:
    parser = ChatOutputParser(starts_in_reasoning=True, tools=WEATHER_TOOLS)
    parsed = parser.parse(QWEN35_TOOL, final=True)
    assert parsed.reasoning == "Weather needs a tool call.\n"
    assert parsed.content == ""
    (call,) = parsed.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "New York", "days": 5, "metric": True}


def test_xml_parameters_without_schema_guess_json() -> None:
    text = "<tool_call>\n<function=f>\n<parameter=a>\n[1, 2]\n</parameter>\n<parameter=b>\nplain words\n</parameter>\n</function>\n</tool_call>"
    _, calls = extract_tool_calls(text, {}, final=True)
    assert json.loads(calls[0].arguments) == {"a": [1, 2], "b": "plain words"}


def test_content_around_two_calls() -> None:
    content, calls = extract_tool_calls(QWEN3_TWO_TOOLS, WEATHER_TOOLS, final=True)
    assert content == "Let me check both."
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Zürich"]


def test_malformed_call_stays_content() -> None:
    text = "<tool_call>\n{not json}\n</tool_call>"
    content, calls = extract_tool_calls(text, WEATHER_TOOLS, final=True)
    assert calls == [] and content == text


@pytest.mark.parametrize("fmt", [QWEN, KIMI])
def test_a_call_with_an_integer_past_ints_digits_stays_content(fmt) -> None:
    """JSON that Python's json refuses with a ValueError of its own (an integer of more than 4300
    digits), not a JSONDecodeError: unreadable as a call, where it raised."""
    args = '{"days": 1' + "0" * 5000 + "}"
    body = (
        f'{{"name": "get_weather", "arguments": {args}}}'
        if fmt is QWEN
        else f"functions.get_weather:0<|tool_call_argument_begin|>{args}"
    )
    text = f"{fmt.start}{body}{fmt.end}"
    content, calls = extract_tool_calls(text, WEATHER_TOOLS, final=True, fmt=fmt)
    assert calls == [] and content == text
    assert stream(ChatOutputParser(tools=WEATHER_TOOLS, tool_format=fmt), text, cuts=[len(text)])[2] == []


@pytest.mark.parametrize(
    "text,starts_inside",
    [(QWEN3_TOOL, False), (QWEN35_TOOL, True), (QWEN3_TWO_TOOLS, False)],
    ids=["qwen3", "qwen3.5", "two"],
)
def test_streamed_tool_calls_equal_whole(text: str, starts_inside: bool) -> None:
    parser = ChatOutputParser(starts_in_reasoning=starts_inside, tools=WEATHER_TOOLS)
    whole = parser.parse(text, final=True)
    reasoning, content, calls = stream(parser, text)
    assert reasoning == (whole.reasoning or "")
    assert content == whole.content
    assert calls == [(c.name, json.loads(c.arguments)) for c in whole.tool_calls]
    assert "<tool_call" not in content


def test_partial_tags_are_held_back_while_streaming() -> None:
    parser = ChatOutputParser(tools=WEATHER_TOOLS)
    assert parser.parse("Sure <tool_ca", final=False).content == "Sure"
    assert parser.parse("Sure <tool_ca", final=True).content == "Sure <tool_ca"
    assert split_reasoning("<think>abc</thi", starts_in_reasoning=False, final=False) == ("abc", "")
    assert split_reasoning("<thi", starts_in_reasoning=False, final=False) == (None, "")


PARIS_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize(
    "tail",
    ['\n<tool_call>\n{"', "\n<tool", "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZür"],
    ids=["json", "tag", "xml"],
)
def test_a_call_cut_by_the_length_limit_leaves_no_markup(tail: str) -> None:
    """A second call cut off by max_tokens is neither content nor a call; the first call stands."""
    parser = ChatOutputParser(tools=WEATHER_TOOLS)
    for text in (PARIS_CALL + tail, "Checking. " + PARIS_CALL + tail):
        whole = parser.parse(text, final=True, cut=True)
        assert "<" not in whole.content and whole.content in ("", "Checking.")
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        _, content, calls = stream(parser, text, cut=True)
        assert content == whole.content and len(calls) == 1
    # where the model itself stopped there, the unfinished JSON call is shown, as before
    if "function=" not in tail:
        assert parser.parse(PARIS_CALL + tail, final=True).content == tail.strip()


def test_content_and_calls_come_in_the_order_written() -> None:
    parser = ChatOutputParser(tools=WEATHER_TOOLS)
    text = "Checking.\n" + PARIS_CALL + "\nDone."
    _, ordered = ChatStreamState(parser).feed_in_order(text, final=True)
    assert [p if isinstance(p, str) else p.function.name for p in ordered] == [
        "Checking.",
        "get_weather",
        "\n\nDone.",
    ]
    assert "".join(p for p in ordered if isinstance(p, str)) == parser.parse(text, final=True).content


FRAGMENTS = [
    "<think>",
    "</think>",
    "<thi",
    "</thin",
    "\n",
    "\n\n",
    "  ",
    "Let me think. ",
    "Answer: 42.",
    "<tool_call>",
    "</tool_call>",
    "<tool_ca",
    '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n',
    "\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n",
    "{broken",
    "é",
    "</",
]


@pytest.mark.parametrize("seed", range(6))
def test_incremental_parsers_match_whole_prefix_parsing(seed: int) -> None:
    """Random texts of tags, partial tags, calls (well-formed and not) and whitespace, cut at random:
    after every piece the stream has sent exactly what parsing the whole prefix gives."""
    import random

    rng = random.Random(seed)
    for _ in range(60):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        cuts = sorted({rng.randint(1, len(text)) for _ in range(rng.randint(1, 6))} | {len(text)})
        for starts_inside in (False, True):
            for tools in (None, WEATHER_TOOLS):
                for parse_reasoning in (True, False):
                    parser = ChatOutputParser(starts_inside, parse_reasoning, tools)
                    stream(parser, text, cuts)
                    stream(parser, text, cuts, cut=True)


KIMI_TWO_TOOLS = (
    "Checking both cities.<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 2}'
    "<|tool_call_end|>"
    '<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{"city": "Zürich"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)


def test_kimi_tool_calls() -> None:
    """Kimi's markup: the calls' names without `functions.` and the index, JSON arguments, the
    section markers neither content nor calls; a broken call stays content."""
    content, calls = extract_tool_calls(KIMI_TWO_TOOLS, WEATHER_TOOLS, final=True, fmt=KIMI)
    assert content == "Checking both cities."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Zürich"}),
    ]
    broken = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{oops<|tool_call_end|>"
    content, calls = extract_tool_calls(broken, WEATHER_TOOLS, final=True, fmt=KIMI)
    assert calls == [] and content == broken
    # Qwen's parser leaves Kimi's markup alone, and the other way round
    assert extract_tool_calls(KIMI_TWO_TOOLS, WEATHER_TOOLS, final=True)[1] == []
    assert extract_tool_calls(QWEN3_TWO_TOOLS, WEATHER_TOOLS, final=True, fmt=KIMI)[1] == []


def test_kimi_call_ids_are_the_models_own() -> None:
    """A Kimi call's id is `functions.NAME:IDX` as the model wrote it (its template writes the id
    back as the call's only record of its function, as vLLM's and SGLang's parsers keep it), in
    whole replies and streams; Qwen's calls, which carry no id, get the server's."""
    from deltaserve.server.text.chat_output import to_openai_tool_calls

    _, calls = extract_tool_calls(KIMI_TWO_TOOLS, WEATHER_TOOLS, final=True, fmt=KIMI)
    want = ["functions.get_weather:0", "functions.get_weather:1"]
    assert [c.id for c in to_openai_tool_calls(calls)] == want
    state = ChatStreamState(ChatOutputParser(False, False, WEATHER_TOOLS, KIMI))
    _, _, deltas = state.feed(KIMI_TWO_TOOLS, True)
    assert [d.id for d in deltas] == want
    _, qwen = extract_tool_calls(QWEN3_TWO_TOOLS, WEATHER_TOOLS, final=True)
    ids = [c.id for c in to_openai_tool_calls(qwen)]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    # the Messages and Responses APIs keep it too (tool_use id, call_id); others get their own form
    from deltaserve.server.api.messages import _Blocks
    from deltaserve.server.api.responses import _Events

    blocks, events = _Blocks(), _Events()
    blocks.feed(None, deltas + [d.model_copy(update={"id": "call_x"}) for d in deltas[:1]])
    events.feed(None, deltas)
    assert [b["id"] for b in blocks.blocks][:2] == want and blocks.blocks[2]["id"].startswith("toolu_")
    assert [item["call_id"] for item in events.output] == want
    # a call id that is not Kimi's form is not kept
    odd = '<|tool_call_begin|>get_weather<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|>'
    (call,) = extract_tool_calls(odd, WEATHER_TOOLS, final=True, fmt=KIMI)[1]
    assert call.name == "get_weather" and call.call_id is None


def test_tool_call_format_follows_the_vocabulary() -> None:
    assert tool_call_format({"<tool_call>": 1}) is QWEN
    assert tool_call_format({"<|tool_call_begin|>": 5, "<|tool_call_argument_begin|>": 6}) is KIMI


KIMI_FRAGMENTS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
    "functions.get_weather:0<|tool_call_argument_begin|>",
    '{"city": "Paris"}',
    "{broken",
    "<|tool_call_be",
    "Answer: 42. ",
    "\n",
    "  ",
    "é",
]


@pytest.mark.parametrize("seed", range(4))
def test_kimi_stream_matches_whole_prefix_parsing(seed: int) -> None:
    """As for Qwen's markup: random texts of Kimi's markers (whole, as the tokenizer emits them,
    and cut by the random piece boundaries), calls well-formed and not."""
    import random

    rng = random.Random(seed)
    parser = ChatOutputParser(False, False, WEATHER_TOOLS, KIMI)
    for _ in range(80):
        text = "".join(rng.choice(KIMI_FRAGMENTS) for _ in range(rng.randint(1, 12)))
        cuts = sorted({rng.randint(1, len(text)) for _ in range(rng.randint(1, 6))} | {len(text)})
        stream(parser, text, cuts)
        stream(parser, text, cuts, cut=True)
    reasoning, content, calls = stream(parser, KIMI_TWO_TOOLS)
    assert content == "Checking both cities." and [c[1]["city"] for c in calls] == ["Paris", "Zürich"]
