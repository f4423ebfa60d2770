"""Where a decode step's time goes: the CUDA-graph replay alone, the whole forward, the
engine step, and a torch-profiler table of the kernels of a few steps.

    python -m bench.engine.profile_decode --model configs/qwen3.5-0.8b --batch-size 1

It also reports how busy the GPU was over the profiled steps (the union of kernel and copy
times over their span) and the longest idle gaps: with overlap scheduling (on by default)
a busy GPU means the host keeps up; gaps show where it does not.
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams


def _ms(fn, n: int = 50) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


def busy_and_gaps(spans: list[tuple[float, float]], top: int = 5) -> tuple[float, float, list[float]]:
    """(busy time, whole span, longest idle gaps) of (start, end) intervals, any overlap."""
    busy, gaps, end, first = 0.0, [], None, None
    for s, e in sorted(spans):
        if end is None:
            first, end, busy = s, e, e - s
        elif s > end:
            gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    span = 0.0 if end is None or first is None else end - first
    return busy, span, sorted(gaps, reverse=True)[:top]


def dummy_engine(model: str, **config: object) -> Engine:
    """The profiled engine: random weights, bf16, CUDA, no prefix reuse, and `config`."""
    return Engine(
        EngineConfig(
            model=model, load_format="dummy", dtype="bfloat16", device="cuda", cache_type="naive", **config
        )  # type: ignore[arg-type]
    )


def report(prof: torch.profiler.profile, what: str, rows: int, trace: str | None) -> None:
    """How busy the GPU was over the profiled `what` and its longest idle gaps, then the kernels
    by GPU time and the ops by CPU time (and a Chrome trace to `trace`)."""
    spans = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if str(e.device_type).endswith("CUDA") and e.time_range.end > e.time_range.start
    ]
    busy, span, gaps = busy_and_gaps(spans)
    if span:
        print(
            f"GPU busy {busy / 1e3:.2f} of {span / 1e3:.2f} ms over {what} ({100 * busy / span:.0f}%); "
            f"longest idle gaps (ms): {[round(g / 1e3, 3) for g in gaps]}"
        )
    if trace:
        prof.export_chrome_trace(trace)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-overlap-schedule", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: prompt length + 512")
    ap.add_argument("--trace", help="write a Chrome trace of the profiled steps here")
    ap.add_argument("--rows", type=int, default=25, help="profiler table rows")
    args = ap.parse_args()
    bs = args.batch_size
    engine = dummy_engine(
        args.model,
        max_running_requests=max(bs, 8),
        max_model_len=args.max_model_len or args.prompt_len + 512,
        disable_cuda_graph=args.disable_cuda_graph,
        enable_overlap_schedule=False if args.disable_overlap_schedule else None,
    )
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    room = engine.max_model_len - args.prompt_len  # the profile needs ~100 steps
    params = SamplingParams(temperature=0.0, max_tokens=min(400, room), ignore_eos=True)
    for i in range(bs):
        engine.add_request(
            str(i), torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist(), params
        )
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    runner = engine.runner
    gr = runner.graph_runner
    print(f"graph runner: {None if gr is None else gr.sizes}")
    if gr is not None and bs in gr.graphs:
        print(f"graph replay alone: {_ms(gr.graphs[bs][0].replay):.3f} ms")
    print(f"engine.step: {_ms(engine.step, 30):.3f} ms")
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(10):
            engine.step()
        torch.cuda.synchronize()
    report(prof, "10 steps", args.rows, args.trace)


if __name__ == "__main__":
    main()
