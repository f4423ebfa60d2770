"""Small mixed steps by piecewise CUDA-graph replay (`--enable-piecewise-cuda-graph`), as vLLM's
piecewise graphs and SGLang's do: the model's forward is captured in pieces, cut at every call
into the backends (`ctx.attn`, `ctx.linear`: attention, conv, the delta rule), whose work depends
on each request's lengths and slots and so runs eagerly between the pieces. Everything else a
step runs (norms, projections, the MoE, RoPE) depends only on its token count, and replays.

One set of pieces per token count in `piecewise_sizes`; a step of t tokens replays the smallest
set of at least t, its rows past t computing on stale inputs that no request reads. A step of
decodes only still replays a decode graph; one of more tokens than the largest set runs eagerly.

What a piece hands an eager op stays where the capture put it (held here); the op's result is
copied into the buffer the next piece reads.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from deltaserve.engine.runner.cuda_graphs import gc_paused, on_side_stream
from deltaserve.engine.runner.forward_batch import ForwardBatch
from deltaserve.models.forward import ForwardContext


def piecewise_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, ... doubling up to max_tokens (and max_tokens itself)."""
    sizes = [s for s in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192) if s <= max_tokens]
    if max_tokens not in sizes:
        sizes.append(max_tokens)
    return sizes


@dataclass
class _Split:
    """One eager op between two pieces: the backend (`attn` or `linear`), its method, its
    arguments (tensors sliced to the step's rows when they are the forward's own), the buffer
    the next piece reads."""

    backend: str
    name: str
    args: tuple[Any, ...]
    sliced: tuple[bool, ...]
    out: torch.Tensor
    op: Any = None  # the backend's bound method, once captured


@dataclass
class _Pieces:
    tokens: int
    graphs: list[Any] = field(default_factory=list)  # torch.cuda.CUDAGraph
    splits: list[_Split] = field(default_factory=list)
    hidden: torch.Tensor | None = None


class _Recorder:
    """The ForwardContext a forward is captured with: each backend call ends the piece being
    captured, returns a zeroed buffer of the op's output shape, and starts the next piece. In
    `warmup` (no capture), it only returns the buffers, so that kernels compile before capture."""

    def __init__(
        self, pieces: _Pieces, owned: set[int], pool: Any, capture: bool, new_graph: Any = None
    ) -> None:
        self.pieces, self.owned, self.pool, self.capture = pieces, owned, pool, capture
        self.new_graph = new_graph or torch.cuda.CUDAGraph
        self.graph: Any = None

    @property
    def attn(self) -> Any:
        return self

    @property
    def linear(self) -> Any:
        return self

    def begin(self) -> None:
        if self.capture:
            self.graph = self.new_graph()
            self.graph.capture_begin(pool=self.pool)

    def end(self) -> None:
        if self.graph is not None:
            # two adjacent ops (conv, then the delta rule) leave an empty piece: nothing to warn of
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "The CUDA Graph is empty")
                self.graph.capture_end()
            self.pieces.graphs.append(self.graph)
            self.graph = None

    def _split(
        self, backend: str, name: str, args: tuple[Any, ...], shape: tuple[int, ...], like: torch.Tensor
    ):
        self.end()
        out = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if self.capture:
            t = self.pieces.tokens
            sliced = tuple(
                isinstance(a, torch.Tensor)
                and a.dim() > 0
                and a.shape[0] == t
                and a.data_ptr() not in self.owned
                for a in args
            )
            self.pieces.splits.append(_Split(backend, name, args, sliced, out))
        self.begin()
        return out

    def attention(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        shape = (q.shape[0], q.shape[1], v.shape[2])
        return self._split("attn", "attention", (layer_id, q, k, v, scale), shape, q)

    def mla_attention(self, layer_id, q, latent, w_kv_b, v_head_dim, scale):  # type: ignore[no-untyped-def]
        shape = (q.shape[0], q.shape[1], v_head_dim)
        return self._split(
            "attn", "mla_attention", (layer_id, q, latent, w_kv_b, v_head_dim, scale), shape, q
        )

    def conv(self, layer_id, x, weight, bias, state="conv", activation="silu"):  # type: ignore[no-untyped-def]
        return self._split(
            "linear", "conv", (layer_id, x, weight, bias, state, activation), tuple(x.shape), x
        )

    def delta_rule(self, layer_id, q, k, v, a, b, A_log, dt_bias):  # type: ignore[no-untyped-def]
        args = (layer_id, q, k, v, a, b, A_log, dt_bias)
        return self._split("linear", "delta_rule", args, tuple(v.shape), v)

    def kda(self, layer_id, q, k, v, g, beta):  # type: ignore[no-untyped-def]
        return self._split("linear", "kda", (layer_id, q, k, v, g, beta), tuple(v.shape), v)


def model_tensors(model: nn.Module) -> set[int]:
    """The model's own tensors, by address: passed to the ops whole, never cut to a step's rows."""
    return {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}


class PiecewiseGraphs:
    def __init__(
        self, model: nn.Module, ctx: ForwardContext, sizes: list[int], pool: Any, device: torch.device
    ) -> None:
        self.model, self.ctx, self.sizes = model, ctx, sizes
        self.input_ids = torch.zeros(sizes[-1], dtype=torch.long, device=device)
        self.positions = torch.zeros(sizes[-1], dtype=torch.long, device=device)
        owned = model_tensors(model)
        self.pieces: dict[int, _Pieces] = {}
        self.replays = 0
        for tokens in reversed(sizes):  # largest first, so that smaller sets reuse its memory
            self.pieces[tokens] = self._capture(tokens, owned, pool)
        torch.cuda.synchronize()

    def _capture(self, tokens: int, owned: set[int], pool: Any) -> _Pieces:
        pieces = _Pieces(tokens)
        ids, pos = self.input_ids[:tokens], self.positions[:tokens]
        with on_side_stream():
            for _ in range(2):  # Triton compiles and autotunes, cuBLAS sets up, outside the capture
                self.model(ids, pos, _Recorder(pieces, owned, pool, capture=False))
            recorder = _Recorder(pieces, owned, pool, capture=True)
            with gc_paused():
                try:
                    recorder.begin()
                    pieces.hidden = self.model(ids, pos, recorder)
                    recorder.end()
                finally:
                    if recorder.graph is not None:  # a failed capture: end it before anything else runs
                        try:
                            recorder.graph.capture_end()
                        except RuntimeError:
                            pass
        for split in pieces.splits:  # the backends' methods, found once
            split.op = getattr(getattr(self.ctx, split.backend), split.name)
        return pieces

    def can_run(self, batch: ForwardBatch) -> bool:
        return (
            batch.positions.dim() == 1
            and batch.image_embeds is None
            and batch.input_ids.numel() <= self.sizes[-1]
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """The hidden states `[t, H]` of the batch's t tokens; the backends were prepared for it."""
        t = batch.input_ids.numel()
        pieces = self.pieces[self.sizes[bisect.bisect_left(self.sizes, t)]]
        self.input_ids[:t].copy_(batch.input_ids)
        self.positions[:t].copy_(batch.positions)
        for graph, split in zip(pieces.graphs, [*pieces.splits, None]):
            graph.replay()
            if split is not None:
                args = (a[:t] if cut else a for a, cut in zip(split.args, split.sliced))
                split.out[:t].copy_(split.op(*args))
        self.replays += 1
        assert pieces.hidden is not None
        return pieces.hidden[:t]
