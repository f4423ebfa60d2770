"""The torch reference of the depthwise causal conv1d (the CPU path and the oracle).

Shapes are those of `deltaserve.kernels.conv`: x `[T, D]`, weight `[D, W]`, a state `[D, W-1]`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv activation {activation!r}")


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: x `[T, D]`, initial_state `[D, W-1]` or None (zeros).

    Returns `(y [T, D], final_state [D, W-1])`.
    """
    dim, width = weight.shape
    seq_len = x.shape[0]
    xt = x.t().to(weight.dtype)
    if initial_state is None:
        history = torch.zeros(dim, width - 1, dtype=xt.dtype, device=x.device)
    else:
        history = initial_state.to(xt.dtype)
    full = torch.cat([history, xt], dim=-1)  # [D, W-1+T]
    y = F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), bias, groups=dim)[0]  # [D, T]
    final = full[:, -(width - 1) :] if width > 1 else full[:, :0]
    assert y.shape[-1] == seq_len
    return _activate(y, activation).t().to(x.dtype), final
