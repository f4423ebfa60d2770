"""Triton kernels of the fused MoE for a few tokens (decode): one program per (assignment, BN
output rows) reads its expert's rows once, as `linear/triton.py`'s GEMV reads a dense weight.

The grouped GEMMs of `moe/triton.py` / `fp8/triton.py` pad each expert's rows to a 16-row tile and
give each expert only `ceil(N / 64)` programs: at one token and ten experts that is too few
programs to stream the experts' bytes. Weights are bf16/fp32, or e4m3 with a scale per
`SCALE_ROWS` x 128 block (`HAS_SCALE`), whose inputs are then quantized per 128 channels in
registers (the format's w8a8 math); products are fp32 and reduced once at the end.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import wait_inputs
from deltaserve.kernels.fp8.triton import _fake_quant


@triton.jit
def _expert_rows_dot(
    v,  # [S, BLOCK] fp32: the input row's slice
    rows,  # [BN, 1, 1] pointers to the expert's weight rows
    s_rows,  # [BN, 1] pointers to their block scales
    ok,  # [S, BLOCK] columns
    blk,  # [S] 128-column block indices
    K,
    n_ok,
    HAS_SCALE: tl.constexpr,
):
    """`[BN, S, BLOCK]` products of one slice of K."""
    k_ok = ok < K
    wt = tl.load(rows + ok[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0).to(tl.float32)
    if HAS_SCALE:
        ws = tl.load(s_rows + blk[None, :], mask=n_ok[:, None] & (blk * 128 < K)[None, :], other=0.0)
        wt = wt * ws[:, :, None]
    return v[None, :, :] * wt


@triton.jit
def _moe_gemv_gate_up_kernel(
    x,  # [T, H]
    w,  # [E, 2I, H]
    w_s,  # [E, ceil(2I/SCALE_ROWS), ceil(H/128)] (HAS_SCALE)
    ids,  # [T * TOP_K] expert of each assignment
    inter,  # [T * TOP_K, I]
    H,
    INTER,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    stride_xt,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_it,
    SCALE_ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BN: tl.constexpr,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    a = tl.program_id(1)
    expert = tl.load(ids + a).to(tl.int64)
    if (expert < 0) | (expert >= E):  # another rank's expert: the down kernel writes its zeros
        return
    on = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = on < INTER
    ob = tl.arange(0, S)
    oc = tl.arange(0, BLOCK)
    x_row = x + (a // TOP_K).to(tl.int64) * stride_xt
    w_base = w + expert * stride_we
    s_base = w_s + expert * stride_se
    g_rows = w_base + on.to(tl.int64)[:, None, None] * stride_wn
    u_rows = w_base + (on + INTER).to(tl.int64)[:, None, None] * stride_wn
    sg_rows = s_base + (on // SCALE_ROWS)[:, None] * stride_sn
    su_rows = s_base + ((on + INTER) // SCALE_ROWS)[:, None] * stride_sn
    acc_g = tl.zeros((BN, S, BLOCK), dtype=tl.float32)
    acc_u = tl.zeros((BN, S, BLOCK), dtype=tl.float32)
    for k0 in range(0, H, S * BLOCK):
        blk = k0 // BLOCK + ob
        ok = blk[:, None] * BLOCK + oc[None, :]
        v = tl.load(x_row + ok, mask=ok < H, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = _fake_quant(v, 1)
        acc_g += _expert_rows_dot(v, g_rows, sg_rows, ok, blk, H, n_ok, HAS_SCALE)
        acc_u += _expert_rows_dot(v, u_rows, su_rows, ok, blk, H, n_ok, HAS_SCALE)
    g = tl.sum(tl.sum(acc_g, axis=2), axis=1)
    u = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    h = g * tl.sigmoid(g) * u
    tl.store(inter + a.to(tl.int64) * stride_it + on, h.to(inter.dtype.element_ty), mask=n_ok)


@triton.jit
def _moe_gemv_down_kernel(
    inter,  # [T * TOP_K, I]
    w,  # [E, H, I]
    w_s,  # [E, ceil(H/SCALE_ROWS), ceil(I/128)] (HAS_SCALE)
    ids,  # [T * TOP_K]
    weights,  # [T * TOP_K] fp32 routing weights
    out,  # [T * TOP_K, H]
    H,
    INTER,
    E: tl.constexpr,
    stride_it,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    SCALE_ROWS: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BN: tl.constexpr,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    a = tl.program_id(1)
    expert = tl.load(ids + a).to(tl.int64)
    on = tl.program_id(0) * BN + tl.arange(0, BN)
    n_ok = on < H
    dst = out + a.to(tl.int64) * stride_ot + on
    if (expert < 0) | (expert >= E):  # skipped: adds zero to its token's sum
        tl.store(dst, tl.zeros((BN,), dtype=out.dtype.element_ty), mask=n_ok)
        return
    ob = tl.arange(0, S)
    oc = tl.arange(0, BLOCK)
    i_row = inter + a.to(tl.int64) * stride_it
    rows = w + expert * stride_we + on.to(tl.int64)[:, None, None] * stride_wn
    s_rows = w_s + expert * stride_se + (on // SCALE_ROWS)[:, None] * stride_sn
    acc = tl.zeros((BN, S, BLOCK), dtype=tl.float32)
    for k0 in range(0, INTER, S * BLOCK):
        blk = k0 // BLOCK + ob
        ok = blk[:, None] * BLOCK + oc[None, :]
        v = tl.load(i_row + ok, mask=ok < INTER, other=0.0).to(tl.float32)
        if HAS_SCALE:
            v = _fake_quant(v, 1)
        acc += _expert_rows_dot(v, rows, s_rows, ok, blk, INTER, n_ok, HAS_SCALE)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) * tl.load(weights + a)
    tl.store(dst, y.to(out.dtype.element_ty), mask=n_ok)


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
