"""Layers shared by the hybrid models: norms, rotary embedding, MLP, sparse MoE."""

from __future__ import annotations

import os
import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.kernels.linear import linear, silu_mul_linear
from deltaserve.kernels.moe import fused_moe
from deltaserve.kernels.norm import add_rms_norm, gated_rms_norm, rms_norm
from deltaserve.kernels.router import softmax_topk
from deltaserve.models.forward import ForwardContext, ImageEmbeds, ModelCapabilities
from deltaserve.models.parallel import NOTHING, SINGLE, Narrow, ShardSpec, TensorParallel


class Linear(nn.Linear):
    """nn.Linear whose forward goes through `kernels.linear` (cuBLAS, or on CUDA the Triton GEMV
    for one or two rows of a small or narrow matrix).

    A projection fused from several checkpoint matrices (gate|up, q|k|v) names their row
    counts in `shard_sizes`: off the fast path (CPU, the fp32 oracle) it runs them as separate
    matmuls, because a matmul's rounding depends on its shape and the unfused model's fp32
    results must be matched bit for bit."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, shard_sizes: list[int] | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        assert shard_sizes is None or sum(shard_sizes) == out_features, (shard_sizes, out_features)
        self.shard_sizes = shard_sizes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_sizes is not None and not use_fast_path(x):
            w = self.weight.split(self.shard_sizes)
            b = self.bias.split(self.shard_sizes) if self.bias is not None else [None] * len(w)
            return torch.cat([F.linear(x, wi, bi) for wi, bi in zip(w, b)], dim=-1)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A projection whose input columns are split over the ranks (o_proj, out_proj): each rank
    multiplies its slice, the partial sums are all-reduced, the bias is added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE) -> None:
        super().__init__(tp.split(in_features, "a row-parallel projection's input width"), out_features, bias)
        self.tp = tp

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        return {"weight": self.tp.narrow(1, self.in_features * self.tp.size)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(x)
        y = self.tp.all_reduce(linear(x, self.weight, None))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Embedding):
    """The embedding table split by token id: each rank holds `vocab_range` rows (the last
    shard zero-padded), looks up the ids it holds, and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = SINGLE) -> None:
        start, rows = tp.vocab_range(vocab_size)
        super().__init__(rows, hidden)
        self.vocab_start = start
        self.vocab_size = vocab_size
        self.tp = tp

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        return {"weight": vocab_narrow(self.tp, self.vocab_size)}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(local.masked_fill(~held, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill_(~held.unsqueeze(-1), 0.0))


def vocab_narrow(tp: TensorParallel, vocab_size: int) -> ShardSpec:
    start, rows = tp.vocab_range(vocab_size)
    length = max(0, min(vocab_size, start + rows) - start)
    return Narrow(0, ((min(start, vocab_size), length),), pad_to=rows)


class _RMSNorm(nn.Module):
    zero_centered: bool

    def __init__(self, dim: int, eps: float, init: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), init))
        self.quantize = False  # FP8 matmuls read the output (`kernels.norm.rms_norm`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered, self.quantize)

    def forward_add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(x + residual), x + residual)`: a decoder layer's residual add, fused."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.zero_centered, self.quantize)


class ZeroCenteredRMSNorm(_RMSNorm):
    """RMSNorm whose weight is stored as an offset from one: y = norm(x) * (1 + w)."""

    zero_centered = True

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps, 0.0)


class RMSNorm(_RMSNorm):
    """Plain RMSNorm, y = w * norm(x), the weight rounded to x's dtype last (Kimi-Linear, DeepSeek)."""

    zero_centered = False

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps, 1.0)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the linear-attention output, gated by silu(z) (GDN) or sigmoid(z)
    (KDA; see `kernels.norm.gated_rms_norm`)."""

    def __init__(self, dim: int, eps: float = 1e-6, kind: str = "silu") -> None:
        super().__init__()
        self.eps = eps
        self.kind = kind
        self.weight = nn.Parameter(torch.ones(dim))
        self.quantize = False  # as `_RMSNorm.quantize`

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate `[T, H, D]`."""
        return gated_rms_norm(x, gate, self.weight, self.eps, self.kind, self.quantize)


class PartialRotaryEmbedding(nn.Module):
    """RoPE on the first `rotary_dim` channels of each head (rotate-half layout)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.rotary_dim = 2 * inv_freq.shape[0]
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q `[T, Hq, D]`, k `[T, Hkv, D]`, positions `[T]`."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(q.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype).unsqueeze(1)
        sin = emb.sin().to(q.dtype).unsqueeze(1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up as one matmul (`gate_up_proj`,
    filled from the checkpoint's `gate_proj` and `up_proj` by the weight loader).

    Tensor-parallel: each rank holds a slice of the intermediate width (gate_up
    column-parallel, down row-parallel); with `reduce` False the caller all-reduces the partial
    sum (a MoE block joins it with the experts' into one all-reduce)."""

    def __init__(
        self, hidden: int, intermediate: int, tp: TensorParallel = SINGLE, reduce: bool = True
    ) -> None:
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        inter = tp.split(intermediate, "an MLP's intermediate size")
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=False, shard_sizes=[inter] * 2)
        self.down_proj = Linear(inter, hidden, bias=False)

    def checkpoint_shards(self) -> dict[str, tuple[str, int, int]]:
        inter = self.down_proj.in_features
        return {
            "gate_proj.weight": ("gate_up_proj.weight", 0, inter),
            "up_proj.weight": ("gate_up_proj.weight", inter, inter),
        }

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        full = self.down_proj.in_features * self.tp.size
        rows, cols = self.tp.narrow(0, full), self.tp.narrow(1, full)
        return {"gate_proj.weight": rows, "up_proj.weight": rows, "down_proj.weight": cols}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation is applied inside the down projection's GEMV where that runs
        out = silu_mul_linear(self.gate_up_proj(x), self.down_proj.weight)
        return self.tp.all_reduce(out) if self.reduce else out


class Experts(nn.Module):
    """Routed experts stored stacked: gate_up `[E, 2I, H]`, down `[E, H, I]`.

    Tensor-parallel: every rank holds every expert's slice of the intermediate width, and
    returns its partial sum (the MoE block all-reduces). Expert-parallel (`tp.expert_parallel`):
    each rank holds whole experts, the block `expert_range`, and sums only the assignments to
    them (the others' ids are masked out); the same all-reduce adds the ranks' sums."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.tp = tp
        self.intermediate = intermediate  # the full width, for slicing checkpoint tensors
        self.expert_range = tp.expert_range(num_experts)  # (first, count) held by this rank
        local = self.expert_range[1]
        inter = intermediate if tp.experts_whole else tp.split(intermediate, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(local, hidden, inter))

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        if self.tp.experts_whole:
            return self._expert_narrows()
        full, tp = self.intermediate, self.tp
        rows, cols = tp.narrow(0, full), tp.narrow(1, full)
        specs: dict[str, ShardSpec] = {}
        for e in range(self.num_experts):
            for kind in ("gate_proj", "up_proj", "w1", "w3"):
                specs[f"{e}.{kind}.weight"] = rows
            for kind in ("down_proj", "w2"):
                specs[f"{e}.{kind}.weight"] = cols

        # stacked checkpoints come as `[E, 2I, H]` or transposed `[E, H, 2I]` (the loader's rule)
        def gate_up(shape: tuple[int, ...]) -> Narrow:
            return tp.narrow(1 if shape[1] == 2 * full else 2, full, full)

        def down(shape: tuple[int, ...]) -> Narrow:
            return tp.narrow(2 if shape[2] == full else 1, full)

        specs["gate_up_proj"], specs["down_proj"] = gate_up, down
        return specs

    def _expert_narrows(self) -> dict[str, ShardSpec]:
        """Expert-parallel: this rank's experts whole (per-expert tensors of the others skipped
        unread), stacked tensors narrowed along the expert dimension (the first in either layout)."""
        first, count = self.expert_range
        specs: dict[str, ShardSpec] = {}
        for e in range(self.num_experts):
            if not first <= e < first + count:
                for kind in ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"):
                    specs[f"{e}.{kind}.weight"] = NOTHING
        specs["gate_up_proj"] = specs["down_proj"] = Narrow(0, ((first, count),))
        return specs

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        topk_ids = held_expert_ids(self.tp, self.expert_range, topk_ids)
        return fused_moe(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights)


def held_expert_ids(
    tp: TensorParallel, expert_range: tuple[int, int], topk_ids: torch.Tensor
) -> torch.Tensor:
    """Expert parallelism: the routed ids as indices into this rank's block of experts, another
    rank's expert as -1, an id the fused MoE skips (no compute, a zero contribution)."""
    if not tp.experts_whole:
        return topk_ids
    first, count = expert_range
    local = topk_ids - first
    return local.masked_fill((local < 0) | (local >= count), -1)


def dense_weight(proj: nn.Module) -> torch.Tensor | None:
    """A projection's weight where it is one unquantized matrix with no bias, else None."""
    if getattr(proj, "bias", None) is not None or getattr(proj, "weight_scale_inv", None) is not None:
        return None
    return proj.weight if getattr(proj, "dense_weight", None) is None else None  # type: ignore[return-value]


def stack_shared_expert(experts: nn.Module, shared: GatedMLP) -> bool:
    """Append `shared`'s matrices to `experts`' stacks (`Experts`, or the FP8 holder with its block
    scales) as one more expert, where both take the same form: one intermediate width on this
    rank, one dtype, FP8 with one scale layout or unquantized alike; `shared`'s weights become
    views of the new stacks' last expert. False, nothing changed, else."""
    stacks = []
    for name, proj in (("gate_up", shared.gate_up_proj), ("down", shared.down_proj)):
        stack, scales = getattr(experts, f"{name}_proj"), getattr(experts, f"{name}_scale", None)
        weight, scale = proj.weight, getattr(proj, "weight_scale_inv", None)
        if getattr(proj, "bias", None) is not None or getattr(proj, "dense_weight", None) is not None:
            return False
        if (
            weight.shape != stack.shape[1:]
            or weight.dtype != stack.dtype
            or (scale is None) != (scales is None)
        ):
            return False
        if scale is not None and scales is not None:
            rows, stack_rows = getattr(proj, "scale_rows", 0), getattr(experts, "scale_rows", 0)
            if rows != 1 and stack_rows == 1:  # block scales as the stack's per-row ones
                scale = scale.repeat_interleave(rows, dim=0)[: weight.shape[0]]
            elif rows != stack_rows:
                return False
            if scale.shape != scales.shape[1:]:
                return False
        stacks.append((name, proj, stack, weight, scales, scale))
    for name, proj, stack, weight, scales, scale in stacks:
        merged = torch.cat([stack, weight[None]])
        setattr(experts, f"{name}_proj", nn.Parameter(merged, requires_grad=False))
        proj.weight = nn.Parameter(merged[-1], requires_grad=False)
        if scale is not None and scales is not None:
            setattr(experts, f"{name}_scale", torch.cat([scales, scale[None]]))
    return True


def fused_shared_max_tokens() -> int:
    """`DELTASERVE_SHARED_EXPERT_TOKENS`: up to this many tokens in a forward, a fused shared
    expert runs inside the routed experts' launches; past it (prefill) as its own MLP, whose
    dense GEMMs suit many tokens better; 0 never."""
    value = os.environ.get("DELTASERVE_SHARED_EXPERT_TOKENS", "") or "512"
    if not value.isdigit():
        raise ValueError(f"DELTASERVE_SHARED_EXPERT_TOKENS={value!r}: expected a token count")
    return int(value)


# the fused router's rows padded to this: cuBLAS's Hopper kernels want the logits' rows 16-byte aligned
ROUTER_ROWS_MULTIPLE = 16


def fuse_shared_experts(model: nn.Module) -> int:
    """Every MoE block's shared expert into its routed experts (`fuse_shared_expert`), as the
    loader does on CUDA, where a shared MLP costs a decode step about as many launches as the
    routed experts. Returns how many blocks fused."""
    blocks = [m for m in model.modules() if hasattr(m, "fuse_shared_expert")]
    fused = sum(bool(m.fuse_shared_expert()) for m in blocks)  # type: ignore[operator]
    if fused and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the stacks replaced stay cached, unseen by the KV pool's sizing
    return fused


class SparseMoeBlock(nn.Module):
    """Softmax top-k routing plus a sigmoid-gated shared expert (Qwen3-Next, Qwen3.5-MoE).

    The shared expert stays split by its intermediate width under expert parallelism too, as
    vLLM keeps it: only the routed experts are placed whole."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        expert_size: int,
        shared_expert_size: int,
        norm_topk_prob: bool,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.tp = tp
        # the router and the shared expert's gate are replicated: every rank routes alike
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = Experts(num_experts, hidden, expert_size, tp)
        self.shared_expert = (
            GatedMLP(hidden, shared_expert_size, tp, reduce=False) if shared_expert_size else None
        )
        self.shared_expert_gate: nn.Module | None = (
            Linear(hidden, 1, bias=False) if shared_expert_size else None
        )
        self.fused_max_tokens: int | None = None  # set by fuse_shared_expert
        self.router_columns: int | None = None  # the router's rows in use, set by fuse_shared_expert

    def fuse_shared_expert(self) -> bool:
        """The shared expert appended to the routed experts' stack as expert E and its gate to the
        router's rows (zero rows after them to a multiple of `ROUTER_ROWS_MULTIPLE`), so that for up
        to `fused_max_tokens` tokens one routed-MoE call computes both; False, nothing changed,
        where their forms differ (expert parallelism, sizes, FP8 against unquantized)."""
        if self.shared_expert is None or self.shared_expert_gate is None or self.tp.experts_whole:
            return False
        gate, shared_gate = dense_weight(self.gate), dense_weight(self.shared_expert_gate)
        if gate is None or shared_gate is None or gate.dtype != shared_gate.dtype:
            return False
        if not stack_shared_expert(self.experts, self.shared_expert):
            return False
        e, hidden = gate.shape
        pad = -(e + 1) % ROUTER_ROWS_MULTIPLE
        with torch.device("meta"):  # off the fast path the matmuls stay apart, as unfused
            shards = [e, 1, pad] if pad else [e, 1]
            self.gate = Linear(hidden, e + 1 + pad, bias=False, shard_sizes=shards)
        weight = torch.cat([gate, shared_gate, gate.new_zeros(pad, hidden)])
        self.gate.weight = nn.Parameter(weight, requires_grad=False)
        self.router_columns = e + 1
        self.shared_expert_gate = None
        self.fused_max_tokens = fused_shared_max_tokens()
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        fused = self.router_columns is not None  # the shared gate's logit is the router's last
        if fused:
            logits = logits[:, : self.router_columns]  # without the padding rows' zeros
        if self.fused_max_tokens is not None and x.shape[0] <= self.fused_max_tokens:
            ids, weights = softmax_topk(logits, self.top_k, self.norm_topk_prob, True, x.dtype)
            return self.tp.all_reduce(self.experts(x, ids, weights))
        routed = logits[:, :-1] if fused else logits
        ids, weights = softmax_topk(routed, self.top_k, self.norm_topk_prob, dtype=x.dtype)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            gate = logits[:, -1:] if fused else self.shared_expert_gate(x)  # type: ignore[misc]
            out = out + torch.sigmoid(gate) * self.shared_expert(x)
        # routed and shared partial sums joined by one all-reduce (the gate is per token)
        return self.tp.all_reduce(out)


def run_decoder(
    embed: nn.Embedding,
    layers: nn.ModuleList,
    norm: _RMSNorm,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    ctx: ForwardContext,
    image_embeds: ImageEmbeds | None = None,
) -> torch.Tensor:
    """Embed, the decoder layers, the final norm. Each layer returns `(output, residual
    stream)`; the residual adds happen inside the next norm (`_RMSNorm.forward_add`).
    `image_embeds` (rows, values): the vision tower's output in place of those tokens' embeddings."""
    x = embed(input_ids)
    if image_embeds is not None:
        rows, values = image_embeds
        x[rows] = values.to(x.dtype)
    residual = None
    for layer in layers:
        x, residual = layer(x, positions, ctx, residual)
    return norm.forward_add(x, residual)[0] if residual is not None else norm(x)


def first_layers(types: list[str], config: Any, field: str = "layer_types") -> list[str]:
    """A config's per-layer list cut to its first num_hidden_layers (fewer where --hf-overrides
    lowers it, as transformers and vLLM build them)."""
    if config.num_hidden_layers > len(types):
        raise ValueError(
            f"num_hidden_layers is {config.num_hidden_layers} but {field} names {len(types)} "
            f"layers; give {field} for every layer"
        )
    return list(types)[: config.num_hidden_layers]


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class HybridCausalLM(nn.Module):
    """The causal-LM shell shared by the model families: a decoder `model` (with
    `embed_tokens` and `layer_types`) and the vocabulary projection, tied or not.

    Tensor-parallel: the LM head holds the embedding's vocabulary shard (tied or not), and
    `compute_logits` all-gathers the shards into the full vocabulary on every rank.

    What the engine reads of a model: `layer_types`, `kv_shapes` and `state_shapes` (to size
    its pools), `capabilities`, the forward (hidden states) and `compute_logits`."""

    capabilities: ClassVar[ModelCapabilities] = ModelCapabilities()

    def __init__(self, config: Any, model: Any, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.tp = tp
        self.vocab_size = int(config.vocab_size)
        self._layer_types: list[str] = list(model.layer_types)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = Linear(config.hidden_size, tp.vocab_range(self.vocab_size)[1], bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = model.embed_tokens.weight
        self._narrows: dict[str, ShardSpec] | None = None

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model's module tree (before fusing), or None for
        tensors it does not serve; families with other spellings override it."""
        return name

    def builds(self, name: str) -> bool:
        """Whether the model has a layer for this (renamed) tensor: not one past a lowered
        num_hidden_layers."""
        m = _LAYER_INDEX.match(name)
        return m is None or int(m.group(1)) < len(self.layer_types)

    def checkpoint_narrow(self, name: str, shape: tuple[int, ...]) -> Narrow | None:
        """This rank's part of the checkpoint tensor `name` of `shape` (None: all of it), from
        the `checkpoint_narrows` listings of the modules."""
        if self._narrows is None:
            self._narrows = collect_narrows(self)
        canonical = self.checkpoint_name(name)
        spec = self._narrows.get(canonical) if canonical is not None else None
        return spec(shape) if callable(spec) else spec

    def checkpoint_narrows(self) -> dict[str, ShardSpec]:
        return {"lm_head.weight": vocab_narrow(self.tp, self.vocab_size)}

    @property
    def layer_types(self) -> list[str]:
        return self._layer_types

    def tied_names(self) -> set[str]:
        return {"lm_head.weight"} if self.tie_word_embeddings else set()

    def kv_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-token KV cache entries of one full-attention layer, by name (`k`, `v`, `latent`)."""
        raise NotImplementedError

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-slot state of one linear-attention layer, by name (`conv`, `recurrent`)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        image_embeds: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        if image_embeds is None:
            return self.model(input_ids, positions, ctx)
        return self.model(input_ids, positions, ctx, image_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return self.lm_head(hidden)
        return self.tp.all_gather(self.lm_head(hidden), dim=-1)[..., : self.vocab_size]


def collect_narrows(model: nn.Module) -> dict[str, ShardSpec]:
    """{checkpoint name: its part on this rank} from every module's `checkpoint_narrows`
    (names relative to the module)."""
    specs: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        listing = getattr(module, "checkpoint_narrows", None)
        if callable(listing):
            dot = f"{prefix}." if prefix else ""
            specs.update({dot + name: spec for name, spec in listing().items()})
    return specs
