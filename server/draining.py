"""Graceful shutdown that tells every client what happened."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

import uvicorn

from .engine_client import EngineClient, ShuttingDownError

logger = logging.getLogger("deltaserve.server")

FLUSH_S = 5  # after the drain: how long uvicorn lets responses write their last bytes


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains: new requests get 503 with Retry-After
    while running ones have `drain_s` to finish; those still running then end with an error (an
    error event and [DONE] when streamed, a 503 when not) and the server exits. A second signal
    exits at once.

    `on_drain` runs when the drain starts (process 0 passes the signal on to the other HTTP
    processes, and `peers_busy` tells it when they are done); `ignore_sigint`: those others leave Ctrl-C, which reaches the whole process group,
    to process 0, whose SIGTERM then starts their drain (a second signal would cut it short)."""

    def __init__(
        self,
        config: uvicorn.Config,
        client: EngineClient,
        drain_s: float,
        on_drain: Callable[[], None] | None = None,
        ignore_sigint: bool = False,
        peers_busy: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__(config)
        self.client = client
        self.drain_s = drain_s
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.on_drain = on_drain
        self.ignore_sigint = ignore_sigint
        self.peers_busy = peers_busy or (lambda: False)

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        if self.on_drain is not None:
            self.on_drain()
        if self.draining or not self.started or self.loop is None:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        self.client.accepting = False
        logger.info(
            "draining: %d requests in flight, %.0f s to finish", self.client.num_in_flight, self.drain_s
        )
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(sig)))

    async def _drain(self, sig: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        # process 0 also waits for the other HTTP processes: its shutdown stops the engine under them
        while (self.client.num_in_flight or self.peers_busy()) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.client.num_in_flight:
            logger.info("aborting %d requests still running", self.client.num_in_flight)
            self.client.fail_all(ShuttingDownError("the server shut down before the request finished"))
            await asyncio.sleep(0.2)  # their error events reach the sockets
        super().handle_exit(sig, None)
