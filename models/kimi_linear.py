"""Kimi-Linear: Kimi Delta Attention / MLA hybrids with a DeepSeek-V3-style MoE.

Reads top to bottom like the model: embed, N x [RMSNorm -> token mixer -> residual, RMSNorm
-> MLP -> residual], RMSNorm, lm_head. The token mixer is KDA on `linear_attention` layers
and NoPE multi-head latent attention on the others; the MLP is dense on the first
`first_k_dense_replace` layers and a routed MoE (sigmoid router with a score-correction
bias, renormalised top-k scaled by `routed_scaling_factor`, plus shared experts) after.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.kernels.router import sigmoid_topk
from deltaserve.kernels.router.reference import with_shared
from deltaserve.models.checkpoints.weights import WeightLoader
from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.common import (
    Experts,
    GatedMLP,
    HybridCausalLM,
    RMSNorm,
    VocabParallelEmbedding,
    first_layers,
    fused_shared_max_tokens,
    run_decoder,
    stack_shared_expert,
)
from deltaserve.models.layers.kda import KimiDeltaAttention
from deltaserve.models.layers.mla import MultiLatentAttention
from deltaserve.models.parallel import SINGLE, TensorParallel


def layer_types_of(config: Any) -> list[str]:
    """transformers' config fills `layer_types`; the release spells it as 1-based lists."""
    if getattr(config, "layer_types", None):
        return first_layers(config.layer_types, config)
    lac = getattr(config, "linear_attn_config", None) or {}
    full = set(lac.get("full_attn_layers", []))
    return [
        "full_attention" if i + 1 in full else "linear_attention" for i in range(config.num_hidden_layers)
    ]


