"""What rank 0 sends the workers each step, and the log of device-state writes that goes with it.

Everything rank 0 writes into device state outside a forward (a prefix-cache snapshot copied
to or from a slot, the decode page table's rows, a speculative window's commit) is recorded in
an `OpLog` as (target, method, args) by the object that writes it. The log travels with the next
forward's batch, so that a worker applies the same writes in the same order before it runs the
same forward. The batch travels as `build_forward_batch`'s host arguments and is rebuilt there;
input ids that only exist on rank 0's device (overlap scheduling: the previous step's sampled
tokens) follow as a tensor broadcast over the tensor group.

The messages travel over a gloo group even where the tensors travel over NCCL (`group.py`), so
that a peer that dies closes its TCP connection and the next message fails at once. An idle rank
0 sends a heartbeat ("beat", which workers ignore) every `HEARTBEAT_S`, so that a rank that dies
while nothing runs (on another node, where no local thread watches it) ends the engine within
seconds rather than at the next request. Workers learn that rank 0 went silent from the rendezvous
store instead (`liveness.py`): an idle offline `LLM` sends them nothing at all.
"""

from __future__ import annotations

import datetime
import math
import pickle
import re
import time
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
    # "stage" (new weights: load them, report), then "commit" or "discard"; "beat" (nothing: an
    # idle rank 0's heartbeat); "stop"
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
BEAT = StepMessage("beat")
HEARTBEAT_S = 1.0  # the longest an idle rank 0 leaves the workers without a message
# a live worker takes a heartbeat at once (it waits for the next message); one that has not in
# this long is hung, or its node unreachable (gloo waits until the receiver reads)
HEARTBEAT_TIMEOUT_S = 30.0


def gloo_words(exc: BaseException) -> str:
    """A collective's error as gloo words it (a peer that died closed its connection), less its
    source line and advice."""
    return re.sub(r"^\[[^\]]*\] ", "", str(exc)).split(". This is typically")[0]


def peer_closed(exc: RuntimeError) -> bool:
    """Whether a collective failed because a peer's connection closed (its process ended)."""
    return re.search(r"Connection (closed|reset) by peer", str(exc)) is not None


class StepChannel:
    """Rank 0's broadcasts to every worker (and their receipt there): each message pickled, its
    length, then its bytes (as torch's broadcast_object_list sends them, which cannot bound its
    wait)."""

    def __init__(self, groups: RankGroups) -> None:
        self.groups = groups
        self.last_sent = time.monotonic()

    def send(self, message: StepMessage, timeout_s: float | None = None) -> None:
        """EngineDeadError when a rank is gone, or (`timeout_s`) does not take the message in time."""
        import torch.distributed as dist

        self.last_sent = start = time.monotonic()
        data = torch.frombuffer(bytearray(pickle.dumps(message, pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        try:
            for t in (torch.tensor([data.numel()], dtype=torch.long), data):
                work = dist.broadcast(t, src=0, group=self.groups.cpu_group, async_op=True)
                if timeout_s is None:
                    work.wait()
                else:
                    left = max(0.0, timeout_s - (time.monotonic() - start))
                    # whole milliseconds, rounded up: it ends past the deadline, which tells it
                    work.wait(timeout=datetime.timedelta(milliseconds=math.ceil(left * 1000)))
        except RuntimeError as exc:
            if timeout_s is not None and time.monotonic() - start >= timeout_s:
                raise EngineDeadError(
                    f"a tensor-parallel rank did not take rank 0's heartbeat in {timeout_s:g} s "
                    "(hung, or its node unreachable)"
                ) from exc
            raise EngineDeadError(f"a tensor-parallel worker is gone ({gloo_words(exc)})") from exc

    def beat(self) -> None:
        """Rank 0, idle: a heartbeat, which workers ignore, once `HEARTBEAT_S` has passed since
        the last message, so that a rank that died while nothing ran ends the engine now rather
        than at the next step. EngineDeadError when one is gone or does not take it in
        `HEARTBEAT_TIMEOUT_S`."""
        if time.monotonic() - self.last_sent >= HEARTBEAT_S:
            self.send(BEAT, HEARTBEAT_TIMEOUT_S)

    def recv(self) -> StepMessage:
        import torch.distributed as dist

        size = torch.empty(1, dtype=torch.long)
        dist.broadcast(size, src=0, group=self.groups.cpu_group)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.groups.cpu_group)
        message: StepMessage = pickle.loads(data.numpy().tobytes())
        return message

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
