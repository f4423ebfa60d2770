"""vLLM's `cache_salt` on a real `deltaserve serve` (built-in model), through the openai client: a
salted request hits only prefixes cached by requests with the same salt, an unsalted one only
unsalted prefixes, and the outputs stay the same."""

from __future__ import annotations

import uuid

import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME


def _messages() -> list[dict[str, str]]:
    # a text no other test sends: the session server's cache holds nothing of it yet
    return [{"role": "user", "content": f"Tell me about salts {uuid.uuid4().hex}. " * 12}]


def test_chat_hits_only_prefixes_of_its_own_salt(client) -> None:
    messages = _messages()
    replies = []
    for salt in ("tenant-a", "tenant-b", "tenant-a", None, None, "tenant-b"):
        extra = {"cache_salt": salt} if salt is not None else {}
        replies.append(
            client.chat.completions.create(
                model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body=extra
            )
        )
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in replies]
    assert cached[:2] == [0, 0] and cached[2] > 0  # b did not hit a's prefix; a's second time did
    assert cached[3] == 0 and cached[4] > 0 and cached[5] > 0  # unsalted: not a's nor b's entries
    assert len({r.choices[0].message.content for r in replies}) == 1


def test_completions_hit_only_prefixes_of_their_own_salt(client) -> None:
    prompt = _messages()[0]["content"]
    cached = []
    for salt in (None, "tenant-a", None, "tenant-a"):
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[:2] == [0, 0] and cached[2] > 0 and cached[3] > 0


def test_the_warm_up_of_n_salted_copies_is_salted_too(client) -> None:
    """n > 1 prefills the prompt once first: under the request's salt, where its copies look, and
    where an unsalted request does not find it."""
    prompt = _messages()[0]["content"]
    r = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=2, n=2, extra_body={"cache_salt": "tenant-a"}
    )
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


# vLLM's validate_cache_salt: a non-empty string of at most 128 characters, without '@', '/', '\\' or NUL
@pytest.mark.parametrize("salt", ["", 5, "s" * 129, "a@b", "a/b", "a\\b", "a\x00b"])
def test_a_salt_vllm_refuses_is_a_400(client, salt) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL_NAME, messages=_messages(), max_tokens=1, extra_body={"cache_salt": salt}
        )
    assert bad.value.body["param"] == "cache_salt"
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(
            model=MODEL_NAME, input="hi", max_output_tokens=1, extra_body={"cache_salt": salt}
        )
    assert bad.value.body["param"] == "cache_salt"


def test_a_salt_of_128_characters_is_served(client) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=1, extra_body={"cache_salt": "s" * 127 + "é"}
    )
    assert r.usage.completion_tokens == 1


def test_responses_hit_only_prefixes_of_their_own_salt(client) -> None:
    text = _messages()[0]["content"]
    cached = []
    for salt in ("tenant-a", None, "tenant-a"):
        extra = {"cache_salt": salt} if salt is not None else {}
        r = client.responses.create(model=MODEL_NAME, input=text, max_output_tokens=2, extra_body=extra)
        cached.append(r.usage.input_tokens_details.cached_tokens)
    assert cached[:2] == [0, 0] and cached[2] > 0


def test_a_beam_search_caches_under_its_salt(client) -> None:
    prompt = _messages()[0]["content"]
    cached = []
    for salt in ("tenant-a", None, "tenant-a"):
        extra = {"use_beam_search": True, "n": 2, **({"cache_salt": salt} if salt else {})}
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body=extra)
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
    assert cached[:2] == [0, 0] and cached[2] > 0


def test_anthropic_messages_hit_only_prefixes_of_their_own_salt(server) -> None:
    """vLLM's /v1/messages takes cache_salt too (as its chat endpoint's field)."""
    import anthropic

    text = _messages()[0]["content"]
    cached = []
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as claude:
        for salt in ("tenant-a", None, "tenant-a"):
            extra = {"cache_salt": salt} if salt is not None else {}
            m = claude.messages.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": text}], extra_body=extra
            )
            cached.append(m.usage.cache_read_input_tokens)
        with pytest.raises(anthropic.BadRequestError):
            claude.messages.create(
                model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": text}],
                extra_body={"cache_salt": ""},
            )  # fmt: skip
    assert cached[:2] == [0, 0] and cached[2] > 0
