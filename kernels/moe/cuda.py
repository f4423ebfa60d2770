"""Fused MoE on CUDA: assignments sorted by expert with tensor ops only, then two grouped GEMMs."""

from __future__ import annotations

import torch


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by expert, each group padded to block_m, in buffers of a fixed worst-case size.

    Returns (rows [R], block_expert [R // block_m]); padding rows hold num_assign. Assignments
    whose id is outside [0, num_experts) (skipped: another rank's expert) form one last group
    whose blocks hold num_experts, as empty blocks do (num_experts or num_experts + 1): the
    GEMMs pass over every block of an expert >= num_experts, the down kernel writes zeros for
    the skipped rows. No host synchronisation, so CUDA graphs can capture it.
    """
    flat = topk_ids.reshape(-1).long()
    flat = flat.masked_fill((flat < 0) | (flat >= num_experts), num_experts)
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    rank = torch.arange(n, device=device) - count_start[sorted_expert]
    max_rows = n + (num_experts + 1) * (block_m - 1)
    max_rows = (max_rows + block_m - 1) // block_m * block_m
    rows = torch.full((max_rows,), n, dtype=torch.int32, device=device)
    rows.scatter_(0, padded_start[sorted_expert] + rank, order.to(torch.int32))
    block_start = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    return rows, block_expert


def fused_moe_cuda(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.moe.triton import _moe_down_kernel, _moe_gate_up_kernel

    t, h = x.shape
    e, two_i, _ = gate_up.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    n = t * top_k
    block_m = 16 if n <= 512 else 64
    x = x.contiguous()
    rows, block_expert = _align(topk_ids, e, block_m)
    inter = torch.empty(n, inter_size, dtype=x.dtype, device=x.device)
    block_n, block_k = 64, 64
    # fp32 serving asks for fp32 results: no tf32 rounding inside the dots
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    grid1 = (block_expert.numel(), triton.cdiv(inter_size, block_n))
    _moe_gate_up_kernel[grid1](
        x, gate_up, rows, block_expert, inter, n, h, inter_size, top_k, e,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        **pdl_args(x.device),
    )  # fmt: skip
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    grid2 = (block_expert.numel(), triton.cdiv(h, block_n))
    _moe_down_kernel[grid2](
        inter, down, rows, block_expert, weights, out, n, h, inter_size, e,
        inter.stride(0), down.stride(0), down.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision,
        **pdl_args(inter.device),
    )  # fmt: skip
    return out.view(t, top_k, h).sum(dim=1)
