"""A reader that falls behind gets the outputs that queued up merged into one per request."""

from __future__ import annotations

import asyncio

from deltaserve.engine.requests.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.server.engine_client import RequestGroup


def output(
    rid: str, ids: list[int], text: str, n: int, delta: bool, reason: str | None = None
) -> RequestOutput:
    logprobs = [Logprob(i, -float(i)) for i in ids]
    comp = CompletionOutput(0, ids, text, reason, logprobs=logprobs, num_tokens=n)
    return RequestOutput(rid, [1, 2], [comp], reason is not None, delta=delta)


def read_once(items: list[RequestOutput]) -> dict[str, RequestOutput]:
    async def run() -> dict[str, RequestOutput]:
        group = RequestGroup(sorted({o.request_id for o in items}))
        for item in items:
            group.queue.put_nowait(item)
        return {o.request_id: o for o in await group.__anext__()}

    return asyncio.run(run())


def test_queued_deltas_are_joined_in_order() -> None:
    got = read_once(
        [
            output("a", [5], "he", 1, True),
            output("b", [9], "x", 1, True),
            output("a", [6, 7], "llo", 3, True),
            output("a", [8], "!", 4, True, "stop"),
        ]
    )
    a = got["a"].outputs[0]
    assert (a.token_ids, a.text, a.num_tokens, a.finish_reason) == ([5, 6, 7, 8], "hello!", 4, "stop")
    assert [lp.token_id for lp in a.logprobs] == [5, 6, 7, 8] and got["a"].finished
    assert got["b"].outputs[0].text == "x"


def test_a_cumulative_output_replaces_older_ones() -> None:
    got = read_once([output("a", [5], "he", 1, False), output("a", [5, 6], "hello", 2, False)])
    assert (got["a"].outputs[0].token_ids, got["a"].outputs[0].text) == ([5, 6], "hello")
