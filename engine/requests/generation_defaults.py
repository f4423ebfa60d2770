"""Sampling defaults from the checkpoint's generation_config.json.

A request that leaves temperature, top_p, top_k, min_p or repetition_penalty unset gets the
model authors' value (the server's requests, and `LLM.generate` without sampling parameters),
as vLLM and SGLang do (Qwen3.5 ships temperature 0.6, top_p
0.95, top_k 20); a value the request sets always wins. `max_new_tokens` becomes the completion
length of requests that set no max_tokens. `--generation-config none` keeps OpenAI's defaults
(temperature 1, no top-p / top-k / min-p / repetition penalty) and no completion cap.

The same file names the model's EOS tokens (`eos_token_ids_of`), beside config.json and the
tokenizer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.engine.requests.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # None: up to the context
    # the file's fields left out for a value of the wrong type, each as "name = value (why)"
    ignored: tuple[str, ...] = field(default=(), compare=False)

    def sampling_params(self) -> SamplingParams:
        """As engine parameters (max_tokens: SamplingParams' 16 when the file sets none)."""
        from deltaserve.engine.requests.sampling_params import SamplingParams

        kwargs: dict[str, Any] = {name: getattr(self, name) for name in _SAMPLED if name != "max_tokens"}
        if self.max_tokens:
            kwargs["max_tokens"] = self.max_tokens
        return SamplingParams(**kwargs)

    def changed(self) -> dict[str, Any]:
        """The defaults that differ from OpenAI's (what the start-up log reports)."""
        base = SamplingDefaults()
        return {name: getattr(self, name) for name in _SAMPLED if getattr(self, name) != getattr(base, name)}

    def warning(self) -> str | None:
        """What the start-up log warns of: the fields left out, or None."""
        if not self.ignored:
            return None
        return (
            f"generation_config.json: ignoring {'; '.join(self.ignored)}: requests that leave "
            "these unset get the usual defaults"
        )


_SAMPLED = tuple(f.name for f in fields(SamplingDefaults) if f.name != "ignored")


def _number(
    config: dict[str, Any], key: str, low: float, high: float, ignored: list[str], low_open: bool = False
) -> float | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        ignored.append(f"{key} = {json.dumps(value)} (not a number)")
        return None
    if not math.isfinite(value):
        ignored.append(f"{key} = {json.dumps(value)} (not finite)")
        return None
    if value < low or value > high or (low_open and value == low):
        raise ValueError(f"generation_config.json: {key} = {value} is outside [{low:g}, {high:g}]")
    return float(value)


def read_sampling_defaults(folder: str | Path) -> SamplingDefaults:
    """The defaults of `folder`'s generation_config.json (OpenAI's where the file or a key is
    missing); a present value out of range is an error, one of the wrong type (a string, a list)
    is left out and named in `ignored`."""
    path = Path(folder) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    found: dict[str, Any] = {}
    ignored: list[str] = []
    for key, low, high, low_open in (
        ("temperature", 0.0, 2.0, False),
        ("top_p", 0.0, 1.0, True),
        ("min_p", 0.0, 1.0, False),
        ("repetition_penalty", 0.0, math.inf, True),
    ):
        value = _number(config, key, low, high, ignored, low_open)
        if value is not None:
            found[key] = value
    top_k = config.get("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool):
        found["top_k"] = max(top_k, 0)  # transformers and vLLM: 0 / -1 mean off
    elif top_k is not None:
        ignored.append(f"top_k = {json.dumps(top_k)} (not an integer)")
    max_new = config.get("max_new_tokens")
    if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new > 0:
        found["max_tokens"] = max_new
    elif max_new is not None:
        ignored.append(f"max_new_tokens = {json.dumps(max_new)} (not a positive integer)")
    return SamplingDefaults(**found, ignored=tuple(ignored))


def load_sampling_defaults(source: str, model_dir: str | Path | None) -> SamplingDefaults:
    """`--generation-config`: "auto" reads the model's folder, "none" (or vLLM's "vllm") keeps
    OpenAI's defaults, anything else is a folder holding a generation_config.json."""
    if source in ("none", "vllm"):
        return SamplingDefaults()
    if source == "auto":
        return read_sampling_defaults(model_dir) if model_dir is not None else SamplingDefaults()
    if not (Path(source) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config: no generation_config.json in {source}")
    return read_sampling_defaults(source)


def eos_token_ids_of(path: str, config: Any, tokenizer: Any | None) -> list[int]:
    """Every EOS token id that generation_config.json, the model's config and the tokenizer name."""
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)

    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return sorted(set(ids))
