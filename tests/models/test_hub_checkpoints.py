"""A checkpoint named by its Hugging Face repo id: huggingface_hub resolves it in a Hub cache laid
out as the Hub writes it (`models--ORG--NAME/refs`, `snapshots/COMMIT/`), with the Hub unreachable
(`HF_HUB_OFFLINE`), and the engine then runs what the folder holds."""

from __future__ import annotations

import os
import shutil

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.models.checkpoints.hub import CheckpointNotFound, is_repo_id, resolve_checkpoint

PROMPTS = [[3, 17, 42, 5, 99, 7], [11, 2, 64]]


def add_to_hub_cache(
    cache: str, repo_id: str, folder: str, commit: str, refs: tuple[str, ...] = ("main",)
) -> str:
    """`folder`'s files as the snapshot `commit` of `repo_id` in Hub cache `cache`, named by `refs`."""
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", commit)
    shutil.copytree(folder, snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    for ref in refs:
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture
def hub_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_repo_id_runs_the_cached_snapshot_as_transformers_runs_it(
    make_checkpoint, hf_reference, tmp_path, hub_offline
) -> None:
    folder = make_checkpoint("qwen3_next")
    cache = str(tmp_path / "hub")
    add_to_hub_cache(cache, "acme/tiny-next", folder, "a" * 40)
    llm = LLM("acme/tiny-next", download_dir=cache, device="cpu", dtype="float32")
    assert llm.engine.config.model == os.path.join(cache, "models--acme--tiny-next", "snapshots", "a" * 40)
    assert greedy(llm) == hf_reference(folder, PROMPTS, 6)


def test_revision_picks_its_snapshot(make_checkpoint, tmp_path, hub_offline) -> None:
    cache = str(tmp_path / "hub")
    main = make_checkpoint("qwen3_next")
    tagged = make_checkpoint("qwen3_next", seed=7)
    add_to_hub_cache(cache, "acme/tiny", main, "1" * 40)
    add_to_hub_cache(cache, "acme/tiny", tagged, "2" * 40, refs=("v2",))
    on_main = greedy(LLM("acme/tiny", download_dir=cache, device="cpu", dtype="float32"))
    on_tag = greedy(LLM("acme/tiny", revision="v2", download_dir=cache, device="cpu", dtype="float32"))
    want_tag = greedy(LLM(tagged, device="cpu", dtype="float32"))
    assert on_tag == want_tag and on_main == greedy(LLM(main, device="cpu", dtype="float32"))
    assert on_tag != on_main  # the two snapshots are different models


def test_random_weights_need_no_weight_files(make_checkpoint, tmp_path, hub_offline) -> None:
    configs_only = tmp_path / "configs"
    configs_only.mkdir()
    shutil.copy(os.path.join(make_checkpoint("qwen3_next"), "config.json"), configs_only)
    cache = str(tmp_path / "hub")
    add_to_hub_cache(cache, "acme/shapes", str(configs_only), "c" * 40)
    llm = LLM("acme/shapes", download_dir=cache, device="cpu", load_format="dummy")
    assert [len(t) for t in greedy(llm)] == [6, 6]


def test_what_is_not_there_is_one_clear_error(tmp_path, hub_offline) -> None:
    cache = str(tmp_path / "hub")
    with pytest.raises(CheckpointNotFound, match=r"'acme/absent'.*cache"):
        resolve_checkpoint("acme/absent", download_dir=cache)
    with pytest.raises(CheckpointNotFound, match="neither a folder nor a Hugging Face repo id"):
        resolve_checkpoint("/no/such/folder", download_dir=cache)
    with pytest.raises(CheckpointNotFound, match="no config.json"):  # a snapshot that is not a model
        empty = tmp_path / "empty"
        empty.mkdir()
        (empty / "README.md").write_text("a dataset card")
        add_to_hub_cache(cache, "acme/not-a-model", str(empty), "d" * 40)
        resolve_checkpoint("acme/not-a-model", download_dir=cache)


def test_a_folder_wins_over_a_repo_id_of_the_same_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert is_repo_id("Qwen/Qwen3.5-9B")
    (tmp_path / "Qwen" / "Qwen3.5-9B").mkdir(parents=True)
    assert not is_repo_id("Qwen/Qwen3.5-9B")
    assert resolve_checkpoint("Qwen/Qwen3.5-9B") == "Qwen/Qwen3.5-9B"
    for name in ("Qwen", "a/b/c", "../x", "org/", "/abs/path"):
        assert not is_repo_id(name), name
