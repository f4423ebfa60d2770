"""The engine's periodic log line, as vLLM's and SGLang's servers write one: what it did since the
last line (prompt tokens admitted for prefill less cache hits, and tokens generated, a second; the
prefix cache's share of the prompt tokens), its load now (requests running and waiting, KV pages
and state slots in use), and where the engine loop's time went: in steps (the part of it spent
waiting for the GPU's tokens apart), idle, and the rest (commands and outputs crossing to the HTTP
processes).

A line every `interval_s` while there is work, then one more once the engine is idle, so that an
idle server's log stays quiet. `deltaserve serve --disable-log-stats` (or `--log-stats-interval 0`)
turns it off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("deltaserve.engine")

STATS_INTERVAL_S = 10.0  # vLLM's interval too


class StatsLog:
    """Call `tick` once a loop iteration; it reads the engine's stats only once an interval."""

    def __init__(
        self,
        stats: Callable[[], dict[str, Any]],
        interval_s: float = STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stats, self.interval_s, self.clock = stats, interval_s, clock
        self._since = clock()
        self._last: dict[str, Any] = {}
        self._quiet = True  # nothing to say until the engine works (then one line once it is idle)

    def tick(self) -> str | None:
        """The line logged now, if one is due (None otherwise)."""
        now = self.clock()
        if now - self._since < self.interval_s:
            return None
        stats = self.stats()
        elapsed, self._since = now - self._since, now
        new = {key: stats.get(key, 0) - self._last.get(key, 0) for key in _COUNTERS}
        self._last = {key: stats.get(key, 0) for key in _COUNTERS}
        idle = not (stats.get("running") or stats.get("waiting") or any(new[k] for k in _TOKENS))
        if idle and self._quiet:
            return None
        self._quiet = idle
        line = _line(stats, new, elapsed)
        logger.info(line)
        return line


_TOKENS = ("prefill_tokens_total", "generation_tokens_total", "cached_tokens_total")
_COUNTERS = (
    *_TOKENS,
    "step_seconds_total",
    "gpu_wait_seconds_total",
    "idle_seconds_total",
)


def _line(stats: dict[str, Any], new: dict[str, Any], elapsed: float) -> str:
    parts = [
        f"prompt {new['prefill_tokens_total'] / elapsed:.1f} tok/s",  # cache hits excluded
        f"generation {new['generation_tokens_total'] / elapsed:.1f} tok/s",
        f"running {stats.get('running', 0)}",
        f"waiting {stats.get('waiting', 0)}",
    ]
    for name, used, total in (
        ("KV pages", "kv_pages_used", "kv_pages_total"),
        ("state slots", "state_slots_used", "state_slots_total"),
    ):
        if stats.get(total):
            parts.append(f"{name} {stats[used]}/{stats[total]} ({100 * stats[used] / stats[total]:.1f}%)")
    admitted = new["cached_tokens_total"] + new["prefill_tokens_total"]  # both counted as prompts start
    if admitted:
        parts.append(f"prefix cache hits {100 * new['cached_tokens_total'] / admitted:.1f}%")
    if "prefill_step_fixed_ms" in stats:  # the adaptive prefill delay's view
        parts.append(
            f"prefill step +{stats['prefill_step_fixed_ms']:.1f} ms"
            f" +{stats['prefill_step_us_per_token']:.2f} us/token"
            f" at {stats['arrivals_per_s']:.1f} arrivals/s"
        )
    if "step_seconds_total" in stats:  # where the engine loop's time went (EngineCore)
        wait = new["gpu_wait_seconds_total"]  # only overlapped steps (CUDA) wait apart from their work
        parts.append(
            f"loop: steps {100 * new['step_seconds_total'] / elapsed:.0f}%"
            + (
                f" (waiting for the GPU {100 * wait / elapsed:.0f}%)"
                if stats["gpu_wait_seconds_total"]
                else ""
            )
            + f", idle {100 * new['idle_seconds_total'] / elapsed:.0f}%"
        )
    return ", ".join(parts)
