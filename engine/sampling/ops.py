"""The batch ops of sampling, shared by the eager sampler (`sampler.py`) and its CUDA-graph
replay (`sampler_graphs.py`): per-row parameters, how much of each row is ranked, and the
filtering and the draw."""

from __future__ import annotations

import torch

from deltaserve.engine.requests.request import Request

# Batches of at least TOPK_MIN_ROWS rows that all set a top-k of at most TOPK_LIMIT rank only
# their k best tokens: over a large vocabulary `torch.topk` is cheaper than a full sort from a
# few rows on, but not for a single row (docs/history/performance-2026-12.md, "The sampler alone").
TOPK_LIMIT = 1024
TOPK_MIN_ROWS = 4


def ranking_width(reqs: list[Request], vocab: int, min_rows: int = TOPK_MIN_ROWS) -> int:
    """How many tokens of each row are ranked: none (0) without top-k and top-p; only the
    k best (`torch.topk`) when at least `min_rows` rows all set a top-k of at most
    TOPK_LIMIT (much cheaper than sorting a 248k vocabulary per row); else all (a sort)."""
    ks = [r.params.top_k for r in reqs]
    if not any(ks) and all(r.params.top_p >= 1.0 for r in reqs):
        return 0
    if all(ks) and max(ks) <= min(TOPK_LIMIT, vocab) and len(reqs) >= min_rows:
        return max(ks)
    return vocab


def seeded(reqs: list[Request], width: int) -> bool:
    """Whether a ranked batch (`width` > 0) races by token id (`pick_tokens`' `by_token`): it
    holds a seeded row, whose draw must not depend on how its batch-mates rank it."""
    return width > 0 and any(r.generator is not None for r in reqs)


def param_rows(reqs: list[Request], vocab: int) -> list[list[float]]:
    """The sampling parameters as five per-row lists: temperature (1 for greedy rows), min_p,
    top_p, top_k (the vocabulary where unset) and greedy (1 or 0)."""
    params = [r.params for r in reqs]
    return [
        [1.0 if p.greedy else p.temperature for p in params],
        [p.min_p for p in params],
        [p.top_p for p in params],
        [min(p.top_k, vocab) if p.top_k else vocab for p in params],  # any k past the vocabulary is all
        [1 if p.greedy else 0 for p in params],
    ]


def filtered_probs(
    scaled: torch.Tensor,
    min_p: torch.Tensor | None,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature-scaled logits `[n, vocab]` to the probabilities each row samples from, after
    top-k, top-p and min-p (per-row tensors; `min_p` None: no row sets one), and the token id
    of each column (None: column = token id).

    `width` says how much is ranked: 0 nothing (no row may set top-k or top-p), less than the
    vocabulary the `width` best (`torch.topk`; every row's top-k must be at most `width`), the
    vocabulary a full sort. Shapes depend on `width` alone, so CUDA graphs capture this.
    """
    vocab = scaled.shape[-1]
    if width == 0:
        probs = torch.softmax(scaled, dim=-1)
        if min_p is None:
            return probs, None
        low = probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
        return torch.softmax(scaled.masked_fill(low, float("-inf")), dim=-1), None
    if width < vocab:
        vals, order = torch.topk(scaled, width, dim=-1)  # the k best, in descending order
    else:
        vals, order = torch.sort(scaled, dim=-1, descending=True)
    rank = torch.arange(vals.shape[-1], device=scaled.device).unsqueeze(0)
    vals = vals.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    # keep the smallest prefix whose mass reaches top_p (the first token always stays); rows
    # without top-p keep everything (a cumulative sum may reach 1.0 early by rounding)
    cut = (probs.cumsum(-1) - probs >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    vals = vals.masked_fill(cut, float("-inf"))
    if min_p is not None:
        probs = torch.softmax(vals, dim=-1)
        vals = vals.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], float("-inf"))
    return torch.softmax(vals, dim=-1), order


def pick_tokens(
    logits: torch.Tensor,
    temp: torch.Tensor,
    min_p: torch.Tensor | None,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    greedy: torch.Tensor,
    noise: torch.Tensor,
    width: int,
    by_token: bool = False,
) -> torch.Tensor:
    """Each row's token: the argmax where `greedy`, else a draw from `filtered_probs` by the
    exponential race (argmax of p / E with E ~ Exp(1) samples from p; `noise` holds the E,
    `[n, width or vocab]` by column). With `by_token` (a batch with seeded rows) `noise` is
    `[n, vocab]` by token id, so that a ranked batch races each token against the value it has
    unranked: a seeded row draws the same token whatever its batch-mates' top-k or top-p.
    No host syncs: CUDA graphs capture this."""
    greedy_tokens = logits.argmax(dim=-1)
    probs, order = filtered_probs(logits / temp.unsqueeze(1), min_p, top_p, top_k, width)
    if by_token and order is not None:
        noise = noise.gather(1, order)
    picked = (probs / noise).argmax(dim=-1, keepdim=True)
    sampled = (order.gather(1, picked) if order is not None else picked).squeeze(1)
    return torch.where(greedy, greedy_tokens, sampled)
