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
    from deltaserve.kernels.triton_gemv import gemv

    g = torch.Generator(device="cuda").manual_seed(m + n)
    x = torch.randn(m, k, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).to(dtype)
    ref = x.double() @ w.double().T
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(gemv(x, w).double(), ref, atol=tol, rtol=tol)


def test_switch_routes_small_batches_only(monkeypatch):
    from deltaserve.kernels import linear as L

    x1 = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
    x2 = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    assert not L.use_gemv(x1, w, None)  # off by default
    monkeypatch.setenv("DELTASERVE_GEMV", "triton")
    assert L.use_gemv(x1, w, None) and not L.use_gemv(x2, w, None)
    torch.testing.assert_close(L.linear(x1, w), x1 @ w.T, atol=2e-2, rtol=2e-2)
