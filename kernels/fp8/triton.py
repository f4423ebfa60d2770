"""Triton kernels of the block-FP8 matmuls (`kernels.fp8` holds their references).

- `_act_quant_kernel`: per token and 128-channel group (32 tokens a program): amax,
  scale = amax / 448, e4m3 values and the fp32 scale, the scales token- or group-major.
- `_fp8_gemm_kernel`: w8a8 GEMM on the FP8 tensor cores; the K loop steps one 128-column
  block at a time, so each partial product is scaled by its token-group and weight-block
  scales before it is accumulated in fp32. With SPLIT > 1, program (m, n, s) takes the s-th range
  of K blocks and writes fp32 parts, which `_split_sum_kernel` adds: a narrow weight at decode's few
  rows then still gives every SM several tiles in flight.
- `_fp8_skinny_kernel`: decode's 1-16 rows on the FP8 tensor cores with the weight's rows as the
  MMA's wide side (wgmma's 64 rows; the tokens its narrow 16), a K split summed by each tile's last
  part to finish instead of a second kernel; unquantized rows after the FP8 ones in programs of
  their own.
- `_fp8_gemv_kernel`: one row (decode) against a narrow weight. It streams the e4m3 weight rows
  once, widening them in registers; the row is quantized in registers (`_fake_quant`), so decode
  does the format's w8a8 math as the GEMM does.
- `_fp8_moe_*_kernel`: `triton_moe`'s grouped GEMMs, w8a8: e4m3 experts times rows quantized per
  token and 128 channels, on the FP8 tensor cores; both scales apply after each 128-column dot.
Weight scales are per `SCALE_ROWS` x 128 block (SCALE_ROWS 128, or 1 for per-row scales).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.kernels.common.arrival import last_to_arrive
from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import wait_inputs
from deltaserve.kernels.moe.triton import col_tile, row_tile

BLOCK_K = 128  # the format's block: one scale per K step


@triton.jit
def _e4m3_codes(v, AXIS: tl.constexpr):
    """fp32 v quantized per group along AXIS (one 128-channel group): its codes in e4m3's range,
    not yet rounded to e4m3, and the group's scale (largest magnitude to 448)."""
    scale = tl.maximum(tl.max(tl.abs(v), axis=AXIS), 1e-10) / 448.0
    return tl.clamp(v / tl.expand_dims(scale, AXIS), -448.0, 448.0), scale


