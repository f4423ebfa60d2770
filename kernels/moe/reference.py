"""The torch reference of the routed-expert MLP (the CPU path and the oracle): expert by expert,
skipping ids outside `[0, E)` as `deltaserve.kernels.moe` describes."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """x `[T, H]`; gate_up `[E, 2I, H]`; down `[E, H, I]`; topk ids and weights `[T, k]`."""
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue
        token_idx, k_idx = torch.where(topk_ids == e)
        gate, up = F.linear(x[token_idx], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, k_idx, None]).to(out.dtype))
    return out
