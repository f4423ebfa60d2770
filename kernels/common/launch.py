"""Device facts that the Triton launchers size their grids by, and whether they launch with PDL."""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

PDL_MODES = ("off", "auto", "on")
# "auto": PDL in the decode graphs of at most this many tokens. Small graphs are chains of short
# kernels whose launch gaps PDL hides; at large grids the next kernel's waiting programs take SM
# slots from the running one, a loss (docs/performance.md, "Environment switches").
PDL_AUTO_MAX_TOKENS = 32
_graph_tokens: ContextVar[int | None] = ContextVar("deltaserve_pdl_graph_tokens", default=None)


@functools.cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of `device`; the H200's 132 off CUDA (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def rounding_dtype(dtype: torch.dtype) -> Any:
    """The Triton dtype a kernel rounds to for a model of `dtype` (its `ROUND` constexpr): bf16 or
    fp16, else fp32 (no rounding)."""
    import triton.language as tl

    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}.get(dtype, tl.float32)


def env_mode(variable: str, modes: tuple[str, ...], default: str) -> str:
    """A kernel switch's value from the environment: one of `modes`, `default` when unset or
    empty; another value is an error (a typo fails at start-up, not as a silent default)."""
    mode = os.environ.get(variable, "") or default
    if mode not in modes:
        raise ValueError(f"{variable} must be one of {', '.join(modes)}, got {mode!r}")
    return mode


def pdl_mode() -> str:
    return env_mode("DELTASERVE_PDL", PDL_MODES, "auto")


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@contextmanager
def capturing_graph(tokens: int) -> Iterator[None]:
    """Kernels launched inside (a decode graph's warm-up and capture) belong to a graph of
    `tokens` tokens: with `DELTASERVE_PDL=auto` they use PDL when that is small."""
    token = _graph_tokens.set(tokens)
    try:
        yield
    finally:
        _graph_tokens.reset(token)


def pdl_enabled(device: torch.device) -> bool:
    """Our Triton kernels launch with programmatic dependent launch (`kernels/common/pdl.py`),
    on CUDA devices of compute capability 9.0 and later: with `DELTASERVE_PDL=on` always, with
    `auto` (the default) in decode graphs of at most PDL_AUTO_MAX_TOKENS tokens, with `off`
    never."""
    mode = pdl_mode()
    if mode == "off" or not _pdl_capable(device):
        return False
    if mode == "on":
        return True
    tokens = _graph_tokens.get()
    return tokens is not None and tokens <= PDL_AUTO_MAX_TOKENS
