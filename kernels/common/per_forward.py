"""What the layers of one forward derive from the same input, built once and kept by its owner."""

from __future__ import annotations

from collections.abc import Callable

import torch


class PerForwardCache:
    """`build()` results kept under a name while their source tensor is unchanged.

    Every layer of a forward passes the same `cu_seqlens`, so what derives from it (FLA's int64
    copy, conv's token-to-sequence index) is built by the first layer only. The caller owns the
    cache (the engine's linear-attention backend keeps one), so two engines in a process share
    nothing; an op given none builds afresh on every call.
    """

    def __init__(self) -> None:
        self._kept: dict[str, tuple[torch.Tensor, int, object, torch.Tensor]] = {}

    def get(
        self, name: str, source: torch.Tensor, extra: object, build: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """`build()`, kept under `name` while `source` is the same object with the same version
        and `extra` is equal. A refilled input (its version counter moves) builds anew. Inference
        tensors (the engine runs under inference_mode) keep no version counter; the engine builds
        a new cu_seqlens tensor for every forward, so identity is enough there."""
        version = -1 if source.is_inference() else source._version
        kept = self._kept.get(name)
        if kept is None or kept[0] is not source or kept[1] != version or kept[2] != extra:
            kept = self._kept[name] = (source, version, extra, build())
        return kept[3]


def per_input(
    cache: PerForwardCache | None,
    name: str,
    source: torch.Tensor,
    extra: object,
    build: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """`cache.get(...)`, or `build()` where the caller keeps no cache."""
    return build() if cache is None else cache.get(name, source, extra, build)
