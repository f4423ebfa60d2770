"""The engine in its own process: load, liveness, its death, a failed step, and the shutdown contract."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

from ..conftest import app_in_thread, metrics_of

# Engine processes started, and killed, per test
pytestmark = pytest.mark.slow


def children_of(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        kids.extend(int(k) for k in text)
    return kids


def engine_pid(server_pid: int) -> int:
    """The server's child that holds the model (the other child is multiprocessing's tracker)."""
    for pid in children_of(server_pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            return pid
    raise AssertionError(f"no engine process under {server_pid}: {children_of(server_pid)}")


def stream_events(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """The stream's data lines into `out["events"]` as they come (a test waits for the first)."""
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
        out["status"] = r.status_code
        events: list[str] = []
        out["events"] = events
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def two_running(
    server, body: dict[str, Any]
) -> tuple[list[threading.Thread], dict[str, Any], dict[str, Any]]:
    """A streamed and a whole request of `body`, running (in threads) when this returns; their
    results land in the two dicts once the threads end."""
    streamed: dict[str, Any] = {}
    whole: dict[str, Any] = {}

    def post() -> None:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        whole["status"], whole["body"] = r.status_code, r.json()

    threads = [
        threading.Thread(target=stream_events, args=(f"{server.url}/v1/completions", body, streamed)),
        threading.Thread(target=post),
    ]
    for t in threads:
        t.start()
    wait_for(lambda: metrics_of(server.url)["deltaserve_num_requests_running"] >= 2)
    return threads, streamed, whole


def test_engine_runs_in_its_own_process(server) -> None:
    assert server.proc is not None
    pid = engine_pid(server.proc.pid)
    assert pid != server.proc.pid
    # the model's weights live there: the engine process is the big one
    rss = {p: int(Path(f"/proc/{p}/statm").read_text().split()[1]) for p in (pid, server.proc.pid)}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert rss[pid] > 0


