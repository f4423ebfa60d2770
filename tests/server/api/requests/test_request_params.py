"""One validator: SamplingParams refuses bad values for the offline API and the server alike, and
the server's 400 names the field as the request spelled it."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from deltaserve.engine.errors import InvalidParamError
from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.server.api.generation import usage_of
from deltaserve.server.api.request_params import build_sampling_params, fan_out
from deltaserve.server.errors import APIError
from deltaserve.server.protocol import ChatCompletionRequest, CompletionRequest

VOCAB = 1000


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest(prompt="hi", **fields)


def refusal(req: ChatCompletionRequest | CompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        build_sampling_params(req, prompt_len=4, max_model_len=1000, vocab_size=VOCAB)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(
    "req,param,value",
    [
        (chat(n=129), "n", "129"),
        (completion(temperature=2.5), "temperature", "2.5"),
        (chat(top_p=0.0), "top_p", "0"),
        (chat(min_p=1.5), "min_p", "1.5"),
        (completion(presence_penalty=-3.0), "presence_penalty", "-3"),
        (chat(top_k=-5), "top_k", "-5"),
        (chat(repetition_penalty=0.0), "repetition_penalty", "0"),
        (chat(seed=2**63), "seed", str(2**63)),
        (completion(stop=["end", ""]), "stop", "empty"),
        (chat(stop_token_ids=[VOCAB]), "stop_token_ids", str(VOCAB)),
        (chat(logit_bias={"-3": 1.0}), "logit_bias", "-3"),
        (chat(logit_bias={str(VOCAB + 5): 1.0}), "logit_bias", str(VOCAB + 5)),
        (completion(logprobs=21), "logprobs", "21"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs", "21"),
        (chat(top_logprobs=1), "top_logprobs", "logprobs"),  # alternatives of no logprobs
        (chat(prompt_logprobs=-1), "prompt_logprobs", "-1"),
        (chat(prompt_logprobs=1, stream=True), "prompt_logprobs", "stream"),
        (completion(prompt_logprobs=2, stream=True), "prompt_logprobs", "stream"),
        (chat(stream_options={"include_usage": True}), "stream_options", "stream"),
        (completion(stream=False, stream_options={"include_usage": False}), "stream_options", "stream"),
        (chat(max_tokens=0), "max_tokens", "0"),
        (chat(max_tokens=0, echo=True), "max_tokens", "0"),  # a chat echo's scoring allows no 0
        (chat(max_completion_tokens=-2), "max_completion_tokens", "-2"),
        (completion(max_tokens=4, min_tokens=9), "min_tokens", "9"),
        (chat(structured_outputs={"choice": []}), "structured_outputs", "choice"),
        # a JSON value of the wrong type is named, not read as something else
        (chat(structured_outputs={"choice": "abc"}), "structured_outputs", "choice"),
        (chat(structured_outputs={"choice": {"a": 1}}), "structured_outputs", "choice"),
        (completion(structured_outputs={"regex": 123}), "structured_outputs", "regex"),
        (chat(structured_outputs={"grammar": ['root ::= "a"']}), "structured_outputs", "grammar"),
        (chat(structured_outputs={"json_object": "yes"}), "structured_outputs", "json_object"),
        (chat(structured_outputs={"json": 5}), "structured_outputs", "json"),
    ],
)
def test_a_bad_value_is_a_400_naming_the_field_as_sent(req: Any, param: str, value: str) -> None:
    err = refusal(req)
    assert err.param == param, err.message
    assert err.message.startswith(param) or param.replace("_", " ") in err.message, err.message
    assert value in err.message


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 129),
        ("temperature", 2.5),
        ("top_k", -5),
        ("seed", 2**63),
        ("stop", [""]),
        ("logprobs", 21),
        ("logit_bias", {7: float("nan")}),
        ("max_tokens", 0),
    ],
)
def test_the_offline_api_refuses_what_the_server_refuses(field: str, value: Any) -> None:
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and isinstance(info.value, ValueError)


def test_the_edges_of_each_range_are_served() -> None:
    params = build_sampling_params(
        chat(n=128, temperature=2.0, top_p=1.0, top_k=-1, seed=2**63 - 1, logprobs=True, top_logprobs=20),
        prompt_len=4,
        max_model_len=1000,
        vocab_size=VOCAB,
    )
    assert (params.n, params.temperature, params.top_k, params.logprobs) == (128, 2.0, 0, 20)
    # vLLM's server clamps a bias to [-100, 100] rather than refusing it (the offline API adds it as given)
    biased = build_sampling_params(chat(logit_bias={"7": 250.0, "8": -1e9}), prompt_len=4, max_model_len=1000)
    assert biased.logit_bias == {7: 100.0, 8: -100.0}
    # vLLM's floor: a positive temperature below 0.01 samples at 0.01, on the server as offline
    cold = build_sampling_params(completion(temperature=0.001), prompt_len=4, max_model_len=1000)
    assert cold.temperature == 0.01 and not cold.greedy
    echo = build_sampling_params(completion(echo=True, max_tokens=0), prompt_len=4, max_model_len=1000)
    assert echo.max_tokens == 0 and echo.prompt_logprobs == 0
    # vLLM's: top_logprobs 0 asks for nothing, so it needs no logprobs (a client that sends its default)
    for logprobs in (None, False):
        quiet = build_sampling_params(
            chat(logprobs=logprobs, top_logprobs=0), prompt_len=4, max_model_len=1000
        )
        assert quiet.logprobs is None


@pytest.mark.parametrize(
    "req,name,why",
    [
        (completion(stream=True, max_tokens=0, prompt_logprobs=0), "max_tokens", "a stream reports no"),
        (chat(stream=True, max_completion_tokens=0, prompt_logprobs=0), "max_completion_tokens", "a stream"),
        (chat(use_beam_search=True, n=2, temperature=0, max_tokens=0), "max_tokens", "use_beam_search"),
    ],
)
def test_max_tokens_zero_where_no_prompt_logprobs_are_reported_says_so(req: Any, name: str, why: str) -> None:
    """A stream's prompt_logprobs 0 is dropped, and beam search takes none: "0 only with
    prompt_logprobs" would tell the client to send what it sent, or what is refused."""
    error = refusal(req)
    assert error.param == name and why in error.message and "0 only with" not in error.message
    assert error.message.startswith(f"{name} must be at least 1")
    # a streamed echo scores its prompt: max_tokens 0 is served there
    echo = build_sampling_params(
        completion(stream=True, echo=True, max_tokens=0), prompt_len=4, max_model_len=9
    )
    assert echo.max_tokens == 0 and echo.prompt_logprobs == 0


