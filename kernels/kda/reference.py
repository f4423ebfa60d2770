"""The torch reference of Kimi Delta Attention (KDA), per sequence (the CPU path and the oracle):
the shared delta rule of `kernels/delta_rule/reference.py` with KDA's q / k normalisation.

Shapes are those of `deltaserve.kernels.kda`.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.delta_rule.reference import chunk_delta_rule_ref, recurrent_delta_rule_ref


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """KDA's q / k normalisation, in the form of FLA's kernels and transformers."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (WY / UT form). Returns `(o [T, H, V], final_state [H, K, V])`."""
    return chunk_delta_rule_ref(q, k, v, g, beta, initial_state, l2norm, chunk_size)


def recurrent_kda_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of N sequences.

    q, k, g `[N, H, K]`, v `[N, H, V]`, beta `[N, H]`, state `[N, H, K, V]`.
    Returns `(o [N, H, V], new_state)`.
    """
    return recurrent_delta_rule_ref(q, k, v, g, beta, state, l2norm)
