"""The scheduler's side of prefix caching: what a request takes from the cache at admission,
which snapshots it saves while it runs, and what it hands back when it leaves.

`NaivePrefixCache` (``cache_type="naive"``) reuses nothing. `RadixPrefixCache` drives
`RadixCache` by the contract in radix_cache.py:

- admission is two-phase: `attach` matches (without recording) and locks, so that page
  allocation may evict anything but the matched path; `commit` records the hit and copies the
  snapshot into the working slot, or `detach` undoes it when admission fails;
- the matched pages head the request's page table and stay the tree's: the request writes
  KV only from the (page-aligned) match length on, so it never writes them, and never frees
  them;
- a prefill chunk ends at the branch point (and at the last page boundary of the sequence
  when max_tokens is too short for decoding to reach the next one); page-aligned chunk ends
  are offered as snapshots; and whenever the computed length lands on a page boundary the working slot is
  copied into the request's rolling slot, so that at release there is a state exactly at a
  page boundary to insert as the end snapshot (no extra forward pass);
- `release` (finish, abort, preemption) inserts the computed tokens, trimmed to whole pages,
  with the request's snapshots: their KV and states are complete whatever the reason the
  request stops, and a preempted request's recompute then hits its own prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deltaserve.engine.cache_policy import HybridPrefillCost
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.kv_pool import KVPool
from deltaserve.engine.radix_cache import RadixCache
from deltaserve.engine.radix_node import Node
from deltaserve.engine.request import Request
from deltaserve.engine.sampling_params import SamplingParams
from deltaserve.engine.state_pool import StatePool


@dataclass(eq=False)
class CacheHold:
    """What a running request holds of the radix cache, from admission to release."""

    node: Node  # locked: the matched path's pages and snapshot stay
    snapshot_slot: int | None  # the matched snapshot, copied in at commit
    num_shared_pages: int  # the head of `req.pages` that belongs to the tree
    branch_point: int  # a prefill chunk ends here (0: nowhere)
    snapshots: dict[int, int] = field(default_factory=dict)  # position -> slot, for insertion
    rolling_slot: int | None = None  # the state at `rolling_pos`, the last page boundary landed on
    rolling_pos: int = 0


class PrefixCache(ABC):
    """The scheduler's interface to a prefix cache (see the module docstring for the order)."""

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
    def on_computed(self, req: Request, prefill: bool) -> None:
        """`req.num_computed_tokens` just advanced past a forward pass."""

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

    def on_computed(self, req: Request, prefill: bool) -> None:
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
        self.cache = RadixCache(kv_pool, state_pool, self.page_size, policy, alpha, prefix_flops)

    def alloc_pages(self, n: int) -> list[int] | None:
        return self.cache.alloc_kv(n)

    def attach(self, req: Request) -> None:
        assert req.prefix is None and not req.pages and req.num_computed_tokens == 0
        tokens = req.all_token_ids  # after a preemption: prompt and output, all recomputed
        # Peek only: admission may still fail for want of pages and be retried every step.
        m = self.cache.match_prefix(tokens, record=False)
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
        m = self.cache.match_prefix(req.all_token_ids)
        assert m.node is hold.node and m.length == req.num_computed_tokens
        if hold.snapshot_slot is not None:
            assert req.slot is not None
            self.state_pool.copy_slot(hold.snapshot_slot, req.slot)  # copy-on-write
        if req.num_preemptions == 0:
            req.num_cached_tokens = m.length

    def detach(self, req: Request) -> None:
        hold = req.prefix
        assert hold is not None and not hold.snapshots and hold.rolling_slot is None
        self.kv_pool.free(req.pages[hold.num_shared_pages :])
        self.cache.unlock(hold.node)
        req.pages, req.prefix = [], None
        req.num_computed_tokens, req.has_initial_state = 0, False

    def prefill_stop(self, req: Request) -> int | None:
        hold = req.prefix
        if hold is None:
            return None
        ahead = [p for p in (hold.branch_point, self._last_page_start(req)) if p > req.num_computed_tokens]
        return min(ahead, default=None)

    def _last_page_start(self, req: Request) -> int:
        """Where the sequence's last, partial page starts, if decoding cannot land on a page
        boundary (max_tokens too short to reach the next one); else 0.

        Ending a prefill chunk there leaves a page-aligned state for the end snapshot, so
        that the next turn of a short exchange hits; it costs a step, not a token."""
        n, ps = req.num_tokens, self.page_size
        assert req.params.max_tokens is not None
        most = n + req.params.max_tokens - len(req.output_token_ids) - 1  # computed at finish
        if n % ps == 0 or most // ps > n // ps:
            return 0
        return n // ps * ps

    def on_computed(self, req: Request, prefill: bool) -> None:
        n, hold = req.num_computed_tokens, req.prefix
        if hold is None or n % self.page_size:
            return
        slot, hold.rolling_slot, hold.rolling_pos = hold.rolling_slot, None, n
        if slot is None:
            slot = self.cache.alloc_snapshot()
            if slot is None:  # every snapshot slot is held: no snapshot here
                return
        assert req.slot is not None
        self.state_pool.copy_slot(req.slot, slot)
        if prefill and self.cache.should_snapshot(req.all_token_ids, n):
            hold.snapshots[n] = slot
        else:
            hold.rolling_slot = slot

    def release(self, req: Request) -> None:
        hold = req.prefix
        if hold is None:  # never admitted: nothing held
            assert not req.pages
            return
        ps = self.page_size
        n_pages = req.num_computed_tokens // ps
        tokens = req.all_token_ids[: n_pages * ps]
        snaps = dict(hold.snapshots)
        end, pos = hold.rolling_slot, hold.rolling_pos
        if end is not None:
            if pos not in snaps and self.cache.should_snapshot(tokens, pos, is_end=True):
                snaps[pos] = end
            else:
                self.state_pool.free_snapshot(end)
        spare = req.pages[n_pages:]
        if tokens:
            spare += self.cache.insert(tokens, req.pages[:n_pages], snaps).duplicates
        else:
            assert not snaps
        self.kv_pool.free(spare)
        self.cache.unlock(hold.node)
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
    return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind="final_only")


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
