"""A reply aborted (/abort_request) while the model writes a tool call, as a call that max_tokens
cuts off: in chat completions and the Responses API, streamed or not, the half-written call whose
name is out (a stream has sent it, and its arguments so far) is a call with the arguments written;
in the Messages API it is a tool_use block, its input what the stream sent of it as Anthropic's SDK
reads it (a string written in part is left out). The tiny model cannot
write calls: a stand-in engine writes a fixed Qwen3.5-style output, then waits with the request
running until it is aborted."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.server.app import build_app
from deltaserve.server.engine_client import EngineClient

from ...conftest import app_in_thread
from .test_scripted_outputs import TOOLS, ScriptedEngine

# A server started in a thread per test
pytestmark = pytest.mark.slow

BEFORE = "Checking the weather."
WHOLE_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
)
# the XML body parses as a call without its closing tags: only the end tells a half call from a whole one
HALF_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
HALF_ARGUMENTS = '{"city": "Par'  # the half call's arguments, as written before the abort


class StallingEngine(ScriptedEngine):
    """Writes its script, then holds each request running, generating nothing, until it is aborted;
    an abort ends it as the real engine does: a last output with finish reason "abort"."""

    def __init__(self, tokenizer: Any, script: str) -> None:
        super().__init__(tokenizer, script)
        self.stall_at = len(self.script)
        self.script = [*self.script, self.eos_token_ids[0]]  # never written: the script's end is no stop
        self.stalled = threading.Event()  # set when a request has written the whole script
        self.aborting: set[str] = set()

    def abort_request(self, request_id: str) -> None:
        if request_id in self.requests:
            self.aborting.add(request_id)

    def step(self) -> list[RequestOutput]:
        held = {r: v for r, v in self.requests.items() if len(v[2]) == self.stall_at}
        for request_id in held:
            del self.requests[request_id]
        outputs = super().step()
        for request_id, (prompt, params, out) in held.items():
            if request_id not in self.aborting:
                self.requests[request_id] = (prompt, params, out)
                self.stalled.set()
                continue
            self.aborting.discard(request_id)
            delta = params.output_kind == "delta"
            text = "" if delta else self.tokenizer.decode(out)
            completion = CompletionOutput(0, [] if delta else list(out), text, "abort", num_tokens=len(out))
            outputs.append(RequestOutput(request_id, prompt, [completion], True, delta=delta))
        return outputs


@pytest.fixture(scope="module")
def tokenizer(builtin_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(builtin_path)


@pytest.fixture
def stalling(tokenizer) -> Iterator[Callable[[str], tuple[str, StallingEngine]]]:
    """Serve the app over a StallingEngine of `script`; returns the server's URL and the engine."""
    with contextlib.ExitStack() as servers:

        def serve(script: str) -> tuple[str, StallingEngine]:
            engine = StallingEngine(tokenizer, script)
            app = build_app(EngineClient.in_thread(engine), model_names=["scripted"])
            port = servers.enter_context(app_in_thread(app, join_s=10))
            return f"http://127.0.0.1:{port}", engine

        yield serve


def aborted(url: str, engine: StallingEngine, name: str, send: Callable[[], Any]) -> Any:
    """Run `send` (a request named `name`) in a thread, abort it by that name once the engine has
    written its script, and return what `send` returned."""
    result: dict[str, Any] = {}
    engine.stalled.clear()
    thread = threading.Thread(target=lambda: result.update(value=send()))
    thread.start()
    assert engine.stalled.wait(30)
    assert httpx.post(f"{url}/abort_request", json={"rid": name}).status_code == 200
    thread.join(30)
    assert "value" in result
    return result["value"]


def test_chat_aborted_mid_call_gives_the_call_so_far(stalling) -> None:
    url, engine = stalling(BEFORE + WHOLE_CALL + "\n" + HALF_CALL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = dict(
        model="scripted", messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=500
    )

    def whole() -> Any:
        return client.chat.completions.create(**kw, extra_body={"request_id": "chat-whole"})

    def streamed() -> list[Any]:
        return list(
            client.chat.completions.create(**kw, stream=True, extra_body={"request_id": "chat-stream"})
        )

    choice = aborted(url, engine, "chat-whole", whole).choices[0]
    assert choice.finish_reason == "abort" and choice.message.content == BEFORE
    # the whole call the reply holds stays; the half one after it is a call cut off, not content
    want = [("get_weather", '{"city": "Paris"}'), ("get_weather", HALF_ARGUMENTS)]
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == want
    chunks = aborted(url, engine, "chat-stream", streamed)
    calls: dict[int, tuple[str, str]] = {}
    for c in (c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or []):
        name, arguments = calls.get(c.index, ("", ""))
        calls[c.index] = (name + (c.function.name or ""), arguments + (c.function.arguments or ""))
    assert [calls[i] for i in sorted(calls)] == want
    content = "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices)
    assert content == BEFORE
    assert [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason] == ["abort"]


def test_responses_aborted_mid_call_give_an_incomplete_call_item(stalling) -> None:
    url, engine = stalling(BEFORE + HALF_CALL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", **TOOLS[0]["function"]}]
    kw: dict[str, Any] = dict(model="scripted", input="Weather?", tools=tools)

    def whole() -> Any:
        return client.responses.create(**kw, extra_headers={"X-Request-Id": "resp-whole"})

    def streamed() -> list[Any]:
        return list(client.responses.create(**kw, stream=True, extra_headers={"X-Request-Id": "resp-stream"}))

    response = aborted(url, engine, "resp-whole", whole)
    assert response.status == "cancelled"
    # the message ended where the call began; the call stopped where the abort cut it
    assert [(i.type, i.status) for i in response.output] == [
        ("message", "completed"),
        ("function_call", "incomplete"),
    ]
    assert response.output_text == BEFORE and response.output[1].arguments == HALF_ARGUMENTS
    events = aborted(url, engine, "resp-stream", streamed)
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == HALF_ARGUMENTS
    final = events[-1].response
    assert final.status == "cancelled" and [(i.type, i.status) for i in final.output] == [
        (i.type, i.status) for i in response.output
    ]
    assert final.output_text == BEFORE and final.output[1].arguments == HALF_ARGUMENTS


def test_messages_aborted_mid_call_give_the_tool_use_sent(stalling) -> None:
    url, engine = stalling(BEFORE + HALF_CALL)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    kw: dict[str, Any] = dict(
        model="scripted",
        max_tokens=500,
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        messages=[{"role": "user", "content": "Weather?"}],
    )

    def whole() -> Any:
        return claude.messages.create(**kw, extra_headers={"X-Request-Id": "msg-whole"})

    def streamed() -> Any:
        with claude.messages.stream(**kw, extra_headers={"X-Request-Id": "msg-stream"}) as stream:
            sent = "".join(e.partial_json for e in stream if e.type == "input_json")
            return stream.get_final_message(), sent

    final, sent = aborted(url, engine, "msg-stream", streamed)
    assert sent == HALF_ARGUMENTS
    for message in (final, aborted(url, engine, "msg-whole", whole)):
        assert message.stop_reason is None
        blocks = [
            (b.type, getattr(b, "text", None) or b.name, getattr(b, "input", None)) for b in message.content
        ]
        assert blocks == [("text", BEFORE, None), ("tool_use", "get_weather", {})]
