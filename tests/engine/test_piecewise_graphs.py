"""Piecewise CUDA graphs (`--enable-piecewise-cuda-graph`): steps with prefill chunks replay the
forward's pieces between the attention and linear-attention ops, and give the tokens that eager
steps give (fp32, so that the two differ in nothing but replay)."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.runner.piecewise_graphs import piecewise_sizes
from deltaserve.server.cli import build_parser

LENGTHS = [1, 9, 64, 65, 130, 300, 17, 200, 47]


def test_piecewise_sizes_double_up_to_the_most_tokens() -> None:
    assert piecewise_sizes(512) == [16, 32, 64, 128, 256, 512]
    assert piecewise_sizes(100) == [16, 32, 64, 100]
    assert piecewise_sizes(16) == [16]


def test_the_flags_reach_the_engine_config(make_checkpoint) -> None:
    from deltaserve.server.launch import _engine_config

    base = ["serve", "--model", make_checkpoint("qwen3_5"), "--device", "cpu"]
    parse = build_parser().parse_args
    assert _engine_config(parse(base)).piecewise_cuda_graph_max_tokens == 0  # off unless asked
    on = _engine_config(parse([*base, "--enable-piecewise-cuda-graph"]))
    assert on.piecewise_cuda_graph_max_tokens == 512
    capped = [*base, "--enable-piecewise-cuda-graph", "--piecewise-cuda-graph-max-tokens", "128"]
    assert _engine_config(parse(capped)).piecewise_cuda_graph_max_tokens == 128


def run(path: str, max_tokens: int, vocab: int, **kw) -> tuple[list[list[int]], LLM]:
    """Greedy tokens of prompts of LENGTHS, prefilled in chunks of 64 beside the others' decodes."""
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in LENGTHS]
    llm = LLM(path, device="cuda", dtype="float32", chunked_prefill_size=64, max_num_batched_tokens=96,
              piecewise_cuda_graph_max_tokens=max_tokens, max_running_requests=16, **kw)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe", "kimi"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_piecewise_steps_give_the_eager_steps_tokens(
    kind, make_checkpoint, tmp_path_factory, kimi_builder, kimi_config, pools_held
):
    """Pieces of up to 64 tokens: steps of 96 tokens run eagerly beside replayed smaller ones."""
    if kind == "kimi":
        path = str(tmp_path_factory.mktemp("kimi"))
        kimi_builder(path, kimi_config)
        vocab = int(kimi_config["vocab_size"])
    else:
        path, vocab = make_checkpoint(kind), 160
    eager, _ = run(path, 0, vocab)
    pieces, llm = run(path, 64, vocab)
    runner = llm.engine.runner
    assert runner.piecewise is not None and runner.piecewise.replays > 0
    assert pieces == eager
    assert not pools_held(llm)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_piecewise_steps_at_real_head_sizes(real_heads_checkpoint, pools_held):
    eager, _ = run(real_heads_checkpoint, 0, 1024)
    pieces, llm = run(real_heads_checkpoint, 512, 1024)
    assert llm.engine.runner.piecewise.replays > 0
    assert pieces == eager
    assert not pools_held(llm)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_piecewise_steps_with_fp8_weights(kind, make_checkpoint, pools_held):
    """FP8 linears and experts (quantized at load, 160 wide: a partial 128-block) inside the pieces."""
    path = make_checkpoint(kind, hidden_size=160, intermediate_size=144)
    eager, _ = run(path, 0, 160, quantization="fp8")
    pieces, llm = run(path, 64, 160, quantization="fp8")
    assert llm.engine.runner.piecewise.replays > 0
    assert pieces == eager
    assert not pools_held(llm)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe", pytest.param("kimi", marks=pytest.mark.slow)])
def test_the_recorder_stands_in_for_each_op_with_its_outputs_shape(
    kind, make_checkpoint, tmp_path_factory, kimi_builder, kimi_config
):
    """What the next piece reads from an op is a buffer made at capture from the op's inputs: every
    op the backends run (attention, MLA, conv, the delta rule, KDA) returns that shape and dtype."""
    from deltaserve.engine.runner.piecewise_graphs import _Pieces, _Recorder

    if kind == "kimi":
        path = str(tmp_path_factory.mktemp("kimi"))
        kimi_builder(path, kimi_config)
    else:
        path = make_checkpoint(kind)
    llm = LLM(path, device="cpu", dtype="float32")
    runner = llm.engine.runner
    calls = []
    for backend in (runner.attn, runner.linear):
        for name in ("attention", "mla_attention", "conv", "delta_rule", "kda"):
            real = getattr(backend, name, None)
            if real is not None:

                def spy(*args, _real=real, _name=name):
                    out = _real(*args)
                    calls.append((_name, args, out))
                    return out

                setattr(backend, name, spy)
    llm.generate([{"prompt_token_ids": [3, 5, 7, 11, 13]}], SamplingParams(temperature=0.0, max_tokens=2))
    recorder = _Recorder(_Pieces(5), set(), None, capture=False)
    names = {name for name, _, _ in calls}
    assert {"conv"} < names and names & {"attention", "mla_attention"} and names & {"delta_rule", "kda"}
    for name, args, out in calls:
        stand_in = getattr(recorder, name)(*args)
        assert (stand_in.shape, stand_in.dtype) == (out.shape, out.dtype), name


class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: captures nothing, counts its pieces."""

    def capture_begin(self, pool=None) -> None:
        pass

    def capture_end(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["qwen3_next", pytest.param("kimi", marks=pytest.mark.slow)])
def test_a_capture_cuts_the_forward_at_every_op_and_slices_only_its_activations(
    kind, make_checkpoint, tmp_path_factory, kimi_builder, kimi_config
):
    """One piece more than ops, a mixer's op or two a layer; the arguments cut to a step's rows are
    the forward's own tensors of the captured token count, never the model's weights, even one
    with as many rows as the capture has tokens (GDN's A_log, MLA's kv_b_proj)."""
    from deltaserve.engine.runner.piecewise_graphs import _Pieces, _Recorder, model_tensors

    if kind == "kimi":
        path = str(tmp_path_factory.mktemp("kimi"))
        kimi_builder(path, kimi_config)
    else:
        path = make_checkpoint(kind)
    model = LLM(path, device="cpu", dtype="float32").engine.runner.model
    weight = "kv_b_proj.weight" if kind == "kimi" else "linear_attn.A_log"
    tokens = next(p.shape[0] for n, p in model.named_parameters() if n.endswith(weight))
    owned = model_tensors(model)
    pieces = _Pieces(tokens)
    recorder = _Recorder(pieces, owned, None, capture=True, new_graph=FakeGraph)
    recorder.begin()
    with torch.inference_mode():
        hidden = model(torch.arange(tokens), torch.arange(tokens), recorder)
    recorder.end()
    assert hidden.shape[0] == tokens and len(pieces.graphs) == len(pieces.splits) + 1
    assert len(model.model.layers) <= len(pieces.splits) <= 2 * len(model.model.layers)
    kept_whole = 0
    for split in pieces.splits:
        for arg, cut in zip(split.args, split.sliced):
            if isinstance(arg, torch.Tensor):
                assert cut == (arg.data_ptr() not in owned and arg.shape[0] == tokens), (
                    split.name,
                    arg.shape,
                )
                kept_whole += not cut and arg.shape[0] == tokens
    assert kept_whole  # the weight of as many rows as tokens reached an op, whole
