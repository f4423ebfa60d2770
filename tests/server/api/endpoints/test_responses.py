"""The Responses API (/v1/responses) through the official client against a real server on the
built-in model: the same prompt and tokens as the chat endpoint, conversation items, forced
function calls, JSON output, streamed events that add up to the final response, and 400s."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}


def test_text_response_matches_the_chat_endpoint(client) -> None:
    """A greedy response has the tokens of the same chat completion (one prompt, one template)."""
    r = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", input="Hello there", max_output_tokens=12, temperature=0
    )
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        max_tokens=12,
        temperature=0,
    )
    assert r.object == "response" and r.model == MODEL_NAME
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.output_text == (chat.choices[0].message.content or "")
    stopped = chat.choices[0].finish_reason == "stop"
    assert r.status == ("completed" if stopped else "incomplete")
    if not stopped:
        assert r.incomplete_details.reason == "max_output_tokens"
    (message,) = [item for item in r.output if item.type == "message"]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert message.status == r.status  # the item max_output_tokens cut is incomplete too, as OpenAI marks it


def test_the_chat_endpoints_sampling_fields_and_reasoning_effort_apply(client) -> None:
    """vLLM's Responses API takes the chat endpoint's sampling fields (stop, structured_outputs,
    penalties, ignore_eos, ...), and reasoning.effort "none" turns the template's thinking off."""
    regex = client.responses.create(
        model=MODEL_NAME,
        input="Hi",
        max_output_tokens=10,
        extra_body={"structured_outputs": {"regex": "abc"}},
    )
    assert regex.output_text == "abc" and regex.status == "completed"
    kw = dict(model=MODEL_NAME, input="Hello there", max_output_tokens=16, temperature=0)
    free = client.responses.create(**kw, extra_body={"ignore_eos": True}).output_text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    cut = client.responses.create(**kw, extra_body={"ignore_eos": True, "stop": [stop]})
    assert stop.strip() and cut.output_text == free[: free.index(stop)]
    off = client.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=1, reasoning={"effort": "none"}
    )
    template_off = client.responses.create(
        model=MODEL_NAME,
        input="Hi",
        max_output_tokens=1,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    plain = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=1)
    assert off.usage.input_tokens == template_off.usage.input_tokens > plain.usage.input_tokens
    assert off.reasoning.effort == "none"


def test_reasoning_effort_max_is_served_as_on_the_chat_endpoint(client) -> None:
    """The SDK's ReasoningEffort holds "max", which chat's reasoning_effort takes (as vLLM's): the
    Responses API takes it too, thinking on, as any effort but "none"."""
    kw = dict(model=MODEL_NAME, input="Hi", max_output_tokens=1)
    high = client.responses.create(**kw, reasoning={"effort": "high"})
    top = client.responses.create(**kw, reasoning={"effort": "max"})
    assert top.reasoning.effort == "max" and top.usage.input_tokens == high.usage.input_tokens


