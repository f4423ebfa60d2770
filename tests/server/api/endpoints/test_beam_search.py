"""vLLM's use_beam_search on /v1/completions and /v1/chat/completions, through the openai client
on a real server: the offline engine's beams (LLM.beam_search, itself held to transformers in
tests/engine/requests/test_beam_search.py), best first, one choice a beam; what it cannot do is a
400 naming the field."""

from __future__ import annotations

import functools
import json
import socket
import time

import openai
import pytest

from deltaserve import LLM, BeamSearchParams
from deltaserve.engine.requests.beam_search import BeamSequence

from ...conftest import MAX_MODEL_LEN, MODEL_NAME

# Servers of its own and offline beams to compare (the engine's beam tests stay fast)
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Once upon a time"]


@functools.cache
def offline(path: str) -> LLM:
    return LLM(path, device="cpu", max_model_len=MAX_MODEL_LEN)


def output_text(llm: LLM, beam: BeamSequence) -> str:
    """A choice's text: the beam's output without the stop token that ended it (the offline
    beam's `text` is vLLM's, the prompt's and every token's)."""
    return llm.tokenizer.decode(beam.text_ids(include_stop=False), skip_special_tokens=True)


def test_choices_are_the_offline_beams(client, builtin_path) -> None:
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        n=3,
        max_tokens=6,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.5)
    llm = offline(builtin_path)
    want = llm.beam_search([{"prompt": p} for p in PROMPTS], params)
    beams = [b for out in want for b in out.sequences]
    assert [c.text for c in reply.choices] == [output_text(llm, b) for b in beams]
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.finish_reason for c in reply.choices] == [b.finish_reason for b in beams]
    assert reply.usage.completion_tokens == sum(len(b.output_ids) for b in beams)
    assert len({c.text for c in reply.choices[:3]}) == 3


def test_a_resent_beam_search_reports_the_prompt_the_cache_served(client) -> None:
    """usage.prompt_tokens_details.cached_tokens counts the prompt tokens the prefix cache served
    its first step, as a sampled request's does (it was always 0)."""
    prompt = list(range(100, 400))  # 300 tokens: the second time, every whole page but the last token's
    ask = dict(model=MODEL_NAME, prompt=prompt, n=2, max_tokens=4, extra_body={"use_beam_search": True})
    client.completions.create(**ask)
    again = client.completions.create(**ask)
    sampled = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens == 300
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == sampled.usage.prompt_tokens_details.cached_tokens and 256 <= cached < 300


def test_chat_choices_are_the_offline_beams_of_the_rendered_prompt(client, builtin_path) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    reply = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, n=2, max_tokens=6, extra_body={"use_beam_search": True}
    )
    llm = offline(builtin_path)
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    (want,) = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=2, max_tokens=6))
    got = [(c.message.reasoning_content or "") + (c.message.content or "") for c in reply.choices]
    assert got == [output_text(llm, b).replace("<think>", "").replace("</think>", "") for b in want.sequences]
    assert reply.usage.prompt_tokens == len(ids)


def test_a_streamed_search_sends_the_beams_it_answers_unstreamed(client) -> None:
    """stream true with use_beam_search was a 400; vLLM answers it. The beams come as events once
    the search ends (which beams win is known only then): the same texts, finish reasons and usage
    as the unstreamed reply, then [DONE], through the openai client's stream reader."""
    ask = dict(model=MODEL_NAME, n=2, max_tokens=5, extra_body={"use_beam_search": True})
    whole = client.completions.create(prompt=PROMPTS, **ask)
    chunks = list(
        client.completions.create(prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **ask)
    )
    assert [(c.choices[0].index, c.choices[0].text, c.choices[0].finish_reason) for c in chunks[:-1]] == [
        (c.index, c.text, c.finish_reason) for c in whole.choices
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1

    messages = [{"role": "user", "content": "Say something."}]
    whole = client.chat.completions.create(messages=messages, **ask)
    texts: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str | None] = {}
    roles = set()
    for chunk in client.chat.completions.create(messages=messages, stream=True, **ask):
        assert len(chunk.choices) == 1  # each beam's role in a chunk of its own, as a sampled stream's
        for c in chunk.choices:
            roles |= {c.index} if c.delta.role == "assistant" else set()
            texts[c.index] += (getattr(c.delta, "reasoning_content", None) or "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
        assert chunk.usage is None
    want = [(c.message.reasoning_content or "") + (c.message.content or "") for c in whole.choices]
    assert roles == {0, 1} and [texts[0], texts[1]] == want and texts[0] != texts[1]
    assert [finish[0], finish[1]] == [c.finish_reason for c in whole.choices]


def test_a_search_reads_the_prompt_truncate_prompt_tokens_leaves(client, builtin_path) -> None:
    """truncate_prompt_tokens cuts a searched completion's prompt as a sampled one's (the search
    read the whole prompt, and usage and echo said so)."""
    prompt = list(range(1000, 1012))
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        n=2,
        max_tokens=4,
        echo=True,
        extra_body={"use_beam_search": True, "truncate_prompt_tokens": 5},
    )
    llm = offline(builtin_path)
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    (want,) = llm.beam_search([{"prompt_token_ids": prompt[-5:]}], params)
    echoed = llm.tokenizer.decode(prompt[-5:])
    assert [c.text for c in reply.choices] == [echoed + output_text(llm, b) for b in want.sequences]
    assert reply.usage.prompt_tokens == 5


