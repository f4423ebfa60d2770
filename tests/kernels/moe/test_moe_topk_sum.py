"""The MoE's sum over each token's top-k rows (`topk_sum_cuda`) is those rows added in k order in
fp32 and rounded once, bit for bit. On CUDA; on CPU through Triton's interpreter in a process of
its own (the interpreter is chosen when Triton is imported), whose cast to bf16 truncates: there
within one bf16 step."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.moe.cuda import topk_sum_cuda


def check_topk_sum(device: str) -> int:
    """Each case against the rows summed in order here; returns the number of cases checked."""
    g = torch.Generator(device=device).manual_seed(0)
    cases = 0
    for t, k, h in [(1, 2, 64), (32, 11, 2048), (5, 8, 1500), (0, 4, 128)]:  # 1500: a partial block
        for dtype in (torch.bfloat16, torch.float32):
            parts = (torch.randn(t * k, h, generator=g, device=device) * 4).to(dtype)
            want = torch.zeros(t, h, device=device)
            for j in range(k):
                want += parts.view(t, k, h)[:, j].float()
            got = topk_sum_cuda(parts, k)
            assert got.shape == (t, h) and got.dtype == dtype
            if device == "cpu" and dtype == torch.bfloat16:  # the interpreter's cast to bf16 truncates
                assert ((got.float() - want).abs() <= want.abs() * 2**-7).all(), (t, k, h)
            else:
                assert torch.equal(got, want.to(dtype)), (t, k, h, dtype)
            cases += 1
    return cases


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_topk_sum_on_cuda():
    assert check_topk_sum("cuda") == 8


@pytest.mark.slow
def test_topk_sum_interpreted(run_interpreted):
    assert int(run_interpreted(__file__, "t.check_topk_sum('cpu')")) == 8
