"""Sampling behaviour: seeds, top-k/top-p/min-p, penalties, stop strings, logprobs, n."""

from __future__ import annotations

import math
import time

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.request import Request
from deltaserve.engine.sampling.ops import TOPK_LIMIT, TOPK_MIN_ROWS
from deltaserve.engine.sampling.penalties import apply_penalties
from deltaserve.engine.sampling.sampler import Sampler


def make_request(params: SamplingParams, prompt=(1, 2, 3), output=()) -> Request:
    r = Request("r", list(prompt), params, IncrementalDetokenizer(None))
    r.output_token_ids = list(output)
    return r


@pytest.fixture(scope="module")
def llm(make_checkpoint):
    return LLM(make_checkpoint("qwen3_next"), dtype="float32", device="cpu", chunked_prefill_size=64)


PROMPTS = [{"prompt_token_ids": [5, 9, 17, 3, 88]}, {"prompt_token_ids": list(range(40, 110))}]


def tokens(outs):
    return [c.token_ids for o in outs for c in o.outputs]


@pytest.mark.slow
def test_seeded_sampling_reproduces_and_seeds_differ(llm):
    p = dict(temperature=1.0, max_tokens=12, ignore_eos=True)
    a = tokens(llm.generate(PROMPTS, SamplingParams(seed=1, **p)))
    b = tokens(llm.generate(PROMPTS, SamplingParams(seed=1, **p)))
    c = tokens(llm.generate(PROMPTS, SamplingParams(seed=2, **p)))
    assert a == b
    assert a != c


def test_seeded_request_is_independent_of_its_batch(llm):
    p = SamplingParams(temperature=0.9, seed=42, max_tokens=10, ignore_eos=True)
    alone = tokens(llm.generate(PROMPTS[:1], p))
    crowd = llm.generate(
        PROMPTS[:1] + PROMPTS[1:] * 3, [p] + [SamplingParams(temperature=1.0, max_tokens=5)] * 3
    )
    assert tokens(crowd[:1]) == alone
    # batch-mates whose top-p or top-k make the batch rank its tokens
    ranked = llm.generate(
        PROMPTS[:1] + PROMPTS[1:] * 2,
        [p, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5), SamplingParams(top_k=20, max_tokens=5)],
    )
    assert tokens(ranked[:1]) == alone


def test_top_k_one_equals_greedy(llm):
    greedy = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))
    topk1 = tokens(
        llm.generate(PROMPTS, SamplingParams(temperature=1.5, top_k=1, max_tokens=10, ignore_eos=True))
    )
    assert greedy == topk1


def test_n_gives_distinct_completions_in_order(llm):
    out = llm.generate(
        PROMPTS[:1], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    )
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 3


def test_max_tokens_finishes_with_length(llm):
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert all(len(c.token_ids) == 4 and c.finish_reason == "length" for o in out for c in o.outputs)


def test_stop_token_ids_end_the_request(llm):
    free = tokens(llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)))[
        0
    ]
    stop_tok = free[4]
    first = free.index(stop_tok)
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok]))
    comp = out[0].outputs[0]
    assert comp.token_ids == free[: first + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop_tok


def test_large_repetition_penalty_avoids_seen_tokens(llm):
    prompt = PROMPTS[0]["prompt_token_ids"]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1e4))
    toks = out[0].outputs[0].token_ids
    assert len(set(toks)) == len(toks)
    assert not set(toks) & set(prompt)


def test_logprobs_are_normalised_and_ranked(llm):
    out = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=5, logprobs=3, ignore_eos=True)
    )
    comp = out[0].outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 5
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert lp.token_id == tok and lp.logprob <= 0.0
        ranked = sorted(lp.top.values(), reverse=True)
        assert len(lp.top) == 3 and list(lp.top.values()) == ranked
        assert lp.top[tok] == pytest.approx(ranked[0])  # greedy picks the top one
    assert comp.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in comp.logprobs))


# -- the sampler's pieces on constructed logits ---------------------------------------------


