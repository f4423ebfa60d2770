"""MoE routing: which k experts each token goes to, and with what weight.

Two rules: softmax top-k (Qwen3-Next, Qwen3.5-MoE; weights optionally renormalised over the
chosen k) and DeepSeek-V3's sigmoid top-k on bias-corrected scores (Kimi-Linear; weights from
the uncorrected scores, renormalised, scaled). The torch references (`router/reference.py`) are
the CPU path and the oracle; on CUDA one Triton program per token does a rule's five to nine torch ops.
A shared expert fused into the experts' stack (`layers.common.fuse_shared_expert`) is routed as a
(k + 1)-th expert of every token.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.router.reference import sigmoid_topk_ref, softmax_topk_ref, with_shared


def softmax_topk(
    logits: torch.Tensor, k: int, renormalize: bool, shared: bool = False, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids `[T, k]` int64, weights `[T, k]`) from router logits `[T, E]`, the weights rounded to
    `dtype` (the model's, as its expert products take them; on CUDA held in fp32, which the fused
    MoE reads as they are). With `shared`, the logits' last column is a shared expert's gate: that
    expert, fused into the stack after the routed ones, follows them with the gate's sigmoid as its
    weight (`[T, k + 1]`)."""
    if use_fast_path(logits):
        from deltaserve.kernels.router.triton import topk_route_launch

        return topk_route_launch(logits, None, k, renormalize, 1.0, False, int(shared), dtype)
    if not shared:
        ids, weights = softmax_topk_ref(logits, k, renormalize)
    else:
        e = logits.shape[1] - 1
        ids, weights = with_shared(*softmax_topk_ref(logits[:, :e], k, renormalize), e, logits[:, e])
    return ids, weights.to(dtype)


def sigmoid_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    renormalize: bool,
    scaling: float,
    shared: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing with one expert group, from fp32 router logits `[T, E]`; `dtype` as in
    `softmax_topk`. With `shared`, a shared expert fused into the stack as expert E follows the k
    with weight one."""
    if use_fast_path(logits):
        from deltaserve.kernels.router.triton import topk_route_launch

        return topk_route_launch(logits, bias, k, renormalize, scaling, True, 2 * shared, dtype)
    ids, weights = sigmoid_topk_ref(logits.sigmoid(), bias, k, renormalize, scaling)
    if shared:
        ids, weights = with_shared(ids, weights, logits.shape[1], None)
    return ids, weights.to(dtype)
