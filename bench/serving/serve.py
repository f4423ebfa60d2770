"""Load generator for any OpenAI-compatible server, in the manner of `vllm bench serve`.

Each request is a random prompt of `--input-len` token ids (uniform in [--vocab-low,
--vocab-high), away from special tokens) sent to /v1/completions as a token list with
`max_tokens = --output-len`, `ignore_eos` and temperature 0, so every request does the same
work. The benchmark does not start the server; point it at one with --base-url.

    # closed loop: C clients, each sending its next request when the last one finishes
    python -m bench.serving.serve --base-url http://127.0.0.1:8000 --concurrency 1,16,64,256 \
        --input-len 1024 --output-len 256 --output-json serve.json
    # open loop: Poisson arrivals at 10 req/s, at most 64 in flight, /health probed meanwhile
    python -m bench.serving.serve --request-rate 10 --num-prompts 500 --max-concurrency 64 --health-probe
    # the same prompts through deltaserve.LLM in-process afterwards (server/offline ratio per level)
    python -m bench.serving.serve --concurrency 1,64 --offline-model configs/qwen3.5-9b \
        --offline-args '{"load_format": "dummy", "max_running_requests": 64}'
    # offline alone (no server)
    python -m bench.serving.serve --offline-only --offline-model configs/qwen3.5-9b --concurrency 1,64 \
        --offline-args '{"load_format": "dummy"}'

Streamed runs (the default; --no-stream for whole responses) time the first chunk that
carries a choice (TTFT) and the gaps between such chunks (ITL); output tokens come from the
final `usage` chunk (`stream_options.include_usage`), else `max_tokens`. TPOT is
(E2E - TTFT) / (output tokens - 1) per request. A concurrency level runs --num-prompts
requests (default 2*C), a rate run --num-prompts (default 100). Each run draws its own
prompts (seeded by --seed and the run), so one run's prompts are not in the prefix cache
for the next.

Offline method: one `LLM` is built (weights loaded once) with max_running_requests = the
largest level unless --offline-args gives one. For each level, `llm.engine` is driven
directly, after the same --warmup requests as the server gets (all at once): min(C,
max_running_requests) requests are added, the engine steps, and each
finished request is replaced by the next one, so at most C run at once as with C HTTP
clients. Output tok/s is output tokens over the wall time from the first add to the last
finish; its TTFT is each request's arrival to first token on the engine's clock, as the server's
histogram keeps it. A rate run is compared as a closed loop at min(N, --max-concurrency). Mirror the
server's flags in --offline-args (max_running_requests, max_model_len, ...) for a fair ratio.

Where the server publishes vLLM's latency histograms in /metrics (deltaserve and vLLM do), each
run also reports the mean TTFT and E2E as the server timed them, from the histograms' sums and
counts before and after the run: the gap to the client's means is time outside the engine (HTTP,
the network, this client).

One Python client process streams only so many chunks a second: each run reports the busiest
client process's CPU share, and --client-processes N splits the clients (or the arrivals) over N
processes that start together. Each process opens its connections (one per client, a GET /health
each) before the clock starts, as clients that have been running hold them.

Against deltaserve, each run also reports where the engine loop's time went over it (its /metrics
counters, read just before the load starts and as it ends): in steps, waiting for the GPU among
them, and idle. Its HTTP processes share their metrics once a second, so each run waits a second
before each of its latency scrapes.

--health-probe GETs /health every 100 ms from a process of its own while a run's load is on and
reports its latency (the server's, not that of this client's busy event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import random
import shlex
import ssl
import sys
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from queue import Empty
from typing import Any

import httpx

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds; streamed requests only
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)


@dataclass
class Run:
    """One load level: a closed loop of `concurrency` clients, or Poisson arrivals at `rate`."""

    label: str
    prompts: list[list[int]]
    concurrency: int | None = None
    rate: float | None = None
    max_concurrency: int | None = None

    @property
    def offline_concurrency(self) -> int:
        return self.concurrency or min(len(self.prompts), self.max_concurrency or len(self.prompts))


def make_prompts(n: int, input_len: int, low: int, high: int, seed: str) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats_ms(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    out = {"mean": 1e3 * sum(values) / len(values)}
    out.update({f"p{q}": 1e3 * percentile(values, q) for q in PERCENTILES})
    return out


# ------------------------------------------------------------------------------------------ HTTP


class Target:
    """Where and what to send: the completions URL and the request body's fixed fields."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        self.url = f"{args.base_url}/v1/completions"
        self.model, self.output_len, self.stream = model, args.output_len, args.stream
        self.headers = {} if args.keepalive else {"Connection": "close"}

    def body(self, prompt: list[int]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": self.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "stream": self.stream,
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


class Connections:
    """A connection per request in flight, each reused by the next request (LIFO), as C clients of
    their own would: one httpx pool shared by all scans every connection it holds on each request
    and response, which at high concurrency makes this client, not the server, the bottleneck."""

    def __init__(self, keepalive: bool, timeout: float) -> None:
        self.limits = httpx.Limits(max_connections=1, max_keepalive_connections=1 if keepalive else 0)
        self.timeout = httpx.Timeout(timeout)
        self.ssl = ssl.create_default_context()  # built once, not by every client (the costly part)
        self.idle: list[httpx.AsyncClient] = []
        self.opened: list[httpx.AsyncClient] = []

    @contextlib.asynccontextmanager
    async def client(self) -> AsyncIterator[httpx.AsyncClient]:
        client = self.idle.pop() if self.idle else self._new()
        try:
            yield client
        finally:
            self.idle.append(client)

    def _new(self) -> httpx.AsyncClient:
        client = httpx.AsyncClient(limits=self.limits, timeout=self.timeout, verify=self.ssl)
        self.opened.append(client)
        return client

    async def open(self, n: int, base_url: str) -> None:
        """`n` connections made before the run's clock starts, each by a GET /health, as clients
        that have been running hold them: otherwise a fresh client process's first requests time
        its own lazy imports and handshakes, not the server."""
        clients = [self._new() for _ in range(n)]

        async def touch(client: httpx.AsyncClient) -> None:
            with contextlib.suppress(httpx.HTTPError):  # a server down fails the run's requests
                await client.get(f"{base_url}/health")

        await asyncio.gather(*(touch(c) for c in clients))
        self.idle.extend(clients)

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.opened))


