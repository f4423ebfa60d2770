"""Speculative verification windows: conv and delta rule over a few tokens per sequence,
starting from a pool slot, keeping the state after every position in a window buffer.

The committed slot is only read: which of the window's states becomes the sequence's state
is decided after sampling (the last accepted position), by `commit_window` in the engine.

Windows are short (k + 1 tokens), so the ops step through positions with the one-token
decode references, all sequences at once: each position's arithmetic is the plain decode
step's, and the state after it equals plain decoding's bit for bit. Tokens arrive packed
`[T, ...]` over N windows; `pad_index` (from `window_pad_index`) maps them into `[N, L, ...]`.
Padding positions run on zeros and their states are never committed.

On CUDA the GDN and KDA windows are one Triton kernel (`window/triton.py`) that keeps the
state in registers across the window, and the conv window one that loads every output's and
state's inputs directly.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.conv.reference import _activate
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.gdn.reference import recurrent_gated_delta_rule_ref
from deltaserve.kernels.kda.reference import recurrent_kda_ref


def window_pad_index(lens: list[int], device: torch.device) -> torch.Tensor:
    """Flat index into `[N * max(lens)]` of each packed token."""
    width = max(lens)
    idx = [i * width + j for i, n in enumerate(lens) for j in range(n)]
    # pinned on CUDA, so that the copy does not wait for the work queued before it
    return torch.tensor(idx, dtype=torch.long, pin_memory=device.type == "cuda").to(device, non_blocking=True)


def _pad(x: torch.Tensor, pad_index: torch.Tensor, n: int, width: int) -> torch.Tensor:
    out = x.new_zeros(n * width, *x.shape[1:])
    out.index_copy_(0, pad_index, x)
    return out.view(n, width, *x.shape[1:])


def conv_window(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    pad_index: torch.Tensor,
    width: int,
    window: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """x `[T, D]` packed over N windows; `window[i, j]` `[D, W-1]` gets the state after token j."""
    if use_fast_path(x):
        from deltaserve.kernels.window.cuda import conv_window_cuda

        return conv_window_cuda(x, conv_pool, weight, bias, slots, pad_index, width, window, activation)
    n = slots.shape[0]
    kernel = weight.shape[1]
    xp = _pad(x.to(weight.dtype), pad_index, n, width)  # [N, L, D]
    history = conv_pool[slots.long()].to(weight.dtype)  # [N, D, W-1]
    full = torch.cat([history, xp.transpose(1, 2)], dim=-1)  # [N, D, W-1+L]
    taps = full.unfold(-1, kernel, 1)  # [N, D, L, W]: the inputs seen by each position
    y = (taps * weight[None, :, None, :]).sum(-1)
    if bias is not None:
        y = y + bias[None, :, None]
    states = taps[..., 1:]  # after position j: its last W-1 inputs
    window[:n, :width] = states.permute(0, 2, 1, 3).to(window.dtype)
    y = _activate(y, activation).transpose(1, 2).reshape(n * width, -1)
    return y[pad_index].to(x.dtype)


def _delta_window(step, gate_per_k, q, k, v, g, beta, state_pool, slots, pad_index, width, window):
    """A delta-rule window: on CUDA the Triton kernel, else `step` (the one-token reference)
    position by position."""
    if use_fast_path(q):
        from deltaserve.kernels.window.cuda import delta_window_cuda

        return delta_window_cuda(q, k, v, g, beta, state_pool, slots, pad_index, width, window, gate_per_k)
    n = slots.shape[0]
    q, k, v, g, beta = (_pad(t, pad_index, n, width) for t in (q, k, v, g, beta))
    state = state_pool[slots.long()]
    outs = []
    for j in range(width):
        o, s = step(q[:, j], k[:, j], v[:, j], g[:, j], beta[:, j], state)
        # stored in the pool's dtype and read back, as plain decoding does between steps
        window[:n, j] = s.to(window.dtype)
        state = window[:n, j]
        outs.append(o)
    out = torch.stack(outs, dim=1)  # [N, L, H, V]
    return out.reshape(n * width, *out.shape[2:])[pad_index].to(v.dtype)


def gdn_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    pad_index: torch.Tensor,
    width: int,
    window: torch.Tensor,
) -> torch.Tensor:
    """Gated delta rule over N windows (gdn_decode's shapes, packed); `window [R, L, HV, K, V]`."""
    args = (q, k, v, g, beta, state_pool, slots, pad_index, width, window)
    return _delta_window(recurrent_gated_delta_rule_ref, False, *args)


def kda_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    pad_index: torch.Tensor,
    width: int,
    window: torch.Tensor,
) -> torch.Tensor:
    """KDA over N windows (kda_decode's shapes, packed); `window [R, L, H, K, V]`."""
    args = (q, k, v, g, beta, state_pool, slots, pad_index, width, window)
    return _delta_window(recurrent_kda_ref, True, *args)
