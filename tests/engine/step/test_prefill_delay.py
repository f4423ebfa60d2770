"""New prompts that arrive beside decode-only steps wait a few steps to be prefilled together
(`max_prefill_delay_steps`); the tokens they get are the same."""

from __future__ import annotations

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(path: str, delay: int) -> Engine:
    cfg = EngineConfig(
        model=path,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=64,
        max_running_requests=4,
        max_model_len=256,
        max_prefill_delay_steps=delay,
    )
    return Engine(cfg)


def finish(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def waiting(engine: Engine) -> int:
    return int(engine.stats()["waiting"])


@pytest.fixture(scope="module")
def path(make_checkpoint) -> str:
    return make_checkpoint("qwen3_next")


def test_arrivals_beside_decodes_are_prefilled_together(path: str) -> None:
    engine = make_engine(path, delay=3)
    engine.add_request(
        "a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    )
    while not any(out.outputs[0].token_ids for out in engine.step()):
        pass  # "a" is prefilled (the cache may split it at its last full page)
    engine.add_request("b", list(range(30, 40)), GREEDY)
    engine.step()
    assert waiting(engine) == 1  # "a" decodes alone
    engine.add_request("c", list(range(50, 60)), GREEDY)
    engine.step()
    assert waiting(engine) == 2
    engine.step()  # "b" has waited its 3 steps: both are admitted in one step
    assert waiting(engine) == 0 and engine.stats()["running"] == 3
    # prompts that fill half the step's budget do not wait
    engine.add_request("d", list(range(60, 92)), GREEDY)
    engine.step()
    assert waiting(engine) == 0
    held = finish(engine)

    reference = make_engine(path, delay=0)
    for rid, prompt in (("b", range(30, 40)), ("c", range(50, 60)), ("d", range(60, 92))):
        reference.add_request(rid, list(prompt), GREEDY)
    assert finish(reference) == {rid: held[rid] for rid in ("b", "c", "d")}


def test_no_delay_without_decodes(path: str) -> None:
    engine = make_engine(path, delay=5)
    engine.add_request("a", list(range(1, 11)), GREEDY)
    engine.step()
    assert waiting(engine) == 0  # nothing decodes: no reason to wait


def test_negative_delay_is_refused(path: str) -> None:
    with pytest.raises(ValueError, match="max_prefill_delay_steps"):
        EngineConfig(model=path, device="cpu", max_prefill_delay_steps=-1)
