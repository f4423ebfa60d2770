"""The fused Triton MoE against the torch reference, eager and under a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.moe.reference import moe_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def inputs(t, e, k, h, i, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).to(dtype)
    logits = torch.randn(t, e, device="cuda", generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), k)
    return x, w1, w2, ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("e,k", [(8, 2), (64, 8)])
@pytest.mark.parametrize("h,i", [(64, 32), (128, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_matches_reference(t, e, k, h, i, dtype):
    from deltaserve.kernels.moe.cuda import fused_moe_cuda

    x, w1, w2, ids, wts = inputs(t, e, k, h, i, dtype)
    ref = moe_ref(x.float(), w1.float(), w2.float(), ids, wts.float())
    out = fused_moe_cuda(x, w1, w2, ids, wts)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3  # tf32 dots in fp32
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("tiles", [(16, 64, 128, 4, 3, 1), (16, 128, 64, 4, 3, 1), (16, 64, 64, 4, 3, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_swapped_tiles_match_reference(tiles, dtype):
    """The grouped GEMMs with the weight's rows on the MMA's wide side (swap 1) or not, at decode's
    16-row tiles, past the per-pair GEMV (320 pairs; an intermediate of 160 part-fills its last tile)."""
    from deltaserve.kernels.moe.cuda import fused_moe_cuda

    x, w1, w2, ids, wts = inputs(40, 64, 8, 256, 160, dtype, seed=3)
    ref = moe_ref(x.float(), w1.float(), w2.float(), ids, wts.float())
    out = fused_moe_cuda(x, w1, w2, ids, wts, tiles)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_fused_moe_replays_in_a_cuda_graph():
    from deltaserve.kernels.moe.cuda import fused_moe_cuda

    x, w1, w2, ids, wts = inputs(16, 32, 4, 64, 64, torch.bfloat16)
    fused_moe_cuda(x, w1, w2, ids, wts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_cuda(x, w1, w2, ids, wts)
    x2, _, _, ids2, wts2 = inputs(16, 32, 4, 64, 64, torch.bfloat16, seed=1)
    x.copy_(x2)
    ids.copy_(ids2)
    wts.copy_(wts2)
    graph.replay()
    ref = moe_ref(x.float(), w1.float(), w2.float(), ids, wts.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _skip_some(ids: torch.Tensor, e: int, seed: int) -> torch.Tensor:
    """About half the assignments skipped, as -1 or as e (both mean another rank's expert)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    draw = torch.rand(ids.shape, device="cuda", generator=g)
    return ids.masked_fill(draw < 0.25, -1).masked_fill((draw >= 0.25) & (draw < 0.5), e)


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_skips_masked_ids(t, dtype):
    """Expert parallelism masks other ranks' experts: skipped assignments add nothing. Held to
    the reference, and bit for bit to the kernel run with those assignments on a valid expert
    at weight zero; all skipped is exactly zero."""
    from deltaserve.kernels.moe.cuda import fused_moe_cuda

    e = 8
    x, w1, w2, ids, wts = inputs(t, e, 4, 128, 96, dtype)
    skipped = _skip_some(ids, e, t)
    keep = (skipped >= 0) & (skipped < e)
    assert 0 < int(keep.sum()) < keep.numel() or t == 1
    out = fused_moe_cuda(x, w1, w2, skipped, wts)
    ref = moe_ref(x.float(), w1.float(), w2.float(), skipped, wts.float())
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    zero_weight = fused_moe_cuda(x, w1, w2, ids, wts * keep)
    torch.testing.assert_close(out, zero_weight, rtol=0, atol=0)
    nothing = fused_moe_cuda(x, w1, w2, torch.full_like(ids, -1), wts)
    assert torch.equal(nothing, torch.zeros_like(nothing))


def test_fused_moe_with_masked_ids_replays_in_a_cuda_graph():
    """The skip pattern changes between replays (each step routes anew): no stale rows."""
    from deltaserve.kernels.moe.cuda import fused_moe_cuda

    e = 32
    x, w1, w2, ids, wts = inputs(16, e, 4, 64, 64, torch.bfloat16)
    ids.copy_(_skip_some(ids, e, 0))
    fused_moe_cuda(x, w1, w2, ids, wts)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_cuda(x, w1, w2, ids, wts)
    for seed in (1, 2):
        x2, _, _, ids2, wts2 = inputs(16, e, 4, 64, 64, torch.bfloat16, seed=seed)
        x.copy_(x2)
        ids.copy_(_skip_some(ids2, e, seed))
        wts.copy_(wts2)
        graph.replay()
        ref = moe_ref(x.float(), w1.float(), w2.float(), ids, wts.float())
        torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def _needs_grouped_mm() -> None:
    from deltaserve.kernels.moe.cuda import _grouped_mm_device

    if not _grouped_mm_device(torch.device("cuda")):
        pytest.skip("torch's grouped GEMM needs a Hopper GPU or later")


@pytest.mark.parametrize("t,e,k", [(300, 64, 8), (2048, 16, 8), (6144, 16, 8), (97, 8, 2)])
def test_grouped_mm_path_matches_reference_and_triton(t, e, k):
    """Prefill's bf16 experts through torch's grouped GEMM: held to the reference as the Triton
    GEMMs are, and close to them; `fused_moe_cuda` takes it from GROUPED_MM_ASSIGNMENTS pairs."""
    _needs_grouped_mm()
    from deltaserve.kernels.moe import cuda

    x, w1, w2, ids, wts = inputs(t, e, k, 128, 96, torch.bfloat16, seed=t)
    ref = moe_ref(x.float(), w1.float(), w2.float(), ids, wts.float())
    grouped = cuda.moe_grouped_mm(x, w1, w2, ids, wts)
    triton_path = cuda.fused_moe_cuda(x, w1, w2, ids, wts, cuda.grouped_tiles(t * k, 2))
    torch.testing.assert_close(grouped.float(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grouped.float(), triton_path.float(), atol=2e-2, rtol=2e-2)
    took = cuda.fused_moe_cuda(x, w1, w2, ids, wts)
    assert torch.equal(took, grouped) == (t * k >= cuda.GROUPED_MM_ASSIGNMENTS)


def test_grouped_mm_path_skips_masked_ids_and_replays_in_a_graph():
    """Other ranks' assignments (-1 or E) add nothing, as in the Triton GEMMs; the path holds no
    host sync, so a graph captures it and replays new routes."""
    _needs_grouped_mm()
    from deltaserve.kernels.moe.cuda import moe_grouped_mm

    e = 16
    x, w1, w2, ids, wts = inputs(512, e, 4, 128, 96, torch.bfloat16)
    skipped = _skip_some(ids, e, 5)
    keep = (skipped >= 0) & (skipped < e)
    out = moe_grouped_mm(x, w1, w2, skipped, wts)
    torch.testing.assert_close(out, moe_grouped_mm(x, w1, w2, ids, wts * keep), rtol=0, atol=0)
    ref = moe_ref(x.float(), w1.float(), w2.float(), skipped, wts.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    nothing = moe_grouped_mm(x, w1, w2, torch.full_like(ids, -1), wts)
    assert torch.equal(nothing, torch.zeros_like(nothing))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_grouped_mm(x, w1, w2, ids, wts)
    for seed in (1, 2):
        x2, _, _, ids2, wts2 = inputs(512, e, 4, 128, 96, torch.bfloat16, seed=seed)
        x.copy_(x2)
        ids.copy_(_skip_some(ids2, e, seed))
        wts.copy_(wts2)
        graph.replay()
        ref = moe_ref(x.float(), w1.float(), w2.float(), ids, wts.float())
        torch.testing.assert_close(captured.float(), ref, atol=2e-2, rtol=2e-2)
