"""Block-FP8 checkpoints (Qwen's FP8 release format) on CPU, fp32.

The oracle is independent of deltaserve's FP8 code: transformers runs the dequantized weights,
and a torch function mode quantizes the input of every matmul with a quantized weight per token
in groups of 128 channels (the w8a8 math of the format), written out again here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.overrides import TorchFunctionMode

from deltaserve.kernels.fp8.blocks import quantize_blocks

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
# several 128-column blocks with a partial last one, and fused sub-matrices of 144 rows
SHAPES = dict(hidden_size=160, intermediate_size=144)
# CUDA in fp32 is not the CPU's arithmetic (FLA's chunked kernels take TF32 dots, FP8 MMAs sum in
# less than fp32), and an activation whose e4m3 rounding flips then moves by a step of 6%
FP8_GPU_NATS = 2e-2
KEEP = (
    "lm_head",
    "embed_tokens",
    "mlp.gate.",
    "shared_expert_gate",
    "in_proj_ba",
    "in_proj_a.",
    "in_proj_b.",
)
PROMPTS = [[1, 5, 9, 2, 7, 3], [11, 4, 4, 8], list(range(20, 57))]


def _is_linear(name: str, t: torch.Tensor) -> bool:
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    kimi = leaf.endswith("proj_with_mqa") or (".experts." in name and leaf in ("w1", "w2", "w3"))
    return t.dim() == 2 and (leaf.endswith("proj") or leaf.startswith("in_proj_") or kimi)


def write_fp8(
    src: str, dst: Path, keep: tuple[str, ...] = KEEP, not_convert: list[str] | None = None
) -> Path:
    """`src` with its linear weights (but `keep`) as e4m3 + per-block weight_scale_inv."""
    shutil.copytree(src, dst)
    (file,) = sorted(dst.glob("*.safetensors"))
    out = {}
    for name, t in load_file(str(file)).items():
        if _is_linear(name, t) and not any(k in name for k in keep):
            q, s = quantize_blocks(t)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, s
        else:
            out[name] = t
    save_file(out, str(file), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    quant = {
        **FP8,
        "modules_to_not_convert": not_convert if not_convert is not None else ["lm_head", "mlp.gate"],
    }
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
    return dst


def write_dequantized(fp8_dir: Path, dst: Path) -> tuple[Path, set[str]]:
    """The FP8 checkpoint's weights dequantized to fp32 (an ordinary checkpoint), and the names
    of the dequantized weights."""
    shutil.copytree(fp8_dir, dst)
    (file,) = sorted(dst.glob("*.safetensors"))
    tensors = load_file(str(file))
    out, quantized = {}, set()
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(f"{name}_scale_inv")
        if scale is not None:
            rows, cols = t.shape
            full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            t = t.float() * full
            quantized.add(name)
        out[name] = t
    save_file(out, str(file), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, quantized


def act_round_trip(x: torch.Tensor) -> torch.Tensor:
    """Per token, per 128 channels: scale amax / 448, e4m3, back."""
    k = x.shape[-1]
    pad = (-k) % 128
    g = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, 128))
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0
    q = (g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s
    return q.flatten(-2)[..., :k].to(x.dtype)


class QuantizeInputs(TorchFunctionMode):
    """Quantizes the input of each F.linear whose weight lives in one of `storages`."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1]
            if w.untyped_storage().data_ptr() in self.storages:
                self.calls += 1
                args = (act_round_trip(x), *args[1:])
        return func(*args, **kwargs)


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager"
    ).eval()


def hf_w8a8_greedy(path: Path, quantized: set[str], prompts: list[list[int]], n: int) -> list[list[int]]:
    model = hf_model(path)
    by_name = dict(model.named_parameters())
    storages = set()
    for name, p in by_name.items():
        # the checkpoint's per-expert tensors live in transformers' fused expert stacks
        base = name.replace("model.language_model.", "model.")
        hit = base in quantized or any(
            q.startswith(base.rsplit(".", 1)[0] + ".") and ".experts." in q
            for q in quantized
            if base.endswith(("experts.gate_up_proj", "experts.down_proj"))
        )
        if hit:
            storages.add(p.untyped_storage().data_ptr())
    assert storages
    return greedy_quantizing_inputs(model, storages, prompts, n)[0]


def greedy_quantizing_inputs(
    model, storages: set[int], prompts: list[list[int]], n: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """`model`'s greedy tokens and prompt log-probabilities, the input of every F.linear whose
    weight lives in `storages` quantized as the format does."""
    mode = QuantizeInputs(storages)
    outs, lps = [], []
    with torch.no_grad(), mode:
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
            )
            outs.append(gen[0, len(p) :].tolist())
            lps.append(prompt_logprobs(model, p))
    assert mode.calls > 0
    return outs, lps