def test_frequency_and_presence_penalties_subtract_per_count():
    row = torch.zeros(6)
    r = make_request(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), output=[2, 2, 4])
    out = apply_penalties(row.clone(), r)
    assert out.tolist() == [0.0, 0.0, -1.25, 0.0, -0.75, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    row = torch.tensor([2.0, -2.0, 2.0, -2.0])
    r = make_request(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert apply_penalties(row.clone(), r).tolist() == [1.0, -4.0, 2.0, -2.0]


def sample_many(probs: list[float], n: int = 4000, **params) -> list[float]:
    """Frequencies of each token over n rows sampled in one batch."""
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[])
    logits = torch.tensor(probs).log().expand(n, -1).contiguous()
    params.setdefault("temperature", 1.0)
    reqs = [make_request(SamplingParams(**params)) for _ in range(n)]
    toks = sampler.sample(logits, reqs)[0]
    return [toks.count(t) / n for t in range(len(probs))]


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    freq = sample_many([0.5, 0.3, 0.15, 0.05], top_p=0.7)
    assert freq[2] == freq[3] == 0.0
    assert math.isclose(freq[0], 0.5 / 0.8, abs_tol=0.03)


def test_min_p_drops_tokens_below_the_scaled_maximum():
    freq = sample_many([0.6, 0.25, 0.1, 0.05], min_p=0.2)
    assert freq[2] == freq[3] == 0.0
    assert math.isclose(freq[1], 0.25 / 0.85, abs_tol=0.03)


def test_top_k_keeps_k_largest():
    freq = sample_many([0.1, 0.4, 0.3, 0.2], top_k=2)
    assert freq[0] == freq[3] == 0.0
    assert math.isclose(freq[1], 0.4 / 0.7, abs_tol=0.03)


def test_temperature_sharpens():
    cold = sample_many([0.6, 0.4], temperature=0.5)
    assert math.isclose(cold[0], 0.36 / 0.52, abs_tol=0.03)


@pytest.mark.parametrize("temperature", [1e-6, 0.005])
def test_a_temperature_below_vllms_floor_samples_at_it(temperature, caplog):
    """vLLM raises a positive temperature below 0.01 to 0.01 (with a warning): a 0.01 logit gap
    is then e to 1, not greedy (1e-6 was) nor e to 2 (0.005 was)."""
    gap = math.exp(-0.01)
    with caplog.at_level("WARNING"):
        freq = sample_many([1 / (1 + gap), gap / (1 + gap)], temperature=temperature)
    assert math.isclose(freq[0], 1 / (1 + math.exp(-1)), abs_tol=0.03)
    assert SamplingParams(temperature=temperature).temperature == 0.01
    assert "raised to 0.01" in caplog.text


def test_min_tokens_bans_eos_until_reached():
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[3])
    logits = torch.tensor([[0.0, 1.0, 0.0, 9.0]])
    early = make_request(SamplingParams(temperature=0.0, min_tokens=2), output=[1])
    late = make_request(SamplingParams(temperature=0.0, min_tokens=2), output=[1, 1])
    assert sampler.sample(logits, [early])[0] == [1]
    assert sampler.sample(logits, [late])[0] == [3]


def test_sampling_follows_the_distribution():
    sampler = Sampler(torch.device("cpu"), 0, eos_token_ids=[])
    probs = torch.tensor([0.7, 0.2, 0.1])
    r = make_request(SamplingParams(temperature=1.0, seed=0))
    r.generator = sampler.new_generator(0)
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[sampler.sample(probs.log()[None], [r])[0][0]] += 1
    for c, p in zip(counts, probs.tolist()):
        assert math.isclose(c / 3000, p, abs_tol=0.03)


