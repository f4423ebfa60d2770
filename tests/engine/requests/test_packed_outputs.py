"""A step's outputs cross the process boundary as tuples (pack_outputs) and come back whole."""

from __future__ import annotations

import dataclasses
import pickle

from deltaserve.engine.requests.outputs import (
    CompletionOutput,
    Logprob,
    RequestOutput,
    pack_outputs,
    unpack_outputs,
)


def _every_field_set() -> RequestOutput:
    """An output whose every field differs from its default, so a field lost on the way shows."""
    lp = [Logprob(5, -0.25, {5: -0.25, 9: -1.5}), Logprob(6, -0.5, {}, rank=2)]
    comps = [
        CompletionOutput(0, [5, 6], "ab", "stop", 6, lp, -0.75, 17, None),
        CompletionOutput(1, [7], "c", "error", None, None, -2.0, 3, "device lost"),
    ]
    return RequestOutput(
        request_id="cmpl-1-0",
        prompt_token_ids=[1, 2, 3],
        outputs=comps,
        finished=True,
        prompt="hi",
        num_cached_tokens=16,
        arrival_time=1.5,
        first_token_time=2.5,
        num_draft_tokens=4,
        num_accepted_tokens=3,
        delta=True,
        prompt_logprobs=[None, Logprob(2, -3.0, {2: -3.0}, rank=7)],
        scheduled_time=2.25,
    )


def test_packed_outputs_come_back_equal_field_by_field() -> None:
    out = _every_field_set()
    for f in dataclasses.fields(RequestOutput):  # the fixture really sets every field
        # but `metrics`, which LLM.generate sets on the outputs it builds from what crossed
        if f.default is not dataclasses.MISSING and f.name != "metrics":
            assert getattr(out, f.name) != f.default, f.name
    running = RequestOutput("cmpl-2-0", [], [CompletionOutput(0, [8], "d")], False)
    back = unpack_outputs(pickle.loads(pickle.dumps(pack_outputs([out, running]))))
    assert back == [out, running]
    assert back[1].outputs[0].num_tokens == 1 and back[1].finished is False


def test_packed_outputs_are_plain_tuples() -> None:
    """What crosses holds no output object (that is what made a step's message slow)."""
    packed = pack_outputs([RequestOutput("r", [], [CompletionOutput(0, [1], "x")], False)])
    head, comps = packed[0]
    assert type(head) is tuple and type(comps[0]) is tuple
    assert not any(isinstance(v, (RequestOutput, CompletionOutput)) for v in (*head, *comps[0]))


def test_an_engine_that_emits_packed_outputs_emits_what_it_would_have_packed(make_checkpoint) -> None:
    """The engine process's steps build their outputs packed (`Engine.emit_packed_outputs`): step
    by step they are `pack_outputs` of what an engine building RequestOutputs gives, the prompts'
    ids left out, for every output kind, with logprobs and prompt logprobs, and an abort."""
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.requests.outputs import packed_head
    from deltaserve.engine.requests.sampling_params import SamplingParams

    path = make_checkpoint("qwen3_next")
    engines = [Engine(EngineConfig(model=path, device="cpu", dtype="float32")) for _ in range(2)]
    engines[1].emit_packed_outputs()
    kinds = ["delta", "cumulative", "final_only"]
    for engine in engines:
        for i, kind in enumerate(kinds):
            params = SamplingParams(
                temperature=0.0,
                max_tokens=5 + i,
                ignore_eos=True,
                output_kind=kind,
                logprobs=2,
                prompt_logprobs=1,
            )
            engine.add_request(f"r{i}", [3 + i, 17, 42, 5, 99], params)
        engine.add_request("gone", [8, 9, 10], SamplingParams(max_tokens=50, output_kind="delta"))
    steps = 0
    while engines[0].has_unfinished_requests():
        if steps == 2:
            for engine in engines:
                engine.abort_request("gone")
        plain, packed = engines[0].step(), engines[1].step()
        assert all(type(p) is tuple for p in packed)
        assert [packed_head(p) for p in packed] == [(o.request_id, o.finished) for o in plain]
        back = unpack_outputs(packed)
        for out, twin in zip(plain, back):  # the two engines' clocks differ
            out.prompt_token_ids = []
            out.arrival_time = twin.arrival_time = 0.0
            out.first_token_time = twin.first_token_time = None
            out.scheduled_time = twin.scheduled_time = None
        assert back == plain, steps
        steps += 1
    assert not engines[1].has_unfinished_requests() and steps > 5


def test_a_requests_output_names_each_of_its_fields() -> None:
    """`build_output` (and the packed outputs, which share its field list) takes each field from
    the request's own: a request whose every such field differs shows any field in a wrong place."""
    from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
    from deltaserve.engine.requests.request import Request
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.engine.step.token_sink import build_output

    lp = [Logprob(5, -0.25, {5: -0.25}), Logprob(6, -0.5, {6: -0.5})]
    req = Request(
        "cmpl-7", [1, 2], SamplingParams(output_kind="cumulative", logprobs=1), IncrementalDetokenizer(None)
    )
    req.output_token_ids, req.logprobs, req.cumulative_logprob = [5, 6], lp, -0.75
    req.finish_reason, req.stop_reason, req.error = "stop", 6, "why"
    req.num_cached_tokens, req.arrival_time, req.first_token_time = 16, 1.5, 2.5
    req.scheduled_time = 2.25
    req.num_draft_tokens, req.num_accepted_tokens = 4, 3
    req.prompt_logprobs = [None, Logprob(2, -3.0, {2: -3.0}, rank=7)]
    out = build_output(req)
    assert (out.request_id, out.prompt_token_ids, out.finished, out.prompt, out.delta) == (
        "cmpl-7",
        [1, 2],
        True,
        None,
        False,
    )
    assert (out.num_cached_tokens, out.arrival_time, out.first_token_time) == (16, 1.5, 2.5)
    assert out.scheduled_time == 2.25
    assert (out.num_draft_tokens, out.num_accepted_tokens, out.prompt_logprobs) == (4, 3, req.prompt_logprobs)
    (comp,) = out.outputs
    assert (comp.index, comp.token_ids, comp.finish_reason, comp.stop_reason) == (0, [5, 6], "stop", 6)
    assert (comp.logprobs, comp.cumulative_logprob, comp.num_tokens, comp.error) == (lp, -0.75, 2, "why")
