"""Tensor parallelism as the models see it: which rank of how many, and the process group
whose collectives join the shards (torch.distributed; NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None when size == 1

    @property
    def enabled(self) -> bool:
        return self.size > 1


SINGLE = TensorParallel()
