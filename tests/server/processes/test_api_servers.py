"""`--api-server-count 2`: two HTTP processes on one port and one engine process. Both answer
requests, each gets its own requests' outputs, /metrics adds them up, a disconnect frees its
request, the engine's death fails both processes' requests, and SIGTERM drains them all."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

from .test_engine_process import FailingEngine, children_of, stream_events, wait_for

# Servers of several HTTP processes, started per test
pytestmark = pytest.mark.slow

TWO = ("--api-server-count", "2", "--max-model-len", "512")


def pids_from_log(server) -> tuple[list[int], int]:
    """(the HTTP processes' pids, the engine's pid), as the server logs them at start-up."""
    log = server.log()
    http = re.search(r"HTTP processes share the port \(pids ([\d, ]+)\)", log)
    engine = re.search(r"engine process pid (\d+)", log)
    assert http and engine, log[-2000:]
    return [int(p) for p in http.group(1).split(", ")], int(engine.group(1))


def gone(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status")
    return not status.exists() or "\nState:\tZ" in status.read_text()


async def streams(url: str, n: int, body: dict[str, Any]) -> list[list[str]]:
    """n streamed completions at once, each on its own connection: their data lines."""

    async def one(i: int) -> list[str]:
        async with httpx.AsyncClient(timeout=120) as http:
            payload = {**body, "prompt": f"client {i}", "stream": True}
            async with http.stream("POST", f"{url}/v1/completions", json=payload) as r:
                assert r.status_code == 200
                return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]

    return await asyncio.gather(*[one(i) for i in range(n)])


def counter(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def finished(url: str, outcome: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf'^deltaserve_requests_total{{[^}}]*outcome="{outcome}"}} (\S+)$', text, re.M)
    assert match, text
    return float(match.group(1))


def test_two_http_processes_serve_one_engine_and_count_together(spawn_server) -> None:
    server = spawn_server(*TWO)
    (first, second), engine = pids_from_log(server)
    assert {first, second, engine} <= {server.proc.pid, *children_of(server.proc.pid)}
    body = {
        "model": MODEL_NAME,
        "max_tokens": 6,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    # the kernel hands a burst's connections to whichever process waits first: burst until both
    # have served some (each logs its own access lines)
    bursts = 0
    while True:
        results = asyncio.run(streams(server.url, 48, body))
        bursts += 1
        for events in results:
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["usage"]["completion_tokens"] == 6  # its own tokens, no other's
        log = server.log()
        if log.count("uvicorn.access: 127.0.0.1") and log.count("uvicorn.access[1]: 127.0.0.1"):
            break
        assert bursts < 10, f"one process took every connection: {log[-3000:]}"
    # whichever process answers a scrape, the totals are the server's, once each process has
    # published its counts (every second) since the streams ended
    wait_for(lambda: all(finished(server.url, "length") == 48 * bursts for _ in range(6)))


def test_a_disconnect_in_either_process_frees_its_request(spawn_server) -> None:
    server = spawn_server(*TWO)
    body = {"model": MODEL_NAME, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}

    async def open_and_leave() -> None:
        clients = [httpx.AsyncClient(timeout=60) for _ in range(12)]
        contexts = [c.stream("POST", f"{server.url}/v1/completions", json=body) for c in clients]
        responses = [await ctx.__aenter__() for ctx in contexts]
        for r in responses:  # each has its first chunk: running in the engine
            await r.aiter_lines().__anext__()
        for ctx, c in zip(contexts, clients):
            await ctx.__aexit__(None, None, None)
            await c.aclose()

    bursts = 0
    while True:  # until both processes have had some of the connections (as above)
        asyncio.run(open_and_leave())
        bursts += 1
        log = server.log()
        if log.count("uvicorn.access: 127.0.0.1") and log.count("uvicorn.access[1]: 127.0.0.1"):
            break
        assert bursts < 10, f"one process took every connection: {log[-3000:]}"
    wait_for(lambda: counter(server.url, "deltaserve_num_requests_running") == 0, timeout=30)
    # each process's counts, published every second: the same total from either process then
    wait_for(lambda: all(finished(server.url, "abort") == 12 * bursts for _ in range(6)))


def test_every_http_process_checks_the_api_key(spawn_server) -> None:
    server = spawn_server(*TWO, "--api-key", "sesame")
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}

    async def without_key() -> list[int]:
        async def one() -> int:
            async with httpx.AsyncClient(timeout=60) as http:  # a connection each: both processes take some
                return (await http.post(f"{server.url}/v1/completions", json=body)).status_code

        return await asyncio.gather(*[one() for _ in range(24)])

    # the kernel hands a burst's connections to whichever process waits first: burst until both
    # have refused some (each logs its own access lines)
    both = (r"uvicorn\.access: .*\" 401", r"uvicorn\.access\[1\]: .*\" 401")
    for _ in range(20):
        assert asyncio.run(without_key()) == [401] * 24
        if all(re.search(p, server.log()) for p in both):
            break
    else:
        raise AssertionError(f"one process took every connection: {server.log()[-3000:]}")
    with_key = httpx.post(
        f"{server.url}/v1/completions", json=body, headers={"Authorization": "Bearer sesame"}, timeout=60
    )
    assert with_key.status_code == 200


def test_killed_engine_fails_requests_and_health_in_every_process(spawn_server) -> None:
    server = spawn_server(*TWO)
    _, engine = pids_from_log(server)
    body = {"model": MODEL_NAME, "prompt": "keep going", "max_tokens": 400, "ignore_eos": True}
    outs: list[dict[str, Any]] = [{} for _ in range(8)]
    threads = [
        threading.Thread(target=stream_events, args=(f"{server.url}/v1/completions", body, out))
        for out in outs
    ]
    for t in threads:
        t.start()
    wait_for(lambda: all(out.get("events") for out in outs))  # every one streaming, in both processes
    t0 = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 10  # no hang, in either process
    for out in outs:
        assert out["events"][-1] == "[DONE]"
        assert json.loads(out["events"][-2])["error"]["type"] == "service_unavailable_error"
    for _ in range(10):  # fresh connections: both processes' /health
        with httpx.Client() as http:
            assert http.get(f"{server.url}/health").status_code == 503


def test_sigterm_drains_every_http_process(spawn_server) -> None:
    server = spawn_server(*TWO)
    pids, engine = pids_from_log(server)
    outs: list[dict[str, Any]] = [{} for _ in range(8)]
    # of different lengths: the process whose requests end first must not stop the engine under the other's
    threads = [
        threading.Thread(
            target=stream_events,
            args=(
                f"{server.url}/v1/completions",
                {"model": MODEL_NAME, "prompt": "drain", "max_tokens": 20 + 40 * i, "ignore_eos": True},
                out,
            ),
        )
        for i, out in enumerate(outs)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: server.log().count("POST /v1/completions") >= 8)
    server.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0
    for out in outs:  # running requests finished within the drain's time
        assert out["events"][-1] == "[DONE]" and "error" not in out["events"][-2]
    assert server.log().count("Finished server process") == 2
    wait_for(lambda: all(gone(p) for p in [*pids, engine]), timeout=30)


def two_socket_pairs(engine: Any) -> tuple[Any, Any, Any]:
    """(first, second, core): `engine`'s loop in a thread with two HTTP processes' socket pairs,
    ready; stop with `second.close()` then `first.stop(10)`."""
    from deltaserve.engine.core import EngineCore, engine_info
    from deltaserve.server.engine_client import EngineHandle

    first = EngineHandle._bind()
    second = EngineHandle._bind(first.ipc_dir, 1)
    core = EngineCore(
        engine, [first.address("in", i) for i in (0, 1)], [first.address("out", i) for i in (0, 1)]
    )

    def loop() -> None:
        core.send(("ready", engine_info(engine)))
        core.run()

    first.thread = second.thread = threading.Thread(target=loop, daemon=True)
    first.thread.start()
    first.await_ready(30)
    second.info = first.info
    return first, second, core


class FailsOnceAllAreIn(FailingEngine):
    """Four steps with all three requests, then a step that fails for a reason no request explains."""

    def step(self) -> list[RequestOutput]:
        if len(self.requests) == 3:
            self.steps += 1
            if self.steps == 5:
                raise RuntimeError("device lost")
        time.sleep(0.01)
        return [
            RequestOutput(rid, [], [CompletionOutput(0, [7], "x", None)], False, delta=True)
            for rid in self.requests
        ]


def test_each_http_process_gets_its_own_outputs_and_faults() -> None:
    """The engine loop with two socket pairs: each client sees only its own requests' outputs,
    and a failed step fails each client's own requests (both count the fault)."""
    from deltaserve.engine.errors import EngineFaultError
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.server.engine_client import EngineClient

    engine = FailsOnceAllAreIn()
    first, second, core = two_socket_pairs(engine)
    params = SamplingParams(max_tokens=50, output_kind="delta")

    async def run() -> tuple[dict[str, set[str]], dict[str, BaseException], list[int]]:
        clients = {"a": EngineClient(first), "b": EngineClient(second)}
        for c in clients.values():
            await c.start()
        seen: dict[str, set[str]] = {"a": set(), "b": set()}
        errors: dict[str, BaseException] = {}

        async def read(name: str, group: Any) -> None:
            try:
                async for outs in group:
                    seen[name].update(o.request_id for o in outs)
            except EngineFaultError as exc:
                errors[name] = exc

        # each read from its add on, so that the steps' outputs are taken before the fault
        reading = [asyncio.create_task(read("a", await clients["a"].add([("a1", [1, 2], params)])))]
        b_group = await clients["b"].add([("b1", [1, 2], params), ("b2", [3], params)])
        reading.append(asyncio.create_task(read("b", b_group)))
        await asyncio.wait_for(asyncio.gather(*reading), 30)
        return seen, errors, [c.faults for c in clients.values()]

    try:
        seen, errors, faults = asyncio.run(run())
    finally:
        second.close()
        first.stop(10)
    assert seen == {"a": {"a1"}, "b": {"b1", "b2"}}
    assert set(errors) == {"a", "b"} and faults == [1, 1]
    assert not engine.requests