def _body_error(body: bytes) -> str:
    """An error response's message, else its first bytes."""
    try:
        message = _error_of(json.loads(body))
    except (ValueError, AttributeError):  # not JSON, or JSON that is not an object
        message = None
    return message or body.decode(errors="replace")[:300]


def _error_of(payload: dict[str, Any]) -> str | None:
    err = payload.get("error")
    if err is None and payload.get("object") != "error":
        return None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err or payload.get("message") or payload)


async def send(conns: Connections, target: Target, prompt: list[int]) -> RequestResult:
    res = RequestResult(prompt_tokens=len(prompt), output_tokens=target.output_len)
    body = target.body(prompt)
    start = time.perf_counter()
    try:
        async with (
            conns.client() as client,
            client.stream("POST", target.url, json=body, headers=target.headers) as resp,
        ):
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {_body_error(await resp.aread())}"
                return res
            if target.stream:
                await _read_stream(resp, res, start)
            else:
                _read_whole(json.loads(await resp.aread()), res)
    except Exception as exc:  # every failure is reported with the run, not raised
        res.error = f"{type(exc).__name__}: {exc}"[:300]
        return res
    res.e2e = time.perf_counter() - start
    res.ok = not res.error
    return res


async def _read_stream(resp: httpx.Response, res: RequestResult, start: float) -> None:
    last = start
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":  # read on to the body's end, or the connection is not reused
            continue
        now = time.perf_counter()
        payload = json.loads(data)
        error = _error_of(payload)
        if error is not None:
            res.error = error
            return
        if payload.get("choices"):
            if res.ttft is None:
                res.ttft = now - start
            else:
                res.itl.append(now - last)
            last = now
        if payload.get("usage"):
            _take_usage(payload["usage"], res)
    if res.ttft is None:
        res.error = "the stream ended without a choice"


