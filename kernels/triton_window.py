"""Triton kernel: the gated delta rule over a speculative verification window.

One program per (window, value head, block of value columns) reads the committed state of
its slot once, steps through the window's tokens in registers, and writes the state after
every position to the window buffer; the slot itself is never written (the engine commits
the accepted position afterwards). Each step's arithmetic is the decode kernel's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _gdn_window_kernel(
    q,  # [T, Hk, K] packed over the windows
    k,
    v,  # [T, HV, V]
    g,  # [T, HV]
    beta,  # [T, HV]
    state,  # pool [S, HV, K, V]
    slots,  # [N]
    token_of,  # [N * WIDTH] packed token index of (window, position), -1 past a window's end
    window,  # [R, L, HV, K, V] states after each position
    out,  # [T, HV, V]
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_wr,
    stride_wl,
    stride_wh,
    stride_wk,
    scale,
    eps,
    WIDTH: tl.constexpr,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // GROUP
    slot = tl.load(slots + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + slot * stride_ss + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    w_base = window + i_n.to(tl.int64) * stride_wr + i_h * stride_wh + o_k[:, None] * stride_wk + o_v[None, :]
    for j in range(WIDTH):
        t = tl.load(token_of + i_n * WIDTH + j)
        live = t >= 0
        t = tl.maximum(t, 0).to(tl.int64)
        b_q = tl.load(q + t * stride_qt + i_hk * stride_qh + o_k, mask=m_k & live, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * stride_kt + i_hk * stride_kh + o_k, mask=m_k & live, other=0.0).to(tl.float32)
        b_v = tl.load(v + t * stride_vt + i_h * stride_vh + o_v, mask=m_v & live, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * stride_gt + i_h, mask=live, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * stride_bt + i_h, mask=live, other=0.0).to(tl.float32)
        b_q = b_q * (1.0 / tl.sqrt(tl.sum(b_q * b_q) + eps)) * scale
        b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k) + eps))
        b_s = b_s * tl.exp(b_g)
        b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        # round through the buffer's dtype, as plain decoding does between steps
        b_s = b_s.to(window.dtype.element_ty).to(tl.float32)
        b_o = tl.sum(b_s * b_q[:, None], 0)
        tl.store(w_base + j * stride_wl, b_s.to(window.dtype.element_ty), mask=m_s & live)
        tl.store(out + t * stride_ot + i_h * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v & live)