def test_chat_template_kwargs_reach_the_template(client) -> None:
    """vLLM's extension: `chat_template_kwargs` as in chat (Qwen3's template closes the think
    section when thinking is off, so the prompt grows)."""
    kw = dict(model=MODEL_NAME, input="Hi", max_output_tokens=1)
    plain = client.responses.create(**kw)
    off = client.responses.create(**kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.input_tokens > plain.usage.input_tokens


def test_conversation_items_render_as_chat_messages(client) -> None:
    """Messages, a function call and its output in `input` make the prompt the same chat
    messages make (equal token counts and greedy tokens)."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
        {"type": "message", "role": "user", "content": "And tomorrow?"},
    ]
    r = client.responses.create(
        model=MODEL_NAME, input=items, tools=[WEATHER], max_output_tokens=10, temperature=0
    )
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, max_tokens=10, temperature=0
    )
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_a_function_call_outputs_content_parts_are_its_text(client) -> None:
    """A function_call_output whose output is a list of input_text parts (as the SDK's types allow)
    gives the tool message their text joined by newlines (as chat and vLLM join parts), the prompt
    of the same output as that string."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    ask = {"role": "user", "content": "Weather in Paris?"}

    def prompt_tokens(output) -> int:
        items = [ask, call, {"type": "function_call_output", "call_id": "call_1", "output": output}]
        r = client.responses.create(model=MODEL_NAME, input=items, tools=[WEATHER], max_output_tokens=1)
        return r.usage.input_tokens

    parts = [{"type": "input_text", "text": "18 C, "}, {"type": "input_text", "text": "sunny"}]
    assert prompt_tokens(parts) == prompt_tokens("18 C, \nsunny") != prompt_tokens("18 C, sunny")
    with pytest.raises(openai.BadRequestError, match="input_file"):
        prompt_tokens([{"type": "input_file", "file_id": "file-1"}])


def test_a_messages_text_parts_join_as_chat_joins_them(client) -> None:
    """An input message's text parts are joined by newlines, as the chat endpoint (and vLLM, whose
    Responses API hands the parts to its chat parser) joins a message's parts: the same prompt as
    the chat request with the same parts, where they were joined with nothing."""
    parts = [{"type": "input_text", "text": "Name three"}, {"type": "input_text", "text": "colours."}]
    chat_parts = [{"type": "text", "text": p["text"]} for p in parts]
    for role in ("user", "system", "assistant"):
        turns = [{"role": role, "content": parts}, {"role": "user", "content": "Go on."}]
        r = client.responses.create(model=MODEL_NAME, input=turns, max_output_tokens=1)
        chat = client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": role, "content": chat_parts}, {"role": "user", "content": "Go on."}],
            max_tokens=1,
        )
        assert r.usage.input_tokens == chat.usage.prompt_tokens, role
        joined = [{"role": role, "content": "Name threecolours."}, {"role": "user", "content": "Go on."}]
        glued = client.chat.completions.create(model=MODEL_NAME, messages=joined, max_tokens=1)
        assert glued.usage.prompt_tokens != chat.usage.prompt_tokens  # the test tells the two apart


def test_an_assistant_turns_refusal_part_is_its_text(client) -> None:
    """An earlier response's output message may hold a `refusal` part (the SDK's
    ResponseOutputRefusal); sent back as input it is the turn's text, as chat reads a refusal
    part, where it was a 400. A user's refusal part stays a 400."""

    def prompt_tokens(part: dict) -> int:
        items = [
            {"role": "user", "content": "Tell me a secret."},
            {"type": "message", "role": "assistant", "content": [part]},
            {"role": "user", "content": "Why not?"},
        ]
        return client.responses.create(model=MODEL_NAME, input=items, max_output_tokens=1).usage.input_tokens

    words = "I can't share that."
    as_text = prompt_tokens({"type": "output_text", "text": words, "annotations": []})
    assert prompt_tokens({"type": "refusal", "refusal": words}) == as_text
    user_refusal = [{"role": "user", "content": [{"type": "refusal", "refusal": words}]}]
    with pytest.raises(openai.BadRequestError, match="refusal"):
        client.responses.create(model=MODEL_NAME, input=user_refusal, max_output_tokens=1)


def test_a_turns_reasoning_and_text_stay_with_its_calls(client, base_url: str) -> None:
    """An output's reasoning, message and function_call items sent back (as a tool loop sends
    them) are the one assistant turn the model wrote, its reasoning the turn's reasoning_content,
    which the chat template shows after the last user message: the chat request's prompt."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "I should look it up."}]}  # fmt: skip
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    ask = {"role": "user", "content": "Weather in Paris?"}
    tool_call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    turn = {"role": "assistant", "reasoning_content": "I should look it up.", "tool_calls": [tool_call]}
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    for items, content in (([thought, call], None), ([thought, said, call], "Checking.")):
        r = client.responses.create(
            model=MODEL_NAME, input=[ask, *items, answer], tools=[WEATHER], max_output_tokens=1
        )
        messages = [
            ask,
            {**turn, "content": content},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        tokens = httpx.post(
            f"{base_url.removesuffix('/v1')}/tokenize", json={"messages": messages, "tools": tools}
        ).json()
        assert r.usage.input_tokens == tokens["count"], items


def test_a_reasoning_items_parts_are_joined_by_newlines(client, base_url: str) -> None:
    """A reasoning item's several summary or reasoning_text parts are the turn's reasoning on lines
    of their own, as vLLM joins them, where they ran together: the prompt counts as the chat
    request's whose reasoning_content holds the newline, and not as one whose parts run on."""
    ask = {"role": "user", "content": "Weather in Paris?"}
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    answer = {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]

    def chat_count(reasoning: str) -> int:
        tool_call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"},
        }
        messages = [
            ask,
            {"role": "assistant", "content": None, "reasoning_content": reasoning, "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        body = {"messages": messages, "tools": tools}
        return httpx.post(f"{base_url.removesuffix('/v1')}/tokenize", json=body).json()["count"]

    texts = ["I should look", "it up."]
    for thought in (
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in texts]},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": t} for t in texts],
        },
    ):
        r = client.responses.create(
            model=MODEL_NAME, input=[ask, thought, call, answer], tools=[WEATHER], max_output_tokens=1
        )
        assert r.usage.input_tokens == chat_count("\n".join(texts)) != chat_count("".join(texts)), thought


