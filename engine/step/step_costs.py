"""What holding new prompts back costs and saves, measured as the engine runs.

A decode-only step replays a CUDA graph; a step with prefill chunks runs eagerly. Its time beyond
a decode step's is a fixed part (launches, on a small model several decode steps of host time)
plus a part per prefill token (the GPU's work, paid however the prompts are grouped). Prompts
prefilled together pay the fixed part once, so the adaptive prefill delay
(`EngineConfig.adaptive_prefill_delay`) holds arrivals while one more step's wait costs less than
it is expected to save: held requests make no progress, a fraction held / decoding of a decode
step, against the arrivals one more step brings (rate x step) each saving the fixed part of a
step of their own. Where the GPU sets the pace the fixed part is about nothing, and nothing waits.
"""

from __future__ import annotations

import math

WEIGHT = 0.1  # of each new window in the moving averages
WINDOW_STEPS = 16  # steps summed into one observation
LONGEST_S = 1.0  # an interval longer than this spans idle time or a stall: not a step's cost
MIN_RELATIVE_DET = 1e-3  # below this the windows cannot tell the fixed part from the per-token part
RATE_WINDOW_S = 1.0  # the arrival rate's time constant


class MixedStepCost:
    """A step's time as decode_s, plus fixed_s for a step with prefill chunks, plus per_token_s
    for each prefill token: least squares over windows of WINDOW_STEPS steps' summed time (with
    overlap scheduling an interval between two plans shows the host's work for one step and the
    GPU's for the one before, which only sums over several steps make whole), weighted toward
    recent windows."""

    def __init__(self) -> None:
        self.decode_s: float | None = None  # None, and fixed_s 0, until windows of different
        self.fixed_s = 0.0  # mixes told the parts apart
        self.per_token_s = 0.0
        self._window = [0, 0, 0, 0.0]  # steps, mixed steps, prefill tokens, seconds
        self._xx: list[list[float]] | None = None  # the normal equations, moving averages
        self._xy: list[float] = [0.0, 0.0, 0.0]

    def record(self, mixed: bool, seconds: float, tokens: int = 0) -> None:
        """A step that took `seconds` (from its plan to the next); `tokens`: its prefill tokens."""
        w = self._window
        if not 0.0 < seconds <= LONGEST_S:
            self._window = [0, 0, 0, 0.0]  # idle time or a stall: this window says nothing
            return
        w[0] += 1
        w[1] += int(mixed)
        w[2] += tokens
        w[3] += seconds
        if w[0] == WINDOW_STEPS:
            self._observe([float(w[0]), float(w[1]), w[2] / 1000.0], w[3])
            self._window = [0, 0, 0, 0.0]

    def _observe(self, x: list[float], y: float) -> None:
        xx = [[a * b for b in x] for a in x]
        xy = [a * y for a in x]
        if self._xx is None:
            self._xx, self._xy = xx, xy
        else:
            self._xx = [[o + WEIGHT * (n - o) for o, n in zip(ro, rn)] for ro, rn in zip(self._xx, xx)]
            self._xy = [o + WEIGHT * (n - o) for o, n in zip(self._xy, xy)]
        solved = _solve3(self._xx, self._xy)
        if solved is not None:
            decode, fixed, per_k = solved
            self.decode_s = max(0.0, decode)
            self.fixed_s = max(0.0, fixed)
            self.per_token_s = max(0.0, per_k / 1000.0)


class ArrivalRate:
    """New requests per second: a count that decays with time constant `RATE_WINDOW_S`."""

    def __init__(self) -> None:
        self._count = 0.0
        self._last = 0.0

    def add(self, now: float) -> None:
        self._count = self._count * math.exp(-(now - self._last) / RATE_WINDOW_S) + 1.0
        self._last = now

    def rate(self, now: float) -> float:
        return self._count * math.exp(-max(0.0, now - self._last) / RATE_WINDOW_S) / RATE_WINDOW_S


def worth_holding(num_held: int, num_decoding: int, rate: float, fixed_s: float) -> bool:
    """Whether `num_held` prompts should sit out one more step beside `num_decoding` decodes:
    the step idles held / decoding of the batch, and the arrivals it brings (rate x step) would
    each save `fixed_s` (both sides in units of the step, which cancels)."""
    return num_held < num_decoding * rate * fixed_s


def _solve3(a: list[list[float]], b: list[float]) -> list[float] | None:
    """x with a x = b (Cramer's rule), or None when a is near singular (the columns too alike)."""

    def det(m: list[list[float]]) -> float:
        return (
            m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
            - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0])
        )

    d = det(a)
    if abs(d) <= MIN_RELATIVE_DET * a[0][0] * a[1][1] * a[2][2]:
        return None
    out = []
    for col in range(3):
        m = [row[:col] + [b[i]] + row[col + 1 :] for i, row in enumerate(a)]
        out.append(det(m) / d)
    return out
