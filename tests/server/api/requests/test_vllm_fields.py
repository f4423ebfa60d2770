"""vLLM's request fields through the official client (`extra_body`): each one deltaserve takes does
what vLLM's does, and one it cannot honour is a 400 naming it rather than ignored."""

from __future__ import annotations

import json

import httpx
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


@pytest.mark.parametrize(
    "endpoint,extra",
    [
        ("chat", {"repetition_detection": {"max_pattern_size": 4, "min_count": 3}}),
        ("chat", {"watermarking": True}),
        ("completions", {"logits_processors": ["my_module.MyProcessor"]}),
        ("chat", {"mm_processor_kwargs": {"max_pixels": 1024}}),
        ("chat", {"media_io_kwargs": {"image": {"mode": "L"}}}),
        ("chat", {"best_of": 3}),
        ("completions", {"prompt_embeds": "AAAA"}),
    ],
)
def test_vllm_fields_that_would_change_the_output_are_400_naming_them(
    client, model_name, endpoint: str, extra: dict
) -> None:
    (field,) = [k for k in extra if k != "logprobs"]
    if endpoint == "chat":
        err = refusal(
            lambda: client.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=3, extra_body=extra
            )
        )
    else:
        err = refusal(
            lambda: client.completions.create(model=model_name, prompt="hi", max_tokens=3, extra_body=extra)
        )
    assert err["param"] == field and err["message"].startswith(f"{field}: not supported"), err


def test_values_of_those_fields_that_change_nothing_are_served(client, model_name) -> None:
    chat = client.chat.completions.create(
        model=model_name,
        messages=MESSAGES,
        max_tokens=3,
        n=2,
        extra_body={
            "thinking_token_budget": -1,  # vLLM's: unlimited
            "repetition_detection": None,
            "watermarking": False,
            "logits_processors": [],
            "mm_processor_kwargs": {},
            "best_of": 2,
        },
    )
    assert len(chat.choices) == 2


@pytest.mark.parametrize(
    "endpoint,extra,param",
    [
        ("chat/completions", {"add_special_tokens": "x"}, "add_special_tokens"),
        ("completions", {"add_special_tokens": "x"}, "add_special_tokens"),
        ("chat/completions", {"documents": [{"title": "t", "text": 5}]}, "documents.0.text"),
        ("chat/completions", {"documents": ["a document"]}, "documents.0"),
        ("chat/completions", {"spaces_between_special_tokens": "x"}, "spaces_between_special_tokens"),
        ("completions", {"spaces_between_special_tokens": 2}, "spaces_between_special_tokens"),
    ],
)
def test_vllm_fields_of_another_type_are_400_naming_them(
    base_url: str, model_name: str, endpoint: str, extra: dict, param: str
) -> None:
    """vLLM's typed fields refuse these values (pydantic); here too, rather than ignoring them."""
    prompt = {"messages": MESSAGES} if endpoint.startswith("chat") else {"prompt": "hi"}
    body = {"model": model_name, **prompt, "max_tokens": 2, **extra}
    r = httpx.post(f"{base_url}/{endpoint}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert set(r.json()) == {"error"}
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param and param in err["message"], err


def test_good_values_of_those_fields_are_served(base_url: str, model_name: str) -> None:
    def prompt_tokens(endpoint: str, body: dict) -> int:
        r = httpx.post(
            f"{base_url}/{endpoint}", json={"model": model_name, "max_tokens": 2, **body}, timeout=60
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    chat = {"messages": MESSAGES, "documents": [{"title": "t", "text": "x"}]}
    # Qwen's tokenizer adds no special tokens to a text: the same prompt either way
    assert prompt_tokens("chat/completions", {**chat, "add_special_tokens": True}) == prompt_tokens(
        "chat/completions", {**chat, "spaces_between_special_tokens": False}
    )
    assert prompt_tokens("completions", {"prompt": "hi", "add_special_tokens": False}) == prompt_tokens(
        "completions", {"prompt": "hi"}
    )


@pytest.mark.parametrize("side,kept", [(None, [400, 500]), ("left", [400, 500]), ("right", [100, 200])])
def test_truncation_side_picks_the_end_of_the_prompt_kept(
    client, server, model_name, side: str | None, kept: list[int]
) -> None:
    r = client.completions.create(
        model=model_name,
        prompt=[100, 200, 300, 400, 500],
        max_tokens=1,
        echo=True,
        extra_body={"truncate_prompt_tokens": 2, "truncation_side": side},
    )
    expected = httpx.post(f"{server.url}/detokenize", json={"tokens": kept}, timeout=30).json()["prompt"]
    assert r.usage.prompt_tokens == 2 and r.choices[0].text.startswith(expected)
    err = refusal(
        lambda: client.completions.create(
            model=model_name, prompt="hi", max_tokens=1, extra_body={"truncation_side": "middle"}
        )
    )
    assert err["param"] == "truncation_side"


def test_return_token_ids_gives_the_prompts_and_each_choices_tokens(client, server, model_name) -> None:
    asked = {"return_token_ids": True}
    chat = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=4, temperature=0, extra_body=asked
    )
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    assert chat.model_extra["prompt_token_ids"] == prompt
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == chat.usage.completion_tokens == 4
    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=4, temperature=0, stream=True, extra_body=asked
    )
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    assert [
        t for c in chunks for choice in c.choices for t in choice.model_extra.get("token_ids") or []
    ] == ids

    text_prompt = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello there"}, timeout=30).json()
    text = client.completions.create(
        model=model_name, prompt="hello there", max_tokens=3, n=2, extra_body={**asked, "ignore_eos": True}
    )
    for choice in text.choices:
        assert choice.model_extra["prompt_token_ids"] == text_prompt["tokens"]
        ids = choice.model_extra["token_ids"]
        assert len(ids) == 3
        decoded = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
        assert decoded == choice.text
    streamed = list(
        client.completions.create(
            model=model_name,
            prompt="hello there",
            max_tokens=3,
            stream=True,
            extra_body={**asked, "ignore_eos": True},
        )
    )
    assert streamed[0].choices[0].model_extra["prompt_token_ids"] == text_prompt["tokens"]
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in streamed if c.choices) == 3

    # not asked: neither field, as before
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert "prompt_token_ids" not in plain.model_extra and "token_ids" not in plain.choices[0].model_extra
    err = refusal(
        lambda: client.completions.create(
            model=model_name, prompt="hi", max_tokens=2, extra_body={**asked, "use_beam_search": True}
        )
    )
    assert err["param"] == "return_token_ids"


