"""Triton MoE router of `deltaserve.kernels.router`: one program (one warp) per token, the top k
found by k rounds of argmax over the row (E <= a few hundred experts fit one program); a shared expert
fused into the experts' stack as expert E follows them, weighted by its gate or by one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.launch import rounding_dtype
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs


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
    """SHARED: 0 none; 1 expert E weighted by the sigmoid of logit column E (Qwen's gate); 2 by one.
    ROUND: the dtype the weights are rounded to, stored as fp32."""
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    oe = tl.arange(0, BLOCK_E)
    me = oe < E
    x = tl.load(logits + t * s_l + oe, mask=me, other=float("-inf")).to(tl.float32)
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
            gate = tl.sigmoid(tl.load(logits + t * s_l + E).to(tl.float32))
        else:
            gate = 1.0
        sel_ids = tl.where(ok == K, (ok * 0 + E).to(tl.int64), sel_ids)
        sel_w = tl.where(ok == K, gate, sel_w)
    width = K + (SHARED > 0)
    mk = ok < width
    tl.store(ids + t * width + ok, sel_ids, mask=mk)
    tl.store(weights + t * width + ok, sel_w.to(ROUND).to(tl.float32), mask=mk)


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


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
