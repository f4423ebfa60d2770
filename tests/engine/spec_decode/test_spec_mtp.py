"""MTP speculation (Qwen3-Next / Qwen3.5 `mtp.*` layer): lossless greedy outputs, drafts equal
to a one-shot recomputation of the MTP over the final sequence, and a copy-the-token MTP whose
drafts are all accepted. transformers' save_pretrained drops `mtp.*`: the tests write them."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch

from deltaserve import LLM, SamplingParams

MTP = {"method": "mtp", "num_speculative_tokens": 3}
NEW = 16


def with_mtp(src: str, dst: str, copy_token: bool = False, seed: int = 0) -> str:
    """The checkpoint plus `mtp.*` tensors: the layer copied from the model's first full-attention
    layer, a random fc and norms; `copy_token`: fc passes the token's embedding through and the
    layer adds nothing, so (with tied embeddings) the MTP proposes the token it is given."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    file = os.path.join(dst, "model.safetensors")
    sd = load_file(file)
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    hidden = text["hidden_size"]
    layer = f"model.layers.{text['layer_types'].index('full_attention')}."
    for k in list(sd):
        if k.startswith(layer):
            sd["mtp.layers.0." + k[len(layer) :]] = sd[k].clone()
    g = torch.Generator().manual_seed(seed)
    if copy_token:
        sd["mtp.fc.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
        for k in list(sd):
            if k.startswith("mtp.layers.0.") and ("o_proj" in k or "down_proj" in k):
                sd[k] = torch.zeros_like(sd[k])
    else:
        sd["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * (2 * hidden) ** -0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{name}.weight"] = (
            torch.zeros(hidden) if copy_token else 0.2 * torch.randn(hidden, generator=g)
        )
    save_file(sd, file, metadata={"format": "pt"})
    return dst


def make_llm(path: str, spec: dict | None = None, **kw) -> LLM:
    kw.setdefault("chunked_prefill_size", 32)
    kw.setdefault("num_kv_pages", 160)
    kw.setdefault("max_model_len", 512)
    return LLM(path, dtype="float32", device="cpu", speculative_config=spec, **kw)


def prompts_of(lengths: list[int], seed: int, repeat: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 160, (n,), generator=g).tolist() * repeat for n in lengths]


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next"])
def mtp_path(request, remembering_checkpoint, tmp_path_factory) -> tuple[str, str]:
    base = remembering_checkpoint(request.param)  # long memory: a wrong committed state shows
    return base, with_mtp(base, str(tmp_path_factory.mktemp(f"{request.param}_mtp")))


def test_mtp_greedy_identical_and_drafts_match_one_shot(mtp_path, pools_held):
    base, path = mtp_path
    prompts = prompts_of([5, 70, 33, 16], seed=1)
    plain = run(make_llm(base, max_running_requests=8), prompts)
    llm = make_llm(path, MTP, max_running_requests=8)
    mtp = llm.engine.spec.mtp
    proposed: dict[tuple[int, ...], list[int]] = {}
    take = mtp.take

    def spy(req):
        drafts = take(req)
        proposed[tuple(req.all_token_ids)] = drafts
        return drafts

    mtp.take = spy  # type: ignore[method-assign]
    assert run(llm, prompts) == plain
    assert sum(len(d) for d in proposed.values()) == llm.engine.stats()["spec_draft_tokens_total"] > 0
    # one shot: the whole final sequence as a prompt in one chunk; the fill's outputs give
    # the first draft after every prefix
    for prompt, out in zip(prompts, plain):
        seq = prompt + out
        ref_llm = make_llm(path, MTP, chunked_prefill_size=512, cache_type="naive")
        outs = []
        run_mtp = ref_llm.engine.spec.mtp._run

        def record(*feed, run_mtp=run_mtp, outs=outs):
            h, logits = run_mtp(*feed)
            outs.append(h)
            return h, logits

        ref_llm.engine.spec.mtp._run = record  # type: ignore[method-assign]
        run(ref_llm, [seq], max_tokens=2)  # still running after the prefill: its fill runs
        with torch.inference_mode():
            first = ref_llm.engine.runner.model.compute_logits(outs[0]).argmax(-1).tolist()
        checked = 0
        for n in range(len(prompt) + 1, len(seq)):
            drafts = proposed.get(tuple(seq[:n]))
            if drafts:
                assert drafts[0] == first[n - 2], f"first draft after {n} tokens"
                checked += 1
        assert checked > 0
    assert not pools_held(llm)


