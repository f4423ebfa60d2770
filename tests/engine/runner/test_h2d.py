"""Host lists to device tensors: the values, dtype and shape `torch.tensor` would give, one list
at a time or several packed into one transfer, on CPU here and on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.runner.h2d import PinnedRing, to_device, to_device_packed

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "values,dtype",
    [
        ([3, -1, 2**40], torch.long),
        ([0, 5, 7], torch.int32),
        ([[1, 2, 0], [4, 5, 6]], torch.int32),
        ([True, False, True], torch.bool),
        ([], torch.long),
        ([0.5, -2.25, 1e-3], torch.float32),
    ],
)
def test_lists_become_the_tensors_torch_would_make(device, values, dtype):
    t = to_device(values, dtype, torch.device(device))
    expect = torch.tensor(values, dtype=dtype)
    assert t.device.type == device and t.dtype == dtype and t.shape == expect.shape
    assert torch.equal(t.cpu(), expect)


def test_ragged_lists_are_an_error():
    with pytest.raises(ValueError):
        to_device([[1, 2], [3]], torch.int32, torch.device("cpu"))


@pytest.mark.parametrize("device", DEVICES)
def test_packed_lists_come_back_as_their_own_tensors(device):
    fields = [
        ([3, -1, 2**40], torch.long),
        ([0, 5, 7], torch.int32),  # 12 bytes: the next field starts on a 16-byte boundary
        ([[1, 2, 0], [4, 5, 6]], torch.int32),
        ([True, False, True], torch.bool),
        ([], torch.long),
        ([2**31 - 1], torch.int32),
    ]
    out = to_device_packed(fields, torch.device(device))
    assert len(out) == len(fields)
    for t, (values, dtype) in zip(out, fields):
        expect = torch.tensor(values, dtype=dtype)
        assert t.device.type == device and t.dtype == dtype and t.shape == expect.shape
        assert torch.equal(t.cpu(), expect)
    assert all(t.data_ptr() % 16 == 0 for t in out if t.numel())
    out[1][0] = 99  # views of one buffer, but each only over its own bytes
    assert torch.equal(out[0].cpu(), torch.tensor([3, -1, 2**40])) and out[2][0, 0].item() == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_ring_is_not_overwritten_under_queued_copies():
    """More transfers than the ring starts with while the stream is still busy: each tensor
    keeps its own values (a buffer is reused only after its copy has run) and the host does not
    wait for the GPU (the ring grows instead)."""
    from deltaserve.engine.runner.h2d import to_device

    torch.cuda._sleep(200_000_000)  # the copies queue behind ~0.1 s of GPU time
    # more than the ring's first 8 buffers, fewer than the 64 it may grow to (so no waiting),
    # whatever earlier tests in this process left it with
    lists = [[i] * (1000 + i) for i in range(40)]
    out = [to_device(v, torch.int32, torch.device("cuda")) for v in lists]
    assert not torch.cuda.current_stream().query()  # the host did not wait for the GPU
    torch.cuda.synchronize()
    for t, v in zip(out, lists):
        assert torch.equal(t.cpu(), torch.tensor(v, dtype=torch.int32))


class _Event:
    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


class _Ring(PinnedRing):
    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)  # no pinned memory without CUDA


def test_ring_grows_rather_than_wait_for_a_queued_copy():
    """A buffer whose copy is still queued is not handed out: the ring grows instead, and only
    at its largest size does the host wait."""
    ring = _Ring(size=2, max_size=4)
    taken = []
    for _ in range(4):
        i, buf = ring.take(8)
        ring.events[i] = _Event()  # what `copied` records: still queued
        taken.append(buf.data_ptr())
    assert len(ring.buffers) == 4 and len(set(taken)) == 4  # four distinct buffers, nobody waited
    i, buf = ring.take(8)  # at its largest size: waits for the oldest copy, then reuses its buffer
    assert buf.data_ptr() == taken[0] and ring.events[i].waited == 1
    for event in ring.events:
        event.done = True
    i, buf = ring.take(8)  # copies done: reuse in turn, no growth
    assert len(ring.buffers) == 4 and buf.data_ptr() == taken[1]
