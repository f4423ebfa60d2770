"""The models' linear layers: cuBLAS, or our Triton GEMV for decode rows of small matrices.

On CUDA (`DELTASERVE_GEMV` unset or `auto`), projections of one or two tokens go to
`linear/triton.py` when the weight is at most 8 MB or has at most 4096 output rows: cuBLAS streams
small matrices well below the memory bandwidth and splits K (a second kernel) on matrices with
few output rows, while on wide matrices it is as fast. The Triton kernel's tiles shrink as rows
are added (its accumulator is capped at 8k elements), so from three rows on cuBLAS is used
everywhere. The rule's timings are in docs/kernels.md (`python -m bench.ops.gemv`).
`DELTASERVE_GEMV=cublas` keeps every projection on cuBLAS; `DELTASERVE_GEMV=triton` widens the
rule to `MAX_ROWS` rows and `MAX_WEIGHT_BYTES` (for measuring).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.kernels.common.launch import env_mode
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.norm import silu_and_mul

AUTO_ROWS = 2
AUTO_WEIGHT_BYTES = 8 << 20
AUTO_OUT_ROWS = 4096
MAX_ROWS = 8
MAX_WEIGHT_BYTES = 256 << 20


MODES = ("auto", "cublas", "triton")


def gemv_mode() -> str:
    return env_mode("DELTASERVE_GEMV", MODES, "auto")


def use_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    if bias is not None or x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return False
    mode = gemv_mode()
    if mode == "cublas":
        return False
    nbytes = weight.numel() * weight.element_size()
    if mode == "triton":
        fits = x.shape[0] <= MAX_ROWS and nbytes <= MAX_WEIGHT_BYTES
    else:
        fits = x.shape[0] <= AUTO_ROWS and (nbytes <= AUTO_WEIGHT_BYTES or weight.shape[0] <= AUTO_OUT_ROWS)
    return fits and x.stride(-1) == 1 and weight.is_contiguous() and use_fast_path(x)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`out`: `[..., N]` with a unit last stride (a slice of a wider output), written in place."""
    if use_gemv(x, weight, bias):
        from deltaserve.kernels.linear.triton import gemv

        return gemv(x, weight, out=out)
    y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`linear(silu_and_mul(x), weight)` for x = `[gate | up]` `[T, 2I]` (a SwiGLU MLP's down
    projection): where the Triton GEMV takes the projection, it applies the activation as it
    reads x (one kernel fewer per MLP and decode step); the same numbers either way."""
    inter = x.shape[-1] // 2
    if x.dim() == 2 and use_gemv(x[:, :inter], weight, None):
        from deltaserve.kernels.linear.triton import gemv

        return gemv(x, weight, silu_mul=True)
    return F.linear(silu_and_mul(x), weight)  # the same routing question, already answered
