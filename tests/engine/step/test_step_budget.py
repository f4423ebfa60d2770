"""`max_num_batched_tokens` bounds every step's tokens: decode rows, speculative verification
windows (the last token and its drafts) and prefill chunks together, as vLLM's scheduler counts
them. Decode rows come first; drafts and prefill chunks get what they leave. Greedy tokens are
those of a roomy budget."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.step.scheduler import SchedulerOutput

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
OVERLAP = pytest.mark.parametrize(
    "overlap", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["sync", "overlap"]
)


def make_engine(path: str, **kw: Any) -> Engine:
    cfg: dict[str, Any] = dict(
        model=path, dtype="float32", device="cpu", page_size=16, max_model_len=256, num_kv_pages=400
    )
    return Engine(EngineConfig(**{**cfg, **kw}))


def record_plans(engine: Engine) -> list[SchedulerOutput]:
    """Every plan the engine's scheduler makes from now on."""
    plans: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput | None:
        plan = schedule()
        if plan is not None:
            plans.append(plan)
        return plan

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    return plans


def run(
    engine: Engine, arrivals: dict[int, dict[str, list[int]]], max_tokens: dict[str, int]
) -> dict[str, list[int]]:
    """Greedy tokens of each request; `arrivals[s]`: the prompts added before step `s`."""
    tokens: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for rid, prompt in arrivals.get(step, {}).items():
            engine.add_request(rid, prompt, greedy(max_tokens[rid]))
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 2000, "no progress"
    return tokens


def step_tokens(plan: SchedulerOutput) -> int:
    return sum(c.num_tokens for c in plan.chunks)


def short_prompts(rng: random.Random, n: int) -> dict[str, list[int]]:
    """Short prompts that repeat themselves: the n-gram drafter proposes for them."""
    prompts = {}
    for i in range(n):
        base = [rng.randrange(160) for _ in range(rng.randint(2, 4))]
        prompts[f"d{i}"] = (base * 4)[: rng.randint(5, 12)]
    return prompts


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def path(remembering_checkpoint) -> str:
    return remembering_checkpoint("qwen3_5")  # a wrong state changes its tokens


@OVERLAP
def test_decode_rows_behind_a_running_prefill_count(path, overlap) -> None:
    """A prompt that leaves the cached tree after 16 tokens gets a first chunk of 16 of the budget
    of 32, short prompts are admitted beside it and decode behind it in the running batch: its
    next chunks leave them their rows (it took all 32, with 4 decode rows: 36 a step)."""
    rng = random.Random(0)
    system = [rng.randrange(160) for _ in range(40)]
    arrivals = {
        0: {"system": system},
        4: {"p": system[:24] + [rng.randrange(160) for _ in range(60)]} | short_prompts(rng, 4),
    }
    max_tokens = {"system": 1, "p": 3} | dict.fromkeys(arrivals[4], 20)
    engine = make_engine(path, max_num_batched_tokens=32, enable_overlap_schedule=overlap)
    plans = record_plans(engine)
    got = run(engine, arrivals, max_tokens)
    assert max(map(step_tokens, plans)) <= 32, [(p.num_decodes, step_tokens(p)) for p in plans]
    # the prompt's chunks ran beside the decode rows
    assert any(p.num_decodes == 4 and any(c.req.request_id == "p" for c in p.chunks[4:]) for p in plans)
    roomy = make_engine(path, max_num_batched_tokens=512, enable_overlap_schedule=False)
    assert got == run(roomy, arrivals, max_tokens)


