"""Layers shared by the hybrid models: norms, rotary embedding, MLP, sparse MoE."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.linear import linear, silu_mul_linear
from deltaserve.kernels.moe import fused_moe
from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm
from deltaserve.kernels.router import softmax_topk


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `kernels.linear` (cuBLAS, or on CUDA the Triton GEMV
    for one or two rows of a small or narrow matrix).

    A projection fused from several checkpoint matrices (gate|up, q|k|v) names their row
    counts in `shard_sizes`: off the fast path (CPU, the fp32 oracle) it runs them as separate
    matmuls, because a matmul's rounding depends on its shape and the unfused model's fp32
    results must be matched bit for bit."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, shard_sizes: list[int] | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        assert shard_sizes is None or sum(shard_sizes) == out_features, (shard_sizes, out_features)
        self.shard_sizes = shard_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_sizes is not None and not use_fast_path(x):
            w = self.weight.split(self.shard_sizes)
            b = self.bias.split(self.shard_sizes) if self.bias is not None else [None] * len(w)
            return torch.cat([F.linear(x, wi, bi) for wi, bi in zip(w, b)], dim=-1)
        return linear(x, self.weight, self.bias)


class _RMSNorm(nn.Module):
    zero_centered: bool

    def __init__(self, dim: int, eps: float, init: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), init))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: a decoder layer's residual add, fused."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered)


class ZeroCenteredRMSNorm(_RMSNorm):
    """RMSNorm whose weight is stored as an offset from one: y = norm(x) * (1 + w)."""

    zero_centered = True

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps, 0.0)


class RMSNorm(_RMSNorm):
    """Plain RMSNorm, y = w * norm(x), the weight rounded to x's dtype last (Kimi-Linear, DeepSeek)."""

    zero_centered = False

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps, 1.0)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the linear-attention output, gated by silu(z) (GDN) or sigmoid(z)
    (KDA; see `kernels.norm.gated_rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6, kind: str = "silu") -> None:
        super().__init__()
        self.eps = eps
        self.kind = kind
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate `[T, H, D]`."""
        return gated_rms_norm(x, gate, self.weight, self.eps, self.kind)


class PartialRotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` channels of each head (rotate-half layout)."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hkv, D]`, positions `[T]`."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(q.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype).unsqueeze(1)
        sin = emb.sin().to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one matmul (`gate_up_proj`,
    filled from the checkpoint's `gate_proj` and `up_proj` by the weight loader)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False, shard_sizes=[intermediate] * 2)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        inter = self.down_proj.in_features
        return {
            "gate_proj.weight": ("gate_up_proj.weight", 0, inter),
            "up_proj.weight": ("gate_up_proj.weight", inter, inter),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation is applied inside the down projection's GEMV where that runs
        return silu_mul_linear(self.gate_up_proj(x), self.down_proj.weight)


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up `[E, 2I, H]`, down `[E, H, I]`."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)


class SparseMoeBlock(nn.Module):
    """Softmax top-k routing plus a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5-MoE)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        expert_size: int,
        shared_expert_size: int,
        norm_topk_prob: bool,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, expert_size)
        self.shared_expert = GatedMLP(hidden, shared_expert_size) if shared_expert_size else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared_expert_size else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = softmax_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        out = self.experts(x, ids, weights.to(x.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def run_decoder(
    embed: nn.Embedding,
    layers: nn.ModuleList,
    norm: _RMSNorm,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: Any,
) -> torch.Tensor:
    """Embed, the decoder layers, the final norm. Each layer returns `(output, residual
    stream)`; the residual adds happen inside the next norm (`_RMSNorm.forward_add`)."""
    x = embed(input_ids)
    residual = None
    for layer in layers:
        x, residual = layer(x, positions, ctx, residual)
    return norm.forward_add(x, residual)[0] if residual is not None else norm(x)


class HybridCausalLM(nn.Module):
    """The causal-LM shell shared by the model families: a decoder `model` (with
    `embed_tokens` and `layer_types`) and the vocabulary projection, tied or not."""

    def __init__(self, config: Any, model: Any) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self._layer_types: list[str] = list(model.layer_types)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight

    @property
    def layer_types(self) -> list[str]:
        return self._layer_types

    def tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: Any) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
