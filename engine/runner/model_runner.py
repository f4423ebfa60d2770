"""Owns the model, the pools and the two backends; runs one batch and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.engine.cache.kv_pool import KVPool
from deltaserve.engine.cache.page_table import SlotPageTable
from deltaserve.engine.cache.pool_sizing import free_memory_bytes, plan_pools
from deltaserve.engine.cache.state_pool import StatePool
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import EngineDeadError
from deltaserve.engine.runner.attention_backend import AttentionBackend
from deltaserve.engine.runner.cuda_graphs import CudaGraphRunner
from deltaserve.engine.runner.forward_batch import ForwardBatch, build_forward_batch
from deltaserve.engine.runner.h2d import to_device
from deltaserve.engine.runner.linear_backend import LinearAttentionBackend
from deltaserve.engine.runner.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from deltaserve.engine.spec_decode.state_window import StateWindow
from deltaserve.kernels.delta_rule.fla import configure_fla
from deltaserve.models.checkpoints.loader import LoadedModel
from deltaserve.models.forward import ForwardContext
from deltaserve.models.layers.attention import rope_max_positions
from deltaserve.models.vision.positions import ImageInputs

if TYPE_CHECKING:
    from deltaserve.engine.parallel.group import RankGroups
    from deltaserve.engine.parallel.step_sync import Op, StepChannel, StepMessage
    from deltaserve.engine.runner.weight_update import StagedWeights
    from deltaserve.models.qwen3_next_mtp import MultiTokenPredictor

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerBackends:
    """The runner's two backends side by side: what it hands the model as its
    `models.forward.ForwardContext`."""

    attn: AttentionBackend
    linear: LinearAttentionBackend


class ModelRunner:
    """With tensor parallelism (`groups`), every rank has one: rank 0's broadcasts each forward
    and the device-state writes before it (`engine/parallel/step_sync.py`), a worker's replays
    them (`run_message`)."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel,
        device: torch.device,
        groups: RankGroups | None = None,
    ) -> None:
        if device.type == "cuda":
            configure_fla()  # before anything imports FLA: it reads its switch once, at import
        self.config = config
        self.groups = groups
        self.loaded = loaded
        self.model = loaded.model
        self.vision = loaded.vision
        self.device = device
        types = self.model.layer_types
        attn_layers = [i for i, t in enumerate(types) if t != "linear_attention"]
        spec = config.spec
        self.mtp: MultiTokenPredictor | None = None
        if spec is not None and spec.method == "mtp":
            self.mtp = self._load_mtp(loaded, device)
            attn_layers.append(self.mtp.layer_id)  # its own KV cache, in the same pages
        linear_layers = [i for i, t in enumerate(types) if t == "linear_attention"]
        kv_shapes = self.model.kv_shapes()
        state_shapes = self.model.state_shapes()
        dtype = config.torch_dtype
        state_dtypes = {
            name: (config.torch_state_dtype if name == "recurrent" else dtype) for name in state_shapes
        }
        per_token = sum(int(torch.Size(s).numel()) for s in kv_shapes.values()) * dtype.itemsize
        bytes_per_page = per_token * len(attn_layers) * config.page_size
        bytes_per_slot = len(linear_layers) * sum(
            int(torch.Size(s).numel()) * state_dtypes[n].itemsize for n, s in state_shapes.items()
        )
        max_pos = rope_max_positions(loaded.config)
        self.sizes = plan_pools(config, bytes_per_page, bytes_per_slot, max_pos, device)
        self.channel: StepChannel | None = None
        if groups is not None:
            from deltaserve.engine.parallel.group import agree_pool_sizes
            from deltaserve.engine.parallel.step_sync import StepChannel

            # rank 0's slot and page numbers index every rank's pools
            self.sizes = agree_pool_sizes(self.sizes, groups)
            config.max_running_requests = self.sizes.num_slots
            self.channel = StepChannel(groups)
        self.kv_pool = KVPool(
            len(attn_layers), self.sizes.num_pages, config.page_size, kv_shapes, dtype, device
        )
        self.state_pool = StatePool(
            len(linear_layers),
            self.sizes.num_slots,
            self.sizes.num_snapshots,
            state_shapes,
            state_dtypes,
            device,
        )
        self.attn = AttentionBackend(self.kv_pool, {layer: i for i, layer in enumerate(attn_layers)})
        self.linear = LinearAttentionBackend(
            self.state_pool, {layer: i for i, layer in enumerate(linear_layers)}
        )
        self.window: StateWindow | None = None
        if spec is not None:
            self.window = StateWindow(
                self.state_pool, config.spec_window_rows, spec.num_speculative_tokens + 1
            )
            self.linear.window = self.window
        # typed as the models' Protocol so that mypy holds the backends to the contract
        self.ctx: ForwardContext = LayerBackends(self.attn, self.linear)
        # decode batches read each slot's pages from here (`engine/cache/page_table.py`)
        max_pages = -(-self.sizes.max_model_len // config.page_size)
        self.attn.slot_pages = SlotPageTable(1 + self.sizes.num_slots, max_pages, device)
        self.step_log = None
        if groups is not None and groups.is_leader:
            from deltaserve.engine.parallel.step_sync import OpLog

            self.step_log = OpLog()  # every writer of device state outside the forward records here
            self.state_pool.log = self.attn.slot_pages.log = self.step_log
            if self.window is not None:
                self.window.log = self.step_log
        self.graph_runner: CudaGraphRunner | None = None
        self.piecewise: PiecewiseGraphs | None = None
        # MTP drafting reads every forward's hidden states, which decode graphs do not keep
        if device.type == "cuda" and not config.disable_cuda_graph and self.mtp is None:
            self.capture_cuda_graphs()
        self.last_hidden: torch.Tensor | None = None  # the last eager forward's, for MTP
        self.last_mtp: torch.Tensor | None = None  # the MTP layer's last output, for its chained drafts
        self._staged: StagedWeights | None = None  # a worker's new weights, until rank 0 says commit

    def memory_info(self) -> dict[str, int]:
        """Bytes of what was allocated (weights, KV pool, working state slots with the padding
        slot, snapshot slots) and the device's free memory after it, for the start-up summary."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        state = self.state_pool
        return {
            "weights_bytes": sum(t.numel() * t.element_size() for t in tensors),
            "kv_pool_bytes": self.kv_pool.num_pages * self.kv_pool.bytes_per_page(),
            "kv_pages": self.kv_pool.capacity,
            "state_pool_bytes": (1 + state.num_working) * state.slot_bytes,
            "snapshot_slots": state.num_snapshots,
            "snapshot_bytes": state.num_snapshots * state.snapshot_bytes,
            "free_memory_bytes": free_memory_bytes(self.device),
        }

    def _load_mtp(self, loaded: LoadedModel, device: torch.device) -> MultiTokenPredictor:
        from deltaserve.models.qwen3_next_mtp import load_mtp

        if not self.model.capabilities.mtp_head:
            raise ValueError(
                f"MTP speculation needs a Qwen3-Next / Qwen3.5 checkpoint, not {loaded.architecture}"
            )
        dummy = self.config.load_format == "dummy"
        config = self.config
        return load_mtp(
            config.model, loaded.config, config.torch_dtype, device, dummy, config.quantization, loaded.tp
        )

    def _decode_body(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # every row of a decode batch is sampled
        return self.model.compute_logits(self.model(input_ids, positions, self.ctx)).float()

    @torch.inference_mode()
    def capture_cuda_graphs(self) -> None:
        max_bs = min(self.config.cuda_graph_max_bs, self.config.num_running)
        max_pages = -(-self.sizes.max_model_len // self.config.page_size)
        try:
            self.graph_runner = CudaGraphRunner(
                self._decode_body, self.attn, self.linear, max_bs, max_pages, self.device
            )
        except Exception as e:  # an op that cannot be captured: decode runs eagerly instead
            logger.warning("CUDA graph capture failed (%s); decoding eagerly", e)
            self.attn.reset_capture()
            self.linear.reset_capture()
            self.graph_runner = None
        else:
            logger.info("captured CUDA graphs for decode batch sizes %s", self.graph_runner.sizes)
            spec = self.config.spec
            if spec is not None and spec.cuda_graph and self.window is not None:
                self._capture_verify_graphs(spec.num_speculative_tokens + 1)
            if self.config.piecewise_cuda_graph_max_tokens:
                self._capture_piecewise(self.config.piecewise_cuda_graph_max_tokens)

    def _capture_piecewise(self, max_tokens: int) -> None:
        assert self.graph_runner is not None
        sizes = piecewise_sizes(min(max_tokens, self.config.max_num_batched_tokens or max_tokens))
        try:
            self.piecewise = PiecewiseGraphs(self.model, self.ctx, sizes, self.graph_runner.pool, self.device)
        except Exception as e:  # asked for by a flag: a clear start-up error, not a slower server
            raise RuntimeError(
                f"piecewise CUDA graph capture failed ({type(e).__name__}: {e}); "
                "start without --enable-piecewise-cuda-graph"
            ) from e
        logger.info("captured piecewise CUDA graphs for steps of up to %s tokens", sizes)

    def _capture_verify_graphs(self, width: int) -> None:
        assert self.graph_runner is not None and self.window is not None
        if "latent" in self.model.kv_shapes():
            # MLA over several query tokens is the expanded torch reference, which reads
            # lengths on the host: it cannot be captured
            logger.info("MLA model: speculative verification runs eagerly")
            return
        max_bs = min(self.window.rows, self.config.cuda_graph_max_bs)
        try:
            self.graph_runner.capture_verify(width, max_bs)
        except Exception as e:  # an op of the window path that cannot be captured
            logger.warning("verification graph capture failed (%s); verifying eagerly", e)
        else:
            assert self.graph_runner.verify is not None
            logger.info(
                "captured verification graphs for %s windows of %d tokens",
                self.graph_runner.verify.sizes,
                width,
            )

    def decode_page_table(self, num_requests: int, num_decodes: int) -> SlotPageTable | None:
        """The device page table that a batch of these counts reads (decodes only, by graph
        or eagerly): the engine updates it and leaves the batch's own table out. None for
        other batches."""
        if num_requests == 0 or num_decodes != num_requests:
            return None
        return self.attn.slot_pages

    @torch.inference_mode()
    def encode_images(self, inputs: ImageInputs) -> torch.Tensor:
        """The vision tower's embeddings of a prompt's images, one row per image token."""
        assert self.vision is not None
        return self.vision(inputs.pixel_values.to(self.device), inputs.grids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[M, vocab]` (fp32) at the batch's sampled positions.

        Batches of only verification windows, all k + 1 tokens, replay verification graphs when
        they were captured (`speculative_config["cuda_graph"]`); other mixed batches run eagerly.
        With tensor parallelism, rank 0 first sends the workers the step (its writes since the
        last forward, then the batch); a failure from then on leaves the ranks out of step, so
        it is the end of the engine (EngineDeadError)."""
        if self.step_log is None:
            return self._forward(batch)
        from deltaserve.engine.parallel.step_sync import StepMessage

        assert self.channel is not None and batch.source is not None
        images = batch.image_embeds
        shape = None if images is None else (len(images[0]), images[1].shape[1], images[1].dtype)
        self.channel.send(
            StepMessage("step", self.step_log.take(), batch.source, batch.inputs_on_device, shape)
        )
        try:
            if batch.inputs_on_device:
                self.channel.broadcast_inputs(batch.input_ids)
            if images is not None:
                self.channel.broadcast_images(images)
            return self._forward(batch)
        except Exception as exc:
            raise EngineDeadError(f"a tensor-parallel step failed ({type(exc).__name__}: {exc})") from exc

    @torch.inference_mode()
    def mtp_forward(
        self, batch: ForwardBatch, base: str, rows: list[int], logits_rows: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The MTP layer over `batch` (its input ids: the next tokens), fed `rows` of the last
        forward's hidden states (`base` "step") or of the MTP's own last output ("mtp"): its output
        `[T, H]` and the logits at `logits_rows`. Workers replay it as they replay a step."""
        if self.step_log is None:
            return self._mtp(batch, base, rows, logits_rows)
        from deltaserve.engine.parallel.step_sync import StepMessage

        assert self.channel is not None and batch.source is not None
        feed = (base, rows, logits_rows)
        self.channel.send(StepMessage("mtp", self.step_log.take(), batch.source, mtp=feed))
        try:
            return self._mtp(batch, base, rows, logits_rows)
        except Exception as exc:
            raise EngineDeadError(f"a tensor-parallel MTP step failed ({type(exc).__name__}: {exc})") from exc

    def _mtp(
        self, batch: ForwardBatch, base: str, rows: list[int], logits_rows: list[int] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.mtp is not None
        source = self.last_hidden if base == "step" else self.last_mtp
        assert source is not None
        self.attn.prepare(batch)
        embeds = self.model.model.embed_tokens(batch.input_ids)
        index = to_device(rows, torch.long, self.device)
        out = self.last_mtp = self.mtp(embeds, source[index], batch.positions, self.ctx)
        if logits_rows is None:
            return out, None
        return out, self.model.compute_logits(out[to_device(logits_rows, torch.long, self.device)])

    def update_weights(self, path: str, load_format: str = "auto") -> None:
        """The checkpoint at `path`'s weights in place of the served ones (`weight_update.py`);
        ValueError, with nothing changed on any rank, when it is not a checkpoint of this model or
        cannot be read. Every rank stages its slice and reports before any copies."""
        error = self.stage_weights(path, load_format)
        self.finish_weights(commit=error is None)
        if error is not None:
            raise ValueError(error)

    def stage_weights(self, path: str, load_format: str = "auto") -> str | None:
        """Every rank loads and checks its slice of `path` (`update_weights`' first half); the
        first rank's error, or None. `finish_weights` must follow: the other ranks wait for it."""
        from deltaserve.engine.parallel.step_sync import StepMessage

        channel, log = self.channel, self.step_log
        if log is not None:
            assert channel is not None
            channel.send(StepMessage("stage", log.take(), reload=(path, load_format)))
        self._staged, error = self._stage(path, load_format)
        if log is not None:  # every rank's verdict
            assert channel is not None
            error = next((e for e in channel.gather(error) or [] if e is not None), None)
        return error

    def finish_weights(self, commit: bool) -> None:
        """Copy the staged weights in on every rank, or drop them (a replica elsewhere refused, or
        nothing was staged)."""
        from deltaserve.engine.parallel.step_sync import StepMessage
        from deltaserve.engine.runner.weight_update import commit_weights

        if self.step_log is not None:
            assert self.channel is not None
            self.channel.send(StepMessage("commit" if commit else "discard"))
        staged, self._staged = self._staged, None
        if commit:
            assert staged is not None, "no weights staged"
            commit_weights(staged)

    def _stage(self, path: str, load_format: str) -> tuple[StagedWeights | None, str | None]:
        from deltaserve.engine.runner.weight_update import stage_weights

        try:
            return stage_weights(
                self.config, self.loaded, self._live_modules(), self.device, path, load_format
            ), None
        except Exception as exc:  # reported to rank 0, which refuses the update on every rank
            if isinstance(exc, ValueError):
                return None, str(exc)
            where = f" on rank {self.groups.tp.rank}" if self.groups is not None else ""
            return None, f"the checkpoint at {path} could not be loaded{where} ({type(exc).__name__}: {exc})"

    def _live_modules(self) -> dict[str, nn.Module]:
        live: dict[str, nn.Module] = {"model": self.model}
        if self.vision is not None:
            live["vision tower"] = self.vision
        if self.mtp is not None:
            live["MTP layer"] = self.mtp
        return live

    # -- tensor parallelism: a worker's side ------------------------------------------------

    @torch.inference_mode()
    def run_message(self, message: StepMessage) -> None:
        """Replay rank 0's step: its device-state writes, then the same forward (a heartbeat:
        nothing)."""
        assert self.channel is not None
        if message.kind == "beat":
            return
        self.apply(message.ops)
        if message.kind == "digest":
            self.channel.gather(self.state_digest())
            return
        if message.kind == "stage":
            assert message.reload is not None
            self._staged, error = self._stage(*message.reload)
            self.channel.gather(error)
            return
        if message.kind in ("commit", "discard"):
            from deltaserve.engine.runner.weight_update import commit_weights

            if message.kind == "commit" and self._staged is not None:
                commit_weights(self._staged)
            self._staged = None
            return
        assert message.batch is not None
        batch = build_forward_batch(**message.batch, device=self.device)
        if message.mtp is not None:
            self._mtp(batch, *message.mtp)
            return
        if message.inputs_on_device:
            self.channel.broadcast_inputs(batch.input_ids)
        if message.images is not None:
            batch.image_embeds = self.channel.recv_images(message.images, self.device)
        self._forward(batch)

    def apply(self, ops: list[Op]) -> None:
        targets = {"state_pool": self.state_pool, "page_table": self.attn.slot_pages, "window": self.window}
        for target, method, args in ops:
            getattr(targets[target], method)(*args)

    def state_digest(self) -> dict[str, torch.Tensor]:
        """Per slot, page and window row, the sum and the absolute sum of its device state (fp64, on
        the host), and the decode page table: a check that workers replayed rank 0's writes (a
        copied row equals its source on every rank; the page table is the same everywhere)."""

        def per_row(buf: torch.Tensor) -> torch.Tensor:  # rows: dim 1 (dim 0 is the layer)
            x = buf.double().transpose(0, 1).flatten(1)
            return torch.stack([x.sum(1), x.abs().sum(1)], 1).cpu()

        assert self.attn.slot_pages is not None
        out: dict[str, torch.Tensor] = {"page_table": self.attn.slot_pages.table.cpu().clone()}
        for name, buf in self.state_pool.buffers.items():
            out[f"state.{name}"] = per_row(buf)
        for name, buf in self.kv_pool.buffers.items():
            out[f"kv.{name}"] = per_row(buf)
        if self.window is not None:
            for name, buf in self.window.buffers.items():
                out[f"window.{name}"] = per_row(buf)
        return out

    def rank_digests(self) -> list[dict[str, torch.Tensor]]:
        """Rank 0: every rank's `state_digest`, after the writes not yet sent are applied."""
        from deltaserve.engine.parallel.step_sync import StepMessage

        if self.step_log is None:
            return [self.state_digest()]
        assert self.channel is not None
        self.channel.send(StepMessage("digest", self.step_log.take()))
        digests = self.channel.gather(self.state_digest())
        assert digests is not None
        return digests

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if self.graph_runner is not None and batch.positions.dim() == 1 and batch.image_embeds is None:
            if self.graph_runner.can_run(batch):
                return self.graph_runner.run(batch)
            if self.graph_runner.can_run_verify(batch):
                return self.graph_runner.run_verify(batch)
        self.attn.prepare(batch)
        self.linear.prepare(batch)
        if self.piecewise is not None and self.piecewise.can_run(batch):
            hidden = self.piecewise.run(batch)
            return self.model.compute_logits(hidden[batch.logits_indices]).float()
        hidden = self.model(batch.input_ids, batch.positions, self.ctx, batch.image_embeds)
        if self.mtp is not None:
            self.last_hidden = hidden
        return self.model.compute_logits(hidden[batch.logits_indices]).float()
