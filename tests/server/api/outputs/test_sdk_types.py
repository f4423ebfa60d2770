"""Every reply body and stream event of a real server, over a matrix of requests, validated
strictly against the official SDKs' types (openai's chat, completions and Responses types,
anthropic's Messages types), with no key the type does not declare unless it is listed below as
an extension vLLM sends too; 4xx bodies hold OpenAI's (or, on /v1/messages, Anthropic's) error
shape. The server's template opens <think> unless thinking is off, so reasoning comes through."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from anthropic.types import ErrorResponse, Message, MessageTokensCount, RawMessageStreamEvent
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, chat_completion, chat_completion_chunk
from openai.types.chat.chat_completion_message import ChatCompletionMessage
from openai.types.completion_choice import CompletionChoice
from openai.types.responses import Response, ResponseItemList, ResponseStreamEvent
from openai.types.shared import ErrorObject
from pydantic import BaseModel, TypeAdapter, ValidationError

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

_VLLM_REASONING = "vLLM's reasoning parser output (reasoning_content, and reasoning as vLLM names it now)"
_VLLM_STOP = "vLLM's stop_reason: the stop string or token id that ended the choice"
_VLLM_IDS = "vLLM's return_token_ids / prompt_logprobs outputs"
_VLLM_CARD = "vLLM's model card: root, parent, max_model_len, permission"
_OPENAI_STORE = (
    "OpenAI's response object echoes store (its API reference's example does); the SDK's type lacks it"
)
# (SDK type, key): why a key the type does not declare may be there
ALLOWED_EXTRAS: dict[tuple[type[BaseModel], str], str] = {
    (chat_completion.Choice, "stop_reason"): _VLLM_STOP,
    (chat_completion_chunk.Choice, "stop_reason"): _VLLM_STOP,
    (CompletionChoice, "stop_reason"): _VLLM_STOP,
    (ChatCompletionMessage, "reasoning_content"): _VLLM_REASONING,
    (ChatCompletionMessage, "reasoning"): _VLLM_REASONING,
    (chat_completion_chunk.ChoiceDelta, "reasoning_content"): _VLLM_REASONING,
    (chat_completion_chunk.ChoiceDelta, "reasoning"): _VLLM_REASONING,
    (ChatCompletion, "prompt_logprobs"): _VLLM_IDS,
    (ChatCompletion, "prompt_token_ids"): _VLLM_IDS,
    (chat_completion.Choice, "token_ids"): _VLLM_IDS,
    (chat_completion_chunk.Choice, "token_ids"): _VLLM_IDS,
    (ChatCompletionChunk, "prompt_token_ids"): _VLLM_IDS,
    (CompletionChoice, "prompt_logprobs"): _VLLM_IDS,
    (CompletionChoice, "prompt_token_ids"): _VLLM_IDS,
    (CompletionChoice, "token_ids"): _VLLM_IDS,
    **{(Model, key): _VLLM_CARD for key in ("root", "parent", "max_model_len", "permission")},
    (Response, "store"): _OPENAI_STORE,
}
# (SDK type, streamed, error location with "*" for any index): the stand-in a null there gets, and why
# the real API sends that null where the SDK's type has no None
ALLOWED_NULLS: dict[tuple[Any, bool, tuple[str, ...]], tuple[Any, str]] = {
    (Completion, True, ("choices", "*", "finish_reason")): (
        "stop",
        "OpenAI's and vLLM's completion chunks carry finish_reason null until the last; the SDK parses chunks as Completion",
    ),
    **{
        (Completion, streamed, ("choices", "*", "logprobs", key, "*")): (
            stand_in,
            "echo's first prompt token has no logprob: null, as in OpenAI's legacy API and vLLM",
        )
        for streamed in (False, True)
        for key, stand_in in (("token_logprobs", 0.0), ("top_logprobs", {}))
    },
}

# Anthropic error types its docs list (HTTP errors) that the SDK's ErrorObject union lacks: a body of
# one is read as invalid_request_error's shape, which its docs give "other 4XX status codes"
ANTHROPIC_ERROR_TYPES = {"request_too_large": "Anthropic's 413 type, which its docs' HTTP errors list"}

_ADAPTERS: dict[Any, TypeAdapter[Any]] = {}


def _extras(value: Any, where: str, out: list[str]) -> None:
    """Keys a validated value holds that its types do not declare (pydantic keeps them as extras)."""
    if isinstance(value, BaseModel):
        for key in value.model_extra or {}:
            if (type(value), key) not in ALLOWED_EXTRAS:
                out.append(f"{where}.{key}: not in {type(value).__module__}.{type(value).__qualname__}")
        for name in type(value).model_fields:
            _extras(getattr(value, name), f"{where}.{name}", out)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _extras(item, f"{where}[{i}]", out)
    elif isinstance(value, dict):
        for key, item in value.items():
            _extras(item, f"{where}[{key!r}]", out)


def _allowed_null(tp: Any, streamed: bool, loc: tuple[Any, ...]) -> tuple[Any, str] | None:
    pattern = tuple("*" if isinstance(part, int) else part for part in loc)
    return ALLOWED_NULLS.get((tp, streamed, pattern))


def mismatches(tp: Any, obj: Any, where: str, streamed: bool = False) -> list[str]:
    """What in `obj` does not fit `tp` strictly: validation errors (but for ALLOWED_NULLS) and
    undeclared keys (but for ALLOWED_EXTRAS)."""
    if tp not in _ADAPTERS:  # built once: a union's adapter takes a while to build
        _ADAPTERS[tp] = TypeAdapter(tp)
    adapter = _ADAPTERS[tp]
    obj = json.loads(json.dumps(obj))  # a copy, whose allowed nulls get their stand-ins
    while True:  # each round puts stand-ins for some allowed nulls, or ends
        try:
            value = adapter.validate_python(obj, strict=True)
            break
        except ValidationError as error:
            wrong = []
            for e in error.errors():
                allowed = _allowed_null(tp, streamed, e["loc"]) if e["input"] is None else None
                if allowed is None:
                    wrong.append(
                        f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r:.80})"
                    )
                    continue
                parent = obj
                for part in e["loc"][:-1]:
                    parent = parent[part]
                parent[e["loc"][-1]] = allowed[0]
            if wrong:
                return wrong
    out: list[str] = []
    _extras(value, where, out)
    return out


def sse_events(text: str) -> list[tuple[str | None, str]]:
    """A stream's (event name, data) pairs; a line of another field is itself a mismatch."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data.append(line[len("data: ") :])
            elif not line.startswith(":"):  # a comment line is a keep-alive
                raise AssertionError(f"a stream line of no SSE field: {line!r}")
        events.append((name, "\n".join(data)))
    return events