def prompt_logprobs(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


def hf_prompt_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    return prompt_logprobs(hf_model(path), prompt)


def ds_greedy(path, n: int, **kw) -> tuple[list[list[int]], list[torch.Tensor]]:
    from deltaserve import LLM
    from deltaserve.engine.requests.sampling_params import SamplingParams

    llm = LLM(model=str(path), device="cpu", dtype="float32", **kw)
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=n, temperature=0, prompt_logprobs=0), use_tqdm=False
    )
    lps = [torch.tensor([lp.logprob for lp in o.prompt_logprobs[1:]]) for o in outs]
    return [list(o.outputs[0].token_ids) for o in outs], lps


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next", "qwen3_5_moe"])
@pytest.mark.slow
def test_fp8_checkpoint_matches_w8a8_reference(kind: str, make_checkpoint, tmp_path: Path) -> None:
    fp8 = write_fp8(make_checkpoint(kind, **SHAPES), tmp_path / "fp8")
    deq, quantized = write_dequantized(fp8, tmp_path / "deq")
    tokens, lps = ds_greedy(fp8, 12)
    assert tokens == hf_w8a8_greedy(deq, quantized, PROMPTS, 12)
    # against transformers on the dequantized weights without activation quantization: the
    # activations' e4m3 rounding (2^-4 relative) is all that separates them
    worst = max(float((lp - hf_prompt_logprobs(deq, p)).abs().max()) for lp, p in zip(lps, PROMPTS))
    print(f"{kind}: max |prompt logprob - transformers (dequantized, unquantized activations)| = {worst:.4f}")
    assert 0 < worst < 0.25


def test_fp8_weights_are_stored_as_fp8(make_checkpoint, tmp_path: Path) -> None:
    from deltaserve.models.checkpoints.loader import load_model

    fp8 = write_fp8(make_checkpoint("qwen3_next", **SHAPES), tmp_path / "fp8")
    model = load_model(str(fp8), torch.float32, torch.device("cpu")).model
    layer = model.model.layers[0]
    assert layer.linear_attn.in_proj.weight.dtype == torch.float8_e4m3fn  # qkvz, then b|a unquantized
    assert layer.linear_attn.in_proj.dense_weight.shape[0] == 2 * 4
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert layer.mlp.gate.weight.dtype == torch.float32 and model.lm_head.weight.dtype == torch.float32
    assert not any(p.is_meta for p in model.parameters())
    # the norms before FP8 matmuls write their FP8 rows on CUDA; the last one feeds the LM head
    norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.linear_attn.norm]
    assert all(n.quantize for n in norms) and not model.model.norm.quantize
    assert model.model.layers[3].self_attn.quantize
    # decode's form of the mixed in_proj (one output from one op) is the module's two matmuls
    from deltaserve.kernels.fp8 import fp8_linear

    proj = layer.linear_attn.in_proj
    x = torch.randn(3, proj.in_features)
    both = fp8_linear(x, proj.weight, proj.weight_scale_inv, proj.scale_rows, dense=proj.dense_weight)
    assert both.shape == (3, proj.out_features)
    assert torch.equal(both, proj(x))


def test_modules_to_not_convert_is_honoured(make_checkpoint, tmp_path: Path) -> None:
    from deltaserve.models.checkpoints.loader import load_model

    src = make_checkpoint("qwen3_5", **SHAPES)
    # o_proj kept unquantized and listed: served unquantized
    fp8 = write_fp8(src, tmp_path / "a", keep=(*KEEP, "o_proj"), not_convert=["lm_head", "o_proj"])
    model = load_model(str(fp8), torch.float32, torch.device("cpu")).model
    attn = model.model.layers[3].self_attn
    assert attn.o_proj.weight.dtype == torch.float32 and attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    # listed but stored as FP8: the config and the files disagree
    bad = write_fp8(src, tmp_path / "b", not_convert=["lm_head", "o_proj"])
    with pytest.raises(ValueError, match="modules_to_not_convert"):
        load_model(str(bad), torch.float32, torch.device("cpu"))


