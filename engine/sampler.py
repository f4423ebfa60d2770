"""Turns a batch of logits into tokens: penalties, temperature, top-k / top-p / min-p, seeds."""

from __future__ import annotations

import torch

from deltaserve.engine.h2d import to_device, to_device_packed
from deltaserve.engine.outputs import Logprob
from deltaserve.engine.penalties import apply_penalties_batch
from deltaserve.engine.request import Request

# Batches of at least TOPK_MIN_ROWS rows that all set a top-k of at most TOPK_LIMIT rank only
# their k best tokens. On the H200 at Qwen3.5's 248k vocabulary (bench/sampler.py --ops) a
# full sort took 0.10 / 0.24 / 1.1 / 4.6 ms at 1 / 8 / 64 / 256 rows, `torch.topk` of 20 or
# 1024 0.12-0.18 / 0.12-0.19 / 0.29-0.32 / 0.85-0.91 ms: slower for a single row.
TOPK_LIMIT = 1024
TOPK_MIN_ROWS = 4


class Sampler:
    """Samples a whole batch at once; only seeded rows draw their noise one by one."""

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
        tokens = self.sample_tokens(logits, reqs).tolist()
        return tokens, self.logprobs_of(logits, tokens, reqs, logprobs)

    def sample_tokens(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The sampled token of each row, left on the logits' device (no host sync)."""
        logits = logits.float()
        if all(r.params.greedy and not self._needs_processing(r) and not r.params.logit_bias for r in reqs):
            return logits.argmax(dim=-1)
        return self._sample_batch(logits.clone(), reqs)

    def logprobs_of(
        self,
        logits: torch.Tensor,
        tokens: list[int],
        reqs: list[Request],
        logprobs: torch.Tensor | None = None,
    ) -> list[Logprob | None]:
        """The chosen tokens' log-probabilities (of the raw logits), for rows that ask."""
        if logprobs is None and any(r.params.logprobs is not None for r in reqs):
            logprobs = torch.log_softmax(logits.float(), dim=-1)
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
        return lps

    def _needs_processing(self, r: Request) -> bool:
        p = r.params
        return (
            p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or len(r.output_token_ids) < p.min_tokens
        )

    def _process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Logit biases, penalties and min_tokens bans, in place. (Biases need no host data of
        earlier steps, so unlike penalties they do not keep a step from overlapping.)"""
        dev = logits.device
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            rows = [i for i, bias in biased for _ in bias]
            ids = [t for _, bias in biased for t in bias]
            vals = [float(v) for _, bias in biased for v in bias.values()]
            rows_t, ids_t, vals_t = to_device_packed(
                [(rows, torch.long), (ids, torch.long), (vals, torch.float32)], dev
            )
            logits.index_put_((rows_t, ids_t), vals_t.to(logits.dtype), accumulate=True)
        penalised = [i for i, r in enumerate(reqs) if self._needs_processing(r)]
        if penalised:
            apply_penalties_batch(logits, [reqs[i] for i in penalised], penalised)
        for i in penalised:
            r = reqs[i]
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, to_device(banned, torch.long, dev)] = float("-inf")
        return logits

    def _sample_batch(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        logits = self._process(logits, reqs)
        greedy_tokens = logits.argmax(dim=-1)
        if all(r.params.greedy for r in reqs):
            return greedy_tokens
        greedy = to_device([r.params.greedy for r in reqs], torch.bool, logits.device)
        probs, order = self._filtered_probs(logits, reqs)
        # exponential race: argmax(p / E) with E ~ Exp(1) samples from p
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        picked = (probs / noise).argmax(dim=-1, keepdim=True)
        sampled = (order.gather(1, picked) if order is not None else picked).squeeze(1)
        return torch.where(greedy, greedy_tokens, sampled)

    def probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The distribution each row samples from `[M, vocab]` (non-greedy rows; for rejection
        sampling of speculative drafts)."""
        probs, order = self._filtered_probs(self._process(logits.float().clone(), reqs), reqs)
        if order is None:
            return probs
        return torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).scatter_(1, order, probs)

    def _filtered_probs(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After temperature, top-k, top-p and min-p: the probabilities, and the token id of
        each column (None: column = token id).

        Only top-p needs the tokens in order, and top-k only the k best: a batch of at least
        TOPK_MIN_ROWS rows that all set a top-k of at most TOPK_LIMIT ranks just those
        (`torch.topk`, much cheaper than sorting a 248k vocabulary per row), a batch without
        top-k or top-p ranks nothing, and only the rest sorts the whole vocabulary.
        """
        dev = logits.device
        vocab = logits.shape[-1]
        params = [r.params for r in reqs]
        ks = [p.top_k for p in params]
        temp, min_p, top_p, top_k = to_device_packed(
            [
                ([1.0 if p.greedy else p.temperature for p in params], torch.float32),
                ([p.min_p for p in params], torch.float32),
                ([p.top_p for p in params], torch.float32),
                ([k or vocab for k in ks], torch.long),
            ],
            dev,
        )
        scaled = logits / temp.unsqueeze(1)
        if not any(ks) and all(p.top_p >= 1.0 for p in params):
            probs = torch.softmax(scaled, dim=-1)
            if any(p.min_p > 0 for p in params):
                low = probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
                probs = torch.softmax(scaled.masked_fill(low, float("-inf")), dim=-1)
            return probs, None
        width = max(ks) if all(ks) and max(ks) <= min(TOPK_LIMIT, vocab) else vocab
        if width < vocab and len(reqs) >= TOPK_MIN_ROWS:
            vals, order = torch.topk(scaled, width, dim=-1)  # the k best, in descending order
        else:
            vals, order = torch.sort(scaled, dim=-1, descending=True)
            width = vocab
        rank = torch.arange(width, device=dev).unsqueeze(0)
        vals = vals.masked_fill(rank >= top_k.unsqueeze(1), float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        vals = vals.masked_fill(probs.cumsum(-1) - probs >= top_p.unsqueeze(1), float("-inf"))
        probs = torch.softmax(vals, dim=-1)
        vals = vals.masked_fill(probs < min_p.unsqueeze(1) * probs[:, :1], float("-inf"))
        return torch.softmax(vals, dim=-1), order
