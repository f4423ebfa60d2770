"""Reading a checkpoint folder: config.json, single or sharded safetensors, tokenizer."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from deltaserve.models.layers.attention import check_max_model_len, rope_max_positions
from deltaserve.models.parallel import SINGLE, Narrow, TensorParallel
from deltaserve.models.registry import resolve, text_config

if TYPE_CHECKING:
    from deltaserve.models.checkpoints.quantization import Fp8Config
    from deltaserve.models.layers.common import HybridCausalLM
    from deltaserve.models.vision.tower import VisionTower

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: HybridCausalLM
    config: Any  # the text model's config
    architecture: str
    num_params: int  # the whole model's, also under tensor parallelism
    tp: TensorParallel = SINGLE
    vision: VisionTower | None = None  # a vision-language checkpoint's tower (images in prompts)
    vision_config: Any = None
    image_token_id: int | None = None


def require_config(path: str) -> str:
    """The checkpoint folder's config.json, or the FileNotFoundError that names both."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise FileNotFoundError(f"no config.json in {path!r}: is it a Hugging Face checkpoint folder?")
    return cfg_file


def read_config(path: str, overrides: dict[str, Any] | None = None) -> tuple[Any, str]:
    """(HF config object, architecture) of a checkpoint folder, with `overrides` (vLLM's
    --hf-overrides) set on it."""
    cfg_file = require_config(path)
    with open(cfg_file) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError(f"{cfg_file} names no architectures")
    refuse_quantized(path, raw)
    from transformers import AutoConfig

    # never remote code (and no interactive "run the custom code?" prompt in a server)
    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    override_config(config, overrides or {})
    return config, archs[0]


def override_config(config: Any, overrides: dict[str, Any], where: str = "") -> None:
    """Set each value on the config; a dict given for a nested config (Qwen3.5's text_config)
    sets its keys there, any other value (rope_parameters included) replaces the old one whole."""
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(current, "to_dict"):
            override_config(current, value, f"{where}{key}.")
        else:
            setattr(config, key, value)
            logger.info("config %s%s overridden: %r", where, key, value)


def refuse_quantized(path: str, raw_config: dict[str, Any]) -> Fp8Config | None:
    """The checkpoint's FP8 block quantization (models/checkpoints/quantization.py), None when unquantized,
    and an error for every other quantization: FP8 weights read without their scales, or any
    format deltaserve does not implement, would load silently and generate noise. Looked for in
    config.json and in the files' own dtypes."""
    from deltaserve.models.checkpoints.quantization import Fp8Config

    for cfg in (raw_config, raw_config.get("text_config") or {}):
        quant = cfg.get("quantization_config")
        if quant:
            return Fp8Config.from_checkpoint(path, quant)
    for name, dtype, _ in _safetensors_headers(path):
        if dtype.startswith("F8") or name.endswith(("weight_scale_inv", "weight_scale")):
            raise ValueError(
                f"{path!r} holds quantized weights ({name}: {dtype}) but config.json has no "
                "quantization_config; deltaserve serves unquantized checkpoints and block-FP8 ones"
            )
    return None


def checkpoint_quantization(path: str) -> Fp8Config | None:
    with open(os.path.join(path, "config.json")) as f:
        return refuse_quantized(path, json.load(f))


