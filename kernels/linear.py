"""The models' linear layers: cuBLAS, or (opt-in) our Triton GEMV at decode-sized batches.

`DELTASERVE_GEMV=triton` routes bias-free projections of at most `MAX_ROWS` tokens whose
weight is under 256 MB to `triton_gemv` on CUDA (the vocabulary projection and larger
batches stay on cuBLAS). It is off by default until `bench/gemv.py` has shown on the GPU
where it pays.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deltaserve.kernels.dispatch import use_fast_path

MAX_ROWS = 8
MAX_WEIGHT_BYTES = 256 << 20


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        bias is None
        and x.dim() == 2
        and x.shape[0] <= MAX_ROWS
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and weight.numel() * weight.element_size() <= MAX_WEIGHT_BYTES
        and use_fast_path(x)
        and os.environ.get("DELTASERVE_GEMV", "cublas") == "triton"
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_gemv(x, weight, bias):
        from deltaserve.kernels.triton_gemv import gemv

        return gemv(x, weight)
    return F.linear(x, weight, bias)
