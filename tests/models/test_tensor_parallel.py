"""Tensor parallelism of the models: two CPU ranks (gloo) give transformers' greedy tokens.

Each rank loads its shard with `load_model(..., tp=...)` and runs its own offline engine on
the same prompts: scheduling is deterministic, so the ranks' collectives line up without a
scheduler on rank 0. The ranks' tokens must equal one process's (TP = 1) and transformers'.
The loader tests read each rank's shard without a process group (loading runs no
collective) and hold it to the checkpoint's tensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import traceback
from typing import Any

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.models.checkpoints.loader import iter_safetensors, load_model
from deltaserve.models.layers.common import Experts
from deltaserve.models.parallel import TensorParallel

NEW_TOKENS = 8
ENGINE = dict(
    dtype="float32",
    device="cpu",
    chunked_prefill_size=32,  # the 100- and 150-token prompts span several chunks
    max_num_batched_tokens=64,
    max_running_requests=4,  # more prompts than slots: requests wait and join mid-run
    pool_memory_gb=0.05,  # the same pools on every rank, whatever memory is free
    max_model_len=512,
)


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def generate(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """(greedy tokens, draft tokens proposed)."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], sum(o.num_draft_tokens for o in outs)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return generate(llm, prompts)[0]


def logprobs(llm: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """Per prompt: its log-probabilities and, at each greedy token, the two likeliest tokens'."""
    params = SamplingParams(
        temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2, prompt_logprobs=0
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        {
            "prompt": [lp.logprob for lp in o.prompt_logprobs[1:]],  # type: ignore[union-attr]
            "top": [sorted(lp.top.values(), reverse=True)[:2] for lp in o.outputs[0].logprobs],  # type: ignore[union-attr]
            "tokens": o.outputs[0].token_ids,
        }
        for o in outs
    ]


def _rank(
    rank: int, size: int, rendezvous: str, cases: list[dict[str, Any]], engine: dict[str, Any], out_dir: str
) -> None:
    """One rank: every case's greedy tokens (each prompt set twice, the second a prefix-cache
    hit) to `out_dir/rank{rank}.json`, or the error to `rank{rank}.err`. On CUDA, rank r runs
    on GPU r over NCCL; on CPU over gloo."""
    import torch.distributed as dist

    try:
        on_cuda = engine["device"] == "cuda"
        if on_cuda:
            torch.cuda.set_device(rank)
        backend = "nccl" if on_cuda else "gloo"
        dist.init_process_group(backend, init_method=rendezvous, rank=rank, world_size=size)
        results = []
        for case in cases:
            ep = case.get("expert_parallel", False)
            tp = TensorParallel(rank, size, dist.group.WORLD, expert_parallel=ep)
            llm = LLM(case["path"], tensor_parallel=tp, **engine, **case.get("engine", {}))
            first, drafts = generate(llm, case["prompts"])
            hits_before = llm.engine.stats()["cached_tokens_total"]
            again = greedy(llm, case["prompts"])
            hits = llm.engine.stats()["cached_tokens_total"] - hits_before
            # (experts, intermediate width) of every routed-expert stack this rank holds
            experts = [
                list(m.down_proj.shape[::2])
                for m in llm.engine.runner.model.modules()
                if isinstance(m, Experts)
            ]
            results.append(
                {"first": first, "again": again, "hit_tokens": hits, "drafts": drafts, "experts": experts}
            )
            if case.get("logprobs"):
                results[-1]["logprobs"] = logprobs(llm, case["prompts"])
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        # both ranks done with the group before either tears it down: a rank that destroyed it
        # while the other still held gloo work (or engine tensors) was seen to abort the other
        del llm
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def run_ranks(
    tmp_path, cases: list[dict[str, Any]], engine: dict[str, Any] = ENGINE, size: int = 2
) -> list[list[dict[str, Any]]]:
    """Every rank's results of `cases` (spawned processes, a file rendezvous)."""
    import torch.multiprocessing as mp

    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    try:
        mp.spawn(_rank, args=(size, rendezvous, cases, engine, str(tmp_path)), nprocs=size, join=True)
    except Exception:
        errors = [p.read_text() for p in sorted(tmp_path.glob("rank*.err"))]
        pytest.fail("a rank failed:\n" + "\n".join(errors))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(size)]


