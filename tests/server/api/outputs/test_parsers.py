"""The reasoning and tool-call parsers on fixed Qwen outputs (the tiny model cannot produce them), whole
and streamed: every prefix of an output is parsed as a stream would see it, and the deltas must add
up to the whole-text result."""

from __future__ import annotations

import json
from typing import Any

import pytest

from deltaserve.server.protocol import DeltaToolCall
from deltaserve.server.text.chat_output import CallEnd, ChatOutputParser, ChatStreamState
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
) -> tuple[str, str, list[tuple[str, Any]]]:
    """Feed `text` in pieces (ending at `cuts`, by default one character each) as a stream would,
    and concatenate the deltas (a call's first carries its name, the next ones fragments of its
    arguments). After every piece, what was streamed must equal the parse of the text so far: the
    incremental parsers give what parsing each whole prefix would. `cut`: the text ends at the
    length limit. The calls' arguments come back decoded where they are JSON."""
    state = ChatStreamState(parser)
    reasoning, content, calls = "", "", []
    start = 0
    for end in cuts or range(1, len(text) + 1):
        final = end == len(text)
        r, c, new_calls = state.feed(text[start:end], final, cut and final)
        start = end
        reasoning += r or ""
        content += c or ""
        for call in new_calls:
            if call.function.name is not None:  # a call's first delta: its index, id, type and name
                assert call.index == len(calls) and call.id and call.type == "function"
                calls.append((call.function.name, ""))
            else:
                assert call.index == len(calls) - 1 and call.id is None
            calls[-1] = (calls[-1][0], calls[-1][1] + (call.function.arguments or ""))
        prefix = parser.parse(text[:end], final, cut and final)
        assert (reasoning, content) == (prefix.reasoning or "", prefix.content), text[:end]
        assert calls == [(c.name, c.arguments) for c in prefix.tool_calls], text[:end]
    return reasoning, content, [(name, _decoded(arguments)) for name, arguments in calls]


