"""The HTTP process's CPU time per streamed token, with no model: the real server (the app, its
EngineClient, pyzmq, uvicorn, the tokenizer's detokenization) over a stand-in engine process
that gives every running request one token a step, a step every `--step-ms`.

    python -m bench.serving.http_overhead --concurrency 64,256 --output-len 256

Each level drives the server with `bench.serving.serve` (streamed completions, prompts of `--input-len`
token ids, /health probed every 100 ms) and reports its output tok/s, the HTTP processes' CPU
time (user + system, from /proc) per output token and the p99 of /health. The HTTP process bounds a server whose engine steps faster than it can
stream: at X µs a token it streams at most 1e6 / X tokens a second on one core. Runs on any
Linux machine; the figure belongs to that machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

STAND_IN = "stand-in"  # the model name the stand-in server serves


class StandInEngine:
    """The Engine's interface: each step sleeps `step_s` and gives every request one random token,
    sent as the engine sends them under `stream_interval` (the first at once, then that many at a time)."""

    def __init__(self, step_s: float, stream_interval: int = 1) -> None:
        self.step_s = step_s
        self.stream_interval = stream_interval
        self.tokenizer = None
        self.max_model_len = 1 << 20
        self.vocab_size = 151936
        self.model_info = {"model": STAND_IN, "architecture": "StandIn"}
        self.eos_token_ids: list[int] = []
        self.requests: dict[str, list[Any]] = {}  # id -> [params, tokens so far, arrival]
        self.rng = random.Random(0)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any) -> None:
        self.requests[request_id] = [params, 0, time.time(), []]

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> dict[str, int]:
        return {"running": len(self.requests), "waiting": 0}

    def step(self) -> list[Any]:
        from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput

        time.sleep(self.step_s)
        outputs = []
        for request_id, state in list(self.requests.items()):
            params, count, arrival, pending = state
            state[1] = count = count + 1
            done = count >= params.max_tokens
            pending.append(self.rng.randrange(1000, 30000))
            if not (done or count == 1 or len(pending) >= self.stream_interval):
                continue
            completion = CompletionOutput(0, pending[:], "", "length" if done else None, num_tokens=count)
            pending.clear()
            outputs.append(
                RequestOutput(
                    request_id,
                    [],
                    [completion],
                    done,
                    arrival_time=arrival,
                    first_token_time=arrival,
                    delta=params.output_kind == "delta",
                )
            )
            if done:
                del self.requests[request_id]
        return outputs


def _run_core(in_addrs: list[str], out_addrs: list[str], step_s: float, stream_interval: int) -> None:
    from deltaserve.engine.core import EngineCore, engine_info

    engine = StandInEngine(step_s, stream_interval)
    core = EngineCore(engine, in_addrs, out_addrs, parent_pid=os.getppid())  # ends with the server
    core.send(("ready", engine_info(engine)))
    core.run()


def serve(
    port: int,
    step_s: float,
    gc_thresholds: tuple[int, ...] | None = None,
    api_servers: int = 1,
    pid_file: str = "",
    stream_interval: int = 1,
) -> None:
    """The server: the stand-in engine in a process of its own, the app as `deltaserve serve` builds
    it (its garbage-collector settings included), uvicorn on loopback; with `api_servers` HTTP
    processes on the port as `--api-server-count` runs them (server/api_servers.py). Their pids go
    to `pid_file`, one a line."""
    import multiprocessing

    from deltaserve.server.engine_client import EngineHandle
    from deltaserve.server.launch import _bind

    handle = EngineHandle._bind()
    ins = [handle.address("in", i) for i in range(api_servers)]
    outs = [handle.address("out", i) for i in range(api_servers)]
    context = multiprocessing.get_context("spawn")
    process = context.Process(target=_run_core, args=(ins, outs, step_s, stream_interval), daemon=True)
    process.start()
    handle.process = process
    handle.await_ready(60.0)
    sock = _bind(argparse.Namespace(host="127.0.0.1", port=port))
    pids = [os.getpid()]
    for index in range(1, api_servers):
        other = context.Process(
            target=_serve_http,
            args=(
                sock,
                index,
                api_servers,
                (handle.ipc_dir, handle.info, process.pid, os.getpid()),
                gc_thresholds,
            ),
            daemon=True,
        )
        other.start()
        pids.append(int(other.pid or 0))
    with open(pid_file or os.devnull, "w") as f:
        f.write("".join(f"{pid}\n" for pid in pids))
    _serve_http(sock, 0, api_servers, handle, gc_thresholds)


def _serve_http(sock: socket.socket, index: int, count: int, engine: Any, gc_thresholds: Any) -> None:
    """One HTTP process: the app over `engine` (process 0's handle, or what another attaches with)."""
    import uvicorn

    from deltaserve.engine.gc_heap import freeze_startup_heap
    from deltaserve.models.checkpoints.builtin import builtin_model_path
    from deltaserve.models.checkpoints.loader import load_tokenizer
    from deltaserve.server.app import build_app
    from deltaserve.server.engine_client import EngineClient, EngineHandle
    from deltaserve.server.metrics import SharedMetrics

    if index > 0:
        from deltaserve.server.api_servers import _end_with_parent

        _end_with_parent(engine[3])
    handle = engine if index == 0 else EngineHandle.attach(engine[0], index, engine[1], engine[2])
    shared = SharedMetrics(handle.ipc_dir, index, count) if count > 1 else None
    client = EngineClient(handle, load_tokenizer(builtin_model_path()))
    app = build_app(client, model_names=[STAND_IN], shared_metrics=shared)
    freeze_startup_heap("HTTP process")
    if gc_thresholds:  # in place of the server's own (engine/gc_heap.py), to compare
        import gc

        gc.set_threshold(*gc_thresholds)
    for sig in (signal.SIGTERM, signal.SIGINT):  # as the server: exit after the drain, not by the signal
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_up(url: str, server: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the stand-in server exited with code {server.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the stand-in server did not come up")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="64,256", help="comma-separated levels")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--step-ms", type=float, default=10.0, help="the stand-in engine's step time")
    ap.add_argument(
        "--gc-thresholds", default=None, help="the HTTP process's gc thresholds, e.g. 700,10,10 (Python's)"
    )
    ap.add_argument("--api-server-count", type=int, default=1, help="HTTP processes, as the server's flag")
    ap.add_argument("--stream-interval", type=int, default=1, help="tokens a chunk, as the server's flag")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    ap.add_argument("--pid-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    gc_thresholds = tuple(int(t) for t in args.gc_thresholds.split(",")) if args.gc_thresholds else None
    if args.serve_port is not None:
        serve(
            args.serve_port,
            args.step_ms / 1e3,
            gc_thresholds,
            args.api_server_count,
            args.pid_file,
            args.stream_interval,
        )
        return

    pid_file = tempfile.NamedTemporaryFile(suffix=".pids")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "bench.serving.http_overhead",
        "--serve-port",
        str(port),
        "--step-ms",
        str(args.step_ms),
        "--api-server-count",
        str(args.api_server_count),
        "--pid-file",
        pid_file.name,
        "--stream-interval",
        str(args.stream_interval),
    ]
    if args.gc_thresholds:
        cmd += ["--gc-thresholds", args.gc_thresholds]
    server = subprocess.Popen(cmd)
    results = []
    try:
        _wait_up(url, server)
        with open(pid_file.name) as f:
            http_pids = [int(line) for line in f if line.strip()]
        load = [
            sys.executable, "-m", "bench.serving.serve", "--base-url", url, "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--vocab-high", "30000", "--warmup", "0", "--health-probe",
        ]  # fmt: skip
        # a first load outside the measurement: the first requests import and build what later ones reuse
        subprocess.run(
            [*load, "--concurrency", "8", "--num-prompts", "8"], check=True, stdout=subprocess.DEVNULL
        )
        for level in [int(c) for c in args.concurrency.split(",")]:
            with tempfile.NamedTemporaryFile(suffix=".json") as out_json:
                before = sum(cpu_seconds(pid) for pid in http_pids)
                subprocess.run(
                    [*load, "--concurrency", str(level), "--num-prompts", str(level * args.requests_per_client),
                     "--output-json", out_json.name],
                    check=True, stdout=subprocess.DEVNULL,
                )  # fmt: skip
                cpu = sum(cpu_seconds(pid) for pid in http_pids) - before
                run = json.load(out_json)["runs"][0]
            tokens = run["output_tokens"]
            row = {
                "concurrency": level,
                "failed": run["failed"],
                "output_tok_s": run["output_tok_s"],
                "server_cpu_s": cpu,
                "server_cpu_us_per_token": 1e6 * cpu / tokens,
                "ideal_tok_s": level * 1e3 / args.step_ms,
                "health_p99_ms": (run.get("health", {}).get("latency_ms") or {}).get("p99"),
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.terminate()
        server.wait(30)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
