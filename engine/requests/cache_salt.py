"""A request's `cache_salt` as a number, alike in every process: the radix tree's first key id
(`request.salted_id`) and the data-parallel router's prefix hashes (`server/engine_router.py`)
both start from it. Torch-free, as the router's process loads no model."""

from __future__ import annotations

import functools
import hashlib


@functools.lru_cache(maxsize=1024)
def salt_digest(salt: str, bits: int = 128) -> int:
    """The first `bits` (a multiple of 8) bits of the salt's SHA-256 as an int; not `hash()`, whose
    value for a str differs between processes."""
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[: bits // 8], "big")
