"""CUDA-graph plumbing on CPU: the graph runner with each capture replaced by a stand-in that
replays the way a captured graph does (the backends' metadata as it was at capture, pointing
into the buffers; the contents filled before replay) gives the eager engine's greedy tokens,
for decode graphs and for speculative verification graphs. Real capture runs on the GPU
(`tests/engine/test_gpu_engine.py`, `tests/engine/spec_decode/test_spec_decode_gpu.py`)."""

from __future__ import annotations

import copy

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.runner.cuda_graphs import CudaGraphRunner

K = 3
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "cuda_graph": True}
LINEAR_STATE = (
    "num_decodes",
    "decode_slots",
    "num_verify_tokens",
    "verify_slots",
    "verify_pad_index",
    "verify_width",
    "prefill_slots",
    "prefill_cu_seqlens",
    "prefill_has_initial",
)


class StandInGraph:
    """What a capture bakes: the metadata objects and tensor views the backends held."""

    def __init__(self, runner: CudaGraphRunner, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        self.runner, self.input_ids, self.positions = runner, input_ids, positions
        self.attn = copy.copy(runner.attn.batch)
        self.linear = {name: getattr(runner.linear, name) for name in LINEAR_STATE}
        self.out = runner.body(input_ids, positions)

    def replay(self) -> None:
        self.runner.attn.batch = self.attn
        for name, value in self.linear.items():
            setattr(self.runner.linear, name, value)
        self.out.copy_(self.runner.body(self.input_ids, self.positions))


def with_stand_in_graphs(llm: LLM, monkeypatch) -> CudaGraphRunner:
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    def capture(self, input_ids, positions):
        graph = StandInGraph(self, input_ids, positions)
        return graph, graph.out

    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)
    runner = llm.engine.runner
    max_pages = -(-runner.sizes.max_model_len // llm.engine.config.page_size)
    with torch.inference_mode():
        graphs = CudaGraphRunner(runner._decode_body, runner.attn, runner.linear, 8, max_pages, runner.device)
        if runner.window is not None:
            graphs.capture_verify(K + 1, runner.window.rows)
    runner.graph_runner = graphs
    return graphs


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    phrases = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (3, 5, 7)]
    return [p * 6 for p in phrases] + [torch.randint(0, 160, (n,), generator=g).tolist() for n in (1, 40, 70)]


def greedy(llm: LLM, ps: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]


def make(path: str, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", chunked_prefill_size=32, max_running_requests=8, **kw)


@pytest.mark.slow
def test_decode_and_verification_graphs_replay_as_eager(make_checkpoint, monkeypatch):
    path = make_checkpoint("qwen3_5")
    ps = prompts()
    plain = greedy(make(path), ps)

    decoding = make(path)
    graphs = with_stand_in_graphs(decoding, monkeypatch)
    assert greedy(decoding, ps) == plain
    assert graphs.decode.replays > 0

    speculating = make(path, speculative_config=SPEC)
    graphs = with_stand_in_graphs(speculating, monkeypatch)
    assert greedy(speculating, ps) == plain
    assert graphs.verify is not None and graphs.verify.replays > 0
    assert speculating.engine.stats()["spec_accepted_tokens_total"] > 0
