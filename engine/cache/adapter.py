"""The engine's adapter to the prefix cache, as the scheduler calls it: what a request takes
from the cache at admission, which snapshots it saves while it runs, and what it hands back
when it leaves.

`NaivePrefixCache` (``cache_type="naive"``) reuses nothing. `RadixPrefixCache` drives
`RadixCache` by the contract in radix_cache.py:

- admission is two-phase: `attach` matches (without recording) and locks, so that page
  allocation may evict anything but the matched path; `commit` records the hit and copies the
  snapshot into the working slot, or `detach` undoes it when admission fails;
- the tree's pages head the request's page table: the request writes KV only from the
  (page-aligned) length it holds of the tree on, so it never writes them, and never frees
  them;
- a prefill chunk ends at the branch point and at the resend point (the last page boundary
  before the prompt's last token: the prompt end's state is kept, so the next chat turn and a
  resend hit). At each page-aligned prefill chunk end the cache picks a regular snapshot
  (prompt end, branch point), a tentative one (other chunk ends) or none; a kept state is
  inserted at once with the prefix's pages, so that later requests hit it while this one
  still runs;
- whenever the computed length lands on a page boundary where nothing is kept, the working
  slot is copied into the request's rolling slot, so that at release there is a state exactly
  at a page boundary to insert as the end snapshot (no extra forward pass);
- `release` (finish, abort, preemption) inserts the computed tokens, trimmed to whole pages,
  with the end snapshot: their KV and states are complete whatever the reason the request
  stops, and a preempted request's recompute then hits its own prefix. An end snapshot past
  the prompt end makes the prompt end's tentative: it now serves only a resend or a follow-up
  that re-renders the answer differently.
"""

from __future__ import annotations

import dataclasses
import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from deltaserve.engine.cache.cache_policy import HybridPrefillCost
from deltaserve.engine.cache.kv_pool import KVPool
from deltaserve.engine.cache.radix_cache import (
    TENTATIVE_PER_PREFILL,
    RadixCache,
    SnapshotKind,
    prompt_end_point,
    resend_point,
    tentative_cap,
)
from deltaserve.engine.cache.radix_node import CacheHold
from deltaserve.engine.cache.state_pool import StatePool
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.requests.request import Request
from deltaserve.engine.requests.sampling_params import SamplingParams

# writes the state after a request's computed tokens into the state pool slot it is given
StateWrite = Callable[[int], None]


class PrefixCache(ABC):
    """The scheduler's interface to a prefix cache (see the module docstring for the order)."""

    # whether a prefill chunk's page-aligned end can serve a prompt admitted after it
    reuses_prefixes = False

    def __init__(self, kv_pool: KVPool, state_pool: StatePool) -> None:
        self.kv_pool, self.state_pool = kv_pool, state_pool

    @abstractmethod
    def alloc_pages(self, n: int) -> list[int] | None: ...

    @abstractmethod
    def attach(self, req: Request) -> None:
        """At admission, with the working slot allocated: start from the cached prefix."""

    @abstractmethod
    def commit(self, req: Request) -> None:
        """Admission went through."""

    @abstractmethod
    def detach(self, req: Request) -> None:
        """Admission failed: undo `attach` (the scheduler frees the working slot)."""

    @abstractmethod
    def prefill_stop(self, req: Request) -> int | None:
        """A position that the next prefill chunk must not run past, if any."""

    @abstractmethod
    def on_computed(self, req: Request, prefill: bool, write: StateWrite | None = None) -> None:
        """`req.num_computed_tokens` just advanced past a forward pass. A state kept here is
        copied from the working slot, or written by `write(slot)` where the state at that
        length is elsewhere (a verification window's accepted position)."""

    @abstractmethod
    def release(self, req: Request) -> None:
        """Hand back the request's pages (and what it holds of the cache); not its working slot."""

    @abstractmethod
    def flush(self) -> None:
        """Free everything cached that no running request uses."""

    @property
    @abstractmethod
    def num_evictable_pages(self) -> int:
        """Cached pages that no request uses: the pool can have them back on demand."""

    @abstractmethod
    def stats(self) -> dict[str, Any]: ...


