"""The step loop as a service: an Engine driven over pyzmq sockets, in its own process.

The HTTP process and the step loop then never share a GIL (vLLM V1's EngineCore and SGLang's
scheduler process do the same). Every loop applies all commands waiting, runs one step, and
sends that step's outputs together with the replies to the commands as one message. Messages
are pickled tuples:

  in:  ("add", call_id, [(request_id, prompt_token_ids, params), ...], arrived)   all or none;
                                         arrived: when the HTTP request came (time.monotonic)
       ("abort", [request_id, ...])                    the client no longer waits: no output
       ("abort_where", prefix | None)    end the live requests whose ids start with prefix (all:
                                         None) as "abort", each with its last output; and those
                                         added later that arrived before it
       ("call", call_id, name, args)     stats / model_info / compile_structured / flush_cache /
                                         set_weight_version / stage_weights (once the running
                                         requests finish; requests added meanwhile wait on until
                                         finish_weights) / finish_weights
       ("hello", pid)                    the HTTP process's pid, sent first: a process that is
                                         gone gets nothing more, and its requests are aborted
       ("stop",)
  out: ("ready", info) | ("failed", message)          once, at start-up
       ("step", outputs, replies, fault)              outputs: pack_outputs' tuples;
                                                      replies: [(call_id, error, value)]
       ("beat",)                                      while idle, so that a wedged loop shows
       ("dead", reason)                               last: the engine cannot go on (a lost
                                                      tensor-parallel rank); the process exits

Outputs leave without their prompt token ids (the client has them) to keep each step's message
small. `serve_engine` runs in the engine process; tests run `EngineCore` in a thread instead.

With several HTTP processes (`--api-server-count`) each has its own pair of sockets: the core
reads the commands of all, remembers which one added each request, and sends each its own
requests' outputs, replies and faults; beats and "dead" go to all, "ready" to the first.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from deltaserve.engine.errors import EngineDeadError, UpdateBusyError, error_reply
from deltaserve.engine.gc_heap import freeze_startup_heap
from deltaserve.engine.requests.outputs import pack_outputs, packed_head
from deltaserve.engine.requests.sampling_params import grammar_timeout_s
from deltaserve.engine.stats_log import StatsLog

logger = logging.getLogger("deltaserve.engine")

IDLE_POLL_MS = 100  # how long an idle loop waits for a command (and how often it sends a beat)
BEAT_S = 0.5  # the longest an idle loop stays silent
CLIENT_CHECK_S = 1.0  # how often the loop looks for HTTP processes that are gone
ABORT_MEMORY_S = 3600.0  # how long an abort_where still ends requests that arrived before it
_CALLS = (
    "stats",
    "model_info",
    "compile_structured",
    "flush_cache",
    "stage_weights",
    "finish_weights",
    "set_weight_version",
)
_OFF_LOOP = ("compile_structured",)  # slow calls that run beside the loop, not inside a step
OFF_LOOP_WORKERS = 4  # how many of them run at once
# calls for an idle engine: new requests wait for them (after stage_weights, until finish_weights)
_WHEN_IDLE = ("stage_weights",)


class DaemonWorkers:
    """Up to `count` daemon threads that run the calls submitted, in turn. A process that ends does
    not wait for them: a ThreadPoolExecutor's threads are joined at exit, so a grammar compiling
    for minutes held a stopped engine's process (and the server's SIGTERM its 30 s, then a kill)."""

    def __init__(self, count: int, name: str) -> None:
        self.count, self.name = count, name
        self._tasks: queue.SimpleQueue[tuple[Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the workers are shut down")
            self._tasks.put((fn, args))
            if len(self._threads) < self.count:
                thread = threading.Thread(
                    target=self._work, name=f"{self.name}_{len(self._threads)}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def shutdown(self) -> None:
        """Stop taking calls; those not yet started are dropped, those running end on their own."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._tasks.put(None)

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None and not self._closed:
            fn, args = task
            try:
                fn(*args)
            except Exception:  # the thread serves on
                logger.exception("an engine call beside the loop failed")


