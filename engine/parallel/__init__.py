"""Tensor parallelism in the engine: one process per rank over torch.distributed.

Rank 0 is the engine as on one device (scheduler, prefix cache, sampling); every other rank is
a worker (`worker.py`) that owns a ModelRunner over its shard and replays, in order, what rank 0
broadcasts (`step_sync.py`): the device-state writes rank 0 made since its last forward, then
the forward itself. `group.py` joins the ranks, `launcher.py` starts and watches the local
worker processes.
"""
