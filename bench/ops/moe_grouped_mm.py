"""One MoE layer's bf16 routed experts, the Triton grouped GEMMs (`fused_moe_cuda`'s tiles)
against torch's grouped GEMM path (`moe_grouped_mm`), and that path's two GEMMs alone, on the
experts' shapes of Qwen3.5-35B-A3B, Kimi-Linear-48B-A3B and Qwen3-Next-80B-A3B, with random
routes; CUDA-event times of 20 calls each.

    python -m bench.ops.moe_grouped_mm
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.kernels.moe.cuda import fused_moe_cuda, grouped_tiles, moe_grouped_mm

SHAPES = {  # experts, top-k, hidden, intermediate
    "qwen3.5-35b-a3b": (256, 8, 2048, 512),
    "kimi-linear-48b-a3b": (256, 8, 2304, 1024),
    "qwen3-next-80b-a3b": (512, 10, 2048, 512),
}


def timed_us(fn: Callable[[], object], calls: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls * 1e3


def compare(name: str, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, tokens: int) -> None:
    """One layer's experts at `tokens` tokens: the three timings and how far the two paths differ."""
    e, two_i, h = gate_up.shape
    x = torch.randn(tokens, h, device=gate_up.device, dtype=torch.bfloat16)
    ids = torch.rand(tokens, e, device=x.device).topk(top_k, dim=1).indices
    w = torch.rand(tokens, top_k, device=x.device)
    tiles = grouped_tiles(tokens * top_k, x.element_size())
    a = fused_moe_cuda(x, gate_up, down, ids, w, tiles).float()
    b = moe_grouped_mm(x, gate_up, down, ids, w).float()
    err = ((a - b).abs().max() / a.abs().max()).item()
    t_triton = timed_us(lambda: fused_moe_cuda(x, gate_up, down, ids, w, tiles))
    t_path = timed_us(lambda: moe_grouped_mm(x, gate_up, down, ids, w))
    flat = ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    ends = torch.cumsum(torch.bincount(flat, minlength=e), 0).to(torch.int32)
    xs = x.index_select(0, order // top_k)
    inter = torch.randn(tokens * top_k, two_i // 2, device=x.device, dtype=torch.bfloat16)
    t_gemms = timed_us(
        lambda: (
            torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends),
            torch._grouped_mm(inter, down.transpose(1, 2), offs=ends),
        )
    )
    gflop = tokens * top_k * 2 * 3 * (two_i // 2) * h / 1e9
    print(
        f"{name} {tokens} tokens: Triton {t_triton:.1f} us ({gflop / t_triton * 1e3:.0f} TFLOP/s), "
        f"grouped_mm path {t_path:.1f} us ({gflop / t_path * 1e3:.0f}), its two GEMMs "
        f"{t_gemms:.1f} us ({gflop / t_gemms * 1e3:.0f}); max difference {err:.1e} of the largest",
        flush=True,
    )


def main() -> None:
    torch.manual_seed(0)
    for name, (e, k, h, i) in SHAPES.items():
        gate_up = torch.randn(e, 2 * i, h, device="cuda", dtype=torch.bfloat16) * h**-0.5
        down = torch.randn(e, h, i, device="cuda", dtype=torch.bfloat16) * i**-0.5
        for tokens in (512, 1024, 2048, 4096, 8192):
            compare(name, gate_up, down, k, tokens)


if __name__ == "__main__":
    main()
