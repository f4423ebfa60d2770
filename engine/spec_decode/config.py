"""`speculative_config`: which drafter proposes tokens and how many per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "mtp")
# vLLM's names for a checkpoint's own MTP layer, as Qwen's model cards give them
METHOD_ALIASES = {"qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp"}


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4  # ngram: longest suffix looked up in the prompt and output
    prompt_lookup_min: int = 1  # ngram: shortest suffix worth a proposal
    # Most requests verified in one step: bounds the window buffers (k + 1 states per
    # request and linear layer); past it, requests decode one token as usual.
    max_batch: int | None = None
    # Every decoding request verifies exactly k drafts (short or missing drafts are padded,
    # which rejection sampling keeps lossless), so that verification steps can replay CUDA
    # graphs captured per batch size instead of running eagerly.
    cuda_graph: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpecConfig:
        known = {
            "method",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "max_batch",
            "cuda_graph",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        # before any comparison: 2.5 or True would pass it (2.5 then failed the model's load), "3"
        # fail it with a message that names no key
        if not isinstance(raw["method"], str):
            raise ValueError(f"speculative_config's method must be a string, got {raw['method']!r}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "max_batch"):
            value = raw.get(key)
            if key not in raw or (key == "max_batch" and value is None):  # its default (max_batch: none)
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"speculative_config's {key} must be an integer, got {value!r}")
        if not isinstance(raw.get("cuda_graph", False), bool):
            raise ValueError(
                f"speculative_config's cuda_graph must be true or false, got {raw['cuda_graph']!r}"
            )
        cfg = cls(**{**raw, "method": METHOD_ALIASES.get(raw["method"], raw["method"])})
        if cfg.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {cfg.method!r}")
        if cfg.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if cfg.max_batch is not None and cfg.max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        return cfg
