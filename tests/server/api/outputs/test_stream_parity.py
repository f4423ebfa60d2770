"""Streamed against unstreamed, on every endpoint (built-in model, greedy or seeded): a stream's
pieces joined are the whole reply (text, reasoning, tool calls, logprobs, finish and stop reasons,
usage) for a table of options, stop strings among them taken from a first answer's text (one
across a token boundary, one a multi-byte character), on the default server and one with
--stream-interval 4."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

# Every option of a table asked streamed and whole, on each API
pytestmark = pytest.mark.slow

PROMPT = "The weather today"
MESSAGES = [{"role": "user", "content": "Hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "description": "d",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        },
    }
]


@pytest.fixture(scope="module", params=["interval-1", "interval-4"])
def url(request, spawn_module_server) -> str:
    if request.param == "interval-1":
        return request.getfixturevalue("server").url
    return spawn_module_server("--max-model-len", "512", "--stream-interval", "4").url


@pytest.fixture(scope="module")
def oai(url: str):
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def fresh(url: str) -> None:
    """An empty prefix cache, so that both runs report the same cached_tokens."""
    assert httpx.post(f"{url}/flush_cache", timeout=30).status_code == 200


def same_logprobs(got: Any, want: Any) -> None:
    """Equal but for float noise in the log-probabilities: tokens, ids and shapes exactly."""
    (got_floats, got_rest), (want_floats, want_rest) = _apart(got), _apart(want)
    assert got_rest == want_rest and got_floats == pytest.approx(want_floats, abs=1e-4)


def _apart(value: Any) -> tuple[list[float], Any]:
    """(the floats in a nested value, the value with each float as "f")."""
    if isinstance(value, float):
        return [value], "f"
    if isinstance(value, list):
        parts = [_apart(v) for v in value]
        return [f for fl, _ in parts for f in fl], [s for _, s in parts]
    if isinstance(value, dict):
        parts = {k: _apart(v) for k, v in value.items()}
        return [f for fl, _ in parts.values() for f in fl], {k: s for k, (_, s) in parts.items()}
    return [], value


def stop_strings(oai: openai.OpenAI) -> tuple[str, str]:
    """From a first greedy answer: 2 characters across a token boundary, and its first non-ASCII
    character (the built-in model's noise holds many)."""
    base = oai.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, logprobs=0)
    text, offsets = base.choices[0].text, base.choices[0].logprobs.text_offset
    cut = next(o for o in offsets[2:] if 0 < o < len(text) - 1)
    wide = next(ch for ch in text if ord(ch) > 0x7F)
    return text[cut - 1 : cut + 1], wide


