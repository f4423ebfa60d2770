"""Fixtures for the server tests: real `deltaserve serve` processes on free loopback ports, serving the
built-in tiny model, and small helpers to read them (metrics, raw HTTP)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from deltaserve.models.checkpoints.builtin import BUILTIN_NAME as MODEL_NAME

MAX_MODEL_LEN = 512


# launch.py's line once the engine is loaded, naming the port the server bound
_SERVING = re.compile(r"serving .* on https?://[^\s]+:([1-9]\d*)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def app_in_thread(app: Any, join_s: float = 20) -> Iterator[int]:
    """A real uvicorn server of `app` (a stand-in engine's) on a free loopback port, in a thread
    of this process: yields the port once it serves, stops it after."""
    import uvicorn

    sock = socket.socket()  # bound here, on a port the system picks, and held until the server serves on it
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(join_s)


@dataclass
class ServerProcess:
    """One `python -m deltaserve serve` child process and where it listens."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0  # the server picks it (--port 0) and logs it; `start` reads it from there
    new_session: bool = False  # a process group of its own, which a test may signal as a whole
    proc: subprocess.Popen[str] | None = None
    log_path: Path | None = None
    tls: ssl.SSLContext | None = None  # an HTTPS server: how clients (the start-up poll) verify it
    uds: str | None = None  # a server on a Unix socket (--uds), polled there

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, log_dir: Path, timeout: float = 180.0) -> ServerProcess:
        self.log_path = log_dir / "server.log"
        if self.uds:  # no TCP port is bound: one the server is told of, for a test to find nothing on
            self.port = free_port()
        cmd = [sys.executable, "-m", "deltaserve", "serve", "--port", str(self.port), *self.args]
        env = {**os.environ, **self.env}
        self.proc = subprocess.Popen(
            cmd,
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            env=env,
            text=True,
            start_new_session=self.new_session,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            if not self.port:
                found = _SERVING.search(self.log())
                if found is None:
                    time.sleep(0.2)
                    continue
                self.port = int(found.group(1))
            try:
                transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
                with httpx.Client(transport=transport, verify=self.tls or True, timeout=1.0) as http:
                    healthy = http.get(f"{self.url}/health").status_code == 200
                if healthy:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not come up in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path and self.log_path.exists() else ""

    def stop(self, timeout: float = 60.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where servers build the built-in model: $DELTASERVE_CACHE if the caller set one (CI reuses it),
    else a session temp dir, so the tests also cover the first-use build."""
    return os.environ.get("DELTASERVE_CACHE") or str(tmp_path_factory.mktemp("deltaserve-cache"))


@pytest.fixture(scope="session")
def builtin_path(model_cache: str) -> str:
    from deltaserve.models.checkpoints.builtin import builtin_model_path

    return builtin_model_path(Path(model_cache))


def _serve(
    tmp_path_factory: pytest.TempPathFactory, cache: str, *args: str, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    server = ServerProcess(list(args), env={"DELTASERVE_CACHE": cache, **(env or {})})
    server.start(tmp_path_factory.mktemp("logs"))
    try:
        yield server
    finally:
        code = server.stop()
        assert code == 0, f"server exited with {code}:\n{server.log()[-4000:]}"


@pytest.fixture(scope="session")
def server(
    tmp_path_factory: pytest.TempPathFactory, builtin_path: str, model_cache: str
) -> Iterator[ServerProcess]:
    """The main server: built-in model (no --model), default settings but a short context."""
    yield from _serve(tmp_path_factory, model_cache, "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def base_url(server: ServerProcess) -> str:
    return f"{server.url}/v1"


@pytest.fixture
def client(base_url: str):
    import openai

    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture
def async_client(base_url: str):
    import openai

    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def metrics_of(url: str) -> dict[str, float]:
    """The server's /metrics as {'name{labels}': value}, with the model_name label dropped."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r'model_name="[^"]*",?', "", name).replace("{}", "")
        out[name] = float(value)
    return out


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every page and slot is free again."""
    keys = ("num_requests_running", "num_requests_waiting", "kv_pages_used", "state_slots_used")
    deadline = time.monotonic() + timeout
    while True:
        m = metrics_of(url)
        if all(m[f"deltaserve_{k}"] == 0 for k in keys) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def post_after_continue(
    port: int, path: str, body: dict[str, Any], headers: dict[str, str], sent: threading.Event
) -> tuple[int, Any]:
    """POST `body` with `Expect: 100-continue`: the server's 100 Continue says its handler has begun
    (the request has arrived); `sent` is set once the whole body is sent after it. Gives the
    status and the JSON reply."""
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\nExpect: 100-continue\r\nConnection: close\r\n{head}\r\n"
            ).encode()
        )
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):
            chunk = sock.recv(1)
            assert chunk, "the server hung up before its 100 Continue"
            interim += chunk
        assert interim.startswith(b"HTTP/1.1 100 "), interim
        sock.sendall(payload)
        sent.set()
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


# Test modules cannot import this conftest (importlib import mode), so helpers travel as fixtures.


@pytest.fixture(scope="session")
def model_name() -> str:
    return MODEL_NAME


@pytest.fixture(scope="session")
def max_model_len() -> int:
    return MAX_MODEL_LEN


@pytest.fixture(scope="session")
def read_metrics():
    return metrics_of


@pytest.fixture(scope="session")
def until_idle():
    return wait_idle


@pytest.fixture(scope="session")
def post_with_continue():
    return post_after_continue


class Spawner:
    """Starts extra servers with their own flags, and stops (SIGTERM) every one it started."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory, model_cache: str) -> None:
        self.tmp_path_factory, self.model_cache = tmp_path_factory, model_cache
        self.started: list[ServerProcess] = []

    def __call__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        tls: ssl.SSLContext | None = None,
        uds: str | None = None,
    ) -> ServerProcess:
        server = ServerProcess(
            [*args, *(["--uds", uds] if uds else [])],
            env={"DELTASERVE_CACHE": self.model_cache, **(env or {})},
            new_session=new_session,
            tls=tls,
            uds=uds,
        )
        self.started.append(server.start(self.tmp_path_factory.mktemp("logs")))
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


# Each server holds an engine and its HTTP processes (about a GB on CPU): they stop with the test,
# or the module, that started them, not all at the session's end, which filled CI's memory.
@pytest.fixture
def spawn_server(tmp_path_factory: pytest.TempPathFactory, builtin_path: str, model_cache: str):
    """`spawn_server(*flags)`: a server for this test, stopped when it ends."""
    spawner = Spawner(tmp_path_factory, model_cache)
    yield spawner
    spawner.stop_all()


@pytest.fixture(scope="module")
def spawn_module_server(tmp_path_factory: pytest.TempPathFactory, builtin_path: str, model_cache: str):
    """As `spawn_server`, for a module's fixture: stopped when the module's tests end."""
    spawner = Spawner(tmp_path_factory, model_cache)
    yield spawner
    spawner.stop_all()
