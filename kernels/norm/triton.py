"""Triton kernels of `deltaserve.kernels.norm`: one program per row, one launch per op.

Rows are addressed as `[T, H, D]` with strides `(s0, s1, 1)`, so that per-head views of fused
projections (q beside its gate, z inside `in_proj`'s output) are read in place; a plain `[T, D]`
input is `H = 1`. Outputs are contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltaserve.kernels.common.fast_launch import fast_launch_module
from deltaserve.kernels.common.pdl import pdl_args, wait_inputs
from deltaserve.kernels.fp8.triton import e4m3_groups


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x with a unit last stride, H, s0, s1) describing x as rows `[T, H, D]`."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    if x.dim() == 3:
        return x, x.shape[1], x.stride(0), x.stride(1)
    x = x.reshape(-1, x.shape[-1])
    return x, 1, x.stride(0), 0


GATED_NORM_ELEMENTS = 2048  # a gated norm program's rows x columns at most (16 rows of 128)


def _warps(block: int) -> int:
    return 1 if block <= 256 else 4 if block <= 2048 else 8


def _row_warps(block: int) -> int:
    """A whole-row norm's warps: 8 columns a thread, the vector width of its loads and stores,
    so that its outputs are stored in the layout they were loaded in (no shared-memory shuffle)."""
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(
    x,
    res,
    w,
    y,
    res_out,
    q,
    qs,
    H,
    sx0,
    sx1,
    sr0,
    sr1,
    D,
    eps,
    ZERO_CENTERED: tl.constexpr,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    # the row as [BLOCK // C, C] groups of C = 128 columns: a group's max (the FP8 scale) stays
    # within a warp, where a flat row would be reshaped through shared memory first
    C: tl.constexpr = 128 if BLOCK > 128 else BLOCK
    o = tl.arange(0, BLOCK // C)[:, None] * C + tl.arange(0, C)[None, :]
    m = o < D
    wv = tl.load(w + o, mask=m, other=0.0).to(tl.float32)  # weights: no kernel writes them
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    t = r // H
    h = r % H
    xv = tl.load(x + t * sx0 + h * sx1 + o, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        rv = tl.load(res + t * sr0 + h * sr1 + o, mask=m, other=0.0).to(tl.float32)
        s = (xv + rv).to(res_out.dtype.element_ty)  # the unfused model's add, rounded alike
        tl.store(res_out + r * D + o, s, mask=m)
        xv = s.to(tl.float32)
    n = xv * tl.rsqrt(tl.sum(tl.sum(xv * xv, 1), 0) / D + eps)
    if ZERO_CENTERED:
        out = n * (1.0 + wv)
    else:
        out = n.to(y.dtype.element_ty).to(tl.float32) * wv
    out = out.to(y.dtype.element_ty)
    tl.store(y + r * D + o, out, mask=m)
    if QUANT:  # whole groups (C = 128): `_quantized_out` asks BLOCK % 128 == 0
        codes, scale = e4m3_groups(out.to(tl.float32), BLOCK // C, C)
        tl.store(q + r * D + o, codes, mask=m)
        g = tl.arange(0, BLOCK // C)[:, None]
        tl.store(qs + r * tl.cdiv(D, C) + g, scale, mask=g * C < D)


@triton.jit
def _store_quantized(v, q, qs, rows, row_ok, col0, D, R: tl.constexpr, BLOCK: tl.constexpr):
    """Output values v `[R, BLOCK]` in the output's dtype (`rows` of a `[*, D]` output, columns
    from col0, a multiple of 128) quantized as `act_quant_cuda` would read them back: e4m3 into q
    `[*, D]`, each 128-channel group's scale into qs `[*, ceil(D / 128)]`."""
    codes, scale = e4m3_groups(v.to(tl.float32), R, BLOCK)
    cols = col0 + tl.arange(0, BLOCK)
    tl.store(q + rows[:, None] * D + cols[None, :], codes, mask=row_ok[:, None] & (cols < D)[None, :])
    groups = tl.cdiv(D, 128)
    g = col0 // 128 + tl.arange(0, BLOCK // 128)
    tl.store(qs + rows[:, None] * groups + g[None, :], scale, mask=row_ok[:, None] & (g < groups)[None, :])


@triton.jit
def _store_quantized_row(v, q, qs, row, col0, D, BLOCK: tl.constexpr):
    """`_store_quantized` of one row's values v `[BLOCK]`."""
    rows = row + tl.zeros((1,), tl.int64)
    _store_quantized(v[None, :], q, qs, rows, rows >= 0, col0, D, 1, BLOCK)


