"""A stream of many choices lets the event loop serve other requests between the events of one
engine step's outputs (each may carry a long echoed prompt's logprobs), not after all of them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

import deltaserve.server.api.generation as generation


class _Named(generation.Generation[str]):
    """Each output's event is its request id."""

    chunk_type = None  # type: ignore[assignment]
    id_prefix = "test"

    def delta_event(self, out: Any) -> str | None:
        return out.request_id

    def delta_choice(self, out: Any) -> str | None:
        raise AssertionError("not reached")

    def final_choice(self, index: int, out: Any) -> Any:
        raise AssertionError("not reached")

    def response_json(self, choices: list[Any], final: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("not reached")


def test_each_output_of_a_step_after_the_first_yields_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    sleep = asyncio.sleep

    async def recorded(delay: float) -> None:
        seen.append("yield")
        await sleep(delay)

    monkeypatch.setattr(asyncio, "sleep", recorded)

    def output(rid: str) -> Any:
        return SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(finish_reason=None)])

    async def group() -> Any:
        yield [output("a"), output("b"), output("c")]
        yield [output("d")]

    async def stream() -> None:
        named = _Named(None, "m", SimpleNamespace(stream_options=None))  # type: ignore[arg-type]
        async for event in named._events(group()):  # type: ignore[arg-type]
            seen.append(event)

    asyncio.run(stream())
    assert seen == ["a", "yield", "b", "yield", "c", "d", generation.DONE]


def _context() -> Any:
    """A server context over a stand-in engine client that holds no tokenizer (token-id prompts)."""
    from deltaserve.server.api.context import ServerContext
    from deltaserve.server.metrics import Metrics

    client = SimpleNamespace(tokenizer=None, vocab_size=1000, model_info={}, max_model_len=512, metrics=None)
    return ServerContext(client, ["m"], Metrics("m"))  # type: ignore[arg-type]


async def _ticks_during(work: Any) -> int:
    """How often another task ran while `work` (a coroutine) was awaited."""
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0)
            ticks += 1

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0)
    start = ticks
    await work
    ticker.cancel()
    return ticks - start


def test_a_generate_batchs_prompts_are_prepared_with_the_loop_serving_others_between_them() -> None:
    """A /generate batch of many prompts holds the event loop for one prompt's checks and
    parameters at a time, not for the whole batch's, which would stall every other stream."""
    from deltaserve.server.api.generate import GenerateRequest, NativeGeneration

    body = GenerateRequest(input_ids=[[7]] * 300, sampling_params={"max_new_tokens": 1})
    prepared = NativeGeneration(_context(), body)
    assert asyncio.run(_ticks_during(prepared.prepare())) >= 300
    assert len(prepared.requests) == 300


def test_a_completions_batchs_prompts_are_prepared_with_the_loop_serving_others_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As /generate's: a /v1/completions list of prompts, each prompt's parameters built apart."""
    from deltaserve.server.api import completions
    from deltaserve.server.protocol import CompletionRequest

    added: list[str] = []

    async def respond(self: Any, raw: Any, stream: bool) -> None:
        added.extend(r[0] for r in self.requests)

    monkeypatch.setattr(completions.CompletionGeneration, "respond", respond)
    req = CompletionRequest(model="m", prompt=[[7]] * 300, max_tokens=1)
    assert asyncio.run(_ticks_during(completions.create_completion(_context(), req, None))) >= 300  # type: ignore[arg-type]
    assert len(added) == 300
