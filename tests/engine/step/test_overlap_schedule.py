"""Overlap scheduling (a step launched before the previous step's tokens are read back) gives
the outputs of synchronous stepping: greedy and seeded sampling, stops, the radix cache,
preemption pressure, aborts, and requests that need host data (which step synchronously)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams

LENGTHS = [1, 7, 33, 64, 90, 150, 5, 40]


def engine(path: str, overlap: bool, **kw) -> Engine:
    cfg = dict(
        model=path,
        dtype="float32",
        device="cpu",
        chunked_prefill_size=32,
        max_running_requests=4,
        max_model_len=320,
    )
    cfg.update(kw)
    return Engine(EngineConfig(**cfg, enable_overlap_schedule=overlap))


def prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() for n in LENGTHS]


def run(eng: Engine, ps: list[list[int]], params: list[SamplingParams]) -> dict[str, tuple]:
    for i, (p, sp) in enumerate(zip(ps, params)):
        eng.add_request(str(i), p, sp)
    done = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                o = out.outputs[0]
                done[out.request_id] = (o.token_ids, o.finish_reason, o.stop_reason)
        steps += 1
        assert steps < 2000
    return done


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "kimi"])
@pytest.mark.slow
def test_greedy_with_stops_identical_to_sync(kind, remembering_checkpoint, pools_held):
    path = remembering_checkpoint(kind)
    ps = prompts()
    plain = [greedy(4 + 5 * i) for i in range(len(ps))]
    ref = run(engine(path, False), ps, plain)
    # stop on a token each request really produces, at different depths (or not at all)
    params = [
        greedy(4 + 5 * i, stop_token_ids=[ref[str(i)][0][min(i, len(ref[str(i)][0]) - 1)]])
        if i % 2
        else plain[i]
        for i in range(len(ps))
    ]
    sync_eng, over_eng = engine(path, False), engine(path, True)
    expected, got = run(sync_eng, ps, params), run(over_eng, ps, params)
    assert got == expected
    assert any(reason == "stop" for _, reason, _ in got.values())
    # tokens computed after a stop are not counted as generated
    assert over_eng.counters["generation_tokens_total"] == sum(len(t) for t, _, _ in got.values())
    assert not pools_held(over_eng)


def test_seeded_sampling_identical_to_sync(make_checkpoint):
    path = make_checkpoint("qwen3_5")
    ps = prompts(1)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=12, ignore_eos=True)
        for i in range(len(ps))
    ]
    assert run(engine(path, True), ps, params) == run(engine(path, False), ps, params)


def test_radix_cache_multi_turn_identical_and_hits(remembering_checkpoint, pools_held):
    """Both turns give the tokens of a synchronous engine without the prefix cache."""
    path = remembering_checkpoint("qwen3_5")
    ps = prompts(2)[:4]
    results = {}
    for overlap, cache in ((False, "naive"), (False, "radix"), (True, "radix")):
        eng = engine(path, overlap, cache_type=cache)
        first = run(eng, ps, [greedy(20)] * len(ps))
        follow = [p + list(first[str(i)][0]) + [3, 4, 5] for i, p in enumerate(ps)]
        cached_before = eng.counters["cached_tokens_total"]
        second = run(eng, follow, [greedy(10)] * len(follow))
        results[overlap, cache] = (first, second)
        if cache == "radix":
            assert eng.counters["cached_tokens_total"] > cached_before  # later turns hit
        assert not pools_held(eng)
    assert results[True, "radix"] == results[False, "radix"] == results[False, "naive"]


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["naive", "radix"])
def test_under_kv_pressure_identical_and_no_leak(cache, remembering_checkpoint, pools_held):
    """Preempted requests (with the radix cache: recomputed from their own released prefix)
    give the tokens of a synchronous engine with pages to spare."""
    path = remembering_checkpoint("qwen3_next")
    ps = prompts(3)
    params = [greedy(30) for _ in ps]
    tight = dict(num_kv_pages=48, page_size=8, cache_type=cache)
    over = engine(path, True, **tight)
    preempted = []
    preempt = over.scheduler.preempt
    over.scheduler.preempt = lambda req: (preempted.append(req), preempt(req))  # type: ignore[method-assign]
    ample = run(engine(path, False, page_size=8, cache_type="naive"), ps, params)
    assert run(over, ps, params) == run(engine(path, False, **tight), ps, params) == ample
    assert preempted  # the pool was short: some decodes had to give way
    assert not pools_held(over)


def test_requests_needing_host_data_step_synchronously(make_checkpoint):
    path = make_checkpoint("qwen3_5")
    ps = prompts(4)
    params = [
        greedy(10, repetition_penalty=1.3)
        if i == 2
        else SamplingParams(temperature=0.0, max_tokens=10, logprobs=2)
        if i == 5
        else greedy(10)
        for i in range(len(ps))
    ]
    assert run(engine(path, True), ps, params) == run(engine(path, False), ps, params)


def test_abort_while_a_step_is_in_flight(remembering_checkpoint, pools_held):
    path = remembering_checkpoint("qwen3_5")
    eng = engine(path, True)
    ps = prompts(5)[:4]
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy(40))
    finished = {}
    for _ in range(12):
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert eng.overlap.in_flight is not None  # a step is launched and not read back
    eng.abort_request("1")
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["1"].outputs[0].finish_reason == "abort"
    for rid in ("0", "2", "3"):
        assert len(finished[rid].outputs[0].token_ids) == 40
    assert not pools_held(eng)


def test_with_speculative_decoding_steps_synchronously(remembering_checkpoint):
    path = remembering_checkpoint("qwen3_5")
    phrase = [7, 8, 9, 10, 11]
    ps = [phrase * 8, prompts(6)[3]]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    params = [greedy(20) for _ in ps]
    over = engine(path, True, speculative_config=spec)
    assert run(over, ps, params) == run(engine(path, False), ps, params)
    assert over.overlap.in_flight is None and over.counters["spec_windows_total"] > 0


def test_drain_finishes_the_step_in_flight(remembering_checkpoint, pools_held):
    """`drain` reads the step in flight back (its tokens counted, its outputs returned); stepping
    on afterwards gives the synchronous engine's tokens."""
    path = remembering_checkpoint("qwen3_5")
    ps = prompts()[:3]
    ref = run(engine(path, False), ps, [greedy(6)] * 3)
    eng = engine(path, True)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, greedy(6))
    for _ in range(3):
        eng.step()
    counted = eng.counters["generation_tokens_total"]
    outs = eng.drain()  # the third step's tokens
    assert eng.counters["generation_tokens_total"] > counted
    assert {o.request_id for o in outs} and all(not o.finished for o in outs)
    assert eng.drain() == []  # nothing in flight any more
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert done == {rid: toks for rid, (toks, _, _) in ref.items()}
    assert not pools_held(eng)


