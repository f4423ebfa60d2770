"""`delta_rule.pool.per_input`: what derives from a forward's `cu_seqlens` is built once per forward
and never served for another input (a new object, a refill in place, other extra arguments)."""

from __future__ import annotations

import torch

from deltaserve.kernels.delta_rule.pool import fla_cu_seqlens, per_input


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


def test_fla_internal_finds_fla_06s_forwards_or_steps_aside(monkeypatch):
    """The GDN and KDA prefill paths call FLA below its entry where FLA is 0.6 (its forwards take
    `chunk_indices`); with DELTASERVE_FLA_DIRECT=0, a missing function or another signature they
    fall back to FLA's public call. (The direct and public paths are held to each other on the
    GPU, tests/kernels/test_cuda_kernels.py and test_kda_cuda.py.)"""
    import sys
    import types

    from deltaserve.kernels.delta_rule.pool import fla_internal
    from deltaserve.kernels.gdn import cuda as gdn_cuda
    from deltaserve.kernels.kda import cuda as kda_cuda

    monkeypatch.delenv("DELTASERVE_FLA_DIRECT", raising=False)
    # FLA's helper module beside the forwards (on CPU the tests hide the real FLA)
    monkeypatch.setitem(sys.modules, "fla.ops.utils.index", types.ModuleType("fla.ops.utils.index"))
    fake = types.ModuleType("fake_fla_ops")
    fake.new = lambda q, k, chunk_indices=None: None
    fake.old = lambda q, k: None
    monkeypatch.setitem(sys.modules, "fake_fla_ops", fake)
    assert fla_internal("fake_fla_ops", "new") is fake.new
    assert fla_internal("fake_fla_ops", "old") is None
    assert fla_internal("fake_fla_ops", "gone") is None
    assert fla_internal("no_such_module_here", "new") is None
    monkeypatch.setenv("DELTASERVE_FLA_DIRECT", "0")
    assert fla_internal("fake_fla_ops", "new") is None
    for cached in (gdn_cuda._fla_forward, kda_cuda._kda_forward):
        assert cached() is None
        cached.cache_clear()
