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
