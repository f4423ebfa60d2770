"""cuBLAS against the Triton GEMV on a model's own projection shapes at decode batch sizes.

    python -m bench.ops.gemv --model configs/qwen3.5-0.8b --rows 1 4 8

Every distinct bias-free linear weight of the model (built on the meta device from its
config, so nothing is allocated for it) is timed both ways inside a CUDA graph of 20 calls,
which leaves launch overhead out as a decode graph does. The calls cycle through copies of the
weight that together exceed the L2 cache (60 MB on the H200), so that each call reads its
matrix from HBM as a decode step does (the same matrix 20 times would be served from L2 when
it fits). Reported: microseconds per call and the bandwidth of reading the weight once.
Decides the Triton GEMV rule of `kernels/linear/__init__.py` (docs/kernels.md).

`--tiles BN:BK ...` also times the Triton GEMV with the given tiles (a sweep of its tiling).
Run with `DELTASERVE_PDL=on` to time the kernels as the small decode graphs launch them.
`--blas cublaslt` times torch's matmul with cuBLASLt preferred, `--blas tunable` with torch's
TunableOp choosing among what it finds for each shape; `--cublas-only` leaves the Triton GEMV out
(for row counts past its rule, prefill's included).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import torch
import torch.nn.functional as F


def linear_shapes(path: str) -> Counter:
    """(N, K) of each linear weight under 256 MB, with how many layers have it."""
    from deltaserve.models.checkpoints.loader import read_config
    from deltaserve.models.layers.common import Linear
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


COLD_BYTES = 256 << 20  # weight copies per shape add up to at least this
MAX_COPIES = 512  # a tiny weight (a 1 x 2048 gate) would otherwise need copies by the hundred thousand


def cold_copies(nbytes: int) -> int:
    """Copies of an `nbytes` weight that exceed the L2 cache together (up to MAX_COPIES)."""
    return min(-(-COLD_BYTES // nbytes), MAX_COPIES)


def time_us(fn, weights: list[torch.Tensor], reps: int = 20, iters: int = 20) -> float:
    """Microseconds per `fn(w)`, the calls cycling through `weights` (every copy at least once)."""
    reps = max(reps, len(weights))
    fn(weights[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(weights[i % len(weights)])
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
    ap.add_argument("--tiles", nargs="*", default=[], help="BN:BK tiles to time the Triton GEMV with")
    ap.add_argument("--json")
    ap.add_argument("--blas", choices=["default", "cublaslt", "tunable"], default="default")
    ap.add_argument("--cublas-only", action="store_true")
    args = ap.parse_args()
    if args.blas == "cublaslt":
        torch.backends.cuda.preferred_blas_library("cublaslt")
    elif args.blas == "tunable":  # each shape tuned at its first call, outside the graph's capture
        torch.cuda.tunable.enable(True)
        torch.cuda.tunable.tuning_enable(True)
    from deltaserve.kernels.linear import triton as triton_gemv
    from deltaserve.kernels.linear.triton import gemv

    default_tiles = triton_gemv.gemv_tiles

    rows = []
    for (n, k), count in sorted(linear_shapes(args.model).items()):
        copies = cold_copies(n * k * 2)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = time_us(lambda w, x=x: F.linear(x, w), ws)
            triton = float("nan") if args.cublas_only else time_us(lambda w, x=x: gemv(x, w), ws)
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
            for tile in args.tiles:
                bn, bk = (int(v) for v in tile.split(":"))
                triton_gemv.gemv_tiles = lambda m_, n_, k_, s_, bn=bn, bk=bk: (
                    default_tiles(m_, n_, k_, s_)[0],
                    bn,
                    bk,
                )
                try:
                    row[f"triton_{tile}_us"] = time_us(lambda w, x=x: gemv(x, w), ws)
                finally:
                    triton_gemv.gemv_tiles = default_tiles
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ws
    for m in args.rows:
        sel = [r for r in rows if r["rows"] == m]
        per_step = {kind: sum(r[f"{kind}_us"] * r["layers"] for r in sel) for kind in ("cublas", "triton")}
        print(json.dumps({"rows": m, "per_decode_step_us": per_step}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
