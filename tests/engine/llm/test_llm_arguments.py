"""What `LLM(...)` checks of its arguments before the model loads, and vLLM's names it takes."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from deltaserve import LLM, SamplingParams


def config_only(checkpoint: str, folder: Path) -> str:
    """The checkpoint's config.json alone: loading its weights would fail, so a check that passes
    this far ran before any weight was read."""
    folder.mkdir()
    shutil.copy(Path(checkpoint) / "config.json", folder / "config.json")
    return str(folder)


def test_a_max_model_len_past_the_models_positions_is_refused_before_the_weights_load(
    make_checkpoint, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused as vLLM refuses it, from config.json before any weight loads."""
    checkpoint = make_checkpoint("qwen3_next")
    positions = json.loads((Path(checkpoint) / "config.json").read_text())["max_position_embeddings"]
    bare = config_only(checkpoint, tmp_path / "bare")
    with caplog.at_level(logging.INFO), pytest.raises(ValueError) as error:
        LLM(bare, device="cpu", max_model_len=positions + 1)
    assert str(error.value).startswith(
        f"max_model_len {positions + 1} is longer than the model's {positions} positions"
    )
    assert "loading the weights" not in caplog.text
    # a YaRN scaling given by hf_overrides reaches further: the check lets it through to the weights
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": positions}
    with pytest.raises(Exception) as missing:
        LLM(bare, device="cpu", max_model_len=2 * positions, hf_overrides={"rope_parameters": yarn})
    assert str(missing.value).startswith("no .safetensors"), missing.value


