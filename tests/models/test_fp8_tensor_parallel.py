"""Block-FP8 checkpoints under tensor parallelism, on CPU (gloo), fp32.

Each rank's FP8 shard, dequantized, must be that rank's shard of the dequantized checkpoint, and
two ranks must generate one process's greedy tokens, for FP8 checkpoints and for `--quantization
fp8`. A rank whose input columns would split the format's 128-column blocks is a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltaserve import LLM
from deltaserve.kernels.fp8.blocks import dequantize_blocks
from deltaserve.models.checkpoints.loader import load_model
from deltaserve.models.checkpoints.quantization import Fp8Experts, Fp8Linear
from deltaserve.models.parallel import TensorParallel

from .test_fp8_checkpoints import SHAPES, write_dequantized, write_fp8
from .test_tensor_parallel import ENGINE, greedy, logprobs, random_prompts, run_ranks

# a flipped activation rounding moves a tiny model's log-probabilities by hundredths of a nat
FLIP = 0.05

# every row-parallel input (attention 4 x 64, GDN values 4 x 64, MLPs and experts 256) halves
# into whole 128-column blocks; the column-parallel halves (64-row heads) split scale blocks
TP_SHAPES = dict(
    hidden_size=160,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=256,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=256,
)
# Kimi-Linear's: MLA 2 heads x 128 values, KDA 2 x 128, experts and the shared expert 256 wide
KIMI_TP_SHAPES = dict(
    hidden_size=160, v_head_dim=128, linear_head_dim=128, intermediate_size=256, moe_intermediate_size=256
)


def dequantized_params(path: Path, rank: int, size: int, ep: bool = False) -> dict[str, torch.Tensor]:
    """A rank's parameters with its FP8 holders' weights dequantized (and their unquantized rows
    appended), under the names the plain model gives them."""
    tp = TensorParallel(rank, size, expert_parallel=ep)
    model = load_model(str(path), torch.float32, torch.device("cpu"), tp=tp).model
    out = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        if isinstance(module, Fp8Linear) and module.weight_scale_inv is not None:
            w = dequantize_blocks(module.weight, module.weight_scale_inv, module.scale_rows)
            if module.dense_weight is not None:
                w = torch.cat([w, module.dense_weight])
            out[dot + "weight"] = w
        elif isinstance(module, Fp8Experts) and module.down_scale is not None:
            assert module.gate_up_scale is not None
            for name, scale in (("gate_up_proj", module.gate_up_scale), ("down_proj", module.down_scale)):
                out[dot + name] = dequantize_blocks(getattr(module, name), scale, module.scale_rows)
    for name, p in model.named_parameters():
        out.setdefault(name, p.data)
    return out


def assert_shards_dequantize_alike(fp8: Path, tmp_path: Path, ep: bool) -> None:
    """Each of two ranks' FP8 shards, dequantized, is that rank's shard of the dequantized checkpoint."""
    deq, quantized = write_dequantized(fp8, tmp_path / "deq")
    assert quantized
    for rank in (0, 1):
        got = dequantized_params(fp8, rank, 2, ep)
        tp = TensorParallel(rank, 2, expert_parallel=ep)
        want = dict(load_model(str(deq), torch.float32, torch.device("cpu"), tp=tp).model.named_parameters())
        assert set(got) == set(want)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w.data, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(("kind", "ep"), [("qwen3_next", False), ("qwen3_next", True), ("qwen3_5", False)])
def test_qwen_fp8_shards_are_the_dequantized_checkpoints_shards(kind, ep, make_checkpoint, tmp_path):
    fp8 = write_fp8(make_checkpoint(kind, **TP_SHAPES), tmp_path / "fp8")
    assert_shards_dequantize_alike(fp8, tmp_path, ep)
    # and they are FP8: rank 0 holds e4m3 halves of the row-parallel projections
    model = load_model(str(fp8), torch.float32, torch.device("cpu"), tp=TensorParallel(0, 2)).model
    o_proj = model.model.layers[3].self_attn.o_proj
    assert o_proj.weight.dtype == torch.float8_e4m3fn and o_proj.weight.shape == (160, 128)


@pytest.mark.parametrize("ep", [False, True])
def test_kimi_fp8_shards_are_the_dequantized_checkpoints_shards(ep, kimi_builder, kimi_config, tmp_path):
    """MLA (kv_b_proj dequantized at load), KDA, experts spelled w1/w2/w3, shared experts."""
    src = tmp_path / "kimi"
    kimi_builder(str(src), {**kimi_config, **KIMI_TP_SHAPES})
    assert_shards_dequantize_alike(write_fp8(str(src), tmp_path / "fp8"), tmp_path, ep)


def test_columns_that_split_a_scale_block_are_a_clear_error(make_checkpoint, tmp_path):
    """SHAPES' GDN layers have 32 value columns: rank 1's 16-31 would split the first 128-column
    block (so would its MLP's 72 of 144 intermediate columns)."""
    fp8 = write_fp8(make_checkpoint("qwen3_5", **SHAPES), tmp_path / "fp8")
    for load_format in ("auto", "dummy"):  # random weights of these shapes are refused alike
        with pytest.raises(
            ValueError,
            match=r"out_proj.weight: a tensor-parallel rank would hold its input columns 16-32 of 32, which split",
        ):
            load_model(
                str(fp8), torch.float32, torch.device("cpu"), load_format=load_format, tp=TensorParallel(1, 2)
            )


def test_dummy_fp8_shards_load(make_checkpoint, tmp_path):
    fp8 = write_fp8(make_checkpoint("qwen3_next", **TP_SHAPES), tmp_path / "fp8")
    model = load_model(
        str(fp8), torch.float32, torch.device("cpu"), load_format="dummy", tp=TensorParallel(1, 2)
    ).model
    attn = model.model.layers[3].self_attn
    assert attn.o_proj.weight.dtype == torch.float8_e4m3fn and attn.o_proj.in_features == 128
    assert model.model.layers[0].mlp.experts.down_proj.shape == (4, 160, 128)
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.slow
def test_tp2_fp8_equals_tp1_but_for_rounding_flips(make_checkpoint, tmp_path):
    """Two gloo ranks against one process: an FP8 Qwen3-Next (also with expert parallelism), and
    a plain Qwen3.5 quantized at load (each rank quantizes the blocks one process would).

    The row-parallel layers' partial sums are added in another order than one process's matmul,
    an ulp apart, and the next layer's per-token e4m3 rounding can turn that into a step of 6% in
    one activation (unquantized models see only the ulp), which moves the log-probabilities of
    that token and the ones after it by up to hundredths of a nat. So log-probabilities must be
    one process's within FLIP nats, and the greedy tokens one process's up to the first position
    whose two likeliest tokens are within FLIP of each other."""
    src = make_checkpoint("qwen3_5", **TP_SHAPES)
    fp8 = str(write_fp8(make_checkpoint("qwen3_next", **TP_SHAPES), tmp_path / "fp8"))
    prompts = random_prompts(160, [1, 7, 33, 100, 60], seed=3)
    cases = [
        {"path": fp8, "prompts": prompts, "logprobs": True},
        {"path": fp8, "prompts": prompts, "logprobs": True, "expert_parallel": True},
        {"path": src, "prompts": prompts, "logprobs": True, "engine": {"quantization": "fp8"}},
    ]
    ranks = run_ranks(tmp_path, cases)
    for i, case in enumerate(cases):
        assert ranks[0][i]["again"] == ranks[0][i]["first"], i  # the prefix cache changes nothing
        assert ranks[1][i] == ranks[0][i], i  # every rank sampled the same tokens
        single = logprobs(LLM(case["path"], **ENGINE, **case.get("engine", {})), case["prompts"])
        diffs = [
            abs(a - b)
            for one, tp2 in zip(single, ranks[0][i]["logprobs"])
            for a, b in zip(one["prompt"], tp2["prompt"], strict=True)
        ]
        assert max(diffs) < FLIP, (i, max(diffs))  # a misplaced shard is off by nats, not hundredths
        assert min(diffs) < 1e-5, i
        for one, tp2 in zip(single, ranks[0][i]["logprobs"]):
            for pos, (tok, (first, second)) in enumerate(zip(one["tokens"], one["top"])):
                if first - second < FLIP:
                    break
                assert tp2["tokens"][pos] == tok, (i, pos, one["tokens"], tp2["tokens"])
    # the quantized model is not the plain one
    assert greedy(LLM(src, **ENGINE), prompts) != ranks[0][2]["first"]


def test_quantizing_at_load_reads_parts_widened_to_whole_blocks():
    """`--quantization fp8` under tensor parallelism reads a rank's rows or columns widened to whole
    128 x 128 blocks (clipped at the weight's edge), not the whole weight; an expert part as it is."""
    from deltaserve.models.checkpoints.quantization import Fp8Config, read_narrow, whole_blocks
    from deltaserve.models.parallel import Narrow

    assert whole_blocks(Narrow(0, ((64, 64), (320, 100))), (500, 256)) == Narrow(0, ((0, 128), (256, 244)))
    assert whole_blocks(Narrow(1, ((128, 128),)), (160, 256)) == Narrow(1, ((128, 128),))
    assert whole_blocks(Narrow(-1, ((0, 100),)), (4, 160, 300)) == Narrow(2, ((0, 128),))
    assert whole_blocks(Narrow(0, ((2, 2),)), (4, 256, 160)) == Narrow(0, ((2, 2),))
    parts = {"a.q_proj.weight": Narrow(0, ((64, 64),)), "a.o_proj.weight": None}
    headers = [(n, "F32", [256, 160]) for n in parts] + [("a.norm.weight", "F32", [160])]
    read = read_narrow(lambda name, shape: parts.get(name), headers, Fp8Config(), quantize=True)
    assert read("a.q_proj.weight", (256, 160)) == Narrow(0, ((0, 128),))
    assert read("a.o_proj.weight", (256, 160)) is None  # the rank holds it whole


@pytest.mark.parametrize("kind,ep", [("qwen3_5", False), ("qwen3_next", False), ("qwen3_next", True)])
def test_quantizing_at_load_gives_each_rank_the_fp8_checkpoints_shard(kind, ep, make_checkpoint, tmp_path):
    """Each of two ranks quantizing its parts of a plain checkpoint at load holds, bit for bit,
    its shard of that checkpoint quantized whole (TP_SHAPES' 64-row heads put half a row block on
    each rank)."""
    src = make_checkpoint(kind, **TP_SHAPES)
    fp8 = write_fp8(src, tmp_path / "fp8")
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=ep)
        at_load = load_model(src, torch.float32, torch.device("cpu"), quantization="fp8", tp=tp).model
        stored = load_model(str(fp8), torch.float32, torch.device("cpu"), tp=tp).model.state_dict()
        got = at_load.state_dict()
        assert got.keys() == stored.keys()
        assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
        for name, t in got.items():
            want = stored[name]
            assert t.dtype == want.dtype and t.shape == want.shape, name
            if t.dtype == torch.float8_e4m3fn:
                t, want = t.view(torch.uint8), want.view(torch.uint8)
            assert torch.equal(t, want), name
