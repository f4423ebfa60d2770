"""The block-scaled e4m3 weight format of `deltaserve.kernels.fp8`: its constants, and a weight's
quantization to blocks and back (what the loader, the references and the launchers share)."""

from __future__ import annotations

import torch

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