KEY = "sdk-types-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
THINKING_TEMPLATE_TAIL = (  # Qwen3.5's generation prompt: thinking open unless enable_thinking is false
    "{%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<think>\\n' }}\n"
    "    {%- endif %}"
)


@pytest.fixture(scope="module")
def thinking_server(spawn_module_server, builtin_path: str, tmp_path_factory: pytest.TempPathFactory):
    """The built-in model served with its template opening <think> as Qwen3.5's does."""
    config = json.loads((Path(builtin_path) / "tokenizer_config.json").read_text())
    template = re.sub(
        r"\{%- if enable_thinking is defined and enable_thinking is false %\}.*?\{%- endif %\}",
        lambda _: THINKING_TEMPLATE_TAIL,
        config["chat_template"],
        count=1,
        flags=re.S,
    )
    assert template != config["chat_template"]
    path = tmp_path_factory.mktemp("template") / "thinking.jinja"
    path.write_text(template)
    # a key, and bodies over 16 KiB a 413: the errors' test reads the 401's and 413's shapes
    return spawn_module_server(
        "--max-model-len", "512", "--chat-template", str(path), "--max-request-body-mb", str(16 / 1024),
        "--api-key", KEY,
    )  # fmt: skip


class Matrix:
    """Sends requests through the official clients, reads their raw replies and collects every
    mismatch, and what the replies held (so the matrix is seen to reach reasoning, calls, ...)."""

    def __init__(self, url: str, key: str = "") -> None:
        key = key or KEY
        self.oai = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=60)
        self.claude = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)
        self.problems: list[str] = []
        self.seen: set[str] = set()

    def _send(self, client: Any, method: str, path: str, body: Any) -> tuple[int, str]:
        try:
            if method == "get":
                return 200, client.get(path, cast_to=str)
            if method == "delete":
                return 200, client.delete(path, cast_to=str)
            return 200, client.post(path, body=body, cast_to=str)
        except (openai.APIStatusError, anthropic.APIStatusError) as error:
            return error.status_code, error.response.text

    def _in_band_error(self, where: str, error: bool, fails: bool) -> None:
        """A stream's error event: where the request is to fail there, the one it was to send."""
        if not fails:
            self.problems.append(f"{where}: an error event in a stream that was not to fail")
        elif error:
            self.problems.append(f"{where}: a second error event")

    def openai(
        self,
        path: str,
        body: dict[str, Any] | None,
        whole: Any,
        event: Any = None,
        method: str = "post",
        fails: bool = False,
    ) -> list[dict[str, Any]]:
        """One OpenAI-API request; its body, or its stream's events, checked (`fails`: the stream
        ends in an error event). Returns the objects."""
        where = f"{method.upper()} {path} {json.dumps(body)[:160]}"
        status, text = self._send(self.oai, method, path, body)
        if status >= 400:
            self.problems.append(f"{where}: {status} {text[:300]}")
            return []
        if not (body or {}).get("stream"):
            obj = json.loads(text)
            self.problems += mismatches(whole, obj, where)
            return [obj]
        objs: list[dict[str, Any]] = []
        events, error = sse_events(text), False
        if event is ResponseStreamEvent:
            for name, data in events:
                obj = json.loads(data)
                if name != obj.get("type"):
                    self.problems.append(f"{where}: event {name!r} sends type {obj.get('type')!r}")
                if name == "error":  # ResponseErrorEvent, in the union
                    self._in_band_error(where, error, fails)
                    error = True
                self.problems += mismatches(event, obj, f"{where} {name}", streamed=True)
                objs.append(obj)
        else:
            if events[-1] != (None, "[DONE]"):
                self.problems.append(f"{where}: the stream ends on {events[-1]!r}, not data: [DONE]")
            for name, data in events[:-1]:
                if name is not None:
                    self.problems.append(f"{where}: an event line {name!r} OpenAI's chunks do not have")
                obj = json.loads(data)
                if list(obj) == ["error"]:  # vLLM's in-band error, which the SDK's stream raises
                    self._in_band_error(where, error, fails)
                    error = True
                    self.problems += mismatches(ErrorObject, obj["error"], f"{where} error")
                else:
                    self.problems += mismatches(event, obj, f"{where} chunk", streamed=True)
                objs.append(obj)
        if fails and not error:
            self.problems.append(f"{where}: no error event in a stream that was to fail")
        return objs

    def messages(self, body: dict[str, Any], fails: bool = False) -> list[dict[str, Any]]:
        where = f"POST /v1/messages {json.dumps(body)[:160]}"
        status, text = self._send(self.claude, "post", "/v1/messages", body)
        if status >= 400:
            self.problems.append(f"{where}: {status} {text[:300]}")
            return []
        if not body.get("stream"):
            obj = json.loads(text)
            self.problems += mismatches(Message, obj, where)
            return [obj]
        objs, error = [], False
        for name, data in sse_events(text):
            obj = json.loads(data)
            if name != obj.get("type"):
                self.problems.append(f"{where}: event {name!r} sends type {obj.get('type')!r}")
            if name == "ping":  # Anthropic's keep-alive event, which its SDK's stream skips
                continue
            if name == "error":  # Anthropic's in-band error: an error body, which the SDK's stream raises
                self._in_band_error(where, error, fails)
                error = True
                self.problems += mismatches(ErrorResponse, obj, f"{where} error")
            else:
                self.problems += mismatches(RawMessageStreamEvent, obj, f"{where} {name}", streamed=True)
            objs.append(obj)
        if fails and not error:
            self.problems.append(f"{where}: no error event in a stream that was to fail")
        return objs

    def error(self, method: str, path: str, body: Any, status: int) -> None:
        """A bad request: the status, and the error shape of the API the path belongs to."""
        anthropic_api = path.startswith("/v1/messages")
        client = self.claude if anthropic_api else self.oai
        got, text = self._send(client, method, path if anthropic_api else path[len("/v1") :], body)
        self.check_error(
            f"{method.upper()} {path} {json.dumps(body)[:120]}", got, text, status, anthropic_api
        )

    def check_error(self, where: str, got: int, text: str, status: int, anthropic_api: bool) -> None:
        if got != status:
            self.problems.append(f"{where}: {got}, not {status}: {text[:200]}")
            return
        obj = json.loads(text)
        if anthropic_api:
            if isinstance(obj.get("error"), dict) and obj["error"].get("type") in ANTHROPIC_ERROR_TYPES:
                obj = {**obj, "error": {**obj["error"], "type": "invalid_request_error"}}
            self.problems += mismatches(ErrorResponse, obj, where)
        elif list(obj) != ["error"]:
            self.problems.append(f"{where}: error body keys {list(obj)}, not ['error']")
        else:
            self.problems += mismatches(ErrorObject, obj["error"], where)


