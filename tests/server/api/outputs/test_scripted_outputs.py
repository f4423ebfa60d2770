"""Reasoning and tool calls through the whole HTTP path. The tiny model cannot write them, so these
tests serve the real app over a stand-in engine that "generates" a fixed Qwen-style output token by
token with the real Qwen3 tokenizer; everything from the request to the SSE bytes is the real server."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.server.app import build_app
from deltaserve.server.engine_client import EngineClient

from ...conftest import app_in_thread

# A server started in a thread per test (tests/server/api/outputs/test_parsers.py stays fast)
pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]
QWEN3_OUTPUT = (
    "<think>\nThe user wants the weather in Paris.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
)
QWEN35_OUTPUT = (
    "Paris weather, two days.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


class ScriptedEngine:
    """The Engine interface, replaying one fixed output for every request."""

    def __init__(self, tokenizer, script: str) -> None:
        self.tokenizer = tokenizer
        self.script = tokenizer.encode(script, add_special_tokens=False)
        self.max_model_len = 4096
        self.vocab_size = 151936
        self.model_info = {"model": "scripted", "architecture": "Scripted"}
        self.eos_token_ids = [151645]
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.sent: dict[str, tuple[int, int]] = {}  # delta outputs: tokens and characters sent

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.requests[request_id] = (prompt_token_ids, params, [])

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def compile_structured(self, spec) -> None:
        pass  # the script is the output: a request's grammar is not applied

    def stats(self) -> dict[str, int]:
        return {"running": len(self.requests), "waiting": 0}

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        outputs = []
        for request_id, (prompt, params, out) in list(self.requests.items()):
            out.append(self.script[len(out)])
            done = len(out) == len(self.script) or len(out) == params.max_tokens
            reason = None if not done else ("stop" if len(out) == len(self.script) else "length")
            text = self.tokenizer.decode(out)
            text = text.rstrip("\ufffd") if not done else text
            completion = CompletionOutput(0, list(out), text, reason)
            if params.output_kind == "delta":  # what streams ask for: only what this step adds
                sent_tokens, sent_chars = self.sent.get(request_id, (0, 0))
                completion = CompletionOutput(
                    0, out[sent_tokens:], text[sent_chars:], reason, num_tokens=len(out)
                )
                self.sent[request_id] = (len(out), len(text))
            delta = params.output_kind == "delta"
            if done or params.output_kind != "final_only":
                outputs.append(RequestOutput(request_id, prompt, [completion], done, delta=delta))
            if done:
                del self.requests[request_id]
        return outputs


@pytest.fixture(scope="module")
def tokenizer(builtin_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path)


@pytest.fixture
def serve_script(tokenizer) -> Iterator:
    """Serve the app over a ScriptedEngine on a free port, in a thread; returns an openai client."""
    with contextlib.ExitStack() as servers:

        def serve(script: str, chat_template: str | None = None, tok=None, **app_kw) -> openai.OpenAI:
            app = build_app(
                EngineClient.in_thread(ScriptedEngine(tok or tokenizer, script)),
                model_names=["scripted"],
                chat_template=chat_template,
                **app_kw,
            )
            port = servers.enter_context(app_in_thread(app, join_s=10))
            return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)

        yield serve


def ask(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(
        model="scripted",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        **{"max_tokens": 500, **kwargs},
    )


def collect_stream(client: openai.OpenAI, **kwargs) -> tuple[str, str, list[dict], list[str]]:
    reasoning, content, calls, finishes = "", "", {}, []
    for chunk in ask(client, stream=True, **kwargs):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": call.id, "name": "", "arguments": ""})
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    return reasoning, content, [calls[i] for i in sorted(calls)], finishes


def test_qwen3_json_tool_call_over_http(serve_script) -> None:
    client = serve_script(QWEN3_OUTPUT)
    r = ask(client, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert "weather in Paris" in choice.message.reasoning_content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "city": "Paris",
        "days": 2,
    }

    reasoning, content, calls, finishes = collect_stream(client, tools=TOOLS)
    assert reasoning == choice.message.reasoning_content
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    assert finishes == ["tool_calls"]


@pytest.mark.parametrize(
    ("tool_choice", "finish"),
    [("required", "tool_calls"), ({"type": "function", "function": {"name": "get_weather"}}, "stop")],
)
def test_a_forced_calls_finish_reason_is_openais(serve_script, tool_choice, finish: str) -> None:
    """OpenAI's and vLLM's finish reason for a forced call: "tool_calls" under "required", "stop"
    under a named function (it was "tool_calls" for both), whole and streamed."""
    client = serve_script(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    choice = ask(client, tools=TOOLS, tool_choice=tool_choice).choices[0]
    assert choice.finish_reason == finish
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris"}]
    _, _, calls, finishes = collect_stream(client, tools=TOOLS, tool_choice=tool_choice)
    assert finishes == [finish] and [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}]


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_whose_arguments_hold_a_lone_surrogate_stays_a_call(serve_script, tool_choice) -> None:
    """A call that tool_choice forces is a call even where its JSON decodes to a lone surrogate
    (vLLM passes a named call's text on as written; under "auto" too, its name sent): its arguments
    keep the escape the model wrote, whole and streamed, and the Responses API's item too; the
    Messages API's tool_use input, which its reply cannot carry, is {} (as for NaN)."""
    script = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "\\ud800"}}\n</tool_call>'
    client = serve_script(script)
    message = ask(client, tools=TOOLS, tool_choice=tool_choice).choices[0].message
    assert not message.content and [c.function.name for c in message.tool_calls] == ["get_weather"]
    assert [c.function.arguments for c in message.tool_calls] == ['{"city": "\\ud800"}']
    assert json.loads(message.tool_calls[0].function.arguments) == {"city": "\ud800"}
    _, content, calls, _ = collect_stream(client, tools=TOOLS, tool_choice=tool_choice)
    assert content == "" and [(c["name"], c["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "\\ud800"}')
    ]
    flat = {"type": "function", "name": "get_weather"} if isinstance(tool_choice, dict) else tool_choice
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    r = client.responses.create(model="scripted", input="?", tools=tools, tool_choice=flat)
    assert [(i.type, i.arguments) for i in r.output] == [("function_call", '{"city": "\\ud800"}')]
    choice = {"type": "tool", "name": "get_weather"} if isinstance(tool_choice, dict) else {"type": "any"}
    m = claude_for(client).messages.create(**WEATHER_ASK, max_tokens=500, tool_choice=choice)
    assert [(b.type, b.input) for b in m.content] == [("tool_use", {})]


def test_qwen35_xml_tool_call_after_prompt_opened_think(serve_script, tmp_path: Path) -> None:
    # A Qwen3.5-style template: its generation prompt opens <think>, so the output starts in reasoning.
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    client = serve_script(QWEN35_OUTPUT, chat_template=template)
    r = ask(client, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content.startswith("Paris weather, two days.")
    (call,) = choice.message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}  # days typed by the schema

    reasoning, content, calls, finishes = collect_stream(client, tools=TOOLS)
    assert reasoning == choice.message.reasoning_content and content == ""
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris", "days": 2}]
    assert finishes == ["tool_calls"]


@pytest.mark.parametrize("form", ["xml", "json"])
def test_the_openai_clients_stream_helper_gets_the_arguments_in_fragments(serve_script, form: str) -> None:
    """The official client's chat stream helper, over a reply of two calls: each call's arguments
    arrive in many `tool_calls.function.arguments.delta` events, before the call's end, that add up
    to the whole reply's arguments (a value with markup-like text, quotes, newlines and unicode);
    the ids stay, the finish reason is tool_calls."""
    city = 'New "York" <b>\n</para é 😀'
    if form == "xml":
        call = f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
    else:
        call = (
            f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': {'city': city}})}\n</tool_call>"
        )
    client = serve_script("Checking.\n" + call + "\n" + call)
    whole = ask(client, tools=TOOLS).choices[0]
    assert [json.loads(c.function.arguments) for c in whole.message.tool_calls] == [{"city": city}] * 2
    kw = dict(model="scripted", messages=[{"role": "user", "content": "?"}], tools=TOOLS, max_tokens=500)
    with client.chat.completions.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    deltas = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [e.arguments for e in done] == [c.function.arguments for c in whole.message.tool_calls]
    for index in (0, 1):
        pieces = [e.arguments_delta for e in deltas if e.index == index]
        assert len(pieces) > 5 and "".join(pieces) == done[index].arguments
        assert {e.name for e in deltas if e.index == index} == {"get_weather"}
    # the first call's fragments come before the second call begins
    first_of_second = next(i for i, e in enumerate(events) if getattr(e, "index", None) == 1)
    assert max(i for i, e in enumerate(events) if e in deltas and e.index == 0) < first_of_second
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert [c.function.arguments for c in choice.message.tool_calls] == [e.arguments for e in done]
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    # every chunk of a call after its first carries its index and arguments only, as OpenAI's do
    raw = [
        c for e in events if e.type == "chunk" for ch in e.chunk.choices for c in ch.delta.tool_calls or []
    ]
    assert [c.id for c in raw if c.function.name] == ids
    assert all(c.id is None and c.type is None for c in raw if not c.function.name)


def test_responses_api_gives_reasoning_and_call_items(serve_script) -> None:
    """/v1/responses over the same scripted Qwen3.5 output: a reasoning item, then a function_call
    item with typed arguments; streamed, the events build the same items."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    client = serve_script(QWEN35_OUTPUT, chat_template=template)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    r = client.responses.create(model="scripted", input="Weather in Paris?", tools=tools)
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning", "function_call"] and r.status == "completed"
    assert r.output[0].content[0].text.startswith("Paris weather, two days.")
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    details = r.usage.output_tokens_details
    assert 5 <= details.reasoning_tokens < r.usage.output_tokens  # the think text's tokens, not the call's

    events = list(
        client.responses.create(model="scripted", input="Weather in Paris?", tools=tools, stream=True)
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == r.output[0].content[0].text
    (args,) = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(args) == {"city": "Paris", "days": 2}
    # the arguments stream in fragments as they are written
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 2 and "".join(pieces) == args == call.arguments
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "function_call"]
    assert final.response.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    # the reasoning item closes before the call item opens
    order = [(e.type, getattr(e, "output_index", None)) for e in events]
    assert order.index(("response.output_item.done", 0)) < order.index(("response.output_item.added", 1))
    # the call item opens in progress and is done when its arguments are, as OpenAI's stream goes
    opened, closed = (next(e.item for e in events if e.type == t and e.output_index == 1) for t in
                      ("response.output_item.added", "response.output_item.done"))  # fmt: skip
    assert (opened.status, closed.status) == ("in_progress", "completed")


def test_kimi_tool_calls_over_http(serve_script, kimi_tokenizer_folder) -> None:
    """A Kimi-style tokenizer (its markers in the vocabulary) makes the server read Kimi's call
    markup: chat completions and the Responses API, whole and streamed."""
    from deltaserve.models.checkpoints.tiktoken_tokenizer import load_tiktoken_tokenizer

    tok = load_tiktoken_tokenizer(kimi_tokenizer_folder[0])
    script = (
        "Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_calls_section_end|>'
    )
    client = serve_script(script, tok=tok)
    r = ask(client, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    _, content, calls, finishes = collect_stream(client, tools=TOOLS)
    assert content == "Let me look." and finishes == ["tool_calls"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris", "days": 2}]
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    resp = client.responses.create(model="scripted", input="Weather?", tools=tools)
    assert [item.type for item in resp.output] == ["message", "function_call"]
    assert resp.output_text == "Let me look." and resp.output[1].name == "get_weather"


def test_without_tools_the_call_text_stays_content(serve_script) -> None:
    client = serve_script(QWEN3_OUTPUT)
    r = ask(client)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "<tool_call>" in r.choices[0].message.content
    _, content, calls, _ = collect_stream(client)
    assert content == r.choices[0].message.content and calls == []


def test_a_call_nested_deeper_than_a_parser_recurses_stops_there(serve_script) -> None:
    """A generated call whose JSON nests past what a parser recurses (and the next turn's template
    takes: MAX_ARGUMENTS_DEPTH) is a call, its name sent before its arguments are read, whose
    arguments stop at that depth, whole and streamed alike; not a 500."""
    from deltaserve.engine.requests.chat_prompt import MAX_ARGUMENTS_DEPTH

    deep = "[" * 1500 + "]" * 1500
    client = serve_script(
        f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": {deep}}}}}\n</tool_call>'
    )
    r = ask(client, tools=TOOLS, max_tokens=3000)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    assert call.function.arguments == '{"city": ' + "[" * (MAX_ARGUMENTS_DEPTH - 1)
    _, content, calls, finishes = collect_stream(client, tools=TOOLS, max_tokens=3000)
    assert content == "" and finishes == ["tool_calls"]
    assert [c["arguments"] for c in calls] == [call.function.arguments]


def test_tool_choice_none_turns_parsing_off(serve_script) -> None:
    client = serve_script(QWEN3_OUTPUT)
    r = ask(client, tools=TOOLS, tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content


def test_required_of_an_empty_tools_list_asks_for_no_call(serve_script) -> None:
    """vLLM's and OpenAI's: tool_choice "required" with `tools: []` is served as "none" (it was a
    400); with no tools field at all it stays a 400."""
    client = serve_script("Plain words.")
    choice = ask(client, tools=[], tool_choice="required").choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "Plain words."
    with pytest.raises(openai.BadRequestError, match="needs tools"):
        ask(client, tool_choice="required")


def test_length_cut_inside_reasoning(serve_script) -> None:
    client = serve_script(QWEN3_OUTPUT)
    r = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=6
    )
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and choice.message.reasoning_content


def test_a_second_call_cut_by_max_tokens_leaves_no_markup(serve_script, tokenizer) -> None:
    """Under tool_choice "required", a second call that max_tokens cuts off is neither content nor a
    call, in chat (whole and streamed) and in the Responses API, whose items keep the written order."""
    first = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    # cut inside the second call, and inside a start tag written as plain text
    for tail, rest in (('<tool_call>\n{"', 'name": "get_weather"'), ("<tool", "_ca")):
        ids = tokenizer.encode(first + tail + rest, add_special_tokens=False)
        limit = len(tokenizer.encode(first + tail, add_special_tokens=False))
        assert tokenizer.decode(ids[:limit]) == first + tail
        client = serve_script(first + tail + rest)
        r = ask(client, tools=TOOLS, tool_choice="required", max_tokens=limit)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [{"city": "Paris"}]
        _, content, calls, finishes = collect_stream(
            client, tools=TOOLS, tool_choice="required", max_tokens=limit
        )
        assert content == "" and [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}]

        tools = [{"type": "function", **TOOLS[0]["function"]}]
        kw = dict(
            model="scripted", input="Weather?", tools=tools, tool_choice="required", max_output_tokens=limit
        )
        resp = client.responses.create(**kw)
        assert resp.status == "incomplete" and [item.type for item in resp.output] == ["function_call"]
        events = list(client.responses.create(**kw, stream=True))
        assert [item.type for item in events[-1].response.output] == ["function_call"]
        assert not [e for e in events if e.type == "response.output_text.delta"]


def test_responses_items_keep_the_written_order(serve_script) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    client = serve_script("Checking." + call + "Then more.")
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    kw = dict(model="scripted", input="Weather?", tools=tools)
    resp = client.responses.create(**kw)
    assert [item.type for item in resp.output] == ["message", "function_call", "message"]
    assert [i.content[0].text for i in resp.output if i.type == "message"] == ["Checking.", "Then more."]
    final = list(client.responses.create(**kw, stream=True))[-1].response
    assert [item.type for item in final.output] == ["message", "function_call", "message"]
    assert final.output_text == resp.output_text


def raw_lines(client: openai.OpenAI, path: str, body: dict) -> list[str]:
    """The stream's chunks' JSON text, as on the wire."""
    import httpx

    resp = httpx.post(f"{client.base_url}{path}", json=body, timeout=30)
    assert resp.status_code == 200
    # SSE lines end at CR or LF only (str.splitlines would also split a U+2028 inside a string)
    lines = resp.content.decode().split("\n")
    return [line[len("data: ") :] for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def raw_chunks(client: openai.OpenAI, path: str, body: dict) -> list[dict]:
    """The stream's chunks as the bytes on the wire give them (the SDK would hide absent fields)."""
    return [json.loads(line) for line in raw_lines(client, path, body)]


def test_stream_chunks_on_the_wire(serve_script) -> None:
    # OpenAI's chunk shape: a chat delta holds only what it adds, no nulls; choices keep their
    # logprobs and finish_reason (null until the end); usage only in its own last chunk
    client = serve_script(QWEN3_OUTPUT)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    chat = raw_chunks(
        client,
        "chat/completions",
        {
            "model": "scripted",
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    *deltas, last = chat
    assert deltas[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    for chunk in deltas:
        assert chunk["object"] == "chat.completion.chunk" and "usage" not in chunk
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "delta", "logprobs", "finish_reason", "stop_reason"}  # as vLLM's
        assert choice["delta"] and None not in choice["delta"].values()
    assert deltas[-1]["choices"][0]["finish_reason"] == "stop"
    assert last["choices"] == [] and last["usage"]["completion_tokens"] > 0

    text = raw_chunks(
        client, "completions", {"model": "scripted", "prompt": "Hi", "max_tokens": 5, "stream": True}
    )
    # a chunk a token, or fewer: outputs the stream had not yet sent when the next came go as one
    assert 1 <= len(text) <= 5
    for chunk in text:
        assert chunk["object"] == "text_completion" and "usage" not in chunk
        (choice,) = chunk["choices"]
        assert set(choice) == {
            "index",
            "text",
            "logprobs",
            "finish_reason",
            "stop_reason",
        }  # no prompt_logprobs
    assert [c["choices"][0]["finish_reason"] for c in text] == [None] * (len(text) - 1) + ["length"]


TRICKY = (
    'Quotes " and \\ back\\slashes,\ttabs,\nnew lines, </script>, café, 日本語, emoji 🙂 and \u2028 done.'
)


def test_streamed_text_chunks_are_what_pydantic_renders(serve_script) -> None:
    """Text-only chunks are filled into a template rendered once (generation.py's text_event):
    each must be byte for byte the chunk that pydantic's models give, and the text whole."""
    from deltaserve.server.protocol import ChatCompletionChunk, CompletionResponse

    client = serve_script(TRICKY)
    chat = raw_lines(
        client,
        "chat/completions",
        {"model": "scripted", "messages": [{"role": "user", "content": "x"}], "stream": True},
    )
    text = raw_lines(
        client, "completions", {"model": "scripted", "prompt": "Hi", "max_tokens": 500, "stream": True}
    )
    assert len(chat) > 10 and len(text) > 10
    for line in chat:
        chunk = ChatCompletionChunk.model_validate_json(line)
        assert chunk.model_dump_json(exclude={"usage"}) == line
    for line in text:
        chunk = CompletionResponse.model_validate_json(line)
        assert (
            chunk.model_dump_json(exclude={"usage": True, "choices": {"__all__": {"prompt_logprobs"}}})
            == line
        )
    content = "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in chat)
    assert content == TRICKY
    assert "".join(json.loads(line)["choices"][0]["text"] for line in text) == TRICKY


def test_anthropic_messages_give_thinking_and_tool_use_blocks(serve_script) -> None:
    """Anthropic's Messages API over the scripted Qwen3 output, through Anthropic's own SDK: a
    thinking block, then a tool_use block with the parsed input, stop_reason tool_use; streamed,
    the events come in Anthropic's order and build the same message."""
    import anthropic
    import httpx

    base = str(serve_script(QWEN3_OUTPUT).base_url).removesuffix("/").removesuffix("/v1")
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    tools = [
        {
            "name": "get_weather",
            "description": "Current weather",
            "input_schema": TOOLS[0]["function"]["parameters"],
        }
    ]
    ask = {
        "model": "scripted",
        "max_tokens": 500,
        "tools": tools,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    m = client.messages.create(**ask)
    assert [b.type for b in m.content] == ["thinking", "tool_use"] and m.stop_reason == "tool_use"
    assert "weather in Paris" in m.content[0].thinking
    call = m.content[1]
    assert (
        call.name == "get_weather"
        and call.input == {"city": "Paris", "days": 2}
        and call.id.startswith("toolu_")
    )
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"] and final.stop_reason == "tool_use"
    assert final.content[0].thinking == m.content[0].thinking and final.content[1].input == call.input
    with httpx.stream("POST", f"{base}/v1/messages", json={**ask, "stream": True}, timeout=30) as r:
        kinds = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    runs = [k for i, k in enumerate(kinds) if k != "content_block_delta" or kinds[i - 1] != k]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]  # deltas: one or more
    assert runs == ["message_start", *block, *block, "message_delta", "message_stop"]


# a Messages request with the get_weather tool (Anthropic's shape), for the scripted outputs
WEATHER_ASK = {
    "model": "scripted",
    "tools": [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
    "messages": [{"role": "user", "content": "?"}],
}


def claude_for(client: openai.OpenAI) -> Any:
    """Anthropic's client for the server an OpenAI client of `serve_script` talks to."""
    import anthropic

    base = str(client.base_url).removesuffix("/").removesuffix("/v1")
    return anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)


LONG_TEXT = "".join(f'line {i}: "quoted" é\tand more\n' for i in range(12))
WRITE_FILE = {
    "name": "write_file",
    "input_schema": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
    },
}


@pytest.mark.parametrize(
    "call",
    [
        '<tool_call>\n{"name": "write_file", "arguments": '
        + json.dumps({"path": "notes.txt", "text": LONG_TEXT})
        + "}\n</tool_call>",
        "<tool_call>\n<function=write_file>\n<parameter=path>\nnotes.txt\n</parameter>\n"
        f"<parameter=text>\n{LONG_TEXT}\n</parameter>\n</function>\n</tool_call>",
    ],
    ids=["qwen3-json", "qwen35-xml"],
)
def test_a_streamed_tool_use_input_comes_as_the_model_writes_it(serve_script, call: str) -> None:
    """A long call streamed through Anthropic's SDK: its tool_use block opens before its input, which
    comes in many input_json_delta fragments (the SDK's snapshot holds the path before the call
    ends) whose join is the whole reply's input as JSON; the message the SDK builds is the whole
    reply's."""
    client = claude_for(serve_script("Writing it.\n" + call))
    ask = {**WEATHER_ASK, "tools": [WRITE_FILE], "max_tokens": 2000}
    m = client.messages.create(**ask)
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    assert m.content[1].input == {"path": "notes.txt", "text": LONG_TEXT}
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    start = next(i for i, e in enumerate(events) if e.type == "content_block_start" and e.index == 1)
    assert events[start].content_block.type == "tool_use" and kinds.index("input_json") > start
    fragments = [e for e in events if e.type == "input_json"]
    assert (
        len(fragments) > 10 and json.loads("".join(e.partial_json for e in fragments)) == m.content[1].input
    )
    assert {"path": "notes.txt"} in [e.snapshot for e in fragments]

    def blocks(message: Any) -> list[tuple[Any, ...]]:
        return [(b.type, getattr(b, "text", None), getattr(b, "name", None), getattr(b, "input", None))
                for b in message.content]  # fmt: skip

    assert blocks(final) == blocks(m) and final.stop_reason == m.stop_reason
    assert final.content[1].id.startswith("toolu_")


@pytest.mark.parametrize("arguments", ['"not json"', "[1, 2]", '"{oops"'])
def test_a_tool_calls_input_is_an_object_streamed_or_not(serve_script, arguments: str) -> None:
    """Arguments that are no JSON object (a string, an array) give a tool_use input of {} in the
    reply and in the stream alike: Anthropic's format has objects only, and its SDK's stream
    parses each input_json_delta as JSON."""
    script = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    client = claude_for(serve_script(script))
    ask = {**WEATHER_ASK, "max_tokens": 500}
    m = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    for reply in (m, final):
        assert [(b.type, b.name, b.input) for b in reply.content] == [("tool_use", "get_weather", {})]


def test_a_reply_cut_after_a_tool_call_stops_for_max_tokens(serve_script) -> None:
    """max_tokens cuts a reply after one whole call (a second one is dropped): the stop reason is
    max_tokens, as chat's finish reason is length, not tool_use."""
    script = (
        QWEN3_OUTPUT + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
    )
    client = serve_script(script)
    chat = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "?"}], tools=TOOLS, max_tokens=45
    )
    assert chat.choices[0].finish_reason == "length" and len(chat.choices[0].message.tool_calls) == 1
    claude = claude_for(client)
    ask = {**WEATHER_ASK, "max_tokens": 45}
    m = claude.messages.create(**ask)
    assert m.stop_reason == "max_tokens" and [b.type for b in m.content][-1] == "tool_use"
    with claude.messages.stream(**ask) as stream:
        assert stream.get_final_message().stop_reason == "max_tokens"


