"""vLLM's `logprob_token_ids` on chat and completions: at each generated token, its top logprobs
are the chosen token's and the asked ids' (in their order), whole and streamed, with the values
/generate's token_ids_logprob gives; vLLM's 400s where it cannot be honoured."""

from __future__ import annotations

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "hello there"}]
ASKED = [11, 42, 7]


def _id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _asked_values(server, prompt_ids: list[int], max_tokens: int) -> list[dict[int, float]]:
    """Each generated position's asked ids' logprobs, from /generate for the same prompt."""
    r = httpx.post(
        f"{server.url}/generate",
        json={
            "input_ids": prompt_ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_tokens, "ignore_eos": True},
            "return_logprob": True,
            "token_ids_logprob": ASKED,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return [{e[1]: e[0] for e in row} for row in r.json()["meta_info"]["output_token_ids_logprobs"]]


def _expected_ids(chosen: int) -> list[int]:
    return [chosen] + [t for t in ASKED if t != chosen]


def test_chat_top_logprobs_are_the_chosen_and_asked_ids_whole_and_streamed(
    client, server, model_name
) -> None:
    body = {
        "model": model_name,
        "messages": MESSAGES,
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,  # the asked ids stand in for the top ones, as in vLLM
        "extra_body": {
            "logprob_token_ids": ASKED,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    }
    whole = client.chat.completions.create(**body)
    content = whole.choices[0].logprobs.content
    want = _asked_values(server, whole.model_extra["prompt_token_ids"], 4)
    assert [_id(e.token) for e in content] == whole.choices[0].token_ids
    for entry, values in zip(content, want, strict=True):
        chosen = _id(entry.token)
        assert [_id(t.token) for t in entry.top_logprobs] == _expected_ids(chosen)
        assert entry.top_logprobs[0].logprob == entry.logprob
        for top in entry.top_logprobs[1:]:
            assert top.logprob == pytest.approx(values[_id(top.token)], abs=1e-4)
    streamed = [
        e for chunk in client.chat.completions.create(**body, stream=True) if chunk.choices
        for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])
    ]  # fmt: skip
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in streamed] == [
        (e.token, [t.token for t in e.top_logprobs]) for e in content
    ]


def test_completion_top_logprobs_are_the_asked_ids_the_echo_keeps_its_own(client, server, model_name) -> None:
    prompt = [5, 9, 17, 3]
    body = {
        "model": model_name,
        "prompt": prompt,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "extra_body": {"logprob_token_ids": ASKED, "return_tokens_as_token_ids": True, "ignore_eos": True},
    }
    lp = client.completions.create(**body).choices[0].logprobs
    want = _asked_values(server, prompt, 3)
    assert lp.top_logprobs[0] is None  # the prompt's first token: nothing before it
    for top in lp.top_logprobs[1:4]:  # the echoed prompt's: its top 2 and its own token
        assert 2 <= len(top) <= 3
    for token, top, values in zip(lp.tokens[4:], lp.top_logprobs[4:], want, strict=True):
        assert [_id(t) for t in top] == _expected_ids(_id(token))
        for t in list(top)[1:]:
            assert top[t] == pytest.approx(values[_id(t)], abs=1e-4)
    streamed = [
        top for chunk in client.completions.create(**body, stream=True)
        for top in (chunk.choices[0].logprobs.top_logprobs if chunk.choices[0].logprobs else [])
    ]  # fmt: skip
    assert [list(t) if t else t for t in streamed] == [list(t) if t else t for t in lp.top_logprobs]


@pytest.mark.parametrize(
    "endpoint,extra,words",
    [
        ("chat", {"logprob_token_ids": [1, 2]}, "needs logprobs true"),
        ("chat", {"logprob_token_ids": [], "logprobs": True}, "empty"),
        ("chat", {"logprob_token_ids": [1], "logprobs": True, "use_beam_search": True, "n": 2}, "beam"),
        ("chat", {"logprob_token_ids": [10**7], "logprobs": True}, "vocabulary"),
        ("chat", {"logprob_token_ids": list(range(129)), "logprobs": True}, "at most 128"),
        ("completions", {"logprob_token_ids": [1, 2]}, "needs logprobs set"),
        ("completions", {"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0}, "echo"),
    ],
)
def test_logprob_token_ids_it_cannot_honour_are_400_naming_it(
    client, model_name, endpoint: str, extra: dict, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=3, extra_body=extra
            )
        else:
            client.completions.create(model=model_name, prompt="hi", extra_body={"max_tokens": 3, **extra})
    err = info.value.response.json()["error"]
    assert err["param"] == "logprob_token_ids" and words in err["message"], err


def test_logprob_token_ids_take_vllms_128_ids(client, model_name) -> None:
    """vLLM's limit: each generated token's top logprobs hold the chosen token and all 128 asked."""
    asked = list(range(128))
    reply = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=2, logprobs=True,
        extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    for entry in reply.choices[0].logprobs.content:
        assert {_id(t.token) for t in entry.top_logprobs} == {*asked, _id(entry.token)}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompt_logprobs_leave_the_128_ids_to_the_generated_tokens(client, model_name, endpoint: str) -> None:
    """vLLM's: the asked ids are the generated tokens' alone, so prompt_logprobs do not bound them
    (it was a 400 past 20 ids: each prompt position computed them, and no reply showed them)."""
    asked = list(range(128))
    extra = {"logprob_token_ids": asked, "prompt_logprobs": 1, "return_tokens_as_token_ids": True}
    extra["ignore_eos"] = True  # two tokens each time, never an end of sequence sampled first
    if endpoint == "chat":
        reply = client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=2, logprobs=True, extra_body=extra
        )
        tops = [
            ({_id(t.token) for t in e.top_logprobs}, _id(e.token)) for e in reply.choices[0].logprobs.content
        ]
        scored = reply.model_extra["prompt_logprobs"]
    else:
        choice = client.completions.create(
            model=model_name, prompt=[5, 9, 17, 3], max_tokens=2, logprobs=1, extra_body=extra
        ).choices[0]
        tops = [
            ({_id(t) for t in top}, _id(tok))
            for tok, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs)
        ]
        scored = choice.model_extra["prompt_logprobs"]
    assert len(tops) == 2 and all(ids == {*asked, chosen} for ids, chosen in tops)
    assert scored[0] is None and all(1 <= len(entry) <= 2 for entry in scored[1:])  # its own and its top 1
