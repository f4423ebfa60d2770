"""The fused Triton norms and GDN gates against their torch references, on CUDA."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.norm import reference as N

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype):
    # bf16: one rounding of the output apart (the kernels keep fp32 where the reference rounds)
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def randn(*shape, dtype, scale=1.0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_centered", [True, False])
@pytest.mark.parametrize("rows,dim", [(1, 1024), (7, 4096), (300, 2048), (3, 100)])
def test_rms_norm_and_residual_add(dtype, zero_centered, rows, dim):
    from deltaserve.kernels.norm.triton import add_rms_norm_launch, rms_norm_launch

    x, r = randn(rows, dim, dtype=dtype), randn(rows, dim, dtype=dtype, seed=1)
    w = randn(dim, dtype=dtype, scale=0.2, seed=2)
    ref = N.rms_norm_ref(x, w, 1e-6, zero_centered)
    torch.testing.assert_close(rms_norm_launch(x, w, 1e-6, zero_centered), ref, **tol(dtype))
    y, s = add_rms_norm_launch(x, r, w, 1e-6, zero_centered)
    assert torch.equal(s, x + r)  # the residual stream is rounded as the unfused add rounds it
    torch.testing.assert_close(y, N.rms_norm_ref(x + r, w, 1e-6, zero_centered), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary", [(256, 64), (128, 128), (64, 32)])
def test_qk_norm_rope_on_a_strided_view(dtype, head_dim, rotary):
    from deltaserve.kernels.norm.triton import rms_norm_rope_launch

    t, h = 9, 4
    q = randn(t, h, 2 * head_dim, dtype=dtype)[..., :head_dim]  # q beside its gate, as q_proj lays it
    w = randn(head_dim, dtype=dtype, scale=0.2, seed=1)
    pos = torch.tensor([0, 1, 2, 5, 17, 100, 1000, 4095, 70000], device="cuda")
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rotary, 2, device="cuda").float() / rotary))
    ref = N.rope_ref(N.rms_norm_ref(q, w, 1e-6, True), pos, inv_freq)
    torch.testing.assert_close(rms_norm_rope_launch(q, w, 1e-6, pos, inv_freq), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [None, 1, 16])  # the default, and each tiling it picks between
@pytest.mark.parametrize("t", [5, 300])
def test_gated_norm_reads_the_gate_inside_the_projection(dtype, rows, t):
    from deltaserve.kernels.norm.triton import gated_rms_norm_launch

    h, d = 16, 128
    proj = randn(t, 3 * h * d + 7, dtype=dtype)
    z = proj[:, h * d : 2 * h * d].view(t, h, d)
    o = randn(t, h, d, dtype=dtype, seed=1)
    w = randn(d, dtype=dtype, scale=0.5, seed=2)
    ref = N.gated_rms_norm_ref(o, z, w, 1e-6)
    torch.testing.assert_close(gated_rms_norm_launch(o, z, w, 1e-6, rows=rows), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_gates(dtype):
    from deltaserve.kernels.norm.triton import gdn_gates_launch

    t, h = 33, 32
    proj = randn(t, 4 * h, dtype=dtype, scale=8.0)  # large enough to reach softplus' linear part
    b, a = proj[:, h : 2 * h], proj[:, 3 * h :]
    A_log, dt_bias = randn(h, dtype=dtype, seed=1), randn(h, dtype=dtype, seed=2)
    g, beta = gdn_gates_launch(a, b, A_log, dt_bias)
    g_ref, beta_ref = N.gdn_gates_ref(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(beta, beta_ref, **tol(dtype))


def test_norms_replay_in_a_cuda_graph():
    from deltaserve.kernels.norm.triton import add_rms_norm_launch

    x, r = randn(4, 512, dtype=torch.bfloat16), randn(4, 512, dtype=torch.bfloat16, seed=1)
    w = randn(512, dtype=torch.bfloat16, seed=2)
    add_rms_norm_launch(x, r, w, 1e-6, True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, s = add_rms_norm_launch(x, r, w, 1e-6, True)
    x.copy_(randn(4, 512, dtype=torch.bfloat16, seed=3))
    graph.replay()
    assert torch.equal(s, x + r)
    torch.testing.assert_close(y, N.rms_norm_ref(x + r, w, 1e-6, True), **tol(torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 3584), (64, 12288), (5, 100)])
def test_silu_and_mul(dtype, rows, inter):
    from deltaserve.kernels.norm.triton import silu_and_mul_launch

    x = randn(rows, 2 * inter, dtype=dtype, scale=3.0)
    torch.testing.assert_close(silu_and_mul_launch(x), N.silu_and_mul_ref(x), **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [7, 300])  # one row a program, 16 rows a program
def test_kda_gate_and_sigmoid_gated_norm(dtype, t):
    from deltaserve.kernels.norm.triton import gated_rms_norm_launch, kda_gate_launch

    h, d = 32, 128  # Kimi-Linear-48B's KDA heads
    proj = randn(t, 3 * h * d, dtype=dtype, scale=6.0)
    f = proj[:, : h * d]
    dt_bias, A_log = randn(h * d, dtype=dtype, seed=1), randn(h, dtype=dtype, seed=2)
    g = kda_gate_launch(f, dt_bias, A_log, d)
    torch.testing.assert_close(g, N.kda_gate_ref(f, dt_bias, A_log, d), atol=1e-5, rtol=1e-5)
    x, z = randn(t, h, d, dtype=dtype, seed=3), proj[:, h * d : 2 * h * d].view(t, h, d)
    w = randn(d, dtype=dtype, seed=4)
    out = gated_rms_norm_launch(x, z, w, 1e-6, "sigmoid")
    torch.testing.assert_close(out, N.gated_rms_norm_ref(x, z, w, 1e-6, "sigmoid"), **tol(dtype))