def test_an_invalid_param_error_keeps_its_field_across_processes() -> None:
    back = pickle.loads(pickle.dumps(InvalidParamError("top_k must be ...", "top_k")))
    assert type(back) is InvalidParamError and back.param == "top_k" and str(back) == "top_k must be ..."


def test_fan_out_makes_one_single_choice_request_per_choice_with_distinct_seeds() -> None:
    params = build_sampling_params(chat(n=3, seed=7), prompt_len=4, max_model_len=1000)
    requests = fan_out("chatcmpl-x", [1, 2, 3, 4], params)
    assert [rid for rid, _, _ in requests] == ["chatcmpl-x-0", "chatcmpl-x-1", "chatcmpl-x-2"]
    assert [(p.n, p.seed) for _, _, p in requests] == [(1, 7), (1, 8), (1, 9)]
    # the largest seed a client may send: its choices' seeds wrap within 64 bits, not a 400
    top = build_sampling_params(chat(n=3, seed=2**63 - 1), prompt_len=4, max_model_len=1000)
    seeds = [p.seed for _, _, p in fan_out("chatcmpl-y", [1], top)]
    assert seeds == [2**63 - 1, -(2**63), -(2**63) + 1]


def output(request_id: str, tokens: int, cached: int) -> RequestOutput:
    done = CompletionOutput(index=0, token_ids=[5] * tokens, text="x" * tokens, finish_reason="length")
    return RequestOutput(request_id, [1], [done], finished=True, num_cached_tokens=cached)


def test_usage_counts_each_prompts_cache_hits_once() -> None:
    # two prompts of 10 tokens, two choices each: the choices of a prompt share its cached tokens
    outputs = [output("cmpl-a-0-0", 3, 8), output("cmpl-a-0-1", 2, 8), output("cmpl-a-1-0", 4, 0)]
    outputs.append(output("cmpl-a-1-1", 1, 6))
    usage = usage_of(20, outputs)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (20, 10, 30)
    assert usage.prompt_tokens_details.cached_tokens == 14
    assert usage_of(5, [output("chatcmpl-b-0", 1, 9)]).prompt_tokens_details.cached_tokens == 5
