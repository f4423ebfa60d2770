"""Prompt-lookup (n-gram) drafting: find the sequence's last n tokens earlier in the prompt or
output, and propose what followed them there.

Longest n first (a longer match predicts better); among matches of one length the most recent
one that is followed by k tokens (it follows the current repetition rather than an old one),
else the earliest (the most tokens to propose).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `tokens` (none when no suffix recurs)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            suffix = seq[-n:]
            # windows that start before the suffix and are followed by at least one token
            hits = np.flatnonzero((sliding_window_view(seq[:-1], n) == suffix).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= len(seq)]
                start = int(full[-1] if full.size else hits[0]) + n
                return seq[start : start + k].tolist()
        return []
