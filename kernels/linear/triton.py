"""Triton GEMV for decode-sized batches: `y = x @ w.T` for a few rows of x.

At batch 1-8 a linear layer is a matrix read: its cost is the weight's bytes over the memory
bandwidth. cuBLAS picks tiles for GEMMs, and on the small matrices of a 1-2B model (4-20 MB) a
batch-1 call streams well below the bandwidth (docs/kernels.md). Here each program reads a few
whole weight rows
(a contiguous stream along K) and the rows are spread over about twice as many programs as
the GPU has SMs, so that every SM streams.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.launch import sm_count
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs

MAX_ROWS = 8  # x rows (tokens) this kernel takes; more go to cuBLAS


@triton.jit
def _gemv_tile(x, wt, om, mm, ok, K, sxm, SILU_MUL: tl.constexpr):
    """Products `[BLOCK_M, BN, BK]` of one K tile: x's rows (SwiGLU applied) times weights wt."""
    mx = mm[:, None] & (ok < K)[None, :]
    xt = tl.load(x + om[:, None] * sxm + ok[None, :], mask=mx, other=0.0)
    if SILU_MUL:
        gate = xt.to(tl.float32)
        up = tl.load(x + om[:, None] * sxm + K + ok[None, :], mask=mx, other=0.0)
        act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
        xt = (act * up.to(tl.float32)).to(up.dtype)
    return xt.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :]


@triton.jit
def _gemv_kernel(
    x,
    w,
    y,
    M,
    N,
    K,
    sxm,
    swn,
    sym,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SILU_MUL: tl.constexpr,
    PDL: tl.constexpr,
):
    """With SILU_MUL, x is `[gate | up]` (`2K` columns) and the product's input is SwiGLU's
    `silu(gate) * up`, rounded as `kernels.norm.silu_and_mul` rounds it.

    With PDL the first K tile is peeled off the loop: its weights are loaded before waiting
    for the previous kernel (that load overlaps the previous kernel's tail; no kernel writes
    weights). Without PDL the kernel is the plain loop."""
    on = tl.program_id(0) * BN + tl.arange(0, BN)
    om = tl.arange(0, BLOCK_M)
    mn = on < N
    mm = om < M
    w_rows = w + on[:, None].to(tl.int64) * swn
    # Products accumulate elementwise and are reduced along K once at the end: a reduction in
    # every iteration (shuffles, a barrier) would serialise the loop's weight loads.
    if PDL:
        ok = tl.arange(0, BK)
        wt = tl.load(w_rows + ok[None, :], mask=mn[:, None] & (ok < K)[None, :], other=0.0)
        wait_inputs(PDL)
        acc = _gemv_tile(x, wt, om, mm, ok, K, sxm, SILU_MUL)
        k_start = BK
    else:
        acc = tl.zeros([BLOCK_M, BN, BK], dtype=tl.float32)
        k_start = 0
    for k0 in range(k_start, K, BK):
        ok = k0 + tl.arange(0, BK)
        wt = tl.load(w_rows + ok[None, :], mask=mn[:, None] & (ok < K)[None, :], other=0.0)
        acc += _gemv_tile(x, wt, om, mm, ok, K, sxm, SILU_MUL)
    out = tl.sum(acc, axis=2)
    tl.store(y + om[:, None] * sym + on[None, :], out.to(y.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def gemv_tiles(m: int, n: int, k: int, sms: int) -> tuple[int, int, int]:
    """(BLOCK_M, BN, BK): BN rows of w per program, fewer while that leaves under 2 programs
    per SM; BK keeps the accumulator (BLOCK_M x BN x BK fp32) within 8k elements."""
    block_m = triton.next_power_of_2(max(m, 1))
    bn = 16
    while bn > 1 and triton.cdiv(n, bn) < 2 * sms:
        bn //= 2
    bk = min(triton.next_power_of_2(k), 1024, max(64, 8192 // (block_m * bn)))
    return block_m, bn, bk


def gemv(
    x: torch.Tensor, w: torch.Tensor, silu_mul: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x `[M, K]` (M <= MAX_ROWS, unit last stride), w `[N, K]` contiguous; `[M, N]` in x's dtype,
    into `out` if given (unit last stride). `silu_mul`: x is `[M, 2K]` = `[gate | up]`, and the
    result is `silu_and_mul(x) @ w.T` without the activation's own kernel."""
    m = x.shape[0]
    k = x.shape[1] // 2 if silu_mul else x.shape[1]
    n = w.shape[0]
    assert m <= MAX_ROWS and w.shape[1] == k and x.stride(-1) == 1 and w.stride(-1) == 1
    assert not silu_mul or x.shape[1] == 2 * k
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (m, n) and y.stride(-1) == 1 and y.dtype == x.dtype, (y.shape, y.stride())
    if m == 0:
        return y
    block_m, bn, bk = gemv_tiles(m, n, k, sm_count(x.device))
    _gemv_kernel[(triton.cdiv(n, bn),)](
        x,
        w,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        y.stride(0),
        BLOCK_M=block_m,
        BN=bn,
        BK=bk,
        SILU_MUL=silu_mul,
        num_warps=4,
        **pdl_args(x.device),
    )
    return y


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
