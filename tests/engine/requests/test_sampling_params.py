"""SamplingParams built in Python (the offline LLM's way, without the server's JSON validation):
a count given as a float, a bool or a string is refused at once, naming the field, instead of
being used as a number (2.5 tokens) or failing deep inside a step."""

from __future__ import annotations

import pytest

from deltaserve.engine.errors import InvalidParamError
from deltaserve.engine.requests.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("logprobs", True),
        ("logprobs", 2.0),
        ("prompt_logprobs", 1.5),
        ("max_tokens", 2.5),
        ("min_tokens", 1.0),
        ("n", "2"),
        ("top_k", 0.5),
        ("seed", 1.5),
        ("priority", False),
    ],
)
def test_a_count_that_is_not_an_integer_is_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidParamError, match=f"{field} must be an integer") as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_for_logprobs_is_refused_with_the_number_to_give(field: str, value: bool) -> None:
    """True is not read as 1, nor False as 0 (which would turn them on): the message says what
    the number means, for a user used to the chat API's boolean `logprobs`."""
    with pytest.raises(InvalidParamError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert f"got {value}: the number of top log-probabilities" in str(info.value)
    assert "0: that one alone; None, the default: none" in str(info.value)


def test_whole_numbers_and_none_pass() -> None:
    params = SamplingParams(
        n=2, top_k=-1, seed=7, max_tokens=None, min_tokens=1, logprobs=0, prompt_logprobs=3
    )
    assert (params.n, params.top_k, params.max_tokens, params.logprobs) == (2, 0, None, 0)


def test_structured_outputs_may_come_as_a_dict_of_their_fields() -> None:
    from deltaserve.engine.requests.sampling_params import StructuredOutputs

    params = SamplingParams(structured_outputs={"regex": "a+", "after_token": 5})
    assert params.structured_outputs == StructuredOutputs(regex="a+", after_token=5)
    with pytest.raises(InvalidParamError, match="no field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_vllms_no_seed_and_output_kind_enum() -> None:
    """vLLM's seed -1 is no seed; its RequestOutputKind members name the output kinds."""
    import enum

    class RequestOutputKind(enum.Enum):  # vLLM's enum, as a script imports it from vllm.sampling_params
        CUMULATIVE = 0
        DELTA = 1
        FINAL_ONLY = 2

    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY).output_kind == "final_only"
    assert SamplingParams(output_kind=RequestOutputKind.DELTA).output_kind == "delta"


def test_vllms_request_output_kind_and_clone_come_from_deltaserve() -> None:
    """`RequestOutputKind` imports from deltaserve (a script need not install vLLM for it), and
    `SamplingParams.clone()` gives a copy whose lists change without changing the original's."""
    from deltaserve import RequestOutputKind

    params = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, stop=["x"], logit_bias={5: 1.0})
    assert params.output_kind == "final_only"
    clone = params.clone()
    assert clone == params and clone is not params
    clone.stop.append("y")
    clone.logit_bias[6] = 2.0  # type: ignore[index]
    assert params.stop == ["x"] and params.logit_bias == {5: 1.0}


@pytest.mark.parametrize("salt", ["", 5])
def test_cache_salt_is_a_non_empty_string(salt) -> None:
    """vLLM's rule for cache_salt (its server's 400): an empty salt would silently mean none."""
    with pytest.raises(InvalidParamError, match="cache_salt must be a non-empty string") as info:
        SamplingParams(cache_salt=salt)
    assert info.value.param == "cache_salt"
