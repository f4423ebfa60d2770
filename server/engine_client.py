"""The HTTP process's side of the engine: a started engine core (engine/core.py) and the async
client that talks to it.

The engine runs in its own process (`EngineHandle.start`), so the event loop and the step loop
never share a GIL; tests may run the same loop in a thread over any object with the Engine's
interface (`EngineHandle.in_thread`). Either way the client speaks to it over pyzmq: adds and
calls await the reply that comes back with the next step's message, aborts are fire and forget,
and each step's outputs fan out to one asyncio queue per request. A dead engine process fails
every request in flight at once and turns /health to 503; so does a loop silent for too long.

With data parallelism (`--data-parallel-size`) the client speaks to several engine processes, one
pair of sockets each: `engine_router.EngineRouter` picks the engine of each added request, aborts
follow their requests, and the calls go to every engine (their stats added up). One engine that
dies fails its own requests and turns /health to 503; the others' requests finish.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import pickle
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltaserve.engine.core import ABORT_MEMORY_S, pid_running
from deltaserve.engine.errors import (
    EngineDeadError,
    EngineFaultError,
    InvalidParamError,
    QueueFullError,
    UpdateBusyError,
    reply_error,
)
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.outputs import CompletionOutput, unpack_outputs

from .engine_router import EngineRouter

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from deltaserve.engine.requests.outputs import RequestOutput
    from deltaserve.engine.requests.sampling_params import SamplingParams
    from deltaserve.models.vision.positions import ImageInputs

    from .metrics import Metrics

    # (request id, prompt ids, sampling parameters), and the prompt's images when it has any
    EngineRequest = tuple[str, list[int], SamplingParams] | tuple[str, list[int], SamplingParams, ImageInputs]

logger = logging.getLogger("deltaserve.server")

WEDGED_AFTER_S = 120.0  # a loop silent this long (no step, no beat) counts as wedged on /health


class ShuttingDownError(QueueFullError):
    """The server is draining and takes no new requests (HTTP 503)."""


class RequestGroup:
    """The engine requests behind one HTTP request (n of them for `n`), read together.

    Each iteration returns one output for every member that made progress since the last one: a
    slow reader gets the outputs that queued up merged (deltas joined, the newest cumulative
    output in place of older ones).
    """

    def __init__(self, request_ids: list[str], engine: int = 0) -> None:
        self.request_ids = request_ids
        self.engine = engine  # the (data-parallel) engine that holds them
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.unfinished = set(request_ids)
        self.failed = False
        # prompt logprobs computed for members that dropped them (`share_scoring`), by request id
        self.prompt_logprobs: dict[str, list[Any]] = {}

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
        for rid, out in latest.items():
            if out.prompt_logprobs is None and rid in self.prompt_logprobs:
                # as the engine gives them: a delta stream once, in its first output
                out.prompt_logprobs = (
                    self.prompt_logprobs.pop(rid) if out.delta else self.prompt_logprobs[rid]
                )
        return list(latest.values())


@dataclass
class EngineHandle:
    """A started engine loop: the bound sockets, what the engine said of itself, and its process
    (or thread)."""

    push: Any  # zmq.Socket: commands out
    pull: Any  # zmq.Socket: steps in
    info: dict[str, Any]
    ipc_dir: str
    process: BaseProcess | None = None
    thread: threading.Thread | None = None
    # another HTTP process's engine (`attach`): watched by its pid, neither stopped nor cleaned up here
    engine_pid: int | None = None
    _ctx: Any = field(default=None, repr=False)

    @classmethod
    def start(
        cls, config: Any, log_level: str = "info", stats_interval_s: float = 0.0, api_servers: int = 1
    ) -> EngineHandle:
        """Start the engine process for `config`; it loads its model meanwhile (data-parallel
        replicas load together), and `await_ready` waits for it. `stats_interval_s`: the engine's
        periodic stats line (engine/stats_log.py); 0: none. `api_servers`: HTTP processes it
        serves, this one first; the others `attach` to it."""
        import multiprocessing

        from deltaserve.engine.core import serve_engine

        handle = cls._bind()
        ins = [handle.address("in", i) for i in range(api_servers)]
        outs = [handle.address("out", i) for i in range(api_servers)]
        rank = getattr(config, "data_parallel_rank", 0)
        # spawn, not fork: the child initialises CUDA, which a forked copy of this process may not
        process = multiprocessing.get_context("spawn").Process(
            target=serve_engine,
            args=(config, ins, outs, os.getpid(), log_level, stats_interval_s),
            name=f"deltaserve-engine-{rank}" if rank else "deltaserve-engine",
            daemon=True,
        )
        process.start()
        handle.process = process
        return handle

    @classmethod
    def attach(cls, ipc_dir: str, index: int, info: dict[str, Any], engine_pid: int) -> EngineHandle:
        """HTTP process `index` (of `start`'s `api_servers`) joins the engine that process 0 started."""
        handle = cls._bind(ipc_dir, index)
        handle.info = info
        handle.engine_pid = engine_pid
        return handle

    @classmethod
    def in_thread(cls, engine: Any) -> EngineHandle:
        """Run the loop over `engine` in a thread of this process (tests, stand-in engines)."""
        from deltaserve.engine.core import EngineCore, engine_info

        handle = cls._bind()
        core = EngineCore(engine, handle.address("in", 0), handle.address("out", 0))

        def run() -> None:
            core.send(("ready", engine_info(engine)))
            core.run()

        handle.thread = threading.Thread(target=run, name="deltaserve-engine", daemon=True)
        handle.thread.start()
        handle.await_ready(60.0)
        return handle

    @classmethod
    def _bind(cls, ipc_dir: str | None = None, index: int = 0) -> EngineHandle:
        import zmq

        ctx = zmq.Context()
        handle = cls(None, None, {}, ipc_dir or tempfile.mkdtemp(prefix="deltaserve-"), _ctx=ctx)
        handle.push, handle.pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        handle.push.setsockopt(zmq.LINGER, 0)
        handle.pull.setsockopt(zmq.LINGER, 0)
        handle.push.bind(handle.address("in", index))
        handle.pull.bind(handle.address("out", index))
        return handle

    def address(self, kind: str, index: int) -> str:
        """The engine's `kind` ("in": commands, "out": steps) socket of HTTP process `index`."""
        return f"ipc://{self.ipc_dir}/{kind}" + (f"-{index}" if index else "")

    def await_ready(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.pull.poll(200):
                message = pickle.loads(self.pull.recv())
                if message[0] == "ready":
                    self.info = message[1]
                    return
                if message[0] == "failed":
                    if self.process is not None:  # it exits on its own: let it clean up (no leak warnings)
                        self.process.join(10.0)
                    self.close()
                    raise RuntimeError(message[1])
                continue
            if not self.alive():
                code = self.process.exitcode if self.process is not None else None
                self.close()
                raise RuntimeError(f"the engine process exited with code {code} while loading")
            if deadline is not None and time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the engine did not start in time")

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        if self.engine_pid is not None:
            return pid_running(self.engine_pid)
        return self.thread is not None and self.thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Tell the loop to stop, wait for it, then kill a process that did not (an attached
        handle only closes its sockets: the engine is process 0's)."""
        import zmq

        if self.engine_pid is not None:
            self.close()
            return
        try:
            self.push.send(pickle.dumps(("stop",)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine process did not stop in %.0f s; killing it", timeout)
                self.process.kill()
                self.process.join(5.0)
        elif self.thread is not None:
            self.thread.join(timeout)
        self.close()

    def close(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        self.push.close(linger=0)
        self.pull.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self.engine_pid is None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)


class EngineClient:
    """The event loop's handle on the engine (or the data-parallel engines): admit, abort, call,
    and read per-request outputs."""

    def __init__(
        self,
        handles: EngineHandle | Sequence[EngineHandle],
        tokenizer: Any = None,
        metrics: Metrics | None = None,
        load_balance_method: str = "cache_aware",
        routes: Any = None,
        shared_load: Any = None,
    ) -> None:
        self.handles = [handles] if isinstance(handles, EngineHandle) else list(handles)
        info = self.handles[0].info
        self.tokenizer = tokenizer
        self.max_model_len: int = info["max_model_len"]
        self.model_info: dict[str, Any] = dict(info["model_info"])
        self.eos_token_ids: list[int] = list(info["eos_token_ids"])
        self.vocab_size: int | None = info.get("vocab_size") or self.model_info.get("vocab_size")
        self.max_requests: int | None = info.get("max_requests")  # each engine's, running and waiting
        self._updating = asyncio.Lock()
        self._aborted_at: dict[str | None, float] = {}  # abort_where's prefixes (None: all), when last
        self.metrics = metrics
        self.accepting = True
        self.faults = 0  # steps that failed with no request to blame
        self.fault: str | None = None  # the last one: /health reports the engine unhealthy
        self.dead: str | None = None  # why an engine is gone, once one is
        self.wedged_after_s = WEDGED_AFTER_S
        # shared with the other HTTP processes: the prefixes' engines (SharedRoutes) and the
        # requests in flight on each engine (SharedLoad)
        self.router = EngineRouter(
            len(self.handles), load_balance_method, routes=routes, shared_load=shared_load
        )
        self._groups: dict[str, RequestGroup] = {}  # engine request id -> its group
        self._engine_of: dict[str, int] = {}  # engine request id -> the engine that holds it
        self._prompts: dict[str, list[int]] = {}  # engine request id -> its prompt (outputs omit it)
        # streams without stop strings are detokenized here, beside the engine's step, not in it
        # a stream decoded here, and whether a stop token's text is shown (include_stop_str_in_output)
        self._detokenizers: dict[str, tuple[IncrementalDetokenizer, bool]] = {}
        self._calls: dict[int, tuple[asyncio.Future[Any], int]] = {}  # call id -> (its reply, engine)
        self._call_ids = itertools.count()
        self._gone: set[int] = set()  # engines that died
        self._last_heard = [time.monotonic()] * len(self.handles)
        self._tasks: list[asyncio.Task[None]] = []
        self._pushes: list[Any] = []

    @property
    def handle(self) -> EngineHandle:
        """The first engine's handle (the only one without data parallelism)."""
        return self.handles[0]

    @classmethod
    def in_thread(cls, engine: Any) -> EngineClient:
        """A client over a loop in a thread of this process, driving `engine` (tests)."""
        return cls(EngineHandle.in_thread(engine), getattr(engine, "tokenizer", None))

    # ------------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        import zmq.asyncio

        self._pushes = [zmq.asyncio.Socket.from_socket(h.push) for h in self.handles]
        for engine in range(len(self.handles)):  # first: once this process is gone, its requests end
            await self._send(("hello", os.getpid()), engine)
        self._last_heard = [time.monotonic()] * len(self.handles)
        for engine, handle in enumerate(self.handles):
            pull = zmq.asyncio.Socket.from_socket(handle.pull)
            self._tasks.append(asyncio.create_task(self._read(engine, pull)))
            self._tasks.append(asyncio.create_task(self._watch(engine)))

    def health(self) -> tuple[bool, str]:
        """(healthy, why not) for /health."""
        if not self.accepting:
            return False, "the server is shutting down"
        if self.dead is not None:
            return False, self.dead
        for engine, handle in enumerate(self.handles):
            if not handle.alive():
                return False, f"{self._name(engine)} process is not running"
        silent = time.monotonic() - min(self._last_heard)
        if silent >= self.wedged_after_s:
            return False, f"the engine has not answered for {silent:.0f} s"
        if self.fault is not None:  # the detail is in the log, not for every caller of /health
            return False, "an engine step failed; the requests it held were failed"
        return True, ""

    @property
    def num_in_flight(self) -> int:
        return len(self._groups)

    @property
    def num_calls(self) -> int:
        """Calls sent to the engines and not yet answered."""
        return len(self._calls)

    def fail_all(self, exc: BaseException) -> None:
        """Every group still open gets `exc`; its reader's cleanup aborts what is left. So does
        every call still unanswered (a request's grammar compiling)."""
        for future, _ in self._calls.values():
            if not future.done():
                future.set_exception(exc)
        ids = list(self._groups)
        self._abort_ids(ids)
        self._fail(ids, exc)

    async def shutdown(self) -> None:
        """Fail whatever still runs and stop the engines."""
        self.accepting = False
        self.fail_all(ShuttingDownError("the server shut down before the request finished"))
        for task in self._tasks:
            task.cancel()
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, h.stop) for h in self.handles))

    # ------------------------------------------------------------------------------- requests

    async def add(
        self,
        requests: Sequence[EngineRequest],
        track: bool = True,
        engine: int | None = None,
        arrived: float | None = None,
    ) -> RequestGroup:
        """Admit the requests together, all or none; raises ValueError or QueueFullError. They go
        to `engine`, or with data parallelism each distinct prompt (with its n samples) where the
        router picks. `track=False`: not a client's request (a prefix warm-up, a health check):
        left out of the metrics. `arrived`: when their HTTP request came (time.monotonic): an
        /abort_request that named them since, through any HTTP process, ends them once added."""
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down")
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        self._check_fits(requests, engine)
        placed = self._place(requests, engine)
        group = RequestGroup([r[0] for r in requests], placed[requests[0][0]] if requests else 0)
        requests = [(r[0], r[1], self._detokenize_here(r[0], r[2]), *r[3:]) for r in requests]  # type: ignore[misc]
        by_engine: dict[int, list[EngineRequest]] = {}
        for request in requests:
            request_id, prompt = request[0], request[1]
            self._groups[request_id] = group
            self._engine_of[request_id] = placed[request_id]
            self._prompts[request_id] = prompt
            by_engine.setdefault(placed[request_id], []).append(request)
            if self.metrics is not None and track:
                self.metrics.request_started(request_id)
        calls: list[int] = []
        try:
            for e, mine in by_engine.items():  # every add sent before any reply is awaited
                calls.append(await self._request(("add", None, mine, arrived), e))
            replies = await asyncio.gather(*(self._calls[c][0] for c in calls), return_exceptions=True)
            failed = next((r for r in replies if isinstance(r, BaseException)), None)
            if failed is not None:
                raise failed
        except BaseException:
            # Also reached when the client goes away while the adds are in flight, or when one
            # engine refuses its part: the aborts sent after the adds undo them (no-ops where an
            # add failed).
            ids = group.request_ids
            self._abort_ids([rid for rid in ids if rid in self._groups])
            self._forget(ids)
            if self.metrics is not None:
                for request_id in ids:
                    self.metrics.forget(request_id)
            raise
        finally:
            for call_id in calls:
                self._calls.pop(call_id, None)
        return group

    def _check_fits(self, requests: Sequence[EngineRequest], engine: int | None) -> None:
        """A request's sequences are admitted together, all or none: more than idle engines hold
        (running and waiting) is a 400, not the 503 of a busy engine, which no retry would get
        past. A prompt's copies (its n samples) run on one engine; `engine` given, all do."""
        cap = self.max_requests
        if cap is None or len(requests) <= cap:
            return  # the common case: they fit one idle engine
        # a prompt's copies (n samples) share its token list (`fan_out`); a batch that gives the
        # same prompt twice has two prompts, which may run on two engines
        copies = Counter(id(r[1]) for r in requests)
        most = max(copies.values(), default=0)
        if most > cap:
            raise InvalidParamError(
                f"n: {most} samples of one prompt run together on one engine, which holds at most "
                f"{cap} requests (running and waiting)",
                "n",
            )
        engines = 1 if engine is not None else len(self.handles)
        if len(requests) > cap * engines:
            param = "prompt" if len(copies) > 1 else "n"
            raise InvalidParamError(
                f"{param}: this request's {len(requests)} sequences ({len(copies)} prompts, n each) are "
                f"admitted together, more than the {cap * engines} requests the server holds at once "
                "(running and waiting); send fewer at a time",
                param,
            )

    def _place(self, requests: Sequence[EngineRequest], engine: int | None) -> dict[str, int]:
        """Each request's engine (counted in the router's load): `engine` for all, else the
        router's pick for each prompt, its copies (n samples, sharing its token list) beside it."""
        placed: dict[str, int] = {}
        chosen: dict[int, int] = {}
        for request_id, prompt, params, *_ in requests:
            if engine is not None or len(self.handles) == 1:
                e = engine or 0
            else:
                key = id(prompt)
                if key not in chosen:
                    chosen[key] = self.router.pick([prompt], params.cache_salt)
                e = chosen[key]
            placed[request_id] = e
            self.router.count(e, 1)
        return placed

    def abort(self, group: RequestGroup) -> None:
        """Abort what is left of a group whose client no longer waits; never blocks."""
        ids = [rid for rid in group.unfinished if rid in self._groups]
        self._abort_ids(ids)
        self._forget(ids)
        if self.metrics is not None:
            for request_id in ids:
                self.metrics.request_aborted(request_id)
        group.unfinished.clear()

    async def abort_where(self, prefix: str | None) -> None:
        """End every request (of any HTTP process) whose engine id starts with `prefix`, or every
        request (None): each ends with finish reason "abort" and what it had generated."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        now = time.monotonic()
        self._aborted_at = {p: at for p, at in self._aborted_at.items() if now - at < ABORT_MEMORY_S}
        self._aborted_at[prefix] = now
        for engine in range(len(self.handles)):
            if engine not in self._gone:
                await self._send(("abort_where", prefix), engine)
        # answered once each engine has applied it (a call's reply follows the commands sent before
        # it): a request sent after this returns, through another HTTP process, is not caught by it
        await self.call_each("model_info", return_exceptions=True)

    def aborted_since(self, request_id: str, since: float) -> bool:
        """Whether this process has aborted (abort_where) ids like `request_id` since `since`: a
        request of several engine requests in turn (a beam search's steps) stops between them."""
        return any(
            at >= since and (prefix is None or request_id.startswith(prefix))
            for prefix, at in self._aborted_at.items()
        )

    async def stats(self) -> dict[str, Any]:
        stats = await self.call("stats")
        stats["engine_faults_total"] = self.faults
        return stats

    async def call(self, name: str, *args: Any) -> Any:
        """One of the engine's calls (engine/core.py), answered with the next step's message; with
        data parallelism every engine's, together: the first error raises, stats are added up
        (`merge_stats`), and any other call gives the first engine's value."""
        values = await self.call_each(name, *args)
        if len(values) > 1 and name == "stats":
            return merge_stats(values)
        return values[0]

    async def call_each(
        self, name: str, *args: Any, return_exceptions: bool = False, engines: Sequence[int] | None = None
    ) -> list[Any]:
        """One of the engine's calls on every (data-parallel) engine, or on `engines`, at once:
        their values (with `return_exceptions`, an engine's exception in place of its value)."""
        which = range(len(self.handles)) if engines is None else engines
        calls = (self._call(("call", None, name, args), e) for e in which)
        return await asyncio.gather(*calls, return_exceptions=return_exceptions)

    async def update_weights(self, path: str, load_format: str, version: str | None) -> None:
        """Every engine stages the checkpoint (each once its running requests finish, holding new
        ones), then all serve it, or, if one cannot, none does: ValueError with its reason. The
        two steps run to their end even if the caller goes away, or the engines would hold
        their requests for good."""

        async def both() -> None:
            async with self._updating:  # this process's updates one after another
                staged = await self.call_each("stage_weights", path, load_format, return_exceptions=True)
                failed = next((r for r in staged if r), None)  # a reason, or an exception raised
                # an engine busy with another process's update staged nothing of this one
                mine = [e for e, r in enumerate(staged) if not isinstance(r, UpdateBusyError)]
                await self.call_each("finish_weights", failed is None, version, engines=mine)
            if isinstance(failed, BaseException):
                raise failed
            if failed is not None:
                raise ValueError(failed)

        await asyncio.shield(both())

    async def _call(self, command: tuple[Any, ...], engine: int = 0) -> Any:
        call_id = await self._request(command, engine)
        try:
            return await self._calls[call_id][0]
        finally:
            self._calls.pop(call_id, None)

    async def _request(self, command: tuple[Any, ...], engine: int) -> int:
        """Send a command that the engine answers; its reply's future is `_calls[call id]`."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        call_id = next(self._call_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, engine)
        sending = asyncio.ensure_future(self._send((command[0], call_id, *command[2:]), engine))
        try:
            # a send to an engine that died waits for a reader that never comes: its failed reply ends it
            await asyncio.wait({sending, future}, return_when=asyncio.FIRST_COMPLETED)
            if not sending.done():
                await future  # failed: the engine is gone
            sending.result()
        except BaseException:
            sending.cancel()
            self._calls.pop(call_id, None)
            raise
        return call_id

    async def _send(self, command: tuple[Any, ...], engine: int) -> None:
        data = pickle.dumps(command, protocol=pickle.HIGHEST_PROTOCOL)
        await self._pushes[engine].send(data, copy=False)

    def _abort_ids(self, ids: list[str]) -> None:
        if not ids or not self._pushes:
            return
        by_engine: dict[int, list[str]] = {}
        for request_id in ids:
            by_engine.setdefault(self._engine_of.get(request_id, 0), []).append(request_id)
        for engine, mine in by_engine.items():
            if engine not in self._gone:
                asyncio.ensure_future(self._send(("abort", mine), engine))

    def _forget(self, ids: list[str]) -> None:
        for request_id in ids:
            self._groups.pop(request_id, None)
            self._prompts.pop(request_id, None)
            self._detokenizers.pop(request_id, None)
            engine = self._engine_of.pop(request_id, None)
            if engine is not None:
                self.router.count(engine, -1)

    def _detokenize_here(self, request_id: str, params: SamplingParams) -> SamplingParams:
        """A stream's text is decoded in this process when nothing in the engine needs it (no
        stop strings): the engine's step, which every stream waits for, then does not."""
        if self.tokenizer is None or params.output_kind != "delta" or params.stop or not params.detokenize:
            return params
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._detokenizers[request_id] = (detok, params.include_stop_str_in_output)
        return dataclasses.replace(params, detokenize=False)

    def _decode(self, out: RequestOutput, detok: IncrementalDetokenizer, keep_stop: bool) -> None:
        """Fill in the text of an output the engine sent without (a delta: what its tokens add);
        the stop token that ended it adds its id but no text, unless `keep_stop`, as the engine's
        own text leaves it out."""
        completion = out.outputs[0]
        start = detok.length
        tokens = completion.token_ids
        if tokens and not keep_stop and self._ends_on_stop_token(completion):
            tokens = tokens[:-1]
        for token in tokens:
            detok.append(token)
        if out.finished and completion.finish_reason != "error":
            detok.flush()
        completion.text = detok.slice(start, detok.length)

    def _ends_on_stop_token(self, completion: CompletionOutput) -> bool:
        if completion.finish_reason != "stop":
            return False
        last, reason = completion.token_ids[-1], completion.stop_reason
        if reason is None:  # an end of sequence (a stop string would have been searched in the engine)
            return last in self.eos_token_ids
        return isinstance(reason, int) and last == reason

    def _name(self, engine: int) -> str:
        return "the engine" if len(self.handles) == 1 else f"engine {engine}"

    # --------------------------------------------------------------------------- engine's side

    async def _read(self, engine: int, pull: Any) -> None:
        while True:
            raw = await pull.recv(copy=False)
            self._last_heard[engine] = time.monotonic()
            message = pickle.loads(raw.buffer)
            if message[0] == "step":
                _, packed, replies, fault = message
                for call_id, error, value in replies:
                    self._resolve(call_id, error, value)
                if packed:
                    self._dispatch(unpack_outputs(packed), time.monotonic())
                if fault is not None:
                    self._on_fault(*fault)
            elif message[0] == "dead":
                self._on_dead(message[1], engine)
            # a queued message is received without yielding: a backlog would starve the loop
            await asyncio.sleep(0)

    async def _watch(self, engine: int) -> None:
        """Notice an engine that died: its requests in flight fail at once instead of hanging."""
        handle = self.handles[engine]
        while handle.alive():
            await asyncio.sleep(0.2)
        # an attached handle's engine is process 0's child: its exit code is not this process's to read
        code = f" (code {handle.process.exitcode})" if handle.process is not None else ""
        self._on_dead(f"{self._name(engine)} process exited{code}", engine)

    def _on_dead(self, reason: str, engine: int = 0) -> None:
        """An engine is gone (it said why first, or its process exited): fail what it held. New
        requests are refused from then on, and /health turns 503."""
        if engine in self._gone:
            return
        self._gone.add(engine)
        if self.dead is None:
            self.dead = reason
        ids = [rid for rid, e in self._engine_of.items() if e == engine]
        logger.error("%s; failing %d requests in flight", reason, len(ids))
        error = EngineDeadError(reason)
        for future, on in self._calls.values():
            if not future.done() and on == engine:
                future.set_exception(error)
        self._fail(ids, error)

    def _fail(self, ids: list[str], exc: BaseException) -> None:
        """The groups of `ids` (a group of n > 1 holds several) get `exc`; the ids are forgotten."""
        for group in {id(g): g for rid in ids if (g := self._groups.get(rid)) is not None}.values():
            group.queue.put_nowait(exc)
        self._forget(ids)

    def _resolve(self, call_id: int, error: tuple[str, str, str | None] | None, value: Any) -> None:
        future, _ = self._calls.get(call_id, (None, 0))
        if future is None or future.done():  # the awaiting request was cancelled meanwhile
            return
        if error is None:
            future.set_result(value)
            return
        future.set_exception(reply_error(*error))

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            out.prompt_token_ids = self._prompts.get(out.request_id, out.prompt_token_ids)
            decoding = self._detokenizers.get(out.request_id)
            if decoding is not None:
                self._decode(out, *decoding)
            if self.metrics is not None:
                self.metrics.request_progress(out, now)
            group = self._groups.get(out.request_id)
            if group is None:
                continue
            group.queue.put_nowait(out)
            if out.finished:
                self._forget([out.request_id])

    def _on_fault(self, message: str, request_ids: list[str]) -> None:
        self.faults += 1
        self.fault = message
        logger.error("engine step failed (%s); %d requests aborted", message, len(request_ids))
        self._fail(request_ids, EngineFaultError("the engine failed while running this request"))


# Of the engines' stats, these are each engine's own estimates: averaged, not added up.
_AVERAGED = ("prefill_step_fixed_ms", "prefill_step_us_per_token")


def merge_stats(per_engine: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Data-parallel engines' stats as one engine's: counts and gauges added up (pages, slots and
    requests of all of them), estimates averaged; each engine's own under "engines"."""
    merged: dict[str, Any] = {}
    for stats in per_engine:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    for key in _AVERAGED:
        if key in merged:
            merged[key] /= len(per_engine)
    if "prefix_cache_hit_rate" in merged:  # of all the engines' lookups, not a sum of rates
        query = merged.get("prefix_cache_query_tokens", 0)
        merged["prefix_cache_hit_rate"] = merged.get("prefix_cache_hit_tokens", 0) / query if query else 0.0
    merged["engines"] = list(per_engine)
    return merged
