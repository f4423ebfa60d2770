"""What rank 0 sends the workers each step, and the log of device-state writes that goes with it.

Everything rank 0 writes into device state outside a forward (a prefix-cache snapshot copied
to or from a slot, the decode page table's rows, a speculative window's commit) is recorded in
an `OpLog` as (target, method, args) by the object that writes it. The log travels with the next
forward's batch, so that a worker applies the same writes in the same order before it runs the
same forward. The batch travels as `build_forward_batch`'s host arguments and is rebuilt there;
input ids that only exist on rank 0's device (overlap scheduling: the previous step's sampled
tokens) follow as a tensor broadcast over the tensor group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.parallel.group import RankGroups
from deltaserve.models.forward import ImageEmbeds

Op = tuple[str, str, tuple[Any, ...]]


class OpLog:
    """Device-state writes made since the last forward, in order."""

    def __init__(self) -> None:
        self._ops: list[Op] = []

    def record(self, target: str, method: str, *args: Any) -> None:
        self._ops.append((target, method, args))

    def take(self) -> list[Op]:
        ops, self._ops = self._ops, []
        return ops


@dataclass
class StepMessage:
    # "step": apply ops, then run the batch; "mtp": the same through the MTP layer; "digest";
    # "stage" (new weights: load them, report), then "commit" or "discard"; "stop"
    kind: str
    ops: list[Op] = field(default_factory=list)
    batch: dict[str, Any] | None = None  # build_forward_batch's arguments, less the device
    inputs_on_device: bool = False  # input ids follow by tensor broadcast
    # image tokens' rows and embeddings follow by tensor broadcast: (their count, width, dtype)
    images: tuple[int, int, torch.dtype] | None = None
    # an MTP forward's feed (ModelRunner.mtp_forward's base, rows and logits rows)
    mtp: tuple[str, list[int], list[int] | None] | None = None
    reload: tuple[str, str] | None = None  # "stage": the checkpoint's path and load format


STOP = StepMessage("stop")


class StepChannel:
    """Rank 0's broadcasts to every worker (and their receipt there)."""

    def __init__(self, groups: RankGroups) -> None:
        self.groups = groups

    def send(self, message: StepMessage) -> None:
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([message], src=0, group=self.groups.cpu_group)
        except RuntimeError as exc:  # a peer that died closed its connection
            raise EngineDeadError(f"a tensor-parallel worker is gone ({exc})") from exc

    def recv(self) -> StepMessage:
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.groups.cpu_group)
        return box[0]

    def broadcast_inputs(self, input_ids: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(input_ids, src=0, group=self.groups.tp.group)

    def broadcast_images(self, images: ImageEmbeds) -> None:
        """Rank 0's image rows and the vision tower's embeddings for them (the tower runs there)."""
        import torch.distributed as dist

        for t in images:
            dist.broadcast(t.contiguous(), src=0, group=self.groups.tp.group)

    def recv_images(self, shape: tuple[int, int, torch.dtype], device: torch.device) -> ImageEmbeds:
        """A worker's copy of rank 0's `broadcast_images`."""
        import torch.distributed as dist

        count, width, dtype = shape
        rows = torch.empty(count, dtype=torch.int64, device=device)
        values = torch.empty(count, width, dtype=dtype, device=device)
        for t in (rows, values):
            dist.broadcast(t, src=0, group=self.groups.tp.group)
        return rows, values

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.groups.tp.size if self.groups.is_leader else None
        dist.gather_object(obj, out, dst=0, group=self.groups.cpu_group)
        return out
