"""`PerForwardCache`: what derives from a forward's `cu_seqlens` is built once per forward, never
served for another input (a new object, a refill in place, other extra arguments), and kept by
its owner only; FLA's switch is set by `configure_fla`, not by importing deltaserve."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deltaserve.kernels.common.per_forward import PerForwardCache, per_input
from deltaserve.kernels.delta_rule.fla import configure_fla, fla_cu_seqlens


def test_built_once_per_input_and_again_when_it_changes():
    builds = []
    cache = PerForwardCache()

    def build(cu: torch.Tensor, total: int):
        return lambda: builds.append(1) or cu.sum() + total

    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    first = cache.get("t", cu, 5, build(cu, 5))
    assert cache.get("t", cu, 5, build(cu, 5)) is first and len(builds) == 1  # the other layers
    cu.copy_(torch.tensor([0, 1, 5]))  # refilled in place: its version moved
    assert cache.get("t", cu, 5, build(cu, 5)).item() == 11 and len(builds) == 2
    assert cache.get("t", cu, 6, build(cu, 6)).item() == 12 and len(builds) == 3  # other extra
    other = cu.clone()
    cache.get("t", other, 6, build(other, 6))
    assert len(builds) == 4  # another object
    with torch.inference_mode():
        inf = torch.tensor([0, 2], dtype=torch.int32)
    copy = fla_cu_seqlens(inf, cache)
    assert copy.dtype == torch.int64 and fla_cu_seqlens(inf, cache) is copy


def test_caches_are_their_owners_own():
    """Two owners (two engines' backends) never see each other's entries; without a cache every
    call builds."""
    builds = []
    cu = torch.tensor([0, 4], dtype=torch.int32)
    a, b = PerForwardCache(), PerForwardCache()
    kept_a = a.get("t", cu, None, lambda: builds.append("a") or cu + 1)
    kept_b = b.get("t", cu, None, lambda: builds.append("b") or cu + 2)
    assert kept_a is not kept_b and builds == ["a", "b"]
    assert torch.equal(kept_b, cu + 2)
    per_input(None, "t", cu, None, lambda: builds.append("none") or cu)
    per_input(None, "t", cu, None, lambda: builds.append("none") or cu)
    assert builds == ["a", "b", "none", "none"]
    assert fla_cu_seqlens(cu) is not fla_cu_seqlens(cu)


@pytest.mark.slow
def test_importing_the_kernels_leaves_the_environment_alone():
    env = {k: v for k, v in os.environ.items() if k != "FLA_DISABLE_BACKEND_DISPATCH"}
    code = (
        "import os, pkgutil, importlib, deltaserve.kernels as K\n"
        "for m in pkgutil.walk_packages(K.__path__, 'deltaserve.kernels.'):\n"
        "    if not m.name.endswith(('.triton', '.cuda', '.pdl')): importlib.import_module(m.name)\n"
        "print(os.environ.get('FLA_DISABLE_BACKEND_DISPATCH'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "None"


def test_configure_fla_sets_fla_switch_unless_told_not_to(monkeypatch):
    monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    monkeypatch.setenv("DELTASERVE_FLA_DIRECT", "0")
    configure_fla()
    assert "FLA_DISABLE_BACKEND_DISPATCH" not in os.environ
    monkeypatch.delenv("DELTASERVE_FLA_DIRECT")
    configure_fla()
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "1"
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "0")  # the user's own choice stays
    configure_fla()
    assert os.environ["FLA_DISABLE_BACKEND_DISPATCH"] == "0"


def test_fla_internal_finds_fla_06s_forwards_or_steps_aside(monkeypatch):
    """The GDN and KDA prefill paths call FLA below its entry where FLA is 0.6 (its forwards take
    `chunk_indices`); with DELTASERVE_FLA_DIRECT=0, a missing function or another signature they
    fall back to FLA's public call. (The direct and public paths are held to each other on the
    GPU, tests/kernels/test_cuda_kernels.py and test_kda_cuda.py.)"""
    import types

    from deltaserve.kernels.delta_rule.fla import fla_internal
    from deltaserve.kernels.gdn import cuda as gdn_cuda
    from deltaserve.kernels.kda import cuda as kda_cuda

    monkeypatch.delenv("DELTASERVE_FLA_DIRECT", raising=False)
    monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")  # configure_fla's write, undone after
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


def test_initial_states_gathered_per_layer_with_the_mask_built_once():
    """Each layer's pool gives its own rows; fresh rows are zeros even over garbage (NaN); the
    next forward's flags are not served the previous forward's mask."""
    from deltaserve.kernels.delta_rule.pool import gather_initial_states

    cache = PerForwardCache()
    slots = torch.tensor([3, 1, 4], dtype=torch.int32)
    pools = [torch.randn(6, 2, 4, 4) for _ in range(2)]
    for p in pools:
        p[1] = float("nan")  # slot 1 starts fresh: whatever it holds must not leak
    first = torch.tensor([True, False, True])
    for p in pools:  # two layers of one forward
        init = gather_initial_states(p, slots, first, cache)
        assert torch.equal(init[0], p[3]) and torch.equal(init[2], p[4])
        assert torch.equal(init[1], torch.zeros(2, 4, 4))
    second = torch.tensor([False, False, True])  # the next forward
    init = gather_initial_states(pools[0], slots, second, cache)
    assert torch.equal(init[0], torch.zeros(2, 4, 4)) and torch.equal(init[2], pools[0][4])
    assert not torch.isnan(pools[0][3]).any() and torch.isnan(pools[0][1]).all()  # the pool unchanged
