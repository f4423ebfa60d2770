"""The OpenAI API of a real `deltaserve serve` (built-in model), driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def chat(client, **kwargs):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=kwargs.pop("messages", MESSAGES), **kwargs
    )


def test_models_health_version(client, server) -> None:
    import openai

    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME  # OpenAI's GET /v1/models/{id}
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]  # vLLM's card: no parent, one permission
    assert card["parent"] is None and card["max_model_len"] > 0
    assert [p["object"] for p in card["permission"]] == ["model_permission"] and card["permission"][0][
        "allow_sampling"
    ]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ping").json() == {"status": "ok"}  # SageMaker's, vLLM's too
    assert httpx.post(f"{server.url}/ping").json() == {"status": "ok"}  # vLLM's /ping takes POST too
    import deltaserve

    assert httpx.get(f"{server.url}/version").json()["version"] == deltaserve.__version__


@pytest.mark.slow
def test_head_is_answered_wherever_get_is(server) -> None:
    """Uptime checkers and some scrapers send HEAD: GET's status and headers, no body."""
    paths = ["/health", "/ping", "/version", "/metrics", "/get_model_info", "/get_weight_version"]
    for path in [*paths, "/v1/models", f"/v1/models/{MODEL_NAME}", "/health_generate"]:
        head, get = httpx.head(f"{server.url}{path}"), httpx.get(f"{server.url}{path}")
        assert (head.status_code, head.content) == (200, b""), path
        assert head.headers["content-type"] == get.headers["content-type"], path
    version = httpx.get(f"{server.url}/version")
    assert httpx.head(f"{server.url}/version").headers["content-length"] == str(len(version.content))
    missing = httpx.head(f"{server.url}/v1/models/no-such-model")
    assert (missing.status_code, missing.content) == (404, b"")
    assert httpx.head(f"{server.url}/generate").status_code == 405  # a POST route: as GET is refused


def test_a_method_a_route_does_not_take_is_405_naming_those_it_does(server) -> None:
    """HTTP's 405 says which methods the path takes (`Allow`), as FastAPI's own reply does."""
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["message"] == "Method Not Allowed"  # still OpenAI's error body
    assert "GET" in httpx.put(f"{server.url}/v1/models").headers["allow"]


