"""Fast CUDA paths of the causal-conv ops, on our Triton kernels (`conv/triton.py`).

Semantics and shapes are those of `deltaserve.kernels.conv`.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache


def _is_silu(activation: str | None) -> bool:
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported conv activation {activation!r}")


def _check(x: torch.Tensor, conv_pool: torch.Tensor, weight: torch.Tensor) -> None:
    dim, width = weight.shape
    assert width >= 2, "a width-1 conv keeps no state"
    assert x.shape[-1] == dim and conv_pool.shape[1:] == (dim, width - 1), (x.shape, conv_pool.shape)
    assert x.stride(-1) == 1 and conv_pool.stride(-1) == 1 and weight.stride(-1) == 1


def conv_decode_cuda(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per request, updating `conv_pool[slots]` in place; CUDA-graph safe."""
    from deltaserve.kernels.conv.triton import conv_decode_launch

    _check(x, conv_pool, weight)
    out = torch.empty_like(x)
    conv_decode_launch(x, conv_pool, weight, bias, slots, out, _is_silu(activation))
    return out


def conv_prefill_cuda(
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
    """Varlen causal conv from the pool's histories; final histories go back to `conv_pool[slots]`."""
    from deltaserve.kernels.conv.triton import conv_prefill_launch

    _check(x, conv_pool, weight)
    out = torch.empty_like(x)
    has_init = has_initial_state.to(torch.int32)
    silu = _is_silu(activation)
    conv_prefill_launch(x, conv_pool, weight, bias, cu_seqlens, slots, has_init, out, silu, cache=cache)
    return out
