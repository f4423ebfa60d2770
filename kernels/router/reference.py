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


def with_shared(
    ids: torch.Tensor, weights: torch.Tensor, expert: int, gate: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed (ids, weights) followed by a shared expert fused into the stack as `expert`,
    weighted by the sigmoid of its gate logits `[T]`, or by one."""
    shared = torch.sigmoid(gate.float()) if gate is not None else torch.ones_like(weights[:, 0])
    ids = torch.cat([ids, torch.full_like(ids[:, :1], expert)], dim=1)
    return ids, torch.cat([weights, shared[:, None]], dim=1)