class EndlessEngine(FailingEngine):
    """A token a step for each request, until it is aborted."""

    def step(self) -> list[RequestOutput]:
        time.sleep(0.01)
        return [
            RequestOutput(rid, [], [CompletionOutput(0, [7], "x", None)], False, delta=True)
            for rid in self.requests
        ]


def test_a_gone_http_process_has_its_requests_aborted_and_the_other_is_served() -> None:
    """An HTTP process that is gone (its pid no longer runs) gets its requests aborted within
    about a second, and nothing more is sent to it (a full socket would block the loop), while
    the other process's requests go on streaming."""
    import subprocess
    import sys

    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.server.engine_client import EngineClient

    engine = EndlessEngine()
    first, second, core = two_socket_pairs(engine)
    gone_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    params = SamplingParams(max_tokens=10_000, output_kind="delta")

    async def run() -> tuple[bool, int]:
        a, b = EngineClient(first), EngineClient(second)
        await a.start()
        await b.start()
        await b._send(("hello", int(gone_pid.stdout)), 0)  # b's process as the engine will find it: exited
        await b.add([("b1", [1], params)])
        a_group = await a.add([("a1", [1], params)])
        start = time.monotonic()
        while "b1" in engine.requests and time.monotonic() - start < 10:
            await asyncio.sleep(0.05)
        aborted = "b1" not in engine.requests
        served = 0
        async for outs in a_group:  # a's request still streams after b's is gone
            served += len(outs)
            if served >= 20:
                break
        return aborted, served

    try:
        aborted, served = asyncio.run(run())
    finally:
        second.close()
        first.stop(10)
    assert aborted and served >= 20
    assert core._lost == {1}


