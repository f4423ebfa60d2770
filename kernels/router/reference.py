"""The torch references of the MoE routing rules (the CPU path and the oracle): softmax top-k and
DeepSeek-V3's sigmoid top-k, as `deltaserve.kernels.router` describes them."""

from __future__ import annotations

import torch


def softmax_topk_ref(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def sigmoid_topk_ref(
    scores: torch.Tensor, bias: torch.Tensor, k: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.topk(scores + bias, k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * scaling
