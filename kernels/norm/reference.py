"""The torch references of the norms, gates and activations of `deltaserve.kernels.norm` (the CPU
path and the oracle of `norm/triton.py`), with its two weight conventions."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool) -> torch.Tensor:
    y = _normalize(x, eps)
    if zero_centered:
        return (y * (1.0 + weight.float())).to(x.dtype)
    return weight * y.to(x.dtype)


def gated_rms_norm_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, kind: str = "silu"
) -> torch.Tensor:
    if kind == "sigmoid":  # KDA: all in fp32, like the release
        return (weight.float() * _normalize(x, eps) * torch.sigmoid(gate.float())).to(x.dtype)
    y = weight * _normalize(x, eps).to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `2 * len(inv_freq)` channels of `x` `[T, H, D]`."""
    rotary = 2 * inv_freq.shape[0]
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(x.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(x.dtype).unsqueeze(1)
    sin = emb.sin().to(x.dtype).unsqueeze(1)
    rot, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def gdn_gates_ref(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def sigmoid_gate_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # over `[T, H * D]` rows, as transformers computes it: the sigmoid of a strided `[T, H, D]`
    # view would run D-long inner loops, whose scalar tails round differently on CPU in fp32
    t = x.shape[0]
    return (x.reshape(t, -1) * torch.sigmoid(gate.reshape(t, -1))).view(x.shape)


def kda_softplus(x: torch.Tensor) -> torch.Tensor:
    # spelled as the release and transformers spell it (log(1 + exp)), not F.softplus
    # (log1p), so that fp32 gates agree bit for bit
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))


def kda_gate_ref(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, head_dim: int) -> torch.Tensor:
    f = f.float() + dt_bias.float()
    f = f.view(f.shape[0], -1, head_dim)
    return -A_log.float().exp().view(-1, 1) * kda_softplus(f)
