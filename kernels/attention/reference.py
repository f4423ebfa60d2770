"""The torch reference of paged causal attention (the CPU path and the oracle).

Shapes and the page layout are those of `deltaserve.kernels.attention`.
"""

from __future__ import annotations

import torch


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    page_size = k_cache.shape[1]
    n_rep = q.shape[1] // k_cache.shape[2]
    bounds = cu_seqlens_q.tolist()
    for i, total in enumerate(seq_lens.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        if hi == lo:
            continue
        pos = torch.arange(total, device=q.device)
        pages = page_table[i, (pos // page_size)].long()
        keys = k_cache[pages, pos % page_size].float()  # [S, Hkv, D]
        vals = v_cache[pages, pos % page_size].float()
        if n_rep > 1:
            keys = keys.repeat_interleave(n_rep, dim=1)
            vals = vals.repeat_interleave(n_rep, dim=1)
        qi = q[lo:hi].float().transpose(0, 1)  # [H, Tq, D]
        scores = qi @ keys.permute(1, 2, 0) * scale  # [H, Tq, S]
        q_pos = torch.arange(total - (hi - lo), total, device=q.device)
        mask = pos.unsqueeze(0) > q_pos.unsqueeze(1)
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[lo:hi] = (probs @ vals.transpose(0, 1)).transpose(0, 1).to(q.dtype)
    return out
