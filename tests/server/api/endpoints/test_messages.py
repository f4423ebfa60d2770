"""Anthropic's Messages API (/v1/messages) on a real server (built-in model), through Anthropic's
SDK: the same reply as the chat endpoint for the same request, usage and token counts, stop
sequences, a tool_result turn, Anthropic-shaped errors and the key sent as x-api-key."""

from __future__ import annotations

import base64
import json

import anthropic
import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

GREEDY = {"temperature": 0, "ignore_eos": True}  # extra fields, as vLLM takes them
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def chat(server, messages, **fields) -> dict:
    body = {"model": MODEL_NAME, "messages": messages, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()


def test_a_message_is_the_chat_reply(server, claude) -> None:
    m = claude.messages.create(
        model=MODEL_NAME, max_tokens=9, system="You are terse.", messages=MESSAGES, extra_body=GREEDY
    )
    reply = chat(server, [{"role": "system", "content": "You are terse."}, *MESSAGES], max_tokens=9)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL_NAME
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == reply["choices"][0]["message"][
        "content"
    ]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 9
    usage = reply["usage"]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == usage["prompt_tokens"]
    counted = claude.messages.count_tokens(model=MODEL_NAME, system="You are terse.", messages=MESSAGES)
    assert counted.input_tokens == usage["prompt_tokens"]
    with claude.messages.stream(
        model=MODEL_NAME, max_tokens=9, system="You are terse.", messages=MESSAGES, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 9


def test_a_streams_message_start_counts_what_the_prefix_cache_served(claude) -> None:
    system = "You answer questions about colours, briefly and politely. " * 8  # pages of its own
    ask = {"model": MODEL_NAME, "max_tokens": 4, "system": system, "messages": MESSAGES, "extra_body": GREEDY}
    claude.messages.create(**ask)  # the prompt's state is now cached
    with claude.messages.stream(**ask) as stream:
        starts = [e.message.usage for e in stream if e.type == "message_start"]
        final = stream.get_final_message().usage
    assert len(starts) == 1
    start = starts[0]
    assert start.cache_read_input_tokens and start.cache_read_input_tokens > 0  # a resend hits
    assert start.cache_read_input_tokens == final.cache_read_input_tokens
    assert start.input_tokens == final.input_tokens


def test_a_stop_sequence_ends_it(claude) -> None:
    free = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES, extra_body=GREEDY)
    stop = free.content[0].text[4:7]
    m = claude.messages.create(
        model=MODEL_NAME, max_tokens=12, messages=MESSAGES, stop_sequences=[stop], extra_body=GREEDY
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == free.content[0].text[: free.content[0].text.index(stop)]


def test_a_tool_result_turn_renders_as_the_chat_tool_message(server, claude) -> None:
    """An assistant tool_use and the user's tool_result are the chat template's tool call and tool
    message: the same prompt tokens as the equivalent chat request."""
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}}]
    turns = [
        *MESSAGES,
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
    ]  # fmt: skip
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=turns, tools=tools).input_tokens
    chat_messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    chat_tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}},
        }
    ]
    tokens = httpx.post(
        f"{server.url}/tokenize", json={"messages": chat_messages, "tools": chat_tools}
    ).json()
    assert counted == tokens["count"]
    m = claude.messages.create(model=MODEL_NAME, max_tokens=4, messages=turns, tools=tools, extra_body=GREEDY)
    assert m.usage.output_tokens == 4


def test_several_text_blocks_are_joined_by_newlines(server, claude) -> None:
    """A message's text blocks and a tool_result's are on lines of their own, as vLLM's Anthropic
    endpoint joins them (and chat its text parts), where they ran together: the prompt counts as
    the chat request's whose texts hold the newlines, and not as one whose texts run on."""
    blocks = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colours."}]
    turns = [
        {"role": "user", "content": blocks},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": blocks}]},
    ]
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=turns).input_tokens

    def chat_count(user: str, tool: str) -> int:
        call = {"id": "toolu_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        chat_turns = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": tool},
        ]
        return httpx.post(f"{server.url}/tokenize", json={"messages": chat_turns}).json()["count"]

    lines, run_on = "Name three\ncolours.", "Name threecolours."
    assert counted == chat_count(lines, lines)
    assert counted != chat_count(run_on, lines) and counted != chat_count(lines, run_on)


