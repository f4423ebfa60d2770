"""Prefill of 8 x 1,024-token prompts in one step, `DELTASERVE_MOE_GEMM=triton` against `auto`
(torch's grouped GEMM for the bf16 experts), alternated in one engine so that both modes see the
same machine, compiled kernels and memory.

    python -m bench.engine.moe_gemm_ab --model bench/configs/kimi-linear-48b-a3b-12l
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from bench.engine.profile_decode import dummy_engine
from deltaserve.engine.requests.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument(
        "--repeats", type=int, default=4, help="timed prefills a mode, alternating which goes first"
    )
    args = ap.parse_args()
    tokens = args.requests * args.prompt_len
    engine = dummy_engine(
        args.model,
        max_running_requests=args.requests,
        max_model_len=args.prompt_len + 16,
        chunked_prefill_size=tokens,
        max_num_batched_tokens=tokens,
        enable_overlap_schedule=False,
    )
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    made = 0

    def prefill(mode: str) -> float:
        nonlocal made
        os.environ["DELTASERVE_MOE_GEMM"] = mode  # read at each MoE call
        for _ in range(args.requests):
            made += 1
            engine.add_request(
                f"r{made}", torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(), params
            )
        torch.cuda.synchronize()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start)

    modes = ("triton", "auto")
    for mode in modes * 2:  # compile and autotune both
        prefill(mode)
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for rep in range(args.repeats):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            times[mode].append(prefill(mode))
    shown = "; ".join(f"{mode} {', '.join(f'{t:.1f}' for t in ts)}" for mode, ts in times.items())
    print(f"{args.model}: {args.requests} x {args.prompt_len} prefill, ms: {shown}")


if __name__ == "__main__":
    main()
