"""Prompt log-probabilities over HTTP, as eval harnesses ask for them: completions with `echo` and
`logprobs` (`max_tokens` 0 or 1), and vLLM's `prompt_logprobs` field on completions and chat."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

# Prompt logprobs' scoring prefills, on the server (tests/engine/step/test_prompt_logprobs.py stays fast)
pytestmark = pytest.mark.slow

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]


@pytest.fixture(scope="module")
def offline(builtin_path: str):
    """The same model's prompt log-probabilities from the offline engine, the reference here
    (the engine's own are held to transformers in tests/engine/step/test_prompt_logprobs.py)."""
    from deltaserve import LLM, SamplingParams

    llm = LLM(model=builtin_path, dtype="float32", device="cpu")
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=0, prompt_logprobs=3))
    return out.prompt_logprobs


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json={"model": MODEL_NAME, **body}, timeout=60)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_every_prompt_token_but_the_first(server, offline, max_tokens: int) -> None:
    r = post(
        server.url, "completions", {"prompt": PROMPT, "max_tokens": max_tokens, "echo": True, "logprobs": 3}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lps = choice["logprobs"]
    assert len(lps["tokens"]) == len(PROMPT) + max_tokens
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for got, want in zip(lps["token_logprobs"][1 : len(PROMPT)], offline[1:]):
        assert math.isclose(got, want.logprob, abs_tol=1e-5)
    # the top 3 and the prompt's own token, as OpenAI's legacy logprobs and vLLM's add it
    for token, value, top in zip(lps["tokens"][1:], lps["token_logprobs"][1:], lps["top_logprobs"][1:]):
        assert top[token] == value and len(top) == 3 + (value < min(sorted(top.values())[-3:]))
    # what lm-evaluation-harness sums for a continuation's log-likelihood is a number now
    assert sum(lps["token_logprobs"][5:-1]) < 0
    if max_tokens == 0:
        assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0


def test_echo_streamed_carries_them_in_the_first_chunk(server, offline) -> None:
    body = {
        "model": MODEL_NAME,
        "prompt": PROMPT,
        "max_tokens": 3,
        "echo": True,
        "logprobs": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][0] is None
    assert [round(x, 5) for x in first["token_logprobs"][1 : len(PROMPT)]] == [
        round(lp.logprob, 5) for lp in offline[1:]
    ]


def test_max_tokens_zero_without_echo_is_still_a_400(server) -> None:
    r = post(server.url, "completions", {"prompt": PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_vllm_prompt_logprobs_field_on_completions_and_chat(server, offline) -> None:
    r = post(server.url, "completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(PROMPT)
    for entry, token, want in zip(got[1:], PROMPT[1:], offline[1:]):
        assert math.isclose(entry[str(token)]["logprob"], want.logprob, abs_tol=1e-5)
        assert entry[str(token)]["rank"] >= 1
        assert sum(1 for e in entry.values() if e["rank"] in (1, 2)) == 2  # the top two are there
    chat = post(
        server.url,
        "chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat.status_code == 200, chat.text
    scored = chat.json()["prompt_logprobs"]
    assert scored[0] is None and len(scored) == chat.json()["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in scored[1:])
    # not asked, not there: replies keep OpenAI's shape
    plain = post(server.url, "completions", {"prompt": PROMPT, "max_tokens": 1}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    plain_chat = post(
        server.url, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    )
    assert "prompt_logprobs" not in plain_chat.json()


@pytest.fixture(scope="module")
def in_process(builtin_path: str) -> Iterator[tuple[str, list[int], list[tuple[str, Any]]]]:
    """The real app over the built-in model's engine (priority scheduling) in a thread of this
    process, on a free port; with the prompt rows the engine scored (each a vocabulary-wide
    log-softmax) and the ids and params of the requests it was given."""
    import deltaserve.engine.engine as engine_module
    from deltaserve import LLM
    from deltaserve.server.app import build_app
    from deltaserve.server.engine_client import EngineClient

    from ...conftest import app_in_thread

    rows: list[int] = []
    added: list[tuple[str, Any]] = []  # the engine ids added, in order, with their params
    record = engine_module.record_prompt_logprobs

    def counted(plan, starts, logits):
        rows.append(logits.shape[0])
        return record(plan, starts, logits)

    engine = LLM(model=builtin_path, dtype="float32", device="cpu", scheduling_policy="priority").engine
    add_request = engine.add_request

    def recorded(request_id: str, prompt_ids: list[int], params: Any, *args, **kwargs):
        added.append((request_id, params))
        args = (prompt_ids, params, *args)
        return add_request(request_id, *args, **kwargs)

    engine.add_request = recorded
    app = build_app(EngineClient.in_thread(engine), model_names=[MODEL_NAME])
    with pytest.MonkeyPatch.context() as patch, app_in_thread(app, join_s=10) as port:
        patch.setattr(engine_module, "record_prompt_logprobs", counted)
        yield f"http://127.0.0.1:{port}", rows, added


LONG = PROMPT * 5  # past two pages: the choices may take it from the prefix cache


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_echo_the_prompt_logprobs_computed_once(in_process, stream: bool) -> None:
    """echo + logprobs with n > 1: every choice echoes n=1's prompt logprobs, which the engine
    computed once for the request (each choice computed them over the whole prompt)."""
    url, rows, _ = in_process
    body = {"prompt": LONG, "max_tokens": 2, "echo": True, "logprobs": 2, "seed": 5, "stream": stream}

    def echoed(n: int) -> list[dict]:
        rows.clear()
        if not stream:
            r = post(url, "completions", {**body, "n": n})
            assert r.status_code == 200, r.text
            return [c["logprobs"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
        firsts: dict[int, dict] = {}
        with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL_NAME, **body, "n": n}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        firsts.setdefault(c["index"], c["logprobs"])
        return [firsts[i] for i in range(n)]

    (single,) = echoed(1)
    assert sum(rows) == len(LONG) - 1
    choices = echoed(3)
    assert sum(rows) == len(LONG) - 1
    for got in choices:
        for name in ("tokens", "token_logprobs", "top_logprobs"):
            assert got[name][: len(LONG)] == single[name][: len(LONG)]


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_echo_each_prompts_logprobs_built_once(in_process, monkeypatch, stream: bool) -> None:
    """echo + logprobs with n > 1 over two prompts: each prompt's echoed logprobs are built once
    for its choices (they were built again for every choice), and every choice still starts with
    its prompt's text and the echo that prompt alone gets, its generated tokens' offsets after it."""
    import deltaserve.server.api.completions as completions

    url, _, _ = in_process
    built: list[int] = []
    build = completions.prompt_completion_logprobs
    monkeypatch.setattr(completions, "prompt_completion_logprobs", lambda *a: built.append(1) or build(*a))
    prompts = [LONG, PROMPT]
    body = {"max_tokens": 3, "echo": True, "logprobs": 2, "seed": 5, "ignore_eos": True, "stream": stream}

    def reply(prompt: str | list[str], n: int) -> list[dict]:
        if not stream:
            r = post(url, "completions", {**body, "prompt": prompt, "n": n})
            assert r.status_code == 200, r.text
            return sorted(r.json()["choices"], key=lambda c: c["index"])
        whole: dict[int, dict] = {}
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={"model": MODEL_NAME, **body, "prompt": prompt, "n": n}
        ) as r:
            for line in r.iter_lines():
                for c in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                    got = whole.setdefault(c["index"], {"text": "", "logprobs": {}})
                    got["text"] += c["text"]
                    for name, values in (c["logprobs"] or {}).items():
                        got["logprobs"].setdefault(name, []).extend(values)
        return [whole[i] for i in sorted(whole)]

    choices = reply(prompts, 3)
    assert len(built) == len(prompts) and len(choices) == 6
    for j, prompt in enumerate(prompts):
        (alone,) = reply(prompt, 1)
        echo = len(prompt)  # PROMPT and LONG are token ids
        echoed_text = "".join(alone["logprobs"]["tokens"][:echo])
        group = choices[3 * j : 3 * j + 3]
        for choice in group:
            lp = choice["logprobs"]
            assert choice["text"].startswith(echoed_text) and alone["text"].startswith(echoed_text)
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                assert lp[name][:echo] == group[0]["logprobs"][name][:echo], name
            for name in ("tokens", "text_offset"):
                assert lp[name][:echo] == alone["logprobs"][name][:echo], name
            # the same scores as the prompt alone, up to a batch's rounding
            assert lp["token_logprobs"][1:echo] == pytest.approx(
                alone["logprobs"]["token_logprobs"][1:echo], abs=1e-4
            )
            assert "".join(lp["tokens"]) == choice["text"] and lp["text_offset"] == sorted(lp["text_offset"])


def test_n_choices_share_vllm_prompt_logprobs_computed_once(in_process) -> None:
    url, rows, _ = in_process
    messages = [{"role": "user", "content": "Hi " * 40}]
    for path, body in (
        ("completions", {"prompt": LONG}),
        ("chat/completions", {"messages": messages}),
    ):
        replies = []
        for n in (1, 4):
            rows.clear()
            r = post(url, path, {**body, "n": n, "max_tokens": 2, "prompt_logprobs": 2, "logprobs": 1})
            assert r.status_code == 200, r.text
            assert sum(rows) == r.json()["usage"]["prompt_tokens"] - 1  # once, whatever n
            replies.append(r.json())
        # the choices started from the prompt that the scoring prefill cached
        assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        single, many = replies
        if path == "completions":
            want = single["choices"][0]["prompt_logprobs"]
            assert [c["prompt_logprobs"] for c in many["choices"]] == [want] * 4
        else:
            assert many["prompt_logprobs"] == single["prompt_logprobs"]
    # SGLang's /generate: input_token_logprobs for each of its n samples
    scored = []
    for n in (1, 3):
        rows.clear()
        body = {
            "input_ids": LONG,
            "sampling_params": {"n": n, "max_new_tokens": 2},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        }
        r = httpx.post(f"{url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert sum(rows) == len(LONG) - 1
        results = r.json() if n > 1 else [r.json()]
        scored.append(
            [(m["meta_info"]["input_token_logprobs"], m["meta_info"]["input_top_logprobs"]) for m in results]
        )
    assert scored[1] == scored[0] * 3


def one_shot(reply: Any) -> bytes:
    """A reply encoded in one go, as FastAPI's JSONResponse encodes a dict."""
    return json.dumps(reply, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def test_n_choices_reply_builds_each_prompts_logprobs_once(in_process, monkeypatch) -> None:
    """n > 1 with prompt_logprobs, echo and logprobs, two prompts, through the openai client: each
    prompt's vLLM prompt_logprobs are built once however many choices carry them (they were built
    for every choice), every choice carries n=1's, its echo agrees with them, and the body is
    the whole reply encoded in one go."""
    import deltaserve.server.api.completions as completions

    url, _, _ = in_process
    built: list[int] = []
    build = completions.vllm_prompt_logprobs
    monkeypatch.setattr(completions, "vllm_prompt_logprobs", lambda *a: built.append(1) or build(*a))
    prompts = [LONG, PROMPT]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        raw = client.completions.with_raw_response.create(
            model=MODEL_NAME,
            prompt=prompts,
            n=4,
            max_tokens=2,
            echo=True,
            logprobs=2,
            seed=5,
            extra_body={"prompt_logprobs": 2},
        )
        assert len(built) == len(prompts)
        body = raw.http_response.content
        assert body == one_shot(json.loads(body))
        assert raw.headers["content-length"] == str(len(body))
        choices = sorted(raw.parse().choices, key=lambda c: c.index)
        assert len(choices) == 8
        for j, prompt in enumerate(prompts):
            single = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=2, extra_body={"prompt_logprobs": 2}
            )
            alone = single.choices[0].model_extra["prompt_logprobs"]
            want = choices[4 * j].model_extra["prompt_logprobs"]
            assert len(want) == len(prompt) and want[0] is None
            # the same scores as the prompt alone (a batch of two may round a near tie's rank apart)
            for i in range(1, len(prompt)):
                token = str(prompt[i])
                assert math.isclose(want[i][token]["logprob"], alone[i][token]["logprob"], rel_tol=1e-5)
            for choice in choices[4 * j : 4 * j + 4]:
                assert choice.model_extra["prompt_logprobs"] == want
                echoed = choice.logprobs.token_logprobs[1 : len(prompt)]
                assert echoed == [want[i][str(prompt[i])]["logprob"] for i in range(1, len(prompt))]


def test_generate_n_samples_build_the_prompts_logprobs_once(in_process, monkeypatch) -> None:
    """/generate with n > 1 and logprob_start_len: the prompt's input_top_logprobs are built once
    for its samples (they were built for each), each sample carries n=1's, and the body is the
    whole reply encoded in one go."""
    from deltaserve.server.api.generate import NativeGeneration

    url, _, _ = in_process
    tops: list[int] = []
    top = NativeGeneration._top
    monkeypatch.setattr(NativeGeneration, "_top", lambda self, *a: tops.append(1) or top(self, *a))
    body: dict[str, Any] = {
        "input_ids": LONG,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    replies = []
    for n in (1, 3):
        tops.clear()
        r = httpx.post(
            f"{url}/generate",
            json={**body, "sampling_params": {"n": n, "max_new_tokens": 2, "ignore_eos": True}},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.content == one_shot(r.json())
        # the prompt's scored rows (all but the first) once, then each sample's two tokens
        assert len(tops) == len(LONG) - 1 + 2 * n
        replies.append(r.json() if n > 1 else [r.json()])
    fields = ("input_token_logprobs", "input_top_logprobs")
    (want,) = [[m["meta_info"][f] for f in fields] for m in replies[0]]
    assert [[m["meta_info"][f] for f in fields] for m in replies[1]] == [want] * 3


def test_the_shared_scoring_prefill_runs_under_the_clients_name(in_process) -> None:
    """The prefill that computes n > 1 choices' prompt logprobs, before they run, is named after
    the request as they are (/abort_request, by the client's name, ends it too), and runs at
    their priority."""
    from deltaserve.server.api.request_params import rid_prefix

    url, _, added = in_process
    added.clear()
    body = {
        "prompt": LONG,
        "n": 2,
        "max_tokens": 1,
        "prompt_logprobs": 1,
        "request_id": "mine",
        "priority": -3,
    }
    r = post(url, "completions", body)
    assert r.status_code == 200, r.text
    assert len(added) == 3 and all(rid.startswith(rid_prefix("mine")) for rid, _ in added), added
    assert [params.priority for _, params in added] == [-3] * 3  # as urgent as its choices


def test_a_prefix_warm_up_runs_at_its_choices_priority_and_name(in_process) -> None:
    """The prefill that warms a prompt for its n > 1 choices, which wait for it, runs at their
    priority (it ran at 0, behind the requests that the choices' priority put after them) and
    under the client's name for the request (/abort_request ends it; it ran on, unnamed)."""
    from deltaserve.server.api.request_params import rid_prefix

    url, _, added = in_process
    added.clear()
    body = {"prompt": LONG, "n": 2, "max_tokens": 1, "priority": -3, "request_id": "urgent"}
    r = post(url, "completions", body)
    assert r.status_code == 200, r.text
    assert len(added) == 3 and [params.priority for _, params in added] == [-3] * 3
    assert all(rid.startswith(rid_prefix("urgent")) for rid, _ in added), added


def test_prompt_only_request_may_fill_the_context(server, client, max_model_len: int, until_idle) -> None:
    """max_tokens 0 generates nothing: a prompt of exactly --max-model-len tokens is scored, not refused."""
    prompt = [PROMPT[i % len(PROMPT)] for i in range(max_model_len)]
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=0, extra_body={"prompt_logprobs": 1}
    )
    choice = out.choices[0]
    scored = choice.model_extra["prompt_logprobs"]
    assert choice.text == "" and choice.finish_reason == "length"
    assert len(scored) == max_model_len and scored[0] is None and all(scored[1:])
    assert out.usage.prompt_tokens == max_model_len and out.usage.completion_tokens == 0
    # one token more, or a token to generate, is still the context's 400
    for extra, max_tokens in ((1, 0), (0, 1)):
        with pytest.raises(openai.BadRequestError, match="context length"):
            client.completions.create(
                model=MODEL_NAME,
                prompt=prompt + PROMPT[:extra],
                max_tokens=max_tokens,
                extra_body={"prompt_logprobs": 1},
            )
    assert until_idle(server.url)["deltaserve_kv_pages_used"] == 0
