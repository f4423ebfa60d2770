"""`pool_states.per_input`: what derives from a forward's `cu_seqlens` is built once per forward
and never served for another input (a new object, a refill in place, other extra arguments)."""

from __future__ import annotations

import torch

from deltaserve.kernels.pool_states import fla_cu_seqlens, per_input


def test_built_once_per_input_and_again_when_it_changes():
    builds = []

    def build(cu: torch.Tensor, total: int):
        return lambda: builds.append(1) or cu.sum() + total

    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    first = per_input("t", cu, 5, build(cu, 5))
    assert per_input("t", cu, 5, build(cu, 5)) is first and len(builds) == 1  # the other layers
    cu.copy_(torch.tensor([0, 1, 5]))  # refilled in place: its version moved
    assert per_input("t", cu, 5, build(cu, 5)).item() == 11 and len(builds) == 2
    assert per_input("t", cu, 6, build(cu, 6)).item() == 12 and len(builds) == 3  # other extra
    other = cu.clone()
    per_input("t", other, 6, build(other, 6))
    assert len(builds) == 4  # another object
    with torch.inference_mode():
        inf = torch.tensor([0, 2], dtype=torch.int32)
    copy = fla_cu_seqlens(inf)
    assert copy.dtype == torch.int64 and fla_cu_seqlens(inf) is copy