def test_streamed_token_ids_include_those_whose_text_a_stop_string_holds_back(
    client, server, model_name
) -> None:
    greedy = {"return_token_ids": True, "ignore_eos": True}
    whole = client.completions.create(
        model=model_name, prompt="hello there", max_tokens=3, temperature=0, extra_body=greedy
    )
    ids = whole.choices[0].model_extra["token_ids"]
    two = httpx.post(f"{server.url}/detokenize", json={"tokens": ids[:2]}, timeout=30).json()["prompt"]
    assert two
    # after the second token the text so far could begin the stop string, so it is held back
    streamed = client.completions.create(
        model=model_name,
        prompt="hello there",
        max_tokens=3,
        temperature=0,
        stop=[two + "\u2603 never"],
        stream=True,
        extra_body=greedy,
    )
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert [t for c in chunks for t in c.model_extra.get("token_ids") or []] == ids
    assert "".join(c.text for c in chunks) == whole.choices[0].text


def test_a_null_max_tokens_on_completions_is_openais_default_16(client, model_name) -> None:
    r = client.completions.create(
        model=model_name, prompt="hi", extra_body={"max_tokens": None, "ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16


def test_reasoning_effort_none_turns_the_templates_thinking_off(client, model_name) -> None:
    def prompt_tokens(**extra: object) -> int:
        r = client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=1, extra_body=extra
        )
        return r.usage.prompt_tokens

    thinking, not_thinking = prompt_tokens(), prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert thinking != not_thinking  # Qwen3's template closes an empty <think> block when off
    assert prompt_tokens(reasoning_effort="none") == not_thinking
    assert prompt_tokens(reasoning_effort="low") == thinking
    # the request's own template switch wins, as in vLLM
    assert prompt_tokens(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}) == thinking
    err = refusal(
        lambda: client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=1, extra_body={"reasoning_effort": "extreme"}
        )
    )
    assert err["param"] == "reasoning_effort"