def _edit(path: Path, change) -> None:
    (file,) = sorted(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_missing_or_misshapen_scales_are_errors(make_checkpoint, tmp_path: Path) -> None:
    from deltaserve.models.checkpoints.loader import load_model

    src = make_checkpoint("qwen3_5", **SHAPES)
    name = "model.layers.3.self_attn.o_proj.weight"
    no_scale = write_fp8(src, tmp_path / "a")
    _edit(no_scale, lambda t: t.pop(f"{name}_scale_inv"))
    with pytest.raises(ValueError, match=f"{name} is FP8.*no {name}_scale_inv"):
        load_model(str(no_scale), torch.float32, torch.device("cpu"))
    wrong = write_fp8(src, tmp_path / "b")
    _edit(wrong, lambda t: t.update({f"{name}_scale_inv": torch.ones(3, 3)}))
    with pytest.raises(ValueError, match=r"o_proj.weight_scale_inv has shape \(3, 3\), expected"):
        load_model(str(wrong), torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_online_quantization_equals_offline(kind: str, make_checkpoint, tmp_path: Path) -> None:
    src = make_checkpoint(kind, **SHAPES)
    offline = write_fp8(src, tmp_path / "fp8")
    online_tokens, online_lps = ds_greedy(src, 10, quantization="fp8")
    offline_tokens, offline_lps = ds_greedy(offline, 10)
    assert online_tokens == offline_tokens
    assert all(torch.equal(a, b) for a, b in zip(online_lps, offline_lps))
    # and it did quantize: the unquantized model's log-probabilities differ
    plain_lps = ds_greedy(src, 10)[1]
    assert not all(torch.equal(a, b) for a, b in zip(online_lps, plain_lps))


def test_dummy_fp8_weights(make_checkpoint, tmp_path: Path, caplog) -> None:
    from deltaserve.models.checkpoints.loader import load_model

    fp8 = write_fp8(make_checkpoint("qwen3_next", **SHAPES), tmp_path / "fp8")
    with caplog.at_level("INFO", logger="deltaserve"):
        model = load_model(str(fp8), torch.float32, torch.device("cpu"), load_format="dummy").model
    # the log says what happened: random weights, nothing read from the checkpoint's files
    assert "random weights" in caplog.text and "loading the weights" not in caplog.text
    layer = model.model.layers[3]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.down_proj.dtype == torch.float8_e4m3fn
    assert model.lm_head.weight.dtype == torch.float32
    # q (with its gate) 128 + k 32 + v 32 rows, 160 columns: 2 x 2 blocks, the last ones partial
    assert layer.self_attn.qkv_proj.weight_scale_inv.shape == (2, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_engine_on_cuda_matches_cpu(make_checkpoint, tmp_path):
    """A tiny FP8 Qwen3-Next on CUDA (fp32 activations) against the CPU reference engine: the
    first position's log-probabilities within FP8_GPU_NATS, and the greedy tokens up to the first
    position where the CPU's two likeliest tokens are closer than that (a near tie either may break)."""
    from deltaserve import LLM
    from deltaserve.engine.requests.sampling_params import SamplingParams

    src = make_checkpoint("qwen3_next", **SHAPES)
    fp8 = write_fp8(src, tmp_path / "fp8")
    # 20 prompts: decode batches of 17-32 rows take the skinny GEMM's 32-row MMAs on CUDA
    prompts = [[1, 5, 9, 2, 7, 3], list(range(20, 90))] + [[3 + j, 40 + 2 * j, 7, 11 + j] for j in range(18)]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5)

    def run(path, device: str, dtype: str) -> list:
        llm = LLM(model=str(path), device=device, dtype=dtype)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    def agreement(a: list, b: list) -> list[int]:
        return [sum(x == y for x, y in zip(p.token_ids, q.token_ids)) for p, q in zip(a, b)]

    cpu, gpu = run(fp8, "cpu", "float32"), run(fp8, "cuda", "float32")
    print(f"FP8 greedy tokens, CUDA vs the CPU reference (fp32): {agreement(cpu, gpu)} of 16 per prompt")
    print(f"bf16 vs FP8 on CUDA: {agreement(run(src, 'cuda', 'bfloat16'), run(fp8, 'cuda', 'bfloat16'))}")
    for c, g in zip(cpu, gpu):
        first_c, first_g = c.logprobs[0].top, g.logprobs[0].top
        print("first position, CPU / CUDA:", first_c, first_g)
        shared = first_c.keys() & first_g.keys()
        assert len(shared) >= 3
        assert max(abs(first_c[t] - first_g[t]) for t in shared) < FP8_GPU_NATS
        for pos, (lp, tok) in enumerate(zip(c.logprobs, c.token_ids)):
            if lp.logprob - max(v for t, v in lp.top.items() if t != tok) < FP8_GPU_NATS:
                break
            assert g.token_ids[pos] == tok, (pos, c.token_ids, g.token_ids)


# -- Kimi-Linear: MLA, KDA and experts named w1/w2/w3 -------------------------------------------


def _kimi_fp8(kimi_builder, kimi_config, tmp_path: Path, keep: tuple[str, ...] = KEEP) -> tuple[Path, Path]:
    """A tiny Kimi-Linear (160 channels: two 128-column blocks, the last partial) and the same in
    the FP8 format, every projection and expert quantized but the routers, the LM head and `keep`."""
    src = tmp_path / "kimi"
    kimi_builder(str(src), {**kimi_config, "hidden_size": 160})
    return src, write_fp8(str(src), tmp_path / "kimi_fp8", keep=keep)


def hf_kimi_w8a8(path: Path, prompts: list[list[int]], n: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """transformers on the dequantized weights, the input of every linear layer and expert stack
    quantized but the LM head's, the routers' and kv_b_proj's (which deltaserve dequantizes at
    load: its MLA kernels read the matrix): greedy tokens and prompt log-probabilities."""
    model = hf_model(path)
    storages = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(("lm_head", ".gate", "kv_b_proj")):
            storages.add(module.weight.untyped_storage().data_ptr())
        if name.endswith(".experts"):
            storages |= {p.untyped_storage().data_ptr() for p in module.parameters(recurse=False)}
    return greedy_quantizing_inputs(model, storages, prompts, n)


@pytest.mark.slow
def test_fp8_kimi_linear_matches_w8a8_reference(kimi_builder, kimi_config, tmp_path: Path) -> None:
    from deltaserve.models.checkpoints.loader import load_model

    src, fp8 = _kimi_fp8(kimi_builder, kimi_config, tmp_path)
    model = load_model(str(fp8), torch.float32, torch.device("cpu")).model
    kda, mla = model.model.layers[0], model.model.layers[1]
    assert mla.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert mla.self_attn.kv_a_proj_with_mqa.weight.dtype == torch.float8_e4m3fn
    assert mla.self_attn.kv_b_proj.weight.dtype == torch.float32  # dequantized at load
    assert kda.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    deq, _ = write_dequantized(fp8, tmp_path / "deq")
    tokens, lps = ds_greedy(fp8, 12)
    ref_tokens, ref_lps = hf_kimi_w8a8(deq, PROMPTS, 12)
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(lps, ref_lps)) < 1e-4
    # this tiny model's sharp logits (initializer_range 0.1) make the activations' e4m3 rounding
    # move log-probabilities by up to about 1.5 nats: reported, held to the w8a8 math above
    worst = max(float((lp - hf_prompt_logprobs(deq, p)).abs().max()) for lp, p in zip(lps, PROMPTS))
    print(
        f"kimi_linear: max |prompt logprob - transformers (dequantized, unquantized activations)| = {worst:.4f}"
    )
    assert worst > 0


@pytest.mark.slow
def test_kimi_online_quantization_equals_offline(kimi_builder, kimi_config, tmp_path: Path) -> None:
    """`--quantization fp8` on Kimi-Linear's spelling (experts w1/w2/w3, kv_a_proj_with_mqa)
    quantizes what the offline format does (but kv_b_proj, which it leaves alone: deltaserve
    would dequantize it at load)."""
    src, fp8 = _kimi_fp8(kimi_builder, kimi_config, tmp_path, keep=(*KEEP, "kv_b_proj"))
    online_tokens, online_lps = ds_greedy(src, 10, quantization="fp8")
    offline_tokens, offline_lps = ds_greedy(fp8, 10)
    assert online_tokens == offline_tokens
    assert all(torch.equal(a, b) for a, b in zip(online_lps, offline_lps))


@pytest.mark.slow
def test_fp8_fused_shared_experts_change_nothing(
    make_checkpoint, kimi_builder, kimi_config, tmp_path: Path, fuse_on_cpu
) -> None:
    """FP8 shared experts fuse into FP8 routed experts (block scales widened to the stack's
    per-row ones where its fused gate|up needs those), and change nothing: fp32 on CPU."""
    qwen = write_fp8(make_checkpoint("qwen3_next", **SHAPES), tmp_path / "fp8")
    _, kimi = _kimi_fp8(kimi_builder, kimi_config, tmp_path)
    before = [ds_greedy(path, 8) for path in (qwen, kimi)]
    counts = fuse_on_cpu()
    after = [ds_greedy(path, 8) for path in (qwen, kimi)]
    assert counts == [4, 3]  # every MoE block of each
    for (tokens, lps), (fused_tokens, fused_lps) in zip(before, after):
        assert fused_tokens == tokens
        for a, b in zip(fused_lps, lps):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
