"""Decode-step fusions against the unfused ops they replace, on CUDA: the GDN decode kernel
computing its own gates, the attention output gate in one kernel, the KV store in one launch."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels import norm as N
from deltaserve.kernels.attention import store_kv

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hk", "hv", "batch"), [(16, 16, 1), (16, 32, 3), (2, 8, 70)])
def test_gdn_decode_with_gates_equals_gates_then_decode(dtype, hk, hv, batch):
    """Same kernel both ways: gates computed inside must give exactly the gates kernel's
    g and beta, so outputs and states agree bit for bit."""
    from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

    dk = dv = 128
    q, k = randn(batch, hk, dk, dtype=dtype), randn(batch, hk, dk, dtype=dtype, seed=1)
    v = randn(batch, hv, dv, dtype=dtype, seed=2)
    # a and b as the views of in_proj's output the model passes (row stride > HV), a large
    # enough to reach softplus' linear part
    proj = randn(batch, 4 * hv, dtype=dtype, scale=8.0, seed=3)
    b, a = proj[:, hv : 2 * hv], proj[:, 3 * hv :]
    A_log, dt_bias = randn(hv, dtype=torch.float32, seed=4), randn(hv, dtype=torch.float32, seed=5)
    slots = (torch.randperm(2 * batch)[:batch] + 1).to(torch.int32).cuda()
    pool = randn(2 * batch + 1, hv, dk, dv, dtype=torch.float32, scale=0.1, seed=6)
    fused_pool, split_pool = pool.clone(), pool.clone()
    fused = gdn_decode_cuda(q, k, v, a, b, fused_pool, slots, gates=(A_log, dt_bias))
    g, beta = N.gdn_gates(a, b, A_log, dt_bias)
    split = gdn_decode_cuda(q, k, v, g, beta, split_pool, slots)
    assert torch.equal(fused, split)
    assert torch.equal(fused_pool, split_pool)
    assert not torch.equal(fused_pool, pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "h", "d"), [(1, 8, 256), (5, 16, 256), (3, 4, 100)])
def test_sigmoid_gate_matches_torch(dtype, t, h, d):
    x = randn(t, h, d, dtype=dtype)
    qg = randn(t, h, 2 * d, dtype=dtype, scale=4.0, seed=1)
    gate = qg.chunk(2, dim=-1)[1]  # a strided view, as the attention layer passes it
    out = N.sigmoid_gate(x, gate)
    assert out.is_contiguous() and out.dtype == dtype
    ref = x * torch.sigmoid(gate.contiguous())
    if dtype == torch.bfloat16:  # both round the sigmoid, then the product, to bf16
        assert torch.equal(out, ref)
    else:  # Triton's sigmoid and torch's differ in the last bits of fp32
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hkv", "d", "page"), [(2, 256, 16), (4, 128, 1), (3, 100, 8)])
def test_store_kv_one_launch_matches_indexed_copy(monkeypatch, dtype, hkv, d, page):
    t, pages = 9, 12
    kv = randn(t, 3 * hkv, d, dtype=dtype)
    k, v = kv[:, hkv : 2 * hkv], kv[:, 2 * hkv :]  # views with a wide row stride
    slots = torch.randperm(pages * page)[:t].cuda()
    caches = [randn(pages, page, hkv, d, dtype=dtype, seed=s) for s in (1, 2)]
    expect = [c.clone() for c in caches]
    store_kv(*caches, k, v, slots)
    with monkeypatch.context() as m:
        m.setenv("DELTASERVE_REFERENCE_KERNELS", "1")
        store_kv(*expect, k, v, slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])
    assert not torch.equal(caches[0], randn(pages, page, hkv, d, dtype=dtype, seed=1))