LENGTHS = [1, 7, 33, 100, 150, 64]


def check_against_tp1_and_transformers(
    tmp_path, cases: dict[str, dict[str, Any]], hf_reference, engine: dict[str, Any] = ENGINE
) -> None:
    names = list(cases)
    ranks = run_ranks(tmp_path, [cases[n] for n in names], engine)
    for i, name in enumerate(names):
        case = cases[name]
        single = greedy(LLM(case["path"], **engine, **case.get("engine", {})), case["prompts"])
        hf = hf_reference(case["path"], case["prompts"], NEW_TOKENS)
        rank0 = ranks[0][i]
        assert single == hf, name
        assert rank0["first"] == hf, name
        assert rank0["again"] == hf, name  # from the prefix cache
        assert rank0["hit_tokens"] > 0, name
        if "speculative_config" in case.get("engine", {}):
            assert rank0["drafts"] > 0, name
        if "experts" in case:  # (experts, intermediate width) every expert stack must hold
            assert rank0["experts"] and all(e == case["experts"] for e in rank0["experts"]), name
        assert ranks[1][i] == rank0, name  # every rank sampled the same tokens


@pytest.mark.slow
def test_tp2_qwen3_next_equals_tp1_and_transformers(tmp_path, make_checkpoint, hf_reference):
    """GDN, gated attention with its KV heads split, MoE with a shared expert, the vocabulary."""
    case = dict(path=make_checkpoint("qwen3_next"), prompts=random_prompts(160, LENGTHS, 1))
    check_against_tp1_and_transformers(tmp_path, {"qwen3_next": case}, hf_reference)


@pytest.mark.slow
def test_tp2_expert_parallel_qwen3_next_equals_tp1_and_transformers(tmp_path, make_checkpoint, hf_reference):
    """Expert parallelism: each rank holds 2 of the 4 experts whole (full intermediate width 16)
    and masks the others' assignments; the shared expert stays split; one all-reduce sums."""
    case = dict(
        path=make_checkpoint("qwen3_next"),
        prompts=random_prompts(160, LENGTHS, 11),
        expert_parallel=True,
        experts=[2, 16],
    )
    check_against_tp1_and_transformers(tmp_path, {"qwen3_next_ep": case}, hf_reference)


@pytest.mark.slow
def test_tp2_expert_parallel_qwen3_5_moe_and_kimi(
    tmp_path, make_checkpoint, small_kimi_checkpoint, hf_reference
):
    cases = {
        "qwen3_5_moe_ep": dict(
            path=make_checkpoint("qwen3_5_moe"),
            prompts=random_prompts(160, LENGTHS, 12),
            expert_parallel=True,
            experts=[2, 16],
        ),
        # sigmoid routing over two expert groups, one group per rank; shared experts split
        "kimi_linear_ep": dict(
            path=small_kimi_checkpoint,
            prompts=random_prompts(160, LENGTHS, 13),
            expert_parallel=True,
            experts=[2, 16],
        ),
    }
    check_against_tp1_and_transformers(tmp_path, cases, hf_reference)


