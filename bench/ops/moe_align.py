"""The MoE's grouping of decode's assignments by expert (`align_cuda`), one layer's call, at each
of --warps for its one-program kernel.

    python -m bench.ops.moe_align --experts 513 --top-k 11 --tokens 1 8 16 24 32 64 --warps 1 2 4 8

80B-A3B's decode is 513 experts (the shared one fused) and top 11, 35B-A3B's 257 and top 9.
Calls are timed as a CUDA graph's replay of 48 of them (a model's MoE layers), each on its own
ids; every tiling's rows are checked against `align_ref` first.
"""

from __future__ import annotations

import argparse
import json

import torch

from bench.ops.kernels import time_graph


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=513)
    p.add_argument("--top-k", type=int, default=11)
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 24, 32, 64])
    p.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--layers", type=int, default=48)
    args = p.parse_args()

    from deltaserve.kernels.moe import align

    g = torch.Generator(device="cuda").manual_seed(0)
    for t in args.tokens:
        ids = [
            torch.randint(0, args.experts, (t, args.top_k), generator=g, device="cuda", dtype=torch.int32)
            for _ in range(args.layers)
        ]
        row: dict[str, object] = {"experts": args.experts, "top_k": args.top_k, "tokens": t}
        for w in args.warps:
            align.ONE_PROGRAM_WARPS = w
            rows, blocks = align.align_cuda(ids[0], args.experts, args.block_m)
            want = align.align_ref(ids[0], args.experts, args.block_m)
            assert torch.equal(rows, want[0]) and torch.equal(blocks, want[1]), w
            fns = [lambda i=i: align.align_cuda(i, args.experts, args.block_m) for i in ids]
            row[f"warps_{w}_us"] = round(time_graph(fns) * 1e6, 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
