"""The radix prefix cache's node, its results, a running request's hold on it and its counters
(see `radix_cache`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class KVPool(Protocol):
    @property
    def page_size(self) -> int: ...

    def alloc(self, n: int) -> list[int] | None: ...
    def free(self, pages: list[int]) -> None: ...
    @property
    def num_free(self) -> int: ...


class StatePool(Protocol):
    @property
    def snapshot_bytes(self) -> int: ...  # one snapshot, all linear layers

    def alloc_snapshot(self) -> int | None: ...
    def free_snapshot(self, slot: int) -> None: ...
    def copy_slot(self, src: int, dst: int) -> None: ...


@dataclass(eq=False)
class Node:
    """An edge of the tree and the position at its end.

    `key` is a whole number of pages of tokens and `pages` their KV pages; a `snapshot`, when
    present, is the recurrent state after the last token of `key`, i.e. at `depth`. A
    `tentative` snapshot is kept on speculation (a prefill chunk boundary, a prompt end once
    its sequence's end is cached), within a quota of its own; it becomes a regular one once it
    serves a hit or a branch.
    """

    key: tuple[int, ...]
    pages: list[int]
    parent: Node | None
    depth: int
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    snapshot: int | None = None
    tentative: bool = False
    # kept on a guess (a tentative snapshot, a prompt end's): its eviction, if a later hit
    # would have used it, raises the tentative quota
    speculative: bool = False
    # The kind of snapshot evicted here lately: a later hit that it would have served adapts
    # the tentative quota.
    evicted: str | None = None
    # Locks held on this node or on a node below it: none of this node's pages may go.
    lock_ref: int = 0
    # Locks held on exactly this node: its snapshot may not go either.
    pins: int = 0
    last_access: int = 0
    snapshot_access: int = 0

    @property
    def num_children(self) -> int:
        return len(self.children)


@dataclass(frozen=True)
class MatchResult:
    """The deepest cached prefix that a prompt can start from.

    `length` tokens (a multiple of the page size, less than the prompt's length) are covered
    by `pages`; `snapshot_slot` holds the linear layers' state after them (None on a miss,
    with `length` 0). Lock `node` while the request runs.
    """

    length: int
    pages: list[int]
    snapshot_slot: int | None
    node: Node


@dataclass(eq=False)
class CacheHold:
    """What a running request holds of the radix cache, from admission to release."""

    node: Node  # locked: the pages from the root to it are the tree's (pinned until commit)
    snapshot_slot: int | None  # the matched snapshot, copied in at commit
    num_shared_pages: int  # the head of `req.pages` that belongs to the tree
    branch_point: int  # a prefill chunk ends here (0: nowhere)
    tentative: list[Node] = field(default_factory=list)  # this prefill's tentative snapshots
    prompt_end: Node | None = None  # where this prefill's prompt-end snapshot went
    rolling_slot: int | None = None  # the state at `rolling_pos`, the last page boundary landed on
    rolling_pos: int = 0


@dataclass(frozen=True)
class InsertResult:
    """`node` ends at the inserted tokens (lock it to keep them); `pages` are the tree's pages
    for them (a running request switches its page table to these); `duplicates` are pages
    the caller passed that the tree already had under other ids: the caller frees them."""

    node: Node
    pages: list[int]
    duplicates: list[int]


@dataclass
class CacheStats:
    query_tokens: int = 0  # prompt tokens seen by match_prefix
    hit_tokens: int = 0  # of those, served from the cache
    kv_pages_evicted: int = 0
    snapshots_admitted: int = 0
    snapshots_evicted: int = 0
    tentative_hit_tokens: int = 0  # hit_tokens served by a tentative snapshot

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
