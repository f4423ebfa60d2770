"""The engine core: add requests, step, get outputs.

Overlap scheduling (`enable_overlap_schedule`): a step schedules and launches its forward
pass before it reads the previous step's sampled tokens back, so that the host's work
(scheduling, batch building, stop checks, outputs) runs while the GPU computes. A decode
whose previous token is still on the device carries a placeholder (`Request.num_placeholders`)
that the batch fills from the device. A request that stops on a token read back late has
already run one more step: that step's token is real (it is the stop token), so its KV and
state are consistent and only its sampled output is dropped. Steps that need host data
before sampling (penalties, min_tokens, logprobs, speculative decoding), or whose decodes
could need a preemption, first finish the step in flight and then run synchronously.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deltaserve.engine.cache.adapter import make_prefix_cache, prefill_cost
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.errors import EngineDeadError, QueueFullError
from deltaserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from deltaserve.engine.request import Request, Status
from deltaserve.engine.runner.forward_batch import build_forward_batch
from deltaserve.engine.runner.h2d import to_device_packed
from deltaserve.engine.runner.model_runner import ModelRunner
from deltaserve.engine.sampling.sampler import SAMPLER_GRAPH_MAX_BS, Sampler
from deltaserve.engine.sampling_params import SamplingParams, StructuredOutputs
from deltaserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from deltaserve.engine.spec_decode import Computed, MtpDrafter, SpecDecoder, Verdict
from deltaserve.engine.stop_checks import check_stop, visible_length, visible_text
from deltaserve.models.loader import load_model, load_tokenizer
from deltaserve.models.parallel import SINGLE

if TYPE_CHECKING:
    from deltaserve.engine.parallel.group import RankGroups
    from deltaserve.engine.parallel.launcher import WorkerProcesses

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens have not been read back."""

    sampled: list[Request]
    tokens: torch.Tensor  # on the device, one per sampled request
    host: torch.Tensor  # their copy on the host (pinned on CUDA), valid once `done` fired
    done: Any  # torch.cuda.Event, or None off CUDA


def eos_token_ids_of(path: str, config: Any, tokenizer: Any | None) -> list[int]:
    ids: list[int] = []

    def add(v: Any) -> None:
        if isinstance(v, int):
            ids.append(v)
        elif isinstance(v, (list, tuple)):
            ids.extend(int(x) for x in v)

    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return sorted(set(ids))


