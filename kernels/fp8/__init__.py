"""Block-scaled FP8 (e4m3) matmuls, the format of Qwen's FP8 releases.

A weight `[N, K]` is stored as e4m3 with one fp32 `scale_inv` per block of `scale_rows` x 128
(rows x columns); the checkpoints' blocks are 128 x 128, and `scale_rows` is 1 where our fused
projections stack sub-matrices whose rows are not multiples of 128 (each row then carries its
own block's scales). Edge blocks are partial. Activations are quantized on the fly per token in
groups of 128 channels (scale = amax / 448). The references below dequantize both sides and
multiply in fp32; they run on CPU and are the oracle of the CUDA kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.dispatch import use_fast_path

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
_EPS = 1e-10  # an all-zero group gets a tiny scale, not a division by zero


def num_blocks(n: int, block: int = BLOCK) -> int:
    return -(-n // block)


def quantize_blocks(w: torch.Tensor, block_rows: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[..., N, K]` as (e4m3 `[..., N, K]`, fp32 scale_inv `[..., ceil(N/block_rows),
    ceil(K/128)]`): each block scaled so that its largest magnitude is 448."""
    *lead, n, k = w.shape
    nb, kb = num_blocks(n, block_rows), num_blocks(k, BLOCK)
    padded = w.float().new_zeros(*lead, nb * block_rows, kb * BLOCK)
    padded[..., :n, :k] = w.float()
    blocks = padded.view(*lead, nb, block_rows, kb, BLOCK)
    scale = (blocks.abs().amax(dim=(-3, -1)).clamp(min=_EPS) / FP8_MAX).float()
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*lead, nb * block_rows, kb * BLOCK)[..., :n, :k].contiguous(), scale


def expand_scales(scale: torch.Tensor, rows: int, cols: int, scale_rows: int = BLOCK) -> torch.Tensor:
    """Block scales `[..., nb, kb]` as one scale per element `[..., rows, cols]`."""
    return scale.repeat_interleave(scale_rows, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[
        ..., :cols
    ]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, scale_rows: int = BLOCK) -> torch.Tensor:
    """fp32 weight of an e4m3 weight and its block scales."""
    return q.float() * expand_scales(scale.float(), q.shape[-2], q.shape[-1], scale_rows)


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


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_rows: int) -> torch.Tensor:
    if use_fast_path(x):
        from deltaserve.kernels.fp8.cuda import fp8_linear_cuda

        return fp8_linear_cuda(x, weight, scale, scale_rows)
    return fp8_linear_ref(x, weight, scale, scale_rows)


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


def fp8_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    scale_rows: int,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
) -> torch.Tensor:
    if use_fast_path(x):
        from deltaserve.kernels.fp8.cuda import fp8_moe_cuda

        return fp8_moe_cuda(x, gate_up, gate_up_scale, down, down_scale, scale_rows, topk_ids, topk_weights)
    return fp8_moe_ref(x, gate_up, gate_up_scale, down, down_scale, scale_rows, topk_ids, topk_weights)