def test_logit_bias_identical_to_sync_and_overlaps(make_checkpoint):
    """A logit bias needs no host data of earlier steps: biased requests keep overlapping and give
    the synchronous engine's tokens; -100 on a request's greedy tokens steers it off them."""
    path = make_checkpoint("qwen3_5")
    ps = prompts(2)
    ref = run(engine(path, False), ps, [greedy(10) for _ in ps])
    params = [greedy(10, logit_bias={t: -100.0 for t in ref[str(i)][0][:3]}) for i in range(len(ps))]
    expected = run(engine(path, False), ps, params)
    over_eng = engine(path, True)
    for i, (p, sp) in enumerate(zip(ps, params)):
        over_eng.add_request(str(i), p, sp)
    got, in_flight = {}, 0
    while over_eng.has_unfinished_requests():
        for out in over_eng.step():
            if out.finished:
                o = out.outputs[0]
                got[out.request_id] = (o.token_ids, o.finish_reason, o.stop_reason)
        in_flight += over_eng.overlap.in_flight is not None  # a step was left running: it overlapped
    assert got == expected and in_flight > 5
    for i in range(len(ps)):
        banned = set(ref[str(i)][0][:3])
        assert not banned & set(got[str(i)][0]) and got[str(i)][0] != ref[str(i)][0]