@pytest.fixture
def matrix(thinking_server) -> Iterator[Matrix]:
    m = Matrix(thinking_server.url)
    yield m
    m.oai.close()
    m.claude.close()


@pytest.fixture(scope="module")
def closes_reasoning(thinking_server) -> dict[str, Any]:
    """Sampling fields under which the random model soon writes </think>, so a reply holds both
    reasoning and an answer (or a call)."""
    tokens = httpx.post(
        f"{thinking_server.url}/tokenize",
        json={"prompt": "</think>", "add_special_tokens": False},
        headers=AUTH,
    ).json()["tokens"]
    assert len(tokens) == 1
    return {"logit_bias": {str(tokens[0]): 9}, "temperature": 1.0, "seed": 1}


PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
RESPONSES_TOOL = {"type": "function", "name": "get_weather", "parameters": PARAMS}
MESSAGES_TOOL = {"name": "get_weather", "input_schema": PARAMS}
JSON_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
HI = [{"role": "user", "content": "Hi"}]


def _each(objs: list[dict[str, Any]], pick: Callable[[dict[str, Any]], list[Any]]) -> list[Any]:
    return [x for obj in objs for x in pick(obj)]


def _no_problems_and_reached(matrix: Matrix, want: set[str]) -> None:
    assert not matrix.problems, "\n".join(matrix.problems)
    # the matrix reached what it is for, streamed and not
    missing = {f"{w} stream={stream}" for w in want for stream in (False, True)} - matrix.seen
    assert not missing, (sorted(missing), sorted(matrix.seen))


