"""SGLang's native /generate on a real server (built-in model): its request and reply shapes, the
same tokens as /v1/completions for the same parameters, batches and n, streams, log-probabilities,
stop reasons and refusals."""

from __future__ import annotations

import json

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def generate(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/generate", json=body, timeout=60)


def completion(server, prompt, **fields) -> dict:
    body = {"model": MODEL_NAME, "prompt": prompt, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()


def test_one_prompt_matches_the_completions_endpoint(server) -> None:
    r = generate(server, text="The capital of France is", sampling_params=GREEDY, rid="mine")
    assert r.status_code == 200, r.text
    out = completion(
        server, "The capital of France is", max_tokens=8, logprobs=0, return_tokens_as_token_ids=True
    )
    ids = [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]
    body = r.json()
    assert body["text"] == out["choices"][0]["text"] and body["output_ids"] == ids
    meta = body["meta_info"]
    assert meta["id"] == "mine" and meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] == out["usage"]["prompt_tokens"] and meta["completion_tokens"] == 8
    assert 0 <= meta["cached_tokens"] <= meta["prompt_tokens"] and meta["e2e_latency"] > 0


def test_a_batch_with_n_comes_back_prompt_by_prompt(server) -> None:
    prompts = [[5, 9, 17], [40, 2, 8, 8]]
    r = generate(
        server, input_ids=prompts, sampling_params=[{**GREEDY, "n": 2}, {**GREEDY, "max_new_tokens": 3}]
    )
    results = r.json()
    assert r.status_code == 200 and [len(x["output_ids"]) for x in results] == [8, 8, 3]
    assert results[0]["output_ids"] == results[1]["output_ids"]  # greedy samples of one prompt
    for got, prompt, n in zip(results, [prompts[0], prompts[0], prompts[1]], [8, 8, 3]):
        alone = completion(server, prompt, max_tokens=n)
        assert got["text"] == alone["choices"][0]["text"] and got["meta_info"]["prompt_tokens"] == len(prompt)
    assert len({x["meta_info"]["id"] for x in results}) == 3


def test_a_stream_sends_the_text_so_far_and_ends_as_the_whole(server) -> None:
    whole = generate(server, input_ids=[5, 9, 17], sampling_params=GREEDY).json()
    with httpx.stream(
        "POST",
        f"{server.url}/generate",
        json={"input_ids": [5, 9, 17], "sampling_params": GREEDY, "stream": True},
    ) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each the text so far
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_log_probabilities_of_the_output_and_the_prompt(server) -> None:
    prompt = [5, 9, 17, 3, 88]
    r = generate(
        server, input_ids=prompt, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2,
        logprob_start_len=1, return_text_in_logprobs=True,
    ).json()  # fmt: skip
    meta = r["meta_info"]
    out = completion(server, prompt, max_tokens=8, logprobs=2, echo=True, return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    given = lp["token_logprobs"][len(prompt) :]
    assert [e[1] for e in meta["output_token_logprobs"]] == r["output_ids"]
    assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx(given, abs=1e-4)
    assert all(isinstance(e[2], str) for e in meta["output_token_logprobs"])
    assert all(len(top) == 2 and top[0][0] >= top[1][0] for top in meta["output_top_logprobs"])
    # the prompt from position 1: its log-probabilities as the completions endpoint echoes them
    assert [e[1] for e in meta["input_token_logprobs"]] == prompt[1:]
    assert [e[0] for e in meta["input_token_logprobs"]] == pytest.approx(
        lp["token_logprobs"][1 : len(prompt)], abs=1e-4
    )


def _floats_apart(value):
    """(the floats of a nested list, the list with each float as "f"): to compare the rest exactly."""
    if isinstance(value, float):
        return [value], "f"
    if isinstance(value, list):
        parts = [_floats_apart(v) for v in value]
        return [f for floats, _ in parts for f in floats], [shape for _, shape in parts]
    return [], value


def test_a_stream_carries_the_prompt_log_probabilities(server) -> None:
    """logprob_start_len in a stream: its events carry the prompt's log-probabilities (and the
    asked ids') as the unstreamed reply does, as SGLang streams them; it was a 400."""
    body = {
        "input_ids": [5, 9, 17, 3, 88], "sampling_params": GREEDY, "return_logprob": True,
        "top_logprobs_num": 2, "logprob_start_len": 1, "token_ids_logprob": [11, 42],
    }  # fmt: skip
    whole = generate(server, **body).json()
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["output_ids"] == whole["output_ids"]
    assert len(last["meta_info"]["input_token_logprobs"]) == 4
    for key in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
        got, want = _floats_apart(last["meta_info"][key]), _floats_apart(whole["meta_info"][key])
        assert got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-4), key


@pytest.mark.slow
def test_token_ids_logprob_at_the_output_and_the_prompt(server, builtin_path) -> None:
    """SGLang's token_ids_logprob: each position's log-probabilities of the asked ids, in their
    order, as the offline engine computes them; the output's own token, asked, is its logprob."""
    from deltaserve import LLM, SamplingParams

    prompt, asked = [5, 9, 17, 3, 88], [11, 42, 7]
    r = generate(
        server, input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
        token_ids_logprob=asked,
    ).json()  # fmt: skip
    meta = r["meta_info"]
    llm = LLM(builtin_path, device="cpu", max_model_len=512)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=0,
        prompt_logprobs=0,
        logprob_token_ids=asked,
        prompt_logprob_token_ids=asked,
    )
    want = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    got = meta["output_token_ids_logprobs"]
    assert [[e[1] for e in row] for row in got] == [asked] * 8
    assert [[e[0] for e in row] for row in got] == [
        pytest.approx(list(lp.asked.values()), abs=1e-4) for lp in want.outputs[0].logprobs
    ]
    assert meta["input_token_ids_logprobs"][0] is None  # nothing before the first token
    assert [[e[0] for e in row] for row in meta["input_token_ids_logprobs"][1:]] == [
        pytest.approx(list(lp.asked.values()), abs=1e-4) for lp in want.prompt_logprobs[1:]
    ]
    bad = generate(server, input_ids=prompt, sampling_params=GREEDY, token_ids_logprob=asked)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids_logprob"
    # as many as the top logprobs at most: each asked id is reported at every prompt position
    many = generate(
        server, input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
        token_ids_logprob=list(range(21)),
    )  # fmt: skip
    assert many.status_code == 400 and many.json()["error"]["param"] == "token_ids_logprob"
    assert "at most 20" in many.json()["error"]["message"]


