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
        for prefix, module in model.named_modules():
            listing = getattr(module, "checkpoint_shards", None)
            if not callable(listing):
                continue
            dot = f"{prefix}." if prefix else ""
            for src, (dst, start, rows) in listing().items():
                self.shards[dot + src] = (dot + dst, start, rows)
                self.shards_per_param[dot + dst] = self.shards_per_param.get(dot + dst, 0) + 1

    def copy(self, name: str, tensor: torch.Tensor) -> None:
        param = self.params.get(name)
        if param is None:
            if name in self.shards:
                dst, start, rows = self.shards[name]
                self._slice(dst, self.params[dst][start : start + rows], tensor, name)
                return
            self.unexpected.append(name)
            return
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor.to(param.dtype))
        self.loaded.add(name)

    def load_expert(self, name: str, tensor: torch.Tensor) -> bool:
        """Per-expert (`experts.E.gate_proj`, or `w1`/`w3`/`w2`) or fused expert tensors."""
        m = _EXPERT.match(name)
        if m:
            prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
            gate_up = self.params.get(prefix + ".gate_up_proj")
            down = self.params.get(prefix + ".down_proj")
            if gate_up is None or down is None:
                self.unexpected.append(name)
                return True
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
            param = self.params.get(name)
            if param is not None and tensor.dim() == 3 and tensor.shape != param.shape:
                if tensor.transpose(1, 2).shape == param.shape:
                    tensor = tensor.transpose(1, 2)
            self.copy(name, tensor)
            return True
        return False

    def _slice(self, param_name: str, dst: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(tensor.to(dst.dtype))
        # an expert parameter counts as loaded once every expert's slices arrived
        counts = self.__dict__.setdefault("_slices", {})
        counts[param_name] = counts.get(param_name, 0) + 1
        param = self.params[param_name]
        if param_name in self.shards_per_param:
            needed = self.shards_per_param[param_name]
        else:  # stacked experts: gate and up per expert, or down per expert
            needed = param.shape[0] * (2 if param_name.endswith("gate_up_proj") else 1)
        if counts[param_name] == needed:
            self.loaded.add(param_name)

    def finish(self) -> None:
        missing = sorted(n for n in self.params if n not in self.loaded and n not in self.ignore)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing tensors: {shown}")
