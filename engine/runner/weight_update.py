"""New weights for the live model from another checkpoint of it (SGLang's
`update_weights_from_disk`, what reinforcement-learning loops call between rollouts).

The checkpoint loads whole into host memory the way the live model was built (this rank's
slice, the live device's layout, FP8 as served), is checked against the live model tensor by
tensor, and only then is copied into the live tensors: a checkpoint that does not match changes
nothing, and CUDA graphs and every reference to a weight stay valid. Host memory holds one more
copy of this rank's weights meanwhile; device memory holds nothing more.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from deltaserve.engine.config import EngineConfig
    from deltaserve.models.checkpoints.loader import LoadedModel

# config keys that name or date a checkpoint, not the model it holds
_NOT_THE_MODEL = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype", "_commit_hash"})


@dataclass
class StagedWeights:
    """(what, the live module, its new weights in host memory), checked to match."""

    modules: list[tuple[str, nn.Module, nn.Module]]


def stage_weights(
    config: EngineConfig,
    loaded: LoadedModel,
    live: dict[str, nn.Module],
    device: torch.device,
    path: str,
    load_format: str = "auto",
) -> StagedWeights:
    """The checkpoint at `path` as the `live` modules ("model", and "vision tower" and "MTP layer"
    where served) on `device` hold it; ValueError when it is not a checkpoint of the served model
    (another config, or tensors of other names or shapes)."""
    from deltaserve.models.checkpoints.loader import load_model

    cpu = torch.device("cpu")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"no checkpoint at {path!r}: it has no config.json")
    torch.manual_seed(config.seed)  # dummy weights: the same seed, the same weights
    new = load_model(
        path,
        config.torch_dtype,
        cpu,
        load_format,
        config.seed,
        quantization=config.quantization,
        tp=loaded.tp,
        hf_overrides=config.hf_overrides,
        vision="vision tower" in live,
        structure_device=device,
    )
    differ = config_differences(loaded.config, new.config)
    if differ:
        raise ValueError(
            f"the checkpoint at {path} is not a checkpoint of the served model: its config differs "
            f"in {', '.join(differ[:6])}"
        )
    modules: list[tuple[str, nn.Module, nn.Module]] = [("model", live["model"], new.model)]
    if "vision tower" in live:
        if new.vision is None:
            raise ValueError(f"the checkpoint at {path} has no vision tower")
        modules.append(("vision tower", live["vision tower"], new.vision))
    if "MTP layer" in live:
        from deltaserve.models.qwen3_next_mtp import load_mtp

        mtp = load_mtp(
            path,
            new.config,
            config.torch_dtype,
            cpu,
            load_format == "dummy",
            config.quantization,
            loaded.tp,
            structure_device=device,
        )
        modules.append(("MTP layer", live["MTP layer"], mtp))
    for what, ours, staged in modules:
        check_same_tensors(what, ours, staged)
    return StagedWeights(modules)


@torch.no_grad()
def commit_weights(staged: StagedWeights) -> None:
    """Copy the staged weights into the live tensors."""
    for _, live, new in staged.modules:
        source = _tensors(new)
        for name, tensor in _tensors(live).items():
            tensor.copy_(source[name])


def config_differences(live: Any, new: Any) -> list[str]:
    """The config keys whose values differ between two checkpoints, less those that only name them."""
    a, b = live.to_dict(), new.to_dict()
    return sorted(k for k in a.keys() | b.keys() if k not in _NOT_THE_MODEL and a.get(k) != b.get(k))


def check_same_tensors(what: str, live: nn.Module, staged: nn.Module) -> None:
    ours, theirs = _tensors(live), _tensors(staged)
    missing, extra = sorted(ours.keys() - theirs.keys()), sorted(theirs.keys() - ours.keys())
    if missing or extra:
        raise ValueError(f"the new {what}'s tensors differ: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, t in ours.items():
        if t.shape != theirs[name].shape or t.dtype != theirs[name].dtype:
            raise ValueError(
                f"the new {what}'s {name} is {tuple(theirs[name].shape)} {theirs[name].dtype}, "
                f"the served one's {tuple(t.shape)} {t.dtype}"
            )


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters, buffers, and the tensors modules keep as plain attributes (FP8 block scales,
    a projection's unquantized rows): a cache derived at run time would show here as a tensor the
    staged copy lacks, and refuse the update rather than go stale."""
    out = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    for prefix, m in module.named_modules():
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{name}" if prefix else name] = value
    return out
