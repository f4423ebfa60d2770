"""Where a long prefill's time goes: one prompt of `--tokens` tokens in one chunk, timed whole,
then once under the torch profiler (kernels by GPU time, ops by CPU time, and how busy the GPU
was over the step: a low figure means the host's launches set the pace), and with `--cprofile`
once under Python's profiler (which Python functions the host's time goes to), and with
`--sync-debug` once under torch's sync debug mode (each op that waits for the GPU, with the
Python lines that called it).

    python -m bench.engine.profile_prefill --model configs/qwen3.5-0.8b --tokens 8192
    python -m bench.engine.profile_prefill --model configs/kimi-linear-48b-a3b --requests 8  # 8 x 1,024

`--requests N` splits the tokens over N prompts prefilled in the same step, as a server's step
prefills its arrivals. `--decode-rows D` first starts D requests of `--decode-prompt-len` tokens
that keep decoding, so that each profiled step is a server's mixed step: the arrivals' prefill
beside D decode rows.

    python -m bench.engine.profile_prefill --model configs/kimi-linear-48b-a3b --requests 8 --decode-rows 200
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable

import torch

from bench.engine.profile_decode import dummy_engine, report
from deltaserve.engine.requests.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rows", type=int, default=30, help="profiler table rows")
    ap.add_argument(
        "--requests", type=int, default=1, help="prompts sharing the tokens, prefilled in one step"
    )
    ap.add_argument("--decode-rows", type=int, default=0, help="requests decoding beside the prefill")
    ap.add_argument("--decode-prompt-len", type=int, default=1024)
    ap.add_argument(
        "--max-running-requests",
        type=int,
        default=None,
        help="default: --requests + --decode-rows, at least 4",
    )
    ap.add_argument("--trace", help="write a Chrome trace of the profiled prefill here")
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="ROWS",
        help="also run one prefill under cProfile and print its ROWS costliest Python functions",
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="also run one prefill under torch's sync debug mode and print where each host sync is called",
    )
    args = ap.parse_args()
    if args.requests < 1 or args.tokens % args.requests:
        ap.error("--requests must divide --tokens")
    per_prompt = args.tokens // args.requests
    decode_steps = 64 if args.decode_rows else 0  # enough for warm-up and every profiled step
    engine = dummy_engine(
        args.model,
        max_running_requests=args.max_running_requests or max(4, args.requests + args.decode_rows),
        max_model_len=max(per_prompt, args.decode_prompt_len) + decode_steps + 16,
        max_num_batched_tokens=max(args.tokens + args.decode_rows, args.decode_prompt_len),
        chunked_prefill_size=max(args.tokens, args.decode_prompt_len),
        enable_overlap_schedule=False,
    )
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def prefill(name: str) -> float:
        names = {f"{name}-{i}" for i in range(args.requests)}
        for rid in names:
            prompt = torch.randint(0, vocab, (per_prompt,), generator=gen).tolist()
            engine.add_request(rid, prompt, params)
        torch.cuda.synchronize()
        t = time.perf_counter()
        while names:  # the decoders, if any, keep running after
            names -= {out.request_id for out in engine.step() if out.finished}
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t)

    decoding = SamplingParams(temperature=0.0, max_tokens=decode_steps, ignore_eos=True)
    for i in range(args.decode_rows):
        prompt = torch.randint(0, vocab, (args.decode_prompt_len,), generator=gen).tolist()
        engine.add_request(f"decoder-{i}", prompt, decoding)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running
    ):
        engine.step()

    for i in range(2):  # compile and autotune at this length
        prefill(f"warm{i}")
    times = [prefill(f"t{i}") for i in range(3)]
    shape = f"{args.requests} x {per_prompt}" if args.requests > 1 else f"{args.tokens}"
    beside = f" beside {args.decode_rows} decode rows" if args.decode_rows else ""
    print(f"prefill of {shape} tokens{beside}: {', '.join(f'{t:.1f}' for t in times)} ms")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        prefill("profiled")
    report(prof, "the prefill", args.rows, args.trace)
    if args.cprofile:
        pr = cProfile.Profile()
        pr.enable()
        prefill("cprofiled")
        pr.disable()
        for key in ("tottime", "cumulative"):
            pstats.Stats(pr).sort_stats(key).print_stats(args.cprofile)
    if args.sync_debug:
        print_syncs(lambda: prefill("sync-debug"))


def print_syncs(fn: Callable[[], object]) -> None:
    """Run fn under torch's sync debug mode; print each synchronizing call site once, with a count."""
    sites: Counter[str] = Counter()

    def record(message: Warning | str, *args: object, **kwargs: object) -> None:
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        sites[f"{message}\n" + "".join(traceback.format_list(frames[-6:]))] += 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():  # restores showwarning on leaving
            warnings.simplefilter("always")
            warnings.showwarning = record  # type: ignore[assignment]
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    print(f"host syncs in one prefill: {sum(sites.values())} at {len(sites)} call sites")
    for site, n in sites.most_common():
        print(f"--- {n}x {site}")


if __name__ == "__main__":
    main()
