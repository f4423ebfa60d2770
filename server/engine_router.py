"""Which data-parallel engine takes a request (`--data-parallel-size`). By default
(`--load-balance-method cache_aware`) the one that already holds the longest part of its prompt,
unless that one is busier than the others by more than a little; else the least busy
(`shortest_queue` always takes the least busy, `round_robin` each in turn).

Each engine has its own prefix cache, so a chat's next turn (its history, then a new message) or
a retry only hits the cache on the engine that served the turn before. The router keeps a hash of
every prompt's first 64, 128, 192, ... tokens (every 1,024 past 8,192), each with the engine it went to, and looks a new
prompt's hashes up from its longest prefix down; the HTTP processes share that table
(`SharedRoutes`). Load is the number of engine requests in flight on each engine, counted by
every HTTP process together (`SharedLoad`): one that took more streams than another still
spreads the whole server's load.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal

from deltaserve.engine.requests.cache_salt import salt_digest

STRIDE = 64  # tokens between the prefixes recorded: a multiple of every page size in use
FINE_TOKENS = 8192  # past this many tokens, a prefix every 16 strides
MAX_KEYS = 1 << 16  # prefixes remembered, the oldest forgotten first
SLACK = 4  # a prefix's engine may hold this many more requests than the least busy one...
SLACK_SHARE = 0.5  # ... or this share more, whichever is larger


def prefix_keys(
    prompt: Sequence[int], stride: int = STRIDE, fine: int = FINE_TOKENS, salt: str | None = None
) -> list[int]:
    """The hashes of `prompt`'s first stride, 2 x stride, ... tokens up to `fine` tokens, then of
    every 16 strides further, shortest first; each chains the one before, so that the whole list
    costs one pass over the prompt (a long context's list stays short). A request's `cache_salt`
    starts the chain: its prefixes route apart from the same tokens' unsalted or otherwise salted."""
    keys: list[int] = []
    # the digest alike in the HTTP processes sharing the table, cut to the keys' 64 bits
    key = 0 if salt is None else salt_digest(salt, 64)
    start = 0
    while True:
        end = start + (stride if start < fine else 16 * stride)
        if end > len(prompt):
            return keys
        key = hash((key, tuple(prompt[start:end])))
        keys.append(key)
        start = end


METHODS = ("cache_aware", "shortest_queue", "round_robin")  # `--load-balance-method`, as SGLang names them


class LocalRoutes:
    """Prefix hash -> engine in this process, the oldest forgotten first past `max_keys`."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self.max_keys = max_keys
        self._owner: dict[int, int] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._owner)

    def deepest(self, keys: list[int]) -> int | None:
        """The engine of the longest of these prefixes recorded, if any."""
        for key in reversed(keys):
            engine = self._owner.get(key)
            if engine is not None:
                return engine
        return None

    def record(self, keys: list[int], engine: int) -> None:
        for key in keys:
            self._owner.pop(key, None)  # to the end: the newest
            self._owner[key] = engine
        while len(self._owner) > self.max_keys:
            del self._owner[next(iter(self._owner))]


def routes_path(ipc_dir: str) -> str:
    """Where the HTTP processes' shared table lives: beside the engine's sockets."""
    import os

    return os.path.join(ipc_dir, "routes")


class SharedRoutes:
    """Prefix hash -> engine shared by every HTTP process (`--api-server-count`): a table of
    `slots` entries in a file each process maps, a key's slot picked by its hash, a newer key
    taking an older one's slot. A chat's next turn that reaches another HTTP process still finds
    the engine of the turn before. Writes are not locked: a read racing a write may miss or name
    a stale engine, which costs a cache hit, never a wrong answer."""

    SLOTS = 1 << 20

    def __init__(self, path: str, create: bool = False, slots: int = SLOTS) -> None:
        import numpy as np

        mode: Literal["w+", "r+"] = "w+" if create else "r+"
        self.keys = np.memmap(path, dtype=np.int64, mode=mode, shape=(slots,))
        self.engines = np.memmap(path + ".engines", dtype=np.int8, mode=mode, shape=(slots,))
        self.slots = slots

    def _slots(self, keys: list[int]) -> tuple[Any, Any]:
        import numpy as np

        stored = np.array(keys, dtype=np.int64)
        stored[stored == 0] = 1  # 0 marks an empty slot
        return stored, stored % self.slots

    def deepest(self, keys: list[int]) -> int | None:
        if not keys:
            return None
        stored, where = self._slots(keys)
        found = (self.keys[where] == stored).nonzero()[0]
        return int(self.engines[where[found[-1]]]) if len(found) else None

    def record(self, keys: list[int], engine: int) -> None:
        if keys:
            stored, where = self._slots(keys)
            self.engines[where] = engine  # the engine first: a reader that sees the key sees it
            self.keys[where] = stored


def load_path(ipc_dir: str) -> str:
    """Where the HTTP processes' in-flight counts live: beside the routing table."""
    return routes_path(ipc_dir) + ".load"


class SharedLoad:
    """Each HTTP process's requests in flight on each engine, `[processes, engines]` in a file every
    process maps: a process writes its own row only (no lock), and balances by the columns' sums."""

    def __init__(self, path: str, index: int, processes: int, engines: int, create: bool = False) -> None:
        import numpy as np

        mode: Literal["w+", "r+"] = "w+" if create else "r+"
        self.table = np.memmap(path, dtype=np.int32, mode=mode, shape=(processes, engines))
        self.index = index

    def add(self, engine: int, delta: int) -> None:
        self.table[self.index, engine] += delta

    def totals(self) -> list[int]:
        return [int(n) for n in self.table.sum(axis=0)]


class EngineRouter:
    def __init__(
        self,
        engines: int,
        method: str = "cache_aware",
        stride: int = STRIDE,
        max_keys: int = MAX_KEYS,
        routes: LocalRoutes | SharedRoutes | None = None,
        shared_load: SharedLoad | None = None,
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"load balance method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        self.load = [0] * engines  # requests in flight on each engine, where this process is alone
        self.shared_load = shared_load  # every HTTP process's, where there are several
        self.stride = stride
        self.routes = routes if routes is not None else LocalRoutes(max_keys)
        self._turn = itertools.cycle(range(engines))  # ties among the least busy, taken in turn

    def count(self, engine: int, delta: int) -> None:
        """A request placed on `engine` (+1) or gone from it (-1)."""
        if self.shared_load is not None:
            self.shared_load.add(engine, delta)
        else:
            self.load[engine] += delta

    def pick(self, prompts: Sequence[Sequence[int]], salt: str | None = None) -> int:
        """The engine for requests that go together (an HTTP request's n choices, all or none), by
        the first prompt and the requests' `cache_salt`; its prefixes are remembered for that engine."""
        if len(self.load) == 1:
            return 0
        if self.method == "round_robin":
            return next(self._turn)
        keys = (
            prefix_keys(prompts[0], self.stride, salt=salt)
            if prompts and self.method == "cache_aware"
            else []
        )
        load = self.shared_load.totals() if self.shared_load is not None else self.load
        least = min(load)
        bound = max(least + SLACK, least * (1 + SLACK_SHARE))
        engine = self.routes.deepest(keys)
        if engine is None or engine >= len(load) or load[engine] > bound:
            engine = next(e for e in self._turn if load[e] == least)
        self.routes.record(keys, engine)
        return engine