def test_a_tool_results_is_error_that_is_not_a_boolean_is_a_400_naming_it(server) -> None:
    """Anthropic's and vLLM's schemas make is_error a boolean; "x" is refused, not ignored."""

    def turns(result: dict) -> list[dict]:
        call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
        done = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "no such city", **result}
        return [*MESSAGES, {"role": "assistant", "content": [call]}, {"role": "user", "content": [done]}]

    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = {"model": MODEL_NAME, "max_tokens": 2}
        r = httpx.post(f"{server.url}{path}", json={**body, "messages": turns({"is_error": "x"})}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "is_error" in r.json()["error"]["message"] and "messages[2]" in r.json()["error"]["message"]
        for good in ({"is_error": True}, {"is_error": None}, {}):
            r = httpx.post(f"{server.url}{path}", json={**body, "messages": turns(good)}, timeout=60)
            assert r.status_code == 200, r.text


def test_a_refusal_names_the_field_as_this_api_spells_it(server) -> None:
    """Blocks and tools become the chat endpoint's messages and functions: a 400 names the field
    the client sent (a tool_result's tool_use_id, a thinking block's thinking, a tool's
    description, an image block), not the chat's it became."""
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(24)).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    for body, named, chat_name in (
        ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5, "content": "x"}]}]},
         "messages[0].content[0]: a tool_result's tool_use_id", "tool_call_id"),
        ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": ["a"]}]}, *MESSAGES]},
         "messages[0].content[0]: a thinking block's thinking", "reasoning_content"),
        ({"messages": MESSAGES, "tools": [{"name": "f", "description": 5, "input_schema": {"type": "object"}}]},
         "tools[0].description", "function"),
        ({"messages": MESSAGES, "tools": [{"name": "f", "input_schema": {"type": "object"}},
                                          {"name": "", "input_schema": {"type": "object"}}]},
         "tools[1].name", "function"),
        ({"messages": [{"role": "user", "content": [image]}]}, "reads text only", "image_url"),
    ):  # fmt: skip
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, "max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert named in message and chat_name not in message, (path, message)


# an image whose media_type is not a string: a list is no key of the media types' table
IMAGE_OF_LIST_MEDIA = {"type": "base64", "media_type": ["image/png"], "data": "iVBORw0KGgo="}


def test_errors_are_anthropic_shaped(server, claude) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL_NAME, max_tokens=-1, messages=MESSAGES)
    assert (
        refused.value.body["type"] == "error"
        and refused.value.body["error"]["type"] == "invalid_request_error"
    )
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=2, messages=MESSAGES)
    bad = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    )  # fmt: skip
    assert bad.status_code == 400 and "image" in bad.json()["error"]["message"]
    missing = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL_NAME, "messages": MESSAGES})
    assert missing.status_code == 400 and missing.json()["type"] == "error"  # pydantic's refusal too
    assert "max_tokens" in missing.json()["error"]["message"]
    # a field of the wrong type inside a tool or a block: a 400 of this shape, not an internal error
    for body in (
        {"messages": MESSAGES, "tools": [{"name": "f", "input_schema": "x"}]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5, "content": "x"}]}
            ]
        },
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "thinking", "thinking": ["a"]}]},
                *MESSAGES,
            ]
        },
        {"messages": [{"role": "user", "content": [{"type": "image", "source": IMAGE_OF_LIST_MEDIA}]}]},
    ):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = httpx.post(f"{server.url}{path}", json={"model": MODEL_NAME, "max_tokens": 2, **body})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (
                path,
                r.text,
            )