def compare_completions(url: str, oai: openai.OpenAI, **kw: Any) -> None:
    options = kw.pop("stream_options", {"include_usage": True})
    fresh(url)
    whole = oai.completions.create(model=MODEL_NAME, **kw)
    fresh(url)
    chunks = list(oai.completions.create(model=MODEL_NAME, stream=True, stream_options=options, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    for choice in whole.choices:
        mine = [c for ch in chunks for c in ch.choices if c.index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert [c.stop_reason for c in mine if c.finish_reason] == [choice.stop_reason]
        if choice.logprobs is not None:
            joined: dict[str, list[Any]] = {
                k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
            }
            for c in mine:
                for key, values in joined.items():
                    values += getattr(c.logprobs, key) if c.logprobs else []
            assert joined["tokens"] == choice.logprobs.tokens
            assert joined["text_offset"] == choice.logprobs.text_offset
            same_logprobs([joined["token_logprobs"], joined["top_logprobs"]], [
                choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
            ])  # fmt: skip
    if all(c.logprobs for c in whole.choices):  # usage counts the tokens (an echo's prompt once a prompt)
        echoed = whole.usage.prompt_tokens * kw.get("n", 1) if kw.get("echo") else 0
        assert sum(len(c.logprobs.tokens) for c in whole.choices) - echoed == whole.usage.completion_tokens
    if options.get("continuous_usage_stats"):  # vLLM's: each chunk's usage is its own choice's so far
        so_far: dict[int, int] = {}
        prompts: dict[int, int] = {}  # each prompt's tokens, as its choices' chunks count them
        for chunk in chunks[:-1]:
            (c,) = chunk.choices
            so_far[c.index] = so_far.get(c.index, 0) + len(c.logprobs.tokens)
            assert chunk.usage.completion_tokens == so_far[c.index]
            prompts.setdefault(c.index // kw.get("n", 1), chunk.usage.prompt_tokens)
            assert chunk.usage.prompt_tokens == prompts[c.index // kw.get("n", 1)]
        assert so_far == {c.index: len(c.logprobs.tokens) for c in whole.choices}
        assert sum(prompts.values()) == whole.usage.prompt_tokens


def compare_chat(url: str, oai: openai.OpenAI, **kw: Any) -> None:
    fresh(url)
    whole = oai.chat.completions.create(model=MODEL_NAME, **kw)
    fresh(url)
    options = {"include_usage": True}
    chunks = list(oai.chat.completions.create(model=MODEL_NAME, stream=True, stream_options=options, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    extra = kw.get("extra_body", {})
    rendered = {"messages": kw["messages"], "tools": kw.get("tools")}
    rendered.update({k: extra[k] for k in ("continue_final_message", "add_generation_prompt") if k in extra})
    prompt = httpx.post(f"{url}/tokenize", json=rendered, timeout=30).json()["tokens"]
    assert whole.usage.prompt_tokens == len(prompt)
    if kw.get("logprobs"):
        assert sum(len(c.logprobs.content) for c in whole.choices) == whole.usage.completion_tokens
    for choice in whole.choices:
        mine = [c for ch in chunks for c in ch.choices if c.index == choice.index]
        message = choice.message
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == (message.content or "")
        reasoning = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in mine)
        assert reasoning == (getattr(message, "reasoning_content", None) or "")
        calls: dict[int, list[str]] = {}  # a call's first delta has its name, the next its arguments
        for t in (t for c in mine for t in c.delta.tool_calls or []):
            assert (t.index in calls) == (t.function.name is None) == (t.id is None)
            call = calls.setdefault(t.index, [t.function.name or "", ""])
            call[1] += t.function.arguments or ""
        assert [tuple(calls[i]) for i in sorted(calls)] == [
            (t.function.name, t.function.arguments) for t in message.tool_calls or []
        ]
        assert [c.finish_reason for c in mine if c.finish_reason] == [choice.finish_reason]
        assert [c.stop_reason for c in mine if c.finish_reason] == [choice.stop_reason]
        if choice.logprobs is not None:
            streamed = [t.model_dump() for c in mine if c.logprobs for t in c.logprobs.content or []]
            same_logprobs(streamed, [t.model_dump() for t in choice.logprobs.content or []])


def without_ids(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id", "created_at")}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


@pytest.mark.parametrize("include", [False, True])
def test_completions(url, oai, include: bool) -> None:
    span, wide = stop_strings(oai)
    greedy = {"prompt": PROMPT, "temperature": 0, "max_tokens": 12}
    for stop in ([span], [wide, "never"]):
        compare_completions(
            url, oai, **greedy, stop=stop, logprobs=1, extra_body={"include_stop_str_in_output": include}
        )
    compare_completions(url, oai, **greedy, extra_body={"min_tokens": 12, "skip_special_tokens": include})
    # greedy choices: top_k 1 at a positive temperature (n > 1 at temperature 0 is a 400, as in vLLM)
    compare_completions(
        url, oai, **{**greedy, "temperature": 1}, echo=True, logprobs=2, n=2, extra_body={"top_k": 1}
    )
    compare_completions(
        url, oai, prompt=[PROMPT, "Hi"], max_tokens=6, temperature=1, seed=5, n=2, best_of=2, logprobs=0,
        stream_options={"include_usage": True, "continuous_usage_stats": include},
    )  # fmt: skip


def test_chat(url, oai) -> None:
    span, wide = stop_strings(oai)
    greedy = {"messages": MESSAGES, "temperature": 0, "max_tokens": 12}
    for stop in ([span], [wide]):
        for include in (False, True):
            compare_chat(url, oai, **greedy, stop=stop, extra_body={"include_stop_str_in_output": include})
    compare_chat(
        url, oai, **{**greedy, "temperature": 1}, logprobs=True, top_logprobs=2, n=2, extra_body={"top_k": 1}
    )
    # reasoning and tool-call markup, written by seeded sampling over a few tokens; the second
    # conversation leaves <think> open, so that the output starts inside reasoning
    ids = httpx.post(
        f"{url}/tokenize", json={"prompt": '<think></think><tool_call></tool_call>\n a{"name":'}, timeout=30
    )
    markup = {"allowed_token_ids": ids.json()["tokens"]}
    thinking = {**markup, "continue_final_message": True, "add_generation_prompt": False}
    opened = [*MESSAGES, {"role": "assistant", "content": "<think>\n"}]
    for seed in range(3):
        sampled = {"temperature": 1, "seed": seed, "logprobs": True, "max_tokens": 16, "tools": TOOLS}
        compare_chat(url, oai, messages=MESSAGES, extra_body=markup, **sampled)
        compare_chat(url, oai, messages=opened, extra_body=thinking, **sampled)
    compare_chat(
        url, oai, messages=MESSAGES, max_tokens=40, temperature=1, seed=1, tools=TOOLS, tool_choice="required"
    )


def test_responses(url, oai) -> None:
    _, wide = stop_strings(oai)
    cases = [
        {"temperature": 0, "extra_body": {"stop": [wide], "include_stop_str_in_output": True}},
        {"temperature": 0, "reasoning": {"effort": "none"}, "extra_body": {"min_tokens": 12}},
        {"temperature": 1, "extra_body": {"seed": 2}, "tools": [{"type": "function", **TOOLS[0]["function"]}],
         "tool_choice": "required"},
    ]  # fmt: skip
    for case in cases:
        fresh(url)
        whole = oai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=12, **case)
        fresh(url)
        events = list(
            oai.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=12, stream=True, **case)
        )
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        assert without_ids(final.model_dump()) == without_ids(whole.model_dump())
        deltas: dict[int, str] = {}
        for e in events:
            if e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
                deltas[e.output_index] = deltas.get(e.output_index, "") + e.delta
        texts = {
            i: item.content[0].text for i, item in enumerate(final.output) if item.type != "function_call"
        }
        assert {i: t for i, t in deltas.items() if t} == {i: t for i, t in texts.items() if t}


def test_messages(url, oai) -> None:
    _, wide = stop_strings(oai)
    tool = {"name": "f", "description": "d", "input_schema": TOOLS[0]["function"]["parameters"]}
    cases = [
        {"stop_sequences": [wide], "extra_body": {"temperature": 0}},
        {"system": "Be brief.", "thinking": {"type": "disabled"}, "extra_body": {"temperature": 0}},
        {"tools": [tool], "tool_choice": {"type": "any"}, "extra_body": {"temperature": 1, "seed": 3}},
    ]
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as claude:
        for case in cases:
            fresh(url)
            whole = claude.messages.create(model=MODEL_NAME, max_tokens=12, messages=MESSAGES, **case)
            fresh(url)
            with claude.messages.stream(model=MODEL_NAME, max_tokens=12, messages=MESSAGES, **case) as stream:
                final = stream.get_final_message()
            assert without_ids(final.model_dump()) == without_ids(whole.model_dump())


def test_generate(url, oai) -> None:
    span, _ = stop_strings(oai)
    greedy = {"temperature": 0, "max_new_tokens": 10}
    bodies = [
        {"text": PROMPT, "sampling_params": {**greedy, "stop": [span], "no_stop_trim": True}},
        {"text": PROMPT, "sampling_params": greedy, "return_logprob": True, "top_logprobs_num": 2,
         "logprob_start_len": 0, "return_text_in_logprobs": True},
        {"text": [PROMPT, "Hi"], "sampling_params": {**greedy, "n": 2, "temperature": 1, "sampling_seed": 4}},
    ]  # fmt: skip
    for body in bodies:
        fresh(url)
        whole = httpx.post(f"{url}/generate", json=body, timeout=60).json()
        fresh(url)
        last: dict[int, dict[str, Any]] = {}
        with httpx.stream("POST", f"{url}/generate", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line.removeprefix("data: "))
                    last[event.pop("index", 0)] = event
        streamed = [last[i] for i in sorted(last)]
        for got, want in zip(streamed, whole if isinstance(whole, list) else [whole], strict=True):
            for result in (got, want):
                result["meta_info"].pop("e2e_latency")
            assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
            same_logprobs(without_ids(got["meta_info"]), without_ids(want["meta_info"]))