def test_256_concurrent_streams_complete_and_health_stays_quick(server, until_idle) -> None:
    body = {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def run() -> tuple[list[int], list[float]]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            health: list[float] = []
            done = asyncio.Event()

            async def probe() -> None:
                while not done.is_set():
                    t = time.perf_counter()
                    r = await http.get(f"{server.url}/health")
                    assert r.status_code == 200
                    health.append(time.perf_counter() - t)
                    await asyncio.sleep(0.05)

            async def one(i: int) -> int:
                tokens = 0
                payload = {**body, "prompt": f"client {i} says hello"}
                async with http.stream("POST", f"{server.url}/v1/completions", json=payload) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            assert "error" not in event, event
                            if event.get("usage"):
                                tokens = event["usage"]["completion_tokens"]
                return tokens

            prober = asyncio.ensure_future(probe())
            counts = await asyncio.gather(*[one(i) for i in range(256)])
            done.set()
            await prober
            return counts, health

    counts, health = asyncio.run(run())
    assert counts == [8] * 256
    assert len(health) >= 20
    # the event loop never waits on a step; the client's own 256 streams share these cores, so the
    # tail is judged at p95 (a burst of connections can hold single probes), the body at the median
    health.sort()
    assert health[len(health) // 2] < 0.25, health[-5:]
    assert health[int(len(health) * 0.95)] < 1.0, health[-5:]
    assert health[-1] < 10.0, health[-5:]
    until_idle(server.url)


def test_killed_engine_fails_requests_in_flight_and_health(spawn_server) -> None:
    server = spawn_server("--max-model-len", "512")
    assert server.proc is not None
    long = {"model": MODEL_NAME, "prompt": "keep going", "max_tokens": 400, "ignore_eos": True}
    threads, streamed, whole = two_running(server, long)
    t0 = time.monotonic()
    os.kill(engine_pid(server.proc.pid), signal.SIGKILL)
    for t in threads:
        t.join(30)
    assert time.monotonic() - t0 < 10  # no hang
    events = streamed["events"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error" and "engine" in error["message"]
    assert error["code"] == "engine_unavailable"  # as the non-streamed reply's (it was null)
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "engine_unavailable"
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "engine" in health.json()["reason"]
    deep = httpx.get(f"{server.url}/health_generate", timeout=30)  # SGLang's
    assert deep.status_code == 503 and "engine" in deep.json()["reason"]
    late = httpx.post(f"{server.url}/v1/completions", json={**long, "max_tokens": 2}, timeout=10)
    assert late.status_code == 503
    assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_a_request_sent_to_an_engine_that_just_died_fails_instead_of_hanging() -> None:
    """A request added after the engine died but before the client noticed (it polls the engine
    every 0.2 s) is sent to a socket no engine reads any more, a send that waits for ever: it
    fails with the engine's death, as the requests in flight do, instead of holding its client."""
    import zmq
    import zmq.asyncio

    from deltaserve.engine.errors import EngineDeadError
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.server.engine_client import EngineClient

    client = EngineClient.in_thread(FailingEngine())

    async def run() -> None:
        await client.start()
        live = client._pushes[0]
        nobody = zmq.asyncio.Context.instance().socket(zmq.PUSH)  # the dead engine's end: no reader
        nobody.bind(f"ipc://{client.handle.ipc_dir}/nobody")
        client._pushes[0] = nobody
        try:
            asyncio.get_running_loop().call_later(0.3, client._on_dead, "the engine process exited (code -9)")
            adding = client.add([("late", [1, 2, 3], SamplingParams(max_tokens=2))])
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(adding, 10)
        finally:
            client._pushes[0] = live
            nobody.close(linger=0)
            await client.shutdown()

    asyncio.run(run())


def test_an_engine_watched_by_its_pid_dies_without_an_unknown_exit_code_in_its_reason() -> None:
    """An HTTP process other than 0 watches the engine by its pid (another process's child, whose
    exit code it cannot read): /health's reason and its requests' errors say the engine exited,
    without the "code None" of a code it never had."""
    import subprocess
    import sys

    from deltaserve.server.engine_client import EngineClient

    client = EngineClient.in_thread(FailingEngine())
    handle = client.handle
    thread = handle.thread
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()

    async def run() -> tuple[bool, str]:
        await client.start()
        handle.thread, handle.engine_pid = None, exited.pid  # as `EngineHandle.attach` leaves it
        try:
            while client.dead is None:
                await asyncio.sleep(0.05)
            return client.health()
        finally:
            handle.thread, handle.engine_pid = thread, None
            await client.shutdown()

    assert asyncio.run(asyncio.wait_for(run(), 30)) == (False, "the engine process exited")


def test_shutdown_deadline_ends_every_request_with_an_error_and_drains_with_503(spawn_server) -> None:
    server = spawn_server("--max-model-len", "2048", "--shutdown-timeout", "2")
    assert server.proc is not None
    long = {"model": MODEL_NAME, "prompt": "never ends", "max_tokens": 2000, "ignore_eos": True}
    threads, streamed, whole = two_running(server, long)
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 503)  # the signal taken
    # draining: new requests are answered, with 503 and Retry-After, not refused
    refused = httpx.post(f"{server.url}/v1/completions", json={**long, "max_tokens": 2}, timeout=10)
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    assert refused.json()["error"]["code"] == "shutting_down"  # not queue_full: another server may take it
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0
    events = streamed["events"]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "service_unavailable_error"
    assert error["code"] == "shutting_down"  # the stream's error event is coded as the refusals are
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "shutting_down"  # as the refusals'


class FailingEngine:
    """The Engine's interface; its third step raises for a reason no request explains."""

    tokenizer = None
    max_model_len = 256
    vocab_size = 1000
    eos_token_ids: list[int] = []
    model_info = {"model": "failing", "architecture": "Failing"}

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.steps = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self.requests[request_id] = 0

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.requests), "waiting": 0}

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        time.sleep(0.01)
        if self.steps == 3:
            raise RuntimeError("device lost")
        outs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            outs.append(RequestOutput(rid, [], [CompletionOutput(0, [7], "x", None)], False, delta=True))
        return outs


