"""Concurrency, disconnects, draining on SIGTERM, and plain curl against a real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time

import httpx
import openai
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

LONG = {"max_tokens": 400, "ignore_eos": True}


@pytest.mark.slow
def test_32_concurrent_streaming_clients(base_url, server, until_idle) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, int]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": f"Client {i} says hello."}],
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage:
                usage = chunk.usage
        return text, usage.completion_tokens, usage.prompt_tokens

    async def run() -> list[tuple[str, int, int]]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300) as client:
            return await asyncio.gather(*[one(client, i) for i in range(32)])

    results = asyncio.run(run())
    assert all(tokens == 12 for _, tokens, _ in results)
    # Batched with 31 others, each client gets what it gets alone.
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0) as client:
        for i in (0, 17, 31):
            alone = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": f"Client {i} says hello."}],
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert alone.choices[0].message.content == results[i][0]
    until_idle(server.url)


def _aborts(read_metrics, url: str) -> float:
    return read_metrics(url)['deltaserve_requests_total{outcome="abort"}']


def test_stream_disconnect_frees_pages_and_slot(server, read_metrics, until_idle) -> None:
    aborted_before = _aborts(read_metrics, server.url)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "stream": True, **LONG}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        received = [line for _, line in zip(range(6), lines) if line]
        assert received and received[0].startswith("data: ")
        busy = read_metrics(server.url)
        assert busy["deltaserve_num_requests_running"] == 1
        assert busy["deltaserve_state_slots_used"] >= 1 and busy["deltaserve_kv_pages_used"] >= 1
    # The client hung up long before 400 tokens: the request is aborted and everything is free.
    idle = until_idle(server.url)
    assert idle["deltaserve_state_slots_used"] == 0 and idle["deltaserve_kv_pages_used"] == 0
    assert _aborts(read_metrics, server.url) == aborted_before + 1


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_an_n_stream_disconnect_frees_every_choice(
    server, base_url, read_metrics, until_idle, path: str
) -> None:
    """A stream of n choices, over a prompt their prefix warm-up prefilled, that the client leaves
    early: every choice is aborted and its slot and pages freed."""
    aborted_before = _aborts(read_metrics, server.url)
    prompt = "Tell me a long story about the sea. " * 8  # past two pages: warmed once for the choices
    with openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=60) as client:
        if path == "chat":
            stream = client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": prompt}],
                n=4,
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        else:
            stream = client.completions.create(
                model=MODEL_NAME,
                prompt=prompt,
                n=4,
                max_tokens=400,
                stream=True,
                extra_body={"ignore_eos": True},
            )
        seen: set[int] = set()
        for chunk in stream:
            seen.update(c.index for c in chunk.choices)
            if seen == {0, 1, 2, 3}:
                break
        busy = read_metrics(server.url)
        assert busy["deltaserve_num_requests_running"] == 4
        assert busy["deltaserve_state_slots_used"] >= 4 and busy["deltaserve_kv_pages_used"] >= 4
        stream.close()
    idle = until_idle(server.url)
    assert idle["deltaserve_state_slots_used"] == 0 and idle["deltaserve_kv_pages_used"] == 0
    assert _aborts(read_metrics, server.url) == aborted_before + 4


def test_non_stream_disconnect_aborts(server, read_metrics, until_idle) -> None:
    aborted_before = _aborts(read_metrics, server.url)
    body = json.dumps({"model": MODEL_NAME, "prompt": "go", "n": 2, **LONG}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request)
        deadline = time.monotonic() + 10
        while read_metrics(server.url)["deltaserve_num_requests_running"] < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    until_idle(server.url)
    assert _aborts(read_metrics, server.url) == aborted_before + 2


def test_port_0_serves_on_a_free_port_that_the_log_names(server) -> None:
    """--port 0 (how the tests start every server): the system picks the port when the server binds
    it, so no other process can take it first, and the 'serving ... on' line names that port, not 0."""
    assert server.proc is not None and server.proc.args[4:6] == ["--port", "0"]
    assert server.port != 0 and f"on http://127.0.0.1:{server.port} " in server.log()
    assert httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=10).status_code == 200


def test_curl(server) -> None:
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-f",
            f"{server.url}/v1/chat/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    reply = json.loads(out.stdout)
    assert reply["object"] == "chat.completion" and reply["usage"]["completion_tokens"] <= 3

    stream_body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 3, "stream": True})
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "-N",
            f"{server.url}/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            stream_body,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    events = [line[len("data: ") :] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])

    bad = subprocess.run(
        [
            "curl",
            "-sS",
            "-w",
            "\n%{http_code}",
            f"{server.url}/v1/completions",
            "-H",
            "Content-Type: application/json",
            "-d",
            "{oops",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    payload, status = bad.stdout.rsplit("\n", 1)
    assert status == "400" and "error" in json.loads(payload)


@pytest.mark.slow
@pytest.mark.parametrize("group", [False, True], ids=["server", "process-group"])
def test_sigterm_drains_running_requests_and_exits_0(spawn_server, group: bool) -> None:
    """SIGTERM to the server process, or to its whole process group as systemd and `timeout` send
    it: the engine process is among the group's, and must not die before the drain ends."""
    server = spawn_server("--max-model-len", "512", "--shutdown-timeout", "60", new_session=group)
    results: dict[str, object] = {}
    streaming = threading.Event()  # its first token has come: the engine is running it

    def stream() -> None:
        body = {"model": MODEL_NAME, "prompt": "drain", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            events: list[str] = []
            results["events"] = events
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    streaming.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(60), f"no token streamed:\n{server.log()[-3000:]}"
    assert server.proc is not None
    if group:
        os.killpg(server.proc.pid, signal.SIGTERM)
    else:
        server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 30
    while True:  # no new connections while draining, once the signal is taken
        try:
            refused = httpx.get(f"{server.url}/health", timeout=2).status_code != 200
        except httpx.HTTPError:
            refused = True
        if refused or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert refused
    assert server.proc.wait(120) == 0, server.log()[-3000:]
    reader.join(10)
    events = results["events"]
    assert isinstance(events, list) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # it ran to completion
    assert "engine process exited" not in server.log()


@pytest.mark.slow
def test_overlap_schedule_server_matches_and_frees_on_disconnect(
    base_url, spawn_server, read_metrics, until_idle
) -> None:
    overlap = spawn_server("--max-model-len", "512", "--enable-overlap-schedule")

    async def texts(url: str) -> list[str]:
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0, timeout=300) as client:

            async def one(i: int) -> str:
                stream = await client.chat.completions.create(
                    model=MODEL_NAME,
                    messages=[{"role": "user", "content": f"Overlap client {i}."}],
                    max_tokens=10 + i,
                    temperature=0,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            return await asyncio.gather(*[one(i) for i in range(8)])

    assert asyncio.run(texts(f"{overlap.url}/v1")) == asyncio.run(texts(base_url))
    # a streaming client that hangs up mid-way is aborted with a step in flight: nothing leaks
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "go"}], "stream": True, **LONG}
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{overlap.url}/v1/chat/completions", json=body) as r,
    ):
        assert [line for _, line in zip(range(6), r.iter_lines()) if line]
    idle = until_idle(overlap.url)
    assert idle["deltaserve_state_slots_used"] == 0 and idle["deltaserve_kv_pages_used"] == 0


