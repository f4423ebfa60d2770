"""Sampling by graph replay (engine/sampling/sampler_graphs.py) gives the eager sampler's tokens.

On CPU the capture is replaced by a stand-in that keeps what a CUDA graph keeps: static
buffers read at replay and one output tensor overwritten by every replay of its graph. Seeded
rows draw their noise from their own generator over the whole vocabulary whatever the ranking
width, so the two paths must agree on them exactly; greedy rows need no noise. The GPU test
(tests/engine/test_gpu_engine.py) does the same with real graphs.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.request import Request
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.sampling.sampler import Sampler
from deltaserve.engine.sampling.sampler_graphs import TOPK_BUCKETS


class StandIn:
    """Captures by running the body once; a replay runs it again into the same output."""

    def __init__(self) -> None:
        self.captured = 0

    def __call__(
        self, body: Callable[[], torch.Tensor], pool: object
    ) -> tuple[Callable[[], None], torch.Tensor]:
        self.captured += 1
        out = body()

        def replay() -> None:
            out.copy_(body())

        return replay, out


def request(params: SamplingParams, output: list[int], seed_gen: Sampler) -> Request:
    r = Request("r", [1, 2, 3, 4], params, IncrementalDetokenizer(None))
    r.output_token_ids = list(output)
    r.generator = seed_gen.new_generator(params.seed)
    return r


ROWS = {
    "plain": [dict(temperature=0.7), dict(temperature=1.3, min_p=0.05), dict(temperature=0.0)],
    "qwen": [dict(temperature=0.6, top_p=0.95, top_k=20)] * 3,
    "topk-mixed": [dict(top_k=5), dict(top_k=70, top_p=0.8), dict(temperature=0.0, top_k=1), dict(top_k=300)],
    "sort": [dict(top_p=0.9), dict(top_k=20), dict(temperature=0.0)],
    "large-k": [dict(top_k=2000), dict(top_k=3, min_p=0.1)],
    "penalties": [
        dict(top_k=20, presence_penalty=1.5),
        dict(repetition_penalty=1.3, logit_bias={7: 5.0}),
        dict(temperature=0.0, frequency_penalty=0.5, min_tokens=9),
    ],
}


def sample_both(rows: list[dict], steps: int, vocab: int = 3000) -> tuple[list, list, StandIn, Sampler]:
    gen = torch.Generator().manual_seed(len(rows))
    stand_in = StandIn()
    eager = Sampler(torch.device("cpu"), 0, eos_token_ids=[2])
    graphed = Sampler(torch.device("cpu"), 0, eos_token_ids=[2], graph_max_bs=8, capture=stand_in)
    params = [SamplingParams(**{"temperature": 1.0, "seed": 10 + i, **r}) for i, r in enumerate(rows)]
    history = [[int(t) for t in torch.randint(0, vocab, (6,), generator=gen)] for _ in rows]
    reqs_e = [request(p, h, eager) for p, h in zip(params, history)]
    reqs_g = [request(p, h, graphed) for p, h in zip(params, history)]
    got_e, got_g = [], []
    for _ in range(steps):
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        logits[:, 2] = 8.0  # the eos: banned while min_tokens is not reached
        te = eager.sample_tokens(logits, reqs_e).tolist()
        tg = graphed.sample_tokens(logits, reqs_g).tolist()
        got_e.append(te)
        got_g.append(tg)
        for r, t in zip(reqs_e, te):
            r.output_token_ids.append(t)
        for r, t in zip(reqs_g, tg):
            r.output_token_ids.append(t)
    return got_e, got_g, stand_in, graphed


@pytest.mark.parametrize("name", list(ROWS))
def test_graph_replay_gives_the_eager_tokens(name):
    eager, graphed, stand_in, sampler = sample_both(ROWS[name], steps=6)
    assert graphed == eager
    assert sampler.graphs is not None and sampler.graphs.replays == 6
    assert stand_in.captured == 1  # one (size, width) key, captured once and replayed
    # the run really sampled (not every row greedy or forced)
    assert len({tuple(step) for step in eager}) > 1


def test_widths_and_padded_sizes():
    sampler = Sampler(torch.device("cpu"), 0, [], graph_max_bs=8, capture=StandIn())
    logits = torch.randn(3, 5000)
    sampler.sample_tokens(logits, [request(SamplingParams(top_k=20), [], sampler) for _ in range(3)])
    graphs = sampler.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    assert graphs.width([request(SamplingParams(top_k=20), [], sampler)]) == TOPK_BUCKETS[0]
    assert graphs.width([request(SamplingParams(top_k=200, top_p=0.5), [], sampler)]) == 256
    assert graphs.width([request(SamplingParams(top_p=0.5), [], sampler)]) == 5000
    assert graphs.width([request(SamplingParams(top_k=5000), [], sampler)]) == 5000
    assert graphs.width([request(SamplingParams(min_p=0.2), [], sampler)]) == 0
    assert list(graphs.graphs) == [(4, TOPK_BUCKETS[0], False)]  # 3 rows replay the 4-row graph
    # more rows than the largest graph, or another vocabulary: sampled eagerly
    many = [request(SamplingParams(seed=1), [], sampler) for _ in range(9)]
    assert sampler.sample_tokens(torch.randn(9, 5000), many).shape == (9,)
    assert sampler.sample_tokens(torch.randn(2, 100), many[:2]).shape == (2,)
    assert graphs.replays == 1


MATES = {
    "alone": [],
    "top_p": [dict(top_p=0.5)],  # the batch sorts the whole vocabulary
    "top_k": [dict(top_k=5)] * 4,  # every row of four with a small top-k: the k best ranked
    "large_k": [dict(top_k=2000), dict(temperature=0.0)],
}


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("own", [dict(), dict(top_k=50)], ids=["plain", "own_top_k"])
def test_seeded_row_draws_alike_whatever_its_batch_ranks(graphs, own):
    """A seeded row draws the same tokens alone and beside rows whose top-k or top-p make the
    batch rank its tokens: its noise is raced by token id, not by rank."""
    vocab, steps = 3000, 12
    gen = torch.Generator().manual_seed(1)
    logits = [torch.randn(4 + 1, vocab, generator=gen) * 3 for _ in range(steps)]
    drawn = {}
    for name, mates in MATES.items():
        capture = StandIn() if graphs else None
        sampler = Sampler(torch.device("cpu"), 0, [], graph_max_bs=8 if graphs else 0, capture=capture)
        params = [SamplingParams(temperature=1.0, seed=5, **own)] + [SamplingParams(**m) for m in mates]
        reqs = [request(p, [], sampler) for p in params]
        drawn[name] = [int(sampler.sample_tokens(step[: len(reqs)], reqs)[0]) for step in logits]
    assert len(set(drawn["alone"])) > steps // 2  # it really sampled
    assert all(d == drawn["alone"] for d in drawn.values()), drawn


def test_failed_capture_falls_back_to_eager():
    def broken(body, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    sampler = Sampler(torch.device("cpu"), 0, [], graph_max_bs=8, capture=broken)
    reqs = [request(SamplingParams(seed=5, top_k=4), [], sampler)]
    logits = torch.randn(1, 50)
    first = sampler.sample_tokens(logits, reqs)
    assert sampler.graphs is not None and sampler.graphs.failed and first.shape == (1,)
    plain = Sampler(torch.device("cpu"), 0, [])
    again = [request(SamplingParams(seed=5, top_k=4), [], plain)]
    # a fresh seeded request through the eager sampler draws what the fallback drew
    assert plain.sample_tokens(logits, again).tolist() == first.tolist()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.slow
def test_engine_with_sampler_graphs_matches_eager(make_checkpoint, pools_held, overlap):
    """Seeded sampling, greedy rows and stops through the whole engine (overlap: the token
    views of the graph's output feed the next step's inputs) give the eager sampler's outputs."""
    path = make_checkpoint("qwen3_5")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 160, (n,), generator=gen).tolist() for n in (3, 17, 40, 9, 66)]
    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=i, max_tokens=12, ignore_eos=True)
        if i % 3
        else SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        for i in range(len(prompts))
    ]

    def outputs(graphs: bool) -> tuple[dict, Engine]:
        cfg = EngineConfig(
            model=path,
            dtype="float32",
            device="cpu",
            chunked_prefill_size=32,
            max_running_requests=4,
            enable_overlap_schedule=overlap,
        )
        eng = Engine(cfg)
        if graphs:
            eng.sampler.graph_max_bs, eng.sampler.capture = 4, StandIn()
        for i, (p, sp) in enumerate(zip(prompts, params)):
            eng.add_request(str(i), p, sp)
        done = {}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        return done, eng

    eager, _ = outputs(False)
    graphed, eng = outputs(True)
    assert graphed == eager
    assert eng.sampler.graphs is not None and eng.sampler.graphs.replays > 10
    assert not pools_held(eng)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("name", list(ROWS))