@pytest.mark.slow
def test_the_key_may_come_as_x_api_key(spawn_server) -> None:
    keyed = spawn_server("--max-model-len", "256", "--api-key", "sk-claude")
    with pytest.raises(anthropic.AuthenticationError) as refused:
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=MESSAGES
        )
    assert "x-api-key" in refused.value.body["error"]["message"]  # the header its clients set the key in
    good = anthropic.Anthropic(base_url=keyed.url, api_key="sk-claude", max_retries=0)
    assert good.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES).usage.output_tokens >= 1


def test_the_chat_endpoints_extra_fields_come_along(claude) -> None:
    """vLLM's extra sampling fields beside Anthropic's: a seed repeats a sample, a bad value is a
    400 naming the field."""

    def sample(**extra) -> str:
        return (
            claude.messages.create(model=MODEL_NAME, max_tokens=8, messages=MESSAGES, extra_body=extra)
            .content[0]
            .text
        )

    assert sample(seed=3, temperature=1.0) == sample(seed=3, temperature=1.0)
    with pytest.raises(anthropic.BadRequestError, match="min_tokens"):
        sample(min_tokens=-1)


def test_a_last_assistant_message_is_continued(server, claude) -> None:
    """Anthropic's prefill: the reply goes on from a last assistant message's text, as a chat
    request with vLLM's continue_final_message does, and no new assistant turn opens."""
    turns = [*MESSAGES, {"role": "assistant", "content": "Red, green and"}]
    m = claude.messages.create(model=MODEL_NAME, max_tokens=6, messages=turns, extra_body=GREEDY)
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    reply = chat(server, turns, max_tokens=6, **cont)
    assert m.content[0].text == reply["choices"][0]["message"]["content"]
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=turns).input_tokens
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": turns, **cont}).json()
    opened = httpx.post(f"{server.url}/tokenize", json={"messages": turns}).json()
    assert counted == tokens["count"] < opened["count"]


def test_json_outputs_hold_the_reply_to_the_schema(claude) -> None:
    """Anthropic's JSON outputs (output_config.format, and the beta's output_format) were ignored:
    the reply was free text. Now it is JSON satisfying the schema; vLLM's guided_whitespace_pattern,
    which the chat endpoint refuses, was dropped here and is now the same 400."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "schema": schema}
    kw = dict(model=MODEL_NAME, max_tokens=30, messages=MESSAGES)
    for m in (
        claude.messages.create(**kw, output_config={"format": fmt}, extra_body={"temperature": 0}),
        claude.messages.create(**kw, extra_body={"temperature": 0, "output_format": fmt}),
    ):
        assert m.stop_reason == "end_turn", m
        value = json.loads(m.content[0].text)
        assert 0 <= value["a"] <= 9 and value["b"] in ("x", "y")
    for extra in (
        {"guided_whitespace_pattern": "[ ]?"},
        {"output_format": {"type": "json_schema"}},
        {"output_format": fmt, "response_format": {"type": "json_object"}},
    ):
        with pytest.raises(anthropic.BadRequestError):
            claude.messages.create(**kw, extra_body=extra)


def test_n_other_than_one_is_refused_not_dropped(claude) -> None:
    """The chat endpoint's n has no place in a message (one sample): refused, as the other fields
    that would change the output are, rather than answering one sample of the n asked."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES, extra_body={"n": 3})
    assert refused.value.body["error"]["message"].startswith("n: not supported")
    m = claude.messages.create(
        model=MODEL_NAME, max_tokens=2, messages=MESSAGES, extra_body={"n": 1, "ignore_eos": True}
    )
    assert m.usage.output_tokens == 2


