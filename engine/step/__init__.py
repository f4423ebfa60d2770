"""One step of the engine's loop: admission, the scheduler's plan, the batch it becomes,
overlap with the step before, and the sampled tokens handed to their requests."""
