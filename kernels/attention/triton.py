"""Triton kernels: causal attention over the paged KV cache (decode with split-KV, and prefill).

Keys and values are gathered token by token through the page table (`page = table[pos //
PAGE]`), so one kernel serves every power-of-two page size and a block may span pages. Softmax
runs online in the exp2 domain (the scale is folded with log2 e).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs


@triton.jit
def _load_kv(
    cache, page_table_row, pos, m_n, i_kh, o_d, m_d, stride_p, stride_t, stride_h, PAGE: tl.constexpr
):
    page = tl.load(page_table_row + pos // PAGE, mask=m_n, other=0).to(tl.int64)
    ptr = cache + page[:, None] * stride_p + (pos % PAGE)[:, None] * stride_t + i_kh * stride_h + o_d[None, :]
    return tl.load(ptr, mask=m_n[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    b_q,
    k_cache,
    v_cache,
    row,
    pos,
    m_n,
    q_pos,
    i_kh,
    o_d,
    m_d,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    scale_log2,
    PAGE: tl.constexpr,
    MASK: tl.constexpr,
    PREC: tl.constexpr,
):
    """Fold one tile of keys into the running softmax. MASK: 0 none, 1 past the end, 2 past
    the end or after the query (causal)."""
    b_k = _load_kv(k_cache, row, pos, m_n, i_kh, o_d, m_d, stride_kp, stride_kt, stride_kh, PAGE)
    s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale_log2
    if MASK == 1:
        s = tl.where(m_n[None, :], s, float("-inf"))
    if MASK == 2:
        s = tl.where(m_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    b_v = _load_kv(v_cache, row, pos, m_n, i_kh, o_d, m_d, stride_vp, stride_vt, stride_vh, PAGE)
    acc = acc * alpha[:, None] + tl.dot(p.to(b_v.dtype), b_v, input_precision=PREC)
    return acc, m_new, l_i


# SPLITS and the page table's width follow each step's rows and longest context: unspecialized,
# one compiled kernel per key tile serves them all
@triton.jit(do_not_specialize=["stride_pt", "SPLITS"])
def _paged_decode_kernel(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    seq_lens,
    out,
    part_o,
    part_lse,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    scale_log2,
    SPLITS,
    HQ: tl.constexpr,
    GROUP: tl.constexpr,
    BG: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    PAGE: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (request, KV head, KV split), covering the GROUP query heads that
    share the KV head so each key and value is read from HBM once."""
    wait_inputs(PDL)
    i_n = tl.program_id(0)
    i_kh = tl.program_id(1)
    i_s = tl.program_id(2)
    q_lo = tl.load(cu_seqlens_q + i_n)
    if tl.load(cu_seqlens_q + i_n + 1) > q_lo:
        seq_len = tl.load(seq_lens + i_n)
        # Splits are cut on the device from the real length, so a captured graph stays valid.
        per_split = tl.cdiv(tl.cdiv(seq_len, SPLITS), BN) * BN
        start = i_s * per_split
        end = tl.minimum(start + per_split, seq_len)

        o_g = tl.arange(0, BG)
        m_g = o_g < GROUP
        heads = i_kh * GROUP + o_g
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        b_q = tl.load(
            q + q_lo.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + o_d[None, :],
            mask=m_g[:, None] & m_d[None, :],
            other=0.0,
        )
        row = page_table + i_n.to(tl.int64) * stride_pt
        m_i = tl.full([BG], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BG], dtype=tl.float32)
        acc = tl.zeros([BG, BD], dtype=tl.float32)
        for blk in range(start, end, BN):
            pos = blk + tl.arange(0, BN)
            m_n = pos < end
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                b_q,
                k_cache,
                v_cache,
                row,
                pos,
                m_n,
                pos,
                i_kh,
                o_d,
                m_d,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                scale_log2,
                PAGE,
                1,
                PREC,
            )
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        res = acc / l_safe[:, None]
        if SPLITS == 1:
            p_o = out + q_lo.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + o_d[None, :]
            tl.store(p_o, res.to(out.dtype.element_ty), mask=m_g[:, None] & m_d[None, :])
        else:
            base = (i_n * HQ + heads) * SPLITS + i_s  # [BG] rows of [N, HQ, SPLITS]
            tl.store(part_o + base[:, None] * D + o_d[None, :], res, mask=m_g[:, None] & m_d[None, :])
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse + base, lse, mask=m_g)


