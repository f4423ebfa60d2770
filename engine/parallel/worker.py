"""A tensor-parallel worker: one rank other than 0, with no scheduler, cache or sampler.

It loads its shard, builds a ModelRunner (pools the size rank 0 agreed, CUDA graphs of the same
sizes) and then replays what rank 0 broadcasts until told to stop; it exits when rank 0's
process goes (its connection closes), when rank 0 stops answering on the rendezvous store
(stopped or hung, or its node unreachable: `liveness.py`) or, on rank 0's node, when its parent
does.

Run as `python -m deltaserve.engine.parallel.worker` with a pickled `WorkerArgs` on stdin
(`launcher.py` does).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass

import torch

from deltaserve.engine.config import EngineConfig

logger = logging.getLogger("deltaserve.worker")


@dataclass
class WorkerArgs:
    config: EngineConfig
    rank: int
    master_port: int
    parent_pid: int
    log_level: int


class LoadError(Exception):
    """A rank could not load its shard: one line, as rank 0 reports a model that fails to load
    (the traceback at debug level)."""


class JoinError(Exception):
    """A rank could not join the others (rank 0 unreachable, a rank missing): one line."""


class PeerGone(Exception):
    """Rank 0's connection (or, in a step, another rank's) closed: its process ended. One line."""


def run_worker(config: EngineConfig, rank: int, master_port: int) -> None:
    from deltaserve.engine.gc_heap import freeze_startup_heap
    from deltaserve.engine.parallel.group import destroy, init_rank, rank_device
    from deltaserve.engine.parallel.liveness import RankZeroWatch
    from deltaserve.engine.parallel.step_sync import gloo_words, peer_closed
    from deltaserve.engine.parts import load_engine_model
    from deltaserve.engine.runner.model_runner import ModelRunner

    device = rank_device(config, rank)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # the node's ranks share its cores: threads that busy-wait on every core slow all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.ranks_per_node))
    try:
        groups = init_rank(config, rank, master_port, device)
    except RuntimeError as exc:  # the rendezvous failed: its error says why, in one line
        raise JoinError(str(exc)) from exc
    watch = RankZeroWatch(config.master_addr, master_port, rank, lambda why: _exit_lost(rank, why))
    try:
        try:
            loaded = load_engine_model(config, device, groups.tp)
            runner = ModelRunner(config, loaded, device, groups)
        except Exception as exc:
            raise LoadError(f"{type(exc).__name__}: {exc}") from exc
        assert runner.channel is not None
        freeze_startup_heap(f"tensor-parallel rank {rank}")
        logger.info("tensor-parallel rank %d ready", rank)
        while True:
            try:
                message = runner.channel.recv()
            except RuntimeError as exc:  # nothing but rank 0 sends here
                raise PeerGone(f"rank 0 is gone ({gloo_words(exc)})") from exc
            if message.kind == "stop":
                break
            try:
                runner.run_message(message)
            except RuntimeError as exc:
                if not peer_closed(exc):
                    raise
                raise PeerGone(f"a rank is gone in the middle of a step ({gloo_words(exc)})") from exc
    finally:
        watch.stop()
        destroy(groups)


def _exit_lost(rank: int, why: str) -> None:
    """Rank 0 no longer answers: this rank's main thread may wait on it inside gloo for ever."""
    logger.error("tensor-parallel rank %d is exiting: %s", rank, why)
    logging.shutdown()
    os._exit(1)


def _exit_with(parent_pid: int) -> None:
    """End this process once its parent is gone (killed, not only stopped)."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=run, name="deltaserve-parent-watch", daemon=True).start()


def main() -> None:
    args: WorkerArgs = pickle.load(sys.stdin.buffer)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s [rank {args.rank}]: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: rank 0 stops us
    _exit_with(args.parent_pid)
    try:
        run_worker(args.config, args.rank, args.master_port)
    except JoinError as exc:
        logger.error("%s", exc)
        logger.debug("where it failed", exc_info=exc.__cause__)
        sys.exit(1)
    except PeerGone as exc:
        logger.error("tensor-parallel rank %d is exiting: %s", args.rank, exc)
        logger.debug("where it failed", exc_info=exc.__cause__)
        sys.exit(1)
    except LoadError as exc:
        logger.error("tensor-parallel rank %d could not load the model: %s", args.rank, exc)
        logger.debug("where it failed", exc_info=exc.__cause__)
        sys.exit(1)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", args.rank)
        sys.exit(1)


if __name__ == "__main__":
    main()
