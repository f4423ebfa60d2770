"""The block-FP8 matmuls at decode sizes: each path on a model's own shapes, cold weights.

    python -m bench.ops.fp8_gemv --model configs/qwen3.5-9b --rows 1 2 4 8 --gemm-tiles 64:4 32:6 --gemv-tiles 4:4
    python -m bench.ops.fp8_gemv --model configs/qwen3.5-9b --rows 1 8 16 --skinny-tiles 64:4:1 64:4:4 128:4:2
    python -m bench.ops.fp8_gemv --moe configs/qwen3-next-80b-a3b-fp8 --tokens 1 4 16 32
    python -m bench.ops.fp8_gemv --moe configs/qwen3-next-80b-a3b-fp8 --tokens 1 --skinny-moe-tiles 4:3:64:4 8:4:64:4

Dense: every distinct linear weight of the model, quantized to e4m3 with 128 x 128 block scales,
timed through the GEMV (products in registers, the row quantized inside it; up to 8 rows), the
w8a8 GEMM and the skinny GEMM (up to 16 rows), against the bf16 Triton GEMV on the same shape; MoE: one layer's routed experts,
through the per-assignment GEMV, the skinny MoE and the grouped GEMMs. Each is timed as `bench.ops.gemv` times it (CUDA graphs, copies that
exceed the L2 cache). Reported: microseconds per call and the bandwidth of the bytes read once.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import torch

from bench.ops.gemv import cold_copies, linear_shapes, time_us


def bench_dense(
    model: str,
    rows: list[int],
    gemm_tiles: list[tuple[int, ...]],
    gemv_tiles: list[tuple[int, ...]],
    skinny_tiles: list[tuple[int, ...]],
) -> list[dict]:
    from deltaserve.kernels.fp8 import cuda as fp8_cuda
    from deltaserve.kernels.fp8.blocks import quantize_blocks
    from deltaserve.kernels.linear.triton import MAX_ROWS, gemv

    out = []
    for (n, k), count in sorted(linear_shapes(model).items()):
        copies = cold_copies(n * k)
        qs = [quantize_blocks(torch.randn(n, k, device="cuda") / k**0.5) for _ in range(copies)]
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(-(-copies // 2))]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row: dict = {"n": n, "k": k, "layers": count, "rows": m}
            if m <= MAX_ROWS:  # the GEMVs take decode's few rows; more go to a GEMM
                row["bf16_gemv_us"] = time_us(lambda w, x=x: gemv(x, w), ws)
                row["fp8_gemv_us"] = time_us(lambda q, x=x: fp8_cuda.fp8_gemv_cuda(x, q[0], q[1], 128), qs)
            for bn, blocks in gemv_tiles if m == 1 else []:
                row[f"fp8_gemv_bn{bn}_s{blocks}_us"] = time_us(
                    lambda q, x=x, t=(bn, blocks): fp8_cuda.fp8_gemv_cuda(x, q[0], q[1], 128, tiles=t), qs
                )
            row["fp8_gemm_us"] = time_us(lambda q, x=x: fp8_cuda.fp8_gemm_cuda(x, q[0], q[1], 128), qs)
            for bn, stages, *split in gemm_tiles:
                t = (bn, stages, split[0] if split else 1)
                row["fp8_gemm_n{}_s{}_k{}_us".format(*t)] = time_us(
                    lambda q, x=x, t=t: fp8_cuda.fp8_gemm_cuda(x, q[0], q[1], 128, t), qs
                )
            if m <= fp8_cuda.SKINNY_MMA_ROWS:
                for t in [None, *skinny_tiles]:
                    name = "x".join(map(str, t)) if t else "default"
                    row[f"fp8_skinny_{name}_us"] = time_us(
                        lambda q, x=x, t=t: fp8_cuda.fp8_skinny_cuda(x, q[0], q[1], 128, t), qs
                    )
            gb = n * k / 1e9
            for key in [key for key in row if key.endswith("_us")]:
                row[key.replace("_us", "_tb_s")] = gb * (2 if key.startswith("bf16") else 1) * 1e3 / row[key]
            out.append(row)
            print(json.dumps(row), flush=True)
    return out


@dataclass
class MoeLayer:
    """One layer's routed experts of a MoE config, random and quantized to e4m3 blocks."""

    experts: int
    hidden: int
    inter: int
    top_k: int
    gate_up: tuple[torch.Tensor, torch.Tensor]  # e4m3 `[E, 2I, H]`, its block scales
    down: tuple[torch.Tensor, torch.Tensor]  # e4m3 `[E, H, I]`, its block scales
    generator: torch.Generator


