"""Owns the model, the pools and the two backends; runs one batch and samples."""

from __future__ import annotations

import logging

import torch

from deltaserve.engine.attention_backend import AttentionBackend
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.forward_batch import ForwardBatch
from deltaserve.engine.forward_context import ForwardContext
from deltaserve.engine.kv_pool import KVPool
from deltaserve.engine.linear_backend import LinearAttentionBackend
from deltaserve.engine.memory import plan_pools
from deltaserve.engine.state_pool import StatePool
from deltaserve.models.loader import LoadedModel

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
        self.config = config
        self.loaded = loaded
        self.model = loaded.model
        self.device = device
        types = self.model.layer_types
        attn_layers = [i for i, t in enumerate(types) if t != "linear_attention"]
        linear_layers = [i for i, t in enumerate(types) if t == "linear_attention"]
        kv_shapes = self.model.kv_shapes()
        state_shapes = self.model.state_shapes()
        dtype = config.torch_dtype
        state_dtypes = {
            name: (config.torch_state_dtype if name == "recurrent" else dtype) for name in state_shapes
        }
        per_token = sum(int(torch.Size(s).numel()) for s in kv_shapes.values()) * dtype.itemsize
        bytes_per_page = per_token * len(attn_layers) * config.page_size
        bytes_per_slot = len(linear_layers) * sum(
            int(torch.Size(s).numel()) * state_dtypes[n].itemsize for n, s in state_shapes.items()
        )
        max_pos = int(getattr(loaded.config, "max_position_embeddings", 32768))
        self.sizes = plan_pools(config, bytes_per_page, bytes_per_slot, max_pos, device)
        self.kv_pool = KVPool(
            len(attn_layers), self.sizes.num_pages, config.page_size, kv_shapes, dtype, device
        )
        self.state_pool = StatePool(
            len(linear_layers),
            self.sizes.num_slots,
            self.sizes.num_snapshots,
            state_shapes,
            state_dtypes,
            device,
        )
        self.attn = AttentionBackend(self.kv_pool, {layer: i for i, layer in enumerate(attn_layers)})
        self.linear = LinearAttentionBackend(
            self.state_pool, {layer: i for i, layer in enumerate(linear_layers)}
        )
        self.ctx = ForwardContext(self.attn, self.linear)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[M, vocab]` (fp32) at the batch's sampled positions."""
        self.attn.prepare(batch)
        self.linear.prepare(batch)
        hidden = self.model(batch.input_ids, batch.positions, self.ctx)
        return self.model.compute_logits(hidden[batch.logits_indices]).float()
