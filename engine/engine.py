"""The engine's loop: add requests, step, get outputs.

A step schedules a plan (`Scheduler`), builds its batch (`step_batch.py`), runs the model
(`ModelRunner`), samples (`Sampler`) and hands each token to its request (`TokenSink`), which
finishes the requests that stop and builds the step's outputs. With overlap scheduling
(`overlap.py`) a step is launched before the previous step's tokens are read back; with
speculative decoding (`spec_decode/`) verification windows ride in the same batch and their
accepted tokens are committed after it (`spec_decode/commit.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.errors import EngineDeadError, InvalidParamError
from deltaserve.engine.parts import build_loop_parts, build_model_parts
from deltaserve.engine.requests.outputs import RequestOutput
from deltaserve.engine.requests.request import Request, Status
from deltaserve.engine.requests.sampling_params import SamplingParams, StructuredOutputs
from deltaserve.engine.runner.forward_batch import ForwardBatch
from deltaserve.engine.runner.model_runner import ModelRunner
from deltaserve.engine.spec_decode import Verdict
from deltaserve.engine.spec_decode.commit import computed_rows, finish_windows
from deltaserve.engine.step.overlap import Overlap, can_overlap
from deltaserve.engine.step.prompt_logprobs import record_prompt_logprobs
from deltaserve.engine.step.scheduler import SchedulerOutput
from deltaserve.engine.step.step_batch import build_step_batch
from deltaserve.kernels.dispatch import use_fast_path
from deltaserve.models.vision.positions import ImageInputs, expand_image_tokens

if TYPE_CHECKING:
    from deltaserve.engine.parallel.ranks import Ranks

logger = logging.getLogger(__name__)


def warm_up_step_tokens(step_tokens: int) -> list[int]:
    """The sizes of the warm-up's prefill steps: each power of two up to the step budget, and the
    budget. Our kernels compile a variant per class of step sizes, a class bounded by powers of two
    of the tokens or of the MoE assignments (k a token: tile and sort widths, the MoE paths'
    limits) or by the budget, so that each class holds one of these
    (tests/kernels/test_triton_variants.py)."""
    sizes = [1 << j for j in range(step_tokens.bit_length())]
    return sizes if sizes[-1] == step_tokens else [*sizes, step_tokens]


# paged decode's split count stops growing at this context (64 splits of 64 positions)
WARM_UP_DECODE_CONTEXT = 4096


def warm_up_decode_rows(num_running: int, captured: int = 0) -> list[int]:
    """The row counts of the warm-up's decode steps beside a long context, `captured` the largest
    decode graph's rows (0: none). Eager: each up to 16, then each power of two, and
    `num_running`. Decode kernels pick their tiles by the rows and the longest context (GDN
    decode's value tile, paged decode's key tile): steps of these rows beside a context of
    `WARM_UP_DECODE_CONTEXT` meet each variant that steps of 1 to `num_running` rows ask for.
    With decode graphs, where decode rows run eagerly beside prompts and verification windows,
    and in steps of more rows than `captured` (the graphs' own kernels compiled at capture, with
    PDL up to 32 tokens, which eager steps do not use): 1, `num_running` - 1 and `num_running`,
    the prompts joining beside one decode row and beside `num_running` - 1 (as the windows, which
    follow the last count), GDN decode's narrow and wide tiles (it picks by the rows alone), and
    `captured` + 1, the fewest rows a step past the graphs runs, where paged decode splits a long
    context most (its merge; tests/kernels/test_triton_variants.py)."""
    if captured:
        past = {captured + 1} if captured < num_running else set()
        return sorted({1, max(1, num_running - 1), num_running} | past)
    rows = {n for n in range(1, 17)} | {1 << j for j in range(num_running.bit_length())} | {num_running}
    return sorted(n for n in rows if n <= num_running)


def warm_up_short_decode_rows(num_running: int, captured: int) -> list[int]:
    """The row counts of the warm-up's decode steps of short contexts only (prompts of 8 tokens),
    after those of `warm_up_decode_rows`: with decode graphs of up to `captured` rows, a step of
    `captured` + 1. Beside a long context paged decode splits each row's positions until its grid
    fills the SMs twice over (its 32-key tile, and the merge); at short contexts a row is one
    split, and a grid of at most two programs an SM takes its 64-key tile."""
    return [captured + 1] if 0 < captured < num_running else []


class Engine:
    """With `tensor_parallel_size` > 1 this process is rank 0: it starts this node's other ranks
    (`engine/parallel/ranks.py`), drives them through its ModelRunner, and is dead (`dead_reason`,
    every step an EngineDeadError) once one of them is gone, when `on_worker_lost(why)` is also
    called, from the thread that watches them. `shutdown` stops them."""

    def __init__(self, config: EngineConfig, on_worker_lost: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.dead_reason: str | None = None
        self._on_worker_lost = on_worker_lost
        self.ranks: Ranks | None = None
        self.device = torch.device(config.device or "cpu")
        from deltaserve.models.checkpoints.loader import check_checkpoint

        # what the checkpoint cannot serve fails here, from its config and headers, not once the
        # weights (and every tensor-parallel rank) are loading
        check_checkpoint(config)
        if config.tensor_parallel_size > 1:
            from deltaserve.engine.parallel.ranks import Ranks

            # the ranks (and the thread that watches them) hold this engine weakly, so that an
            # engine dropped without `shutdown` (`del llm`) is collected and its workers stopped
            this = weakref.ref(self)

            def lost(why: str) -> None:
                engine = this()
                if engine is not None:
                    engine._worker_lost(why)

            self.ranks = Ranks(config, lost)
            weakref.finalize(self, self.ranks.stop, None, False)
            self.device = self.ranks.device
        elif self.device.type == "cuda" and self.device.index is not None:
            # Triton launches and graph captures take the current device: it must be ours (a
            # data-parallel replica on cuda:1, --device cuda:N)
            torch.cuda.set_device(self.device)
        try:
            self._build(config)
        except BaseException as exc:
            gone = self.ranks.exited() if self.ranks is not None else None
            self.shutdown(graceful=False)
            if gone is not None:
                raise RuntimeError(f"{gone} while the engine started (its log says why)") from exc
            raise
        if self.ranks is not None:
            self.ranks.watch()

    def _worker_lost(self, why: str) -> None:
        if self.dead_reason is not None:  # the first reason: a silent worker's kill follows it
            return
        self.dead_reason = f"the engine lost a worker: {why}"
        logger.error("%s", self.dead_reason)
        if self._on_worker_lost is not None:
            self._on_worker_lost(why)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the other tensor-parallel ranks (told to stop, killed if they do not) and leave
        the process group; nothing to do on one device. Idempotent."""
        runner: ModelRunner | None = getattr(self, "runner", None)
        if self.ranks is not None:
            alive = runner is not None and self.dead_reason is None
            self.ranks.stop(runner.channel if alive and runner is not None else None, graceful)

    def _build(self, config: EngineConfig) -> None:
        model = build_model_parts(config, self.device, self.ranks.groups if self.ranks is not None else None)
        self.model_config = model.model_config
        self.vocab_size = model.vocab_size
        self.tokenizer = model.tokenizer
        self.eos_token_ids = model.eos_token_ids
        self.runner = model.runner
        self.max_model_len = model.max_model_len
        self.sampler = model.sampler
        self.grammars = model.grammars
        self.admission = model.admission
        self.overlap = model.overlap
        self.model_info = model.model_info
        self._staged_path: str | None = None  # a checkpoint staged, until finish_weights
        self.image_processor = model.image_processor
        self._model_parts = model
        self.requests: dict[str, Request] = {}
        self._finished_outputs: list[Any] = []  # aborts, sent with the next step's outputs
        self._new_loop_parts()
        if config.warmup:
            self._warm_up()

    def _new_loop_parts(self, config: EngineConfig | None = None) -> None:
        loop = build_loop_parts(config or self.config, self._model_parts, self.requests)
        self.prefix_cache = loop.prefix_cache
        self.spec = loop.spec
        self.scheduler = loop.scheduler
        self.counters = loop.counters
        self.sink = loop.sink
        # the previous plan's time and kind: the step timeline (debug log) and the scheduler's
        # measure of what a prefill step costs; None after a step with nothing to run
        self._last_plan: tuple[float, int] | None = None  # (when, prefill tokens)
        # where the loop's time goes (stats): seconds inside `step`, and the GPU waits among them
        self.step_s, self._wait_base = 0.0, self.read_back_wait_s

    def _warm_up(self) -> None:
        """Run a few prompts of mixed lengths through mixed steps once before serving: the first
        prefill of each shape compiles and autotunes its Triton / FLA kernels (seconds), which
        would otherwise stall every stream of the first requests. Where the fast kernels run,
        decode steps of `warm_up_decode_rows` (with speculative decoding, then a verification
        window of each width) and a prefill step of each size of `warm_up_step_tokens` follow.
        Then the engine is as new:
        an empty prefix cache with fresh statistics, counters at zero, pools idle."""
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
        sizes: list[int] = []
        rows: list[int] = []
        short: list[int] = []
        widths: list[int] = []
        if use_fast_path(torch.empty(0, device=self.device)):  # the CPU's references compile nothing
            spec, graphs = self.config.spec, self.runner.graph_runner
            captured = graphs.sizes[-1] if graphs is not None else 0
            rows, widths = self._warm_up_decode_rows(
                warm_up_decode_rows(self.config.num_running, captured),
                spec.num_speculative_tokens if spec is not None else 0,
            )
            short, _ = self._warm_up_decode_rows(
                warm_up_short_decode_rows(self.config.num_running, captured), 0, 8
            )
            sizes = self._warm_up_step_sizes(warm_up_step_tokens(self.config.step_tokens))
        self._new_loop_parts()
        then = f", decode steps of {', '.join(map(str, rows))} rows" if rows else ""
        then += f", of {', '.join(map(str, short))} rows of short contexts" if short else ""
        then += f", verification windows of {', '.join(map(str, widths))} tokens" if widths else ""
        then += f", then prefill steps of {', '.join(map(str, sizes))} tokens" if sizes else ""
        logger.info("warmed up the kernels in %.1f s (mixed steps%s)", time.perf_counter() - t0, then)

    def _warm_up_decode_rows(
        self, rows: list[int], k: int = 0, context: int = WARM_UP_DECODE_CONTEXT
    ) -> tuple[list[int], list[int]]:
        """A decode step of each of `rows` requests: requests join (without a prefix cache, a
        prefill delay or drafts) until that many decode, the first one's prompt `context` tokens
        (half the model's length at most) and the others' 8 (fewer where `context` is). With
        `k` drafts, after the last count's decode step, the first request verifies a window of each
        width, 2 to k + 1 tokens, beside the others' decode rows: the window kernels compile a
        variant per width (the step's widest), which serving meets near a request's end, where
        fewer drafts fit, or as a drafter's proposals fall out. All are aborted at the end. Where
        the pools take no more requests at once, the larger counts are left out; returns the
        counts and the widths that ran."""
        config = dataclasses.replace(
            self.config,
            cache_type="naive",
            max_prefill_delay_steps=0,
            adaptive_prefill_delay=False,
            hold_prefill_tails=False,
        )
        self._new_loop_parts(config)
        self.scheduler.propose = None
        longest = max(1, min(context, self.max_model_len // 2))
        added = 0
        ran: list[int] = []
        for n in rows:
            while len(self.requests) < n:
                length = longest if added == 0 else min(8, longest)
                ids = [(7 * j + added) % self.vocab_size for j in range(length)]
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=self.max_model_len - length,
                    ignore_eos=True,
                    output_kind="final_only",
                )
                self.add_request(f"deltaserve-warmup-decode-{added}", ids, params)
                added += 1
            live = list(self.requests.values())
            # the prompts' chunks, and a few steps more: a request the pools cannot admit would wait
            # for another to finish, thousands of tokens later
            steps = -(-(longest + 8 * n) // self.config.chunk_size) + 4
            for _ in range(steps):
                if not any(r.num_computed_tokens < len(r.prompt_token_ids) for r in live):
                    break
                self.step()
            else:
                break
            self.step()  # all of them decode
            ran.append(n)
        widths: list[int] = []
        first, spec = self.requests.get("deltaserve-warmup-decode-0"), self.spec
        for n in range(1, k + 1):
            if first is None or first.finished or spec is None:
                break
            # any token is a valid draft: verification accepts it only where the model agrees
            self.scheduler.propose = lambda r, n=n: (
                [r.all_token_ids[-1]] * min(n, spec.room(r)) if r is first else []
            )
            drafted = first.num_draft_tokens
            self.step()
            if first.num_draft_tokens > drafted:  # fewer where the pages or the step's budget ran out
                widths.append(first.num_draft_tokens - drafted + 1)
        for request_id in list(self.requests):
            self.abort_request(request_id)
        while self.has_unfinished_requests():
            self.step()
        self._finished_outputs.clear()
        return ran, widths

    def _warm_up_step_sizes(self, sizes: list[int]) -> list[int]:
        """A prefill step of each of `sizes` tokens: prompts of a chunk at most, one sampled token
        each, without a prefix cache (the radix cache ends a prompt's chunk short of its end). A
        size that would take more prompts than run at once is left out; returns those that ran."""
        self._new_loop_parts(dataclasses.replace(self.config, cache_type="naive"))
        longest = min(self.config.chunk_size, self.max_model_len - 1)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind="final_only")
        ran = []
        for size in sizes:
            lengths = [min(longest, size - start) for start in range(0, size, longest)]
            if len(lengths) > self.config.num_running:
                continue
            for k, n in enumerate(lengths):
                ids = [(7 * j + k) % self.vocab_size for j in range(n)]
                self.add_request(f"deltaserve-warmup-{size}-{k}", ids, params)
            while self.has_unfinished_requests():
                self.step()
            ran.append(size)
        return ran

    # -- requests ---------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: ImageInputs | None = None,
    ) -> None:
        """Queue a request; a ValueError (bad input) or QueueFullError leaves nothing behind.
        `images`: the prompt's (`models/vision/processor.py`), their tokens in the prompt already;
        the vision tower runs on them here, once."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        running, waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        req = self.admission.build(request_id, prompt_token_ids, params, running, waiting, images)
        if req.images is not None:
            req.images.embeds = self.runner.encode_images(req.images.inputs)
        self.requests[request_id] = req
        self.scheduler.add(req)
        if not params.internal:
            self.counters["prompt_tokens_total"] += len(req.prompt_token_ids)

    def process_images(self, images: list[Any]) -> ImageInputs:
        """PIL images as the vision tower reads them; an InvalidParamError where the model reads
        text only, a ValueError for an image it cannot take."""
        if self.image_processor is None:
            raise InvalidParamError(f"the prompt has images, but {self.admission.images.refusal}", "messages")
        return self.image_processor(images)

    def expand_image_tokens(self, prompt_token_ids: list[int], images: ImageInputs) -> list[int]:
        """The prompt with each image's one placeholder token repeated to the image's tokens
        (kept as given when they are already)."""
        assert self.image_processor is not None and self.admission.images.image_token_id is not None
        sizes = self.image_processor.num_tokens(images)
        if prompt_token_ids.count(self.admission.images.image_token_id) == sum(sizes):
            return prompt_token_ids
        return expand_image_tokens(prompt_token_ids, self.admission.images.image_token_id, sizes)

    def emit_packed_outputs(self) -> None:
        """From now on, hand back each step's outputs packed (`requests.outputs.pack_outputs`'
        tuples, without the prompts' ids), as the engine process sends them to its HTTP processes:
        no RequestOutput objects built only to be taken apart again."""
        self.sink.packed = True

    def abort_request(self, request_id: str) -> None:
        out = self.sink.abort(request_id)
        if out is not None:
            self._finished_outputs.append(out)

    def compile_structured(self, spec: StructuredOutputs) -> Future[Any] | None:
        """Compile `spec`'s grammar into the cache now (ValueError for a bad schema or a missing
        xgrammar), so that admitting the request does not compile it on the engine's thread. When
        another call is compiling the same grammar: that compile's Future (its caller waits on it
        instead of holding a thread)."""
        return self.admission.compile_structured(spec)

    def set_tokenizer(self, tokenizer: Any) -> None:
        """Encode and decode with `tokenizer` from now on (vLLM's `LLM.set_tokenizer`): requests
        admitted after this get their text, stop strings and structured outputs' vocabulary from
        it; the stop token ids stay the checkpoint's."""
        self.tokenizer = tokenizer
        self._model_parts.tokenizer = tokenizer
        self.admission.tokenizer = tokenizer
        self.grammars.reset(tokenizer)

    def prepare_grammars(self) -> None:
        """Build structured outputs' view of the vocabulary now (xgrammar's TokenizerInfo, a
        pass over the whole vocabulary) instead of at the first JSON request, which would spend
        it on the engine's thread while every stream waits. The server calls this in a thread
        at start-up. Without xgrammar or a tokenizer it does nothing (the first such request
        then gets the 400 that says why)."""
        try:
            self.grammars.get()
        except ValueError:
            pass

    def has_unfinished_requests(self) -> bool:
        in_flight = self.overlap is not None and self.overlap.in_flight is not None
        return self.scheduler.has_unfinished() or in_flight

    # -- stepping ---------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        start = time.perf_counter()
        try:
            if self.overlap is not None:
                return self._step_overlapped(self.overlap)
            return self._step_sync()
        except EngineDeadError as exc:
            self._died(exc)
        finally:
            self.step_s += time.perf_counter() - start

    def heartbeat(self) -> None:
        """With tensor parallelism, while idle (the engine process's loop calls it between steps):
        a no-op message to the workers once a second, so that a rank that died while nothing ran
        (on another node: no thread here watches it) ends the engine now, not at the next
        request. EngineDeadError when one is gone; nothing to do on one device."""
        if self.ranks is None or self.dead_reason is not None or self.runner.channel is None:
            return
        try:
            self.runner.channel.beat()
        except EngineDeadError as exc:
            self._died(exc)

    def _died(self, exc: EngineDeadError) -> NoReturn:
        if self.dead_reason is None:
            # a local worker's death reaches the collectives first: name it when it is one
            gone = self.ranks.exited(wait_s=1.0) if self.ranks is not None else None
            self.dead_reason = f"the engine lost a worker: {gone}" if gone else str(exc)
        raise EngineDeadError(self.dead_reason) from exc

    def _step_sync(self) -> list[RequestOutput]:
        outputs = self._take_finished()
        plan = self.scheduler.schedule()
        if plan is None:
            self._last_plan = None
            return outputs
        self._count_plan(plan)
        starts = [c.req.num_computed_tokens for c in plan.chunks]
        logits = self._forward(plan, starts)
        sampled = [c.req for c in plan.chunks if c.sample and not c.drafts]
        self.scheduler.advance(plan)
        logits, verdicts = self._verify(plan, logits)
        now = time.time()
        outputs += self._sample(sampled, logits, now)
        if plan.verify_chunks:
            assert self.spec is not None
            ps = self.config.page_size
            outputs += finish_windows(
                plan.verify_chunks, verdicts, now, self.sink, self.spec.window, self.prefix_cache, ps
            )
        if self.spec is not None and self.spec.mtp is not None:
            self.spec.after_step(computed_rows(plan, starts, verdicts))
        return outputs

    def _step_overlapped(self, overlap: Overlap) -> list[RequestOutput]:
        prev = overlap.in_flight
        if not self._can_overlap(prev is not None):
            return self.drain() + self._step_sync()
        outputs = self._take_finished()
        plan = self.scheduler.schedule()
        if plan is None:
            self._last_plan = None
            return outputs + self.drain()
        self._count_plan(plan)
        batch = self._batch(plan)
        if prev is not None:
            overlap.fill_placeholders(batch, plan, prev)
        logits = self.runner.forward(batch)
        sampled = [c.req for c in plan.chunks if c.sample]
        launched = overlap.launch(sampled, logits) if sampled else None
        for req in sampled:
            req.num_placeholders += 1
        read = overlap.read_back(prev, self.sink) if prev is not None else []
        # the plan's inputs are all known now: the cache may see them as computed
        self.scheduler.advance(plan)
        outputs += self._check_read(read)
        overlap.hold(launched)
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Finish the step in flight (overlap scheduling), if any: read its tokens back and run
        their stop checks; its outputs are returned. The next `step` starts with nothing in flight."""
        prev = self.overlap.take() if self.overlap is not None else None
        if prev is None:
            return []
        assert self.overlap is not None
        outputs = self._take_finished()
        return outputs + self._check_read(self.overlap.read_back(prev, self.sink))

    # -- the steps' parts ---------------------------------------------------------------

    def _take_finished(self) -> list[RequestOutput]:
        outputs, self._finished_outputs = self._finished_outputs, []
        return outputs

    def _count_plan(self, plan: SchedulerOutput) -> None:
        """The step's part of the counters; at debug level, a log line of the step (what it runs,
        and the time since the step before: a timeline of the engine)."""
        self.counters["preemptions_total"] += len(plan.preempted)
        for req in plan.admitted:
            if req.params.internal:
                continue
            if req.num_preemptions == 0:
                self.counters["cached_tokens_total"] += req.num_cached_tokens
            # counted as it is admitted: what the cache left to prefill (a prompt's last token may
            # run as a decode, so the prefill chunks alone would miss it)
            self.counters["prefill_tokens_total"] += req.num_pending
        now = time.perf_counter()
        prefills = plan.chunks[plan.num_decodes + plan.num_verify :]
        tokens = sum(c.num_tokens for c in prefills)
        since = None
        if self._last_plan is not None:
            since = now - self._last_plan[0]
            self.scheduler.step_cost.record(self._last_plan[1] > 0, since, self._last_plan[1])
        self._last_plan = (now, tokens)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step: %d decodes, %d verifications, %d prefill chunks of %d tokens; %s since the last",
                plan.num_decodes,
                plan.num_verify,
                len(prefills),
                tokens,
                "-" if since is None else f"{1e3 * since:.2f} ms",
            )

    def _batch(self, plan: SchedulerOutput) -> ForwardBatch:
        return build_step_batch(plan, self.runner, self.config.page_size, self.device)

    def _forward(self, plan: SchedulerOutput, starts: list[int]) -> torch.Tensor:
        """The logits of the plan's sampled positions; prompt log-probabilities recorded."""
        batch = self._batch(plan)
        logits = self.runner.forward(batch)
        n = batch.num_prompt_logits
        if n:
            record_prompt_logprobs(plan, starts, logits[-n:])
            logits = logits[:-n]
        return logits

    def _verify(self, plan: SchedulerOutput, logits: torch.Tensor) -> tuple[torch.Tensor, list[Verdict]]:
        """The verification windows' verdicts, and the logits without their rows."""
        windows = plan.verify_chunks
        if not windows:
            return logits, []
        assert self.spec is not None
        lo, hi = plan.num_decodes, plan.num_decodes + sum(c.num_tokens for c in windows)
        verdicts = self.spec.verify(logits[lo:hi], [c.req for c in windows], [c.drafts for c in windows])
        return torch.cat([logits[:lo], logits[hi:]]), verdicts

    def _sample(self, sampled: list[Request], logits: torch.Tensor, now: float) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if not sampled:
            return outputs
        tokens, logprobs = self.sampler.sample(logits, sampled)
        for req, tok, lp in zip(sampled, tokens, logprobs):
            if req.params.max_tokens == 0:  # only the prompt's log-probabilities were asked for
                self.sink.finish(req, "length", None)
            else:
                self.sink.append(req, tok, lp, now)
            self.sink.emit(outputs, req)
        return outputs

    def _check_read(self, read: list[tuple[Request, int]]) -> list[RequestOutput]:
        """Stop checks and outputs of the tokens a read-back recorded."""
        outputs: list[RequestOutput] = []
        for req, tok in read:
            self.sink.check(req, tok)
            self.sink.emit(outputs, req)
        return outputs

    def _can_overlap(self, in_flight: bool) -> bool:
        if self.spec is not None:
            return False
        free = self.runner.kv_pool.num_free + self.prefix_cache.num_evictable_pages
        return can_overlap(
            self.sampler,
            self.requests.values(),
            self.scheduler.running,
            self.config.page_size,
            free,
            in_flight,
        )

    # -- introspection ----------------------------------------------------------------

    @property
    def read_back_wait_s(self) -> float:
        """Overlap scheduling: seconds the host has waited for steps' tokens (`Overlap`)."""
        return self.overlap.read_back_wait_s if self.overlap is not None else 0.0

    def tensor_parallel_digests(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's device-state digest (`ModelRunner.state_digest`), rank 0's first: a check
        that the workers replayed each write of rank 0."""
        return self.runner.rank_digests()

    def flush_cache(self) -> None:
        """Drop every cached page and snapshot that no running request uses."""
        self.prefix_cache.flush()

    def update_weights_from_disk(
        self, model_path: str, load_format: str = "auto", weight_version: str | None = None
    ) -> None:
        """Serve the weights of another checkpoint of the same model from now on (SGLang's
        update_weights_from_disk), labelled `weight_version` where given, and drop the prefix
        cache, which the old weights computed. It needs the engine idle (the server holds new
        requests and lets the running finish); ValueError, with nothing changed, for a checkpoint
        of another model."""
        error = self.stage_weights(model_path, load_format)
        self.finish_weights(error is None, weight_version)
        if error is not None:
            raise ValueError(error)

    def stage_weights(self, model_path: str, load_format: str = "auto") -> str | None:
        """`update_weights_from_disk`'s first half, on every tensor-parallel rank: the checkpoint
        loaded and checked, nothing changed yet; why it cannot be served, or None. Data-parallel
        replicas all stage before any commits (the server's update). `finish_weights` must
        follow before anything else runs."""
        if self.has_unfinished_requests():
            raise RuntimeError("the weights change only between requests: requests are running")
        if load_format not in ("auto", "dummy"):
            return f"unknown load format {load_format!r}; use 'auto' or 'dummy'"
        error = self.runner.stage_weights(model_path, load_format)
        self._staged_path = None if error is not None else str(model_path)
        return error

    def finish_weights(self, commit: bool, weight_version: str | None = None) -> None:
        """Serve the staged weights (and drop the prefix cache, which the old ones computed), or
        drop them."""
        path, self._staged_path = self._staged_path, None
        self.runner.finish_weights(commit and path is not None)
        if not commit or path is None:
            return
        self.flush_cache()
        self.model_info["model"] = path  # what /get_model_info reports, as SGLang does
        if weight_version is not None:
            self.set_weight_version(weight_version)
        logger.info("now serving the weights of %s", path)

    def set_weight_version(self, version: str) -> None:
        """Label the weights served (SGLang's weight_version), as /get_model_info reports it."""
        self.model_info["weight_version"] = str(version)

    def count_generated(self, count: int) -> None:
        """Tokens a caller returned that no counted request generated (a beam search's beams
        past its first step, whose requests run `internal`)."""
        self.counters["generation_tokens_total"] += max(0, count)

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
            **(self._hold_stats() if self.config.adaptive_prefill_delay else {}),
            "step_seconds_total": self.step_s,
            # overlap scheduling: the host waiting for a step's tokens (without it, a step's wait
            # for the GPU is inside its sampling, counted as step time only)
            "gpu_wait_seconds_total": self.read_back_wait_s - self._wait_base,
        }

    def _hold_stats(self) -> dict[str, float]:
        """What the adaptive prefill delay weighs: a prefill step's cost beyond a decode step
        (fixed, and per prefill token) and the arrival rate."""
        cost = self.scheduler.step_cost
        return {
            "prefill_step_fixed_ms": 1e3 * cost.fixed_s,
            "prefill_step_us_per_token": 1e6 * cost.per_token_s,
            "arrivals_per_s": self.scheduler.arrivals.rate(time.monotonic()),
        }


__all__ = ["Engine", "EngineConfig", "SamplingParams", "Status"]
