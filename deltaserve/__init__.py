"""deltaserve: an OpenAI-compatible server for hybrid linear-attention LLMs."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _ShadowedTopLevel(importlib.abc.MetaPathFinder):
    """A checkout's top-level folders (`kernels/` is `deltaserve.kernels`) shadow installed packages
    of the same name, such as Hugging Face's `kernels` that transformers imports, wherever the
    checkout's root is on sys.path (`python -m` run from it): such names resolve past the root
    first, and to the folder only where nothing else has them."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if path is not None or not os.path.isfile(os.path.join(_ROOT, name, "__init__.py")):
            return None
        elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
        return importlib.machinery.PathFinder.find_spec(name, elsewhere)


# a checkout (an editable install); an installed copy's folders sit beside the packages they would shadow
if os.path.isfile(os.path.join(_ROOT, "pyproject.toml")) and not any(
    isinstance(f, _ShadowedTopLevel) for f in sys.meta_path
):
    sys.meta_path.insert(0, _ShadowedTopLevel())

if TYPE_CHECKING:
    from deltaserve.engine.llm import LLM, TextPrompt, TokensPrompt
    from deltaserve.engine.requests.beam_search import BeamSearchParams
    from deltaserve.engine.requests.outputs import CompletionOutput, RequestOutput
    from deltaserve.engine.requests.sampling_params import (
        GuidedDecodingParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )

__all__ = [
    "LLM",
    "BeamSearchParams",
    "CompletionOutput",
    "GuidedDecodingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]

# the module of each lazily imported name: vLLM's top-level names, and those vLLM scripts import
# from vllm.sampling_params (StructuredOutputsParams, its older GuidedDecodingParams, BeamSearchParams,
# RequestOutputKind)
_LAZY = {
    "LLM": "deltaserve.engine.llm",
    "TextPrompt": "deltaserve.engine.llm",
    "TokensPrompt": "deltaserve.engine.llm",
    "SamplingParams": "deltaserve.engine.requests.sampling_params",
    "StructuredOutputsParams": "deltaserve.engine.requests.sampling_params",
    "RequestOutputKind": "deltaserve.engine.requests.sampling_params",
    "GuidedDecodingParams": "deltaserve.engine.requests.sampling_params",
    "BeamSearchParams": "deltaserve.engine.requests.beam_search",
    "RequestOutput": "deltaserve.engine.requests.outputs",
    "CompletionOutput": "deltaserve.engine.requests.outputs",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that `import deltaserve` (and the CLI's --help) stays cheap.
    if name not in _LAZY:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
