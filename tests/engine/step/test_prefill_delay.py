"""New prompts that arrive beside decode-only steps wait a few steps to be prefilled together
(`max_prefill_delay_steps`); the tokens they get are the same."""

from __future__ import annotations

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.step.step_costs import LONGEST_S, MixedStepCost

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(path: str, delay: int, adaptive: bool = False, tails: bool = False) -> Engine:
    cfg = EngineConfig(
        model=path,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=64,
        max_running_requests=4,
        max_model_len=256,
        max_prefill_delay_steps=delay,
        adaptive_prefill_delay=adaptive,
        hold_prefill_tails=tails,
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


class FixedCost(MixedStepCost):
    """A prefill step's extra cost held where the test puts it (the engine's records ignored)."""

    def __init__(self, extra_s: float) -> None:
        super().__init__()
        self.fixed = extra_s

    def record(self, mixed: bool, seconds: float) -> None:
        pass

    @property
    def extra_s(self) -> float:
        return self.fixed


def decoding_alone(engine: Engine) -> None:
    engine.add_request(
        "a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    while not any(out.outputs[0].token_ids for out in engine.step()):
        pass


def arrival_beside_decodes(
    path: str, delay: int, extra_s: float, prompt: list[int], tails: bool = False
) -> Engine:
    """An adaptive-delay engine whose prefill step costs `extra_s` more than a decode step, with
    "a" decoding and "b" (`prompt`) just arrived."""
    engine = make_engine(path, delay=delay, adaptive=True, tails=tails)
    engine.scheduler.step_cost = FixedCost(extra_s)
    decoding_alone(engine)
    engine.add_request("b", prompt, GREEDY)
    return engine


def test_adaptive_delay_waits_while_a_prefill_step_would_cost_more(path: str) -> None:
    engine = arrival_beside_decodes(path, 0, 3600.0, list(range(30, 40)))
    for _ in range(15):
        engine.step()
        assert waiting(engine) == 1  # a prefill step costs far more than the wait so far
    engine.step()  # the 16-step cap
    assert waiting(engine) == 0


def test_adaptive_delay_does_not_wait_when_a_prefill_step_costs_no_more(path: str) -> None:
    engine = arrival_beside_decodes(path, 8, 0.0, list(range(30, 40)))
    engine.step()
    assert waiting(engine) == 0  # the fixed 8-step delay alone would have held it


def test_adaptive_delay_ends_once_the_wait_reaches_the_extra_cost(path: str) -> None:
    import time

    engine = arrival_beside_decodes(path, 0, 0.3, list(range(30, 40)))
    engine.step()
    assert waiting(engine) == 1
    time.sleep(0.35)
    engine.step()
    assert waiting(engine) == 0


def test_mixed_step_cost_is_the_difference_of_the_averages() -> None:
    cost = MixedStepCost()
    cost.record(True, 0.030)
    assert cost.extra_s == 0.0  # no decode step seen yet
    for _ in range(50):
        cost.record(False, 0.004)
        cost.record(True, 0.030)
    assert cost.extra_s == pytest.approx(0.026, rel=1e-3)
    cost.record(False, LONGEST_S + 1)  # idle time between two steps is no step's cost
    cost.record(True, 0.0)
    assert cost.extra_s == pytest.approx(0.026, rel=1e-3)
    for _ in range(100):
        cost.record(True, 0.002)  # prefill steps got cheaper than decode steps
    assert cost.extra_s == 0.0


def test_the_engine_measures_both_kinds_of_step(path: str) -> None:
    engine = make_engine(path, delay=0, adaptive=True)
    decoding_alone(engine)
    for _ in range(3):
        engine.step()
    cost = engine.scheduler.step_cost
    assert cost.mixed_s is not None and cost.decode_s is not None
    assert 0 < cost.decode_s <= LONGEST_S and 0 < cost.mixed_s <= LONGEST_S


def test_adaptive_delay_is_on_by_default_with_cuda_only(path: str) -> None:
    assert EngineConfig(model=path, device="cpu").adaptive_prefill_delay is False
    assert EngineConfig(model=path, device="cpu", adaptive_prefill_delay=True).adaptive_prefill_delay is True
    assert EngineConfig(model=path, device="cuda").adaptive_prefill_delay is True


def computed(engine: Engine, rid: str) -> int:
    return engine.requests[rid].num_computed_tokens


def test_held_tails_wait_from_their_first_chunk_and_give_the_same_tokens(path: str) -> None:
    """A 20-token prompt runs as 16 (the cache keeps the state at the last full page) and a
    4-token tail; with `hold_prefill_tails` the tail waits beside the decodes like an arrival."""
    prompt = list(range(30, 50))
    engine = arrival_beside_decodes(path, 3, 3600.0, prompt, tails=True)
    for _ in range(2):
        engine.step()
        assert waiting(engine) == 1  # the arrival waits (3 steps)
    engine.step()
    assert waiting(engine) == 0 and computed(engine, "b") == 16  # admitted: its first chunk ran
    for _ in range(2):
        engine.step()
        assert computed(engine, "b") == 16  # its tail waits 3 steps from the first chunk's end
    engine.step()
    assert computed(engine, "b") >= 20
    held = finish(engine)

    reference = make_engine(path, delay=0)
    reference.add_request("b", prompt, GREEDY)
    assert finish(reference)["b"] == held["b"]


def test_tails_run_at_once_without_the_flag_or_when_a_prefill_step_costs_no_more(path: str) -> None:
    for tails, cost in ((False, 3600.0), (True, 0.0)):
        engine = arrival_beside_decodes(path, 3, cost, list(range(30, 50)), tails=tails)
        while waiting(engine):
            engine.step()
        assert computed(engine, "b") == 16
        engine.step()
        assert computed(engine, "b") >= 20, (tails, cost)


def test_tails_are_not_held_without_decodes(path: str) -> None:
    engine = make_engine(path, delay=3, adaptive=True, tails=True)
    engine.scheduler.step_cost = FixedCost(3600.0)
    engine.add_request("b", list(range(30, 50)), GREEDY)
    engine.step()
    assert computed(engine, "b") == 16
    engine.step()
    assert computed(engine, "b") >= 20  # nothing decodes beside it: no reason to wait
