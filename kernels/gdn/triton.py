"""Triton kernel: one gated-delta-rule decode step that updates pool slots in place.

Decode is bound by state traffic (a Qwen3.5-9B layer holds 32 x 128 x 128 fp32 = 2 MiB per
request), so the kernel reads each state tile once, applies decay, delta rule and output in
registers, and writes it back to the same slot: one read and one write per element, where
gather -> FLA -> scatter would cost three of each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs
from deltaserve.kernels.norm.triton import gdn_log_decay


@triton.jit
def delta_rule_update(b_s, b_q, b_k, b_v, b_decay, b_beta, scale, eps):
    """One token of the gated delta rule on an fp32 `[BK, BV]` state tile: q and k L2-normalised
    (q scaled), the state decayed by `b_decay` (a scalar, or `[BK, 1]`: one decay per key
    channel, KDA) and corrected towards v. Returns (new state, normalised q)."""
    b_q = b_q * (1.0 / tl.sqrt(tl.sum(b_q * b_q) + eps)) * scale
    b_k = b_k * (1.0 / tl.sqrt(tl.sum(b_k * b_k) + eps))
    b_s = b_s * b_decay
    b_delta = (b_v - tl.sum(b_s * b_k[:, None], 0)) * b_beta
    return b_s + b_k[:, None] * b_delta[None, :], b_q


@triton.jit
def _gdn_decode_kernel(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    state,
    slots,
    out,
    stride_qn,
    stride_qh,
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    stride_gn,
    stride_bn,
    stride_on,
    stride_oh,
    stride_ss,
    stride_sh,
    stride_sk,
    scale,
    eps,
    HV: tl.constexpr,
    GROUP: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    GATES: tl.constexpr,
    PDL: tl.constexpr,
):
    """With GATES, `g` and `beta` hold GDN's raw gate projections a and b, and the gates are
    computed here (`kernels.norm.gdn_gates`, beta rounded to b's dtype as there)."""
    wait_inputs(PDL)
    i_nh = tl.program_id(0)
    i_v = tl.program_id(1)
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // GROUP  # repeat_interleave: value head h reads key head h // GROUP
    slot = tl.load(slots + i_n).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_s = m_k[:, None] & m_v[None, :]

    # Issue the big state load first so its latency overlaps the small loads and norms.
    p_s = state + slot * stride_ss + i_h * stride_sh + o_k[:, None] * stride_sk + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)

    b_q = tl.load(q + i_n * stride_qn + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_n * stride_kn + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_n * stride_vn + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g = tl.load(g + i_n * stride_gn + i_h).to(tl.float32)
    b_beta = tl.load(beta + i_n * stride_bn + i_h)
    if GATES:
        b_g = gdn_log_decay(b_g, tl.load(dt_bias + i_h).to(tl.float32), tl.load(A_log + i_h).to(tl.float32))
        b_beta = tl.sigmoid(b_beta.to(tl.float32)).to(beta.dtype.element_ty)
    b_beta = b_beta.to(tl.float32)

    b_s, b_q = delta_rule_update(b_s, b_q, b_k, b_v, tl.exp(b_g), b_beta, scale, eps)
    b_o = tl.sum(b_s * b_q[:, None], 0)

    tl.store(p_s, b_s.to(state.dtype.element_ty), mask=m_s)
    tl.store(out + i_n * stride_on + i_h * stride_oh + o_v, b_o.to(out.dtype.element_ty), mask=m_v)


def decode_block_v(
    batch: int, heads_v: int, head_k_dim: int, head_v_dim: int, sm_count: int
) -> tuple[int, int]:
    """Pick `(BV, num_warps)` for the decode kernel.

    Wide tiles (BV=64, 4 warps, 32 KiB of state per program) stream best once they give every
    SM about four programs; below that, narrow tiles (BV=16, 2 warps) spread the few heads over
    more SMs (the sweep is in docs/kernels.md).
    """
    bk = triton.next_power_of_2(head_k_dim)
    bv_max = triton.next_power_of_2(head_v_dim)
    wide = max(8, min(64, bv_max, 8192 // bk))  # at most 64 fp32 state registers per thread
    if batch * heads_v * triton.cdiv(head_v_dim, wide) >= 4 * sm_count:
        return wide, 4
    return max(8, min(16, bv_max)), 2


def gdn_decode_launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    block_v: int,
    num_warps: int,
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`gates=(A_log, dt_bias)`: g and beta are GDN's raw gate projections a and b."""
    n, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    if n == 0:
        return
    grid = (n * hv, triton.cdiv(dv, block_v))
    _gdn_decode_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        *(gates if gates is not None else (g, beta)),
        state_pool,
        slots,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        beta.stride(0),
        out.stride(0),
        out.stride(1),
        state_pool.stride(0),
        state_pool.stride(1),
        state_pool.stride(2),
        dk**-0.5,
        1e-6,
        HV=hv,
        GROUP=hv // hk,
        K=dk,
        V=dv,
        BK=triton.next_power_of_2(dk),
        BV=block_v,
        GATES=gates is not None,
        num_warps=num_warps,
        **pdl_args(q.device),
    )


@triton.jit(do_not_specialize=["T"])  # the step's prefill tokens: one compile for every count
def _qk_norm_v_kernel(
    q,
    k,
    v,
    q_out,
    k_out,
    v_out,
    T,
    stride_q,
    stride_k,
    stride_v,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BT: tl.constexpr,
    BDK: tl.constexpr,
    BDV: tl.constexpr,
    eps,
):
    """Program (token block, head slot): slots 0..HK-1 are q heads and HK..2HK-1 k heads,
    L2-normalised (in fp32, as FLA's l2norm_fwd) into contiguous outputs; the rest are v heads,
    copied into a contiguous output. Inputs are row-strided views with unit-stride heads."""
    i_t = tl.program_id(0)
    i_h = tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    rows = o_t.to(tl.int64)
    # (each branch names its own tiles: Triton types a name assigned in both branches once)
    if i_h < 2 * HK:
        o_k = tl.arange(0, BDK)
        m_k = m_t[:, None] & (o_k < DK)[None, :]
        if i_h < HK:
            src, dst, stride, h = q, q_out, stride_q, i_h
        else:
            src, dst, stride, h = k, k_out, stride_k, i_h - HK
        b_x = tl.load(src + rows[:, None] * stride + h * DK + o_k[None, :], mask=m_k, other=0.0).to(
            tl.float32
        )
        b_rstd = 1 / tl.sqrt(tl.sum(b_x * b_x, 1) + eps)
        b_y = b_x * b_rstd[:, None]
        tl.store(
            dst + rows[:, None] * (HK * DK) + h * DK + o_k[None, :], b_y.to(dst.dtype.element_ty), mask=m_k
        )
    else:
        h_v = i_h - 2 * HK
        o_v = tl.arange(0, BDV)
        m_v = m_t[:, None] & (o_v < DV)[None, :]
        b_v = tl.load(v + rows[:, None] * stride_v + h_v * DV + o_v[None, :], mask=m_v, other=0.0)
        tl.store(v_out + rows[:, None] * (HV * DV) + h_v * DV + o_v[None, :], b_v, mask=m_v)


def qk_norm_v_launch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k `[T, HK, DK]` L2-normalised per head and v `[T, HV, DV]`, all three contiguous, in
    one launch from row-strided views (GDN's split conv output) for FLA's chunked kernels."""
    t, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be unit-stride and packed"
    q_out = torch.empty((t, hk, dk), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hk, dk), dtype=k.dtype, device=k.device)
    v_out = torch.empty((t, hv, dv), dtype=v.dtype, device=v.device)
    if t:
        block_t = 32
        _qk_norm_v_kernel[(triton.cdiv(t, block_t), 2 * hk + hv)](
            q,
            k,
            v,
            q_out,
            k_out,
            v_out,
            t,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            HK=hk,
            HV=hv,
            DK=dk,
            DV=dv,
            BT=block_t,
            BDK=triton.next_power_of_2(dk),
            BDV=triton.next_power_of_2(dv),
            eps=eps,
            num_warps=4,
        )
    return q_out, k_out, v_out


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
