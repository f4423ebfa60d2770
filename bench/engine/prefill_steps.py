"""One prompt at a time through the offline engine, each of its steps timed to the GPU's end: where
a lone request's time to first token goes (how many steps its prefill takes, and what each costs),
with the radix prefix cache and without; then one prompt's steps under Python's profiler.

    python -m bench.engine.prefill_steps --model configs/qwen3.5-0.8b --tokens 1024
    python -m bench.engine.prefill_steps --model configs/qwen3.5-0.8b --cache-types radix --piecewise 0 512

`--piecewise N ...`: each run again with piecewise CUDA graphs of up to N tokens (0: eager steps).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import time
from typing import Any

import torch

from deltaserve import LLM, SamplingParams


def run_prompt(
    engine: Any, prompt: list[int], params: SamplingParams, prof: cProfile.Profile | None = None
) -> list[float]:
    """The prompt's steps, each timed to the GPU's end (ms)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    engine.add_request(f"p{time.monotonic_ns()}", prompt, params)
    sync()
    steps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        engine.step()
        if prof is not None:
            prof.disable()
        sync()
        steps.append(1e3 * (time.perf_counter() - t))
    return steps


def timed_prompts(engine: Any, prompts: list[list[int]], params: SamplingParams) -> list[list[float]]:
    """Each prompt's steps (`run_prompt`), after the warm-up: a profiler's samples of the timed
    prompts alone are those under this frame (`bench.pyspy_summary --within timed_prompts`)."""
    return [run_prompt(engine, p, params) for p in prompts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4, help="timed prompts per cache type")
    ap.add_argument("--cache-types", default="radix,naive")
    ap.add_argument("--piecewise", type=int, nargs="+", default=[0], metavar="N")
    ap.add_argument(
        "--cprofile",
        type=int,
        default=0,
        metavar="ROWS",
        help="profile one prompt: ROWS rows by cumulative, then by own time",
    )
    args = ap.parse_args()
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, output_kind="final_only")

    def prompt() -> list[int]:
        return [rng.randrange(100, 100_000) for _ in range(args.tokens)]

    for cache, pieces in [(c, n) for c in args.cache_types.split(",") for n in args.piecewise]:
        llm = LLM(
            args.model,
            load_format="dummy",
            cache_type=cache,
            max_model_len=args.tokens + 16,
            piecewise_cuda_graph_max_tokens=pieces,
        )
        name = f"{cache}, pieces of up to {pieces}" if pieces else cache
        for _ in range(3):  # compile and autotune at these shapes
            run_prompt(llm.engine, prompt(), params)
        for steps in timed_prompts(llm.engine, [prompt() for _ in range(args.prompts)], params):
            print(f"{name}: first token after {sum(steps):.1f} ms, steps (ms) {[round(s, 1) for s in steps]}")
        if args.cprofile:
            prof = cProfile.Profile()
            run_prompt(llm.engine, prompt(), params, prof)
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.cprofile)
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)
        llm.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
