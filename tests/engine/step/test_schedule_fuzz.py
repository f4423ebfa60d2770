"""Differential fuzz of the scheduler under memory pressure: prefix caching, chunked prefill,
preemption, eviction, aborts, overlap scheduling and speculative decoding change nothing but
speed. Random workloads (shared system prompts, retries, prompts that are prefixes of others,
chat turns that resend earlier answers, lengths around page boundaries, arrivals between
steps, aborts, cache flushes) run on tiny pools; every completed request's greedy tokens equal
its run alone without the prefix cache (an aborted one's are a prefix of them), after every
step each KV page, working slot and snapshot slot has exactly one owner, no step holds more
tokens than `max_num_batched_tokens`, and a flush leaves nothing held."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deltaserve.engine.cache.adapter import warmup_params
from deltaserve.engine.cache.cache_policy import POLICIES
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.step.scheduler import SchedulerOutput

# Random workloads, each request also run alone to compare
pytestmark = pytest.mark.slow

VOCAB = 160  # the tiny checkpoints' (tests/conftest.py)
MAX_LEN = 256  # the fuzzed engine's context; its KV pool holds one such request, or a few pages more
MAX_NEW = 40


class Alone:
    """Each prompt run by itself: naive cache, one prefill chunk, nothing else running."""

    def __init__(self, path: str) -> None:
        self.engine = Engine(
            EngineConfig(
                model=path,
                dtype="float32",
                device="cpu",
                cache_type="naive",
                max_running_requests=1,
                chunked_prefill_size=MAX_LEN,
                max_model_len=MAX_LEN,
                enable_overlap_schedule=False,
            )
        )
        self.memo: dict[tuple, list[int]] = {}
        self.runs = 0

    def tokens(self, prompt: list[int], n: int, penalty: float = 1.0) -> list[int]:
        """The first `n` greedy tokens (greedy: a longer run's head)."""
        key = (tuple(prompt), penalty)
        if len(self.memo.get(key, [])) < n:
            self.runs += 1
            rid = f"alone-{self.runs}"
            params = SamplingParams(
                temperature=0.0, max_tokens=n, ignore_eos=True, repetition_penalty=penalty
            )
            self.engine.add_request(rid, prompt, params)
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        self.memo[key] = list(out.outputs[0].token_ids)
        return self.memo[key][:n]


def check_owners(engine: Engine) -> None:
    """Every KV page, working slot and snapshot slot is free, the tree's or one running
    request's, exactly once; the tree's lock counts are the running requests' holds."""
    kv, st, page = engine.runner.kv_pool, engine.runner.state_pool, engine.config.page_size
    cache = engine.prefix_cache.cache  # type: ignore[attr-defined]
    pages: dict[int, Any] = {}
    snapshots: dict[int, Any] = {}
    slots: dict[int, Any] = {}

    def own(table: dict[int, Any], key: int | None, who: Any) -> None:
        assert key is not None and key not in table, f"{key} held by {table.get(key)} and {who}"
        table[key] = who

    for p in kv._free:
        own(pages, p, "free")
    for s in st._free_snapshots:
        own(snapshots, s, "free")
    for s in st._free:
        own(slots, s, "free")
    locks: dict[int, int] = {}
    for req in engine.scheduler.waiting:
        assert req.slot is None and not req.pages and req.prefix is None, req.request_id
    for req in engine.scheduler.running:
        own(slots, req.slot, req.request_id)
        hold = req.prefix
        assert hold is not None
        path, node = [], hold.node
        while node.parent is not None:
            locks[id(node)] = locks.get(id(node), 0) + 1
            path = node.pages + path
            node = node.parent
        assert req.pages[: hold.num_shared_pages] == path, req.request_id  # the tree's, read only
        for p in req.pages[hold.num_shared_pages :]:
            own(pages, p, req.request_id)
        if hold.rolling_slot is not None:
            own(snapshots, hold.rolling_slot, req.request_id)
        assert req.num_computed_tokens <= len(req.pages) * page
    unlocked = 0
    for node in cache._nodes():
        for p in node.pages:
            own(pages, p, node)
        if node.snapshot is not None:
            own(snapshots, node.snapshot, node)
        assert node.lock_ref == locks.get(id(node), 0) and node.pins == 0
        unlocked += 0 if node.lock_ref else len(node.pages)
    assert cache.evictable_size == unlocked
    assert sorted(pages) == list(range(1, kv.num_pages))
    assert sorted(slots) == list(range(1, st.num_working + 1))
    assert sorted(snapshots) == list(range(st.num_working + 1, st.num_working + st.num_snapshots + 1))


class Workload:
    """Prompts that share their beginnings the ways users' do."""

    def __init__(self, rng: random.Random, page: int) -> None:
        self.rng, self.page = rng, page
        self.prompts: list[list[int]] = []
        self.histories: list[list[int]] = []  # completed requests' prompt and output
        self.systems = [self.fresh(rng.choice([2 * page, 3 * page - 1, 50, 96])) for _ in range(2)]

    def fresh(self, n: int) -> list[int]:
        rng = self.rng
        if rng.random() < 0.3:  # repeats itself: n-gram drafts are proposed
            base = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 20))]
            return (base * (n // len(base) + 1))[:n]
        return [rng.randrange(VOCAB) for _ in range(n)]

    def near_a_page(self) -> int:
        return max(1, self.page * self.rng.randint(1, 8) + self.rng.choice([-1, 0, 1]))

    def prompt(self) -> list[int]:
        rng, r = self.rng, self.rng.random()
        if self.prompts and r < 0.15:  # a retry
            p = list(rng.choice(self.prompts))
        elif self.prompts and r < 0.3:  # a prefix of an earlier one
            src = rng.choice(self.prompts)
            p = src[: min(len(src), rng.choice([self.near_a_page(), rng.randint(1, len(src))]))]
        elif self.prompts and r < 0.45:  # an earlier one, longer
            p = rng.choice(self.prompts) + self.fresh(rng.randint(1, 60))
        elif self.histories and r < 0.6:  # the next chat turn
            p = rng.choice(self.histories) + self.fresh(rng.randint(1, 40))
        elif self.histories and r < 0.65:  # the whole history again
            p = list(rng.choice(self.histories))
        elif r < 0.85:
            p = rng.choice(self.systems) + self.fresh(rng.randint(1, 60))
        else:
            p = self.fresh(self.near_a_page() if rng.random() < 0.5 else rng.randint(1, 200))
        p = p[: MAX_LEN - MAX_NEW]
        self.prompts.append(p)
        return p


def pressure_config(rng: random.Random, path: str) -> dict[str, Any]:
    """Small pools, budgets and chunks, each feature on or off."""
    page = rng.choice([4, 8, 16, 16, 32, 64])
    cfg: dict[str, Any] = dict(
        model=path,
        dtype="float32",
        device="cpu",
        max_model_len=MAX_LEN,
        page_size=page,
        max_running_requests=rng.randint(1, 6),
        max_num_batched_tokens=rng.choice([8, 16, 24, 48, 64, 100, 128]),
        chunked_prefill_size=rng.choice([8, 16, 32, 40, 64, 128]),
        num_kv_pages=MAX_LEN // page + 1 + rng.choice([0, 1, 2, 8, 24]),
        num_snapshot_slots=rng.randint(0, 8),
        prefix_cache_policy=rng.choice(POLICIES),
        enable_overlap_schedule=rng.random() < 0.5,
        max_prefill_delay_steps=rng.choice([0, 0, 2]),
        scheduling_policy=rng.choice(["fcfs", "fcfs", "priority"]),
    )
    if rng.random() < 0.3:
        cfg["speculative_config"] = {"method": "ngram", "num_speculative_tokens": rng.randint(1, 4)}
    return cfg


class OracleDrafter:
    """Drafts a live request's true greedy continuation (its run alone) for a random number of
    tokens, then a wrong token: windows accept any count, so page boundaries fall everywhere in
    them (n-gram drafts on random prompts are seldom accepted)."""

    def __init__(self, rng: random.Random, alone: Alone, live: dict[str, tuple[list[int], SamplingParams]]):
        self.rng, self.alone, self.live = rng, alone, live

    def propose(self, tokens: list[int], k: int) -> list[int]:
        for p, params in self.live.values():
            assert params.max_tokens is not None
            if tokens[: len(p)] != p:
                continue
            seq = p + self.alone.tokens(p, params.max_tokens, params.repetition_penalty)
            if seq[: len(tokens)] == tokens and len(seq) > len(tokens):
                cont = seq[len(tokens) :]
                drafts = cont[: self.rng.randint(0, k)]
                if len(drafts) < k:
                    drafts.append((cont[len(drafts)] + 1) % VOCAB if len(cont) > len(drafts) else 0)
                return drafts
        return []


def fuzz(
    path: str, seed: int, num_requests: int, alone: Alone, oracle: bool = False, **overrides: Any
) -> dict[str, int]:
    """One random workload on `path`: asserts as the module says; the engine's counters, and
    how many requests were aborted. `oracle`: speculative decoding drafts with `OracleDrafter`."""
    rng = random.Random(seed)
    cfg = {**pressure_config(rng, path), **overrides}
    engine = Engine(EngineConfig(**cfg))
    schedule = engine.scheduler.schedule

    def within_budget() -> SchedulerOutput | None:
        plan = schedule()
        if plan is not None:  # decode rows and verification windows count
            assert sum(c.num_tokens for c in plan.chunks) <= engine.config.step_tokens, cfg
        return plan

    engine.scheduler.schedule = within_budget  # type: ignore[method-assign]
    work = Workload(rng, cfg["page_size"])
    live: dict[str, tuple[list[int], SamplingParams]] = {}
    if oracle:
        assert engine.spec is not None
        engine.spec.drafter = OracleDrafter(random.Random(seed), alone, live)
    done: dict[str, tuple[list[int], SamplingParams, list[int], str]] = {}
    by_priority = cfg["scheduling_policy"] == "priority"
    added = steps = 0
    while added < num_requests or engine.has_unfinished_requests():
        if added < num_requests and (not engine.has_unfinished_requests() or rng.random() < 0.35):
            for _ in range(min(rng.choice([1, 1, 1, 2, 3, 6]), num_requests - added)):
                p = work.prompt()
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=rng.choice([1, 2, rng.randint(1, 12), rng.randint(1, MAX_NEW)]),
                    ignore_eos=True,
                    priority=rng.randint(0, 3) if by_priority else 0,
                    repetition_penalty=1.3 if rng.random() < 0.1 else 1.0,
                    next_turn_len=len(p) - rng.randint(0, 6) if rng.random() < 0.2 else None,
                    logprobs=1 if rng.random() < 0.05 else None,  # needs host data: no overlap
                )
                engine.add_request(f"r{added}", p, params)
                live[f"r{added}"] = (p, params)
                added += 1
        if work.prompts and rng.random() < 0.05:  # LLM.generate's warm-up of a prompt run n > 1 times
            engine.add_request(f"warmup{steps}", rng.choice(work.prompts)[:-1] or [0], warmup_params())
        if rng.random() < 0.01:
            engine.flush_cache()  # /flush_cache: safe under load
        if live and rng.random() < 0.04:
            engine.abort_request(rng.choice(sorted(live)))
        for out in engine.step():
            if out.finished and out.request_id in live:
                p, params = live.pop(out.request_id)
                c = out.outputs[0]
                done[out.request_id] = (p, params, list(c.token_ids), str(c.finish_reason))
                if c.finish_reason != "abort":
                    work.histories.append(p + list(c.token_ids))
        check_owners(engine)
        steps += 1
        assert steps < 20_000, "no progress"
    for rid, (p, params, got, reason) in done.items():
        assert params.max_tokens is not None
        want = alone.tokens(p, params.max_tokens, params.repetition_penalty)
        if reason == "abort":
            want = want[: len(got)]
        assert got == want, (rid, reason, len(p), cfg)
    stats = {**engine.stats(), "aborted": sum(d[3] == "abort" for d in done.values())}
    engine.flush_cache()
    kv, st = engine.runner.kv_pool, engine.runner.state_pool
    assert (kv.num_used, st.num_used, st.num_snapshots_used) == (0, 0, 0), cfg
    return stats


@pytest.fixture(scope="module")
def qwen35(remembering_checkpoint) -> str:
    return remembering_checkpoint("qwen3_5")  # a wrong state changes its tokens


PRESSURE = dict(page_size=16, num_kv_pages=18, max_running_requests=4, num_snapshot_slots=3)


@pytest.mark.parametrize(
    "seed,features",
    [
        (
            3,
            dict(
                enable_overlap_schedule=True,
                speculative_config=None,
                chunked_prefill_size=24,
                max_num_batched_tokens=40,
            ),
        ),
        (3, dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3})),
        pytest.param(
            3,
            dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3}, oracle=True),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["overlap", "ngram", "oracle_drafts"],
)
def test_fuzzed_workload_under_pressure(qwen35, seed, features):
    """A small workload on pools that hold one full-length request and two pages more: requests
    are preempted, cached pages and snapshots evicted, requests aborted, and still every
    output is the one of the request alone."""
    stats = fuzz(qwen35, seed, 32, Alone(qwen35), **{**PRESSURE, **features})
    assert stats["preemptions_total"] > 0 and stats["kv_page_evictions"] > 0, stats
    assert stats["snapshot_evictions"] > 0 and stats["cached_tokens_total"] > 0, stats
    assert stats["aborted"] > 0, stats
    if features.get("speculative_config"):
        assert stats["spec_draft_tokens_total"] > 0, stats
    if features.get("oracle"):
        assert stats["spec_accepted_tokens_total"] > stats["spec_draft_tokens_total"] / 3, stats


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi"])
def test_fuzzed_workloads_every_architecture(kind, remembering_checkpoint):
    path = remembering_checkpoint(kind)
    alone = Alone(path)
    for seed in range(4):
        fuzz(path, 100 + seed, 40, alone)
