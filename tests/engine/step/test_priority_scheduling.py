"""Priority scheduling (vLLM's `--scheduling-policy priority`): waiting requests are admitted by
priority (lower first, then arrival), memory pressure preempts the lowest, and the tokens are
those of first-come-first-served; under fcfs a priority other than 0 is refused."""

from __future__ import annotations

import random

import pytest

from deltaserve import LLM
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.errors import InvalidParamError
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.step.waiting_queue import priority_key


@pytest.fixture(scope="module")
def checkpoint(remembering_checkpoint) -> str:
    return remembering_checkpoint("qwen3_next")  # long memory: a preempted request's state matters


def make_engine(path: str, policy: str, **kw) -> Engine:
    kw.setdefault("max_running_requests", 1)
    kw.setdefault("max_model_len", 128)
    cfg = EngineConfig(model=path, dtype="float32", device="cpu", scheduling_policy=policy, **kw)
    return Engine(cfg)


def prompts(n: int, length: int = 9, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(160) for _ in range(length)] for _ in range(n)]


def finish_order(engine: Engine) -> tuple[list[str], dict[str, list[int]]]:
    order, tokens = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
    return order, tokens


def test_waiting_requests_run_by_priority_then_arrival(checkpoint) -> None:
    """One running place: the waiting requests take it lowest priority value first, equal ones
    in arrival order; first-come-first-served runs them as they came, with the same tokens."""
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    given = {"a": 5, "b": 0, "c": 5, "d": -1, "e": 0}
    runs = {}
    for policy in ("fcfs", "priority"):
        engine = make_engine(checkpoint, policy)
        for (rid, prio), p in zip(given.items(), prompts(len(given))):
            engine.add_request(rid, p, SamplingParams(priority=prio if policy == "priority" else 0, **greedy))
        runs[policy] = finish_order(engine)
    assert runs["fcfs"][0] == ["a", "b", "c", "d", "e"]
    assert runs["priority"][0] == ["d", "b", "e", "a", "c"]
    assert runs["priority"][1] == runs["fcfs"][1]


def test_memory_pressure_preempts_the_lowest_priority(checkpoint, monkeypatch) -> None:
    """Too few KV pages for the growing requests: each one preempted is the lowest priority of
    those running, not the newest as under fcfs (the urgent ones arrive last), the most urgent is
    never preempted, and every output is the one the requests get with room for all."""
    ps = prompts(4, length=60, seed=11)
    early, late = {"low": 3, "mid": 2}, {"high": 0, "next": 1}
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = make_engine(checkpoint, "fcfs", max_running_requests=4)
    for rid, p in zip([*early, *late], ps):
        roomy.add_request(rid, p, SamplingParams(**greedy))
    expected = finish_order(roomy)[1]
    engine = make_engine(checkpoint, "priority", max_running_requests=4, num_kv_pages=12, page_size=16)
    victims = []
    preempt = engine.scheduler.preempt

    def recording(req):
        victims.append(
            (req.request_id, req.params.priority, max(map(priority_key, engine.scheduler.running)))
        )
        preempt(req)

    monkeypatch.setattr(engine.scheduler, "preempt", recording)
    for (rid, prio), p in zip(early.items(), ps):
        engine.add_request(rid, p, SamplingParams(priority=prio, **greedy))
    first = engine.step()  # the less urgent two run before the others arrive
    for (rid, prio), p in zip(late.items(), ps[2:]):
        engine.add_request(rid, p, SamplingParams(priority=prio, **greedy))
    tokens = finish_order(engine)[1]
    assert not first and victims, "the pool was meant to be too small for all four"
    for rid, prio, lowest in victims:
        assert prio == lowest[0], (rid, prio, lowest)
    assert "high" not in {rid for rid, _, _ in victims}
    assert tokens == expected
    stats = engine.stats()
    assert stats["preemptions_total"] == len(victims)  # /metrics' num_preemptions_total
    assert (stats["running"], stats["waiting"], stats["kv_pages_used"], stats["state_slots_used"]) == (
        0,
        0,
        0,
        0,
    )


def test_fcfs_refuses_a_priority_and_the_offline_api_takes_one_a_prompt(checkpoint, monkeypatch) -> None:
    engine = make_engine(checkpoint, "fcfs")
    with pytest.raises(InvalidParamError) as refused:
        engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2, priority=1))
    assert refused.value.param == "priority" and "--scheduling-policy priority" in str(refused.value)
    with pytest.raises(InvalidParamError, match="priority"):
        SamplingParams(max_tokens=2, priority=2**63).validate()
    assert engine.stats()["waiting"] == 0
    llm = LLM(checkpoint, dtype="float32", device="cpu", max_running_requests=1, scheduling_policy="priority")
    admitted = []
    remove = llm.engine.scheduler.waiting.remove

    def recording(req):
        admitted.append(req.prompt_token_ids)
        remove(req)

    monkeypatch.setattr(llm.engine.scheduler.waiting, "remove", recording)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ps = prompts(3)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False, priority=[3, 1, 2])
    assert [o.prompt_token_ids for o in outs] == ps  # in the prompts' order
    assert admitted == [ps[1], ps[2], ps[0]]  # run as their priorities say
