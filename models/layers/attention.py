"""Gated full attention of the Qwen3-Next / Qwen3.5 hybrids, over the paged KV cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deltaserve.kernels.norm import rms_norm_rope, sigmoid_gate
from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.common import (
    Linear,
    PartialRotaryEmbedding,
    RowParallelLinear,
    ZeroCenteredRMSNorm,
)
from deltaserve.models.parallel import SINGLE, Narrow, ShardSpec, TensorParallel
from deltaserve.models.vision.positions import mrope_channels, rotate_3d

ROPE_TYPES = ("default", "linear", "yarn")


def rope_frequencies(config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """The checkpoint's RoPE as (inv_freq over its rotary channels, attention factor), by
    transformers' formulas for each type: plain, position interpolation ("linear") or YaRN (its
    ramp between interpolated and extrapolated frequencies, and the factor that scales cos and
    sin). Any other scaling is refused at load rather than run as plain RoPE. (With text alone,
    Qwen3.5's multimodal sections all see the same position: one-dimensional RoPE.)"""
    params, kind = _rope_scaling(config)
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
    dim = int(head_dim * partial)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind == "linear":
        return 1.0 / (pos_freqs * float(params["factor"])), 1.0
    if kind != "yarn":
        raise ValueError(
            f"the checkpoint's RoPE scaling {kind!r} is not supported (only {', '.join(ROPE_TYPES)} are); "
            "remove rope_scaling from its config to run it without"
        )
    original = int(params.get("original_max_position_embeddings") or config.max_position_embeddings)
    factor = params.get("factor") or config.max_position_embeddings / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (
            _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            if mscale and mscale_all_dim
            else _yarn_mscale(factor)
        )
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolated = 1 - ramp  # the share of the original frequency each channel keeps
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention)


def rope_max_positions(config: Any) -> int:
    """The longest sequence the checkpoint's RoPE serves: its max_position_embeddings, or as far as
    its scaling reaches (YaRN: original length x factor; linear: that length x factor)."""
    native = int(getattr(config, "max_position_embeddings", 32768))
    params, kind = _rope_scaling(config)
    factor = params.get("factor")
    if kind == "yarn" and factor:
        return max(native, int(int(params.get("original_max_position_embeddings") or native) * factor))
    if kind == "linear" and factor:
        return int(native * factor)
    return native


def check_max_model_len(max_model_len: int | None, max_positions: int) -> None:
    """A `max_model_len` past the model's positions (`rope_max_positions`) is a ValueError, as vLLM
    and SGLang refuse it, rather than serve positions the attention layers' RoPE never saw."""
    if max_model_len is not None and max_model_len > max_positions:
        raise ValueError(
            f"max_model_len {max_model_len} is longer than the model's {max_positions} positions "
            "(max_position_embeddings, or as far as its RoPE scaling reaches; a YaRN rope_parameters "
            "given by --hf-overrides, the LLM's hf_overrides, reaches further)"
        )


def _rope_scaling(config: Any) -> tuple[dict[str, Any], str]:
    """The config's RoPE parameters (either spelling) and their type ("default" when unnamed)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    return params, params.get("rope_type") or params.get("type") or "default"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class GatedAttention(nn.Module):
    """q/k RMSNorm, partial RoPE, and an output gate sigmoid(g) carried inside q_proj.

    Tensor-parallel: each rank holds a slice of the query heads (each head's q and gate rows
    together) and of the KV heads, or one KV head replicated when there are fewer than ranks;
    o_proj is row-parallel."""

    def __init__(self, config: Any, layer_id: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.tp = tp
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads = tp.split(total_heads, "num_attention_heads")
        self.total_kv_heads = config.num_key_value_heads
        self.first_kv_head, self.num_kv_heads = tp.kv_heads(self.total_kv_heads, "num_key_value_heads")
        bias = getattr(config, "attention_bias", False)
        hidden = config.hidden_size
        # q (with its output gate), k and v as one matmul; the loader fills it from the three
        self.q_size = self.num_heads * self.head_dim * 2
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            hidden,
            self.q_size + 2 * self.kv_size,
            bias=bias,
            shard_sizes=[self.q_size, self.kv_size, self.kv_size],
        )
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, hidden, bias, tp)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        inv_freq, self.rope_attention_factor = rope_frequencies(config, self.head_dim)
        self.rotary = PartialRotaryEmbedding(inv_freq)
        # which of the 3-D positions each rotated channel pair reads (a prompt with images)
        self.mrope_channels = mrope_channels(config, inv_freq.shape[0])
        self.scale = self.head_dim**-0.5
        self.quantize = False  # an FP8 o_proj reads the gated output (`kernels.norm.sigmoid_gate`)

    def after_loading(self) -> None:
        """YaRN scales the rotated channels' cos and sin, so q's and k's: folded into the q and k
        norms' weights for those channels (zero-centered: the scale is 1 + w), where the fused
        norm-and-RoPE op reads them."""
        factor = self.rope_attention_factor
        if factor == 1.0:
            return
        rotary = 2 * self.rotary.inv_freq.shape[0]
        for norm in (self.q_norm, self.k_norm):
            w = norm.weight.data
            w[:rotary] = (factor * (1.0 + w[:rotary].float()) - 1.0).to(w.dtype)

    def _norm_rope(self, x: torch.Tensor, norm: ZeroCenteredRMSNorm, positions: torch.Tensor) -> torch.Tensor:
        """The per-head norm and partial RoPE, one fused op. By 3-D positions `[3, T]` (image
        tokens in the step, models/vision/positions.py) the fused op only normalizes (at position
        0) and the rotation follows in torch."""
        inv_freq = self.rotary.inv_freq
        if positions.dim() == 1:
            return rms_norm_rope(x, norm.weight, norm.eps, positions, inv_freq)
        assert self.mrope_channels is not None, "3-D positions for a model without M-RoPE"
        normed = rms_norm_rope(x, norm.weight, norm.eps, torch.zeros_like(positions[0]), inv_freq)
        return rotate_3d(normed, positions, inv_freq, self.mrope_channels)

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        q, kv = self.q_size, self.kv_size
        rows = {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}
        kinds = ("weight", "bias") if self.qkv_proj.bias is not None else ("weight",)
        return {f"{p}.{w}": (f"qkv_proj.{w}", s, n) for p, (s, n) in rows.items() for w in kinds}

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        q = self.tp.narrow(0, self.q_size * self.tp.size)  # whole heads: q and gate interleave per head
        kv = Narrow(0, ((self.first_kv_head * self.head_dim, self.kv_size),))
        kinds = ("weight", "bias") if self.qkv_proj.bias is not None else ("weight",)
        return {f"{p}.{w}": n for p, n in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)) for w in kinds}

    def kv_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)}

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = self._norm_rope(q, self.q_norm, positions)
        k = self._norm_rope(k, self.k_norm, positions)
        o = ctx.attn.attention(self.layer_id, q, k, v, self.scale)
        return self.o_proj(sigmoid_gate(o, gate, self.quantize).reshape(t, -1))