@pytest.mark.slow
def test_forced_function_call_and_json_output(client) -> None:
    r = client.responses.create(
        model=MODEL_NAME,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=1.0,
        extra_body={"seed": 3},
    )
    calls = [item for item in r.output if item.type == "function_call"]
    if r.status == "completed":
        (call,) = calls
        args = json.loads(call.arguments)
        assert call.name == "get_weather" and call.call_id and set(args) == {"city", "unit"}
        assert args["unit"] in ("C", "F")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL_NAME,
        input="JSON please",
        text={"format": {"type": "json_schema", "name": "v", "schema": schema, "strict": True}},
        max_output_tokens=40,
        temperature=0,
    )
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


@pytest.mark.slow
def test_forced_function_call_with_a_text_format(client) -> None:
    """openai-agents' Responses model with `output_type` and `tool_choice="required"`: the forced call
    answers this turn; the JSON `text.format` is for a later turn's text."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    kw = dict(
        model=MODEL_NAME,
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
        max_output_tokens=120,
        extra_body={"seed": 1},
    )
    for stream in (False, True):
        r = (
            list(client.responses.create(**kw, stream=True))[-1].response
            if stream
            else client.responses.create(**kw)
        )
        assert r.status == "completed" and [item.type for item in r.output] == ["function_call"]
        assert set(json.loads(r.output[0].arguments)) == {"city", "unit"}


def test_stream_events_add_up_to_the_response(client) -> None:
    kw = dict(model=MODEL_NAME, input="Count with me", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status
    assert [i.status for i in final.output] == [i.status for i in whole.output]
    assert final.output[-1].status == final.status  # the item being written when it ended
    done_items = [e.item.status for e in events if e.type == "response.output_item.done"]
    assert done_items == [i.status for i in whole.output]
    assert final.usage.output_tokens == whole.usage.output_tokens
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [e.text for e in done] == [whole.output_text]
    added = kinds.index("response.output_item.added")
    assert added < kinds.index("response.output_text.delta") < kinds.index("response.output_item.done")


def test_responses_and_events_hold_every_field_the_sdks_types_require(client) -> None:
    """The client builds its objects without validating them, so a field its types require that
    the server left out reads as None: validated against those types, nothing is missing."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    kw = dict(model=MODEL_NAME, input="Count with me", max_output_tokens=4, temperature=0)
    whole = client.responses.create(**kw)
    Response.model_validate(whole.to_dict())
    assert whole.usage.input_tokens_details.cache_write_tokens == 0
    events = list(client.responses.create(**kw, stream=True))
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event.to_dict())
    texts = [e for e in events if e.type in ("response.output_text.delta", "response.output_text.done")]
    assert texts and all(e.logprobs == [] for e in texts)


