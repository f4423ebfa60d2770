"""Kimi Delta Attention token mixer (Kimi-Linear), reading and writing the state pool.

The checkpoint's separate q/k/v projections and their three short convs are fused at load
time into one `qkv_proj` and one `[3 * H * D, W]` conv weight: the convs are depthwise, so
one conv over the concatenated channels is the three convs, with one conv state per slot
and one kernel launch instead of three.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltaserve.kernels.norm import kda_gate
from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.common import GatedRMSNorm, Linear, RowParallelLinear
from deltaserve.models.parallel import SINGLE, Narrow, ShardSpec, TensorParallel


class KimiDeltaAttention(nn.Module):
    """Tensor-parallel: each rank holds a slice of the heads (q/k/v rows and conv channels,
    the heads' rows of f_b, g_b and b, A_log, dt_bias, their state); the low-rank f_a and g_a
    are replicated and o_proj is row-parallel."""

    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = tp.split(config.linear_num_heads, "linear_num_heads")
        self.head_dim = config.linear_head_dim
        self.dim = self.num_heads * self.head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        hidden = config.hidden_size
        self.qkv_proj = Linear(hidden, 3 * self.dim, bias=False)
        self.conv1d_weight = nn.Parameter(torch.empty(3 * self.dim, self.conv_kernel))
        # low-rank forget gate: g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias), per channel;
        # low-rank output gate g_b(g_a(x)); beta = sigmoid(b(x)). The three projections of x
        # (f_a, g_a, b) run as one matmul, `gates_a_proj`, filled from the checkpoint's three.
        self.gates_a_proj = Linear(
            hidden,
            2 * self.head_dim + self.num_heads,
            bias=False,
            shard_sizes=[self.head_dim, self.head_dim, self.num_heads],
        )
        self.f_b_proj = Linear(self.head_dim, self.dim, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.dim))
        self.g_b_proj = Linear(self.head_dim, self.dim, bias=False)
        self.o_norm = GatedRMSNorm(self.head_dim, eps=config.rms_norm_eps, kind="sigmoid")
        self.o_proj = RowParallelLinear(self.dim * tp.size, hidden, False, tp)
        self.activation = getattr(config, "hidden_act", "silu")

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        tp, dim, heads = self.tp, self.dim * self.tp.size, self.num_heads * self.tp.size
        rows = tp.narrow(0, dim)

        def a_log(shape: tuple[int, ...]) -> Narrow:  # `[H]`, or the release's `[1, 1, H, 1]`
            return tp.narrow(shape.index(heads), heads)

        specs: dict[str, ShardSpec] = {f"{p}.weight": rows for p in ("q_proj", "k_proj", "v_proj")}
        specs.update({f"{p}_conv1d.weight": rows for p in ("q", "k", "v")})
        specs["conv1d.weight"] = tp.narrow(0, dim, dim, dim)  # transformers' fused q | k | v conv
        specs.update({"f_b_proj.weight": rows, "g_b_proj.weight": rows, "dt_bias": rows})
        specs.update({"b_proj.weight": tp.narrow(0, heads), "A_log": a_log})
        return specs

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state: the fused q/k/v conv history and the recurrent matrix per head."""
        return {
            "conv": (3 * self.dim, self.conv_kernel - 1),
            "recurrent": (self.num_heads, self.head_dim, self.head_dim),
        }

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        d, h, target = self.head_dim, self.num_heads, "gates_a_proj.weight"
        return {
            "f_a_proj.weight": (target, 0, d),
            "g_a_proj.weight": (target, d, d),
            "b_proj.weight": (target, 2 * d, h),
        }

    def _gates_a(self, x: torch.Tensor) -> list[torch.Tensor]:
        """f_a(x), g_a(x), b(x)."""
        return list(self.gates_a_proj(x).split([self.head_dim, self.head_dim, self.num_heads], dim=-1))

    def forget_gate(self, x: torch.Tensor) -> torch.Tensor:
        """Log decay `[T, H, D]` in fp32."""
        return kda_gate(self.f_b_proj(self._gates_a(x)[0]), self.dt_bias, self.A_log, self.head_dim)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        shape = (t, self.num_heads, self.head_dim)
        mixed = ctx.linear.conv(
            self.layer_id, self.qkv_proj(x), self.conv1d_weight, None, "conv", self.activation
        )
        q, k, v = (p.view(shape) for p in mixed.split(self.dim, dim=-1))
        fa, ga, b = self._gates_a(x)
        g = kda_gate(self.f_b_proj(fa), self.dt_bias, self.A_log, self.head_dim)
        o = ctx.linear.kda(self.layer_id, q, k, v, g, torch.sigmoid(b))
        gate = self.g_b_proj(ga).view(shape)
        return self.o_proj(self.o_norm(o, gate).reshape(t, self.dim))
