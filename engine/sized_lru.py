"""A map of the most recently used entries within a byte bound (and a count), the least recently
used dropped first: the engine's compiled grammars and the server's stored responses."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class SizedLRU(Generic[K, V]):
    """Entries of a given size each, kept while they total `max_bytes` or less and number
    `max_items` or fewer; the newest is kept whatever its size. Not thread-safe."""

    def __init__(self, max_bytes: int, max_items: int | None = None) -> None:
        self.max_bytes, self.max_items = max_bytes, max_items
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, key: K) -> V | None:
        """The entry, now the most recently used; None if it is not kept."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: K, value: V, nbytes: int) -> None:
        self.pop(key)
        self._entries[key] = (value, nbytes)
        self.nbytes += nbytes
        while len(self._entries) > 1 and (
            self.nbytes > self.max_bytes
            or (self.max_items is not None and len(self._entries) > self.max_items)
        ):
            self.nbytes -= self._entries.popitem(last=False)[1][1]

    def pop(self, key: K) -> V | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.nbytes -= entry[1]
        return entry[0]

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def values(self) -> Iterator[V]:
        return (value for value, _ in self._entries.values())
