"""A reasoning budget through a real server: vLLM's `thinking_token_budget` on chat and
completions (the official openai client), SGLang's `thinking_budget` on /generate, and enabled
thinking's `budget_tokens` on /v1/messages (the anthropic client). The built-in model never
closes its reasoning on its own, so each reply's reasoning is exactly its budget's tokens."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL

# Qwen3.5's shape: the generation prompt opens <think>
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
END = 151668  # </think> in the built-in model's Qwen3 tokenizer


@pytest.fixture(scope="module")
def server(spawn_module_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(TEMPLATE)
    return spawn_module_server("--max-model-len", "2048", "--chat-template", str(template))


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def detokenize(server, ids: list[int]) -> str:
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30)
    r.raise_for_status()
    return r.json()["prompt"]


def chat(client, budget: int | None, **kw):
    extra = {"return_token_ids": True, **({} if budget is None else {"thinking_token_budget": budget})}
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body=extra, **kw
    )


@pytest.mark.parametrize("budget", [0, 1, 6])
def test_chat_reasoning_has_the_budgets_tokens_then_the_answer(server, client, budget) -> None:
    free = chat(client, None).choices[0]
    assert END not in free.token_ids and free.message.content is None  # all reasoning, no answer
    c = chat(client, budget).choices[0]
    assert c.token_ids[:budget] == free.token_ids[:budget]
    assert c.token_ids[budget] == END
    reasoning = c.message.reasoning_content
    assert (reasoning or "") == detokenize(server, c.token_ids[:budget]).lstrip("\n")
    assert c.message.content == detokenize(server, c.token_ids[budget + 1 :]).lstrip("\n")
    assert c.message.content and c.finish_reason == "length"


def test_a_streamed_chat_is_forced_alike(client) -> None:
    whole = chat(client, 4).choices[0].message
    stream = chat(client, 4, stream=True)
    deltas = [chunk.choices[0].delta for chunk in stream if chunk.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert "".join(d.content or "" for d in deltas) == whole.content


def test_unlimited_and_thinking_off_change_nothing(client) -> None:
    free = chat(client, None).choices[0].token_ids
    assert chat(client, -1).choices[0].token_ids == free
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    no_budget = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, **off},
    )
    budgeted = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True, "thinking_token_budget": 0, **off},
    )
    assert budgeted.choices[0].token_ids == no_budget.choices[0].token_ids


def test_completions_count_from_a_prompt_that_opens_reasoning(client) -> None:
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    free = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    c = client.completions.create(
        **kw, extra_body={"return_token_ids": True, "thinking_token_budget": 3}
    ).choices[0]
    assert c.token_ids[:3] == free.token_ids[:3] and c.token_ids[3] == END
    assert "</think>" in c.text


def test_generate_takes_sglangs_thinking_budget(server) -> None:
    body = {
        "text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "thinking_budget": 2},
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"][2] == END


@pytest.mark.parametrize("value", [-2, 2.5, True, "x", [1]])
@pytest.mark.parametrize("endpoint", ["chat/completions", "completions"])
def test_bad_budgets_are_400_naming_the_field(server, endpoint, value) -> None:
    prompt = {"messages": MESSAGES} if endpoint.startswith("chat") else {"prompt": "hi"}
    body = {"model": MODEL, **prompt, "max_tokens": 2, "thinking_token_budget": value}
    r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "thinking_token_budget" and err["type"] == "invalid_request_error", err


def test_beam_search_refuses_a_budget(server) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "use_beam_search": True, "n": 2}
    r = httpx.post(f"{server.url}/v1/completions", json={**body, "thinking_token_budget": 2}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_token_budget", r.text


@pytest.fixture
def claude(server):
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.mark.slow
def test_messages_budget_tokens_bounds_the_thinking_block(client, claude) -> None:
    """Anthropic's least budget is 1024: the thinking block is the reasoning a chat request with
    that thinking_token_budget writes (1024 tokens, then </think>), and the text its answer;
    adaptive thinking sets no budget, and the model thinks on past it."""
    kw = dict(model=MODEL, max_tokens=1030, messages=MESSAGES)
    greedy = {"temperature": 0}  # as an extra body field: newer SDKs no longer send it
    reply = claude.messages.create(
        **kw, thinking={"type": "enabled", "budget_tokens": 1024}, extra_body=greedy
    )
    c = client.chat.completions.create(
        **kw, temperature=0, extra_body={"return_token_ids": True, "thinking_token_budget": 1024}
    ).choices[0]
    assert END not in c.token_ids[:1024] and c.token_ids[1024] == END
    assert [b.type for b in reply.content] == ["thinking", "text"]
    assert reply.content[0].thinking == c.message.reasoning_content
    assert reply.content[1].text == c.message.content
    assert reply.usage.output_tokens == 1030 and reply.stop_reason == "max_tokens"
    free = claude.messages.create(**kw, thinking={"type": "adaptive"}, extra_body=greedy)
    longer = free.content[0].thinking  # the model's own end comes later
    assert longer.startswith(reply.content[0].thinking) and len(longer) > len(reply.content[0].thinking)


@pytest.mark.parametrize(
    "thinking,max_tokens,says",
    [
        ({"type": "enabled", "budget_tokens": 1023}, 2000, "greater than or equal to 1024"),
        ({"type": "enabled", "budget_tokens": 1024}, 1024, "`max_tokens` must be greater"),
        ({"type": "enabled", "budget_tokens": "2000"}, 4000, "valid integer"),
    ],
)
def test_messages_budget_tokens_out_of_anthropics_range_is_their_400(
    claude, thinking, max_tokens, says
) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=max_tokens, messages=MESSAGES, thinking=thinking)
    body = refused.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert says in body["error"]["message"], body


def test_messages_budget_tokens_beside_thinking_token_budget_is_a_400(claude) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=MODEL,
            max_tokens=2000,
            messages=MESSAGES,
            thinking={"type": "enabled", "budget_tokens": 1024},
            extra_body={"thinking_token_budget": 5},
        )
    assert "give one of" in refused.value.response.json()["error"]["message"]
