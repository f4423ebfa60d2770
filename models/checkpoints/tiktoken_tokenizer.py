"""Kimi-Linear's tokenizer without its remote code.

Moonshot ships Kimi-Linear's tokenizer as a `tiktoken.model` (base64 token bytes and rank per
line) plus Python code (`tokenization_kimi.py`, run only with trust_remote_code) that builds a
tiktoken `Encoding` and wraps it as a slow transformers tokenizer; that code imports transformers
4 internals that transformers 5 no longer has. Here the same vocabulary becomes a fast
`tokenizers` tokenizer: byte-level BPE whose merges come from the ranks (transformers'
`TikTokenConverter`), the released split pattern, and the special tokens the remote code
defines: the ids right after the base vocabulary, named by `tokenizer_config.json`'s
`added_tokens_decoder` or `<|reserved_token_{id}|>`. Special-token text in a prompt encodes to
its id, as the remote code's `allowed_special="all"` does (chat templates rely on it).
`tests/models/test_tiktoken_tokenizer.py` holds it to tiktoken itself.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any

# the split pattern of Kimi's released tokenizer (`tokenization_kimi.py`, `pat_str`)
KIMI_PATTERN = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
NUM_SPECIAL = 256 + 2  # reserved ids after the base vocabulary (the remote code's count)
# tool-call markers: kept in decoded text (not "special" here, unlike the remote code, whose
# users turn skip_special_tokens off for tools), so that the server can read the calls
TOOL_MARKERS = frozenset(
    {
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_section_begin|>",
        "<|tool_call_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    }
)


def is_tiktoken_folder(path: str) -> bool:
    """A tokenizer shipped as `tiktoken.model` with no `tokenizer.json` (Kimi's form)."""
    return os.path.isfile(os.path.join(path, "tiktoken.model")) and not os.path.isfile(
        os.path.join(path, "tokenizer.json")
    )


def read_ranks(file: str) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(file, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{file}: the ranks are not 0..{len(ranks) - 1}")
    return ranks


def load_tiktoken_tokenizer(path: str) -> Any:
    """The folder's `tiktoken.model` and `tokenizer_config.json` as a PreTrainedTokenizerFast."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = read_ranks(os.path.join(path, "tiktoken.model"))
    config: dict[str, Any] = {}
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            config = json.load(f)
    named = {int(i): t["content"] for i, t in (config.get("added_tokens_decoder") or {}).items()}
    base = len(ranks)
    specials = [named.get(i, f"<|reserved_token_{i}|>") for i in range(base, base + NUM_SPECIAL)]

    class Converter(TikTokenConverter):
        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:  # type: ignore[override]
            return ranks

    tok = Converter(vocab_file="", pattern=KIMI_PATTERN).converted()
    # special tokens take the ids after the base vocabulary, in order
    for s in specials:  # one at a time: each takes the next id
        if s in TOOL_MARKERS:
            tok.add_tokens([AddedToken(s, special=False, normalized=False)])
        else:
            tok.add_special_tokens([AddedToken(s, special=True, normalized=False)])
    for i, s in enumerate(specials):
        if tok.token_to_id(s) != base + i:
            raise ValueError(f"{path}: special token {s!r} did not land on id {base + i}")

    def special(name: str, default: str | None) -> str | None:
        value = config.get(name, default)
        return value.get("content") if isinstance(value, dict) else value

    class KimiTokenizerFast(PreTrainedTokenizerFast):
        """Renders tools with every key sorted, as Kimi's remote code does before its template."""

        def apply_chat_template(self, conversation: Any, tools: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
            return super().apply_chat_template(conversation, tools=sorted_keys(tools), **kwargs)

    tokenizer = KimiTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos_token", "[BOS]"),
        eos_token=special("eos_token", "[EOS]"),
        pad_token=special("pad_token", None),
        unk_token=special("unk_token", None),
        clean_up_tokenization_spaces=False,
        model_max_length=int(config.get("model_max_length") or 1 << 30),
    )
    template = config.get("chat_template")
    template_file = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(template_file):
        with open(template_file) as f:
            template = f.read()
    if template:
        tokenizer.chat_template = template
    return tokenizer


def sorted_keys(obj: Any) -> Any:
    """`obj` with every dict's keys in sorted order, nested (lists keep their order)."""
    if isinstance(obj, dict):
        return {k: sorted_keys(v) for k, v in sorted(obj.items())}
    if isinstance(obj, list):
        return [sorted_keys(v) for v in obj]
    return obj
