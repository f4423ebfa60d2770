"""Block-scaled FP8 (e4m3) matmuls, the format of Qwen's FP8 releases.

A weight `[N, K]` is stored as e4m3 with one fp32 `scale_inv` per block of `scale_rows` x 128
(rows x columns); the checkpoints' blocks are 128 x 128, and `scale_rows` is 1 where our fused
projections stack sub-matrices whose rows are not multiples of 128 (each row then carries its
own block's scales). Edge blocks are partial. Activations are quantized on the fly per token in
groups of 128 channels (scale = amax / 448). The format is in `fp8/blocks.py`; the references
(`fp8/reference.py`) dequantize both sides and multiply in fp32; they run on CPU and are the
oracle of the CUDA kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.fp8.reference import fp8_linear_ref, fp8_moe_ref


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_rows: int,
    dense: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dense`: unquantized weight rows `[ND, K]`, whose products with x follow the FP8 ones
    (`[..., N + ND]`)."""
    if use_fast_path(x):
        from deltaserve.kernels.fp8.cuda import fp8_linear_cuda

        return fp8_linear_cuda(x, weight, scale, scale_rows, dense=dense)
    y = fp8_linear_ref(x, weight, scale, scale_rows)
    return y if dense is None else torch.cat([y, F.linear(x, dense)], dim=-1)


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
