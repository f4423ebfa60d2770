"""Programs of one launch that finish a tile together: the last of them to arrive completes it
(a K split's parts summed, a token's experts added, a router's logits ranked).

Arrivals are counted per tile in one int32 buffer a device, zero between launches: each tile's
last program sets its count back. Launches on a device run one after another, and under PDL a
kernel touches counts only after waiting for the kernel before it, so they all share the buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's counts, at least `tiles` of them."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < tiles:
        buf = _counters[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_to_arrive(counters, tile, parts):
    """After this program's part is stored: whether it is the last of `parts` to arrive at `tile`
    (that one completes the tile, then sets its count back to zero)."""
    tl.debug_barrier()  # every thread's part stored before the tile's count moves
    return tl.atomic_add(counters + tile, 1, sem="acq_rel") == parts - 1
