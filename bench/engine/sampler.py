"""The sampler's time per decode step: a batch of logits in, tokens out (left on the device).

    python -m bench.engine.sampler [--vocab 248320] [--batch-sizes 1 64 256] [--device cuda]

Random fp32 logits of Qwen3.5's vocabulary; each batch samples with one set of parameters for
all its rows: greedy, temperature only, Qwen3.5's generation_config.json (temperature 0.6,
top_p 0.95, top_k 20: what requests that leave sampling unset get), top-p only, and Qwen3.5's
with presence_penalty 1.5 over `--history` prompt and output tokens a request. Reported:
milliseconds per call (median of `--iters`, synchronised), the time a sampled decode step
spends beside the forward pass. Uses only `Sampler.sample_tokens`, so the same script times an
older commit (bench/ab.sh). `--graphs 32` samples batches of up to 32 rows by graph replay, as
the engine does on CUDA (the default, without the flag, is the eager sampler). `--ops` also times the ranking ops alone on the same logits
(a full sort against `torch.topk` of 20 and 1024), which decide the sampler's paths.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deltaserve.engine.requests.detokenizer import IncrementalDetokenizer
from deltaserve.engine.requests.request import Request
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.engine.sampling.sampler import Sampler

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7),
    "qwen3.5 defaults": dict(temperature=0.6, top_p=0.95, top_k=20),
    "top_p": dict(temperature=0.7, top_p=0.9),
    # Qwen's model cards suggest presence_penalty 1.5 against endless repetition
    "qwen3.5 + presence": dict(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.5),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument(
        "--history",
        type=int,
        default=1024,
        help="prompt and output tokens of each request (penalties read them)",
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ops", action="store_true", help="also time sort / topk alone")
    ap.add_argument(
        "--graphs",
        type=int,
        default=0,
        metavar="MAX_BS",
        help="sample batches of at most MAX_BS rows by graph replay (engine/sampling/sampler_graphs.py)",
    )
    ap.add_argument(
        "--graph-topk-min-rows",
        type=int,
        default=None,
        help="with --graphs: batches of fewer rows sort instead of ranking with torch.topk",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device(args.device)
    if args.graphs:
        from deltaserve.engine.sampling import sampler_graphs

        if args.graph_topk_min_rows is not None:
            sampler_graphs.GRAPH_TOPK_MIN_ROWS = args.graph_topk_min_rows
        sampler = Sampler(dev, 0, [], graph_max_bs=args.graphs)
    else:
        sampler = Sampler(dev, 0, [])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    results = []
    for bs in args.batch_sizes:
        logits = torch.randn(bs, args.vocab, device=dev) * 4
        row = {"batch": bs}
        for name, setting in SETTINGS.items():
            gen = torch.Generator().manual_seed(bs)
            reqs = []
            for i in range(bs):
                history = torch.randint(0, args.vocab, (2 * args.history,), generator=gen).tolist()
                req = Request(
                    f"r{i}", history[: args.history], SamplingParams(**setting), IncrementalDetokenizer(None)
                )
                req.output_token_ids = history[args.history :]
                reqs.append(req)
            for _ in range(3):
                sampler.sample_tokens(logits, reqs)
            times = []
            for _ in range(args.iters):
                for req in reqs:  # one more output token each, as a decode step adds
                    req.output_token_ids.append(1)
                sync()
                t = time.perf_counter()
                sampler.sample_tokens(logits, reqs)
                sync()
                times.append((time.perf_counter() - t) * 1e3)
            row[name] = round(statistics.median(times), 3)
        if args.ops:
            ops = {"op sort": None, "op topk 20": 20, "op topk 1024": 1024}
            for name, k in ops.items():
                times = []
                for i in range(args.iters + 1):
                    sync()
                    t = time.perf_counter()
                    if k is None:
                        torch.sort(logits, dim=-1, descending=True)
                    else:
                        torch.topk(logits, k, dim=-1)
                    sync()
                    if i == 0:
                        continue  # warm-up
                    times.append((time.perf_counter() - t) * 1e3)
                row[name] = round(statistics.median(times), 3)
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ms_per_call": results}, f, indent=1)


if __name__ == "__main__":
    main()
