"""Linear-attention layers' backend: causal conv and delta rule over the state pool.

Decode rows (one token, continuing a state) take the in-place slot-indexed decode ops;
speculative verification windows (after the decodes) take the window ops, which read their
slot and leave the state after every position in the window buffer (`spec_decode/`);
prefill chunks take the variable-length ops, starting from zeros or from their slot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from deltaserve.engine.cache.state_pool import StatePool
from deltaserve.engine.runner.forward_batch import ForwardBatch
from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.conv import conv_decode, conv_prefill
from deltaserve.kernels.gdn import gdn_decode_gated, gdn_prefill
from deltaserve.kernels.kda import kda_decode, kda_prefill
from deltaserve.kernels.norm import gdn_gates
from deltaserve.kernels.window import conv_window, gdn_window, kda_window, window_pad_index
from deltaserve.models.forward import LinearOps

if TYPE_CHECKING:
    from deltaserve.engine.spec_decode.state_window import StateWindow


class LinearAttentionBackend(LinearOps):
    """`models.forward.LinearOps` (causal conv, GDN and KDA delta rules) over the state pool."""

    def __init__(self, pool: StatePool, layer_index: dict[int, int]) -> None:
        self.pool = pool
        self.layer_index = layer_index  # model layer id -> pool layer
        self.num_decodes = 0
        self.decode_slots = torch.empty(0, dtype=torch.int32)
        self.prefill_slots = torch.empty(0, dtype=torch.int32)
        self.prefill_cu_seqlens = torch.zeros(1, dtype=torch.int32)
        self.prefill_has_initial = torch.empty(0, dtype=torch.bool)
        self.prefill_chunk_indices: torch.Tensor | None = None
        # what the prefill ops derive from prefill_cu_seqlens, built by the first layer only
        self.kernel_cache = PerForwardCache()
        self._graph_slots: dict[int, torch.Tensor] = {}  # CUDA-graph buffers per width
        self._graph_pad: dict[int, torch.Tensor] = {}
        self.window: StateWindow | None = None  # set when speculative decoding is on
        self.num_verify_tokens = 0
        self.verify_slots = torch.empty(0, dtype=torch.int32)
        self.verify_pad_index = torch.empty(0, dtype=torch.long)
        self.verify_width = 0

    def prepare(self, batch: ForwardBatch) -> None:
        n, nv = batch.num_decodes, len(batch.verify_lens)
        m = n + sum(batch.verify_lens)  # tokens of the decode and verification rows
        self.num_decodes = n
        self.num_verify_tokens = m - n
        self.decode_slots = batch.state_slots[:n]
        if nv:
            self.verify_slots = batch.state_slots[n : n + nv]
            self.verify_pad_index = window_pad_index(batch.verify_lens, batch.input_ids.device)
            self.verify_width = max(batch.verify_lens)
        self.prefill_slots = batch.state_slots[n + nv :]
        self.prefill_cu_seqlens = batch.cu_seqlens_q[n + nv :] - m
        self.prefill_has_initial = batch.has_initial_state[n + nv :]
        self.prefill_chunk_indices = batch.prefill_chunk_indices

    def _window(self, layer_id: int, state: str) -> torch.Tensor:
        assert self.window is not None, "a verification batch without a window buffer"
        return self.window.layer(self.layer_index[layer_id])[state]

    def _verify_args(self, layer_id: int, state: str) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        return self.verify_slots, self.verify_pad_index, self.verify_width, self._window(layer_id, state)

    # -- CUDA graphs: batches of n requests of `width` tokens each (decode: 1; speculative
    # verification windows: k + 1, state read from the slot, written to the window buffer)
    # replay through slot buffers this backend owns ------------------------------------

    def init_capture_graph(self, max_bs: int, device: torch.device, width: int = 1) -> None:
        if width > 1:
            assert self.window is not None and max_bs <= self.window.rows, (
                "verification graphs need the window"
            )
            self._graph_pad[width] = torch.arange(max_bs * width, dtype=torch.long, device=device)
        self._graph_slots[width] = torch.zeros(max_bs, dtype=torch.int32, device=device)

    def prepare_for_capture(self, bs: int, width: int = 1) -> None:
        slots = self._graph_slots[width][:bs]
        decodes = bs if width == 1 else 0
        self.num_decodes = decodes
        self.decode_slots = slots[:decodes]
        self.num_verify_tokens = 0 if width == 1 else bs * width
        if width > 1:
            self.verify_slots = slots
            self.verify_pad_index = self._graph_pad[width][: bs * width]
            self.verify_width = width
        self.prefill_slots = slots[:0]
        self.prefill_cu_seqlens = torch.zeros(1, dtype=torch.int32, device=slots.device)
        self.prefill_has_initial = torch.zeros(0, dtype=torch.bool, device=slots.device)
        self.prefill_chunk_indices = None

    def prepare_for_replay(self, batch: ForwardBatch, bs: int, width: int = 1) -> None:
        """Copy the batch's slots in; padding rows point at slot 0 (and, for windows, fill
        window rows n..bs, never committed)."""
        n = batch.num_requests
        slots = self._graph_slots[width]
        slots[:n].copy_(batch.state_slots)
        slots[n:bs].zero_()

    def graph_slots(self, width: int = 1) -> torch.Tensor:
        """The state-slot buffer the graphs of `width` read (filled by `prepare_for_replay`)."""
        return self._graph_slots[width]

    def reset_capture(self, width: int = 1) -> None:
        self._graph_slots.pop(width, None)
        self._graph_pad.pop(width, None)

    def conv(
        self,
        layer_id: int,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        state: str = "conv",
        activation: str | None = "silu",
    ) -> torch.Tensor:
        pool = self.pool.layer(self.layer_index[layer_id])[state]
        n = self.num_decodes
        parts = []
        m = n + self.num_verify_tokens
        if n:
            parts.append(conv_decode(x[:n], pool, weight, bias, self.decode_slots, activation))
        if m > n:
            args = self._verify_args(layer_id, state)
            parts.append(conv_window(x[n:m], pool, weight, bias, *args, activation))
        if x.shape[0] > m:
            parts.append(
                conv_prefill(
                    x[m:],
                    pool,
                    weight,
                    bias,
                    self.prefill_cu_seqlens,
                    self.prefill_slots,
                    self.prefill_has_initial,
                    activation,
                    cache=self.kernel_cache,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _recurrent(self, layer_id: int, inputs: tuple[torch.Tensor, ...], decode_op, window_op, prefill_op):
        """Route one recurrent op's rows: decodes, then verification windows, then prefills."""
        pool = self.pool.layer(self.layer_index[layer_id])["recurrent"]
        n = self.num_decodes
        m = n + self.num_verify_tokens
        parts = []
        if n:
            parts.append(decode_op(*(x[:n] for x in inputs), pool, self.decode_slots))
        if m > n:
            win = self._verify_args(layer_id, "recurrent")
            parts.append(window_op(*(x[n:m] for x in inputs), pool, *win))
        if inputs[0].shape[0] > m:
            parts.append(
                prefill_op(
                    *(x[m:] for x in inputs),
                    self.prefill_cu_seqlens,
                    pool,
                    self.prefill_slots,
                    self.prefill_has_initial,
                    chunk_indices=self.prefill_chunk_indices,
                    cache=self.kernel_cache,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def delta_rule(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
    ) -> torch.Tensor:
        """Gated DeltaNet from its raw gate projections a, b `[T, HV]` (one log-decay and one
        beta per value head, `kernels.norm.gdn_gates`): decode rows compute them inside the
        decode kernel, the other rows before their op."""

        def gated(op):
            return lambda q, k, v, a, b, *rest, **kw: op(
                q, k, v, *gdn_gates(a, b, A_log, dt_bias), *rest, **kw
            )

        def decode(q, k, v, a, b, pool, slots):
            return gdn_decode_gated(q, k, v, a, b, A_log, dt_bias, pool, slots)

        return self._recurrent(layer_id, (q, k, v, a, b), decode, gated(gdn_window), gated(gdn_prefill))

    def kda(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """Kimi Delta Attention: `delta_rule` with a per-key-channel gate g `[T, H, K]`."""
        return self._recurrent(layer_id, (q, k, v, g, beta), kda_decode, kda_window, kda_prefill)