def test_the_checker_reports_wrong_types_missing_fields_and_undeclared_keys() -> None:
    """The checker itself: a value of the wrong type, a required field left out, an undeclared key
    at any depth are reported; a listed extension and a listed null (where listed) are not."""
    chunk = {
        "id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "x", "reasoning_content": "r"}, "finish_reason": None, "stop_reason": None}],
    }  # fmt: skip
    assert mismatches(ChatCompletionChunk, chunk, "c") == []
    assert mismatches(ChatCompletionChunk, {**chunk, "created": "1"}, "c") != []  # strict: no str for int
    assert mismatches(ChatCompletionChunk, {k: v for k, v in chunk.items() if k != "model"}, "c") != []
    deep = json.loads(json.dumps(chunk))
    deep["choices"][0]["delta"]["bytes"] = [1]
    (problem,) = mismatches(ChatCompletionChunk, deep, "c")
    assert problem.startswith("c.choices[0].delta.bytes:")
    unknown = {"type": "response.text.delta", "sequence_number": 0, "delta": "x"}
    assert mismatches(ResponseStreamEvent, unknown, "e") != []
    legacy = {
        "id": "c", "object": "text_completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}],
    }  # fmt: skip
    assert mismatches(Completion, legacy, "c", streamed=True) == []
    assert mismatches(Completion, legacy, "c", streamed=False) != []  # a whole completion has its reason


