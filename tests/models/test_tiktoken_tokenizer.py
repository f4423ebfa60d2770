"""Kimi-Linear's tokenizer read natively (`models/tiktoken_tokenizer.py`) against tiktoken itself
(what Kimi's remote code wraps), on a toy `tiktoken.model` built here: the same ids for mixed
Latin / CJK / digit / whitespace text and special-token text, the same decoded text, and a tiny
Kimi-Linear checkpoint with it serves text prompts and a chat template end to end."""

from __future__ import annotations

import base64
import json
import random

import pytest

tiktoken = pytest.importorskip("tiktoken")

from deltaserve.models.tiktoken_tokenizer import KIMI_PATTERN, NUM_SPECIAL, load_tiktoken_tokenizer  # noqa: E402

CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2026 and we're testing 12345 tokens!\n\n"
    "中国的首都是北京。 Tokenizers split CamelCase words like HTTPServer and naïve café.\n"
    "  indented   spaces\tand tabs\r\n"
)
SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|im_system|>",
    7: "<|im_middle|>",
}
TEMPLATE = (
    "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def toy_ranks(merges: int = 300) -> dict[bytes, int]:
    """Every byte, then the most frequent adjacent pairs of a small corpus, merged greedily
    (a real BPE training run in miniature, so that merges nest as in a released vocabulary)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in CORPUS.split(" ")] * 3
    for _ in range(merges):
        counts: dict[tuple[bytes, bytes], int] = {}
        for w in words:
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + 1
        if not counts:
            break
        (a, b), _ = max(counts.items(), key=lambda kv: (kv[1], kv[0]))
        ranks.setdefault(a + b, len(ranks))
        for w in words:
            i = 0
            while i < len(w) - 1:
                if w[i] == a and w[i + 1] == b:
                    w[i : i + 2] = [a + b]
                i += 1
    return ranks


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi_tok")
    ranks = toy_ranks()
    with open(path / "tiktoken.model", "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    base = len(ranks)
    config = {
        "added_tokens_decoder": {str(base + i): {"content": s, "special": True} for i, s in SPECIALS.items()},
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": TEMPLATE,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path), ranks


def oracle(ranks: dict[bytes, int]):
    base = len(ranks)
    special = {SPECIALS.get(i, f"<|reserved_token_{base + i}|>"): base + i for i in range(NUM_SPECIAL)}
    return tiktoken.Encoding(name="toy", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=special)


def test_ids_and_text_match_tiktoken(folder):
    path, ranks = folder
    tok, ref = load_tiktoken_tokenizer(path), oracle(ranks)
    rng = random.Random(0)
    pieces = CORPUS.split(" ") + [
        "<|im_end|>",
        "[EOS]",
        "\n",
        "  ",
        "１２３",
        "Ünïcödé",
        "'S",
        "DON'T",
        "x" * 40,
    ]
    texts = [CORPUS, "<|im_user|>user<|im_middle|>你好<|im_end|>"]
    texts += [" ".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    texts += ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 30))) for _ in range(200)]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok.decode(ids) == ref.decode(ids) == text
    base = len(ranks)
    assert tok.convert_tokens_to_ids("<|im_end|>") == base + 2
    assert tok.convert_ids_to_tokens(base + 5) == f"<|reserved_token_{base + 5}|>"
    assert len(tok) == base + NUM_SPECIAL
    assert tok.eos_token == "[EOS]" and tok.eos_token_id == base + 1
    assert tok.decode([base + 2, *ref.encode("ok")], skip_special_tokens=True) == "ok"


def test_a_kimi_checkpoint_serves_text_with_it(folder, tmp_path, kimi_builder, kimi_config):
    """The engine loads the tokenizer from a Kimi checkpoint folder (no remote code run), renders
    its chat template and returns text; the prompt's ids are tiktoken's."""
    import shutil

    from deltaserve import LLM, SamplingParams

    path, ranks = folder
    ckpt = tmp_path / "kimi"
    kimi_builder(str(ckpt), {**kimi_config, "vocab_size": len(ranks) + NUM_SPECIAL})
    for name in ("tiktoken.model", "tokenizer_config.json"):
        shutil.copy(f"{path}/{name}", ckpt / name)
    llm = LLM(str(ckpt), dtype="float32", device="cpu")
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "中国 fox?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_token_ids == oracle(ranks).encode(prompt, allowed_special="all")
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