def test_a_step_failure_fails_its_requests_marks_unhealthy_and_is_counted() -> None:
    from deltaserve.server.app import build_app
    from deltaserve.server.engine_client import EngineClient

    engine = FailingEngine()
    app = build_app(EngineClient.in_thread(engine), model_names=["failing"])
    with app_in_thread(app, join_s=10) as port:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/health").status_code == 200
        out: dict[str, Any] = {}
        stream_events(f"{url}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 50}, out)
        assert out["events"][-1] == "[DONE]"
        error = json.loads(out["events"][-2])["error"]
        assert error["type"] == "server_error" and "device lost" not in error["message"]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and "step failed" in health.json()["reason"]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'deltaserve_engine_faults_total{model_name="failing"} 1' in metrics
        assert not engine.requests  # the loop aborted what it held


class SlowGrammarEngine(FailingEngine):
    """Compiles the regex "slow" until `release` is set; any other grammar at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.compiling = threading.Event()  # a "slow" compile has begun
        self.compiled: list[str] = []

    def compile_structured(self, spec: Any) -> None:
        if spec.regex == "slow":
            self.compiling.set()
            self.release.wait(30)
        self.compiled.append(spec.regex)


def test_a_slow_grammar_does_not_hold_up_the_other_requests_grammars() -> None:
    """A grammar that takes xgrammar minutes to compile (a choice of thousands of strings) holds
    up its own request only: another request's grammar compiles meanwhile. (One worker compiled
    them all, in turn: every structured output waited for the slow one.)"""
    from deltaserve.engine.requests.sampling_params import StructuredOutputs
    from deltaserve.server.engine_client import EngineClient

    engine = SlowGrammarEngine()
    client = EngineClient.in_thread(engine)

    async def run() -> None:
        await client.start()
        try:
            slow = asyncio.create_task(client.call("compile_structured", StructuredOutputs(regex="slow")))
            assert await asyncio.to_thread(engine.compiling.wait, 10)
            await asyncio.wait_for(client.call("compile_structured", StructuredOutputs(regex="[0-9]+")), 10)
            assert engine.compiled == ["[0-9]+"] and not slow.done()
            engine.release.set()
            await asyncio.wait_for(slow, 10)
            assert engine.compiled == ["[0-9]+", "slow"]
        finally:
            engine.release.set()
            await client.shutdown()

    asyncio.run(run())


def test_requests_for_a_grammar_being_compiled_wait_without_holding_the_compile_workers(
    tokenized_checkpoint, monkeypatch
) -> None:
    """Requests that ask for a grammar another request is compiling wait for that compile, and
    while they wait they hold none of the engine's compile workers: clients retrying a grammar
    that takes xgrammar minutes (a large choice) each held one, waiting, and once they held all
    four every other request's grammar waited too (a small regex, for 272 s here)."""
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.core import OFF_LOOP_WORKERS
    from deltaserve.engine.engine import Engine
    from deltaserve.engine.requests.sampling_params import StructuredOutputs
    from deltaserve.engine.sampling import structured
    from deltaserve.server.engine_client import EngineClient

    release = threading.Event()
    compile_now = structured.Grammars._compile

    def held(self: Any, spec: Any) -> Any:
        if spec.regex == "[a-z]+":  # the slow grammar: compiled once it is released
            release.wait(30)
        return compile_now(self, spec)

    monkeypatch.setattr(structured.Grammars, "_compile", held)
    engine = Engine(EngineConfig(model=tokenized_checkpoint, dtype="float32", device="cpu"))
    taken: list[Any] = []
    workers_taken = threading.Event()  # as many of them as there are compile workers began
    compile_structured = engine.compile_structured

    def counted(spec: Any) -> Any:
        taken.append(spec)
        if len(taken) >= OFF_LOOP_WORKERS:
            workers_taken.set()
        return compile_structured(spec)

    monkeypatch.setattr(engine, "compile_structured", counted)
    client = EngineClient.in_thread(engine)

    async def run() -> None:
        await client.start()
        try:
            asked = [
                asyncio.create_task(client.call("compile_structured", StructuredOutputs(regex="[a-z]+")))
                for _ in range(OFF_LOOP_WORKERS + 2)
            ]
            assert await asyncio.to_thread(workers_taken.wait, 30)
            await asyncio.wait_for(client.call("compile_structured", StructuredOutputs(regex="[0-9]+")), 10)
            assert not any(task.done() for task in asked)
            release.set()
            await asyncio.wait_for(asyncio.gather(*asked), 30)
            with pytest.raises(
                ValueError, match="cannot be compiled"
            ):  # a waiter gets the compile's error too
                await asyncio.gather(
                    *(
                        client.call("compile_structured", StructuredOutputs(regex="(unclosed"))
                        for _ in range(3)
                    )
                )
        finally:
            release.set()
            await client.shutdown()

    asyncio.run(run())


