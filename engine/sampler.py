"""Turns a batch of logits into tokens: penalties, temperature, top-k / top-p / min-p, seeds."""

from __future__ import annotations

import torch

from deltaserve.engine.outputs import Logprob
from deltaserve.engine.request import Request


def apply_penalties(row: torch.Tensor, req: Request) -> torch.Tensor:
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


def filter_logits(row: torch.Tensor, req: Request) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, masking the rest to -inf."""
    p = req.params
    row = row / p.temperature
    if p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_vals, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_vals, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = probs.cumsum(-1) - probs >= p.top_p
        row = row.scatter(0, order, sorted_vals.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = torch.softmax(row, dim=-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


class Sampler:
    def __init__(self, device: torch.device, seed: int, eos_token_ids: list[int]) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids

    def new_generator(self, seed: int | None) -> torch.Generator | None:
        if seed is None:
            return None
        return torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[Logprob | None]]:
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in reqs)
        logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        simple = all(r.params.greedy and not self._needs_processing(r) for r in reqs)
        if simple:
            tokens = logits.argmax(dim=-1).tolist()
        else:
            tokens = [self._sample_row(logits[i].clone(), r) for i, r in enumerate(reqs)]
        lps: list[Logprob | None] = []
        for i, (tok, r) in enumerate(zip(tokens, reqs)):
            if logprobs is None or r.params.logprobs is None:
                lps.append(None)
                continue
            row = logprobs[i]
            top: dict[int, float] = {}
            if r.params.logprobs > 0:
                vals, ids = torch.topk(row, r.params.logprobs)
                top = dict(zip(ids.tolist(), vals.tolist()))
            lps.append(Logprob(tok, float(row[tok]), top))
        return tokens, lps

    def _needs_processing(self, r: Request) -> bool:
        p = r.params
        return (
            p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or len(r.output_token_ids) < p.min_tokens
        )

    def _sample_row(self, row: torch.Tensor, r: Request) -> int:
        p = r.params
        row = apply_penalties(row, r)
        if len(r.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if banned:
                row[torch.tensor(banned, dtype=torch.long, device=row.device)] = float("-inf")
        if p.greedy:
            return int(row.argmax())
        probs = torch.softmax(filter_logits(row, r), dim=-1)
        gen = r.generator if r.generator is not None else self.generator
        # exponential race: argmax(p / E) with E ~ Exp(1) samples from p
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return int((probs / noise).argmax())
