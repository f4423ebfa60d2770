"""Triton kernels: depthwise causal conv1d over a pool of conv states `[S, D, W-1]`.

A request's inputs, read as one stream, are `[history (W-1 columns), x_0, x_1, ...]`; output t
is the dot of the weight with stream positions t .. t+W-1, and the new history is the stream's
last W-1 positions. The pool layout is channel-first (HF's), unlike FLA's `[N, D, W]`, so these
kernels read and write the pool by slot directly instead of converting around FLA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs
from deltaserve.kernels.common.per_forward import PerForwardCache, per_input


@triton.jit
def _conv_decode_kernel(
    x,
    pool,
    weight,
    bias,
    slots,
    out,
    D,
    stride_xn,
    stride_ps,
    stride_pd,
    stride_wd,
    stride_on,
    W: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    o_h = tl.arange(0, BH)  # columns of the new history, j = 0 .. W-2
    m_d = o_d < D
    m_h = o_h < W - 1
    p_row = pool + slot * stride_ps + o_d[:, None] * stride_pd

    # new_hist[j] = stream[j + 1]: the old history shifted left, then x.
    b_x = tl.load(x + i_n * stride_xn + o_d, mask=m_d, other=0.0)
    b_shift = tl.load(p_row + o_h[None, :] + 1, mask=m_d[:, None] & (o_h[None, :] < W - 2), other=0.0)
    b_new = tl.where(o_h[None, :] == W - 2, b_x[:, None].to(b_shift.dtype), b_shift)
    b_first = tl.load(pool + slot * stride_ps + o_d * stride_pd, mask=m_d, other=0.0)

    b_w0 = tl.load(weight + o_d * stride_wd, mask=m_d, other=0.0).to(tl.float32)
    b_wr = tl.load(
        weight + o_d[:, None] * stride_wd + o_h[None, :] + 1, mask=m_d[:, None] & m_h[None, :], other=0.0
    )
    y = b_first.to(tl.float32) * b_w0 + tl.sum(b_new.to(tl.float32) * b_wr.to(tl.float32), 1)
    if HAS_BIAS:
        y += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(out + i_n * stride_on + o_d, y.to(out.dtype.element_ty), mask=m_d)
    # Threads may hold other threads' history columns: finish every read before any write.
    tl.debug_barrier()
    tl.store(p_row + o_h[None, :], b_new.to(pool.dtype.element_ty), mask=m_d[:, None] & m_h[None, :])


@triton.jit(do_not_specialize=["T"])  # the step's prefill tokens: one compile for every count
def _conv_prefill_kernel(
    x,
    pool,
    weight,
    bias,
    seq_pos,
    slots,
    has_init,
    out,
    T,
    D,
    stride_xt,
    stride_ps,
    stride_pd,
    stride_wd,
    stride_ot,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    i_t = tl.program_id(0)
    i_d = tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    # each token's position in its sequence, built once per forward (`token_index`)
    b_pos = tl.load(seq_pos + T + o_t, mask=m_t, other=W - 1)
    # the tile's pointers once (T * D can pass 2**31): each tap is a scalar offset from them
    p_x = x + o_t.to(tl.int64)[:, None] * stride_xt + o_d[None, :]
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    # tap j reads stream position pos + j: history column pos + j while that precedes the
    # sequence's inputs, else input pos + j - (W-1). History terms come first in tap order,
    # so each output sums its terms in tap order as one stream would.
    if tl.min(b_pos) < W - 1:  # only tiles where a sequence starts read the history
        b_seq = tl.load(seq_pos + o_t, mask=m_t, other=0)
        b_slot = tl.load(slots + b_seq, mask=m_t, other=0).to(tl.int64)
        b_init = tl.load(has_init + b_seq, mask=m_t, other=0) != 0
        for j in tl.static_range(W - 1):
            m_hist = m_t & (b_pos < W - 1 - j) & b_init
            b_hist = tl.load(
                pool + b_slot[:, None] * stride_ps + o_d[None, :] * stride_pd + (b_pos + j)[:, None],
                mask=m_hist[:, None] & m_d[None, :],
                other=0.0,
            )
            b_w = tl.load(weight + o_d * stride_wd + j, mask=m_d, other=0.0).to(tl.float32)
            acc += b_hist.to(tl.float32) * b_w[None, :]
    for j in tl.static_range(W):
        back = W - 1 - j
        # loaded without waiting for b_pos; a prior sequence's rows dropped after
        b_in = tl.load(p_x - back * stride_xt, mask=(m_t & (o_t >= back))[:, None] & m_d[None, :], other=0.0)
        b_in = tl.where((b_pos >= back)[:, None], b_in.to(tl.float32), 0.0)
        b_w = tl.load(weight + o_d * stride_wd + j, mask=m_d, other=0.0).to(tl.float32)
        acc += b_in * b_w[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(
        out + o_t.to(tl.int64)[:, None] * stride_ot + o_d[None, :],
        acc.to(out.dtype.element_ty),
        mask=m_t[:, None] & m_d[None, :],
    )


@triton.jit
def _conv_final_state_kernel(
    x,
    pool,
    cu_seqlens,
    slots,
    has_init,
    D,
    stride_xt,
    stride_ps,
    stride_pd,
    W: tl.constexpr,
    BH: tl.constexpr,
    BD: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    i_n = tl.program_id(0)
    i_d = tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    slot = tl.load(slots + i_n).to(tl.int64)
    init = tl.load(has_init + i_n) != 0
    o_d = i_d * BD + tl.arange(0, BD)
    o_h = tl.arange(0, BH)
    m_d = o_d < D
    m_h = o_h < W - 1
    # New column j is stream position length + j: an input when that is past the history
    # (length + j >= W-1), else a column of the old history (short sequences).
    src = length + o_h - (W - 1)
    in_x = src >= 0
    p_row = pool + slot * stride_ps + o_d[:, None] * stride_pd
    b_in = tl.load(
        x + (bos + src)[None, :] * stride_xt + o_d[:, None],
        mask=m_d[:, None] & (m_h & in_x)[None, :],
        other=0.0,
    )
    b_hist = tl.load(
        p_row + (length + o_h)[None, :],
        mask=m_d[:, None] & (m_h & (~in_x) & init)[None, :],
        other=0.0,
    )
    b_new = tl.where(in_x[None, :], b_in.to(pool.dtype.element_ty), b_hist)
    tl.debug_barrier()  # all reads of the old history before any write
    tl.store(p_row + o_h[None, :], b_new, mask=m_d[:, None] & m_h[None, :])


def conv_decode_launch(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    out: torch.Tensor,
    silu: bool,
    block_d: int = 256,
    num_warps: int = 4,
) -> None:
    n, dim = x.shape
    width = weight.shape[1]
    if n == 0:
        return
    _conv_decode_kernel[(n, triton.cdiv(dim, block_d))](
        x,
        conv_pool,
        weight,
        bias if bias is not None else weight,
        slots,
        out,
        dim,
        x.stride(0),
        conv_pool.stride(0),
        conv_pool.stride(1),
        weight.stride(0),
        out.stride(0),
        W=width,
        BH=triton.next_power_of_2(max(width - 1, 1)),
        BD=block_d,
        HAS_BIAS=bias is not None,
        SILU=silu,
        num_warps=num_warps,
        **pdl_args(x.device),
    )


def token_index(cu_seqlens: torch.Tensor, total: int, cache: PerForwardCache | None = None) -> torch.Tensor:
    """`[2, total]` int32 on the device (no host sync): each token's sequence (the first bound
    strictly above it), then its position in that sequence. Built once per forward where the
    caller keeps a `cache`."""

    def build() -> torch.Tensor:
        tokens = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
        seq = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
        return torch.stack([seq, tokens - cu_seqlens[seq]]).to(torch.int32)

    return per_input(cache, "token_index", cu_seqlens, total, build)


def conv_prefill_launch(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    out: torch.Tensor,
    silu: bool,
    block_t: int = 16,
    block_d: int = 128,
    num_warps: int = 4,
    *,
    cache: PerForwardCache | None = None,
) -> None:
    """Tiles: the fastest of the `python -m bench.ops.kernels --only conv_prefill --sweep` tilings
    (docs/kernels.md). `cache`: the caller's, where the token-to-sequence index is kept."""
    total, dim = x.shape
    width = weight.shape[1]
    n = slots.shape[0]
    if total > 0:
        seq_pos = token_index(cu_seqlens, total, cache)
        _conv_prefill_kernel[(triton.cdiv(total, block_t), triton.cdiv(dim, block_d))](
            x,
            conv_pool,
            weight,
            bias if bias is not None else weight,
            seq_pos,
            slots,
            has_initial_state,
            out,
            total,
            dim,
            x.stride(0),
            conv_pool.stride(0),
            conv_pool.stride(1),
            weight.stride(0),
            out.stride(0),
            W=width,
            BT=block_t,
            BD=block_d,
            HAS_BIAS=bias is not None,
            SILU=silu,
            num_warps=num_warps,
            **pdl_args(x.device),
        )
    if n > 0:
        # Runs after the output kernel on the same stream, which has read the old history.
        block_d = 256
        _conv_final_state_kernel[(n, triton.cdiv(dim, block_d))](
            x,
            conv_pool,
            cu_seqlens,
            slots,
            has_initial_state,
            dim,
            x.stride(0),
            conv_pool.stride(0),
            conv_pool.stride(1),
            W=width,
            BH=triton.next_power_of_2(max(width - 1, 1)),
            BD=block_d,
            num_warps=4,
            **pdl_args(x.device),
        )


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