def pid_running(pid: int) -> bool:
    """A process that exists and has not exited (a zombie, not yet reaped by its parent, has)."""
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False
    try:  # no /proc: ask the kernel whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def engine_info(engine: Any) -> dict[str, Any]:
    """What the HTTP process needs to know of a started engine."""
    return {
        "model_info": dict(engine.model_info),
        "max_model_len": int(engine.max_model_len),
        "eos_token_ids": list(engine.eos_token_ids),
        "vocab_size": getattr(engine, "vocab_size", None),
        # the most requests it holds at once, running and waiting (None: no bound it can say)
        "max_requests": _max_requests(engine),
    }


def _max_requests(engine: Any) -> int | None:
    config = getattr(engine, "config", None)
    if config is None:
        return None
    return int(config.num_running + config.max_waiting_requests)


class EngineCore:
    """Owns one Engine and runs its loop until told to stop (or until its parent is gone)."""

    def __init__(
        self,
        engine: Any,
        in_addrs: str | list[str],
        out_addrs: str | list[str],
        parent_pid: int | None = None,
        stats_interval_s: float = 0.0,
    ) -> None:
        import zmq

        self.engine = engine
        if hasattr(engine, "emit_packed_outputs"):  # the steps' outputs come packed, as they are sent
            engine.emit_packed_outputs()
        # the periodic stats line (engine/stats_log.py); 0: none
        self._stats_log = StatsLog(self.stats, stats_interval_s) if stats_interval_s > 0 else None
        self._idle_s = 0.0  # seconds the loop waited for a command with no work to do
        in_addrs = [in_addrs] if isinstance(in_addrs, str) else in_addrs
        out_addrs = [out_addrs] if isinstance(out_addrs, str) else out_addrs
        assert len(in_addrs) == len(out_addrs)
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._ins: list[Any] = []
        self._outs: list[Any] = []
        for in_addr, out_addr in zip(in_addrs, out_addrs):
            pull = self._ctx.socket(zmq.PULL)
            pull.connect(in_addr)
            self._poller.register(pull, zmq.POLLIN)
            push = self._ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 1000)
            push.setsockopt(zmq.SNDTIMEO, 1000)  # a send that waits this long checks the parent
            push.connect(out_addr)
            self._ins.append(pull)
            self._outs.append(push)
        self._parent_pid = parent_pid
        self._live: set[str] = set()  # ids added and not yet finished or aborted
        self._owner: dict[str, int] = {}  # live id -> the HTTP process (socket pair) that added it
        self._replies: list[list[tuple[int, tuple[str, str, str | None] | None, Any]]] = [
            [] for _ in self._outs
        ]
        self._done_off_loop: queue.SimpleQueue[tuple[int, int, tuple[str, str, str | None] | None, Any]] = (
            queue.SimpleQueue()
        )
        self._off_loop_pending = 0
        self._when_idle: list[tuple[int, int, str, tuple[Any, ...]]] = []  # (client, call_id, name, args)
        self._held: list[tuple[int, tuple[Any, ...]]] = []  # "add" commands that wait for them
        self._abort_when_added: set[str] = set()  # held requests an abort_where named: ended once added
        self._aborted_at: dict[str | None, float] = {}  # abort_where's prefix -> when it came (monotonic)
        self._staged = False  # weights staged (stage_weights), not yet served or dropped
        # several: a grammar that takes minutes (a choice of thousands of strings) holds up its own
        # request, not every other request's grammar behind it
        self._worker = DaemonWorkers(OFF_LOOP_WORKERS, "deltaserve-engine-calls")
        self._flush = False  # aborts' last outputs wait for a step, which an idle engine must still run
        self._last_sent = time.monotonic()
        self._client_pids: dict[int, int] = {}  # HTTP process (socket pair) -> its pid ("hello")
        self._lost: set[int] = set()  # HTTP processes that are gone: nothing more is sent to them
        self._clients_checked = time.monotonic()

    def send(self, message: tuple[Any, ...], client: int | None = 0) -> None:
        """To one HTTP process's socket; `client=None`: to all."""
        import zmq

        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for index in range(len(self._outs)) if client is None else [client]:
            while index not in self._lost:
                try:
                    self._outs[index].send(data, copy=False)
                    break
                except zmq.Again:  # nobody reads: fine while the server lives, the end when it is gone
                    self._check_parent()
                    self._check_clients(now=True)
        self._last_sent = time.monotonic()

    def _check_clients(self, now: bool = False) -> None:
        """Abort the requests of HTTP processes that are gone (killed, crashed), once a second or
        `now`: their clients wait no more, and their sockets would block every send."""
        if not now and time.monotonic() - self._clients_checked < CLIENT_CHECK_S:
            return
        self._clients_checked = time.monotonic()
        for client, pid in self._client_pids.items():
            if client not in self._lost and not pid_running(pid):
                self._lose_client(client, pid)

    def _lose_client(self, client: int, pid: int) -> None:
        mine = [rid for rid, owner in self._owner.items() if owner == client]
        logger.warning("HTTP process %d is gone: aborting its %d requests", pid, len(mine))
        self._lost.add(client)
        for request_id in mine:  # their last outputs go nowhere (the routing skips a lost owner)
            self.engine.abort_request(request_id)
        self._flush = bool(mine)
        self._replies[client] = []
        self._held = [(c, command) for c, command in self._held if c != client]
        self._when_idle = [call for call in self._when_idle if call[0] != client]

    def _check_parent(self) -> None:
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            raise SystemExit("the server process is gone")

    def run(self) -> None:
        try:
            while self._apply_commands():
                reason = getattr(self.engine, "dead_reason", None)
                if reason is not None:
                    raise EngineDeadError(reason)
                if self._when_idle and not self.engine.has_unfinished_requests():
                    self._run_when_idle()
                self._step()
                self._heartbeat()
                if self._stats_log is not None:
                    self._stats_log.tick()
        except EngineDeadError as exc:
            logger.error("the engine is dead: %s", exc)
            self.send(("dead", str(exc)), client=None)
            raise
        finally:
            self._abort_all()
            self._worker.shutdown()
            for pull in self._ins:
                pull.close(linger=0)
            for push in self._outs:
                push.close()
            self._ctx.term()

    def _apply_commands(self) -> bool:
        """Apply every command waiting (waiting a little when there is nothing to do); False on stop."""
        import zmq

        self._check_clients()
        busy = self.engine.has_unfinished_requests()
        if busy:
            ready = self._poller.poll(0)
        else:  # the wait for work is the loop's idle time
            start = time.perf_counter()
            ready = self._poller.poll(1 if self._off_loop_pending else IDLE_POLL_MS)
            self._idle_s += time.perf_counter() - start
        if not ready:
            if busy:  # a killed server's outputs queue unread for many steps before a send blocks
                self._check_parent()
            else:
                self._idle_tick()
            return True
        for client, pull in enumerate(self._ins):
            while True:
                try:
                    raw = pull.recv(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if not self._apply(pickle.loads(raw.buffer), client):
                    return False
        return True

    def _apply(self, command: tuple[Any, ...], client: int = 0) -> bool:
        kind = command[0]
        if kind == "stop":
            return False
        if kind == "hello":
            self._client_pids[client] = command[1]
            return True
        if kind == "add" and (self._when_idle or self._staged):
            self._held.append((client, command))
        elif kind == "abort":
            self._drop_held(set(command[1]))
            for request_id in command[1]:
                if request_id in self._live:
                    self._live.discard(request_id)
                    self._owner.pop(request_id, None)
                    self.engine.abort_request(request_id)
        elif kind == "abort_where":
            prefix, now = command[1], time.monotonic()
            self._aborted_at = {p: at for p, at in self._aborted_at.items() if now - at < ABORT_MEMORY_S}
            self._aborted_at[prefix] = now
            for request_id in [r for r in self._live if prefix is None or r.startswith(prefix)]:
                self.engine.abort_request(request_id)  # its owner keeps it until that output goes
            # held ones (a weight update is under way) end as "abort" too, once added: their owners
            # wait for an output
            self._abort_when_added.update(
                r[0] for _, held in self._held for r in held[2] if prefix is None or r[0].startswith(prefix)
            )
            self._flush = True
        elif kind == "add":
            call_id, requests = command[1], command[2]
            reply = self._add(requests, client)
            self._replies[client].append((call_id, *reply))
            arrived = command[3] if len(command) > 3 else None
            if reply[0] is None and arrived is not None:
                self._abort_named_since(requests, arrived)
        elif kind == "call":
            _, call_id, name, args = command
            if name not in _CALLS:
                self._replies[client].append((call_id, ("internal", f"unknown call {name!r}", None), None))
            elif name == "stage_weights" and (self._staged or any(w[2] == name for w in self._when_idle)):
                busy = UpdateBusyError("another weight update is under way: send one at a time")
                self._replies[client].append((call_id, error_reply(busy), None))
            elif name in _WHEN_IDLE:
                self._when_idle.append((client, call_id, name, args))
            elif name == "finish_weights":  # the staged weights served or dropped: the held go on
                self._replies[client].append((call_id, *self._call(name, args)))
                self._staged = False
                self._release_held()
            elif name in _OFF_LOOP:
                self._off_loop_pending += 1
                self._worker.submit(self._call_off_loop, client, call_id, name, args, time.monotonic())
            else:
                self._replies[client].append((call_id, *self._call(name, args)))
        return True

    def _add(
        self, requests: list[tuple[Any, ...]], client: int = 0
    ) -> tuple[tuple[str, str, str | None] | None, None]:
        added: list[str] = []
        try:
            for request_id, token_ids, params, *images in requests:  # images: a fourth field, when any
                self.engine.add_request(request_id, token_ids, params, *images)
                added.append(request_id)
        except Exception as exc:
            for request_id in added:
                self.engine.abort_request(request_id)
            return error_reply(exc), None
        self._live.update(added)
        self._owner.update((request_id, client) for request_id in added)
        return None, None

    def _run_when_idle(self) -> None:
        """The calls that waited for the running requests to finish, then the requests held meanwhile."""
        for client, call_id, name, args in self._when_idle:
            self._replies[client].append((call_id, *self._call(name, args)))
            self._staged |= name == "stage_weights"
        self._when_idle = []
        if not self._staged:  # staged weights: requests wait on for finish_weights
            self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for client, command in held:
            self._apply(command, client)
        for request_id in self._abort_when_added & self._live:
            self.engine.abort_request(request_id)
            self._flush = True
        self._abort_when_added.clear()

    def _drop_held(self, request_ids: set[str]) -> None:
        """Aborts of requests still held: they are never added."""
        for i, (client, held) in enumerate(self._held):
            kept = [r for r in held[2] if r[0] not in request_ids]
            self._held[i] = (client, (*held[:2], kept, *held[3:]))

    def _abort_named_since(self, requests: list[tuple[Any, ...]], arrived: float) -> None:
        """Requests just added that an abort_where named after their HTTP request arrived (while an
        HTTP process prepared them: tokenizing, compiling a grammar, a warm-up prefill): they end
        as "abort", as they would have had they been running, whichever process the abort came to."""
        named = [(p, at) for p, at in self._aborted_at.items() if at >= arrived]
        for request_id, *_ in requests if named else []:
            if any(p is None or request_id.startswith(p) for p, _ in named):
                self.engine.abort_request(request_id)
                self._flush = True

    def model_info(self) -> dict[str, Any]:
        """What the engine says of its model now (the checkpoint's path changes with an update)."""
        return dict(getattr(self.engine, "model_info", {}))

    def stats(self) -> dict[str, Any]:
        """The engine's stats, and the loop's idle time beside its step time; requests a weight
        update holds count as waiting (they are not in the engine's queue yet)."""
        stats = {**self.engine.stats(), "idle_seconds_total": self._idle_s}
        held = self._num_held()
        if held:
            stats["waiting"] = stats.get("waiting", 0) + held
        return stats

    def _num_held(self) -> int:
        """Requests held for a weight update, less those an abort_where already ended."""
        return sum(1 for _, held in self._held for r in held[2] if r[0] not in self._abort_when_added)

    def _call(self, name: str, args: tuple[Any, ...]) -> tuple[tuple[str, str, str | None] | None, Any]:
        # stats and model_info are the core's own; the other calls are the engine's
        own = {"stats": self.stats, "model_info": self.model_info}
        fn = own.get(name) or getattr(self.engine, name, None)
        if fn is None:  # a stand-in engine without it: nothing to do
            return None, None
        try:
            return None, fn(*args)
        except Exception as exc:
            reply = error_reply(exc)
            if reply[0] == "internal":  # not the caller's mistake: its traceback is ours to see
                logger.exception("engine call %s failed", name)
            return reply, None

    def _call_off_loop(
        self, client: int, call_id: int, name: str, args: tuple[Any, ...], queued: float
    ) -> None:
        timeout = grammar_timeout_s()
        if time.monotonic() - queued > timeout:  # its caller gave up: no worker is spent on it
            late = ValueError(f"structured outputs: the grammar waited over {timeout:g} s to compile")
            self._done_off_loop.put((client, call_id, error_reply(late), None))
            return
        error, value = self._call(name, args)
        if isinstance(value, Future):  # the same work under way for another call: answered with it,
            # without holding this worker meanwhile (callers retrying a slow grammar held them all)
            def answer(done: Future[Any]) -> None:
                exc = done.exception()
                self._done_off_loop.put((client, call_id, None if exc is None else error_reply(exc), None))

            value.add_done_callback(answer)
            return
        self._done_off_loop.put((client, call_id, error, value))

    def _step(self) -> None:
        while not self._done_off_loop.empty():
            client, call_id, error, value = self._done_off_loop.get()
            self._replies[client].append((call_id, error, value))
            self._off_loop_pending -= 1
        outputs: list[Any] = []
        fault: tuple[str, list[str]] | None = None
        fault_owners: dict[str, int] = {}
        if self.engine.has_unfinished_requests() or self._flush:
            self._flush = False
            try:
                outputs = self.engine.step()
            except EngineDeadError:
                raise
            except Exception as exc:  # a step that fails leaves no request's state to trust
                logger.exception("engine step failed; aborting the requests in flight")
                fault = (f"{type(exc).__name__}: {exc}", sorted(self._live))
                fault_owners = dict(self._owner)
                self._abort_all()
        routed: list[list[Any]] = [[] for _ in self._outs]
        for out in outputs:
            if not isinstance(out, tuple):  # an engine that does not pack (stand-ins in tests, benches)
                out.prompt_token_ids = []
                out = pack_outputs([out])[0]
            request_id, finished = packed_head(out)
            owner = self._owner.get(request_id, 0)
            if owner not in self._lost:
                routed[owner].append(out)
            if finished:
                self._live.discard(request_id)
                self._owner.pop(request_id, None)
        for client, (mine, replies) in enumerate(zip(routed, self._replies)):
            if client in self._lost:
                continue
            own_fault = None
            if fault is not None:
                own_fault = (fault[0], [rid for rid in fault[1] if fault_owners.get(rid, 0) == client])
            if mine or replies or own_fault is not None:
                self._replies[client] = []
                self.send(("step", mine, replies, own_fault), client)

    def _heartbeat(self) -> None:
        """An idle tensor-parallel engine's heartbeat to its ranks (once a second; steps are one):
        a rank that is gone ends the loop as a failed step does."""
        beat = getattr(self.engine, "heartbeat", None)
        if beat is not None and not self.engine.has_unfinished_requests():
            beat()

    def _idle_tick(self) -> None:
        if time.monotonic() - self._last_sent >= BEAT_S:
            self.send(("beat",), client=None)
        self._check_parent()

    def _abort_all(self) -> None:
        for request_id in list(self._live):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        self._live.clear()
        self._owner.clear()
        if getattr(self.engine, "dead_reason", None) is not None:
            return
        if self.engine.has_unfinished_requests():  # anything the engine still holds: drop its outputs
            try:
                self.engine.step()
            except Exception:
                logger.exception("clean-up step failed")


def serve_engine(
    config: Any,
    in_addrs: str | list[str],
    out_addrs: str | list[str],
    parent_pid: int,
    log_level: str,
    stats_interval_s: float = 0.0,
) -> None:
    """The engine process: load the engine, say ready (or why not) to the first HTTP process, and
    run the loop for all of them (with a stats line every `stats_interval_s` while it works; 0: none)."""
    import zmq

    # whose line it is, with data-parallel replicas
    where = f"[dp{config.data_parallel_rank}]" if config.data_parallel_size > 1 else ""
    logging.basicConfig(
        level=log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s"
    )
    # Ctrl-C, and a SIGTERM sent to the whole process group (systemd, `timeout`, `kill -- -PGID`),
    # reach this process too: the server drains first, then stops it; it also ends when the server
    # goes. The tensor-parallel ranks it starts inherit the ignored SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        from deltaserve.engine.engine import Engine

        # a lost tensor-parallel rank: the loop ends on its own unless a collective holds it
        engine = Engine(config, on_worker_lost=lambda why: _exit_unless_gone(why, 5.0))
    except Exception as exc:
        logger.debug("engine start-up failed", exc_info=True)
        ctx = zmq.Context()
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 5000)
        out.connect(out_addrs if isinstance(out_addrs, str) else out_addrs[0])
        out.send(pickle.dumps(("failed", f"{type(exc).__name__}: {exc}")))
        out.close()
        ctx.term()
        raise SystemExit(1) from None
    http = 1 if isinstance(in_addrs, str) else len(in_addrs)
    _leave_cores_for_http(str(engine.device), http, config.data_parallel_size)
    core = EngineCore(engine, in_addrs, out_addrs, parent_pid, stats_interval_s)
    freeze_startup_heap("engine process")
    if engine.tokenizer is not None:
        import importlib.util

        if importlib.util.find_spec("xgrammar") is not None:
            # JSON output's vocabulary tables, built beside start-up rather than at the first request
            threading.Thread(target=engine.prepare_grammars, name="deltaserve-grammars", daemon=True).start()
    core.send(("ready", engine_info(engine)))
    try:
        core.run()
    except EngineDeadError as exc:
        # leaving the process group waits for a rank that is hung rather than gone (a heartbeat
        # it never took): the server has heard that the engine is dead, so do not wait long
        _exit_unless_gone(str(exc), 10.0)
        raise
    finally:
        engine.shutdown()


def _exit_unless_gone(why: str, after_s: float) -> None:
    def run() -> None:
        time.sleep(after_s)
        logger.error("%s; the engine loop did not stop, exiting", why)
        os._exit(1)

    threading.Thread(target=run, name="deltaserve-exit", daemon=True).start()


def _leave_cores_for_http(device: str, processes: int, replicas: int = 1) -> None:
    # On CPU, torch's intra-op threads busy-wait on every core; the HTTP processes (tokenizing,
    # streaming) then fight them and all slow down severalfold. A core for each is cheaper, and
    # data-parallel replicas share what is left.
    import torch

    cores = os.cpu_count() or 1
    if device.startswith("cpu") and cores > 1 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (cores - processes) // replicas)))