class Engine:
    """With `tensor_parallel_size` > 1 this process is rank 0: it starts this node's other ranks
    (`engine/parallel/`), drives them through its ModelRunner, and is dead (`dead_reason`, every
    step an EngineDeadError) once one of them is gone. `shutdown` stops them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device or "cpu")
        self.dead_reason: str | None = None
        self.on_worker_lost: Callable[[str], None] | None = None  # called from the watching thread
        self._groups: RankGroups | None = None
        self._workers: WorkerProcesses | None = None
        if config.tensor_parallel_size > 1:
            self._start_ranks()
        try:
            self._build(config)
        except BaseException as exc:
            gone = self._workers.exited() if self._workers is not None else None
            self.shutdown(graceful=False)
            if gone is not None:
                raise RuntimeError(f"{gone} while the engine started (its log says why)") from exc
            raise
        if self._workers is not None:
            self._workers.watch(self._worker_lost)

    def _start_ranks(self) -> None:
        from deltaserve.engine.parallel.group import free_port, init_rank, rank_device
        from deltaserve.engine.parallel.launcher import WorkerProcesses

        config = self.config
        if config.node_rank != 0:
            raise ValueError("the engine is rank 0, on node 0: other nodes run headless workers")
        self.device = rank_device(config, 0)
        port = config.master_port or free_port()
        local = [r for r in config.node_ranks if r != 0]
        self._workers = WorkerProcesses(config, local, port) if local else None
        try:
            self._groups = init_rank(
                config, 0, port, self.device, self._workers.exited if self._workers is not None else None
            )
        except BaseException:
            self.shutdown(graceful=False)
            raise
        config.tensor_parallel = self._groups.tp

    def _worker_lost(self, why: str) -> None:
        self.dead_reason = f"the engine lost a worker: {why}"
        logger.error("%s", self.dead_reason)
        if self.on_worker_lost is not None:
            self.on_worker_lost(why)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (told to stop, killed if they do not) and leave
        the process group; nothing to do on one device. Idempotent."""
        from deltaserve.engine.parallel.group import destroy
        from deltaserve.engine.parallel.step_sync import STOP

        groups, workers = self._groups, self._workers
        self._groups = self._workers = None
        runner = getattr(self, "runner", None)
        if graceful and groups is not None and self.dead_reason is None and runner is not None:
            try:
                assert runner.channel is not None
                runner.channel.send(STOP)
            except EngineDeadError:
                pass
        if workers is not None:
            workers.stop(timeout=30.0 if graceful else 0.0)
        destroy(groups)

    def _build(self, config: EngineConfig) -> None:
        torch.manual_seed(config.seed)
        tp = config.tensor_parallel or SINGLE
        loaded = load_model(
            config.model,
            config.torch_dtype,
            self.device,
            config.load_format,
            config.seed,
            quantization=config.quantization,
            tp=tp,
        )
        self.model_config = loaded.config
        self.vocab_size = int(loaded.config.vocab_size)
        self.tokenizer = load_tokenizer(config.tokenizer or config.model)
        self.eos_token_ids = eos_token_ids_of(config.model, loaded.config, self.tokenizer)
        self.runner = ModelRunner(config, loaded, self.device, self._groups)
        self.max_model_len = self.runner.sizes.max_model_len
        kv, st = self.runner.kv_pool, self.runner.state_pool
        self._prefill_cost = prefill_cost(loaded.config, self.runner.model.layer_types, loaded.num_params)
        self.prefix_cache = make_prefix_cache(config, kv, st, self._prefill_cost)
        self.scheduler = Scheduler(config, kv, st, self.prefix_cache)
        self._grammars: Any = None  # structured outputs' compiled grammars (engine/sampling/structured.py)
        self._grammars_lock = threading.Lock()
        # small sampled batches replay CUDA graphs of the sampler (engine/sampling/sampler_graphs.py)
        graphs = self.device.type == "cuda" and not config.disable_cuda_graph
        self.sampler = Sampler(
            self.device,
            config.seed,
            self.eos_token_ids,
            graph_max_bs=min(SAMPLER_GRAPH_MAX_BS, config.cuda_graph_max_bs) if graphs else 0,
        )
        self.requests: dict[str, Request] = {}
        self._finished_outputs: list[RequestOutput] = []
        self._inflight: _InFlight | None = None
        self._host_buffers: list[torch.Tensor] = []
        # overlap scheduling: seconds the host has waited for a step's tokens (benchmarks read it:
        # a step's wall time less this is its host work, the part that overlap has to hide)
        self.read_back_wait_s = 0.0
        if config.enable_overlap_schedule and self.device.type == "cuda":
            n = config.num_running
            self._host_buffers = [torch.empty(n, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self.counters = {
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "cached_tokens_total": 0,
            "spec_draft_tokens_total": 0,
            "spec_accepted_tokens_total": 0,
            "spec_windows_total": 0,
        }
        self.spec: SpecDecoder | None = None
        spec = config.spec
        if spec is not None:
            assert self.runner.window is not None
            mtp = None
            if self.runner.mtp is not None:
                mtp = MtpDrafter(self.runner, self.scheduler.reserve_pages, spec.num_speculative_tokens)
            self.spec = SpecDecoder(spec, self.runner.window, self.sampler, self.max_model_len, mtp)
            self.scheduler.propose = self.spec.propose
            self.scheduler.max_verify = self.runner.window.rows
        self.model_info = {
            "model": config.model,
            "architecture": loaded.architecture,
            "dtype": config.dtype,
            "device": str(self.device),
            "tensor_parallel_size": config.tensor_parallel_size,
            "expert_parallel": (config.tensor_parallel or SINGLE).experts_whole,
            "num_params": loaded.num_params,
            "kv_capacity_tokens": self.runner.kv_pool.capacity * config.page_size,
            "state_slots": self.runner.state_pool.num_working,
            "max_model_len": self.max_model_len,
            "cache_type": config.cache_type,
            "prefix_cache_policy": config.prefix_cache_policy,
            "page_size": config.page_size,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "chunked_prefill_size": config.chunked_prefill_size,
            **self.runner.memory_info(),  # bytes of weights and pools, free memory: start-up summary
        }
        if config.warmup:
            self._warm_up()

    def _warm_up(self) -> None:
        """Run a few prompts of mixed lengths through mixed steps once before serving: the first
        prefill of each shape compiles and autotunes its Triton / FLA kernels (seconds), which
        would otherwise stall every stream of the first requests. Then the engine is as new: an
        empty prefix cache with fresh statistics, counters at zero, pools idle."""
        t0 = time.perf_counter()
        longest = max(1, min(self.config.chunk_size, self.max_model_len - 4, 1000))
        lengths = sorted({longest, min(77, longest), min(16, longest)}, reverse=True)
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, output_kind="final_only")
        for i, n in enumerate(lengths):
            self.add_request(
                f"deltaserve-warmup-{i}", [(7 * j + i) % self.vocab_size for j in range(n)], params
            )
            self.step()  # the next one arrives while this one runs: a mixed step
        while self.has_unfinished_requests():
            self.step()
        self.prefix_cache.flush()
        kv, st = self.runner.kv_pool, self.runner.state_pool
        self.prefix_cache = make_prefix_cache(self.config, kv, st, self._prefill_cost)
        self.scheduler.prefix_cache = self.prefix_cache
        self.counters = dict.fromkeys(self.counters, 0)
        logger.info("warmed up the prefill kernels in %.1f s", time.perf_counter() - t0)

    # -- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; a ValueError (bad input) or QueueFullError leaves nothing behind."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        params = copy.copy(params)  # max_tokens may be filled in below; the caller's stays as given
        params.validate()
        bad = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
            )
        n_prompt = len(prompt_token_ids)
        if params.max_tokens is None:
            if n_prompt >= self.max_model_len:
                raise ValueError(
                    f"the prompt has {n_prompt} tokens; the maximum model length is {self.max_model_len}"
                )
            params.max_tokens = self.max_model_len - n_prompt
        if n_prompt + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"the prompt has {n_prompt} tokens and max_tokens is {params.max_tokens}: together "
                f"{n_prompt + params.max_tokens}, over the maximum model length of {self.max_model_len}"
            )
        # requests not yet scheduled into free running places do not count against the bound
        free = max(0, self.config.num_running - len(self.scheduler.running))
        if len(self.scheduler.waiting) >= self.config.max_waiting_requests + free:
            raise QueueFullError(
                f"the waiting queue is full ({self.config.max_waiting_requests} requests beyond the running batch)"
            )
        matcher = None
        if params.structured_outputs is not None:  # compiled here: a bad schema is the caller's 400
            matcher = self._grammars_built().matcher(params.structured_outputs)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            # a final-only output without stop strings needs its text once, at the end
            detokenizer=IncrementalDetokenizer(
                self.tokenizer if params.detokenize else None,
                params.skip_special_tokens,
                deferred=params.output_kind == "final_only" and not params.stop,
            ),
            generator=self.sampler.new_generator(params.seed),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            matcher=matcher,
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        self.counters["prompt_tokens_total"] += n_prompt

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return
        self.scheduler.finish(req)
        req.num_placeholders = 0  # a token in flight for it is dropped when read back
        req.finish_reason = "abort"
        self._finished_outputs.append(self._output(req))

    def _grammars_built(self) -> Any:
        with self._grammars_lock:
            if self._grammars is None:
                from deltaserve.engine.sampling.structured import Grammars

                self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammars

    def compile_structured(self, spec: StructuredOutputs) -> None:
        """Compile `spec`'s grammar into the cache now (ValueError for a bad schema or a missing
        xgrammar), so that admitting the request does not compile it on the engine's thread."""
        self._grammars_built().compile(spec)

    def prepare_grammars(self) -> None:
        """Build structured outputs' view of the vocabulary now (xgrammar's TokenizerInfo, a
        pass over the whole vocabulary) instead of at the first JSON request, which would spend
        it on the engine's thread while every stream waits. The server
        calls this in a thread at start-up. Without xgrammar or a tokenizer it does nothing (the
        first such request then gets the 400 that says why)."""
        try:
            self._grammars_built()
        except ValueError:
            pass

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # -- stepping ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        try:
            if self.config.enable_overlap_schedule:
                return self._step_overlapped()
            return self._step_sync()
        except EngineDeadError as exc:
            if self.dead_reason is None:
                # a local worker's death reaches the collectives first: name it when it is one
                gone = self._workers.exited(wait_s=1.0) if self._workers is not None else None
                self.dead_reason = f"the engine lost a worker: {gone}" if gone else str(exc)
            raise EngineDeadError(self.dead_reason) from exc

    def tensor_parallel_digests(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's device-state digest (`ModelRunner.state_digest`), rank 0's first: a check
        that the workers replayed each write of rank 0."""
        return self.runner.rank_digests()

    def _step_sync(self) -> list[RequestOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        plan = self.scheduler.schedule()
        if plan is None:
            return outputs
        for req in plan.admitted:
            if req.num_preemptions == 0:
                self.counters["cached_tokens_total"] += req.num_cached_tokens
        starts = [c.req.num_computed_tokens for c in plan.chunks]
        batch = self._batch(plan)
        logits = self.runner.forward(batch)
        if batch.num_prompt_logits:
            n = batch.num_prompt_logits
            self._record_prompt_logprobs(plan, starts, logits[-n:])
            logits = logits[:-n]
        sampled = [c.req for c in plan.chunks if c.sample and not c.drafts]
        self.scheduler.advance(plan)
        windows = plan.verify_chunks
        verdicts: list[Verdict] = []
        if windows:
            assert self.spec is not None
            lo, hi = plan.num_decodes, plan.num_decodes + sum(c.num_tokens for c in windows)
            verdicts = self.spec.verify(logits[lo:hi], [c.req for c in windows], [c.drafts for c in windows])
            logits = torch.cat([logits[:lo], logits[hi:]])
        now = time.time()
        if sampled:
            tokens, logprobs = self.sampler.sample(logits, sampled)
            for req, tok, lp in zip(sampled, tokens, logprobs):
                if req.params.max_tokens == 0:  # only the prompt's log-probabilities were asked for
                    self._finish(req, "length", None)
                else:
                    self._append_token(req, tok, lp, now)
                self._emit(outputs, req)
        if windows:
            outputs.extend(self._finish_windows(windows, verdicts, now))
        if self.spec is not None and self.spec.mtp is not None:
            self.spec.after_step(self._computed(plan, starts, verdicts))
        return outputs

    # -- overlap scheduling --------------------------------------------------------------

    def _step_overlapped(self) -> list[RequestOutput]:
        prev = self._inflight
        if not self._can_overlap(prev is not None):
            outputs = self.drain()
            return outputs + self._step_sync()
        outputs, self._finished_outputs = self._finished_outputs, []
        plan = self.scheduler.schedule()
        if plan is None:
            return outputs + self.drain()
        for req in plan.admitted:
            if req.num_preemptions == 0:
                self.counters["cached_tokens_total"] += req.num_cached_tokens
        batch = self._batch(plan)
        if prev is not None:
            self._fill_placeholders(batch, plan, prev)
        logits = self.runner.forward(batch)
        sampled = [c.req for c in plan.chunks if c.sample]
        launched = self._launch_readback(sampled, logits) if sampled else None
        for req in sampled:
            req.num_placeholders += 1
        read = self._read_back(prev) if prev is not None else []
        # the plan's inputs are all known now: the cache may see them as computed
        self.scheduler.advance(plan)
        if prev is not None:
            outputs.extend(self._after_read_back(read))
        self._inflight = launched
        return outputs

    def _can_overlap(self, in_flight: bool) -> bool:
        """No host data needed before sampling, and (with a step in flight, whose tokens are
        not known) pages for every decode without preempting anyone."""
        if self.spec is not None:
            return False
        reqs = self.requests.values()
        if any(
            r.params.logprobs is not None
            or r.params.prompt_logprobs is not None
            or self.sampler._needs_processing(r)
            for r in reqs
        ):
            return False
        if not in_flight:
            return True
        ps = self.config.page_size
        need = sum(max(0, -(-r.num_tokens // ps) - len(r.pages)) for r in self.scheduler.running)
        return need <= self.runner.kv_pool.num_free + self.prefix_cache.num_evictable_pages

    def _fill_placeholders(self, batch: Any, plan: SchedulerOutput, prev: _InFlight) -> None:
        """Decode rows whose input is the previous step's token: take it from the device."""
        index = {id(r): i for i, r in enumerate(prev.sampled)}
        rows, src = [], []
        for row, c in enumerate(plan.chunks[: plan.num_decodes]):
            if c.req.num_placeholders:
                rows.append(row)
                src.append(index[id(c.req)])
        if not rows:
            return
        batch.inputs_on_device = True
        k = len(rows)
        if rows[-1] == k - 1 and src == rows:  # the steady state: one copy, nothing to send
            batch.input_ids[:k].copy_(prev.tokens[:k])
            return
        rows_t, src_t = to_device_packed([(rows, torch.long), (src, torch.long)], batch.input_ids.device)
        batch.input_ids.index_copy_(0, rows_t, prev.tokens.index_select(0, src_t))

    def _launch_readback(self, sampled: list[Request], logits: torch.Tensor) -> _InFlight:
        tokens = self.sampler.sample_tokens(logits, sampled)
        if not self._host_buffers:  # off CUDA the copy is synchronous (and a copy: `tokens` may
            # be a sampler graph's output, which the next step's sampling overwrites)
            return _InFlight(sampled, tokens, tokens.to("cpu", copy=True), None)
        self._host_buffers.reverse()  # the other buffer may still be read for the previous step
        host = self._host_buffers[0][: len(sampled)]
        host.copy_(tokens, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the copy's stream, on any cuda:N
        return _InFlight(sampled, tokens, host, done)

    def _read_back(self, prev: _InFlight) -> list[tuple[Request, int]]:
        """The step's tokens replace its placeholders (requests aborted meanwhile drop theirs)."""
        if prev.done is not None:
            t = time.perf_counter()
            prev.done.synchronize()
            self.read_back_wait_s += time.perf_counter() - t
        now = time.time()
        read = []
        for req, tok in zip(prev.sampled, prev.host.tolist()):
            if req.finished:
                continue
            req.num_placeholders -= 1
            self._record_token(req, tok, None, now)
            read.append((req, tok))
        return read

    def _after_read_back(self, read: list[tuple[Request, int]]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for req, tok in read:
            self._check_token(req, tok)
            self._emit(outputs, req)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight (overlap scheduling), if any: read its tokens back and run
        their stop checks; its outputs are returned. The next `step` starts with nothing in flight."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return []
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs + self._after_read_back(self._read_back(prev))

    @staticmethod
    def _prompt_rows(req: Request, start: int, num_tokens: int) -> int:
        """Positions of a chunk whose logits score the next prompt token (prompt logprobs)."""
        if req.params.prompt_logprobs is None:
            return 0
        return max(0, min(start + num_tokens, len(req.prompt_token_ids) - 1) - start)

    def _record_prompt_logprobs(self, plan: SchedulerOutput, starts: list[int], logits: torch.Tensor) -> None:
        """Each scored position's log-probability of the prompt token after it, and the top ones."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        row = 0
        for c, start in zip(plan.chunks, starts):
            n = self._prompt_rows(c.req, start, c.num_tokens)
            if n == 0:
                continue
            req, k = c.req, c.req.params.prompt_logprobs or 0
            targets = req.prompt_token_ids[start + 1 : start + 1 + n]
            block = logprobs[row : row + n]
            row += n
            assert req.prompt_logprobs is not None
            known = len(req.prompt_logprobs) - 1 - start  # a recomputed prefix (preemption) has them
            if known >= n:
                continue
            picked = block.gather(1, torch.tensor(targets, device=block.device).view(-1, 1))
            ranks = ((block > picked).sum(dim=1) + 1).tolist()
            chosen = picked.view(-1).tolist()
            tops = torch.topk(block, k) if k > 0 else None
            for j in range(max(0, known), n):
                top = dict(zip(tops.indices[j].tolist(), tops.values[j].tolist())) if tops is not None else {}
                req.prompt_logprobs.append(Logprob(targets[j], chosen[j], top, ranks[j]))

    @staticmethod
    def _computed(plan: SchedulerOutput, starts: list[int], verdicts: list[Verdict]) -> list[Computed]:
        """Per chunk, the positions the step computed (a window: its accepted prefix)."""
        rows, row, accepted = [], 0, iter(verdicts)
        for c, start in zip(plan.chunks, starts):
            count = next(accepted).num_accepted + 1 if c.drafts else c.num_tokens
            rows.append(Computed(c.req, start, count, row, c.sample))
            row += c.num_tokens
        return rows

    def _finish_windows(
        self, windows: list[ScheduledChunk], verdicts: list[Verdict], now: float
    ) -> list[RequestOutput]:
        """Append each window's accepted tokens, then commit the state after the last accepted
        position to the working slot and advance the request past it.

        A request that stops inside its window (stop token, length) is released with its slot
        and computed length as they were before the window: consistent, only a few tokens
        short for the prefix cache."""
        assert self.spec is not None
        outputs: list[RequestOutput] = []
        commits = []
        for row, (c, v) in enumerate(zip(windows, verdicts)):
            req = c.req
            req.num_draft_tokens += len(c.drafts)
            req.num_accepted_tokens += v.num_accepted
            self.counters["spec_draft_tokens_total"] += len(c.drafts)
            self.counters["spec_accepted_tokens_total"] += v.num_accepted
            self.counters["spec_windows_total"] += 1
            for tok, lp in zip(v.tokens, v.logprobs):
                self._append_token(req, tok, lp, now)
                if req.finished:
                    break
            if not req.finished:
                commits.append((req, row, v.num_accepted))
            self._emit(outputs, req)
        window, ps = self.spec.window, self.config.page_size
        for req, row, accepted in commits:
            # A page boundary crossed inside the window: the prefix cache sees the (accepted)
            # state there, as it would have in plain decoding.
            old = req.num_computed_tokens
            for pos in range(old - old % ps + ps, old + accepted + 1, ps):
                assert req.slot is not None
                window.commit([req.slot], [row], [pos - old - 1])
                req.num_computed_tokens = pos
                self.prefix_cache.on_computed(req, prefill=False)
            req.num_computed_tokens = old
        window.commit(
            [r.slot or 0 for r, _, _ in commits], [row for _, row, _ in commits], [a for _, _, a in commits]
        )
        for req, _, accepted in commits:
            req.num_computed_tokens += accepted + 1
            self.prefix_cache.on_computed(req, prefill=False)
        return outputs

    def _batch(self, plan: SchedulerOutput):
        chunks = plan.chunks

        def tokens(c: ScheduledChunk) -> list[int]:
            start = c.req.num_computed_tokens
            end = start + c.num_tokens - len(c.drafts)
            toks = c.req.token_slice(start, end)
            if len(toks) < end - start:  # overlap: a placeholder, filled on the device
                toks = toks + [0] * (end - start - len(toks))
            return toks + c.drafts

        pages = [c.req.pages for c in chunks]
        slots = [c.req.slot or 0 for c in chunks]
        table = self.runner.decode_page_table(len(chunks), plan.num_decodes)
        if table is not None:  # a decode graph reads the device's table: send what changed
            table.update(slots, pages)
        return build_forward_batch(
            token_lists=[tokens(c) for c in chunks],
            starts=[c.req.num_computed_tokens for c in chunks],
            pages=pages,
            slots=slots,
            has_initial=[c.req.num_computed_tokens > 0 or c.req.has_initial_state for c in chunks],
            sample_mask=[c.sample for c in chunks],
            num_decodes=plan.num_decodes,
            page_size=self.config.page_size,
            device=self.device,
            num_verify=plan.num_verify,
            page_table=table is None,
            prompt_rows=[self._prompt_rows(c.req, c.req.num_computed_tokens, c.num_tokens) for c in chunks]
            if any(c.req.params.prompt_logprobs is not None for c in chunks)
            else None,
        )

    def _append_token(self, req: Request, tok: int, lp: Any, now: float) -> None:
        self._record_token(req, tok, lp, now)
        self._check_token(req, tok)

    def _record_token(self, req: Request, tok: int, lp: Any, now: float) -> None:
        if req.error is not None:  # sampled from logits its processing could not touch: not its token
            return
        if req.first_token_time is None:
            req.first_token_time = now
        req.output_token_ids.append(tok)
        self.counters["generation_tokens_total"] += 1
        if req.matcher is not None and not req.matcher.accept(tok):
            req.matcher = None  # cannot happen under the mask; never feed a broken state again
            req.grammar_broken = True
        if lp is not None and req.logprobs is not None:
            req.logprobs.append(lp)
            req.cumulative_logprob += lp.logprob

    def _check_token(self, req: Request, tok: int) -> None:
        """Detokenize the newest token and apply the stop conditions. A request whose own part of
        the step failed (`Request.error`, or an exception here) finishes with "error" alone."""
        verdict = None
        if req.error is None:
            try:
                checked = req.detokenizer.length
                req.detokenizer.append(tok)
                verdict = check_stop(req, tok, self.eos_token_ids, self.max_model_len, checked)
            except Exception as exc:
                logger.exception("detokenizing or stop checks failed for request %s", req.request_id)
                req.error = f"stop checks failed ({type(exc).__name__})"
        if req.error is not None:
            verdict = ("error", None)
        elif verdict is None and (req.grammar_broken or (req.matcher is not None and req.matcher.terminated)):
            verdict = ("stop", None)  # the grammar is complete (its stop token accepted)
        if verdict is not None:
            self._finish(req, *verdict)

    def _finish(self, req: Request, reason: str, stop_reason: int | str | None) -> None:
        # a matched stop string already cut the text; a failed request's text is not trusted
        if not isinstance(stop_reason, str) and reason != "error":
            req.detokenizer.flush()
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.num_placeholders = 0  # overlap: the token sampled after the stop is dropped
        self.scheduler.finish(req)
        self.requests.pop(req.request_id, None)

    def _emit(self, outputs: list[RequestOutput], req: Request) -> None:
        """A step's output for the request (`output_kind`): every step, every step that added
        tokens, or only the last."""
        kind = req.params.output_kind
        if (
            req.finish_reason is not None
            or kind == "cumulative"
            or (kind == "delta" and len(req.output_token_ids) > req.num_sent_tokens)
        ):
            outputs.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput:
        delta = req.params.output_kind == "delta"
        n_tokens = len(req.output_token_ids)
        if delta:  # only what is new: the cost does not grow with the output
            start, chars = req.num_sent_tokens, visible_length(req)
            token_ids = req.output_token_ids[start:]
            text = req.detokenizer.slice(req.num_sent_chars, chars)
            logprobs = req.logprobs[start:] if req.logprobs is not None else None
            req.num_sent_tokens, req.num_sent_chars = n_tokens, chars
        else:
            token_ids = list(req.output_token_ids)
            text = visible_text(req)
            logprobs = list(req.logprobs) if req.logprobs is not None else None
        comp = CompletionOutput(
            index=0,
            token_ids=token_ids,
            text=text,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=req.cumulative_logprob,
            num_tokens=n_tokens,
            error=req.error,
        )
        prompt_logprobs = None
        whole = req.prompt_logprobs is not None and len(req.prompt_logprobs) == len(req.prompt_token_ids)
        if whole and not (delta and req.prompt_logprobs_sent):
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=req.finish_reason is not None,
            num_cached_tokens=req.num_cached_tokens,
            arrival_time=req.arrival_time,
            first_token_time=req.first_token_time,
            num_draft_tokens=req.num_draft_tokens,
            num_accepted_tokens=req.num_accepted_tokens,
            delta=delta,
            prompt_logprobs=prompt_logprobs,
        )

    # -- introspection ----------------------------------------------------------------

    def flush_cache(self) -> None:
        """Drop every cached page and snapshot that no running request uses."""
        self.prefix_cache.flush()

    def stats(self) -> dict[str, Any]:
        kv, st = self.runner.kv_pool, self.runner.state_pool
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            # Cached pages that no request uses are as good as free: they are evicted on demand.
            "kv_pages_used": kv.num_used - self.prefix_cache.num_evictable_pages,
            "kv_pages_total": kv.capacity,
            "state_slots_used": st.num_used,
            "state_slots_total": st.num_working,
            "snapshots_used": st.num_snapshots_used,
            "snapshots_total": st.num_snapshots,
            **self.prefix_cache.stats(),
            **self.counters,
        }


__all__ = ["Engine", "EngineConfig", "SamplingParams", "Status"]