def _safetensors_headers(path: str) -> Iterator[tuple[str, str, list[int]]]:
    """(tensor name, safetensors dtype such as 'BF16' or 'F8_E4M3', shape) from the files' headers alone."""
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        with open(os.path.join(path, name), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, info in header.items():
            if key != "__metadata__":
                yield key, str(info.get("dtype", "")), list(info.get("shape", []))


def iter_safetensors(
    path: str,
    progress: bool = False,
    narrow: Callable[[str, tuple[int, ...]], Narrow | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a single-file or sharded (index.json) safetensors checkpoint; `progress`
    shows a bar over the shards on stderr. `narrow(name, shape)` names the part of a tensor to
    read (a tensor-parallel rank's), and only that part is read from the file; a tensor the rank
    holds nothing of (another rank's expert) is not read nor yielded."""
    from safetensors import safe_open
    from tqdm import tqdm

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path!r}")
    for name in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=not progress):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if narrow is None:
                    yield key, f.get_tensor(key)
                    continue
                lazy = f.get_slice(key)
                part = narrow(key, tuple(lazy.get_shape()))
                if part is not None and part.holds_nothing:
                    continue
                yield key, (f.get_tensor(key) if part is None else part.read(lazy))


M = TypeVar("M", bound=nn.Module)
# where MoE blocks run their shared expert as one more routed expert; the CPU (the oracle) keeps
# transformers' order of operations
SHARED_EXPERT_FUSION = ("cuda",)


def build_on(device: torch.device, dtype: torch.dtype, make: Callable[[], M]) -> M:
    """`make()` with its parameters created in place on `device` in `dtype` (the serving dtype):
    no full-size fp32 copy on the host."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights of a realistic scale, for benchmarks without checkpoints."""
    from deltaserve.models.layers.common import ZeroCenteredRMSNorm

    # a norm stored as an offset from one is neutral at 0, every other norm at 1
    zero_centred = {
        f"{name}.weight" for name, m in model.named_modules() if isinstance(m, ZeroCenteredRMSNorm)
    }
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.dtype.itemsize == 1:  # FP8 weights and their records: models/checkpoints/quantization.py's
                continue
            gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
            if name.endswith("A_log"):
                p.uniform_(1.0, 16.0, generator=gen).log_()
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif p.dim() == 1:
                p.fill_(0.0 if name in zero_centred or "bias" in name else 1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _model_of(path: str, hf_overrides: dict[str, Any] | None) -> tuple[Any, str, Any, bool, Any]:
    """(config, architecture, model class, nested, text config) of a checkpoint folder."""
    config, arch = read_config(path, hf_overrides)
    cls, nested = resolve(arch)
    tcfg = text_config(config, nested)
    if nested and getattr(config, "tie_word_embeddings", None) is not None:
        tcfg.tie_word_embeddings = config.tie_word_embeddings
    return config, arch, cls, nested, tcfg


def check_tensor_parallel(
    path: str, size: int, expert_parallel: bool = False, hf_overrides: dict[str, Any] | None = None
) -> None:
    """The ValueError a rank would raise building its shard of the checkpoint's model (heads,
    experts or widths that do not divide by `size`), raised here from config.json alone: the
    model is built on the meta device, so that the layers' own checks run before any rank starts."""
    if size <= 1:
        return
    _, _, cls, _, tcfg = _model_of(path, hf_overrides)
    # the checks depend on the size alone, so rank 0's shard stands for every rank's
    with torch.device("meta"):
        cls(tcfg, TensorParallel(0, size, None, expert_parallel=expert_parallel))


# where Qwen3-Next / Qwen3.5 checkpoints keep the MTP layer's weights
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.", "language_model.mtp.")


def num_mtp_layers(config: Any) -> int:
    n = getattr(config, "mtp_num_hidden_layers", None) or getattr(config, "num_nextn_predict_layers", None)
    return int(n or 1)


def check_mtp(path: str, dummy: bool = False, hf_overrides: dict[str, Any] | None = None) -> None:
    """What MTP speculation needs of the checkpoint, from config.json and the safetensors headers
    alone: a model with an MTP head, one MTP layer, and its `mtp.*` weights unless they are random."""
    _, arch, cls, _, tcfg = _model_of(path, hf_overrides)
    if not cls.capabilities.mtp_head:
        raise ValueError(f"MTP speculation needs a Qwen3-Next / Qwen3.5 checkpoint, not {arch}")
    if num_mtp_layers(tcfg) != 1:
        raise ValueError(f"only one MTP layer is supported, the config has {num_mtp_layers(tcfg)}")
    if not dummy and not any(name.startswith(MTP_PREFIXES) for name, _, _ in _safetensors_headers(path)):
        raise ValueError("the checkpoint has no mtp.* weights: MTP speculation needs them")


def check_model_len(path: str, max_model_len: int | None, hf_overrides: dict[str, Any] | None = None) -> None:
    """`check_max_model_len` from config.json alone (with `hf_overrides`), before any weight loads."""
    if max_model_len is not None and max_model_len != -1:  # -1: vLLM's auto, within the positions
        check_max_model_len(max_model_len, rope_max_positions(_model_of(path, hf_overrides)[4]))


def check_checkpoint(config: Any) -> None:
    """What an engine's config (`EngineConfig`) asks of its checkpoint that config.json and the
    safetensors headers answer before any weight loads: a tensor-parallel size its heads divide by,
    a max_model_len within its positions, and MTP weights for MTP speculation (ValueError); and
    config.json itself (FileNotFoundError)."""
    require_config(config.model)  # a folder without one fails here, not in the engine's load
    hf = config.hf_overrides
    check_tensor_parallel(config.model, config.tensor_parallel_size, config.enable_expert_parallel, hf)
    check_model_len(config.model, config.max_model_len, hf)
    if config.spec is not None and config.spec.method == "mtp":
        check_mtp(config.model, config.load_format == "dummy", hf)


def load_model(
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    *,
    quantization: str | None = None,
    tp: TensorParallel = SINGLE,
    hf_overrides: dict[str, Any] | None = None,
    vision: bool = True,
    structure_device: torch.device | None = None,
) -> LoadedModel:
    """The model of a checkpoint folder; with `tp`, this rank's shard of it, read from the
    files slice by slice; `hf_overrides` set on its config first. A vision-language checkpoint's
    vision tower is loaded too, on one device (tensor parallelism: rank 0's), unless `vision` is False.
    `structure_device`: the device whose layout the model takes (default `device`), for a copy
    staged in host memory for a model on another device."""
    config, arch, cls, nested, tcfg = _model_of(path, hf_overrides)
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load format {load_format!r}; use 'auto' or 'dummy'")
    if load_format == "dummy":  # nothing is read from the checkpoint but its config
        logger.info("making random weights (--load-format dummy) for %s (%s) on %s", path, arch, device)
    else:
        logger.info("loading the weights of %s (%s) onto %s", path, arch, device)
    make = lambda: cls(tcfg, tp)  # noqa: E731
    model = build_and_load(
        path, make, dtype, device, load_format, seed, quantization, tp, tp.rank == 0, structure_device
    )
    num_params = sum(p.numel() for p in model.parameters())
    if tp.enabled:  # a rank holds a shard: count the whole model on the meta device instead
        with torch.device("meta"):
            num_params = sum(p.numel() for p in cls(tcfg).parameters())
    loaded = LoadedModel(model, tcfg, arch, num_params, tp)
    vcfg = getattr(config, "vision_config", None) if nested else None
    if vision and vcfg is not None and tp.rank == 0:  # rank 0 alone: its embeddings go to the others
        loaded.vision = load_vision_tower(path, vcfg, dtype, device, load_format, seed)
        loaded.vision_config, loaded.image_token_id = vcfg, int(config.image_token_id)
    return loaded


def load_vision_tower(
    path: str, vcfg: Any, dtype: torch.dtype, device: torch.device, load_format: str, seed: int
) -> VisionTower:
    """The checkpoint's `model.visual.*` (or `visual.*`) weights in a `VisionTower`; FP8 ones
    (a quantized release that did not leave the tower out) dequantized by their block scales."""
    from deltaserve.models.vision.tower import VisionTower

    tower = build_on(device, dtype, lambda: VisionTower(vcfg))
    if load_format == "dummy":
        init_dummy_weights(tower, seed + 1)
        return tower.eval()
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                for prefix in ("model.visual.", "visual."):
                    if key.startswith(prefix):
                        tensors[key[len(prefix) :]] = f.get_tensor(key)
    for key in [k for k in tensors if k.endswith(".weight_scale_inv")]:
        scale, weight = tensors.pop(key), key[: -len("_scale_inv")]
        w = tensors[weight].float()
        rows, cols = w.shape[0], w.shape[-1]
        full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        tensors[weight] = (w.view(rows, -1) * full).view(w.shape)
    missing, unexpected = tower.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise ValueError(
            f"the checkpoint's vision tower does not match its config (missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}); run it with --language-model-only to serve text alone"
        )
    return tower.eval()


def build_and_load(
    path: str,
    make: Callable[[], M],
    dtype: torch.dtype,
    device: torch.device,
    load_format: str,
    seed: int,
    quantization: str | None,
    tp: TensorParallel = SINGLE,
    progress: bool = False,
    structure_device: torch.device | None = None,
) -> M:
    """`make()` on `device` with the checkpoint's weights (or random ones: load_format 'dummy');
    FP8 when the checkpoint is block-FP8 or `quantization` is 'fp8' (quantized as it loads);
    with `tp`, only this rank's slices are read."""
    from deltaserve.models.checkpoints import quantization as q

    if quantization not in (None, *q.METHODS):
        raise ValueError(f"unknown quantization {quantization!r}; supported: {', '.join(q.METHODS)}")
    fp8 = checkpoint_quantization(path)
    quantize = fp8 is None and quantization == "fp8"
    if quantize:
        fp8 = q.Fp8Config()
    build = lambda: build_on(device, dtype, make)  # noqa: E731
    model: M = q.build_fp8(build, device, dtype) if fp8 is not None else build()  # type: ignore[assignment]
    # linear-attention gate parameters stay fp32: exp(A_log) in bf16 loses the decay
    for name, p in model.named_parameters():
        if name.endswith(("A_log", "dt_bias")):
            p.data = p.data.float()
    if load_format == "dummy":
        if fp8 is not None:
            q.init_dummy_fp8(model, fp8, device, seed)
        init_dummy_weights(model, seed)
    else:
        narrow = model.checkpoint_narrow if tp.enabled else None
        if fp8 is None:
            weights = iter_safetensors(path, progress=progress, narrow=narrow)  # type: ignore[arg-type]
        else:
            headers = list(_safetensors_headers(path))
            read = q.read_narrow(narrow, headers, fp8, quantize) if narrow is not None else None  # type: ignore[arg-type]
            weights = iter_safetensors(path, progress=progress, narrow=read)
            weights = q.fp8_weights(weights, headers, fp8, dtype, device, quantize, narrow)  # type: ignore[arg-type]
        model.load_weights(weights)  # type: ignore[operator]
    for module in model.modules():  # what a layer derives from its loaded weights (YaRN's norms)
        after = getattr(module, "after_loading", None)
        if after is not None:
            after()
    if (structure_device or device).type in SHARED_EXPERT_FUSION:
        from deltaserve.models.layers.common import fuse_shared_experts

        if fused := fuse_shared_experts(model):
            logger.info("shared experts run as one more routed expert in %d MoE blocks", fused)
    return model.eval()


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "tiktoken.model",
)


def has_tokenizer(path: str) -> bool:
    """Whether the folder holds any tokenizer file that `load_tokenizer` reads."""
    return any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES)


def require_tokenizer(path: str, named: str) -> None:
    """A tokenizer asked for by name must be there (`named`: how the caller gave it): without one the
    engine would serve token-id prompts alone."""
    if not has_tokenizer(path):
        raise ValueError(f"{named} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")


def load_tokenizer(path: str) -> Any | None:
    """The checkpoint's tokenizer, or None when it ships no tokenizer files."""
    if not has_tokenizer(path):
        return None
    from deltaserve.models.checkpoints.tiktoken_tokenizer import is_tiktoken_folder, load_tiktoken_tokenizer

    if is_tiktoken_folder(path):  # Kimi-Linear's: a tiktoken file and remote code, read natively
        return load_tiktoken_tokenizer(path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # a remote-code tokenizer we cannot run offline, for example
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"))
        raise ValueError(
            f"cannot load the tokenizer in {path!r} ({e}); provide a tokenizer.json, or send token-id prompts"
        ) from e