def test_a_stop_string_is_the_matched_reason(server) -> None:
    free = generate(server, input_ids=[5, 9, 17], sampling_params={**GREEDY, "max_new_tokens": 12}).json()[
        "text"
    ]
    stop = free[4:7]
    r = generate(
        server, input_ids=[5, 9, 17], sampling_params={**GREEDY, "max_new_tokens": 12, "stop": [stop]}
    ).json()
    assert r["text"] == free[: free.index(stop)]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "hi", "input_ids": [1, 2]}, "text"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": -3}}, "sampling_params.max_new_tokens"),
        ({"text": "hi", "sampling_params": {"temperature": 9}}, "temperature"),
        ({"text": "hi", "sampling_params": {"frobnicate": 1}}, "sampling_params.frobnicate"),
        ({"text": "hi", "sampling_params": {"regex": "a+", "json_schema": "{}"}}, "sampling_params"),
        ({"text": "hi", "image_data": "cat.png"}, "image_data"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a"], "sampling_params": []}, "sampling_params"),  # no entry, not the defaults
        ({"text": "hi", "priority": 3}, "priority"),  # the server runs fcfs
        ({"text": "hi", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
        # a prompt's logprobs from a position it does not have: SGLang refuses them too
        ({"input_ids": [5, 9, 17], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
        ({"input_ids": [5, 9, 17], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
        ({"input_ids": [[5, 9], [17]], "return_logprob": True, "logprob_start_len": 1}, "logprob_start_len"),
        ({"input_ids": [5, 9, 17], "logprob_start_len": -7}, "logprob_start_len"),
        # one rid for two prompts: their replies' ids and /abort_request could not tell them apart
        ({"text": ["a", "b"], "rid": ["job", "job"]}, "rid"),
        ({"text": ["a", "b"], "rid": "job"}, "rid"),
    ],
)
def test_refusals_are_400s_naming_the_field(server, read_metrics, body: dict, param: str) -> None:
    before = read_metrics(server.url)["deltaserve_prompt_tokens_total"]
    r = generate(server, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert read_metrics(server.url)["deltaserve_prompt_tokens_total"] == before  # nothing admitted


def test_a_prompts_last_position_and_distinct_rids_are_served(server) -> None:
    r = generate(
        server, input_ids=[5, 9, 17], sampling_params=GREEDY, return_logprob=True, logprob_start_len=2
    ).json()
    assert [row[1] for row in r["meta_info"]["input_token_logprobs"]] == [17]
    batch = generate(server, text=["a", "b"], rid=["job-a", "job-b"], sampling_params=GREEDY).json()
    assert [r["meta_info"]["id"] for r in batch] == ["job-a", "job-b"]


def test_regex_constrains_the_text(server) -> None:
    r = generate(
        server, text="Answer:", sampling_params={"temperature": 1.0, "max_new_tokens": 8, "regex": "(yes|no)"}
    )
    assert r.status_code == 200 and r.json()["text"] in ("yes", "no")


def test_sglang_health_generate_and_model_info(server, read_metrics, until_idle) -> None:
    """/health_generate runs a one-token request through the engine, left out of the request
    metrics and the token counters; /get_model_info names the checkpoint as /v1/models does."""
    until_idle(server.url)
    before = read_metrics(server.url)
    for _ in range(3):
        r = httpx.get(f"{server.url}/health_generate", timeout=60)
        assert r.status_code == 200 and r.json() == {"status": "ok"}
    after = until_idle(server.url)
    tokens = [
        f"deltaserve_{k}_tokens_total" for k in ("prompt", "prefill", "generation", "prefix_cache_query")
    ]
    counted = [k for k in before if k.startswith("deltaserve_time_to_first_token_seconds_count")]
    assert counted and all(after[k] == before[k] for k in counted + tokens), {
        k: (before[k], after[k]) for k in counted + tokens
    }
    info = httpx.get(f"{server.url}/get_model_info").json()
    card = httpx.get(f"{server.url}/v1/models").json()["data"][0]
    assert info["model_path"] == card["root"] and info["is_generation"] is True
    assert info["served_model_names"] == [MODEL_NAME] and info["architectures"][0]


def test_a_grammar_that_ends_matches_its_stop_token(server) -> None:
    """An EBNF grammar complete after "a" ends on the stop token it allows: SGLang's matched id."""
    r = generate(server, text="Say:", sampling_params={"max_new_tokens": 6, "ebnf": 'root ::= "a"'}).json()
    assert r["text"] == "a"
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": r["output_ids"][-1]}