def test_out_of_range_params_are_rejected():
    for bad in (dict(n=0), dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's sampling distribution, written out plainly on the whole vocabulary: temperature,
    top-k, then top-p on what top-k left (renormalised, as vLLM does), then min-p."""
    probs = torch.softmax(row / p.temperature, dim=-1)
    ranked = torch.argsort(probs, descending=True).tolist()
    if p.top_k:
        ranked = ranked[: p.top_k]
    total = sum(float(probs[t]) for t in ranked)
    kept, mass = [], 0.0
    for token in ranked:
        if mass >= p.top_p:
            break
        kept.append(token)
        mass += float(probs[token]) / total
    out = torch.zeros_like(probs)
    out[kept] = probs[kept]
    out = torch.where(out >= p.min_p * out.max(), out, torch.zeros_like(out))
    return out / out.sum()


@pytest.mark.parametrize(
    "rows",
    [
        # every row with a top-k, at least TOPK_MIN_ROWS rows: only the k best are ranked
        [dict(top_k=20), dict(top_k=5, top_p=0.8), dict(top_k=50, min_p=0.05), dict(top_k=1), dict(top_k=7)],
        [dict(top_k=20), dict(top_k=5, top_p=0.8)],  # too few rows: full sort
        [dict(top_k=20, top_p=0.9), dict(top_p=0.7), dict()],  # a row without top-k: full sort
        [dict(), dict(temperature=0.5), dict(temperature=1.7)],  # plain temperature: no ranking
        [dict(min_p=0.1), dict(), dict(min_p=0.02, temperature=0.7)],  # min-p without ranking
        [dict(top_k=2000), dict(top_k=3)],  # beyond TOPK_LIMIT: full sort
    ],
    ids=["topk", "few_rows", "sort", "plain", "min_p", "large_k"],
)
def test_each_path_gives_the_written_out_distribution(rows, monkeypatch):
    ranked = []
    real_topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda *a, **k: ranked.append(a[1]) or real_topk(*a, **k))
    gen = torch.Generator().manual_seed(0)
    vocab = 3000
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    params = [SamplingParams(**{"temperature": 1.0, **r}) for r in rows]
    got = Sampler(torch.device("cpu"), 0, []).probs(logits, [make_request(p) for p in params])
    for i, p in enumerate(params):
        torch.testing.assert_close(got[i], reference_probs(logits[i], p), atol=1e-6, rtol=1e-4)
    # the path taken: topk of the largest k only when every row of enough rows sets a small one
    ks = [p.top_k for p in params]
    uses_topk = all(ks) and max(ks) <= TOPK_LIMIT and len(params) >= TOPK_MIN_ROWS
    assert ranked == ([max(ks)] if uses_topk else [])


def test_greedy_rows_beside_a_sampled_one_draw_no_noise(monkeypatch):
    """Greedy rows take their argmax and the sampled rows alone draw noise: a row of noise costs a
    vocabulary, which a large greedy batch would otherwise add to every step of the streams beside it.
    The sampled row, seeded, draws what it draws alone."""
    vocab = 3000
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)

    def sample(rows: torch.Tensor, greedy: int, at: int) -> tuple[list[int], list[int]]:
        sampler = Sampler(torch.device("cpu"), 0, [])
        drawn: list[int] = []
        real = sampler.fill_noise
        monkeypatch.setattr(sampler, "fill_noise", lambda n, r, v: drawn.append(n.shape[0]) or real(n, r, v))
        reqs = [make_request(SamplingParams(temperature=0.0)) for _ in range(greedy)]
        reqs.insert(at, make_request(params))
        reqs[at].generator = sampler.new_generator(params.seed)
        return sampler.sample_tokens(rows, reqs).tolist(), drawn

    tokens, drawn = sample(logits, 8, 4)
    assert drawn == [1]  # one row of noise, not nine
    greedy = logits.argmax(dim=-1).tolist()
    assert tokens[:4] + tokens[5:] == greedy[:4] + greedy[5:]
    alone, _ = sample(logits[4:5], 0, 0)
    assert tokens[4] == alone[0]


def test_logit_bias_forces_and_bans_tokens(llm):
    forced = llm.generate(
        PROMPTS,
        SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0}),
    )
    assert all(c.token_ids == [42] * 6 for o in forced for c in o.outputs)
    free = tokens(llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
    banned = {t: -100.0 for row in free for t in row}
    steered = tokens(
        llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias=banned)
        )
    )
    assert not set(banned) & {t for row in steered for t in row}
    # logprobs stay those of the model: the forced token's is its unbiased value, below 0
    out = llm.generate(
        PROMPTS[:1],
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0, logit_bias={42: 100.0}),
    )[0].outputs[0]
    assert out.token_ids == [42, 42] and all(lp.logprob < -0.5 for lp in out.logprobs)


def test_allowed_token_ids_restrict_sampling_to_them(llm):
    """Only the allowed ids are sampled, greedy or not; greedy, they give what a +100 bias on them
    gives (it keeps their order and outweighs every other logit of this model); logprobs stay the
    model's own."""
    allowed = [7, 42, 99, 123]
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    masked = tokens(llm.generate(PROMPTS, SamplingParams(allowed_token_ids=allowed, **greedy)))
    biased = tokens(llm.generate(PROMPTS, SamplingParams(logit_bias=dict.fromkeys(allowed, 100.0), **greedy)))
    assert masked == biased
    sampled = llm.generate(
        PROMPTS,
        SamplingParams(
            temperature=1.5, seed=3, max_tokens=12, ignore_eos=True, allowed_token_ids=allowed, n=3
        ),
    )
    assert {t for o in sampled for c in o.outputs for t in c.token_ids} <= set(allowed)
    out = llm.generate(PROMPTS[:1], SamplingParams(allowed_token_ids=[42], logprobs=0, **greedy))[0].outputs[
        0
    ]
    assert out.token_ids == [42] * 6 and all(lp.logprob < -0.5 for lp in out.logprobs)


def test_allowed_token_ids_go_to_the_device_once_per_request(monkeypatch):
    """Each request's allowed_token_ids are sent to the device once, not every step (a
    near-vocabulary list rebuilt each step slowed every request batched with it); the tokens
    still come from the list, and a row without one samples freely."""
    import deltaserve.engine.sampling.sampler as sampler_module

    sent: list[int] = []
    real_one, real_packed = sampler_module.to_device, sampler_module.to_device_packed

    def one(values, dtype, device):
        sent.append(len(values))
        return real_one(values, dtype, device)

    def packed(fields, device):
        sent.extend(len(values) for values, _ in fields)
        return real_packed(fields, device)

    monkeypatch.setattr(sampler_module, "to_device", one)
    monkeypatch.setattr(sampler_module, "to_device_packed", packed)
    vocab, steps = 1000, 6
    allowed = list(range(0, vocab, 2))
    reqs = [make_request(SamplingParams(temperature=1.0, allowed_token_ids=allowed)) for _ in range(4)]
    reqs.append(make_request(SamplingParams(temperature=1.0)))
    sampler, noise = Sampler(torch.device("cpu"), 0, [0]), torch.Generator().manual_seed(0)
    picked = []
    for _ in range(steps):
        logits = torch.randn(len(reqs), vocab, generator=noise)
        picked.append(sampler.sample_tokens(logits, reqs).tolist())
    assert {t for row in picked for t in row[:4]} <= set(allowed)
    assert any(row[4] % 2 for row in picked)
    # the four lists once, then a few row indices and parameters per step
    assert sum(sent) <= 4 * len(allowed) + steps * 10 * len(reqs)


def test_logit_bias_goes_to_the_device_once_per_request(monkeypatch):
    """Each request's logit_bias is sent to the device once, not gathered from its dict every
    step; the biases still apply, each to its own row, and a row without one is untouched."""
    import deltaserve.engine.sampling.sampler as sampler_module

    sent: list[int] = []
    real_packed = sampler_module.to_device_packed

    def packed(fields, device):
        sent.extend(len(values) for values, _ in fields)
        return real_packed(fields, device)

    monkeypatch.setattr(sampler_module, "to_device_packed", packed)
    vocab, steps, size = 1000, 5, 200
    biases = [{t: float(j + 1) for t in range(j, vocab, vocab // size)} for j in range(3)]
    reqs = [make_request(SamplingParams(logit_bias=b)) for b in biases] + [make_request(SamplingParams())]
    sampler = Sampler(torch.device("cpu"), 0, [0])
    for _ in range(steps):
        logits = torch.zeros(len(reqs), vocab)
        out = sampler.process(logits, reqs)
        for row, bias in zip(out, biases):
            want = torch.zeros(vocab)
            want[list(bias)] = torch.tensor(list(bias.values()))
            assert torch.equal(row, want)
        assert torch.equal(out[3], torch.zeros(vocab))
    # each dict's ids and values once, then the rows and their counts per step
    assert sum(sent) <= 3 * 2 * size + steps * 2 * len(reqs)


def test_allowed_token_ids_are_checked(llm):
    for bad in ([], [-1], [1, "2"]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids: token id"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(allowed_token_ids=[3, 10**7]))
    assert not llm.engine.has_unfinished_requests()


def test_bad_words_are_never_generated(llm):
    """A bad word's last token is never sampled right after its others (vLLM's rule): greedy
    decoding follows the free run up to the pair's first token, then leaves it; a one-token bad
    word is banned outright, as a -100 bias bans it."""
    greedy = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = tokens(llm.generate(PROMPTS, SamplingParams(**greedy)))
    row = free[0]
    pair = row[2:4]
    first = next(i for i in range(len(row) - 1) if row[i : i + 2] == pair)
    out = tokens(llm.generate(PROMPTS[:1], SamplingParams(bad_words_token_ids=[pair], **greedy)))[0]
    assert out[: first + 1] == row[: first + 1] and out[first + 1] != pair[1]
    assert all(out[i : i + 2] != pair for i in range(len(out) - 1))
    single = free[1][1]
    banned = tokens(llm.generate(PROMPTS[1:], SamplingParams(bad_words_token_ids=[[single]], **greedy)))[0]
    biased = tokens(llm.generate(PROMPTS[1:], SamplingParams(logit_bias={single: -100.0}, **greedy)))[0]
    assert single not in banned and banned == biased
    with pytest.raises(ValueError, match="bad_words_token_ids: token id"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(bad_words_token_ids=[[1, 10**7]]))
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words_token_ids=[[]])


def test_logit_bias_is_checked():
    for bad in ({-1: 1.0}, {5: float("nan")}, {5: "1"}):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def test_offline_logit_bias_past_100_is_added_as_given(llm):
    """vLLM's offline SamplingParams takes any bias (only its server clamps to [-100, 100]): +150
    beats +100 whichever token the model prefers, and a huge or infinite one forces or bans."""
    p = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    tied = tokens(llm.generate(PROMPTS[:1], SamplingParams(logit_bias={42: 100.0, 43: 100.0}, **p)))[0][0]
    other = 85 - tied  # 43 where the model's own logits pick 42, and the other way round
    biased = SamplingParams(logit_bias={tied: 100.0, other: 150.0}, **p)
    assert biased.logit_bias == {tied: 100.0, other: 150.0}
    assert tokens(llm.generate(PROMPTS[:1], biased)) == [[other] * 3]
    free = tokens(llm.generate(PROMPTS[:1], SamplingParams(**p)))[0][0]
    for bias in (-1e9, float("-inf")):
        steered = tokens(llm.generate(PROMPTS[:1], SamplingParams(logit_bias={free: bias}, **p)))
        assert free not in steered[0]
    for bias in (1e38, float("inf")):  # sampled at vLLM's lowest temperature, no NaN
        hot = SamplingParams(temperature=0.01, seed=1, max_tokens=3, ignore_eos=True, logit_bias={7: bias})
        assert tokens(llm.generate(PROMPTS, hot)) == [[7] * 3] * 2


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="logit_bias: token id"):
        llm.engine.add_request("x", [1, 2, 3], SamplingParams(logit_bias={10**7: 5.0}))
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("length,cached", [(75, 64), (80, 64)])  # a page-aligned prompt too
def test_n_copies_start_from_the_cached_prompt(llm, length, cached):
    """`generate` with n > 1 prefills the prompt once first: each copy starts from the radix cache
    (the whole pages before the prompt's last token) and gives what one request gives."""
    prompt = {"prompt_token_ids": [(7 * i + length) % 150 + 1 for i in range(length)]}  # not seen before
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = llm.generate(prompt, SamplingParams(n=3, **{**greedy, "temperature": 1.0, "top_k": 1}))[0]
    assert out.num_cached_tokens == cached
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1
    one = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"]}, SamplingParams(**greedy))[0]
    assert one.outputs[0].token_ids == out.outputs[0].token_ids


def test_n_above_one_at_temperature_zero_is_refused_offline_as_in_vllm(llm):
    """vLLM's `ValueError("n must be 1 when using greedy sampling ...")`, from `generate` here: the
    params themselves stay valid (SGLang's `/generate` serves such copies on purpose). A batch
    with one such prompt queues none of them; top_k=1 at a positive temperature is vLLM's way to
    n identical choices."""
    greedy = dict(temperature=0.0, max_tokens=3, ignore_eos=True)
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling.*got 2"):
        llm.generate(PROMPTS, SamplingParams(n=2, **greedy))
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling"):
        llm.generate(PROMPTS, [SamplingParams(**greedy), SamplingParams(n=3, **greedy)])
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(PROMPTS[:1], SamplingParams(n=2, top_k=1, max_tokens=3, ignore_eos=True))
    assert [c.token_ids for c in out.outputs] == tokens(
        llm.generate(PROMPTS[:1], SamplingParams(**greedy))
    ) * 2


def test_batched_penalties_equal_the_row_by_row_ones():
    """Random penalties over random histories, a verification view (the request with drafts
    appended, not stored) among them, and outputs growing between steps: the batched form gives
    the row-by-row reference's logits."""
    import copy
    import random

    from deltaserve.engine.sampling.penalties import apply_penalties_batch

    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab = 500
    reqs = []
    for _ in range(7):
        params = SamplingParams(
            repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
            presence_penalty=rng.choice([0.0, 1.5, -0.5]),
            frequency_penalty=rng.choice([0.0, 0.7]),
        )
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        reqs.append(make_request(params, prompt, [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]))
    for _ in range(4):
        for r in reqs:  # the requests' outputs grow in place, as the engine appends them
            r.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.randint(0, 3)))
        view = copy.copy(reqs[2])
        view.output_token_ids = reqs[2].output_token_ids + [rng.randrange(vocab) for _ in range(2)]
        batch = [*reqs, view]
        logits = torch.randn(len(batch) + 2, vocab, generator=gen) * 3
        rows = list(range(1, len(batch) + 1))  # rows need not start at 0
        want = logits.clone()
        for r, i in zip(batch, rows):
            want[i] = apply_penalties(want[i], r)
        got = logits.clone()
        apply_penalties_batch(got, batch, rows)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert not torch.equal(got, logits)  # the penalties did something


def test_offline_logprobs_are_vllms_dicts(tokenized_checkpoint):
    """LLM.generate's logprobs as vLLM's: per position a dict token id -> (logprob, rank,
    decoded_token), the chosen token first, then the top ones best first; the chosen token's rank
    is its own (as prompt_logprobs rank the same tokens), and no cumulative_logprob unasked."""
    llm = LLM(tokenized_checkpoint, dtype="float32", device="cpu")
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=4, logprobs=2, prompt_logprobs=1, ignore_eos=True
    )
    (out,) = llm.generate("The sky is", params)
    comp = out.outputs[0]
    # the same tokens as a prompt: its log-probabilities, from the prompt's own path
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (again,) = llm.generate({"prompt_token_ids": out.prompt_token_ids + comp.token_ids}, scored)
    references = again.prompt_logprobs[len(out.prompt_token_ids) :]
    for token_id, position, reference in zip(comp.token_ids, comp.logprobs, references, strict=True):
        assert isinstance(position, dict) and list(position)[0] == token_id
        chosen, ref = position[token_id], reference[token_id]
        assert chosen.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert abs(chosen.rank - ref.rank) <= 2 and chosen.decoded_token == tokenizer.decode([token_id])
        top = [position[t] for t in list(position)[1:]]
        assert [t.rank for t in top] == list(range(1, len(top) + 1)) and len(top) >= 1
        assert all(t.logprob >= chosen.logprob for t in top)
    assert comp.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs))
    )
    assert out.prompt_logprobs[0] is None
    for token_id, position in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert list(position)[0] == token_id and position[token_id].decoded_token == tokenizer.decode(
            [token_id]
        )
    (plain,) = llm.generate("The sky is", SamplingParams(max_tokens=2))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_generate_keeps_the_requests_times(llm):
    """LLM.generate's outputs carry when each prompt was scheduled and gave its first token (the
    engine's outputs hold them; the grouped output of a prompt's samples dropped them)."""
    before = time.time()
    outs = llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    for out in outs:
        assert out.scheduled_time is not None and out.first_token_time is not None
        assert before <= out.arrival_time <= out.scheduled_time <= out.first_token_time <= time.time()


def test_generate_outputs_carry_vllms_metrics(llm):
    """`out.metrics` as vLLM's offline outputs have it (reading it raised AttributeError): the
    request's times in vLLM's names, up to when its last sample finished."""
    before = time.time()
    outs = llm.generate(PROMPTS, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    after = time.time()
    for out in outs:
        m = out.metrics
        assert (m.arrival_time, m.first_scheduled_time, m.first_token_time) == (
            out.arrival_time,
            out.scheduled_time,
            out.first_token_time,
        )
        assert m.time_in_queue == pytest.approx(m.first_scheduled_time - m.arrival_time)
        assert before <= m.first_token_time <= m.last_token_time <= m.finished_time <= after
