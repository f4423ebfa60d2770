"""Device facts that the Triton launchers size their grids by, and whether they launch with PDL."""

from __future__ import annotations

import functools
import os

import torch

PDL_MODES = ("off", "on")


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`; the H200's 132 off CUDA (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def pdl_mode() -> str:
    mode = os.environ.get("DELTASERVE_PDL", "off") or "off"
    if mode not in PDL_MODES:
        raise ValueError(f"DELTASERVE_PDL must be one of {', '.join(PDL_MODES)}, got {mode!r}")
    return mode


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Our Triton kernels launch with programmatic dependent launch (`kernels/triton_pdl.py`)
    when `DELTASERVE_PDL=on`, on CUDA devices of compute capability 9.0 and later. Off by
    default until its final form is measured (docs/performance.md)."""
    return pdl_mode() == "on" and _pdl_capable(device)
