"""The garbage collector in a long-running serving process.

Start-up leaves millions of long-lived objects (torch, transformers, the model's modules, the
tokenizer), and each of Python's full collections walks all of them: a pause of hundreds of
milliseconds in which the step loop or the HTTP event loop stands still. Both processes move
what start-up made into the permanent generation once it is done, as vLLM's engine core does;
collections then walk only what serving allocates.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap(process: str) -> None:
    """Collect what start-up left for the collector, then freeze the rest out of its walks."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.info(
        "%s: %d start-up objects frozen out of garbage collection (%.0f ms)",
        process,
        gc.get_freeze_count(),
        1e3 * (time.perf_counter() - t0),
    )
