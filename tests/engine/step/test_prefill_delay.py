"""New prompts that arrive beside decode-only steps wait a few steps to be prefilled together
(`max_prefill_delay_steps`); the tokens they get are the same."""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.step.step_costs import (
    LONGEST_S,
    RATE_WINDOW_S,
    ArrivalRate,
    MixedStepCost,
    worth_holding,
)

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
    # prompts that fill the step's budget do not wait
    engine.add_request("d", list(range(60, 124)), GREEDY)
    engine.step()
    assert waiting(engine) == 0
    held = finish(engine)

    reference = make_engine(path, delay=0)
    for rid, prompt in (("b", range(30, 40)), ("c", range(50, 60)), ("d", range(60, 124))):
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
    """A prefill step's fixed extra cost held where the test puts it (the engine's records ignored)."""

    def __init__(self, fixed_s: float) -> None:
        super().__init__()
        self.fixed_s = fixed_s

    def record(self, mixed: bool, seconds: float, tokens: int = 0) -> None:
        pass


class FixedRate(ArrivalRate):
    """Arrivals per second held where the test puts them."""

    def __init__(self, per_s: float) -> None:
        super().__init__()
        self.per_s = per_s

    def rate(self, now: float) -> float:
        return self.per_s


def decoding_alone(engine: Engine) -> None:
    engine.add_request(
        "a", list(range(1, 21)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    while not any(out.outputs[0].token_ids for out in engine.step()):
        pass


def arrival_beside_decodes(
    path: str, delay: int, fixed_s: float, prompt: list[int], tails: bool = False, rate: float = 1.0
) -> Engine:
    """An adaptive-delay engine whose prefill step costs a fixed `fixed_s` more than a decode
    step, under `rate` arrivals a second, with "a" decoding and "b" (`prompt`) just arrived."""
    engine = make_engine(path, delay=delay, adaptive=True, tails=tails)
    engine.scheduler.step_cost = FixedCost(fixed_s)
    engine.scheduler.arrivals = FixedRate(rate)
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


def test_adaptive_delay_holds_while_the_arrivals_it_waits_for_are_worth_it(path: str) -> None:
    # one decoding request, 3 arrivals a second, 0.5 s saved by each: worth holding fewer than 1.5
    engine = arrival_beside_decodes(path, 0, 0.5, list(range(30, 40)), rate=3.0)
    engine.step()
    assert waiting(engine) == 1
    engine.add_request("c", list(range(50, 60)), GREEDY)
    engine.step()
    assert waiting(engine) == 0 and engine.stats()["running"] == 3  # two held: both go at once
    engine.add_request("d", list(range(60, 70)), GREEDY)
    engine.step()
    assert waiting(engine) == 1  # three decode now: worth holding fewer than 4.5
    engine.scheduler.arrivals = FixedRate(0.0)
    engine.step()
    assert waiting(engine) == 0  # nothing more is coming: holding saves nothing


def test_worth_holding_compares_the_idle_share_with_the_expected_saving() -> None:
    assert worth_holding(1, 10, 2.0, 0.1)  # 1/10 of a step idle against 2 x 0.1
    assert not worth_holding(2, 10, 2.0, 0.1)
    assert not worth_holding(1, 10, 100.0, 0.0)  # nothing fixed to save


def run_steps(cost: MixedStepCost, fixed_s: float, per_token_s: float, decode_s: float, lag: bool) -> None:
    """2,000 steps, a random third of them with prefill chunks of random sizes; `lag`: each
    interval shows the step before's extra time (overlap scheduling when the GPU sets the pace)."""
    rng = random.Random(0)
    before = 0.0
    for _ in range(2000):
        tokens = rng.choice([16, 1024, 2048, 4096, 8192]) if rng.random() < 0.3 else 0
        extra = fixed_s + per_token_s * tokens if tokens else 0.0
        cost.record(tokens > 0, decode_s + (before if lag else extra), tokens)
        before = extra


def test_mixed_step_cost_finds_the_fixed_part_of_a_prefill_step() -> None:
    host_bound = MixedStepCost()
    assert host_bound.fixed_s == 0.0 and host_bound.decode_s is None
    run_steps(host_bound, 0.025, 1e-6, 0.004, lag=False)  # 25 ms of launches, 1 us a token
    assert host_bound.fixed_s == pytest.approx(0.025, rel=1e-3)
    assert host_bound.per_token_s == pytest.approx(1e-6, rel=1e-2)
    assert host_bound.decode_s == pytest.approx(0.004, rel=1e-3)
    host_bound.record(False, LONGEST_S + 1)  # idle time between two steps is no step's cost
    assert host_bound.fixed_s == pytest.approx(0.025, rel=1e-3)


def test_the_fixed_part_survives_overlap_scheduling_lag() -> None:
    # the GPU's work per token, each interval showing the step before: nothing fixed to save
    gpu_bound = MixedStepCost()
    run_steps(gpu_bound, -0.004, 26e-6, 0.017, lag=True)
    assert gpu_bound.fixed_s < 0.002
    assert gpu_bound.per_token_s == pytest.approx(26e-6, rel=0.05)
    # host-bound steps seen with the lag: the same parts
    lagged = MixedStepCost()
    run_steps(lagged, 0.025, 1e-6, 0.004, lag=True)
    assert lagged.fixed_s == pytest.approx(0.025, rel=0.1)  # a window's edges blur it a little


def test_prefill_steps_all_alike_cannot_tell_the_fixed_part() -> None:
    cost = MixedStepCost()
    for i in range(400):
        cost.record(i % 3 == 0, 0.030 if i % 3 == 0 else 0.004, 1024 if i % 3 == 0 else 0)
    assert cost.fixed_s == 0.0  # nothing waits on a guess


def test_arrival_rate_follows_the_arrivals() -> None:
    arrivals = ArrivalRate()
    for i in range(300):
        arrivals.add(10.0 + i / 100)  # 100 a second for 3 s
    assert arrivals.rate(13.0) == pytest.approx(100, rel=0.06)
    assert arrivals.rate(18.0) < 1.0  # quiet for 5 s


class Recorded(MixedStepCost):
    """What the engine feeds the cost model, kept."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[bool, float, int]] = []

    def record(self, mixed: bool, seconds: float, tokens: int = 0) -> None:
        self.steps.append((mixed, seconds, tokens))
        super().record(mixed, seconds, tokens)


def test_the_engine_feeds_each_step_with_its_prefill_tokens(path: str) -> None:
    engine = make_engine(path, delay=0, adaptive=True)
    engine.scheduler.step_cost = cost = Recorded()
    decoding_alone(engine)  # "a" (20 tokens) prefilled, then decoding
    engine.add_request("b", list(range(30, 40)), GREEDY)
    finish(engine)
    # no upper bound: on a loaded host one step takes seconds
    assert all(seconds > 0 for _, seconds, _ in cost.steps)
    assert all(mixed == (tokens > 0) for mixed, _, tokens in cost.steps)
    # every step but the last is recorded at the next plan; the prompts' tokens are all there
    assert sum(tokens for _, _, tokens in cost.steps) == 20 + 10
    assert sum(not mixed for mixed, _, _ in cost.steps) >= 30


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


def test_the_engine_reports_what_the_adaptive_delay_weighs(path: str) -> None:
    plain = make_engine(path, delay=0)
    assert "prefill_step_fixed_ms" not in plain.stats()
    engine = make_engine(path, delay=0, adaptive=True)
    decoding_alone(engine)
    stats = engine.stats()
    # one arrival ("a"), decayed by however long its first steps took on a loaded machine
    assert 0 < stats["arrivals_per_s"] <= 1 / RATE_WINDOW_S
    assert stats["prefill_step_fixed_ms"] >= 0 and stats["prefill_step_us_per_token"] >= 0
