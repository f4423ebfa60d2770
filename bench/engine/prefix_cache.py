"""Replay synthetic traces through the radix prefix cache and compare snapshot policies.

No model runs: prefill is simulated, so this measures what the cache decides (token hit
rate, prefill tokens and FLOPs saved) on the CPU in seconds. Sizes are Qwen3-Next-80B-A3B's:
a snapshot is 36 GDN layers x (recurrent 32x128x128 fp32 + conv 8192x3 bf16) ~ 73.7 MiB,
KV is 12 attention layers x 2 x 2 heads x 256 x bf16 = 24 KiB per token. Each cache size is
a memory budget split evenly between the snapshot area and the KV pages.

Each request is served as the engine serves it: prefill chunks end at the chunk size, the
branch point and the resend point; at each chunk end the cache keeps a regular snapshot
(prompt end, branch point), a tentative one (``+tentative`` rows: other chunk ends, within
their quota) or none, inserted at once; the finished sequence's end is offered last, and
then the prompt end's snapshot turns tentative (``+tentative`` rows).

    python bench/engine/prefix_cache.py                  # table on stdout
    python bench/engine/prefix_cache.py --json out.json  # also the rows as JSON
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import numpy as np

from deltaserve.engine.cache.cache_policy import QWEN3_NEXT_PREFILL_COST
from deltaserve.engine.cache.radix_cache import TENTATIVE_PER_PREFILL, RadixCache, resend_point, tentative_cap

SNAPSHOT_BYTES = 36 * (32 * 128 * 128 * 4 + 8192 * 3 * 2)
KV_BYTES_PER_TOKEN = 12 * 2 * 2 * 256 * 2
VOCAB = 150_000
ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# (row name, snapshot policy, tentative chunk-boundary snapshots)
VARIANTS = (
    ("marconi", "marconi", False),
    ("marconi+tentative", "marconi", True),
    ("branch_lru", "branch_lru", False),
    ("every_chunk_lru", "every_chunk_lru", False),
)

Request = tuple[tuple[int, ...], tuple[int, ...]]  # prompt, output


@dataclass(frozen=True)
class Result:
    workload: str
    cache_gib: float
    snapshots: int
    kv_tokens: int
    policy: str
    alpha: float
    requests: int
    prompt_tokens: int
    hit_tokens: int
    hit_rate: float
    flops_saved: float  # fraction of prefill FLOPs skipped
    snapshots_admitted: int
    snapshots_evicted: int
    kv_pages_evicted: int
    tentative_hit_tokens: int  # of hit_tokens, served by a tentative snapshot
    tentative_peak: int  # most tentative snapshots held at once
    tentative_peak_gib: float


class CountingKVPool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self._free = list(range(num_pages - 1, 0, -1))

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return out

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)

    @property
    def num_free(self) -> int:
        return len(self._free)


class CountingStatePool:
    snapshot_bytes = SNAPSHOT_BYTES

    def __init__(self, num_snapshots: int) -> None:
        self._free = list(range(num_snapshots, 0, -1))

    def alloc_snapshot(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_snapshot(self, slot: int) -> None:
        self._free.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        pass


# ---- traces ---------------------------------------------------------------------------------


class Tokens:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def text(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.integers(1, VOCAB, n).tolist())

    def lognormal(self, median: float, sigma: float, lo: int, hi: int) -> int:
        return int(np.clip(self.rng.lognormal(math.log(median), sigma), lo, hi))


def interleave(
    sessions: list[Iterator[Request]], starts: list[float], gap: Callable[[], float]
) -> list[Request]:
    """Merge sessions by time: each turn follows the previous one after `gap()` seconds."""
    events = [(start, i) for i, start in enumerate(starts)]
    out: list[Request] = []
    while events:
        events.sort()
        t, i = events.pop(0)
        req = next(sessions[i], None)
        if req is not None:
            out.append(req)
            events.append((t + gap(), i))
    return out


def conversation(
    tok: Tokens,
    system: tuple[int, ...],
    turns: int,
    user: Callable[[], int],
    answer: Callable[[], int],
    think: Callable[[], int] | None = None,
    retry: float = 0.0,
) -> Iterator[Request]:
    """A chat's turns. With `think`, each answer opens with reasoning that the next turn's
    history drops (Qwen3's chat template does): the next prompt leaves the previous sequence
    right after the previous prompt. With `retry`, that share of turns is sent twice."""
    history = system
    for _ in range(turns):
        prompt = history + tok.text(user())
        reasoning = tok.text(think()) if think else ()
        reply = tok.text(answer())
        yield prompt, reasoning + reply
        if tok.rng.random() < retry:
            yield prompt, reasoning + reply
        history = prompt + reply


def chat_trace(seed: int, sessions: int = 400, thinking: bool = False) -> list[Request]:
    """ShareGPT / LMSys-like: short template header, ~3 turns, lognormal turn lengths. `thinking`:
    a reasoning model's (lognormal 300 reasoning tokens, dropped from the history), 10% of turns
    retried."""
    tok = Tokens(np.random.default_rng(seed))
    header = tok.text(24)
    extra = dict(think=lambda: tok.lognormal(300, 0.8, 8, 4096), retry=0.1) if thinking else {}
    convs = [
        conversation(
            tok, header, min(1 + int(tok.rng.geometric(0.35)), 12),
            lambda: tok.lognormal(80, 1.0, 4, 4096), lambda: tok.lognormal(250, 0.9, 8, 2048), **extra,
        )
        for _ in range(sessions)
    ]  # fmt: skip
    return interleave(convs, tok.rng.uniform(0, 3600, sessions).tolist(), lambda: tok.rng.exponential(60))


def chat_think_trace(seed: int, sessions: int = 400) -> list[Request]:
    """The chat trace with a reasoning model, 10% of turns retried."""
    return chat_trace(seed, sessions, thinking=True)


def few_shot_trace(seed: int, tasks: int = 60) -> list[Request]:
    """Eval harnesses and templated apps: tasks with a 1-4k-token shared prefix (instructions,
    few-shot examples), each asked 4-16 single questions over a few minutes. A task's second
    request is the first branch off its prefix."""
    tok = Tokens(np.random.default_rng(seed))
    sessions: list[Iterator[Request]] = []
    starts: list[float] = []
    for start in tok.rng.uniform(0, 3600, tasks).tolist():
        prefix = tok.text(int(tok.rng.integers(1000, 4000)))
        for _ in range(int(tok.rng.integers(4, 17))):
            q = prefix + tok.text(tok.lognormal(80, 0.8, 4, 1000))
            sessions.append(iter([(q, tok.text(tok.lognormal(60, 0.8, 1, 500)))]))
            starts.append(start + tok.rng.exponential(120))
    return interleave(sessions, starts, lambda: 0.0)


def agent_session(tok: Tokens, tools: tuple[int, ...], max_context: int) -> Iterator[Request]:
    history = tools + tok.text(tok.lognormal(700, 0.6, 100, 4000))  # the issue text
    for _ in range(int(tok.rng.integers(15, 51))):
        output = tok.text(tok.lognormal(180, 0.6, 16, 1500))  # reasoning and a tool call
        yield history, output
        history = history + output + tok.text(tok.lognormal(600, 1.0, 16, 8000))  # tool output
        if len(history) > max_context:
            return


def agentic_trace(seed: int, sessions: int = 32) -> list[Request]:
    """SWE-bench-like agents: a 6k-token shared tool prompt, 15-50 steps appending tool output."""
    tok = Tokens(np.random.default_rng(seed))
    tools = tok.text(6000)
    runs = [agent_session(tok, tools, 48_000) for _ in range(sessions)]
    return interleave(runs, tok.rng.uniform(0, 1400, sessions).tolist(), lambda: tok.rng.exponential(10))


def shared_system_trace(seed: int, users: int = 600) -> list[Request]:
    """Many users of a few apps, one system prompt each (Zipf popularity), 1-4 turns."""
    tok = Tokens(np.random.default_rng(seed))
    systems = [tok.text(n) for n in (2048, 3000, 1200, 800)]
    weights = np.array([1 / (k + 1) ** 1.5 for k in range(len(systems))])
    apps = tok.rng.choice(len(systems), users, p=weights / weights.sum())
    convs = [
        conversation(
            tok, systems[a], min(1 + int(tok.rng.geometric(0.5)), 4),
            lambda: tok.lognormal(100, 0.8, 4, 2000), lambda: tok.lognormal(200, 0.8, 8, 2000),
        )
        for a in apps
    ]  # fmt: skip
    return interleave(convs, tok.rng.uniform(0, 3600, users).tolist(), lambda: tok.rng.exponential(90))


def mixed_trace(seed: int) -> list[Request]:
    """Chats and agents on one server: short snapshots compete with long, expensive ones."""
    chat, agents = chat_trace(seed, sessions=300), agentic_trace(seed + 1, sessions=16)
    rng = np.random.default_rng(seed + 2)
    order = rng.permutation([0] * len(chat) + [1] * len(agents))  # keeps each trace's own order
    streams = [iter(chat), iter(agents)]
    return [next(streams[k]) for k in order]


WORKLOADS: dict[str, Callable[[int], list[Request]]] = {
    "chat": chat_trace,
    "agentic": agentic_trace,
    "shared_system": shared_system_trace,
    "mixed": mixed_trace,
    "chat_think": chat_think_trace,
    "few_shot": few_shot_trace,
}


# ---- replay ---------------------------------------------------------------------------------


def prefill_ends(start: int, length: int, chunk: int, stops: list[int]) -> list[int]:
    """Where the prefill's chunks end: every `chunk` tokens, and at each stop on the way."""
    ends, pos = [], start
    while pos < length:
        pos = min([pos + chunk, length] + [p for p in stops if p > pos])
        ends.append(pos)
    return ends


def replay(
    trace: list[Request],
    policy: str,
    alpha: float,
    cache_gib: float,
    page_size: int,
    chunk: int,
    tentative: bool = False,
) -> Result:
    """Serve the trace one request at a time, calling the cache as the engine does."""
    budget = cache_gib * 2**30 / 2
    snapshots, kv_tokens = int(budget // SNAPSHOT_BYTES), int(budget // KV_BYTES_PER_TOKEN)
    ps = page_size
    cache = RadixCache(
        CountingKVPool(kv_tokens // ps + 1, ps),
        CountingStatePool(snapshots),
        ps,
        policy=policy,
        alpha=alpha,
        prefix_flops=QWEN3_NEXT_PREFILL_COST,
        max_tentative=tentative_cap(snapshots) if tentative else 0,
    )
    flops_total = flops_saved = 0.0
    peak = 0
    for prompt, output in trace:
        m = cache.match_prefix(prompt)
        cache.lock(m.node, pin=False)  # the engine copies the snapshot out at once
        flops_total += QWEN3_NEXT_PREFILL_COST(len(prompt))
        flops_saved += QWEN3_NEXT_PREFILL_COST(m.length)
        full = prompt + output
        end = (len(full) - 1) // ps * ps  # the last sampled token is never fed
        own = cache.alloc_kv(end // ps - len(m.pages))
        if own is None:  # larger than the whole pool: served without caching
            cache.unlock(m.node, pin=False)
            continue
        node, pages, kept, prompt_end = m.node, m.pages + own, [], None
        bp = cache.branch_point(prompt)
        for n in prefill_ends(m.length, len(prompt), chunk, [bp, resend_point(len(prompt), ps)]):
            kind = cache.prefill_snapshot(prompt, n)
            slot = cache.alloc_snapshot(tentative=kind == "tentative") if kind else None
            if slot is None:
                continue
            end_of_prompt = n == len(prompt) // ps * ps
            guess = (n,) if kind == "tentative" else ()
            r = cache.insert(prompt[:n], pages[: n // ps], {n: slot}, guess, (n,) if end_of_prompt else ())
            cache.kv_pool.free(r.duplicates)
            cache.lock(r.node, pin=False)
            cache.unlock(node, pin=False)
            node, pages = r.node, r.pages + pages[n // ps :]
            if end_of_prompt:
                prompt_end = r.node
            elif kind == "tentative" and r.node.tentative:
                kept.append(r.node)
                if len(kept) > TENTATIVE_PER_PREFILL:
                    cache.discard_tentative(kept.pop(0))
        peak = max(peak, cache.num_tentative)
        slots = {}
        if cache.should_snapshot(full, end, is_end=True) and (slot := cache.alloc_snapshot()) is not None:
            slots[end] = slot
        r = cache.insert(full[:end], pages, slots)
        cache.kv_pool.free(r.duplicates)
        cache.unlock(node, pin=False)
        if slots and prompt_end is not None and prompt_end.depth < end:
            cache.demote(prompt_end)
    s = cache.stats
    return Result(
        "", cache_gib, snapshots, kv_tokens, policy, alpha, len(trace), s.query_tokens, s.hit_tokens,
        s.hit_rate, flops_saved / flops_total, s.snapshots_admitted, s.snapshots_evicted, s.kv_pages_evicted,
        s.tentative_hit_tokens, peak, peak * SNAPSHOT_BYTES / 2**30,
    )  # fmt: skip


def tune_alpha(trace: list[Request], cache_gib: float, page_size: int, chunk: int, tentative: bool) -> float:
    """Marconi's bootstrapping: the alpha with the best hit rate on a separate trace."""
    rates = {a: replay(trace, "marconi", a, cache_gib, page_size, chunk, tentative).hit_rate for a in ALPHAS}
    return max(ALPHAS, key=lambda a: (round(rates[a], 4), -a))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--cache-gib", nargs="+", type=float, default=[2.0, 4.0, 8.0, 32.0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument(
        "--chunk", type=int, default=512, help="prefill chunk (snapshot offers), a multiple of 64"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    rows: list[Result] = []
    header = f"{'workload':<14}{'cache':>8}{'snaps':>7}{'KV tok':>9}  {'policy':<18}{'alpha':>6}{'hit rate':>10}{'saved tok':>12}{'FLOPs sv':>10}{'snap ev':>9}{'tent hit':>10}{'tent pk':>9}"
    print(header)
    print("-" * len(header))
    for name in args.workloads:
        trace, tuning = WORKLOADS[name](args.seed), WORKLOADS[name](args.seed + 1000)
        for gib in args.cache_gib:
            t0 = time.perf_counter()
            for row, policy, tentative in VARIANTS:
                tuned = policy == "marconi"
                alpha = tune_alpha(tuning, gib, args.page_size, args.chunk, tentative) if tuned else 0.0
                r = replay(trace, policy, alpha, gib, args.page_size, args.chunk, tentative)
                r = Result(**{**asdict(r), "workload": name, "policy": row})
                rows.append(r)
                print(
                    f"{name:<14}{gib:>6.0f}Gi{r.snapshots:>7}{r.kv_tokens:>9}  {row:<18}"
                    f"{alpha if tuned else float('nan'):>6.2f}{r.hit_rate:>10.1%}"
                    f"{r.hit_tokens:>12,}{r.flops_saved:>10.1%}{r.snapshots_evicted:>9}"
                    f"{r.tentative_hit_tokens:>10,}{r.tentative_peak:>5} ({r.tentative_peak_gib:.1f}G)"
                )
            print(
                f"{'':<14}({len(trace)} requests, {sum(len(p) for p, _ in trace):,} prompt tokens, {time.perf_counter() - t0:.1f}s)"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
