"""The block-FP8 CUDA kernels against their torch references (`kernels.fp8.reference`), at FP8 tolerance."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.fp8.blocks import dequantize_blocks, quantize_blocks
from deltaserve.kernels.fp8.reference import fp8_linear_ref, fp8_moe_ref, quantize_activations

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROWS = [1, 2, 3, 8, 64, 300]
# (N, K): aligned, partial row and column blocks, a narrow projection, 9B's down projection
SHAPES = [(256, 512), (200, 300), (64, 2048), (1000, 130), (4096, 12288), (9000, 256)]


def _weight(n: int, k: int, scale_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) / k**0.5
    return quantize_blocks(w, scale_rows)


def _arrival_counts(device: torch.device) -> torch.Tensor | None:
    """The kernels' arrival counts on `device` (none until a launch counts arrivals)."""
    from deltaserve.kernels.common.arrival import _counters

    return _counters.get(device)


def _close(out: torch.Tensor, ref: torch.Tensor, rel: float) -> None:
    """Within `rel` of the reference's largest magnitude."""
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= rel * ref.float().abs().max().item() + 1e-4, err


@pytest.mark.parametrize("tokens", [1, 37, 1000])  # one program's rows, a ragged tail, many programs
def test_act_quant_matches_reference(tokens):
    from deltaserve.kernels.fp8.cuda import act_quant_cuda

    x = torch.randn(tokens, 300, device="cuda", dtype=torch.bfloat16) * 3
    x[tokens // 2] = 0  # an all-zero token: a tiny scale, zeros out
    q, s = act_quant_cuda(x)
    q_ref, s_ref = quantize_activations(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # the same codes, but for a rounding tie of the division: one e4m3 step apart (at most 1/8 of a
    # normal code, 2^-9 among the subnormals)
    assert (q.float() - q_ref.float()).abs().le(q_ref.float().abs() * 0.13 + 2**-9).all()
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


@pytest.mark.parametrize("tokens", [1, 37, 64])
def test_act_quant_pads_rows_and_lays_scales_by_group(tokens):
    """cuBLAS's layout: rows padded to a multiple of 4 with zeros, the scales stored group-major."""
    from deltaserve.kernels.fp8.cuda import act_quant_cuda

    x = torch.randn(tokens, 640, device="cuda", dtype=torch.bfloat16)
    q, s = act_quant_cuda(x, rows_multiple=4, group_major=True)
    padded = -(-tokens // 4) * 4
    assert q.shape == (padded, 640) and s.shape == (padded, 5) and s.stride() == (1, padded)
    q0, s0 = act_quant_cuda(x)
    assert torch.equal(q[:tokens].float(), q0.float()) and torch.equal(s[:tokens], s0)
    assert not q[tokens:].float().any()


# (N, K) that cuBLAS takes: aligned, a partial 128-row block (208), 9B's down projection
CUBLAS_SHAPES = [(256, 512), (208, 1024), (4096, 12288)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_rows", [128, 1])
@pytest.mark.parametrize("n,k", CUBLAS_SHAPES)
@pytest.mark.parametrize("m", [17, 64, 301])
def test_fp8_gemm_cublas_matches_reference_and_triton(m, n, k, scale_rows, dtype):
    """cuBLAS's block-scaled GEMM does the reference's w8a8 math, as the Triton GEMM does, for row
    counts that are and are not multiples of 4."""
    from deltaserve.kernels.fp8.cuda import fp8_gemm_cuda

    w, s = _weight(n, k, scale_rows, m + n + k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    got = fp8_gemm_cuda(x, w, s, scale_rows, cublas=True)
    assert got.dtype == dtype and got.shape == (m, n) and got.is_contiguous()
    exact = 1e-2 if dtype == torch.bfloat16 else 1e-4
    _close(got, fp8_linear_ref(x.float(), w, s, scale_rows), exact + 1e-2)  # + rounding ties
    _close(got, fp8_gemm_cuda(x, w, s, scale_rows, cublas=False), exact + 1e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_rows", [128, 1])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", ROWS)
def test_fp8_linear_matches_reference(m, n, k, scale_rows, dtype):
    """Both paths (the GEMV for one row of a narrow weight, the GEMM) are w8a8: held to the
    reference but for rounding ties of the activations' quantization, and within FP8's error of
    the unquantized product."""
    from deltaserve.kernels.fp8.cuda import fp8_gemv_cuda, fp8_linear_cuda

    w, s = _weight(n, k, scale_rows, m + n + k)
    x = torch.randn(m, k, device="cuda").to(dtype)
    out = fp8_linear_cuda(x, w, s, scale_rows)
    assert out.dtype == dtype and out.shape == (m, n)
    exact = 1e-2 if dtype == torch.bfloat16 else 1e-4
    _close(out, fp8_linear_ref(x.float(), w, s, scale_rows), exact + 1e-2)  # + rounding ties
    _close(out, x.float() @ dequantize_blocks(w, s, scale_rows).T, 0.1)
    if m <= 8:  # the GEMV itself at every row count (serving sends it one row of narrow weights)
        _close(fp8_gemv_cuda(x, w, s, scale_rows), fp8_linear_ref(x.float(), w, s, scale_rows), exact + 1e-2)


@pytest.mark.parametrize("tiles", [(64, 4, 3), (16, 8, 8)])
@pytest.mark.parametrize("scale_rows", [128, 1])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 16, 40])
def test_fp8_gemm_k_split_matches_one_part(m, n, k, scale_rows, tiles):
    """K split across programs (at a split that leaves some parts no blocks at all, for the short
    K's) gives the one-part GEMM's result but for the order of its fp32 sums."""
    from deltaserve.kernels.fp8.cuda import fp8_gemm_cuda

    w, s = _weight(n, k, scale_rows, m + n + k)
    x = torch.randn(m, k, device="cuda") * 3
    x[0, : min(k, 128)] = 0  # an all-zero group
    got = fp8_gemm_cuda(x, w, s, scale_rows, tiles)
    want = fp8_gemm_cuda(x, w, s, scale_rows, (tiles[0], tiles[1], 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tiles", [None, (64, 4, 3)])
@pytest.mark.parametrize("nd", [64, 10, 200])  # 80B's and 9B's GDN gate rows, a partial tile, several
@pytest.mark.parametrize("m", [1, 3, 16, 24, 40, 42])  # past the skinny GEMM: cuBLAS in place, or (42) padded
def test_fp8_linear_with_unquantized_rows(m, nd, tiles, dtype):
    """A projection of FP8 rows followed by unquantized ones (a GDN in_proj's gate rows) writes
    both into one output; through the skinny GEMM from one launch, whose FP8 columns are the plain
    skinny GEMM's bits, and whose unquantized ones are the matmul in the inputs' dtype."""
    from deltaserve.kernels.fp8 import cuda as fp8_cuda

    n, k = 1024, 2048
    w, s = _weight(n, k, 128, m + nd)
    dense = (torch.randn(nd, k, device="cuda") / k**0.5).to(dtype)
    x = (torch.randn(m, k, device="cuda") * 3).to(dtype)
    if m <= fp8_cuda.SKINNY_MAX_ROWS:
        got = fp8_cuda.fp8_skinny_cuda(x, w, s, 128, tiles, dense=dense)
        assert torch.equal(got[:, :n], fp8_cuda.fp8_skinny_cuda(x, w, s, 128, tiles))
        counters = _arrival_counts(x.device)
        assert counters is None or not counters.any()
    else:
        got = fp8_cuda.fp8_linear_cuda(x, w, s, 128, dense=dense)
        _close(got[:, :n], fp8_linear_ref(x.float(), w, s, 128), 2e-2)
        assert torch.equal(got[:, :n], fp8_cuda.fp8_linear_cuda(x, w, s, 128))
    assert got.shape == (m, n + nd)
    want = x.float() @ dense.float().T
    _close(got[:, n:], want, 1e-5 if dtype == torch.float32 else 1e-2)
    out = torch.full((m, n + nd), float("nan"), device="cuda", dtype=dtype)
    fp8_cuda.fp8_linear_cuda(x, w, s, 128, out=out, dense=dense)  # in place, every column written
    assert torch.equal(out, fp8_cuda.fp8_linear_cuda(x, w, s, 128, dense=dense))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 3, 64, 300, 600])  # 600: past 2,048 pairs (64-row tiles) at top 4 and 10
@pytest.mark.parametrize(
    "e,h,inter,top_k,scale_rows", [(8, 256, 128, 2, 128), (16, 300, 96, 4, 1), (64, 2048, 512, 10, 128)]
)
def test_fp8_moe_matches_reference(t, e, h, inter, top_k, scale_rows, dtype):
    """Both paths (the skinny MoE up to SKINNY_MOE_PAIRS (token, expert) pairs, the grouped GEMMs
    past them) are w8a8: held to the reference but for rounding ties, and within
    FP8's error of the MoE on the dequantized experts."""
    from deltaserve.kernels.fp8.cuda import SKINNY_MOE_PAIRS, fp8_moe_cuda, moe_tiles
    from deltaserve.kernels.moe.reference import moe_ref

    g = torch.Generator(device="cuda").manual_seed(t + e)
    gu, gu_s = quantize_blocks(torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5, scale_rows)
    dn, dn_s = quantize_blocks(torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5, scale_rows)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    logits = torch.randn(t, e, device="cuda", generator=g)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    out = fp8_moe_cuda(x, gu, gu_s, dn, dn_s, scale_rows, ids, weights.to(dtype))
    deq = moe_ref(
        x.float(),
        dequantize_blocks(gu, gu_s, scale_rows),
        dequantize_blocks(dn, dn_s, scale_rows),
        ids,
        weights,
    )
    ref = fp8_moe_ref(x.float(), gu, gu_s, dn, dn_s, scale_rows, ids, weights)
    # bf16: the kernels quantize the bf16-rounded intermediate, the reference its fp32 value, and a
    # bf16 rounding moves about one e4m3 code in 32 by a step (6%); Hopper's wgmma (the skinny MoE,
    # the grouped GEMMs' 64-row and swapped tiles) keeps fewer bits in its FP8 sums than fp32, which
    # moves codes the same way in fp32; unswapped 16-row tiles' mma.sync sums in fp32
    # (docs/history/performance-2026-12.md, "How FP8 decode runs", its accuracy)
    tiles = moe_tiles(t * top_k)
    wgmma = t * top_k <= SKINNY_MOE_PAIRS or tiles[0] >= 64 or bool(tiles[5])
    exact = 4e-2 if dtype == torch.bfloat16 or wgmma else 1e-4
    _close(out, ref, exact + 1e-2)  # + rounding ties of the activations' quantization
    _close(out, deq, 0.1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "tiles,down_tiles",
    [
        ((16, 64, 128, 4, 4, 0), (128, 128, 4, 3)),  # mma.sync's 16 rows
        ((16, 64, 128, 4, 4, 1), (128, 128, 4, 3)),  # swapped: the weight's rows on wgmma's wide side
        ((16, 128, 128, 8, 3, 1), (64, 128, 4, 4, 0)),  # swapped gate/up, unswapped down
    ],
)
def test_fp8_moe_grouped_tiles_match_reference(tiles, down_tiles, dtype):
    """The grouped GEMMs at decode's tilings, swapped or not (320 pairs, past the skinny MoE's; an
    intermediate of 560 columns, so its last tile and scale block are part-filled): w8a8 as the
    reference."""
    from deltaserve.kernels.fp8.cuda import fp8_moe_cuda

    t, e, h, inter, top_k = 40, 64, 2048, 560, 8
    g = torch.Generator(device="cuda").manual_seed(7)
    gu, gu_s = quantize_blocks(torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5)
    dn, dn_s = quantize_blocks(torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    weights, ids = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1).topk(top_k, dim=-1)
    out = fp8_moe_cuda(x, gu, gu_s, dn, dn_s, 128, ids, weights.to(dtype), tiles, down_tiles)
    ref = fp8_moe_ref(x.float(), gu, gu_s, dn, dn_s, 128, ids, weights)
    exact = 4e-2 if dtype == torch.bfloat16 or tiles[5] or down_tiles[4:] == (1,) else 1e-4
    _close(out, ref, exact + 1e-2)


def test_fp8_linear_is_graph_capturable():
    from deltaserve.kernels.fp8.cuda import fp8_linear_cuda

    w, s = _weight(512, 1024, 128, 0)
    # the GEMV, the Triton GEMM with a K split (decode's rows on a narrow weight), cuBLAS
    for m in (1, 4, 64):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        expected = fp8_linear_cuda(x, w, s, 128)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_linear_cuda(x, w, s, 128)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("t", [4, 100])  # the skinny MoE (12 pairs), the grouped GEMMs (300)
def test_fp8_moe_skips_masked_ids(t):
    """Ids -1 and E (another expert-parallel rank's experts) add nothing: bit for bit the
    kernel with those assignments on a valid expert at weight zero."""
    from deltaserve.kernels.fp8.cuda import fp8_moe_cuda

    e, h, inter = 8, 256, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    gu, gu_s = quantize_blocks(torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5, 128)
    dn, dn_s = quantize_blocks(torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5, 128)
    x = torch.randn(t, h, device="cuda", generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1).topk(3, dim=-1)
    weights = weights.to(torch.bfloat16)
    skipped = ids.clone()
    skipped[::2, 0] = -1
    skipped[1::3, 2] = e
    keep = (skipped >= 0) & (skipped < e)
    out = fp8_moe_cuda(x, gu, gu_s, dn, dn_s, 128, skipped, weights)
    zero_weight = fp8_moe_cuda(x, gu, gu_s, dn, dn_s, 128, ids, weights * keep)
    torch.testing.assert_close(out, zero_weight, rtol=0, atol=0)
    assert not torch.equal(out, fp8_moe_cuda(x, gu, gu_s, dn, dn_s, 128, ids, weights))


@pytest.mark.parametrize("tiles", [None, (64, 4, 1), (64, 3, 3), (128, 4, 8)])
@pytest.mark.parametrize("scale_rows", [128, 1])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 16, 24, 32, 64])  # 16-row MMAs up to 16, then 32 and 64
def test_fp8_skinny_matches_gemm(m, n, k, scale_rows, tiles):
    """The skinny GEMM (weight rows as the MMA's wide side, a K split summed by its last part, at
    splits that leave some parts no blocks) is the reference's w8a8 math, and the Triton GEMM's
    result but for the tensor cores' own accumulation within each 128-column block (wgmma's FP8
    sums keep fewer bits than fp32); it leaves its counters at zero, so a second call gives the
    same bits."""
    from deltaserve.kernels.fp8 import cuda as fp8_cuda

    w, s = _weight(n, k, scale_rows, m + n + k)
    x = torch.randn(m, k, device="cuda") * 3
    x[0, : min(k, 128)] = 0  # an all-zero group
    got = fp8_cuda.fp8_skinny_cuda(x, w, s, scale_rows, tiles)
    _close(got, fp8_linear_ref(x, w, s, scale_rows), 1e-4 + 1e-2)  # + rounding ties
    _close(got, fp8_cuda.fp8_gemm_cuda(x, w, s, scale_rows, (64, 4, 1), cublas=False), 1e-3)
    assert not torch.equal(got, torch.zeros_like(got))
    assert torch.equal(fp8_cuda.fp8_skinny_cuda(x, w, s, scale_rows, tiles), got)
    counters = _arrival_counts(x.device)  # none until a launch splits K
    assert counters is None or not counters.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t", [1, 3, 6])
@pytest.mark.parametrize(
    "e,h,inter,top_k,scale_rows", [(8, 256, 128, 2, 128), (16, 300, 96, 4, 1), (512, 2048, 512, 10, 128)]
)
def test_fp8_moe_skinny_matches_gemv(t, e, h, inter, top_k, scale_rows, dtype):
    """The skinny MoE (gate and up rows on wgmma's wide side, H split at few assignments, the
    intermediate quantized by whoever finishes its block, the experts' sum added by the last of
    a token's assignments) gives the per-assignment GEMVs' result but for the tensor cores' own
    sums, the intermediate's roundings they move and one rounding of the experts' sum; another
    rank's experts add nothing; its counters end at zero, so a second call, on memory filled with NaN
    in between, gives the same bits."""
    from deltaserve.kernels.fp8 import cuda as fp8_cuda
    from deltaserve.kernels.moe.cuda import moe_gemv_cuda

    g = torch.Generator(device="cuda").manual_seed(t + e)
    gu, gu_s = quantize_blocks(torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5, scale_rows)
    dn, dn_s = quantize_blocks(torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5, scale_rows)
    x = torch.randn(t, h, device="cuda", generator=g).to(dtype)
    weights, ids = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1).topk(top_k, dim=-1)
    weights = weights.to(dtype)
    ids[0, 0] = -1  # another rank's expert
    got = fp8_cuda.fp8_moe_skinny_cuda(x, gu, gu_s, dn, dn_s, scale_rows, ids, weights)
    want = moe_gemv_cuda(x, gu, dn, ids, weights, gu_s, dn_s, scale_rows)
    # wgmma's FP8 sums keep fewer bits than fp32, which moves a few of the intermediate's e4m3
    # roundings by a step (6%); bf16 as test_fp8_moe_matches_reference
    _close(got, want, 5e-2 if dtype == torch.bfloat16 else 1e-2)
    torch.full((64 << 20,), float("nan"), device="cuda")  # freed to the cache: a part read unwritten shows
    assert torch.equal(fp8_cuda.fp8_moe_skinny_cuda(x, gu, gu_s, dn, dn_s, scale_rows, ids, weights), got)
    counts = _arrival_counts(x.device)
    assert counts is not None and not counts.any()


