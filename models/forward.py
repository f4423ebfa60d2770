"""The model/engine contract: what a model's layers call during a forward, and what a model
tells the engine about itself.

A model's forward receives a `ForwardContext`; its full-attention layers call `ctx.attn`, its
linear-attention (GDN / KDA) layers call `ctx.linear`. Both are Protocols, so models name no
engine class: the engine's backends (`engine/runner/attention_backend.py`,
`engine/runner/linear_backend.py`) implement them, and mypy holds them to these signatures.
Every op takes the model's `layer_id`; the backend maps it to the layer's place in its pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class PagedAttention(Protocol):
    def attention(
        self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Stores the new tokens' K / V `[T, H_kv, D]` in the layer's KV pages, then attends with
        queries `[T, H, D]` over each request's pages; returns `[T, H, D]`."""
        ...


class LatentAttention(Protocol):
    def mla_attention(
        self,
        layer_id: int,
        q: torch.Tensor,
        latent: torch.Tensor,
        w_kv_b: torch.Tensor,
        v_head_dim: int,
        scale: float,
    ) -> torch.Tensor:
        """Multi-head latent attention: stores each new token's latent `[T, L + R]`, attends with
        queries `[T, H, nope + R]` over the cached latents expanded by `w_kv_b`; returns
        `[T, H, v_head_dim]`."""
        ...


class AttentionOps(PagedAttention, LatentAttention, Protocol):
    """What full-attention layers (gated attention, MLA) call: `ForwardContext.attn`."""


class CausalConv(Protocol):
    def conv(
        self,
        layer_id: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        state: str = "conv",
        activation: str | None = "silu",
    ) -> torch.Tensor:
        """Depthwise causal conv of `x` `[T, C]` with `weight` `[C, W]`, continuing each request
        from (and updating) its conv state named `state`; returns `[T, C]`."""
        ...


class DeltaRule(Protocol):
    def delta_rule(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
    ) -> torch.Tensor:
        """Gated DeltaNet over each request's recurrent state, from the raw gate projections
        a, b `[T, HV]`; q, k `[T, H, K]`, v `[T, HV, V]`; returns `[T, HV, V]`."""
        ...

    def kda(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """Kimi Delta Attention: the delta rule with a per-key-channel log decay g `[T, H, K]`
        and beta `[T, H]`; returns `[T, H, V]`."""
        ...


class LinearOps(CausalConv, DeltaRule, Protocol):
    """What linear-attention layers (GDN, KDA) call: `ForwardContext.linear`."""


class ForwardContext(Protocol):
    """What a model's forward receives: the two backends side by side (neither wraps the other).
    Read-only here, so an implementation may hold its concrete backends."""

    @property
    def attn(self) -> AttentionOps: ...

    @property
    def linear(self) -> LinearOps: ...


# image tokens in a step: their rows in the batch, and the vision tower's embeddings for them
ImageEmbeds = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ModelCapabilities:
    """What a model family offers beyond the forward and logits every model has; the engine
    reads it instead of testing the model's class."""

    # the checkpoint may carry a multi-token-prediction layer (`qwen3_next_mtp.py`)
    mtp_head: bool = False