def without_bytes(entry: dict) -> dict:
    """An output_text part's logprob entry as the text events' type has it: no bytes."""
    tops = [{k: v for k, v in t.items() if k != "bytes"} for t in entry["top_logprobs"]]
    return {**{k: v for k, v in entry.items() if k != "bytes"}, "top_logprobs": tops}


def test_include_output_text_logprobs_gives_the_chat_endpoints_logprobs(client) -> None:
    """include's message.output_text.logprobs with top_logprobs: each token's logprob and top
    alternatives in output_text.logprobs, as the chat endpoint gives them (vLLM's Responses API
    does), streamed in the text deltas; top_logprobs alone asks for nothing, as in vLLM."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    kw = dict(model=MODEL_NAME, input="Count with me", max_output_tokens=6, temperature=0)
    asked = dict(kw, top_logprobs=2, include=["message.output_text.logprobs"])
    whole = client.responses.create(**asked)
    Response.model_validate(whole.to_dict())
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count with me"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    expected = [t.to_dict() for t in chat.choices[0].logprobs.content]
    (message,) = [item for item in whole.output if item.type == "message"]
    got = [t.to_dict() for t in message.content[0].logprobs]
    assert got == expected and all(len(t["top_logprobs"]) == 2 for t in got)
    assert whole.top_logprobs == 2  # echoed, as OpenAI's and vLLM's responses do
    events = list(client.responses.create(**asked, stream=True))
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event.to_dict())
    final = events[-1].response
    (streamed,) = [item for item in final.output if item.type == "message"]
    assert [t.to_dict() for t in streamed.content[0].logprobs] == expected
    deltas = [t.to_dict() for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == [t.to_dict() for t in done.logprobs] == [without_bytes(t) for t in expected]
    # a reply that ends on its end token: that token has no text, and the last message holds it too
    chosen = dict(asked, extra_body={"structured_outputs": {"choice": ["ab"]}})
    ended = client.responses.create(**chosen)
    tokens = [t.token for t in ended.output[-1].content[0].logprobs]
    assert (
        ended.status == "completed"
        and "".join(tokens[:-1]) == "ab"
        and len(tokens) == ended.usage.output_tokens
    )
    events = list(client.responses.create(**chosen, stream=True))
    final = events[-1].response
    assert [t.to_dict() for t in final.output[-1].content[0].logprobs] == [
        t.to_dict() for t in ended.output[-1].content[0].logprobs
    ]
    # the end token, of no text, comes in a delta too (one of no text, before the done event), as
    # every other token's logprob does: the deltas' logprobs make up the done event's
    texts = [e for e in events if e.type in ("response.output_text.delta", "response.output_text.done")]
    assert [e.type for e in texts[-2:]] == ["response.output_text.delta", "response.output_text.done"]
    assert texts[-2].delta == "" and [t.token for t in texts[-2].logprobs] == tokens[-1:]
    deltas = [t.to_dict() for e in texts[:-1] for t in e.logprobs]
    assert (
        deltas
        == [t.to_dict() for t in texts[-1].logprobs]
        == [without_bytes(t.to_dict()) for t in final.output[-1].content[0].logprobs]
    )
    plain = client.responses.create(**kw, top_logprobs=2)
    assert all(
        part.logprobs is None for item in plain.output if item.type == "message" for part in item.content
    )


@pytest.mark.slow
def test_stream_sends_each_steps_text_as_it_is_generated(client) -> None:
    """The first delta comes well before the response completes, and the deltas make the final text."""
    start = time.monotonic()
    arrivals = []
    for event in client.responses.create(
        model=MODEL_NAME, input="Tell me a story", max_output_tokens=200, temperature=0, stream=True
    ):
        arrivals.append((time.monotonic() - start, event))
    deltas = [
        (t, e)
        for t, e in arrivals
        if e.type in ("response.output_text.delta", "response.reasoning_text.delta")
    ]
    end, last = arrivals[-1]
    assert last.type in ("response.completed", "response.incomplete")
    assert last.response.usage.output_tokens > 100 and len(deltas) > 50
    first = deltas[0][0]
    assert end - first > 0.25 * end, (first, end)
    text = "".join(e.delta for _, e in deltas if e.type == "response.output_text.delta")
    assert text == last.response.output_text
    reasoning = "".join(e.delta for _, e in deltas if e.type == "response.reasoning_text.delta")
    thought = [i.content[0].text for i in last.response.output if i.type == "reasoning"]
    assert reasoning == "".join(thought)


def test_previous_response_continues_the_conversation(client, base_url: str) -> None:
    """A stored response's input and output come before the next turn's input: the same prompt
    as sending the whole conversation; GET reads a stored response, DELETE drops it, and
    `store: false` keeps none."""
    first = client.responses.create(
        model=MODEL_NAME, input="Name a color.", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input="And another?",
        max_output_tokens=6,
        temperature=0,
    )
    whole = client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "user", "content": "Name a color."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And another?"},
        ],
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    # a third turn chains through both
    third = client.responses.create(
        model=MODEL_NAME, previous_response_id=second.id, input="Thanks.", max_output_tokens=2
    )
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens

    assert client.responses.retrieve(first.id).output_text == first.output_text
    deleted = httpx.delete(f"{base_url}/responses/{first.id}", timeout=30)
    assert deleted.status_code == 200 and deleted.json()["deleted"] is True
    assert httpx.get(f"{base_url}/responses/{first.id}", timeout=30).status_code == 404
    gone = httpx.post(
        f"{base_url}/responses", json={"input": "hi", "previous_response_id": first.id}, timeout=30
    )
    assert gone.status_code == 400 and gone.json()["error"]["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, store=False)
    assert httpx.get(f"{base_url}/responses/{unstored.id}", timeout=30).status_code == 404
    streamed = list(client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=3, stream=True))
    kept = client.responses.retrieve(streamed[-1].response.id)
    assert kept.output_text == streamed[-1].response.output_text


def test_cancel_and_streamed_retrieve_of_a_stored_response_are_400s(client) -> None:
    """Every response here is answered in its request: the SDK's cancel is vLLM's 400 for a
    synchronous response (404 for one not stored), and retrieve(stream=True), which replays a
    background response's events, is a 400, not a JSON body the client reads as no events."""
    r = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as cancel:
        client.responses.cancel(r.id)
    assert cancel.value.body["param"] == "response_id" and "synchronous" in cancel.value.message
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_missing")
    with pytest.raises(openai.BadRequestError) as replay:
        list(client.responses.retrieve(r.id, stream=True))
    assert replay.value.body["param"] == "stream"
    assert client.responses.retrieve(r.id).id == r.id


