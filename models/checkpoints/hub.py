"""A checkpoint named by its Hugging Face repo id (`Qwen/Qwen3.5-9B`), as vLLM and SGLang take one:
its files fetched into the Hub's cache, or found there when the Hub cannot be reached
(`HF_HUB_OFFLINE=1`, no network). A path that exists is used as it is."""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# what deltaserve reads: config, tokenizer and generation config (JSON, Jinja, merges, Kimi's
# tiktoken ranks) and the safetensors weights; no PyTorch .bin, no ONNX or GGUF copies
_FILES = ["*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
_WEIGHTS = ["*.safetensors"]


class CheckpointNotFound(ValueError):
    """Neither a folder nor a repo id the Hub (or its cache) has."""


def is_repo_id(name: str) -> bool:
    """Whether `name`, which is not an existing path, has a repo id's shape (`org/name`)."""
    return not os.path.exists(name) and _REPO_ID.fullmatch(name) is not None and ".." not in name


def resolve_checkpoint(
    name: str,
    revision: str | None = None,
    download_dir: str | None = None,
    weights: bool = True,
    tokenizer_only: bool = False,
) -> str:
    """The folder of checkpoint `name`: the path itself if it exists, else the Hub cache's snapshot
    of repo `name` at `revision` (a branch, tag or commit; default main) under `download_dir` (default
    the Hub's cache, `HF_HOME`), fetched first unless it is there and current. `weights=False` fetches
    all but the safetensors (random weights, `--load-format dummy`). `tokenizer_only`: a tokenizer's
    repo (`--tokenizer`), no weights fetched and no config.json asked for, as vLLM takes one."""
    if os.path.exists(name):
        return name
    if not is_repo_id(name):
        raise CheckpointNotFound(f"{name!r} is neither a folder nor a Hugging Face repo id (org/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = _FILES + (_WEIGHTS if weights and not tokenizer_only else [])
    logger.info(
        "fetching %s%s from the Hugging Face Hub (or its cache)", name, f"@{revision}" if revision else ""
    )
    try:
        path = snapshot_download(name, revision=revision, cache_dir=download_dir, allow_patterns=patterns)
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        why = str(exc).strip().splitlines()  # the Hub's messages end with what to do
        raise CheckpointNotFound(
            f"{name!r} is no folder here, and the Hugging Face Hub cannot give it, nor its cache: "
            f"{why[-1] if why else exc}"
        ) from None
    if not tokenizer_only and not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointNotFound(f"{name!r} at {path} has no config.json: is it a model repo?")
    logger.info("%s is at %s", name, path)
    return str(path)
