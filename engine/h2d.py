"""Host lists to device tensors without stalling the host."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    # once per dtype: this runs for every list of every step
    return torch.empty(0, dtype=dtype).numpy().dtype


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a list of equal-length lists) as a tensor on `device`.

    The list becomes an array through numpy, which converts nested Python lists about three
    times faster than `torch.tensor` (a batch-256 page table of 40 pages a request: 145
    against 445 µs on the development CPU). On CUDA it is staged in pinned memory and copied
    without blocking, in order on the current stream: `torch.tensor(values, device=cuda)` (a
    blocking copy) would make the host wait for everything queued, which under overlap
    scheduling is the step in flight. PyTorch's pinned-memory cache keeps the staging block
    until the copy has run."""
    host = torch.from_numpy(np.asarray(values, dtype=_numpy_dtype(dtype)))
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
