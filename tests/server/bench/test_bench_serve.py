"""bench.serving.serve against a real server on the built-in model: closed-loop levels streamed and not,
the /health probe, the JSON report, and the offline comparison through deltaserve.LLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from bench.serving.serve import Connections, Run, main, split_run

PROMPTS, OUTPUT_LEN = 4, 8
SHAPE = ["--input-len", "16", "--output-len", str(OUTPUT_LEN), "--num-prompts", str(PROMPTS)]


def check_run(run: dict[str, Any], streamed: bool, output_len: int = OUTPUT_LEN) -> None:
    assert run["failed"] == 0, run["errors"]
    assert run["completed"] == PROMPTS
    assert run["output_tokens"] == PROMPTS * output_len
    assert run["input_tokens"] == PROMPTS * 16
    names = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms") if streamed else ("e2e_ms",)
    for name in names:
        s = run[name]
        assert 0 < s["p50"] <= s["p90"] <= s["p99"], (name, s)
    if not streamed:
        assert run["ttft_ms"] is None and run["itl_ms"] is None


@pytest.mark.slow
def test_streamed_levels_with_health_probe(server: Any, tmp_path: Path) -> None:
    path = tmp_path / "serve.json"
    argv = ["--base-url", server.url, "--concurrency", "1,4", *SHAPE, "--health-probe"]
    result = main([*argv, "--output-json", str(path)])
    assert [r["concurrency"] for r in result["runs"]] == [1, 4]
    for run in result["runs"]:
        check_run(run, streamed=True)
        assert run["health"]["probes"] > 0 and run["health"]["non_200"] == 0
        # the server's own timing of this run's requests, within what the client saw
        server = run["server_mean_ms"]
        assert 0 < server["ttft"] <= run["ttft_ms"]["mean"], (server, run["ttft_ms"])
        assert server["ttft"] < server["e2e"] <= run["e2e_ms"]["mean"], (server, run["e2e_ms"])
        # the engine loop's shares of the run, from its /metrics counters (CPU: no GPU wait)
        loop = run["engine_loop"]
        assert 0 < loop["step"] and 0 <= loop["idle"] and loop["step"] + loop["idle"] <= 1, loop
        assert loop["gpu_wait"] == 0
    saved = json.loads(path.read_text())
    assert saved["runs"] == json.loads(json.dumps(result["runs"]))
    assert saved["command"].startswith("python -m bench.serving.serve --base-url") and saved["date"]
    assert saved["settings"]["stream"] is True and saved["model"]


@pytest.mark.slow
def test_whole_responses_fresh_connections_and_offline(
    server: Any, builtin_path: str, tmp_path: Path
) -> None:
    offline_args = json.dumps({"max_model_len": 64})
    argv = ["--base-url", server.url, "--concurrency", "1,4", *SHAPE, "--no-stream", "--no-keepalive"]
    argv += ["--offline-model", builtin_path, "--offline-args", offline_args]
    result = main([*argv, "--output-json", str(tmp_path / "serve.json")])
    for run, offline in zip(result["runs"], result["offline"], strict=True):
        check_run(run, streamed=False)
        assert offline["output_tokens"] == PROMPTS * OUTPUT_LEN
        assert offline["concurrency"] == run["concurrency"]
        assert run["server_vs_offline"] == run["output_tok_s"] / offline["output_tok_s"]
        # the engine's arrival-to-first-token time, below the whole request's
        assert 0 < offline["ttft_mean_ms"] < 1e3 * offline["duration_s"]
        assert run["offline_ttft_mean_ms"] == offline["ttft_mean_ms"]
    assert json.loads((tmp_path / "serve.json").read_text())["offline"] == result["offline"]


@pytest.mark.slow
def test_client_processes_share_the_clients(server: Any) -> None:
    shape = ["--input-len", "16", "--output-len", "48", "--num-prompts", str(PROMPTS)]
    argv = ["--base-url", server.url, "--concurrency", "4", *shape, "--client-processes", "2"]
    (run,) = main(argv)["runs"]
    check_run(run, streamed=True, output_len=48)
    assert run["client_processes"] == 2 and 0 < run["client_cpu_share"] < 2
    # the engine loop's shares cover the load, not the client processes' start-up, during which
    # the engine has nothing to do (counted from the start-up: idle over 40% of this load)
    assert run["engine_loop"]["idle"] < 0.3, run["engine_loop"]


def test_split_run_deals_clients_prompts_and_arrivals() -> None:
    prompts = [[i] for i in range(10)]
    parts = split_run(Run("c=5", prompts, concurrency=5), 3)
    assert [p.concurrency for p in parts] == [2, 2, 1]
    assert sorted(q for p in parts for q in p.prompts) == prompts
    assert [len(split_run(Run("c=2", prompts, concurrency=2), 8))] == [2]  # never a process without a client
    parts = split_run(Run("rate=6", prompts, rate=6.0, max_concurrency=4), 4)
    assert [p.rate for p in parts] == [1.5] * 4 and [p.max_concurrency for p in parts] == [1] * 4
    assert sorted(q for p in parts for q in p.prompts) == prompts
    assert [p.max_concurrency for p in split_run(Run("rate=6", prompts, rate=6.0), 2)] == [None, None]


@pytest.mark.slow
@pytest.mark.parametrize("outputs", ["final", "streams"])
def test_offline_only(builtin_path: str, outputs: str) -> None:
    """The offline engine alone, asking for final outputs (LLM.generate's) or for a stream's delta
    output every step, packed as the engine process sends them: the same tokens either way."""
    argv = ["--offline-only", "--offline-model", builtin_path, "--concurrency", "2", *SHAPE]
    argv += ["--offline-outputs", outputs]
    result = main([*argv, "--offline-args", json.dumps({"max_model_len": 64}), "--warmup", "3"])
    assert result["runs"] == [] and len(result["offline"]) == 1
    assert result["offline"][0]["output_tokens"] == PROMPTS * OUTPUT_LEN
    assert result["offline"][0]["warmup_requests"] == 3  # as many as the server's warm-up
    assert result["offline"][0]["outputs"] == outputs


def test_connections_reuse_the_last_freed_client() -> None:
    """One client (one connection) per request in flight; a freed one serves the next request."""

    async def go() -> None:
        conns = Connections(keepalive=True, timeout=5.0)
        async with conns.client() as a, conns.client() as b:
            assert a is not b
        async with conns.client() as c:
            assert c is a  # b was freed first, a last
        assert len(conns.opened) == 2
        await conns.aclose()
        assert all(client.is_closed for client in conns.opened)

    asyncio.run(go())


def test_connections_opened_before_the_run_serve_its_first_requests() -> None:
    """`open(n)` makes n connections (a GET /health each) that the run's first n requests reuse,
    so that no request is timed with a handshake; a server that is not there raises nothing."""
    accepted: list[int] = []
    paths: list[str] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):  # the client closed
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                paths.append(request.split(b" ")[1].decode())
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()

    async def go() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        conns = Connections(keepalive=True, timeout=5.0)
        await conns.open(3, url)
        assert len(accepted) == 3 and paths == ["/health"] * 3

        together = asyncio.Barrier(3)

        async def request() -> None:
            async with conns.client() as client:
                assert (await client.get(f"{url}/v1/completions")).status_code == 200
                await asyncio.wait_for(together.wait(), 10)  # the three hold their clients at once

        await asyncio.gather(request(), request(), request())
        assert len(accepted) == 3 and len(conns.opened) == 3  # reused, none opened
        await conns.aclose()
        server.close()
        await server.wait_closed()
        gone = Connections(keepalive=True, timeout=5.0)
        await gone.open(1, url)  # refused: the run's requests will say so
        await gone.aclose()

    asyncio.run(go())
