"""Radix prefix cache for hybrid models: KV pages for the attention layers, recurrent-state
snapshots for the linear layers.

A linear layer's state exists only where it was saved, so a prompt can start only from a
node that holds a snapshot; KV pages and snapshots are kept and evicted separately. Keys are
token ids in whole pages (`page_size`); every node boundary is a page boundary.

The engine's calls, in order (see docs/prefix_cache.md):

1. admission: ``m = cache.match_prefix(prompt)``; ``cache.lock(m.node)``; copy
   ``m.snapshot_slot`` into the request's working slot (``state_pool.copy_slot``) and put
   ``m.pages`` at the head of its page table; prefill starts at ``m.length``.
2. ``bp = cache.branch_point(prompt)``: split the prefill so that a chunk ends at ``bp``, and
   at ``resend_point(len(prompt))``, so that the prompt's end leaves a state to keep.
3. after each prefill chunk ending at a page-aligned ``p``: ``kind = cache.prefill_snapshot(
   prompt, p)``; if it is not None, ``slot = cache.alloc_snapshot(tentative=...)``, copy the
   working slot into it and insert at once: ``r = cache.insert(prompt[:p], pages, {p: slot},
   tentative=...)``; lock ``r.node`` (``pin=False``: the request no longer reads the
   snapshot), unlock the old node, free ``r.duplicates``, switch to ``r.pages``. Of one
   prefill's tentative snapshots keep the last ``TENTATIVE_PER_PREFILL``
   (``discard_tentative`` the older ones).
4. at finish, with ``seq`` the tokens whose state the working slot holds trimmed to whole
   pages, ``cache.should_snapshot(seq, len(seq), is_end=True)`` decides the end snapshot;
   ``r = cache.insert(seq, pages[:len(seq) // page_size], {len(seq): slot})``; free
   ``r.duplicates`` and the pages past ``seq``; unlock the request's node. When the end
   snapshot lies past the prompt end's, ``demote`` the prompt end's.
5. when a pool runs dry: ``cache.alloc_kv(n)`` / ``cache.alloc_snapshot()`` evict and retry
   (``evict_kv``: LRU unlocked leaves, snapshot-less ones first; ``evict_snapshots``:
   regular snapshots in the policy's order, then tentative ones; an inner node's KV stays).
   ``flush()`` frees everything unlocked.

Tentative snapshots (a prefill's chunk-boundary states, kept so that the first request to
branch off a shared prefix already hits) are bounded twice: the last
``TENTATIVE_PER_PREFILL`` of each prefill, and a quota that applies once the snapshot area
is full: then a new tentative snapshot replaces the oldest one when they fill the quota, and
tentative snapshots over it are the first to go. A prompt end's snapshot joins them once its
sequence's end is cached (which serves a continuation as well). A hit or a second child below
one makes it regular. The quota starts at half of ``max_tentative`` (`tentative_cap`: half
the snapshot slots) and adapts as ARC does with its ghost lists: a hit that a lately evicted
snapshot kept on a guess (tentative, or a prompt end's) would have served raises it by one,
one that another evicted snapshot would have served lowers it by one (never below one).

Ownership: pages and snapshot slots passed to `insert` belong to the tree afterwards, except
the returned duplicates; a snapshot the tree already has at a position is freed by the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Literal

from deltaserve.engine.cache.cache_policy import VictimQueue, make_policy, ranking_size
from deltaserve.engine.cache.radix_node import CacheStats, InsertResult, KVPool, MatchResult, Node, StatePool

__all__ = ["RadixCache", "MatchResult", "InsertResult", "CacheStats", "Node", "SnapshotKind"]

SnapshotKind = Literal["regular", "tentative"]

# A branch off a shared prefix most often comes within the last chunk or two of the prompt
# that first sent it (a question after a system prompt, an issue after a tool prompt).
TENTATIVE_PER_PREFILL = 2


def tentative_cap(num_snapshot_slots: int) -> int:
    """Tentative snapshots the tree holds at most: half the snapshot slots, so that half stay
    for regular snapshots and the requests' rolling states."""
    return num_snapshot_slots // 2


