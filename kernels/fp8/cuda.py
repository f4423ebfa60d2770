"""Block-FP8 matmuls on CUDA: launch shapes around `fp8/triton.py`'s kernels, and cuBLAS's
block-scaled GEMM where it fits. Nothing here reads a value back to the host, so CUDA graphs
capture all of it."""

from __future__ import annotations

import functools

import torch

from deltaserve.kernels.fp8.blocks import BLOCK, FP8_DTYPE, num_blocks

# One row through the GEMV only for small weights (under 4,096 rows and 8M elements); past them, or
# past one row, the GEMM with its K split is faster on the H200 (bench/ops/fp8_gemv.py; the timings:
# docs/history/performance-2026-12.md, "How FP8 decode runs")
GEMV_MAX_N = 4096
GEMV_MAX_NUMEL = 2048 * 4096


def gemm_tiles(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, stages, split) of the Triton GEMM. Past 16 rows (where cuBLAS does not fit): 128-row tiles.
    Decode-sized batches (up to 16 rows) read a wide weight in 32-row tiles, 6 deep, one part of K;
    a weight too narrow for two such tiles an SM in 64-row tiles, 4 deep, with K split until there
    are as many tiles as SMs (each part two 128-column blocks or more)."""
    if m > 16:
        return 128, 3, 1
    if -(-n // 32) >= 2 * sms:
        return 32, 6, 1
    tiles, kb, split = -(-n // 64), num_blocks(k), 1
    while tiles * split < sms and 4 * split <= kb:
        split *= 2
    return 64, 4, split


ACT_QUANT_ROWS = 32  # tokens per program of the activation quantization

SKINNY_MMA_ROWS = 64  # the most rows one skinny launch takes: the narrow side of its MMA
# decode batches of up to this many rows take the skinny GEMM, larger ones cuBLAS, which past it wins
# on wide weights while the skinny GEMM's lead on narrow ones shrinks (the timings:
# docs/history/performance-2026-12.md, "How FP8 decode runs")
SKINNY_MAX_ROWS = 32

# Up to this many rows (decode's, where the skinny GEMM and MoE quantize their input in a launch of
# its own) the ops that write a matmul's input quantize it on their way out (`keep_quantized`).
FUSED_QUANT_ROWS = SKINNY_MAX_ROWS

# (y, q, s): the last output that its op also quantized; holding y keeps its memory from being
# handed to another tensor while the slot can match it
_kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def quantized_buffers(rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 `[rows, k]`, fp32 scales `[rows, ceil(k/128)]`) in `act_quant_cuda`'s default layout,
    for an op that quantizes its output as it writes it."""
    return (
        torch.empty(rows, k, dtype=FP8_DTYPE, device=device),
        torch.empty(rows, num_blocks(k), dtype=torch.float32, device=device),
    )


