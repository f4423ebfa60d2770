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


def delta_window_cuda(
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
    gate_per_k: bool,
) -> torch.Tensor:
    """The GDN (g `[T, HV]`) or KDA (`gate_per_k`: g `[T, H, K]`) window in one Triton kernel."""
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.window.triton import _delta_window_kernel

    n, t = slots.shape[0], q.shape[0]
    hk, dk = k.shape[1], k.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if n == 0 or t == 0:
        return out
    token_of = _token_of(pad_index, n, width, t, q.device)
    q, k, v, g, beta = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, g, beta))
    block_v = max(8, min(32, triton.next_power_of_2(dv)))
    _delta_window_kernel[(n * hv, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state_pool, slots, token_of, window, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), out.stride(0), out.stride(1),
        state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        window.stride(0), window.stride(1), window.stride(2), window.stride(3),
        dk**-0.5, 1e-6,
        WIDTH=width, HV=hv, GROUP=hv // hk, K=dk, V=dv, BK=triton.next_power_of_2(dk), BV=block_v,
        GATE_PER_K=gate_per_k,
        **pdl_args(q.device),
    )  # fmt: skip
    return out


def _token_of(pad_index: torch.Tensor, n: int, width: int, t: int, device: torch.device) -> torch.Tensor:
    """`[N * width]`: the packed token index of each (window, position), -1 past a window's end."""
    token_of = torch.full((n * width,), -1, dtype=torch.int32, device=device)
    token_of[pad_index] = torch.arange(t, dtype=torch.int32, device=device)
    return token_of


def conv_window_cuda(
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
    import triton

    from deltaserve.kernels.common.pdl import pdl_args
    from deltaserve.kernels.conv.cuda import _check, _is_silu
    from deltaserve.kernels.window.triton import _conv_window_kernel

    _check(x, conv_pool, weight)
    assert window.stride(-1) == 1
    n, (t, dim) = slots.shape[0], x.shape
    out = torch.empty_like(x)
    if n == 0 or t == 0:
        return out
    block_d = 256
    _conv_window_kernel[(n, triton.cdiv(dim, block_d))](
        x, conv_pool, weight, bias if bias is not None else weight, slots,
        _token_of(pad_index, n, width, t, x.device), window, out, dim,
        x.stride(0), conv_pool.stride(0), conv_pool.stride(1), weight.stride(0),
        window.stride(0), window.stride(1), window.stride(2), out.stride(0),
        W=weight.shape[1], WIDTH=width, BD=block_d, HAS_BIAS=bias is not None, SILU=_is_silu(activation),
        **pdl_args(x.device),
    )  # fmt: skip
    return out
