"""The models' linear layers: cuBLAS, or our Triton GEMV where it was measured to win.

On CUDA (`DELTASERVE_GEMV` unset or `auto`), projections of one or two tokens whose bf16/fp32
weight is at most 8 MB go to `triton_gemv`: on the H200 cuBLAS reads such small matrices at
0.3-1.2 TB/s (a 1024x2048 bf16 projection: 12.2 us against Triton's 2.7 us), while from about
10 MB up cuBLAS is as fast or faster, and the Triton kernel, whose tiles shrink as rows are
added (its per-iteration product is capped at 8k elements), loses from three rows on
(bench/gemv.py, docs/kernels.md). `DELTASERVE_GEMV=cublas` keeps
every projection on cuBLAS; `DELTASERVE_GEMV=triton` widens the rule to `MAX_ROWS` rows and
`MAX_WEIGHT_BYTES` (for measuring).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from deltaserve.kernels.dispatch import use_fast_path

AUTO_ROWS = 2
AUTO_WEIGHT_BYTES = 8 << 20
MAX_ROWS = 8
MAX_WEIGHT_BYTES = 256 << 20


MODES = ("auto", "cublas", "triton")


def gemv_mode() -> str:
    mode = os.environ.get("DELTASERVE_GEMV", "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"DELTASERVE_GEMV must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if bias is not None or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    mode = gemv_mode()
    if mode == "cublas":
        return False
    rows, nbytes = (MAX_ROWS, MAX_WEIGHT_BYTES) if mode == "triton" else (AUTO_ROWS, AUTO_WEIGHT_BYTES)
    return (
        x.shape[0] <= rows
        and weight.numel() * weight.element_size() <= nbytes
        and x.stride(-1) == 1
        and weight.is_contiguous()
        and use_fast_path(x)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if use_gemv(x, weight, bias):
        from deltaserve.kernels.triton_gemv import gemv

        return gemv(x, weight)
    return F.linear(x, weight, bias)