def test_an_abort_through_one_process_ends_what_the_other_still_prepared() -> None:
    """An abort_where through one HTTP process while the other still prepares a request it names
    (tokenizing, a grammar, a warm-up prefill): the engine ends that request once it is added, as
    it arrived before the abort; one that arrived after the abort runs."""
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.server.engine_client import EngineClient

    engine = EndlessEngine()
    first, second, core = two_socket_pairs(engine)
    params = SamplingParams(max_tokens=10_000, output_kind="delta")

    async def run() -> set[str]:
        a, b = EngineClient(first), EngineClient(second)
        await a.start()
        await b.start()
        arrived = time.monotonic()  # job-1's HTTP request comes to a, which prepares it
        await b.abort_where("job-")  # meanwhile an /abort_request comes to b
        await a.add([("job-1", [1], params)], arrived=arrived)
        await a.add([("job-2", [1], params)], arrived=time.monotonic())  # sent after the abort
        await a.add([("other-1", [1], params)], arrived=arrived)  # not named by it
        deadline = time.monotonic() + 30
        while set(engine.requests) != {"job-2", "other-1"} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # until the adds and the abort reached the engine
        return set(engine.requests)

    try:
        running = asyncio.run(run())
    finally:
        second.close()
        first.stop(10)
    assert running == {"job-2", "other-1"}


