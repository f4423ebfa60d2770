"""Which data-parallel engine takes a request (`--data-parallel-size`). By default
(`--load-balance-method cache_aware`) the one that already holds the longest part of its prompt,
unless that one is busier than the others by more than a little; else the least busy
(`shortest_queue` always takes the least busy, `round_robin` each in turn).

Each engine has its own prefix cache, so a chat's next turn (its history, then a new message) or
a retry only hits the cache on the engine that served the turn before. The router keeps a hash of
every prompt's first 64, 128, 192, ... tokens (the last `MAX_KEYS` of them), each with the engine
it went to, and looks a new prompt's hashes up from its longest prefix down. Load is the number of
engine requests this HTTP process has in flight on each engine (each HTTP process routes its own).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

STRIDE = 64  # tokens between the prefixes recorded: a multiple of every page size in use
MAX_KEYS = 1 << 16  # prefixes remembered, the oldest forgotten first
SLACK = 4  # a prefix's engine may hold this many more requests than the least busy one...
SLACK_SHARE = 0.5  # ... or this share more, whichever is larger


def prefix_keys(prompt: Sequence[int], stride: int = STRIDE) -> list[int]:
    """The hashes of `prompt`'s first stride, 2 x stride, ... tokens, shortest first; each chains
    the one before, so that the whole list costs one pass over the prompt."""
    keys: list[int] = []
    key = 0
    for end in range(stride, len(prompt) + 1, stride):
        key = hash((key, tuple(prompt[end - stride : end])))
        keys.append(key)
    return keys


METHODS = ("cache_aware", "shortest_queue", "round_robin")  # `--load-balance-method`, as SGLang names them


class EngineRouter:
    def __init__(
        self, engines: int, method: str = "cache_aware", stride: int = STRIDE, max_keys: int = MAX_KEYS
    ) -> None:
        if method not in METHODS:
            raise ValueError(f"load balance method must be one of {', '.join(METHODS)}, got {method!r}")
        self.method = method
        self.load = [0] * engines
        self.stride = stride
        self.max_keys = max_keys
        self._owner: dict[int, int] = {}  # prefix hash -> engine, oldest first (insertion order)
        self._turn = itertools.cycle(range(engines))  # ties among the least busy, taken in turn

    def pick(self, prompts: Sequence[Sequence[int]]) -> int:
        """The engine for requests that go together (an HTTP request's n choices, all or none), by
        the first prompt; its prefixes are remembered for that engine."""
        if len(self.load) == 1:
            return 0
        if self.method == "round_robin":
            return next(self._turn)
        keys = prefix_keys(prompts[0], self.stride) if prompts and self.method == "cache_aware" else []
        least = min(self.load)
        bound = max(least + SLACK, least * (1 + SLACK_SHARE))
        engine = self._holder(keys, bound)
        if engine is None:
            engine = next(e for e in self._turn if self.load[e] == least)
        for key in keys:
            self._owner.pop(key, None)  # to the end: the newest
            self._owner[key] = engine
        while len(self._owner) > self.max_keys:
            del self._owner[next(iter(self._owner))]
        return engine

    def _holder(self, keys: list[int], bound: float) -> int | None:
        """The engine that took the longest of these prefixes, if it holds at most `bound` requests."""
        for key in reversed(keys):
            engine = self._owner.get(key)
            if engine is not None:
                return engine if self.load[engine] <= bound else None
        return None
