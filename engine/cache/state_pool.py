"""Conv and recurrent state of every linear-attention layer, one slot per request.

Slot 0 is the padding slot. Slots 1..num_working are working slots, owned by running
requests; the ones after them are the snapshot area of the prefix cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deltaserve.engine.parallel.step_sync import OpLog


class StatePool:
    def __init__(
        self,
        num_layers: int,
        num_working: int,
        num_snapshots: int,
        shapes: dict[str, tuple[int, ...]],
        dtypes: dict[str, torch.dtype],
        device: torch.device,
    ) -> None:
        self.num_working = num_working
        self.num_snapshots = num_snapshots
        total = 1 + num_working + num_snapshots
        self.buffers = {
            name: torch.zeros(num_layers, total, *shape, dtype=dtypes[name], device=device)
            for name, shape in shapes.items()
        }
        self._free = list(range(num_working, 0, -1))
        self._free_snapshots = list(range(total - 1, num_working, -1))
        self.log: OpLog | None = None  # tensor parallelism: rank 0 records its writes for the workers

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_working - len(self._free)

    @property
    def num_snapshots_used(self) -> int:
        return self.num_snapshots - len(self._free_snapshots)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        assert 0 < slot <= self.num_working, f"not a working slot: {slot}"
        self._free.append(slot)

    def alloc_snapshot(self) -> int | None:
        return self._free_snapshots.pop() if self._free_snapshots else None

    def free_snapshot(self, slot: int) -> None:
        assert slot > self.num_working, f"not a snapshot slot: {slot}"
        self._free_snapshots.append(slot)

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy every layer's conv and recurrent state together."""
        if self.log is not None:
            self.log.record("state_pool", "copy_slot", src, dst)
        for buf in self.buffers.values():
            buf[:, dst].copy_(buf[:, src])

    def layer(self, index: int) -> dict[str, torch.Tensor]:
        return {name: buf[index] for name, buf in self.buffers.items()}

    @property
    def slot_bytes(self) -> int:
        return sum(b[:, 0].numel() * b.element_size() for b in self.buffers.values())

    @property
    def snapshot_bytes(self) -> int:
        return self.slot_bytes
