"""What a step that carries prefill chunks costs beyond one of decodes alone, as the engine runs.

A decode-only step replays a CUDA graph; a step with a prefill chunk runs eagerly, and on a small
model its launches cost the host several decode steps. The adaptive prefill delay
(`EngineConfig.adaptive_prefill_delay`) lets arrivals wait at most that extra cost to be
prefilled together: waiting longer than the step it saves cannot pay (the rent-or-buy bound),
and where the GPU sets the pace the extra is small and so is the wait.
"""

from __future__ import annotations

WEIGHT = 0.1  # of each new interval in the moving averages
LONGEST_S = 1.0  # an interval longer than this spans idle time or a stall: not a step's cost


class MixedStepCost:
    """Moving averages of the time from one step's plan to the next, by the kind of step."""

    def __init__(self) -> None:
        self.decode_s: float | None = None
        self.mixed_s: float | None = None

    def record(self, mixed: bool, seconds: float) -> None:
        if not 0.0 < seconds <= LONGEST_S:
            return
        old = self.mixed_s if mixed else self.decode_s
        new = seconds if old is None else old + WEIGHT * (seconds - old)
        if mixed:
            self.mixed_s = new
        else:
            self.decode_s = new

    @property
    def extra_s(self) -> float:
        """A mixed step's cost beyond a decode step's; 0 until both were seen."""
        if self.decode_s is None or self.mixed_s is None:
            return 0.0
        return max(0.0, self.mixed_s - self.decode_s)
