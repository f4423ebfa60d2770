"""Graceful shutdown that tells every client what happened."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import TYPE_CHECKING, Any

import uvicorn

from .engine_client import EngineClient, ShuttingDownError

if TYPE_CHECKING:
    from .api_servers import ApiServers

logger = logging.getLogger("deltaserve.server")

FLUSH_S = 5  # after the drain: how long uvicorn lets responses write their last bytes


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose first SIGTERM / SIGINT drains: new requests get 503 with Retry-After
    while running ones have `drain_s` to finish; those still running then end with an error (an
    error event and [DONE] when streamed, a 503 when not) and the server exits. A second signal
    exits at once.

    `peers` (process 0 of several HTTP processes): each signal is passed on to them, and the drain
    also waits for them to exit, since process 0's shutdown stops the engine under them.
    `ignore_sigint` (the others): Ctrl-C reaches the whole process group; process 0's SIGTERM
    then starts their drain, which a second signal would cut short."""

    def __init__(
        self,
        config: uvicorn.Config,
        client: EngineClient,
        drain_s: float,
        peers: ApiServers | None = None,
        ignore_sigint: bool = False,
    ) -> None:
        super().__init__(config)
        self.client = client
        self.drain_s = drain_s
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.peers = peers
        self.ignore_sigint = ignore_sigint

    async def startup(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if sig == signal.SIGINT and self.ignore_sigint:
            return
        if self.peers is not None:
            self.peers.drain()
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
        peers = self.peers
        while (
            self.client.num_in_flight or (peers is not None and peers.any_alive())
        ) and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.client.num_in_flight:
            logger.info("aborting %d requests still running", self.client.num_in_flight)
        # and those still being prepared, waiting for the engine's answer (a grammar's compile)
        if self.client.num_in_flight or self.client.num_calls:
            self.client.fail_all(ShuttingDownError("the server shut down before the request finished"))
            await asyncio.sleep(0.2)  # their error events reach the sockets
        super().handle_exit(sig, None)
