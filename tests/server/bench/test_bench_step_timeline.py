"""bench.serving.step_timeline: the engine's debug step lines summed, between a run's marks."""

from __future__ import annotations

from bench.serving.step_timeline import Timeline

LOG = """\
x DEBUG deltaserve.engine: step: 1 decodes, 0 verifications, 0 prefill chunks of 0 tokens; - since the last
x INFO uvicorn.access: 127.0.0.1 - "GET /metrics HTTP/1.1" 200
x DEBUG deltaserve.engine: step: 0 decodes, 0 verifications, 2 prefill chunks of 64 tokens; 500.00 ms since the last
x DEBUG deltaserve.engine: step: 2 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 30.00 ms since the last
x DEBUG deltaserve.engine: step: 1 decodes, 1 verifications, 1 prefill chunks of 32 tokens; 10.00 ms since the last
x DEBUG deltaserve.engine: step: 3 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 50.00 ms since the last
x DEBUG deltaserve.engine: step: 3 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 12.00 ms since the last
x INFO uvicorn.access: 127.0.0.1 - "GET /metrics HTTP/1.1" 200
x DEBUG deltaserve.engine: step: 9 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 8.00 ms since the last
"""


def test_steps_between_the_marks_are_timed_by_the_next_line() -> None:
    s = Timeline.parse(LOG.splitlines(), between="GET /metrics").summary()
    # five steps between the marks; the last of them has no next line inside, so four are timed:
    # the prefill step 30 ms, the decode step 10, the mixed step 50, a decode step 12
    assert s["steps"] == 4 and s["with_prefill"] == 2
    assert s["decode_rows"] == 0 + 2 + 2 + 3 and s["prefill_tokens"] == 64 + 32
    assert s["decode_ms"] == (10 + 12) / 2 and s["mixed_ms"] == (30 + 50) / 2
    assert abs(s["seconds"] - 0.102) < 1e-9


def test_idle_gaps_are_left_out_and_no_marks_keep_every_step() -> None:
    s = Timeline.parse(LOG.splitlines()).summary(idle_ms=100)
    assert s["steps"] == 5  # six timed (all but the last line), the 500 ms gap left out
    assert Timeline.parse(LOG.splitlines(), between="never").summary()["steps"] == 0


def test_a_run_keeps_only_the_steps_between_its_own_pair_of_marks() -> None:
    second = """\
x DEBUG deltaserve.engine: step: 5 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 7.00 ms since the last
x INFO uvicorn.access: 127.0.0.1 - "GET /metrics HTTP/1.1" 200
x DEBUG deltaserve.engine: step: 4 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 9.00 ms since the last
x DEBUG deltaserve.engine: step: 4 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 6.00 ms since the last
x DEBUG deltaserve.engine: step: 4 decodes, 0 verifications, 0 prefill chunks of 0 tokens; 6.00 ms since the last
x INFO uvicorn.access: 127.0.0.1 - "GET /metrics HTTP/1.1" 200
"""
    lines = (LOG + second).splitlines()
    first = Timeline.parse(lines, between="GET /metrics", run=1).summary()
    assert first["steps"] == 4 and first["with_prefill"] == 2
    s = Timeline.parse(lines, between="GET /metrics", run=2).summary()
    # three steps between the second run's marks, the first two timed (6 ms each)
    assert s["steps"] == 2 and s["decode_rows"] == 8 and s["decode_ms"] == 6.0
    assert Timeline.parse(lines, between="GET /metrics", run=3).summary()["steps"] == 0


def test_steps_with_prefill_give_their_median_p90_and_slowest() -> None:
    times = [90.0, 100.0, 80.0, 360.0, 95.0]
    lines = [
        f"step: 4 decodes, 0 verifications, 1 prefill chunks of 8192 tokens; {'-' if i == 0 else f'{times[i - 1]:.2f} ms'} since the last"
        for i in range(len(times) + 1)
    ]
    s = Timeline.parse(lines).summary()
    assert s["with_prefill"] == 5
    assert (s["mixed_p50_ms"], s["mixed_p90_ms"], s["mixed_max_ms"]) == (95.0, 360.0, 360.0)
    assert Timeline.parse(lines[:1]).summary()["mixed_max_ms"] == 0.0
