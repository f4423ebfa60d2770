"""How many Triton variants our launchers ask for as a step's sizes change: each new one is a
compile (a second or so) inside the step that first meets it. Counted on CPU from the launches'
specialization keys (`tests/triton_keys.py`, the `triton_keys` fixture) at Kimi-Linear's sizes,
on `meta` tensors."""

from __future__ import annotations

import json
import os

import pytest
import torch

M = "meta"
HEADS, NOPE, ROPE, LATENT, V_DIM, PAGE = 32, 128, 64, 512, 128, 16


def mla_decode(n: int, max_positions: int) -> None:
    from deltaserve.kernels.mla.cuda import mla_decode_triton

    pages = -(-max_positions // PAGE)
    mla_decode_triton(
        torch.empty(n, HEADS, NOPE + ROPE, device=M, dtype=torch.bfloat16),
        torch.empty(4096, PAGE, LATENT + ROPE, device=M, dtype=torch.bfloat16),
        torch.empty(HEADS * (NOPE + V_DIM), LATENT, device=M, dtype=torch.bfloat16),
        torch.zeros(n, pages, device=M, dtype=torch.int32),
        torch.zeros(n, device=M, dtype=torch.int32),
        (NOPE + ROPE) ** -0.5,
        V_DIM,
    )


def test_mla_decode_compiles_once_for_every_batch_and_context(triton_keys) -> None:
    """A mixed step's decode rows (1 to 256 of them, beside prompts up to 32k positions) split
    their positions differently (`mla.cuda._num_splits`) and read a page table as wide as the
    longest context: the kernel takes both at run time, so all of them run one compiled kernel."""
    with triton_keys.recorded_launches() as launches:
        for n in (1, 2, 3, 5, 7, 9, 16, 33, 45, 67, 200, 256):
            for positions in (16, 300, 1024, 1300, 2049, 8192, 32768):
                mla_decode(n, positions)
    assert len(launches) == 12 * 7
    assert len(triton_keys.variants(launches)["_mla_decode_kernel"]) == 1


def check_mla_decode(device: str) -> int:
    """The decode kernel against the expanded reference with one, eight and 19 splits of the
    positions; returns the number of cases checked."""
    from deltaserve.kernels.mla.cuda import _num_splits, mla_decode_triton
    from deltaserve.kernels.mla.reference import mla_attention_ref

    g = torch.Generator(device=device).manual_seed(0)
    cases = 0
    for lens, splits in (([1, 7, 33], 1), ([300, 1, 2049], 8), ([5000, 40, 3, 9, 1, 700], 19)):
        n = len(lens)
        max_pages = max(lens) // PAGE + 1
        assert _num_splits(n * 2, max_pages * PAGE, torch.device(device)) == splits
        pool = n * max_pages + 1
        cache = torch.randn(pool, PAGE, LATENT + ROPE, device=device, generator=g)
        table = (torch.randperm(pool - 1, device=device, generator=g)[: n * max_pages] + 1).view(n, -1).int()
        q = torch.randn(n, HEADS, NOPE + ROPE, device=device, generator=g)
        w = torch.randn(HEADS * (NOPE + V_DIM), LATENT, device=device, generator=g) / LATENT**0.5
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        scale = (NOPE + ROPE) ** -0.5
        out = mla_decode_triton(q, cache, w, table, seq, scale, V_DIM)
        cu = torch.arange(n + 1, dtype=torch.int32, device=device)
        ref = mla_attention_ref(q, cache, w, table, cu, seq, scale, V_DIM)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        cases += 1
    return cases


@pytest.mark.slow
def test_mla_decode_interpreted(run_interpreted) -> None:
    assert int(run_interpreted(__file__, "t.check_mla_decode('cpu')")) == 3


# Qwen3.5-35B-A3B's full-attention layers (Qwen3-Next-80B-A3B's are the same)
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 2, 256


def paged_decode(n: int, max_positions: int) -> None:
    from deltaserve.kernels.attention.cuda import paged_attention_cuda

    pages = -(-max_positions // PAGE)
    paged_attention_cuda(
        torch.empty(n, Q_HEADS, HEAD_DIM, device=M, dtype=torch.bfloat16),
        torch.empty(4096, PAGE, KV_HEADS, HEAD_DIM, device=M, dtype=torch.bfloat16),
        torch.empty(4096, PAGE, KV_HEADS, HEAD_DIM, device=M, dtype=torch.bfloat16),
        torch.zeros(n, pages, device=M, dtype=torch.int32),
        torch.arange(n + 1, device=M, dtype=torch.int32),
        torch.zeros(n, device=M, dtype=torch.int32),
        HEAD_DIM**-0.5,
        1,
    )


def test_paged_decode_compiles_once_per_tile_for_every_batch_and_context(triton_keys) -> None:
    """An eager decode step's rows (1 to 256 of them, up to 32k positions) split their positions
    1 to 64 ways (`attention.cuda.decode_splits`): the split kernel and the merge of the splits
    take the count at run time, so they compile once each, the split kernel once per key tile
    (64 positions when its grid is about one wave, else 32)."""
    with triton_keys.recorded_launches() as launches:
        for n in (1, 2, 3, 5, 7, 9, 16, 33, 45, 67, 200, 256):
            for positions in (16, 300, 1024, 1300, 2049, 8192, 32768):
                paged_decode(n, positions)
    variants = triton_keys.variants(launches)
    assert len(variants["_paged_decode_kernel"]) == 2
    assert len(variants["_paged_decode_reduce_kernel"]) == 1


def check_paged_decode(device: str) -> int:
    """The split kernel and the merge against the torch reference with one split, four, 19 and
    45 (not powers of two, two and three merge tiles), over rows short enough to leave splits
    empty; returns the number of cases checked."""
    from deltaserve.kernels.attention.cuda import paged_decode_launch
    from deltaserve.kernels.attention.reference import paged_attention_ref

    g = torch.Generator(device=device).manual_seed(0)
    hq, hkv, dim, page = 4, 2, 32, 4
    cases = 0
    for lens, splits in (([1, 9, 70], 1), ([300, 1, 65, 17], 4), ([1200, 3, 130], 19), ([1500, 700, 2], 45)):
        n = len(lens)
        max_pages = max(lens) // page + 1
        pool = n * max_pages + 1
        k_cache, v_cache = torch.randn(2, pool, page, hkv, dim, device=device, generator=g)
        table = (torch.randperm(pool - 1, device=device, generator=g)[: n * max_pages] + 1).view(n, -1).int()
        q = torch.randn(n, hq, dim, device=device, generator=g)
        cu = torch.arange(n + 1, dtype=torch.int32, device=device)
        seq = torch.tensor(lens, dtype=torch.int32, device=device)
        out = torch.full_like(q, float("nan"))
        paged_decode_launch(q, k_cache, v_cache, table, cu, seq, dim**-0.5, out, splits, 16)
        ref = paged_attention_ref(q, k_cache, v_cache, table, cu, seq, dim**-0.5)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
        cases += 1
    return cases


@pytest.mark.slow
def test_paged_decode_interpreted(run_interpreted) -> None:
    assert int(run_interpreted(__file__, "t.check_paged_decode('cpu')")) == 4


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.empty(*shape, device=M, dtype=dtype)


def count(triton_keys, calls) -> dict[str, int]:  # type: ignore[no-untyped-def]
    with triton_keys.recorded_launches() as launches:
        for call in calls:
            call()
    return {k: len(v) for k, v in triton_keys.variants(launches).items()}


def moe(t: int) -> None:
    """Kimi-Linear's experts with the shared one fused (257, top 8 + 1), as a step of t tokens."""
    from deltaserve.kernels.moe.cuda import fused_moe_cuda

    ids = torch.empty(t, 9, device=M, dtype=torch.long)
    fused_moe_cuda(
        meta(t, 2304), meta(257, 2048, 2304), meta(257, 2304, 1024), ids, torch.empty(t, 9, device=M)
    )


def test_moe_compiles_once_per_tile_choice(triton_keys) -> None:
    """Steps of 15 to 227 tokens (136 to 2043 assignments) take one set of GEMM tiles; the
    alignment takes one program, its sort as wide as the assignments' next power of two (256 up
    to 28 tokens, 512 up to 56, 1024 up to 113), then four launches. Within each of those, every
    count of tokens, a multiple of 16 or not, runs the same compiled kernels."""
    for tokens in (range(15, 29), range(29, 57), range(57, 114), range(114, 228)):
        variants = count(triton_keys, [lambda t=t: moe(t) for t in tokens])
        assert variants and all(n == 1 for n in variants.values()), (tokens, variants)


def test_prefill_token_counts_compile_once(triton_keys) -> None:
    """The conv, the q/k normalisation before FLA, the gated norm at one tiling (tensor parallel:
    4 heads a rank) and paged attention's prefill (its page table as wide as the longest context)
    run one compiled kernel whatever a step's count of prefill tokens and pages."""
    from deltaserve.kernels.attention.cuda import paged_prefill_launch
    from deltaserve.kernels.conv.triton import conv_prefill_launch
    from deltaserve.kernels.gdn.triton import qk_norm_v_launch
    from deltaserve.kernels.norm.triton import gated_rms_norm_launch

    dim, width = 3 * 4096, 4
    one = torch.zeros(1, device=M, dtype=torch.int32)

    def conv(p: int) -> None:
        x = meta(p + 3, dim)[3:]  # after three decode rows
        conv_prefill_launch(
            x,
            meta(64, dim, width - 1),
            meta(dim, width),
            None,
            meta(2, dtype=torch.int32),
            one,
            one,
            meta(p, dim),
            True,
        )

    def qk_norm(p: int) -> None:
        q, k, v = (part.view(p, 32, 128) for part in meta(p, dim).split(4096, dim=-1))
        qk_norm_v_launch(q, k, v)

    def gated_norm(t: int) -> None:
        gated_rms_norm_launch(meta(t, 4, 128), meta(t, 4, 128), meta(128), 1e-6, rows=1)

    def attention(pages: int) -> None:
        q = meta(40, 16, 256)
        cu = meta(2, dtype=torch.int32)
        table = torch.zeros(1, pages, device=M, dtype=torch.int32)
        paged_prefill_launch(q, meta(512, 16, 2, 256), meta(512, 16, 2, 256), table, cu, one, 0.06, q, 40)

    sizes = [1, 2, 3, 15, 16, 17, 32, 77, 1000, 1024, 4097]
    calls = [lambda p=p, f=f: f(p) for p in sizes for f in (conv, qk_norm, gated_norm, attention)]
    assert count(triton_keys, calls) == {
        "_conv_prefill_kernel": 1,
        "_conv_final_state_kernel": 1,
        "_qk_norm_v_kernel": 1,
        "_gated_rms_norm_kernel": 1,
        "_paged_prefill_kernel": 1,
    }


def step_kernels(t: int) -> None:
    """What depends on a step's t tokens alone in a Kimi-Linear layer: the norms, the KDA gate,
    the router and the experts (the shared one fused up to 512 tokens, as on CUDA)."""
    from deltaserve.kernels.moe.cuda import fused_moe_cuda
    from deltaserve.kernels.norm.triton import add_rms_norm_launch, gated_rms_norm_launch, kda_gate_launch
    from deltaserve.kernels.router.triton import topk_route_launch

    add_rms_norm_launch(meta(t, 2304), meta(t, 2304), meta(2304), 1e-5, False)
    gated_rms_norm_launch(meta(t, 32, 128), meta(t, 32, 128), meta(128), 1e-5, "sigmoid")
    kda_gate_launch(meta(t, 4096), meta(4096), meta(32), 128)
    shared = t <= 512
    logits = meta(t, 256, dtype=torch.float32)
    topk_route_launch(
        logits, meta(256, dtype=torch.float32), 8, True, 2.446, True, 2 * shared, torch.bfloat16
    )
    k = 8 + shared
    ids = torch.empty(t, k, device=M, dtype=torch.long)
    fused_moe_cuda(
        meta(t, 2304), meta(257, 2048, 2304), meta(257, 2304, 1024), ids, torch.empty(t, k, device=M)
    )


@pytest.mark.slow
def test_the_warm_up_step_sizes_meet_every_variant_of_a_step(triton_keys, monkeypatch) -> None:
    """Each variant that Kimi-Linear's steps of 1 to 8192 tokens ask for, one a class of sizes
    (powers of two of the tokens or of the assignments, 9 or 8 a token; the MoE's paths), is
    met by a step of the engine's warm-up (`warm_up_step_tokens`), none first while serving."""
    from deltaserve.engine.engine import warm_up_step_tokens
    from deltaserve.kernels.moe import cuda

    monkeypatch.setattr(cuda, "_grouped_mm_device", lambda device: True)  # Hopper's grouped GEMM

    def keys(sizes) -> set:  # type: ignore[no-untyped-def]
        with triton_keys.recorded_launches() as launches:
            for t in sizes:
                step_kernels(t)
        return set(launches)

    serving = keys(range(1, 8193))
    warmed = keys(warm_up_step_tokens(8192))
    assert len(serving) > 20 and serving - warmed == set()


@pytest.mark.slow
def test_with_piecewise_graphs_the_warm_up_meets_every_variant_of_a_step_past_them(
    triton_keys, monkeypatch
) -> None:
    """Piecewise graphs (`--enable-piecewise-cuda-graph`) compile Kimi-Linear's step kernels at
    each of `piecewise_sizes` tokens at capture, without PDL as eager steps launch; a step of more
    tokens than the largest runs eagerly. The captures and the warm-up's prefill steps of more
    tokens (`warm_up_step_tokens`) meet every variant that steps of the largest + 1 to the step
    budget ask for, where the captures alone do not."""
    from deltaserve.engine.engine import warm_up_step_tokens
    from deltaserve.engine.runner.piecewise_graphs import piecewise_sizes
    from deltaserve.kernels.moe import cuda

    monkeypatch.setattr(cuda, "_grouped_mm_device", lambda device: True)
    per_size: dict[int, set] = {}

    def keys(sizes) -> set:  # type: ignore[no-untyped-def]
        for t in set(sizes) - per_size.keys():
            with triton_keys.recorded_launches() as launches:
                step_kernels(t)
            per_size[t] = set(launches)
        return set().union(*(per_size[t] for t in sizes))

    for budget, largest in ((8192, 16), (8192, 100), (8192, 1000), (6000, 300), (2048, 512)):
        captured = piecewise_sizes(largest)
        serving = keys(range(largest + 1, budget + 1))
        eager = [t for t in warm_up_step_tokens(budget) if t > largest]
        assert serving - keys(captured) != set(), largest
        assert serving - keys(captured + eager) == set(), largest


def decode_step(n: int, context: int, tp: int, kv_heads: int = KV_HEADS) -> None:
    """What a decode step of n rows, the longest `context` positions, launches per layer that
    could pick its variant by them: Qwen3.5-35B-A3B's GDN decode and full attention (Qwen3.5-9B's
    with 4 `kv_heads`), a rank's heads of `tp`, and Kimi-Linear's MLA decode (its KDA decode,
    FLA's, takes the rows at run time)."""
    from deltaserve.kernels.attention.cuda import paged_attention_cuda
    from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

    hk, hv, dim = 16 // tp, 32 // tp, 128
    slots = torch.zeros(n, device=M, dtype=torch.int32)
    gates = (meta(hv, dtype=torch.float32), meta(hv, dtype=torch.float32))
    pool = meta(512, hv, dim, dim, dtype=torch.float32)
    gdn_decode_cuda(
        meta(n, hk, dim), meta(n, hk, dim), meta(n, hv, dim), meta(n, hv), meta(n, hv), pool, slots, gates
    )
    mla_decode(n, context)
    paged_attention_cuda(
        meta(n, Q_HEADS // tp, HEAD_DIM),
        meta(4096, PAGE, kv_heads // tp, HEAD_DIM),
        meta(4096, PAGE, kv_heads // tp, HEAD_DIM),
        torch.zeros(n, -(-context // PAGE), device=M, dtype=torch.int32),
        torch.arange(n + 1, device=M, dtype=torch.int32),
        torch.zeros(n, device=M, dtype=torch.int32),
        HEAD_DIM**-0.5,
        1,
    )


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("running", [256, 6, 12, 100])
def test_the_warm_up_decode_steps_meet_every_variant_of_a_decode_step(triton_keys, tp, running) -> None:
    """Eager decode steps of 1 to `running` rows beside contexts up to 32k ask for GDN decode's
    narrow and wide value tiles and paged decode's 64- and 32-key tiles; the warm-up's decode
    steps (`warm_up_decode_rows`, the longest row `WARM_UP_DECODE_CONTEXT` long) meet each."""
    from deltaserve.engine.engine import WARM_UP_DECODE_CONTEXT, warm_up_decode_rows

    def keys(steps) -> set:  # type: ignore[no-untyped-def]
        with triton_keys.recorded_launches() as launches:
            for n, context in steps:
                decode_step(n, context, tp)
        return set(launches)

    serving = keys((n, c) for n in range(1, running + 1) for c in (16, 300, 2049, 4096, 32768))
    warmed = keys((n, WARM_UP_DECODE_CONTEXT) for n in warm_up_decode_rows(running))
    assert serving - warmed == set()
    variants = triton_keys.variants(list(serving))
    wide_from = {1: 9, 2: 17}[tp]  # rows from which GDN decode's tiles give each SM 4 programs
    assert len(variants["_gdn_decode_kernel"]) == (2 if running >= wide_from else 1)
    assert len(variants["_paged_decode_kernel"]) == 2


def verify_step(decodes: int, windows: int, width: int, tp: int) -> None:
    """What a step of `decodes` decode rows, then `windows` verification windows (the widest
    `width` tokens) or prompts, launches per layer that could pick its variant by them: Qwen3.5-
    35B-A3B's GDN layer (the decode rows; the windows' gates, conv and delta rule over the
    projection's rows after the decodes) and full attention (queries of several tokens: the
    prefill kernel), a rank's heads of `tp`, and Kimi-Linear's conv and KDA windows."""
    from deltaserve.kernels.attention.cuda import paged_attention_cuda
    from deltaserve.kernels.gdn.cuda import gdn_decode_cuda
    from deltaserve.kernels.norm.triton import gdn_gates_launch
    from deltaserve.kernels.window.cuda import conv_window_cuda, delta_window_cuda

    n, t = decodes + windows, decodes + windows * width
    rows = slice(decodes, t)  # the windows' tokens
    slots = torch.zeros(windows, device=M, dtype=torch.int32)
    pad = torch.arange(windows * width, device=M)
    hk, hv, dim = 16 // tp, 32 // tp, 128
    conv_dim = (2 * hk + hv) * dim
    proj = meta(t, conv_dim + hv * dim + 2 * hv)  # in_proj's rows: the conv's input, z, b, a
    b, a = proj[:, -2 * hv : -hv], proj[:, -hv:]
    conv_pool, conv_window = meta(512, conv_dim, 3), meta(32, 4, conv_dim, 3)
    conv_window_cuda(
        proj[rows, :conv_dim], conv_pool, meta(conv_dim, 4), None, slots, pad, width, conv_window
    )
    q, k, v = (x.view(t, -1, dim) for x in meta(t, conv_dim).split([hk * dim, hk * dim, hv * dim], dim=-1))
    pool = meta(512, hv, dim, dim, dtype=torch.float32)
    if decodes:
        gates = (meta(hv, dtype=torch.float32), meta(hv, dtype=torch.float32))
        decode_slots = torch.zeros(decodes, device=M, dtype=torch.int32)
        gdn_decode_cuda(
            q[:decodes], k[:decodes], v[:decodes], a[:decodes], b[:decodes], pool, decode_slots, gates
        )
    g, beta = gdn_gates_launch(a[rows], b[rows], meta(hv, dtype=torch.float32), meta(hv, dtype=torch.float32))
    window = meta(32, 4, hv, dim, dim, dtype=torch.float32)
    delta_window_cuda(q[rows], k[rows], v[rows], g, beta, pool, slots, pad, width, window, False)
    paged_attention_cuda(
        meta(t, Q_HEADS // tp, HEAD_DIM),
        meta(4096, PAGE, KV_HEADS // tp, HEAD_DIM),
        meta(4096, PAGE, KV_HEADS // tp, HEAD_DIM),
        torch.zeros(n, 256, device=M, dtype=torch.int32),
        torch.zeros(n + 1, device=M, dtype=torch.int32),
        torch.zeros(n, device=M, dtype=torch.int32),
        HEAD_DIM**-0.5,
        width,
    )
    kh, kdim = 32 // tp, 3 * 32 // tp * dim  # Kimi-Linear: KDA heads of 128, q / k / v convolved
    kimi_conv, kimi_window = meta(512, kdim, 3), meta(32, 4, kdim, 3)
    conv_window_cuda(meta(t, kdim)[rows], kimi_conv, meta(kdim, 4), None, slots, pad, width, kimi_window)
    kq, kk, kv = (x.view(t, kh, dim)[rows] for x in meta(t, kdim).split(kh * dim, dim=-1))
    kda_pool, kda_window = (
        meta(512, kh, dim, dim, dtype=torch.float32),
        meta(32, 4, kh, dim, dim, dtype=torch.float32),
    )
    gate = meta(t - decodes, kh, dim, dtype=torch.float32)
    delta_window_cuda(kq, kk, kv, gate, meta(t - decodes, kh), kda_pool, slots, pad, width, kda_window, True)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("running, k", [(256, 3), (12, 2), (6, 4)])
def test_the_warm_up_meets_every_variant_of_a_verification_step(triton_keys, tp, running, k) -> None:
    """Speculative decoding: steps of 0 to `running` - 1 decode rows (eager, whether or not decode
    graphs were captured) beside 1 to `max_batch` verification windows, the widest 2 to k + 1
    tokens, ask for a conv and a delta-rule (GDN, KDA) window kernel per width and GDN decode's
    tiles; the warm-up meets each: windows of every width beside the last row count's other
    decode rows, and decode rows in its eager decode steps (`warm_up_decode_rows`) or, with
    graphs, beside the prompts that join its decode steps' requests."""
    from deltaserve.engine.engine import WARM_UP_DECODE_CONTEXT, warm_up_decode_rows

    def keys(calls) -> set:  # type: ignore[no-untyped-def]
        with triton_keys.recorded_launches() as launches:
            for call in calls:
                call()
        return set(launches)

    widths = range(2, k + 2)
    verify = min(32, running)  # max_batch's default
    serving = keys(
        lambda d=d, w=w, width=width: verify_step(d, w, width, tp)
        for d in range(running)
        for w in {1, 2, verify}
        if d + w <= running
        for width in widths
    )
    variants = triton_keys.variants(list(serving))
    assert len(variants["_conv_window_kernel"]) == k and len(variants["_delta_window_kernel"]) == 2 * k
    for captured in (0, running):  # eager, and decode graphs of every row count
        eager = not captured
        rows = warm_up_decode_rows(running, captured)
        beside = rows[-1] - 1  # the last count's other requests decode beside the window
        windows = [lambda width=width, d=beside: verify_step(d, 1, width, tp) for width in widths]
        if eager:
            decodes = [lambda n=n: decode_step(n, WARM_UP_DECODE_CONTEXT, tp) for n in rows]
        else:  # decode rows beside the prompts that join them
            decodes = [lambda d=d: verify_step(d, 0, 2, tp) for d in rows[:-1]]
        assert serving - keys(windows + decodes) == set(), eager


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("running", [256, 32, 12, 6])
def test_with_decode_graphs_the_warm_up_meets_every_variant_of_decode_rows_beside_prompts(
    triton_keys, tp, running
) -> None:
    """Where decode graphs were captured, decode steps replay them (their kernels compiled at
    capture, with PDL up to 32 tokens, which eager steps do not use, so none is counted here), but
    a step with prompts runs its 1 to `running` - 1 decode rows eagerly: GDN decode's narrow tile,
    and its wide one from about four programs an SM. The warm-up's decode steps
    (`warm_up_decode_rows(running, captured=running)`) have prompts join beside one decode row and
    beside `running` - 1, which meet both."""
    from deltaserve.engine.engine import warm_up_decode_rows

    def keys(decodes) -> set:  # type: ignore[no-untyped-def]
        with triton_keys.recorded_launches() as launches:
            for d in decodes:
                verify_step(d, 0, 2, tp)  # no windows: d decode rows beside a prompt
        return set(launches)

    serving = keys(range(1, running))
    assert serving - keys(warm_up_decode_rows(running, captured=running)[:-1]) == set()
    wide_from = {1: 9, 2: 17}[tp]
    assert len(triton_keys.variants(list(serving))["_gdn_decode_kernel"]) == (2 if running > wide_from else 1)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("running, captured", [(256, 8), (256, 32), (256, 64), (48, 16), (100, 64)])
def test_with_decode_graphs_the_warm_up_meets_every_variant_of_decode_steps_past_them(
    triton_keys, tp, kv_heads, running, captured
) -> None:
    """With `--cuda-graph-max-bs` below `--max-running-requests`, decode steps of `captured` + 1
    to `running` rows run eagerly, beside contexts short and long: paged decode's 64-key tile
    (short contexts, while the grid is at most two programs an SM), its 32-key tile and its merge
    (long ones), GDN decode's tiles, MLA decode. The warm-up's decode steps past the graphs,
    beside its long request (`warm_up_decode_rows`) and of short contexts only
    (`warm_up_short_decode_rows`, 8 tokens of prompt), and the decode rows beside its prompts
    (all but the last count) meet each."""
    from deltaserve.engine.engine import (
        WARM_UP_DECODE_CONTEXT,
        warm_up_decode_rows,
        warm_up_short_decode_rows,
    )

    def keys(calls) -> set:  # type: ignore[no-untyped-def]
        with triton_keys.recorded_launches() as launches:
            for call in calls:
                call()
        return set(launches)

    def step(n: int, context: int):  # type: ignore[no-untyped-def]
        return lambda: decode_step(n, context, tp, kv_heads)

    contexts = (9, 300, 2049, 4096, 32768)
    serving = keys(step(n, c) for n in range(captured + 1, running + 1) for c in contexts)
    rows = warm_up_decode_rows(running, captured)
    warmed = keys(
        [step(n, WARM_UP_DECODE_CONTEXT) for n in rows if n > captured]
        + [step(n, 9) for n in warm_up_short_decode_rows(running, captured)]
        + [lambda d=d: verify_step(d, 0, 2, tp) for d in rows[:-1]]
    )
    assert serving - warmed == set()
    tiles = {
        p[2]
        for launch in serving
        if launch.kernel == "_paged_decode_kernel"
        for p in launch.key
        if p[0] == "BN"
    }
    few = (captured + 1) * kv_heads // tp <= 2 * 132  # a row one split: at most two programs an SM
    assert tiles == ({"64", "32"} if few else {"32"})


FP8 = torch.float8_e4m3fn


def fp8_weight(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight `[..., n, k]` and its 128 x 128 block scales."""
    *e, n, k = shape
    return meta(*shape, dtype=FP8), meta(*e, -(-n // 128), -(-k // 128), dtype=torch.float32)


@pytest.fixture
def cuda_ops(monkeypatch):  # type: ignore[no-untyped-def]
    """The ops' CUDA paths on `meta` tensors: their dispatch says fast, cuBLAS's block-scaled GEMM
    returns its output unwritten, Hopper's grouped GEMM is there and no quantized rows are kept."""
    from deltaserve.kernels import fp8, linear, moe, norm, router
    from deltaserve.kernels.fp8 import cuda as fp8_cuda
    from deltaserve.kernels.moe import cuda as moe_cuda

    for module in (fp8, linear, moe, norm, router):
        monkeypatch.setattr(module, "use_fast_path", lambda t: True)

    def scaled_mm(a, b, scale_a, scale_b, out_dtype, out=None):  # type: ignore[no-untyped-def]
        return torch.empty(a.shape[0], b.shape[1], device=M, dtype=out_dtype) if out is None else out

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(moe_cuda, "_grouped_mm_device", lambda device: True)
    monkeypatch.setattr(fp8_cuda, "_kept", None)


def test_fp8_step_rows_compile_once_per_tile(triton_keys, cuda_ops) -> None:
    """The FP8 path's kernels at Qwen3-Next-80B's sizes: within each class of rows that takes one
    tiling (the activation quantization's rows a program, a power of two up to 32; the skinny GEMM's
    16 or 32 rows; cuBLAS's rows, their scales group-major; the Triton GEMM's 32-row tiles; the
    skinny MoE's K split; the grouped MoE's alignment past the skinny MoE's 192 assignments, one sort
    width up to 512), every count of rows, 1, a multiple of 16 or neither, runs the same compiled
    kernels."""
    from deltaserve.kernels.fp8.cuda import fp8_gemm_cuda, fp8_moe_cuda, fp8_moe_skinny_cuda, fp8_skinny_cuda

    def skinny(m: int) -> None:  # GDN's in_proj: q, k, v, z in FP8, b and a unquantized
        fp8_skinny_cuda(meta(m, 2048), *fp8_weight(12288, 2048), 128, dense=meta(64, 2048))

    def cublas(m: int) -> None:
        fp8_gemm_cuda(meta(m, 2048), *fp8_weight(12288, 2048), 128)

    def triton_gemm(m: int) -> None:  # where cuBLAS does not fit, or `DELTASERVE_FP8_DECODE=gemm`
        fp8_gemm_cuda(meta(m, 2048), *fp8_weight(12288, 2048), 128, cublas=False)

    def skinny_moe(t: int) -> None:  # 512 experts and the shared one, top 10 + 1
        ids = torch.empty(t, 11, device=M, dtype=torch.long)
        experts = (*fp8_weight(513, 1024, 2048), *fp8_weight(513, 2048, 512))
        fp8_moe_skinny_cuda(meta(t, 2048), *experts, 128, ids, torch.empty(t, 11, device=M))

    def grouped_moe(t: int) -> None:  # past the skinny MoE's 192 assignments
        ids = torch.empty(t, 11, device=M, dtype=torch.long)
        experts = (*fp8_weight(513, 1024, 2048), *fp8_weight(513, 2048, 512))
        fp8_moe_cuda(meta(t, 2048), *experts, 128, ids, torch.empty(t, 11, device=M))

    classes = [(skinny, r) for r in (range(3, 5), range(5, 9), range(9, 17))]
    classes += [(skinny, range(17, 33)), (cublas, range(33, 300, 7)), (cublas, range(300, 9000, 997))]
    classes += [(triton_gemm, range(17, 33)), (skinny_moe, range(9, 17)), (grouped_moe, range(18, 47))]
    for f, rows in classes:  # as many variants as the class's first count of rows asks for
        variants = count(triton_keys, [lambda m=m, f=f: f(m) for m in rows])
        assert variants == count(triton_keys, [lambda f=f, m=rows[0]: f(m)]), (f.__name__, rows, variants)


def qwen_config(name: str) -> dict:
    """A config of configs/, its text model's fields at the top."""
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "configs", name, "config.json")) as f:
        c = json.load(f)
    return {**c, **c.get("text_config", {})}


def qwen_step_kernels(t: int, c: dict) -> None:
    """What depends on a step's t tokens alone in a Qwen3-Next / Qwen3.5 GDN layer and attention
    layer, each with its norms and MLP, as the model runs them on CUDA (FP8: every projection but
    the router's, the decode rows' quantization done by the op before; the shared expert fused up to
    512 tokens). The conv, the q/k norm before FLA and paged attention are counted above."""
    from deltaserve.kernels.fp8 import fp8_linear, fp8_moe
    from deltaserve.kernels.linear import linear, silu_mul_linear
    from deltaserve.kernels.moe import fused_moe
    from deltaserve.kernels.norm import (
        add_rms_norm,
        gated_rms_norm,
        gdn_gates,
        rms_norm_rope,
        sigmoid_gate,
        silu_and_mul,
    )
    from deltaserve.kernels.router import softmax_topk

    fp8, h = "quantization_config" in c, c["hidden_size"]

    def proj(x: torch.Tensor, n: int, dense: int = 0) -> torch.Tensor:
        if not fp8:
            return linear(x, meta(n + dense, x.shape[1]))
        return fp8_linear(
            x, *fp8_weight(n, x.shape[1]), 128, dense=meta(dense, x.shape[1]) if dense else None
        )

    def norm(x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, x, meta(h), 1e-6, True, fp8)[0]

    def dense_mlp(x: torch.Tensor, inter: int) -> torch.Tensor:
        gate_up = proj(x, 2 * inter)
        if fp8:
            return proj(silu_and_mul(gate_up, True), h)
        return silu_mul_linear(gate_up, meta(h, inter))

    def mlp(x: torch.Tensor) -> None:
        x = norm(x)
        e, inter = c.get("num_experts"), c.get("moe_intermediate_size")
        if not e:
            dense_mlp(x, c["intermediate_size"])
            return
        fused = t <= 512
        logits = linear(x, meta(-(-(e + 1) // 16) * 16, h))[:, : e + 1]  # the shared expert's gate last
        ids, weights = softmax_topk(logits if fused else logits[:, :e], c["num_experts_per_tok"], True, fused)
        experts = (e + fused, 2 * inter, h), (e + fused, h, inter)
        if fp8:
            fp8_moe(x, *fp8_weight(*experts[0]), *fp8_weight(*experts[1]), 128, ids, weights)
        else:
            fused_moe(x, meta(*experts[0]), meta(*experts[1]), ids, weights)
        if not fused:
            dense_mlp(x, c["shared_expert_intermediate_size"])

    x = meta(t, h)
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    key, value = hk * c["linear_key_head_dim"], hv * c["linear_value_head_dim"]
    p = proj(norm(x), 2 * key + 2 * value, dense=2 * hv)  # q, k, v, z in FP8; b, a unquantized
    gdn_gates(p[:, -hv:], p[:, -2 * hv : -hv], meta(hv), meta(hv))
    z = p[:, 2 * key + value : 2 * key + 2 * value].view(t, hv, -1)
    o = gated_rms_norm(meta(t, hv, value // hv), z, meta(value // hv), 1e-6, "silu", fp8)
    mlp(proj(o.view(t, value), h))

    heads, kv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    qkv = proj(norm(x), 2 * heads * d + 2 * kv * d)
    q, gate = qkv[:, : 2 * heads * d].view(t, heads, 2 * d).chunk(2, dim=-1)
    inv_freq = meta(d // 8, dtype=torch.float32)  # a quarter of each head rotated, as all of them do
    positions = torch.empty(t, device=M, dtype=torch.long)
    rms_norm_rope(q, meta(d), 1e-6, positions, inv_freq)
    rms_norm_rope(
        qkv[:, 2 * heads * d : (2 * heads + kv) * d].view(t, kv, d), meta(d), 1e-6, positions, inv_freq
    )
    o = sigmoid_gate(meta(t, heads, d), gate, fp8)
    mlp(proj(o.view(t, heads * d), h))


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["qwen3-next-80b-a3b-fp8", "qwen3.5-9b-fp8", "qwen3.5-35b-a3b", "qwen3.5-9b"]
)
def test_the_warm_up_step_sizes_meet_every_variant_of_a_qwen_step(triton_keys, cuda_ops, name) -> None:
    """As for Kimi-Linear: each variant that the model's steps of 1 to 8192 tokens ask for is met by
    a step of the warm-up (`warm_up_step_tokens`)."""
    from deltaserve.engine.engine import warm_up_step_tokens

    c = qwen_config(name)

    def keys(sizes) -> set:  # type: ignore[no-untyped-def]
        with triton_keys.recorded_launches() as launches:
            for t in sizes:
                qwen_step_kernels(t, c)
        return set(launches)

    serving = keys(range(1, 8193))
    warmed = keys(warm_up_step_tokens(8192))
    assert len(serving) > 10 and serving - warmed == set()
