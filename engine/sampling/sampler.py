"""Turns a batch of logits into tokens: penalties, temperature, top-k / top-p / min-p, seeds."""

from __future__ import annotations

import logging

import torch

from deltaserve.engine.requests.outputs import Logprob
from deltaserve.engine.requests.request import Request
from deltaserve.engine.runner.h2d import to_device, to_device_packed
from deltaserve.engine.sampling.ops import filtered_probs, param_rows, pick_tokens, ranking_width, seeded
from deltaserve.engine.sampling.penalties import apply_penalties_batch
from deltaserve.engine.sampling.sampler_graphs import Capture, SamplerGraphs

logger = logging.getLogger(__name__)

# on CUDA, sampled batches of at most this many rows replay graphs (engine/sampling/sampler_graphs.py):
# their cost is the host's launches; larger batches' is the GPU's
SAMPLER_GRAPH_MAX_BS = 32


def _bad_word_ends(r: Request) -> list[int]:
    """The tokens r may not sample next: each bad word's last token where its generated tokens
    end with the word's others (vLLM's rule: generated tokens only, not the prompt)."""
    out = r.output_token_ids
    return [
        seq[-1]
        for seq in r.params.bad_words_token_ids or []
        if len(seq) == 1 or (len(out) >= len(seq) - 1 and list(out[len(out) - len(seq) + 1 :]) == seq[:-1])
    ]


def _allowed_outside(r: Request, vocab: int, dev: torch.device) -> torch.Tensor:
    """r's `allowed_outside` row (True where allowed_token_ids forbid), made on its first use."""
    row = r.allowed_outside
    if row is None or row.shape[0] != vocab or row.device != dev:
        row = torch.ones(vocab, dtype=torch.bool, device=dev)
        row[to_device(r.params.allowed_token_ids or [], torch.long, dev)] = False
        r.allowed_outside = row
    return row


_MAX_BIAS = 1e30


