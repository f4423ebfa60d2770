"""`deltaserve serve --tensor-parallel-size 2` on CPU (gloo): answers through the openai client as
TP = 1 does (n, seeds, beams, logprobs, prompt logprobs, a JSON schema, stop strings, a prefix-cache
hit, after a client hung up mid-stream), stops with its workers (a process group's SIGTERM drains them first), spreads over two
loopback "nodes" (one headless, which stops its other ranks and exits 1 once one fails), is a dead engine (503, requests in flight failed) once a
worker is killed (one on the other node too, while idle), and a SIGTERM or Ctrl-C while it loads stops every process it started."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

PROMPT = [11, 42, 7, 99, 3, 250, 18, 64, 5]
TP2 = ("--device", "cpu", "--max-model-len", "512", "--tensor-parallel-size", "2")


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").iterdir():
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except FileNotFoundError:
                continue
            out.extend(kids)
            todo.extend(kids)
    return out


def worker_pids(server_pid: int) -> list[int]:
    found = []
    for pid in descendants(server_pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"deltaserve.engine.parallel.worker" in cmdline:
            found.append(pid)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def tp1_text(builtin_path: str) -> str:
    from deltaserve import LLM, SamplingParams

    llm = LLM(builtin_path, device="cpu", max_model_len=512)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=12))
    return out[0].outputs[0].text


def complete(url: str, model: str) -> str:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0)
    return reply.choices[0].text


def test_tp2_server_answers_as_tp1_and_stops_with_its_workers(spawn_server, model_name, tp1_text):
    server = spawn_server(*TP2)
    assert server.proc is not None
    workers = worker_pids(server.proc.pid)
    assert len(workers) == 1 and alive(workers[0])
    assert complete(server.url, model_name) == tp1_text
    assert server.stop() == 0
    assert not any(alive(p) for p in workers)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# what rank 0 alone does on top of the ranks' forward: forked slots (n, beam), seeded sampling,
# logprobs gathered over the vocabulary shards, prompt logprobs, grammars, stop strings
FEATURES: list[dict[str, Any]] = [
    {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7},
    {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "logprobs": 3, "echo": True},
    {"prompt": PROMPT, "max_tokens": 3, "temperature": 0.0, "extra_body": {"prompt_logprobs": 2}},
    {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "n": 2, "extra_body": {"use_beam_search": True}},
    {"prompt": "give json", "max_tokens": 30, "temperature": 0.0, "extra_body": {"guided_json": SCHEMA}},
    {"prompt": "Hello there", "max_tokens": 30, "temperature": 0.0, "stop": ["a", "e"]},
    {"prompt": list(range(1000, 1100)), "max_tokens": 8, "temperature": 0.0},  # cached the second time
    {"prompt": list(range(1000, 1100)), "max_tokens": 8, "temperature": 0.0},
]


def rounded(x: Any) -> Any:
    """Log-probabilities to 3 places: the ranks' partial sums round apart in the last bits."""
    if isinstance(x, float):
        return round(x, 3)
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [rounded(v) for v in x]
    return x


def features(url: str, model: str) -> list[Any]:
    import openai

    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        replies = [client.completions.create(model=model, **body).model_dump() for body in FEATURES]
    choices = [
        [(c["text"], c["finish_reason"], c["logprobs"], c.get("prompt_logprobs")) for c in r["choices"]]
        for r in replies
    ]
    return rounded([[c, r["usage"]] for c, r in zip(choices, replies)])


