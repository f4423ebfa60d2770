"""Prefill's bf16 experts through torch's grouped GEMM (`moe_grouped_mm`) on CPU, its gather-sum
kernel through Triton's interpreter in a process of its own: held to the torch reference, and
other ranks' assignments (-1 or E) add nothing. The CUDA tests are in test_moe_cuda.py."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.moe.reference import moe_ref


def check_grouped_mm(device: str) -> int:
    """Routes with and without skipped assignments against the reference; returns the cases checked."""
    from deltaserve.kernels.moe.cuda import moe_grouped_mm

    g = torch.Generator(device=device).manual_seed(0)
    cases = 0
    for t, e, k, h, i in [(40, 8, 2, 64, 32), (9, 16, 4, 48, 24), (1, 4, 1, 32, 16)]:
        x = torch.randn(t, h, generator=g, device=device).to(torch.bfloat16)
        w1 = (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).to(torch.bfloat16)
        weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=g, device=device), -1), k)
        draw = torch.rand(ids.shape, generator=g, device=device)
        skipped = ids.masked_fill(draw < 0.25, -1).masked_fill((draw >= 0.25) & (draw < 0.5), e)
        for route in (ids, skipped):
            got = moe_grouped_mm(x, w1, w2, route, weights.to(torch.bfloat16)).float()
            want = moe_ref(x.float(), w1.float(), w2.float(), route, weights)
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
            cases += 1
        nothing = moe_grouped_mm(x, w1, w2, torch.full_like(ids, -1), weights)
        assert torch.equal(nothing, torch.zeros_like(nothing))
    return cases


@pytest.mark.slow
def test_grouped_mm_interpreted(run_interpreted):
    assert int(run_interpreted(__file__, "t.check_grouped_mm('cpu')")) == 6