def test_a_tokenizer_folder_without_a_tokenizer_is_refused(make_checkpoint, tmp_path: Path) -> None:
    """As `deltaserve serve --tokenizer` refuses it: without a tokenizer every text prompt and chat
    would fail."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError) as error:
        LLM(config_only(make_checkpoint("qwen3_next"), tmp_path / "bare"), device="cpu", tokenizer=str(empty))
    assert str(error.value).startswith(f"tokenizer {str(empty)!r} holds no tokenizer files (tokenizer.json")


def test_a_folder_without_config_json_is_refused_before_anything_loads(tmp_path: Path) -> None:
    """The error `deltaserve serve --model` gives, as a FileNotFoundError, before any rank starts."""
    for tp in (1, 2):
        with pytest.raises(FileNotFoundError) as error:
            LLM(str(tmp_path), device="cpu", tensor_parallel_size=tp)
        assert (
            str(error.value)
            == f"no config.json in {str(tmp_path)!r}: is it a Hugging Face checkpoint folder?"
        )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")


def test_tokenizer_revision_picks_the_tokenizers_snapshot(
    tokenized_checkpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's LLM(..., tokenizer_revision=...), as --tokenizer-revision: the revision of
    `tokenizer`'s repo, or without `tokenizer` the model repo's tokenizer files at it (its weights
    staying at `revision`). Here only the repo's v2 holds tokenizer files."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the cache only
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    for commit, ref in (("1" * 40, "main"), ("2" * 40, "v2")):  # the Hub cache's layout
        shutil.copytree(tokenized_checkpoint, repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    for name in TOKENIZER_FILES:
        (repo / "snapshots" / ("1" * 40) / name).unlink(missing_ok=True)
    main, v2 = str(repo / "snapshots" / ("1" * 40)), str(repo / "snapshots" / ("2" * 40))
    llm = LLM("acme/tiny", download_dir=str(cache), device="cpu", tokenizer_revision="v2")
    assert (llm.engine.config.model, llm.engine.config.tokenizer) == (main, v2)
    assert llm.generate("Hello", SamplingParams(max_tokens=1))[0].prompt_token_ids == [9707]
    given = LLM(tokenized_checkpoint, download_dir=str(cache), device="cpu", tokenizer="acme/tiny",
                tokenizer_revision="v2")  # fmt: skip
    assert given.engine.config.tokenizer == v2
    with pytest.raises(ValueError, match="holds no tokenizer files"):  # main's has none
        LLM(tokenized_checkpoint, download_dir=str(cache), device="cpu", tokenizer="acme/tiny")


def test_a_tokenizer_repo_without_config_json_loads(
    tokenized_checkpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM(..., tokenizer="org/tokenizer") of a repo holding tokenizer files alone, as vLLM loads
    one, where it raised "has no config.json: is it a model repo?"."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the cache only
    repo, commit = tmp_path / "hub" / "models--acme--tok", "3" * 40
    (repo / "snapshots" / commit).mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenized_checkpoint) / name, repo / "snapshots" / commit / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    llm = LLM(tokenized_checkpoint, device="cpu", tokenizer="acme/tok", download_dir=str(tmp_path / "hub"))
    assert llm.engine.config.tokenizer == str(repo / "snapshots" / commit)
    assert llm.generate("Hello", SamplingParams(max_tokens=1))[0].prompt_token_ids == [9707]


def test_older_vllms_prompt_token_ids_keyword(tokenized_checkpoint: str) -> None:
    """`llm.generate(prompt_token_ids=[[...], ...], sampling_params=...)`, older vLLM's form: the same
    as TokensPrompts, where it was a TypeError; one prompt's ids alone are one prompt, and texts
    given with them are what the outputs report."""
    llm = LLM(tokenized_checkpoint, device="cpu", dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = [[9707, 11], [13048]]
    want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": i} for i in ids], greedy)]
    batch = llm.generate(prompt_token_ids=ids, sampling_params=greedy)
    assert [(o.prompt_token_ids, o.outputs[0].token_ids) for o in batch] == list(zip(ids, want))
    (one,) = llm.generate(prompt_token_ids=ids[1], sampling_params=greedy, use_tqdm=False)
    assert (one.prompt_token_ids, one.outputs[0].token_ids) == (ids[1], want[1])
    texts = llm.generate(["Hello,", "Hi"], greedy, prompt_token_ids=ids)
    assert [(o.prompt, o.prompt_token_ids) for o in texts] == [("Hello,", ids[0]), ("Hi", ids[1])]
    with pytest.raises(ValueError, match="the same number"):
        llm.generate(["Hello,"], greedy, prompt_token_ids=ids)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        llm.generate(prompt_token_ids=[], sampling_params=greedy)
    with pytest.raises(ValueError, match="give prompts"):
        llm.generate(sampling_params=greedy)


def test_vllms_generate_and_chat_keywords_at_their_defaults_run(tokenized_checkpoint: str) -> None:
    """A vLLM script's `generate(..., lora_request=None, tokenization_kwargs=None)` and
    `chat(..., lora_request=None, mm_processor_kwargs=None)` run as without them, where they were a
    TypeError; an adapter (which deltaserve cannot apply) is a ValueError naming it, an unknown
    keyword still a TypeError."""
    from deltaserve import BeamSearchParams

    llm = LLM(tokenized_checkpoint, device="cpu", dtype="float32")
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(["Hello,", "Hi"], greedy, use_tqdm=False)]
    for keywords in (
        {"lora_request": None, "priority": None, "tokenization_kwargs": None},
        {"lora_request": [None, None], "tokenization_kwargs": {}, "prompt_adapter_request": None},
        {"guided_options_request": None, "tokenization_kwargs": {"add_special_tokens": True}},
    ):
        outs = llm.generate(["Hello,", "Hi"], sampling_params=greedy, use_tqdm=False, **keywords)
        assert [o.outputs[0].token_ids for o in outs] == want, keywords
    adapter = object()  # a LoRARequest
    for keywords, says in (
        ({"lora_request": adapter}, "lora_request: LoRA adapters are not implemented"),
        ({"lora_request": [None, adapter]}, "lora_request: LoRA adapters are not implemented"),
        ({"prompt_adapter_request": adapter}, "prompt_adapter_request: prompt adapters are not"),
        ({"guided_options_request": adapter}, "guided_options_request: give SamplingParams"),
        ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs \\['truncation'\\]: only"),
    ):
        with pytest.raises(ValueError, match=f"^{says}"):
            llm.generate(["Hello,", "Hi"], greedy, use_tqdm=False, **keywords)
    assert not llm.engine.requests
    with pytest.raises(TypeError, match="unexpected keyword argument 'lora_requests'"):
        llm.generate(["Hello,"], greedy, lora_requests=None)
    # vLLM's use_tqdm may be a callable making the bar
    made: list[int] = []

    def bar(total: int, **_: object) -> object:
        made.append(total)
        return type("Bar", (), {"update": lambda self, n: None, "close": lambda self: None})()

    assert len(llm.generate(["Hi"] * 16, greedy, use_tqdm=bar)) == 16 and made == [16]

    chat = [{"role": "user", "content": "Name a colour."}]
    (plain,) = llm.chat(chat, greedy, use_tqdm=False)
    # vLLM's positional order: messages, sampling_params, use_tqdm, lora_request
    (same,) = llm.chat(chat, greedy, False, None, tokenization_kwargs=None, mm_processor_kwargs=None)
    assert (same.prompt_token_ids, same.outputs[0].token_ids) == (
        plain.prompt_token_ids,
        plain.outputs[0].token_ids,
    )
    with pytest.raises(ValueError, match="^lora_request: LoRA adapters are not implemented"):
        llm.chat(chat, greedy, lora_request=adapter)
    with pytest.raises(ValueError, match="^mm_processor_kwargs \\['max_pixels'\\]"):
        llm.chat(chat, greedy, mm_processor_kwargs={"max_pixels": 4})
    with pytest.raises(TypeError, match="unexpected keyword argument 'lora'"):
        llm.chat(chat, greedy, lora=None)
    beams = BeamSearchParams(beam_width=2, max_tokens=2)
    (searched,) = llm.beam_search([{"prompt_token_ids": [9707]}], beams, lora_request=None, use_tqdm=False)
    assert len(searched.sequences) == 2
    with pytest.raises(ValueError, match="^lora_request: LoRA adapters are not implemented"):
        llm.beam_search([{"prompt_token_ids": [9707]}], beams, lora_request=adapter)


def test_get_tokenizer_takes_vllms_lora_request_and_set_tokenizer_replaces_it(
    tokenized_checkpoint: str, kimi_tokenizer_folder
) -> None:
    """Older vLLM's `llm.get_tokenizer(lora_request=None)` returns the tokenizer (it was a
    TypeError), an adapter is a ValueError naming LoRA; `llm.set_tokenizer(tok)` (an
    AttributeError) makes prompts, chats and outputs' text use `tok`."""
    from deltaserve.models.checkpoints.loader import load_tokenizer

    llm = LLM(tokenized_checkpoint, device="cpu", dtype="float32")
    qwen = llm.get_tokenizer()
    assert llm.get_tokenizer(None) is qwen and llm.get_tokenizer(lora_request=None) is qwen
    with pytest.raises(ValueError, match="^lora_request: LoRA adapters are not implemented"):
        llm.get_tokenizer(object())
    toy = load_tokenizer(kimi_tokenizer_folder[0])
    llm.set_tokenizer(toy)
    assert llm.get_tokenizer() is toy
    # tokens the toy vocabulary holds, so that its decode reads them
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, allowed_token_ids=list(range(200))
    )
    (out,) = llm.generate(["The quick brown fox"], params, use_tqdm=False)
    assert out.prompt_token_ids == toy.encode("The quick brown fox")
    ids = list(out.outputs[0].token_ids)
    assert out.outputs[0].text == toy.decode(ids) != qwen.decode(ids)
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)
    assert chat.prompt == "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"