def _read_whole(payload: dict[str, Any], res: RequestResult) -> None:
    error = _error_of(payload)
    if error is not None:
        res.error = error
    elif not payload.get("choices"):
        res.error = "the response has no choices"
    elif payload.get("usage"):
        _take_usage(payload["usage"], res)


def _take_usage(usage: dict[str, Any], res: RequestResult) -> None:
    res.output_tokens = int(usage.get("completion_tokens") or res.output_tokens)
    res.prompt_tokens = int(usage.get("prompt_tokens") or res.prompt_tokens)


async def closed_loop(conns: Connections, target: Target, run: Run) -> list[RequestResult]:
    assert run.concurrency is not None
    results: list[RequestResult | None] = [None] * len(run.prompts)
    queue = deque(range(len(run.prompts)))

    async def worker() -> None:
        while queue:
            i = queue.popleft()
            results[i] = await send(conns, target, run.prompts[i])

    await asyncio.gather(*(worker() for _ in range(min(run.concurrency, len(run.prompts)))))
    return [r for r in results if r is not None]


async def poisson(conns: Connections, target: Target, run: Run, seed: int) -> list[RequestResult]:
    assert run.rate is not None
    rng = random.Random(seed)
    gate = asyncio.Semaphore(run.max_concurrency) if run.max_concurrency else None

    async def one(prompt: list[int]) -> RequestResult:
        if gate is None:
            return await send(conns, target, prompt)
        async with gate:  # timed from when it is sent, as vLLM's bench does
            return await send(conns, target, prompt)

    tasks = []
    for prompt in run.prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if run.rate != float("inf"):
            await asyncio.sleep(rng.expovariate(run.rate))
    return list(await asyncio.gather(*tasks))


def _probe_health(base_url: str, stop: Any, ready: Any, results: Any) -> None:
    """GET /health every 100 ms until `stop` is set; runs in a process of its own, so that the
    latency it sees is the server's and not this client's busy event loop."""
    latencies: list[float] = []
    bad: Counter[str] = Counter()
    with httpx.Client(timeout=30.0) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                resp = client.get(f"{base_url}/health")
                if resp.status_code != 200:
                    bad[f"HTTP {resp.status_code}"] += 1
            except Exception as exc:  # a probe that fails is counted, the load goes on
                bad[type(exc).__name__] += 1
            dt = time.perf_counter() - t
            latencies.append(dt)
            ready.set()
            stop.wait(max(0.0, 0.1 - dt))
    results.put(
        {
            "probes": len(latencies),
            "latency_ms": stats_ms(latencies),
            "non_200": sum(bad.values()),
            "non_200_reasons": dict(bad),
        }
    )


class HealthProbe:
    """`_probe_health` in a child process for the length of one run."""

    def __init__(self, base_url: str) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.stop, ready, self.results = ctx.Event(), ctx.Event(), ctx.Queue()
        self.process = ctx.Process(
            target=_probe_health, args=(base_url, self.stop, ready, self.results), daemon=True
        )
        self.process.start()
        ready.wait(60)  # the load starts once the probe is probing

    def finish(self) -> dict[str, Any]:
        self.stop.set()
        out: dict[str, Any] = self.results.get(timeout=60)
        self.process.join(10)
        return out


# the server's own latency histograms in its Prometheus /metrics (vLLM's names, which deltaserve keeps)
SERVER_LATENCIES = {"ttft": "vllm:time_to_first_token_seconds", "e2e": "vllm:e2e_request_latency_seconds"}


