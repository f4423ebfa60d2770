"""FP8 block-quantized checkpoints (Qwen's FP8 releases) and `--quantization fp8`.

The format: `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}`; each FP8 linear weight is e4m3 with an fp32
`weight_scale_inv` per 128 x 128 block beside it; activations are quantized per token and 128
channels at run time (`kernels.fp8`). Every other quantization is refused.

How the weights arrive without a full-precision copy:
- the model is built with its parameters on the meta device (buffers real), every linear layer
  and routed-expert stack is swapped for an FP8-capable holder (`Fp8Linear`, `Fp8Experts`) whose
  parameter stays on meta until the loader first writes to it, and the rest is materialized;
- the checkpoint stream turns each FP8 weight and its scales into *row records*: per output
  row, the row's e4m3 bytes and the fp32 scales of its column blocks, in a uint8 tensor as wide
  as the row in the model dtype plus the scales. The models' loaders fuse and reorder checkpoint
  matrices by rows (q|k|v, gate|up, Qwen3-Next's interleaved in_proj_qkvz, experts), so records
  move weights and scales together through that code unchanged. An unquantized matrix fused
  with FP8 ones (the GDN gate projections, b|a) travels as records too, marked by a negative
  scale, its row in the model dtype;
- once a holder's parameter is complete it is unpacked into e4m3 + block scales (and an
  unquantized tail of rows, if any), and the records are freed.

Tensor parallelism: a rank reads its rows or columns of each e4m3 weight and the whole (small)
scale tensor, whose rows follow the weight's as the records' per-row scales do; a rank's columns
must be whole 128-column blocks, since activations are quantized per 128 channels.
`--quantization fp8` reads the rank's part of each weight widened to whole 128 x 128 blocks,
quantizes it, then keeps the rank's part, so that every rank quantizes the blocks one GPU would.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.fp8 import fp8_linear, fp8_moe
from deltaserve.kernels.fp8.blocks import BLOCK, FP8_DTYPE, dequantize_blocks, num_blocks, quantize_blocks
from deltaserve.kernels.linear import linear
from deltaserve.kernels.moe import fused_moe
from deltaserve.kernels.norm import silu_and_mul
from deltaserve.models.layers.common import held_expert_ids
from deltaserve.models.parallel import SINGLE, Narrow, ShardSpec, TensorParallel

if TYPE_CHECKING:
    from deltaserve.models.layers.common import Experts

logger = logging.getLogger(__name__)

METHODS = ("fp8",)
_SUPPORTED = "quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', weight_block_size [128, 128]"
# what Qwen's FP8 releases keep unquantized besides norms, convs and embeddings: the LM head,
# the routers and the GDN gate projections (also what `--quantization fp8` leaves alone)
DEFAULT_NOT_CONVERTED = (
    "lm_head",
    "embed_tokens",
    "mlp.gate",
    "shared_expert_gate",
    "in_proj_ba",
    "in_proj_a",
    "in_proj_b",
    "kv_b_proj",
)
_DENSE_MARK = -1.0  # scale of an unquantized row in a record (real scales are positive)


@dataclass(frozen=True)
class Fp8Config:
    modules_to_not_convert: tuple[str, ...] = DEFAULT_NOT_CONVERTED

    @staticmethod
    def from_checkpoint(path: str, quant: Any) -> Fp8Config:
        """The checkpoint's `quantization_config`, or a clear error for any format but block FP8."""
        if not isinstance(quant, dict):
            raise ValueError(f"{path!r}: quantization_config is not a mapping; {_SUPPORTED} is supported")
        method = quant.get("quant_method", "unknown")
        problems = []
        if method != "fp8":
            problems.append(f"quant_method {method!r}")
        if quant.get("fmt", "e4m3") != "e4m3":
            problems.append(f"fmt {quant.get('fmt')!r}")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            problems.append(f"activation_scheme {quant.get('activation_scheme')!r}")
        if method == "fp8" and list(quant.get("weight_block_size") or []) != [BLOCK, BLOCK]:
            problems.append(f"weight_block_size {quant.get('weight_block_size')!r}")
        if problems:
            raise ValueError(
                f"{path!r} is a quantized checkpoint that deltaserve does not implement "
                f"({', '.join(problems)}); supported: {_SUPPORTED}, or unquantized checkpoints"
            )
        return Fp8Config(tuple(quant.get("modules_to_not_convert") or ()))

    def converts(self, name: str) -> bool:
        """Whether the module `name` (checkpoint spelling, no `.weight`) may be FP8: an entry of
        `modules_to_not_convert` names a whole module path (`mlp.gate` is not `mlp.gate_proj`),
        anywhere in the name, or is a glob."""
        padded = f".{name}."
        return not any(
            f".{key}." in padded or fnmatch.fnmatch(name, key) for key in self.modules_to_not_convert
        )