def test_chat_shape_and_usage(client, server) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()
    r = chat(client, max_tokens=7, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert r.usage.prompt_tokens == tokens["count"]
    assert r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7
    assert 0 <= r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens


def test_max_completion_tokens(client) -> None:
    r = chat(client, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_temperature_zero_is_deterministic(client) -> None:
    outs = {chat(client, max_tokens=12, temperature=0).choices[0].message.content for _ in range(3)}
    assert len(outs) == 1


def test_seed_reproducible_and_distinct(client) -> None:
    def sample(seed: int) -> str:
        return (
            chat(client, max_tokens=12, temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
            .choices[0]
            .message.content
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_stream_equals_non_stream_with_usage_chunk(client) -> None:
    whole = chat(client, max_tokens=16, temperature=0)
    chunks = list(
        chat(client, max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage(client) -> None:
    chunks = list(chat(client, max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason is not None


def test_n_choices(client) -> None:
    r = chat(client, n=3, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    assert len({c.message.content for c in r.choices}) > 1  # seeds seed, seed+1, seed+2
    again = chat(client, n=3, max_tokens=8, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_a_streamed_choice_opens_with_its_own_role_chunk(client) -> None:
    """vLLM's chat stream opens with a chunk for each choice, in order, carrying its role, empty
    content, the prompt's token ids where asked and its own usage (prompt, 0 generated); no chunk
    holds two choices."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    ask = {"n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 7, "stream": True, "stream_options": options}
    chunks = list(chat(client, **ask, extra_body={"return_token_ids": True}))
    opening = chunks[:3]
    assert [[(c.index, c.delta.role, c.delta.content) for c in ch.choices] for ch in opening] == [
        [(i, "assistant", "")] for i in range(3)
    ]
    whole = chat(client, max_tokens=1)
    for chunk in opening:
        assert chunk.prompt_token_ids and len(chunk.prompt_token_ids) == whole.usage.prompt_tokens
        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (whole.usage.prompt_tokens, 0)
    assert all(len(ch.choices) == 1 for ch in chunks[:-1]) and chunks[-1].choices == []
    assert all(c.delta.role is None for ch in chunks[3:] for c in ch.choices)


def test_n_above_one_with_greedy_sampling_is_a_400(client, server) -> None:
    """vLLM refuses n > 1 at temperature 0 (its samples would be n copies of one reply), on chat
    and completions alike; n 1 greedy and n > 1 sampled are served, and so is SGLang's /generate,
    which reads temperature 0 as top_k 1 and gives the copies."""
    for create, ask in (
        (client.chat.completions.create, {"messages": [{"role": "user", "content": "hi"}]}),
        (client.completions.create, {"prompt": "hi"}),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            create(model=MODEL_NAME, n=2, temperature=0, max_tokens=2, **ask)
        assert refused.value.body["param"] == "n" and "greedy" in refused.value.body["message"]
        assert len(create(model=MODEL_NAME, n=1, temperature=0, max_tokens=2, **ask).choices) == 1
        assert len(create(model=MODEL_NAME, n=2, temperature=0.5, max_tokens=2, **ask).choices) == 2
    sampling = {"n": 2, "temperature": 0, "max_new_tokens": 2}
    copies = httpx.post(
        f"{server.url}/generate", json={"text": "hi", "sampling_params": sampling}, timeout=60
    )
    assert copies.status_code == 200 and len({c["text"] for c in copies.json()}) == 1


def test_n_choices_streamed(client) -> None:
    chunks = list(chat(client, n=3, max_tokens=5, stream=True, extra_body={"ignore_eos": True}))
    texts: dict[int, str] = {}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1, 2}


def test_stop_string(client) -> None:
    base = (
        chat(client, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}).choices[0].message.content
    )
    # Cut at a piece of the greedy answer: the same greedy run must end right before it.
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    assert stop.strip(), base
    cut = chat(client, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop  # vLLM's: the string that matched
    assert cut.message.content == base[: base.index(stop)]
    streamed = list(
        chat(client, max_tokens=24, temperature=0, stop=stop, stream=True, extra_body={"ignore_eos": True})
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut.message.content
    assert [c.choices[0].stop_reason for c in streamed if c.choices and c.choices[0].finish_reason] == [stop]


def test_stop_token_ids(client, server) -> None:
    greedy = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "One two three", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        timeout=60,
    ).json()
    first_tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": greedy["choices"][0]["text"]}).json()[
        "tokens"
    ]
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={
            "prompt": "One two three",
            "max_tokens": 6,
            "temperature": 0,
            "stop_token_ids": [first_tokens[0]],
        },
        timeout=60,
    ).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_the_same_streamed_or_not(client, server, include) -> None:
    """A stream's text (decoded in the HTTP process) leaves the stop token out as the engine's
    does, unless include_stop_str_in_output; an end of sequence with special tokens shown too,
    and the one that completes a grammar under ignore_eos."""
    body = {"model": MODEL_NAME, "prompt": [5, 9, 17, 3], "max_tokens": 8, "temperature": 0}
    free = client.completions.create(**body, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in free.choices[0].logprobs.tokens]
    eos = httpx.post(f"{server.url}/tokenize", json={"prompt": "<|im_end|>", "add_special_tokens": False})
    shown = {"skip_special_tokens": False}
    for extra in (
        {"stop_token_ids": [ids[2]]},
        {"logit_bias": {str(eos.json()["tokens"][0]): 100}, "min_tokens": 2, **shown},
        # a grammar's end of sequence, with ignore_eos: the grammar, not the token, ends it
        {"structured_outputs": {"regex": "abc"}, "ignore_eos": True, **shown},
    ):
        extra = {**extra, "include_stop_str_in_output": include}
        whole = client.completions.create(**body, extra_body=extra).choices[0]
        chunks = list(client.completions.create(**body, stream=True, extra_body=extra))
        assert whole.finish_reason == "stop" and chunks[-1].choices[0].finish_reason == "stop"
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
        # vLLM's stop_reason: the stop token's id, none for an end of sequence or a grammar's end
        want = ids[2] if "stop_token_ids" in extra else None
        assert whole.stop_reason == want and chunks[-1].choices[0].stop_reason == want
        assert whole.text.endswith("<|im_end|>") == (include and "skip_special_tokens" in extra)
        assert "structured_outputs" not in extra or whole.text.removesuffix("<|im_end|>") == "abc"


@pytest.mark.slow
def test_legacy_top_logprobs_hold_the_chosen_token(client) -> None:
    """OpenAI's legacy completions (and vLLM's) always give the chosen token's logprob among the
    top_logprobs: up to logprobs + 1 entries, streamed as not."""
    body = dict(model=MODEL_NAME, prompt="alpha beta", max_tokens=12, temperature=1.5, seed=3, logprobs=1)
    lp = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].logprobs
    assert any(len(top) == 2 for top in lp.top_logprobs)  # sampled tokens outside the top 1
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 1 <= len(top) <= 2
    chunks = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
    streamed = [
        top
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for top in c.choices[0].logprobs.top_logprobs
    ]
    assert streamed == lp.top_logprobs


def test_chat_logprobs(client) -> None:
    r = chat(
        client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True}
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert bytes(t.bytes).decode("utf-8", errors="replace") == t.token
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(t.logprob, max(x.logprob for x in t.top_logprobs), rel_tol=1e-4)
    streamed = chat(
        client,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [
        t.token
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == [t.token for t in content]


def test_completions(client) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert (
        r.object == "text_completion"
        and len(r.choices) == 1
        and r.choices[0].finish_reason in ("stop", "length")
    )
    streamed = client.completions.create(
        model=MODEL_NAME,
        prompt="The capital of France is",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completions_default_max_tokens_is_16(client) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt="Hi", extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16


def test_completions_batch_prompts_token_ids_echo_logprobs(client, server) -> None:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "alpha beta"}).json()["tokens"]
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=["alpha beta", "gamma"],
        n=2,
        max_tokens=3,
        temperature=1.0,
        extra_body={"ignore_eos": True, "top_k": 1},  # greedy choices (n > 1 at temperature 0 is a 400)
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy copies of one prompt
    by_ids = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == r.choices[0].text
    assert r.usage.prompt_tokens == len(ids) + len(
        httpx.post(f"{server.url}/tokenize", json={"prompt": "gamma"}).json()["tokens"]
    )

    echo_request = dict(
        model=MODEL_NAME,
        prompt="alpha beta",
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    echo = client.completions.create(**echo_request)
    choice = echo.choices[0]
    assert choice.text == "alpha beta" + r.choices[0].text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + 3 and "".join(lp.tokens) == choice.text
    # every prompt token but the first is scored (its prefill's logits), as vLLM does
    assert lp.token_logprobs[0] is None and all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 2 for top in lp.top_logprobs[len(ids) :])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Streamed, the chunks add up to the same text and logprobs, offsets counted from the start.
    chunks = [c.choices[0] for c in client.completions.create(**echo_request, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == choice.text
    assert [t for c in chunks if c.logprobs for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in chunks if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset


@pytest.mark.parametrize("prompt", ["a\U0001d518\U0001d52b\U0001d526b", "hi \U0001fae0 there"])
def test_text_offsets_stay_in_the_text_when_tokens_split_characters(client, server, prompt: str) -> None:
    """Byte-level tokens that each hold part of a character start where the character does: the
    offsets never go back, and every whole token's text is found at its offset."""
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    request = dict(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1)
    choice = client.completions.create(**request, extra_body={"ignore_eos": True}).choices[0]
    lp, text = choice.logprobs, choice.text
    assert len(lp.tokens) == len(ids) + 4 and any("\ufffd" in t for t in lp.tokens[: len(ids)])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    prompt_tokens = zip(lp.tokens[: len(ids)], lp.text_offset)  # the model's own tokens may be any bytes
    whole = [(t, o) for t, o in prompt_tokens if "\ufffd" not in t]
    assert len(whole) >= 2 and all(text[o : o + len(t)] == t for t, o in whole), list(
        zip(lp.tokens, lp.text_offset)
    )
    streamed = client.completions.create(**request, stream=True, extra_body={"ignore_eos": True})
    assert [
        o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
    ] == lp.text_offset


def test_tokenize_detokenize_roundtrip(server, max_model_len) -> None:
    text = "Hello, wörld! 你好"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == max_model_len
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == text


def test_tokenize_returns_token_strings_where_asked(server) -> None:
    """vLLM's return_token_strs: each id's piece as the tokenizer spells it (byte-level BPE marks a
    leading space with G-dot), for a prompt and for rendered messages; without it, no such field."""
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["token_strs"] == ["Hello", "\u0120world"] and r["count"] == len(r["tokens"]) == 2
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert len(chat["token_strs"]) == chat["count"] and chat["token_strs"][0] == "<|im_start|>"
    assert "token_strs" not in httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()


def test_chat_template_kwargs_reach_the_template(server) -> None:
    on = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    off = httpx.post(
        f"{server.url}/tokenize",
        json={"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["tokens"]
    assert off[: len(on)] == on and len(off) > len(on)  # Qwen3 appends an empty think block
    detok = httpx.post(f"{server.url}/detokenize", json={"tokens": off[len(on) :]}).json()["prompt"]
    assert "<think>" in detok and "</think>" in detok


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt", "tokenize", "chat_template"])
def test_chat_template_kwargs_cannot_set_what_the_server_passes(client, server, key: str) -> None:
    """A key the server passes the template itself (from the request's own fields) is a 400 naming
    it, on chat and on /tokenize, not a renderer's "multiple values" TypeError."""
    body = {"messages": MESSAGES, "chat_template_kwargs": {key: []}}
    r = httpx.post(f"{server.url}/tokenize", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"chat_template_kwargs.{key}" and "multiple values" not in error["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, messages=MESSAGES, max_tokens=2, extra_body={"chat_template_kwargs": {key: []}})
    assert exc.value.status_code == 400 and key in exc.value.message
    served = chat(client, messages=MESSAGES, max_tokens=2, extra_body={"ignore_eos": True})
    assert served.choices[0].finish_reason == "length"


def test_continue_final_message_leaves_the_last_turn_open(client, server) -> None:
    partial = "Red, green and"
    messages = [*MESSAGES, {"role": "assistant", "content": partial}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **fields}).json()["tokens"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"].endswith(partial)
    closed = httpx.post(
        f"{server.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}
    ).json()["tokens"]
    assert closed[: len(ids)] == ids and len(closed) > len(ids)  # the closed turn's end-of-turn follows
    # the chat goes on from that very prompt: greedy, the tokens the completions endpoint makes from its ids
    r = chat(client, messages=messages, max_tokens=8, temperature=0, logprobs=True, extra_body=fields)
    assert r.usage.prompt_tokens == len(ids)
    c = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0, logprobs=0)
    assert [t.token for t in r.choices[0].logprobs.content] == c.choices[0].logprobs.tokens
    both = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 2, "continue_final_message": True},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


@pytest.mark.slow
def test_truncate_prompt_tokens_keeps_the_prompts_end(client, server, max_model_len) -> None:
    def detok(ids: list[int]) -> str:
        return httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]

    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The quick brown fox jumps. " * 3}).json()[
        "tokens"
    ]
    greedy = {"model": MODEL_NAME, "max_tokens": 6, "temperature": 0}
    cut = client.completions.create(prompt=ids, echo=True, extra_body={"truncate_prompt_tokens": 5}, **greedy)
    short = client.completions.create(prompt=ids[-5:], **greedy)
    assert cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == detok(ids[-5:]) + short.choices[0].text  # the echo is the prompt kept
    # chat: the rendered prompt's last tokens
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    r = chat(client, max_tokens=6, temperature=0, logprobs=True, extra_body={"truncate_prompt_tokens": 7})
    c = client.completions.create(prompt=rendered[-7:], logprobs=0, **greedy)
    assert r.usage.prompt_tokens == 7
    assert [t.token for t in r.choices[0].logprobs.content] == c.choices[0].logprobs.tokens
    # -1 keeps what the context holds: all of a short prompt
    whole = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": -1}, **greedy)
    assert whole.usage.prompt_tokens == len(ids)
    for bad in (0, -2, max_model_len + 1):
        r = httpx.post(
            f"{server.url}/v1/completions", json={**greedy, "prompt": ids, "truncate_prompt_tokens": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", bad


def test_tools_render_and_content_parts(client, server) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
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
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=tools, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the tool schemas are in the prompt
    counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages, "tools": tools}).json()
    assert counted["count"] == r.usage.prompt_tokens  # /tokenize renders the tools as chat does


@pytest.mark.parametrize(
    ("call", "param"),
    [
        ({"id": 5, "type": "function"}, "messages.1.tool_calls.0.id"),
        ({"id": "call_1", "type": "nonsense"}, "messages.1.tool_calls.0.type"),
        ({"type": "function"}, "messages.1.tool_calls.0.id"),
        ({"id": "call_1"}, "messages.1.tool_calls.0.type"),
        ({}, "messages.1.tool_calls.0.id"),
    ],
)
def test_an_earlier_tool_calls_id_or_type_missing_or_of_another_kind_is_a_400_naming_it(
    server, call: dict, param: str
) -> None:
    """OpenAI's and vLLM's schemas require a string id and type "function"; another, or none, is
    refused, not rendered (the id as a number, a call of some other type as a function's)."""
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}

    def history(tool_call: dict) -> list[dict]:
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**tool_call, "function": function}],
        }
        tool = {"role": "tool", "tool_call_id": "5", "content": "sunny"}
        return [{"role": "user", "content": "Weather in Paris?"}, assistant, tool]

    for path, body in [
        ("/v1/chat/completions", {"model": MODEL_NAME, "max_tokens": 2}),
        ("/tokenize", {}),
    ]:
        r = httpx.post(f"{server.url}{path}", json={**body, "messages": history(call)}, timeout=60)
        assert r.status_code == 400, r.text
        assert set(r.json()) == {"error"}
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert err["param"] == param and param.rsplit(".", 1)[1] in err["message"], err
        # the same history with OpenAI's id and type is served
        r = httpx.post(
            f"{server.url}{path}",
            json={**body, "messages": history({"id": "call_1", "type": "function"})},
            timeout=60,
        )
        assert r.status_code == 200, r.text


def test_cached_tokens_match_the_prefix_cache_counter(client, server, read_metrics) -> None:
    long_messages = [{"role": "user", "content": "Tell me about deltanets. " * 20}]
    cached, texts = [], []
    for _ in range(2):
        before = read_metrics(server.url)["deltaserve_cached_prompt_tokens_total"]
        r = chat(client, messages=long_messages, max_tokens=2, temperature=0)
        after = read_metrics(server.url)["deltaserve_cached_prompt_tokens_total"]
        assert r.usage.prompt_tokens_details.cached_tokens == after - before
        assert r.usage.prompt_tokens_details.cached_tokens <= r.usage.prompt_tokens
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        texts.append(r.choices[0].message.content)
    # the server runs the radix cache by default: the repeat finds most of its prompt cached
    assert cached[1] > r.usage.prompt_tokens // 2
    assert texts[0] == texts[1]
    metrics = read_metrics(server.url)
    assert metrics["deltaserve_prefix_cache_snapshots"] > 0
    assert 0 < metrics["deltaserve_prefix_cache_hit_rate"] <= 1


def test_next_turn_hits_when_the_generation_prompt_ends_past_a_page(client, server) -> None:
    """enable_thinking false: the generation prompt ends in an empty reasoning block that the
    next turn's history does not repeat (Qwen3.5's thinking prompt ends in `<think>\\n` alike).
    With a page boundary inside it, the prompt end's state is kept at the page boundary before
    it, where the next turn leaves the prompt: turn 2 starts there, not from scratch."""
    import uuid

    off = {"chat_template_kwargs": {"enable_thinking": False}}

    def count(messages: list[dict]) -> list[int]:
        return httpx.post(f"{server.url}/tokenize", json={"messages": messages, **off}).json()["tokens"]

    words = f"{uuid.uuid4().hex} Answer in one line."
    while len(count([{"role": "user", "content": words}])) % 16 != 2:
        words += " y"
    messages = [{"role": "user", "content": words}]
    first = chat(client, messages=messages, max_tokens=6, temperature=0, extra_body=off)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    prompt, following = count(messages[:1]), count(messages)
    kept = len(prompt) - 4  # the empty reasoning block's four tokens are not repeated
    assert following[:kept] == prompt[:kept] and following[kept] != prompt[kept]
    second = chat(client, messages=messages, max_tokens=2, temperature=0, extra_body=off)
    assert second.usage.prompt_tokens_details.cached_tokens == kept // 16 * 16 > 0


@pytest.mark.parametrize("shared", ["system", "tools"])
def test_second_conversation_hits_the_shared_system_prompt(client, server, shared) -> None:
    """Two users' first turns behind one system prompt (or one set of tools): the second user's
    prompt starts from the state at the last page boundary of what the two prompts share. A
    state exists only where a prefill chunk ended, and the first prompt's prefill ran past the
    system prompt in one chunk: the second user recomputed it all, and only a third one hit it."""
    import uuid

    head = f"{uuid.uuid4().hex} Follow the house rules, all of them. " + "Rule: be brief. " * 40
    if shared == "system":
        first: list[dict] = [{"role": "system", "content": head}]
        extra: dict = {}
    else:
        first = []
        tool = {"name": "lookup", "description": head, "parameters": {"type": "object", "properties": {}}}
        extra = {"tools": [{"type": "function", "function": tool}]}

    def ask(question: str) -> tuple[list[int], int]:
        messages = [*first, {"role": "user", "content": question}]
        ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages, **extra}).json()["tokens"]
        r = chat(client, messages=messages, max_tokens=2, temperature=0, **extra)
        assert r.usage.prompt_tokens == len(ids)
        return ids, r.usage.prompt_tokens_details.cached_tokens

    a, cached_a = ask("Where is the station?")
    b, cached_b = ask("How old is the moon?")
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    # the first may hit what earlier requests on this server cached before the unique part (the
    # template's tools preamble), not the shared head itself
    assert cached_a < common // 16 * 16 and common > 16
    assert cached_b == common // 16 * 16


def test_reset_prefix_cache_drops_what_no_request_holds(client, server) -> None:
    """vLLM's POST /reset_prefix_cache and SGLang's /flush_cache: the next identical request finds
    nothing cached, and gets the same greedy answer."""
    messages = [{"role": "user", "content": "Resetting caches, again and again. " * 20}]
    first = chat(client, messages=messages, max_tokens=4, temperature=0)
    repeat = chat(client, messages=messages, max_tokens=4, temperature=0)
    assert repeat.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens // 2
    for path in ("/reset_prefix_cache", "/flush_cache"):
        assert httpx.post(f"{server.url}{path}", timeout=30).json() == {"status": "ok"}
        after = chat(client, messages=messages, max_tokens=4, temperature=0)
        assert after.usage.prompt_tokens_details.cached_tokens == 0, path
        assert after.choices[0].message.content == first.choices[0].message.content


@pytest.mark.slow
def test_prefill_counter_counts_what_the_cache_did_not_serve(client, server, read_metrics) -> None:
    import random

    rng = random.Random()
    # 273 tokens: 17 pages and one token, which runs as a decode after the prompt-end chunk
    for length in (273, 100):
        prompt = [rng.randrange(1000, 20000) for _ in range(length)]
        computed = []
        for _ in range(2):
            before = read_metrics(server.url)
            r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0)
            after = read_metrics(server.url)
            computed.append(
                after["deltaserve_prefill_tokens_total"] - before["deltaserve_prefill_tokens_total"]
            )
            assert computed[-1] == length - r.usage.prompt_tokens_details.cached_tokens
        assert computed[0] == length and 0 < computed[1] < length  # the repeat hit the cache


def test_async_client(async_client) -> None:
    async def run() -> tuple[str, str]:
        whole = await async_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0
        )
        stream = await async_client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        await async_client.close()
        return whole.choices[0].message.content, text

    whole, streamed = asyncio.run(run())
    assert whole == streamed


def test_metrics_exposition(client, server, read_metrics) -> None:
    chat(client, max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "deltaserve_requests_total",
        "deltaserve_prompt_tokens_total",
        "deltaserve_generation_tokens_total",
        "deltaserve_num_requests_running",
        "deltaserve_num_requests_waiting",
        "deltaserve_kv_pages_used",
        "deltaserve_state_slots_used",
        "deltaserve_time_to_first_token_seconds_bucket",
        "deltaserve_inter_token_latency_seconds_bucket",
    ):
        assert f"\n{name}{{" in text, name
    m = read_metrics(server.url)
    assert m["deltaserve_time_to_first_token_seconds_count"] >= 1
    assert (
        m['deltaserve_time_to_first_token_seconds_bucket{le="+Inf"}']
        == m["deltaserve_time_to_first_token_seconds_count"]
    )
    assert m["deltaserve_kv_pages_total"] > 0 and m["deltaserve_state_slots_total"] > 0
    # the radix cache keeps the prompt's end: a snapshot slot held, until the cache is flushed
    assert m["deltaserve_state_snapshots_total"] > 0 and m["deltaserve_state_snapshots_used"] >= 1
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    assert read_metrics(server.url)["deltaserve_state_snapshots_used"] == 0


@pytest.mark.slow
def test_metrics_say_where_the_engine_loops_time_goes(client, server, read_metrics) -> None:
    # the wall clock spans both reads, so it holds the engine's time between its two snapshots
    # even when a response is slow to come back
    t0 = time.monotonic()
    before = read_metrics(server.url)
    chat(client, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    time.sleep(0.5)  # a duration, not an event: the idle time the engine must count
    after = read_metrics(server.url)
    wall = time.monotonic() - t0

    def delta(name: str) -> float:
        return (
            after[f"deltaserve_engine_{name}_seconds_total"]
            - before[f"deltaserve_engine_{name}_seconds_total"]
        )

    assert delta("step") > 0 and delta("idle") > 0.3
    assert delta("step") + delta("idle") <= wall
    assert after["deltaserve_engine_gpu_wait_seconds_total"] == 0  # CPU: no overlapped steps to wait for


@pytest.mark.slow
def test_non_streamed_request_times_its_first_token(client, server, read_metrics) -> None:
    """A non-streamed request gets one output from the engine, at its end; its time to first
    token still comes from when the first token was made, not from when the response was ready."""
    before = read_metrics(server.url)
    chat(client, max_tokens=60, temperature=0, extra_body={"ignore_eos": True})
    after = read_metrics(server.url)

    def delta(name: str) -> float:
        return after[f"deltaserve_{name}"] - before[f"deltaserve_{name}"]

    assert delta("time_to_first_token_seconds_count") == 1
    assert delta("inter_token_latency_seconds_count") == 59
    assert 0 < delta("time_to_first_token_seconds_sum") < delta("e2e_request_latency_seconds_sum")


def test_logit_bias_over_http(client, server) -> None:
    """The official client's logit_bias: +100 on one token makes every sampled token that one."""
    token = httpx.post(f"{server.url}/tokenize", json={"prompt": " hello"}).json()["tokens"][0]
    r = chat(
        client, max_tokens=4, temperature=1.0, logit_bias={str(token): 100}, extra_body={"ignore_eos": True}
    )
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": r.choices[0].message.content}).json()["tokens"]
    assert r.usage.completion_tokens == 4 and set(ids) == {token}


def test_empty_stream_options_on_an_unstreamed_request_is_served_as_in_vllm(client) -> None:
    """vLLM refuses stream_options without stream only where the object holds something."""
    r = chat(client, max_tokens=2, stream_options={}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
    done = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2, stream=False, stream_options={}
    )
    assert done.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, max_tokens=2, stream_options={"include_usage": False})
    assert refused.value.body["param"] == "stream_options"


def test_logit_bias_beyond_100_is_clamped_as_vllm_does(client, server) -> None:
    """A bias past [-100, 100] acts as -100 or +100 (vLLM's server clamps it), not a 400."""
    token = httpx.post(f"{server.url}/tokenize", json={"prompt": " hello"}).json()["tokens"][0]
    extra = {"ignore_eos": True, "return_token_ids": True}
    forced = chat(client, max_tokens=4, temperature=1.0, logit_bias={str(token): 250}, extra_body=extra)
    assert forced.choices[0].token_ids == [token] * 4
    first = chat(client, max_tokens=4, temperature=0, extra_body=extra).choices[0].token_ids[0]
    banned = chat(client, max_tokens=4, temperature=0, logit_bias={str(first): -1e6}, extra_body=extra)
    at_edge = chat(client, max_tokens=4, temperature=0, logit_bias={str(first): -100}, extra_body=extra)
    assert first not in banned.choices[0].token_ids
    assert banned.choices[0].token_ids == at_edge.choices[0].token_ids


def test_allowed_token_ids_over_http(client, server) -> None:
    """vLLM's allowed_token_ids: sampled tokens come from the set alone, and greedy ones are those a
    +100 bias on the set gives; an id outside the vocabulary is a 400 naming the field."""
    allowed = httpx.post(f"{server.url}/tokenize", json={"prompt": " red green blue"}).json()["tokens"]
    extra = {"ignore_eos": True, "allowed_token_ids": allowed}
    r = chat(client, max_tokens=8, temperature=1.0, seed=5, extra_body=extra)
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": r.choices[0].message.content}).json()["tokens"]
    assert r.usage.completion_tokens == 8 and set(ids) <= set(allowed)
    masked = chat(client, max_tokens=8, temperature=0, extra_body=extra)
    biased = chat(
        client, max_tokens=8, temperature=0, logit_bias=dict.fromkeys(map(str, allowed), 100),
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert masked.choices[0].message.content == biased.choices[0].message.content
    bad = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "allowed_token_ids": [10**9]},
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids"


def test_masks_that_forbid_every_token_are_a_400(client, server, until_idle) -> None:
    """allowed_token_ids whose one token is a stop token that min_tokens holds off leave nothing
    to sample: a 400 that says so (an error event once a stream has begun), nothing held after
    it, and the server serves on."""
    import openai

    token = httpx.post(f"{server.url}/tokenize", json={"prompt": " hello"}).json()["tokens"][0]
    masks = {"allowed_token_ids": [token], "stop_token_ids": [token], "min_tokens": 2}
    body = {"model": MODEL_NAME, "prompt": [5, 9, 17], "max_tokens": 4, **masks}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(**{k: body[k] for k in ("model", "prompt", "max_tokens")}, extra_body=masks)
    message = refused.value.body["message"]
    assert "allowed_token_ids" in message and "min_tokens" in message and "output token 1" in message
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error" and error["message"] == message
    idle = until_idle(server.url)
    assert idle["deltaserve_state_slots_used"] == 0 and idle["deltaserve_kv_pages_used"] == 0
    assert chat(client, max_tokens=3, extra_body={"ignore_eos": True}).usage.completion_tokens == 3


def test_bad_words_over_http(client, server) -> None:
    """vLLM's bad_words: a word the model writes when free is never written with it."""
    greedy = {"model": MODEL_NAME, "prompt": [5, 9, 17, 3, 88], "max_tokens": 8, "temperature": 0}
    free = client.completions.create(**greedy, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in free.choices[0].logprobs.tokens]

    def tokenize(text: str) -> list[int]:
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]

    def one_token_word(token: int) -> str | None:  # its text, where that alone tokenizes back to it
        word = httpx.post(f"{server.url}/detokenize", json={"tokens": [token]}).json()["prompt"]
        return word if word.strip() == word != "" and tokenize(word) == [token] else None

    j, word = next((j, w) for j in range(1, len(ids)) if (w := one_token_word(ids[j])) is not None)
    banned = client.completions.create(
        **greedy, logprobs=0, extra_body={"bad_words": [word], "return_tokens_as_token_ids": True}
    )
    out = [int(t.removeprefix("token_id:")) for t in banned.choices[0].logprobs.tokens]
    assert out[:j] == ids[:j] and ids[j] not in out
    blank = httpx.post(f"{server.url}/v1/completions", json={**greedy, "bad_words": [" "]})
    assert blank.status_code == 400 and blank.json()["error"]["param"] == "bad_words"