class NaivePrefixCache(PrefixCache):
    """No reuse: every request computes its whole sequence and frees its pages at the end."""

    def alloc_pages(self, n: int) -> list[int] | None:
        return self.kv_pool.alloc(n)

    def attach(self, req: Request) -> None:
        return None

    def commit(self, req: Request) -> None:
        return None

    def detach(self, req: Request) -> None:
        self.release(req)

    def prefill_stop(self, req: Request) -> int | None:
        return None

    def on_computed(self, req: Request, prefill: bool, write: StateWrite | None = None) -> None:
        return None

    def release(self, req: Request) -> None:
        if req.pages:
            self.kv_pool.free(req.pages)
            req.pages = []

    def flush(self) -> None:
        return None

    @property
    def num_evictable_pages(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        return {
            "prefix_cache_hit_rate": 0.0,
            "prefix_cache_hit_tokens": 0,
            "prefix_cache_query_tokens": 0,
            "snapshots": 0,
            "snapshot_bytes": 0,
            "snapshot_evictions": 0,
            "kv_page_evictions": 0,
            "kv_pages_cached": 0,
        }


class RadixPrefixCache(PrefixCache):
    reuses_prefixes = True

    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        policy: str,
        alpha: float,
        prefix_flops: Callable[[int], float] | None,
    ) -> None:
        super().__init__(kv_pool, state_pool)
        self.page_size = kv_pool.page_size
        cap = tentative_cap(state_pool.num_snapshots)
        self.cache = RadixCache(kv_pool, state_pool, self.page_size, policy, alpha, prefix_flops, cap)

    def alloc_pages(self, n: int) -> list[int] | None:
        return self.cache.alloc_kv(n)

    def attach(self, req: Request) -> None:
        assert req.prefix is None and not req.pages and req.num_computed_tokens == 0
        tokens = req.cache_key_ids  # after a preemption: prompt and output, all recomputed
        # Peek only: admission may still fail for want of pages and be retried every step.
        m = self.cache.match_prefix(_matchable(req), record=False)
        self.cache.lock(m.node)
        bp = self.cache.branch_point(tokens)
        req.prefix = CacheHold(
            m.node, m.snapshot_slot, len(m.pages), bp if m.length < bp < len(tokens) else 0
        )
        req.pages = list(m.pages)
        req.num_computed_tokens = m.length
        req.has_initial_state = m.length > 0

    def commit(self, req: Request) -> None:
        hold = req.prefix
        assert hold is not None
        # The matched path is locked, so recording now finds the same node.
        m = self.cache.match_prefix(_matchable(req), count=not req.params.internal)
        assert m.node is hold.node and m.length == req.num_computed_tokens
        if hold.snapshot_slot is not None:
            assert req.slot is not None
            self.state_pool.copy_slot(hold.snapshot_slot, req.slot)  # copy-on-write
        # The copy is made: the snapshot may go, the pages under it stay.
        self.cache.lock(hold.node, pin=False)
        self.cache.unlock(hold.node)
        if req.num_preemptions == 0:
            req.num_cached_tokens = m.length

    def detach(self, req: Request) -> None:
        hold = req.prefix
        assert hold is not None and not hold.tentative and hold.rolling_slot is None
        self.kv_pool.free(req.pages[hold.num_shared_pages :])
        self.cache.unlock(hold.node)
        req.pages, req.prefix = [], None
        req.num_computed_tokens, req.has_initial_state = 0, False

    def prefill_stop(self, req: Request) -> int | None:
        hold = req.prefix
        if hold is None:
            return None
        # Stopping at the resend point costs a step (a short last chunk), not a token.
        resend = resend_point(req.num_tokens, self.page_size)
        # where other conversations with this system prompt will branch: kept before they come
        shared = (req.params.shared_prefix_len or 0) // self.page_size * self.page_size
        stops = (hold.branch_point, resend, self._prompt_end(req), shared)
        ahead = [p for p in stops if p > req.num_computed_tokens]
        return min(ahead, default=None)

    def on_computed(self, req: Request, prefill: bool, write: StateWrite | None = None) -> None:
        n, hold = req.num_computed_tokens, req.prefix
        if hold is None or n % self.page_size:
            return
        assert req.slot is not None
        if write is None:
            write = functools.partial(self.state_pool.copy_slot, req.slot)
        # While prefilling, the tokens are exactly the sequence being prefilled.
        kind = self.cache.prefill_snapshot(req.cache_key_ids, n, self._prompt_end(req)) if prefill else None
        if kind is not None:
            if hold.rolling_slot is not None:  # older than the state kept now
                self.state_pool.free_snapshot(hold.rolling_slot)
                hold.rolling_slot = None
            slot = self.cache.alloc_snapshot(tentative=kind == "tentative")
            if slot is not None:
                write(slot)
                self._insert_prefix(req, n, slot, kind)
                hold.rolling_pos = n
                return
        slot, hold.rolling_slot, hold.rolling_pos = hold.rolling_slot, None, n
        if slot is None:
            slot = self.cache.alloc_snapshot()
            if slot is None:  # every snapshot slot is held: no snapshot here
                return
        write(slot)
        hold.rolling_slot = slot

    def _prompt_end(self, req: Request) -> int:
        """Where the prompt end's snapshot goes: the last page boundary of what the next chat
        turn repeats (`SamplingParams.next_turn_len`; the generation prompt's `<think>` is not
        repeated), by default of the whole sequence prefilled."""
        return prompt_end_point(len(req.cache_key_ids), self.page_size, req.params.next_turn_len)

    def _insert_prefix(self, req: Request, n: int, slot: int, kind: SnapshotKind) -> None:
        """Hand the first `n` tokens' pages and the state at `n` to the tree while `req` runs."""
        hold = req.prefix
        assert hold is not None
        k, tentative = n // self.page_size, kind == "tentative"
        prompt_end = n == self._prompt_end(req)
        r = self.cache.insert(
            req.cache_key_ids[:n],
            req.pages[:k],
            {n: slot},
            (n,) if tentative else (),
            (n,) if prompt_end else (),
        )
        self.cache.lock(r.node, pin=False)
        self.cache.unlock(hold.node, pin=False)
        self.kv_pool.free(r.duplicates)
        hold.node, hold.num_shared_pages = r.node, k
        req.pages = r.pages + req.pages[k:]  # a new list: the decode page table rewrites the row
        if prompt_end:
            hold.prompt_end = r.node
        elif tentative and r.node.tentative:
            hold.tentative.append(r.node)
            if len(hold.tentative) > TENTATIVE_PER_PREFILL:
                self.cache.discard_tentative(hold.tentative.pop(0))

    def release(self, req: Request) -> None:
        hold = req.prefix
        if hold is None:  # never admitted: nothing held
            assert not req.pages
            return
        ps = self.page_size
        n_pages = req.num_computed_tokens // ps
        tokens = req.cache_key_ids[: n_pages * ps]
        snaps = {}
        end, pos = hold.rolling_slot, hold.rolling_pos
        if end is not None:
            if self.cache.should_snapshot(tokens, pos, is_end=True):
                snaps[pos] = end
            else:
                self.state_pool.free_snapshot(end)
        spare = req.pages[n_pages:]
        if tokens:
            spare += self.cache.insert(tokens, req.pages[:n_pages], snaps).duplicates
        else:
            assert not snaps
        self.kv_pool.free(spare)
        self.cache.unlock(hold.node, pin=False)
        if snaps and hold.prompt_end is not None and hold.prompt_end.depth < pos:
            self.cache.demote(hold.prompt_end)
        req.pages, req.prefix = [], None

    def flush(self) -> None:
        self.cache.flush()

    @property
    def num_evictable_pages(self) -> int:
        return self.cache.evictable_size

    def stats(self) -> dict[str, Any]:
        c, s = self.cache, self.cache.stats
        return {
            "prefix_cache_hit_rate": s.hit_rate,
            "prefix_cache_hit_tokens": s.hit_tokens,
            "prefix_cache_query_tokens": s.query_tokens,
            "snapshots": c.num_snapshots,
            "snapshot_bytes": c.snapshot_bytes,
            "snapshot_evictions": s.snapshots_evicted,
            "kv_page_evictions": s.kv_pages_evicted,
            "kv_pages_cached": c.evictable_size + c.protected_size,
        }


