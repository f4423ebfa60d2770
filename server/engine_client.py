"""The bridge between the HTTP event loop and the synchronous Engine.

The Engine runs in its own thread, so no request waits on another's forward pass except through
batching. Commands (add, abort, stats, stop) reach it through one thread-safe queue; its outputs come
back once per step through `loop.call_soon_threadsafe` and fan out to one asyncio queue per request.
Only the engine thread ever touches the Engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.engine.outputs import RequestOutput
    from deltaserve.engine.sampling_params import SamplingParams

    from .metrics import Metrics

logger = logging.getLogger("deltaserve.server")

_IDLE_POLL_S = 0.5  # how long the idle engine thread sleeps on its command queue before re-checking


class QueueFullError(Exception):
    """The waiting queue is at its bound (HTTP 503)."""


class ShuttingDownError(QueueFullError):
    """The server is draining and takes no new requests (HTTP 503)."""


class RequestGroup:
    """The engine requests behind one HTTP request (n of them for `n`), read together.

    Each iteration returns one output for every member that made progress since the last one: a
    slow reader gets the outputs that queued up merged (deltas joined, the newest cumulative
    output in place of older ones).
    """

    def __init__(self, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.failed = False

    def __aiter__(self) -> AsyncIterator[list[RequestOutput]]:
        return self

    async def __anext__(self) -> list[RequestOutput]:
        if self.failed or not self.unfinished:
            raise StopAsyncIteration
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        latest: dict[str, RequestOutput] = {}
        for item in items:
            if isinstance(item, BaseException):
                self.failed = True  # `unfinished` stays as it is: the reader's cleanup aborts those
                raise item
            earlier = latest.get(item.request_id)
            latest[item.request_id] = item if earlier is None else earlier.merge(item)
        self.unfinished.difference_update(rid for rid, out in latest.items() if out.finished)
        return list(latest.values())


class EngineClient:
    def __init__(self, engine: Any, metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.model_info: dict[str, Any] = dict(engine.model_info)
        self.eos_token_ids: list[int] = list(engine.eos_token_ids)
        self.vocab_size: int | None = getattr(engine, "vocab_size", None) or self.model_info.get("vocab_size")
        self.metrics = metrics
        self._commands: queue.SimpleQueue[tuple[str, Any, asyncio.Future[Any] | None]] = queue.SimpleQueue()
        self._groups: dict[str, RequestGroup] = {}  # engine request id -> its group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._live: set[str] = set()  # engine-thread side: ids added and not yet finished or aborted
        self.accepting = True

    # ----------------------------------------------------------------------------- event-loop side

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="deltaserve-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def add(
        self, requests: list[tuple[str, list[int], SamplingParams]], track: bool = True
    ) -> RequestGroup:
        """Admit the requests together (all or none); raises ValueError or QueueFullError.
        `track=False`: not a client's request (a prefix warm-up): left out of the metrics."""
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down")
        group = RequestGroup([rid for rid, _, _ in requests])
        for request_id in group.request_ids:
            self._groups[request_id] = group
            if self.metrics is not None and track:
                self.metrics.request_started(request_id)
        try:
            await self._call("add", requests)
        except BaseException:
            # Also reached when the client goes away while the add is in flight: the abort queued
            # after the add undoes it, and is a no-op if the add failed.
            for request_id in group.request_ids:
                self._groups.pop(request_id, None)
                self._commands.put(("abort", request_id, None))
                if self.metrics is not None:
                    self.metrics.forget(request_id)
            raise
        return group

    def abort(self, group: RequestGroup) -> None:
        """Abort what is left of a group whose client no longer waits; never blocks."""
        self._abort_unfinished(group)
        group.unfinished.clear()

    def _abort_unfinished(self, group: RequestGroup) -> None:
        for request_id in group.unfinished:
            if self._groups.pop(request_id, None) is not None:
                self._commands.put(("abort", request_id, None))
                if self.metrics is not None:
                    self.metrics.request_aborted(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self._call("stats", None)

    async def shutdown(self) -> None:
        """Abort whatever still runs and stop the engine thread."""
        self.accepting = False
        for group in {id(g): g for g in self._groups.values()}.values():
            group.queue.put_nowait(ShuttingDownError("the server shut down before the request finished"))
            self._abort_unfinished(group)
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(("stop", None, None))
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    async def _call(self, kind: str, payload: Any) -> Any:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._commands.put((kind, payload, future))
        return await future

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            if self.metrics is not None:
                self.metrics.request_progress(out, now)
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            group.queue.put_nowait(out)
            if out.finished:
                del self._groups[out.request_id]

    def _fail_all(self, exc: BaseException) -> None:
        for group in {id(g): g for g in self._groups.values()}.values():
            group.queue.put_nowait(exc)
        self._groups.clear()

    # ------------------------------------------------------------------------------- engine thread

    def _run(self) -> None:
        engine = self.engine
        while True:
            try:
                if not self._handle_commands(block=not engine.has_unfinished_requests()):
                    return
                if not engine.has_unfinished_requests():
                    continue
                outputs = engine.step()
            except Exception as exc:  # a failed step must not take the server down with it
                logger.exception("engine step failed; failing the requests in flight")
                self._abort_all_in_engine()
                self._post(self._fail_all, RuntimeError(f"engine error: {exc}"))
                continue
            if outputs:
                self._live.difference_update(out.request_id for out in outputs if out.finished)
                self._post(self._dispatch, outputs, time.monotonic())

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands; False once told to stop."""
        try:
            command = self._commands.get(timeout=_IDLE_POLL_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind, payload, future = command
            if kind == "stop":
                self._abort_all_in_engine()
                return False
            if kind == "abort":
                self.engine.abort_request(payload)
                self._live.discard(payload)
            elif kind == "stats":
                self._settle(future, self.engine.stats)
            elif kind == "add":
                self._settle(future, functools.partial(self._add, payload))
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _add(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        added: list[str] = []
        try:
            for request_id, token_ids, params in requests:
                self.engine.add_request(request_id, token_ids, params)
                added.append(request_id)
                self._live.add(request_id)
        except BaseException as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
                self._live.discard(request_id)
            if type(exc).__name__ == "QueueFullError":  # the engine's, kept apart from its import
                raise QueueFullError(str(exc)) from exc
            raise

    def _abort_all_in_engine(self) -> None:
        for request_id in list(self._live):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        self._live.clear()

    def _settle(self, future: asyncio.Future[Any] | None, fn: Callable[[], Any]) -> None:
        try:
            result, error = fn(), None
        except Exception as exc:
            result, error = None, exc
        if future is not None:
            self._post(_resolve, future, result, error)

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _resolve(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting request was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