def test_fp8_decode_graph_with_pdl_equals_plain_launches(monkeypatch):
    """A chain of batch-1 decode's FP8 kernels (the skinny GEMM with and without a K split, the
    GEMV, the skinny MoE and the per-assignment MoE GEMVs) replayed from a graph with programmatic
    dependent launch: bit for bit what plain launches compute."""
    from deltaserve.kernels.fp8.cuda import fp8_gemv_cuda, fp8_moe_skinny_cuda, fp8_skinny_cuda
    from deltaserve.kernels.moe.cuda import moe_gemv_cuda

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0 (the launches would be plain ones)")
    g = torch.Generator(device="cuda").manual_seed(5)
    layers = []
    for i in range(6):
        experts = [
            quantize_blocks(torch.randn(8, *shape, device="cuda", generator=g) / 32)
            for shape in ((256, 1024), (1024, 128))
        ]
        layers.append((_weight(512, 1024, 128, i), _weight(1024, 512, 128, 100 + i), experts))
    ids = torch.tensor([[1, 6]], device="cuda")
    weights = torch.tensor([[0.7, 0.3]], device="cuda", dtype=torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        for (up, up_s), (down, down_s), ((gu, gu_s), (dn, dn_s)) in layers:
            # RMS-normalized as a model's layer input is: the MoE is quadratic in x, and six layers
            # of it grew some random inputs past bf16's range (NaN, which never compares equal)
            x = x * torch.rsqrt(x.float().square().mean() + 1e-6).to(x.dtype)
            h = fp8_skinny_cuda(x, up, up_s, 128, (64, 4, 4))  # K split in four
            x = fp8_gemv_cuda(h, down, down_s, 128) + fp8_skinny_cuda(h, down, down_s, 128)
            x = x + fp8_moe_skinny_cuda(x, gu, gu_s, dn, dn_s, 128, ids, weights)
            x = x + moe_gemv_cuda(x, gu, dn, ids, weights, gu_s, dn_s, 128)
        return x

    inputs = [torch.randn(1, 1024, device="cuda", generator=g).bfloat16() for _ in range(4)]
    monkeypatch.setenv("DELTASERVE_PDL", "off")
    expected = [chain(x) for x in inputs]
    monkeypatch.setenv("DELTASERVE_PDL", "on")
    x_in = torch.zeros_like(inputs[0])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain(x_in)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x_in)
    for x, want in zip(inputs, expected):
        x_in.copy_(x)
        graph.replay()
        assert want.isfinite().all() and want.abs().max() > 0
        torch.testing.assert_close(out, want, rtol=0, atol=0)
