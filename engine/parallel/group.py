"""Joining the ranks: torch.distributed's TCP rendezvous at node 0, the tensor group (NCCL on
CUDA, gloo on CPU) that the model's collectives use, and a gloo group for the pickled step
messages (host objects travel over gloo even when tensors travel over NCCL, as in vLLM and
SGLang)."""

from __future__ import annotations

import datetime
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from deltaserve.engine.cache.pool_sizing import PoolSizes
from deltaserve.engine.config import EngineConfig
from deltaserve.models.parallel import TensorParallel

logger = logging.getLogger(__name__)

# collectives of a forward, and a worker's wait for the next step, which lasts as long as the
# server idles: a peer that dies closes its sockets and ends the wait at once anyway, and one
# that goes silent is found by `liveness.py`
_COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(frozen=True)
class RankGroups:
    tp: TensorParallel  # rank, size and the tensor group
    cpu_group: Any  # gloo: the step messages

    @property
    def is_leader(self) -> bool:
        return self.tp.rank == 0


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """A rank's device: on CUDA the GPU of its place on its node, counted from the cuda:N given
    (a data-parallel replica's first GPU; cuda:0 when none is)."""
    device = torch.device(config.device or "cpu")
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank % config.ranks_per_node)


_HINT = "start every node with the same --master-addr, --master-port, --nnodes and --tensor-parallel-size"


def open_store(config: EngineConfig, rank: int, master_port: int) -> Any:
    """The rendezvous's TCP store: rank 0 hosts it at master_addr:master_port (port 0: one the
    system picks, `store.port`, bound before any worker is told it), the others connect to it."""
    import torch.distributed as dist

    addr, limit = config.master_addr, config.distributed_timeout_s
    where = f"tensor-parallel rendezvous at {addr}:{master_port}"
    if rank != 0:
        # torch's client logs a C++ stack trace before it raises when nothing listens there: wait
        # here until rank 0's store does, and say so in one line if it never does
        why = _unreachable(addr, master_port, time.monotonic() + limit)
        if why is not None:
            raise RuntimeError(f"{where}: rank {rank} could not reach rank 0 in {limit:g} s ({why}); {_HINT}")
    try:
        return dist.TCPStore(
            addr,
            master_port,
            config.tensor_parallel_size,
            rank == 0,
            timeout=datetime.timedelta(seconds=limit),
            wait_for_workers=False,
        )
    except Exception as exc:
        if rank == 0:  # the store's host: binding fails at once, nothing was waited for
            raise RuntimeError(
                f"{where}: rank 0 could not listen on {addr}:{master_port} ({exc}); give a free "
                "--master-port (another server's ranks may hold this one; one node picks a free one "
                "when it is left out)"
            ) from None
        raise RuntimeError(
            f"{where}: rank {rank} could not reach rank 0 in {limit:g} s ({exc}); {_HINT}"
        ) from None


def init_rank(
    config: EngineConfig,
    rank: int,
    master_port: int,
    device: torch.device,
    check_workers: Callable[[], str | None] | None = None,
    store: Any = None,
) -> RankGroups:
    """Join the rendezvous as `rank` (through `store` when rank 0 opened it already) and build the
    two groups. A rank missing after `distributed_timeout_s` is an error that says who waited for
    whom; rank 0 also stops waiting as soon as `check_workers` names a local worker that exited."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel engine "
            "per process (shut the other down first)"
        )
    world = config.tensor_parallel_size
    limit = config.distributed_timeout_s
    where = f"tensor-parallel rendezvous at {config.master_addr}:{master_port}"
    if store is None:
        store = open_store(config, rank, master_port)
    if rank == 0:
        keys = [f"deltaserve/joined/{r}" for r in range(1, world)]
        deadline = time.monotonic() + limit
        while not store.check(keys):
            gone = check_workers() if check_workers is not None else None
            if gone is not None:
                raise RuntimeError(f"{where}: {gone} before joining")
            if time.monotonic() > deadline:
                joined = sum(store.check([k]) for k in keys)
                raise RuntimeError(
                    f"{where} timed out after {limit:g} s: {joined} of the other {world - 1} ranks "
                    f"joined; {_HINT}"
                )
            time.sleep(0.05)
    else:
        store.set(f"deltaserve/joined/{rank}", "1")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=_COLLECTIVE_TIMEOUT)
    cpu_group = dist.new_group(backend="gloo", timeout=_COLLECTIVE_TIMEOUT) if backend != "gloo" else None
    logger.info("tensor-parallel rank %d of %d joined (%s on %s)", rank, world, backend, device)
    tp = TensorParallel(rank, world, dist.group.WORLD, expert_parallel=config.enable_expert_parallel)
    return RankGroups(tp, cpu_group or dist.group.WORLD)


def _unreachable(addr: str, port: int, deadline: float) -> str | None:
    """None once something accepts connections at `addr:port` (before `deadline`), else why not."""
    while True:
        try:
            timeout = min(5.0, max(0.1, deadline - time.monotonic()))
            with socket.create_connection((addr, port), timeout=timeout):
                return None
        except OSError as exc:
            why = str(exc) or type(exc).__name__
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.2)


def destroy(groups: RankGroups | None) -> None:
    import torch.distributed as dist

    if groups is not None and dist.is_initialized():
        dist.destroy_process_group()


def agree_pool_sizes(sizes: PoolSizes, groups: RankGroups) -> PoolSizes:
    """Every rank's pools the same size: the smallest each rank's memory allows (the padding page
    and slot stay inside it), so that rank 0's slot and page numbers mean the same everywhere."""
    import torch.distributed as dist

    mine = torch.tensor(
        [sizes.num_pages, sizes.num_slots, sizes.num_snapshots, sizes.max_model_len], dtype=torch.long
    )
    dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=groups.cpu_group)
    pages, slots, snapshots, max_len = (int(x) for x in mine.tolist())
    return PoolSizes(pages, slots, snapshots, max_len)
