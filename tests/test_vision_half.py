"""The vision family in f16 and bf16 (issue 32): conv, conv_transpose and the weight gradient
through each tier, pool and its gradient, batch norm's channel_affine, resample (pad, resize,
adaptive_avg_pool), against float64 NumPy written here from the half-rounded inputs
(tests/halfref.py: the kernels compute in f32 and round once, so the error is about one
rounding of the output). A convolution with many input channels x taps shows an f32
accumulator: a half one fails it."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from halfref import HALVES, HOST, assert_half_close, f64, rounded
from rlx_numba.ir.opdef import F32, opdef
from rlx_numba.ir.ops_vision import half_product

VISION_OPS = ("conv", "conv_transpose", "conv_wgrad", "implicit_gemm", "im2col", "col2im",
              "pool", "pool_grad", "channel_affine", "resample")


def test_dtype_rules():
    assert all(opdef(op).dtype_rule == F32 for op in VISION_OPS)


# ---- float64 references ---------------------------------------------------------------------
def _tup(v, d):
    return (v,) * d if np.isscalar(v) else tuple(v)


def conv_ref(x, w, stride=1, pads=None, dilation=1, groups=1):
    """y [N, K, *O] = sum over (c, tap) of w * x at o*stride - pad_lo + tap*dilation; ``pads``
    (lo, hi) a spatial dim."""
    x, w = f64(x), f64(w)
    d = w.ndim - 2
    st, dl, k = _tup(stride, d), _tup(dilation, d), w.shape[2:]
    xp = np.pad(x, [(0, 0), (0, 0)] + list(pads or [(0, 0)] * d))
    n, c = x.shape[:2]
    cg, kg = c // groups, w.shape[0] // groups
    out = [(xp.shape[2 + i] - dl[i] * (k[i] - 1) - 1) // st[i] + 1 for i in range(d)]
    y = np.zeros((n, w.shape[0], *out))
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * dl[i], tap[i] * dl[i] + st[i] * (out[i] - 1) + 1, st[i])
                   for i in range(d))
        patch = xp[(slice(None), slice(None)) + sl]
        for g in range(groups):
            y[:, g * kg:(g + 1) * kg] += np.einsum(
                "kc,nc...->nk...", w[(slice(g * kg, (g + 1) * kg), slice(None)) + tap],
                patch[:, g * cg:(g + 1) * cg])
    return y


def conv_t_ref(z, w, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    """Each z element scattered through the kernel, then the padding cropped."""
    z, w = f64(z), f64(w)
    d = w.ndim - 2
    st, p, op, dl = (_tup(v, d) for v in (stride, padding, output_padding, dilation))
    n, c = z.shape[:2]
    size, k = z.shape[2:], w.shape[2:]
    cg, og = c // groups, w.shape[1]
    full = [(size[i] - 1) * st[i] + dl[i] * (k[i] - 1) + 1 + op[i] for i in range(d)]
    y = np.zeros((n, og * groups, *full))
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * dl[i], tap[i] * dl[i] + st[i] * (size[i] - 1) + 1, st[i])
                   for i in range(d))
        for g in range(groups):
            y[(slice(None), slice(g * og, (g + 1) * og)) + sl] += np.einsum(
                "co,nc...->no...", w[(slice(g * cg, (g + 1) * cg), slice(None)) + tap],
                z[:, g * cg:(g + 1) * cg])
    return y[(slice(None), slice(None)) + tuple(slice(p[i], full[i] - p[i]) for i in range(d))]


def wgrad_ref(x, dy, k, stride=1, pads=None, dilation=1, groups=1):
    """dw [K, C/G, *k] = sum over (n, o) of dy[n, kk, o] * x at o's window position for tap."""
    x, dy = f64(x), f64(dy)
    d = len(k)
    st, dl = _tup(stride, d), _tup(dilation, d)
    xp = np.pad(x, [(0, 0), (0, 0)] + list(pads or [(0, 0)] * d))
    c, kc = x.shape[1], dy.shape[1]
    cg, kg = c // groups, kc // groups
    out = dy.shape[2:]
    dw = np.zeros((kc, cg) + tuple(k))
    n = x.shape[0]
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * dl[i], tap[i] * dl[i] + st[i] * (out[i] - 1) + 1, st[i])
                   for i in range(d))
        patch = xp[(slice(None), slice(None)) + sl]
        for g in range(groups):
            dw[(slice(g * kg, (g + 1) * kg), slice(None)) + tap] = np.einsum(
                "nkl,ncl->kc", dy[:, g * kg:(g + 1) * kg].reshape(n, kg, -1),
                patch[:, g * cg:(g + 1) * cg].reshape(n, cg, -1))
    return dw


def _inputs(rng, dtype, **shapes):
    return {name: rounded(rng.standard_normal(s), dtype) for name, s in shapes.items()}


