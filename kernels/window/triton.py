"""Triton kernel: the gated delta rule over a speculative verification window.

One program per (window, value head, block of value columns) reads the committed state of
its slot once, steps through the window's tokens in registers, and writes the state after
every position to the window buffer; the slot itself is never written (the engine commits
the accepted position afterwards). Each step's arithmetic is the decode kernel's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import wait_inputs
from deltaserve.kernels.gdn.triton import delta_rule_update


@triton.jit
def _delta_window_kernel(
    q,  # [T, Hk, K] packed over the windows
    k,
    v,  # [T, HV, V]
    g,  # [T, HV] (GDN), or [T, HV, K] with GATE_PER_K (KDA: a decay per key channel)
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
    stride_gh,
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
    GATE_PER_K: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
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
        if GATE_PER_K:
            b_g = tl.load(g + t * stride_gt + i_h * stride_gh + o_k, mask=m_k & live, other=0.0).to(
                tl.float32
            )
        else:
            b_g = tl.load(g + t * stride_gt + i_h * stride_gh, mask=live, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + t * stride_bt + i_h, mask=live, other=0.0).to(tl.float32)
        if GATE_PER_K:
            b_decay = tl.exp(b_g)[:, None]
        else:
            b_decay = tl.exp(b_g)
        b_s, b_q = delta_rule_update(b_s, b_q, b_k, b_v, b_decay, b_beta, scale, eps)
        # round through the buffer's dtype, as plain decoding does between steps
        b_s = b_s.to(window.dtype.element_ty).to(tl.float32)
        b_o = tl.sum(b_s * b_q[:, None], 0)
        tl.store(w_base + j * stride_wl, b_s.to(window.dtype.element_ty), mask=m_s & live)
        tl.store(out + t * stride_ot + i_h * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v & live)


@triton.jit
def _conv_window_kernel(
    x,  # [T, D] packed over the windows
    pool,  # [S, D, W-1] committed histories
    weight,  # [D, W]
    bias,  # [D] (weight when absent)
    slots,  # [N]
    token_of,  # [N * WIDTH] packed token of (window, position), -1 past a window's end
    window,  # [R, L, D, W-1] the history after each position
    out,  # [T, D]
    D,
    stride_xt,
    stride_ps,
    stride_pd,
    stride_wd,
    stride_wr,
    stride_wl,
    stride_wc,
    stride_ot,
    W: tl.constexpr,
    WIDTH: tl.constexpr,
    BD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    """A window's stream is [history (W-1), x_0 .. x_{L-1}]; output j is the weight's dot with
    stream[j .. j+W-1] and the history after j is stream[j+1 .. j+W-1]. Every element is a
    direct load (pool or x), so positions need no sequential pass and the slot is only read."""
    wait_inputs(PDL)
    i_n = tl.program_id(0)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_d = o_d < D
    slot = tl.load(slots + i_n).to(tl.int64)
    p_hist = pool + slot * stride_ps + o_d * stride_pd
    w_base = window + i_n.to(tl.int64) * stride_wr + o_d * stride_wc
    for j in tl.static_range(WIDTH):
        t = tl.load(token_of + i_n * WIDTH + j)
        acc = tl.zeros([BD], dtype=tl.float32)
        for k in tl.static_range(W):
            s = j + k  # stream index
            if s < W - 1:
                val = tl.load(p_hist + s, mask=m_d, other=0.0)
            else:
                ts = tl.load(token_of + i_n * WIDTH + (s - (W - 1)))
                val = tl.load(
                    x + tl.maximum(ts, 0).to(tl.int64) * stride_xt + o_d, mask=m_d & (ts >= 0), other=0.0
                )
            val = val.to(weight.dtype.element_ty)
            if k >= 1:  # the history after position j holds stream[j+1 .. j+W-1]
                tl.store(w_base + j * stride_wl + (k - 1), val.to(window.dtype.element_ty), mask=m_d)
            acc += val.to(tl.float32) * tl.load(weight + o_d * stride_wd + k, mask=m_d, other=0.0).to(
                tl.float32
            )
        if HAS_BIAS:
            acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
        if SILU:
            acc = acc * tl.sigmoid(acc)
        tl.store(
            out + tl.maximum(t, 0).to(tl.int64) * stride_ot + o_d,
            acc.to(out.dtype.element_ty),
            mask=m_d & (t >= 0),
        )


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
