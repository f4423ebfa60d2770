"""The torch references of the block-scaled FP8 matmuls (the CPU path and the oracle of the CUDA
kernels): activations quantized per token group of 128 channels, both sides dequantized, the
product in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.fp8.blocks import _EPS, BLOCK, FP8_DTYPE, FP8_MAX, dequantize_blocks, num_blocks


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[T, K]` per token in groups of 128 channels: (e4m3 `[T, K]`, fp32 scales `[T, ceil(K/128)]`)."""
    t, k = x.shape
    kb = num_blocks(k)
    padded = x.float().new_zeros(t, kb * BLOCK)
    padded[:, :k] = x.float()
    groups = padded.view(t, kb, BLOCK)
    scale = groups.abs().amax(dim=-1).clamp(min=_EPS) / FP8_MAX
    q = (groups / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(t, kb * BLOCK)[:, :k].contiguous(), scale


def fake_quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """fp32 x after the per-token-group e4m3 round trip (what the FP8 matmul sees)."""
    q, scale = quantize_activations(x)
    return q.float() * scale.repeat_interleave(BLOCK, dim=-1)[:, : x.shape[1]]


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int
) -> torch.Tensor:
    """x `[T, K]` (any float dtype) times an e4m3 weight `[N, K]`: `[T, N]` in x's dtype."""
    w = dequantize_blocks(weight, scale, scale_rows)
    return (
        F.linear(fake_quantize_activations(x.reshape(-1, x.shape[-1])), w)
        .to(x.dtype)
        .view(*x.shape[:-1], weight.shape[0])
    )


def fp8_moe_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    scale_rows: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    """`kernels.moe.moe_ref` with e4m3 experts (gate_up `[E, 2I, H]`, down `[E, H, I]`, scales
    per block) and both matmuls' inputs quantized per token group."""
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():
        if not 0 <= e < gate_up.shape[0]:  # skipped, as in moe_ref
            continue
        token_idx, k_idx = torch.where(topk_ids == e)
        h = fp8_linear_ref(x[token_idx], gate_up[e], gate_up_scale[e], scale_rows)
        gate, up = h.float().chunk(2, dim=-1)
        y = fp8_linear_ref((F.silu(gate) * up).to(x.dtype), down[e], down_scale[e], scale_rows)
        out.index_add_(0, token_idx, (y * topk_weights[token_idx, k_idx, None]).to(out.dtype))
    return out