async def server_latency_totals(base_url: str) -> dict[str, float]:
    """`{"ttft_sum": s, "ttft_count": n, ...}` from the server's /metrics; empty where it has none."""
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            resp = await client.get(f"{base_url}/metrics")
    except httpx.HTTPError:
        return {}
    totals: dict[str, float] = {}
    if resp.status_code != 200:
        return totals
    for line in resp.text.splitlines():
        for key, name in SERVER_LATENCIES.items():
            for part in ("sum", "count"):
                if line.startswith(f"{name}_{part}"):
                    totals[f"{key}_{part}"] = totals.get(f"{key}_{part}", 0.0) + float(line.rsplit(" ", 1)[1])
        for key in ENGINE_LOOP:
            if line.startswith(f"deltaserve_engine_{key}_seconds_total"):
                totals[f"loop_{key}"] = float(line.rsplit(" ", 1)[1])
        if line.startswith("deltaserve_dp_engine_step_seconds_total"):  # one line per data-parallel engine
            totals["engines"] = totals.get("engines", 0.0) + 1
    return totals


# deltaserve's engine loop: seconds in steps, of those waiting for the GPU, and idle (/metrics)
ENGINE_LOOP = ("step", "gpu_wait", "idle")


def engine_loop_shares(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Each part of the engine loop's time between two scrapes, as a share of the `wall` time
    between them (the mean over data-parallel engines, whose seconds /metrics adds up)."""
    engines = after.get("engines", 1.0)
    return {
        key: (after[f"loop_{key}"] - before[f"loop_{key}"]) / wall / engines
        for key in ENGINE_LOOP
        if f"loop_{key}" in after and f"loop_{key}" in before
    }


def server_means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean TTFT and E2E of the requests between two scrapes, as the server timed them."""
    out = {}
    for key in SERVER_LATENCIES:
        count = after.get(f"{key}_count", 0.0) - before.get(f"{key}_count", 0.0)
        if count > 0:
            out[key] = 1e3 * (after[f"{key}_sum"] - before.get(f"{key}_sum", 0.0)) / count
    return out


@dataclass
class Driven:
    results: list[RequestResult]
    start: float  # time.monotonic() when the load began, after the connections were made
    cpu_s: float  # this process's CPU seconds from then


async def drive(
    args: argparse.Namespace,
    target: Target,
    run: Run,
    seed: int,
    ready: Callable[[], Awaitable[object]] | None = None,
) -> Driven:
    """The run's load from this process: its connections made, `ready` waited for (the other
    client processes), then its closed loop or its Poisson arrivals."""
    conns = Connections(args.keepalive, args.timeout)
    try:
        await conns.open(
            min(run.concurrency or run.max_concurrency or 1, len(run.prompts)) or 1, args.base_url
        )
        if ready is not None:
            await ready()
        start, cpu = time.monotonic(), time.process_time()
        if run.concurrency is not None:
            results = await closed_loop(conns, target, run)
        else:
            results = await poisson(conns, target, run, seed)
        return Driven(results, start, time.process_time() - cpu)
    finally:
        await conns.aclose()


def split_run(run: Run, workers: int) -> list[Run]:
    """The run as one part per client process: closed-loop clients and prompts dealt out round
    the processes; Poisson arrivals at rate / parts each (together a Poisson process at the whole
    rate), the in-flight cap dealt out as the clients are."""
    cap = run.concurrency or run.max_concurrency
    n = max(1, min(workers, len(run.prompts), cap or workers))

    def share(total: int | None, i: int) -> int | None:
        return None if total is None else total // n + (i < total % n)

    return [
        Run(
            run.label,
            run.prompts[i::n],
            concurrency=share(run.concurrency, i),
            rate=None if run.rate is None else run.rate / n,
            max_concurrency=share(run.max_concurrency, i),
        )
        for i in range(n)
    ]


def _client_process(
    args: argparse.Namespace, model: str, part: Run, seed: int, barrier: Any, results: Any
) -> None:
    """One client process's part of a run; hands back (start, end, CPU seconds, results as dicts)
    on the monotonic clock, which all processes share."""

    async def released() -> None:  # every part starts together, once each has its connections
        barrier.wait()

    done = asyncio.run(drive(args, Target(args, model), part, seed, ready=released))
    end = time.monotonic()
    results.put((done.start, end, done.cpu_s, [asdict(r) for r in done.results]))


async def run_in_processes(
    args: argparse.Namespace, model: str, run: Run, ready: Callable[[], Awaitable[object]]
) -> tuple[list[RequestResult], float, list[float]]:
    """The run from `--client-processes` processes, started by this one once they all have their
    connections and `ready` has run: (results, wall time from the first start to the last end,
    each process's CPU seconds)."""
    import multiprocessing

    parts = split_run(run, args.client_processes)
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(len(parts) + 1), ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_process, args=(args, model, part, args.seed + i, barrier, queue), daemon=True
        )
        for i, part in enumerate(parts)
    ]
    for proc in procs:
        proc.start()

    def check() -> None:  # a process that failed says so on stderr, and the run stops here
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise SystemExit(f"a client process failed (exit code {failed[0]})")

    while barrier.n_waiting < len(parts):
        check()
        await asyncio.sleep(0.01)
    await ready()
    barrier.wait()  # the last party: releases them all

    def collect() -> list[Any]:
        got = []
        while len(got) < len(procs):
            try:
                got.append(queue.get(timeout=1.0))
            except Empty:
                check()
        return got

    got = await asyncio.get_running_loop().run_in_executor(None, collect)
    for proc in procs:
        proc.join(30)
    results = [RequestResult(**r) for *_, part in got for r in part]
    return results, max(g[1] for g in got) - min(g[0] for g in got), [g[2] for g in got]