def test_cuda_graphs_give_the_eager_tokens(name):
    """Real CUDA graphs at Qwen3.5's vocabulary against the eager sampler, seeded rows."""
    dev = torch.device("cuda")
    vocab = 248320
    rows = ROWS[name]
    params = [SamplingParams(**{"temperature": 1.0, "seed": 10 + i, **r}) for i, r in enumerate(rows)]
    eager = Sampler(dev, 0, eos_token_ids=[2])
    graphed = Sampler(dev, 0, eos_token_ids=[2], graph_max_bs=32)
    reqs_e = [request(p, [5, 6, 7], eager) for p in params]
    reqs_g = [request(p, [5, 6, 7], graphed) for p in params]
    gen = torch.Generator(device=dev).manual_seed(3)
    for _ in range(5):
        logits = torch.randn(len(rows), vocab, generator=gen, device=dev) * 3
        te = eager.sample_tokens(logits, reqs_e).tolist()
        tg = graphed.sample_tokens(logits, reqs_g).tolist()
        assert tg == te
        for r, t in zip(reqs_e + reqs_g, te + tg):
            r.output_token_ids.append(t)
    assert graphed.graphs is not None and graphed.graphs.replays == 5


@pytest.mark.gpu
@cuda
def test_cuda_engine_sampler_graphs_match_eager(make_checkpoint, pools_held):
    """The engine on CUDA (decode graphs, overlap) with sampler graphs gives the outputs of
    eager sampling: seeded Qwen3.5 defaults and greedy rows, fp32."""
    from deltaserve import LLM

    path = make_checkpoint(
        "qwen3_5", hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32
    )
    gen = torch.Generator().manual_seed(11)
    prompts = [
        {"prompt_token_ids": torch.randint(0, 160, (n,), generator=gen).tolist()} for n in (5, 30, 70, 12)
    ]
    params = [
        SamplingParams(temperature=0.6, top_k=20, top_p=0.95, seed=i, max_tokens=20, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        for i in range(len(prompts))
    ]
    kw = dict(device="cuda", dtype="float32", chunked_prefill_size=64, max_running_requests=8)
    graphed = LLM(path, **kw)
    assert graphed.engine.sampler.graph_max_bs > 0
    plain = LLM(path, **kw)
    plain.engine.sampler.graph_max_bs = 0
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert got == want
    assert graphed.engine.sampler.graphs is not None and graphed.engine.sampler.graphs.replays > 10
    assert not pools_held(graphed)
