"""The Triton GEMV against cuBLAS's product on CUDA, and the opt-in switch that routes to it."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(1024, 3584), (7168, 1024), (8224, 1024), (33, 100), (4096, 12288)])
def test_gemv_matches_matmul(dtype, m, n, k):
    from deltaserve.kernels.linear.triton import gemv

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    ref = x.double() @ w.double().T
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(gemv(x, w).double(), ref, atol=tol, rtol=tol)


def test_switch_routes_measured_shapes_only(monkeypatch):
    """auto: one or two rows, weights up to 8 MB or of at most 4096 output rows (where the
    H200 measurement favours the Triton kernel); cublas: none; triton: up to 8 rows and 256 MB."""
    from deltaserve.kernels import linear as L

    def rows(m: int) -> torch.Tensor:
        return torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)

    small = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16)  # 4 MB
    big = torch.randn(8224, 1024, device="cuda", dtype=torch.bfloat16)  # 16.8 MB
    monkeypatch.delenv("DELTASERVE_GEMV", raising=False)
    assert L.use_gemv(rows(1), small, None) and L.use_gemv(rows(2), small, None)
    assert not L.use_gemv(rows(3), small, None) and not L.use_gemv(rows(1), big, None)
    narrow = torch.empty(4096, 12288, device="cuda", dtype=torch.bfloat16)  # 9B's down, 100 MB
    x = torch.randn(2, 12288, device="cuda", dtype=torch.bfloat16)
    assert L.use_gemv(x[:1], narrow, None) and L.use_gemv(x, narrow, None)
    assert not L.use_gemv(torch.randn(3, 12288, device="cuda", dtype=torch.bfloat16), narrow, None)
    assert not L.use_gemv(rows(1), small, torch.zeros(2048, device="cuda", dtype=torch.bfloat16))
    assert not L.use_gemv(rows(1).cpu(), small.cpu(), None)
    monkeypatch.setenv("DELTASERVE_GEMV", "cublas")
    assert not L.use_gemv(rows(1), small, None)
    monkeypatch.setenv("DELTASERVE_GEMV", "triton")
    assert L.use_gemv(rows(8), big, None) and not L.use_gemv(rows(9), big, None)
    x = rows(4)
    torch.testing.assert_close(L.linear(x, big), x @ big.T, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 5])
@pytest.mark.parametrize("n,k", [(1024, 3584), (4096, 12288), (33, 100)])
def test_gemv_with_swiglu_equals_activation_then_gemv(dtype, m, n, k):
    """The activation applied while x is read rounds as the separate kernel does, so the
    product is the same number for number."""
    from deltaserve.kernels.linear.triton import gemv
    from deltaserve.kernels.norm import silu_and_mul

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = (torch.randn(m, 2 * k, device="cuda", generator=g) * 2).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    fused = gemv(x, w, silu_mul=True)
    assert torch.equal(fused, gemv(silu_and_mul(x), w))
    ref = silu_and_mul(x).double() @ w.double().T
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fused.double(), ref, atol=tol, rtol=tol)


def test_mlp_down_projection_routes_through_the_fused_gemv(monkeypatch):
    """auto: one row into a small down projection takes the fused GEMV; cublas: the
    activation kernel and F.linear; both agree."""
    from deltaserve.kernels import linear as L
    from deltaserve.kernels.linear import triton as triton_gemv

    calls = []
    real = triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    x = torch.randn(1, 2 * 3584, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3584, device="cuda", dtype=torch.bfloat16) / 60
    monkeypatch.delenv("DELTASERVE_GEMV", raising=False)
    fused = L.silu_mul_linear(x, w)
    assert calls == [{"silu_mul": True}]
    monkeypatch.setenv("DELTASERVE_GEMV", "cublas")
    torch.testing.assert_close(L.silu_mul_linear(x, w), fused, atol=2e-2, rtol=2e-2)
    assert len(calls) == 1
