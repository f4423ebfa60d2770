"""Copying checkpoint tensors into a model's parameters, with clear errors."""

from __future__ import annotations

import re

import torch
from torch import nn

_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED_EXPERTS = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")


class WeightLoader:
    """Tracks which parameters were filled so that a missing tensor is an error naming it."""

    def __init__(self, model: nn.Module, ignore: set[str] | None = None) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.loaded: set[str] = set()
        self.ignore = ignore or set()
        self.unexpected: list[str] = []
        # checkpoint tensors that fill rows of one of our fused parameters (gate|up, q|k|v):
        # modules list them as {checkpoint name: (parameter, first row, rows)}
        self.shards: dict[str, tuple[str, int, int]] = {}
        self.shards_per_param: dict[str, int] = {}
        # parameters that FP8 holders (models/checkpoints/quantization.py) allocate on first write and
        # convert once complete: {parameter: (module, its attribute)}
        self.holders: dict[str, tuple[nn.Module, str]] = {}
        self.device = next((p.device for p in self.params.values() if not p.is_meta), torch.device("cpu"))
        # expert stacks that hold a block of the experts (expert parallelism): {prefix: (first, count)}
        self.expert_ranges: dict[str, tuple[int, int]] = {}
        for prefix, module in model.named_modules():
            held = getattr(module, "expert_range", None)
            if isinstance(held, tuple):
                self.expert_ranges[prefix] = held
            if hasattr(module, "finish_param"):
                for attr, p in module.named_parameters(recurse=False):
                    if p.is_meta and p.dtype == torch.uint8:
                        self.holders[f"{prefix}.{attr}" if prefix else attr] = (module, attr)
            listing = getattr(module, "checkpoint_shards", None)
            if not callable(listing):
                continue
            dot = f"{prefix}." if prefix else ""
            for src, (dst, start, rows) in listing().items():
                self.shards[dot + src] = (dot + dst, start, rows)
                self.shards_per_param[dot + dst] = self.shards_per_param.get(dot + dst, 0) + 1

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.params:
            if name in self.shards:
                dst, start, rows = self.shards[name]
                self._slice(dst, self._param(dst)[start : start + rows], tensor, name)
                return
            self.unexpected.append(name)
            return
        _copy_into(self._param(name), self._fit(name, tensor), name)
        self._done(name)

    def load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """Per-expert (`experts.E.gate_proj`, or `w1`/`w3`/`w2`) or fused expert tensors. E is
        the checkpoint's expert number; a stack holding a block of the experts (`expert_range`)
        stores it at E - first and passes over the experts it does not hold."""
        m = _EXPERT.match(name)
        if m:
            prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
            if prefix + ".gate_up_proj" not in self.params or prefix + ".down_proj" not in self.params:
                self.unexpected.append(name)
                return True
            if prefix in self.expert_ranges:
                first, count = self.expert_ranges[prefix]
                expert -= first
                if not 0 <= expert < count:  # another rank's expert
                    return True
            gate_up, down = self._param(prefix + ".gate_up_proj"), self._param(prefix + ".down_proj")
            inter = gate_up.shape[1] // 2
            if kind in ("gate_proj", "w1"):
                self._slice(prefix + ".gate_up_proj", gate_up[expert, :inter], tensor, name)
            elif kind in ("up_proj", "w3"):
                self._slice(prefix + ".gate_up_proj", gate_up[expert, inter:], tensor, name)
            else:
                self._slice(prefix + ".down_proj", down[expert], tensor, name)
            return True
        m = _FUSED_EXPERTS.match(name)
        if m:
            param = self._param(name) if name in self.params else None
            if param is not None and tensor.dim() == 3 and tensor.shape != param.shape:
                if tensor.transpose(1, 2).shape == param.shape:
                    tensor = tensor.transpose(1, 2)
            self.copy(name, tensor)
            return True
        return False

    def _slice(self, param_name: str, dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        _copy_into(dst, self._fit(param_name, tensor), name)
        # an expert parameter counts as loaded once every expert's slices arrived
        counts = self.__dict__.setdefault("_slices", {})
        counts[param_name] = counts.get(param_name, 0) + 1
        param = self.params[param_name]
        if param_name in self.shards_per_param:
            needed = self.shards_per_param[param_name]
        else:  # stacked experts: gate and up per expert, or down per expert
            needed = param.shape[0] * (2 if param_name.endswith("gate_up_proj") else 1)
        if counts[param_name] == needed:
            self._done(param_name)

    def _param(self, name: str) -> torch.Tensor:
        """The parameter `name`, allocated now if an FP8 holder deferred it."""
        param = self.params[name]
        if param.is_meta and name in self.holders:
            module, attr = self.holders[name]
            module.materialize_param(attr, self.device)  # type: ignore[operator]
            param = self.params[name] = getattr(module, attr)
        return param

    def _fit(self, param_name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A checkpoint tensor in its parameter's form: FP8 holders take row records (see
        models/checkpoints/quantization.py), other parameters plain values."""
        from deltaserve.models.checkpoints import quantization as q

        if param_name in self.holders:
            if tensor.dtype == torch.uint8:
                return tensor
            dtype: torch.dtype = self.holders[param_name][0].dtype  # type: ignore[assignment]
            return q.pack_dense(tensor, dtype)
        param = self.params[param_name]
        if tensor.dtype == torch.uint8 and param.dtype != torch.uint8:
            return q.records_to_dense(tensor, param.shape[-1], param.dtype)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"{param_name}: an FP8 checkpoint tensor reached it without its block scales")
        return tensor

    def _done(self, name: str) -> None:
        self.loaded.add(name)
        if name in self.holders:
            module, attr = self.holders[name]
            module.finish_param(attr)  # type: ignore[operator]

    def finish(self) -> None:
        missing = sorted(n for n in self.params if n not in self.loaded and n not in self.ignore)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")


def _copy_into(dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    """The checkpoint tensor `name` into `dst` (a parameter or a slice of one), shapes checked."""
    if tuple(dst.shape) != tuple(tensor.shape):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(tensor.to(dst.dtype))