REQUEST_TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def test_a_requests_chat_template_renders_only_where_the_server_trusts_it(serve_script, tokenizer) -> None:
    import httpx

    body = {"model": "scripted", "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    want = tokenizer.encode("[user] Weather in Paris?\n")
    trusting = serve_script(QWEN3_OUTPUT, trust_request_chat_template=True)
    r = trusting.chat.completions.create(**body, max_tokens=3, extra_body={"chat_template": REQUEST_TEMPLATE})
    assert r.usage.prompt_tokens == len(want)
    root = str(trusting.base_url).removesuffix("/v1/")
    tokens = httpx.post(f"{root}/tokenize", json={**body, "chat_template": REQUEST_TEMPLATE}).json()
    assert tokens["tokens"] == want
    # the server's own template is used where the request gives none: a different prompt
    assert trusting.chat.completions.create(**body, max_tokens=3).usage.prompt_tokens != len(want)

    wary = serve_script(QWEN3_OUTPUT)
    with pytest.raises(openai.BadRequestError) as refused:
        wary.chat.completions.create(**body, max_tokens=3, extra_body={"chat_template": REQUEST_TEMPLATE})
    assert refused.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.value.body["message"]
    root = str(wary.base_url).removesuffix("/v1/")
    r2 = httpx.post(f"{root}/tokenize", json={**body, "chat_template": REQUEST_TEMPLATE})
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "chat_template"


def test_parallel_tool_calls_false_keeps_the_first_call(serve_script) -> None:
    """parallel_tool_calls false under tool_choice "auto" (no grammar holds the model to one call):
    the reply carries the first call only, whole and streamed, as vLLM filters it."""
    calls = [{"city": "Paris"}, {"city": "Rome"}]
    client = serve_script(
        "\n".join(
            f'<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(c)}}}\n</tool_call>'
            for c in calls
        )
    )
    both = ask(client, tools=TOOLS).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments) for c in both] == calls
    choice = ask(client, tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == calls[:1]
    _, content, streamed, finishes = collect_stream(client, tools=TOOLS, parallel_tool_calls=False)
    assert content == "" and finishes == ["tool_calls"]
    assert [json.loads(c["arguments"]) for c in streamed] == calls[:1]


def test_include_reasoning_false_leaves_the_reasoning_out(serve_script) -> None:
    """vLLM's include_reasoning: false gives the answer alone, whole and streamed."""
    client = serve_script("<think>\nA private thought.\n</think>\n\nThe answer.")
    shown = ask(client).choices[0].message
    assert "private thought" in shown.reasoning_content and shown.content == "The answer."
    hidden = ask(client, extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == "The answer." and getattr(hidden, "reasoning_content", None) is None
    reasoning, content, _, finishes = collect_stream(client, extra_body={"include_reasoning": False})
    assert reasoning == "" and content == "The answer." and finishes == ["stop"]


def test_documents_reach_a_template_that_renders_them(serve_script) -> None:
    """vLLM's documents: passed to the chat template (RAG templates render them), as vLLM does."""
    template = (
        "{% for d in documents or [] %}<doc>{{ d.title }}: {{ d.text }}</doc>\n{% endfor %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    client = serve_script("An answer.", chat_template=template)
    docs = [{"title": "Paris", "text": "Sunny all week."}]
    r = ask(client, extra_body={"documents": docs, "return_prompt_text": True})
    assert r.model_extra["prompt_text"].startswith("<doc>Paris: Sunny all week.</doc>\n<|im_start|>user")
    assert r.choices[0].message.content == "An answer."
    plain = ask(client, extra_body={"return_prompt_text": True})
    assert plain.model_extra["prompt_text"].startswith("<|im_start|>user")


class BeamScriptedEngine(ScriptedEngine):
    """Answers a beam search's one-token steps: the script's next token the likeliest after the
    script's longest start that the prompt ends with, then the end-of-turn token."""

    def step(self) -> list[RequestOutput]:
        from deltaserve.engine.requests.outputs import Logprob

        outputs = []
        for request_id, (prompt, params, _) in list(self.requests.items()):
            done = next(
                k for k in range(len(self.script), -1, -1) if k == 0 or prompt[-k:] == self.script[:k]
            )
            token = self.script[done] if done < len(self.script) else self.eos_token_ids[0]
            top = {token: -0.01, **{other: -9.0 - other for other in range(1, 2 * params.n + 4)}}
            top = dict(list(top.items())[: params.logprobs or 1])
            logprobs = [Logprob(token, top[token], top)]
            completion = CompletionOutput(0, [token], "", "length", logprobs=logprobs)
            outputs.append(RequestOutput(request_id, prompt, [completion], True))
            del self.requests[request_id]
        return outputs


def test_beam_search_chat_reads_tool_calls_as_a_sampled_reply_does(tokenizer) -> None:
    """vLLM's chat beam search runs its beams through the chat's tool parser: a call a beam writes
    is a tool_calls entry (whole and streamed), and a call max_tokens cuts off is no content."""
    script = 'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    app = build_app(EngineClient.in_thread(BeamScriptedEngine(tokenizer, script)), model_names=["scripted"])
    with app_in_thread(app, join_s=10) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        beam = {"use_beam_search": True}
        r = ask(client, tools=TOOLS, n=2, max_tokens=60, extra_body=beam)
        best = r.choices[0]
        assert best.finish_reason == "tool_calls" and best.message.content == "Let me look."
        (call,) = best.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        _, content, calls, finishes = collect_stream(client, tools=TOOLS, max_tokens=60, extra_body=beam)
        assert content == "Let me look." and finishes == ["tool_calls"]
        assert [json.loads(c["arguments"]) for c in calls] == [{"city": "Paris"}]
        cut = len(tokenizer.encode('Let me look.<tool_call>\n{"name": "get', add_special_tokens=False))
        r = ask(client, tools=TOOLS, max_tokens=cut, extra_body=beam)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content == "Let me look."
        assert not r.choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError) as forced:  # its grammar is for sampled replies
            ask(client, tools=TOOLS, tool_choice="required", extra_body=beam)
        assert forced.value.body["param"] == "tool_choice"