_COMPILING_AT_EXIT = """
import asyncio, threading, time
from deltaserve.engine.requests.sampling_params import StructuredOutputs
from deltaserve.server.engine_client import EngineClient


class Engine:
    tokenizer = None
    max_model_len = 256
    vocab_size = 1000
    eos_token_ids = []
    model_info = {"model": "slow", "architecture": "Slow"}
    def add_request(self, *args): pass
    def abort_request(self, request_id): pass
    def has_unfinished_requests(self): return False
    def stats(self): return {"running": 0, "waiting": 0}
    def step(self): return []
    def compile_structured(self, spec):
        print("compiling", flush=True)
        started.set()
        time.sleep(60)


started = threading.Event()


async def main():
    client = EngineClient.in_thread(Engine())
    await client.start()
    compiling = asyncio.ensure_future(client.call("compile_structured", StructuredOutputs(regex="slow")))
    while not started.is_set():  # its compile under way
        await asyncio.sleep(0.02)
    compiling.cancel()
    await client.shutdown()
    print("stopped", flush=True)

asyncio.run(main())
"""


def test_an_engine_stopped_while_a_grammar_compiles_exits_at_once(tmp_path: Path) -> None:
    """A stopped engine's process ends without waiting for a grammar still compiling (minutes, for a
    large choice): its compile threads were joined at the process's exit, so a server's SIGTERM
    waited out the engine's 30 s stop deadline and then killed it."""
    import subprocess
    import sys

    script = tmp_path / "compiling_at_exit.py"
    script.write_text(_COMPILING_AT_EXIT)
    # an exit that joined the compile's thread would come after its 60 s: past this timeout
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=45)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["compiling", "stopped"]


@pytest.mark.parametrize("end", ["drain", "engine_dies"])
def test_a_request_whose_grammar_outlasts_the_server_or_engine_is_a_503(end: str) -> None:
    """A request still waiting for its grammar's compile when the drain ends is a 503 coded
    shutting_down, as a request still running is. (It was no request in flight to the drain,
    which ended at once; uvicorn then cancelled it: a 500 and a traceback in the log.) One whose
    engine dies meanwhile is a 503 coded engine_unavailable (it was a 500)."""
    import socket

    import uvicorn

    from deltaserve.server.app import build_app
    from deltaserve.server.draining import DrainingServer
    from deltaserve.server.engine_client import EngineClient

    engine = SlowGrammarEngine()
    client = EngineClient.in_thread(engine)
    app = build_app(client, model_names=["failing"])
    sock = socket.socket()  # held from here until the server serves on it: no other process takes the port
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=1
    )
    server = DrainingServer(config, client, drain_s=0.5)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: server.started)
    out: dict[str, Any] = {}

    def post() -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": 5, "structured_outputs": {"regex": "slow"}}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
        out["status"], out["body"] = r.status_code, r.json()

    poster = threading.Thread(target=post)
    poster.start()
    try:
        assert engine.compiling.wait(30)  # its grammar compiling
        if end == "drain":
            server.handle_exit(signal.SIGTERM, None)
        else:
            assert server.loop is not None
            server.loop.call_soon_threadsafe(client._on_dead, "the engine process exited")
        poster.join(20)
        code = "shutting_down" if end == "drain" else "engine_unavailable"
        assert out["status"] == 503 and out["body"]["error"]["code"] == code
    finally:
        engine.release.set()
        if end != "drain":
            server.handle_exit(signal.SIGTERM, None)
        thread.join(20)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 5, "structured_outputs": {"regex": "slow"}}),
        (
            "/v1/completions",
            {"prompt": [1, 2, 3], "max_tokens": 5, "structured_outputs": {"regex": "slow"}, "stream": True},
        ),
        ("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5, "regex": "slow"}}),
    ],
)
def test_a_client_that_hangs_up_while_its_grammar_compiles_is_let_go(path: str, body: dict[str, Any]) -> None:
    """A request waiting for its grammar's compile stops waiting once its client hangs up, and never
    reaches the engine; the compile goes on. (The handler waited out the compile, minutes for a
    large choice, and only then submitted the request, for the disconnect to abort it.)"""
    import socket

    from deltaserve.server.app import build_app
    from deltaserve.server.engine_client import EngineClient

    engine = SlowGrammarEngine()
    client = EngineClient.in_thread(engine)
    app = build_app(client, model_names=["failing"])
    payload = json.dumps(body).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with app_in_thread(app) as port:
        try:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(request)
                wait_for(lambda: client.num_calls == 1, timeout=10)  # its grammar compiling
            # the client gone: no one waits for it (not the compile, which ends on its own after 30 s)
            wait_for(lambda: client.num_calls == 0, timeout=15)
            assert engine.compiled == []  # ... while the compile goes on
            engine.release.set()
            wait_for(lambda: engine.compiled == ["slow"], timeout=10)
            time.sleep(0.3)  # nothing to wait for: a request that reached the engine would show by now
            assert engine.steps == 0 and not engine.requests  # the request never reached the engine
        finally:
            engine.release.set()


