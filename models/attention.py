"""Gated full attention of the Qwen3-Next / Qwen3.5 hybrids, over the paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from deltaserve.kernels.norm import rms_norm_rope
from deltaserve.models.layers import PartialRotaryEmbedding, ZeroCenteredRMSNorm

if TYPE_CHECKING:
    from deltaserve.engine.forward_context import ForwardContext


def rope_settings(config: Any) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from either config spelling."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return float(theta), float(factor)


class GatedAttention(nn.Module):
    """q/k RMSNorm, partial RoPE, and an output gate sigmoid(g) carried inside q_proj."""

    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        theta, factor = rope_settings(config)
        self.rotary = PartialRotaryEmbedding(self.head_dim, int(self.head_dim * factor), theta)
        self.scale = self.head_dim**-0.5

    def kv_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        # per-head q/k norm and partial RoPE, one fused op each
        inv_freq = self.rotary.inv_freq
        q = rms_norm_rope(q, self.q_norm.weight, self.q_norm.eps, positions, inv_freq)
        k = rms_norm_rope(k, self.k_norm.weight, self.k_norm.eps, positions, inv_freq)
        o = ctx.attn.attention(self.layer_id, q, k, v, self.scale)
        o = o.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o)
