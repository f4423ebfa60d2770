"""Host (CPU) time of one decode step outside the forward pass and the sampler.

The model's forward is replaced by a constant logits tensor, and the sampler is timed
apart, so what remains is the scheduler, batch building, token bookkeeping,
detokenization, stop checks and outputs: the part of a step that CUDA graphs cannot hide.

    python -m bench.engine.host_overhead --batch 256 --prompt-len 512 --steps 50 [--profile]

`--profile` prints the functions that take the host's time (cProfile: its own overhead makes
the reported total larger than without it).
"""

from __future__ import annotations

import argparse
import json
import pickle
import time

import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.gc_heap import freeze_startup_heap
from deltaserve.engine.requests.outputs import pack_outputs
from deltaserve.engine.requests.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: the built-in tiny model)")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--cache-type", default="radix", choices=["radix", "naive"])
    ap.add_argument(
        "--output-kind",
        default="cumulative",
        choices=["cumulative", "delta", "final_only"],
        help="cumulative: an output per request per step (streaming); final_only: LLM.generate, non-streamed HTTP",
    )
    ap.add_argument(
        "--no-detokenize",
        action="store_true",
        help="the engine makes no text (a server's streams: their HTTP process detokenizes)",
    )
    ap.add_argument(
        "--stream-interval", type=int, default=1, help="the engine's stream_interval (delta outputs)"
    )
    ap.add_argument("--profile", action="store_true", help="print the functions that take the most host time")
    ap.add_argument(
        "--send",
        choices=["none", "packed", "objects"],
        default="none",
        help="what the server's engine process does with a step's outputs, timed with the step: "
        "packed: the step builds them as the tuples it sends, then they are pickled (engine/core.py); "
        "objects: RequestOutputs, then pack_outputs, then pickled (how it did before)",
    )
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="overlap scheduling's step (the CUDA default; on CPU its device copies are synchronous)",
    )
    args = ap.parse_args()
    if args.model is None:
        from deltaserve.models.checkpoints.builtin import builtin_model_path

        args.model = builtin_model_path()
    engine = Engine(
        EngineConfig(
            model=args.model,
            device="cpu",
            cache_type=args.cache_type,
            max_running_requests=args.batch,
            chunked_prefill_size=8192,
            max_model_len=args.prompt_len + args.steps + 64,
            enable_overlap_schedule=args.overlap,
            stream_interval=args.stream_interval,
        )
    )
    vocab = engine.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.steps + 8,
        ignore_eos=True,
        output_kind=args.output_kind,
        detokenize=not args.no_detokenize,
    )
    for i in range(args.batch):
        engine.add_request(
            str(i), torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(), params
        )
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    freeze_startup_heap("bench")  # as the engine process does once it is up
    logits = torch.zeros(args.batch, vocab)
    engine.runner.forward = lambda batch: logits[: batch.logits_indices.shape[0]]  # type: ignore[method-assign]
    spent = [0.0]

    def timed(fn):
        def wrapper(lg, reqs):
            t = time.perf_counter()
            out = fn(lg, reqs)
            spent[0] += time.perf_counter() - t
            return out

        return wrapper

    # the sampler's argmax over the vocabulary is the GPU's work there: timed apart (both
    # synchronous and overlapped steps sample through sample_tokens)
    engine.sampler.sample_tokens = timed(engine.sampler.sample_tokens)  # type: ignore[method-assign]
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    if args.send == "packed":  # as under engine/core.py
        engine.emit_packed_outputs()

    def send(outs: list) -> None:
        if args.send == "objects":
            for out in outs:
                out.prompt_token_ids = []
            outs = pack_outputs(outs)
        pickle.dumps(("step", outs, [], None), protocol=pickle.HIGHEST_PROTOCOL)

    t = time.perf_counter()
    for _ in range(args.steps):
        outs = engine.step()
        if args.send != "none":
            send(outs)
    per_step = (time.perf_counter() - t) / args.steps
    if profiler is not None:
        import pstats

        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    host_ms = 1e3 * (per_step - spent[0] / args.steps)
    print(
        json.dumps(
            {
                "batch": args.batch,
                "cache_type": args.cache_type,
                "output_kind": args.output_kind,
                "overlap": args.overlap,
                "detokenize": not args.no_detokenize,
                "steps": args.steps,
                "host_ms_per_decode_step": host_ms,
                "send": args.send,
                "stream_interval": args.stream_interval,
            }
        )
    )


if __name__ == "__main__":
    main()
