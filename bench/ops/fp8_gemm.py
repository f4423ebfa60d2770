"""The block-FP8 matmul at prefill sizes: each path on a model's own linear shapes.

    python -m bench.ops.fp8_gemm --model configs/qwen3.5-9b --rows 512 2048 8192
    python -m bench.ops.fp8_gemm --moe configs/qwen3.5-35b-a3b --tokens 8192 --moe-tiles 64:128:64:8:3

Per weight shape `[N, K]` and row count M, microseconds per call (the activations' quantization
included; timed as `bench.ops.gemv` times, in CUDA graphs with weights that exceed the L2 cache) and
TFLOP/s of:
- `triton`: `fp8_gemm_cuda`'s Triton GEMM (at up to 16 rows with its K split);
- `cublas`: cuBLAS's block-scaled FP8 GEMM through `torch._scaled_mm` (activation scales per
  1 x 128, weight scales per 128 x 128); `cublas_row_scales`: the same with a scale per weight row
  and 128 columns (a `scale_rows` of 1);
- `bf16`: `torch.mm` on bf16 weights of the same shape, for scale.
With --moe, one layer's routed experts through `fp8_moe_cuda`'s grouped GEMMs (past its GEMV's
assignments), at its default tiles and at each of --moe-tiles (BLOCK_M:BLOCK_N:STEP_K:WARPS:STAGES[:SWAP],
the FP8 down GEMM's own BLOCK_N:STEP_K:WARPS:STAGES[:SWAP] after a slash; SWAP 1 puts the weight's
rows on the MMA's wide side, and the down GEMM takes gate/up's unless given); with --bf16 as well, through
the bf16 experts' `fused_moe_cuda` (the third number is its BLOCK_K).
Each FP8 path's largest error against `fp8_linear_ref` (fp32), relative to the reference's
largest magnitude, is printed beside its time.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from bench.ops.gemv import cold_copies, linear_shapes, time_us


def bench_shape(n: int, k: int, count: int, m: int) -> dict:
    from deltaserve.kernels.fp8.blocks import quantize_blocks
    from deltaserve.kernels.fp8.cuda import fp8_gemm_cuda
    from deltaserve.kernels.fp8.reference import fp8_linear_ref

    copies = cold_copies(n * k)
    qs = [quantize_blocks(torch.randn(n, k, device="cuda") / k**0.5) for _ in range(copies)]
    rows = [(q, s.repeat_interleave(128, dim=0)[:n].contiguous()) for q, s in qs]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ref = fp8_linear_ref(x, *qs[0], 128).float()
    peak = ref.abs().max().item()
    row: dict = {"n": n, "k": k, "layers": count, "rows": m}
    paths: dict[str, tuple[Callable[[Any], torch.Tensor], list]] = {
        "triton": (lambda q: fp8_gemm_cuda(x, q[0], q[1], 128, cublas=False), qs),
        "cublas": (lambda q: fp8_gemm_cuda(x, q[0], q[1], 128, cublas=True), qs),
        "cublas_row_scales": (lambda q: fp8_gemm_cuda(x, q[0], q[1], 1, cublas=True), rows),
    }
    for name, (fn, weights) in paths.items():
        try:
            err = (fn(weights[0]).float() - ref).abs().max().item() / peak
            us = time_us(fn, weights)
        except Exception as e:  # a path this torch or shape lacks: say why and go on
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        row[f"{name}_us"] = round(us, 1)
        row[f"{name}_tflops"] = round(2 * m * n * k / us / 1e6, 1)
        row[f"{name}_relerr"] = float(f"{err:.2e}")
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
    us = time_us(lambda w: x @ w.t(), wb)
    row["bf16_us"], row["bf16_tflops"] = round(us, 1), round(2 * m * n * k / us / 1e6, 1)
    return row


def parse_moe_tiles(spec: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """`BM:BN:K:W:S[:SWAP][/BN:K:W:S[:SWAP]]`: the grouped GEMMs' tiles, the down GEMM's apart after a
    slash; SWAP 1 puts the weight's rows on the MMA's wide side."""
    gate_up, _, down = spec.partition("/")
    return tuple(int(v) for v in gate_up.split(":")), tuple(int(v) for v in down.split(":")) if down else None


def tiles_name(t: tuple[tuple[int, ...], tuple[int, ...] | None]) -> str:
    name = "tiles_{}x{}_k{}_w{}_s{}".format(*t[0]) + ("_swap" if t[0][5:6] == (1,) else "")
    if t[1] is None:
        return name
    return name + "_down_{}_k{}_w{}_s{}".format(*t[1]) + ("_swap" if t[1][4:5] == (1,) else "")


def bench_moe(model: str, tokens: int, tiles: list[Any], bf16: bool) -> dict:
    from bench.ops.fp8_gemv import moe_layer
    from deltaserve.kernels.fp8.blocks import dequantize_blocks
    from deltaserve.kernels.fp8.cuda import fp8_moe_cuda
    from deltaserve.kernels.fp8.reference import fp8_moe_ref
    from deltaserve.kernels.moe.cuda import fused_moe_cuda
    from deltaserve.kernels.moe.reference import moe_ref

    layer = moe_layer(model)
    e, h, inter, top_k, g = layer.experts, layer.hidden, layer.inter, layer.top_k, layer.generator
    (gu, gu_s), (dn, dn_s) = layer.gate_up, layer.down
    x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
    routes: list[Any] = []
    for _ in range(2):
        w, ids = torch.softmax(torch.randn(tokens, e, device="cuda", generator=g), -1).topk(top_k, dim=-1)
        routes.append((w.to(torch.bfloat16), ids))
    if bf16:  # the bf16 experts' kernels, on the same values
        gu_b, dn_b = dequantize_blocks(gu, gu_s).bfloat16(), dequantize_blocks(dn, dn_s).bfloat16()
        ref = moe_ref(x.float(), gu_b.float(), dn_b.float(), routes[0][1], routes[0][0].float())

        def run(r: Any, t: Any) -> torch.Tensor:
            return fused_moe_cuda(x, gu_b, dn_b, r[1], r[0], t[0] if t is not None else None)
    else:
        ref = fp8_moe_ref(x.float(), gu, gu_s, dn, dn_s, 128, routes[0][1], routes[0][0].float())

        def run(r: Any, t: Any) -> torch.Tensor:
            gate_up, down = t if t is not None else (None, None)
            return fp8_moe_cuda(x, gu, gu_s, dn, dn_s, 128, r[1], r[0], gate_up, down)

    peak = ref.abs().max().item()
    row: dict = {"experts": e, "hidden": h, "inter": inter, "top_k": top_k, "tokens": tokens, "bf16": bf16}
    flops = 2 * tokens * top_k * 3 * h * inter
    for t in [None, *tiles]:
        name = "default" if t is None else tiles_name(t)
        try:
            err = (run(routes[0], t).float() - ref).abs().max().item() / peak
            us = time_us(partial(run, t=t), routes)
        except Exception as exc:  # a tiling that does not compile or fit: say why and go on
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        row[f"{name}_us"], row[f"{name}_tflops"] = round(us, 1), round(flops / us / 1e6, 1)
        row[f"{name}_relerr"] = float(f"{err:.2e}")
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--moe", help="a MoE config: time its routed experts instead")
    p.add_argument("--tokens", type=int, nargs="+", default=[8192])
    p.add_argument(
        "--moe-tiles",
        nargs="*",
        default=[],
        help="BLOCK_M:BLOCK_N:STEP_K:WARPS:STAGES, optionally /BLOCK_N:STEP_K:WARPS:STAGES for the down GEMM (FP8)",
    )
    p.add_argument("--bf16", action="store_true", help="with --moe: the bf16 experts' kernels")
    p.add_argument("--rows", type=int, nargs="+", default=[512, 2048, 8192])
    args = p.parse_args()
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda}), flush=True)
    if args.moe:
        moe_tiles = [parse_moe_tiles(t) for t in args.moe_tiles]
        for t in args.tokens:
            print(json.dumps(bench_moe(args.moe, t, moe_tiles, args.bf16)), flush=True)
        return
    for (n, k), count in sorted(linear_shapes(args.model).items()):
        for m in args.rows:
            print(json.dumps(bench_shape(n, k, count, m)), flush=True)


if __name__ == "__main__":
    main()
