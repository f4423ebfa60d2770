"""Kimi Delta Attention token mixer (Kimi-Linear), reading and writing the state pool.

The checkpoint's separate q/k/v projections and their three short convs are fused at load
time into one `qkv_proj` and one `[3 * H * D, W]` conv weight: the convs are depthwise, so
one conv over the concatenated channels is the three convs, with one conv state per slot
and one kernel launch instead of three.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deltaserve.models.layers import Linear

if TYPE_CHECKING:
    from deltaserve.engine.forward_context import ForwardContext


class SigmoidGatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the KDA output, gated by sigmoid(gate); all in fp32 like the release."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight.float() * y * torch.sigmoid(gate.float())
        return y.to(x.dtype)


def kda_softplus(x: torch.Tensor) -> torch.Tensor:
    # spelled as the release and transformers spell it (log(1 + exp)), not F.softplus
    # (log1p), so that fp32 gates agree bit for bit
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.dim = self.num_heads * self.head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, 3 * self.dim, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(3 * self.dim, self.conv_kernel))
        # low-rank forget gate: g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias), per channel
        self.f_a_proj = Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = Linear(self.head_dim, self.dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.dim))
        self.b_proj = Linear(hidden, self.num_heads, bias=False)
        # low-rank output gate
        self.g_a_proj = Linear(hidden, self.head_dim, bias=False)
        self.g_b_proj = Linear(self.head_dim, self.dim, bias=False)
        self.o_norm = SigmoidGatedRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = Linear(self.dim, hidden, bias=False)
        self.activation = getattr(config, "hidden_act", "silu")

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state: the fused q/k/v conv history and the recurrent matrix per head."""
        return {
            "conv": (3 * self.dim, self.conv_kernel - 1),
            "recurrent": (self.num_heads, self.head_dim, self.head_dim),
        }

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay `[T, H, D]` in fp32."""
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        f = f.view(x.shape[0], self.num_heads, self.head_dim)
        return -self.A_log.float().exp().view(-1, 1) * kda_softplus(f)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        shape = (t, self.num_heads, self.head_dim)
        mixed = ctx.linear.conv(
            self.layer_id, self.qkv_proj(x), self.conv1d_weight, None, "conv", self.activation
        )
        q, k, v = (p.view(shape) for p in mixed.split(self.dim, dim=-1))
        beta = torch.sigmoid(self.b_proj(x))
        o = ctx.linear.kda(self.layer_id, q, k, v, self.forget_gate(x), beta)
        gate = self.g_b_proj(self.g_a_proj(x)).view(shape)
        return self.o_proj(self.o_norm(o, gate).reshape(t, self.dim))
