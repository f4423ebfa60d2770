"""Prometheus metrics in the text exposition format, written by hand to keep dependencies at zero.

Every metric is `deltaserve_...`; the few that vLLM's dashboards chart are also given under vLLM's
names (`vllm:...`, `_VLLM_STATS` and the request histograms), with the same `model_name` label.
Latencies are measured on the engine thread's clock right after each step, so they include the
model's time but not the HTTP event loop's. With several HTTP processes (`--api-server-count`)
each counts its own requests and `SharedMetrics` adds the others' to what /metrics shows.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import pickle
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.engine.requests.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)
# a request's phases (queue, prefill, decode, the whole inference) run longer than its tokens' gaps
_PHASE_BUCKETS = _LATENCY_BUCKETS + (120.0, 300.0, 600.0, 1800.0)
# token counts a request: 1, 2, 5, 10, 20, 50, ... 5,000,000 (vLLM's 1-2-5 buckets)
_TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5))

# Engine stats rendered as (metric name, type, help); absent keys are skipped.
_STATS = (
    ("running", "num_requests_running", "gauge", "Requests in the running batch."),
    (
        "waiting",
        "num_requests_waiting",
        "gauge",
        "Requests waiting for admission, those a weight update holds too.",
    ),
    ("kv_pages_used", "kv_pages_used", "gauge", "KV-cache pages in use."),
    ("kv_pages_total", "kv_pages_total", "gauge", "KV-cache pages in the pool."),
    ("state_slots_used", "state_slots_used", "gauge", "Recurrent-state slots in use."),
    ("state_slots_total", "state_slots_total", "gauge", "Recurrent-state slots in the pool."),
    ("snapshots_used", "state_snapshots_used", "gauge", "State snapshot slots the prefix cache holds."),
    ("snapshots_total", "state_snapshots_total", "gauge", "State snapshot slots in the pool."),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens processed."),
    (
        "prefill_tokens_total",
        "prefill_tokens_total",
        "counter",
        "Tokens left to prefill as requests are admitted (prompt tokens less cache hits, plus recomputes).",
    ),
    ("generation_tokens_total", "generation_tokens_total", "counter", "Tokens generated."),
    (
        "cached_tokens_total",
        "cached_prompt_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache.",
    ),
    (
        "prefix_cache_hit_rate",
        "prefix_cache_hit_rate",
        "gauge",
        "Share of queried prompt tokens found in the cache.",
    ),
    (
        "prefix_cache_hit_tokens",
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens matched in the cache.",
    ),
    ("prefix_cache_query_tokens", "prefix_cache_query_tokens_total", "counter", "Prompt tokens looked up."),
    ("snapshots", "prefix_cache_snapshots", "gauge", "Recurrent-state snapshots held by the cache."),
    ("snapshot_bytes", "prefix_cache_snapshot_bytes", "gauge", "Bytes held by those snapshots."),
    ("snapshot_evictions", "prefix_cache_snapshot_evictions_total", "counter", "Snapshots evicted."),
    ("kv_page_evictions", "prefix_cache_kv_page_evictions_total", "counter", "Cached KV pages evicted."),
    ("kv_pages_cached", "prefix_cache_kv_pages", "gauge", "KV pages held by the cache."),
    (
        "engine_faults_total",
        "engine_faults_total",
        "counter",
        "Engine steps that failed with no single request to blame (the requests in flight failed).",
    ),
    (
        "step_seconds_total",
        "engine_step_seconds_total",
        "counter",
        "Seconds the engine loop spent in steps (scheduling, the forward, sampling, outputs).",
    ),
    (
        "gpu_wait_seconds_total",
        "engine_gpu_wait_seconds_total",
        "counter",
        "Of those, seconds the host waited for a step's tokens (overlap scheduling).",
    ),
    (
        "idle_seconds_total",
        "engine_idle_seconds_total",
        "counter",
        "Seconds the engine loop had nothing to do.",
    ),
    ("spec_draft_tokens_total", "spec_decode_draft_tokens_total", "counter", "Draft tokens verified."),
    ("spec_accepted_tokens_total", "spec_decode_accepted_tokens_total", "counter", "Draft tokens accepted."),
    ("spec_windows_total", "spec_decode_verify_steps_total", "counter", "Verification windows run."),
    (
        "preemptions_total",
        "num_preemptions_total",
        "counter",
        "Running requests preempted for want of KV pages (freed, recomputed later).",
    ),
)


# engine stat key -> vLLM's name, for what existing vLLM dashboards chart (type and help: _STATS)
_VLLM_NAMES = {
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "prompt_tokens_total": "prompt_tokens_total",
    "generation_tokens_total": "generation_tokens_total",
    "prefix_cache_query_tokens": "prefix_cache_queries_total",
    "prefix_cache_hit_tokens": "prefix_cache_hits_total",
    "preemptions_total": "num_preemptions_total",
}
_VLLM_STATS = tuple(
    (_VLLM_NAMES[key], key, kind, help_text) for key, _, kind, help_text in _STATS if key in _VLLM_NAMES
)


def _spec_gauges(stats: dict[str, Any]) -> list[tuple[str, str, float]]:
    """Acceptance rate and mean accepted length, derived from the engine's spec counters."""
    drafts, accepted = stats.get("spec_draft_tokens_total"), stats.get("spec_accepted_tokens_total")
    windows = stats.get("spec_windows_total")
    if drafts is None or accepted is None or windows is None:
        return []
    return [
        (
            "spec_decode_acceptance_rate",
            "Share of draft tokens accepted.",
            accepted / drafts if drafts else 0.0,
        ),
        (
            "spec_decode_mean_accepted_length",
            "Tokens gained per verification step: accepted drafts plus the model's own token.",
            1.0 + accepted / windows if windows else 0.0,
        ),
    ]


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def render(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {self.sum}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines

    def add(self, counts: list[int], total: float, count: int) -> None:
        """Another process's observations of the same buckets."""
        self.counts = [a + b for a, b in zip(self.counts, counts)]
        self.sum += total
        self.count += count


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.labels = f'model_name="{_escape(model_name)}"'
        self.finished: dict[str, int] = {}
        self.http_errors: dict[int, int] = {}
        self.rejected: dict[str, int] = {}  # requests refused for want of room, by reason
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram(_LATENCY_BUCKETS + (120.0, 300.0))
        # each finished request's phases on the engine's clock, and its token counts
        self.queue = Histogram(_PHASE_BUCKETS)
        self.prefill = Histogram(_PHASE_BUCKETS)
        self.decode = Histogram(_PHASE_BUCKETS)
        self.inference = Histogram(_PHASE_BUCKETS)
        self.prompt_tokens = Histogram(_TOKEN_BUCKETS)
        self.generation_tokens = Histogram(_TOKEN_BUCKETS)
        # request id -> [arrival, time of the last new token, tokens so far]
        self._timing: dict[str, list[float]] = {}
        # tokens that the engine's generation_tokens_total leaves out: a beam search's beams past
        # its first step, whose engine requests are not counted (server/api/beam_search.py)
        self.generated_here = 0

    def tokens_generated(self, count: int) -> None:
        """Tokens a client got that the engine's counter left out (see `generated_here`)."""
        self.generated_here += max(0, count)

    def request_started(self, request_id: str) -> None:
        self._timing[request_id] = [time.monotonic(), 0.0, 0]

    def request_progress(self, out: RequestOutput, now: float) -> None:
        timing = self._timing.get(out.request_id)
        if timing is None:
            return
        arrival, last_time, last_count = timing
        count = sum(c.num_tokens for c in out.outputs)
        if count > last_count:
            if last_count == 0:
                # the engine's own clock: a non-streamed request sends no output before its last
                first = out.first_token_time
                self.ttft.observe(first - out.arrival_time if first and out.arrival_time else now - arrival)
                if count > 1:  # tokens that arrived together: spread over the time since the first
                    span = max(0.0, time.time() - first) if first else 0.0
                    self.itl.observe(span / (count - 1), times=int(count - 1))
            else:
                self.itl.observe((now - last_time) / (count - last_count), times=int(count - last_count))
            timing[1], timing[2] = now, count
        if out.finished:
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
            self._finish(out.request_id, reason, now)
            self._phases(out, count)

    def _phases(self, out: RequestOutput, generated: int) -> None:
        """A finished request's time waiting, prefilling (to its first token), decoding and in all
        since it was first scheduled, as the engine timed them (wall clock), and its token counts."""
        now = time.time()
        arrival, scheduled, first = out.arrival_time, out.scheduled_time, out.first_token_time
        if scheduled is not None:
            if arrival:
                self.queue.observe(max(0.0, scheduled - arrival))
            self.inference.observe(max(0.0, now - scheduled))
            if first is not None:
                self.prefill.observe(max(0.0, first - scheduled))
        if first is not None:
            self.decode.observe(max(0.0, now - first))
        self.prompt_tokens.observe(len(out.prompt_token_ids))
        self.generation_tokens.observe(generated)

    def request_aborted(self, request_id: str) -> None:
        if request_id in self._timing:
            self._finish(request_id, "abort", time.monotonic())

    def forget(self, request_id: str) -> None:
        """A request that was never admitted."""
        self._timing.pop(request_id, None)

    def request_error(self, status: int) -> None:
        self.http_errors[status] = self.http_errors.get(status, 0) + 1

    def request_rejected(self, reason: str) -> None:
        """A request turned away before it reached the engine's queue (503): "queue_full" or
        "shutting_down"."""
        self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def snapshot(self) -> dict[str, Any]:
        """The counters and histograms (not the requests in flight), for `merged` in another process."""
        hists = {name: (h.counts, h.sum, h.count) for name, h in self._histograms().items()}
        return {
            "finished": self.finished,
            "http_errors": self.http_errors,
            "rejected": self.rejected,
            "generated_here": self.generated_here,
            **hists,
        }

    def merged(self, snapshots: list[dict[str, Any]]) -> Metrics:
        """A copy of these metrics with other processes' snapshots added."""
        total = Metrics(self.model_name)
        for snap in [self.snapshot(), *snapshots]:
            for key in ("finished", "http_errors", "rejected"):
                mine = getattr(total, key)
                for k, v in snap[key].items():
                    mine[k] = mine.get(k, 0) + v
            for name, hist in total._histograms().items():
                hist.add(*snap[name])
            total.generated_here += snap.get("generated_here", 0)
        return total

    def _histograms(self) -> dict[str, Histogram]:
        return {
            "ttft": self.ttft,
            "itl": self.itl,
            "e2e": self.e2e,
            "queue": self.queue,
            "prefill": self.prefill,
            "decode": self.decode,
            "inference": self.inference,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
        }

    def _finish(self, request_id: str, reason: str, now: float) -> None:
        arrival = self._timing.pop(request_id)[0]
        self.e2e.observe(now - arrival)
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def render(self, stats: dict[str, Any]) -> str:
        p, lab = "deltaserve_", self.labels
        if "generation_tokens_total" in stats:
            stats = {
                **stats,
                "generation_tokens_total": stats["generation_tokens_total"] + self.generated_here,
            }
        lines: list[str] = []

        def header(name: str, kind: str, help_text: str) -> None:
            lines.extend((f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}"))

        header(
            "requests_total", "counter", "Finished engine requests by outcome (stop, length, abort, error)."
        )
        for reason in sorted(set(self.finished) | {"stop", "length", "abort", "error"}):
            lines.append(f'{p}requests_total{{{lab},outcome="{reason}"}} {self.finished.get(reason, 0)}')
        header("request_errors_total", "counter", "Requests refused with an error, by HTTP status.")
        for status, count in sorted(self.http_errors.items()):
            lines.append(f'{p}request_errors_total{{{lab},status="{status}"}} {count}')
        header("requests_rejected_total", "counter", "Requests refused with 503 for want of room, by reason.")
        for reason in sorted(set(self.rejected) | {"queue_full"}):
            count = self.rejected.get(reason, 0)
            lines.append(f'{p}requests_rejected_total{{{lab},reason="{reason}"}} {count}')
        for key, name, kind, help_text in _STATS:
            if key in stats:
                header(name, kind, help_text)
                lines.append(f"{p}{name}{{{lab}}} {stats[key]}")
        for name, help_text, value in _spec_gauges(stats):
            header(name, "gauge", help_text)
            lines.append(f"{p}{name}{{{lab}}} {value}")
        engines = stats.get("engines") or []  # data-parallel engines: each one's own beside the sums
        for key, name, kind, help_text in _STATS if len(engines) > 1 else ():
            if key in engines[0]:
                header(f"dp_{name}", kind, f"{help_text} By data-parallel engine.")
                for i, one in enumerate(engines):
                    lines.append(f'{p}dp_{name}{{{lab},engine="{i}"}} {one[key]}')
        histograms = (
            ("time_to_first_token_seconds", self.ttft, "Time from admission to the first generated token."),
            ("inter_token_latency_seconds", self.itl, "Time between consecutive generated tokens."),
            ("e2e_request_latency_seconds", self.e2e, "Time from admission to finish."),
            (
                "request_queue_time_seconds",
                self.queue,
                "Time a request waited before it was first scheduled.",
            ),
            ("request_prefill_time_seconds", self.prefill, "Time from first scheduled to the first token."),
            ("request_decode_time_seconds", self.decode, "Time from the first token to the last."),
            ("request_inference_time_seconds", self.inference, "Time from first scheduled to finish."),
            ("request_prompt_tokens", self.prompt_tokens, "Prompt tokens of each finished request."),
            (
                "request_generation_tokens",
                self.generation_tokens,
                "Tokens generated by each finished request.",
            ),
        )
        for name, hist, help_text in histograms:
            header(name, "histogram", help_text)
            lines.extend(f"{p}{line}" for line in hist.render(name, lab))
        p = "vllm:"
        for name, key, kind, help_text in _VLLM_STATS:
            if key in stats:
                header(name, kind, help_text)
                lines.append(f"{p}{name}{{{lab}}} {stats[key]}")
        header("request_success_total", "counter", "Finished requests by finish reason.")
        for reason in sorted(set(self.finished) | {"stop", "length", "abort"}):
            count = self.finished.get(reason, 0)
            lines.append(f'{p}request_success_total{{{lab},finished_reason="{reason}"}} {count}')
        used, total = stats.get("kv_pages_used"), stats.get("kv_pages_total")
        if used is not None and total:
            header("kv_cache_usage_perc", "gauge", "Share of KV-cache pages in use (0 to 1).")
            lines.append(f"{p}kv_cache_usage_perc{{{lab}}} {used / total}")
        for name, hist, help_text in histograms:
            header(name, "histogram", help_text)
            lines.extend(f"{p}{line}" for line in hist.render(name, lab))
        return "\n".join(lines) + "\n"


class SharedMetrics:
    """The HTTP processes' own metrics, each process's snapshot in a file of a folder they share
    (rewritten every `PUBLISH_S`): /metrics in any process adds the others' to its own, as
    Prometheus' multiprocess mode does. The others' figures are then up to `PUBLISH_S` old."""

    PUBLISH_S = 1.0

    def __init__(self, folder: str, index: int, count: int) -> None:
        self.folder, self.index, self.count = folder, index, count

    def _path(self, index: int) -> str:
        return os.path.join(self.folder, f"metrics-{index}.pkl")

    def publish(self, metrics: Metrics) -> None:
        tmp = self._path(self.index) + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump(metrics.snapshot(), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, self._path(self.index))  # a reader sees the old file or the new, never half

    def peers(self) -> list[dict[str, Any]]:
        """The other processes' last snapshots (none yet from one that has not published)."""
        out = []
        for index in range(self.count):
            if index == self.index:
                continue
            try:
                with open(self._path(index), "rb") as f:
                    out.append(pickle.load(f))
            except (OSError, EOFError, pickle.UnpicklingError):
                continue
        return out

    async def publish_every(self, metrics: Metrics) -> None:
        """Publish until cancelled (the app's lifespan)."""
        while True:
            try:
                self.publish(metrics)
            except OSError:
                pass  # the folder went with a shutdown; the next try or the end will tell
            await asyncio.sleep(self.PUBLISH_S)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