def moe_layer(model: str) -> MoeLayer:
    from deltaserve.kernels.fp8.blocks import quantize_blocks
    from deltaserve.models.checkpoints.loader import read_config
    from deltaserve.models.registry import resolve, text_config

    config, arch = read_config(model)
    cfg = text_config(config, resolve(arch)[1])
    e, h, inter, top_k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(0)
    gu = quantize_blocks(torch.randn(e, 2 * inter, h, device="cuda", generator=g) / h**0.5)
    dn = quantize_blocks(torch.randn(e, h, inter, device="cuda", generator=g) / inter**0.5)
    return MoeLayer(e, h, inter, top_k, gu, dn, g)


def bench_moe(model: str, tokens: list[int], skinny_tiles: list[tuple[int, ...]]) -> list[dict]:
    from deltaserve.kernels.fp8 import cuda as fp8_cuda
    from deltaserve.kernels.moe import cuda as moe_cuda

    layer = moe_layer(model)
    e, h, inter, top_k, g = layer.experts, layer.hidden, layer.inter, layer.top_k, layer.generator
    (gu, gu_s), (dn, dn_s) = layer.gate_up, layer.down
    out = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
        # routings cycled through, so that the experts the calls touch exceed the L2 cache
        routes: list[Any] = []
        for _ in range(8):
            w, ids = torch.softmax(torch.randn(t, e, device="cuda", generator=g), -1).topk(top_k, dim=-1)
            routes.append((w.to(torch.bfloat16), ids))
        touched = sum(ids.unique().numel() for _, ids in routes) / len(routes)
        row: dict = {
            "experts": e,
            "hidden": h,
            "inter": inter,
            "top_k": top_k,
            "tokens": t,
            "touched": touched,
        }
        paths = {
            "gemv": lambda r, x=x: moe_cuda.moe_gemv_cuda(x, gu, dn, r[1], r[0], gu_s, dn_s, 128),
            "skinny": lambda r, x=x: fp8_cuda.fp8_moe_skinny_cuda(x, gu, gu_s, dn, dn_s, 128, r[1], r[0]),
            "grouped": lambda r, x=x: fp8_cuda.fp8_moe_cuda(x, gu, gu_s, dn, dn_s, 128, r[1], r[0]),
        }
        for spec in skinny_tiles:  # SPLIT:GATE_UP_STAGES:DOWN_BLOCK_N:DOWN_STAGES

            def tiled(r: Any, x: torch.Tensor = x, spec: Any = spec) -> torch.Tensor:
                return fp8_cuda.fp8_moe_skinny_cuda(x, gu, gu_s, dn, dn_s, 128, r[1], r[0], tiles=spec)

            paths["skinny_" + "_".join(map(str, spec))] = tiled
        limits = moe_cuda.GEMV_ASSIGNMENTS, fp8_cuda.SKINNY_MOE_PAIRS
        moe_cuda.GEMV_ASSIGNMENTS = fp8_cuda.SKINNY_MOE_PAIRS = 0  # the grouped GEMMs at any count
        for name, call in paths.items():
            row[f"{name}_us"] = time_us(call, routes)
            row[f"{name}_tb_s"] = touched * 3 * h * inter / 1e9 * 1e3 / row[f"{name}_us"]
        moe_cuda.GEMV_ASSIGNMENTS, fp8_cuda.SKINNY_MOE_PAIRS = limits
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="dense shapes of this config")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument(
        "--gemm-tiles",
        nargs="*",
        default=[],
        metavar="BLOCK_N:STAGES[:SPLIT]",
        help="also time the w8a8 GEMM at these tilings and K splits (the default: kernels/fp8/cuda.py's gemm_tiles)",
    )
    ap.add_argument(
        "--gemv-tiles",
        nargs="*",
        default=[],
        metavar="BN:S",
        help="also time the one-row FP8 GEMVs at BN weight rows and S 128-column blocks a program",
    )
    ap.add_argument(
        "--skinny-tiles",
        nargs="*",
        default=[],
        metavar="BLOCK_N:STAGES:SPLIT",
        help="also time the skinny GEMM (up to 16 rows, weight rows as the MMA's wide side) at these tilings",
    )
    ap.add_argument("--moe", help="routed experts of this config")
    ap.add_argument(
        "--skinny-moe-tiles",
        nargs="*",
        default=[],
        metavar="SPLIT:STAGES:DOWN_BLOCK_N:DOWN_STAGES",
        help="with --moe: also time the skinny MoE at these tilings (the default: kernels/fp8/cuda.py's skinny_moe_tiles)",
    )
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    if args.model:

        def pairs(specs: list[str]) -> list[tuple[int, ...]]:
            return [tuple(int(v) for v in t.split(":")) for t in specs]

        rows += bench_dense(
            args.model, args.rows, pairs(args.gemm_tiles), pairs(args.gemv_tiles), pairs(args.skinny_tiles)
        )
    if args.moe:
        rows += bench_moe(
            args.moe, args.tokens, [tuple(int(v) for v in t.split(":")) for t in args.skinny_moe_tiles]
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
