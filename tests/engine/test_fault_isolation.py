"""A fault that belongs to one request fails that request alone: the others in its step sample
as they would have without it, and every page and slot is freed."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams

GOOD = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> str:
    return make_checkpoint("qwen3_next")


def make_engine(path: str, overlap: bool) -> Engine:
    cfg = EngineConfig(
        model=path,
        dtype="float32",
        device="cpu",
        chunked_prefill_size=512,
        max_running_requests=16,
        max_model_len=256,
        enable_overlap_schedule=overlap,
    )
    return Engine(cfg)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    lengths = (3, 9, 17, 30, 5, 41, 12, 8, 22, 2)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in lengths]


def run(engine: Engine, bad: dict | None = None, params: SamplingParams | None = None) -> dict:
    """The ten good requests (and, with `bad`, an eleventh whose params are corrupted after
    add_request's checks, as a bug past validation would; with `params`, an eleventh with
    those): each one's final output."""
    for i, p in enumerate(prompts()):
        engine.add_request(f"good-{i}", p, GOOD)
    if bad is not None or params is not None:
        params = params or SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5)
        engine.add_request("bad", [7, 8, 9, 10], params)
        for name, value in (bad or {}).items():
            setattr(engine.requests["bad"].params, name, value)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for out in engine.step():  # anything queued after the last step
        done[out.request_id] = out
    return done


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert (s["running"], s["waiting"], s["kv_pages_used"], s["state_slots_used"]) == (0, 0, 0, 0), s
    assert not engine.requests


@pytest.mark.parametrize(
    "bad, overlap",
    [
        ({"stop_token_ids": [10**12]}, False),  # min_tokens bans an id past the vocabulary
        ({"stop_token_ids": [2**70]}, False),  # ... or one that no int64 holds
        ({"logit_bias": {10**12: 5.0}}, True),  # a bias needs no host data: the step overlaps
        ({"logit_bias": {10**12: 5.0}}, False),
    ],
)
@pytest.mark.slow
def test_a_bad_request_fails_alone(checkpoint, bad: dict, overlap: bool) -> None:
    engine = make_engine(checkpoint, overlap)
    reference = run(engine)
    assert_idle(engine)
    done = run(engine, bad)
    failed = done.pop("bad").outputs[0]
    assert failed.finish_reason == "error" and failed.error and failed.token_ids == []
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == {
        rid: out.outputs[0].token_ids for rid, out in reference.items()
    }
    assert all(len(out.outputs[0].token_ids) == 12 for out in done.values())
    assert_idle(engine)
    # the engine goes on serving
    again = run(engine)
    assert {rid: o.outputs[0].token_ids for rid, o in again.items()} == {
        rid: o.outputs[0].token_ids for rid, o in reference.items()
    }


def test_engine_refuses_stop_ids_outside_the_vocabulary(checkpoint) -> None:
    engine = make_engine(checkpoint, False)
    for ids in ([engine.vocab_size], [10**12], [2**70], [-1]):
        with pytest.raises(ValueError, match="stop_token_ids"):
            engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=ids))
    for name in ("temperature", "top_p", "presence_penalty"):
        params = SamplingParams(max_tokens=4)
        setattr(params, name, float("nan"))
        with pytest.raises(ValueError, match=name):
            engine.add_request("x", [1, 2, 3], params)
    assert_idle(engine)