def test_a_grammar_not_compiled_in_time_is_a_400_and_is_not_compiled_once_its_caller_left(
    monkeypatch,
) -> None:
    """A request whose grammar is not compiled within the grammar timeout is a 400 coded
    grammar_timeout (SGLang's timeout), and a grammar whose caller gave up while it waited for a
    compile worker is never compiled. (A request waited as long as its compile took, minutes for
    an object of a thousand optional properties, and the grammars queued behind such compiles
    each took a worker in turn, long after their clients had gone.)"""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from deltaserve.engine.core import OFF_LOOP_WORKERS
    from deltaserve.server.app import build_app
    from deltaserve.server.engine_client import EngineClient

    monkeypatch.setenv("DELTASERVE_GRAMMAR_TIMEOUT", "1")
    engine = SlowGrammarEngine()
    app = build_app(EngineClient.in_thread(engine), model_names=["failing"])
    with app_in_thread(app) as port:
        try:
            url = f"http://127.0.0.1:{port}/v1"
            with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=20) as api:

                def ask(regex: str) -> openai.BadRequestError:
                    with pytest.raises(openai.BadRequestError) as refused:
                        api.completions.create(
                            model="failing",
                            prompt=[1, 2, 3],
                            max_tokens=5,
                            extra_body={"structured_outputs": {"regex": regex}},
                        )
                    return refused.value

                started = time.monotonic()
                with ThreadPoolExecutor(OFF_LOOP_WORKERS) as pool:  # every compile worker held
                    errors = list(pool.map(ask, ["slow"] * OFF_LOOP_WORKERS))
                errors.append(ask("[0-9]+"))  # queued behind them
                assert time.monotonic() - started < 10
            for err in errors:
                assert err.code == "grammar_timeout" and err.param == "structured_outputs", err
            # the queued grammar past the timeout too: it reached the engine after its wait began
            time.sleep(1)  # a duration, not an event: the grammar timeout passes for the queued one
            engine.release.set()
            wait_for(lambda: len(engine.compiled) >= OFF_LOOP_WORKERS, timeout=10)
            time.sleep(0.5)  # nothing to wait for: the queued grammar, if compiled, would show by now
            assert engine.compiled == ["slow"] * OFF_LOOP_WORKERS
        finally:
            engine.release.set()


class TwoPlacesEngine(FailingEngine):
    """Holds two requests at once, one running and one waiting (what the HTTP process reads)."""

    config = SimpleNamespace(num_running=1, max_waiting_requests=1)