def _quantized_out(
    y: torch.Tensor, rows: int, k: int, block: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(q, scales) for an op that quantizes its output `y` seen as `[rows, k]` (decode's few rows,
    whole 128-channel groups a program), or None where it should not."""
    from deltaserve.kernels.fp8.cuda import FUSED_QUANT_ROWS, quantized_buffers

    if rows > FUSED_QUANT_ROWS or block % 128:
        return None
    return quantized_buffers(rows, k, y.device)


def _norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    shape = x.shape
    d = shape[-1]
    xr, h, sx0, sx1 = _rows(x)
    rows = xr.shape[0] * h if xr.dim() == 3 else xr.shape[0]
    y = torch.empty(shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    quant = _quantized_out(y, rows, d, block) if quantize and x.dim() == 2 else None
    res_out = None
    sr0 = sr1 = 0
    rr = xr
    if residual is not None:
        assert residual.shape == shape, (residual.shape, shape)
        rr, hr, sr0, sr1 = _rows(residual)
        assert hr == h
        res_out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            xr,
            rr,
            weight,
            y,
            res_out if res_out is not None else y,
            *(quant or (y, y)),
            h,
            sx0,
            sx1,
            sr0,
            sr1,
            d,
            eps,
            ZERO_CENTERED=zero_centered,
            HAS_RES=residual is not None,
            BLOCK=block,
            QUANT=quant is not None,
            num_warps=_row_warps(block),
            **pdl_args(xr.device),
        )
    _keep(y, quant)
    return y, res_out


def _keep(y: torch.Tensor, quant: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    if quant is not None:
        from deltaserve.kernels.fp8.cuda import keep_quantized

        keep_quantized(y, *quant)


def rms_norm_launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered: bool, quantize: bool = False
) -> torch.Tensor:
    """`quantize`: also the output's block-FP8 rows, which the next FP8 matmul of it takes
    (`kernels.fp8.cuda.keep_quantized`; decode's few rows of a 2-D x only)."""
    return _norm(x, None, weight, eps, zero_centered, quantize)[0]


def add_rms_norm_launch(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    zero_centered: bool,
    quantize: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    y, s = _norm(x, residual, weight, eps, zero_centered, quantize)
    assert s is not None
    return y, s


@triton.jit(do_not_specialize=["R"])  # the step's (token, head) rows: one compile for every count
def _gated_rms_norm_kernel(
    x,
    z,
    w,
    y,
    q,
    qs,
    R,
    H,
    sx0,
    sx1,
    sz0,
    sz1,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    SIGMOID_FP32: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    # ROWS (token, head) rows a program: one 128-wide row is too little work for a program
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = r // H
    h = r % H
    o = tl.arange(0, BLOCK)
    m = (r < R)[:, None] & (o < D)[None, :]
    xv = tl.load(x + (t * sx0 + h * sx1)[:, None] + o[None, :], mask=m, other=0.0).to(tl.float32)
    n = xv * tl.rsqrt(tl.sum(xv * xv, 1) / D + eps)[:, None]
    wv = tl.load(w + o, mask=o < D, other=0.0).to(tl.float32)[None, :]
    zv = tl.load(z + (t * sz0 + h * sz1)[:, None] + o[None, :], mask=m, other=0.0).to(tl.float32)
    if SIGMOID_FP32:  # KDA: w * norm(x) * sigmoid(z), all fp32
        out = wv * n * tl.sigmoid(zv)
    else:  # GDN: (w * norm(x) rounded to x's dtype) * silu(z)
        v = (n.to(y.dtype.element_ty).to(tl.float32) * wv).to(y.dtype.element_ty).to(tl.float32)
        out = v * zv * tl.sigmoid(zv)
    tl.store(y + r[:, None] * D + o[None, :], out.to(y.dtype.element_ty), mask=m)
    if QUANT:  # a (token, head) row is whole groups of its token's row (D a multiple of 128)
        _store_quantized(out.to(y.dtype.element_ty), q, qs, r, r < R, 0, D, ROWS, BLOCK)


def gated_rms_norm_launch(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    kind: str = "silu",
    rows: int | None = None,
    quantize: bool = False,
) -> torch.Tensor:
    """`rows`: (token, head) rows a program (default: one for decode-sized inputs, up to
    GATED_NORM_ELEMENTS' worth for prefill; the sweep in docs/kernels.md). `quantize`: as
    `rms_norm_launch`'s, of the output seen as `[T, H * D]` (a head dimension of whole groups)."""
    assert x.shape == gate.shape and x.dim() == 3, (x.shape, gate.shape)
    t, h, d = x.shape
    xr, _, sx0, sx1 = _rows(x)
    zr, _, sz0, sz1 = _rows(gate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    quant = _quantized_out(y, t, h * d, block) if quantize and d % 128 == 0 else None
    if t * h:
        if rows is None:  # several rows a program once there are programs enough for the SMs
            rows = max(1, min(GATED_NORM_ELEMENTS // block, triton.next_power_of_2(t * h) // 512))
        _gated_rms_norm_kernel[(triton.cdiv(t * h, rows),)](
            xr,
            zr,
            weight,
            y,
            *(quant or (y, y)),
            t * h,
            h,
            sx0,
            sx1,
            sz0,
            sz1,
            d,
            eps,
            ROWS=rows,
            BLOCK=block,
            SIGMOID_FP32=kind == "sigmoid",
            QUANT=quant is not None,
            num_warps=_warps(rows * block),
            **pdl_args(xr.device),
        )
    _keep(y, quant)
    return y


@triton.jit
def _kda_gate_kernel(f, dt_bias, A_log, g, HD, sf, D: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < HD
    u = tl.load(f + t * sf + o, mask=m, other=0.0).to(tl.float32)
    u += tl.load(dt_bias + o, mask=m, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(A_log + o // D, mask=m, other=0.0).to(tl.float32))
    softplus = tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(tl.minimum(u, 20.0))))
    tl.store(g + t * HD + o, -decay * softplus, mask=m)


def kda_gate_launch(
    f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, head_dim: int
) -> torch.Tensor:
    assert f.dim() == 2 and f.stride(-1) == 1 and f.shape[1] % head_dim == 0, f.shape
    t, hd = f.shape
    g = torch.empty((t, hd // head_dim, head_dim), dtype=torch.float32, device=f.device)
    if t:
        block = min(1024, triton.next_power_of_2(hd))
        _kda_gate_kernel[(t, triton.cdiv(hd, block))](
            f, dt_bias, A_log, g, hd, f.stride(0), D=head_dim, BLOCK=block, num_warps=4, **pdl_args(f.device)
        )
    return g


@triton.jit
def _rms_norm_rope_kernel(
    x,
    w,
    pos,
    inv_freq,
    y,
    H,
    s0,
    s1,
    D,
    eps,
    HALF: tl.constexpr,
    BH: tl.constexpr,
    BR: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    r = tl.program_id(0).to(tl.int64)
    t = r // H
    h = r % H
    base = x + t * s0 + h * s1
    rot = 2 * HALF
    o1 = tl.arange(0, BH)
    m1 = o1 < HALF
    orr = tl.arange(0, BR)
    mr = orr < D - rot
    x1 = tl.load(base + o1, mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + o1, mask=m1, other=0.0).to(tl.float32)
    xr = tl.load(base + rot + orr, mask=mr, other=0.0).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0) + tl.sum(xr * xr, 0)) / D + eps)
    dt = y.dtype.element_ty
    w1 = tl.load(w + o1, mask=m1, other=0.0).to(tl.float32)
    w2 = tl.load(w + HALF + o1, mask=m1, other=0.0).to(tl.float32)
    wr = tl.load(w + rot + orr, mask=mr, other=0.0).to(tl.float32)
    # the reference rounds the norm's output, cos and sin to x's dtype before rotating
    y1 = (x1 * inv * (1.0 + w1)).to(dt).to(tl.float32)
    y2 = (x2 * inv * (1.0 + w2)).to(dt).to(tl.float32)
    yr = xr * inv * (1.0 + wr)
    f = tl.load(pos + t).to(tl.float32) * tl.load(inv_freq + o1, mask=m1, other=0.0)
    c = tl.cos(f).to(dt).to(tl.float32)  # angles reach 1e5 rad: the GPU test holds them to torch
    s = tl.sin(f).to(dt).to(tl.float32)
    out = y + r * D
    tl.store(out + o1, (y1 * c - y2 * s).to(dt), mask=m1)
    tl.store(out + HALF + o1, (y2 * c + y1 * s).to(dt), mask=m1)
    tl.store(out + rot + orr, yr.to(dt), mask=mr)


def rms_norm_rope_launch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor
) -> torch.Tensor:
    assert x.dim() == 3 and positions.shape[0] == x.shape[0], (x.shape, positions.shape)
    t, h, d = x.shape
    half = inv_freq.shape[0]
    assert 2 * half <= d
    xr, _, s0, s1 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if t * h:
        _rms_norm_rope_kernel[(t * h,)](
            xr,
            weight,
            positions,
            inv_freq,
            y,
            h,
            s0,
            s1,
            d,
            eps,
            HALF=half,
            BH=triton.next_power_of_2(max(half, 1)),
            BR=triton.next_power_of_2(max(d - 2 * half, 1)),
            num_warps=1 if d <= 256 else 4,
            **pdl_args(xr.device),
        )
    return y


@triton.jit
def gdn_log_decay(a, dt_bias, A_log):
    """GDN's log-decay `-exp(A_log) * softplus(a + dt_bias)` from fp32 values (softplus linear
    above 20, as torch's); also inlined by the GDN decode kernel."""
    u = a + dt_bias
    return -tl.exp(A_log) * tl.where(u > 20.0, u, tl.log(1.0 + tl.exp(tl.minimum(u, 20.0))))


@triton.jit
def _gdn_gates_kernel(a, b, A_log, dt_bias, g, beta, H, sa, sb, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    m = o < H
    av = tl.load(a + t * sa + o, mask=m, other=0.0).to(tl.float32)
    bias = tl.load(dt_bias + o, mask=m, other=0.0).to(tl.float32)
    a_log = tl.load(A_log + o, mask=m, other=0.0).to(tl.float32)
    tl.store(g + t * H + o, gdn_log_decay(av, bias, a_log), mask=m)
    bv = tl.load(b + t * sb + o, mask=m, other=0.0).to(tl.float32)
    tl.store(beta + t * H + o, tl.sigmoid(bv).to(beta.dtype.element_ty), mask=m)


def gdn_gates_launch(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    assert a.dim() == 2 and a.shape == b.shape and a.stride(-1) == 1 and b.stride(-1) == 1
    t, h = a.shape
    g = torch.empty((t, h), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, h), dtype=b.dtype, device=b.device)
    if t:
        _gdn_gates_kernel[(t,)](
            a,
            b,
            A_log,
            dt_bias,
            g,
            beta,
            h,
            a.stride(0),
            b.stride(0),
            BLOCK=triton.next_power_of_2(h),
            num_warps=1,
            **pdl_args(a.device),
        )
    return g, beta


@triton.jit
def _silu_and_mul_kernel(x, y, q, qs, N, sx, BLOCK: tl.constexpr, QUANT: tl.constexpr, PDL: tl.constexpr):
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    gate = tl.load(x + t * sx + o, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x + t * sx + N + o, mask=m, other=0.0)
    # the reference rounds silu(gate) to x's dtype before the product
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    out = (act * up.to(tl.float32)).to(y.dtype.element_ty)
    tl.store(y + t * N + o, out, mask=m)
    if QUANT:
        _store_quantized_row(out, q, qs, t, tl.program_id(1) * BLOCK, N, BLOCK)


def silu_and_mul_launch(x: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """`quantize`: as `rms_norm_launch`'s."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0, x.shape
    t, i = x.shape[0], x.shape[1] // 2
    y = torch.empty((t, i), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(i))
    quant = _quantized_out(y, t, i, block) if quantize else None
    if t:
        _silu_and_mul_kernel[(t, triton.cdiv(i, block))](
            x, y, *(quant or (y, y)), i, x.stride(0), BLOCK=block, QUANT=quant is not None, num_warps=4,
            **pdl_args(x.device),
        )  # fmt: skip
    _keep(y, quant)
    return y


@triton.jit
def _sigmoid_gate_kernel(
    x,
    gate,
    y,
    q,
    qs,
    H,
    sxt,
    sxh,
    sgt,
    sgh,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    QUANT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    o = tl.arange(0, BLOCK)
    m = o < D
    xv = tl.load(x + t * sxt + h * sxh + o, mask=m, other=0.0)
    gv = tl.load(gate + t * sgt + h * sgh + o, mask=m, other=0.0)
    # as torch: the sigmoid rounded to the gate's dtype, the product in fp32 rounded to x's
    act = tl.sigmoid(gv.to(tl.float32)).to(gv.dtype).to(tl.float32)
    out = (xv.to(tl.float32) * act).to(y.dtype.element_ty)
    tl.store(y + (t * H + h) * D + o, out, mask=m)
    if QUANT:  # as the gated norm's: a head is whole groups of its token's row
        _store_quantized_row(out, q, qs, t * H + h, 0, D, BLOCK)


def sigmoid_gate_launch(x: torch.Tensor, gate: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """`quantize`: as `gated_rms_norm_launch`'s."""
    assert x.dim() == 3 and x.shape == gate.shape and x.stride(-1) == 1 and gate.stride(-1) == 1
    assert x.dtype == gate.dtype, (x.dtype, gate.dtype)
    t, h, d = x.shape
    y = torch.empty((t, h, d), dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(d)
    quant = _quantized_out(y, t, h * d, block) if quantize and d % 128 == 0 else None
    if t:
        _sigmoid_gate_kernel[(t, h)](
            x,
            gate,
            y,
            *(quant or (y, y)),
            h,
            x.stride(0),
            x.stride(1),
            gate.stride(0),
            gate.stride(1),
            D=d,
            BLOCK=block,
            QUANT=quant is not None,
            num_warps=_warps(block),
            **pdl_args(x.device),
        )
    _keep(y, quant)
    return y


fast_launch_module(__name__)  # Triton's per-call Python work once per kind of call (fast_launch.py)