@pytest.mark.parametrize("penalty", [1e30, -1e30])
def test_a_penalty_past_a_floats_range_still_ranks_the_beams(client, builtin_path, penalty: float) -> None:
    """length ** length_penalty past a float's range was a 500 (OverflowError, or a division by an
    underflowed 0): the beams rank as the score orders them, longest first for a huge penalty."""
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[0],
        n=2,
        max_tokens=4,
        extra_body={"use_beam_search": True, "length_penalty": penalty},
    )
    params = BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=penalty)
    llm = offline(builtin_path)
    (want,) = llm.beam_search([{"prompt": PROMPTS[0]}], params)
    assert [c.text for c in reply.choices] == [output_text(llm, b) for b in want.sequences]
    assert len(reply.choices) == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 11}, "n"),
        ({"temperature": 0.8}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
        # were dropped (and with max_tokens 0, chat gave one empty choice for n 2)
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"prompt_logprobs": 0, "max_tokens": 0}, "prompt_logprobs"),
        # refused as for a sampled request: this server runs fcfs
        ({"priority": 5}, "priority"),
    ],
)
def test_what_beam_search_cannot_do_is_a_400(client, fields: dict, param: str) -> None:
    fields = dict(fields)
    extra = {"use_beam_search": True}
    for name in ("prompt_logprobs", "priority"):  # vLLM's, which the openai client sends as extras
        if name in fields:
            extra[name] = fields.pop(name)
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    chat["logprobs"] = "logprobs" in fields
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**chat, extra_body=extra)
    assert err.value.body["param"] == param
    body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**body, extra_body=extra)
    assert err.value.body["param"] == param
    ok = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("path", "ask"),
    [
        ("/v1/completions", {"prompt": "go", "max_tokens": MAX_MODEL_LEN - 8}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "go"}], "max_tokens": MAX_MODEL_LEN - 32},
        ),
    ],
)
def test_a_client_that_hangs_up_ends_its_search_at_the_next_step(server, read_metrics, path, ask) -> None:
    """A search is one short engine request a step: a client gone between two steps ends it, as
    an aborted request (its steps ran on to max_tokens, the client's disconnect seen by none)."""
    body = json.dumps(
        {"model": MODEL_NAME, "n": 2, "use_beam_search": True, "ignore_eos": True, **ask}
    ).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    before = read_metrics(server.url)
    aborted = 'deltaserve_requests_total{outcome="abort"}'
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        deadline = time.monotonic() + 30
        while (  # its first step is in (it counts the prompt's tokens): it hangs up mid-search
            read_metrics(server.url)["deltaserve_prompt_tokens_total"]
            == before["deltaserve_prompt_tokens_total"]
        ):
            assert time.monotonic() < deadline, "the search's first step never came"
            time.sleep(0.05)
    deadline = time.monotonic() + 30
    while read_metrics(server.url)[aborted] == before[aborted] and time.monotonic() < deadline:
        time.sleep(0.05)
    gone = read_metrics(server.url)
    assert gone[aborted] == before[aborted] + 1  # ended by the hang-up, not at max_tokens
    time.sleep(1.0)  # nothing to wait for: a step run after the abort would show by now
    after = read_metrics(server.url)
    assert after["deltaserve_engine_step_seconds_total"] == gone["deltaserve_engine_step_seconds_total"]
    assert after["deltaserve_num_requests_running"] == after["deltaserve_num_requests_waiting"] == 0


def test_a_search_counts_once_with_the_tokens_it_returns(client, server, read_metrics, until_idle) -> None:
    """The metrics count each prompt's search as one request, with its prompt's tokens and the
    tokens of the beams it returns, under deltaserve's and vLLM's names alike (they counted each
    step's engine requests: 7 requests and 33 prompt tokens for a 3-token prompt's 4 steps)."""
    before = until_idle(server.url)
    reply = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS,
        n=2,
        max_tokens=4,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    after = until_idle(server.url)
    prompt, generated = reply.usage.prompt_tokens, reply.usage.completion_tokens
    assert len(reply.choices) == 4 and generated == 4 * 4

    def grew(name: str) -> float:
        return after[name] - before[name]

    for p in ("deltaserve_", "vllm:"):
        assert grew(f"{p}prompt_tokens_total") == prompt
        assert grew(f"{p}generation_tokens_total") == generated
        assert grew(f"{p}e2e_request_latency_seconds_count") == 2
        assert grew(f"{p}time_to_first_token_seconds_count") == 2
        assert grew(f"{p}request_prompt_tokens_sum") == prompt
        assert grew(f"{p}request_generation_tokens_sum") == generated
    assert grew('deltaserve_requests_total{outcome="length"}') == 2
    assert grew('vllm:request_success_total{finished_reason="length"}') == 2
