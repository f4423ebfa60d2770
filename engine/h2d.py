"""Host lists to device tensors without stalling the host."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`. On CUDA it is staged in pinned memory and copied
    without blocking, in order on the current stream: `torch.tensor(values, device=cuda)` (a
    blocking copy) would make the host wait for everything queued, which under overlap
    scheduling is the step in flight. PyTorch's pinned-memory cache keeps the staging block
    until the copy has run."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
