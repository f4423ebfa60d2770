"""Routed-expert MLP (SwiGLU experts, top-k weighted sum).

An id outside `[0, E)` (-1: an expert held by another expert-parallel rank) is an assignment
to skip: it costs no expert compute and adds exactly nothing, whatever its weight."""

from __future__ import annotations

import torch

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.moe.reference import moe_ref


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    if use_fast_path(x):
        from deltaserve.kernels.moe.cuda import fused_moe_cuda

        return fused_moe_cuda(x, gate_up, down, topk_ids, topk_weights)
    return moe_ref(x, gate_up, down, topk_ids, topk_weights)
