"""The verification window buffer beside the state pool, and the commit of accepted states.

Per linear layer and state (conv, recurrent): `[rows, k + 1, *shape]`, in the pool's dtype.
Row i belongs to the i-th verifying request of the current step; position j holds the state
after the window's token j. After sampling, `commit` copies each request's state at its last
accepted position into its working slot, every layer's conv and recurrent state together;
until then the slot still holds the state before the window (a request that ends mid-window
frees it unread). An accepted position on a page boundary is written the same way straight into
the prefix cache's snapshot slot, so the states the cache keeps never pass through the slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltaserve.engine.cache.state_pool import StatePool
from deltaserve.engine.runner.h2d import to_device

if TYPE_CHECKING:
    from deltaserve.engine.parallel.step_sync import OpLog


class StateWindow:
    def __init__(self, pool: StatePool, rows: int, width: int) -> None:
        self.pool = pool
        self.rows, self.width = rows, width
        self.buffers = {
            name: torch.zeros(buf.shape[0], rows, width, *buf.shape[2:], dtype=buf.dtype, device=buf.device)
            for name, buf in pool.buffers.items()
        }
        self.log: OpLog | None = None  # tensor parallelism: rank 0 records its writes for the workers

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: buf[index] for name, buf in self.buffers.items()}

    def commit(self, slots: list[int], rows: list[int], positions: list[int]) -> None:
        """`pool[slot] = window[row, position]` for each triple, all layers and states at once."""
        if not slots:
            return
        if self.log is not None:
            self.log.record("window", "commit", slots, rows, positions)
        dev = next(iter(self.buffers.values())).device
        s, r, p = (to_device(x, torch.long, dev) for x in (slots, rows, positions))
        for name, win in self.buffers.items():
            self.pool.buffers[name][:, s] = win[:, r, p]
