"""The ops that write an FP8 matmul's input (the norms, the attention's gate, SwiGLU) quantize it on their way out at
decode's few rows: what they keep must be what `act_quant_cuda` makes of their output, bit for
bit, and a matmul takes it only for that very output. On CUDA; on CPU through Triton's
interpreter in a process of its own (the interpreter is chosen when Triton is imported)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.fp8 import cuda as F


def check_fused_quantization(device: str) -> int:
    """Each fused op against its unfused launch and `act_quant_cuda` of that output; returns the
    number of cases checked."""
    from deltaserve.kernels.norm import triton as N

    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    def kept_equals_act_quant(y: torch.Tensor, unfused: torch.Tensor) -> None:
        assert torch.equal(y, unfused)
        rows = y.reshape(y.shape[0], -1)
        kept = F._kept_quantization(rows)
        assert kept is not None, y.shape
        F._kept = None
        q, s = F.act_quant_cuda(rows)
        assert torch.equal(kept[0].view(torch.uint8), q.view(torch.uint8)) and torch.equal(kept[1], s)

    cases = 0
    for rows, d in [(1, 256), (3, 640), (16, 2048), (2, 300), (32, 512)]:  # 300: a partial last group
        x, r, w = randn(rows, d), randn(rows, d), randn(d, scale=0.2)
        for zc in (True, False):
            kept_equals_act_quant(
                N.rms_norm_launch(x, w, 1e-6, zc, quantize=True), N.rms_norm_launch(x, w, 1e-6, zc)
            )
            kept_equals_act_quant(
                N.add_rms_norm_launch(x, r, w, 1e-6, zc, quantize=True)[0],
                N.add_rms_norm_launch(x, r, w, 1e-6, zc)[0],
            )
            cases += 2
    for t, h, d in [(1, 4, 128), (5, 3, 256), (16, 2, 128), (24, 2, 128)]:
        x, w = randn(t, h, d), randn(d)
        z = randn(t, h, 2 * d)[..., :d]  # the gate inside the projection's output, as GDN's z
        for kind in ("silu", "sigmoid"):
            kept_equals_act_quant(
                N.gated_rms_norm_launch(x, z, w, 1e-6, kind, quantize=True),
                N.gated_rms_norm_launch(x, z, w, 1e-6, kind),
            )
            cases += 1
    for t, h, d in [(1, 2, 256), (7, 3, 128)]:  # the attention's output gate, inside q_proj's rows
        x, qg = randn(t, h, d), randn(t, h, 2 * d)
        kept_equals_act_quant(
            N.sigmoid_gate_launch(x, qg[..., d:], quantize=True), N.sigmoid_gate_launch(x, qg[..., d:])
        )
        cases += 1
    for t, i in [(1, 512), (3, 3000), (16, 128), (32, 256)]:
        x = randn(t, 2 * i, scale=3.0)
        kept_equals_act_quant(N.silu_and_mul_launch(x, quantize=True), N.silu_and_mul_launch(x))
        cases += 1
    # nothing kept past decode's rows, nor for heads that split a 128-channel group
    F._kept = None
    w = randn(256)
    N.rms_norm_launch(randn(F.FUSED_QUANT_ROWS + 1, 256), w, 1e-6, True, quantize=True)
    N.gated_rms_norm_launch(randn(2, 4, 64), randn(2, 4, 64), randn(64), 1e-6, quantize=True)
    assert F._kept is None
    return cases + 1


def test_a_kept_quantization_serves_only_its_own_rows():
    y = torch.randn(4, 2, 128)
    q, s = F.quantized_buffers(4, 256, y.device)
    F.keep_quantized(y, q, s)
    try:
        hit = F._kept_quantization(y.view(4, 256))
        assert hit is not None and hit[0] is q and hit[1] is s
        assert F._kept_quantization(y.view(8, 128)) is None  # other rows: other groups
        assert F._kept_quantization(y.view(4, 256)[:2]) is None  # a part of the rows
        assert F._kept_quantization(y.view(4, 256)[:, :128]) is None
        assert F._kept_quantization(y.view(4, 256).to(torch.bfloat16)) is None
        assert F._kept_quantization(torch.randn(4, 256)) is None
    finally:
        F._kept = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fused_quantization_on_cuda():
    assert check_fused_quantization("cuda") > 20


@pytest.mark.slow
def test_fused_quantization_interpreted(run_interpreted):
    assert int(run_interpreted(__file__, "t.check_fused_quantization('cpu')")) > 20