def _matchable(req: Request) -> list[int]:
    """What of a request may come from the cache: nothing when it asks for its prompt's
    log-probabilities, which only a forward pass over the whole prompt gives."""
    return req.cache_key_ids[:1] if req.params.prompt_logprobs is not None else req.cache_key_ids


def warmup_prompts(prompts: Sequence[list[int]], cache_type: str, page_size: int) -> list[list[int]]:
    """What to prefill once before prompts that run n > 1 times (each a one-token request that
    is released at once), so that the copies find the prompt in the radix cache instead of all
    computing it side by side, as SGLang does: each distinct prompt of two pages or more, less
    its last token, whose state snapshot then lands on the page boundary below the prompt's end
    even for a page-aligned prompt, where each copy resumes. Nothing without the radix cache."""
    if cache_type != "radix":
        return []
    unique = {tuple(p): p for p in prompts if len(p) >= 2 * page_size}
    return [p[:-1] for p in unique.values()]


def warmup_params() -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, output_kind="final_only", internal=True
    )


def scores_once(params: SamplingParams, copies: int) -> bool:
    """Whether a prompt run `copies` > 1 times with these params has its prompt logprobs
    computed once, by a scoring warm-up (`scoring_params`), and shared by the copies (which then
    drop them, `unscored`): they depend on the prompt alone. Not with max_tokens 0, which is
    valid only with prompt_logprobs."""
    return copies > 1 and params.prompt_logprobs is not None and params.max_tokens != 0