# deltaserve's HTTP processes share their metrics once a second: a scrape this long after the
# last request counts it wherever it was served
METRICS_SETTLE_S = 1.1


async def run_http(args: argparse.Namespace, target: Target, run: Run) -> dict[str, Any]:
    probe = HealthProbe(args.base_url) if args.health_probe else None
    scrape: dict[str, Any] = {}

    async def ready() -> None:  # the server's counters just before the load, not the clients' start-up
        await asyncio.sleep(METRICS_SETTLE_S)
        # the clock starts before the scrape: the counters' interval then lies inside the wall time
        scrape["at"] = time.perf_counter()
        scrape["before"] = await server_latency_totals(args.base_url)

    if args.client_processes > 1:
        results, duration, cpu = await run_in_processes(args, target.model, run, ready)
    else:
        done = await drive(args, target, run, args.seed, ready=ready)
        results, duration, cpu = done.results, time.monotonic() - done.start, [done.cpu_s]
    ended, wall = await server_latency_totals(args.base_url), time.perf_counter() - scrape["at"]
    health = probe.finish() if probe is not None else None
    out = summarize(run, results, duration, args.save_detailed)
    # the busiest client process's CPU share: near 1, the load generator may bound the figures
    out["client_processes"], out["client_cpu_share"] = len(cpu), max(cpu) / duration
    if health is not None:
        out["health"] = health
    # beside the client's figures: a gap between the two is time outside the engine
    await asyncio.sleep(METRICS_SETTLE_S)
    out["server_mean_ms"] = server_means_ms(scrape["before"], await server_latency_totals(args.base_url))
    out["engine_loop"] = engine_loop_shares(scrape["before"], ended, wall)
    return out


