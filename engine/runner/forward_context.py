"""What a model's layers see during one forward: the two backends, side by side."""

from __future__ import annotations

from dataclasses import dataclass

from deltaserve.engine.runner.attention_backend import AttentionBackend
from deltaserve.engine.runner.linear_backend import LinearAttentionBackend


@dataclass
class ForwardContext:
    attn: AttentionBackend
    linear: LinearAttentionBackend
