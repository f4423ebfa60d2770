"""The requests that wait for a running place: in arrival order, or by priority.

Under "fcfs" a request joins at the back and a preempted one goes back to the front (it came
first). Under "priority" (vLLM's policy) both take their place by (priority, arrival time):
the lowest value first, and among equals the earliest.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from deltaserve.engine.requests.request import Request


def priority_key(req: Request) -> tuple[int, float]:
    return req.params.priority, req.arrival_time


class WaitingQueue:
    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._queue: list[Request] = []

    def add(self, req: Request) -> None:
        """A new request."""
        if self.by_priority:
            bisect.insort_right(self._queue, req, key=priority_key)
        else:
            self._queue.append(req)

    def add_preempted(self, req: Request) -> None:
        """A request that ran and gave its place back: first of all (fcfs), or in its place."""
        if self.by_priority:
            bisect.insort_left(self._queue, req, key=priority_key)
        else:
            self._queue.insert(0, req)

    def first(self) -> Request:
        return self._queue[0]

    def remove(self, req: Request) -> None:
        self._queue.remove(req)

    def __contains__(self, req: object) -> bool:
        return req in self._queue

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)
