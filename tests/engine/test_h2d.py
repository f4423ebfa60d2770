"""Host lists to device tensors: the values, dtype and shape `torch.tensor` would give, on CPU
here and on CUDA where there is one."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.h2d import to_device

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
