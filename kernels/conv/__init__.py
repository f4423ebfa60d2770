"""Depthwise causal conv1d of the linear-attention layers, over a pool of conv states.

x is token-major `[T, D]`; weight `[D, W]`; a conv state holds the last W-1 inputs of a
sequence channel-first, `[D, W-1]` (pools are `[S, D, W-1]`).
"""

from __future__ import annotations

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.conv.reference import _activate, causal_conv1d_ref
from deltaserve.kernels.dispatch import use_fast_path


def conv_prefill(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    cache: PerForwardCache | None = None,
) -> torch.Tensor:
    """Variable-length conv over N packed sequences; final states go to `conv_pool[slots]`.
    `cache`: the caller's, where the fast path keeps what it derives from `cu_seqlens`."""
    if use_fast_path(x):
        from deltaserve.kernels.conv.cuda import conv_prefill_cuda

        return conv_prefill_cuda(
            x, conv_pool, weight, bias, cu_seqlens, slots, has_initial_state, activation, cache
        )
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        init = conv_pool[slot] if bool(has_initial_state[i]) else None
        y, final = causal_conv1d_ref(x[lo:hi], weight, bias, init, activation)
        out[lo:hi] = y
        conv_pool[slot] = final.to(conv_pool.dtype)
    return out


def conv_decode(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token for each of N sequences: x `[N, D]`; updates `conv_pool[slots]` in place."""
    if use_fast_path(x):
        from deltaserve.kernels.conv.cuda import conv_decode_cuda

        return conv_decode_cuda(x, conv_pool, weight, bias, slots, activation)
    idx = slots.long()
    history = conv_pool[idx].to(weight.dtype)  # [N, D, W-1]
    full = torch.cat([history, x.to(weight.dtype).unsqueeze(-1)], dim=-1)  # [N, D, W]
    y = (full * weight.unsqueeze(0)).sum(-1)
    if bias is not None:
        y = y + bias
    conv_pool[idx] = full[..., 1:].to(conv_pool.dtype)
    return _activate(y, activation).to(x.dtype)
