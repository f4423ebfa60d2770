"""Tensor parallelism as the models see it: which rank of how many, and the process group
whose collectives join the shards (torch.distributed; NCCL on GPUs, gloo on CPU).

Sharding follows vLLM and SGLang: column-parallel projections keep a rank's slice of the
output rows (each sub-matrix of a fused projection sliced on its own), row-parallel ones a
slice of the input columns and all-reduce their partial sums. `Narrow` says which part of a
checkpoint tensor a rank holds, so that the loader reads only that part from the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Narrow:
    """A rank's part of a checkpoint tensor: `pieces` `(start, length)` along `dim`, in order,
    concatenated, then zero-padded along `dim` to `pad_to` rows (a padded vocabulary shard).
    No pieces (`NOTHING`): the rank holds none of the tensor (another rank's expert), and the
    loader skips it without reading."""

    dim: int
    pieces: tuple[tuple[int, int], ...]
    pad_to: int | None = None

    @property
    def holds_nothing(self) -> bool:
        return not self.pieces

    def _index(self, ndim: int, start: int, length: int) -> tuple[slice, ...]:
        dim = self.dim % ndim
        return (slice(None),) * dim + (slice(start, start + length),)

    def _finish(self, parts: list[torch.Tensor], ndim: int) -> torch.Tensor:
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)
        if self.pad_to is not None and out.shape[self.dim] < self.pad_to:
            shape = list(out.shape)
            shape[self.dim % ndim] = self.pad_to - out.shape[self.dim]
            out = torch.cat([out, out.new_zeros(shape)], dim=self.dim)
        return out

    def apply(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [tensor[self._index(tensor.dim(), s, n)] for s, n in self.pieces]
        return self._finish(parts, tensor.dim())

    def read(self, lazy: Any) -> torch.Tensor:
        """The part from a safetensors slice (`safe_open(...).get_slice(name)`), reading only
        its bytes."""
        ndim = len(lazy.get_shape())
        return self._finish([lazy[self._index(ndim, s, n)] for s, n in self.pieces], ndim)


NOTHING = Narrow(0, ())

# what a module lists per checkpoint tensor: a fixed part, or one that depends on the tensor's
# stored shape (layouts that differ between releases)
ShardSpec = Narrow | Callable[[tuple[int, ...]], Narrow]


@dataclass(frozen=True)
class TensorParallel:
    """`expert_parallel`: the routed experts are split whole over the same ranks (EP size = TP
    size, as with vLLM's --enable-expert-parallel) instead of each rank holding every expert's
    slice of the intermediate width."""

    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None when size == 1
    expert_parallel: bool = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    @property
    def experts_whole(self) -> bool:
        """True when this rank holds whole experts: expert parallelism over more than one rank
        (at size 1 the flag changes nothing, as in vLLM)."""
        return self.expert_parallel and self.size > 1

    # -- shard sizes ----------------------------------------------------------------

    def split(self, total: int, what: str) -> int:
        """This rank's count of `total` heads (or rows) split evenly; `what` names them in the
        error when they do not divide."""
        if total % self.size:
            raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def kv_heads(self, total: int, what: str) -> tuple[int, int]:
        """(first KV head, count) of this rank: split when there are at least as many heads as
        ranks, else one head replicated over `size // total` consecutive ranks (as vLLM does)."""
        if total >= self.size:
            n = self.split(total, what)
            return self.rank * n, n
        if self.size % total:
            raise ValueError(
                f"{what} ({total}) is fewer than the tensor-parallel size {self.size} "
                "and does not divide it, so the heads cannot be replicated evenly"
            )
        return self.rank * total // self.size, 1

    def narrow(self, dim: int, *blocks: int) -> Narrow:
        """Each of `blocks` (consecutive sub-matrices along `dim`, such as q | k | v) split
        evenly, this rank's slice of each, concatenated."""
        pieces, offset = [], 0
        for b in blocks:
            n = b // self.size
            pieces.append((offset + self.rank * n, n))
            offset += b
        return Narrow(dim, tuple(pieces))

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """(first expert, count) of this rank: under expert parallelism a contiguous block of
        `num_experts / size` experts, otherwise all of them."""
        if not self.experts_whole:
            return 0, num_experts
        if num_experts % self.size:
            raise ValueError(
                f"the number of routed experts ({num_experts}) is not divisible by the "
                f"expert-parallel size {self.size} (the tensor-parallel size); "
                "serve it without --enable-expert-parallel"
            )
        n = num_experts // self.size
        return self.rank * n, n

    def vocab_range(self, vocab: int) -> tuple[int, int]:
        """(first token id, padded rows) of this rank's vocabulary shard: ceil(vocab / size)
        rows each, the last rank's tail padded."""
        rows = -(-vocab // self.size)
        return self.rank * rows, rows

    # -- collectives ------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (x itself at size 1)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x, concatenated along `dim` in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if x.is_cuda:  # one buffer, as NCCL (and CUDA graphs) like it
            out = x.new_empty((self.size, *x.shape))
            dist.all_gather_into_tensor(out, x, group=self.group)
            return torch.cat(out.unbind(0), dim=dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TensorParallel()
