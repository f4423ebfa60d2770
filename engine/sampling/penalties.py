"""Repetition, presence and frequency penalties for a whole batch at once.

Applied row by row, each penalised request would cost a set and a sort of its whole token
history in Python, a transfer and three or four kernels, every step: at large batches with long
outputs, more host time than the forward pass (Qwen's model cards suggest presence_penalty 1.5,
so many requests carry one). Here each
request's tokens are kept as numpy arrays that grow with it (`TokenArrays` in request.py, on the request,
so they go when it goes), the batch's (row, token) pairs go over in one copy, and the counts
and the seen-mask are built by one scatter each. The results are those of `apply_penalties`
(tests/engine/sampling/test_sampling.py holds them to it).
"""

from __future__ import annotations

import numpy as np
import torch

from deltaserve.engine.requests.request import Request, TokenArrays
from deltaserve.engine.runner.h2d import to_device_packed


def apply_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
    """One row, written out plainly: the reference the batched form is held to."""
    p = req.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _pairs(rows: list[int], arrays: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(row index, token) of every token of `arrays[j]`, which belongs to row `rows[j]`."""
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    row_idx = np.repeat(np.asarray(rows, dtype=np.int64), lengths)
    tokens = np.concatenate(arrays) if arrays else np.empty(0, dtype=np.int64)
    return row_idx, tokens


def apply_penalties_batch(logits: torch.Tensor, reqs: list[Request], rows: list[int]) -> None:
    """Penalties of `reqs[i]` applied to `logits[rows[i]]`, in place, for all of them at once:
    repetition first (prompt and output tokens), then presence and frequency (output tokens)."""
    dev, vocab = logits.device, logits.shape[-1]
    rep = [(r, i) for r, i in zip(reqs, rows) if r.params.repetition_penalty != 1.0]
    pf = [
        (r, i)
        for r, i in zip(reqs, rows)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_token_ids
    ]
    if rep:
        owners, arrays = [], []
        for j, (r, _) in enumerate(rep):  # prompt and output ids, each its own array (no concat)
            t = TokenArrays.of(r)
            owners += [j, j]
            arrays += [t.prompt, t.outputs(r)]
        r_idx, t_idx = _pairs(owners, arrays)
        at, r_t, t_t, pen = to_device_packed(
            [
                ([i for _, i in rep], torch.long),
                (r_idx, torch.long),
                (t_idx, torch.long),
                ([r.params.repetition_penalty for r, _ in rep], torch.float32),
            ],
            dev,
        )
        seen = torch.zeros(len(rep), vocab, dtype=torch.bool, device=dev)
        seen[r_t, t_t] = True
        vals = logits[at]
        pen = pen.to(logits.dtype).unsqueeze(1)
        logits[at] = torch.where(seen, torch.where(vals > 0, vals / pen, vals * pen), vals)
    if pf:
        r_idx, t_idx = _pairs(list(range(len(pf))), [TokenArrays.of(r).outputs(r) for r, _ in pf])
        at, r_t, t_t, freq, pres = to_device_packed(
            [
                ([i for _, i in pf], torch.long),
                (r_idx, torch.long),
                (t_idx, torch.long),
                ([r.params.frequency_penalty for r, _ in pf], torch.float32),
                ([r.params.presence_penalty for r, _ in pf], torch.float32),
            ],
            dev,
        )
        counts = torch.zeros(len(pf), vocab, dtype=logits.dtype, device=dev)
        counts.index_put_((r_t, t_t), torch.ones_like(t_t, dtype=logits.dtype), accumulate=True)
        freq, pres = freq.to(logits.dtype).unsqueeze(1), pres.to(logits.dtype).unsqueeze(1)
        logits[at] -= freq * counts + pres * (counts > 0).to(logits.dtype)
