"""Triton kernels of the fused MoE: grouped GEMMs over assignments sorted by expert.

Each (token, k) assignment is one row. Rows are grouped by expert and every group padded to
a multiple of BLOCK_M, so a program handles one block of one expert's rows: the first GEMM
computes silu(x W_gate) * (x W_up) for its rows, the second multiplies by W_down and the
routing weight. Nothing depends on values at launch time, so the whole op is graph-safe.
Blocks of an expert >= E are empty or hold skipped assignments (another expert-parallel
rank's experts): no GEMM runs for them, and the down kernel writes their rows as zeros.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import wait_inputs


@triton.jit
def row_tile(base, rows, row_ok, stride, offs_k, k_ok):
    """`[len(rows), K]`: columns offs_k of each of `rows` (K contiguous in a row), zeros where masked."""
    return tl.load(
        base + rows[:, None] * stride + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
    )


@triton.jit
def col_tile(base, rows, row_ok, stride, offs_k, k_ok):
    """`row_tile` transposed, `[K, len(rows)]`: a swapped tile's narrow operand."""
    return tl.load(
        base + rows[None, :] * stride + offs_k[:, None], mask=row_ok[None, :] & k_ok[:, None], other=0.0
    )


@triton.jit
def _gate_up_swapped(
    x, w_base, inter, assign, valid, token, offs_n, n_ok, H, INTER, stride_xt, stride_wn, stride_it,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """`_moe_gate_up_kernel`'s tile transposed: `[BLOCK_N, BLOCK_M]` products of the gate and up
    rows with the block's rows."""
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = col_tile(x, token, valid, stride_xt, offs_k, k_ok)
        wg = row_tile(w_base, offs_n, n_ok, stride_wn, offs_k, k_ok)
        wu = row_tile(w_base, offs_n + INTER, n_ok, stride_wn, offs_k, k_ok)
        acc_g = tl.dot(wg, a, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(wu, a, acc_u, input_precision=PRECISION)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = inter + assign.to(tl.int64)[None, :] * stride_it + offs_n[:, None]
    tl.store(dst, h.to(inter.dtype.element_ty), mask=valid[None, :] & n_ok[:, None])


@triton.jit
def _down_swapped(
    inter, w_base, weights, out, a_row, valid, offs_n, n_ok, INTER, stride_it, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """`_moe_down_kernel`'s tile transposed: `[BLOCK_N, BLOCK_M]` products of the down rows with
    the block's intermediate rows, scaled by their routing weights."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = col_tile(inter, a_row, valid, stride_it, offs_k, k_ok)
        b = row_tile(w_base, offs_n, n_ok, stride_wn, offs_k, k_ok)
        acc = tl.dot(b, a, acc, input_precision=PRECISION)
    rw = tl.load(weights + a_row, mask=valid, other=0.0).to(tl.float32)
    dst = out + a_row[None, :] * stride_ot + offs_n[:, None]
    tl.store(dst, (acc * rw[None, :]).to(out.dtype.element_ty), mask=valid[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["num_assign"])  # compared with row ids only: no gain, a compile per step size
def _moe_gate_up_kernel(
    x,  # [T, H]
    w,  # [E, 2I, H]
    rows,  # [R] assignment id per padded row (>= num_assign: padding)
    block_expert,  # [B] expert of each block (>= E: empty, or skipped assignments)
    inter,  # [num_assign, I] output
    num_assign,
    H,
    INTER,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    stride_xt,
    stride_we,
    stride_wn,
    stride_it,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """SWAP: the weight's BLOCK_N rows on the MMA's wide side and the block's BLOCK_M rows its
    narrow one (wgmma from 64 weight rows; otherwise 16-row tiles take `mma.sync`)."""
    wait_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    if expert >= E:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(rows + offs_m)
    valid = assign < num_assign
    token = tl.where(valid, assign // TOP_K, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < INTER
    w_base = w + expert.to(tl.int64) * stride_we
    if SWAP:
        _gate_up_swapped(
            x, w_base, inter, assign, valid, token, offs_n, n_ok, H, INTER, stride_xt, stride_wn, stride_it,
            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
        )  # fmt: skip
        return
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < H
        a = tl.load(
            x + token[:, None] * stride_xt + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        wg = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        wu = tl.load(
            w_base + (offs_n[None, :] + INTER) * stride_wn + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = inter + assign.to(tl.int64)[:, None] * stride_it + offs_n[None, :]
    tl.store(dst, h.to(inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_assign"])  # compared with row ids only: no gain, a compile per step size
def _moe_down_kernel(
    inter,  # [num_assign, I]
    w,  # [E, H, I]
    rows,
    block_expert,
    weights,  # [num_assign] routing weight of each assignment
    out,  # [num_assign, H]
    num_assign,
    H,
    INTER,
    E: tl.constexpr,
    stride_it,
    stride_we,
    stride_wn,
    stride_ot,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    SWAP: tl.constexpr,
    PDL: tl.constexpr,
):
    """SWAP: as the gate/up kernel's, the weight's rows on the MMA's wide side."""
    wait_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(rows + offs_m)
    valid = assign < num_assign
    a_row = tl.where(valid, assign, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    dst = out + a_row[:, None] * stride_ot + offs_n[None, :]
    if expert >= E:
        # skipped assignments (another rank's expert) add zero to their token's sum
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out.dtype.element_ty)
        tl.store(dst, zero, mask=valid[:, None] & n_ok[None, :])
        return
    w_base = w + expert.to(tl.int64) * stride_we
    if SWAP:
        _down_swapped(
            inter, w_base, weights, out, a_row, valid, offs_n, n_ok, INTER, stride_it, stride_wn, stride_ot,
            BLOCK_M, BLOCK_N, BLOCK_K, PRECISION,
        )  # fmt: skip
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < INTER
        a = tl.load(
            inter + a_row[:, None] * stride_it + offs_k[None, :],
            mask=valid[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            w_base + offs_n[None, :] * stride_wn + offs_k[:, None],
            mask=n_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    rw = tl.load(weights + a_row, mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _topk_sum_kernel(parts, out, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Token t's output: its TOP_K rows of `parts` ([T * TOP_K, H]) summed in order in fp32."""
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(parts + (t * TOP_K + k) * H + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + t * H + offs, acc.to(out.dtype.element_ty), mask=ok)


@triton.jit
def _topk_gather_sum_kernel(
    y, rows, ids, weights, out, H, E, stride_y, TOP_K: tl.constexpr, BLOCK: tl.constexpr
):
    """Token t's output: over its TOP_K assignments in order, the routing weight times the
    assignment's row of `y` (`rows`: where each assignment's row is), summed in fp32; an
    assignment to an expert outside [0, E) (another rank's) adds nothing."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        a = t * TOP_K + k
        e = tl.load(ids + a)
        held = (e >= 0) & (e < E)
        row = tl.load(rows + a).to(tl.int64)
        w = tl.load(weights + a).to(tl.float32)
        part = tl.load(y + row * stride_y + offs, mask=ok, other=0.0).to(tl.float32)
        acc += tl.where(held, w * part, 0.0)  # a row past every group holds what was there: never added
    tl.store(out + t * H + offs, acc.to(out.dtype.element_ty), mask=ok)


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
