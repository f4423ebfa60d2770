"""Decode and prefill throughput on real architectures with random weights, against the roofline.

    python -m bench.engine.decode --model configs/qwen3.5-9b --batch-sizes 1 8 64 256 \
        --prompt-len 512 --new-tokens 256 --prefill-len 8192 --hf --json out.json

Decode tok/s counts only steps where every request decodes (prefill excluded). The roofline
is the bytes a step must move (weights, each request's state read and written, its KV)
over the measured copy bandwidth; prefill's is FLOPs over the measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.engine.roofline import decode_step_bytes, model_cost, prefill_flops
from deltaserve.engine.config import EngineConfig
from deltaserve.engine.engine import Engine
from deltaserve.engine.requests.sampling_params import SamplingParams
from deltaserve.kernels.fp8 import cuda as fp8_cuda
from deltaserve.kernels.moe import cuda as moe_cuda


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


COPY_BW = 4.27e12  # bytes/s, the H200's device-to-device copy rate (docs/kernels.md)
MATMUL_FLOPS = 790e12  # bf16 matmul rate of the H200 (docs/kernels.md)


def timed_steps(engine: Engine) -> tuple[list[float], list[float]]:
    """Run to completion; per step: wall seconds and CPU seconds outside the forward pass.

    With overlap scheduling the forward is not synchronised (that would undo the overlap): the
    CPU time is the wall time less the time the engine waited for a step's tokens
    (`Engine.read_back_wait_s`), so a step whose CPU time is its whole wall time was bound by
    the host, not the GPU."""
    walls: list[float] = []
    cpu: list[float] = []
    if engine.config.enable_overlap_schedule:
        while engine.has_unfinished_requests():
            waited = engine.read_back_wait_s
            t = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - t)
            cpu.append(walls[-1] - (engine.read_back_wait_s - waited))
        _sync()
        return walls, cpu
    forward = engine.runner.forward
    spent = {"fwd": 0.0}

    def timed_forward(batch):
        t = time.perf_counter()
        out = forward(batch)
        _sync()
        spent["fwd"] = time.perf_counter() - t
        return out

    engine.runner.forward = timed_forward  # type: ignore[method-assign]
    try:
        while engine.has_unfinished_requests():
            spent["fwd"] = 0.0
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            walls.append(dt)
            cpu.append(dt - spent["fwd"])
    finally:
        engine.runner.forward = forward  # type: ignore[method-assign]
    return walls, cpu


SAMPLING = {
    "greedy": {},
    "qwen": {"temperature": 0.6, "top_p": 0.95, "top_k": 20},
    "temperature": {"temperature": 0.7},
}


def bench_decode(
    engine: Engine, bs: int, prompt_len: int, new_tokens: int, vocab: int, sampling: dict | None = None
) -> dict:
    gen = torch.Generator().manual_seed(bs)
    params = SamplingParams(
        **{"temperature": 0.0, **(sampling or {})}, max_tokens=new_tokens, ignore_eos=True
    )
    for i in range(bs):
        engine.add_request(
            f"d{bs}-{i}", torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params
        )
    # prefill everything first, so that the timed steps are pure decode
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    engine.drain()  # with overlap scheduling the last prefill step may still be in flight
    _sync()
    before = engine.counters["generation_tokens_total"]
    walls, cpu = timed_steps(engine)
    tokens = engine.counters["generation_tokens_total"] - before
    steps = len(walls)
    decode_time = sum(walls)
    return {
        "batch": bs,
        "steps": steps,
        "tok_s": tokens / decode_time,
        "step_ms": 1e3 * decode_time / steps,
        "cpu_ms_per_step": 1e3 * sum(cpu) / steps if cpu else None,
    }


def bench_prefill(engine: Engine, tokens: int, vocab: int, repeats: int = 3, prompts: int = 1) -> dict:
    """The fastest of `repeats` runs of `prompts` prompts of `tokens` each, admitted together, to
    their first tokens (no prefix reuse: the engine's cache is naive)."""
    gen = torch.Generator().manual_seed(0)
    batch = [torch.randint(0, vocab, (tokens,), generator=gen).tolist() for _ in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for j, prompt in enumerate(batch):  # compiles the prefill kernels at this length
        engine.add_request(f"warm-{j}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    times = []
    for i in range(repeats):
        for j, prompt in enumerate(batch):
            engine.add_request(f"p{i}-{j}", prompt, params)
        _sync()
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        _sync()
        times.append(time.perf_counter() - t)
    dt = min(times)
    total = tokens * prompts
    return {"tokens": total, "prompts": prompts, "seconds": dt, "tok_s": total / dt, "all_seconds": times}


def bench_hf(path: str, batch_sizes: list[int], prompt_len: int, new_tokens: int) -> dict:
    """transformers (with FLA when importable) generate on the same shapes, random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    tcfg = getattr(cfg, "text_config", None) or cfg
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(tcfg, dtype=torch.bfloat16).eval()

    def run(ids: torch.Tensor, n: int) -> float:
        _sync()
        t = time.perf_counter()
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
        _sync()
        return time.perf_counter() - t

    out = {}
    for bs in batch_sizes:
        ids = torch.randint(0, tcfg.vocab_size, (bs, prompt_len), device="cuda")
        run(ids, 2)  # warm-up
        t1, tn = run(ids, 1), run(ids, new_tokens)
        out[bs] = {"tok_s": bs * (new_tokens - 1) / (tn - t1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a folder with config.json (configs/...)")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 8, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prefill-len", type=int, default=8192)
    ap.add_argument(
        "--prefill-prompts", type=int, default=1, help="prompts of --prefill-len prefilled together"
    )
    ap.add_argument(
        "--step-budget",
        type=int,
        default=None,
        help="the step's token budget (max_num_batched_tokens); default: the prefill length, at least 8,192",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the longest of prompt + new tokens and the prefill length, plus 16",
    )
    ap.add_argument("--hf", action="store_true", help="also run transformers on the same shapes")
    ap.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument(
        "--quantization",
        choices=["fp8"],
        default=None,
        help="fp8: block-FP8 weights for an unquantized config (FP8 configs need no flag)",
    )
    ap.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="synchronous steps (overlap scheduling is on by default on CUDA); needed for the "
        "host-time column, which only synchronous steps can measure",
    )
    ap.add_argument(
        "--sampling",
        choices=["greedy", "qwen", "temperature"],
        default="greedy",
        help="decode requests' sampling: greedy, qwen (temperature 0.6, top_p 0.95, top_k 20: what "
        "Qwen3.5's generation_config.json gives requests that set none), or temperature 0.7 alone",
    )
    ap.add_argument(
        "--moe-pairs",
        type=int,
        default=None,
        help="the most (token, expert) pairs the MoE streams per pair before its grouped GEMMs "
        "(kernels.moe.cuda.GEMV_ASSIGNMENTS, kernels.fp8.cuda.SKINNY_MOE_PAIRS), to find where "
        "the two paths cross",
    )
    ap.add_argument("--device", default="cuda", help="cpu only for a quick dry run of the script")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.moe_pairs is not None:
        moe_cuda.GEMV_ASSIGNMENTS = fp8_cuda.SKINNY_MOE_PAIRS = args.moe_pairs

    max_bs = max(max(args.batch_sizes, default=1), args.prefill_prompts)
    max_len = args.max_model_len or max(args.prompt_len + args.new_tokens, args.prefill_len) + 16
    engine = Engine(
        EngineConfig(
            model=args.model,
            load_format="dummy",
            quantization=args.quantization,
            dtype="bfloat16",
            device=args.device,
            cache_type="naive",
            max_running_requests=max_bs,
            max_model_len=max_len,
            chunked_prefill_size=args.step_budget or max(args.prefill_len, 8192),
            max_num_batched_tokens=args.step_budget or max(args.prefill_len, 8192),
            disable_cuda_graph=args.disable_cuda_graph,
            enable_overlap_schedule=False if args.disable_overlap_schedule else None,
        )
    )
    cfg = engine.model_config
    cost = model_cost(engine.runner.model, cfg)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    result: dict = {"model": args.model, "gpu": gpu, "info": engine.model_info, "sampling": args.sampling}
    rows = []
    for bs in args.batch_sizes:
        r = bench_decode(
            engine, bs, args.prompt_len, args.new_tokens, cfg.vocab_size, SAMPLING[args.sampling]
        )
        ctx = args.prompt_len + args.new_tokens // 2
        roof = bs / (decode_step_bytes(cost, bs, ctx) / COPY_BW)
        r.update(roofline_tok_s=roof, pct_roofline=100 * r["tok_s"] / roof)
        r["cpu_pct"] = 100 * r["cpu_ms_per_step"] / r["step_ms"] if r["cpu_ms_per_step"] is not None else None
        rows.append(r)
        print(json.dumps(r), flush=True)
    result["decode"] = rows
    if args.prefill_len:
        p = bench_prefill(engine, args.prefill_len, cfg.vocab_size, prompts=args.prefill_prompts)
        p["roofline_s"] = args.prefill_prompts * prefill_flops(cost, args.prefill_len) / MATMUL_FLOPS
        p["x_roofline"] = p["seconds"] / p["roofline_s"]
        result["prefill"] = p
        print(json.dumps(p), flush=True)
    del engine
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if args.hf:
        try:
            result["hf"] = bench_hf(args.model, args.hf_batch_sizes, args.prompt_len, args.hf_new_tokens)
            for bs, r in result["hf"].items():
                ours = next((x["tok_s"] for x in rows if x["batch"] == bs), None)
                if ours:
                    r["deltaserve_speedup"] = ours / r["tok_s"]
            print(json.dumps({"hf": result["hf"]}), flush=True)
        except Exception as e:  # transformers' own model may be missing on an older release
            result["hf_error"] = repr(e)
            print("transformers run failed:", e, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
