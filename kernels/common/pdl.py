"""Programmatic dependent launch (PDL, Hopper and later) for our Triton kernels.

A decode step is a chain of a few hundred small kernels, and the gap between one kernel's end
and the next one's start stays even inside a CUDA graph. A kernel launched with PDL may be scheduled while the kernel before it on
the stream is still running: it does what depends on nothing earlier (the GEMV loads its first
weight tile), then `griddepcontrol.wait` blocks until the previous kernel has finished and its
writes are visible. Right after the wait it lets the next kernel launch in turn.

The rule every kernel here keeps: `wait_inputs(PDL)` comes before any load of data another
kernel writes and before any store, in every program, unconditionally. Then "this kernel has
passed its wait" implies "every earlier kernel has finished", so the ordering of the whole
stream holds transitively. One exception follows from it: a kernel may load before its wait
what was written two or more launches back (the skinny MoE's down kernel reads the router's
ids and its expert's first weight tile), since it starts only once the kernel just before it has
passed its own wait. Kernels we do not own (cuBLAS, FLA, torch) launch normally and wait
as always. Whether to launch with PDL is `launch.pdl_enabled` (`DELTASERVE_PDL`).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.launch import pdl_enabled


@triton.jit
def wait_inputs(PDL: tl.constexpr):
    """Wait for the kernels before this one (a no-op without PDL), then let the next launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_args(device: torch.device) -> dict[str, Any]:
    """Launch keyword arguments: the kernel's `PDL` constexpr and Triton's `launch_pdl`."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
