"""Qwen3-Next and the Qwen3.5 family: GDN / gated-attention hybrids with dense or MoE MLPs.

Reads top to bottom like the model: embed, N x [norm -> token mixer -> residual, norm ->
MLP -> residual], norm, lm_head. Every third-of-four layer's token mixer is a Gated
DeltaNet; the rest are gated full attention (`config.layer_types`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from deltaserve.models.checkpoints.weights import WeightLoader
from deltaserve.models.forward import ForwardContext, ImageEmbeds, ModelCapabilities
from deltaserve.models.layers.attention import GatedAttention
from deltaserve.models.layers.common import (
    GatedMLP,
    HybridCausalLM,
    SparseMoeBlock,
    VocabParallelEmbedding,
    ZeroCenteredRMSNorm,
    first_layers,
    run_decoder,
)
from deltaserve.models.layers.gated_deltanet import GatedDeltaNet
from deltaserve.models.parallel import SINGLE, TensorParallel


def layer_types_of(config: Any) -> list[str]:
    types = getattr(config, "layer_types", None)
    if types:
        return first_layers(types, config)
    interval = getattr(config, "full_attention_interval", 4)
    return [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(config.num_hidden_layers)
    ]


def is_moe_layer(config: Any, layer_id: int) -> bool:
    if getattr(config, "num_experts", 0) <= 0:
        return False
    if layer_id in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, layer_type: str, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layer_id, tp)
        else:
            self.self_attn = GatedAttention(config, layer_id, tp)
        self.mlp: nn.Module
        if is_moe_layer(config, layer_id):
            self.mlp = SparseMoeBlock(
                config.hidden_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.moe_intermediate_size,
                getattr(config, "shared_expert_intermediate_size", 0),
                getattr(config, "norm_topk_prob", True),
                tp,
            )
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, tp)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(mlp output, residual stream)`: the stream is `residual + x`, added inside the next
        norm (the first layer's stream is its input)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.forward_add(x, residual)
        if self.linear_attn is not None:
            h = self.linear_attn(h, ctx)
        else:
            assert self.self_attn is not None
            h = self.self_attn(h, positions, ctx)
        h, residual = self.post_attention_layernorm.forward_add(h, residual)
        return self.mlp(h), residual


class HybridModel(nn.Module):
    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_types = layer_types_of(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, t, tp) for i, t in enumerate(self.layer_types))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        image_embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        return run_decoder(self.embed_tokens, self.layers, self.norm, input_ids, positions, ctx, image_embeds)


class Qwen3NextForCausalLM(HybridCausalLM):
    """Also serves Qwen3.5 dense and MoE text models (same blocks, other weight names)."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities(mtp_head=True)

    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__(config, HybridModel(config, tp), tp)

    def decoder_layers(self) -> list[DecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state of one linear layer (every linear layer has the same)."""
        for layer in self.decoder_layers():
            if layer.linear_attn is not None:
                return layer.linear_attn.state_shapes()
        return {}

    def kv_shapes(self) -> dict[str, tuple[int, ...]]:
        for layer in self.decoder_layers():
            if layer.self_attn is not None:
                return layer.self_attn.kv_shapes()
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self, ignore=self.tied_names())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for raw_name, tensor in weights:
            name = self.checkpoint_name(raw_name)
            if name is None:
                continue
            m = re.match(r"model\.layers\.(\d+)\.linear_attn\.(in_proj_\w+)\.weight$", name)
            if m:
                parts = pending.setdefault(m.group(1), {})
                parts[m.group(2)] = tensor
                self._maybe_fuse_in_proj(loader, int(m.group(1)), parts)
                continue
            if name.endswith("linear_attn.conv1d.weight"):
                loader.copy(
                    name.replace("conv1d.weight", "conv1d_weight"), tensor.reshape(tensor.shape[0], -1)
                )
                continue
            if loader.load_expert(name, tensor):
                continue
            loader.copy(name, tensor)
        for layer_id, parts in pending.items():
            if parts:
                raise ValueError(f"layer {layer_id}: incomplete linear-attention projections {sorted(parts)}")
        loader.finish()

    def checkpoint_name(self, name: str) -> str | None:
        """Map a checkpoint name to ours, or None for weights we do not serve."""
        if name.startswith(("mtp.", "model.visual.", "visual.", "model.mtp.")):
            return None
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        if name.startswith("language_model."):
            name = name[len("language_model.") :]
            name = name if name.startswith(("model.", "lm_head.")) else "model." + name
        return name if self.builds(name) else None

    def _maybe_fuse_in_proj(
        self, loader: WeightLoader, layer_id: int, parts: dict[str, torch.Tensor]
    ) -> None:
        gdn = self.decoder_layers()[layer_id].linear_attn
        if gdn is None:
            raise ValueError(f"layer {layer_id} is not a linear-attention layer but has {sorted(parts)}")
        target = f"model.layers.{layer_id}.linear_attn.in_proj.weight"
        if {"in_proj_qkvz", "in_proj_ba"} <= parts.keys():
            loader.copy(target, gdn.fuse_qwen3_next(parts.pop("in_proj_qkvz"), parts.pop("in_proj_ba")))
        elif {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"} <= parts.keys():
            fused = gdn.fuse_qwen3_5(
                *(parts.pop(k) for k in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
            )
            loader.copy(target, fused)