def test_return_tokens_as_token_ids(client, server) -> None:
    """vLLM's return_tokens_as_token_ids: logprobs name each token `token_id:N`, N the id whose text
    the same request without it names, prompt tokens and alternatives too."""
    ids = {"return_tokens_as_token_ids": True}
    named = chat(client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    as_ids = chat(client, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, extra_body=ids)
    token_ids = []
    for a, b in zip(named.choices[0].logprobs.content, as_ids.choices[0].logprobs.content, strict=True):
        assert b.token.startswith("token_id:") and b.bytes == list(b.token.encode())
        assert all(t.token.startswith("token_id:") for t in b.top_logprobs) and b.logprob == a.logprob
        token_ids.append(int(b.token.removeprefix("token_id:")))
    texts = [httpx.post(f"{server.url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in token_ids]
    assert "".join(texts) == named.choices[0].message.content == as_ids.choices[0].message.content
    prompt = [5, 9, 17]
    c = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True, extra_body=ids
    )
    assert c.choices[0].logprobs.tokens[:3] == [f"token_id:{t}" for t in prompt]
    assert all(k.startswith("token_id:") for top in c.choices[0].logprobs.top_logprobs[1:] for k in top)


def test_continuous_usage_stats(client) -> None:
    """vLLM's stream option: every chunk carries the usage so far of its own choice (vLLM's
    previous_num_tokens[i], not the request's), growing to that choice's tokens; the last chunk
    the whole request's."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"ignore_eos": True}
    chat_chunks = list(chat(client, max_tokens=6, n=2, stream=True, stream_options=options, extra_body=extra))
    text_chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt="Hello",
            max_tokens=6,
            stream=True,
            stream_options=options,
            extra_body=extra,
        )
    )
    for chunks, n in ((chat_chunks, 2), (text_chunks, 1)):
        assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 0 for c in chunks)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6 * n
        per_choice: dict[int, list[int]] = {}
        for chunk in chunks[:-1]:
            for choice in chunk.choices:
                per_choice.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
        assert sorted(per_choice) == list(range(n))
        for counts in per_choice.values():
            assert counts == sorted(counts) and counts[-1] == 6 and any(0 < k < 6 for k in counts)
    # without include_usage, no usage at all (vLLM's rule)
    alone = {"continuous_usage_stats": True}
    quiet = list(chat(client, max_tokens=4, stream=True, stream_options=alone, extra_body=extra))
    assert quiet and all(c.usage is None for c in quiet)


def test_continuous_usage_counts_the_tokens_whose_text_a_stop_string_holds_back(client, server) -> None:
    """vLLM's completions stream sends a chunk for each step's tokens, their text held back or not:
    with continuous usage stats, the chunk of a token whose text may begin a stop string still
    carries the count that token adds."""
    greedy = {"model": MODEL_NAME, "prompt": "hello there", "max_tokens": 3, "temperature": 0}
    whole = client.completions.create(**greedy, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = whole.choices[0].model_extra["token_ids"]
    two = httpx.post(f"{server.url}/detokenize", json={"tokens": ids[:2]}, timeout=30).json()["prompt"]
    assert two
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            **greedy,
            stop=[two + "\u2603 never"],  # the first two tokens' text could begin it: held back
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [1, 2, 3]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_chat_continuous_usage_counts_the_tokens_whose_text_is_held_back(client, server) -> None:
    """As the completions stream (and vLLM's chat stream without a parser): a chat step whose text a
    stop string holds back still sends its chunk, an empty delta, with the usage its token adds, so
    that each chunk's count grows by its step's tokens and the last is the final usage's."""
    greedy = {"max_tokens": 3, "temperature": 0}
    whole = chat(client, **greedy, extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = whole.choices[0].model_extra["token_ids"]
    two = httpx.post(f"{server.url}/detokenize", json={"tokens": ids[:2]}, timeout=30).json()["prompt"]
    assert two
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        chat(
            client,
            **greedy,
            stop=[two + "\u2603 never"],  # the first two tokens' text could begin it: held back
            stream=True,
            stream_options=options,
            extra_body={"ignore_eos": True},
        )
    )
    assert [c.usage.completion_tokens for c in chunks if c.choices] == [0, 1, 2, 3]  # the role's chunk first
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[1].content is None and deltas[1].model_dump(exclude_none=True) == {}  # an empty delta
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    # a forced call's markup and arguments, which the tool-call parser holds back, count as they come too
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    forced = list(
        chat(client, max_tokens=4, tools=[tool], tool_choice="required", stream=True, stream_options=options)
    )
    assert [c.usage.completion_tokens for c in forced if c.choices] == [0, 1, 2, 3, 4]
    assert forced[-1].usage.completion_tokens == 4


def test_n_copies_find_their_prompt_cached(client, server, read_metrics) -> None:
    """n > 1: the prompt is prefilled once before the copies run, so every copy starts from the
    cache (all but the last partial page) and answers as a single request does; the warm-up is
    not counted as a client's request."""
    import uuid

    messages = [{"role": "user", "content": f"{uuid.uuid4().hex} tell me about hybrid models. " * 12}]
    greedy = dict(messages=messages, max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    before = read_metrics(server.url)
    # greedy copies: top_k 1 at a positive temperature (n > 1 at temperature 0 is a 400)
    r = chat(client, n=3, **{**greedy, "temperature": 1.0, "extra_body": {"ignore_eos": True, "top_k": 1}})
    after = read_metrics(server.url)
    prompt = r.usage.prompt_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= prompt - 16 > 0
    cached = after["deltaserve_cached_prompt_tokens_total"] - before["deltaserve_cached_prompt_tokens_total"]
    assert cached >= 3 * (prompt - 16)

    def finished(m: dict) -> float:
        return sum(v for k, v in m.items() if k.startswith("deltaserve_requests_total"))

    assert finished(after) - finished(before) == 3
    texts = {c.message.content for c in r.choices}
    assert len(texts) == 1 and r.usage.completion_tokens == 15
    assert chat(client, **greedy).choices[0].message.content in texts


@pytest.mark.slow
def test_structured_outputs_over_http(client) -> None:
    """response_format json_schema / json_object through the official client: the built-in
    model's random weights give noise unconstrained, and JSON that satisfies the schema here."""
    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "score": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["answer", "score"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema, "strict": True}}
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Judge."}],
        max_tokens=40,
        n=2,
        seed=1,
        temperature=1.0,
        response_format=fmt,
    )
    for choice in r.choices:
        value = json.loads(choice.message.content)
        assert (
            value["answer"] in ("yes", "no")
            and 1 <= value["score"] <= 5
            and set(value) == {"answer", "score"}
        )
        assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Judge."}],
        max_tokens=40,
        temperature=0.0,
        response_format=fmt,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert set(json.loads(text)) == {"answer", "score"}
    obj = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=60,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    content = obj.choices[0].message.content
    assert content.startswith("{")
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_vllm_style_constraints_over_http(client, base_url) -> None:
    """vLLM's `structured_outputs` and older `guided_*` fields through the official client
    (extra_body), on chat and completions; conflicting or bad ones are 400s."""
    import re

    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Yes or no?"}],
        max_tokens=10,
        n=3,
        seed=1,
        temperature=1.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert {c.message.content for c in r.choices} <= {"yes", "no"}
    c = client.completions.create(
        model=MODEL_NAME,
        prompt="Code:",
        max_tokens=12,
        temperature=1.0,
        seed=2,
        extra_body={"guided_regex": r"[A-Z]{2}[0-9]{2}"},
    )
    assert re.fullmatch(r"[A-Z]{2}[0-9]{2}", c.choices[0].text)
    for body, param in (
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs"),
        # a grammar that does not compile names the field it came from
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ):
        err = httpx.post(
            f"{base_url}/chat/completions",
            json={
                "model": MODEL_NAME,
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                **body,
            },
            timeout=30,
        )
        assert err.status_code == 400, err.text
        assert err.json()["error"]["param"] == param


THINKING_TEMPLATE = (  # Qwen3.5's shape: the generation prompt opens <think>, XML tool calls
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Call as <tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


@pytest.mark.slow
def test_structured_output_follows_the_reasoning(spawn_server, tmp_path) -> None:
    """When the prompt opens <think>, the grammar starts after the model's </think>: the answer
    (content) is the JSON and the reasoning stays the model's own. (The random model is pushed to
    close its reasoning by a bias on </think>; a grammar from the first token would forbid that
    token, and the whole reply would be reasoning with no content.)"""
    import openai

    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    server = spawn_server("--max-model-len", "512", "--chat-template", str(template))
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    end = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "</think>", "add_special_tokens": False}
    ).json()["tokens"]
    assert len(end) == 1
    kw = dict(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Think, then answer in JSON."}],
        max_tokens=120,
        temperature=1.0,
        seed=2,
        n=4,
        logit_bias={str(end[0]): 9},
        response_format={"type": "json_object"},
    )
    r = client.chat.completions.create(**kw)
    finished = [c for c in r.choices if c.finish_reason == "stop"]
    assert finished
    for c in finished:
        assert isinstance(json.loads(c.message.content), dict)
        assert not (c.message.reasoning_content or "").lstrip().startswith("{")
    stream = client.chat.completions.create(**{**kw, "n": 1, "stream": True})
    parts = [c.choices[0].delta for c in stream if c.choices]
    content = "".join(d.content or "" for d in parts)
    if content:
        assert content.lstrip().startswith("{")
    # a forced tool call likewise comes after the reasoning, in the template's XML form
    forced = {k: v for k, v in kw.items() if k != "response_format"}
    r = client.chat.completions.create(**forced, tools=TOOLS, tool_choice="required")
    calls = [c for c in r.choices if c.finish_reason == "tool_calls"]
    assert calls
    for c in calls:
        (call,) = c.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time") and isinstance(args, dict)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.slow
def test_tool_choice_forces_a_call(client) -> None:
    """tool_choice names a function (one call), or "required" (one or more, unless
    parallel_tool_calls is false): the built-in model's random weights answer with calls whose
    arguments satisfy the functions' parameters (unforced: noise)."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=60, n=2, seed=4
    )
    for choice in r.choices:
        assert choice.finish_reason == "stop"  # a named function's, as OpenAI's and vLLM's
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in "CF"
    # "required": one call or several (up to sampling.FORCED_CALLS), each of a given function
    names, counts = set(), []
    for seed in range(8):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            seed=seed,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and len(calls) <= 4
        for call in calls:
            names.add(call.function.name)
            assert isinstance(json.loads(call.function.arguments), dict)
        if r.choices[0].finish_reason == "tool_calls":
            counts.append(len(calls))
    assert names <= {"get_weather", "get_time"} and counts and max(counts) >= 2
    # without parallel calls, exactly one
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=120,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    free = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=TOOLS, max_tokens=30, seed=4
    )
    assert not free.choices[0].message.tool_calls


@pytest.mark.slow
def test_auto_tool_choice_holds_a_strict_tools_arguments_to_its_schema(client, server) -> None:
    """OpenAI's `strict`: under tool_choice "auto" the model may answer in text, and a call it opens
    (pushed here by a bias on `<tool_call>`) has arguments that satisfy the strict tool's schema.
    Chat and the Responses API alike."""
    (opener,) = httpx.post(f"{server.url}/tokenize", json={"prompt": "<tool_call>"}, timeout=30).json()[
        "tokens"
    ]
    tools = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    weather = tools[0]["function"]

    def prompt(tools: list) -> list[int]:
        body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
        return httpx.post(f"{server.url}/tokenize", json=body, timeout=30).json()["tokens"]

    assert prompt(tools) == prompt(TOOLS)  # strict is the server's to hold, not the template's to show
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    names = set()
    for seed in range(6):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=tools,
            parallel_tool_calls=False,
            max_tokens=120,
            seed=seed,
            logit_bias={str(opener): 100},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        (call,) = choice.message.tool_calls
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
        names.add(call.function.name)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 10
        else:
            assert args in ({"zone": "UTC"}, {"zone": "CET"})
    assert "get_weather" in names
    # a response_format holds the text instead, and its refusal names it, not the tools
    unenforced = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}},
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL_NAME, messages=messages, tools=tools, max_tokens=5, response_format=unenforced
        )
    assert info.value.body["param"] == "response_format"
    # without the bias the model answers in text, which the grammar leaves alone
    free = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, tools=tools, max_tokens=20, seed=4
    )
    assert free.choices[0].message.content and not free.choices[0].message.tool_calls
    response = client.responses.create(
        model=MODEL_NAME,
        input="Weather in Paris?",
        tools=[
            {"type": "function", "name": "get_weather", "parameters": weather["parameters"], "strict": True}
        ],
        parallel_tool_calls=False,
        max_output_tokens=120,
        extra_body={"seed": 1, "logit_bias": {str(opener): 100}},
    )
    (item,) = [i for i in response.output if i.type == "function_call"]
    args = json.loads(item.arguments)
    assert item.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
    anthropic_tool = {"name": "get_weather", "input_schema": weather["parameters"], "strict": True}
    body = {
        "model": MODEL_NAME,
        "max_tokens": 120,
        "messages": messages,
        "tools": [anthropic_tool],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "seed": 1,
        "logit_bias": {str(opener): 100},
    }
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    (block,) = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert set(block["input"]) == {"city", "unit"} and block["input"]["unit"] in ("C", "F")
    r = httpx.post(f"{server.url}/v1/messages", json={**body, "tools": [{**anthropic_tool, "strict": "yes"}]})
    assert r.status_code == 400 and "tools[0].strict" in r.json()["error"]["message"]


VERDICT = {
    "type": "json_schema",
    "json_schema": {
        "name": "verdict",
        "schema": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}


@pytest.mark.slow
def test_forced_call_with_a_response_format_answers_the_call(client) -> None:
    """openai-agents' `output_type` with `tool_choice="required"` sends both: the forced call's
    grammar governs this turn, the JSON format is for the text of a later turn."""
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            response_format=VERDICT,
            max_tokens=120,
            seed=1,
        )
        # a named call ends with "stop", as OpenAI's and vLLM's do; "required" with "tool_calls"
        finish = "tool_calls" if choice == "required" else "stop"
        assert r.choices[0].finish_reason == finish and r.choices[0].message.content is None
        (call,) = r.choices[0].message.tool_calls
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time") and "ok" not in args


@pytest.mark.slow
def test_stream_interval_sends_the_first_token_then_groups(spawn_server, server) -> None:
    """--stream-interval 4: a stream's first chunk carries one token, later ones four (the last
    what is left), with every token's log-probability; the text is the unstreamed request's, and
    a chat stream joins to the same message as without the flag."""
    grouped = spawn_server("--max-model-len", "256", "--stream-interval", "4")
    body = {"model": MODEL_NAME, "prompt": [5, 9, 17], "max_tokens": 11, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 0}, timeout=60).json()
    with httpx.stream(
        "POST", f"{grouped.url}/v1/completions", json={**body, "logprobs": 0, "stream": True}, timeout=60
    ) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    sizes = [len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"] and c["logprobs"]["tokens"]]
    assert sizes == [1, 4, 4, 2]
    # a request's own stream_interval (vLLM's) below the server's is raised to it
    smaller = {**body, "logprobs": 0, "stream": True, "stream_interval": 2}
    with httpx.stream("POST", f"{grouped.url}/v1/completions", json=smaller, timeout=60) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    raised = [json.loads(e)["choices"][0]["logprobs"]["tokens"] for e in lines[:-1]]
    assert [len(t) for t in raised if t] == [1, 4, 4, 2]
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    import openai

    with openai.OpenAI(base_url=f"{grouped.url}/v1", api_key="unused", max_retries=0) as c:
        stream = c.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=9, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    plain = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": MODEL_NAME,
            "messages": MESSAGES,
            "max_tokens": 9,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=60,
    ).json()
    assert streamed == plain["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_priority_needs_the_priority_policy(client, spawn_server, server) -> None:
    """vLLM's `priority`: under the default fcfs policy anything but 0 is a 400 naming it; a server
    started with --scheduling-policy priority serves it, on chat, completions and responses."""
    import openai

    with pytest.raises(openai.BadRequestError) as refused:
        chat(client, max_tokens=2, extra_body={"priority": 1})
    assert (
        refused.value.body["param"] == "priority"
        and "--scheduling-policy priority" in refused.value.body["message"]
    )
    assert (
        chat(client, max_tokens=2, extra_body={"priority": 0, "ignore_eos": True}).usage.completion_tokens
        == 2
    )
    ranked = spawn_server("--max-model-len", "256", "--scheduling-policy", "priority")
    with openai.OpenAI(base_url=f"{ranked.url}/v1", api_key="unused", max_retries=0) as c:
        r = c.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=3, extra_body={"priority": -7, "ignore_eos": True}
        )
        assert r.usage.completion_tokens == 3
        done = c.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, extra_body={"priority": 4})
        assert done.choices[0].finish_reason in ("length", "stop")
        resp = c.responses.create(
            model=MODEL_NAME, input="Hi", max_output_tokens=2, extra_body={"priority": 2}
        )
        assert resp.status in ("completed", "incomplete")


def test_the_client_may_name_its_request(server) -> None:
    """vLLM's X-Request-Id: the reply's id is the endpoint's prefix and the header's value (or the
    body's request_id), on every streamed chunk too, and the header comes back; two requests of
    one name run side by side."""
    import concurrent.futures

    body = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2}
    r = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "trace-7"}, timeout=60
    )
    assert r.json()["id"] == "chatcmpl-trace-7" and r.headers["x-request-id"] == "trace-7"
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={**body, "stream": True},
        headers={"X-Request-Id": "s-1"},
    ) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert {c["id"] for c in chunks} == {"chatcmpl-s-1"}
    named = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "request_id": "job-3"},
        timeout=60,
    )
    assert named.json()["id"] == "cmpl-job-3" and "x-request-id" not in named.headers

    def same_name(_: int) -> int:
        return httpx.post(
            f"{server.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "twin"}, timeout=60
        ).status_code

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(same_name, range(2))) == [200, 200]
