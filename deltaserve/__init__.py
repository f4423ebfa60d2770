"""deltaserve: an OpenAI-compatible server for hybrid linear-attention LLMs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from deltaserve.engine.llm import LLM
    from deltaserve.engine.requests.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import deltaserve` (and the CLI's --help) stays cheap.
    if name == "LLM":
        from deltaserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deltaserve.engine.requests.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
