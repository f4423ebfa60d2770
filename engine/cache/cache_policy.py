"""Snapshot policies of the radix prefix cache: which recurrent-state snapshots to admit, which to drop.

A snapshot holds every linear layer's conv and recurrent state at one position. It is
large (Qwen3-Next: ~72 MiB, the KV of ~3k tokens) and reusable only by a prompt that
continues exactly that prefix, so most offered snapshots are never hit. The policies:

- ``marconi`` (Marconi, arXiv 2411.19379): admit only snapshots at branch points and
  sequence ends (speculative insertion); evict by utility
  ``recency + alpha * flops_saved / bytes``, both terms min-max normalised over the
  candidates, lowest first. Snapshots at nodes with two or more children (shared
  prefixes) are evicted only when nothing else is left, as in the paper.
- ``branch_lru``: Marconi's admission, LRU eviction.
- ``every_chunk_lru``: admit every offered snapshot (each prefill-chunk boundary), LRU
  eviction; the fine-grained checkpointing baseline of vLLM / SGLang.

Under every policy the radix cache also keeps each prompt's end, and some chunk boundaries as
tentative snapshots with a quota of their own (radix_cache.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class SnapshotNode(Protocol):
    """What a policy may read off a tree node."""

    @property
    def depth(self) -> int: ...  # tokens from the root to the snapshot's position
    @property
    def snapshot_access(self) -> int: ...  # logical clock of the snapshot's last insert or hit
    @property
    def num_children(self) -> int: ...


@dataclass(frozen=True)
class HybridPrefillCost:
    """Prefill FLOPs of a hybrid model as a function of prefix length L.

    `linear_per_token` covers everything whose cost grows with L (projections, MLP / MoE,
    linear-attention layers); `attention_per_token_pair` the full-attention layers' score and
    value products, which grow with L^2 / 2.
    """

    linear_per_token: float
    attention_per_token_pair: float

    def __call__(self, length: int) -> float:
        return self.linear_per_token * length + self.attention_per_token_pair * length * length / 2

    @staticmethod
    def from_config(
        active_params: float, num_attention_layers: int, num_heads: int, head_dim: int
    ) -> HybridPrefillCost:
        # 2 FLOPs per weight per token; QK^T and PV are 2 * 2 * heads * head_dim per token pair.
        return HybridPrefillCost(2.0 * active_params, 4.0 * num_attention_layers * num_heads * head_dim)


# Qwen3-Next-80B-A3B: ~3B active parameters, 12 gated-attention layers of 16 heads x 256.
QWEN3_NEXT_PREFILL_COST = HybridPrefillCost.from_config(3.0e9, 12, 16, 256)


class SnapshotPolicy(ABC):
    """Admission (a flag) and eviction order of snapshots."""

    name: str
    admit_every_chunk: bool  # False: only branch points and sequence ends are admitted

    @abstractmethod
    def victims(self, candidates: Sequence[SnapshotNode], n: int) -> list[SnapshotNode]:
        """The `n` (or fewer) candidates to drop first; every candidate is unlocked."""


class LRUPolicy(SnapshotPolicy):
    def __init__(self, name: str, admit_every_chunk: bool) -> None:
        self.name = name
        self.admit_every_chunk = admit_every_chunk

    def victims(self, candidates: Sequence[SnapshotNode], n: int) -> list[SnapshotNode]:
        return sorted(candidates, key=lambda c: (c.snapshot_access, c.depth))[:n]


class MarconiPolicy(SnapshotPolicy):
    name = "marconi"
    admit_every_chunk = False

    def __init__(self, alpha: float, prefix_flops: Callable[[int], float], snapshot_bytes: int) -> None:
        self.alpha = alpha
        self.prefix_flops = prefix_flops
        self.snapshot_bytes = max(snapshot_bytes, 1)

    def victims(self, candidates: Sequence[SnapshotNode], n: int) -> list[SnapshotNode]:
        # Branch points serve every sequence below them; drop them only when nothing else is left.
        single = [c for c in candidates if c.num_children < 2]
        shared = [c for c in candidates if c.num_children >= 2]
        chosen = self._by_utility(single)[:n]
        if len(chosen) < n:
            chosen += self._by_utility(shared)[: n - len(chosen)]
        return chosen

    def _by_utility(self, nodes: Sequence[SnapshotNode]) -> list[SnapshotNode]:
        if not nodes:
            return []
        recency = _normalise([float(c.snapshot_access) for c in nodes])
        # A hit on a snapshot at depth L skips the whole prefix's prefill: FLOPs per byte held.
        efficiency = _normalise([self.prefix_flops(c.depth) / self.snapshot_bytes for c in nodes])
        utility = [r + self.alpha * e for r, e in zip(recency, efficiency)]
        order = sorted(range(len(nodes)), key=lambda i: (utility[i], nodes[i].snapshot_access))
        return [nodes[i] for i in order]


def _normalise(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi <= lo:
        return [0.0] * len(values)
    return [(v - lo) / (hi - lo) for v in values]


Ranked = TypeVar("Ranked", bound=SnapshotNode)

# A ranking serves this fraction of the candidates' count in evictions before it is redone.
RERANK_FRACTION = 16


class VictimQueue(Generic[Ranked]):
    """Victims in a policy's order, ranked once for several evictions.

    Ranking every candidate is O(N log N) Python and a busy server evicts a snapshot for nearly
    every prompt it admits, so `rank(k)` gives the first max(k, N / RERANK_FRACTION) at once and
    later evictions take from them. A ranked node hit, pinned, dropped or made a branch point
    since (`still(node)` false, or its access or branch state changed) is passed over, and a
    snapshot added since waits for the next ranking: with LRU the order is exact (the newest go
    last anyway), with Marconi's utility it is at most that many evictions old. Below
    RERANK_FRACTION candidates every eviction ranks afresh.
    """

    def __init__(self, rank: Callable[[int], list[Ranked]], still: Callable[[Ranked], bool]) -> None:
        self._rank, self._still = rank, still
        self._queue: deque[tuple[Ranked, int, bool]] = deque()

    def take(self, n: int) -> list[Ranked]:
        """Up to `n` victims, each still a candidate now."""
        out: list[Ranked] = []
        taken: set[int] = set()  # a new ranking lists again the victims taken from the last one
        fresh = False
        while len(out) < n:
            if not self._queue:
                if fresh:  # a new ranking gave no more: nothing else is a candidate
                    break
                self._queue.extend((c, c.snapshot_access, c.num_children >= 2) for c in self._rank(n))
                fresh = True
                continue
            node, access, shared = self._queue.popleft()
            if id(node) in taken:
                continue
            if self._still(node) and node.snapshot_access == access and (node.num_children >= 2) == shared:
                out.append(node)
                taken.add(id(node))
        return out


def ranking_size(n: int, num_candidates: int) -> int:
    """How many a ranking of `num_candidates` for `n` victims takes: `n`, or more to amortise it."""
    return max(n, num_candidates // RERANK_FRACTION)


POLICIES = ("marconi", "branch_lru", "every_chunk_lru")


def make_policy(
    name: str, alpha: float, prefix_flops: Callable[[int], float], snapshot_bytes: int
) -> SnapshotPolicy:
    if name == "marconi":
        return MarconiPolicy(alpha, prefix_flops, snapshot_bytes)
    if name == "branch_lru":
        return LRUPolicy(name, admit_every_chunk=False)
    if name == "every_chunk_lru":
        return LRUPolicy(name, admit_every_chunk=True)
    raise ValueError(f"unknown snapshot policy {name!r}; expected one of {', '.join(POLICIES)}")