def _bias_tensors(r: Request, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """r's `logit_bias_tensors` (token ids, biases) on `dev`, made on their first use."""
    pair = r.logit_bias_tensors
    if pair is None or pair[0].device != dev:
        bias = r.params.logit_bias or {}
        # past 1e30 fp32 logits keep nothing of the model's, and a temperature's division would overflow
        values = [min(_MAX_BIAS, max(-_MAX_BIAS, float(v))) for v in bias.values()]
        ids, vals = to_device_packed([(list(bias), torch.long), (values, torch.float32)], dev)
        pair = r.logit_bias_tensors = (ids, vals)
    return pair


def _masks(r: Request) -> list[str]:
    """What forbids tokens at r's next position, as its client would name it."""
    p = r.params
    flags = _mask_flags(r)
    names = [
        "allowed_token_ids",
        "bad_words",
        f"min_tokens ({p.min_tokens}, which holds off stop tokens)",
        "a structured output's grammar",
        f"thinking_token_budget ({p.thinking_token_budget}, spent: the reasoning's end is forced)",
    ]
    return [name for name, on in zip(names, flags) if on]


def _mask_flags(r: Request) -> tuple[bool, bool, bool, bool, bool]:
    """Which of allowed_token_ids, bad words, min_tokens' ban, a grammar and a spent reasoning
    budget mask r's next token."""
    p = r.params
    return (
        p.allowed_token_ids is not None,
        bool(p.bad_words_token_ids),
        len(r.output_token_ids) < p.min_tokens and bool(p.stop_token_ids or not p.ignore_eos),
        r.matcher is not None and r.matcher.active,
        r.thinking is not None and r.thinking.forcing,
    )


class Sampler:
    """Samples a whole batch at once; only seeded rows draw their noise one by one.

    With `graph_max_bs`, sampled batches of at most that many rows replay CUDA graphs of the
    same ops (`engine/sampling/sampler_graphs.py`; `capture` replaces CUDA's capture, for tests)."""

    def __init__(
        self,
        device: torch.device,
        seed: int,
        eos_token_ids: list[int],
        graph_max_bs: int = 0,
        capture: Capture | None = None,
    ) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = eos_token_ids
        self.graph_max_bs = graph_max_bs
        self.capture = capture
        self.graphs: SamplerGraphs | None = None

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
        if all(r.params.greedy and not self.needs_processing(r) and not self._restricted(r) for r in reqs):
            return logits.argmax(dim=-1)
        if 0 < len(reqs) <= self.graph_max_bs:
            if self.graphs is None:
                self.graphs = SamplerGraphs(
                    self.process,
                    self.fill_noise,
                    self.device,
                    logits.shape[-1],
                    self.graph_max_bs,
                    self.capture,
                )
            if self.graphs.takes(len(reqs), logits.shape[-1]):
                tokens = self.graphs.sample(logits, reqs)
                if tokens is not None:
                    return tokens
        return self._sample_batch(logits, reqs)

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
        chosen: list[float] = []
        ranks: list[int] = []
        if logprobs is not None:  # the chosen tokens' values and ranks (1 the likeliest), one read
            picked = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).view(-1, 1))
            chosen = picked.view(-1).tolist()
            ranks = ((logprobs > picked).sum(dim=1) + 1).tolist()
        for i, (tok, r) in enumerate(zip(tokens, reqs)):
            if logprobs is None or r.params.logprobs is None:
                lps.append(None)
                continue
            row = logprobs[i]
            top: dict[int, float] = {}
            if r.params.logprobs > 0:
                vals, ids = torch.topk(row, r.params.logprobs)
                top = dict(zip(ids.tolist(), vals.tolist()))
            asked = r.params.logprob_token_ids
            values = row[asked].tolist() if asked else []
            lps.append(Logprob(tok, chosen[i], top, ranks[i], dict(zip(asked or [], values))))
        return lps

    def needs_processing(self, r: Request) -> bool:
        """Whether the request's logits need processing that reads its tokens so far (so its
        step cannot overlap the previous one): penalties, min_tokens, bad words, a grammar, a
        reasoning budget until the reasoning ends."""
        return (
            self._penalised(r)
            or bool(r.params.bad_words_token_ids)
            or r.matcher is not None
            or (r.thinking is not None and not r.thinking.done)
        )

    @staticmethod
    def _restricted(r: Request) -> bool:
        """Whether the request's logits are biased or masked (from its parameters alone)."""
        return bool(r.params.logit_bias) or r.params.allowed_token_ids is not None

    @staticmethod
    def _penalised(r: Request) -> bool:
        p = r.params
        return (
            p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0
            or len(r.output_token_ids) < p.min_tokens
        )

    def process(
        self, logits: torch.Tensor, reqs: list[Request], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`_process` of a copy of `logits` (made in `out` if given); `logits` stay as they are.

        Should the batch's processing raise, each row is processed alone, and a row that raises
        again fails its own request only: its `error` is set (the engine finishes it with
        finish_reason "error") and it keeps its raw logits, so the other rows sample as before."""
        out = logits.clone() if out is None else out.copy_(logits)
        try:
            self._process(out, reqs)
        except Exception:
            if len(reqs) > 1:
                logger.warning("logit processing failed for a batch; processing it row by row")
            out.copy_(logits)
            for i, r in enumerate(reqs):
                try:
                    self._process(out[i : i + 1], [r])
                except Exception as exc:
                    logger.exception("logit processing failed for request %s (it alone ends)", r.request_id)
                    r.error = f"logit processing failed ({type(exc).__name__})"
                    out[i].copy_(logits[i])
        self._fail_emptied_rows(logits, out, reqs)
        return out

    @staticmethod
    def _fail_emptied_rows(logits: torch.Tensor, out: torch.Tensor, reqs: list[Request]) -> None:
        """A row whose masks together forbid every token has nothing to sample: its request fails
        with a message for its client (`Request.bad_input`) and the row keeps its raw logits, so
        that the batch samples finite numbers. Only rows under a grammar or two masks can empty,
        and those steps wait for the previous one anyway, so reading their rows back costs no overlap."""
        rows = []
        for i, r in enumerate(reqs):
            if r.error is None:
                flags = _mask_flags(r)
                if flags[3] or sum(flags) > 1:
                    rows.append(i)
        if not rows:
            return
        emptied = torch.isneginf(out[rows]).all(dim=-1).tolist()
        for i, empty in zip(rows, emptied):
            if empty:
                r = reqs[i]
                r.error = (
                    f"the request leaves no token to sample at output token {len(r.output_token_ids) + 1}: "
                    f"{' and '.join(_masks(r))} together forbid every token"
                )
                r.bad_input = True
                out[i].copy_(logits[i])

    def _process(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Logit biases, allowed tokens, penalties, min_tokens bans, grammar masks and a spent
        reasoning budget's forced end, in place.
        (Biases and allowed tokens need no host data of earlier steps, so unlike the others they
        do not keep a step from overlapping.)"""
        dev = logits.device
        biased = [i for i, r in enumerate(reqs) if r.params.logit_bias]
        if biased:
            pairs = [_bias_tensors(reqs[i], dev) for i in biased]
            counts = [len(ids) for ids, _ in pairs]
            owners, repeats = to_device_packed([(biased, torch.long), (counts, torch.long)], dev)
            # output_size: no wait for the device to learn the length
            rows_t = torch.repeat_interleave(owners, repeats, output_size=sum(counts))
            ids_t = torch.cat([ids for ids, _ in pairs])
            vals_t = torch.cat([vals for _, vals in pairs])
            logits.index_put_((rows_t, ids_t), vals_t.to(logits.dtype), accumulate=True)
        allowed = [i for i, r in enumerate(reqs) if r.params.allowed_token_ids]
        if allowed:
            outside = torch.stack([_allowed_outside(reqs[i], logits.shape[-1], dev) for i in allowed])
            rows_a = to_device(allowed, torch.long, dev)
            logits[rows_a] = logits[rows_a].masked_fill(outside, float("-inf"))
        bad_ends = [
            (i, t) for i, r in enumerate(reqs) if r.params.bad_words_token_ids for t in _bad_word_ends(r)
        ]
        if bad_ends:
            rows_b, ids_b = to_device_packed(
                [([i for i, _ in bad_ends], torch.long), ([t for _, t in bad_ends], torch.long)], dev
            )
            logits[rows_b, ids_b] = float("-inf")
        penalised = [i for i, r in enumerate(reqs) if self._penalised(r)]
        if penalised:
            apply_penalties_batch(logits, [reqs[i] for i in penalised], penalised)
        for i in penalised:
            r = reqs[i]
            if len(r.output_token_ids) < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, to_device(banned, torch.long, dev)] = float("-inf")
        constrained = [i for i, r in enumerate(reqs) if r.matcher is not None and r.matcher.active]
        if constrained:  # last: what the grammar forbids stays forbidden
            from deltaserve.engine.sampling.structured import apply_grammar_masks, slow_mask_error

            for j in apply_grammar_masks(logits, constrained, [reqs[i].matcher for i in constrained]):
                r = reqs[constrained[j]]
                r.error = slow_mask_error(len(r.output_token_ids) + 1)
                r.bad_input = True
        forced = [
            (i, r.thinking.end) for i, r in enumerate(reqs) if r.thinking is not None and r.thinking.forcing
        ]
        if forced:  # the end keeps its value after the masks above: one that forbids it empties the row
            rows_f, ids_f = to_device_packed(
                [([i for i, _ in forced], torch.long), ([t for _, t in forced], torch.long)], dev
            )
            kept = logits[rows_f, ids_f]
            logits[rows_f] = float("-inf")
            logits[rows_f, ids_f] = kept
        return logits

    def _sample_batch(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        logits = self.process(logits, reqs)
        drawn = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(drawn) == len(reqs):
            return self._draw(logits, reqs)
        tokens = logits.argmax(dim=-1)
        if drawn:  # noise and ranking for the rows that draw only: a row of noise costs a vocabulary
            rows = to_device(drawn, torch.long, logits.device)
            tokens[rows] = self._draw(logits[rows], [reqs[i] for i in drawn])
        return tokens

    def _draw(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Each row's token by the exponential race over its filtered distribution (`pick_tokens`)."""
        vocab = logits.shape[-1]
        temp, min_p, top_p, top_k, greedy = self._param_tensors(reqs, vocab, logits.device)
        width = ranking_width(reqs, vocab)
        by_token = seeded(reqs, width)
        columns = vocab if by_token else width or vocab
        noise = torch.empty((len(reqs), columns), dtype=torch.float32, device=logits.device)
        self.fill_noise(noise, reqs, vocab)
        keep_min_p = min_p if any(r.params.min_p > 0 for r in reqs) else None
        return pick_tokens(logits, temp, keep_min_p, top_p, top_k, greedy.bool(), noise, width, by_token)

    @staticmethod
    def _param_tensors(reqs: list[Request], vocab: int, device: torch.device) -> list[torch.Tensor]:
        """temperature, min_p, top_p (fp32), top_k (int64), greedy (int8) per row, one copy."""
        temp, min_p, top_p, top_k, greedy = param_rows(reqs, vocab)
        return to_device_packed(
            [
                (temp, torch.float32),
                (min_p, torch.float32),
                (top_p, torch.float32),
                (top_k, torch.long),
                (greedy, torch.int8),
            ],
            device,
        )

    def fill_noise(self, noise: torch.Tensor, reqs: list[Request], vocab: int) -> None:
        """Exp(1) noise for the exponential race `[n, width]`: from the engine's generator, and
        for seeded rows from their own, drawn over the whole vocabulary whatever the width, so
        that a seeded request's generator advances alike on every path (a batch with one races
        by token id, `seeded`)."""
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(reqs):
            if r.generator is None:
                continue
            if noise.shape[1] == vocab and noise[i].is_contiguous():
                noise[i].exponential_(generator=r.generator)
            else:
                row = torch.empty(vocab, dtype=noise.dtype, device=noise.device)
                noise[i].copy_(row.exponential_(generator=r.generator)[: noise.shape[1]])

    def probs(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """The distribution each row samples from `[M, vocab]` (non-greedy rows; for rejection
        sampling of speculative drafts)."""
        probs, order = self._filtered_probs(self.process(logits.float(), reqs), reqs)
        if order is None:
            return probs
        return torch.zeros(logits.shape, dtype=probs.dtype, device=probs.device).scatter_(1, order, probs)

    def _filtered_probs(
        self, logits: torch.Tensor, reqs: list[Request]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """After temperature, top-k, top-p and min-p: the probabilities, and the token id of
        each column (None: column = token id)."""
        vocab = logits.shape[-1]
        temp, min_p, top_p, top_k, _ = self._param_tensors(reqs, vocab, logits.device)
        keep_min_p = min_p if any(r.params.min_p > 0 for r in reqs) else None
        return filtered_probs(
            logits / temp.unsqueeze(1), keep_min_p, top_p, top_k, ranking_width(reqs, vocab)
        )
