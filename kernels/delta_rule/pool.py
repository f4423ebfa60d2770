"""Plumbing shared by the recurrent ops (GDN, KDA) around a pool of per-slot states."""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.kernels.common.per_forward import PerForwardCache, per_input

# (q, k, v, g, beta, initial state or None) -> (o, final state), one sequence
ChunkRef = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (q, k, v, g, beta, states [N, ...]) -> (o, new states), one token for each of N sequences
StepRef = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def prefill_each_sequence(
    chunk_ref: ChunkRef,
    inputs: tuple[torch.Tensor, ...],
    cu_seqlens: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
) -> torch.Tensor:
    """The reference varlen prefill: one sequence at a time, final states into the pool."""
    v = inputs[2]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slots.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        init = state_pool[slot] if bool(has_initial_state[i]) else None
        o, final = chunk_ref(*(x[lo:hi] for x in inputs), init)
        out[lo:hi] = o.to(v.dtype)
        state_pool[slot] = final.to(state_pool.dtype)
    return out


def step_slots(
    step_ref: StepRef, inputs: tuple[torch.Tensor, ...], state_pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """The reference decode: gather the slots' states, step, write them back."""
    idx = slots.long()
    out, new_state = step_ref(*inputs, state_pool[idx])
    state_pool[idx] = new_state.to(state_pool.dtype)
    return out.to(inputs[2].dtype)


def long_slots(slots: torch.Tensor, cache: PerForwardCache | None = None) -> torch.Tensor:
    """`slots` as int64 (index_select's and index_copy_'s index), built once per forward."""
    return per_input(cache, "long_slots", slots, None, slots.long)


def gather_initial_states(
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    has_initial_state: torch.Tensor,
    cache: PerForwardCache | None = None,
) -> torch.Tensor:
    """fp32 copies of the slots' states, zeros where a sequence starts fresh (for FLA's kernels).
    The fresh-row mask and the int64 slots are built by the first layer of a forward only: each
    op here is a launch, and a small model's prefill step is bound by launches."""
    init = state_pool.index_select(0, long_slots(slots, cache)).float()
    shape = (-1, *([1] * (init.dim() - 1)))
    fresh = per_input(
        cache, "fresh_rows", has_initial_state, shape, lambda: ~has_initial_state.bool().view(shape)
    )
    # a fill, not a multiply: an unused slot may hold garbage (NaN) that 0 * x would keep
    return init.masked_fill_(fresh, 0.0)
