"""Radix prefix cache: randomized operations against a reference model, and policy behaviour."""

from __future__ import annotations

import random

import pytest

from deltaserve.engine.cache.cache_policy import QWEN3_NEXT_PREFILL_COST
from deltaserve.engine.cache.radix_cache import Node, RadixCache


class FakeKVPool:
    """Pages 1..n-1 (0 is reserved); asserts on double and foreign frees."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))
        self.used: set[int] = set()
        self.log: list[int] = []  # pages freed since the test last looked

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self.used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            assert p in self.used, f"page {p} freed twice or never allocated"
            self.used.remove(p)
            self._free.append(p)
            self.log.append(p)

    @property
    def num_free(self) -> int:
        return len(self._free)


class FakeStatePool:
    """Snapshot slots numbered from 100 (beside the working slots); asserts on double frees."""

    snapshot_bytes = 72 << 20

    def __init__(self, num_snapshots: int) -> None:
        self._free = list(range(100 + num_snapshots - 1, 99, -1))
        self.used: set[int] = set()
        self.log: list[int] = []

    def alloc_snapshot(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self.used.add(slot)
        return slot

    def free_snapshot(self, slot: int) -> None:
        assert slot in self.used, f"snapshot slot {slot} freed twice or never allocated"
        self.used.remove(slot)
        self._free.append(slot)
        self.log.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        pass


def make_cache(
    policy: str = "marconi", ps: int = 2, pages: int = 64, snaps: int = 8, **kw: float
) -> RadixCache:
    return RadixCache(FakeKVPool(pages, ps), FakeStatePool(snaps), ps, policy=policy, **kw)  # type: ignore[arg-type]


def tree_contents(cache: RadixCache) -> tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], int]]:
    """{prefix: page of its last page} and {prefix: snapshot slot}, checking node invariants."""
    pages: dict[tuple[int, ...], int] = {}
    snaps: dict[tuple[int, ...], int] = {}
    ps = cache.page_size
    stack: list[tuple[Node, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, prefix = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node and child.key[:ps] == first
            assert len(child.key) == ps * len(child.pages) > 0
            assert child.depth == node.depth + len(child.key) == len(prefix) + len(child.key)
            assert child.lock_ref >= child.pins + sum(c.lock_ref for c in child.children.values())
            full = prefix + child.key
            for i, page in enumerate(child.pages):
                pages[full[: len(prefix) + (i + 1) * ps]] = page
            if child.snapshot is not None:
                snaps[full] = child.snapshot
            # a tentative snapshot that became a branch point is a regular one
            assert not child.tentative or (child.snapshot is not None and child.num_children < 2)
            stack.append((child, full))
    return pages, snaps


class Reference:
    """The cache's contents as plain dicts, updated by the test from what the cache returns
    and what the fake pools saw freed, and checked against the tree after every operation."""

    def __init__(self, cache: RadixCache) -> None:
        self.cache = cache
        self.kv: FakeKVPool = cache.kv_pool  # type: ignore[assignment]
        self.sp: FakeStatePool = cache.state_pool  # type: ignore[assignment]
        self.pages: dict[tuple[int, ...], int] = {}
        self.snaps: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[Node, tuple[int, ...]]] = []  # handle, tokens up to it
        self.owned_pages: set[int] = set()  # held by running requests, outside the tree
        self.owned_slots: set[int] = set()

    def locked_prefixes(self) -> set[tuple[int, ...]]:
        ps = self.cache.page_size
        return {t[: i * ps] for _, t in self.locks for i in range(1, len(t) // ps + 1)}

    def absorb_frees(self, expected_slots: frozenset[int] = frozenset()) -> None:
        """Apply the cache's own frees (evictions) to the reference, checking each is legal."""
        locked, pinned = self.locked_prefixes(), {t for _, t in self.locks}
        by_page = {p: k for k, p in self.pages.items()}
        for page in self.kv.log:
            assert page in by_page, "the cache freed a page it does not own"
            prefix = by_page[page]
            assert prefix not in locked, "evicted a locked page"
            del self.pages[prefix]
            if prefix in self.snaps:
                assert self.snaps[prefix] in self.sp.log, "a snapshot outlived its KV"
        by_slot = {s: k for k, s in self.snaps.items()}
        for slot in self.sp.log:
            if slot in expected_slots:
                continue
            assert slot in by_slot, "the cache freed a snapshot it does not own"
            assert by_slot[slot] not in pinned, "evicted a locked snapshot"
            del self.snaps[by_slot[slot]]
        self.kv.log.clear()
        self.sp.log.clear()
        ps = self.cache.page_size
        assert all(len(k) == ps or k[:-ps] in self.pages for k in self.pages), "a hole in the tree"

    def check(self) -> None:
        pages, snaps = tree_contents(self.cache)
        assert pages == self.pages and snaps == self.snaps
        c = self.cache
        assert c.evictable_size + c.protected_size == len(self.pages)
        assert c.protected_size == len(self.locked_prefixes())
        assert c.num_snapshots == len(self.snaps)
        assert self.kv.used == set(self.pages.values()) | self.owned_pages, "page leaked"
        assert self.sp.used == set(self.snaps.values()) | self.owned_slots, "snapshot leaked"

    def expected_match(self, tokens: tuple[int, ...]) -> tuple[int, list[int], int | None]:
        ps = self.cache.page_size
        lengths = [n for n in range(ps, len(tokens), ps) if tokens[:n] in self.snaps]
        n = max(lengths, default=0)
        return n, [self.pages[tokens[: i * ps]] for i in range(1, n // ps + 1)], self.snaps.get(tokens[:n])


def gen_tokens(rng: random.Random, history: list[tuple[int, ...]], ps: int) -> tuple[int, ...]:
    # A small vocabulary and continuations of earlier sequences make prefixes collide often.
    base: tuple[int, ...] = ()
    if history and rng.random() < 0.8:
        seq = rng.choice(history)
        base = seq[: rng.randint(0, len(seq))]
    return base + tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 6 * ps + 2)))


