"""Fused MoE on CUDA: assignments grouped by expert (`moe/align.py`), then two grouped GEMMs;
for a few tokens, one GEMV per assignment instead (`moe/triton_gemv.py`); for prefill's many
bf16 assignments, torch's grouped GEMM (`torch._grouped_mm`, CUTLASS) between a gather and a
weighted sum of our own."""

from __future__ import annotations

import functools

import torch

from deltaserve.kernels.common.launch import env_mode

GEMV_ASSIGNMENTS = 128  # up to this many (token, expert) pairs the experts' rows are streamed per pair
# from this many pairs (about 6k tokens) bf16 experts gain from torch's grouped GEMM (bench/ops/moe_grouped_mm.py)
GROUPED_MM_ASSIGNMENTS = 49152
MOE_GEMM_MODES = ("auto", "triton")
_GEMV_ACC = 4096  # fp32 products a program keeps, BN x S x 128: more spill at sm_90's 255 registers


def grouped_tiles(assignments: int, element_size: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the grouped GEMMs: 16-row tiles for decode's
    batches, 64-row ones for prefill (bench/ops/fp8_gemm.py --moe --bf16; the timings:
    docs/history/performance-2026-12.md, "FP8 checkpoints, change by change"); fp32's
    twice as wide values in smaller tiles, within the shared memory."""
    if element_size > 2:
        return (16, 64, 64, 4, 3) if assignments <= 512 else (64, 64, 64, 8, 3)
    if assignments <= 2048:
        return 16, 64, 128, 4, 3
    return 64, 128, 64, 4, 4


def topk_sum_cuda(parts: torch.Tensor, top_k: int) -> torch.Tensor:
    """`parts.view(T, top_k, H).sum(dim=1)` (`parts`: `[T * top_k, H]`, contiguous), summed in k
    order in fp32, in one launch that can start before the GEMM writing `parts` ends (PDL)."""
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.moe.triton import _topk_sum_kernel

    n, h = parts.shape
    assert parts.is_contiguous() and n % top_k == 0, (parts.shape, parts.stride(), top_k)
    out = torch.empty(n // top_k, h, dtype=parts.dtype, device=parts.device)
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(h))
    _topk_sum_kernel[(n // top_k, triton.cdiv(h, block))](
        parts, out, h, TOP_K=top_k, BLOCK=block, num_warps=4, **pdl_args(parts.device)
    )
    return out


def fused_moe_cuda(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """`tiles`: the grouped GEMMs' (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, swap]), `grouped_tiles`
    unless given (`bench/ops/fp8_gemm.py --moe --bf16` sweeps them); swap 1 puts the weight's rows
    on the MMA's wide side (off unless given: within 2% of `mma.sync` at decode's sizes, whose
    bf16 expert reads are near the bandwidth already)."""
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.moe.align import align_cuda
    from deltaserve.kernels.moe.triton import _moe_down_kernel, _moe_gate_up_kernel

    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    if n <= GEMV_ASSIGNMENTS:
        return moe_gemv_cuda(x, gate_up, down, topk_ids, topk_weights)
    if tiles is None and n >= GROUPED_MM_ASSIGNMENTS and grouped_mm_applies(x, gate_up, down):
        return moe_grouped_mm(x, gate_up, down, topk_ids, topk_weights)
    block_m, block_n, block_k, warps, stages, *rest = tiles or grouped_tiles(n, x.element_size())
    swap = bool(rest and rest[0])
    x = x.contiguous()
    rows, block_expert = align_cuda(topk_ids, e, block_m)
    inter = torch.empty(n, inter_size, dtype=x.dtype, device=x.device)
    # fp32 serving asks for fp32 results: no tf32 rounding inside the dots
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid1 = (block_expert.numel(), triton.cdiv(inter_size, block_n))
    _moe_gate_up_kernel[grid1](
        x, gate_up, rows, block_expert, inter, n, h, inter_size, top_k, e,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, SWAP=swap, num_warps=warps,
        num_stages=stages,
        **pdl_args(x.device),
    )  # fmt: skip
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    grid2 = (block_expert.numel(), triton.cdiv(h, block_n))
    _moe_down_kernel[grid2](
        inter, down, rows, block_expert, weights, out, n, h, inter_size, e,
        inter.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, SWAP=swap, num_warps=warps,
        num_stages=stages,
        **pdl_args(inter.device),
    )  # fmt: skip
    return topk_sum_cuda(out, top_k)


def moe_gemv_tiles(n: int, k: int, assignments: int, acc: int, sms: int) -> tuple[int, int]:
    """(BN, S): S 128-column blocks per iteration (up to 4), BN rows within `acc` products, fewer
    while the grid would leave SMs without two programs."""
    import triton

    s = min(4, triton.next_power_of_2(triton.cdiv(k, 128)))
    bn = max(1, acc // (s * 128))
    while bn > 1 and triton.cdiv(n, bn) * assignments < 2 * sms:
        bn //= 2
    return bn, s


def moe_gemv_cuda(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    scale_rows: int = 128,
) -> torch.Tensor:
    """The fused MoE for a few tokens: each assignment's expert rows read once by programs of
    their own. With scales, the experts are e4m3 (scales per `scale_rows` x 128 block) and both
    inputs are quantized per 128 channels in the kernels, as `fp8.cuda.fp8_moe_cuda` does."""
    import triton

    from deltaserve.kernels.common.launch import sm_count
    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.moe.triton_gemv import _moe_gemv_down_kernel, _moe_gemv_gate_up_kernel

    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    fp8 = gate_up_scale is not None and down_scale is not None
    gs = gate_up_scale if gate_up_scale is not None else gate_up
    ds = down_scale if down_scale is not None else down
    sms = sm_count(x.device)
    pdl = pdl_args(x.device)
    inter = torch.empty(n, inter_size, dtype=x.dtype, device=x.device)
    bn, s = moe_gemv_tiles(inter_size, h, n, _GEMV_ACC // 2, sms)
    _moe_gemv_gate_up_kernel[(triton.cdiv(inter_size, bn), n)](
        x, gate_up, gs, ids, inter, h, inter_size, top_k, e,
        x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gs.stride(0) if fp8 else 0, gs.stride(1) if fp8 else 0, inter.stride(0),
        SCALE_ROWS=scale_rows, HAS_SCALE=fp8, BN=bn, S=s, BLOCK=128, num_warps=4, **pdl,
    )  # fmt: skip
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    bn, s = moe_gemv_tiles(h, inter_size, n, _GEMV_ACC, sms)
    _moe_gemv_down_kernel[(triton.cdiv(h, bn), n)](
        inter, down, ds, ids, weights, out, h, inter_size, e,
        inter.stride(0), down.stride(0), down.stride(1),
        ds.stride(0) if fp8 else 0, ds.stride(1) if fp8 else 0, out.stride(0),
        SCALE_ROWS=scale_rows, HAS_SCALE=fp8, BN=bn, S=s, BLOCK=128, num_warps=4, **pdl,
    )  # fmt: skip
    return topk_sum_cuda(out, top_k)


def moe_gemm_mode() -> str:
    """`DELTASERVE_MOE_GEMM`: `auto` (torch's grouped GEMM for prefill's bf16 experts) or `triton`."""
    return env_mode("DELTASERVE_MOE_GEMM", MOE_GEMM_MODES, "auto")


@functools.cache
def _grouped_mm_device(device: torch.device) -> bool:
    # torch's grouped GEMM runs on Hopper and later
    return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability(device)[0] >= 9


def grouped_mm_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """bf16 experts whose widths CUTLASS takes (multiples of 8), stored row-major per expert."""
    return (
        moe_gemm_mode() == "auto"
        and x.dtype == gate_up.dtype == down.dtype == torch.bfloat16
        and gate_up.is_contiguous()
        and down.is_contiguous()
        and all(d % 8 == 0 for d in (*gate_up.shape[1:], down.shape[1]))
        and _grouped_mm_device(x.device)
    )


def moe_grouped_mm(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`fused_moe_cuda` through `torch._grouped_mm`: the assignments sorted by expert (other ranks'
    last, past every group), their tokens' rows gathered, gate/up, SwiGLU, down, then each token's
    rows weighted and summed in k order in fp32 (`_topk_gather_sum_kernel`). No host sync."""
    import triton

    from deltaserve.kernels.moe.triton import _topk_gather_sum_kernel
    from deltaserve.kernels.norm import silu_and_mul

    t, h = x.shape
    e = gate_up.shape[0]
    top_k = topk_ids.shape[1]
    flat = topk_ids.reshape(-1)
    held = (flat >= 0) & (flat < e)
    keys, order = torch.sort(torch.where(held, flat, e), stable=True)
    ends = torch.searchsorted(keys, torch.arange(e, device=x.device, dtype=keys.dtype), right=True)
    ends = ends.to(torch.int32)
    rows = torch.empty_like(order)  # each assignment's row in expert order
    rows[order] = torch.arange(order.numel(), device=x.device)
    xs = x.index_select(0, order // top_k)
    inter = silu_and_mul(torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends))
    y = torch._grouped_mm(inter, down.transpose(1, 2), offs=ends)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block = min(1024, triton.next_power_of_2(h))
    _topk_gather_sum_kernel[(t, triton.cdiv(h, block))](
        y, rows, flat, weights, out, h, e, y.stride(0), TOP_K=top_k, BLOCK=block, num_warps=4
    )
    return out