@OVERLAP
def test_verification_windows_take_what_decode_rows_leave(path, overlap) -> None:
    """Twenty requests decoding with n-gram drafts (windows of up to 5 tokens) and a long prompt
    arriving, under a budget of 40: every step holds at most 40 tokens (the windows ran to 43),
    drafts are cut to what the decode rows leave (a new prompt's chunks get what the windows
    leave, as in vLLM), and the tokens are a roomy budget's without speculation."""
    rng = random.Random(0)
    arrivals = {0: short_prompts(rng, 20), 12: {"long": [rng.randrange(160) for _ in range(150)]}}
    max_tokens = dict.fromkeys(arrivals[0], 30) | {"long": 8}
    engine = make_engine(
        path,
        max_num_batched_tokens=40,
        max_running_requests=32,
        speculative_config=NGRAM,
        enable_overlap_schedule=overlap,
    )
    plans = record_plans(engine)
    got = run(engine, arrivals, max_tokens)
    assert max(map(step_tokens, plans)) <= 40, [(p.num_decodes, p.num_verify, step_tokens(p)) for p in plans]
    busy = [p for p in plans if p.num_decodes + p.num_verify >= 10]
    assert any(p.num_verify and step_tokens(p) == 40 for p in busy)
    assert engine.stats()["spec_draft_tokens_total"] > 0

    roomy = make_engine(
        path, max_num_batched_tokens=512, max_running_requests=32, enable_overlap_schedule=False
    )
    assert got == run(roomy, arrivals, max_tokens)


def test_a_budget_below_the_running_requests_caps_the_decode_batch(path) -> None:
    """Sixty-four running requests allowed, a budget of 8: at most 8 tokens a step, so at most
    8 decode rows (the others wait to be admitted), none starves, and every request finishes
    with a roomy budget's tokens."""
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(160) for _ in range(rng.randint(1, 3))] for i in range(20)}
    max_tokens = dict.fromkeys(prompts, 6)
    engine = make_engine(
        path, max_num_batched_tokens=8, max_running_requests=64, enable_overlap_schedule=False
    )
    plans = record_plans(engine)
    got = run(engine, {0: prompts}, max_tokens)
    assert max(map(step_tokens, plans)) <= 8 and max(p.num_decodes for p in plans) > 4
    roomy = make_engine(
        path, max_num_batched_tokens=512, max_running_requests=64, enable_overlap_schedule=False
    )
    assert got == run(roomy, {0: prompts}, max_tokens)


def test_a_budget_below_a_page_still_moves_a_prompt_on(path) -> None:
    """Twenty decode rows leave 12 of a budget of 32 with pages of 16: a long prompt arriving
    among them is prefilled 12 tokens a step instead of waiting for the decodes to end; once the
    rows thin out its chunks end on pages again (where the prefix cache keeps states), and the
    tokens are a roomy budget's."""
    rng = random.Random(2)
    arrivals = {0: {f"r{i}": [rng.randrange(160) for _ in range(3)] for i in range(20)}}
    arrivals[3] = {"long": [rng.randrange(160) for _ in range(200)]}
    max_tokens = {f"r{i}": 6 + i for i in range(20)} | {"long": 4}
    cfg: dict[str, Any] = dict(max_running_requests=32, enable_overlap_schedule=False)
    engine = make_engine(path, max_num_batched_tokens=32, **cfg)
    chunks: list[tuple[int, int, int]] = []  # the long prompt's (decode rows, start, length)
    schedule = engine.scheduler.schedule

    def recorded() -> SchedulerOutput | None:
        plan = schedule()
        for c in plan.chunks[plan.num_decodes :] if plan is not None else []:
            if c.req.request_id == "long" and not c.sample:
                chunks.append((plan.num_decodes, c.req.num_computed_tokens, c.num_tokens))
        return plan

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    got = run(engine, arrivals, max_tokens)
    assert chunks[0] == (20, 0, 12), chunks  # beside the twenty rows, at once
    roomy = [s + n for rows, s, n in chunks if rows <= 32 - 16]  # the ends with a page of budget
    assert roomy and all(end % 16 == 0 for end in roomy), chunks
    assert got == run(make_engine(path, max_num_batched_tokens=512, **cfg), arrivals, max_tokens)