POOL_PAGES = 64


@pytest.mark.parametrize("policy", ["marconi", "branch_lru", "every_chunk_lru"])
@pytest.mark.parametrize(
    "ps,seed",
    [pytest.param(1, 0, marks=pytest.mark.slow), (2, 1), pytest.param(4, 2, marks=pytest.mark.slow)],
)
def test_randomized_against_reference(policy: str, ps: int, seed: int) -> None:
    rng = random.Random(seed)
    cache = make_cache(policy, ps=ps, pages=POOL_PAGES + 1, snaps=8, max_tentative=2)
    ref = Reference(cache)
    history: list[tuple[int, ...]] = []
    running: list[tuple[tuple[int, ...], list[int], dict[int, int], Node, list[int], set[int]]] = []
    hits = 0
    for _ in range(5000):
        op = rng.random()
        if op < 0.35 and len(running) < 3:
            tokens = gen_tokens(rng, history, ps)
            whole = tokens[: len(tokens) // ps * ps]
            m = cache.match_prefix(tokens)
            assert (m.length, m.pages, m.snapshot_slot) == ref.expected_match(tokens)
            assert m.node.depth == m.length
            hits += m.length > 0
            bp = max(n for n in range(0, len(whole) + 1, ps) if n == 0 or whole[:n] in ref.pages)
            assert cache.branch_point(tokens) == bp
            cache.lock(m.node)
            ref.locks.append((m.node, tokens[: m.length]))
            new = cache.alloc_kv(len(whole) // ps - len(m.pages))
            ref.absorb_frees()
            if new is None:
                cache.unlock(m.node)
                ref.locks.pop()
                continue
            ref.owned_pages.update(new)
            snaps: dict[int, int] = {}
            tentative: set[int] = set()
            for n in range(m.length + ps, len(whole) + 1, ps):
                guess = rng.random() < 0.3
                if guess or (rng.random() < 0.6 and cache.should_snapshot(tokens, n, is_end=n == len(whole))):
                    slot = cache.alloc_snapshot(tentative=guess)
                    ref.absorb_frees()
                    if slot is not None:
                        snaps[n] = slot
                        ref.owned_slots.add(slot)
                        if guess:
                            tentative.add(n)
            running.append((whole, m.pages + new, snaps, m.node, new, tentative))
            history.append(tokens)
        elif op < 0.6 and running:
            whole, pages, snaps, handle, _, tentative = running.pop(rng.randrange(len(running)))
            before = dict(ref.pages)
            dup_slots = frozenset(s for n, s in snaps.items() if whole[:n] in ref.snaps)
            r = cache.insert(whole, pages, snaps, tentative)
            ref.absorb_frees(dup_slots)
            expect_dups = [p for i, p in enumerate(pages) if before.get(whole[: (i + 1) * ps], p) != p]
            assert r.duplicates == expect_dups
            assert r.node.depth == len(whole)
            ref.owned_pages -= set(pages)
            ref.owned_slots -= set(snaps.values())
            for i, p in enumerate(pages):
                ref.pages.setdefault(whole[: (i + 1) * ps], p)
            for n, s in snaps.items():
                ref.snaps.setdefault(whole[:n], s)
            assert r.pages == [ref.pages[whole[: (i + 1) * ps]] for i in range(len(pages))]
            cache.kv_pool.free(r.duplicates)
            ref.kv.log.clear()
            if whole and rng.random() < 0.3:  # keep the inserted sequence locked a while
                cache.lock(r.node)
                ref.locks.append((r.node, whole))
            idx = next(i for i, (h, _) in enumerate(ref.locks) if h is handle)
            cache.unlock(handle)
            ref.locks.pop(idx)
        elif op < 0.7 and ref.locks and len(ref.locks) > len(running):
            held = {id(r[3]) for r in running}
            free = [i for i, (h, _) in enumerate(ref.locks) if id(h) not in held]
            if free:
                cache.unlock(ref.locks.pop(rng.choice(free))[0])
        elif op < 0.75:
            freed = cache.evict_kv(rng.randint(1, 6))
            assert freed == len(ref.kv.log)
            ref.absorb_frees()
        elif op < 0.8:
            dropped = cache.evict_snapshots(rng.randint(1, 3))
            assert dropped == len(ref.sp.log)
            ref.absorb_frees()
        else:
            tokens = gen_tokens(rng, history, ps)
            m = cache.match_prefix(tokens, record=False)
            assert (m.length, m.pages, m.snapshot_slot) == ref.expected_match(tokens)
        ref.check()
    assert hits >= 25, "the workload should hit the cache often"
    for _, _, snaps, _, own, _ in running:  # abort what still runs: its own pages and slots go back
        cache.kv_pool.free(own)
        for slot in snaps.values():
            cache.state_pool.free_snapshot(slot)
        ref.owned_pages -= set(own)
        ref.owned_slots -= set(snaps.values())
    ref.kv.log.clear()
    ref.sp.log.clear()
    cache.flush()
    ref.absorb_frees()
    ref.check()
    assert set(ref.pages) == ref.locked_prefixes(), "flush left an unlocked page"
    assert set(ref.snaps) <= {t for _, t in ref.locks}, "flush left an unlocked snapshot"
    for handle, _ in ref.locks:
        cache.unlock(handle)
    cache.flush()
    assert cache.kv_pool.num_free == POOL_PAGES and not ref.kv.used
    assert not ref.sp.used and cache.num_snapshots == 0
    assert cache.evictable_size == cache.protected_size == 0 and not cache.root.children


def seq(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def insert_fresh(cache: RadixCache, tokens: tuple[int, ...], snaps: tuple[int, ...] = ()) -> Node:
    """Insert `tokens` with snapshots at `snaps`, as a finished request would."""
    m = cache.match_prefix(tokens, record=False)
    new = cache.alloc_kv(len(tokens) // cache.page_size - len(m.pages))
    assert new is not None
    slots = {n: cache.alloc_snapshot() for n in snaps}
    assert None not in slots.values()
    r = cache.insert(tokens, m.pages + new, slots)  # type: ignore[arg-type]
    cache.kv_pool.free(r.duplicates)
    return r.node


def test_marconi_admits_branch_points_and_ends_not_chunk_boundaries() -> None:
    cache, every = make_cache("marconi"), make_cache("every_chunk_lru")
    a = seq(1, 16)
    for c in (cache, every):
        insert_fresh(c, a, snaps=(16,))
    b = a[:8] + seq(100, 9)  # leaves the tree inside an edge, at 8
    assert cache.branch_point(b) == 8
    assert cache.should_snapshot(b, 8)
    assert not cache.should_snapshot(b, 4) and not cache.should_snapshot(b, 6)
    assert cache.should_snapshot(b, 16, is_end=True) and not cache.should_snapshot(b, 7, is_end=True)
    assert every.should_snapshot(b, 4) and every.should_snapshot(b, 8)
    assert not every.should_snapshot(a + (5, 5), 16)  # already cached
    # A continuation of a cached sequence (the next turn of a chat) is no branch.
    c = a + seq(200, 6)
    assert cache.branch_point(c) == 16 and not cache.should_snapshot(c, 16)
    assert not cache.should_snapshot(a[:10], 8)  # a prefix of a cached sequence: no branch either
    insert_fresh(cache, b[:16], snaps=(16,))
    d = a[:8] + seq(300, 5)  # leaves at a node that now has two children
    assert cache.branch_point(d) == 8 and cache.should_snapshot(d, 8)
    insert_fresh(cache, d[:12], snaps=(8,))
    assert not cache.should_snapshot(seq(1, 8) + seq(400, 4), 8)  # the branch point is cached now


def test_marconi_keeps_branch_point_snapshot_that_lru_drops() -> None:
    for policy, first_victim in (("marconi", 16), ("branch_lru", 8)):
        cache = make_cache(policy, alpha=1.0)
        a = seq(1, 16)
        insert_fresh(cache, a, snaps=(8,))  # the shared prefix's snapshot is the oldest
        insert_fresh(cache, a, snaps=(16,))
        insert_fresh(cache, a[:8] + seq(100, 8), snaps=(16,))
        assert cache.evict_snapshots(1) == 1
        assert cache.match_prefix(a + (0,), record=False).length == (8 if first_victim == 16 else 16)
        if first_victim == 8:
            assert cache.match_prefix(a[:8] + (7, 7), record=False).length == 0


def test_lru_evicts_snapshots_least_recently_used_first() -> None:
    cache = make_cache("branch_lru")
    seqs = [seq(10 * i + 1, 6) for i in range(3)]
    for s in seqs:
        insert_fresh(cache, s, snaps=(6,))
    assert cache.match_prefix(seqs[0] + (99,)).length == 6  # the hit makes seqs[0] the most recent
    order = []
    for _ in range(3):
        cache.evict_snapshots(1)
        order.append(
            [i for i, s in enumerate(seqs) if cache.match_prefix(s + (99,), record=False).length == 0]
        )
    assert order == [[1], [1, 2], [0, 1, 2]]
    assert cache.stats.snapshots_evicted == 3 and cache.evictable_size == 9  # the KV stays


def test_marconi_alpha_trades_recency_for_flops_saved() -> None:
    for alpha, survivor in ((0.0, "short"), (10.0, "long")):
        cache = make_cache("marconi", alpha=alpha, prefix_flops=QWEN3_NEXT_PREFILL_COST)
        long, short = seq(1, 32), seq(100, 4)
        insert_fresh(cache, long, snaps=(32,))  # older but saves 8x the prefill
        insert_fresh(cache, short, snaps=(4,))
        cache.evict_snapshots(1)
        kept = {
            n: cache.match_prefix(s + (0,), record=False).length > 0
            for n, s in (("long", long), ("short", short))
        }
        assert kept == {"long": survivor == "long", "short": survivor == "short"}


def test_dropping_inner_snapshot_keeps_kv() -> None:
    cache = make_cache("branch_lru")
    a = seq(1, 12)
    insert_fresh(cache, a, snaps=(4, 12))
    cache.match_prefix(a + (0,))  # touches the deep snapshot only
    pages_before = cache.evictable_size
    cache.evict_snapshots(1)
    assert cache.evictable_size == pages_before == 6
    assert cache.match_prefix(a[:6] + (0,), record=False).length == 0
    m = cache.match_prefix(a + (0,), record=False)
    assert m.length == 12 and len(m.pages) == 6
    assert cache.branch_point(a[:4] + (0, 0)) == 4  # the KV is still there to find branches


def test_evict_kv_takes_dead_leaves_then_lru_leaves() -> None:
    cache = make_cache("marconi")
    kv: FakeKVPool = cache.kv_pool  # type: ignore[assignment]
    old, new, dead = seq(1, 4), seq(100, 4), seq(200, 4)
    leaves = {
        name: insert_fresh(cache, s, snaps=(4,) if name != "dead" else ())
        for name, s in (("old", old), ("new", new), ("dead", dead))
    }
    cache.match_prefix(new + (0,))
    evicted = []
    for _ in range(3):
        kv.log.clear()
        assert cache.evict_kv(1) == 2  # whole leaves go
        evicted += [name for name, node in leaves.items() if node.pages and node.pages[0] in kv.log]
    assert evicted == ["dead", "old", "new"]
    assert cache.num_snapshots == 0 and cache.stats.snapshots_evicted == 2


def test_locked_path_survives_flush_and_split() -> None:
    cache = make_cache("marconi")
    kv: FakeKVPool = cache.kv_pool  # type: ignore[assignment]
    a = seq(1, 16)
    insert_fresh(cache, a, snaps=(16,))
    insert_fresh(cache, seq(50, 6), snaps=(6,))
    m = cache.match_prefix(a + (0,))
    cache.lock(m.node)
    assert cache.protected_size == 8 and cache.evictable_size == 3
    insert_fresh(cache, a[:6] + seq(100, 4), snaps=(10,))  # splits the locked edge at 6
    assert m.node.depth == 16 and m.node.parent is not None and m.node.parent.depth == 6
    assert cache.protected_size == 8 and cache.evictable_size == 5
    assert cache.evict_kv(100) == 5 and cache.evict_snapshots(10) == 0
    cache.flush()
    assert cache.match_prefix(a + (0,), record=False) == m
    cache.unlock(m.node)
    assert cache.protected_size == 0 and cache.evictable_size == 8
    cache.flush()
    assert kv.num_free == kv.num_pages - 1 and not kv.used and not cache.state_pool.used  # type: ignore[attr-defined]


def test_insert_dedups_pages_and_snapshots() -> None:
    cache = make_cache("marconi")
    kv: FakeKVPool = cache.kv_pool  # type: ignore[assignment]
    sp: FakeStatePool = cache.state_pool  # type: ignore[assignment]
    a = seq(1, 8)
    first, kept = kv.alloc(4), sp.alloc_snapshot()
    assert first is not None and kept is not None
    cache.insert(a, first, {8: kept})
    second, tail, slot = kv.alloc(4), kv.alloc(1), sp.alloc_snapshot()
    assert second is not None and tail is not None and slot is not None
    r = cache.insert(a + seq(50, 2), second + tail, {8: slot})
    assert r.duplicates == second and r.pages[:4] == first
    assert slot not in sp.used and kept in sp.used, "the tree frees a snapshot it already has"
    kv.free(r.duplicates)
    m = cache.match_prefix(a + seq(50, 3))
    assert m.length == 8 and m.pages == first
    assert not cache.insert(a + seq(50, 2), m.pages + r.pages[4:]).duplicates  # the tree's own pages
    assert cache.stats.hit_rate == 8 / 11


def test_alloc_evicts_when_pools_run_dry() -> None:
    cache = make_cache("branch_lru", pages=5, snaps=2)
    a = seq(1, 4)
    insert_fresh(cache, a, snaps=(2, 4))
    assert cache.alloc_snapshot() is not None  # the area was full: the older snapshot went
    assert cache.num_snapshots == 1 and cache.match_prefix(a + (0,), record=False).length == 4
    m = cache.match_prefix(a + (0,))
    cache.lock(m.node)
    assert cache.alloc_snapshot() is None  # the one cached snapshot is locked
    assert cache.alloc_kv(3) is None  # the locked two pages cannot go
    assert cache.alloc_kv(2) is not None
    cache.unlock(m.node)
    assert cache.alloc_snapshot() is not None and cache.num_snapshots == 0


def replay(
    cache: RadixCache, requests: list[tuple[tuple[int, ...], tuple[int, ...]]], chunk: int
) -> list[int]:
    """Serve requests one after another as the engine would; the cached length of each."""
    ps, cached = cache.page_size, []
    for prompt, output in requests:
        m = cache.match_prefix(prompt)
        cache.lock(m.node)
        cached.append(m.length)
        cuts = {*range(m.length + chunk, len(prompt), chunk), cache.branch_point(prompt)}
        slots = {}
        for p in sorted(c for c in cuts if m.length < c < len(prompt) and c % ps == 0):
            if cache.should_snapshot(prompt, p) and (slot := cache.alloc_snapshot()) is not None:
                slots[p] = slot
        full = prompt + output
        end = (len(full) - 1) // ps * ps  # the state covers every token but the last sampled one
        if cache.should_snapshot(full, end, is_end=True) and (slot := cache.alloc_snapshot()) is not None:
            slots[end] = slot
        new = cache.alloc_kv(end // ps - len(m.pages))
        assert new is not None
        r = cache.insert(full[:end], m.pages + new, slots)
        cache.kv_pool.free(r.duplicates)
        cache.unlock(m.node)
    return cached


@pytest.mark.parametrize("policy", ["marconi", "branch_lru", "every_chunk_lru"])
def test_shared_system_prompt_and_multi_turn_hit(policy: str) -> None:
    system = seq(1000, 64)
    users = [system + seq(2000 + 100 * i, 20) for i in range(12)]
    cache = make_cache(policy, ps=4, pages=400, snaps=4)
    cached = replay(cache, [(u, seq(5000 + 100 * i, 9)) for i, u in enumerate(users)], chunk=16)
    # Marconi-style admission snapshots the branch point once a second user shows it is one.
    assert cached[:2] == [0, 64 if policy == "every_chunk_lru" else 0] and set(cached[2:]) == {64}
    # The next turn of a chat starts from the end of the previous answer (trimmed to pages).
    turn1, answer = users[0] + (7,), seq(9000, 11)
    turn2 = turn1 + answer + seq(9500, 5)
    assert replay(cache, [(turn1, answer), (turn2, (8,))], chunk=16) == [64, 92]
    cache.flush()
    assert not cache.kv_pool.used and not cache.state_pool.used  # type: ignore[attr-defined]


def insert_prefill(
    cache: RadixCache, tokens: tuple[int, ...], ends: tuple[int, ...]
) -> dict[int, str | None]:
    """Prefill `tokens` in chunks ending at `ends` as the engine does: at each chunk end the
    cache picks the snapshot kind, and a kept state is inserted at once. The kinds chosen."""
    ps, kinds = cache.page_size, {}
    for n in ends:
        kind = kinds[n] = cache.prefill_snapshot(tokens, n)
        slot = cache.alloc_snapshot(tentative=kind == "tentative") if kind else None
        if slot is None:
            continue
        m = cache.match_prefix(tokens[:n], record=False)
        own = cache.alloc_kv(n // ps - len(m.pages))
        assert own is not None
        end = (n,) if n == len(tokens) // ps * ps else ()  # the prompt end: kept on a guess too
        r = cache.insert(tokens[:n], m.pages + own, {n: slot}, (n,) if kind == "tentative" else (), end)
        cache.kv_pool.free(r.duplicates)
    return kinds


def test_prefill_keeps_prompt_end_and_tentative_chunk_ends() -> None:
    cache = make_cache("marconi", ps=4, pages=200, snaps=8, max_tentative=4)
    system = seq(1, 32)
    first = system + seq(100, 10)  # 42 tokens: the prompt end is its last page boundary, 40
    kinds = insert_prefill(cache, first, (8, 16, 24, 32, 40))
    assert kinds == {8: "tentative", 16: "tentative", 24: "tentative", 32: "tentative", 40: "regular"}
    assert cache.num_tentative == 4  # the area has room: the quota does not apply yet
    assert cache.match_prefix(first[:30] + (0,), record=False).length == 24
    assert cache.match_prefix(first[:20] + (0,), record=False).length == 16
    assert cache.match_prefix(first + (5,), record=False).length == 40  # the next turn
    assert cache.match_prefix(first, record=False).length == 40  # a resend
    # The first request to branch off the system prompt hits at the chunk boundary there.
    second = system + seq(200, 9)
    assert cache.prefill_snapshot(second, 32) is None  # already cached
    m = cache.match_prefix(second)
    assert m.length == 32 and not m.node.tentative, "a hit makes a tentative snapshot regular"
    assert cache.stats.tentative_hit_tokens == 32 and cache.num_tentative == 3
    # A page-aligned prompt: its end, and the resend point a page before it (tentative).
    aligned = seq(300, 16)
    assert insert_prefill(cache, aligned, (12, 16)) == {12: "tentative", 16: "regular"}
    assert cache.match_prefix(aligned, record=False).length == 12
    # Without tentative snapshots only the prompt end (and branch points) are kept.
    plain = make_cache("marconi", ps=4, pages=200, snaps=8)
    kinds = insert_prefill(plain, first, (8, 16, 24, 32, 40))
    assert kinds == {8: None, 16: None, 24: None, 32: None, 40: "regular"}


def test_tentative_snapshots_keep_to_their_quota_once_the_area_is_full() -> None:
    cache = make_cache("marconi", ps=4, pages=200, snaps=4, max_tentative=4)
    a, b, c, d = seq(1, 16), seq(100, 16), seq(200, 16), seq(300, 16)

    def hit(tokens: tuple[int, ...]) -> int:
        return cache.match_prefix(tokens + (0,), record=False).length

    insert_fresh(cache, a, snaps=(16,))  # the oldest snapshot
    insert_prefill(cache, b, (4, 8))
    insert_prefill(cache, c, (4,))  # free slots: three tentative ones, over the quota of two
    assert cache.tentative_quota == 2 and cache.num_tentative == 3 and cache.num_snapshots == 4
    held = [cache.alloc_snapshot()]  # the area is full: the oldest tentative one over the quota goes
    assert held[0] is not None and cache.num_tentative == 2
    assert (hit(a), hit(b[:6]), hit(b[:10])) == (16, 0, 8)
    cache.state_pool.free_snapshot(held.pop())
    insert_prefill(cache, d, (4,))  # the free slot again
    held.append(cache.alloc_snapshot(tentative=True))  # the quota is filled: the oldest tentative one
    assert held[-1] is not None and cache.num_tentative == 2 and (hit(a), hit(b[:10])) == (16, 0)
    held.append(cache.alloc_snapshot())  # within the quota: a regular one goes
    assert held[-1] is not None and cache.num_tentative == 2 and hit(a) == 0
    held.append(cache.alloc_snapshot())  # no regular one is left: a tentative one
    assert held[-1] is not None and cache.num_tentative == 1 and hit(c[:5]) == 0


def test_tentative_quota_follows_what_evicted_snapshots_would_have_served() -> None:
    cache = make_cache("marconi", ps=4, pages=200, snaps=8, max_tentative=4)
    a = seq(1, 16)
    insert_prefill(cache, a + (9,), (4, 8, 12, 16))
    assert cache.tentative_quota == 2 and cache.num_tentative == 3
    assert cache.evict_snapshots(1) == 1  # the oldest tentative one over the quota, at 4
    assert cache.match_prefix(a[:6] + (0,)).length == 0  # which would have served this
    assert cache.tentative_quota == 3
    assert cache.match_prefix(a[:6] + (0,)).length == 0  # each eviction counts once
    assert cache.tentative_quota == 3
    assert cache.evict_snapshots(1) == 1  # the prompt end at 16 (the tentative ones fit the quota)
    assert cache.match_prefix(a + (0,)).length == 12
    assert cache.tentative_quota == 4, "a prompt end is kept on a guess as tentative ones are"
    # A sequence end that a later hit would have used: regular snapshots need the room.
    b = seq(100, 8)
    insert_fresh(cache, b, snaps=(8,))
    cache.evict_snapshots(cache.num_snapshots)  # the KV stays: prompts still reach the place
    assert cache.match_prefix(b + (0,)).length == 0
    assert cache.tentative_quota == 3
    for _ in range(3):
        insert_fresh(cache, b, snaps=(8,))
        cache.evict_snapshots(cache.num_snapshots)
        cache.match_prefix(b + (0,))
    assert cache.tentative_quota == 1  # never below one


def test_tentative_snapshot_becomes_regular_at_a_branch() -> None:
    cache = make_cache("marconi", ps=4, pages=200, snaps=8, max_tentative=4)
    a = seq(1, 16)
    assert insert_prefill(cache, a + (7, 7), (4, 8, 16)) == {4: "tentative", 8: "tentative", 16: "regular"}
    node = cache.match_prefix(a[:8] + (0, 0), record=False).node
    assert node.depth == 8 and node.tentative
    insert_fresh(cache, a[:8] + seq(100, 4))  # a second child below the 8-token node
    assert not node.tentative and cache.num_tentative == 1
    assert not cache.discard_tentative(node) and node.snapshot is not None


def test_unpinned_lock_keeps_pages_but_not_the_snapshot() -> None:
    cache = make_cache("marconi", ps=4, pages=200, snaps=4)
    a = seq(1, 16)
    node = insert_fresh(cache, a, snaps=(16,))
    cache.lock(node, pin=False)
    assert cache.evict_snapshots(1) == 1 and node.snapshot is None
    assert cache.evict_kv(100) == 0 and cache.protected_size == 4
    cache.unlock(node, pin=False)
    assert cache.evict_kv(100) == 4


def test_prefill_cost_and_policy_names() -> None:
    cost = QWEN3_NEXT_PREFILL_COST
    assert cost(0) == 0 and cost(2000) > 2 * cost(1000) > 0  # the attention term is quadratic
    with pytest.raises(ValueError, match="unknown snapshot policy"):
        make_cache("fifo")


def test_lru_evictions_keep_the_exact_order_while_rankings_are_reused() -> None:
    """With many snapshots a ranking serves several evictions (the cost of one is O(N log N));
    under LRU every victim is still the least recently used snapshot at that moment."""
    rng = random.Random(7)
    ps, n = 2, 96
    cache = make_cache("branch_lru", ps=ps, pages=4 * n, snaps=n)
    ranks = 0
    rank = cache._rank_regular

    def counting(k: int) -> list[Node]:
        nonlocal ranks
        ranks += 1
        return rank(k)

    cache._regular_victims._rank = counting  # type: ignore[assignment]
    prompts = []
    for i in range(n):  # n distinct two-page prompts, each with its end's snapshot
        tokens = [1000 + i, i, 7, 7]
        slot = cache.state_pool.alloc_snapshot()
        cache.kv_pool.free(cache.insert(tokens, cache.kv_pool.alloc(2), {4: slot}).duplicates)
        prompts.append(tokens)
    evicted = 0
    for _ in range(40):
        for tokens in rng.sample(prompts, 3):  # hits move snapshots to the back of the order
            cache.match_prefix(tokens + [9])
        snapshot_nodes = [nd for nd in cache._snapshot_nodes if not nd.tentative and not nd.pins]
        expect = min(snapshot_nodes, key=lambda nd: (nd.snapshot_access, nd.depth))
        assert cache.evict_snapshots(1) == 1
        evicted += 1
        assert expect.snapshot is None, "the least recently used snapshot went first"
    assert ranks <= evicted // 2, f"{ranks} rankings for {evicted} evictions"


def test_a_snapshot_hit_after_its_ranking_is_passed_over() -> None:
    ps, n = 2, 64
    cache = make_cache("branch_lru", ps=ps, pages=4 * n, snaps=n)
    prompts = []
    for i in range(n):
        tokens = [1000 + i, i, 7, 7]
        slot = cache.state_pool.alloc_snapshot()
        cache.kv_pool.free(cache.insert(tokens, cache.kv_pool.alloc(2), {4: slot}).duplicates)
        cache.match_prefix(tokens + [9])  # distinct access times, oldest first
        prompts.append(tokens)
    assert cache.evict_snapshots(1) == 1  # ranks several at once: the next victims are queued
    oldest_left = prompts[1]
    cache.match_prefix(oldest_left + [9])  # now the newest
    assert cache.evict_snapshots(1) == 1
    hit = cache.match_prefix(oldest_left + [9], record=False)
    assert hit.snapshot_slot is not None, "the snapshot hit since the ranking was kept"
    assert cache.match_prefix(prompts[2] + [9], record=False).snapshot_slot is None


@pytest.mark.parametrize("policy", ["marconi", "branch_lru"])
def test_flush_after_an_eviction_drops_each_snapshot_once(policy: str) -> None:
    """An eviction ranks more victims than it takes (a sixteenth of the candidates); a later
    eviction of more than are left ranks again, and must not take a victim from both rankings
    (`/reset_prefix_cache` after a busy stretch failed on a snapshot dropped twice)."""
    cache = make_cache(policy, pages=200, snaps=48)
    sp: FakeStatePool = cache.state_pool  # type: ignore[assignment]
    for i in range(40):
        insert_fresh(cache, seq(1000 * (i + 1), 4), snaps=(4,))
    assert cache.num_snapshots == 40
    assert cache.evict_snapshots(1) == 1
    cache.flush()
    assert cache.num_snapshots == 0 and not sp.used
    assert cache.stats.snapshots_evicted == 40