def _decoded(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


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
def test_a_call_with_an_integer_past_ints_digits_keeps_it(fmt) -> None:
    """An integer of more than 4300 digits, which Python's json refuses with a ValueError of its own
    (it raised, then stayed content): valid JSON, its digits are the arguments' as written."""
    args = '{"days": 1' + "0" * 5000 + "}"
    body = (
        f'{{"name": "get_weather", "arguments": {args}}}'
        if fmt is QWEN
        else f"functions.get_weather:0<|tool_call_argument_begin|>{args}"
    )
    text = f"{fmt.start}{body}{fmt.end}"
    content, calls = extract_tool_calls(text, WEATHER_TOOLS, final=True, fmt=fmt)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", args)]
    parser = ChatOutputParser(tools=WEATHER_TOOLS, tool_format=fmt)
    assert stream(parser, text, cuts=[len(text) // 2, len(text)])[2] == [("get_weather", args)]


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
    """A second call cut off by max_tokens is no content; the first call stands. Cut before its name
    it is no call; after it (a stream has sent the name and the arguments so far) it is one, whose
    arguments are those written, cut off as the stream's are."""
    parser = ChatOutputParser(tools=WEATHER_TOOLS)
    named = "function=" in tail
    for text in (PARIS_CALL + tail, "Checking. " + PARIS_CALL + tail):
        whole = parser.parse(text, final=True, cut=True)
        assert "<" not in whole.content and whole.content in ("", "Checking.")
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [
            ("get_weather", '{"city": "Paris"}'),
            *([("get_weather", '{"city": "Zür')] if named else []),
        ]
        _, content, calls = stream(parser, text, cut=True)
        assert content == whole.content and len(calls) == 1 + named
    # where the model itself stopped there, the unfinished JSON call is shown, as before
    if "function=" not in tail:
        assert parser.parse(PARIS_CALL + tail, final=True).content == tail.strip()


def test_content_and_calls_come_in_the_order_written() -> None:
    parser = ChatOutputParser(tools=WEATHER_TOOLS)
    text = "Checking.\n" + PARIS_CALL + "\nDone."
    _, ordered = ChatStreamState(parser).feed_in_order(text, final=True)
    assert [p if isinstance(p, str | CallEnd) else p.function.name for p in ordered] == [
        "Checking.",
        "get_weather",
        CallEnd(0),
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
    section markers neither content nor calls; a call broken before its arguments stays content,
    one broken in them (its name sent) keeps its arguments up to where they break."""
    content, calls = extract_tool_calls(KIMI_TWO_TOOLS, WEATHER_TOOLS, final=True, fmt=KIMI)
    assert content == "Checking both cities."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("get_weather", {"city": "Zürich"}),
    ]
    broken = "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>[1]<|tool_call_end|>"
    content, calls = extract_tool_calls(broken, WEATHER_TOOLS, final=True, fmt=KIMI)
    assert calls == [] and content == broken
    broken = broken.replace("[1]", '{"city": oops}')
    content, calls = extract_tool_calls(broken, WEATHER_TOOLS, final=True, fmt=KIMI)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": ')]
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
    _, ordered = state.feed_in_order(KIMI_TWO_TOOLS, True)
    deltas = [d for d in ordered if isinstance(d, DeltaToolCall)]
    assert [d.id for d in deltas] == want
    _, qwen = extract_tool_calls(QWEN3_TWO_TOOLS, WEATHER_TOOLS, final=True)
    ids = [c.id for c in to_openai_tool_calls(qwen)]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
    # the Messages and Responses APIs keep it too (tool_use id, call_id); others get their own form
    from deltaserve.server.api.messages import _Blocks
    from deltaserve.server.api.responses import _Events

    blocks, events = _Blocks(), _Events()
    calls = [p for p in ordered if not isinstance(p, str)]
    blocks.feed(None, [*calls, deltas[0].model_copy(update={"id": "call_x"}), CallEnd(2)])
    events.feed(None, calls)
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


@pytest.mark.parametrize(
    "fmt,text,name_at,want",
    [
        (QWEN, QWEN35_TOOL.split("</think>\n\n")[1], "New Yo", '{"city": "New Yo'),
        (QWEN, QWEN3_TOOL.split("</think>\n\n")[1], '"Par', '{"city": "Par'),
        (KIMI, KIMI_TWO_TOOLS, '"Par', '{"city": "Par'),
    ],
    ids=["xml", "json", "kimi"],
)
def test_a_call_streams_its_name_then_its_arguments_as_written(
    fmt, text: str, name_at: str, want: str
) -> None:
    """A call's first delta (index, id, type, name) goes out once its name is written, before its
    end tag; its arguments follow in fragments as the model writes them, as OpenAI's, vLLM's and
    SGLang's streams send them."""
    parser = ChatOutputParser(parse_reasoning=False, tools=WEATHER_TOOLS, tool_format=fmt)
    state = ChatStreamState(parser)
    head = text[: text.index(name_at) + len(name_at)]
    _, _, deltas = state.feed(head, final=False)
    (first, *rest) = deltas
    assert (first.index, first.type, first.function.name) == (0, "function", "get_weather") and first.id
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    assert "".join(d.function.arguments or "" for d in deltas) == want
    _, _, more = state.feed(text[len(head) :], final=True)
    arguments = want + "".join(d.function.arguments or "" for d in more if d.index == 0)
    assert json.loads(arguments) == json.loads(parser.parse(text, final=True).tool_calls[0].arguments)


# characters that a tool-call reader must not take for markup, escapes or formatting
TRICKY = [
    "<",
    ">",
    "</",
    "<parameter",
    "</para",
    "</function",
    '"',
    "'",
    "\\",
    "\n",
    "\t",
    " ",
    "é",
    "😀",
    "{",
    "a",
]


def _random_value(rng: Any, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 2 else 4)
    if kind == 0:
        return "".join(rng.choice(TRICKY) for _ in range(rng.randrange(8)))
    if kind == 1:
        return rng.choice([0, -7, 10**30, 2.5, -0.125, 1e300, True, False, None])
    if kind == 2:
        return "x" + "".join(rng.choice(TRICKY) for _ in range(rng.randrange(8))) + "y"
    if kind == 3:
        return rng.randrange(-1000, 1000)
    if kind == 4:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {f"k{i}{rng.choice(TRICKY)}": _random_value(rng, depth + 1) for i in range(rng.randrange(3))}


def _random_call(rng: Any, fmt: Any, index: int) -> tuple[str, dict[str, Any]]:
    """A call's markup, written as a model would in one of the three forms, and its arguments."""
    if fmt is KIMI:
        args = {f"p{i}": _random_value(rng) for i in range(rng.randrange(4))}
        spaced = rng.random() < 0.5  # the model's own JSON layout, which the arguments do not keep
        body = json.dumps(args, ensure_ascii=rng.random() < 0.5, indent=2 if spaced else None)
        return (
            f"<|tool_call_begin|>functions.get_weather:{index}<|tool_call_argument_begin|>{body}<|tool_call_end|>",
            args,
        )
    if rng.random() < 0.5:
        args = {f"p{i}": _random_value(rng) for i in range(rng.randrange(4))}
        body = json.dumps({"name": "get_weather", "arguments": args}, ensure_ascii=rng.random() < 0.5)
        return f"<tool_call>\n{body}\n</tool_call>", args
    # Qwen3.5's XML: "city" is a string by the schema, streamed as it comes; "days" an integer
    args, params = {}, []
    for key in rng.sample(["city", "days"], rng.randrange(3)):
        if key == "city":
            value: Any = "".join(rng.choice(TRICKY) for _ in range(rng.randrange(12)))
            for tag in ("</parameter>", "<parameter=", "</function>", "</tool_call>"):
                value = value.replace(tag, "")
            # a value whose last character is a newline loses it to the markup's, as the template writes it
            value = value.rstrip("\n") if rng.random() < 0.5 else value
            written = value
        else:
            value = rng.randrange(-50, 50)
            written = str(value)
        args[key] = value
        params.append(f"<parameter={key}>\n{written}\n</parameter>\n")
    return f"<tool_call>\n<function=get_weather>\n{''.join(params)}</function>\n</tool_call>", args


@pytest.mark.parametrize("fmt", [QWEN, KIMI], ids=["qwen", "kimi"])
@pytest.mark.parametrize("seed", range(4))
def test_random_calls_stream_the_arguments_of_the_whole_reply(fmt, seed: int) -> None:
    """Random replies of text and calls (values holding `<`, partial tags, quotes, backslashes,
    newlines and unicode), fed in random pieces: after every piece the streamed calls (names and
    joined argument fragments) equal the parse of the text so far, and the whole reply's arguments
    are those written, as json.dumps writes them. Cut off at random (max_tokens), a call whose name is out keeps the
    start of its arguments, the same streamed and whole."""
    import random

    rng = random.Random(seed)
    parser = ChatOutputParser(parse_reasoning=False, tools=WEATHER_TOOLS, tool_format=fmt)
    for _ in range(40):
        parts, written = [rng.choice(["", "Checking. ", "a < b "])], []
        for index in range(rng.randrange(1, 4)):
            markup, args = _random_call(rng, fmt, index)
            parts += [markup, rng.choice(["", "\n"])]
            written.append(args)
        text = "".join(parts)
        if fmt is KIMI:
            text = text.replace("<|tool_call_begin|>", "<|tool_calls_section_begin|><|tool_call_begin|>", 1)
        cuts = sorted({rng.randint(1, len(text)) for _ in range(rng.randint(1, 30))} | {len(text)})
        _, _, calls = stream(parser, text, cuts)
        assert calls == [("get_weather", args) for args in written]
        whole = [c.arguments for c in parser.parse(text, final=True).tool_calls]
        assert whole == [json.dumps(args, ensure_ascii=False) for args in written]  # as OpenAI's are written
        end = rng.randint(1, len(text))
        _, _, cut_calls = stream(parser, text[:end], [c for c in cuts if c < end] + [end], cut=True)
        shown = [c.arguments for c in parser.parse(text[:end], final=True, cut=True).tool_calls]
        assert len(cut_calls) == len(shown) <= len(whole)
        assert all(whole[i].startswith(arguments) for i, arguments in enumerate(shown))


@pytest.mark.parametrize("fmt", [QWEN, KIMI], ids=["qwen", "kimi"])
def test_a_lone_surrogate_escape_in_the_arguments_stays_that_escape(fmt) -> None:
    """Arguments whose JSON decodes to a lone surrogate (no reply can carry one) keep the escape the
    model wrote, whoever chose the call: its name was sent before them. A name holding one is no
    call, its text content."""
    args = '{"city": "\\ud800 \\ud83d\\ude00"}'
    body = (
        f'{{"name": "get_weather", "arguments": {args}}}'
        if fmt is QWEN
        else f"functions.get_weather:0<|tool_call_argument_begin|>{args}"
    )
    text = f"{fmt.start}{body}{fmt.end}"
    parser = ChatOutputParser(tools=WEATHER_TOOLS, tool_format=fmt)
    assert [(c.name, c.arguments) for c in parser.parse(text, final=True).tool_calls] == [
        ("get_weather", '{"city": "\\ud800 😀"}')
    ]
    assert stream(parser, text)[2] == [("get_weather", {"city": "\ud800 😀"})]
    if fmt is QWEN:
        text = '<tool_call>{"name": "get_\\udc00", "arguments": {}}</tool_call>'
        parsed = parser.parse(text, final=True)
        assert parsed.tool_calls == [] and parsed.content == text