# ---- conv, conv_transpose, the weight gradient ------------------------------------------------
CONV_CASES = [
    # x, w, kwargs (padding given as (lo, hi) a dim for the reference)
    ((2, 3, 9, 7), (4, 3, 3, 3), dict(stride=2, padding=1), [(1, 1), (1, 1)]),
    ((1, 4, 7, 6), (6, 2, 3, 2), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2),
     [(1, 1), (2, 2)]),
    ((1, 3, 6, 5), (5, 3, 1, 1), dict(), None),                                     # 1x1
    ((1, 2, 7, 6), (3, 2, 4, 3), dict(padding="same"), [(1, 2), (1, 1)]),           # even: hi+1
    ((2, 3, 11), (5, 3, 4), dict(stride=3, dilation=2, padding=2), [(2, 2)]),       # 1-d
]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("xs,ws,kw,pads", CONV_CASES)
def test_conv(rng, dtype, xs, ws, kw, pads):
    """conv with bias (in x's dtype, as torch's) on the simulator's tiers (the numba
    implicit-GEMM kernel; tier 1 for a 1x1)."""
    a = _inputs(rng, dtype, x=xs, w=ws, b=(ws[0],))
    g = rlx.Graph("conv")
    x, w, b = (g.input(k, v.shape, dtype) for k, v in a.items())
    y = g.conv(x, w, b, **kw)
    g.set_outputs([y, g.conv(x, w, **kw)])
    got, plain = run_graph(g, a)
    want = conv_ref(a["x"], a["w"], kw.get("stride", 1), pads, kw.get("dilation", 1),
                    kw.get("groups", 1))
    assert_half_close(plain, want, dtype, what="conv")
    bshape = (1, -1) + (1,) * (len(xs) - 2)
    # off cuDNN the conv rounds, then the bias add (as torch's unfused conv + add): two
    # roundings, the first of |conv|, which can exceed |y| where the bias cancels it
    assert_half_close(got, want + f64(a["b"]).reshape(bshape), dtype, what="conv + bias",
                      scale=np.abs(want) + np.abs(want).max() * 2.0 ** -6)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("tier", [
    "2", pytest.param("0", marks=pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on a GPU"))])
def test_conv_epilogue_fused_in_half(rng, monkeypatch, dtype, tier):
    """relu(conv + bias + z) and relu(conv + bias) in half fold into the conv (passes/fusion.py's
    conv epilogue): one implicit-GEMM kernel each on tier 2 (its tile store), one
    cudnnConvolutionBiasActivationForward each on tier 0, rounding once after the relu; NaN in
    z propagates through the relu (as torch's). z is -conv + a little: conv + bias + z cancels
    to ~0.02 where |conv| ~ 3, so a chain that rounded the conv to half first (the unfused
    one: conv, then each add, rounded) would be off by u |conv|, ~100x the bound of one
    rounding of the result checked here. The third output is the many-term case with bias
    and relu folded: a half accumulator fails it (``_accumulation_case``)."""
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", tier)
    a = _inputs(rng, dtype, x=(2, 3, 7, 6), w=(4, 3, 3, 3))
    a["b"] = rounded(0.01 * rng.standard_normal(4), dtype)
    conv = conv_ref(a["x"], a["w"], 1, [(1, 1), (1, 1)])
    a["z"] = rounded(-conv + 0.01 * rng.standard_normal(conv.shape), dtype)
    a["z"][1, 2, 3, 4] = np.nan
    xa, wa, pads = _accumulation_case(rng, dtype)
    a["xa"], a["wa"], a["ba"] = xa, wa, rounded(rng.standard_normal(2), dtype)
    g = rlx.Graph("epi")
    x, w, b, z, xat, wat, bat = (g.input(k, v.shape, dtype) for k, v in a.items())
    g.set_outputs([g.relu(g.add(g.conv(x, w, b, padding=1), z)),
                   g.relu(g.conv(x, w, b, padding=1)),
                   g.relu(g.conv(xat, wat, bat, padding=1))])
    exe = rlx.compile(g)
    y1, y2, y3 = exe.run(a)
    cb = conv + f64(a["b"]).reshape(1, -1, 1, 1)
    want1 = np.maximum(cb + f64(a["z"]), 0)           # (np.maximum keeps the NaN)
    assert_half_close(y1, want1, dtype, what="relu(conv + b + z)",
                      scale=np.nanmax(want1) * 2.0 ** -6)
    assert np.isnan(y1[1, 2, 3, 4]) and np.isnan(f64(y1)).sum() == 1
    assert_half_close(y2, np.maximum(cb, 0), dtype, what="relu(conv + b)")
    want3 = np.maximum(conv_ref(xa, wa, 1, pads) + f64(a["ba"]).reshape(1, -1, 1, 1), 0)
    assert_half_close(y3, want3, dtype, what="relu(conv + b) of 576 terms")
    names = [s.kernel_name for s in exe.steps]
    what = "cudnn fwd" if tier == "0" else "numba implicit-GEMM conv"
    assert len(names) == 3, names
    assert sum(f"{what} +bias +z relu" in k for k in names) == 1, names
    assert sum(f"{what} +bias relu" in k for k in names) == 2, names


@pytest.mark.parametrize("dtype", HALVES)
def test_conv_unbatched_3d(rng, dtype):
    a = _inputs(rng, dtype, x=(2, 4, 3, 5), w=(3, 2, 2, 2, 3))
    g = rlx.Graph("c3")
    x, w = g.input("x", a["x"].shape, dtype), g.input("w", a["w"].shape, dtype)
    g.set_outputs([g.conv(x, w, stride=(1, 1, 2), padding=(1, 0, 1))])
    (got,) = run_graph(g, a)
    want = conv_ref(a["x"][None], a["w"], (1, 1, 2), [(1, 1), (0, 0), (1, 1)])[0]
    assert_half_close(got, want, dtype, what="conv 3-d")


T_CASES = [
    ((2, 4, 4, 5), (4, 3, 3, 3), dict(stride=2, padding=1, output_padding=1)),
    ((1, 4, 3, 4), (4, 1, 2, 3), dict(stride=(1, 2), dilation=(2, 1), groups=2)),
    ((1, 3, 7), (3, 2, 5), dict(stride=2, padding=2)),
]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("zs,ws,kw", T_CASES)
def test_conv_transpose(rng, dtype, zs, ws, kw):
    a = _inputs(rng, dtype, z=zs, w=ws)
    g = rlx.Graph("ct")
    z, w = g.input("z", zs, dtype), g.input("w", ws, dtype)
    g.set_outputs([g.conv_transpose(z, w, **kw)])
    (got,) = run_graph(g, a)
    assert_half_close(got, conv_t_ref(a["z"], a["w"], **kw), dtype, what="conv_transpose")


def _wgrad_graph(dtype, xs, dys, k, stride, pad, pad_hi, dilation, groups):
    g = rlx.Graph("wg")
    x, dy = g.input("x", xs, dtype), g.input("dy", dys, dtype)
    g.set_outputs([g.bind("conv_wgrad", (x, dy), kernel=k, stride=stride, pad=pad,
                          dilation=dilation, groups=groups, pad_hi=pad_hi)])
    return g


@pytest.mark.parametrize("dtype", HALVES)
def test_conv_wgrad(rng, dtype):
    """The weight gradient (im2col in half, its products and batch sum in f32, one rounding)."""
    k, st, dl, groups = (3, 2), (2, 1), (1, 2), 2
    xs, dys = (2, 4, 7, 6), (2, 6, 4, 4)
    a = _inputs(rng, dtype, x=xs, dy=dys)
    g = _wgrad_graph(dtype, xs, dys, k, st, (1, 1), (1, 1), dl, groups)
    (got,) = run_graph(g, a)
    want = wgrad_ref(a["x"], a["dy"], k, st, [(1, 1), (1, 1)], dl, groups)
    assert got.shape == (6, 2, 3, 2)
    assert_half_close(got, want, dtype, what="conv_wgrad")


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("tiers", ["1", "2"])
def test_conv_tiers_in_half(rng, monkeypatch, dtype, tiers):
    """Forward and transpose through tier 1 (im2col / col2im in half; the transpose's product
    in f32, its windows overlapping, so col2im sums unrounded columns) and tier 2 (the
    implicit-GEMM kernel reading half): each rounds once."""
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", tiers)
    kw = dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    a = _inputs(rng, dtype, x=(1, 4, 7, 6), w=(6, 2, 3, 3), z=(1, 6, 4, 4))
    g = rlx.Graph("tiers")
    x, w, z = (g.input(n, v.shape, dtype) for n, v in a.items())
    w1 = rounded(rng.standard_normal((5, 4, 1, 1)), dtype)     # a strided 1x1 (downsample)
    g.set_outputs([g.conv(x, w, **kw), g.conv_transpose(z, w, stride=2, padding=1, groups=2),
                   g.conv(x, g.constant(w1, dtype), stride=2)])
    exe = rlx.compile(g)
    y, yt, y1 = exe.run(a)
    assert_half_close(y1, conv_ref(a["x"], w1, (2, 2), [(0, 0), (0, 0)], (1, 1), 1), dtype,
                      what=f"strided 1x1 conv tier {tiers}")
    assert_half_close(y, conv_ref(a["x"], a["w"], (2, 1), [(1, 1), (1, 1)], (1, 2), 2), dtype,
                      what=f"conv tier {tiers}")
    assert_half_close(yt, conv_t_ref(a["z"], a["w"], 2, 1, groups=2), dtype,
                      what=f"conv_transpose tier {tiers}")
    names = " ".join(s.kernel_name for s in exe.steps)
    assert ("implicit-GEMM" in names) == (tiers == "2"), names
    assert ("im2col" in names) == (tiers == "1"), names
    assert ("col2im" in names) == (tiers == "1"), names


@pytest.mark.skipif(ON_GPU, reason="the lowering's choice, read off the numba product's name; "
                    "test_gpu_conv_transpose_off_cudnn_rounds_once checks the GPU's values")
@pytest.mark.parametrize("dtype", HALVES)
def test_conv_transpose_tier1_product_dtype(monkeypatch, dtype):
    """Tier 1's conv_transpose: where windows overlap (dilation * (k - 1) >= stride on an
    axis) its product is f32 (z and w cast up) and col2im sums f32 columns; where none do (a
    2x2 stride-2 upsampling) each image element is one column and the product stays half."""
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", "1")
    z = (1, 4, 3, 3)
    for kw, ws, wide in ((dict(stride=2), (4, 2, 2, 2), False),
                         (dict(padding=1, dilation=2, output_padding=1), (4, 2, 3, 3), True),
                         (dict(stride=(2, 1), padding=(0, 1)), (4, 2, 2, 3), True)):
        g = rlx.Graph("ctp")
        g.set_outputs([g.conv_transpose(g.input("z", z, dtype), g.input("w", ws, dtype), **kw)])
        names = [s.kernel_name for s in rlx.compile(g).steps]
        (mm,) = [n for n in names if "sgemm" in n]
        assert (f"{dtype}->{dtype}" not in mm) == wide, (kw, names)
        assert any("col2im" in n for n in names), names


@pytest.mark.skipif(not ON_GPU, reason="cuDNN and cuBLAS run on a GPU")
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("zs,ws,kw", [
    ((1, 1, 4), (1, 1, 3), dict(padding=1, dilation=2, output_padding=1)),    # the fuzzer's
    ((2, 6, 5, 4), (6, 2, 3, 3), dict(stride=(1, 2), padding=1, dilation=(2, 1),
                                      output_padding=(1, 0), groups=2)),
    ((1, 32, 6, 5), (32, 8, 3, 3), dict(padding=(1, 0), dilation=2, output_padding=(1, 0)))])
def test_gpu_conv_transpose_off_cudnn_rounds_once(rng, dtype, zs, ws, kw):
    """A half conv_transpose cuDNN declines (output_padding >= stride: padding unequal on the
    two sides) takes tier 1 on the default ladder: its overlapping columns are summed in f32
    and the image rounded once, within one rounding of float64 (it was 1-2 ulps off when the
    half product rounded each column before col2im's sum)."""
    a = _inputs(rng, dtype, z=zs, w=ws)
    g = rlx.Graph("ctgpu")
    g.set_outputs([g.conv_transpose(g.input("z", zs, dtype), g.input("w", ws, dtype), **kw)])
    exe = rlx.compile(g)
    names = [s.kernel_name for s in exe.steps]
    assert any("col2im" in n for n in names) and not any("cudnn" in n for n in names), names
    (got,) = exe.run(a)
    want = conv_t_ref(a["z"], a["w"], **kw)
    assert_half_close(got, want, dtype, k=1.0, what=f"conv_transpose {kw} {names}")


@pytest.mark.parametrize("dtype", HALVES)
def test_conv_and_pool_vjps_in_half(rng, dtype):
    """g.grad through conv and max pool in half: dx a half conv_transpose, dw a half
    conv_wgrad, the pool's a half pool_grad (the seed s is dy exactly)."""
    kw = dict(stride=2, padding=1, groups=2)
    a = _inputs(rng, dtype, x=(2, 4, 7, 6), w=(6, 2, 3, 3), s=(2, 6, 4, 3), t=(2, 4, 3, 3))
    g = rlx.Graph("vjp")
    x, w, sd, td = (g.input(n, v.shape, dtype) for n, v in a.items())
    y = g.conv(x, w, **kw)
    p = g.pool(x, "max", 2)
    dx, dw = g.grad(g.reduce_sum(g.mul(y, sd)), [x, w])
    (dxp,) = g.grad(g.reduce_sum(g.mul(p, td)), [x])
    g.set_outputs([dx, dw, dxp])
    got_dx, got_dw, got_dxp = run_graph(g, a)
    # dx is the transpose at x's size: its width 6 is conv_transpose's 5 + output_padding 1
    want_dx = conv_t_ref(a["s"], a["w"], 2, 1, output_padding=(0, 1), groups=2)
    assert_half_close(got_dx, want_dx, dtype, what="conv dx")
    assert_half_close(got_dw, wgrad_ref(a["x"], a["s"], (3, 3), 2, [(1, 1), (1, 1)], 1, 2),
                      dtype, what="conv dw")
    xx = f64(a["x"])[:, :, :6, :6].reshape(2, 4, 3, 2, 3, 2).transpose(0, 1, 2, 4, 3, 5)
    first = xx.reshape(2, 4, 3, 3, 4).argmax(-1)
    want_p = np.zeros((2, 4, 3, 3, 4))
    np.put_along_axis(want_p, first[..., None], f64(a["t"])[..., None], -1)
    want_dxp = np.zeros(a["x"].shape)
    want_dxp[:, :, :6, :6] = (want_p.reshape(2, 4, 3, 3, 2, 2).transpose(0, 1, 2, 4, 3, 5)
                              .reshape(2, 4, 6, 6))
    assert_half_close(got_dxp, want_dxp, dtype, k=1, what="max pool dx")


@pytest.mark.parametrize("dtype", HALVES)
def test_conv_tier_choice_in_half(monkeypatch, dtype):
    """A half 1x1 conv takes tier 1 (one product, no im2col) only where matmul takes half;
    until then the numba kernel reads the half data, and the reason says so."""
    from rlx_numba.runtime.lower_vision import conv_tier
    g = rlx.Graph("choice")
    y1 = g.conv(g.input("x", (1, 2, 6, 6), dtype), g.input("w", (3, 2, 1, 1), dtype))
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", "1,2")
    if half_product(rlx.dtype(dtype)):
        assert conv_tier(g, y1.node)[0] == 1
    else:
        assert conv_tier(g, y1.node) == (2, "tier 0 not allowed by RLX_NUMBA_CONV_TIERS; "
                                            f"tier 1: matmul takes no {dtype} operands yet")


def _accumulation_case(rng, dtype):
    """x, w all in [0.5, 1.5): conv's 64 channels x 9 taps = 576 positive products, sum ~ 576.
    A half accumulator rounds each partial sum: f16 (11 bits) has an ulp of 0.25-0.5 above
    128-256, so each add of a ~1 term errs up to 0.25, hundreds of them; bf16 (8 bits) has an
    ulp of 2-4 above 256-512, so a ~1 term barely moves the sum (it stalls far below 576).
    An f32 accumulator is exact to ~1e-5 here and the one output rounding meets 2 u."""
    x = rounded(rng.uniform(0.5, 1.5, (1, 64, 4, 3)), dtype)
    w = rounded(rng.uniform(0.5, 1.5, (2, 64, 3, 3)), dtype)
    return x, w, [(1, 1), (1, 1)]


def _half_accumulated(x, w, pads, dtype):
    """The reference conv accumulated term by term in ``dtype`` (what the test must reject)."""
    h = HOST[dtype]
    xp = np.pad(f64(x), [(0, 0), (0, 0)] + pads)
    n, c, hh, ww = x.shape
    acc = np.zeros((n, w.shape[0], hh, ww), h)
    for ci in range(c):
        for ky in range(3):
            for kx in range(3):
                term = np.einsum("k,nyx->nkyx", f64(w[:, ci, ky, kx]),
                                 xp[:, ci, ky:ky + hh, kx:kx + ww])
                acc = (f64(acc) + f64(term.astype(h))).astype(h)
    return acc


@pytest.mark.parametrize("dtype", HALVES)
def test_conv_accumulates_in_f32(rng, dtype):
    x, w, pads = _accumulation_case(rng, dtype)
    g = rlx.Graph("acc")
    g.set_outputs([g.conv(g.input("x", x.shape, dtype), g.input("w", w.shape, dtype),
                          padding=1)])
    (got,) = run_graph(g, {"x": x, "w": w})
    want = conv_ref(x, w, 1, pads)
    assert_half_close(got, want, dtype, what="conv of 576 terms")
    with pytest.raises(AssertionError):        # the case tells the two accumulators apart
        assert_half_close(_half_accumulated(x, w, pads, dtype), want, dtype)


def test_conv_dtype_errors():
    g = rlx.Graph("e")
    x, w16 = g.input("x", (1, 4, 5, 5), "f16"), g.input("w", (2, 4, 3, 3), "f16")
    cases = [
        (lambda: g.conv(x, g.input("wb", (2, 4, 3, 3), "bf16")),
         "conv: w must have x's dtype f16 (no promotion, as torch), got w bf16 [2, 4, 3, 3] "
         "and x f16 [1, 4, 5, 5]"),
        (lambda: g.conv(x, g.input("wf", (2, 4, 3, 3))), "got w f32 [2, 4, 3, 3] and x f16"),
        (lambda: g.conv(x, w16, g.input("b", (2,))),
         "conv: bias must be f16 [2] (one per output channel), got f32 [2]"),
        (lambda: g.conv_transpose(x, g.input("wt", (4, 2, 3, 3), "bf16")),
         "conv_transpose: w must have x's dtype f16"),
        (lambda: g.conv(g.input("xi", (1, 4, 5, 5), "i32"), w16),
         "conv: x must be f32, f16 or bf16, got i32 [1, 4, 5, 5]"),
        (lambda: g.batch_norm(x, g.input("m", (4,)), g.input("v", (4,), "f16")),
         "batch_norm: var must be f32 [4]"),
        (lambda: g.batch_norm(x, g.input("mb", (4,), "bf16"), g.input("vb", (4,), "bf16")),
         "batch_norm: mean must be f32 or f16 [4]"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value), str(e.value)
    pool = g.pool(x, "max", 2)
    with pytest.raises(ValueError, match=r"pool_grad: dy must be f16 \[1, 4, 2, 2\] \(x's dtype\)"
                       r", got bf16"):
        g.bind("pool_grad", (x, g.input("dy", (1, 4, 2, 2), "bf16")), **pool.node.attrs)
    with pytest.raises(ValueError, match="conv_wgrad: dy must have x's dtype f16"):
        g.bind("conv_wgrad", (x, g.input("d2", (1, 2, 3, 3))), kernel=(3, 3), stride=(1, 1),
               pad=(0, 0), dilation=(1, 1), groups=1, pad_hi=(0, 0))


# ---- pool and its gradient -------------------------------------------------------------------
def pool_windows(shape, k, st, p, dl, ceil_mode):
    """[(output index, [input indices in the window, row-major], window clipped to the padded
    input's size)] of a 2-d pool, as torch's."""
    out = []
    for i, s in enumerate(shape):
        span = dl[i] * (k[i] - 1) + 1
        o = (s + 2 * p[i] - span + (st[i] - 1 if ceil_mode else 0)) // st[i] + 1
        if ceil_mode and (o - 1) * st[i] >= s + p[i]:
            o -= 1
        out.append(o)
    wins = []
    for o in np.ndindex(*out):
        starts = [o[i] * st[i] - p[i] for i in range(2)]
        idx = [[s0 + j * dl[i] for j in range(k[i]) if 0 <= s0 + j * dl[i] < shape[i]]
               for i, s0 in enumerate(starts)]
        padded = np.prod([min(starts[i] + k[i], shape[i] + p[i]) - starts[i] for i in range(2)])
        wins.append((o, [(a, b) for a in idx[0] for b in idx[1]], padded))
    return tuple(out), wins


POOL_CASES = [
    ("max", (3, 3), dict(stride=2, padding=1, ceil_mode=True)),
    ("max", (3, 2), dict(stride=(2, 1), padding=(1, 1), dilation=(2, 1))),
    ("avg", (3, 3), dict(stride=2, padding=1)),
    ("avg", (3, 2), dict(stride=2, padding=1, count_include_pad=False, ceil_mode=True)),
]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("kind,k,kw", POOL_CASES)
def test_pool_and_grad(rng, dtype, kind, k, kw):
    xs = (2, 3, 7, 6)
    a = _inputs(rng, dtype, x=xs)
    st, p = _tup(kw.get("stride", k), 2), _tup(kw.get("padding", 0), 2)
    out, wins = pool_windows(xs[2:], k, st, p, _tup(kw.get("dilation", 1), 2),
                             kw.get("ceil_mode", False))
    a["dy"] = rounded(rng.standard_normal(xs[:2] + out), dtype)
    g = rlx.Graph("pool")
    x, dy = g.input("x", xs, dtype), g.input("dy", xs[:2] + out, dtype)
    y = g.pool(x, kind, k, **kw)
    g.set_outputs([y, g.bind("pool_grad", (x, dy), **y.node.attrs)])
    got, dx = run_graph(g, a)
    xx, dyy = f64(a["x"]), f64(a["dy"])
    want, dwant = np.zeros(xs[:2] + out), np.zeros(xs)
    for o, idx, padded in wins:
        vals = np.stack([xx[:, :, i, j] for i, j in idx], -1)
        if kind == "max":
            want[:, :, o[0], o[1]] = vals.max(-1)
            first = vals.argmax(-1)             # the first largest, as torch's
            for t, (i, j) in enumerate(idx):
                dwant[:, :, i, j] += np.where(first == t, dyy[:, :, o[0], o[1]], 0.0)
        else:
            div = padded if kw.get("count_include_pad", True) else len(idx)
            want[:, :, o[0], o[1]] = vals.sum(-1) / div
            for i, j in idx:
                dwant[:, :, i, j] += dyy[:, :, o[0], o[1]] / div
    assert_half_close(got, want, dtype, k=1 if kind == "max" else 2, what=f"{kind} pool")
    assert_half_close(dx, dwant, dtype, what=f"{kind} pool grad")


@pytest.mark.parametrize("dtype", HALVES)
def test_avg_pool_accumulates_in_f32(rng, dtype):
    """An avg pool of a 17 x 17 window of values near 100 + small noise: 289 terms summing to
    ~28900. In half, each add rounds the partial sum at an ulp of 16 (f16) or 128 (bf16) above
    16384, so the noise (and for bf16 the terms themselves) is lost; in f32 the mean is right."""
    x = rounded(100 + rng.uniform(-4, 4, (1, 2, 17, 17)), dtype)
    g = rlx.Graph("ap")
    g.set_outputs([g.pool(g.input("x", x.shape, dtype), "avg", 17)])
    (got,) = run_graph(g, {"x": x})
    want = f64(x).mean(axis=(2, 3), keepdims=True)
    assert_half_close(got, want, dtype, what="avg pool of 289")
    acc = np.zeros((1, 2), HOST[dtype])
    for v in f64(x).reshape(1, 2, -1).transpose(2, 0, 1):
        acc = (f64(acc) + v).astype(HOST[dtype])
    with pytest.raises(AssertionError):
        assert_half_close((f64(acc) / 289).astype(HOST[dtype]).reshape(want.shape), want, dtype)


# ---- batch norm's channel_affine -------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("params", ["f32", "x"])
def test_batch_norm(rng, dtype, params):
    """Inference batch norm: per-channel statistics in f32 (as torch's cuDNN batch norm takes
    them with half x) or in x's dtype; x's mean far from 0 (centring in f32)."""
    pd = dtype if params == "x" else "f32"
    xs, c = (2, 3, 5, 7), 3
    x = rounded(50 + rng.standard_normal(xs), dtype)
    mean = rounded(50 + rng.standard_normal(c) * 0.1, pd)
    var = rounded(rng.uniform(0.5, 2, c), pd)
    gamma, beta = rounded(rng.standard_normal(c), pd), rounded(rng.standard_normal(c), pd)
    g = rlx.Graph("bn")
    ins = [g.input(n, v.shape, pd) for n, v in (("m", mean), ("v", var), ("ga", gamma),
                                                 ("be", beta))]
    xt = g.input("x", xs, dtype)
    g.set_outputs([g.batch_norm(xt, *ins, eps=1e-3), g.batch_norm(xt, ins[0], ins[1])])
    got, plain = run_graph(g, {"x": x, "m": mean, "v": var, "ga": gamma, "be": beta})
    b = (1, c, 1, 1)
    r = 1 / np.sqrt(f64(var) + 1e-3)
    want = (f64(x) - f64(mean).reshape(b)) * (f64(gamma) * r).reshape(b) + f64(beta).reshape(b)
    assert_half_close(got, want, dtype, what="batch_norm")
    want_plain = (f64(x) - f64(mean).reshape(b)) / np.sqrt(f64(var) + 1e-5).reshape(b)
    assert_half_close(plain, want_plain, dtype, what="batch_norm without affine")


# ---- resample: pad, resize, adaptive_avg_pool ------------------------------------------------
def _resize_axis(x, axis, n_out, mode, align_corners):
    n = x.shape[axis]
    if mode == "nearest":
        idx = np.minimum(np.floor(np.arange(n_out) * (n / n_out)).astype(int), n - 1)
        return np.take(x, idx, axis)
    o = np.arange(n_out, dtype=np.float64)
    src = (o * ((n - 1) / (n_out - 1) if n_out > 1 else 0.0) if align_corners
           else np.maximum((o + 0.5) * (n / n_out) - 0.5, 0))
    i0 = np.minimum(np.floor(src).astype(int), n - 1)
    i1 = np.minimum(i0 + 1, n - 1)
    lam = (src - i0).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
    return np.take(x, i0, axis) * (1 - lam) + np.take(x, i1, axis) * lam


def _adaptive_axis(x, axis, n_out):
    n = x.shape[axis]
    parts = [np.take(x, np.arange(o * n // n_out, -(-(o + 1) * n // n_out)), axis).mean(
        axis, keepdims=True) for o in range(n_out)]
    return np.concatenate(parts, axis)


RESAMPLE_CASES = [
    ("pad constant", lambda g, x: g.pad(x, (1, 2, 2, 0), value=1.5),
     lambda x: np.pad(x, [(0, 0), (0, 0), (2, 0), (1, 2)], constant_values=1.5)),
    ("pad reflect", lambda g, x: g.pad(x, (2, 1, 1, 2), "reflect"),
     lambda x: np.pad(x, [(0, 0), (0, 0), (1, 2), (2, 1)], "reflect")),
    ("pad replicate", lambda g, x: g.pad(x, (0, 3), "replicate"),
     lambda x: np.pad(x, [(0, 0), (0, 0), (0, 0), (0, 3)], "edge")),
    ("nearest", lambda g, x: g.resize(x, size=(8, 4)),
     lambda x: _resize_axis(_resize_axis(x, 2, 8, "nearest", False), 3, 4, "nearest", False)),
    ("bilinear", lambda g, x: g.resize(x, size=(9, 11), mode="bilinear"),
     lambda x: _resize_axis(_resize_axis(x, 2, 9, "linear", False), 3, 11, "linear", False)),
    ("bilinear align_corners", lambda g, x: g.resize(x, size=(4, 10), mode="bilinear",
                                                     align_corners=True),
     lambda x: _resize_axis(_resize_axis(x, 2, 4, "linear", True), 3, 10, "linear", True)),
    ("adaptive_avg_pool", lambda g, x: g.adaptive_avg_pool(x, (2, 3)),
     lambda x: _adaptive_axis(_adaptive_axis(x, 2, 2), 3, 3)),
    ("adaptive, one axis", lambda g, x: g.adaptive_avg_pool(x, (3, None)),
     lambda x: _adaptive_axis(x, 2, 3)),
]


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("name,build,ref", RESAMPLE_CASES, ids=[c[0] for c in RESAMPLE_CASES])
def test_resample(rng, dtype, name, build, ref):
    xs = (1, 2, 5, 7)
    x = rounded(rng.standard_normal(xs), dtype)
    g = rlx.Graph("rs")
    g.set_outputs([build(g, g.input("x", xs, dtype))])
    (got,) = run_graph(g, {"x": x})
    assert_half_close(got, ref(f64(x)), dtype, what=name)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("mode", ["linear", "nearest"])
def test_resize_1d_and_3d(rng, dtype, mode):
    x1 = rounded(rng.standard_normal((2, 3, 7)), dtype)
    x3 = rounded(rng.standard_normal((1, 2, 3, 4, 5)), dtype)
    g = rlx.Graph("r1")
    m3 = "trilinear" if mode == "linear" else "nearest"
    g.set_outputs([g.resize(g.input("a", x1.shape, dtype), scale_factor=2, mode=mode),
                   g.resize(g.input("b", x3.shape, dtype), size=(5, 3, 6), mode=m3)])
    got1, got3 = run_graph(g, {"a": x1, "b": x3})
    want3 = f64(x3)
    for axis, n in zip((2, 3, 4), (5, 3, 6)):
        want3 = _resize_axis(want3, axis, n, mode, False)
    assert_half_close(got1, _resize_axis(f64(x1), 2, 14, mode, False), dtype, what="1-d")
    # 3-d is two nodes (axis 2, then the last two in one), the one between kept in f32: the
    # result is rounded once, as torch's (it had been rounded twice: an ulp off)
    assert_half_close(got3, want3, dtype, what="3-d")


@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", HALVES)
def test_global_adaptive_pool_is_one_mean(rng, dtype, channels_last):
    """adaptive_avg_pool to 1 on every spatial axis is one mean reduction (the resample path
    made channels-last a strided pass, 10x slower than torch): f32 sums rounded once, within
    a unit roundoff of the float64 mean, where a running sum kept in half is off by many
    (values near 200, 225 a window); its gradient spreads dy / 225."""
    xs = (2, 15, 15, 5) if channels_last else (2, 5, 15, 15)
    axes = (1, 2) if channels_last else (2, 3)
    x = rounded(200 + rng.standard_normal(xs) * 8, dtype)
    g = rlx.Graph("gap")
    t = g.input("x", xs, dtype)
    y = g.adaptive_avg_pool(t, (1, 1), channels_last=channels_last)
    assert y.node.op == "reduce" and y.shape == tuple(1 if a in axes else s
                                                         for a, s in enumerate(xs))
    seed = rounded(rng.standard_normal(y.shape), dtype)
    g.set_outputs([y, *g.grad(y, [t], seed=g.constant(seed, dtype))])
    got, dx = run_graph(g, {"x": x})
    want = f64(x).mean(axis=axes, keepdims=True)
    assert_half_close(got, want, dtype, k=1.0, scale=0.0, what="global pool")
    running = np.zeros(want.shape, HOST[dtype])             # a sum kept in the half type
    for i in range(15):
        for j in range(15):
            idx = (slice(None), i, j) if channels_last else (slice(None), slice(None), i, j)
            running = (running.astype(np.float32) + x[idx].reshape(want.shape)
                       .astype(np.float32)).astype(HOST[dtype])
    with pytest.raises(AssertionError):
        assert_half_close((running.astype(np.float32) / 225).astype(HOST[dtype]), want,
                          dtype, k=1.0, scale=0.0, what="half running sum")
    assert_half_close(dx, np.broadcast_to(f64(seed) / 225, xs), dtype, k=1.0, what="dx")


@pytest.mark.parametrize("dtype", HALVES)
def test_channels_last_adaptive_pool_rounds_once(rng, dtype):
    """A channels-last 2-d adaptive average pool is two resample nodes (the spatial axes are
    not the last two): the node between is f32, so each output is its window's mean rounded
    once (the fuzzer found it a half ulp off torch when it was rounded twice); its gradient
    too."""
    xs = (2, 7, 9, 3)
    x = rounded(rng.standard_normal(xs) * 8, dtype)
    g = rlx.Graph("cl_pool")
    t = g.input("x", xs, dtype)
    y = g.adaptive_avg_pool(t, (3, 4), channels_last=True)
    seed = rounded(rng.standard_normal(y.shape), dtype)
    g.set_outputs([y, *g.grad(y, [t], seed=g.constant(seed, dtype))])
    got, dx = run_graph(g, {"x": x})
    first = np.moveaxis(f64(x), -1, 1)
    want = np.moveaxis(_adaptive_axis(_adaptive_axis(first, 2, 3), 3, 4), 1, -1)
    assert_half_close(got, want, dtype, k=1.0, what="cl adaptive pool")
    dy = np.moveaxis(f64(seed), -1, 1)                        # the adjoint: each window's
    dwant = np.zeros(first.shape)                             # dy spread over its entries
    for o1 in range(3):
        for o2 in range(4):
            r1 = slice(o1 * 7 // 3, -(-(o1 + 1) * 7 // 3))
            r2 = slice(o2 * 9 // 4, -(-(o2 + 1) * 9 // 4))
            cnt = (r1.stop - r1.start) * (r2.stop - r2.start)
            dwant[:, :, r1, r2] += dy[:, :, o1:o1 + 1, o2:o2 + 1] / cnt
    assert_half_close(dx, np.moveaxis(dwant, 1, -1), dtype, k=2.0, what="its gradient")


# ---- cuDNN (tier 0) in half, on a GPU ----------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dtype", HALVES)
def test_cudnn_in_half(rng, monkeypatch, dtype):
    """conv, conv_transpose and the weight gradient as cuDNN calls on half tensors (compute
    type f32), and the many-term case: a reduced-precision reduction would fail it."""
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", "0")
    kw = dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    a = _inputs(rng, dtype, x=(2, 4, 9, 8), w=(6, 2, 3, 3), z=(2, 6, 5, 4))
    xa, wa, pads = _accumulation_case(rng, dtype)
    a["xa"], a["wa"] = xa, wa
    dys = (2, 6, 5, 6)                  # conv's output for x, w and kw
    a["dy"] = rounded(rng.standard_normal(dys), dtype)
    g = rlx.Graph("cudnn")
    x, w, z, xat, wat, dy = (g.input(n, v.shape, dtype) for n, v in a.items())
    g.set_outputs([g.conv(x, w, **kw), g.conv_transpose(z, w, stride=2, padding=1, groups=2),
                   g.conv(xat, wat, padding=1),
                   g.bind("conv_wgrad", (x, dy), kernel=(3, 3), stride=(2, 1), pad=(1, 1),
                          dilation=(1, 2), groups=2, pad_hi=(1, 1))])
    exe = rlx.compile(g)
    y, yt, ya, dw = exe.run(a)
    assert_half_close(y, conv_ref(a["x"], a["w"], (2, 1), [(1, 1), (1, 1)], (1, 2), 2), dtype,
                      what="cudnn conv")
    assert_half_close(yt, conv_t_ref(a["z"], a["w"], 2, 1, groups=2), dtype,
                      what="cudnn conv_transpose")
    assert_half_close(ya, conv_ref(xa, wa, 1, pads), dtype, what="cudnn conv of 576 terms")
    assert_half_close(dw, wgrad_ref(a["x"], a["dy"], (3, 3), (2, 1), [(1, 1), (1, 1)], (1, 2),
                                    2), dtype, what="cudnn wgrad")
    names = [s.kernel_name for s in exe.steps]
    assert sum("cudnn" in n for n in names) == 4, names

