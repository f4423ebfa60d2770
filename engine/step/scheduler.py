"""Continuous batching with chunked prefill over the KV page pool and the state pool.

Each step: running decodes first (one token each), then the next chunks of running
prefills, then newly admitted requests, within `max_num_batched_tokens` tokens in all (decode
rows and verification windows count; every decode row's token is set aside first, whatever its
place in the running batch), no request's chunk longer than `chunked_prefill_size` (and the chunks
scoring prompt logprobs `PROMPT_LOGPROB_STEP_ROWS` tokens in all): prefill
chunks ride along with the decodes, as in vLLM and SARATHI, so that a step's time stays
bounded. A chunk is cut to whole pages (or `chunk_align`) where the budget left holds one, else
it takes what is left. A request is admitted only when a state slot and the pages for its first chunk are
free; otherwise it waits. A decode that finds no free page preempts the newest running request
(its pages and slot are freed and it is recomputed later). Under priority scheduling
(`scheduling_policy`) requests are admitted by priority and the lowest is preempted instead
(`waiting_queue.py`).

While the running requests only decode, a step runs by CUDA-graph replay; one with a prefill
chunk runs eagerly, which costs the host far more. So new prompts that arrive one by one
under load may wait up to `max_prefill_delay_steps` steps to be prefilled together, unless
they already fill the step's budget; with `adaptive_prefill_delay`, also only while one more
step's wait costs less than it is expected to save, as measured (`step_costs.py`), and with
`hold_prefill_tails` running prompts' remaining chunks wait with them.

With speculative decoding a decoding request may bring drafts: its chunk is a verification
window (the last token and the drafts, cut to what the decode rows leave of the budget), placed
after the one-token decodes. Its pages cover the whole window, but it is not advanced with the
plan: the engine advances it by the accepted length after sampling (`advance` skips it).

Pages come from the prefix cache (`cache/adapter.py`), which evicts cached pages before it
reports the pool dry; a newly admitted request starts from its cached prefix, and a prefill
chunk ends where the prompt leaves the cache's tree, so that a snapshot can be saved there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deltaserve.engine.cache.adapter import PrefixCache
from deltaserve.engine.cache.kv_pool import KVPool
from deltaserve.engine.cache.state_pool import StatePool
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.requests.request import Request, Status
from deltaserve.engine.step.step_costs import ArrivalRate, MixedStepCost, worth_holding
from deltaserve.engine.step.waiting_queue import WaitingQueue, priority_key

ADAPTIVE_MAX_STEPS = 16  # the adaptive delay's cap in steps when max_prefill_delay_steps is 0
# prompt positions one step scores for prompt logprobs, all requests together: each is a row of
# logits over the vocabulary, memory no start-up measure reserved, so one request's rows could
# otherwise fail everyone's step
PROMPT_LOGPROB_STEP_ROWS = 1024


@dataclass
class ScheduledChunk:
    req: Request
    num_tokens: int
    sample: bool  # the chunk reaches the end of the sequence: a token is sampled after it
    drafts: list[int] = field(default_factory=list)  # a verification window's draft tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    num_decodes: int
    preempted: list[Request] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    num_verify: int = 0  # verification windows, right after the decodes

    @property
    def verify_chunks(self) -> list[ScheduledChunk]:
        return self.chunks[self.num_decodes : self.num_decodes + self.num_verify]


def reserve_pages(prefix_cache: PrefixCache, page_size: int, req: Request, num_tokens: int) -> bool:
    """Pages for the first `num_tokens` positions, if free (or evictable); never preempts."""
    need = -(-num_tokens // page_size) - len(req.pages)
    if need <= 0:
        return True
    pages = prefix_cache.alloc_pages(need)
    if pages is None:
        return False
    req.pages.extend(pages)
    return True


class Scheduler:
    """`propose` (speculative decoding) gives a decoding request's drafts; at most `max_verify`
    requests verify drafts in one step."""

    def __init__(
        self,
        config: EngineConfig,
        kv_pool: KVPool,
        state_pool: StatePool,
        prefix_cache: PrefixCache,
        propose: Callable[[Request], list[int]] | None = None,
        max_verify: int = 0,
    ) -> None:
        self.config = config
        self.kv_pool = kv_pool
        self.state_pool = state_pool
        self.prefix_cache = prefix_cache
        self.waiting = WaitingQueue(config.scheduling_policy == "priority")
        self.running: list[Request] = []
        self.propose = propose
        self.max_verify = max_verify
        self.num_steps = 0
        self.step_cost = MixedStepCost()  # fed by the engine: the adaptive prefill delay's cost model
        self.arrivals = ArrivalRate()

    def add(self, req: Request) -> None:
        req.arrival_step = self.num_steps
        self.arrivals.add(time.monotonic())
        self.waiting.add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        self.num_steps += 1
        budget = self.config.step_tokens
        decodes: list[ScheduledChunk] = []
        verifies: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[Request] = []
        admitted: list[Request] = []
        starved = False  # a running prefill found no pages for its chunk
        # with hold_prefill_tails (which EngineConfig allows only with the adaptive delay), running
        # prompts' chunks may wait with the arrivals
        rows, unfinished = self._prefill_work()  # rows: decode rows not yet scheduled
        hold_all = self.config.hold_prefill_tails and self._hold_prefills(rows, unfinished, budget)
        for req in list(self.running):
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            decoding = self._decodes(req)
            if hold_all and not decoding:
                continue
            if decoding:
                if req.ends_with_placeholder:  # overlap scheduling: finishes when read back
                    continue
                rows -= 1  # the decode rows after this one
                drafts: list[int] = []
                if self.propose is not None and len(verifies) < self.max_verify:
                    # drafts take only what this and the later decode rows leave of the budget
                    drafts = self.propose(req)[: max(0, budget - rows - 1)]
                    # drafts never preempt anyone: without pages for them, plain decode
                    if drafts and not self._ensure_pages(req, req.num_tokens + len(drafts)):
                        drafts = []
                if drafts:
                    verifies.append(ScheduledChunk(req, 1 + len(drafts), True, drafts))
                    budget -= 1 + len(drafts)
                    continue
                while not self._ensure_pages(req, req.num_tokens):
                    victim = self._victim()
                    self.preempt(victim)
                    preempted.append(victim)
                    if victim is req:
                        break
                    # under priority scheduling the victim may already have its chunk in this step
                    for chunks in (decodes, verifies, prefills):
                        for c in [c for c in chunks if c.req is victim]:
                            chunks.remove(c)
                            budget += c.num_tokens
                if req.status is Status.RUNNING:
                    decodes.append(ScheduledChunk(req, 1, True))
                    budget -= 1
                continue
            chunk = self._chunk(req, budget - rows, prefills)  # the later decode rows' tokens are kept
            if chunk <= 0 or not self._ensure_pages(req, req.num_computed_tokens + chunk):
                starved |= chunk > 0
                continue
            budget -= chunk
            prefills.append(ScheduledChunk(req, chunk, chunk == req.num_pending))
        hold = hold_all or (not prefills and self._hold_prefills(len(decodes) + len(verifies), [], budget))
        followers: list[Request] = []  # waiting for a prefill of this step to keep their prefix
        while not hold and budget > 0 and len(self.running) < self.config.num_running:
            first = next((r for r in self.waiting if r not in followers), None)
            if first is None:
                break
            req = first
            if req.num_placeholders:  # preempted with a token in flight: wait for its value
                break
            slot = self.state_pool.alloc()
            if slot is None:
                break
            req.slot = slot
            self.prefix_cache.attach(req)
            if self._follows(req, prefills):
                self.prefix_cache.detach(req)
                self.state_pool.free(slot)
                req.slot = None
                followers.append(req)
                continue
            chunk = self._chunk(req, budget, prefills)
            if chunk <= 0 or not self._ensure_pages(req, req.num_computed_tokens + chunk):
                self.prefix_cache.detach(req)
                self.state_pool.free(slot)
                req.slot = None
                break
            self.prefix_cache.commit(req)
            self.waiting.remove(req)
            if req.scheduled_time is None:  # its queue time ends (not again after a preemption)
                req.scheduled_time = time.time()
            req.status = Status.RUNNING
            self.running.append(req)
            admitted.append(req)
            budget -= chunk
            prefills.append(ScheduledChunk(req, chunk, chunk == req.num_pending))
        if not decodes and not verifies and not prefills:
            if starved and len(self.running) > 1:
                # Prefills hold the pages each other waits for, and no decode would preempt:
                # the newest is recomputed later.
                victim = self._victim()
                self.preempt(victim)
                plan = self.schedule()
                if plan is not None:
                    plan.preempted.insert(0, victim)
                return plan
            return None
        return SchedulerOutput(
            decodes + verifies + prefills, len(decodes), preempted, admitted, len(verifies)
        )

    def _follows(self, req: Request, prefills: list[ScheduledChunk]) -> bool:
        """Whether `req` (attached: its match computed) would start deeper a step later: a prompt
        prefilled in this step shares its tokens up to this step's chunk end, a page boundary
        past `req`'s match, where that prompt keeps its state. Prompts arriving together with
        one prefix (a system prompt, a resent request) then compute it once, not once each."""
        if not self.prefix_cache.reuses_prefixes or req.params.prompt_logprobs is not None:
            return False  # no cache, or a prompt it never serves (its logprobs need every token)
        page, head = self.config.page_size, req.prompt_token_ids[: self.config.page_size]
        for c in prefills:
            end = c.req.num_computed_tokens + c.num_tokens
            # the first page first: most prompts of a step share none, and their ids are long
            if end % page or not req.num_computed_tokens < end < req.num_tokens:
                continue
            if c.req.prompt_token_ids[:page] == head and c.req.cache_key_ids[:end] == req.cache_key_ids[:end]:
                return True
        return False

    def _hold_prefills(self, decoding: int, chunks: list[Request], budget: int) -> bool:
        """Whether the waiting prompts, and `chunks` (running prompts' remaining chunks, with
        `hold_prefill_tails`), sit out this step to be prefilled with later arrivals: only beside
        `decoding` decodes, for at most `max_prefill_delay_steps` steps (with the adaptive delay,
        16 if 0), while they leave part of the budget unused, and, with the adaptive delay, while
        holding them one more step is worth it (`step_costs.worth_holding`). An arrival waits from
        its arrival, a running prompt's chunk from the end of its last one."""
        adaptive = self.config.adaptive_prefill_delay
        delay = self.config.max_prefill_delay_steps or (ADAPTIVE_MAX_STEPS if adaptive else 0)
        first = self.waiting.first() if self.waiting else None
        if not delay or not decoding or (first is None and not chunks):
            return False
        oldest_step = min([r.ready_step for r in chunks] + ([first.arrival_step] if first else []))
        if self.num_steps - oldest_step >= delay:
            return False
        pending, held = sum(r.num_pending for r in chunks), len(chunks)
        for req in self.waiting:
            if pending >= budget:
                break
            pending += req.num_pending
            held += 1
        if pending >= budget:
            return False
        if not adaptive:
            return True
        rate = self.arrivals.rate(time.monotonic())
        return worth_holding(held, decoding, rate, self.step_cost.fixed_s)

    def _prefill_work(self) -> tuple[int, list[Request]]:
        """How many running requests decode this step, and the running prompts with chunks left."""
        chunks: list[Request] = []
        decoding = 0
        for r in self.running:
            if r.status is not Status.RUNNING:
                continue
            if not self._decodes(r):
                chunks.append(r)
            elif not r.ends_with_placeholder:
                decoding += 1
        return decoding, chunks

    @staticmethod
    def _decodes(req: Request) -> bool:
        """Its sequence is computed but for its last token: one token a step (or a window)."""
        return req.num_pending == 1 and req.num_computed_tokens > 0

    def advance(self, plan: SchedulerOutput) -> None:
        """The plan's forward pass ran: its tokens are computed (verification windows: later)."""
        for i, c in enumerate(plan.chunks):
            if c.drafts:
                continue
            c.req.num_computed_tokens += c.num_tokens
            self.prefix_cache.on_computed(c.req, prefill=i >= plan.num_decodes)
            if i >= plan.num_decodes and not c.sample:  # part of the prompt is left: ready now
                c.req.ready_step = self.num_steps

    def _chunk(self, req: Request, budget: int, prefills: list[ScheduledChunk]) -> int:
        pending = req.num_pending
        budget = min(budget, self.config.chunk_size)
        if req.params.prompt_logprobs is not None:  # what the step's other scored chunks leave
            scored = sum(c.num_tokens for c in prefills if c.req.params.prompt_logprobs is not None)
            budget = min(budget, max(0, PROMPT_LOGPROB_STEP_ROWS - scored))
        page, align, start = self.config.page_size, self.config.chunk_align, req.num_computed_tokens
        if pending <= budget:
            chunk = pending
        elif budget < page and budget < align:
            chunk = budget  # legal: KV goes in at any page offset; only snapshots need page ends
        else:
            # what decodes left of a small budget still moves the prompt on, a page at a time
            chunk = budget // align * align or budget // page * page
            if start % page and align % page == 0:  # after a sub-page chunk: end on a page again
                chunk = (start + chunk) // page * page - start
        stop = self.prefix_cache.prefill_stop(req)
        if stop is not None:
            chunk = min(chunk, stop - req.num_computed_tokens)
        return chunk

    def _ensure_pages(self, req: Request, num_tokens: int) -> bool:
        return reserve_pages(self.prefix_cache, self.kv_pool.page_size, req, num_tokens)

    def _release(self, req: Request) -> None:
        self.prefix_cache.release(req)
        if req.slot is not None:
            self.state_pool.free(req.slot)
            req.slot = None

    def _victim(self) -> Request:
        """Whom memory pressure preempts: the newest running request, or under priority
        scheduling the lowest (the largest priority value, then the latest arrival)."""
        if self.waiting.by_priority:
            return max(self.running, key=priority_key)
        return self.running[-1]

    def preempt(self, req: Request) -> None:
        """Free everything the request holds; it is recomputed from its tokens later."""
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.has_initial_state = False
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.add_preempted(req)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req)
        req.status = Status.FINISHED
