"""cuBLAS against the Triton GEMV on a model's own projection shapes at decode batch sizes.

    python -m bench.gemv --model configs/qwen3.5-0.8b --rows 1 4 8

Every distinct bias-free linear weight of the model (built on the meta device from its
config, so nothing is allocated for it) is timed both ways inside a CUDA graph of 20 calls,
which leaves launch overhead out as a decode graph does. Reported: microseconds per call and
the bandwidth of reading the weight once. Decides `DELTASERVE_GEMV=triton` (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
import torch.nn.functional as F


def linear_shapes(path: str) -> Counter:
    """(N, K) of each linear weight under 256 MB, with how many layers have it."""
    from deltaserve.models.layers import Linear
    from deltaserve.models.loader import read_config
    from deltaserve.models.registry import resolve, text_config

    config, arch = read_config(path)
    cls, nested = resolve(arch)
    with torch.device("meta"):
        model = cls(text_config(config, nested))
    return Counter(
        tuple(m.weight.shape)
        for m in model.modules()
        if isinstance(m, Linear) and m.bias is None and m.weight.numel() * 2 <= 256 << 20
    )


def time_us(fn, reps: int = 20, iters: int = 20) -> float:
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / (iters * reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--json")
    args = ap.parse_args()
    from deltaserve.kernels.triton_gemv import gemv

    rows = []
    for (n, k), count in sorted(linear_shapes(args.model).items()):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_us(lambda x=x, w=w: F.linear(x, w))
            triton = time_us(lambda x=x, w=w: gemv(x, w))
            gb = n * k * 2 / 1e9
            row = {
                "n": n,
                "k": k,
                "layers": count,
                "rows": m,
                "cublas_us": cublas,
                "triton_us": triton,
                "cublas_tb_s": gb * 1e3 / cublas,
                "triton_tb_s": gb * 1e3 / triton,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    for m in args.rows:
        sel = [r for r in rows if r["rows"] == m]
        per_step = {kind: sum(r[f"{kind}_us"] * r["layers"] for r in sel) for kind in ("cublas", "triton")}
        print(json.dumps({"rows": m, "per_decode_step_us": per_step}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