def scoring_params(params: SamplingParams) -> SamplingParams:
    """The warm-up that computes a prompt's logprobs for its copies, as each would have."""
    return dataclasses.replace(  # max_tokens 0: the prompt's forward pass only
        warmup_params(),
        max_tokens=0,
        prompt_logprobs=params.prompt_logprobs,
        prompt_logprob_token_ids=params.prompt_logprob_token_ids,
        priority=params.priority,  # the copies wait for it
        cache_salt=params.cache_salt,  # the copies hit it
    )


def unscored(params: SamplingParams) -> SamplingParams:
    """A copy whose prompt logprobs come from the scoring warm-up: free to hit the prefix cache."""
    return dataclasses.replace(params, prompt_logprobs=None, prompt_logprob_token_ids=None)


def prefill_cost(model_config: Any, layer_types: Sequence[str], num_params: int) -> HybridPrefillCost:
    """The model's prefill FLOPs by prefix length, for Marconi's FLOPs saved per byte.

    All parameters count as active (an over-estimate for MoE, which weighs the attention
    layers' quadratic term a little less than it should)."""
    heads = int(getattr(model_config, "num_attention_heads", 1))
    head_dim = getattr(model_config, "head_dim", None) or int(model_config.hidden_size) // heads
    num_attention = sum(t != "linear_attention" for t in layer_types)
    return HybridPrefillCost.from_config(float(num_params), num_attention, heads, int(head_dim))


def make_prefix_cache(
    config: EngineConfig,
    kv_pool: KVPool,
    state_pool: StatePool,
    prefix_flops: Callable[[int], float] | None = None,
) -> PrefixCache:
    if config.cache_type == "naive":
        return NaivePrefixCache(kv_pool, state_pool)
    return RadixPrefixCache(
        kv_pool, state_pool, config.prefix_cache_policy, config.prefix_cache_alpha, prefix_flops
    )