@pytest.mark.slow  # a server of its own and many requests, here and below
def test_chat_completions_and_chunks_fit_the_sdks_types(matrix: Matrix, closes_reasoning) -> None:
    chat = {"model": MODEL_NAME, "messages": HI, "max_tokens": 8}
    turn = [
        *HI,
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "P", "unit": "C"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    for stream in (False, True):
        usage = USAGE if stream else {}
        for fields in (
            {},
            {"n": 2, "logprobs": True, "top_logprobs": 2},
            {"stop": ["a", "e"], "echo": True},
            {"tools": CHAT_TOOLS, "tool_choice": "auto"},
            {"tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 40},
            {"tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 40},
            {"messages": turn, "tools": CHAT_TOOLS, "tool_choice": "none", "max_completion_tokens": 5, "user": "u", "metadata": {"a": "b"}},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": JSON_SCHEMA}}},
            {"prompt_logprobs": 1, "return_token_ids": True} if not stream else {"return_token_ids": True},
            {**closes_reasoning, "logprobs": True, "top_logprobs": 1, "max_tokens": 16, "chat_template_kwargs": {}},
            {**closes_reasoning, "tools": CHAT_TOOLS, "tool_choice": "required", "max_tokens": 40, "chat_template_kwargs": {}},
        ):  # fmt: skip
            body = {**chat, **NO_THINKING, **usage, **fields, "stream": stream}
            objs = matrix.openai("/chat/completions", body, ChatCompletion, ChatCompletionChunk)
            parts = [c.get("message") or c.get("delta") or {} for c in _each(objs, lambda o: o["choices"])]
            calls = any(p.get("tool_calls") for p in parts)
            thought = any(p.get("reasoning_content") for p in parts)
            reached = {"calls": calls, "reasoning": thought, "reasoning and calls": calls and thought}
            matrix.seen |= {f"{what} stream={stream}" for what, got in reached.items() if got}
    _no_problems_and_reached(matrix, {"calls", "reasoning", "reasoning and calls"})


@pytest.mark.slow
def test_completions_and_their_chunks_fit_the_sdks_types(matrix: Matrix) -> None:
    completion = {"model": MODEL_NAME, "prompt": "Hi there", "max_tokens": 6}
    for stream in (False, True):
        for fields in (
            {},
            {"n": 2, "logprobs": 2, "echo": True},
            {"stop": ["a", "e"]},
            {"prompt": ["a", "b"], "n": 2},
            {"prompt_logprobs": 1, "return_token_ids": True} if not stream else {"return_token_ids": True},
            {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": JSON_SCHEMA}}},
        ):
            body = {**completion, **(USAGE if stream else {}), **fields, "stream": stream}
            objs = matrix.openai("/completions", body, Completion, Completion)
            if any(c["logprobs"] for c in _each(objs, lambda o: o["choices"])):
                matrix.seen.add(f"logprobs stream={stream}")
    _no_problems_and_reached(matrix, {"logprobs"})


@pytest.mark.slow
def test_responses_and_their_events_fit_the_sdks_types(matrix: Matrix, closes_reasoning) -> None:
    response = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 12}
    off = {"reasoning": {"effort": "none"}}
    called: tuple[str, dict[str, Any]] | None = None  # a stored response's id and its call
    for stream in (False, True):
        for fields in (
            off,
            {"reasoning": {"effort": "high", "summary": "auto"}},
            {**closes_reasoning, "max_output_tokens": 16},
            {**closes_reasoning, "tools": [RESPONSES_TOOL], "tool_choice": "required", "max_output_tokens": 60},
            {**off, "tools": [RESPONSES_TOOL], "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40},
            {**off, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
            {"include": ["reasoning.encrypted_content"], "store": False},
            {**off, "instructions": "Be brief.", "metadata": {"a": "b"}, "store": True, "truncation": "auto", "user": "u"},
            {**off, "text": {"format": {"type": "json_schema", "name": "v", "schema": JSON_SCHEMA}}},
        ):  # fmt: skip
            objs = matrix.openai(
                "/responses", {**response, **fields, "stream": stream}, Response, ResponseStreamEvent
            )
            final = objs[-1].get("response", objs[-1]) if objs else {}
            matrix.seen |= {f"{item['type']} stream={stream}" for item in final.get("output", [])}
            calls = [item for item in final.get("output", []) if item["type"] == "function_call"]
            if calls and not stream:
                called = (final["id"], calls[0])
    # the tool loop's next turns: the call's output, then one that follows the stored response on
    assert called is not None, "no unstreamed response called the tool"
    stored, call = called
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    for stream in (False, True):
        body = {
            **response,
            **off,
            "input": [*HI, call, output],
            "tools": [RESPONSES_TOOL],
            "tool_choice": "none",
        }
        matrix.openai("/responses", {**body, "stream": stream}, Response, ResponseStreamEvent)
        body = {**response, **off, "input": "More", "previous_response_id": stored}
        matrix.openai("/responses", {**body, "stream": stream}, Response, ResponseStreamEvent)
    matrix.openai(f"/responses/{stored}", None, Response, method="get")
    matrix.openai(f"/responses/{stored}/input_items?order=asc", None, ResponseItemList, method="get")
    _no_problems_and_reached(matrix, {"message", "reasoning", "function_call"})


@pytest.mark.slow
def test_messages_and_their_events_fit_the_sdks_types(matrix: Matrix, closes_reasoning) -> None:
    message = {"model": MODEL_NAME, "messages": HI, "max_tokens": 10}
    off = {"thinking": {"type": "disabled"}}
    # adaptive: enabled thinking's budget_tokens must be at least 1024 and below max_tokens
    on = {"thinking": {"type": "adaptive"}, **closes_reasoning}
    turn = [
        *HI,
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "x"}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "P", "unit": "C"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]  # fmt: skip
    for stream in (False, True):
        for fields in (
            off,
            {**on, "max_tokens": 16},
            {**on, "tools": [MESSAGES_TOOL], "tool_choice": {"type": "any"}, "max_tokens": 60},
            {**off, "tools": [MESSAGES_TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}, "max_tokens": 40},
            {**off, "messages": turn, "tools": [MESSAGES_TOOL], "tool_choice": {"type": "none"}},
            {**off, "stop_sequences": ["a", "e"], "system": "Be brief.", "metadata": {"user_id": "u"}, "temperature": 0},
        ):  # fmt: skip
            objs = matrix.messages({**message, **fields, "stream": stream})
            blocks = _each(objs, lambda o: o.get("content") or [o.get("content_block") or {}])
            matrix.seen |= {f"{b['type']} stream={stream}" for b in blocks if "type" in b}
            reasons = [o.get("stop_reason") or (o.get("delta") or {}).get("stop_reason") for o in objs]
            matrix.seen |= {f"{r} stream={stream}" for r in reasons if r}
    count = matrix.claude.post(
        "/v1/messages/count_tokens", body={"model": MODEL_NAME, "messages": HI}, cast_to=str
    )
    matrix.problems += mismatches(MessageTokensCount, json.loads(count), "POST /v1/messages/count_tokens")
    _no_problems_and_reached(matrix, {"text", "thinking", "tool_use", "stop_sequence", "max_tokens"})


@pytest.mark.slow
def test_models_and_errors_fit_the_sdks_types(matrix: Matrix, thinking_server) -> None:
    (models,) = matrix.openai("/models", None, dict, method="get")
    assert list(models) == ["object", "data"] and models["object"] == "list"
    for card in models["data"]:
        matrix.problems += mismatches(Model, card, "GET /models")
    matrix.openai(f"/models/{MODEL_NAME}", None, Model, method="get")
    chat = {"model": MODEL_NAME, "messages": HI, "max_tokens": 4}
    for method, path, body, status in (
        ("post", "/v1/chat/completions", {**chat, "n": 0}, 400),
        ("post", "/v1/chat/completions", {**chat, "stream": True, "temperature": -1}, 400),
        ("post", "/v1/chat/completions", {**chat, "model": "nope"}, 404),
        ("post", "/v1/chat/completions", {**chat, "tools": CHAT_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400),
        ("post", "/v1/chat/completions", [1], 400),
        ("get", "/v1/chat/completions", None, 405),
        ("post", "/v1/completions", {"model": MODEL_NAME}, 400),
        ("post", "/v1/completions", {"model": MODEL_NAME, "prompt": " a" * 600, "max_tokens": 4}, 400),
        ("post", "/v1/responses", {"model": MODEL_NAME, "input": 5}, 400),
        ("post", "/v1/responses", {"model": MODEL_NAME, "input": "x", "stream": True, "reasoning": {"effort": "x"}}, 400),
        ("get", "/v1/responses/resp_nope", None, 404),
        ("get", "/v1/responses/resp_nope/input_items", None, 404),
        ("get", "/v1/models/nope", None, 404),
        ("get", "/v1/nope", None, 404),
        ("post", "/v1/messages", {**chat, "max_tokens": -1}, 400),
        ("post", "/v1/messages", {**chat, "model": "nope"}, 404),
        ("post", "/v1/messages", {**chat, "stream": True, "thinking": {"type": "x"}}, 400),
        ("post", "/v1/messages/count_tokens", {"model": MODEL_NAME}, 400),
        ("post", "/v1/chat/completions", {**chat, "user": "u" * 20000}, 413),
        ("post", "/v1/messages", {**chat, "system": "s" * 20000}, 413),
    ):  # fmt: skip
        matrix.error(method, path, body, status)
    # a stream the engine fails once it has begun: its error comes in-band, in the API's shape
    hello = httpx.post(
        f"{thinking_server.url}/tokenize", json={"prompt": "hello", "add_special_tokens": False}, headers=AUTH
    )
    empty = {"allowed_token_ids": hello.json()["tokens"][:1], "bad_words": ["hello"], "stream": True}
    matrix.openai("/chat/completions", {**chat, **empty}, ChatCompletion, ChatCompletionChunk, fails=True)
    matrix.openai(
        "/completions", {"model": MODEL_NAME, "prompt": "Hi", **empty}, Completion, Completion, fails=True
    )
    matrix.openai(
        "/responses", {"model": MODEL_NAME, "input": "Hi", **empty}, Response, ResponseStreamEvent, fails=True
    )
    matrix.messages({**chat, **empty}, fails=True)
    stored = matrix.openai(
        "/responses", {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 2}, Response
    )
    status, text = matrix._send(matrix.oai, "delete", f"/responses/{stored[0]['id']}", None)
    deleted = {"id": stored[0]["id"], "object": "response.deleted", "deleted": True}  # OpenAI's; no SDK type
    assert (status, json.loads(text)) == (200, deleted)
    for path in ("/v1/chat/completions", "/v1/messages"):  # a body no SDK would send: not JSON
        reply = httpx.post(
            f"{thinking_server.url}{path}",
            content=b"{no",
            headers={"content-type": "application/json", **AUTH},
        )
        matrix.check_error(path, reply.status_code, reply.text, 400, path == "/v1/messages")
    stranger = Matrix(thinking_server.url, key="not-the-key")
    stranger.error("post", "/v1/chat/completions", chat, 401)
    stranger.error("post", "/v1/messages", chat, 401)
    assert not matrix.problems + stranger.problems, "\n".join(matrix.problems + stranger.problems)
