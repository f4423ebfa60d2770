"""Bytes and FLOPs a decode step or a prefill must move or compute, read off a built model.

Works for every architecture deltaserve serves (GDN and KDA hybrids, GQA and MLA attention,
dense and MoE MLPs): parameters are counted from the model's modules (on the meta device
if you like), state and KV sizes from its `state_shapes()` / `kv_shapes()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from deltaserve.models.checkpoints.quantization import Fp8Experts
from deltaserve.models.layers.common import Experts


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
    attn_flops_per_pair: int  # per (query, visible key) pair over all attention layers


def _attention_width(cfg: Any) -> int:
    """Hq x (qk dim + v dim): the FLOPs of one (query, key) pair are twice this."""
    heads = cfg.num_attention_heads
    if getattr(cfg, "kv_lora_rank", None):  # MLA
        return heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads * 2 * head_dim


def model_cost(model: nn.Module, cfg: Any, dtype_bytes: int = 2, state_dtype_bytes: int = 4) -> ModelCost:
    experts = [m for m in model.modules() if isinstance(m, (Experts, Fp8Experts))]
    expert_params = sum(p.numel() for m in experts for p in m.parameters())
    num_experts = experts[0].num_experts if experts else 0
    per_expert = expert_params // (num_experts * len(experts)) if experts else 0
    tied = bool(getattr(model, "tie_word_embeddings", False))

    def nbytes(p: nn.Parameter) -> int:  # FP8 weights are one byte; the rest in the serving dtype
        return p.numel() * (1 if p.element_size() == 1 else dtype_bytes)

    expert_bytes = sum(nbytes(p) for m in experts for p in m.parameters())
    dense = dense_bytes = 0
    for name, p in model.named_parameters():  # a tied lm_head is listed once, as the embedding
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        dense += p.numel()
        dense_bytes += nbytes(p)
    dense -= expert_params
    dense_bytes -= expert_bytes
    top_k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
    types = list(model.layer_types)  # type: ignore[arg-type]
    n_lin = types.count("linear_attention")
    n_attn = len(types) - n_lin
    state = n_lin * sum(
        _numel(shape) * (state_dtype_bytes if name == "recurrent" else dtype_bytes)
        for name, shape in model.state_shapes().items()  # type: ignore[operator]
    )
    kv = n_attn * dtype_bytes * sum(_numel(s) for s in model.kv_shapes().values())  # type: ignore[operator]
    return ModelCost(
        weight_bytes=dense_bytes,
        expert_bytes=expert_bytes // (num_experts * len(experts)) if experts else 0,
        num_experts=num_experts,
        top_k=top_k,
        moe_layers=len(experts),
        active_params=dense + len(experts) * top_k * per_expert,
        state_bytes=state,
        kv_bytes_per_token=kv,
        attn_flops_per_pair=n_attn * 2 * _attention_width(cfg),
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


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