# -- row records -------------------------------------------------------------------------


def record_width(k: int, dtype: torch.dtype) -> int:
    return k * dtype.itemsize + 4 * num_blocks(k)


def row_scales(scale: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """The 128 x 128 block scales of the weight `name` of `shape` `[..., N, K]`, one row of
    column-block scales per weight row: `[..., N, ceil(K/128)]`."""
    *lead, n, k = shape
    if tuple(scale.shape) != (*lead, num_blocks(n), num_blocks(k)):
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale.shape)}, expected "
            f"{(*lead, num_blocks(n), num_blocks(k))} (one scale per 128 x 128 block of {name} {tuple(shape)})"
        )
    return scale.float().repeat_interleave(BLOCK, dim=-2)[..., :n, :]


def narrow_row_scales(rows: torch.Tensor, spec: Narrow, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """A rank's part (`spec`, of the weight of `shape`) of per-row scales: rows and experts as the
    weight's; columns in whole 128-column blocks (the last may end at the weight's edge)."""
    dim = spec.dim % len(shape)
    if dim != len(shape) - 1:
        return spec.apply(rows)
    return Narrow(dim, _column_blocks(spec, shape[-1], name)).apply(rows)


def _column_blocks(spec: Narrow, k: int, name: str) -> tuple[tuple[int, int], ...]:
    """A column part's pieces in 128-column blocks, or the error of a piece that splits one."""
    for start, length in spec.pieces:
        if start % BLOCK or (length % BLOCK and start + length != k):
            raise split_blocks_error(name, start, length, k)
    return tuple((start // BLOCK, num_blocks(length)) for start, length in spec.pieces)


def whole_blocks(spec: Narrow, shape: tuple[int, ...]) -> Narrow:
    """`spec`'s pieces widened to whole 128 x 128 blocks of the weight of `shape` (a part along
    an expert dimension as it is): what `--quantization fp8` reads of a weight under tensor
    parallelism, so that quantizing it gives the whole weight's blocks."""
    dim = spec.dim % len(shape)
    if dim < len(shape) - 2:
        return spec
    pieces = []
    for start, length in spec.pieces:
        first = start // BLOCK * BLOCK
        pieces.append((first, min(shape[dim], -(-(start + length) // BLOCK) * BLOCK) - first))
    return Narrow(dim, tuple(pieces))


def quantize_part(
    w: torch.Tensor, spec: Narrow | None, shape: tuple[int, ...], name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`--quantization fp8` of the weight `name` of `shape`: (e4m3, per-row scales) of the whole
    weight, or of the rank's part `spec` when `w` holds it widened as `whole_blocks` reads it
    (each widened piece quantized alone: its blocks are the whole weight's)."""
    if spec is None or spec.dim % len(shape) < len(shape) - 2:  # whole matrices
        q, s = quantize_blocks(w)
        return q, row_scales(s, tuple(w.shape), name)
    assert spec.pad_to is None, name  # padding is for vocabularies, which stay unquantized
    dim = spec.dim % len(shape)
    wide = whole_blocks(spec, shape)
    codes, rows = [], []
    for (start, length), (first, _), piece in zip(
        spec.pieces, wide.pieces, w.split([n for _, n in wide.pieces], dim), strict=True
    ):
        q, s = quantize_blocks(piece)
        r = row_scales(s, tuple(piece.shape), name)
        codes.append(Narrow(dim, ((start - first, length),)).apply(q))
        if dim == len(shape) - 1:
            _column_blocks(Narrow(dim, ((start, length),)), shape[-1], name)
            rows.append(Narrow(dim, ((0, num_blocks(length)),)).apply(r))
        else:
            rows.append(Narrow(dim, ((start - first, length),)).apply(r))
    return torch.cat(codes, dim), torch.cat(rows, dim)


def split_blocks_error(name: str, start: int, length: int, k: int) -> ValueError:
    return ValueError(
        f"{name}: a tensor-parallel rank would hold its input columns {start}-{start + length} "
        f"of {k}, which split the FP8 format's 128-column blocks (activations are quantized per "
        "128 channels); serve this checkpoint with a tensor-parallel size that splits them whole"
    )


def check_whole_blocks(name: str, local: int, tp: TensorParallel) -> None:
    """`--load-format dummy`: the error a checkpoint of these shapes would give (each rank holds
    `local` of a projection's input columns)."""
    if tp.enabled and local % BLOCK:
        raise split_blocks_error(name, tp.rank * local, local, local * tp.size)


def pack_rows(q: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An e4m3 weight `[..., N, K]` and its per-row scales `[..., N, ceil(K/128)]` as row records
    `[..., N, width]`."""
    *lead, n, k = q.shape
    out = torch.zeros(*lead, n, record_width(k, dtype), dtype=torch.uint8, device=q.device)
    out[..., :k] = q.view(torch.uint8)
    out[..., k * dtype.itemsize :] = rows.contiguous().view(torch.uint8)
    return out


def pack_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    """An e4m3 weight `[..., N, K]` and its 128 x 128 scales as row records `[..., N, width]`."""
    return pack_rows(q, row_scales(scale, tuple(q.shape), name), dtype)


def pack_dense(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An unquantized weight `[..., N, K]` as row records (marked by negative scales)."""
    *lead, n, k = w.shape
    out = torch.empty(*lead, n, record_width(k, dtype), dtype=torch.uint8, device=w.device)
    out[..., : k * dtype.itemsize] = w.to(dtype).contiguous().view(torch.uint8)
    marks = torch.full((*lead, n, num_blocks(k)), _DENSE_MARK, device=w.device)
    out[..., k * dtype.itemsize :] = marks.view(torch.uint8)
    return out


def _unpack(
    records: torch.Tensor, k: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 `[..., N, K]`, row scales `[..., N, kb]`, dense `[..., N, K]`) views of records."""
    body = records[..., : k * dtype.itemsize]
    scales = records[..., k * dtype.itemsize :].contiguous().view(torch.float32)
    return records[..., :k].view(FP8_DTYPE), scales, body.contiguous().view(dtype)


def records_to_dense(records: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Row records as a plain weight in `dtype` (FP8 rows dequantized), for parameters that are
    no FP8 holder (a router fused-in beside FP8 experts, say)."""
    q, scales, dense = _unpack(records, k, dtype)
    fp8 = scales[..., :1] >= 0
    return torch.where(fp8, dequantize_blocks(q, scales.clamp(min=0), 1).to(dtype), dense)


def _compact(row_scales: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Row scales `[..., N, kb]` as 128-row block scales where each block's rows agree (always in
    real checkpoints, whose fused sub-matrices are multiples of 128 rows), else per row."""
    n = row_scales.shape[-2]
    blocks = row_scales[..., ::BLOCK, :]
    if torch.equal(blocks.repeat_interleave(BLOCK, dim=-2)[..., :n, :], row_scales):
        return blocks.contiguous(), BLOCK
    return row_scales.contiguous(), 1


# -- the FP8 holders ------------------------------------------------------------------------


class Fp8Linear(nn.Module):
    """A linear layer whose weight is block-FP8 (`weight` e4m3 `[N, K]`, `weight_scale_inv` fp32
    per `scale_rows` x 128 block), optionally followed by `dense_rows` unquantized output rows
    (`dense_weight`), or, when the checkpoint stores it unquantized, a plain linear layer.

    `shard_sizes` as in `layers.Linear`: off the fast path each sub-matrix is its own matmul.
    `tp`: a row-parallel projection's, whose partial sums are all-reduced before the bias;
    `narrows`: the replaced layer's `checkpoint_narrows`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        shard_sizes: list[int] | None,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        narrows: dict[str, ShardSpec] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard_sizes = shard_sizes
        self.dtype = dtype
        self.tp = tp
        self.narrows = narrows or {}
        self.weight = nn.Parameter(
            torch.empty(out_features, record_width(in_features, dtype), dtype=torch.uint8, device="meta"),
            requires_grad=False,
        )
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device="meta")) if bias else None
        self.weight_scale_inv: torch.Tensor | None = None
        self.dense_weight: torch.Tensor | None = None
        self.scale_rows = BLOCK
        self.dense_only = False  # dequantize FP8 rows at load (a consumer reads `.weight` itself)
        self.dummy_dense_rows = 0  # `--load-format dummy`: unquantized trailing rows
        self.input_split = SINGLE  # the ranks its input columns are split over (row-parallel)

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        return self.narrows

    def materialize_param(self, name: str, device: torch.device) -> None:
        self.weight = nn.Parameter(torch.zeros_like(self.weight, device=device), requires_grad=False)

    def finish_param(self, name: str) -> None:
        self.finish_loading()

    def finish_loading(self) -> None:
        q, scales, dense = _unpack(self.weight.data, self.in_features, self.dtype)
        is_fp8 = scales[:, 0] >= 0
        n = int(is_fp8.sum())
        if not bool(is_fp8[:n].all()):
            raise ValueError(
                f"a fused projection ({self.out_features} x {self.in_features}) mixes FP8 and unquantized "
                "checkpoint matrices other than as FP8 rows followed by unquantized ones"
            )
        if n and self.dense_only:
            dense = dense.clone()
            dense[:n] = dequantize_blocks(q[:n], scales[:n], 1).to(self.dtype)
            n = 0
        if n == 0:
            self.weight = nn.Parameter(dense.clone(), requires_grad=False)
            return
        scale, self.scale_rows = _compact(scales[:n])
        self.weight = nn.Parameter(q[:n].contiguous(), requires_grad=False)
        self.weight_scale_inv = scale
        self.dense_weight = dense[n:].clone() if n < self.out_features else None

    def init_dummy(self, device: torch.device, fp8: bool, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        w = torch.empty(self.out_features, self.in_features, device=device).normal_(0.0, 0.02, generator=gen)
        n = self.out_features - self.dummy_dense_rows if fp8 else 0
        q, s = quantize_blocks(w[:n])
        records = torch.cat([pack_fp8(q, s, self.dtype, "dummy"), pack_dense(w[n:], self.dtype)])
        self.weight = nn.Parameter(records, requires_grad=False)
        self.finish_loading()
        if self.bias is not None:
            self.bias = nn.Parameter(torch.zeros(self.out_features, dtype=self.dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            y = self._dense(x, self.weight)
        elif self.dense_weight is not None:
            # both parts in one output (on CUDA at decode from one launch where the skinny GEMM
            # runs; past it cuBLAS writes its part in place)
            y = fp8_linear(x, self.weight, self.weight_scale_inv, self.scale_rows, dense=self.dense_weight)
        else:
            y = self._fp8(x)
        if self.tp.enabled:  # row-parallel: the ranks' partial sums, before the bias
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def _fp8(self, x: torch.Tensor) -> torch.Tensor:
        assert self.weight_scale_inv is not None
        if self.shard_sizes is not None and not use_fast_path(x):
            w = dequantize_blocks(self.weight, self.weight_scale_inv, self.scale_rows)
            from deltaserve.kernels.fp8.reference import fake_quantize_activations

            xq = fake_quantize_activations(x.reshape(-1, x.shape[-1]))
            outs = [F.linear(xq, wi) for wi in w.split(self.shard_sizes)]
            return torch.cat(outs, dim=-1).to(x.dtype).view(*x.shape[:-1], -1)
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.scale_rows)

    def _dense(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.shard_sizes is not None and not use_fast_path(x):
            return torch.cat([F.linear(x, wi) for wi in w.split(self.shard_sizes)], dim=-1)
        return linear(x, w)


class Fp8Experts(nn.Module):
    """Routed experts (gate_up `[E, 2I, H]`, down `[E, H, I]`) in block FP8 (scales per
    `scale_rows` x 128 block, `gate_up_scale` / `down_scale`), or unquantized as stored.
    `experts`: the stack it replaces, whose sharding it keeps (`layers.common.Experts`)."""

    def __init__(self, experts: Experts, dtype: torch.dtype) -> None:
        super().__init__()
        num_experts, two_i, hidden = experts.gate_up_proj.shape
        intermediate = two_i // 2
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.dtype = dtype
        self.tp = experts.tp
        self.expert_range = experts.expert_range
        self.narrows = experts.checkpoint_narrows()
        shapes = {"gate_up_proj": (2 * intermediate, hidden), "down_proj": (hidden, intermediate)}
        for name, (n, k) in shapes.items():
            meta = torch.empty(num_experts, n, record_width(k, dtype), dtype=torch.uint8, device="meta")
            setattr(self, name, nn.Parameter(meta, requires_grad=False))
        self._pending = set(shapes)
        self.gate_up_scale: torch.Tensor | None = None
        self.down_scale: torch.Tensor | None = None
        self.scale_rows = BLOCK

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        return self.narrows

    def materialize_param(self, name: str, device: torch.device) -> None:
        setattr(
            self,
            name,
            nn.Parameter(torch.zeros_like(getattr(self, name), device=device), requires_grad=False),
        )

    def finish_param(self, name: str) -> None:
        self._pending.discard(name)
        if self._pending:
            return
        k = {"gate_up_proj": self.hidden, "down_proj": self.intermediate}
        parts = {n: _unpack(getattr(self, n).data, k[n], self.dtype) for n in k}
        kinds = {n: bool((s[..., 0] >= 0).all()) for n, (_, s, _) in parts.items()}
        mixed = {n: bool((s[..., 0] >= 0).any()) != kinds[n] for n, (_, s, _) in parts.items()}
        if any(mixed.values()) or len(set(kinds.values())) > 1:
            raise ValueError(
                "routed experts mix FP8 and unquantized weights; they must be all one or the other"
            )
        if not kinds["down_proj"]:
            for n, (_, _, dense) in parts.items():
                setattr(self, n, nn.Parameter(dense.clone(), requires_grad=False))
            return
        gu, gu_s = _compact(parts["gate_up_proj"][1])
        dn, dn_s = _compact(parts["down_proj"][1])
        if gu_s != dn_s:  # one scale layout for both matmuls: per row where either needs it
            gu, dn, gu_s = parts["gate_up_proj"][1].contiguous(), parts["down_proj"][1].contiguous(), 1
        self.scale_rows = gu_s
        self.gate_up_scale, self.down_scale = gu, dn
        self.gate_up_proj = nn.Parameter(parts["gate_up_proj"][0].contiguous(), requires_grad=False)
        self.down_proj = nn.Parameter(parts["down_proj"][0].contiguous(), requires_grad=False)

    def init_dummy(self, device: torch.device, seed: int) -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        for name, (n, k) in {
            "gate_up_proj": (2 * self.intermediate, self.hidden),
            "down_proj": (self.hidden, self.intermediate),
        }.items():
            q = torch.empty(self.num_experts, n, k, dtype=torch.uint8, device=device)
            for e in range(self.num_experts):  # one expert at a time: no full-precision stack
                w = torch.empty(n, k, device=device).normal_(0.0, 0.02, generator=gen)
                qe, se = quantize_blocks(w)
                q[e] = qe.view(torch.uint8)
                if e == 0:
                    scales = torch.empty(self.num_experts, *se.shape, device=device)
                scales[e] = se
            setattr(self, name, nn.Parameter(q.view(FP8_DTYPE), requires_grad=False))
            setattr(self, "gate_up_scale" if name == "gate_up_proj" else "down_scale", scales)
        self._pending.clear()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        topk_ids = held_expert_ids(self.tp, self.expert_range, topk_ids)
        if self.down_scale is None:
            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)
        assert self.gate_up_scale is not None
        return fp8_moe(
            x, self.gate_up_proj, self.gate_up_scale, self.down_proj, self.down_scale, self.scale_rows,
            topk_ids, topk_weights,
        )  # fmt: skip


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    fp8_down = self.down_proj.weight_scale_inv is not None
    out = self.down_proj(silu_and_mul(self.gate_up_proj(x), quantize=fp8_down))
    return self.tp.all_reduce(out) if self.reduce else out


# -- building the model ---------------------------------------------------------------------


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside create their parameters on the meta device; buffers (rotary tables)
    stay real, computed as usual."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def swap_in_fp8_modules(model: nn.Module, dtype: torch.dtype) -> None:
    """Every linear layer (but a tied LM head) and every routed-expert stack becomes an FP8 holder;
    the norms and gates before the FP8 matmuls write their outputs' FP8 rows too
    (`kernels.norm.rms_norm`)."""
    from deltaserve.models.layers.attention import GatedAttention
    from deltaserve.models.layers.common import (
        Experts,
        GatedMLP,
        GatedRMSNorm,
        RMSNorm,
        RowParallelLinear,
        ZeroCenteredRMSNorm,
    )
    from deltaserve.models.layers.gated_deltanet import GatedDeltaNet
    from deltaserve.models.layers.mla import MultiLatentAttention

    tied = {id(p) for n, p in model.named_parameters() if n.endswith("embed_tokens.weight")}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child.weight) not in tied:
                # a row-parallel projection's all-reduce and checkpoint slices go with it
                tp, narrows = (
                    (child.tp, child.checkpoint_narrows())
                    if isinstance(child, RowParallelLinear)
                    else (SINGLE, None)
                )
                holder = Fp8Linear(
                    child.in_features, child.out_features, child.bias is not None,
                    getattr(child, "shard_sizes", None), dtype, tp, narrows,
                )  # fmt: skip
                if isinstance(parent, GatedMLP) and child_name == "down_proj":
                    holder.input_split = parent.tp  # row-parallel, the MLP all-reducing
                elif tp.enabled:
                    holder.input_split = tp
                if isinstance(parent, GatedDeltaNet) and child_name == "in_proj":
                    holder.dummy_dense_rows = 2 * parent.num_v_heads
                if isinstance(parent, MultiLatentAttention) and child_name == "kv_b_proj":
                    holder.dense_only = True  # the MLA kernels read its weight as a matrix
                setattr(parent, child_name, holder)
            elif isinstance(child, Experts):
                setattr(parent, child_name, Fp8Experts(child, dtype))
            elif isinstance(child, GatedRMSNorm) or (
                isinstance(child, (RMSNorm, ZeroCenteredRMSNorm))
                and child_name in ("input_layernorm", "post_attention_layernorm")
            ):  # their outputs are the FP8 matmuls' inputs (the final norm's is the LM head's)
                child.quantize = True
        if isinstance(parent, GatedMLP):
            # its forward hands `down_proj.weight` to a fused kernel; the holder runs as a module
            parent.forward = _mlp_forward.__get__(parent)  # type: ignore[method-assign]
        elif isinstance(parent, GatedAttention):
            parent.quantize = True  # its gated output is o_proj's input


def materialize_rest(model: nn.Module, device: torch.device) -> None:
    """Real (uninitialized) storage for every meta parameter outside the FP8 holders' weights."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        holder_params = {"weight"} if isinstance(module, Fp8Linear) else set()
        if isinstance(module, Fp8Experts):
            holder_params = {"gate_up_proj", "down_proj"}
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta or name in holder_params:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
            module._parameters[name] = done[id(p)]


def build_fp8(build: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`build()` (the loader's: the model made on `device` in `dtype`) with FP8 holders in place;
    taken as an argument so that this module imports nothing of the loader that imports it."""
    with parameters_on_meta():
        model = build()
    swap_in_fp8_modules(model, dtype)
    materialize_rest(model, device)
    return model


def init_dummy_fp8(model: nn.Module, config: Fp8Config, device: torch.device, seed: int) -> None:
    """Random FP8 weights where the format would have them (not the LM head, the routers, the
    GDN gate rows, nor what `modules_to_not_convert` names), unquantized ones elsewhere."""
    for i, (name, module) in enumerate(model.named_modules()):
        if isinstance(module, Fp8Linear):
            fp8 = config.converts(name) and not name.endswith(("lm_head", ".gate", "shared_expert_gate"))
            if fp8:
                check_whole_blocks(f"{name}.weight", module.in_features, module.input_split)
            module.init_dummy(device, fp8 and not module.dense_only, seed * 100003 + i)
        elif isinstance(module, Fp8Experts):
            if not module.tp.experts_whole:
                check_whole_blocks(f"{name}.down_proj", module.intermediate, module.tp)
            module.init_dummy(device, seed * 100003 + i)


# -- the checkpoint stream ------------------------------------------------------------------


def _parent(name: str) -> str:
    return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""


def _quantizable(name: str, shape: list[int], config: Fp8Config) -> bool:
    """`--quantization fp8`: the 2-D `*_proj` weights (and fused expert stacks) that a release
    in this format would carry as FP8."""
    module = name[: -len(".weight")] if name.endswith(".weight") else name
    leaf = module.rsplit(".", 1)[-1]
    fused_experts = ".experts." in f".{name}" and leaf in ("gate_up_proj", "down_proj") and len(shape) == 3
    # Kimi-Linear spells its experts' matrices w1/w2/w3 and MLA's latent projection *_proj_with_mqa
    kimi = leaf.endswith("proj_with_mqa") or (".experts." in name and leaf in ("w1", "w2", "w3"))
    projection = leaf.endswith("proj") or leaf.startswith("in_proj_") or kimi
    linear_weight = name.endswith(".weight") and len(shape) == 2 and projection
    return (fused_experts or linear_weight) and config.converts(module)


Headers = list[tuple[str, str, list[int]]]  # (name, safetensors dtype, shape) of each checkpoint tensor
NarrowFn = Callable[[str, tuple[int, ...]], Narrow | None]  # a rank's part of a checkpoint tensor


def read_narrow(narrow: NarrowFn, headers: Headers, config: Fp8Config, quantize: bool) -> NarrowFn:
    """Tensor parallelism: what a rank reads of each checkpoint tensor. An FP8 weight's scales
    whole (`fp8_weights` keeps the rows the weight's part has), none where the rank holds nothing
    of the weight; a weight that `--quantization fp8` quantizes, its part widened to whole blocks
    (quantized as on one GPU, then narrowed); every other tensor as `narrow` says."""
    shapes = {n: tuple(shape) for n, _, shape in headers}

    def part(name: str, shape: tuple[int, ...]) -> Narrow | None:
        if quantize and _quantizable(name, list(shape), config):
            spec = narrow(name, shape)
            return whole_blocks(spec, shape) if spec is not None and not spec.holds_nothing else spec
        if not name.endswith(".weight_scale_inv"):
            return narrow(name, shape)
        weight = name[: -len("_scale_inv")]
        spec = narrow(weight, shapes.get(weight, shape))
        return spec if spec is not None and spec.holds_nothing else None

    return part


def fp8_weights(
    tensors: Iterator[tuple[str, torch.Tensor]],
    headers: Headers,
    config: Fp8Config,
    dtype: torch.dtype,
    device: torch.device,
    quantize: bool,
    narrow: NarrowFn | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with FP8 weights (and the unquantized matrices beside them) as
    row records; `quantize`: the unquantized checkpoint's linear weights quantized on the way.
    `narrow` (tensor parallelism; the tensors read as `read_narrow` says): each FP8 record
    holds the rank's part of its weight."""
    names = {n for n, _, _ in headers}
    fp8: set[str] = set()
    for name, dtype_s, shape in headers:
        if name.endswith(".weight_scale_inv"):
            weight = name[: -len("_scale_inv")]
            if weight not in names:
                raise ValueError(f"checkpoint has {name} but no {weight}")
            fp8.add(weight)
        elif dtype_s.startswith("F8") and f"{name}_scale_inv" not in names:
            raise ValueError(
                f"checkpoint tensor {name} is FP8 ({dtype_s}) but has no {name}_scale_inv beside it"
            )
        elif quantize and _quantizable(name, shape, config):
            fp8.add(name)
    for name in fp8:
        if not config.converts(name[: -len(".weight")]):
            raise ValueError(
                f"{name} is stored as FP8 but quantization_config's modules_to_not_convert names it"
            )
    shapes = {n: tuple(s) for n, _, s in headers}
    parents = {_parent(n) for n in fp8}
    held: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        if name.endswith(".weight_scale_inv") or name in fp8:
            weight = name[: -len("_scale_inv")] if name.endswith("_scale_inv") else name
            held[name] = t
            scale_name = f"{weight}_scale_inv"
            if weight in held and (scale_name in held or scale_name not in names):
                w = held.pop(weight).to(device)
                full = shapes.get(weight, tuple(w.shape))
                spec = narrow(weight, full) if narrow is not None else None
                if scale_name in names:
                    q = w
                    if q.dtype != FP8_DTYPE:
                        raise ValueError(
                            f"{weight} has a weight_scale_inv but is {q.dtype}, not float8_e4m3fn"
                        )
                    rows = row_scales(held.pop(scale_name).to(device), full, weight)
                    if spec is not None:
                        rows = narrow_row_scales(rows, spec, full, weight)
                else:
                    q, rows = quantize_part(w, spec, full, weight)
                yield weight, pack_rows(q, rows, dtype)
        elif len(shapes.get(name, [])) in (2, 3) and name.endswith(".weight") and _parent(name) in parents:
            yield name, pack_dense(t.to(device), dtype)  # fused with FP8 sub-matrices
        else:
            yield name, t
    if held:
        raise ValueError(f"checkpoint ended with FP8 weights or scales unpaired: {sorted(held)[:4]}")