def summarize(run: Run, results: list[RequestResult], duration: float, detailed: bool) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    errors = Counter(r.error for r in results if not r.ok)
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tpots = [
        (r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.ttft is not None and r.output_tokens > 1
    ]
    out: dict[str, Any] = {
        "label": run.label,
        "concurrency": run.concurrency,
        "request_rate": run.rate,
        "max_concurrency": run.max_concurrency,
        "num_prompts": len(run.prompts),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": [{"error": e, "count": n} for e, n in errors.most_common(10)],
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_tok_s": out_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration,
        "ttft_ms": stats_ms(ttfts),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([g for r in done for g in r.itl]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
    }
    if detailed:
        out["requests"] = [asdict(r) for r in results]
    return out


async def served_model(base_url: str) -> str:
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            resp = await client.get(f"{base_url}/v1/models")
            resp.raise_for_status()
            return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, LookupError) as exc:
        raise SystemExit(
            f"no model from {base_url}/v1/models ({type(exc).__name__}: {exc}): pass --model"
        ) from None


async def run_all_http(args: argparse.Namespace, runs: list[Run]) -> tuple[str, list[dict[str, Any]]]:
    model = args.model or await served_model(args.base_url)
    target = Target(args, model)
    if args.warmup:  # first-request costs (compilation, allocator) stay out of the first run
        warm = make_prompts(args.warmup, args.input_len, args.vocab_low, args.vocab_high, f"{args.seed}-warm")
        conns = Connections(args.keepalive, args.timeout)
        try:
            for res in await asyncio.gather(*(send(conns, target, p) for p in warm)):
                if not res.ok:
                    raise SystemExit(f"warm-up request failed: {res.error}")
        finally:
            await conns.aclose()
    out = []
    for run in runs:
        out.append(await run_http(args, target, run))
        print(f"{run.label}: {out[-1]['completed']} completed, {out[-1]['failed']} failed", file=sys.stderr)
    return model, out


# --------------------------------------------------------------------------------------- offline


def run_offline(args: argparse.Namespace, runs: list[Run]) -> list[dict[str, Any]]:
    """The runs' prompts through one in-process `LLM`, each at its concurrency (module docstring)."""
    from deltaserve import LLM, SamplingParams

    kwargs = json.loads(args.offline_args) if args.offline_args else {}
    kwargs.setdefault("max_running_requests", max(r.offline_concurrency for r in runs))
    engine = LLM(args.offline_model, **kwargs).engine
    cap = engine.config.max_running_requests
    streams = args.offline_outputs == "streams"
    if streams:  # the steps build their outputs packed, as under engine/core.py
        engine.emit_packed_outputs()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        ignore_eos=True,
        output_kind="delta" if streams else "final_only",
        detokenize=not streams,  # a server's streams are detokenized by the HTTP process
    )
    warm: list[list[int]] = []
    if args.warmup:  # the server's warm-up (run_all_http): the same requests, all at once
        warm = make_prompts(args.warmup, args.input_len, args.vocab_low, args.vocab_high, f"{args.seed}-warm")
        _drive(engine, warm, params, min(len(warm), cap), "warm", streams)
    out = []
    for run in runs:
        concurrency = min(run.offline_concurrency, cap)
        print(f"offline {run.label}: started", file=sys.stderr)  # marks where its steps begin in a log
        t = time.perf_counter()
        tokens, ttfts = _drive(engine, run.prompts, params, concurrency, run.label, streams)
        dt = time.perf_counter() - t
        out.append(
            {
                "label": run.label,
                "concurrency": concurrency,
                "num_prompts": len(run.prompts),
                "duration_s": dt,
                "output_tokens": tokens,
                "output_tok_s": tokens / dt,
                "total_tok_s": (tokens + sum(len(p) for p in run.prompts)) / dt,
                # the engine's own clock, as the server's TTFT histogram is kept
                "ttft_mean_ms": 1e3 * sum(ttfts) / len(ttfts) if ttfts else None,
                "warmup_requests": len(warm),
                "outputs": args.offline_outputs,
            }
        )
        print(f"offline {run.label}: {tokens / dt:.1f} output tok/s", file=sys.stderr)
    return out


def _drive(
    engine: Any, prompts: list[list[int]], params: Any, concurrency: int, tag: str, streams: bool = False
) -> tuple[int, list[float]]:
    """Run `prompts` with at most `concurrency` in the engine: the output tokens they made, and
    each request's time from its arrival to its first token. `streams`: the engine's outputs come
    packed, and each step's are pickled as the engine process sends them to its HTTP processes."""
    import pickle

    from deltaserve.engine.requests.outputs import packed_head, unpack_outputs

    pending = deque(enumerate(prompts))
    tokens = 0
    ttfts: list[float] = []

    def submit() -> None:
        i, ids = pending.popleft()
        engine.add_request(f"bench-{tag}-{i}", ids, params)

    for _ in range(min(concurrency, len(prompts))):
        submit()
    while engine.has_unfinished_requests():
        outs = engine.step()
        if streams:  # as engine/core.py sends them
            pickle.dumps(("step", outs, [], None), protocol=pickle.HIGHEST_PROTOCOL)
            outs = unpack_outputs([out for out in outs if packed_head(out)[1]])
        for out in outs:
            if out.finished:
                tokens += out.outputs[0].num_tokens
                if out.first_token_time is not None:
                    ttfts.append(out.first_token_time - out.arrival_time)
                if pending:
                    submit()
    return tokens, ttfts