def test_a_lost_http_process_stops_the_server_with_an_error(spawn_server) -> None:
    server = spawn_server(*TWO)
    (_, second), engine = pids_from_log(server)
    os.kill(second, signal.SIGKILL)
    assert server.proc.wait(60) == 1  # exits, not serving on half of itself; a supervisor restarts it
    assert f"stopped because HTTP process {second} exited" in server.log()
    wait_for(lambda: gone(engine), timeout=30)


def test_default_count_is_two_beside_a_cuda_engine_with_cores_for_them() -> None:
    from deltaserve.server.api_servers import default_api_server_count

    assert default_api_server_count("cuda", 16) == 2
    assert default_api_server_count("cuda:1", 8) == 2
    assert default_api_server_count("cuda", 4) == 1  # the engine and two HTTP processes would share cores
    assert default_api_server_count("cpu", 64) == 1
    # data-parallel engines: one HTTP process each, while each keeps a core beside its engine's
    assert default_api_server_count("cuda", 128, engines=8) == 8
    assert default_api_server_count("cuda", 16, engines=8) == 2  # 8 engines leave no core for 8 more
    assert default_api_server_count("cuda", 16, engines=4) == 4
    assert default_api_server_count("cpu", 64, engines=4) == 1


def test_a_request_sent_after_abort_all_returns_is_not_aborted(spawn_server) -> None:
    """abort_all answers once the engine has applied it: a request sent after the answer, on
    another connection (often the other HTTP process's), runs to its end; it could be read first
    and caught by the abort."""
    server = spawn_server(*TWO)

    async def trials() -> list[str]:
        endings = []
        for trial in range(30):
            async with httpx.AsyncClient(timeout=60) as one, httpx.AsyncClient(timeout=60) as two:
                busy = [
                    asyncio.ensure_future(
                        one.post(f"{server.url}/v1/completions", json={"prompt": f"bg {i}", "max_tokens": 30})
                    )
                    for i in range(4)
                ]
                await asyncio.sleep(0.01 * (trial % 5))
                assert (
                    await one.post(f"{server.url}/abort_request", json={"abort_all": True})
                ).status_code == 200
                body = {"prompt": "after", "max_tokens": 5, "ignore_eos": True}
                reply = await two.post(f"{server.url}/v1/completions", json=body)
                endings.append(reply.json()["choices"][0]["finish_reason"])
                await asyncio.gather(*busy)
        return endings

    assert asyncio.run(trials()) == ["length"] * 30


def test_a_stored_response_is_found_through_every_http_process(spawn_server) -> None:
    """A response stored through one HTTP process is retrieved, listed, continued and deleted
    through either: a client's next connection may go to the other one."""
    server = spawn_server(*TWO)

    def fresh(method: str, path: str, **kwargs: Any) -> httpx.Response:
        with httpx.Client(timeout=60, headers={"Connection": "close"}) as http:
            return http.request(method, f"{server.url}{path}", **kwargs)

    def takers(path: str) -> set[str]:  # the HTTP processes that answered ("uvicorn.access[1]:" the second)
        return {line.split()[3] for line in server.log().splitlines() if path in line}

    made = fresh(
        "POST", "/v1/responses", json={"model": MODEL_NAME, "input": "remember me", "max_output_tokens": 16}
    )
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    # which process accepts a connection is the kernel's choice: calls go on until both have answered
    for _ in range(40):
        got = fresh("GET", f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.json()["id"] == rid, got.text
        items = fresh("GET", f"/v1/responses/{rid}/input_items")
        assert items.status_code == 200 and items.json()["data"], items.text
        follow = {"model": MODEL_NAME, "input": "and?", "previous_response_id": rid, "max_output_tokens": 16}
        assert fresh("POST", "/v1/responses", json=follow).status_code == 200
        if len(takers(f"GET /v1/responses/{rid} ")) == 2 and len(takers("POST /v1/responses ")) == 2:
            break
    assert len(takers(f"GET /v1/responses/{rid} ")) == 2, takers(f"GET /v1/responses/{rid} ")
    assert fresh("DELETE", f"/v1/responses/{rid}").status_code == 200
    for _ in range(6):  # gone for both
        assert fresh("GET", f"/v1/responses/{rid}").status_code == 404
