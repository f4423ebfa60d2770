"""The ranks' liveness, kept on the rendezvous store beside the step channel.

Every worker adds 1 to a counter of its own in rank 0's TCPStore every `BEAT_S`. The store
answers from a thread of rank 0's process that no Python work holds up (a model loading, a long
step, the vision tower, an offline `LLM` that sends nothing between calls), so a worker whose add
has gone unanswered for `TIMEOUT_S` knows what the step channel cannot: rank 0's process is
stopped or frozen, or its node unreachable, and the worker exits rather than wait on it for ever
(a rank 0 that exited closed its connections, which ends the worker's wait at once anyway). A
rank 0 whose process runs but whose engine loop is wedged still answers: that is node 0's
/health to report.

Rank 0 reads the counters in turn: a worker whose counter stood still for `TIMEOUT_S` is stopped
or frozen, or its node unreachable, which ends the engine even while a step waits for that
worker inside a collective (which nothing else bounds: a step may take long, a worker's adds
never stop while its process runs).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

BEAT_S = 1.0  # how often a worker adds to its counter (and each side looks)
# how long an unanswered add, or a counter that stands still, is tolerated: a live rank answers in
# milliseconds whatever its main thread does
TIMEOUT_S = 30.0


def _key(rank: int) -> str:
    return f"deltaserve/alive/{rank}"


def _client(addr: str, port: int) -> Any:
    """A connection of its own to the rendezvous store (the process group's is not shared)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    return dist.TCPStore(addr, port, None, False, timeout=timeout, wait_for_workers=False)


def _one_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class RankZeroWatch:
    """A worker's side: its counter's adds, and `on_lost(why)` (from a thread) once one has gone
    unanswered for `TIMEOUT_S`."""

    def __init__(self, addr: str, port: int, rank: int, on_lost: Callable[[str], None]) -> None:
        self._where = f"{addr}:{port}"
        self._on_lost = on_lost
        self._stopped = threading.Event()
        # when the add under way (or one that failed) was sent; None while none waits
        self._waiting_since: float | None = time.monotonic()
        self._why = ""  # the error of an add that failed
        threading.Thread(
            target=self._add, args=(addr, port, rank), name="deltaserve-liveness", daemon=True
        ).start()
        threading.Thread(target=self._check, name="deltaserve-liveness-check", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()

    def _add(self, addr: str, port: int, rank: int) -> None:
        try:
            store = _client(addr, port)
            while not self._stopped.is_set():
                self._waiting_since = time.monotonic()
                store.add(_key(rank), 1)
                self._waiting_since = None
                self._stopped.wait(BEAT_S)
        except Exception as exc:  # rank 0's process is gone: its connection closed (it stays unanswered)
            self._why = f" ({_one_line(exc)})"

    def _check(self) -> None:
        # the add's own wait is what tells: a worker stalled as a whole (its GIL held) waits in none
        while not self._stopped.wait(BEAT_S):
            since = self._waiting_since
            if since is not None and time.monotonic() - since >= TIMEOUT_S:
                self._on_lost(
                    f"rank 0 (the rendezvous store at {self._where}) did not answer for {TIMEOUT_S:g} s: "
                    f"its process is stopped or frozen, or its node unreachable{self._why}"
                )
                return


class WorkersWatch:
    """Rank 0's side: `on_silent(rank, why)` (from a thread) once a worker's counter has stood still
    for `TIMEOUT_S`."""

    def __init__(
        self, addr: str, port: int, ranks: Iterable[int], on_silent: Callable[[int, str], None]
    ) -> None:
        self._on_silent = on_silent
        self._stopped = threading.Event()
        threading.Thread(
            target=self._run, args=(addr, port, list(ranks)), name="deltaserve-liveness", daemon=True
        ).start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self, addr: str, port: int, ranks: list[int]) -> None:
        try:
            store = _client(addr, port)
        except Exception as exc:  # our own process's store: not expected to fail
            logger.warning("cannot watch the tensor-parallel ranks' liveness: %s", _one_line(exc))
            return
        seen: dict[int, tuple[int, float]] = {}  # rank -> (its count, when it last changed)
        while not self._stopped.wait(BEAT_S):
            now = time.monotonic()
            for rank in ranks:
                try:
                    count = store.add(_key(rank), 0)
                except Exception as exc:  # the store went with the process group (a stop under way)
                    if not self._stopped.is_set():
                        logger.warning(
                            "stopped watching the tensor-parallel ranks' liveness: %s", _one_line(exc)
                        )
                    return
                if rank not in seen or seen[rank][0] != count:
                    seen[rank] = (count, now)
                elif now - seen[rank][1] >= TIMEOUT_S and not self._stopped.is_set():
                    self._on_silent(
                        rank,
                        f"tensor-parallel rank {rank} was not heard from for {TIMEOUT_S:g} s: its process "
                        "is stopped or frozen, or its node unreachable",
                    )
                    return