def test_accepted_connections_send_without_nagle() -> None:
    """The listening socket `serve` binds gives the connections asyncio (so uvicorn) accepts
    TCP_NODELAY: with Nagle on, a response written in two parts waited for the client's delayed
    ACK on every kept-alive request."""
    from types import SimpleNamespace

    from deltaserve.server.launch import _bind

    sock = _bind(SimpleNamespace(host="127.0.0.1", port=0))

    async def accept_one() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(
                writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            )
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
        return nodelay

    assert asyncio.run(accept_one()) != 0


def test_a_kernel_capped_accept_queue_is_warned_about(tmp_path, caplog) -> None:
    from deltaserve.server.launch import _warn_if_accept_queue_capped

    path = tmp_path / "somaxconn"
    path.write_text("128\n")
    with caplog.at_level("WARNING", logger="deltaserve"):
        _warn_if_accept_queue_capped(2048, str(path))
    assert "caps the accept queue at 128" in caplog.text
    caplog.clear()
    path.write_text("4096\n")
    with caplog.at_level("WARNING", logger="deltaserve"):
        _warn_if_accept_queue_capped(2048, str(path))
    assert caplog.text == ""


def test_a_signal_while_the_tokenizer_loads_stops_start_up(builtin_path, monkeypatch) -> None:
    """SIGTERM while the HTTP side loads its tokenizer (seconds after the engine is up) stops
    start-up, as it does while the engine loads: the fallback that catches a tokenizer's load
    errors did not swallow it, and the server went on to serve, deaf to that signal."""
    import transformers

    from deltaserve.models.checkpoints.loader import load_tokenizer
    from deltaserve.server.launch import _Interrupted, _Starting

    def signalled_while_loading(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler runs in here, as it would in the load's own code
        raise AssertionError("the signal was not handled")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", signalled_while_loading)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    starting = _Starting()
    try:
        assert signal.getsignal(signal.SIGTERM) == starting._handle  # else the signal would end pytest
        with pytest.raises(_Interrupted):
            load_tokenizer(builtin_path)
    finally:
        starting.done()
        for sig, handler in before.items():
            signal.signal(sig, handler)
