"""vLLM's request fields through the official client (`extra_body`): each one deltaserve takes does
what vLLM's does, and one it cannot honour is a 400 naming it rather than ignored."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "user", "content": "hello there"}]


def refusal(call) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.status_code == 400
    body = info.value.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_nulls_in_nullable_openai_fields_are_their_defaults(client, model_name) -> None:
    # OpenAI's schema makes these nullable, and clients that write every field send null
    chat = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=3,
        temperature=0,
        extra_body={
            "n": None,
            "stream": None,
            "logprobs": None,
            "parallel_tool_calls": None,
            "return_tokens_as_token_ids": None,
            "ignore_eos": None,
        },
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    assert chat.usage.completion_tokens == 3
    text = client.completions.create(
        model=model_name, prompt="hi", max_tokens=3, extra_body={"echo": None, "n": None, "stream": None}
    )
    assert len(text.choices) == 1 and not text.choices[0].text.startswith("hi")
    stream = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": None, "continuous_usage_stats": None},  # type: ignore[typeddict-item]
    )
    assert all(chunk.usage is None for chunk in stream)
    # a null where a value is required is still a 400 naming the field
    err = refusal(lambda: client.chat.completions.create(model=model_name, messages=None, max_tokens=3))
    assert err["param"] == "messages"
