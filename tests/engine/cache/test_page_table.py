"""The device page table of decode graphs follows the requests' page lists as they grow, are
replaced, and move to reused slots, sending only what changed."""

from __future__ import annotations

import random

import torch

from deltaserve.engine.cache.page_table import SlotPageTable


def _rows(table: SlotPageTable, slots: list[int], lens: list[int]) -> list[list[int]]:
    out = torch.empty(len(slots), table.max_pages, dtype=torch.int32)
    table.gather(torch.tensor(slots), out)
    return [row[:n] for row, n in zip(out.tolist(), lens)]


def test_rows_follow_lists_and_only_changes_are_sent(monkeypatch):
    table = SlotPageTable(num_slots=5, max_pages=8, device=torch.device("cpu"))
    sent: list[int] = []
    real = torch.Tensor.index_copy_

    def counting(self, dim, index, source):
        sent.append(index.numel())
        return real(self, dim, index, source)

    monkeypatch.setattr(torch.Tensor, "index_copy_", counting)
    a, b = [3, 4], [7]
    table.update([1, 2], [a, b])
    assert _rows(table, [1, 2], [2, 1]) == [[3, 4], [7]] and sent == [3]
    table.update([1, 2], [a, b])  # nothing changed: nothing sent
    assert sent == [3]
    a.append(9)  # grows in place: only the new entry
    table.update([2, 1], [b, a])
    assert _rows(table, [1, 2], [3, 1]) == [[3, 4, 9], [7]] and sent == [3, 1]
    c = [11, 12]  # slot 1 reused by another request (a new list of the same length as before)
    table.update([1], [c])
    assert _rows(table, [1], [2]) == [[11, 12]] and sent == [3, 1, 2]
    out = torch.empty(2, 8, dtype=torch.int32)
    table.gather(torch.tensor([0, 0]), out)  # padding rows: the padding page
    assert out.eq(0).all()


def test_random_histories_match_the_lists():
    rng = random.Random(0)
    table = SlotPageTable(num_slots=9, max_pages=16, device=torch.device("cpu"))
    lists: dict[int, list[int]] = {}
    for _ in range(300):
        slot = rng.randrange(1, 9)
        op = rng.random()
        if slot not in lists or op < 0.2:
            lists[slot] = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 6))]
        elif len(lists[slot]) < 16:
            lists[slot].extend(
                rng.randrange(1, 1000) for _ in range(rng.randrange(1, 16 - len(lists[slot]) + 1))
            )
        slots = rng.sample(sorted(lists), rng.randrange(1, len(lists) + 1))
        table.update(slots, [lists[s] for s in slots])
        assert _rows(table, slots, [len(lists[s]) for s in slots]) == [lists[s] for s in slots]


def test_a_table_made_in_inference_mode_updates_outside_it():
    """The model runner makes the table while it captures graphs (under inference mode); the
    engine updates it from plain code."""
    with torch.inference_mode():
        table = SlotPageTable(num_slots=3, max_pages=4, device=torch.device("cpu"))
    table.update([2], [[5, 6]])
    assert _rows(table, [2], [2]) == [[5, 6]]
