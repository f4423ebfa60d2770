"""Starting, watching and stopping a node's worker processes (every local rank but rank 0's).

Each worker is `python -m deltaserve.engine.parallel.worker` with its arguments pickled on
stdin: a fresh interpreter (no CUDA state inherited), and one that a daemonic engine process
may start, which multiprocessing forbids. Workers also end themselves when their parent goes.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.parallel.worker import WorkerArgs

logger = logging.getLogger(__name__)


class WorkerProcesses:
    def __init__(self, config: EngineConfig, ranks: Iterable[int], master_port: int) -> None:
        level = logging.getLogger().getEffectiveLevel()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        for rank in ranks:
            proc = subprocess.Popen(
                [sys.executable, "-m", "deltaserve.engine.parallel.worker"], stdin=subprocess.PIPE
            )
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(WorkerArgs(config, rank, master_port, os.getpid(), level)))
            proc.stdin.close()
            self.procs[rank] = proc
        self._stopping = False
        # no worker outlives this object, nor this process's normal exit
        self._finalizer = weakref.finalize(self, _kill, list(self.procs.values()))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs.values()]

    def exited(self, wait_s: float = 0.0) -> str | None:
        """Which worker exited, if one did (or does within `wait_s`)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    return f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def watch(self, on_exit: Callable[[str], None], interval: float = 0.2) -> None:
        """Call `on_exit(why)` from a thread once a worker exits while it should run."""

        def run() -> None:
            while not self._stopping:
                why = self.exited()
                if why is not None:
                    if not self._stopping:
                        on_exit(why)
                    return
                time.sleep(interval)

        threading.Thread(target=run, name="deltaserve-tp-watch", daemon=True).start()

    def wait_first(self) -> tuple[int, int]:
        """Until a worker exits: its rank and exit code."""
        while True:
            for rank, proc in self.procs.items():
                code = proc.poll()
                if code is not None:
                    return rank, code
            time.sleep(0.1)

    def wait(self) -> int:
        """Until every worker exits; the first non-zero exit code, or 0."""
        codes = [proc.wait() for proc in self.procs.values()]
        return next((c for c in codes if c), 0)

    def stop(self, timeout: float = 30.0) -> None:
        """Wait up to `timeout` for the workers to exit (they were told to), then kill the rest."""
        self._stopping = True
        deadline = time.monotonic() + timeout
        for rank, proc in self.procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if timeout > 0:
                    logger.warning(
                        "tensor-parallel rank %d did not stop in %.0f s; killing it", rank, timeout
                    )
        self._finalizer()

    def terminate(self) -> None:
        """SIGTERM every worker (a headless node told to stop)."""
        self._stopping = True
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
