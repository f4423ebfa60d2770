"""Triton kernel: MLA decode over the paged latent cache, in the absorbed form.

One program handles one request, a block of heads and one split of the positions (splits
keep a lone long request from running on a handful of multiprocessors; their partial
results are merged by log-sum-exp afterwards). The absorbed query (`W_uk^T q_nope`
beside `q_pe`) attends over the cached latents `[c | k_pe]` with an online softmax, and the
output stays in latent space (`[H, L]`); the caller applies `W_uv`. Each latent tile is read
once for all heads of the block: the latent cache, not per-head K/V, is the traffic.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import wait_inputs


# SPLITS and the page table's width follow each step's rows and longest context: unspecialized,
# one compiled kernel serves them all (the table's row is read a page index at a time)
@triton.jit(do_not_specialize=["SPLITS", "stride_pt"])
def _mla_decode_kernel(
    q,  # [N, H, L + R] fp32, absorbed
    cache,  # [P, PAGE, L + R]
    page_table,  # [N, max_pages] int32
    seq_lens,  # [N] int32
    out,  # [N, H, SPLITS, L] fp32: unnormalised partial sums of each split
    out_ml,  # [N, H, SPLITS, 2] fp32: each split's running max and softmax denominator
    scale,
    H,
    stride_qn,
    stride_qh,
    stride_cp,
    stride_ct,
    stride_pt,
    stride_on,
    stride_oh,
    stride_os,
    SPLITS,
    L: tl.constexpr,
    R: tl.constexpr,
    PAGE: tl.constexpr,
    BH: tl.constexpr,
    BL: tl.constexpr,
    BR: tl.constexpr,
    BN: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    i_n = tl.program_id(0)
    i_hb = tl.program_id(1)
    i_s = tl.program_id(2)
    heads = i_hb * BH + tl.arange(0, BH)
    m_h = heads < H
    o_l = tl.arange(0, BL)
    o_r = tl.arange(0, BR)
    m_l = o_l < L
    m_r = o_r < R
    q_row = q + i_n.to(tl.int64) * stride_qn + heads[:, None] * stride_qh
    q_c = tl.load(q_row + o_l[None, :], mask=m_h[:, None] & m_l[None, :], other=0.0)
    q_pe = tl.load(q_row + L + o_r[None, :], mask=m_h[:, None] & m_r[None, :], other=0.0)
    # a padding row (length 0) attends to one position, so that its output stays finite
    seq_len = tl.maximum(tl.load(seq_lens + i_n), 1)
    # this program's share of the positions, cut from the real length on the device
    per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BN) * BN
    lo = i_s * per_split
    hi = tl.minimum(seq_len, lo + per_split)
    row = page_table + i_n.to(tl.int64) * stride_pt
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, BL], dtype=tl.float32)
    for start in range(lo, hi, BN):
        pos = start + tl.arange(0, BN)
        m_n = pos < hi
        page = tl.load(row + pos // PAGE, mask=m_n, other=0).to(tl.int64)
        base = cache + page * stride_cp + (pos % PAGE) * stride_ct
        c = tl.load(base[:, None] + o_l[None, :], mask=m_n[:, None] & m_l[None, :], other=0.0).to(tl.float32)
        pe = tl.load(base[:, None] + L + o_r[None, :], mask=m_n[:, None] & m_r[None, :], other=0.0).to(
            tl.float32
        )
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(pe), s, input_precision=PRECISION) * scale
        s = tl.where(m_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # every tile holds a live position: m_new is finite
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p, c, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    base_o = i_n.to(tl.int64) * stride_on + heads * stride_oh + i_s * stride_os
    tl.store(out + base_o[:, None] + o_l[None, :], acc, mask=m_h[:, None] & m_l[None, :])
    # a split past the end keeps max -inf and denominator 0: it weighs nothing in the merge
    ml = out_ml + (i_n.to(tl.int64) * H + heads) * (SPLITS * 2) + i_s * 2
    tl.store(ml, m_i, mask=m_h)
    tl.store(ml + 1, l_i, mask=m_h)


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
