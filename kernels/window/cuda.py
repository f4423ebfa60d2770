"""The verification windows on CUDA: launch shapes around `window/triton.py`'s kernels."""

from __future__ import annotations

import torch


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