def keep_quantized(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
    """Record that (q, s) is `act_quant_cuda` of y seen as `[rows, k]` (`q`'s shape): the next
    matmul that quantizes y, or a view of all of it with that shape, takes them instead of a
    launch. One slot: y's producer is the op just before its matmuls (a norm, SwiGLU), and y
    is not written again after it."""
    global _kept
    assert y.is_contiguous() and y.numel() == q.numel(), (y.shape, q.shape)
    _kept = (y, q, s)


def _kept_quantization(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    if _kept is None:
        return None
    y, q, s = _kept
    same = x.data_ptr() == y.data_ptr() and x.dtype == y.dtype and x.shape == q.shape
    return (q, s) if same and x.is_contiguous() else None


def act_quant_cuda(
    x: torch.Tensor, rows_multiple: int = 1, group_major: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, K]` per token and 128 channels: (e4m3 `[T', K]`, fp32 scales `[T', ceil(K/128)]`),
    T' = T rounded up to `rows_multiple` (the rows past T are zeros). `group_major`: the scales'
    storage is `[ceil(K/128), T']` (the returned tensor is its transpose), as cuBLAS reads them.
    In the default layout, what x's producer quantized already (`keep_quantized`) is returned."""
    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.fp8.triton import _act_quant_kernel

    if rows_multiple == 1 and not group_major:
        kept = _kept_quantization(x)
        if kept is not None:
            return kept
    t, k = x.shape
    t_out = -(-t // rows_multiple) * rows_multiple
    q = torch.empty(t_out, k, dtype=FP8_DTYPE, device=x.device)
    if group_major:
        s = torch.empty(num_blocks(k), t_out, dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty(t_out, num_blocks(k), dtype=torch.float32, device=x.device)
    if t_out:
        rows = min(ACT_QUANT_ROWS, 1 << (t_out - 1).bit_length())
        grid = (-(-t_out // rows), num_blocks(k))
        _act_quant_kernel[grid](
            x, q, s, t, t_out, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), BLOCK=BLOCK, ROWS=rows,
            **pdl_args(x.device),
        )  # fmt: skip
    return q, s


# cuBLAS's block-scaled FP8 GEMM (1 x 128 activation scales, 128 x 128 or 1 x 128 weight scales)
# from this many rows on; below them the Triton GEMM (bench/ops/fp8_gemm.py; the timings:
# docs/history/performance-2026-12.md, "How FP8 decode runs")
CUBLAS_MIN_ROWS = 17


def cublas_fits(m: int, n: int, k: int) -> bool:
    """cuBLAS takes both dimensions of the weight in multiples of 16, and its scales' K blocks in
    multiples of 4."""
    return m >= CUBLAS_MIN_ROWS and n % 16 == 0 and k % (4 * BLOCK) == 0


def _aligned_rows(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


def fp8_gemm_cublas(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """w8a8 through `torch._scaled_mm`'s block scaling: the rows quantized (padded to a multiple of
    4, so that each K block's scales start 16-byte aligned), the weight read as K x N column-major.
    `out` (rows of unit stride, a slice of a wider output) is cuBLAS's own output where no rows
    were padded and its rows start 16-byte aligned (cuBLAS refuses others), so that a wider
    projection's parts need no copy."""
    q, s = act_quant_cuda(x, rows_multiple=4, group_major=True)
    w_s = scale.t() if scale_rows == BLOCK else scale.t().contiguous()
    if out is not None and q.shape[0] == x.shape[0] and _aligned_rows(out):
        return torch._scaled_mm(q, weight.t(), s, w_s, out_dtype=x.dtype, out=out)
    y = torch._scaled_mm(q, weight.t(), s, w_s, out_dtype=x.dtype)[: x.shape[0]]
    return y if out is None else out.copy_(y)


def fp8_gemm_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: int,
    tiles: tuple[int, int, int] | None = None,
    cublas: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """w8a8 on the FP8 tensor cores: x `[M, K]` quantized per token group, then cuBLAS's GEMM where
    it fits (`cublas`: None, by `cublas_fits` unless `tiles` are given), else the Triton GEMM (and
    with a K split, the parts' sum). `tiles`: the Triton GEMM's (BLOCK_N, stages, split),
    `gemm_tiles` unless given (`bench/ops/fp8_gemv.py` sweeps them). `out`: `[M, N]` with rows of
    unit stride, written in place."""
    import triton

    from deltaserve.kernels.common.launch import sm_count
    from deltaserve.kernels.fp8.triton import _fp8_gemm_kernel, _split_sum_kernel

    m, k = x.shape
    n = weight.shape[0]
    if cublas is None:
        cublas = tiles is None and cublas_fits(m, n, k)
    if m and cublas:
        return fp8_gemm_cublas(x, weight, scale, scale_rows, out)
    if out is not None:
        return out.copy_(fp8_gemm_cuda(x, weight, scale, scale_rows, tiles, cublas=False))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    q, s = act_quant_cuda(x)
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_n, num_stages, split = tiles or gemm_tiles(m, n, k, sm_count(x.device))
    per_split = -(-num_blocks(k) // split)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split)
    _fp8_gemm_kernel[grid](
        q, s, weight, scale, out, part, m, n, k, per_split,
        q.stride(0), s.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=scale_rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK=BLOCK, SPLIT=split,
        num_warps=4, num_stages=num_stages,
    )  # fmt: skip
    if split > 1:
        sum_block = 1024
        _split_sum_kernel[(triton.cdiv(m * n, sum_block),)](
            part, out, m * n, n, out.stride(0), SPLIT=split, BLOCK=sum_block
        )
    return out


# up to this many (token, expert) pairs the skinny MoE reads each pair's expert rows, past it the
# grouped GEMMs read each expert's once: where they crossed on 35B-A3B's and 80B-A3B's experts
SKINNY_MOE_PAIRS = 192


def skinny_tiles(n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_N, stages, split) of the skinny GEMM: 64-row weight tiles, 4 deep, K split in two
    until the tiles number at least twice the SMs, each part eight 128-column blocks or more
    (`bench/ops/fp8_gemv.py --skinny-tiles` sweeps the alternatives)."""
    tiles, kb, split = -(-n // 64), num_blocks(k), 1
    while tiles * split < 2 * sms and kb >= 16 * split:
        split *= 2
    return 64, 4, split


def _output(out: torch.Tensor | None, m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(m, n, dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(-1) == 1 and out.dtype == x.dtype, (out.shape, out.stride())
    return out


def fp8_skinny_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: int,
    tiles: tuple[int, int, int] | None = None,
    out: torch.Tensor | None = None,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """w8a8 for up to `SKINNY_MMA_ROWS` rows on the FP8 tensor cores, the weight's rows as the MMA's
    wide side: the rows quantized, then one launch, a K split summed by its last part. `tiles`:
    (BLOCK_N, stages, split), `skinny_tiles` unless given (`bench/ops/fp8_gemv.py` sweeps them).
    `out`: `[M, N]` with a unit last stride, written in place of a new tensor. `dense`: unquantized
    weight rows `[ND, K]` whose products with the unquantized rows follow in the output (`[M, N +
    ND]`), from the same launch."""
    import triton

    from deltaserve.kernels.common.arrival import arrival_counters
    from deltaserve.kernels.common.launch import sm_count
    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.fp8.triton import _fp8_skinny_kernel

    m, k = x.shape
    n = weight.shape[0]
    nd = 0 if dense is None else dense.shape[0]
    assert m <= SKINNY_MMA_ROWS, m
    assert dense is None or (dense.shape[1] == k and dense.stride(-1) == 1 and dense.dtype == x.dtype)
    out = _output(out, m, n + nd, x)
    if m == 0:
        return out
    xq, xs = act_quant_cuda(x)
    block_n, num_stages, split = tiles or skinny_tiles(n, k, sm_count(x.device))
    block_m = max(16, triton.next_power_of_2(m))  # wgmma's narrow side: 16 rows or more
    grid = (triton.cdiv(n, block_n) + triton.cdiv(nd, block_n), split)
    part = torch.empty(split, m, n + nd, dtype=torch.float32, device=x.device) if split > 1 else out
    counters = arrival_counters(x.device, grid[0]) if split > 1 else out
    _fp8_skinny_kernel[grid](
        xq, xs, weight, scale, out, part, counters, x, dense if dense is not None else x,
        m, n, nd, k, -(-num_blocks(k) // split),
        xq.stride(0), xs.stride(0), weight.stride(0), scale.stride(0), out.stride(0), x.stride(0),
        dense.stride(0) if dense is not None else 0,
        SCALE_ROWS=scale_rows, BLOCK_N=block_n, BLOCK_M=block_m, BLOCK=BLOCK, SPLIT=split,
        DENSE=dense is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=num_stages, **pdl_args(x.device),
    )  # fmt: skip
    return out


def skinny_moe_tiles(
    pairs: int, inter_blocks: int, hidden_blocks: int, sms: int
) -> tuple[int, int, int, int]:
    """(split, gate/up stages, down BLOCK_N, down stages) of the skinny MoE: gate/up's H split in
    two while its programs number under twice the SMs and each part keeps eight 128-column blocks
    or more; the down projection in 64-row tiles (`bench/ops/fp8_gemv.py --skinny-moe-tiles`
    sweeps the alternatives)."""
    split = 1
    while pairs * inter_blocks * split < 2 * sms and hidden_blocks >= 8 * split:
        split *= 2
    return split, 3, 64, 4


def fp8_moe_skinny_cuda(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    scale_rows: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """The FP8 MoE for a few tokens on the skinny GEMM: each assignment's 128-row blocks of gate
    and up rows on wgmma's wide side (H split while that leaves too few programs), the intermediate
    quantized by whoever finishes its block, then the down projection, whose per-token sum over the
    experts the last of them adds: three launches with the rows' quantization. `tiles`: (split,
    gate/up stages, down BLOCK_N, down stages), `skinny_moe_tiles` unless given."""
    import triton

    from deltaserve.kernels.common.arrival import arrival_counters
    from deltaserve.kernels.common.launch import rounding_dtype, sm_count
    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.fp8.triton import _fp8_moe_skinny_down_kernel, _fp8_moe_skinny_gate_up_kernel

    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    pdl = pdl_args(x.device)
    xq, xs = act_quant_cuda(x)
    ids = topk_ids.reshape(-1).contiguous()
    tiles_i, kb = num_blocks(inter_size), num_blocks(h)
    split, gu_stages, down_n, down_stages = tiles or skinny_moe_tiles(n, tiles_i, kb, sm_count(x.device))
    tiles_h = triton.cdiv(h, down_n)
    hq = torch.empty(n, inter_size, dtype=FP8_DTYPE, device=x.device)
    hs = torch.empty(n, tiles_i, dtype=torch.float32, device=x.device)
    part = torch.empty(split, n, 2, inter_size, dtype=torch.float32, device=x.device) if split > 1 else hs
    counters = arrival_counters(x.device, max(n * tiles_i, t * tiles_h))
    _fp8_moe_skinny_gate_up_kernel[(tiles_i, n, split)](
        xq, xs, gate_up, gate_up_scale, ids, hq, hs, part, counters, n, h, inter_size, -(-kb // split),
        xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), hq.stride(0), hs.stride(0),
        TOP_K=top_k, E=e, SCALE_ROWS=scale_rows, BLOCK=BLOCK, ROUND=rounding_dtype(x.dtype), SPLIT=split,
        num_warps=4, num_stages=gu_stages, **pdl,
    )  # fmt: skip
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    down_part = torch.empty(n, h, dtype=torch.float32, device=x.device)
    _fp8_moe_skinny_down_kernel[(tiles_h, n)](
        hq, hs, down, down_scale, ids, weights, out, down_part, counters, h, inter_size,
        hq.stride(0), hs.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        out.stride(0),
        TOP_K=top_k, E=e, SCALE_ROWS=scale_rows, BLOCK_N=down_n, BLOCK=BLOCK, num_warps=4,
        num_stages=down_stages, **pdl,
    )  # fmt: skip
    return out


def gemv_tiles(block_m: int, n: int, k: int, sms: int) -> tuple[int, int]:
    """(BN, S) of the FP8 GEMV: BLOCK_M x BN x S x 128 fp32 products within 8k, and at least two
    programs per SM."""
    import triton

    s = min(8, triton.next_power_of_2(num_blocks(k)))
    bn = 16
    while bn > 1 and (triton.cdiv(n, bn) < 2 * sms or block_m * bn * s * BLOCK > 8192):
        bn //= 2
    while block_m * bn * s * BLOCK > 8192:
        s //= 2
    return bn, s


def fp8_gemv_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: int,
    tiles: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x `[M, K]` (one row in serving) times the e4m3 weight, read once, x quantized per token and
    128 channels inside the kernel; products in registers; `out` as in `fp8_skinny_cuda`.
    `tiles`: (BN weight rows, S 128-column blocks) a program and iteration, which `bench/ops/fp8_gemv.py`
    sweeps; by default as many rows as leave two programs an SM, within 8k products."""
    import triton

    from deltaserve.kernels.common.launch import sm_count
    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.fp8.triton import _fp8_gemv_kernel

    m, k = x.shape
    n = weight.shape[0]
    out = _output(out, m, n, x)
    if m == 0:
        return out
    block_m = triton.next_power_of_2(m)
    bn, s = tiles or gemv_tiles(block_m, n, k, sm_count(x.device))
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, scale, out, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), out.stride(0),
        SCALE_ROWS=scale_rows, BLOCK_M=block_m, BN=bn, S=s, BLOCK=BLOCK, num_warps=4, **pdl_args(x.device),
    )  # fmt: skip
    return out


def fp8_decode_mode() -> str:
    """`DELTASERVE_FP8_DECODE`: 2-16 rows, and one row of a weight too large for the GEMV, through
    the skinny GEMM (`skinny`) or the Triton GEMM with its split-sum kernel (`gemm`); the routed
    experts of up to `SKINNY_MOE_PAIRS` pairs through the skinny MoE, or of up to `GEMV_ASSIGNMENTS`
    through the per-assignment GEMVs. Read afresh: EngineConfig checks it at start-up."""
    from deltaserve.kernels.common.launch import env_mode

    return env_mode("DELTASERVE_FP8_DECODE", ("skinny", "gemm"), "skinny")


@functools.cache
def decode_mode() -> str:
    """`fp8_decode_mode`, read once: the FP8 projections ask it every forward."""
    return fp8_decode_mode()


def fp8_linear_cuda(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: int,
    out: torch.Tensor | None = None,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out`: `[..., N]` with a unit last stride (a slice of a wider output), written in place.
    `dense`: unquantized weight rows `[ND, K]` whose products follow the FP8 ones (`[..., N + ND]`
    out): in the skinny GEMM's launch where that runs, else the unquantized matmul apart."""
    from deltaserve.kernels.linear import linear

    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    n = weight.shape[0]
    width = n + (0 if dense is None else dense.shape[0])
    out2 = out.view(-1, width) if out is not None else None
    skinny = x2.shape[0] <= SKINNY_MAX_ROWS and decode_mode() == "skinny"
    if dense is not None and skinny:
        y = fp8_skinny_cuda(x2, weight, scale, scale_rows, out=out2, dense=dense)
    elif dense is not None:  # both parts into one output
        y = out2 if out2 is not None else x2.new_empty(x2.shape[0], width)
        fp8_linear_cuda(x2, weight, scale, scale_rows, y[:, :n])
        linear(x2, dense, out=y[:, n:])
    elif x2.shape[0] == 1 and n < GEMV_MAX_N and weight.numel() < GEMV_MAX_NUMEL:
        y = fp8_gemv_cuda(x2, weight, scale, scale_rows, out=out2)
    elif skinny:
        y = fp8_skinny_cuda(x2, weight, scale, scale_rows, out=out2)
    else:
        y = fp8_gemm_cuda(x2, weight, scale, scale_rows, out=out2)
    return y.view(*x.shape[:-1], width)


def moe_tiles(assignments: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, STEP_K, warps, stages, swap) of the grouped GEMMs (the down GEMM takes its
    BLOCK_M and swap), with a K step of a whole scale block: for decode's batches 16-row tiles, swapped
    (the weight's rows on wgmma's 64-row side, the few tokens on its narrow one; unswapped, 16 rows
    take `mma.sync`); for prefill 64-row ones (bench/ops/fp8_gemm.py --moe; the timings:
    docs/history/performance-2026-12.md, "How FP8 decode runs")."""
    if assignments <= 2048:
        return 16, 64, 128, 4, 4, 1
    return 64, 64, 128, 4, 4, 0


# (BLOCK_N, STEP_K, warps, stages) of the down GEMM, whose rows are the gate/up GEMM's (`moe_tiles`'
# BLOCK_M): its K is the experts' intermediate width, a few scale blocks, so tiles wider than
# gate/up's read each row's activations fewer times
MOE_DOWN_TILES = (128, 128, 4, 3)


def fp8_moe_cuda(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    scale_rows: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    tiles: tuple[int, ...] | None = None,
    down_tiles: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """`moe.cuda.fused_moe_cuda` with e4m3 experts: w8a8 grouped GEMMs, or for a few tokens the
    per-assignment GEMV, which quantizes its rows in registers (as `fp8_linear_cuda` splits rows).
    `tiles`: the gate/up GEMM's (BLOCK_M, BLOCK_N, STEP_K, warps, stages[, swap]), `moe_tiles` unless
    given; `down_tiles`: the down GEMM's (BLOCK_N, STEP_K, warps, stages[, swap]), `MOE_DOWN_TILES`
    unless given, its swap gate/up's unless given (`bench/ops/fp8_gemm.py --moe` sweeps both)."""
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.fp8.triton import _fp8_moe_down_kernel, _fp8_moe_gate_up_kernel
    from deltaserve.kernels.moe.align import align_cuda
    from deltaserve.kernels.moe.cuda import GEMV_ASSIGNMENTS, moe_gemv_cuda, topk_sum_cuda

    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    if n <= SKINNY_MOE_PAIRS and decode_mode() == "skinny":
        return fp8_moe_skinny_cuda(
            x, gate_up, gate_up_scale, down, down_scale, scale_rows, topk_ids, topk_weights
        )
    if n <= GEMV_ASSIGNMENTS:
        return moe_gemv_cuda(x, gate_up, down, topk_ids, topk_weights, gate_up_scale, down_scale, scale_rows)
    block_m, block_n, step_k, warps, stages, *rest = tiles or moe_tiles(n)
    swap = bool(rest and rest[0])
    pdl = pdl_args(x.device)
    x = x.contiguous()
    # the sort class just past the skinny MoE's pairs (193-256) holds no power of two of tokens at top
    # 9 or 11, the warm-up's step sizes: those assignments take the next class's lanes
    lanes = 2 * triton.next_power_of_2(SKINNY_MOE_PAIRS) if decode_mode() == "skinny" else 16
    rows, block_expert = align_cuda(topk_ids, e, block_m, lanes)
    xq, xs = act_quant_cuda(x)
    inter = torch.empty(n, inter_size, dtype=x.dtype, device=x.device)
    grid1 = (block_expert.numel(), triton.cdiv(inter_size, block_n))
    _fp8_moe_gate_up_kernel[grid1](
        xq, xs, gate_up, gate_up_scale, rows, block_expert, inter, n, h, inter_size, top_k, e,
        xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up_scale.stride(0),
        gate_up_scale.stride(1), inter.stride(0),
        SCALE_ROWS=scale_rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK=BLOCK, STEP_K=step_k,
        SWAP=swap, num_warps=warps, num_stages=stages, **pdl,
    )  # fmt: skip
    iq, is_ = act_quant_cuda(inter)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    block_n, step_k, warps, stages, *rest = down_tiles or MOE_DOWN_TILES
    swap = bool(rest[0]) if rest else swap
    grid2 = (block_expert.numel(), triton.cdiv(h, block_n))
    _fp8_moe_down_kernel[grid2](
        iq, is_, down, down_scale, rows, block_expert, weights, out, n, h, inter_size, e,
        iq.stride(0), is_.stride(0), down.stride(0), down.stride(1), down_scale.stride(0), down_scale.stride(1),
        out.stride(0),
        SCALE_ROWS=scale_rows, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK=BLOCK, STEP_K=step_k,
        SWAP=swap, num_warps=warps, num_stages=stages, **pdl,
    )  # fmt: skip
    return topk_sum_cuda(out, top_k)