def test_chat_echo_starts_the_reply_with_the_continued_message(client, model_name) -> None:
    started = [*MESSAGES, {"role": "assistant", "content": "Once upon a time"}]
    opts = {"add_generation_prompt": False, "continue_final_message": True}

    def reply(messages: list, stream: bool = False, **extra: object) -> str:
        r = client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=4,
            temperature=0,
            stream=stream,
            extra_body=extra,
        )
        if stream:
            return "".join(c.choices[0].delta.content or "" for c in r if c.choices)
        return r.choices[0].message.content or ""

    continued = reply(started, **opts)
    assert reply(started, echo=True, **opts) == "Once upon a time" + continued
    assert reply(started, stream=True, echo=True, **opts) == "Once upon a time" + continued
    # a reply to the user's message: nothing of another role's is echoed, as in vLLM
    assert reply(MESSAGES, echo=True) == reply(MESSAGES)
    # vLLM's stream opens with each choice's role chunk (empty content), then each one's echo chunk
    stream = client.chat.completions.create(
        model=model_name,
        messages=started,
        max_tokens=2,
        n=2,
        seed=1,
        stream=True,
        extra_body={"echo": True, **opts},
    )
    opening = [(c.choices[0].index, c.choices[0].delta.role, c.choices[0].delta.content) for c in stream][:4]
    assert opening == [
        (0, "assistant", ""),
        (1, "assistant", ""),
        (0, None, started[-1]["content"]),
        (1, None, started[-1]["content"]),
    ]


def test_chat_echo_scores_the_prompt_as_vllm_does(client, model_name) -> None:
    """vLLM's chat echo: the reply carries prompt_logprobs, the rendered prompt's tokens scored with
    top_logprobs candidates each (0 without logprobs); an explicit prompt_logprobs wins."""

    def ask(**extra: object):
        return client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=2, temperature=0, **extra
        )

    plain = ask(extra_body={"echo": True})
    scored = plain.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == plain.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in scored[1:])  # the prompt's own token alone
    top = ask(logprobs=True, top_logprobs=3, extra_body={"echo": True}).model_extra["prompt_logprobs"]
    assert len(top) == len(scored) and all(2 <= len(entry) <= 4 for entry in top[1:])
    assert all(sum(e["rank"] <= 3 for e in entry.values()) == 3 for entry in top[1:])
    wins = ask(extra_body={"echo": True, "prompt_logprobs": 1}).model_extra["prompt_logprobs"]
    assert all(1 <= len(entry) <= 2 for entry in wins[1:])
    assert "prompt_logprobs" not in ask().model_extra  # no echo, not asked: OpenAI's shape
    streamed = ask(stream=True, extra_body={"echo": True})  # nowhere to put them in a stream, as in vLLM
    assert all("prompt_logprobs" not in chunk.model_extra for chunk in streamed)


def test_prompt_logprobs_0_is_streamed_as_vllm_accepts_it(client, model_name) -> None:
    """vLLM refuses prompt_logprobs on a stream only above 0 (or -1): 0 streams the same text as
    without it, and no chunk carries them."""
    chat = {"model": model_name, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "stream": True}
    plain = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**chat))
    zero = list(client.chat.completions.create(**chat, extra_body={"prompt_logprobs": 0}))
    assert "".join(c.choices[0].delta.content or "" for c in zero if c.choices) == plain
    assert all("prompt_logprobs" not in c.model_extra for c in zero)
    body = {"model": model_name, "prompt": "hello", "max_tokens": 4, "temperature": 0, "stream": True}
    plain = "".join(c.choices[0].text for c in client.completions.create(**body))
    zero = list(client.completions.create(**body, extra_body={"prompt_logprobs": 0}))
    assert "".join(c.choices[0].text for c in zero) == plain
    err = refusal(lambda: client.completions.create(**body, extra_body={"prompt_logprobs": 1}))
    assert err["param"] == "prompt_logprobs" and "stream" in err["message"]


def test_include_reasoning_false_leaves_out_logprobs_and_token_ids_as_vllm_does(client, model_name) -> None:
    """vLLM hides every token's logprobs and ids with the reasoning (they would spell it out),
    whole and streamed; the prompt's ids and the text stay."""
    asked = {"logprobs": True, "top_logprobs": 2, "max_tokens": 6, "temperature": 0}
    extra = {"return_token_ids": True, "ignore_eos": True}

    def ask(stream: bool = False, **more: object):
        return client.chat.completions.create(
            model=model_name, messages=MESSAGES, stream=stream, extra_body={**extra, **more}, **asked
        )

    shown = ask().choices[0]
    assert len(shown.token_ids) == 6 and len(shown.logprobs.content) == 6
    whole = ask(include_reasoning=False)
    assert whole.choices[0].logprobs is None and whole.choices[0].model_extra.get("token_ids") is None
    assert whole.model_extra["prompt_token_ids"] and whole.usage.completion_tokens == 6
    chunks = [c for c in ask(stream=True, include_reasoning=False, stream_options={"include_usage": True})]
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    choices = [ch for c in chunks for ch in c.choices]
    assert choices and all(ch.logprobs is None and ch.model_extra.get("token_ids") is None for ch in choices)
    assert chunks[-1].usage.completion_tokens == 6


