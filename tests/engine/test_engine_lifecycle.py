"""Requests join, leave, abort and fail without leaking pages or slots."""

from __future__ import annotations

import pytest

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.errors import QueueFullError
from deltaserve.engine.requests.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(make_checkpoint):
    cfg = EngineConfig(
        model=make_checkpoint("qwen3_next"),
        dtype="float32",
        device="cpu",
        chunked_prefill_size=32,
        max_running_requests=3,
        max_waiting_requests=4,
        max_model_len=256,
    )
    return Engine(cfg)


def idle(engine: Engine) -> bool:
    s = engine.stats()
    return (s["running"], s["waiting"], s["kv_pages_used"], s["state_slots_used"]) == (0, 0, 0, 0)


def drain(engine: Engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    for out in engine.step():  # outputs of aborts queued after the last step
        finished[out.request_id] = out
    return finished


def test_requests_join_and_leave_between_steps(engine):
    p = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", list(range(1, 50)), p)
    engine.step()
    engine.step()
    engine.add_request("b", [7, 8, 9], p)  # joins while "a" decodes
    done = drain(engine)
    assert set(done) == {"a", "b"} and all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    assert idle(engine)


def test_abort_frees_pages_and_slot_at_once(engine):
    p = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"x{i}", list(range(1, 40 + i)), p)
    for _ in range(10):
        engine.step()
    assert engine.stats()["state_slots_used"] == 3 and engine.stats()["waiting"] == 1
    for i in range(4):
        engine.abort_request(f"x{i}")
    assert idle(engine)
    done = drain(engine)
    assert {o.outputs[0].finish_reason for o in done.values()} == {"abort"}
    engine.abort_request("x0")  # twice, and unknown ids, are no-ops
    engine.abort_request("never-seen")
    assert idle(engine)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1, 2, 100000], SamplingParams(), "outside the vocabulary"),
        ([i % 150 for i in range(1, 250)], SamplingParams(max_tokens=20), "maximum model length of 256"),
        ([i % 150 for i in range(300)], SamplingParams(max_tokens=None), "maximum model length is 256"),
    ],
)
def test_bad_requests_raise_and_change_nothing(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, params)
    assert idle(engine) and "bad" not in engine.requests


@pytest.mark.slow
def test_waiting_queue_bound(engine):
    """A burst fills the free running places (3) and then the waiting queue (4) before anything
    is refused, whether or not a step has moved the first ones into the running batch."""
    p = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    for i in range(7):
        engine.add_request(f"q{i}", [1, 2, 3], p)
    with pytest.raises(QueueFullError):
        engine.add_request("q-over", [1, 2, 3], p)
    engine.step()
    assert (engine.stats()["running"], engine.stats()["waiting"]) == (3, 4)
    with pytest.raises(QueueFullError):
        engine.add_request("q-over", [1, 2, 3], p)
    engine.abort_request("q0")  # a running place frees: one more may wait for it
    engine.add_request("q7", [1, 2, 3], p)
    with pytest.raises(QueueFullError):
        engine.add_request("q-over", [1, 2, 3], p)
    drain(engine)
    assert idle(engine)


def test_default_max_tokens_fills_the_model_length(engine):
    p = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    engine.add_request("long", [i % 150 for i in range(1, 200)], p)
    out = drain(engine)["long"].outputs[0]
    assert len(out.token_ids) == 256 - 199 and out.finish_reason == "length"
    assert p.max_tokens is None  # the caller's params are not modified
    assert idle(engine)


def test_final_only_requests_report_once(engine):
    """`output_kind="final_only"`: no output while the request runs, then the same final output
    as a cumulative request's."""
    outs: dict[str, list] = {"c": [], "f": []}
    engine.add_request("c", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True))
    engine.add_request(
        "f",
        [5, 6, 7],
        SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, output_kind="final_only"),
    )
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id].append(out)
    assert len(outs["c"]) == 9 and len(outs["f"]) == 1
    assert outs["f"][0].finished and outs["f"][0].outputs[0].token_ids == outs["c"][-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="deltas")
    assert idle(engine)