def prompt_end_point(num_tokens: int, page_size: int, next_turn_len: int | None = None) -> int:
    """Where a prompt's end state is kept: the last page boundary within its first
    `next_turn_len` tokens (what the next chat turn repeats), by default within all of them."""
    n = num_tokens if next_turn_len is None else max(0, min(num_tokens, next_turn_len))
    return n // page_size * page_size


def resend_point(num_tokens: int, page_size: int) -> int:
    """The last page boundary before a sequence's last token: the deepest state that a resend
    of the same sequence can start from (its last token is always recomputed)."""
    return (num_tokens - 1) // page_size * page_size


class RadixCache:
    def __init__(
        self,
        kv_pool: KVPool,
        state_pool: StatePool,
        page_size: int,
        policy: str = "marconi",
        alpha: float = 1.0,
        prefix_flops: Callable[[int], float] | None = None,
        max_tentative: int = 0,
    ) -> None:
        self.kv_pool, self.state_pool, self.page_size = kv_pool, state_pool, page_size
        self.max_tentative = max_tentative
        self.tentative_quota = max_tentative // 2
        # nodes whose snapshot was evicted lately (`Node.evicted`), oldest first
        self._ghosts: dict[Node, None] = {}
        # Without a model's cost, FLOPs saved grow with the prefix: deeper snapshots are worth more.
        self.policy = make_policy(policy, alpha, prefix_flops or float, state_pool.snapshot_bytes)
        self.root = Node(key=(), pages=[], parent=None, depth=0)
        self.stats = CacheStats()
        self.evictable_size = 0  # pages in nodes no lock reaches
        self.protected_size = 0  # pages in nodes on a locked path
        self._snapshot_nodes: set[Node] = set()
        self._tentative_nodes: set[Node] = set()
        self._clock = 0
        self._regular_victims = VictimQueue(
            self._rank_regular, lambda n: n in self._snapshot_nodes and not n.pins and not n.tentative
        )
        self._tentative_victims = VictimQueue(
            self._rank_tentative, lambda n: n in self._tentative_nodes and not n.pins
        )

    # ---- lookups -----------------------------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], record: bool = True, count: bool = True) -> MatchResult:
        """The deepest node with a snapshot strictly inside `token_ids` (the last token is always
        recomputed, for its logits). `record=False` peeks without touching stats or recency;
        `count=False` records recency but leaves the hit statistics alone (a server's own request)."""
        path, _ = self._walk(tuple(token_ids[: len(token_ids) - 1]))
        hits = [i for i, n in enumerate(path) if n.snapshot is not None]
        used = path[: hits[-1] + 1] if hits else []
        hit = used[-1] if used else self.root
        if record:
            self._clock += 1
            for n in used:
                n.last_access = self._clock
            hit.snapshot_access = self._clock
            if count:
                self.stats.query_tokens += len(token_ids)
                self.stats.hit_tokens += hit.depth
                if hit.tentative:
                    self.stats.tentative_hit_tokens += hit.depth
            self._learn(path, hit.depth)
            if hit.tentative:
                self._promote(hit)
        pages = [p for n in used for p in n.pages]
        return MatchResult(hit.depth, pages, hit.snapshot, hit)

    def branch_point(self, token_ids: Sequence[int]) -> int:
        """How far (in whole pages) `token_ids` follows the tree's KV, snapshots or not."""
        path, partial = self._walk(tuple(token_ids))
        return (path[-1].depth if path else 0) + partial * self.page_size

    def should_snapshot(self, token_ids: Sequence[int], length: int, is_end: bool = False) -> bool:
        """Whether the policy admits a snapshot of the state after `token_ids[:length]`.

        Offer every page-aligned prefill-chunk end and the branch point (`is_end=False`) and
        the finished sequence's end (`is_end=True`). Marconi and branch_lru admit a chunk end
        only where the prompt leaves the tree inside an edge or at a node with children.
        """
        tokens = tuple(token_ids)
        if not self._offerable(tokens, length):
            return False
        if self.policy.admit_every_chunk or is_end:
            return True
        # A branch: the prompt goes on past `length` where the tree also goes on, differently.
        path, partial = self._walk(tokens)
        end = path[-1] if path else self.root
        tree_goes_on = partial > 0 or bool(end.children)
        return tree_goes_on and end.depth + partial * self.page_size == length < len(tokens)

    def prefill_snapshot(
        self, token_ids: Sequence[int], length: int, prompt_end: int | None = None
    ) -> SnapshotKind | None:
        """How to keep the state after a prefill chunk that ends at `length`, `token_ids` being
        the whole sequence prefilled: a regular snapshot at the prompt's end (`prompt_end`, by
        default the last page boundary of `token_ids`: the next chat turn and a resend start
        there) and wherever `should_snapshot` admits one; a tentative one at any other
        page-aligned chunk end while `max_tentative` allows them; else none."""
        tokens = tuple(token_ids)
        if not self._offerable(tokens, length):
            return None
        if prompt_end is None:
            prompt_end = len(tokens) // self.page_size * self.page_size
        if length == prompt_end or self.should_snapshot(tokens, length):
            return "regular"
        return "tentative" if self.max_tentative > 0 else None

    # ---- locks -------------------------------------------------------------------------

    def lock(self, node: Node, pin: bool = True) -> None:
        """Protect every page from the root to `node`, and with `pin` its snapshot too."""
        node.pins += pin
        for n in self._ancestry(node):
            if n.lock_ref == 0:
                self.evictable_size -= len(n.pages)
                self.protected_size += len(n.pages)
            n.lock_ref += 1

    def unlock(self, node: Node, pin: bool = True) -> None:
        """Undo `lock(node, pin)`."""
        assert node.pins >= pin and (node.lock_ref > 0 or node is self.root), "unlock without lock"
        node.pins -= pin
        for n in self._ancestry(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.evictable_size += len(n.pages)
                self.protected_size -= len(n.pages)

    # ---- insertion ---------------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int],
        kv_pages: Sequence[int],
        snapshots: Mapping[int, int] | None = None,
        tentative: Collection[int] = (),
        speculative: Collection[int] = (),
    ) -> InsertResult:
        """Add `token_ids` (whole pages) with their KV `kv_pages` and `snapshots`
        ({length: slot}, each length page-aligned in (0, len(token_ids)]); the snapshots at
        the lengths in `tentative` are tentative (a regular one where the tree has a
        tentative one makes that regular), those in `speculative` (a prompt end's) are
        regular but kept on a guess, as tentative ones are, for the quota's adaptation."""
        tokens, ps, snaps = tuple(token_ids), self.page_size, dict(snapshots or {})
        assert len(tokens) % ps == 0 and len(kv_pages) * ps == len(tokens), "insert whole pages"
        assert all(0 < p <= len(tokens) and p % ps == 0 for p in snaps), "snapshots at page ends"
        self._clock += 1
        cuts = sorted(snaps)
        node, pos, tree_pages, duplicates, at = self.root, 0, [], [], {0: self.root}
        while pos < len(tokens):
            stop = next((c for c in cuts if c > pos), len(tokens))
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                child = Node(tokens[pos:stop], list(kv_pages[pos // ps : stop // ps]), node, stop)
                node.children[tokens[pos : pos + ps]] = child
                self.evictable_size += len(child.pages)
                if node.tentative and node.num_children >= 2:  # a branch point now
                    self._promote(node)
            else:
                k = min(self._common_pages(child.key, tokens, pos), (stop - pos) // ps)
                if k < len(child.pages):
                    child = self._split(child, k)
                mine = kv_pages[pos // ps : pos // ps + k]
                duplicates += [m for m, t in zip(mine, child.pages) if m != t]
            child.last_access = self._clock
            tree_pages += child.pages
            node, pos = child, child.depth
            at[pos] = node
        for length, slot in snaps.items():
            target = at[length]
            if target.snapshot is None:
                target.snapshot, target.snapshot_access = slot, self._clock
                target.speculative = length in tentative or length in speculative
                self._snapshot_nodes.add(target)
                self.stats.snapshots_admitted += 1
                if length in tentative and target.num_children < 2:
                    target.tentative = True
                    self._tentative_nodes.add(target)
            else:
                self.state_pool.free_snapshot(slot)
                if target.tentative and length not in tentative:
                    self._promote(target)
        return InsertResult(node, tree_pages, duplicates)

    # ---- eviction ----------------------------------------------------------------------

    def alloc_kv(self, n: int) -> list[int] | None:
        """`n` pages from the KV pool, evicting cached pages when it runs short."""
        if self.kv_pool.num_free < n:
            self.evict_kv(n - self.kv_pool.num_free)
        return self.kv_pool.alloc(n)

    def alloc_snapshot(self, tentative: bool = False) -> int | None:
        """A snapshot slot, evicting a cached snapshot when the area is full: for a `tentative`
        one, the oldest tentative one when they fill the quota (and then nothing else)."""
        slot = self.state_pool.alloc_snapshot()
        if slot is None:
            if tentative and self.num_tentative >= self.tentative_quota:
                evicted = self._evict_tentative(1)
            else:
                evicted = self.evict_snapshots(1)
            slot = self.state_pool.alloc_snapshot() if evicted else None
        return slot

    def evict_kv(self, num_pages: int) -> int:
        """Free at least `num_pages` pages (fewer if too much is locked) by removing unlocked
        leaves, least recently used first; leaves without a snapshot go first, since no
        prompt can start inside them. Returns the number of pages freed."""

        def entry(n: Node) -> tuple[bool, int, int, Node]:
            return (n.snapshot is not None, n.last_access, id(n), n)

        heap = [entry(n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            node = heapq.heappop(heap)[-1]
            assert node.parent is not None
            self.kv_pool.free(node.pages)
            freed += len(node.pages)
            self.evictable_size -= len(node.pages)
            if node.snapshot is not None:
                self._drop_snapshot(node, ghost=False)  # no prompt reaches it any more
            parent = node.parent
            del parent.children[node.key[: self.page_size]]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, entry(parent))
        self.stats.kv_pages_evicted += freed
        return freed

    def evict_snapshots(self, n: int) -> int:
        """Drop up to `n` unpinned snapshots, regular ones in the policy's order, then tentative
        ones oldest first (their quota keeps them from crowding regular ones out; evicting them
        first would leave none once the area is full); their nodes' KV stays."""
        dropped = self._evict_tentative(min(n, self.num_tentative - self.tentative_quota))
        victims = self._regular_victims.take(n - dropped)
        for node in victims:
            self._drop_snapshot(node)
        dropped += len(victims)
        return dropped + self._evict_tentative(n - dropped)

    def _rank_regular(self, n: int) -> list[Node]:
        candidates = [node for node in self._snapshot_nodes if node.pins == 0 and not node.tentative]
        return self.policy.victims(candidates, ranking_size(n, len(candidates)))  # type: ignore[return-value]

    def _rank_tentative(self, n: int) -> list[Node]:
        candidates = [node for node in self._tentative_nodes if node.pins == 0]
        candidates.sort(key=lambda node: (node.snapshot_access, node.depth))
        return candidates[: ranking_size(n, len(candidates))]

    def demote(self, node: Node) -> bool:
        """Make `node`'s regular snapshot tentative, unless it is pinned or a branch point."""
        if node.snapshot is None or node.tentative or node.pins or node.num_children >= 2:
            return False
        node.tentative = node.speculative = True
        self._tentative_nodes.add(node)
        return True

    def discard_tentative(self, node: Node) -> bool:
        """Drop `node`'s snapshot if it is still tentative and unpinned."""
        if not node.tentative or node.pins:
            return False
        self._drop_snapshot(node, ghost=False)
        return True

    def flush(self) -> None:
        """Free every page and snapshot no lock holds."""
        self.evict_snapshots(len(self._snapshot_nodes))
        self.evict_kv(self.evictable_size)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshot_nodes)

    @property
    def num_tentative(self) -> int:
        return len(self._tentative_nodes)

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.state_pool.snapshot_bytes

    # ---- internals ---------------------------------------------------------------------

    def _offerable(self, tokens: tuple[int, ...], length: int) -> bool:
        """`length` is a page boundary within `tokens` where the tree holds no snapshot yet."""
        if length <= 0 or length % self.page_size or length > len(tokens):
            return False
        path, partial = self._walk(tokens[:length])
        return not (partial == 0 and path and path[-1].depth == length and path[-1].snapshot is not None)

    def _learn(self, path: list[Node], hit: int) -> None:
        """Adapt the tentative quota to a hit that a lately evicted snapshot would have deepened."""
        ghost = next((n for n in reversed(path) if n.depth > hit and n.evicted is not None), None)
        if ghost is None:
            return
        step = 1 if ghost.evicted == "tentative" else -1
        self.tentative_quota = min(self.max_tentative, max(1, self.tentative_quota + step))
        ghost.evicted = None
        del self._ghosts[ghost]

    def _evict_tentative(self, n: int) -> int:
        if n <= 0:
            return 0
        victims = self._tentative_victims.take(n)
        for node in victims:
            self._drop_snapshot(node)
        return len(victims)

    def _promote(self, node: Node) -> None:
        node.tentative = False
        self._tentative_nodes.discard(node)

    def _drop_snapshot(self, node: Node, ghost: bool = True) -> None:
        assert node.snapshot is not None
        self.state_pool.free_snapshot(node.snapshot)
        if ghost and self.max_tentative:
            node.evicted = "tentative" if node.speculative else "regular"
            self._ghosts.pop(node, None)
            self._ghosts[node] = None
            if len(self._ghosts) > 2 * self.max_tentative:  # as many as there are slots
                oldest = next(iter(self._ghosts))
                oldest.evicted = None
                del self._ghosts[oldest]
        node.snapshot = None
        self._snapshot_nodes.discard(node)
        self._promote(node)
        self.stats.snapshots_evicted += 1

    def _walk(self, tokens: tuple[int, ...]) -> tuple[list[Node], int]:
        """Nodes whose whole key `tokens` covers from the root down, and how many pages of
        the next edge it covers beyond them."""
        ps, node, pos = self.page_size, self.root, 0
        path: list[Node] = []
        while pos + ps <= len(tokens):
            child = node.children.get(tokens[pos : pos + ps])
            if child is None:
                return path, 0
            k = self._common_pages(child.key, tokens, pos)
            if k < len(child.pages):
                return path, k
            path.append(child)
            node, pos = child, child.depth
        return path, 0

    def _common_pages(self, key: tuple[int, ...], tokens: tuple[int, ...], pos: int) -> int:
        if tokens[pos : pos + len(key)] == key:
            return len(key) // self.page_size
        ps, k = self.page_size, 0
        while (k + 1) * ps <= len(key) and tokens[pos + k * ps : pos + (k + 1) * ps] == key[
            k * ps : (k + 1) * ps
        ]:
            k += 1
        return k

    def _split(self, child: Node, k: int) -> Node:
        """Cut `child`'s edge after `k` pages; the new upper node is returned, `child` keeps
        its depth (and so its snapshot and its handles stay valid)."""
        ps, parent = self.page_size, child.parent
        assert parent is not None and 0 < k < len(child.pages)
        upper = Node(child.key[: k * ps], child.pages[:k], parent, child.depth - len(child.key) + k * ps)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.key, child.pages, child.parent = child.key[k * ps :], child.pages[k:], upper
        parent.children[upper.key[:ps]] = upper
        upper.children[child.key[:ps]] = child
        return upper

    def _ancestry(self, node: Node) -> Iterator[Node]:
        while node.parent is not None:
            yield node
            node = node.parent

    def _nodes(self) -> Iterator[Node]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
