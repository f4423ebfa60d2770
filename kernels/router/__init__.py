"""MoE routing: which k experts each token goes to, and with what weight.

Two rules: softmax top-k (Qwen3-Next, Qwen3.5-MoE; weights optionally renormalised over the
chosen k) and DeepSeek-V3's sigmoid top-k on bias-corrected scores (Kimi-Linear; weights from
the uncorrected scores, renormalised, scaled). The torch references (`router/reference.py`) are
the CPU path and the oracle; on CUDA one Triton program per token does a rule's five to nine torch ops.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.router.reference import sigmoid_topk_ref, softmax_topk_ref


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids `[T, k]` int64, weights `[T, k]` fp32) from router logits `[T, E]`."""
    if use_fast_path(logits):
        from deltaserve.kernels.router.triton import topk_route_launch

        return topk_route_launch(logits, None, k, renormalize, 1.0, sigmoid=False)
    return softmax_topk_ref(logits, k, renormalize)


def sigmoid_topk(
    logits: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing with one expert group, from fp32 router logits `[T, E]`."""
    if use_fast_path(logits):
        from deltaserve.kernels.router.triton import topk_route_launch

        return topk_route_launch(logits, bias, k, renormalize, scaling, sigmoid=True)
    return sigmoid_topk_ref(logits.sigmoid(), bias, k, renormalize, scaling)
