"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): which rows of a step's logits
score prompt tokens, and what they give each request."""

from __future__ import annotations

import torch

from deltaserve.engine.requests.outputs import Logprob
from deltaserve.engine.requests.request import Request
from deltaserve.engine.step.scheduler import SchedulerOutput


def prompt_rows(req: Request, start: int, num_tokens: int) -> int:
    """Positions of a chunk whose logits score the next prompt token (prompt logprobs)."""
    if req.params.prompt_logprobs is None:
        return 0
    return max(0, min(start + num_tokens, len(req.prompt_token_ids) - 1) - start)


def record_prompt_logprobs(plan: SchedulerOutput, starts: list[int], logits: torch.Tensor) -> None:
    """Each scored position's log-probability of the prompt token after it, and the top ones."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    row = 0
    for c, start in zip(plan.chunks, starts):
        n = prompt_rows(c.req, start, c.num_tokens)
        if n == 0:
            continue
        req, k = c.req, c.req.params.prompt_logprobs or 0
        targets = req.prompt_token_ids[start + 1 : start + 1 + n]
        block = logprobs[row : row + n]
        row += n
        assert req.prompt_logprobs is not None
        known = len(req.prompt_logprobs) - 1 - start  # a recomputed prefix (preemption) has them
        if known >= n:
            continue
        picked = block.gather(1, torch.tensor(targets, device=block.device).view(-1, 1))
        ranks = ((block > picked).sum(dim=1) + 1).tolist()
        chosen = picked.view(-1).tolist()
        tops = torch.topk(block, k) if k > 0 else None
        ids = req.params.prompt_logprob_token_ids or []
        asked = block[:, ids].tolist() if ids else [[]] * n
        for j in range(max(0, known), n):
            top = dict(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else {}
            req.prompt_logprobs.append(
                Logprob(targets[j], chosen[j], top, ranks[j], dict(zip(ids, asked[j])))
            )
