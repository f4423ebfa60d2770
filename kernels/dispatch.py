"""The one place that decides whether an op takes its fast CUDA path."""

from __future__ import annotations

import torch

from deltaserve.kernels.common.launch import env_mode


def use_fast_path(t: torch.Tensor) -> bool:
    """True when `t` lives on CUDA and the fast kernels are not switched off.

    `DELTASERVE_REFERENCE_KERNELS=1` forces the torch references everywhere (debugging,
    and the GPU tests that hold a fast kernel to its reference).
    """
    return t.is_cuda and reference_kernels_mode() != "1"


def reference_kernels_mode() -> str:
    """`DELTASERVE_REFERENCE_KERNELS`: "0" (default) or "1"; another value is an error."""
    return env_mode("DELTASERVE_REFERENCE_KERNELS", ("0", "1"), "0")
