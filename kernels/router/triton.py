"""Triton MoE router of `deltaserve.kernels.router`: one program (one warp) per token, the top k
found by k rounds of argmax over the row (E <= a few hundred experts fit one program); a shared expert
fused into the experts' stack as expert E follows them, weighted by its gate or by one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.arrival import arrival_counters, last_to_arrive
from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.launch import rounding_dtype, sm_count
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs
from deltaserve.kernels.linear.triton import gemv_rows, gemv_tiles


@triton.jit
def _route(
    logits, bias, ids, weights, E, scaling, K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr, RENORM: tl.constexpr, SHARED: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    """One token: its logits row (read past L1: another program of the launch may have written
    it), its ids and weights rows. SHARED: 0 none; 1 expert E weighted by the sigmoid of logit
    column E (Qwen's gate); 2 by one. ROUND: the dtype the weights are rounded to, stored as fp32."""
    oe = tl.arange(0, BLOCK_E)
    me = oe < E
    x = tl.load(logits + oe, mask=me, other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    if SIGMOID:
        score = tl.sigmoid(x)
        choice = score + tl.load(bias + oe, mask=me, other=0.0).to(tl.float32)
        choice = tl.where(me, choice, float("-inf"))
    else:
        p = tl.exp(x - tl.max(x, 0))
        score = p / tl.sum(p, 0)
        choice = tl.where(me, score, float("-inf"))
    ok = tl.arange(0, BLOCK_K)
    sel_ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    sel_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    # one max a round finds the value and, among ties, the lowest index: the value's bits in an
    # order-preserving int32 above the reversed index
    bits = choice.to(tl.int32, bitcast=True)
    bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    key = (bits.to(tl.int64) << 32) | (BLOCK_E - 1 - oe).to(tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, 0)
        idx = BLOCK_E - 1 - (best & 0xFFFFFFFF)
        if SIGMOID:  # the weight is the score, not the biased choice that ranked it
            w = tl.sum(tl.where(oe == idx, score, 0.0), 0)
        else:
            w_bits = (best >> 32).to(tl.int32)
            w = tl.where(w_bits >= 0, w_bits, w_bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        sel_ids = tl.where(ok == j, idx, sel_ids)
        sel_w = tl.where(ok == j, w, sel_w)
        key = tl.where(oe == idx, -(2**63), key)
    if RENORM:
        total = tl.sum(sel_w, 0)
        if SIGMOID:
            total += 1e-20
        sel_w = sel_w / total
    sel_w = sel_w * scaling
    if SHARED:
        if SHARED == 1:
            gate = tl.sigmoid(tl.load(logits + E, cache_modifier=".cg").to(tl.float32))
        else:
            gate = 1.0
        sel_ids = tl.where(ok == K, (ok * 0 + E).to(tl.int64), sel_ids)
        sel_w = tl.where(ok == K, gate, sel_w)
    mk = ok < K + (SHARED > 0)
    tl.store(ids + ok, sel_ids, mask=mk)
    tl.store(weights + ok, sel_w.to(ROUND).to(tl.float32), mask=mk)


@triton.jit
def _topk_route_kernel(
    logits,
    bias,
    ids,
    weights,
    E,
    s_l,
    scaling,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORM: tl.constexpr,
    SHARED: tl.constexpr,
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    width = K + (SHARED > 0)
    _route(
        logits + t * s_l, bias, ids + t * width, weights + t * width, E, scaling,
        K, BLOCK_E, BLOCK_K, SIGMOID, RENORM, SHARED, ROUND,
    )  # fmt: skip


@triton.jit
def _gemv_route_kernel(
    x,
    w,
    logits,
    ids,
    weights,
    counters,
    M,
    N,
    H,
    E,
    sxm,
    swn,
    BLOCK_M: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORM: tl.constexpr,
    ROUND: tl.constexpr,
    PDL: tl.constexpr,
):
    """The router's GEMV (`linear.triton.gemv_rows`: N weight rows, H columns, logits rounded to
    x's dtype as the GEMV's output is) and, in the last of its programs to finish, Qwen's
    routing of each of the M tokens (softmax top-K, then the shared expert of logit column E)."""
    out, om, on = gemv_rows(x, w, M, N, H, sxm, swn, BLOCK_M, BN, BK, False, PDL)
    mask = (om < M)[:, None] & (on < N)[None, :]
    tl.store(logits + om[:, None] * N + on[None, :], out.to(logits.dtype.element_ty), mask=mask)
    if last_to_arrive(counters, 0, tl.num_programs(0)):
        for t in range(M):
            _route(
                logits + t * N, logits, ids + t * (K + 1), weights + t * (K + 1), E, 1.0,
                K, BLOCK_E, BLOCK_K, False, RENORM, 1, ROUND,
            )  # fmt: skip
        tl.atomic_xchg(counters, 0)


def topk_route_launch(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    k: int,
    renormalize: bool,
    scaling: float,
    sigmoid: bool,
    shared: int = 0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`shared` as the kernel's SHARED; with 1, the logits' last column is the shared expert's gate.
    The weights rounded to `dtype`, kept in fp32: what the fused MoE reads, with no conversion."""
    assert logits.dim() == 2 and logits.stride(-1) == 1 and k <= logits.shape[1], (logits.shape, k)
    t, e = logits.shape
    e -= shared == 1
    width = k + (shared > 0)
    ids = torch.empty((t, width), dtype=torch.long, device=logits.device)
    weights = torch.empty((t, width), dtype=torch.float32, device=logits.device)
    if t:
        _topk_route_kernel[(t,)](
            logits,
            bias if bias is not None else logits,
            ids,
            weights,
            e,
            logits.stride(0),
            scaling,
            K=k,
            BLOCK_E=triton.next_power_of_2(e),
            BLOCK_K=triton.next_power_of_2(width),
            SIGMOID=sigmoid,
            RENORM=renormalize,
            SHARED=shared,
            ROUND=rounding_dtype(dtype),
            num_warps=1,  # a row's reductions within one warp: shuffles, no barriers
            **pdl_args(logits.device),
        )
    return ids, weights


def gemv_route_launch(
    x: torch.Tensor, weight: torch.Tensor, columns: int, k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_route_launch(linear(x, weight)[:, :columns], None, k, renormalize, 1.0, False, 1,
    dtype)` in one launch: the GEMV's programs, then its last to finish routes each token."""
    m, h = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.is_contiguous() and weight.shape[1] == h and columns <= n
    e = columns - 1
    logits = torch.empty((m, n), dtype=x.dtype, device=x.device)
    ids = torch.empty((m, k + 1), dtype=torch.long, device=x.device)
    weights = torch.empty((m, k + 1), dtype=torch.float32, device=x.device)
    if m:
        block_m, bn, bk = gemv_tiles(m, n, h, sm_count(x.device))
        _gemv_route_kernel[(triton.cdiv(n, bn),)](
            x, weight, logits, ids, weights, arrival_counters(x.device, 1), m, n, h, e, x.stride(0),
            weight.stride(0), BLOCK_M=block_m, BN=bn, BK=bk, K=k, BLOCK_E=triton.next_power_of_2(e),
            BLOCK_K=triton.next_power_of_2(k + 1), RENORM=renormalize, ROUND=rounding_dtype(dtype),
            num_warps=4, **pdl_args(x.device),  # the GEMV's: the same logits, bit for bit
        )  # fmt: skip
    return ids, weights


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
