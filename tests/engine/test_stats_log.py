"""The engine's periodic stats line: throughputs over the interval, the load now, quiet when idle."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from deltaserve.engine.stats_log import StatsLog


class Engine:
    """Stats as `Engine.stats` gives them, moved by hand."""

    def __init__(self) -> None:
        self.s: dict[str, Any] = {
            "running": 0,
            "waiting": 0,
            "kv_pages_used": 0,
            "kv_pages_total": 200,
            "state_slots_used": 0,
            "state_slots_total": 8,
            "prompt_tokens_total": 0,
            "prefill_tokens_total": 0,
            "generation_tokens_total": 0,
            "cached_tokens_total": 0,
        }
        self.reads = 0

    def stats(self) -> dict[str, Any]:
        self.reads += 1
        return dict(self.s)

    def work(self, prompt: int, cached: int, generated: int, running: int) -> None:
        self.s["prompt_tokens_total"] += prompt
        self.s["cached_tokens_total"] += cached
        self.s["prefill_tokens_total"] += prompt - cached
        self.s["generation_tokens_total"] += generated
        self.s.update(running=running, kv_pages_used=50, state_slots_used=running)


@pytest.fixture
def clock() -> list[float]:
    return [100.0]


def test_a_line_an_interval_with_the_intervals_rates(clock, caplog) -> None:
    engine = Engine()
    log = StatsLog(engine.stats, 10.0, clock=lambda: clock[0])
    engine.work(prompt=3000, cached=1000, generated=500, running=2)
    clock[0] += 9.0
    assert log.tick() is None and engine.reads == 0  # not due: the stats are not even read
    clock[0] += 1.0
    with caplog.at_level(logging.INFO, logger="deltaserve.engine"):
        line = log.tick()
    assert line == (
        "prompt 200.0 tok/s, generation 50.0 tok/s, running 2, waiting 0, KV pages 50/200 (25.0%), "
        "state slots 2/8 (25.0%), prefix cache hits 33.3%"
    )
    assert caplog.messages == [line]
    # the next interval counts only its own tokens
    engine.work(prompt=0, cached=0, generated=1000, running=2)
    clock[0] += 20.0
    assert log.tick().startswith("prompt 0.0 tok/s, generation 50.0 tok/s, running 2")


def test_one_line_for_an_idle_engine_then_quiet_until_it_works(clock) -> None:
    engine = Engine()
    log = StatsLog(engine.stats, 10.0, clock=lambda: clock[0])
    clock[0] += 30.0
    assert log.tick() is None  # a server that has not worked yet says nothing
    engine.work(prompt=100, cached=0, generated=10, running=1)
    lines = []
    for _ in range(4):
        clock[0] += 10.0
        lines.append(log.tick())
        engine.s["running"] = 0  # finished after the first interval
    assert lines[0] is not None and "running 1" in lines[0]
    assert lines[1] is not None and "generation 0.0 tok/s, running 0" in lines[1]  # the idle line
    assert lines[2:] == [None, None]
    engine.work(prompt=10, cached=0, generated=5, running=1)
    clock[0] += 10.0
    assert "running 1" in log.tick()


def first_line(clock: list[float], **stats: float) -> str | None:
    """The line after one interval of a little work, the engine's stats holding `stats` too."""
    engine = Engine()
    engine.s.update(stats)
    log = StatsLog(engine.stats, 10.0, clock=lambda: clock[0])
    engine.work(prompt=100, cached=0, generated=10, running=1)
    clock[0] += 10.0
    return log.tick()


def test_the_line_shows_what_the_adaptive_prefill_delay_weighs(clock) -> None:
    line = first_line(clock, prefill_step_fixed_ms=24.5, prefill_step_us_per_token=1.25, arrivals_per_s=130.0)
    assert line is not None and line.endswith("prefill step +24.5 ms +1.25 us/token at 130.0 arrivals/s")


def test_the_line_shows_where_the_engine_loops_time_went(clock) -> None:
    engine = Engine()
    engine.s.update(step_seconds_total=1.0, gpu_wait_seconds_total=0.5, idle_seconds_total=3.0)
    log = StatsLog(engine.stats, 10.0, clock=lambda: clock[0])
    engine.work(prompt=100, cached=0, generated=10, running=1)
    clock[0] += 10.0
    log.tick()  # the first interval: the totals from before the log started are not its own
    engine.work(prompt=0, cached=0, generated=10, running=1)
    engine.s.update(step_seconds_total=9.0, gpu_wait_seconds_total=3.5, idle_seconds_total=3.5)
    clock[0] += 10.0
    assert log.tick().endswith("loop: steps 80% (waiting for the GPU 30%), idle 5%")
    # an idle loop's seconds are not work: the engine still goes quiet
    engine.s.update(running=0, idle_seconds_total=13.5)
    clock[0] += 10.0
    assert log.tick().endswith("idle 100%")
    engine.s["idle_seconds_total"] = 23.5
    clock[0] += 10.0
    assert log.tick() is None


def test_without_overlapped_steps_the_line_leaves_the_gpu_wait_out(clock) -> None:
    line = first_line(clock, step_seconds_total=6.0, gpu_wait_seconds_total=0.0, idle_seconds_total=1.0)
    assert line is not None and line.endswith("loop: steps 60%, idle 10%")