def test_vllms_routine_keyword_arguments_run_and_unknown_ones_are_a_type_error(
    make_checkpoint, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A vLLM script's LLM(..., swap_space=4, tokenizer_mode="auto", dtype="half") runs: machinery
    deltaserve lacks is ignored with one warning, a value whose meaning it has is taken, one that
    would change the results is refused."""
    import torch

    from deltaserve.engine import llm_arguments
    from deltaserve.engine.config import EngineConfig
    from deltaserve.engine.llm_arguments import engine_kwargs

    monkeypatch.setattr(llm_arguments, "_warned", set(), raising=False)  # warned once a process
    vllm = {"swap_space": 4, "tokenizer_mode": "auto", "cpu_offload_gb": 0, "task": "generate"}
    with caplog.at_level(logging.WARNING, logger="deltaserve.engine.llm_arguments"):
        assert engine_kwargs({**vllm, "dtype": "half"}) == ({"dtype": "half"}, "auto")
        assert engine_kwargs({**vllm, "dtype": torch.bfloat16}) == ({"dtype": "bfloat16"}, "auto")
    assert EngineConfig(model="m", device="cpu", dtype="half").dtype == "float16"  # vLLM's name
    assert caplog.messages == [
        "swap_space is ignored: a preempted request is recomputed, never swapped to CPU memory"
    ]
    for name, value in (("tokenizer_mode", "slow"), ("tokenizer_mode", "mistral"), ("cpu_offload_gb", 4)):
        with pytest.raises(ValueError, match=f"^{name} {value!r}: only "):
            engine_kwargs({name: value})
    # vLLM's None is its default, the cache on
    assert engine_kwargs({"enable_prefix_caching": None}) == ({}, "auto")
    assert engine_kwargs({"enable_prefix_caching": False}) == ({"cache_type": "naive"}, "auto")
    # as is None for vLLM's names of ours
    assert engine_kwargs({"block_size": None, "gpu_memory_utilization": None, "max_num_seqs": None}) == (
        {},
        "auto",
    )
    with pytest.raises(TypeError, match="^LLM\\(\\) got an unexpected keyword argument 'enable_lora'$"):
        engine_kwargs({"swap_space": 4, "enable_lora": True})
    llm = LLM(make_checkpoint("qwen3_next"), device="cpu", dtype=torch.float32, **vllm)
    assert llm.engine.config.dtype == "float32"
    assert llm.generate([[5, 9, 17]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_seed_none_is_seed_0_as_in_vllm(make_checkpoint) -> None:
    """LLM(..., seed=None), vLLM's signature default, is seed 0, as vLLM's engine takes it."""
    checkpoint = make_checkpoint("qwen3_next")
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    drawn = [
        LLM(checkpoint, device="cpu", dtype="float32", seed=seed).generate([[5, 9, 17]], params)[0]
        for seed in (None, 0)
    ]
    assert drawn[0].outputs[0].token_ids == drawn[1].outputs[0].token_ids


@pytest.mark.parametrize(
    "setting, says",
    [
        ({"max_model_len": 1}, "max_model_len must be at least 2"),
        ({"max_model_len": 0}, "max_model_len must be at least 2"),
        # vLLM's names are named as given, not as the EngineConfig field they set
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be a fraction in (0, 1], got 1.5"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static must be a fraction in (0, 1], got 1.5"),
        ({"max_num_seqs": 0}, "max_num_seqs must be at least 1, got 0"),
        ({"max_running_requests": 0}, "max_running_requests must be at least 1, got 0"),
        ({"block_size": 12}, "block_size must be a power of two, got 12"),
        ({"block_size": "16"}, "block_size must be an integer, got '16'"),
        ({"page_size": 12}, "page_size must be a power of two, got 12"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes must be positive, got 0"),
        ({"kv_cache_memory_bytes": -(2**30)}, f"kv_cache_memory_bytes must be positive, got {-(2**30)}"),
        ({"pool_memory_gb": 0}, "pool_memory_gb must be positive, got 0.0"),
        # a switch given a string ("False" is truthy) turned it on
        ({"enforce_eager": "False"}, "enforce_eager must be True or False, got 'False'"),
        ({"disable_cuda_graph": "yes"}, "disable_cuda_graph must be True or False, got 'yes'"),
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be True or False, got 'false'"),
        ({"enable_overlap_schedule": 0}, "enable_overlap_schedule must be True or False, got 0"),
        ({"max_waiting_requests": -1}, "max_waiting_requests must be at least 0"),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs must be at least 1"),
        # a wrong type is named, where "32k" was "'<' not supported between 'str' and 'int'"
        # and 2.5 was taken as a length
        ({"max_model_len": "32k"}, "max_model_len must be an integer, got '32k'"),
        ({"max_model_len": 2.5}, "max_model_len must be an integer, got 2.5"),
        ({"max_num_seqs": 8.0}, "max_num_seqs must be an integer, got 8.0"),
        ({"seed": True}, "seed must be an integer, got True"),
        ({"tensor_parallel_size": "2"}, "tensor_parallel_size must be an integer, got '2'"),
        ({"pool_memory_gb": "1"}, "pool_memory_gb must be a number, got '1'"),
        ({"gpu_memory_utilization": float("nan")}, "gpu_memory_utilization must be a number, got nan"),
        ({"kv_cache_memory_bytes": "2G"}, "kv_cache_memory_bytes must be an integer, got '2G'"),
    ],
)
def test_values_the_cli_refuses_are_refused_offline_too(
    make_checkpoint, tmp_path: Path, setting: dict, says: str
) -> None:
    """The values the CLI's flags refuse are a ValueError naming the argument as given, before the
    model loads (max_model_len=1 would refuse every prompt, 0 would serve the model's full length)."""
    with pytest.raises(ValueError) as error:
        LLM(config_only(make_checkpoint("qwen3_next"), tmp_path / "bare"), device="cpu", **setting)
    assert str(error.value).startswith(says)


def test_numpy_numbers_are_taken_as_pythons(make_checkpoint) -> None:
    """Integer, real and bool settings computed with numpy (np.int64, np.float32, np.bool_) run,
    stored as Python's."""
    import numpy as np

    llm = LLM(
        make_checkpoint("qwen3_next"),
        device="cpu",
        max_model_len=np.int64(64),
        max_num_seqs=np.int32(4),
        pool_memory_gb=np.float32(0.25),
        enforce_eager=np.bool_(True),
    )
    config = llm.engine.config
    assert config.disable_cuda_graph is True
    assert (config.max_model_len, config.max_running_requests, config.pool_memory_gb) == (64, 4, 0.25)
    assert type(config.max_model_len) is int and type(config.pool_memory_gb) is float
    assert llm.generate([[5, 9, 17]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids


def test_max_model_len_minus_one_is_vllms_auto(make_checkpoint, caplog: pytest.LogCaptureFixture) -> None:
    """LLM(max_model_len=-1), as vLLM's LLM takes it: the model's 1,024 positions, lowered to the
    whole pages one request holds where the pools are smaller (the model's length is then refused)."""
    checkpoint = make_checkpoint("qwen3_next")
    with pytest.raises(ValueError, match="not enough memory for one request"):
        LLM(checkpoint, device="cpu", pool_memory_gb=0.0002)
    with caplog.at_level(logging.INFO, logger="deltaserve.engine.cache.pool_sizing"):
        llm = LLM(checkpoint, device="cpu", max_model_len=-1, pool_memory_gb=0.0002)
    assert llm.engine.max_model_len == 752 and llm.engine.max_model_len % llm.engine.config.page_size == 0
    assert "max_model_len auto: lowered from 1024 to 752 tokens" in caplog.text
    assert llm.generate([[5] * 700], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="752"):
        llm.generate([[5] * 752], SamplingParams(max_tokens=2))
    assert LLM(checkpoint, device="cpu", max_model_len=-1, pool_memory_gb=0.01).engine.max_model_len == 1024


def test_pools_too_small_name_the_offline_llms_arguments_too(make_checkpoint) -> None:
    """The sizing errors name the LLM's arguments beside the CLI's flags: an offline caller has no
    --pool-memory-gb to raise."""
    checkpoint = make_checkpoint("qwen3_next")
    with pytest.raises(ValueError, match="not enough memory for one request") as refused:
        LLM(checkpoint, device="cpu", pool_memory_gb=0.0002)
    assert "LLM: max_model_len" in str(refused.value) and "LLM: pool_memory_gb" in str(refused.value)
    with pytest.raises(ValueError, match="^max_model_len auto: not enough memory") as auto:
        LLM(checkpoint, device="cpu", max_model_len=-1, kv_cache_memory_bytes=1024)
    assert "kv_cache_memory_bytes" in str(auto.value)


def test_load_format_takes_vllms_safetensors_and_refuses_what_it_cannot_load() -> None:
    """load_format 'safetensors' (vLLM's name) loads as auto does; a format deltaserve has no loader
    for ('pt', a typo) is a ValueError before anything loads, where it loaded the safetensors."""
    from deltaserve.engine.config import EngineConfig

    assert EngineConfig(model="m", device="cpu", load_format="safetensors").load_format == "auto"
    for name in ("pt", "dumy"):
        with pytest.raises(ValueError, match="load_format must be"):
            EngineConfig(model="m", device="cpu", load_format=name)


def test_kv_cache_memory_bytes_sizes_the_pools_and_vllms_none_defaults_are_taken() -> None:
    """LLM(kv_cache_memory_bytes=N), vLLM's, is pool_memory_gb in bytes; kv_cache_dtype=None and
    pipeline_parallel_size=None, vLLM's defaults, are ours."""
    from deltaserve.engine.llm_arguments import engine_kwargs

    assert engine_kwargs({"kv_cache_memory_bytes": 3 * 2**29}) == ({"pool_memory_gb": 1.5}, "auto")
    with pytest.raises(ValueError, match="not both"):
        engine_kwargs({"kv_cache_memory_bytes": 2**30, "pool_memory_gb": 1.0})
    assert engine_kwargs({"kv_cache_dtype": None, "pipeline_parallel_size": None}) == ({}, "auto")