def test_a_batch_of_one_prompt_repeated_is_refused_naming_prompt_not_n() -> None:
    """More sequences than an idle engine holds is a 400: a prompt's n samples name n, and a batch
    that repeats a prompt names prompt (its copies were counted as one prompt's samples)."""
    from deltaserve.engine.errors import InvalidParamError
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.server.api.request_params import fan_out
    from deltaserve.server.engine_client import EngineClient

    client = EngineClient.in_thread(TwoPlacesEngine())
    params = SamplingParams(max_tokens=1)

    async def run() -> None:
        await client.start()
        try:
            with pytest.raises(InvalidParamError) as batch:
                await client.add([(f"p{i}", [1, 2, 3], params) for i in range(3)])
            assert batch.value.param == "prompt" and "3 sequences" in str(batch.value)
            with pytest.raises(InvalidParamError) as samples:
                await client.add(fan_out("s", [1, 2, 3], replace(params, n=3)))
            assert samples.value.param == "n" and "3 samples" in str(samples.value)
        finally:
            await client.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("flag", ["--max-num-batched-tokens", "--chunked-prefill-size"])
def test_budget_flags_reach_the_engine(flag: str) -> None:
    from deltaserve.server.cli import build_parser

    args = build_parser().parse_args(["serve", flag, "2048"])
    assert getattr(args, flag[2:].replace("-", "_")) == 2048


def test_more_slots_than_fit_start_with_what_fits_and_say_so(spawn_server, read_metrics) -> None:
    server = spawn_server(
        "--max-model-len", "512", "--max-running-requests", "100000", "--pool-memory-gb", "0.05"
    )
    total = read_metrics(server.url)["deltaserve_state_slots_total"]
    assert 1 <= total < 100000
    assert "clamped" in server.log() and f"memory holds {int(total)} running requests" in server.log()
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "fits", "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 200


def test_engine_process_ends_when_the_server_is_killed(spawn_server) -> None:
    server = spawn_server("--max-model-len", "2048")
    assert server.proc is not None
    engine = engine_pid(server.proc.pid)
    streamed: dict[str, Any] = {}
    body = {"model": MODEL_NAME, "prompt": "orphan", "max_tokens": 2000, "ignore_eos": True}
    reader = threading.Thread(target=lambda: _ignore(stream_events, server.url, body, streamed), daemon=True)
    reader.start()
    wait_for(lambda: bool(streamed.get("events")))  # its first token came: the engine is at work
    server.proc.kill()  # no drain, no stop message: the engine must notice on its own
    server.proc.wait(10)

    def gone() -> bool:
        status = Path(f"/proc/{engine}/status")
        return not status.exists() or "\nState:\tZ" in status.read_text()

    wait_for(gone, timeout=30)


def _ignore(fn, url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    try:
        fn(f"{url}/v1/completions", body, out)
    except httpx.HTTPError:
        pass  # the server was killed under it


def test_the_engine_logs_its_stats_while_it_works(spawn_server) -> None:
    logged = spawn_server("--max-model-len", "512", "--log-stats-interval", "0.3")
    quiet = spawn_server("--max-model-len", "512", "--log-stats-interval", "0.3", "--disable-log-stats")
    body = {"model": MODEL_NAME, "prompt": "stats " * 40, "max_tokens": 96, "ignore_eos": True}
    for server in (logged, quiet):
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200

    def idle_logged() -> bool:  # an interval after the request
        return any("generation 0.0 tok/s, running 0, waiting 0" in line for line in logged.log().splitlines())

    wait_for(idle_logged)
    lines = [line for line in logged.log().splitlines() if "deltaserve.engine:" in line and "tok/s" in line]
    working = [line for line in lines if "generation 0.0 tok/s" not in line]
    assert working and "running 1" in working[0] and "KV pages" in working[0]
    assert "running 0, waiting 0" in lines[-1]  # the idle line, once
    assert sum("running 0, waiting 0" in line and "generation 0.0" in line for line in lines) == 1
    assert "tok/s" not in quiet.log()