def with_mtp(src: str, dst: str) -> str:
    """The checkpoint plus `mtp.*` tensors (save_pretrained drops them): the layer copied from
    layer 3 (full attention, MoE), a random fc and norms."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    file = os.path.join(dst, "model.safetensors")
    sd = load_file(file)
    g = torch.Generator().manual_seed(5)
    for k in list(sd):
        if k.startswith("model.layers.3."):
            sd["mtp.layers.0." + k[len("model.layers.3.") :]] = sd[k].clone()
    sd["mtp.fc.weight"] = torch.randn(32, 64, generator=g) / 8
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{name}.weight"] = 0.2 * torch.randn(32, generator=g)
    save_file(sd, file, metadata={"format": "pt"})
    return dst


@pytest.mark.slow
def test_tp2_qwen3_5_and_kimi_equal_tp1_and_transformers(
    tmp_path, make_checkpoint, small_kimi_checkpoint, hf_reference
):
    mtp = with_mtp(make_checkpoint("qwen3_next"), str(tmp_path / "mtp"))
    repeats = [[5, 6, 7, 8, 9] * 12, [40, 41, 42] * 30]  # n-gram lookup finds drafts in these
    cases = {
        # the MTP layer sharded as the model's, drafting through the sharded embedding and head
        "qwen3_next_mtp": dict(
            path=mtp,
            prompts=random_prompts(160, [7, 100, 33], 5),
            engine=dict(speculative_config={"method": "mtp", "num_speculative_tokens": 2}),
        ),
        "qwen3_next_ngram": dict(
            path=make_checkpoint("qwen3_next"),
            prompts=repeats + random_prompts(160, [50], 6),
            engine=dict(
                speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
            ),
        ),
        # Qwen3.5's separate projections, an odd vocabulary (the last shard padded), tied embeddings
        "qwen3_5_tied_odd_vocab": dict(
            path=make_checkpoint("qwen3_5", tie_word_embeddings=True, vocab_size=161),
            prompts=random_prompts(161, LENGTHS, 2),
        ),
        # one KV head, replicated on both ranks
        "qwen3_5_moe_kv1": dict(
            path=make_checkpoint("qwen3_5_moe", num_key_value_heads=1),
            prompts=random_prompts(160, LENGTHS, 3),
        ),
        # KDA, MLA, sigmoid-routed MoE with a shared expert
        "kimi_linear": dict(path=small_kimi_checkpoint, prompts=random_prompts(160, LENGTHS, 4)),
    }
    check_against_tp1_and_transformers(tmp_path, cases, hf_reference)


# -- loading: each rank's shard is its slice of the checkpoint ------------------------


def _halves(t: torch.Tensor, rank: int, dim: int, *parts: int) -> torch.Tensor:
    """Rank `rank` of 2: the rank's half of each of `parts` (consecutive blocks along dim)."""
    pieces, offset = [], 0
    for p in parts:
        pieces.append(t.narrow(dim, offset + rank * (p // 2), p // 2))
        offset += p
    return torch.cat(pieces, dim=dim)


def _safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def _load(path: str, rank: int = 0, size: int = 1, ep: bool = False) -> dict[str, torch.Tensor]:
    tp = TensorParallel(rank, size, expert_parallel=ep)
    loaded = load_model(path, torch.float32, torch.device("cpu"), tp=tp)
    return dict(loaded.model.named_parameters())


def test_qwen_shards_are_checkpoint_slices(make_checkpoint):
    """Qwen3-Next's interleaved in_proj_qkvz: each rank takes whole key-head groups, which
    reordered are its halves of q, k, v, z (and of b, a); q_proj's per-head q|gate rows go
    whole; experts keep every expert's slice of the intermediate width."""
    path = make_checkpoint("qwen3_next", vocab_size=161)
    ckpt, full = _safetensors(path), _load(path)
    key, value, hv = 2 * 8, 4 * 8, 4  # linear key heads x dim, value heads x dim, value heads
    for rank in (0, 1):
        shard = _load(path, rank, 2)
        emb = ckpt["model.embed_tokens.weight"][rank * 81 : rank * 81 + 81]
        emb = torch.cat([emb, emb.new_zeros(81 - emb.shape[0], emb.shape[1])])
        torch.testing.assert_close(shard["model.embed_tokens.weight"], emb, rtol=0, atol=0)
        # key-head group g of in_proj_qkvz: q_g, k_g, v and z of its 2 value heads
        groups = ckpt["model.layers.0.linear_attn.in_proj_qkvz.weight"].view(2, 48, 32)[rank]
        q, k, v, z = groups.split([8, 8, 16, 16])
        ba = ckpt["model.layers.0.linear_attn.in_proj_ba.weight"].view(2, 4, 32)[rank]
        expected = torch.cat([q, k, v, z, ba])
        torch.testing.assert_close(
            shard["model.layers.0.linear_attn.in_proj.weight"], expected, rtol=0, atol=0
        )
        layer0 = "model.layers.0.linear_attn."
        for name, parts in (
            ("in_proj.weight", [key, key, value, value, hv, hv]),
            ("conv1d_weight", [key, key, value]),
        ):
            torch.testing.assert_close(shard[layer0 + name], _halves(full[layer0 + name], rank, 0, *parts))
        torch.testing.assert_close(
            shard[layer0 + "out_proj.weight"], ckpt[layer0 + "out_proj.weight"][:, rank * 16 : rank * 16 + 16]
        )
        q_proj = ckpt["model.layers.3.self_attn.q_proj.weight"]  # 4 heads x (16 q + 16 gate)
        k_proj = ckpt["model.layers.3.self_attn.k_proj.weight"]  # 2 KV heads: one each
        qkv = shard["model.layers.3.self_attn.qkv_proj.weight"]
        torch.testing.assert_close(qkv[:64], q_proj[rank * 64 : rank * 64 + 64], rtol=0, atol=0)
        torch.testing.assert_close(qkv[64:80], k_proj[rank * 16 : rank * 16 + 16], rtol=0, atol=0)
        experts = "model.layers.0.mlp.experts."
        gate_up, down = shard[experts + "gate_up_proj"], shard[experts + "down_proj"]
        for e in range(4):
            gate = ckpt[f"{experts}{e}.gate_proj.weight"][rank * 8 : rank * 8 + 8]
            up = ckpt[f"{experts}{e}.up_proj.weight"][rank * 8 : rank * 8 + 8]
            torch.testing.assert_close(gate_up[e], torch.cat([gate, up]), rtol=0, atol=0)
            torch.testing.assert_close(
                down[e], ckpt[f"{experts}{e}.down_proj.weight"][:, rank * 8 : rank * 8 + 8], rtol=0, atol=0
            )
        for name in ("model.layers.0.mlp.gate.weight", "model.norm.weight", layer0 + "norm.weight"):
            torch.testing.assert_close(shard[name], full[name], rtol=0, atol=0)  # replicated


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe"])
def test_expert_parallel_ranks_hold_their_experts_whole(kind, make_checkpoint):
    """Per-expert checkpoint names: rank r's stacks are experts 2r and 2r + 1 of the file,
    whole; the other rank's expert tensors are not read at all; the shared expert is halved by
    its width as without EP, the router replicated."""
    path = make_checkpoint(kind)
    ckpt = _safetensors(path)
    cpu = torch.device("cpu")
    for rank in (0, 1):
        model = load_model(path, torch.float32, cpu, tp=TensorParallel(rank, 2, expert_parallel=True)).model
        shard = dict(model.named_parameters())
        for layer in range(4):
            mlp = f"model.layers.{layer}.mlp."
            gate_up, down = shard[mlp + "experts.gate_up_proj"], shard[mlp + "experts.down_proj"]
            assert gate_up.shape == (2, 32, 32) and down.shape == (2, 32, 16)
            for local in (0, 1):
                e = f"{mlp}experts.{2 * rank + local}."
                gate, up = ckpt[e + "gate_proj.weight"], ckpt[e + "up_proj.weight"]
                torch.testing.assert_close(gate_up[local], torch.cat([gate, up]), rtol=0, atol=0)
                torch.testing.assert_close(down[local], ckpt[e + "down_proj.weight"], rtol=0, atol=0)
            shared_gate = ckpt[mlp + "shared_expert.gate_proj.weight"][rank * 8 : rank * 8 + 8]
            torch.testing.assert_close(
                shard[mlp + "shared_expert.gate_up_proj.weight"][:8], shared_gate, rtol=0, atol=0
            )
            torch.testing.assert_close(shard[mlp + "gate.weight"], ckpt[mlp + "gate.weight"], rtol=0, atol=0)
        read = {name for name, _ in iter_safetensors(path, narrow=model.checkpoint_narrow)}
        owner = {n: int(m.group(1)) // 2 for n in ckpt if (m := re.search(r"\.experts\.(\d+)\.", n))}
        mine = {n for n, r in owner.items() if r == rank}
        theirs = set(owner) - mine
        assert len(theirs) == len(mine) == 4 * 2 * 3  # layers x experts x (gate, up, down)
        assert mine <= read and not theirs & read


def test_expert_parallel_dummy_weights_and_pools(make_checkpoint):
    """`--load-format dummy` fills each rank's whole experts; the pools are those of TP."""
    path = make_checkpoint("qwen3_next")
    for rank in (0, 1):
        tp = TensorParallel(rank, 2, expert_parallel=True)
        model = load_model(path, torch.float32, torch.device("cpu"), load_format="dummy", tp=tp).model
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        assert len(experts) == 4 and all(m.gate_up_proj.shape == (2, 32, 32) for m in experts)
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert all(m.gate_up_proj.abs().sum() > 0 for m in experts)
        assert model.state_shapes() == {"conv": (32, 3), "recurrent": (2, 8, 8)}


def test_indivisible_expert_count_is_a_clear_error():
    """Three experts over two ranks: EP says so; plain TP still splits their width."""
    import transformers as T

    from deltaserve.models.kimi_linear import KimiLinearForCausalLM
    from deltaserve.models.qwen3_next import Qwen3NextForCausalLM

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16, vocab_size=64, hidden_size=32)
    qwen = T.Qwen3NextConfig(
        num_hidden_layers=4,
        num_experts=3,
        shared_expert_intermediate_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        **moe,
    )
    kimi = T.KimiLinearConfig(
        num_hidden_layers=2,
        num_local_experts=3,
        n_shared_experts=1,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        linear_num_heads=2,
        linear_head_dim=16,
        layer_types=["linear_attention", "full_attention"],
        **moe,
    )
    for cls, config in ((Qwen3NextForCausalLM, qwen), (KimiLinearForCausalLM, kimi)):
        cls(config, TensorParallel(0, 2))  # tensor parallelism alone splits their width
        with pytest.raises(ValueError, match=r"routed experts \(3\).*expert-parallel size 2"):
            cls(config, TensorParallel(0, 2, expert_parallel=True))


def test_expert_parallel_at_one_rank_changes_nothing(make_checkpoint):
    """As in vLLM, EP over a single rank is plain loading: every expert, the same tensors."""
    path = make_checkpoint("qwen3_next")
    plain, ep = _load(path), _load(path, 0, 1, ep=True)
    assert plain.keys() == ep.keys()
    assert all(torch.equal(plain[n], ep[n]) for n in plain)
    assert ep["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4


def test_replicated_kv_head_and_qwen35_projections(make_checkpoint):
    """One KV head: both ranks hold it. Qwen3.5's separate in_proj_qkv: each of q, k, v halved."""
    path = make_checkpoint("qwen3_5_moe", num_key_value_heads=1)
    ckpt = _safetensors(path)
    for rank in (0, 1):
        shard = _load(path, rank, 2)
        qkv = shard["model.layers.3.self_attn.qkv_proj.weight"]
        torch.testing.assert_close(qkv[64:80], ckpt["model.layers.3.self_attn.k_proj.weight"], rtol=0, atol=0)
        torch.testing.assert_close(qkv[80:96], ckpt["model.layers.3.self_attn.v_proj.weight"], rtol=0, atol=0)
        in_proj = shard["model.layers.0.linear_attn.in_proj.weight"]
        full_qkv = ckpt["model.layers.0.linear_attn.in_proj_qkv.weight"]
        torch.testing.assert_close(in_proj[:32], _halves(full_qkv, rank, 0, 16, 16, 32), rtol=0, atol=0)


@pytest.mark.parametrize("ep", [False, True], ids=["tp", "ep"])
def test_kimi_shards_from_fused_checkpoint(tmp_path, kimi_builder, kimi_config, ep):
    """transformers' in-memory Kimi names (stacked experts, one fused conv, `forget_gate.`)
    narrowed per rank: the shards are the TP = 1 model's tensors, halved as sharded; with
    expert parallelism the stacked experts are halved along the expert dimension instead (4 of
    the 8 whole), and the shared experts still by their width."""
    from safetensors.torch import save_file

    saved, fused = tmp_path / "saved", tmp_path / "fused"
    model = kimi_builder(str(saved), kimi_config)
    fused.mkdir()
    (fused / "config.json").write_text((saved / "config.json").read_text())
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"))
    full = _load(str(fused))
    dim, inter = 2 * 16, 16  # KDA heads x head dim; expert intermediate
    # (how the TP = 1 tensor is split: dim, parts; None: replicated)
    rules: dict[str, tuple[int, list[int]] | None] = {
        "embed_tokens.weight": (0, [192]),
        "lm_head.weight": (0, [192]),
        "qkv_proj.weight": (0, [dim] * 3),
        "conv1d_weight": (0, [dim] * 3),
        "f_b_proj.weight": (0, [dim]),
        "g_b_proj.weight": (0, [dim]),
        "dt_bias": (0, [dim]),
        "A_log": (0, [2]),
        "self_attn.o_proj.weight": (1, [2 * 12]),  # MLA heads x v_head_dim, or KDA's dim
        "q_proj.weight": (0, [2 * 16]),
        "kv_b_proj.weight": (0, [2 * 20]),
        "experts.gate_up_proj": (1, [inter, inter]),
        "experts.down_proj": (2, [inter]),
        "shared_experts.gate_up_proj.weight": (0, [inter, inter]),
        "shared_experts.down_proj.weight": (1, [inter]),
        "0.mlp.gate_up_proj.weight": (0, [64, 64]),
        "0.mlp.down_proj.weight": (1, [64]),
    }
    if ep:
        rules["experts.gate_up_proj"] = rules["experts.down_proj"] = (0, [8])
    for rank in (0, 1):
        shard = _load(str(fused), rank, 2, ep)
        assert shard.keys() == full.keys()
        for name, tensor in full.items():
            rule = next((r for suffix, r in rules.items() if name.endswith(suffix)), None)
            if name.endswith("gates_a_proj.weight"):  # f_a and g_a replicated, b's heads halved
                expected = torch.cat([tensor[:32], tensor[32:].chunk(2)[rank]])
            elif name.endswith("self_attn.o_proj.weight") and tensor.shape[1] == dim:
                expected = _halves(tensor, rank, 1, dim)
            elif rule is None:
                expected = tensor
            else:
                expected = _halves(tensor, rank, *rule[:1], *rule[1])
            torch.testing.assert_close(shard[name], expected, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_vision_language_checkpoints_shard_their_text_model(kind, make_checkpoint):
    """`model.language_model.*` names narrow as the text model's; the vision tower is skipped."""
    path = make_checkpoint(kind)
    ckpt, full = _safetensors(path), _load(path)
    for rank in (0, 1):
        shard = _load(path, rank, 2)
        embed = ckpt["model.language_model.embed_tokens.weight"][rank * 80 : rank * 80 + 80]
        torch.testing.assert_close(shard["model.embed_tokens.weight"], embed, rtol=0, atol=0)
        o_proj = ckpt["model.language_model.layers.3.self_attn.o_proj.weight"][:, rank * 32 : rank * 32 + 32]
        torch.testing.assert_close(shard["model.layers.3.self_attn.o_proj.weight"], o_proj, rtol=0, atol=0)
        a_log = "model.layers.0.linear_attn.A_log"
        torch.testing.assert_close(shard[a_log], full[a_log][rank * 2 : rank * 2 + 2], rtol=0, atol=0)


def test_pool_shapes_are_per_rank_and_dummy_weights_load(make_checkpoint, small_kimi_checkpoint):
    """The engine sizes its pools from kv_shapes / state_shapes: each rank's hold its heads
    only (MLA's latent is replicated). `--load-format dummy` fills each rank's shard."""
    qwen = make_checkpoint("qwen3_next")
    cpu = torch.device("cpu")
    for rank in (0, 1):
        tp = TensorParallel(rank, 2)
        model = load_model(qwen, torch.float32, cpu, load_format="dummy", tp=tp).model
        # GDN: 2 of 4 value heads (8 x 8), conv over half of q, k (2 x 8 each) and v (4 x 8)
        assert model.state_shapes() == {"conv": (32, 3), "recurrent": (2, 8, 8)}
        assert model.kv_shapes() == {"k": (1, 16), "v": (1, 16)}  # 1 of 2 KV heads
        assert all(torch.isfinite(p).all() for p in model.parameters())
        kimi = load_model(small_kimi_checkpoint, torch.float32, cpu, tp=tp).model
        assert kimi.state_shapes() == {"conv": (48, 3), "recurrent": (1, 16, 16)}  # 1 of 2 KDA heads
        assert kimi.kv_shapes() == {"latent": (16 + 8,)}


@pytest.mark.parametrize(
    ("field", "value"),
    [("linear_num_key_heads", 3), ("num_attention_heads", 3), ("num_key_value_heads", 3)],
)
def test_indivisible_heads_are_a_clear_error(field, value):
    import transformers as T

    from deltaserve.models.qwen3_next import Qwen3NextForCausalLM

    heads = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    heads[field] = value
    if field == "linear_num_key_heads":
        heads["linear_num_value_heads"] = 6
    if field == "num_attention_heads":
        heads["num_key_value_heads"] = 1
    config = T.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, intermediate_size=32, num_experts=0, **heads
    )
    Qwen3NextForCausalLM(config)  # a valid model at one rank
    with pytest.raises(ValueError, match=rf"{field} \({value}\).*tensor-parallel size 2"):
        Qwen3NextForCausalLM(config, TensorParallel(0, 2))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_on_two_gpus_equals_transformers(tmp_path, make_checkpoint, small_kimi_checkpoint, hf_reference):
    """NCCL between two GPUs, fp32 (so that tokens are held to transformers exactly), decode by
    CUDA graphs where they capture: the GPU kernels on each rank's shard shapes."""
    engine = {**ENGINE, "device": "cuda", "max_running_requests": 8}
    wide = dict(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)
    cases = {
        "qwen3_next": dict(
            path=make_checkpoint("qwen3_next", **wide), prompts=random_prompts(160, LENGTHS, 7)
        ),
        "qwen3_5_moe_kv1": dict(
            path=make_checkpoint("qwen3_5_moe", num_key_value_heads=1, **wide),
            prompts=random_prompts(160, LENGTHS, 8),
        ),
        "kimi_linear": dict(path=small_kimi_checkpoint, prompts=random_prompts(160, LENGTHS, 9)),
    }
    check_against_tp1_and_transformers(tmp_path, cases, hf_reference, engine)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tp2_expert_parallel_on_two_gpus_equals_transformers(
    tmp_path, make_checkpoint, small_kimi_checkpoint, hf_reference
):
    """Expert parallelism over NCCL, fp32: the Triton fused MoE skips the other rank's
    assignments (eagerly and in the decode graphs) and the sum over ranks is transformers'."""
    engine = {**ENGINE, "device": "cuda", "max_running_requests": 8}
    wide = dict(hidden_size=64, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32)
    cases = {
        "qwen3_5_moe_ep": dict(
            path=make_checkpoint("qwen3_5_moe", **wide),
            prompts=random_prompts(160, LENGTHS, 14),
            expert_parallel=True,
            experts=[2, 16],
        ),
        "kimi_linear_ep": dict(
            path=small_kimi_checkpoint,
            prompts=random_prompts(160, LENGTHS, 15),
            expert_parallel=True,
            experts=[2, 16],
        ),
    }
    check_against_tp1_and_transformers(tmp_path, cases, hf_reference, engine)