@triton.jit(do_not_specialize=["SPLITS"])
def _paged_decode_reduce_kernel(
    cu_seqlens_q,
    out,
    part_o,
    part_lse,
    stride_ot,
    stride_oh,
    SPLITS,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (request, query head): the SPLITS partial results weighed by their
    log-sum-exp, BS splits a tile, so that the count is a run-time value."""
    wait_inputs(PDL)
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    q_lo = tl.load(cu_seqlens_q + i_n)
    if tl.load(cu_seqlens_q + i_n + 1) > q_lo:
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        base = (i_n * HQ + i_h) * SPLITS
        m = float("-inf")
        for s in range(0, SPLITS, BS):
            o_s = s + tl.arange(0, BS)
            lse = tl.load(part_lse + base + o_s, mask=o_s < SPLITS, other=float("-inf"))
            m = tl.maximum(m, tl.max(lse, 0))
        m = tl.where(m == float("-inf"), 0.0, m)
        acc = tl.zeros([BD], dtype=tl.float32)
        w_sum = tl.zeros([BS], dtype=tl.float32)
        for s in range(0, SPLITS, BS):
            o_s = s + tl.arange(0, BS)
            m_s = o_s < SPLITS
            w = tl.exp2(tl.load(part_lse + base + o_s, mask=m_s, other=float("-inf")) - m)
            b_o = tl.load(
                part_o + (base + o_s)[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0
            )
            acc += tl.sum(w[:, None] * b_o, 0)
            w_sum += w
        denom = tl.sum(w_sum, 0)
        res = acc / tl.where(denom > 0, denom, 1.0)
        p_o = out + q_lo.to(tl.int64) * stride_ot + i_h * stride_oh + o_d
        tl.store(p_o, res.to(out.dtype.element_ty), mask=m_d)


@triton.jit(do_not_specialize=["stride_pt"])  # the table is as wide as the step's longest context
def _paged_prefill_kernel(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    seq_lens,
    out,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_kt,
    stride_kh,
    stride_vp,
    stride_vt,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    scale_log2,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    PAGE: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (query block, request, query head); query j of a request of q_len new
    tokens sits at position seq_len - q_len + j and sees keys up to and including it."""
    wait_inputs(PDL)
    # Last query blocks first: they see the most keys, and long programs started early
    # leave a shorter tail.
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_n = tl.program_id(1)
    i_h = tl.program_id(2)
    i_kh = i_h // GROUP
    q_lo = tl.load(cu_seqlens_q + i_n)
    q_len = tl.load(cu_seqlens_q + i_n + 1) - q_lo
    if i_m * BM < q_len:
        seq_len = tl.load(seq_lens + i_n)
        prefix = seq_len - q_len
        o_m = i_m * BM + tl.arange(0, BM)
        m_m = o_m < q_len
        q_pos = prefix + o_m
        o_d = tl.arange(0, BD)
        m_d = o_d < D
        rows = (q_lo + o_m).to(tl.int64)
        b_q = tl.load(
            q + rows[:, None] * stride_qt + i_h * stride_qh + o_d[None, :],
            mask=m_m[:, None] & m_d[None, :],
            other=0.0,
        )
        row = page_table + i_n.to(tl.int64) * stride_pt
        m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BM], dtype=tl.float32)
        acc = tl.zeros([BM, BD], dtype=tl.float32)
        # Keys up to the block's first query position are visible to every row: whole tiles
        # of them need no mask. The tiles after that, up to the last query, are masked.
        unmasked_end = (prefix + i_m * BM + 1) // BN * BN
        end = tl.minimum(seq_len, prefix + (i_m + 1) * BM)
        for blk in range(0, unmasked_end, BN):
            pos = blk + tl.arange(0, BN)
            m_n = pos < unmasked_end  # always true; keeps the gather's mask shape uniform
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                b_q,
                k_cache,
                v_cache,
                row,
                pos,
                m_n,
                q_pos,
                i_kh,
                o_d,
                m_d,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                scale_log2,
                PAGE,
                0,
                PREC,
            )
        for blk in range(unmasked_end, end, BN):
            pos = blk + tl.arange(0, BN)
            m_n = pos < end
            # Every query sees position 0 (in this tile or an earlier one), so each row's
            # running max is finite once this tile is done and no row divides 0 by 0.
            acc, m_i, l_i = _attend_tile(
                acc,
                m_i,
                l_i,
                b_q,
                k_cache,
                v_cache,
                row,
                pos,
                m_n,
                q_pos,
                i_kh,
                o_d,
                m_d,
                stride_kp,
                stride_kt,
                stride_kh,
                stride_vp,
                stride_vt,
                stride_vh,
                scale_log2,
                PAGE,
                2,
                PREC,
            )
        res = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        p_o = out + rows[:, None] * stride_ot + i_h * stride_oh + o_d[None, :]
        tl.store(p_o, res.to(out.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


@triton.jit
def _store_kv_kernel(
    k_cache,
    v_cache,
    k,
    v,
    slot_mapping,
    skt,
    skh,
    svt,
    svh,
    sc,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    o = tl.arange(0, BLOCK)
    m = o < D
    dst = tl.load(slot_mapping + t).to(tl.int64) * sc + h * D + o
    kv = tl.load(k + t * skt + h * skh + o, mask=m)
    tl.store(k_cache + dst, kv.to(k_cache.dtype.element_ty), mask=m)
    vv = tl.load(v + t * svt + h * svh + o, mask=m)
    tl.store(v_cache + dst, vv.to(v_cache.dtype.element_ty), mask=m)


def store_kv_launch(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`kernels.attention.store_kv` in one launch: caches `[pages, page, Hkv, D]` contiguous,
    k and v `[T, Hkv, D]` views with unit last stride."""
    t, h, d = k.shape
    assert v.shape == k.shape and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (h, d)
    if t:
        block = triton.next_power_of_2(d)
        _store_kv_kernel[(t, h)](
            k_cache,
            v_cache,
            k,
            v,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            h * d,
            D=d,
            BLOCK=block,
            num_warps=1 if block <= 256 else 4,
            **pdl_args(k_cache.device),
        )


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