def mlp_types_of(config: Any) -> list[str]:
    if getattr(config, "mlp_layer_types", None):
        return first_layers(config.mlp_layer_types, config, "mlp_layer_types")
    dense = getattr(config, "first_k_dense_replace", 1)
    return ["dense" if i < dense else "sparse" for i in range(config.num_hidden_layers)]


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 routing: sigmoid scores, top-k chosen on scores + bias, weighted by scores."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.num_groups = getattr(config, "n_group", 1) or 1
        self.topk_groups = getattr(config, "topk_group", 1) or 1
        self.renormalize = bool(getattr(config, "norm_topk_prob", True))
        self.scaling = float(getattr(config, "routed_scaling_factor", 1.0))
        # fp32 whatever the model dtype (the release keeps the router fp32): near-tied expert
        # scores must not flip with bf16 rounding of the router weight
        self.weight = nn.Parameter(torch.empty(num_experts, config.hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids `[T, k]`, topk_weights `[T, k]`, rounded to x's dtype as `router.sigmoid_topk`
        says); with `shared`, a shared expert fused into the stack as expert E follows the k with
        weight one."""
        logits = F.linear(x.float(), self.weight.float())
        if self.num_groups == 1:
            bias = self.e_score_correction_bias
            return sigmoid_topk(logits, bias, self.top_k, self.renormalize, self.scaling, shared, x.dtype)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.num_groups > 1:
            grouped = choice.view(x.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            keep = torch.zeros_like(group_scores)
            keep.scatter_(1, torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False)[1], 1)
            mask = keep.unsqueeze(-1).expand_as(grouped).reshape(x.shape[0], -1)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        if shared:
            ids, weights = with_shared(ids, weights, logits.shape[1], None)
        return ids, weights.to(x.dtype)


class KimiMoE(nn.Module):
    """Tensor-parallel: the router replicated, the routed and shared experts split by their
    intermediate width, their partial sums joined by one all-reduce. Expert-parallel: the
    routed experts whole per rank (`Experts`), the shared experts still split, one all-reduce."""

    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate = SigmoidRouter(config)
        self.experts = Experts(config.num_local_experts, config.hidden_size, config.moe_intermediate_size, tp)
        shared = config.moe_intermediate_size * (getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts: GatedMLP | None = (
            GatedMLP(config.hidden_size, shared, tp, reduce=False) if shared else None
        )
        self.fused_max_tokens: int | None = None  # set by fuse_shared_expert

    def fuse_shared_expert(self) -> bool:
        """`SparseMoeBlock.fuse_shared_expert`: the shared experts (one expert's width) as expert E,
        routed to every token with weight one."""
        if self.shared_experts is None or self.tp.experts_whole:
            return False
        if not stack_shared_expert(self.experts, self.shared_experts):
            return False
        self.fused_max_tokens = fused_shared_max_tokens()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_max_tokens is not None and x.shape[0] <= self.fused_max_tokens:
            ids, weights = self.gate(x, shared=True)
            return self.tp.all_reduce(self.experts(x, ids, weights))
        ids, weights = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: Any, layer_id: int, layer_type: str, mlp_type: str, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn: KimiDeltaAttention | MultiLatentAttention
        if layer_type == "linear_attention":
            self.self_attn = KimiDeltaAttention(config, layer_id, tp)
        else:
            self.self_attn = MultiLatentAttention(config, layer_id, tp)
        self.mlp: nn.Module = (
            KimiMoE(config, tp)
            if mlp_type == "sparse"
            else GatedMLP(config.hidden_size, config.intermediate_size, tp)
        )

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mlp output, residual stream)`, the residual adds fused into the norms."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        if isinstance(self.self_attn, KimiDeltaAttention):
            h = self.self_attn(h, ctx)
        else:
            h = self.self_attn(h, positions, ctx)
        h, residual = self.post_attention_layernorm.forward_add(h, residual)
        return self.mlp(h), residual


class KimiLinearModel(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_types = layer_types_of(config)
        mlp_types = mlp_types_of(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, t, m, tp) for i, (t, m) in enumerate(zip(self.layer_types, mlp_types))
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return run_decoder(self.embed_tokens, self.layers, self.norm, input_ids, positions, ctx)


# checkpoint spellings -> ours: the release's, and the one transformers keeps in memory
_RENAMES = [
    (re.compile(r"\.block_sparse_moe\."), ".mlp."),
    (re.compile(r"\.self_attn\.forget_gate\."), ".self_attn."),
]
# tensors of a KDA layer that we fuse: target -> the parts, in order
_FUSED = {
    "qkv_proj.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
    "conv1d_weight": ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"),
}
_KDA_TENSOR = re.compile(r"model\.layers\.(\d+)\.self_attn\.(\w+\.weight|\w+)$")


class KimiLinearForCausalLM(HybridCausalLM):
    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, KimiLinearModel(config, tp), tp)

    def checkpoint_name(self, name: str) -> str | None:
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        return name if self.builds(name) else None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state of one KDA layer (every KDA layer has the same)."""
        for layer in self.model.layers:
            if isinstance(layer.self_attn, KimiDeltaAttention):
                return layer.self_attn.state_shapes()
        return {}

    def kv_shapes(self) -> dict[str, tuple[int, ...]]:
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MultiLatentAttention):
                return layer.self_attn.kv_shapes()
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, ignore=self.tied_names())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is None:
                continue
            m = _KDA_TENSOR.match(name)
            if m and isinstance(self.model.layers[int(m.group(1))].self_attn, KimiDeltaAttention):
                self._load_kda_tensor(loader, pending, name, m.group(2), tensor)
                continue
            if loader.load_expert(name, tensor):
                continue
            loader.copy(name, tensor)
        for target, parts in pending.items():
            raise ValueError(f"checkpoint has only {sorted(parts)} of the tensors fused into {target!r}")
        loader.finish()

    def _load_kda_tensor(
        self,
        loader: WeightLoader,
        pending: dict[str, dict[str, torch.Tensor]],
        name: str,
        leaf: str,
        tensor: torch.Tensor,
    ) -> None:
        prefix = name[: -len(leaf)]
        if leaf == "A_log":  # the release stores it `[1, 1, H, 1]`
            tensor = tensor.reshape(-1)
        elif leaf == "conv1d.weight":  # transformers' fused conv, `[3 * H * D, 1, W]`
            leaf, tensor = "conv1d_weight", tensor.reshape(tensor.shape[0], -1)
        for target, names in _FUSED.items():
            if leaf in names:
                if target == "conv1d_weight":
                    tensor = tensor.reshape(tensor.shape[0], -1)
                parts = pending.setdefault(prefix + target, {})
                parts[leaf] = tensor
                if len(parts) == len(names):
                    del pending[prefix + target]
                    loader.copy(prefix + target, torch.cat([parts[n] for n in names]))
                return
        loader.copy(prefix + leaf, tensor)