def test_tp2_serves_rank_0s_features_as_tp1(spawn_server, server, model_name):
    """n, seeds, beams, logprobs, prompt logprobs, a JSON schema, stop strings and a prefix-cache
    hit give TP = 1's tokens and values; a client gone mid-stream frees its slot, and the next
    request reads no state it left behind."""
    tp2 = spawn_server(*TP2)
    body = {
        "model": model_name,
        "prompt": "keep going",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{tp2.url}/v1/completions", json=body, timeout=120) as r:
        next(line for line in r.iter_lines() if line.startswith("data: "))  # then hang up
    ours, theirs = features(tp2.url, model_name), features(server.url, model_name)
    assert ours[-1][1]["prompt_tokens_details"]["cached_tokens"] > 0  # the hit
    assert ours == theirs
    metrics = httpx.get(f"{tp2.url}/metrics", timeout=10).text
    assert f'deltaserve_state_slots_used{{model_name="{model_name}"}} 0' in metrics


def test_tp2_beside_two_http_processes(spawn_server, model_name, tp1_text):
    # on CUDA two HTTP processes are the default, so tensor parallelism meets them there
    server = spawn_server(*TP2, "--api-server-count", "2")
    assert server.proc is not None
    workers = worker_pids(server.proc.pid)
    assert len(workers) == 1 and "2 HTTP processes share the port" in server.log()
    assert [complete(server.url, model_name) for _ in range(4)] == [tp1_text] * 4
    assert server.stop() == 0
    assert not any(alive(p) for p in workers)


def test_a_group_sigterm_drains_the_tp2_server(spawn_server, model_name):
    """SIGTERM to the whole process group, as systemd and `timeout` send it, reaches the engine
    process and the worker too: both run on until the drain ends, so the request in flight completes."""
    server = spawn_server(*TP2, "--shutdown-timeout", "60", new_session=True)
    assert server.proc is not None
    workers = worker_pids(server.proc.pid)
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        events = (line for line in r.iter_lines() if line.startswith("data: "))
        first = next(events)  # the request is streaming now
        os.killpg(server.proc.pid, signal.SIGTERM)
        rest = list(events)
    assert json.loads(first[len("data: ") :])["choices"]
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(120) == 0, server.log()[-3000:]
    assert "exited with code" not in server.log()  # no rank died of the signal
    assert not any(alive(p) for p in workers)


@contextlib.contextmanager
def node_1(model_cache: str, tmp_path: Path, port: int) -> Iterator[tuple[tuple[str, ...], subprocess.Popen]]:
    """Node 1 of two loopback nodes (rank 1, headless), meeting node 0 at `port` (a reserved one):
    yields node 0's flags and its process."""
    nodes = ("--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "deltaserve", "serve", *TP2, *nodes, "--node-rank", "1", "--headless"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "DELTASERVE_CACHE": model_cache},
    )
    try:
        yield nodes, node1
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_two_loopback_nodes_serve_through_node_0(
    spawn_server, model_cache, model_name, tp1_text, tmp_path, master_port
):
    with node_1(model_cache, tmp_path, master_port) as (nodes, node1):
        server = spawn_server(*TP2, *nodes, "--node-rank", "0")
        assert server.proc is not None
        assert worker_pids(server.proc.pid) == []  # node 0 holds rank 0 only
        assert complete(server.url, model_name) == tp1_text
        assert server.stop() == 0
        assert node1.wait(60) == 0, (tmp_path / "node1.log").read_text()[-3000:]


def test_an_idle_node_0_notices_a_remote_rank_die(
    spawn_server, model_cache, model_name, tmp_path, master_port
):
    """No thread on node 0 watches node 1's rank: the heartbeat that idle rank 0 sends every second
    finds it gone. /health stayed 200 until the next request failed."""
    with node_1(model_cache, tmp_path, master_port) as (nodes, node1):
        server = spawn_server(*TP2, *nodes, "--node-rank", "0")
        assert server.proc is not None
        (worker,) = worker_pids(node1.pid)
        time.sleep(2)  # idle: heartbeats go out and change nothing
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        while (health := httpx.get(f"{server.url}/health", timeout=5)).status_code == 200:
            # the heartbeat each second, not the liveness check's 30 s (nor the next request)
            assert time.monotonic() - t0 < 15, "node 0 did not notice node 1's rank die"
            time.sleep(0.1)
        assert health.status_code == 503 and "gone" in health.json()["reason"], health.text
        assert node1.wait(30) != 0
        assert server.stop() == 0


def test_a_headless_node_whose_rank_fails_stops_its_others_and_exits_1(
    model_cache, make_checkpoint, tmp_path, master_port
):
    """Node 1 of `--tensor-parallel-size 4 --nnodes 2` runs ranks 2 and 3; one dies while both wait
    for rank 0 to join (as one that fails to load would): the node stops the other at once and exits
    1, naming the rank. It used to wait for the other, here the whole --distributed-timeout."""
    port = str(master_port)  # held unlistened to: node 0 never comes
    model = make_checkpoint("qwen3_next", linear_num_key_heads=4)  # the built-in's 2 do not split 4 ways
    flags = ("--device", "cpu", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1")
    log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "deltaserve", "serve", model, *flags, "--master-port", port, "--headless"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "DELTASERVE_CACHE": model_cache},
    )
    try:
        deadline = time.monotonic() + 60
        while len(workers := worker_pids(node1.pid)) < 2:
            assert node1.poll() is None and time.monotonic() < deadline, (tmp_path / "node1.log").read_text()
            time.sleep(0.05)
        os.kill(workers[0], signal.SIGKILL)
        assert node1.wait(30) == 1
        text = (tmp_path / "node1.log").read_text()
        assert "of this node exited with code -9; stopping the others" in text, text[-3000:]
        assert not any(alive(p) for p in workers)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_a_killed_worker_is_a_dead_engine(spawn_server, model_name):
    server = spawn_server(*TP2)
    assert server.proc is not None
    (worker,) = worker_pids(server.proc.pid)
    (engine,) = [
        p for p in descendants(server.proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    streamed: dict[str, Any] = {}
    streaming = threading.Event()  # its first token came: both ranks are stepping it
    body = {
        "model": model_name,
        "prompt": "keep going",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    def stream() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
            events: list[str] = []
            streamed["events"] = events
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    streaming.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert streaming.wait(60), server.log()[-3000:]
    t0 = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    thread.join(30)
    assert not thread.is_alive() and time.monotonic() - t0 < 15  # no hang
    events = streamed["events"]
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2])
    health = httpx.get(f"{server.url}/health", timeout=5)
    assert health.status_code == 503 and "rank 1" in health.json()["reason"], health.text
    assert (
        httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=10).status_code
        == 503
    )
    deadline = time.monotonic() + 15
    while alive(engine):  # the dead engine's process ends too, nothing left behind
        assert time.monotonic() < deadline, "the engine process outlived its worker"
        time.sleep(0.1)
    assert server.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_loading_stops_every_rank(model_cache, tmp_path, sig):
    """Ctrl-C (SIGINT to the terminal's process group) or a group SIGTERM while the engine loads:
    the engine process and its worker ignore both (the server drains them once it runs), so the
    server must stop them itself. Python's exit used to wait for the loading engine forever
    (SIGINT), or the server died and left both loading, orphaned (SIGTERM)."""
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "deltaserve", "serve", "--port", "0", *TP2],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "DELTASERVE_CACHE": model_cache},
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's is
    )
    try:
        deadline = time.monotonic() + 60
        while not worker_pids(server.pid):  # the engine is past its signal set-up, loading
            log_text = (tmp_path / "server.log").read_text()
            assert server.poll() is None and time.monotonic() < deadline, log_text
            time.sleep(0.05)
        started = descendants(server.pid)
        os.killpg(server.pid, sig)
        server.wait(20)
        deadline = time.monotonic() + 5
        while any(alive(p) for p in started):
            assert time.monotonic() < deadline, f"left behind: {[p for p in started if alive(p)]}"
            time.sleep(0.05)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
