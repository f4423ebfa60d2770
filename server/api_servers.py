"""More HTTP processes on the same port (`--api-server-count N`), as vLLM's API servers.

One HTTP process (tokenizing, detokenizing, SSE, JSON) streams only so many chunks a second on one
core; past that a small model's engine waits on it. Process 0 (`deltaserve serve` itself) binds
the port and starts the engine; it then spawns processes 1..N-1, which inherit the listening
socket (the kernel hands each new connection to one of the processes accepting on it) and each
talk to the engine (each data-parallel engine) over their own pair of pyzmq sockets
(engine/core.py routes every request's outputs to the process that added it). Each has its own
/health; /metrics adds up all of theirs (`metrics.SharedMetrics`).

Process 0 passes SIGTERM on, so all drain together; each ends with its parent (PR_SET_PDEATHSIG).
One that dies stops the others: the server exits rather than serve on a part of its processes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

logger = logging.getLogger("deltaserve.server")

MIN_CORES_FOR_TWO = 8  # two HTTP processes and the engine's busy thread each want a core of their own


def default_api_server_count(device: str, cores: int, engines: int = 1) -> int:
    """`--api-server-count` left unset: beside CUDA engines on a host with the cores for them (a
    GPU's small model at hundreds of streams outruns one HTTP process), two HTTP processes, or one
    per data-parallel engine where there are more engines and each process can have a core beside
    its engine's; else one."""
    if not device.startswith("cuda") or cores < MIN_CORES_FOR_TWO:
        return 1
    return max(2, min(engines, cores // 2 - engines))


def usable_cores() -> int:
    """The cores this process may run on (its affinity, as a container's cpuset limits it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ApiServers:
    """HTTP processes 1..N-1, started and watched by process 0."""

    def __init__(self, processes: list[BaseProcess], ready: list[Any]) -> None:
        self.processes = processes
        self.ready = ready  # one multiprocessing Event each, set when its app is built
        self._stopping = False
        self.lost: str | None = None  # which one exited while the server was running

    @classmethod
    def start(
        cls, args: argparse.Namespace, sock: socket.socket, handles: list[Any], model_dir: str, tokenizer: str
    ) -> ApiServers:
        import multiprocessing

        # each engine (one per data-parallel replica): its sockets' folder, what it said, its pid
        engines = [(h.ipc_dir, h.info, h.process.pid) for h in handles]
        context = multiprocessing.get_context("spawn")
        processes: list[BaseProcess] = []
        ready = [context.Event() for _ in range(1, args.api_server_count)]
        for index in range(1, args.api_server_count):
            process = context.Process(
                target=run_api_server,
                args=(
                    args,
                    index,
                    sock,
                    engines,
                    model_dir,
                    tokenizer,
                ),
                kwargs={"parent_pid": os.getpid(), "ready": ready[index - 1]},
                name=f"deltaserve-http-{index}",
                daemon=True,
            )
            process.start()
            processes.append(process)
        return cls(processes, ready)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until each has built its app (so that process 0 listens last, with all of them); one
        that exits first ends the server with an error."""
        deadline = time.monotonic() + timeout
        for process, ready in zip(self.processes, self.ready):
            while not ready.wait(0.2):
                if not process.is_alive() or time.monotonic() > deadline:
                    self.stop(5.0)
                    raise SystemExit(f"deltaserve serve: error: HTTP process {process.name} did not start")

    def pids(self, own: int) -> list[int]:
        return [own, *(p.pid for p in self.processes if p.pid is not None)]

    def drain(self) -> None:
        """Pass process 0's SIGTERM (or Ctrl-C) on: each drains as process 0 does."""
        self._stopping = True
        for process in self.processes:
            if process.pid is not None and process.is_alive():
                try:
                    os.kill(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def any_alive(self) -> bool:
        return any(process.is_alive() for process in self.processes)

    def watch(self, on_lost: Callable[[], None]) -> None:
        """Call `on_lost` (once) if one of them exits while the server is not stopping."""

        def run() -> None:
            while not self._stopping:
                for process in self.processes:
                    if not process.is_alive() and not self._stopping:
                        self.lost = f"HTTP process {process.pid} exited (code {process.exitcode})"
                        logger.error("%s; stopping the server", self.lost)
                        self._stopping = True
                        on_lost()
                        return
                time.sleep(0.2)

        threading.Thread(target=run, name="deltaserve-http-watch", daemon=True).start()

    def stop(self, timeout: float) -> None:
        """Wait for them to finish their drain, then kill what is left."""
        self.drain()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                logger.warning("HTTP process %s did not stop in %.0f s; killing it", process.pid, timeout)
                process.kill()
                process.join(5.0)


def run_api_server(
    args: argparse.Namespace,
    index: int,
    sock: socket.socket,
    engines: list[tuple[str, dict[str, Any], int]],
    model_dir: str,
    tokenizer: str,
    parent_pid: int,
    ready: Any,
) -> None:
    """HTTP process `index`: attach to the engine, serve on the inherited socket until SIGTERM."""
    _end_with_parent(parent_pid)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s[{index}]: %(message)s",
        stream=sys.stderr,
    )
    from .engine_client import EngineHandle
    from .launch import _sampling_defaults, http_server
    from .metrics import SharedMetrics

    handles = [EngineHandle.attach(ipc_dir, index, info, pid) for ipc_dir, info, pid in engines]
    server = http_server(
        args,
        handles,
        _sampling_defaults(args, model_dir, log=False),
        tokenizer,
        shared=SharedMetrics(engines[0][0], index, args.api_server_count),
        ignore_sigint=True,
    )
    ready.set()
    server.run(sockets=[sock])
    if not server.started:
        raise SystemExit(1)


def _end_with_parent(parent_pid: int) -> None:
    """SIGTERM (a drain) when process 0 goes, however it goes (Linux; elsewhere process 0's
    exit kills its daemonic children)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        try:
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # it went before the line above
        raise SystemExit(1)
