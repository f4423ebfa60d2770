"""Sampling defaults from generation_config.json: read, validated, and used only where a request
leaves a field unset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltaserve.engine.requests.generation_defaults import SamplingDefaults, load_sampling_defaults
from deltaserve.server.api.request_params import build_sampling_params
from deltaserve.server.cli import build_parser
from deltaserve.server.errors import APIError
from deltaserve.server.protocol import ChatCompletionRequest

QWEN35 = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "eos_token_id": [1, 2]}


def folder(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def params(defaults: SamplingDefaults, **fields):
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
    return build_sampling_params(req, prompt_len=4, max_model_len=1000, defaults=defaults)


def test_auto_reads_the_model_folder_and_none_ignores_it(tmp_path: Path) -> None:
    model = folder(tmp_path, {**QWEN35, "repetition_penalty": 1.05, "min_p": 0.0, "max_new_tokens": 300})
    auto = load_sampling_defaults("auto", model)
    assert (auto.temperature, auto.top_p, auto.top_k, auto.repetition_penalty) == (0.6, 0.95, 20, 1.05)
    assert auto.max_tokens == 300 and auto.changed() == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 300,
    }
    assert load_sampling_defaults("none", model) == SamplingDefaults()
    assert load_sampling_defaults("vllm", model) == SamplingDefaults()
    assert load_sampling_defaults("auto", tmp_path / "missing") == SamplingDefaults()


def test_unset_fields_take_the_defaults_set_ones_win(tmp_path: Path) -> None:
    defaults = load_sampling_defaults("auto", folder(tmp_path, {**QWEN35, "max_new_tokens": 50}))
    p = params(defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.95, 20, 0.0, 50)
    p = params(defaults, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=7)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 1.0, 0, 7)
    p = params(SamplingDefaults())  # OpenAI's defaults, up to the context
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (1.0, 1.0, 0, 1000 - 4)


def test_out_of_range_values_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="top_p"):
        load_sampling_defaults("auto", folder(tmp_path, {"top_p": 0.0}))
    with pytest.raises(ValueError, match="temperature"):
        load_sampling_defaults("auto", folder(tmp_path, {"temperature": 3}))
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_sampling_defaults("auto", tmp_path)


def test_values_of_the_wrong_type_are_left_out_and_named(tmp_path: Path) -> None:
    """A string, a list or a bool where a number belongs is not guessed at: left out (the usual
    default stays) and named in the start-up warning; null is no value, and says nothing."""
    config = {"temperature": "0.7", "top_p": 0.9, "top_k": [20], "min_p": None, "max_new_tokens": True}
    config["repetition_penalty"] = float("nan")  # Python's json reads and writes NaN
    defaults = load_sampling_defaults("auto", folder(tmp_path, config))
    assert defaults.changed() == {"top_p": 0.9}
    assert defaults.ignored == (
        'temperature = "0.7" (not a number)',
        "repetition_penalty = NaN (not finite)",
        "top_k = [20] (not an integer)",
        "max_new_tokens = true (not a positive integer)",
    )
    warning = defaults.warning()
    assert warning is not None and all(name in warning for name in ("temperature", "top_k", "max_new_tokens"))
    clean = load_sampling_defaults("auto", folder(tmp_path, {**QWEN35, "min_p": None}))
    assert clean.ignored == () and clean.warning() is None


def test_flag_checks_its_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "good").mkdir()
    (tmp_path / "bad").mkdir()
    good = folder(tmp_path / "good", QWEN35)
    bad = folder(tmp_path / "bad", {"top_k": 5, "min_p": 2})
    assert build_parser().parse_args(["serve", "--generation-config", str(good)]).generation_config == str(
        good
    )
    assert build_parser().parse_args(["serve"]).generation_config == "auto"
    for wrong in (tmp_path / "nowhere", bad):
        with pytest.raises(SystemExit) as exit_info:
            build_parser().parse_args(["serve", "--generation-config", str(wrong)])
        assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no generation_config.json" in err and "min_p" in err


def test_a_request_still_gets_a_clear_error_for_its_own_values() -> None:
    with pytest.raises(APIError) as info:
        params(SamplingDefaults(temperature=0.6), temperature=2.5)
    assert (info.value.status, info.value.param) == (400, "temperature")


@pytest.mark.slow
def test_served_requests_take_the_folder_defaults(tmp_path: Path, spawn_server, model_name: str) -> None:
    """A real server with a generation config of temperature 0 and 5 new tokens: a request that sets
    neither is greedy (n > 1 refused, as for an explicit temperature 0; its reply that of one) and 5
    long; one that sets them gets what it asked for. Fields of the wrong type are warned of, once."""
    import openai

    server = spawn_server(
        "--max-model-len",
        "256",
        "--generation-config",
        str(folder(tmp_path, {"temperature": 0.0, "max_new_tokens": 5, "top_p": "0.9", "top_k": [20]})),
    )
    assert (
        "sampling defaults from generation_config.json" in server.log() and "temperature=0.0" in server.log()
    )
    warned = [line for line in server.log().splitlines() if "WARNING" in line and "generation_config" in line]
    assert len(warned) == 1 and 'top_p = "0.9"' in warned[0] and "top_k = [20]" in warned[0], warned
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Count to ten."}]
    extra = {"ignore_eos": True}
    # the default temperature 0 is greedy: n > 1 is then a 400, as vLLM's merged defaults give it
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model_name, messages=messages, n=3, extra_body=extra)
    assert refused.value.body["param"] == "n"
    plain = client.chat.completions.create(model=model_name, messages=messages, extra_body=extra)
    assert plain.usage.completion_tokens == 5
    greedy = client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, extra_body=extra
    )
    assert greedy.choices[0].message.content == plain.choices[0].message.content
    own = client.chat.completions.create(
        model=model_name, messages=messages, n=3, temperature=1.0, max_tokens=8, seed=1, extra_body=extra
    )
    assert own.usage.completion_tokens == 3 * 8 and len({c.message.content for c in own.choices}) > 1
