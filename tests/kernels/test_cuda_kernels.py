"""The fast CUDA paths (FLA, our Triton kernels) held to the torch references, on the GPU.

References run on the same CUDA tensors with `DELTASERVE_REFERENCE_KERNELS=1`; errors are
measured as ||out - ref|| / ||ref||. Pools are filled with random data so that a wrong slot,
a missed write or a stray write shows.
"""

from __future__ import annotations

import pytest
import torch

from deltaserve.kernels.attention import paged_attention
from deltaserve.kernels.common.per_forward import PerForwardCache
from deltaserve.kernels.conv import conv_decode, conv_prefill
from deltaserve.kernels.gdn import gdn_decode, gdn_prefill

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEV = "cuda"
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def reference(monkeypatch: pytest.MonkeyPatch, op, *args, **kwargs):
    with monkeypatch.context() as m:
        m.setenv("DELTASERVE_REFERENCE_KERNELS", "1")
        return op(*args, **kwargs)


def pick_slots(n: int, num_slots: int) -> torch.Tensor:
    """n distinct slots in a scrambled order, never slot 0 (the padding slot)."""
    return (torch.randperm(num_slots - 1)[:n] + 1).to(torch.int32).to(DEV)


def cu_from(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEV)


def assert_untouched(after: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> None:
    keep = torch.ones(after.shape[0], dtype=torch.bool, device=DEV)
    keep[slots.long()] = False
    assert keep[0], "slot 0 must stay unaddressed in these tests"
    assert torch.equal(after[keep], before[keep])


# --- GDN -------------------------------------------------------------------------------


def gdn_inputs(total: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype):
    q = torch.randn(total, hk, dk, device=DEV, dtype=dtype)
    k = torch.randn(total, hk, dk, device=DEV, dtype=dtype)
    v = torch.randn(total, hv, dv, device=DEV, dtype=dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(total, hv, device=DEV)) * 0.5
    beta = torch.rand(total, hv, device=DEV).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hk", "hv", "dk", "dv"), [(2, 4, 128, 128), (3, 3, 64, 32), (2, 8, 128, 64)])
@pytest.mark.parametrize("batch", [1, 7, 70])
def test_gdn_decode(monkeypatch, dtype, hk, hv, dk, dv, batch):
    from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

    num_slots = 2 * batch + 3
    pool = torch.randn(num_slots, hv, dk, dv, device=DEV) * 0.1
    slots = pick_slots(batch, num_slots)
    inputs = gdn_inputs(batch, hk, hv, dk, dv, dtype)
    ref_pool = pool.clone()
    ref = reference(monkeypatch, gdn_decode, *inputs, ref_pool, slots)
    before = pool.clone()
    out = gdn_decode_cuda(*inputs, pool, slots)
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(pool[slots.long()], ref_pool[slots.long()]) < 2e-5
    assert_untouched(pool, before, slots)


def test_gdn_decode_cuda_graph(monkeypatch):
    from deltaserve.kernels.gdn.cuda import gdn_decode_cuda

    batch, hk, hv, dk, dv, num_slots = 8, 2, 4, 128, 128, 20
    pool = torch.randn(num_slots, hv, dk, dv, device=DEV) * 0.1
    static = [t.clone() for t in gdn_inputs(batch, hk, hv, dk, dv, torch.bfloat16)]
    slots = pick_slots(batch, num_slots)
    gdn_decode_cuda(*static, pool.clone(), slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn_decode_cuda(*static, pool, slots)
    for _ in range(2):
        for buf, new in zip(static, gdn_inputs(batch, hk, hv, dk, dv, torch.bfloat16)):
            buf.copy_(new)
        slots.copy_(pick_slots(batch, num_slots))
        ref_pool = pool.clone()
        ref = reference(monkeypatch, gdn_decode, *static, ref_pool, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < TOL[torch.bfloat16]
        assert rel_err(pool, ref_pool) < 2e-5


@pytest.mark.parametrize(
    ("dtype", "hk", "hv", "dk", "dv"), [(torch.bfloat16, 2, 4, 128, 128), (torch.float32, 2, 2, 64, 64)]
)
def test_gdn_prefill(monkeypatch, dtype, hk, hv, dk, dv):
    from deltaserve.kernels.gdn.cuda import gdn_prefill_cuda

    lengths = [1, 63, 64, 65, 130, 7, 200]
    has_init = torch.tensor([True, False, True, True, False, True, False], device=DEV)
    num_slots = 12
    pool = torch.randn(num_slots, hv, dk, dv, device=DEV) * 0.1
    slots = pick_slots(len(lengths), num_slots)
    cu = cu_from(lengths)
    inputs = gdn_inputs(sum(lengths), hk, hv, dk, dv, dtype)
    ref_pool = pool.clone()
    ref = reference(monkeypatch, gdn_prefill, *inputs, cu, ref_pool, slots, has_init)
    before = pool.clone()
    out = gdn_prefill_cuda(*inputs, cu, pool, slots, has_init)
    # FLA computes its chunk products in TF32 / bf16, hence looser bounds than decode.
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and out.shape == ref.shape
    assert rel_err(out, ref) < tol
    assert rel_err(pool[slots.long()], ref_pool[slots.long()]) < tol
    assert_untouched(pool, before, slots)


def test_gdn_prefill_refilled_cu_seqlens(monkeypatch):
    """A cu_seqlens buffer refilled in place must not reuse FLA's chunk indices of the
    previous batch (FLA caches them by tensor identity)."""
    from deltaserve.kernels.gdn.cuda import gdn_prefill_cuda

    hk, hv, dim, num_slots = 2, 4, 128, 6
    cu = cu_from([100, 30])
    slots = pick_slots(2, num_slots)
    has_init = torch.tensor([False, True], device=DEV)
    pool = torch.randn(num_slots, hv, dim, dim, device=DEV) * 0.1
    cache = PerForwardCache()  # as the engine's backend keeps one
    for lengths in ([100, 30], [7, 123]):
        cu.copy_(cu_from(lengths))
        inputs = gdn_inputs(130, hk, hv, dim, dim, torch.bfloat16)
        ref_pool = pool.clone()
        ref = reference(monkeypatch, gdn_prefill, *inputs, cu, ref_pool, slots, has_init)
        out = gdn_prefill_cuda(*inputs, cu, pool, slots, has_init, cache=cache)
        assert rel_err(out, ref) < 2e-2
        assert rel_err(pool, ref_pool) < 2e-2


def test_gdn_prefill_direct_equals_public(monkeypatch):
    """FLA's forward called below its entry point (the default, `_fla_forward`; q and k
    normalised by our kernel instead of FLA's) gives the public call's outputs and states, on
    strided views of one projection as the model passes them."""
    from deltaserve.kernels.gdn import cuda as gdn_cuda

    hk, hv, dk, dv, num_slots = 2, 4, 128, 128, 8
    lengths = [5, 64, 190, 33]
    total = sum(lengths)
    wide = torch.randn(total, 2 * hk * dk + hv * dv + 3, device=DEV, dtype=torch.bfloat16)
    q, k, v = wide[:, 3:].split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(total, hk, dk), k.view(total, hk, dk), v.view(total, hv, dv)
    assert not q.is_contiguous()
    _, _, _, g, beta = gdn_inputs(total, hk, hv, dk, dv, torch.bfloat16)
    slots = pick_slots(len(lengths), num_slots)
    has_init = torch.tensor([True, False, True, False], device=DEV)
    pool = torch.randn(num_slots, hv, dk, dv, device=DEV) * 0.1
    results = []
    try:
        for direct in ("1", "0"):
            monkeypatch.setenv("DELTASERVE_FLA_DIRECT", direct)
            gdn_cuda._fla_forward.cache_clear()
            assert (gdn_cuda._fla_forward() is not None) == (direct == "1")
            p = pool.clone()
            out = gdn_cuda.gdn_prefill_cuda(q, k, v, g, beta, cu_from(lengths), p, slots, has_init)
            results.append((out, p))
    finally:
        gdn_cuda._fla_forward.cache_clear()
    assert rel_err(results[0][0], results[1][0]) < 1e-2
    assert rel_err(results[0][1], results[1][1]) < 1e-2
    assert_untouched(results[0][1], pool, slots)


def test_cached_launches_equal_tritons_path(monkeypatch):
    """After the first call of a kind, launches skip Triton's Python path (fast_launch.py): they
    must run what Triton's path runs. The GDN prefill (FLA's kernels, our qk-norm, the initial
    state gather) gives bit-identical outputs and states either way, over batches of other sizes
    and initial states, and the second round takes the cached path."""
    import fla.ops.common.chunk_o as fla_chunk_o

    from deltaserve.kernels.common import fast_launch
    from deltaserve.kernels.gdn import triton as gdn_triton
    from deltaserve.kernels.gdn.cuda import gdn_prefill_cuda

    hk, hv, dk, dv, num_slots = 2, 4, 128, 128, 16
    kernels = (gdn_triton._qk_norm_v_kernel, fla_chunk_o.chunk_fwd_kernel_o)
    hits = [fast_launch.cached_launches(k) for k in kernels]
    for lengths in [[5, 64, 190, 33], [1000], [7, 7, 130], [64, 1, 300, 12, 77]] * 2:
        n = len(lengths)
        inputs = gdn_inputs(sum(lengths), hk, hv, dk, dv, torch.bfloat16)
        slots = pick_slots(n, num_slots)
        has_init = torch.rand(n, device=DEV) < 0.5
        pool = torch.randn(num_slots, hv, dk, dv, device=DEV) * 0.1
        cached_pool, plain_pool = pool.clone(), pool.clone()
        cached = gdn_prefill_cuda(*inputs, cu_from(lengths), cached_pool, slots, has_init)
        with fast_launch.plain_launches():
            plain = gdn_prefill_cuda(*inputs, cu_from(lengths), plain_pool, slots, has_init)
        assert torch.equal(cached, plain) and torch.equal(cached_pool, plain_pool)
        ref_pool = pool.clone()
        ref = reference(monkeypatch, gdn_prefill, *inputs, cu_from(lengths), ref_pool, slots, has_init)
        assert rel_err(cached, ref) < 2e-2 and rel_err(cached_pool, ref_pool) < 2e-2
    assert all(fast_launch.cached_launches(k) >= before + 4 for k, before in zip(kernels, hits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("t", "hk", "hv", "dk", "dv"), [(8192, 16, 16, 128, 128), (37, 3, 3, 64, 32), (70, 1, 2, 48, 80)]
)
def test_qk_norm_v(dtype, t, hk, hv, dk, dv):
    """q and k L2-normalised and v copied, contiguous, from strided views: against torch and
    against FLA's own l2norm_fwd (which the public FLA call uses)."""
    from fla.modules.norm.l2norm import l2norm_fwd

    from deltaserve.kernels.gdn.triton import qk_norm_v_launch

    wide = torch.randn(t, 2 * hk * dk + hv * dv + 7, device=DEV, dtype=dtype)
    q, k, v = wide[:, 7:].split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv)
    qo, ko, vo = qk_norm_v_launch(q, k, v)
    assert qo.is_contiguous() and ko.is_contiguous() and vo.is_contiguous()
    for got, x in ((qo, q), (ko, k)):
        xf = x.float()
        ref = xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6)
        assert rel_err(got, ref) < TOL[dtype]
        fla = l2norm_fwd(x.contiguous())[0]
        assert (got.float() - fla.float()).abs().max() <= (2e-6 if dtype == torch.float32 else 8e-3)
    assert torch.equal(vo, v)


# --- causal conv -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize(("use_bias", "activation"), [(True, "silu"), (False, None)])
def test_conv_decode(monkeypatch, dtype, width, use_bias, activation):
    from deltaserve.kernels.conv.cuda import conv_decode_cuda

    batch, dim, num_slots = 9, 300, 16
    pool = torch.randn(num_slots, dim, width - 1, device=DEV).to(dtype)
    weight = torch.randn(dim, width, device=DEV).to(dtype)
    bias = torch.randn(dim, device=DEV).to(dtype) if use_bias else None
    x = torch.randn(batch, dim, device=DEV).to(dtype)
    slots = pick_slots(batch, num_slots)
    ref_pool = pool.clone()
    ref = reference(monkeypatch, conv_decode, x, ref_pool, weight, bias, slots, activation)
    before = pool.clone()
    out = conv_decode_cuda(x, pool, weight, bias, slots, activation)
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(pool, ref_pool)  # the new history is a copy, exact in any dtype
    assert_untouched(pool, before, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_prefill(monkeypatch, dtype, width):
    from deltaserve.kernels.conv.cuda import conv_prefill_cuda

    lengths = [1, 2, 3, 64, 70, 5, 1]
    has_init = torch.tensor([True, True, False, True, False, True, False], device=DEV)
    dim, num_slots = 200, 12
    pool = torch.randn(num_slots, dim, width - 1, device=DEV).to(dtype)
    weight = torch.randn(dim, width, device=DEV).to(dtype)
    bias = torch.randn(dim, device=DEV).to(dtype)
    x = torch.randn(sum(lengths), dim, device=DEV).to(dtype)
    slots = pick_slots(len(lengths), num_slots)
    cu = cu_from(lengths)
    ref_pool = pool.clone()
    ref = reference(monkeypatch, conv_prefill, x, ref_pool, weight, bias, cu, slots, has_init, "silu")
    before = pool.clone()
    out = conv_prefill_cuda(x, pool, weight, bias, cu, slots, has_init, "silu")
    assert rel_err(out, ref) < TOL[dtype]
    assert torch.equal(pool, ref_pool)
    assert_untouched(pool, before, slots)


def test_conv_prefill_refilled_cu_seqlens(monkeypatch):
    """The tokens' sequence index is kept per cu_seqlens object (once per forward): a buffer
    refilled in place with other lengths must not reuse the old index."""
    from deltaserve.kernels.conv.cuda import conv_prefill_cuda

    dim, width, num_slots = 96, 4, 6
    weight = torch.randn(dim, width, device=DEV)
    slots = pick_slots(2, num_slots)
    has_init = torch.tensor([True, True], device=DEV)
    cu = cu_from([50, 10])
    cache = PerForwardCache()  # as the engine's backend keeps one
    for lengths in ([50, 10], [3, 57]):
        cu.copy_(cu_from(lengths))
        pool = torch.randn(num_slots, dim, width - 1, device=DEV)
        x = torch.randn(60, dim, device=DEV)
        ref_pool = pool.clone()
        ref = reference(monkeypatch, conv_prefill, x, ref_pool, weight, None, cu, slots, has_init, "silu")
        out = conv_prefill_cuda(x, pool, weight, None, cu, slots, has_init, "silu", cache=cache)
        assert rel_err(out, ref) < TOL[torch.float32]
        assert torch.equal(pool, ref_pool)


def test_conv_decode_cuda_graph(monkeypatch):
    from deltaserve.kernels.conv.cuda import conv_decode_cuda

    batch, dim, width, num_slots = 4, 128, 4, 10
    pool = torch.randn(num_slots, dim, width - 1, device=DEV)
    weight = torch.randn(dim, width, device=DEV)
    x = torch.randn(batch, dim, device=DEV)
    slots = pick_slots(batch, num_slots)
    conv_decode_cuda(x, pool.clone(), weight, None, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = conv_decode_cuda(x, pool, weight, None, slots)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        slots.copy_(pick_slots(batch, num_slots))
        ref_pool = pool.clone()
        ref = reference(monkeypatch, conv_decode, x, ref_pool, weight, None, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < TOL[torch.float32]
        assert torch.equal(pool, ref_pool)


# --- paged attention -------------------------------------------------------------------


def paged_inputs(q_lens, seq_lens, hq, hkv, dim, page, dtype):
    """A cache whose pages are handed out in scrambled order, page 0 left as padding."""
    pages_per = [-(-s // page) for s in seq_lens]
    num_pages = sum(pages_per) + 4
    k_cache = torch.randn(num_pages, page, hkv, dim, device=DEV).to(dtype)
    v_cache = torch.randn(num_pages, page, hkv, dim, device=DEV).to(dtype)
    order = (torch.randperm(num_pages - 1) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(pages_per) + 2, dtype=torch.int32)
    for i, n in enumerate(pages_per):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    q = torch.randn(sum(q_lens), hq, dim, device=DEV).to(dtype)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    return q, k_cache, v_cache, table.to(DEV), cu_from(q_lens), seq


ATTN_TOL = {torch.float32: 1e-4, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv", "page"), [(8, 2, 16), (4, 4, 64), (6, 1, 1)])
def test_paged_decode(monkeypatch, dtype, dim, hq, hkv, page):
    seq_lens = [1, 37, 1500, 200, 64]
    args = paged_inputs([1] * len(seq_lens), seq_lens, hq, hkv, dim, page, dtype)
    scale = dim**-0.5
    ref = reference(monkeypatch, paged_attention, *args, scale)
    out = paged_attention(*args, scale, max_seqlen_q=1)
    assert rel_err(out, ref) < ATTN_TOL[dtype]


@pytest.mark.parametrize("splits", [1, 3, 32])
def test_paged_decode_splits(monkeypatch, splits):
    from deltaserve.kernels.attention.cuda import paged_decode_launch

    seq_lens = [1, 700, 33, 2048]
    args = paged_inputs([1] * len(seq_lens), seq_lens, 8, 2, 128, 16, torch.bfloat16)
    ref = reference(monkeypatch, paged_attention, *args, 0.1)
    out = torch.full_like(args[0], float("nan"))
    paged_decode_launch(*args, 0.1, out, splits, 64)
    assert rel_err(out, ref) < ATTN_TOL[torch.bfloat16]


def test_paged_decode_cuda_graph(monkeypatch):
    from deltaserve.kernels.attention.cuda import paged_attention_cuda

    q, k_cache, v_cache, table, cu, seq = paged_inputs([1] * 4, [900] * 4, 8, 2, 128, 16, torch.bfloat16)
    seq.copy_(torch.tensor([5, 300, 900, 17], device=DEV))
    paged_attention_cuda(q, k_cache, v_cache, table, cu, seq, 0.1, 1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_cuda(q, k_cache, v_cache, table, cu, seq, 0.1, 1)
    for lengths in ([900, 1, 64, 65], [33, 800, 2, 899]):
        seq.copy_(torch.tensor(lengths, device=DEV))
        q.copy_(torch.randn_like(q))
        ref = reference(monkeypatch, paged_attention, q, k_cache, v_cache, table, cu, seq, 0.1)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref) < ATTN_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv", "page"), [(8, 2, 16), (4, 4, 32)])
def test_paged_prefill(monkeypatch, dtype, dim, hq, hkv, page):
    q_lens = [1, 17, 64, 100, 130]
    prefix = [0, 5, 100, 0, 33]
    seq_lens = [p + n for p, n in zip(prefix, q_lens)]
    args = paged_inputs(q_lens, seq_lens, hq, hkv, dim, page, dtype)
    scale = dim**-0.5
    ref = reference(monkeypatch, paged_attention, *args, scale)
    out = paged_attention(*args, scale)  # max_seqlen_q computed inside
    assert rel_err(out, ref) < ATTN_TOL[dtype]
    out = paged_attention(*args, scale, max_seqlen_q=max(q_lens))
    assert rel_err(out, ref) < ATTN_TOL[dtype]
