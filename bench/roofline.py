"""Bytes and FLOPs a decode step or a prefill must move or compute, from a model's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelCost:
    weight_bytes: int  # dense weights, read once per forward (input embeddings are only looked up)
    expert_bytes: int  # one routed expert of one layer
    num_experts: int
    top_k: int
    moe_layers: int
    active_params: int  # parameters a token passes through (routed experts: top-k of them)
    state_bytes: int  # per request: every linear layer's recurrent + conv state
    kv_bytes_per_token: int  # per cached token, all attention layers
    attn_layers: int
    attn_flops_per_pair: int  # per (query, key) pair over all attention layers


def model_cost(cfg: Any, dtype_bytes: int = 2, state_dtype_bytes: int = 4) -> ModelCost:
    h, v = cfg.hidden_size, cfg.vocab_size
    types = list(cfg.layer_types)
    n_lin = types.count("linear_attention")
    n_attn = len(types) - n_lin
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * hk * dk + hv * dv
    lin_params = h * (conv_dim + hv * dv + 2 * hv) + conv_dim * cfg.linear_conv_kernel_dim + hv * dv * h
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn_params = h * (2 * hq * d + 2 * hkv * d) + hq * d * h
    experts = getattr(cfg, "num_experts", 0) or 0
    if experts:
        ei, si, k = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.num_experts_per_tok
        mlp_total = experts * 3 * h * ei + 3 * h * si + h * experts + h
        mlp_active = k * 3 * h * ei + 3 * h * si + h * experts + h
    else:
        mlp_total = mlp_active = 3 * h * cfg.intermediate_size
    layers_active = n_lin * lin_params + n_attn * attn_params + len(types) * mlp_active
    head = h * v
    expert = 3 * h * cfg.moe_intermediate_size if experts else 0
    dense = n_lin * lin_params + n_attn * attn_params + len(types) * (mlp_total - experts * expert)
    weight_bytes = (dense + head) * dtype_bytes
    state = n_lin * (
        hv * dk * dv * state_dtype_bytes + conv_dim * (cfg.linear_conv_kernel_dim - 1) * dtype_bytes
    )
    kv = n_attn * 2 * hkv * d * dtype_bytes
    k = getattr(cfg, "num_experts_per_tok", 0) or 0
    return ModelCost(
        weight_bytes,
        expert * dtype_bytes,
        experts,
        k,
        len(types) if experts else 0,
        layers_active + head,
        state,
        kv,
        n_attn,
        n_attn * 4 * hq * d,
    )


def decode_step_bytes(cost: ModelCost, batch: int, context: int) -> int:
    """Weights once (routed experts: those the batch is expected to touch), each request's state
    read and written, its KV read (and one token written)."""
    touched = 0.0
    if cost.num_experts:
        touched = cost.num_experts * (1 - (1 - cost.top_k / cost.num_experts) ** batch)
    weights = cost.weight_bytes + cost.moe_layers * touched * cost.expert_bytes
    return int(weights) + batch * (2 * cost.state_bytes + (context + 1) * cost.kv_bytes_per_token)


def prefill_flops(cost: ModelCost, tokens: int) -> float:
    return 2.0 * cost.active_params * tokens + cost.attn_flops_per_pair * tokens * tokens / 2
