"""Host lists to device tensors without stalling the host.

On CUDA the values are written into a pinned staging buffer and copied without blocking, in
order on the current stream: `torch.tensor(values, device=cuda)` (a blocking copy) would make
the host wait for everything queued, which under overlap scheduling is the step in flight.
The staging buffers are a small ring, reused, and a batch's lists go over in one packed copy:
a fresh pinned allocation and each separate copy cost the host tens of microseconds.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch

_ALIGN = 16  # Triton specialises on 16-byte aligned pointers


class PinnedRing:
    """Pinned host buffers reused in turn. A buffer is handed out again only after the copy
    from its previous use has run (an event recorded after that copy), so staging never
    overwrites bytes a queued copy has yet to read. The host never waits for that: when the
    next buffer's copy is still queued (under overlap scheduling a step's copies queue behind
    the step in flight, and a sampled step makes several), the ring grows by a buffer instead,
    up to `max_size`."""

    def __init__(self, size: int = 8, max_size: int = 64) -> None:
        self.buffers: list[torch.Tensor | None] = [None] * size
        self.events: list[torch.cuda.Event | None] = [None] * size
        self.max_size = max_size
        self.next = 0

    def take(self, nbytes: int) -> tuple[int, torch.Tensor]:
        i = self.next
        event = self.events[i]
        if event is not None and not event.query():
            if len(self.buffers) < self.max_size:  # still queued: a new buffer here instead
                self.buffers.insert(i, None)
                self.events.insert(i, None)
                event = None
            else:
                event.synchronize()
        self.next = (i + 1) % len(self.buffers)
        buf = self.buffers[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.buffers[i] = self._alloc(max(nbytes, 2 * buf.numel() if buf is not None else 1 << 16))
        return i, buf[:nbytes]

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def copied(self, i: int, stream: torch.cuda.Stream) -> None:
        event = self.events[i]
        if event is None:
            event = self.events[i] = torch.cuda.Event()
        event.record(stream)


_rings = threading.local()


def _ring() -> PinnedRing:
    ring = getattr(_rings, "ring", None)
    if ring is None:
        ring = _rings.ring = PinnedRing()
    return ring


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    # once per dtype: this runs for every list of every step
    return torch.empty(0, dtype=dtype).numpy().dtype


def to_device_packed(
    fields: Sequence[tuple[Sequence | np.ndarray, torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Several host lists (each `(values, dtype)`; a list of equal-length lists is 2-D) as
    tensors on `device` through one staging buffer and one copy. The tensors are views into
    one device buffer, each over its own bytes and 16-byte aligned."""
    arrays = [np.asarray(values, dtype=_numpy_dtype(dtype)) for values, dtype in fields]
    offsets = []
    total = 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    if device.type != "cuda":
        buf = torch.empty(total, dtype=torch.uint8)
        _write(buf.numpy(), arrays, offsets)
    else:
        buf = torch.empty(total, dtype=torch.uint8, device=device)
        _send(buf, lambda staging: _write(staging, arrays, offsets))
    return [
        buf[off : off + a.nbytes].view(dtype).view(a.shape)
        for a, off, (_, dtype) in zip(arrays, offsets, fields)
    ]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a list of equal-length lists) as a tensor on `device`, through
    numpy (`torch.tensor` converts nested lists element by element); on CUDA through the
    pinned ring, without blocking."""
    if device.type != "cuda":
        return torch.from_numpy(np.asarray(values, dtype=_numpy_dtype(dtype)))
    return to_device_packed([(values, dtype)], device)[0]


def copy_to_device(dst: torch.Tensor, values: np.ndarray) -> None:
    """Copy a numpy array into the contiguous tensor `dst` (same shape and dtype); on CUDA
    through the pinned ring, without blocking (a static buffer a CUDA graph reads)."""
    src = np.ascontiguousarray(values)
    if dst.device.type != "cuda":
        dst.copy_(torch.from_numpy(src))
        return
    _send(dst.view(-1).view(torch.uint8), lambda staging: _write(staging, [src], [0]))


def _write(staging: np.ndarray, arrays: Sequence[np.ndarray], offsets: Sequence[int]) -> None:
    for a, off in zip(arrays, offsets):
        staging[off : off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _send(dst: torch.Tensor, fill: Callable[[np.ndarray], None]) -> None:
    """Fill a staging buffer of the pinned ring (`fill(its bytes as numpy)`) and copy it into
    the CUDA bytes `dst`, without blocking; the ring reuses the buffer after the copy ran."""
    ring = _ring()
    i, host = ring.take(dst.numel())
    fill(host.numpy())
    dst.copy_(host, non_blocking=True)
    ring.copied(i, torch.cuda.current_stream(dst.device))