# ---------------------------------------------------------------------------------------- report


def _f(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def print_report(result: dict[str, Any]) -> None:
    runs = result["runs"]
    rows = [
        [
            r["label"],
            str(r["completed"]),
            str(r["failed"]),
            _f(r["duration_s"], 2),
            _f(r["request_throughput"], 2),
            _f(r["output_tok_s"]),
            _f(r["total_tok_s"]),
            _f(r.get("offline_output_tok_s")),
            _f(r.get("server_vs_offline"), 3),
        ]
        for r in runs
    ]
    head = ["run", "done", "failed", "dur s", "req/s", "out tok/s", "total tok/s", "offline tok/s", "ratio"]
    _table(head, rows)
    metric_rows = []
    for r in runs:
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            s = r.get(name)
            if s:
                metric_rows.append(
                    [r["label"], name[:-3].upper()] + [_f(s[k], 2) for k in ("mean", "p50", "p90", "p99")]
                )
    if metric_rows:
        print()
        _table(["run", "metric", "mean ms", "p50 ms", "p90 ms", "p99 ms"], metric_rows)
    for r in runs:
        for e in r["errors"][:5]:
            print(f"{r['label']}: {e['count']} x {e['error']}")
        server = r.get("server_mean_ms") or {}
        if server:
            client = {
                "ttft": (r.get("ttft_ms") or {}).get("mean"),
                "e2e": (r.get("e2e_ms") or {}).get("mean"),
            }
            offline = r.get("offline_ttft_mean_ms")
            print(
                f"{r['label']}: mean as the server timed it (client): "
                + ", ".join(f"{k.upper()} {_f(v, 2)} ms ({_f(client[k], 2)})" for k, v in server.items())
                + (f"; offline engine TTFT {_f(offline, 2)} ms" if offline is not None else "")
            )
        if "health" in r:
            h = r["health"]
            lat = h["latency_ms"] or {}
            print(
                f"{r['label']}: /health {h['probes']} probes, p50 {_f(lat.get('p50'), 2)} ms, "
                f"p99 {_f(lat.get('p99'), 2)} ms, non-200 {h['non_200']}"
            )
        loop = r.get("engine_loop") or {}
        if {"step", "gpu_wait", "idle"} <= loop.keys():  # a stand-in engine reports only some
            print(
                f"{r['label']}: the engine loop in steps {100 * loop['step']:.0f}% of the run "
                f"(waiting for the GPU {100 * loop['gpu_wait']:.0f}%), idle {100 * loop['idle']:.0f}%"
            )
        if "client_cpu_share" in r:
            print(
                f"{r['label']}: {r['client_processes']} client process(es), the busiest at "
                f"{100 * r['client_cpu_share']:.0f}% of a core"
            )
    if not runs:
        _table(
            ["run", "concurrency", "dur s", "out tok/s", "total tok/s", "TTFT mean ms"],
            [
                [
                    o["label"],
                    str(o["concurrency"]),
                    _f(o["duration_s"], 2),
                    _f(o["output_tok_s"]),
                    _f(o["total_tok_s"]),
                    _f(o.get("ttft_mean_ms"), 2),
                ]
                for o in result["offline"] or []
            ],
        )


def _table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for row in [head, ["-" * w for w in widths], *rows]:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


# ------------------------------------------------------------------------------------------- CLI


def _numbers(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    ap.add_argument("--model", default=None, help="default: the first of the server's /v1/models")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab-low", type=int, default=1000)
    ap.add_argument("--vocab-high", type=int, default=100000, help="exclusive")
    ap.add_argument(
        "--concurrency",
        default=None,
        help="closed-loop levels, e.g. 1,16,64,256 (the default without --request-rate)",
    )
    ap.add_argument(
        "--request-rate", default=None, help="Poisson arrival rates in req/s, e.g. 10 or 5,10,inf"
    )
    ap.add_argument("--max-concurrency", type=int, default=None, help="cap in-flight requests of rate runs")
    ap.add_argument(
        "--num-prompts", type=int, default=None, help="per run; default 2*C, or 100 for a rate run"
    )
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--no-keepalive",
        dest="keepalive",
        action="store_false",
        help="Connection: close, a new connection per request",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    ap.add_argument("--warmup", type=int, default=1, help="requests sent (and not counted) before the runs")
    ap.add_argument("--health-probe", action="store_true", help="GET /health every 100 ms during each run")
    ap.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="split each HTTP run's clients (or arrivals) over this many processes, so that one "
        "Python process's event loop does not bound a fast server",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--offline-model", default=None, help="also run the prompts through deltaserve.LLM(PATH)")
    ap.add_argument(
        "--offline-args",
        default=None,
        help='LLM keyword arguments as JSON, e.g. \'{"load_format": "dummy"}\'',
    )
    ap.add_argument("--offline-only", action="store_true", help="no HTTP runs, the offline one alone")
    ap.add_argument(
        "--offline-outputs",
        choices=["final", "streams"],
        default="final",
        help="final: each request's last output only, as LLM.generate asks; streams: a delta output "
        "for every running request every step, packed and pickled as the server's engine process "
        "sends them (what streams cost the engine, without HTTP)",
    )
    ap.add_argument("--save-detailed", action="store_true", help="per-request results in the JSON too")
    ap.add_argument(
        "--log-level", default=None, help="the offline engine's logging (debug: a line per engine step)"
    )
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    if args.offline_only and not args.offline_model:
        ap.error("--offline-only needs --offline-model")
    if args.client_processes < 1:
        ap.error("--client-processes must be at least 1")
    if not 0 <= args.vocab_low < args.vocab_high:
        ap.error("need 0 <= --vocab-low < --vocab-high")
    if args.concurrency is None and args.request_rate is None:
        args.concurrency = "1,16,64,256"
    return args


def build_runs(args: argparse.Namespace) -> list[Run]:
    runs = []
    for c in _numbers(args.concurrency or ""):
        n = args.num_prompts or 2 * int(c)
        label = f"c={int(c)}"
        runs.append(Run(label, _prompts_for(args, n, label), concurrency=int(c)))
    for rate in _numbers(args.request_rate or ""):
        n = args.num_prompts or 100
        label = f"rate={rate:g}"
        runs.append(Run(label, _prompts_for(args, n, label), rate=rate, max_concurrency=args.max_concurrency))
    return runs


def _prompts_for(args: argparse.Namespace, n: int, label: str) -> list[list[int]]:
    return make_prompts(n, args.input_len, args.vocab_low, args.vocab_high, f"{args.seed}-{label}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.log_level:
        import logging

        logging.basicConfig(
            level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    runs = build_runs(args)
    result: dict[str, Any] = {
        "command": shlex.join(
            ["python", "-m", "bench.serving.serve", *(sys.argv[1:] if argv is None else argv)]
        ),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": vars(args),
        "model": args.model,
        "runs": [],
        "offline": None,
    }
    if not args.offline_only:
        result["model"], result["runs"] = asyncio.run(run_all_http(args, runs))
    if args.offline_model:
        result["offline"] = run_offline(args, runs)
        for served, offline in zip(result["runs"], result["offline"]):
            served["offline_output_tok_s"] = offline["output_tok_s"]
            served["server_vs_offline"] = served["output_tok_s"] / offline["output_tok_s"]
            served["offline_ttft_mean_ms"] = offline["ttft_mean_ms"]
    print_report(result)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
