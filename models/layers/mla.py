"""Multi-head latent attention (DeepSeek-V2 MLA) as Kimi-Linear uses it: no position encoding.

Each token's KV is compressed to a latent c (kv_lora_rank, RMS-normalised) plus a key part
k_pe (qk_rope_head_dim) shared by all heads; the cache holds exactly these, `L + R` numbers
per token and layer, instead of per-head K and V (`kv_b_proj` expands them at attention time).
Kimi-Linear's MLA layers are NoPE (`mla_use_nope`): k_pe is used as it comes, unrotated,
position comes from the KDA layers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.common import Linear, RMSNorm, RowParallelLinear
from deltaserve.models.parallel import SINGLE, ShardSpec, TensorParallel


class MultiLatentAttention(nn.Module):
    """Tensor-parallel: each rank holds a slice of the query heads (q_proj / q_b_proj rows)
    and their rows of the kv_b up-projection; the latent path (q_a, kv_a and their norms) and
    the latent cache are replicated; o_proj is row-parallel."""

    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if not getattr(config, "mla_use_nope", True):
            # the release's own modeling code asserts mla_use_nope; transformers never rotates
            raise ValueError("Kimi-Linear MLA with RoPE (mla_use_nope=false) is not supported")
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads = tp.split(config.num_attention_heads, "num_attention_heads")
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        qk_head_dim = self.nope_dim + self.rope_dim
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        if self.q_lora_rank is None:
            self.q_proj = Linear(hidden, self.num_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = Linear(self.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        # eps 1e-6, not rms_norm_eps: the release and transformers build this norm with the default
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = Linear(
            self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_head_dim), bias=False
        )
        self.o_proj = RowParallelLinear(self.num_heads * self.v_head_dim * tp.size, hidden, bias, tp)
        self.scale = qk_head_dim**-0.5

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        heads = self.num_heads * self.tp.size
        q = self.tp.narrow(0, heads * (self.nope_dim + self.rope_dim))
        kv_b = self.tp.narrow(0, heads * (self.nope_dim + self.v_head_dim))
        return {"q_proj.weight": q, "q_b_proj.weight": q, "kv_b_proj.weight": kv_b}

    def kv_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"latent": (self.kv_lora_rank + self.rope_dim,)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope_dim + self.rope_dim)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)
        o = ctx.attn.mla_attention(
            self.layer_id, q, latent, self.kv_b_proj.weight, self.v_head_dim, self.scale
        )
        return self.o_proj(o.reshape(t, self.num_heads * self.v_head_dim))
