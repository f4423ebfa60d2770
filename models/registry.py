"""Maps a checkpoint's `architectures[0]` to the class that serves it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.models.layers.common import HybridCausalLM

# a model class: (text config, tensor parallelism = one rank) -> the model
ModelClass = Callable[..., "HybridCausalLM"]

# architecture -> (module, class, whether the text config is nested under `text_config`)
_MODELS: dict[str, tuple[str, str, bool]] = {
    "Qwen3NextForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM", False),
    "Qwen3_5ForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM", False),
    "Qwen3_5ForConditionalGeneration": ("qwen3_next", "Qwen3NextForCausalLM", True),
    "Qwen3_5MoeForCausalLM": ("qwen3_next", "Qwen3NextForCausalLM", False),
    "Qwen3_5MoeForConditionalGeneration": ("qwen3_next", "Qwen3NextForCausalLM", True),
    "KimiLinearForCausalLM": ("kimi_linear", "KimiLinearForCausalLM", False),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve(architecture: str) -> tuple[ModelClass, bool]:
    """(model class, config nested under text_config) for an architecture name."""
    if architecture not in _MODELS:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, cls, nested = _MODELS[architecture]
    return getattr(importlib.import_module(f"deltaserve.models.{module}"), cls), nested


def text_config(config: Any, nested: bool) -> Any:
    return config.text_config if nested else getattr(config, "text_config", None) or config
