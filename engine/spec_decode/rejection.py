"""Accepting drafts: the target model's verdict on each verification window.

Window i brings drafts d_1..d_n and n + 1 rows of logits: row j is the target's distribution
p_j for the token after d_j (row 0: after the last committed token). Each row is processed
as if the accepted drafts before it were already output (penalties, min_tokens), through a
view of the request with those tokens appended.

- greedy: accept d_{j+1} while it is the target's argmax at row j; the first disagreement
  (or the row after the last draft) gives the target's own token. The output is exactly
  plain greedy decoding's.
- sampling: the drafter proposes deterministically, a point mass q = delta(d). Standard
  speculative sampling accepts with probability min(1, p(d) / q(d)) = p(d) and on rejection
  draws from the residual norm(max(0, p - q)), which is p with d removed and renormalised:
  P(d) = p(d) and P(x != d) = (1 - p(d)) * p(x) / (1 - p(d)) = p(x), the target's law.
  After n acceptances the bonus token is drawn from p_n.
- seeded sampling: row j draws its token as plain decoding draws it (the request's own
  generator, one exponential race a token), and d_{j+1} is accepted while it is that token,
  which it is with probability p_j(d_{j+1}): the same law and acceptance, and the tokens of the
  request without speculation, whatever its drafts (and so whatever runs beside it).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from deltaserve.engine.requests.outputs import Logprob
from deltaserve.engine.requests.request import Request
from deltaserve.engine.sampling.sampler import Sampler


@dataclass
class Verdict:
    tokens: list[int]  # the accepted drafts, then the target's own token
    logprobs: list[Logprob | None]
    num_accepted: int


def _view(req: Request, extra: list[int]) -> Request:
    """The request as the sampler sees it after `extra` more output tokens (not stored)."""
    if not extra:
        return req
    view = copy.copy(req)
    view.output_token_ids = req.output_token_ids + extra
    return view


def verify_windows(
    sampler: Sampler, logits: torch.Tensor, reqs: list[Request], drafts: list[list[int]]
) -> list[Verdict]:
    """`logits [sum(len(d) + 1), vocab]`, the windows' rows in order."""
    views = [_view(r, d[:j]) for r, d in zip(reqs, drafts) for j in range(len(d) + 1)]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    greedy_rows = [i for i, r in enumerate(reqs) if r.params.greedy]
    targets: list[int] = [0] * len(views)
    if greedy_rows:
        rows = [j for i in greedy_rows for j in range(starts[i], starts[i + 1])]
        picked, _ = sampler.sample(logits[rows], [views[j] for j in rows])
        for j, t in zip(rows, picked):
            targets[j] = t
    verdicts: list[Verdict] = []
    for i, (req, d) in enumerate(zip(reqs, drafts)):
        lo = starts[i]
        if req.params.greedy:
            n = 0
            while n < len(d) and targets[lo + n] == d[n]:
                n += 1
            tokens = d[:n] + [targets[lo + n]]
        else:
            draw = _seeded_draws if req.generator is not None else _rejection_sample
            tokens = draw(sampler, logits[lo : starts[i + 1]], views[lo : starts[i + 1]], d)
            n = len(tokens) - 1
        rows_used = list(range(lo, lo + n + 1))
        emptied = next((views[j] for j in rows_used if views[j].error is not None), None)
        if emptied is not None and emptied is not req:  # a row it reached had no token to sample
            req.error, req.bad_input = emptied.error, emptied.bad_input
        lps = sampler.logprobs_of(logits[rows_used], tokens, [views[j] for j in rows_used])
        verdicts.append(Verdict(tokens, lps, n))
    return verdicts


def _rejection_sample(
    sampler: Sampler, logits: torch.Tensor, views: list[Request], drafts: list[int]
) -> list[int]:
    gen = views[0].generator or sampler.generator
    probs = sampler.probs(logits, views)  # [n + 1, vocab]
    dev = probs.device
    draft = torch.tensor(drafts, dtype=torch.long, device=dev)
    uniform = torch.rand(len(drafts), generator=gen, device=dev)
    accept = (uniform < probs[:-1].gather(1, draft.unsqueeze(1)).squeeze(1)).tolist()
    n = accept.index(False) if False in accept else len(drafts)
    row = probs[n]
    if n < len(drafts):  # the residual: p without the rejected draft
        row = row.clone()
        row[drafts[n]] = 0.0
    return drafts[:n] + [int(torch.multinomial(row, 1, generator=gen))]


def _seeded_draws(
    sampler: Sampler, logits: torch.Tensor, views: list[Request], drafts: list[int]
) -> list[int]:
    """Each position's token as plain decoding samples it, drawn one position at a time so that
    the request's generator advances by one draw a token emitted, as without speculation."""
    tokens: list[int] = []
    for j, view in enumerate(views):
        tokens.append(int(sampler.sample_tokens(logits[j : j + 1], [view])[0]))
        if j == len(drafts) or tokens[-1] != drafts[j]:
            break
    return tokens