def test_copy_token_mtp_drafts_are_accepted(remembering_checkpoint, tmp_path_factory, pools_held):
    base = remembering_checkpoint("qwen3_5", tie_word_embeddings=True)
    path = with_mtp(base, str(tmp_path_factory.mktemp("copy_mtp")), copy_token=True)
    prompts = prompts_of([3, 4, 50], seed=2, repeat=4)
    plain = run(make_llm(base), prompts)
    llm = make_llm(path, MTP)
    emb = llm.engine.runner.model.model.embed_tokens.weight
    proposed: list[tuple[int, list[int]]] = []
    take = llm.engine.spec.mtp.take

    def spy(req):
        drafts = take(req)
        proposed.append((req.all_token_ids[-1], drafts))
        return drafts

    llm.engine.spec.mtp.take = spy  # type: ignore[method-assign]
    assert run(llm, prompts) == plain
    with torch.no_grad():
        nearest = (emb @ emb.t()).argmax(-1).tolist()  # the token whose embedding each one matches best
    for last, drafts in proposed:
        want, t = [], last
        for _ in drafts:
            t = nearest[t]
            want.append(t)
        assert drafts == want
    s = llm.engine.stats()
    assert s["spec_accepted_tokens_total"] > 0
    assert not pools_held(llm)


@pytest.mark.slow
def test_mtp_under_kv_pressure_and_cache_hits(mtp_path, pools_held):
    """Drafts beside preemptions (a few pages for four growing requests, recomputed from their
    own released prefix), then next turns that hit snapshots of states committed from windows:
    the tokens of a plain engine with room for all and no prefix cache."""
    base, path = mtp_path
    prompts = prompts_of([40, 45, 50, 55], seed=3)
    plain = make_llm(base, max_running_requests=4, cache_type="naive")
    ref = run(plain, prompts, max_tokens=40)
    llm = make_llm(path, MTP, max_running_requests=4, page_size=8, num_kv_pages=30, max_model_len=128)
    preempted = []
    preempt = llm.engine.scheduler.preempt
    llm.engine.scheduler.preempt = lambda req: (preempted.append(req), preempt(req))  # type: ignore[method-assign]
    assert run(llm, prompts, max_tokens=40) == ref
    assert preempted and llm.engine.stats()["spec_draft_tokens_total"] > 0
    second = [p + r + [7, 8, 9] for p, r in zip(prompts, ref)]
    before = llm.engine.stats()["cached_tokens_total"]
    assert run(llm, second) == run(plain, second)
    assert llm.engine.stats()["cached_tokens_total"] > before
    assert not pools_held(llm)


def test_mtp_needs_the_weights(make_checkpoint, caplog):
    """Refused from the safetensors headers before the model loads; random weights need none."""
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="^the checkpoint has no mtp"):
        make_llm(make_checkpoint("qwen3_5"), MTP)
    assert "loading the weights" not in caplog.text
    assert make_llm(make_checkpoint("qwen3_5"), MTP, load_format="dummy").engine.runner.mtp is not None


def test_mtp_needs_a_model_that_declares_an_mtp_head(small_kimi_checkpoint, caplog):
    """Kimi-Linear declares no MTP head (`ModelCapabilities`): refused before any weight is read."""
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="MTP speculation needs a Qwen3-Next"):
        make_llm(small_kimi_checkpoint, MTP)
    assert "loading the weights" not in caplog.text