def test_return_prompt_text_gives_the_rendered_prompt(client, server, model_name) -> None:
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()["tokens"]
    rendered = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=30).json()["prompt"]
    asked = {"return_prompt_text": True}
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2, extra_body=asked)
    assert r.model_extra["prompt_text"] == rendered and "hello there" in rendered
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=2, stream=True, extra_body=asked
        )
    )
    assert chunks[0].model_extra["prompt_text"] == rendered
    assert all("prompt_text" not in c.model_extra for c in chunks[1:])
    plain = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert "prompt_text" not in plain.model_extra
    beams = {**asked, "use_beam_search": True}  # a beam search's reply carries it too
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=2, n=2, extra_body=beams
    )
    assert r.model_extra["prompt_text"] == rendered
    chunks = list(
        client.chat.completions.create(
            model=model_name, messages=MESSAGES, max_tokens=2, n=2, stream=True, extra_body=beams
        )
    )
    # as vLLM's: each choice's opening chunk (its role) carries it
    assert [c.model_extra["prompt_text"] for c in chunks[:2]] == [rendered] * 2
    assert all("prompt_text" not in c.model_extra for c in chunks[2:])


def test_chat_reply_without_a_generation_prompt_takes_the_last_messages_role(client, model_name) -> None:
    # vLLM's get_chat_request_role: the last message's role where no generation prompt opens a turn
    def role(stream: bool, **extra: object) -> str | None:
        r = client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            max_tokens=2,
            temperature=0,
            stream=stream,
            extra_body={"add_generation_prompt": False, **extra},
        )
        if stream:
            return next(c for c in r if c.choices).choices[0].delta.role
        return r.choices[0].message.role

    assert role(False) == role(True) == "user"
    assert role(False, use_beam_search=True, n=2) == role(True, use_beam_search=True, n=2) == "user"
    r = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].message.role == "assistant"


def test_a_low_temperature_is_warned_of_once_a_request(server, client, model_name) -> None:
    """A temperature below 0.01 is raised with one warning in the log a request, however many
    prompts it holds (completions' batch, /generate's shared sampling_params)."""
    warning = "is below 0.01, which may give inf or NaN: raised to 0.01"
    before = server.log().count(warning)
    out = client.completions.create(
        model=model_name, prompt=["Hi", "Yo", "So"], max_tokens=1, temperature=0.005
    )
    assert len(out.choices) == 3
    r = httpx.post(
        f"{server.url}/generate",
        json={"text": ["Hi", "Yo"], "sampling_params": {"max_new_tokens": 1, "temperature": 0.005}},
        timeout=60,
    )
    assert r.status_code == 200 and len(r.json()) == 2
    assert server.log().count(warning) - before == 2, server.log()[-2000:]


def test_tokenize_adds_the_tokenizers_bos_to_messages_only_when_asked(
    spawn_server, builtin_path: str, tmp_path
) -> None:
    """vLLM's /tokenize: a text prompt gets the tokenizer's special tokens unless told not to, and a
    chat's rendered prompt gets them only with add_special_tokens true (the template writes its own)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(builtin_path)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save_pretrained(tmp_path)
    server = spawn_server("--max-model-len", "256", "--tokenizer", str(tmp_path))

    def tokens(body: dict) -> list[int]:
        r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens({"prompt": "hello there"})[0] == bos
    assert tokens({"prompt": "hello there", "add_special_tokens": False})[0] != bos
    plain = tokens({"messages": MESSAGES})
    assert plain[0] != bos
    assert tokens({"messages": MESSAGES, "add_special_tokens": False}) == plain
    assert tokens({"messages": MESSAGES, "add_special_tokens": True}) == [bos, *plain]


def test_stream_interval_groups_a_streams_tokens(server, model_name) -> None:
    """vLLM's per-request stream_interval: the first chunk carries one token, later ones that many
    (the last what is left), the text unchanged; below 1 it is a 400 naming it."""
    body = {"model": model_name, "prompt": [5, 9, 17], "max_tokens": 11, "temperature": 0, "ignore_eos": True}
    url = f"{server.url}/v1/completions"
    whole = httpx.post(url, json={**body, "logprobs": 0}, timeout=60).json()["choices"][0]
    grouped = {**body, "logprobs": 0, "stream": True, "stream_interval": 4}
    with httpx.stream("POST", url, json=grouped, timeout=60) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert [len(c["logprobs"]["tokens"]) for c in chunks if c["logprobs"]["tokens"]] == [1, 4, 4, 2]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    bad = httpx.post(url, json={**grouped, "stream_interval": 0}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_interval"
