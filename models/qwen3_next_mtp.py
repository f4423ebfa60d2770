"""Qwen3-Next / Qwen3.5 multi-token prediction (MTP) module: the checkpoint's `mtp.*` weights.

One extra decoder layer (gated full attention, the model's MLP or MoE) that predicts the
token after next: at position p it reads the model's final hidden state h_p and the embedding
of token p + 1,

    x = fc([pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)])
    h'_p = norm(layer(x))            logits = lm_head(h'_p)   -> t_{p+2}

sharing the model's embedding and lm_head. Chained, h'_p stands in for h_{p+1} with the
drafted token. The layer keeps its own KV cache (one more attention layer in the pool, layer
id `num_hidden_layers`). `save_pretrained` of transformers drops these weights; the release
checkpoints carry them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deltaserve.models.checkpoints.loader import MTP_PREFIXES as PREFIXES
from deltaserve.models.checkpoints.loader import num_mtp_layers
from deltaserve.models.checkpoints.weights import WeightLoader
from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.common import Linear, ZeroCenteredRMSNorm, collect_narrows
from deltaserve.models.parallel import SINGLE, Narrow, ShardSpec, TensorParallel
from deltaserve.models.qwen3_next import DecoderLayer


class MultiTokenPredictor(nn.Module):
    """Tensor-parallel: the layer is sharded as the model's are; fc and the norms replicated."""

    def __init__(self, config: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if num_mtp_layers(config) != 1:
            raise ValueError(f"only one MTP layer is supported, the config has {num_mtp_layers(config)}")
        hidden = config.hidden_size
        self.layer_id = int(config.num_hidden_layers)  # its KV cache's layer id
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(config, self.layer_id, "full_attention", tp)])
        self.norm = ZeroCenteredRMSNorm(hidden, eps=config.rms_norm_eps)
        self._narrows: dict[str, ShardSpec] | None = None

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1)
        h, residual = self.layers[0](self.fc(x), positions, ctx, None)
        return self.norm.forward_add(h, residual)[0]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = WeightLoader(self)
        for name, tensor in weights:
            prefix = next((p for p in PREFIXES if name.startswith(p)), None)
            if prefix is None:
                continue
            name = name[len(prefix) :]
            if not loader.load_expert(name, tensor):
                loader.copy(name, tensor)
        if not loader.loaded:
            raise ValueError("the checkpoint has no mtp.* weights: MTP speculation needs them")
        loader.finish()

    def checkpoint_narrow(self, name: str, shape: tuple[int, ...]) -> Narrow | None:
        """This rank's part of the checkpoint tensor `name` (None: all of it, or not ours)."""
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            return None
        if self._narrows is None:
            self._narrows = collect_narrows(self)
        spec = self._narrows.get(name[len(prefix) :])
        return spec(shape) if callable(spec) else spec


def load_mtp(
    path: str,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    dummy: bool,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    structure_device: torch.device | None = None,
) -> MultiTokenPredictor:
    from deltaserve.models.checkpoints.loader import build_and_load

    make = lambda: MultiTokenPredictor(config, tp)  # noqa: E731
    load_format = "dummy" if dummy else "auto"
    return build_and_load(
        path, make, dtype, device, load_format, 0, quantization, tp, structure_device=structure_device
    )