# T and T_OUT (the step's tokens) bound row masks; stride_sg (the padded tokens where the scales are
# group-major) offsets a store of one scale a thread, no vector to lose: one compile for every count
@triton.jit(do_not_specialize=["T", "T_OUT", "stride_sg"])
def _act_quant_kernel(
    x,
    q,
    s,
    T,
    T_OUT,
    K,
    stride_x,
    stride_q,
    stride_st,
    stride_sg,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    # ROWS tokens per program: one token's 128 channels alone left a prefill with 100k+ tiny programs
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    offs = group * BLOCK + tl.arange(0, BLOCK)
    live = rows < T
    kept = rows < T_OUT  # rows past T (padding) quantize zeros
    k_ok = offs[None, :] < K
    rows64 = rows.to(tl.int64)
    v = tl.load(x + rows64[:, None] * stride_x + offs[None, :], mask=live[:, None] & k_ok, other=0.0).to(
        tl.float32
    )
    y, scale = _e4m3_codes(v, 1)
    tl.store(
        q + rows64[:, None] * stride_q + offs[None, :], y.to(q.dtype.element_ty), mask=kept[:, None] & k_ok
    )
    tl.store(s + rows64 * stride_st + group * stride_sg, scale, mask=kept)


@triton.jit
def e4m3_groups(v, R: tl.constexpr, N: tl.constexpr):
    """fp32 v `[R, N]` (N a multiple of 128) in 128-channel groups along its rows: (e4m3 codes
    `[R, N]`, fp32 scales `[R, N // 128]`), as `_act_quant_kernel` makes them; what an op that
    writes a matmul's input quantizes on its way out (`kernels.norm`'s fused norms)."""
    codes, scale = _e4m3_codes(tl.reshape(v, (R * (N // 128), 128)), 1)
    return tl.reshape(codes, (R, N)).to(tl.float8e4nv), tl.reshape(scale, (R, N // 128))


@triton.jit
def _fake_quant(v, AXIS: tl.constexpr):
    """fp32 v after `_act_quant_kernel`'s e4m3 round trip, AXIS holding one 128-channel group."""
    codes, scale = _e4m3_codes(v, AXIS)
    return codes.to(tl.float8e4nv).to(tl.float32) * tl.expand_dims(scale, AXIS)


# M (the step's rows) bounds row masks and offsets split parts by whole rows: one compile for every count
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a,  # [M, K] e4m3
    a_s,  # [M, ceil(K/128)] fp32
    b,  # [N, K] e4m3
    b_s,  # [ceil(N/SCALE_ROWS), ceil(K/128)] fp32
    c,  # [M, N]
    part,  # [SPLIT, M, N] fp32 (SPLIT > 1)
    M,
    N,
    K,
    blocks_per_split,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a + offs_m.to(tl.int64)[:, None] * stride_am
    b_cols = b + offs_n.to(tl.int64)[None, :] * stride_bn
    first = tl.program_id(2) * blocks_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(K, BLOCK))):
        offs_k = i * BLOCK + tl.arange(0, BLOCK)
        k_ok = offs_k < K
        at = tl.load(a_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        bt = tl.load(b_cols + offs_k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        sa = tl.load(a_s + offs_m * stride_asm + i, mask=m_ok, other=0.0)
        sb = tl.load(b_s + (offs_n // SCALE_ROWS) * stride_bsn + i, mask=n_ok, other=0.0)
        acc += tl.dot(at, bt) * sa[:, None] * sb[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        dst = c + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(dst, acc.to(c.dtype.element_ty), mask=mask)
    else:
        dst = part + (tl.program_id(2) * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(dst, acc, mask=mask)


@triton.jit
def _skinny_block(x, x_s, wt, sw, i, K, offs_m, m_ok, stride_xm, stride_xsm, BLOCK: tl.constexpr):
    """One 128-column block's scaled product `[BLOCK_N, BLOCK_M]`: weight tile wt (scales sw) times
    the rows' e4m3 codes of block i and their scales."""
    offs_k = i * BLOCK + tl.arange(0, BLOCK)
    mask = m_ok[None, :] & (offs_k < K)[:, None]
    xt = tl.load(x + offs_m[None, :] * stride_xm + offs_k[:, None], mask=mask, other=0.0)
    sx = tl.load(x_s + offs_m * stride_xsm + i, mask=m_ok & (i * BLOCK + 0 * offs_m < K), other=0.0)
    return tl.dot(wt, xt) * sx[None, :] * sw[:, None]


@triton.jit
def _skinny_fp8_tile(
    x, x_s, w, w_s, pid_n, offs_m, m_ok, N, K, first, last, stride_xm, stride_xsm, stride_wn, stride_wsn,
    SCALE_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """(acc `[BLOCK_N, BLOCK_M]`, output columns, their mask) of weight tile pid_n over K blocks
    [first, last). With PDL its first weight tile is loaded before waiting for the previous kernel."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = w + offs_n.to(tl.int64)[:, None] * stride_wn
    s_rows = w_s + (offs_n // SCALE_ROWS) * stride_wsn
    # a part past the last block (short K, many parts) reads nothing and adds zeros
    k_ok = first * BLOCK + tl.arange(0, BLOCK) < K
    wt = tl.load(
        w_rows + first * BLOCK + tl.arange(0, BLOCK)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0
    )
    sw = tl.load(s_rows + first, mask=n_ok & (first * BLOCK + 0 * offs_n < K), other=0.0)
    wait_inputs(PDL)
    acc = _skinny_block(x, x_s, wt, sw, first, K, offs_m, m_ok, stride_xm, stride_xsm, BLOCK)
    for i in range(first + 1, last):
        offs_k = i * BLOCK + tl.arange(0, BLOCK)
        wt = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & (offs_k < K)[None, :], other=0.0)
        sw = tl.load(s_rows + i, mask=n_ok, other=0.0)
        acc += _skinny_block(x, x_s, wt, sw, i, K, offs_m, m_ok, stride_xm, stride_xsm, BLOCK)
    return acc, offs_n, n_ok


@triton.jit
def _skinny_dense_tile(
    xd, wd, tile, offs_m, m_ok, N, ND, K, first, last, stride_xdm, stride_wdn,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """As `_skinny_fp8_tile`, for tile `tile` of the ND unquantized rows (output columns N on),
    in the inputs' dtype on the tensor cores (PRECISION: fp32's, not TF32)."""
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rows < ND
    wd_rows = wd + rows.to(tl.int64)[:, None] * stride_wdn
    wait_inputs(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(first, last):
        offs_k = i * BLOCK + tl.arange(0, BLOCK)
        k_ok = offs_k < K
        wt = tl.load(wd_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        xt = tl.load(
            xd + offs_m[None, :] * stride_xdm + offs_k[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0
        )
        acc += tl.dot(wt, xt, input_precision=PRECISION)
    return acc, N + rows, n_ok


# M (the step's rows) bounds row masks and offsets split parts by whole rows: one compile for every count
@triton.jit(do_not_specialize=["M"])
def _fp8_skinny_kernel(
    x,  # [M, K] e4m3, per token and 128 channels
    x_s,  # [M, ceil(K/128)] fp32
    w,  # [N, K] e4m3
    w_s,  # [ceil(N/SCALE_ROWS), ceil(K/128)] fp32
    y,  # [M, N + ND]
    part,  # [SPLIT, M, N + ND] fp32 (SPLIT > 1)
    counters,  # [num_programs(0)] int32, zero between launches (SPLIT > 1)
    xd,  # [M, K] the unquantized rows (DENSE)
    wd,  # [ND, K] the unquantized weight rows after w's (DENSE)
    M,
    N,
    ND,
    K,
    blocks_per_split,
    stride_xm,
    stride_xsm,
    stride_wn,
    stride_wsn,
    stride_ym,
    stride_xdm,
    stride_wdn,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr,
    DENSE: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """Decode's few rows (M <= BLOCK_M) as the MMA's narrow side: weight tiles of BLOCK_N rows are
    the left operand, so the tensor cores take them as loaded (wgmma's 64-row side).
    SPLIT > 1: program (n, s) takes the s-th range of K blocks and writes its fp32 part; the last
    of a tile's parts to finish adds them in split order (deterministic) and resets the tile's
    counter, so no second kernel sums them. With PDL the first weight tile is loaded before
    waiting for the previous kernel (no kernel writes weights).
    DENSE: the first programs take the ND unquantized rows that follow w's in the output (a GDN
    in_proj's gate rows), with the same split: one launch for a projection mixing both."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    first = tl.program_id(1) * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(K, BLOCK))
    if DENSE:  # the unquantized tiles first: twice an FP8 tile's bytes, they start in the first wave
        dense_tiles = tl.cdiv(ND, BLOCK_N)
        if pid_n < dense_tiles:
            acc, offs_n, n_ok = _skinny_dense_tile(
                xd, wd, pid_n, offs_m, m_ok, N, ND, K, first, last, stride_xdm, stride_wdn,
                BLOCK_N, BLOCK_M, BLOCK, PRECISION, PDL,
            )  # fmt: skip
        else:
            acc, offs_n, n_ok = _skinny_fp8_tile(
                x, x_s, w, w_s, pid_n - dense_tiles, offs_m, m_ok, N, K, first, last, stride_xm, stride_xsm,
                stride_wn, stride_wsn, SCALE_ROWS, BLOCK_N, BLOCK, PDL,
            )  # fmt: skip
    else:
        acc, offs_n, n_ok = _skinny_fp8_tile(
            x, x_s, w, w_s, pid_n, offs_m, m_ok, N, K, first, last, stride_xm, stride_xsm, stride_wn,
            stride_wsn, SCALE_ROWS, BLOCK_N, BLOCK, PDL,
        )  # fmt: skip
    width = N + ND
    mask = n_ok[:, None] & m_ok[None, :]
    dst = y + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT == 1:
        tl.store(dst, acc.to(y.dtype.element_ty), mask=mask)
    else:
        parts = part + offs_m[None, :] * width + offs_n[:, None]
        tl.store(parts + tl.program_id(1) * M * width, acc, mask=mask)
        if last_to_arrive(counters, pid_n, SPLIT):
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT):
                total += tl.load(parts + s * M * width, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(dst, total.to(y.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counters + pid_n, 0)


# NUM_ASSIGN only offsets split parts, by whole assignments (2 * INTER): one compile for every count
@triton.jit(do_not_specialize=["NUM_ASSIGN"])
def _fp8_moe_skinny_gate_up_kernel(
    x,  # [T, H] e4m3, per token and 128 channels
    x_s,  # [T, ceil(H/128)] fp32
    w,  # [E, 2I, H] e4m3
    w_s,  # [E, ceil(2I/SCALE_ROWS), ceil(H/128)] fp32
    ids,  # [T * TOP_K]
    h,  # [T * TOP_K, I] e4m3: silu(gate) * up, rounded to the model dtype, quantized per 128
    h_s,  # [T * TOP_K, ceil(I/128)] fp32
    part,  # [SPLIT, T * TOP_K, 2, I] fp32 (SPLIT > 1)
    counters,  # [T * TOP_K * ceil(I/128)] int32, zero between launches (SPLIT > 1)
    NUM_ASSIGN,
    H,
    INTER,
    blocks_per_split,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ht,
    stride_hst,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUND: tl.constexpr,  # the model dtype the intermediate is rounded to before its quantization
    SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """The skinny GEMM for the routed experts of a few tokens: program (n, a, s) takes 128 gate
    and 128 up rows of assignment a's expert (the 128 intermediate channels that form one block of
    the down projection's input) over the s-th range of H's blocks, on wgmma's wide side; the
    token's row is the narrow side. Whoever completes a tile computes silu(gate) * up and
    quantizes it, so the down projection needs no quantization launch."""
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    wait_inputs(PDL)
    expert = tl.load(ids + a).to(tl.int64)
    if (expert < 0) | (expert >= E):  # another rank's expert: the down kernel adds zero for it
        return
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < INTER
    cols = tl.arange(0, 16)[None, :]  # the token's row is the MMA's first column
    x_row = x + (a // TOP_K).to(tl.int64) * stride_xt
    sx_row = x_s + (a // TOP_K).to(tl.int64) * stride_xst
    g_rows = w + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + INTER * stride_wn
    sg_rows = w_s + expert * stride_se + (offs_n // SCALE_ROWS) * stride_sn
    su_rows = w_s + expert * stride_se + ((offs_n + INTER) // SCALE_ROWS) * stride_sn
    acc_g = tl.zeros((BLOCK, 16), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK, 16), dtype=tl.float32)
    first = tl.program_id(2) * blocks_per_split
    for i in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(H, BLOCK))):
        offs_k = i * BLOCK + tl.arange(0, BLOCK)
        k_ok = offs_k < H
        xt = tl.load(x_row + offs_k[:, None] + cols * 0, mask=(cols == 0) & k_ok[:, None], other=0.0)
        sx = tl.load(sx_row + i)
        wmask = n_ok[:, None] & k_ok[None, :]
        wg = tl.load(g_rows + offs_k[None, :], mask=wmask, other=0.0)
        wu = tl.load(u_rows + offs_k[None, :], mask=wmask, other=0.0)
        sg = tl.load(sg_rows + i, mask=n_ok, other=0.0)
        su = tl.load(su_rows + i, mask=n_ok, other=0.0)
        acc_g += tl.dot(wg, xt) * sx * sg[:, None]
        acc_u += tl.dot(wu, xt) * sx * su[:, None]
    g = tl.sum(acc_g, axis=1)  # the other columns are zeros
    u = tl.sum(acc_u, axis=1)
    finish = True
    if SPLIT > 1:
        parts = part + (a * 2) * INTER + offs_n
        step = NUM_ASSIGN * 2 * INTER
        tl.store(parts + tl.program_id(2) * step, g, mask=n_ok)
        tl.store(parts + tl.program_id(2) * step + INTER, u, mask=n_ok)
        tile = a * tl.num_programs(0) + pid_n
        finish = last_to_arrive(counters, tile, SPLIT)
        if finish:
            g = tl.zeros((BLOCK,), dtype=tl.float32)
            u = tl.zeros((BLOCK,), dtype=tl.float32)
            for s in range(SPLIT):
                g += tl.load(parts + s * step, mask=n_ok, other=0.0, cache_modifier=".cg")
                u += tl.load(parts + s * step + INTER, mask=n_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counters + tile, 0)
    if finish:
        v = (g * tl.sigmoid(g) * u).to(ROUND).to(tl.float32)
        q, scale = _e4m3_codes(tl.where(n_ok, v, 0.0), 0)
        tl.store(h + a.to(tl.int64) * stride_ht + offs_n, q.to(h.dtype.element_ty), mask=n_ok)
        tl.store(h_s + a.to(tl.int64) * stride_hst + pid_n, scale)


@triton.jit
def _fp8_moe_skinny_down_kernel(
    h,  # [T * TOP_K, I] e4m3
    h_s,  # [T * TOP_K, ceil(I/128)] fp32
    w,  # [E, H, I] e4m3
    w_s,  # [E, ceil(H/SCALE_ROWS), ceil(I/128)] fp32
    ids,  # [T * TOP_K]
    weights,  # [T * TOP_K] fp32 routing weights
    out,  # [T, H]
    part,  # [T * TOP_K, H] fp32
    counters,  # [T * ceil(H/BLOCK_N)] int32, zero between launches
    H,
    INTER,
    stride_ht,
    stride_hst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (n, a): BLOCK_N rows of assignment a's down projection times its quantized
    intermediate, scaled by its routing weight (zero for another rank's expert); the last of a
    token's TOP_K assignments to finish a tile adds theirs in assignment order (deterministic) and
    writes the token's output, so no kernel sums over the experts afterwards. With PDL the expert's
    first weight tile is loaded before the wait: the expert ids come from the router, two launches
    back, which finished before the gate/up kernel's programs passed their waits and let this one
    launch."""
    pid_n = tl.program_id(0)
    a = tl.program_id(1)
    expert = tl.load(ids + a, cache_modifier=".cg").to(tl.int64)
    valid = (expert >= 0) & (expert < E)
    expert = tl.where(valid, expert, 0)
    rows = tl.arange(0, 16)  # the assignment's row is the MMA's first column
    acc, offs_n, n_ok = _skinny_fp8_tile(
        h + a.to(tl.int64) * stride_ht, h_s + a.to(tl.int64) * stride_hst, w + expert * stride_we,
        w_s + expert * stride_se, pid_n, rows, rows < 1, H, INTER, 0, tl.cdiv(INTER, BLOCK), 0, 0, stride_wn,
        stride_sn, SCALE_ROWS, BLOCK_N, BLOCK, PDL,
    )  # fmt: skip
    # another rank's expert adds zero; its intermediate row was never written (where, not a product)
    acc = tl.where(valid, acc, 0.0)
    y = tl.sum(acc, axis=1) * tl.load(weights + a)
    token = a // TOP_K
    tl.store(part + a.to(tl.int64) * H + offs_n, y, mask=n_ok)
    tile = token * tl.num_programs(0) + pid_n
    if last_to_arrive(counters, tile, TOP_K):
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for j in range(TOP_K):
            total += tl.load(
                part + (token * TOP_K + j).to(tl.int64) * H + offs_n,
                mask=n_ok,
                other=0.0,
                cache_modifier=".cg",
            )
        tl.store(out + token.to(tl.int64) * stride_ot + offs_n, total.to(out.dtype.element_ty), mask=n_ok)
        tl.atomic_xchg(counters + tile, 0)


@triton.jit
def _split_sum_kernel(part, c, MN, N, stride_cm, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """c = the sum over SPLIT of part `[SPLIT, M, N]` fp32, in split order (deterministic)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(part + s * MN + offs, mask=ok, other=0.0)
    dst = c + (offs // N).to(tl.int64) * stride_cm + offs % N
    tl.store(dst, acc.to(c.dtype.element_ty), mask=ok)


@triton.jit
def _fp8_gemv_kernel(
    x,  # [M, K]
    w,  # [N, K] e4m3
    w_s,
    y,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_wsn,
    stride_ym,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    S: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Each iteration reads S whole 128-column blocks of BN rows, so that enough bytes are in
    flight: the scale then broadcasts along the block's own axis."""
    wait_inputs(PDL)
    on = tl.program_id(0) * BN + tl.arange(0, BN)
    om = tl.arange(0, BLOCK_M)
    ob = tl.arange(0, S)
    oc = tl.arange(0, BLOCK)
    n_ok = on < N
    m_ok = om < M
    w_rows = w + on.to(tl.int64)[:, None, None] * stride_wn
    s_rows = w_s + (on // SCALE_ROWS)[:, None] * stride_wsn
    x_rows = x + om[:, None, None] * stride_xm
    kb = tl.cdiv(K, BLOCK)
    # elementwise products, reduced along K once at the end (see linear/triton.py)
    acc = tl.zeros((BLOCK_M, BN, S, BLOCK), dtype=tl.float32)
    for k0 in range(0, K, S * BLOCK):
        blk = k0 // BLOCK + ob
        ok = blk[:, None] * BLOCK + oc[None, :]
        k_ok = ok < K
        wt = tl.load(w_rows + ok[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        ws = tl.load(s_rows + blk[None, :], mask=n_ok[:, None] & (blk < kb)[None, :], other=0.0)
        xt = tl.load(x_rows + ok[None, :, :], mask=m_ok[:, None, None] & k_ok[None, :, :], other=0.0)
        wf = wt.to(tl.float32) * ws[:, :, None]
        acc += _fake_quant(xt.to(tl.float32), 2)[:, None, :, :] * wf[None, :, :, :]
    out = tl.sum(tl.sum(acc, axis=3), axis=2)
    dst = y + om[:, None] * stride_ym + on[None, :]
    tl.store(dst, out.to(y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_gate_up_swapped(
    x, x_s, w_base, s_base, inter, assign, valid, token, offs_n, n_ok, H, INTER, stride_xt, stride_xst,
    stride_wn, stride_sn, stride_it, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr, STEP_K: tl.constexpr,
):  # fmt: skip
    """`_fp8_moe_gate_up_kernel`'s tile transposed: `[BLOCK_N, BLOCK_M]` products of the gate and
    up rows (K-major, as wgmma's FP8 operands must be) with the block's rows."""
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, STEP_K):  # STEP_K divides the 128-column scale block
        i = k0 // BLOCK
        offs_k = k0 + tl.arange(0, STEP_K)
        k_ok = offs_k < H
        a = col_tile(x, token, valid, stride_xt, offs_k, k_ok)
        wg = row_tile(w_base, offs_n, n_ok, stride_wn, offs_k, k_ok)
        wu = row_tile(w_base, offs_n + INTER, n_ok, stride_wn, offs_k, k_ok)
        sg = tl.load(s_base + (offs_n // SCALE_ROWS) * stride_sn + i, mask=n_ok, other=0.0)
        su = tl.load(s_base + ((offs_n + INTER) // SCALE_ROWS) * stride_sn + i, mask=n_ok, other=0.0)
        sa = tl.load(x_s + token * stride_xst + i, mask=valid, other=0.0)
        acc_g += tl.dot(wg, a) * sg[:, None] * sa[None, :]
        acc_u += tl.dot(wu, a) * su[:, None] * sa[None, :]
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = inter + assign.to(tl.int64)[None, :] * stride_it + offs_n[:, None]
    tl.store(dst, h.to(inter.dtype.element_ty), mask=valid[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["num_assign"])  # compared with row ids only: no gain, a compile per step size
def _fp8_moe_gate_up_kernel(
    x,  # [T, H] e4m3, per token and 128 channels
    x_s,  # [T, ceil(H/128)] fp32
    w,  # [E, 2I, H] e4m3
    w_s,  # [E, ceil(2I/SCALE_ROWS), ceil(H/128)]
    rows,
    block_expert,
    inter,  # [num_assign, I]
    num_assign,
    H,
    INTER,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    stride_xt,
    stride_xst,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_it,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    STEP_K: tl.constexpr,
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
    s_base = w_s + expert.to(tl.int64) * stride_se
    if SWAP:
        _moe_gate_up_swapped(
            x, x_s, w_base, s_base, inter, assign, valid, token, offs_n, n_ok, H, INTER, stride_xt, stride_xst,
            stride_wn, stride_sn, stride_it, SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK, STEP_K,
        )  # fmt: skip
        return
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, STEP_K):  # STEP_K divides the 128-column scale block
        i = k0 // BLOCK
        offs_k = k0 + tl.arange(0, STEP_K)
        k_ok = offs_k < H
        a = tl.load(
            x + token[:, None] * stride_xt + offs_k[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0
        )
        wmask = n_ok[None, :] & k_ok[:, None]
        wg = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        wu = tl.load(w_base + (offs_n[None, :] + INTER) * stride_wn + offs_k[:, None], mask=wmask, other=0.0)
        sg = tl.load(s_base + (offs_n // SCALE_ROWS) * stride_sn + i, mask=n_ok, other=0.0)
        su = tl.load(s_base + ((offs_n + INTER) // SCALE_ROWS) * stride_sn + i, mask=n_ok, other=0.0)
        sa = tl.load(x_s + token * stride_xst + i, mask=valid, other=0.0)
        acc_g += tl.dot(a, wg) * sa[:, None] * sg[None, :]
        acc_u += tl.dot(a, wu) * sa[:, None] * su[None, :]
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = inter + assign.to(tl.int64)[:, None] * stride_it + offs_n[None, :]
    tl.store(dst, h.to(inter.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _moe_down_swapped(
    inter, inter_s, w_base, s_base, weights, out, a_row, valid, offs_n, n_ok, INTER, stride_it, stride_ist,
    stride_wn, stride_sn, stride_ot, SCALE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr, STEP_K: tl.constexpr,
):  # fmt: skip
    """`_fp8_moe_down_kernel`'s tile transposed: `[BLOCK_N, BLOCK_M]` products of the down rows
    with the block's intermediate rows, scaled by their routing weights."""
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, INTER, STEP_K):
        i = k0 // BLOCK
        offs_k = k0 + tl.arange(0, STEP_K)
        k_ok = offs_k < INTER
        a = col_tile(inter, a_row, valid, stride_it, offs_k, k_ok)
        b = row_tile(w_base, offs_n, n_ok, stride_wn, offs_k, k_ok)
        sb = tl.load(s_base + (offs_n // SCALE_ROWS) * stride_sn + i, mask=n_ok, other=0.0)
        sa = tl.load(inter_s + a_row * stride_ist + i, mask=valid, other=0.0)
        acc += tl.dot(b, a) * sb[:, None] * sa[None, :]
    rw = tl.load(weights + a_row, mask=valid, other=0.0).to(tl.float32)
    dst = out + a_row[None, :] * stride_ot + offs_n[:, None]
    tl.store(dst, (acc * rw[None, :]).to(out.dtype.element_ty), mask=valid[None, :] & n_ok[:, None])


@triton.jit(do_not_specialize=["num_assign"])  # compared with row ids only: no gain, a compile per step size
def _fp8_moe_down_kernel(
    inter,  # [num_assign, I] e4m3, per row and 128 channels
    inter_s,  # [num_assign, ceil(I/128)] fp32
    w,  # [E, H, I] e4m3
    w_s,  # [E, ceil(H/SCALE_ROWS), ceil(I/128)]
    rows,
    block_expert,
    weights,
    out,  # [num_assign, H]
    num_assign,
    H,
    INTER,
    E: tl.constexpr,
    stride_it,
    stride_ist,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_ot,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK: tl.constexpr,
    STEP_K: tl.constexpr,
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
    s_base = w_s + expert.to(tl.int64) * stride_se
    if SWAP:
        _moe_down_swapped(
            inter, inter_s, w_base, s_base, weights, out, a_row, valid, offs_n, n_ok, INTER, stride_it,
            stride_ist, stride_wn, stride_sn, stride_ot, SCALE_ROWS, BLOCK_M, BLOCK_N, BLOCK, STEP_K,
        )  # fmt: skip
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, STEP_K):
        i = k0 // BLOCK
        offs_k = k0 + tl.arange(0, STEP_K)
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
        sb = tl.load(s_base + (offs_n // SCALE_ROWS) * stride_sn + i, mask=n_ok, other=0.0)
        sa = tl.load(inter_s + a_row * stride_ist + i, mask=valid, other=0.0)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
    rw = tl.load(weights + a_row, mask=valid, other=0.0).to(tl.float32)
    acc = acc * rw[:, None]
    tl.store(dst, acc.to(out.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