# parameters that together forbid every token at some output position (valid one by one)
EMPTYING = {
    "allowed-vs-min_tokens": ({"allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 3}, 1),
    "allowed-vs-bad_words": ({"allowed_token_ids": [5, 6], "bad_words_token_ids": [[5], [6]]}, 1),
    # 9 first (5 stops, before min_tokens), then "9 9" is a bad word: nothing at the second
    "all-three": (
        {
            "allowed_token_ids": [9, 5],
            "bad_words_token_ids": [[9, 9]],
            "stop_token_ids": [5],
            "min_tokens": 4,
        },
        2,
    ),
}


@pytest.mark.parametrize("temperature", [0.0, pytest.param(1.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("case", sorted(EMPTYING))
def test_masks_that_forbid_every_token_fail_that_request_alone(
    checkpoint, case: str, overlap: bool, temperature: float
) -> None:
    """Masks that leave no token (allowed_token_ids, bad words, min_tokens' ban on stop tokens)
    end their request with an error its client may read, naming them and the position, instead
    of sampling a token they forbid; the others in its steps sample as they would have."""
    masks, position = EMPTYING[case]
    engine = make_engine(checkpoint, overlap)
    reference = run(engine)
    params = SamplingParams(temperature=temperature, seed=1, max_tokens=12, **masks)
    done = run(engine, params=params)
    failed = done.pop("bad").outputs[0]
    assert failed.finish_reason == "error" and failed.bad_input, failed
    assert f"at output token {position}:" in failed.error
    named = {
        "allowed_token_ids": "allowed_token_ids",
        "bad_words_token_ids": "bad_words",
        "min_tokens": "min_tokens",
    }
    assert all(named[name] in failed.error for name in masks if name in named), failed.error
    assert failed.token_ids == [9] * (position - 1)  # what the masks allowed before, and nothing forbidden
    assert {rid: out.outputs[0].token_ids for rid, out in done.items()} == {
        rid: out.outputs[0].token_ids for rid, out in reference.items()
    }
    assert_idle(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_offline_llm_serves_on_after_a_step_that_raised(checkpoint, monkeypatch, overlap: bool) -> None:
    """A step that raises (here the logprobs of one) fails that generate call; the requests it
    held are aborted, so the next call runs, with the tokens a fresh engine gives, and frees all."""
    import threading

    from deltaserve import LLM
    from deltaserve.engine.sampling import sampler

    llm = LLM(
        model=checkpoint, dtype="float32", device="cpu", max_model_len=256, enable_overlap_schedule=overlap
    )
    want = llm.generate([[5, 9, 17]], GOOD, use_tqdm=False)[0].outputs[0].token_ids
    real = sampler.Sampler.logprobs_of
    calls = {"n": 0}

    def failing(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:  # the second step's
            raise RuntimeError("logprobs failed")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(sampler.Sampler, "logprobs_of", failing)
    with pytest.raises(RuntimeError, match="logprobs failed"):
        llm.generate([[5, 9, 17], [7, 8]], SamplingParams(max_tokens=8, logprobs=2), use_tqdm=False)
    monkeypatch.setattr(sampler.Sampler, "logprobs_of", real)
    again: dict = {}
    thread = threading.Thread(
        target=lambda: again.update(out=llm.generate([[5, 9, 17]], GOOD, use_tqdm=False)), daemon=True
    )
    thread.start()
    thread.join(120)  # a request left behind would keep the loop waiting for ever
    assert "out" in again and again["out"][0].outputs[0].token_ids == want
    stats = llm.engine.stats()
    assert stats["state_slots_used"] == 0 and not llm.engine.requests


def test_a_prompt_too_long_for_its_samples_is_refused_before_any_warm_up(checkpoint, monkeypatch) -> None:
    """n > 1 samples of a prompt that, with max_tokens, overflows the context: the error names the
    request's own numbers, and no warm-up prefill of the prompt runs first."""
    from deltaserve import LLM

    llm = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=256)
    warmed: list = []
    monkeypatch.setattr(llm, "_warm_prefixes", warmed.extend)
    with pytest.raises(ValueError, match="250 tokens and max_tokens is 10: together 260"):
        llm.generate([[5] * 250], SamplingParams(n=2, max_tokens=10), use_tqdm=False)
    assert warmed == []


def test_stop_strings_without_a_tokenizer_are_refused(checkpoint) -> None:
    """A checkpoint without tokenizer files has no text to find stop strings in: they are refused,
    naming stop, rather than never matching; stop token ids work."""
    from deltaserve import LLM
    from deltaserve.engine.errors import InvalidParamError

    llm = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=256)
    assert llm.tokenizer is None
    with pytest.raises(InvalidParamError, match="stop strings need the text") as info:
        llm.generate([[5, 9, 17]], SamplingParams(max_tokens=4, stop=["a"]), use_tqdm=False)
    assert info.value.param == "stop"
    out = llm.generate([[5, 9, 17]], GOOD, use_tqdm=False)[0].outputs[0]
    stopped = llm.generate(
        [[5, 9, 17]], dataclasses.replace(GOOD, stop_token_ids=[out.token_ids[2]]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 3
    with pytest.raises(ValueError, match="'prompt' or 'prompt_token_ids'"):  # a dict of neither
        llm.generate({"text": "hi"}, GOOD, use_tqdm=False)


def test_prompt_token_ids_that_are_not_integers_are_refused(checkpoint) -> None:
    """A float, a digit string or a bool among a prompt's token ids is refused, naming it, rather
    than read as another token (1.7 as 1, "12" as 12, True as 1); numpy's integers are ids."""
    import numpy as np

    from deltaserve import LLM

    llm = LLM(model=checkpoint, dtype="float32", device="cpu", max_model_len=256)
    for bad in (1.7, "12", True):
        with pytest.raises(ValueError, match=f"token ids must be integers, got {bad!r}"):
            llm.generate({"prompt_token_ids": [5, bad, 17]}, GOOD, use_tqdm=False)
        with pytest.raises(ValueError, match="token ids must be integers"):
            llm.generate([[5, 9], [5, bad]], GOOD, use_tqdm=False)
    assert not llm.engine.requests
    (out,) = llm.generate({"prompt_token_ids": np.array([5, 9, 17])}, GOOD, use_tqdm=False)
    assert out.prompt_token_ids == [5, 9, 17] and len(out.outputs[0].token_ids) == GOOD.max_tokens
