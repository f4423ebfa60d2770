"""Device facts that the Triton launchers size their grids by."""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`; the H200's 132 off CUDA (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count
