"""The garbage collector in a long-running serving process.

Start-up leaves millions of long-lived objects (torch, transformers, the model's modules, the
tokenizer), and each of Python's full collections walks all of them: a pause of hundreds of
milliseconds in which the step loop or the HTTP event loop stands still. Both processes move
what start-up made into the permanent generation once it is done, as vLLM's engine core does;
collections then walk only what serving allocates.

What serving allocates is mostly short-lived and acyclic (outputs, chunks), but at hundreds of
requests in flight it is still a large live heap, and the default thresholds walk all of it in a
full collection every second or so. Higher thresholds keep cycles collected, only less often.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)

# gen0 at 20k allocations (the default is 700); a full collection after 10 x 100 of those
SERVING_GC_THRESHOLDS = (20_000, 10, 100)


def freeze_startup_heap(process: str) -> None:
    """Collect what start-up left for the collector, then freeze the rest out of its walks."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        process,
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - t0),
    )
