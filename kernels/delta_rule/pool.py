"""Plumbing shared by the recurrent ops (GDN, KDA) around a pool of per-slot states."""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

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


def gather_initial_states(
    state_pool: torch.Tensor, slots: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """fp32 copies of the slots' states, zeros where a sequence starts fresh (for FLA's kernels)."""
    init = state_pool.index_select(0, slots.long()).float()
    # where, not multiply: an unused slot may hold garbage (NaN) that 0 * x would keep
    fresh = ~has_initial_state.bool().view(-1, *([1] * (init.dim() - 1)))
    return torch.where(fresh, torch.zeros((), dtype=init.dtype, device=init.device), init)


_per_input: dict[str, tuple[torch.Tensor, int, object, torch.Tensor]] = {}


def per_input(
    name: str, source: torch.Tensor, extra: object, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """`build()`, kept under `name` while `source` is the same object with the same version and
    `extra` is equal: every layer of a forward passes the same `cu_seqlens`, so what derives
    from it is built once per forward. A refilled input (its version counter moves) builds
    anew. Inference tensors (the engine runs under inference_mode) keep no version counter;
    the engine builds a new cu_seqlens tensor for every forward, so identity is enough there."""
    version = -1 if source.is_inference() else source._version
    kept = _per_input.get(name)
    if kept is None or kept[0] is not source or kept[1] != version or kept[2] != extra:
        kept = _per_input[name] = (source, version, extra, build())
    return kept[3]


def fla_cu_seqlens(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """An int64 copy of `cu_seqlens`, the same object for as long as the input is unchanged:
    FLA caches its chunk indices (built with a host sync) by argument identity alone, so the
    same object for every layer keeps that to one sync per forward, and a new object for a
    refilled input keeps FLA from reusing indices of an older batch."""
    return per_input("fla_cu_seqlens", cu_seqlens, None, lambda: cu_seqlens.to(torch.int64, copy=True))


def fla_internal(module: str, name: str) -> Callable[..., Any] | None:
    """FLA's chunked forward `module.name`, below its public entry point (no autograd Function,
    argument guards or backend dispatch, whose host time per layer bounds a small model's
    prefill, docs/performance.md). None with DELTASERVE_FLA_DIRECT=0, or where FLA's internals
    differ from 0.6's (no such function, or one without `chunk_indices`): the public call then."""
    if os.environ.get("DELTASERVE_FLA_DIRECT", "1") == "0":
        return None
    try:
        fn = getattr(importlib.import_module(module), name)
        importlib.import_module("fla.ops.utils.index")  # prepare_chunk_indices, used beside it
    except (ImportError, AttributeError):
        return None
    if "chunk_indices" not in inspect.signature(fn).parameters:
        return None
    return fn


def fla_chunk_forward(
    fwd: Callable[..., Any],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    init: torch.Tensor,
    cu: torch.Tensor,
    chunk_indices: torch.Tensor | None = None,
) -> Any:
    """Call FLA's chunked forward `fwd` (from `fla_internal`) on one packed varlen batch: q and k
    L2-normalised and v made contiguous by one kernel of ours (FLA's kernels index inputs as
    contiguous `[1, T, H, D]`), its chunk indices built here unless given (built from host
    lengths they cost no device sync); FLA's raw outputs back."""
    from fla.ops.utils.index import prepare_chunk_indices

    from deltaserve.kernels.gdn.triton import qk_norm_v_launch

    q, k, v = qk_norm_v_launch(q, k, v)
    return fwd(
        q=q.unsqueeze(0),
        k=k.unsqueeze(0),
        v=v.unsqueeze(0),
        g=g.unsqueeze(0).contiguous(),
        beta=beta.unsqueeze(0).contiguous(),
        scale=q.shape[-1] ** -0.5,
        initial_state=init,
        output_final_state=True,
        cu_seqlens=cu,
        chunk_indices=prepare_chunk_indices(cu, 64) if chunk_indices is None else chunk_indices,
    )
