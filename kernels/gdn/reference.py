"""The torch reference of the gated delta rule (GDN), per sequence (the CPU path and the oracle):
the shared delta rule of `kernels/delta_rule/reference.py` with GDN's q / k normalisation.

Shapes are those of `deltaserve.kernels.gdn`.
"""

from __future__ import annotations

import torch

from deltaserve.kernels.delta_rule.reference import chunk_delta_rule_ref, recurrent_delta_rule_ref


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GDN's q / k normalisation, in the form of transformers' Qwen3-Next reference."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, chunked (WY / UT form). Returns `(o [T, HV, V], final_state [HV, K, V])`."""
    return chunk_delta_rule_ref(q, k, v, g, beta, initial_state, l2norm, chunk_size)


def recurrent_gated_delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over a batch of one-token sequences.

    q, k `[N, Hk, K]`, v `[N, HV, V]`, g, beta `[N, HV]`, state `[N, HV, K, V]`.
    Returns `(o [N, HV, V], new_state)`.
    """
    return recurrent_delta_rule_ref(q, k, v, g, beta, state, l2norm)
