"""Verification-window ops against the one-token decode ops they must equal, step for step."""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.conv import conv_decode
from deltaserve.kernels.gdn import gdn_decode
from deltaserve.kernels.kda import kda_decode
from deltaserve.kernels.window import conv_window, gdn_window, kda_window, window_pad_index

LENS = [3, 1, 4]  # windows of different lengths, packed
SLOTS = [2, 5, 1]


def _decode_sequence(step, inputs, pool, lens, slots):
    """Plain decoding, token by token: outputs (packed) and the state after every token."""
    outs, states = [], []
    lo = 0
    for n, slot in zip(lens, slots):
        idx = torch.tensor([slot], dtype=torch.int32, device=pool.device)
        row = []
        for j in range(n):
            outs.append(step(*(x[lo + j : lo + j + 1] for x in inputs), pool, idx))
            row.append(pool[slot].clone())
        states.append(row)
        lo += n
    return torch.cat(outs), states


@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_delta_window_equals_decode_steps(op):
    torch.manual_seed(0)
    t, h, dk, dv = sum(LENS), 2, 8, 8
    q, k = torch.randn(t, h, dk), torch.randn(t, h, dk)
    v = torch.randn(t, h, dv)
    g = -torch.rand(t, h, dk) if op == "kda" else -torch.rand(t, h)
    beta = torch.rand(t, h)
    pool = torch.randn(7, h, dk, dv)
    window = torch.zeros(4, 5, h, dk, dv)
    decode, win_op = (kda_decode, kda_window) if op == "kda" else (gdn_decode, gdn_window)
    before = pool.clone()
    pad = window_pad_index(LENS, pool.device)
    out = win_op(q, k, v, g, beta, pool, torch.tensor(SLOTS, dtype=torch.int32), pad, max(LENS), window)
    assert torch.equal(pool, before), "the window op must not write the committed slots"
    ref_out, ref_states = _decode_sequence(decode, (q, k, v, g, beta), before.clone(), LENS, SLOTS)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for i, row in enumerate(ref_states):
        for j, s in enumerate(row):
            torch.testing.assert_close(window[i, j], s, rtol=0, atol=1e-6)


def test_conv_window_equals_decode_steps():
    torch.manual_seed(1)
    d, w = 12, 4
    x = torch.randn(sum(LENS), d)
    weight, bias = torch.randn(d, w), torch.randn(d)
    pool = torch.randn(7, d, w - 1)
    window = torch.zeros(4, 5, d, w - 1)
    before = pool.clone()
    pad = window_pad_index(LENS, pool.device)
    out = conv_window(x, pool, weight, bias, torch.tensor(SLOTS, dtype=torch.int32), pad, max(LENS), window)
    assert torch.equal(pool, before)

    def step(xi, p, idx):
        return conv_decode(xi, p, weight, bias, idx)

    ref_out, ref_states = _decode_sequence(step, (x,), before.clone(), LENS, SLOTS)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    for i, row in enumerate(ref_states):
        for j, s in enumerate(row):
            torch.testing.assert_close(window[i, j], s, rtol=0, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_delta_window_cuda_matches_fast_decode(op):
    """On CUDA both windows are the Triton delta-rule window kernel (KDA with a decay per key
    channel); plain decoding runs the fast decode kernels (ours for GDN, FLA's for KDA). The
    states agree to kernel rounding (greedy parity on GPU rests on this)."""
    torch.manual_seed(0)
    dev = torch.device("cuda")
    t, h, dk, dv = sum(LENS), 4, 64, 64
    q, k = torch.randn(t, h, dk, device=dev), torch.randn(t, h, dk, device=dev)
    v = torch.randn(t, h, dv, device=dev)
    g = -torch.rand(t, h, dk, device=dev) if op == "kda" else -torch.rand(t, h, device=dev)
    beta = torch.rand(t, h, device=dev)
    pool = torch.randn(7, h, dk, dv, device=dev) * 0.1
    window = torch.zeros(4, 5, h, dk, dv, device=dev)
    decode, win_op = (kda_decode, kda_window) if op == "kda" else (gdn_decode, gdn_window)
    before = pool.clone()
    pad = window_pad_index(LENS, dev)
    out = win_op(q, k, v, g, beta, pool, torch.tensor(SLOTS, dtype=torch.int32, device=dev), pad, 4, window)
    ref_out, ref_states = _decode_sequence(decode, (q, k, v, g, beta), before.clone(), LENS, SLOTS)
    torch.testing.assert_close(out, ref_out, rtol=1e-3, atol=1e-3)
    for i, row in enumerate(ref_states):
        for j, s in enumerate(row):
            torch.testing.assert_close(window[i, j], s, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_window_cuda_matches_fast_decode(dtype):
    """The Triton conv window against the Triton one-token conv decode, step by step, at a
    real conv width (Qwen3.5-0.8B: 6,144 channels, kernel 4); the slot is only read."""
    torch.manual_seed(2)
    dev = torch.device("cuda")
    d, w = 6144, 4
    x = torch.randn(sum(LENS), d, device=dev).to(dtype)
    weight, bias = torch.randn(d, w, device=dev).to(dtype), torch.randn(d, device=dev).to(dtype)
    pool = torch.randn(7, d, w - 1, device=dev).to(dtype)
    window = torch.zeros(4, 5, d, w - 1, device=dev, dtype=dtype)
    before = pool.clone()
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=dev)
    out = conv_window(x, pool, weight, bias, slots, window_pad_index(LENS, dev), max(LENS), window)
    assert torch.equal(pool, before)

    def step(xi, p, idx):
        return conv_decode(xi, p, weight, bias, idx)

    ref_out, ref_states = _decode_sequence(step, (x,), before.clone(), LENS, SLOTS)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # fp32 sums in another order; one bf16 rounding
    torch.testing.assert_close(out, ref_out, rtol=tol, atol=tol)
    for i, row in enumerate(ref_states):
        for j, s in enumerate(row):
            torch.testing.assert_close(window[i, j], s, rtol=0, atol=0)  # states are copies