def test_input_items_lists_the_items_a_stored_response_was_made_from(client, base_url: str) -> None:
    """`client.responses.input_items.list(id)`: OpenAI's list of the items used to generate a
    stored response (earlier turns' input and output too), each with an id, newest first unless
    `order=asc`, `limit` a page with `has_more`, `after` the next; 404 for one not stored."""
    first = client.responses.create(model=MODEL_NAME, input="Name a color.", max_output_tokens=4)
    second = client.responses.create(
        model=MODEL_NAME,
        previous_response_id=first.id,
        input=[
            {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": [{"type": "input_text", "text": "And another?"}]},
        ],
        max_output_tokens=4,
    )
    asc = client.responses.input_items.list(second.id, order="asc")
    assert asc.object == "list" and asc.has_more is False
    items = asc.data
    assert len(items) == 1 + len(first.output) + 2
    assert [i.id for i in items[1 : 1 + len(first.output)]] == [i.id for i in first.output]
    question, noted, another = items[0], items[-2], items[-1]
    assert question.type == "message" and question.role == "user"
    assert question.content[0].type == "input_text" and question.content[0].text == "Name a color."
    assert noted.role == "assistant" and noted.content[0].type == "output_text"
    assert noted.content[0].text == "Noted." and another.content[0].text == "And another?"
    ids = [i.id for i in items]
    assert all(ids) and len(set(ids)) == len(ids)
    assert (asc.first_id, asc.last_id) == (ids[0], ids[-1])
    # the ids are kept: a second read lists the same ones, newest first by default
    assert [i.id for i in client.responses.input_items.list(second.id).data] == ids[::-1]
    page = client.responses.input_items.list(second.id, limit=2)
    assert [i.id for i in page.data] == ids[::-1][:2] and page.has_more is True
    assert [i.id for i in client.responses.input_items.list(second.id, limit=1)] == ids[::-1]  # every page
    after = client.responses.input_items.list(second.id, order="asc", after=ids[1])
    assert [i.id for i in after.data] == ids[2:]
    assert [i.id for i in client.responses.input_items.list(first.id).data] == [ids[0]]
    kept = client.responses.input_items.list(first.id, include=["message.input_image.image_url"])
    assert [i.id for i in kept.data] == [ids[0]]
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_missing")
    for query in ({"limit": 0}, {"limit": 101}, {"limit": "x"}, {"order": "up"}, {"after": "msg_missing"}):
        r = httpx.get(f"{base_url}/responses/{second.id}/input_items", params=query, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(query)), r.text
    r = httpx.get(f"{base_url}/responses/{second.id}/input_items", params={"include[]": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text


@pytest.fixture(params=["memory", "shared"])
def make_store(request, tmp_path):
    """A store of one HTTP process (in memory), or of several (files in a folder they share)."""
    from deltaserve.server.api.responses import ResponseStore, SharedResponseStore

    if request.param == "memory":
        return ResponseStore
    return lambda **kw: SharedResponseStore(str(tmp_path / "responses"), **kw)


def test_the_store_keeps_the_last_responses(make_store) -> None:
    from deltaserve.server.api.responses import StoredResponse

    store = make_store(size=2)
    for name in ("a", "b"):
        store.put(name, StoredResponse([], {"id": name}))
    assert store.get("a") is not None  # used: now the most recent
    store.put("c", StoredResponse([], {"id": "c"}))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert store.delete("a") and not store.delete("a")


def test_the_store_keeps_its_responses_within_its_bytes(make_store) -> None:
    """Large inputs (an image's data URL) push the oldest responses out, so that the store cannot
    grow by tens of MB a request up to its 1,024 responses; the newest is kept whatever its size."""
    from deltaserve.server.api.responses import ResponseStore, StoredResponse

    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x" * 4000}]}]
    store = make_store(size=100, max_bytes=10_000)
    for name in ("a", "b", "c"):
        store.put(name, StoredResponse(image, {"id": name}))
    assert store.get("a") is None and store.get("b") is not None and store.get("c") is not None
    store.put("huge", StoredResponse([{"role": "user", "content": "y" * 50_000}], {"id": "huge"}))
    assert store.get("huge") is not None and store.get("b") is None and store.get("c") is None
    assert store.delete("huge")
    store.put("d", StoredResponse(image, {"id": "d"}))
    store.put("e", StoredResponse(image, {"id": "e"}))
    assert store.get("d") is not None and store.get("e") is not None  # what "huge" took is free again
    # the server's own store: 1,024 responses of a 1 MB input each are not all kept
    default = ResponseStore()
    text = "z" * (1 << 20)
    for i in range(1024):
        default.put(str(i), StoredResponse([{"role": "user", "content": text}], {"id": str(i)}))
    assert default.get("0") is None and default.get("1023") is not None


def test_several_processes_share_their_stored_responses(tmp_path) -> None:
    """Two stores over one folder (two HTTP processes) see each other's responses and deletes; an
    id from a URL names no file outside the folder."""
    from deltaserve.server.api.responses import SharedResponseStore, StoredResponse

    folder = tmp_path / "responses"
    first, second = SharedResponseStore(str(folder)), SharedResponseStore(str(folder))
    first.put("resp_1", StoredResponse([{"role": "user", "content": "hi"}], {"id": "resp_1"}))
    got = second.get("resp_1")
    assert got is not None and got.body == {"id": "resp_1"} and got.items[0]["content"] == "hi"
    assert second.delete("resp_1") and first.get("resp_1") is None and not first.delete("resp_1")
    (tmp_path / "secret").write_bytes(b"not a response")
    assert first.get("../secret") is None and not first.delete("../secret")
    assert (tmp_path / "secret").exists()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "v"}}}, "text.format"),
        ({"input": [{"type": "computer_call"}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),  # vLLM resolves none either
        ({"input": []}, "input"),
        # a field of the wrong type inside a tool or an item: a 400, not an internal error
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]}, None),
        ({"input": "hi", "tools": [{"type": "function", "name": "f", "description": 5}]}, None),
        ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, None),
        # a reasoning item whose summary or content is not a list of text parts
        ({"input": [{"type": "reasoning", "summary": 5}, {"role": "user", "content": "hi"}]}, "input"),
        (
            {
                "input": [
                    {"type": "reasoning", "summary": [], "content": [{"text": 5}]},
                    {"role": "user", "content": "hi"},
                ]
            },
            "input",
        ),
        ({"input": "hi", "reasoning": {"effort": "bogus"}}, "reasoning.effort"),
        # fields that would change the output and are not implemented here: refused, not ignored
        ({"input": "hi", "logprob_token_ids": [1, 2]}, "logprob_token_ids"),
        ({"input": "hi", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_requests_are_400s(base_url: str, body: dict, param: str | None) -> None:
    r = httpx.post(f"{base_url}/responses", json={"model": MODEL_NAME, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    if param in ("max_output_tokens", "text.format"):
        assert param in err["message"] and "json_schema':" not in err["message"]  # the Responses shape


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"truncation": "x"}, "truncation"),
        ({"include": ["nonsense"]}, "include.0"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"reasoning": {"summary": "x"}}, "reasoning.summary"),
        ({"reasoning": {"generate_summary": 1}}, "reasoning.generate_summary"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"tools": [{"type": "function", "name": "f", "strict": "x"}]}, "tools"),
    ],
)
def test_a_typed_field_of_another_type_or_value_is_400_naming_it(
    base_url: str, body: dict, param: str
) -> None:
    """Values OpenAI's and vLLM's schemas refuse are refused here too, not echoed or ignored."""
    r = httpx.post(f"{base_url}/responses", json={"input": "hi", "max_output_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"], err


def test_the_allowed_values_of_those_fields_are_served_and_echoed(base_url: str) -> None:
    body = {
        "input": "hi",
        "max_output_tokens": 2,
        "truncation": "auto",
        "include": ["reasoning.encrypted_content", "web_search_call.action.sources"],
        "reasoning": {"summary": "concise"},
        "metadata": {"k": "v"},
        "tools": [{"type": "function", "name": "f", "strict": True}],
    }
    r = httpx.post(f"{base_url}/responses", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["truncation"] == "auto" and out["reasoning"]["summary"] == "concise"
    assert out["metadata"] == {"k": "v"}


def _call(arguments: str) -> dict:
    return {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}


THOUGHT = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Hm."}]}


@pytest.mark.parametrize(
    ("item", "named"),
    [
        ({**_call("{}"), "name": ""}, "input[0].name: a function_call item's name is empty"),
        (
            _call("[" * 100_000 + "]" * 100_000),
            "input[0].arguments: a tool call's arguments nest objects and arrays deeper than 128 levels",
        ),
    ],
)
def test_a_refused_item_after_a_previous_response_is_named_by_its_index_in_input(
    client, base_url: str, item: dict, named: str
) -> None:
    """The previous response's items come first in the conversation, not in this request's input."""
    first = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=2)
    body = {"model": MODEL_NAME, "previous_response_id": first.id, "input": [item], "max_output_tokens": 2}
    r = httpx.post(f"{base_url}/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input" and named in err["message"], err


PNG_DATA_URL = "data:image/png;base64,iVBORw0KGgoAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"tools": [{"type": "function", "name": "f", "description": 5}]}, "tools.0.description",
         "tools[0].description"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters",
         "tools[0].parameters"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]}, "tools.0.parameters",
         "tools[0].parameters"),
        ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "input",
         "input[0]: a function_call_output item's call_id"),
        # OpenAI's and vLLM's schemas: output is a string or content parts, not any JSON value
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": 5}]}, "input",
         "input[0].output: a function_call_output item's output is a string or a list of content parts"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": {"temp": 18}}]}, "input",
         "input[0].output: a function_call_output item's output is a string or a list of content parts"),
        ({"input": [{"type": "function_call_output", "call_id": "c1"}]}, "input",
         "input[0].output: a function_call_output item's output is a string or a list of content parts"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG_DATA_URL}]}]}, "input",
         "reads text only"),
        # OpenAI's 400 for an empty name ("Expected a string with minimum length 1"), not a call to no function
        ({"input": [{"type": "function_call", "call_id": "c1", "name": "", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input",
         "input[0].name: a function_call item's name is empty"),
        # arguments the chat path refuses: named as the item, though its calls merged into one chat turn
        ({"input": [{"role": "user", "content": "hi"}, _call('{"a": "\\udfff"}')]}, "input",
         "input[1].arguments: a tool call's arguments hold a lone surrogate"),
        ({"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}, THOUGHT, _call("{}"),
                                                 _call('{"a": 1' + "0" * 5000 + "}")]}, "input",
         "input[3].arguments: a tool call's arguments hold an integer too long to read"),
    ],
)  # fmt: skip
def test_a_refusal_names_the_field_as_this_api_spells_it(
    base_url: str, body: dict, param: str, named: str
) -> None:
    """Tools and items become the chat endpoint's functions and messages: a 400 names the field the
    client sent (a tool's description, an item's call_id, an input_image), not the chat's it
    became (function.description, tool_call_id, an image_url part)."""
    r = httpx.post(f"{base_url}/responses", json={"input": "hi", "max_output_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and named in err["message"], err
    for chat_name in (".function.", "tool_call_id", "part type 'image_url'", "messages[", "tool_calls["):
        assert chat_name not in err["message"] and chat_name not in err["param"], err


def test_a_function_tool_without_a_name_is_400_saying_so(base_url: str) -> None:
    body = {
        "model": MODEL_NAME,
        "input": "hi",
        "tools": [{"type": "function", "parameters": {"type": "object"}}],
    }
    r = httpx.post(f"{base_url}/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "tools[0]: a function tool needs a name" in err["message"], err


def test_a_bad_request_admits_nothing(client, base_url: str, read_metrics) -> None:
    url = base_url.removesuffix("/v1")

    def finished() -> float:
        return sum(v for k, v in read_metrics(url).items() if k.startswith("deltaserve_requests_total"))

    before = finished()
    r = httpx.post(f"{base_url}/responses", json={"input": "hi", "previous_response_id": "r"}, timeout=30)
    assert r.status_code == 400 and finished() == before  # refused before reaching the engine
    assert client.responses.create(model=MODEL_NAME, input="still fine", max_output_tokens=2).usage
    assert finished() == before + 1


def test_structured_output_options_apply_and_unsupported_ones_are_refused(client) -> None:
    """Beside text.format, structured_outputs' disable_any_whitespace writes JSON without
    whitespace, as on the chat endpoint; vLLM's guided_whitespace_pattern, which the chat endpoint
    refuses, was dropped here (JSON with deltaserve's separators): now the same 400."""
    import openai

    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    kw = dict(
        model=MODEL_NAME,
        input="JSON",
        max_output_tokens=30,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "s", "schema": schema}},
    )
    r = client.responses.create(**kw, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert r.status == "completed" and " " not in r.output_text and json.loads(r.output_text)["b"] in "xy"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kw, extra_body={"guided_whitespace_pattern": "[ ]?"})
    assert refused.value.body["param"] == "guided_whitespace_pattern"