def test_tools_need_distinct_non_empty_names_and_a_schema(claude) -> None:
    tool = {"name": "f", "input_schema": {"type": "object"}}
    for tools, choice, needle in (
        ([tool, {**tool, "description": "again"}], None, "unique"),
        ([{**tool, "name": ""}], None, "at least 1 character"),
        ([{"name": "f", "description": "no schema"}], None, "tools[0].input_schema: Field required"),
        # Anthropic's shape named back, not the chat endpoint's it is translated into
        ([tool], {"type": "tool", "name": ""}, "named tool_choice is {'type': 'tool', 'name': ...}"),
        ([tool], {"type": "tool"}, "named tool_choice is {'type': 'tool', 'name': ...}"),
        ([tool], {"type": "auto", "disable_parallel_tool_use": "no"}, "disable_parallel_tool_use"),
    ):
        kwargs = {"tool_choice": choice} if choice else {}
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES, tools=tools, **kwargs)
        assert needle in refused.value.body["error"]["message"]
    m = claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES, tools=[tool])
    assert m.usage.output_tokens >= 1


PNG_HEAD = b"\x89PNG\r\n\x1a\n" + bytes(24)
JPEG_HEAD = b"\xff\xd8\xff\xe0" + bytes(28)


@pytest.mark.parametrize(
    "media_type,data,needle",
    [
        ("image/bmp", PNG_HEAD, "media_type must be one of image/jpeg, image/png, image/gif, image/webp"),
        (None, PNG_HEAD, "media_type must be one of"),
        ("image/png", JPEG_HEAD, "the image's data is not of its media_type image/png"),
        ("image/webp", b"RIFF\x00\x00\x00\x00WAVE" + bytes(20), "not of its media_type image/webp"),
        # the declared type matches: refused only because this model reads no images
        ("image/png", PNG_HEAD, "reads text only"),
        ("image/jpeg", JPEG_HEAD, "reads text only"),
    ],
    ids=["bmp", "no-media-type", "jpeg-as-png", "wav-as-webp", "png", "jpeg"],
)
def test_an_image_blocks_media_type_is_checked(server, claude, media_type, data: bytes, needle: str) -> None:
    source = {"type": "base64", "data": base64.b64encode(data).decode()}
    if media_type is not None:
        source["media_type"] = media_type
    content = [{"type": "image", "source": source}, {"type": "text", "text": "what is it?"}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(
            f"{server.url}{path}",
            json={"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": content}]},
        )
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert needle in r.json()["error"]["message"]
    served = claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES, extra_body=GREEDY)
    assert served.usage.output_tokens == 2


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": True},
        {"logprobs": True, "top_logprobs": 2},
        {"prompt_logprobs": 1},
        {"logprob_token_ids": [1, 2]},
        {"use_beam_search": True},
    ],
)
def test_chat_fields_a_message_has_no_place_for_are_refused(claude, extra: dict) -> None:
    """The chat endpoint's logprobs and beam search would be computed and dropped: refused."""
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES, extra_body=extra)
    assert refused.value.body["error"]["message"].startswith(f"{next(iter(extra))}: not supported")
    off = {k: False if v is True else None for k, v in extra.items()}
    assert claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES, extra_body=off)


def test_a_tool_use_block_needs_a_name_and_an_input_of_bounded_depth(server) -> None:
    """Anthropic's tool_use name has at least 1 character (the Responses API's function_call
    refuses an empty one too); an input nested past what the template's renderer follows is a 400
    naming the block, not Python's "maximum recursion depth exceeded"."""
    deep: dict = {}
    node = deep
    for _ in range(600):
        node["a"] = {}
        node = node["a"]

    def turns(use: dict) -> list[dict]:
        call = {"type": "tool_use", "id": "toolu_1", **use}
        done = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}
        return [*MESSAGES, {"role": "assistant", "content": [call]}, {"role": "user", "content": [done]}]

    for use, needle in (
        ({"name": "", "input": {}}, "messages[1].content[0].name: a tool_use block's name is empty"),
        ({"name": "f", "input": deep}, "messages[1].content[0].input: a tool_use block's input nests"),
    ):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            body = {"model": MODEL_NAME, "max_tokens": 2, "messages": turns(use)}
            r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert needle in message and "recursion" not in message, message
    body = {
        "model": MODEL_NAME,
        "max_tokens": 2,
        "messages": turns({"name": "f", "input": {"a": {"b": [1]}}}),
    }
    assert httpx.post(f"{server.url}/v1/messages", json=body, timeout=60).status_code == 200


