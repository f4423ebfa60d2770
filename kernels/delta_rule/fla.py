"""The bridge to flash-linear-attention (FLA), whose chunked kernels run GDN and KDA prefill on CUDA.

FLA is imported lazily, and only after `configure_fla`: FLA reads its one process-wide switch
when it is first imported, so deltaserve sets it at a known point (the engine's start-up, and
every path here before it imports FLA) rather than as a side effect of importing deltaserve.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

import torch

from deltaserve.kernels.common.launch import env_mode
from deltaserve.kernels.common.per_forward import PerForwardCache, per_input


def fla_direct() -> bool:
    """`DELTASERVE_FLA_DIRECT` (default 1): call FLA's chunked forwards below their public entry.
    Not 0 or 1 is an error (a typo fails at start-up, not as a silent default)."""
    return env_mode("DELTASERVE_FLA_DIRECT", ("0", "1"), "1") == "1"


def configure_fla() -> None:
    """Before FLA is first imported: with direct calls (the default), turn FLA's backend dispatcher
    off (`FLA_DISABLE_BACKEND_DISPATCH=1`) so that FLA binds its Triton functions directly, not
    through a loop over optional backends on every call. A value the user set is kept; once FLA
    is loaded this changes nothing."""
    if fla_direct():
        os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")


def import_fla(module: str) -> Any:
    """FLA's `module`, configured first (`configure_fla`)."""
    configure_fla()
    return importlib.import_module(module)


def fla_cu_seqlens(cu_seqlens: torch.Tensor, cache: PerForwardCache | None = None) -> torch.Tensor:
    """An int64 copy of `cu_seqlens`, the same object for as long as the input is unchanged (kept
    in the caller's `cache`): FLA caches its chunk indices (built with a host sync) by argument
    identity alone, so the same object for every layer keeps that to one sync per forward, and a
    new object for a refilled input keeps FLA from reusing indices of an older batch."""
    return per_input(cache, "fla_cu_seqlens", cu_seqlens, None, lambda: cu_seqlens.to(torch.int64, copy=True))


def fla_internal(module: str, name: str) -> Callable[..., Any] | None:
    """FLA's chunked forward `module.name`, below its public entry point (no autograd Function,
    argument guards or backend dispatch, whose host time per layer bounds a small model's
    prefill, docs/performance.md, "Environment switches"). None with DELTASERVE_FLA_DIRECT=0, or
    where FLA's internals differ from 0.6's (no such function, or one without `chunk_indices`): the
    public call then."""
    if not fla_direct():
        return None
    try:
        fn = getattr(import_fla(module), name)
        import_fla("fla.ops.utils.index")  # prepare_chunk_indices, used beside it
    except (ImportError, AttributeError):
        return None
    if "chunk_indices" not in inspect.signature(fn).parameters:
        return None
    from deltaserve.kernels.common.fast_launch import fast_launch_modules

    fast_launch_modules("fla.")  # its kernels, loaded with `module`: no per-call autotuner work
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
    from deltaserve.kernels.gdn.triton import qk_norm_v_launch

    prepare_chunk_indices = import_fla("fla.ops.utils.index").prepare_chunk_indices
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
