"""RMSNorm in its forms (with a fused residual add, gated by silu, before RoPE), the GDN gates
and SwiGLU's activation.

Each op has its torch reference in `norm/reference.py` (the CPU path and the oracle) and one fused
Triton kernel on CUDA (`norm/triton.py`): in torch a norm is about nine kernels, and at small
batches a decode step is bound by how many kernels it runs, not by the bytes they move.

Two weight conventions: `zero_centered` (Qwen3-Next / Qwen3.5: y = norm(x) * (1 + w), all in
fp32) and plain (Kimi-Linear: y = w * norm(x) rounded to x's dtype first).
"""

from __future__ import annotations

import torch

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.norm.reference import (
    gated_rms_norm_ref,
    gdn_gates_ref,
    kda_gate_ref,
    rms_norm_ref,
    rope_ref,
    sigmoid_gate_ref,
    silu_and_mul_ref,
)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, quantize: bool = False
) -> torch.Tensor:
    """Over the last dim of `x` `[..., D]`; the result is contiguous. `quantize`: an FP8 matmul
    reads the result; on CUDA, at decode's few rows, the kernel also writes its block-FP8 rows,
    which that matmul takes instead of quantizing them in a launch (`kernels.fp8.cuda.keep_quantized`)."""
    if use_fast_path(x):
        from deltaserve.kernels.norm.triton import rms_norm_launch

        return rms_norm_launch(x, weight, eps, zero_centered, quantize)
    return rms_norm_ref(x, weight, eps, zero_centered)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual` (rounded to x's dtype, as the unfused model adds), then
    `(rms_norm(s), s)`: the pre-norm decoder layer's residual add fused into its next norm.
    `quantize` as `rms_norm`'s."""
    if use_fast_path(x):
        from deltaserve.kernels.norm.triton import add_rms_norm_launch

        return add_rms_norm_launch(x, residual, weight, eps, zero_centered, quantize)
    s = x + residual
    return rms_norm_ref(s, weight, eps, zero_centered), s


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    kind: str = "silu",
    quantize: bool = False,
) -> torch.Tensor:
    """A linear-attention layer's output norm, per head, gated: `x`, `gate` `[T, H, D]` (any row
    strides); `[T, H, D]` out. `kind="silu"`: GDN's `(w * norm(x)) * silu(gate)`, the product
    rounded to x's dtype first; `"sigmoid"`: KDA's `w * norm(x) * sigmoid(gate)` in fp32.
    `quantize` as `rms_norm`'s, for the output seen as `[T, H * D]`."""
    if kind not in ("silu", "sigmoid"):
        raise ValueError(f"gated norm kind must be 'silu' or 'sigmoid', got {kind!r}")
    if use_fast_path(x):
        from deltaserve.kernels.norm.triton import gated_rms_norm_launch

        return gated_rms_norm_launch(x, gate, weight, eps, kind, quantize=quantize)
    return gated_rms_norm_ref(x, gate, weight, eps, kind)


def rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    """Zero-centered per-head RMSNorm of `x` `[T, H, D]` followed by partial RoPE (Qwen's q and k)."""
    if use_fast_path(x):
        from deltaserve.kernels.norm.triton import rms_norm_rope_launch

        return rms_norm_rope_launch(x, weight, eps, positions, inv_freq)
    return rope_ref(rms_norm_ref(x, weight, eps, zero_centered=True), positions, inv_freq)


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN's per-head log-decay `g = -exp(A_log) * softplus(a + dt_bias)` (fp32) and
    `beta = sigmoid(b)` (b's dtype), from `a`, `b` `[T, H]` (any row stride)."""
    if use_fast_path(a):
        from deltaserve.kernels.norm.triton import gdn_gates_launch

        return gdn_gates_launch(a, b, A_log, dt_bias)
    return gdn_gates_ref(a, b, A_log, dt_bias)


def silu_and_mul(x: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """SwiGLU's `silu(gate) * up` of `x = [gate | up]` `[T, 2I]`; `[T, I]` out. `quantize` as
    `rms_norm`'s."""
    if use_fast_path(x):
        from deltaserve.kernels.norm.triton import silu_and_mul_launch

        return silu_and_mul_launch(x, quantize)
    return silu_and_mul_ref(x)


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """`x * sigmoid(gate)` for x, gate `[T, H, D]` (gate any view with unit last stride: the
    attention output gate inside q_proj's rows), contiguous, in x's dtype: one kernel on CUDA
    where torch runs three (the gate's copy, the sigmoid, the product). `quantize` as
    `gated_rms_norm`'s."""
    if use_fast_path(x):
        from deltaserve.kernels.norm.triton import sigmoid_gate_launch

        return sigmoid_gate_launch(x, gate, quantize)
    return sigmoid_gate_ref(x, gate)


def kda_gate(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, head_dim: int) -> torch.Tensor:
    """KDA's per-channel log decay `-exp(A_log[h]) * softplus(f + dt_bias)`, fp32 `[T, H, D]`,
    from the low-rank projection `f` `[T, H * D]`."""
    if use_fast_path(f):
        from deltaserve.kernels.norm.triton import kda_gate_launch

        return kda_gate_launch(f, dt_bias, A_log, head_dim)
    return kda_gate_ref(f, dt_bias, A_log, head_dim)
