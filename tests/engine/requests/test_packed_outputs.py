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
    )


def test_packed_outputs_come_back_equal_field_by_field() -> None:
    out = _every_field_set()
    for f in dataclasses.fields(RequestOutput):  # the fixture really sets every field
        if f.default is not dataclasses.MISSING:
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
