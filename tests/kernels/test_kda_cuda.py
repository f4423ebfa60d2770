"""KDA's fast CUDA paths (FLA's chunk_kda, slot-indexed fused recurrent) held to the references.

References run on the same CUDA tensors with `DELTASERVE_REFERENCE_KERNELS=1`; errors are
||out - ref|| / ||ref||. Pools hold random data so that a wrong slot, a missed write or a
stray write shows.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.kda import kda_decode, kda_prefill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def reference(monkeypatch: pytest.MonkeyPatch, op, *args):
    with monkeypatch.context() as m:
        m.setenv("DELTASERVE_REFERENCE_KERNELS", "1")
        return op(*args)


def pick_slots(n: int, num_slots: int) -> torch.Tensor:
    """n distinct slots in a scrambled order, never slot 0 (the padding slot)."""
    return (torch.randperm(num_slots - 1)[:n] + 1).to(torch.int32).to(DEV)


def assert_untouched(after: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> None:
    keep = torch.ones(after.shape[0], dtype=torch.bool, device=DEV)
    keep[slots.long()] = False
    assert torch.equal(after[keep], before[keep])


def kda_inputs(total: int, heads: int, dim: int, dtype: torch.dtype):
    q = torch.randn(total, heads, dim, device=DEV, dtype=dtype)
    k = torch.randn(total, heads, dim, device=DEV, dtype=dtype)
    v = torch.randn(total, heads, dim, device=DEV, dtype=dtype)
    # per-channel log decays as the model makes them: -exp(A) * softplus(.), fp32
    g = -torch.nn.functional.softplus(torch.randn(total, heads, dim, device=DEV)) * 0.3
    beta = torch.rand(total, heads, device=DEV).to(dtype)
    return q, k, v, g, beta


def test_kda_prefill_direct_equals_public(monkeypatch):
    """FLA's KDA forward called below its entry point (the default, `_kda_forward`) gives the
    public `chunk_kda`'s outputs and states (bf16, one shape: each new shape compiles FLA's
    KDA kernels for a minute or two)."""
    from deltaserve.kernels.kda import cuda as kda_cuda

    heads, dim, num_slots = 4, 128, 8
    lengths = [5, 64, 190, 33]
    slots = pick_slots(len(lengths), num_slots)
    has_init = torch.tensor([True, False, True, False], device=DEV)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    inputs = kda_inputs(sum(lengths), heads, dim, torch.bfloat16)
    pool = torch.randn(num_slots, heads, dim, dim, device=DEV) * 0.1
    results = []
    try:
        for direct in ("1", "0"):
            monkeypatch.setenv("DELTASERVE_FLA_DIRECT", direct)
            kda_cuda._kda_forward.cache_clear()
            assert (kda_cuda._kda_forward() is not None) == (direct == "1")
            p = pool.clone()
            results.append((kda_cuda.kda_prefill_cuda(*inputs, cu, p, slots, has_init), p))
    finally:
        kda_cuda._kda_forward.cache_clear()
    assert rel_err(results[0][0], results[1][0]) < 1e-2
    assert rel_err(results[0][1], results[1][1]) < 1e-2
    assert_untouched(results[0][1], pool, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim"), [(4, 128), (3, 64)])
def test_kda_prefill(monkeypatch, dtype, heads, dim):
    from deltaserve.kernels.kda.cuda import kda_prefill_cuda

    lengths = [1, 63, 64, 65, 130, 7, 200]
    has_init = torch.tensor([True, False, True, True, False, True, False], device=DEV)
    num_slots = 12
    pool = torch.randn(num_slots, heads, dim, dim, device=DEV) * 0.1
    slots = pick_slots(len(lengths), num_slots)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    inputs = kda_inputs(sum(lengths), heads, dim, dtype)
    ref_pool = pool.clone()
    ref = reference(monkeypatch, kda_prefill, *inputs, cu, ref_pool, slots, has_init)
    before = pool.clone()
    out = kda_prefill_cuda(*inputs, cu, pool, slots, has_init)
    # FLA computes its chunk products in TF32 / bf16, hence looser bounds than decode
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tol
    assert rel_err(pool[slots.long()], ref_pool[slots.long()]) < tol
    assert_untouched(pool, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim"), [(4, 128), (3, 64)])
@pytest.mark.parametrize("batch", [1, 7, 70])
def test_kda_decode(monkeypatch, dtype, heads, dim, batch):
    from deltaserve.kernels.kda.cuda import kda_decode_cuda

    num_slots = 2 * batch + 3
    pool = torch.randn(num_slots, heads, dim, dim, device=DEV) * 0.1
    slots = pick_slots(batch, num_slots)
    inputs = kda_inputs(batch, heads, dim, dtype)
    ref_pool = pool.clone()
    ref = reference(monkeypatch, kda_decode, *inputs, ref_pool, slots)
    before = pool.clone()
    out = kda_decode_cuda(*inputs, pool, slots)
    tol = 2e-5 if dtype == torch.float32 else 1.5e-2
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tol
    assert rel_err(pool[slots.long()], ref_pool[slots.long()]) < 2e-5
    assert_untouched(pool, before, slots)


def test_kda_decode_cuda_graph(monkeypatch):
    from deltaserve.kernels.kda.cuda import kda_decode_cuda

    batch, heads, dim, num_slots = 8, 4, 128, 20
    pool = torch.randn(num_slots, heads, dim, dim, device=DEV) * 0.1
    static = [t.clone() for t in kda_inputs(batch, heads, dim, torch.bfloat16)]
    slots = pick_slots(batch, num_slots)
    kda_decode_cuda(*static, pool.clone(), slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kda_decode_cuda(*static, pool, slots)
    for _ in range(2):
        for buf, new in zip(static, kda_inputs(batch, heads, dim, torch.bfloat16)):
            buf.copy_(new)
        slots.copy_(pick_slots(batch, num_slots))
        ref_pool = pool.clone()
        ref = reference(monkeypatch, kda_decode, *static, ref_pool, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < 1.5e-2
        assert rel_err(pool, ref_pool) < 2e-5


def test_mla_decode_cuda_graph(monkeypatch):
    """MLA decode over the latent cache, captured in a CUDA graph, against the expanded reference."""
    from deltaserve.kernels.mla import mla_attention

    heads, nope, rope, lora, vdim, page, n = 8, 128, 64, 512, 128, 16, 6
    w = torch.randn(heads * (nope + vdim), lora, device=DEV) * 0.05
    cache = torch.randn(40, page, lora + rope, device=DEV)
    page_table = torch.randint(1, 40, (n, 5), device=DEV, dtype=torch.int32)
    seq_lens = torch.tensor([1, 17, 80, 33, 64, 5], device=DEV, dtype=torch.int32)
    cu = torch.arange(n + 1, device=DEV, dtype=torch.int32)
    q = torch.randn(n, heads, nope + rope, device=DEV)
    args = (q, cache, w, page_table, cu, seq_lens, 0.07, vdim)
    mla_attention(*args)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_attention(*args)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(monkeypatch, mla_attention, *args)) < 1e-4
