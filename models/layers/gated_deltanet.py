"""Gated DeltaNet token mixer (Qwen3-Next, Qwen3.5), reading and writing the state pool.

The checkpoint's projections are fused at load time into one `in_proj` whose output is laid
out `[q | k | v | z | b | a]`, so that both checkpoint forms (Qwen3-Next's per-key-head
interleaved `in_proj_qkvz` / `in_proj_ba`, Qwen3.5's separate `in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`) run the same code.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.common import GatedRMSNorm, Linear, RowParallelLinear
from deltaserve.models.parallel import SINGLE, ShardSpec, TensorParallel


class GatedDeltaNet(nn.Module):
    """Tensor-parallel: each rank holds a slice of the key heads and the value heads grouped
    under them (in_proj rows, conv channels, A_log, dt_bias, its heads' state); out_proj is
    row-parallel."""

    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_k_heads = tp.split(config.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = tp.split(config.linear_num_value_heads, "linear_num_value_heads")
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.in_proj = Linear(hidden, self.conv_dim + self.value_dim + 2 * self.num_v_heads, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, self.conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = RowParallelLinear(self.value_dim * tp.size, hidden, False, tp)

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        tp, n = self.tp, self.tp.size
        key, value, heads = self.key_dim * n, self.value_dim * n, self.num_v_heads * n
        qkv = tp.narrow(0, key, key, value)
        per_head = tp.narrow(0, heads)
        return {
            # Qwen3-Next's fused rows are grouped per key head: a contiguous slice is whole groups
            "in_proj_qkvz.weight": tp.narrow(0, 2 * key + 2 * value),
            "in_proj_ba.weight": tp.narrow(0, 2 * heads),
            # Qwen3.5's: q | k | v, each sliced on its own
            "in_proj_qkv.weight": qkv,
            "in_proj_z.weight": tp.narrow(0, value),
            "in_proj_b.weight": per_head,
            "in_proj_a.weight": per_head,
            "conv1d.weight": qkv,
            "A_log": per_head,
            "dt_bias": per_head,
        }

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state of this layer: conv history and the recurrent matrix per value head."""
        return {
            "conv": (self.conv_dim, self.conv_kernel - 1),
            "recurrent": (self.num_v_heads, self.head_k_dim, self.head_v_dim),
        }

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        proj = self.in_proj(x)
        mixed, z, b, a = proj.split(
            [self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1
        )
        mixed = ctx.linear.conv(self.layer_id, mixed, self.conv1d_weight, None)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        o = ctx.linear.delta_rule(self.layer_id, q, k, v, a, b, self.A_log, self.dt_bias)
        o = self.norm(
            o.view(t, self.num_v_heads, self.head_v_dim), z.view(t, self.num_v_heads, self.head_v_dim)
        )
        return self.out_proj(o.view(t, self.value_dim))

    # -- checkpoint forms -------------------------------------------------------------

    def fuse_qwen3_next(self, qkvz: torch.Tensor, ba: torch.Tensor) -> torch.Tensor:
        """Rows of Qwen3-Next's per-key-head interleaved projections, reordered to ours."""
        hk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        r = self.num_v_heads // hk
        groups = qkvz.view(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=1)
        b, a = ba.view(hk, 2 * r, -1).split([r, r], dim=1)
        parts = [p.reshape(-1, qkvz.shape[-1]) for p in (q, k, v, z, b, a)]
        return torch.cat(parts, dim=0)

    @staticmethod
    def fuse_qwen3_5(qkv: torch.Tensor, z: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return torch.cat([qkv, z, b, a], dim=0)
