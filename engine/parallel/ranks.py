"""Rank 0's side of tensor parallelism: this node's other ranks started, the process groups
joined, a lost worker reported, and all of it stopped again."""

from __future__ import annotations

from collections.abc import Callable

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.parallel.group import RankGroups, destroy, init_rank, open_store, rank_device
from deltaserve.engine.parallel.launcher import WorkerProcesses
from deltaserve.engine.parallel.liveness import WorkersWatch
from deltaserve.engine.parallel.step_sync import STOP, StepChannel


class Ranks:
    """Starts this node's workers and joins the groups as rank 0; `on_lost(why)` is called from a
    watching thread once a worker exits while it should run, or goes silent (after `watch`)."""

    def __init__(self, config: EngineConfig, on_lost: Callable[[str], None]) -> None:
        if config.node_rank != 0:
            raise ValueError("the engine is rank 0, on node 0: other nodes run headless workers")
        self.device = rank_device(config, 0)
        self._on_lost = on_lost
        # listening before the workers start: no other process can take the port in between
        store = open_store(config, 0, config.master_port or 0)
        port = store.port
        self._store_at = (config.master_addr, port)
        self._world = config.tensor_parallel_size
        self._liveness: WorkersWatch | None = None
        local = [r for r in config.node_ranks if r != 0]
        self.workers: WorkerProcesses | None = WorkerProcesses(config, local, port) if local else None
        self.groups: RankGroups | None = None
        try:
            self.groups = init_rank(
                config, 0, port, self.device, self.workers.exited if self.workers is not None else None, store
            )
        except BaseException:
            self.stop(None, graceful=False)
            raise

    def watch(self) -> None:
        if self.workers is not None:
            self.workers.watch(self._on_lost)
        self._liveness = WorkersWatch(*self._store_at, range(1, self._world), self._silent)

    def _silent(self, rank: int, why: str) -> None:
        self._on_lost(why)
        workers = self.workers
        proc = workers.procs.get(rank) if workers is not None else None
        if proc is not None:  # one of ours: killed, a step that waits on it fails now
            proc.kill()

    def exited(self, wait_s: float = 0.0) -> str | None:
        """Which local worker exited, if one did (or does within `wait_s`)."""
        return self.workers.exited(wait_s) if self.workers is not None else None

    def stop(self, channel: StepChannel | None, graceful: bool = True) -> None:
        """Tell the workers to stop over `channel` (when graceful), kill those that do not, and
        leave the process group. Idempotent."""
        groups, workers = self.groups, self.workers
        self.groups = self.workers = None
        if self._liveness is not None:
            self._liveness.stop()
        if graceful and groups is not None and channel is not None:
            try:
                channel.send(STOP)
            except EngineDeadError:
                pass
        if workers is not None:
            workers.stop(timeout=30.0 if graceful else 0.0)
        destroy(groups)
