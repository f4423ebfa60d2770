"""Microbenchmarks of the fast kernels on one GPU, against the measured copy bandwidth.

    python bench/ops/kernels.py [--json PATH] [--sweep] [--only gdn_decode,paged_prefill,...]

Decode kernels are timed as CUDA-graph replays (that is how the engine runs them) over
enough layer-like copies of the data that it cannot sit in L2 between calls; prefill kernels
with events around eager calls. Every figure is the median of several replays.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

DEV = "cuda"
SECTIONS = (
    "gdn_decode",
    "conv_decode",
    "conv_prefill",
    "gated_norm",
    "paged_decode",
    "paged_prefill",
    "gdn_prefill",
)
L2_BYTES = 60 * 2**20


def time_graph(fns: list[Callable[[], object]], replays: int = 20) -> float:
    """Median seconds per call of `fns` (one call each), captured together in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(fns))
    return statistics.median(times)


def time_eager(fn: Callable[[], object], reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_eager(lambda: dst.copy_(src))


def layers_for(bytes_per_layer: int) -> int:
    """Copies of the working set so that a graph of calls streams >= 4x the L2."""
    return max(1, min(64, -(-4 * L2_BYTES // bytes_per_layer)))


def bench_gdn_decode(batch: int, hk: int, hv: int, dim: int, sweep: bool) -> list[dict]:
    from deltaserve.kernels.gdn.cuda import gdn_decode_cuda
    from deltaserve.kernels.gdn.triton import decode_block_v, gdn_decode_launch

    state_bytes = batch * hv * dim * dim * 4
    layers = layers_for(state_bytes)
    pools = [torch.randn(batch + 1, hv, dim, dim, device=DEV) * 0.01 for _ in range(layers)]
    slots = (torch.randperm(batch, device=DEV) + 1).to(torch.int32)
    q = torch.randn(batch, hk, dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(batch, hv, dim, device=DEV, dtype=torch.bfloat16)
    g = -torch.rand(batch, hv, device=DEV) * 0.1
    beta = torch.rand(batch, hv, device=DEV, dtype=torch.bfloat16)
    moved = 2 * state_bytes  # read and write each state element once
    rows = []

    def record(name: str, seconds: float) -> None:
        rows.append(variant_row("gdn_decode", name, seconds, moved, batch=batch, hk=hk, hv=hv, dim=dim))

    record("deltaserve", time_graph([lambda p=p: gdn_decode_cuda(q, k, v, g, beta, p, slots) for p in pools]))
    if sweep:
        out = torch.empty_like(v)
        for bv in (8, 16, 32, 64):
            for warps in (2, 4, 8):
                fns = [
                    lambda p=p, bv=bv, warps=warps: gdn_decode_launch(
                        q, k, v, g, beta, p, slots, out, bv, warps
                    )
                    for p in pools
                ]
                record(f"BV={bv},warps={warps}", time_graph(fns))
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        rows[0]["variant"] += "(BV={},warps={})".format(*decode_block_v(batch, hv, dim, dim, sms))
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return rows
    states = [p[1:] for p in pools]  # contiguous [batch, ...]: FLA's best case, no gather

    def fla(state: torch.Tensor) -> None:
        fused_recurrent_gated_delta_rule(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            g=g.unsqueeze(1),
            beta=beta.unsqueeze(1),
            initial_state=state,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    try:
        record("fla fused_recurrent (contiguous state)", time_graph([lambda s=s: fla(s) for s in states]))
    except Exception as exc:
        print(f"fla fused_recurrent failed: {type(exc).__name__}: {exc}")

    def fla_pool(pool: torch.Tensor) -> None:
        idx = slots.long()
        _, final = fused_recurrent_gated_delta_rule(
            q.unsqueeze(1),
            k.unsqueeze(1),
            v.unsqueeze(1),
            g=g.unsqueeze(1),
            beta=beta.unsqueeze(1),
            initial_state=pool[idx],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        pool[idx] = final

    try:
        record("fla gather+scatter", time_graph([lambda p=p: fla_pool(p) for p in pools]))
    except Exception as exc:
        print(f"fla gather+scatter failed: {type(exc).__name__}: {exc}")
    return rows


def bench_paged_decode(
    batch: int, context: int, hq: int, hkv: int, dim: int, page: int, sweep: bool
) -> list[dict]:
    from deltaserve.kernels.attention.cuda import decode_splits, paged_attention_cuda, paged_decode_launch

    pages_per = -(-context // page)
    kv_bytes = 2 * batch * context * hkv * dim * 2
    layers = layers_for(kv_bytes)
    caches = []
    for _ in range(layers):
        shape = (batch * pages_per + 1, page, hkv, dim)
        caches.append(
            (
                torch.randn(shape, device=DEV, dtype=torch.bfloat16),
                torch.randn(shape, device=DEV, dtype=torch.bfloat16),
            )
        )
    table = (torch.randperm(batch * pages_per, device=DEV) + 1).to(torch.int32).view(batch, pages_per)
    q = torch.randn(batch, hq, dim, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    seq = torch.full((batch,), context, device=DEV, dtype=torch.int32)
    rows = []

    def record(name: str, seconds: float) -> None:
        shape = dict(batch=batch, context=context, hq=hq, hkv=hkv, dim=dim, page=page)
        rows.append(variant_row("paged_decode", name, seconds, kv_bytes, **shape))

    fns = [lambda c=c: paged_attention_cuda(q, c[0], c[1], table, cu, seq, dim**-0.5, 1) for c in caches]
    splits = decode_splits(
        batch, hkv, pages_per * page, torch.cuda.get_device_properties(0).multi_processor_count
    )
    record(f"deltaserve(splits={splits})", time_graph(fns))
    if sweep:
        out = torch.empty_like(q)
        variants = [(splits, bn, w, st) for bn in (32, 64) for w, st in ((4, 2), (4, 3), (8, 2))]
        variants += [(s, bn, 4, 2) for s in (1, 4, 16, 32, 64) for bn in (32, 64) if s != splits]
        for s, bn, warps, stages in variants:
            fns = [
                lambda c=c, s=s, bn=bn, warps=warps, stages=stages: paged_decode_launch(
                    q, c[0], c[1], table, cu, seq, dim**-0.5, out, s, bn, warps, stages
                )
                for c in caches
            ]
            try:
                record(f"splits={s},BN={bn},warps={warps},stages={stages}", time_graph(fns, replays=10))
            except Exception as exc:  # out of shared memory for a large tile, say
                print(f"skip splits={s} BN={bn} warps={warps} stages={stages}: {type(exc).__name__}: {exc}")
    return rows


def bench_paged_prefill(
    q_len: int, prefix: int, hq: int, hkv: int, dim: int, page: int, sweep: bool
) -> list[dict]:
    from deltaserve.kernels.attention.cuda import paged_prefill_launch, prefill_tiles

    total = prefix + q_len
    pages = -(-total // page)
    shape = (pages + 1, page, hkv, dim)
    k_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    table = (torch.randperm(pages, device=DEV) + 1).to(torch.int32).view(1, pages)
    q = torch.randn(q_len, hq, dim, device=DEV, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    cu = torch.tensor([0, q_len], device=DEV, dtype=torch.int32)
    seq = torch.tensor([total], device=DEV, dtype=torch.int32)
    pairs = q_len * prefix + q_len * (q_len + 1) / 2  # (query, visible key) pairs
    flops = 4 * hq * dim * pairs
    default = prefill_tiles(q.dtype)
    tiles_list = [default]
    if sweep:
        tiles_list += [
            (64, 64, 8, 2),
            (128, 32, 8, 2),
            (128, 64, 8, 2),
            (64, 32, 4, 3),
            (128, 64, 8, 3),
            (64, 64, 4, 2),
        ]
    rows = []
    for tiles in tiles_list:
        try:
            seconds = time_eager(
                lambda tiles=tiles: paged_prefill_launch(
                    q, k_cache, v_cache, table, cu, seq, dim**-0.5, out, q_len, tiles
                )
            )
        except Exception as exc:  # out of shared memory for a large tile, say
            print(f"skip prefill tiles {tiles}: {type(exc).__name__}: {exc}")
            continue
        name = "deltaserve" if not rows else "BM={},BN={},warps={},stages={}".format(*tiles)
        rows.append(
            dict(
                op="paged_prefill",
                variant=name,
                q_len=q_len,
                prefix=prefix,
                hq=hq,
                hkv=hkv,
                dim=dim,
                us=seconds * 1e6,
                tflops=flops / seconds / 1e12,
            )
        )
    return rows


def gpu_seconds(fn: Callable[[], object], reps: int = 5) -> float:
    """Kernel time alone (profiler), to tell device work from host overhead."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(getattr(event, "self_device_time_total", 0.0) for event in prof.key_averages())
    return total / reps / 1e6


def bench_gdn_prefill(lengths: list[int], hk: int, hv: int, dim: int) -> dict:
    from deltaserve.kernels.gdn.cuda import gdn_prefill_cuda

    total = sum(lengths)
    q = torch.randn(total, hk, dim, device=DEV, dtype=torch.bfloat16)
    k = torch.randn_like(q)
    v = torch.randn(total, hv, dim, device=DEV, dtype=torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(total, hv, device=DEV))
    beta = torch.rand(total, hv, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV, dtype=torch.int32)
    pool = torch.randn(len(lengths) + 1, hv, dim, dim, device=DEV) * 0.01
    slots = torch.arange(1, len(lengths) + 1, device=DEV, dtype=torch.int32)
    has_init = torch.ones(len(lengths), dtype=torch.bool, device=DEV)

    def ours() -> None:
        gdn_prefill_cuda(q, k, v, g, beta, cu, pool, slots, has_init)

    row: dict = dict(op="gdn_prefill", lengths=f"{len(lengths)}x{lengths[0]}", hk=hk, hv=hv, dim=dim)
    seconds = time_eager(ours)
    row.update(us=seconds * 1e6, tok_per_s=total / seconds)
    try:
        row["gpu_us"] = gpu_seconds(ours) * 1e6
    except Exception as exc:
        print(f"profiler failed: {type(exc).__name__}: {exc}")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu_long = cu.long()
    init = pool[1:].clone()

    def raw() -> None:  # FLA alone: no gather / scatter, cu_seqlens already int64
        chunk_gated_delta_rule(
            q[None],
            k[None],
            v[None],
            g=g[None],
            beta=beta[None],
            initial_state=init,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu_long,
        )

    with torch.no_grad():
        row["fla_raw_us"] = time_eager(raw) * 1e6
    return row


def bench_conv_decode(batch: int, dim: int, width: int, sweep: bool) -> list[dict]:
    from deltaserve.kernels.conv.triton import conv_decode_launch

    state_bytes = batch * dim * (width - 1) * 2
    layers = layers_for(state_bytes)
    pools = [torch.randn(batch + 1, dim, width - 1, device=DEV, dtype=torch.bfloat16) for _ in range(layers)]
    weight = torch.randn(dim, width, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(batch, dim, device=DEV, dtype=torch.bfloat16)
    slots = (torch.randperm(batch, device=DEV) + 1).to(torch.int32)
    moved = 2 * state_bytes + 2 * batch * dim * 2
    variants = [(256, 4)]
    if sweep:
        variants += [(bd, w) for bd in (128, 512, 1024) for w in (2, 4, 8)]
    # Each variant must agree with the default on the same input (pools advance per call,
    # so compare one call from a saved pool).
    check_pool = pools[0].clone()
    expected, expected_pool = torch.empty_like(x), check_pool.clone()
    conv_decode_launch(x, expected_pool, weight, None, slots, expected, True)
    rows = []
    for bd, warps in variants:
        out = torch.empty_like(x)
        trial = check_pool.clone()
        conv_decode_launch(x, trial, weight, None, slots, out, True, bd, warps)
        ok = torch.allclose(out.float(), expected.float(), rtol=1e-2, atol=1e-2) and torch.equal(
            trial, expected_pool
        )
        fns = [
            lambda p=p, bd=bd, warps=warps, out=out: conv_decode_launch(
                x, p, weight, None, slots, out, True, bd, warps
            )
            for p in pools
        ]
        seconds = time_graph(fns)
        rows.append(
            dict(
                op="conv_decode",
                variant=f"BD={bd},warps={warps}" + ("" if ok else " MISMATCH"),
                batch=batch,
                dim=dim,
                width=width,
                us=seconds * 1e6,
                gbps=moved / seconds / 1e9,
            )
        )
    return rows


def bench_conv_prefill(tokens: int, dim: int, row_stride: int, width: int, sweep: bool) -> list[dict]:
    """GDN's prefill conv as the model runs it: a strided view of the in_proj output (rows of
    `row_stride`), one sequence of `tokens`, silu; GPU time per call against bytes moved."""
    from deltaserve.kernels.conv.triton import conv_prefill_launch

    proj = torch.randn(tokens, row_stride, device=DEV, dtype=torch.bfloat16)
    x = proj[:, :dim]
    pool = torch.randn(4, dim, width - 1, device=DEV, dtype=torch.bfloat16)
    weight = torch.randn(dim, width, device=DEV, dtype=torch.bfloat16)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=DEV)
    slots = torch.tensor([1], dtype=torch.int32, device=DEV)
    has_init = torch.ones(1, dtype=torch.int32, device=DEV)
    moved = 2 * tokens * dim * 2  # x read once, out written once
    variants = [(16, 128, 4)]  # the default
    if sweep:
        variants += [(bt, bd, w) for bt in (16, 32, 64, 128) for bd in (64, 128, 256) for w in (4, 8)]
        variants = list(dict.fromkeys(variants))
    expected = torch.empty(tokens, dim, device=DEV, dtype=torch.bfloat16)
    conv_prefill_launch(x, pool.clone(), weight, None, cu, slots, has_init, expected, True)
    rows = []
    for bt, bd, warps in variants:
        out = torch.empty_like(expected)

        def call(out=out, bt=bt, bd=bd, warps=warps) -> None:
            conv_prefill_launch(x, pool.clone(), weight, None, cu, slots, has_init, out, True, bt, bd, warps)

        call()
        ok = torch.equal(out, expected)
        seconds = gpu_seconds(call)
        rows.append(
            variant_row(
                "conv_prefill", f"BT={bt},BD={bd},warps={warps}", seconds, moved, ok, tokens=tokens, dim=dim
            )
        )
    return rows


def variant_row(op: str, variant: str, seconds: float, moved: int, ok: bool = True, **shape: int) -> dict:
    """One timed variant of a kernel at `shape`, marked where its output does not match the default's."""
    return dict(
        op=op,
        variant=variant + ("" if ok else " MISMATCH"),
        **shape,
        us=seconds * 1e6,
        gbps=moved / seconds / 1e9,
    )


def bench_gated_norm(tokens: int, heads: int, dim: int, sweep: bool) -> list[dict]:
    """GDN's output norm as the model runs it: the attention output `[T, H, D]` normalised and
    gated by silu of z, a strided view of the in_proj output; GPU time per call against bytes moved."""
    from deltaserve.kernels.norm.triton import gated_rms_norm_launch

    width = heads * dim
    x = torch.randn(tokens, heads, dim, device=DEV, dtype=torch.bfloat16)
    z = torch.randn(tokens, 2 * width + 64, device=DEV, dtype=torch.bfloat16)[:, width : 2 * width]
    z = z.view(tokens, heads, dim)
    w = torch.randn(dim, device=DEV, dtype=torch.bfloat16)
    moved = 3 * tokens * width * 2  # x and z read once, out written once
    expected = gated_rms_norm_launch(x, z, w, 1e-6)
    rows = []
    for per_program in [None] + ([1, 2, 4, 8, 32, 64] if sweep else [1]):
        seconds = gpu_seconds(lambda r=per_program: gated_rms_norm_launch(x, z, w, 1e-6, rows=r))
        # tilings sum a row in different orders: one bf16 rounding apart is a match
        got = gated_rms_norm_launch(x, z, w, 1e-6, rows=per_program)
        ok = torch.allclose(got.float(), expected.float(), atol=3e-2, rtol=2e-2)
        rows.append(
            variant_row(
                "gated_norm", f"rows={per_program or 'default'}", seconds, moved, ok, tokens=tokens, dim=width
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--sweep", action="store_true", help="also time block-size variants")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS)
    )
    args = parser.parse_args()
    only = set(args.only.split(","))
    torch.manual_seed(0)
    copy = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: device copy {copy / 1e12:.2f} TB/s (read + write)")
    rows: list[dict] = []

    def report(new: list[dict]) -> None:
        """Print and save as we go, so a run cut short still leaves its rows."""
        for row in new:
            if "gbps" in row and row["op"] != "copy":
                row["pct_copy"] = 100 * row["gbps"] * 1e9 / copy
            print(
                json.dumps(
                    {key: round(val, 2) if isinstance(val, float) else val for key, val in row.items()}
                )
            )
        rows.extend(new)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    report([dict(op="copy", gbps=copy / 1e9)])
    if "gdn_decode" in only:
        for hv in (32, 16):
            for batch in (1, 4, 64, 256):
                report(bench_gdn_decode(batch, 16, hv, 128, args.sweep))
    if "conv_decode" in only:
        for batch in (256, 64, 1):
            report(bench_conv_decode(batch, 8192, 4, args.sweep))
    if "conv_prefill" in only:
        # Qwen3.5-0.8B's GDN conv (q, k, v: 6144 channels of an 8224-wide in_proj row), 9B's
        report(bench_conv_prefill(8192, 6144, 8224, 4, args.sweep))
        report(bench_conv_prefill(8192, 8192, 12352, 4, args.sweep))
    if "gated_norm" in only:
        for tokens in (8192, 1):
            report(bench_gated_norm(tokens, 32, 128, args.sweep))
    if "paged_decode" in only:
        for batch, context in ((1, 32768), (64, 4096), (256, 2048)):
            report(bench_paged_decode(batch, context, 16, 4, 256, 16, args.sweep))
    if "gdn_prefill" in only:
        report([bench_gdn_prefill([8192], 16, 32, 128), bench_gdn_prefill([1024] * 8, 16, 32, 128)])
    if "paged_prefill" in only:
        report(bench_paged_prefill(8192, 0, 16, 4, 256, 16, False))
        report(bench_paged_prefill(2048, 6144, 16, 4, 256, 16, False))
        report(bench_paged_prefill(8192, 0, 32, 8, 128, 16, args.sweep))


if __name__ == "__main__":
    main()