def test_anthropics_sdk_lists_the_models_in_its_shape(server, claude) -> None:
    """`client.models.list()` / `retrieve()` (which send anthropic-version) get Anthropic's model
    objects in one page that says it is the last; OpenAI's clients keep OpenAI's list."""
    page = claude.models.list()
    assert [m.id for m in page] == [MODEL_NAME]  # the SDK pages on unless has_more is false
    assert page.has_more is False and page.first_id == page.last_id == MODEL_NAME
    info = page.data[0]
    assert info.type == "model" and info.display_name == MODEL_NAME and info.lifecycle == "active"
    assert info.created_at.tzinfo is not None  # an RFC 3339 time, which the SDK reads as a datetime
    openai_list = httpx.get(f"{server.url}/v1/models").json()
    assert (
        list(openai_list) == ["object", "data"]
        and info.max_input_tokens == openai_list["data"][0]["max_model_len"]
    )
    assert claude.models.retrieve(MODEL_NAME).display_name == MODEL_NAME
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.models.retrieve("no-such-model")
    assert missing.value.body["type"] == "error" and missing.value.body["error"]["type"] == "not_found_error"


def test_every_reply_carries_a_request_id(server, claude) -> None:
    """Anthropic's SDKs read a response's id from its request-id header (a message's `_request_id`,
    an error's `request_id`), streamed or not, refused or not."""
    ids = [claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=MESSAGES)._request_id]
    with claude.messages.stream(model=MODEL_NAME, max_tokens=2, messages=MESSAGES) as stream:
        ids.append(stream.response.headers.get("request-id"))
    ids.append(
        claude.messages.with_raw_response.count_tokens(model=MODEL_NAME, messages=MESSAGES).headers.get(
            "request-id"
        )
    )
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL_NAME, max_tokens=-1, messages=MESSAGES)
    ids.append(refused.value.request_id)
    # a route of Anthropic's this server lacks: its 404 in Anthropic's shape, with an id too
    batches = httpx.post(f"{server.url}/v1/messages/batches", json={"requests": []})
    assert batches.status_code == 404 and batches.json()["type"] == "error"
    ids.append(batches.headers.get("request-id"))
    assert all(i and i.startswith("req_") for i in ids) and len(set(ids)) == len(ids), ids
    chat_reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
    assert chat_reply.status_code == 200 and "request-id" not in chat_reply.headers  # OpenAI's clients: none


def test_count_tokens_counts_a_prompt_longer_than_the_context(server, claude) -> None:
    """Anthropic's count tells a client whether its prompt fits (so that it can shorten one that
    does not): a prompt past the context is counted; only the message itself is refused."""
    long = [{"role": "user", "content": "word " * 2000}]
    counted = claude.messages.count_tokens(model=MODEL_NAME, messages=long)
    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"messages": long, "add_generation_prompt": True}, timeout=60
    ).json()
    assert counted.input_tokens == tokenized["count"] > tokenized["max_model_len"]
    with pytest.raises(anthropic.BadRequestError, match="maximum context length"):
        claude.messages.create(model=MODEL_NAME, max_tokens=2, messages=long)
    tool = {"name": "f", "input_schema": {"type": "object"}}
    with pytest.raises(anthropic.BadRequestError, match="not among the tools"):  # still checked
        claude.messages.count_tokens(
            model=MODEL_NAME, messages=MESSAGES, tools=[tool], tool_choice={"type": "tool", "name": "g"}
        )
