"""Each state slot's KV page list, kept on the device for decode-graph batches.

A decode step at batch 256 would otherwise rebuild the whole `[N, max_pages]` page table from
Python lists and copy it over, host time that grows with the context. Here the table lives on
the device, one row per
state slot, and a step sends only the entries that changed: the pages a request gained since
its row was last written, or its whole list when the request's list object is new (admission,
preemption, or a new request in a reused slot). A request's page list only grows in place
(`Scheduler._ensure_pages`) or is replaced by a new list, which this relies on. The graph's
page table is then gathered from the rows of the batch's slots on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltaserve.engine.runner.h2d import to_device_packed

if TYPE_CHECKING:
    from deltaserve.engine.parallel.step_sync import OpLog


class SlotPageTable:
    def __init__(self, num_slots: int, max_pages: int, device: torch.device) -> None:
        self.max_pages = max_pages
        self.table = torch.zeros(num_slots, max_pages, dtype=torch.int32, device=device)
        # per slot: the page list object its row was written from, and how many entries
        self._written: list[tuple[list[int] | None, int]] = [(None, 0)] * num_slots
        self.log: OpLog | None = None  # tensor parallelism: rank 0 records its writes for the workers

    def update(self, slots: list[int], pages: list[list[int]]) -> None:
        """Bring the rows of `slots` up to date with their requests' page lists."""
        index: list[int] = []
        values: list[int] = []
        width = self.max_pages
        for slot, p in zip(slots, pages):
            ref, n = self._written[slot]
            if ref is p:
                if n == len(p):
                    continue
                start = n
            else:
                start = 0
            assert len(p) <= width, (len(p), width)
            base = slot * width
            index.extend(range(base + start, base + len(p)))
            values.extend(p[start:])
            self._written[slot] = (p, len(p))
        if index:
            self.write(index, values)

    def write(self, index: list[int], values: list[int]) -> None:
        """`table.flat[index] = values`."""
        if self.log is not None:
            self.log.record("page_table", "write", index, values)
        dev = self.table.device
        # the table may be an inference tensor (made while graphs were captured), which
        # only inference mode may update in place
        with torch.inference_mode():
            index_t, values_t = to_device_packed([(index, torch.long), (values, torch.int32)], dev)
            self.table.view(-1).index_copy_(0, index_t, values_t)

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """`out[i] = table[slots[i]]` (padding rows, slot 0, read the padding page)."""
        torch.index_select(self.table, 0, slots, out=out)
