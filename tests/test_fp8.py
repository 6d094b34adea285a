"""fp8 / i16 dtypes and casts, quantize / dequantize_linear (ONNX), scaled_matmul
(torch._scaled_mm) and qmatmul (ONNX MatMulInteger), against ml_dtypes and NumPy written here.

Oracles: casts and quantisation bit-exact against ml_dtypes / NumPy (f32 division, np.rint,
clip); qmatmul bit-exact against int64 NumPy; scaled_matmul against the exact sum of the fp8
products (float64: each product of two fp8 values has at most 8 significant bits, so float64
sums of K <= 2^40 of them are exact), with the error an f32 sum may make in any order:
|fl(sum) - sum| <= gamma_{K-1} sum |p_k| (gamma_n = n u / (1 - n u), u = 2^-24; Higham
Thm 4.4), then a rounding each for scale_a * scale_b, the scaling and the bias add, then half an
ulp of the output dtype.
"""
import ml_dtypes as md
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.kernels import lowp as L
from conftest import ON_GPU, run_graph

E4, E5 = md.float8_e4m3fn, md.float8_e5m2
HOST = {"f8e4m3": E4, "f8e5m2": E5, "bf16": md.bfloat16, "f16": np.float16, "f32": np.float32}
UNIT = {"f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}


def _bits_equal(got, want, what):
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8), err_msg=what)


# ---- dtypes and casts --------------------------------------------------------------------------
def _edge_f32():
    """Ties, overflow edges, subnormals, specials for both fp8 formats, and random values."""
    out = [464.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -3e38]
    for t in (E4, E5):
        v = np.arange(256, dtype=np.uint8).view(t).astype(np.float64)
        v = np.unique(v[np.isfinite(v)])
        mid = (v[1:] + v[:-1]) / 2                   # exact ties (in f32 too)
        top = float(v[-1])
        out += list(v) + list(mid) + [top * 1.03, top * 1.0703125, top * 1.0703, top * 1.5]
    rng = np.random.default_rng(5)
    x = np.array(out, np.float32)
    return np.concatenate([x, np.nextafter(x, np.float32(np.inf)),
                           (rng.standard_normal(200) * 50).astype(np.float32)])


def test_fp8_casts_match_ml_dtypes():
    """f32 -> fp8 (round to nearest even, no saturation: e4m3fn NaN past 448, e5m2 inf) and
    fp8 -> f32 / f16 / bf16 / the other fp8 / i32 for every byte, as ml_dtypes converts."""
    x = _edge_f32()
    codes = np.arange(256, dtype=np.uint8)
    g = rlx.Graph("casts")
    xi = g.input("x", x.shape, "f32")
    e4 = g.input("e4", (256,), "f8e4m3")
    e5 = g.input("e5", (256,), "f8e5m2")
    outs = [g.cast(xi, "f8e4m3"), g.cast(xi, "f8e5m2"), g.cast(g.cast(xi, "f8e4m3"), "f32")]
    for src in (e4, e5):
        outs += [g.cast(src, d) for d in ("f32", "f16", "bf16", "i32")]
    outs += [g.cast(e4, "f8e5m2"), g.cast(e5, "f8e4m3")]
    g.set_outputs(outs)
    got = run_graph(g, {"x": x, "e4": codes.view(E4), "e5": codes.view(E5)})
    _bits_equal(got[0], x.astype(E4), "f32->e4m3")
    _bits_equal(got[1], x.astype(E5), "f32->e5m2")
    np.testing.assert_array_equal(got[2], x.astype(E4).astype(np.float32))
    k = 3
    for t in (E4, E5):
        f = codes.view(t).astype(np.float32)
        np.testing.assert_array_equal(got[k], f)
        np.testing.assert_array_equal(got[k + 1], f.astype(np.float16))
        np.testing.assert_array_equal(got[k + 2].astype(np.float32), f.astype(md.bfloat16)
                                      .astype(np.float32))
        fin = np.isfinite(f)    # (NaN / inf to int: the saturating cast of test_cast.py)
        np.testing.assert_array_equal(got[k + 3][fin], np.trunc(f[fin]).astype(np.int32))
        k += 4
    _bits_equal(got[k], codes.view(E4).astype(np.float32).astype(E5), "e4m3->e5m2")
    _bits_equal(got[k + 1], codes.view(E5).astype(np.float32).astype(E4), "e5m2->e4m3")
    # spelled out: 464 is half way between 448 and 480 (NaN's code): to even, 448; just
    # above it, NaN (no saturation); e5m2 keeps it
    assert got[2][0] == 448.0 and np.isnan(got[2][np.flatnonzero(x == np.nextafter(
        np.float32(464), np.float32(np.inf)))[0]]) and got[1][0].astype(
        np.float32) == 448.0


def test_i16_casts_and_arithmetic():
    """i16: float casts truncate then wrap through i32 (as u8 / i8), arithmetic wraps in i16,
    u8 with i8 promotes to i16 (torch)."""
    f = np.array([1.9, -2.7, 40000.5, -1e9, 32767.0, np.nan], np.float32)
    a = np.array([30000, -32768, 5, 7, -1, 32767], np.int16)
    u = np.array([255, 0, 1, 128, 7, 9], np.uint8)
    i = np.array([-128, 127, -1, 5, 0, 1], np.int8)
    g = rlx.Graph("i16")
    xf, xa = g.input("f", f.shape, "f32"), g.input("a", a.shape, "i16")
    xu, xi = g.input("u", u.shape, "u8"), g.input("i", i.shape, "i8")
    g.set_outputs([g.cast(xf, "i16"), xa + xa, g.cast(xa, "f32"), xu + xi, g.cast(xa, "f8e4m3")])
    cf, s, af, ui, a8 = run_graph(g, {"f": f, "a": a, "u": u, "i": i})
    want = np.array([1, -2, 40000, -1000000000, 32767, 0], np.int64)
    assert cf.dtype == np.int16 and list(cf) == list(((want + 2**15) % 2**16 - 2**15))
    assert s.dtype == np.int16 and list(s) == list((a.astype(np.int32) * 2).astype(np.int16))
    np.testing.assert_array_equal(af, a.astype(np.float32))
    assert ui.dtype == np.int16 and list(ui) == list(u.astype(np.int16) + i)
    _bits_equal(a8, a.astype(np.float32).astype(E4), "i16->e4m3")


def test_small_int_reductions_and_fp8_reduction_error():
    """max / min keep u8 / i16 (their values exactly), sum gives i64; a reduction of fp8 raises
    at build time naming the op (fp8 is a storage format here, as in torch)."""
    a = np.array([[-300, 7, 32767], [-32768, 0, 5]], np.int16)
    u = np.array([[200, 3, 255], [0, 9, 1]], np.uint8)
    g = rlx.Graph("red")
    xa, xu = g.input("a", a.shape, "i16"), g.input("u", u.shape, "u8")
    g.set_outputs([g.reduce_max(xa, 1), g.reduce_min(xa, 0), g.sum(xa), g.reduce_max(xu, 0)])
    mx, mn, sm, mu = run_graph(g, {"a": a, "u": u})
    assert mx.dtype == np.int16 and list(mx) == [32767, 5]
    assert mn.dtype == np.int16 and list(mn) == [-32768, 0, 5]
    assert sm.dtype == np.int64 and int(sm) == int(a.astype(np.int64).sum())
    assert mu.dtype == np.uint8 and list(mu) == [200, 9, 255]
    f = g.input("f", (2, 3), "f8e4m3")
    for make, op in ((lambda: g.sum(f), "reduce sum"), (lambda: g.argmax(f, 1), "argmax"),
                     (lambda: g.cumsum(f, 0), "cumsum")):
        with pytest.raises(ValueError, match=f"{op}: x is f8e4m3 \\[2, 3\\]; fp8 tensors"):
            make()


# ---- quantize / dequantize_linear ---------------------------------------------------------------
_QINFO = {"i8": (-128, 127, np.int8), "u8": (0, 255, np.uint8), "i16": (-32768, 32767, np.int16)}


def _quantize_ref(x, s, z, dtype):
    """ONNX QuantizeLinear (saturate=1) in NumPy: f32 division, half to even, + zero point,
    clip; fp8: x / s + z clipped to the finite range (inf too: onnx.helper's saturate=True),
    then ml_dtypes' rounding."""
    v = x.astype(np.float32) / s.astype(np.float32)
    if dtype in ("f8e4m3", "f8e5m2"):
        if z is not None:
            v = v + z.astype(np.float32)
        top = 448.0 if dtype == "f8e4m3" else 57344.0
        return np.clip(v, -top, top).astype(np.float32).astype(HOST[dtype])
    lo, hi, t = _QINFO[dtype]
    v = np.rint(v) + (z.astype(np.float32) if z is not None else 0)
    return np.clip(v, lo, hi).astype(t)


def _qvalues(rng, shape, dtype):
    if dtype in _QINFO:
        lo, hi, t = _QINFO[dtype]
        return rng.integers(lo, hi + 1, shape).astype(t)
    return (rng.standard_normal(shape) * 4).astype(np.float32).astype(HOST[dtype])


@pytest.mark.parametrize("dtype", ["i8", "u8", "i16", "f8e4m3", "f8e5m2"])
def test_quantize_dequantize_per_tensor_and_per_channel(rng, dtype):
    """Every quantised dtype, scale / zero point () or [1] per tensor and [C] per channel on a
    negative axis; ties (x / scale = k + 1/2), saturation both ways, +-inf and NaN for fp8."""
    shape, axis = (2, 3, 5), -2
    fp8 = dtype.startswith("f8")
    big = 1e6 if fp8 else 40000.0
    x = (rng.standard_normal(shape) * (300 if fp8 else 40)).astype(np.float32)
    x.flat[:8] = [2.5, -2.5, 0.5, -1.5, big, -big, 3.5, 0.0]
    if fp8:
        x.flat[8:11] = [np.inf, -np.inf, np.nan]
    s_t = np.array([0.5], np.float32)
    s_c = np.array([0.5, 0.25, 2.0], np.float32)
    z_t = _qvalues(rng, (), dtype)
    z_c = _qvalues(rng, (3,), dtype)
    g = rlx.Graph("q")
    xi = g.input("x", shape, "f32")
    st, sc = g.input("st", (1,), "f32"), g.input("sc", (3,), "f32")
    zt, zc = g.input("zt", (), dtype), g.input("zc", (3,), dtype)
    qt = g.quantize(xi, st, zt)                      # dtype from the zero point
    qc = g.quantize(xi, sc, zc, axis=axis, dtype=dtype)
    qn = g.quantize(xi, st, dtype=dtype)             # no zero point
    g.set_outputs([qt, qc, qn, g.dequantize_linear(qt, st, zt),
                   g.dequantize_linear(qc, sc, zc, axis=axis), g.dequantize_linear(qn, st)])
    feeds = {"x": x, "st": s_t, "sc": s_c, "zt": z_t, "zc": z_c}
    got = run_graph(g, feeds)
    sc_b, zc_b = s_c.reshape(3, 1), z_c.reshape(3, 1)
    want = [_quantize_ref(x, s_t, z_t, dtype), _quantize_ref(x, sc_b, zc_b, dtype),
            _quantize_ref(x, s_t, None, dtype)]
    for k, w in enumerate(want):
        _bits_equal(got[k], w, f"quantize {k}")
    for k, (q, s, z) in enumerate([(want[0], s_t, z_t), (want[1], sc_b, zc_b),
                                    (want[2], s_t, None)]):
        d = q.astype(np.float32) - (z.astype(np.float32) if z is not None else np.float32(0))
        np.testing.assert_array_equal(got[3 + k], (d * s).astype(np.float32))


def test_quantize_rounds_half_to_even_and_saturates():
    """Spelled-out values: x / scale = 0.5, 1.5, 2.5, -0.5, -2.5 round to 0, 2, 2, 0, -2; u8 with
    zero point 128; past the range saturates; fp8 e4m3 of 460 rounds to 448, inf saturates
    to the largest finite value in both formats (ONNX saturate=1)."""
    x = np.array([0.5, 1.5, 2.5, -0.5, -2.5, 300.0, -300.0], np.float32)
    g = rlx.Graph("q")
    xi = g.input("x", x.shape, "f32")
    one = g.constant(np.float32(1.0))
    z = g.constant(np.uint8(128))
    y = g.input("y", (4,), "f32")
    g.set_outputs([g.quantize(xi, one), g.quantize(xi, one, z),
                   g.quantize(y, one, dtype="f8e4m3"), g.quantize(y, one, dtype="f8e5m2")])
    q8, qu, f4, f5 = run_graph(g, {"x": x, "y": np.array([460, np.inf, -1e9, 0.3], np.float32)})
    assert list(q8) == [0, 2, 2, 0, -2, 127, -128]
    assert list(qu) == [128, 130, 130, 128, 126, 255, 0]
    assert list(f4.astype(np.float32)) == [448, 448, -448, 0.3125]
    assert list(f5.astype(np.float32)) == [448, 57344, -57344, 0.3125]


def test_quantize_half_input(rng):
    """A bf16 x (widened exactly, then as f32) to u8 and f8e4m3 through the vector kernel
    (16-byte bf16 loads, byte stores)."""
    x = (rng.standard_normal((4, 24)) * 100).astype(np.float32).astype(md.bfloat16)
    s = np.array([0.75], np.float32)
    g = rlx.Graph("qh")
    xi = g.input("x", x.shape, "bf16")
    si = g.input("s", (1,), "f32")
    z = g.constant(np.uint8(100))
    g.set_outputs([g.quantize(xi, si, z), g.quantize(xi, si, dtype="f8e4m3")])
    qu, q8 = run_graph(g, {"x": x, "s": s})
    xf = x.astype(np.float32)
    _bits_equal(qu, _quantize_ref(xf, s, np.uint8(100), "u8"), "bf16 -> u8")
    _bits_equal(q8, _quantize_ref(xf, s, None, "f8e4m3"), "bf16 -> f8e4m3")


def test_quantize_gradients():
    """quantize passes no gradient (ONNX defines none); dequantize_linear's scale gets
    sum(dy * (q - zero_point)), checked against NumPy."""
    q = np.array([[3, -7, 100], [0, 1, -128]], np.int8)
    g = rlx.Graph("qg")
    x = g.input("x", (2, 3), "f32")
    s = g.param("s", (3,), "f32")
    qi = g.input("q", (2, 3), "i8")
    loss = g.sum(g.dequantize_linear(qi, s, g.constant(np.array([1, 2, 3], np.int8)), axis=1)
                 * 2.0) + g.sum(g.cast(g.quantize(x, s, axis=1, dtype="f8e4m3"), "f32"))
    ds, dx = g.grad(loss, [s, x])
    g.set_outputs([ds, dx])
    got_ds, got_dx = run_graph(g, {"x": np.ones((2, 3), np.float32), "q": q},
                               {"s": np.array([0.5, 2.0, 1.0], np.float32)})
    np.testing.assert_allclose(got_ds, 2.0 * (q.astype(np.float64) - [1, 2, 3]).sum(0))
    np.testing.assert_array_equal(got_dx, np.zeros((2, 3), np.float32))


# ---- scaled_matmul --------------------------------------------------------------------------
def _fp8(rng, shape, dtype):
    x = rng.standard_normal(shape) * (8 if dtype == "f8e4m3" else 100)
    return x.astype(np.float32).astype(HOST[dtype])


def _scaled_bound(a, b, s_ab, bias, out_dtype, u_acc):
    """(exact result in float64, elementwise error bound): module docstring."""
    af, bf = a.astype(np.float64), b.astype(np.float64)
    exact = af @ bf
    mag = np.abs(af) @ np.abs(bf)
    k = a.shape[1]
    gam = (k - 1) * u_acc / (1 - (k - 1) * u_acc)
    u = 2.0 ** -24
    v = exact * s_ab
    bias_f = bias.astype(np.float64) if bias is not None else 0.0
    want = v + bias_f
    pre = np.abs(s_ab) * (gam * mag) + 4 * u * (np.abs(s_ab) * mag + np.abs(bias_f))
    return want, pre + UNIT[out_dtype] * (np.abs(want) + pre)


SCALED = [  # a, b, scales, bias, out_dtype, b as a transpose, M, K, N
    ("f8e4m3", "f8e4m3", "tensor", True, "bf16", False, 3, 32, 16),
    ("f8e4m3", "f8e5m2", "tensor1", False, "f32", True, 5, 16, 16),
    ("f8e5m2", "f8e4m3", "rowwise", True, "f16", False, 2, 48, 32),
    ("f8e4m3", "f8e4m3", "rowwise", True, "f32", True, 3, 32, 16),
    ("f8e4m3", "f8e4m3", "tensor", True, "f32", False, 1, 16, 16),
]


@pytest.mark.parametrize("adt,bdt,scales,has_bias,out,b_t,m,k,n", SCALED)
def test_scaled_matmul(rng, adt, bdt, scales, has_bias, out, b_t, m, k, n):
    """torch._scaled_mm's values: every fp8 pairing torch takes, per-tensor scales () and [1],
    rowwise [M, 1] / [1, N], a bias in out_dtype, each output dtype, b given [K, N] or as the
    transpose of an [N, K] tensor (torch's column-major mat2)."""
    a, b = _fp8(rng, (m, k), adt), _fp8(rng, (k, n), bdt)
    shape_a, shape_b = {"tensor": ((), ()), "tensor1": ((1,), (1,)),
                        "rowwise": ((m, 1), (1, n))}[scales]
    sa = rng.uniform(0.5, 2.0, shape_a).astype(np.float32)
    sb = rng.uniform(0.001, 0.01, shape_b).astype(np.float32)
    bias = (rng.standard_normal(n) * 50).astype(np.float32).astype(HOST[out])
    g = rlx.Graph("smm")
    ai = g.input("a", (m, k), adt)
    bi = g.transpose(g.input("bt", (n, k), bdt)) if b_t else g.input("b", (k, n), bdt)
    sai, sbi = g.input("sa", shape_a, "f32"), g.input("sb", shape_b, "f32")
    bias_i = g.input("bias", (n,), out) if has_bias else None
    g.set_outputs([g.scaled_matmul(ai, bi, sai, sbi, bias=bias_i, out_dtype=out)])
    feeds = {"a": a, "sa": sa, "sb": sb, **({"bias": bias} if has_bias else {}),
             **({"bt": np.ascontiguousarray(b.T)} if b_t else {"b": b})}
    (y,) = run_graph(g, feeds)
    assert y.dtype == np.dtype(HOST[out]) and y.shape == (m, n)
    s_ab = (sa.astype(np.float64).reshape(-1, 1) * sb.astype(np.float64).reshape(1, -1)
            if scales == "rowwise" else float(sa.reshape(-1)[0]) * float(sb.reshape(-1)[0]))
    # on a GPU cuBLASLt's fp8 tensor cores keep about 14 bits within a K-block before the
    # f32 promotion (DeepSeek-V3 report, sec. 3.3.2): 2^-13 stands in for u in the sum there
    want, bound = _scaled_bound(a, b, s_ab, bias if has_bias else None, out,
                                2.0 ** -13 if ON_GPU else 2.0 ** -24)
    err = np.abs(y.astype(np.float64) - want)
    assert (err <= bound).all(), (err - bound).max()


def test_scaled_matmul_checks():
    g = rlx.Graph("e")
    a = g.input("a", (4, 32), "f8e4m3")
    b = g.input("b", (32, 16), "f8e4m3")
    s = g.input("s", (), "f32")
    cases = [
        (lambda: g.scaled_matmul(a, g.input("b1", (32, 24), "f8e4m3"), s, s),
         "K and N must be multiples of 16"),
        (lambda: g.scaled_matmul(g.input("a1", (4, 24), "f8e4m3"), g.input("b2", (24, 16),
                                                                          "f8e4m3"), s, s),
         "K and N must be multiples of 16"),
        (lambda: g.scaled_matmul(a, g.input("b3", (16, 16), "f8e4m3"), s, s), "disagree on K"),
        (lambda: g.scaled_matmul(g.input("a2", (4, 32), "bf16"), b, s, s),
         "a must be a 2-D fp8 tensor"),
        (lambda: g.scaled_matmul(g.input("a3", (4, 32), "f8e5m2"), g.input("b4", (32, 16),
                                                                          "f8e5m2"), s, s),
         "both f8e5m2"),
        (lambda: g.scaled_matmul(a, b, g.input("s2", (4, 1), "f32"), s), "both rowwise"),
        (lambda: g.scaled_matmul(a, b, g.input("s3", (4,), "f32"), g.input("s4", (16,), "f32")),
         "scale_a [4, 1], scale_b [1, 16]"),
        (lambda: g.scaled_matmul(a, b, g.input("s5", (), "f16"), s), "scale_a must be f32"),
        (lambda: g.scaled_matmul(a, b, s, s, bias=g.input("c", (16,), "f32")),
         "bias must be bf16 [16]"),
        (lambda: g.scaled_matmul(a, b, s, s, bias=g.input("c2", (8,), "bf16")),
         "bias must be bf16 [16]"),
        (lambda: g.scaled_matmul(a, b, s, s, out_dtype="i32"), "out_dtype must be one of"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError, match="scaled_matmul") as e:
            make()
        assert msg in str(e.value), (msg, str(e.value))
    y = g.scaled_matmul(a, b, s, s, out_dtype="f32")
    with pytest.raises(ValueError, match="scaled_matmul .* has no gradient"):
        g.grad(g.sum(y), [a])


# ---- qmatmul -------------------------------------------------------------------------------
QM = [("i8", 0, 0, False, 3, 37, 5), ("u8", 131, -3, True, 4, 19, 6), ("u8", 0, 0, False, 2, 8, 3),
      ("i8", -128, 127, True, 1, 33, 7)]


@pytest.mark.parametrize("adt,az,bz,b_t,m,k,n", QM)
def test_qmatmul_exact(rng, adt, az, bz, b_t, m, k, n):
    """Bit-exact against int64 NumPy: i8 / u8 a, zero points at the range ends, odd sizes, the
    extreme values (a = 255 or -128 against b = -128), b given as a transpose."""
    lo, hi = (0, 255) if adt == "u8" else (-128, 127)
    a = rng.integers(lo, hi + 1, (m, k)).astype(np.uint8 if adt == "u8" else np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    a[0, :] = lo if adt == "i8" else hi
    b[:, 0] = -128
    g = rlx.Graph("qmm")
    ai = g.input("a", (m, k), adt)
    bi = g.transpose(g.input("bt", (n, k), "i8")) if b_t else g.input("b", (k, n), "i8")
    g.set_outputs([g.qmatmul(ai, bi, a_zero=az, b_zero=bz)])
    (y,) = run_graph(g, {"a": a, **({"bt": np.ascontiguousarray(b.T)} if b_t else {"b": b})})
    want = (a.astype(np.int64) - az) @ (b.astype(np.int64) - bz)
    assert y.dtype == np.int32
    np.testing.assert_array_equal(y, want)


def test_qmatmul_checks():
    g = rlx.Graph("e")
    a = g.input("a", (3, 8), "i8")
    b = g.input("b", (8, 4), "i8")
    cases = [
        (lambda: g.qmatmul(g.input("a1", (3, 8), "i32"), b), "a must be a 2-D i8 or u8 tensor"),
        (lambda: g.qmatmul(a, g.input("b1", (8, 4), "u8")), "b must be a 2-D i8 tensor"),
        (lambda: g.qmatmul(a, g.input("b2", (7, 4), "i8")), "disagree on K (8 != 7)"),
        (lambda: g.qmatmul(a, b, a_zero=200), "a_zero must be a Python int in [-128, 127]"),
        (lambda: g.qmatmul(a, b, b_zero=True), "b_zero must be a Python int"),
        (lambda: g.qmatmul(g.input("a2", (3, 8), "u8"), b, a_zero=-1), "in [0, 255] (u8)"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError, match="qmatmul") as e:
            make()
        assert msg in str(e.value), (msg, str(e.value))


def test_quantize_checks():
    g = rlx.Graph("e")
    x = g.input("x", (2, 3), "f32")
    s = g.input("s", (), "f32")
    cases = [
        (lambda: g.quantize(x, s, dtype="i32"), "quantize: dtype must be one of"),
        (lambda: g.quantize(x, s, g.input("z", (), "u8"), dtype="i8"),
         "zero_point u8 [] must have the quantised dtype i8"),
        (lambda: g.quantize(x, g.input("s1", (3,), "f32")), "per tensor (axis=None) scale"),
        (lambda: g.quantize(x, g.input("s2", (3,), "f32"), axis=0),
         "per-channel scale must be [2]"),
        (lambda: g.quantize(x, s, axis=2), "axis must be an int in [-2, 2)"),
        (lambda: g.quantize(g.input("xi", (2, 3), "i32"), s), "x must be a float tensor"),
        (lambda: g.quantize(x, g.input("si", (), "i32")), "scale must be a float tensor"),
        (lambda: g.dequantize_linear(x, s), "q must be i8, u8, i16, i32, f8e4m3 or f8e5m2"),
        (lambda: g.dequantize_linear(g.input("q", (2, 3), "i8"), s, g.input("z2", (), "u8")),
         "zero_point u8 [] must have q's dtype i8"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value), (msg, str(e.value))


# ---- the cuBLASLt tiers' own kernels, in the simulator ------------------------------------------
def test_lt_tier_kernels_zero_points_and_scales(rng):
    """The numba pieces of the cuBLASLt tiers, on a product NumPy stands in for: a u8 a shifted
    to i8, the transposed b, the row / column sums and the zero-point fix give the exact
    (a - az)(b - bz); the scale epilogue applies rowwise scales and a bias."""
    m, k, n, az, bz = 3, 11, 5, 200, -7
    a = rng.integers(0, 256, (m, k)).astype(np.uint8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    grid, block = (2,), (16,)
    a8 = np.zeros(m * k, np.int8)
    L.shift_u8[grid, block](a8, a.reshape(-1), m * k)
    bt = np.zeros(k * n, np.int8)     # (k, n not multiples of the tile: the edges)
    L.transpose_bytes[(2, 2), (L.TILE, L.TROWS)](bt.view(np.uint8), b.reshape(-1).view(np.uint8),
                                                 k, n)
    np.testing.assert_array_equal(bt.reshape(n, k), b.T)
    out = (a8.reshape(m, k).astype(np.int64) @ b.astype(np.int64)).astype(np.int32).reshape(-1)
    ra, cb = np.zeros(m, np.int32), np.zeros(n, np.int32)
    L.qmm_sums[grid, block](ra, cb, a8, bt, m, n, k, True)
    azs = az - 128
    L.qmm_fix[grid, block](out, ra, cb, azs, bz, k * azs * bz, m, n)
    np.testing.assert_array_equal(out.reshape(m, n),
                                  (a.astype(np.int64) - az) @ (b.astype(np.int64) - bz))
    acc = rng.standard_normal(m * n).astype(np.float32)
    sa, sb = rng.uniform(1, 2, m).astype(np.float32), rng.uniform(1, 2, n).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    res = np.zeros(m * n, np.float32)
    L.scale_epilogue("f32", True, True)[grid, block](res, acc, sa, sb, bias, m, n)
    want = (acc.reshape(m, n) * (sa[:, None] * sb[None, :]) + bias).astype(np.float32)
    # a GPU contracts acc * s + bias into one FMA (one rounding, NumPy's two): within an ulp
    assert (np.abs(res.reshape(m, n) - want) <= (np.spacing(np.abs(want)) if ON_GPU else 0)).all()


def test_fallback_log_names_the_tier(caplog, monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    g = rlx.Graph("log")
    g.set_outputs([g.qmatmul(g.input("a", (2, 4), "i8"), g.input("b", (4, 3), "i8"))])
    with caplog.at_level("WARNING", logger="rlx_numba"):
        rlx.compile(g)
    if ON_GPU:   # K = 4, N = 3: not a multiple of 4, so cuBLASLt is passed over there too
        assert "K and N multiples of 4" in caplog.text
    assert "qmatmul tier 1 (numba)" in caplog.text


# ---- GPU: the cuBLASLt tiers against the numba tier ----------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="cuBLASLt tiers: a GPU test")
@pytest.mark.parametrize("scales,b_t,out,outer", [("tensor", True, "bf16", "1"),
                                                  ("tensor", False, "f32", "1"),
                                                  ("rowwise", True, "bf16", "1"),
                                                  ("rowwise", True, "bf16", "0"),
                                                  ("rowwise", False, "f16", "1")])
def test_gpu_scaled_matmul_lt_matches_numba(rng, monkeypatch, scales, b_t, out, outer):
    """cuBLASLt's fp8 tier (one call; rowwise through the outer-vector scale mode, or with
    RLX_NUMBA_LT_OUTER_VEC=0 f32 sums and the scale epilogue) and the numba tier, both within
    the bound of the exact result."""
    monkeypatch.setenv("RLX_NUMBA_LT_OUTER_VEC", outer)
    m, k, n = 96, 256, 128
    a, b = _fp8(rng, (m, k), "f8e4m3"), _fp8(rng, (k, n), "f8e4m3")
    sh = ((), ()) if scales == "tensor" else ((m, 1), (1, n))
    sa = rng.uniform(0.5, 2, sh[0]).astype(np.float32)
    sb = rng.uniform(0.001, 0.01, sh[1]).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32).astype(HOST[out])

    def run(tiers):
        monkeypatch.setenv("RLX_NUMBA_LOWP_TIERS", tiers)
        g = rlx.Graph("smm")
        bi = g.transpose(g.input("bt", (n, k), "f8e4m3")) if b_t else g.input("b", (k, n), "f8e4m3")
        y = g.scaled_matmul(g.input("a", (m, k), "f8e4m3"), bi, g.input("sa", sh[0], "f32"),
                            g.input("sb", sh[1], "f32"), bias=g.input("c", (n,), out),
                            out_dtype=out)
        g.set_outputs([y])
        exe = rlx.compile(g)
        kinds = " ".join(s.kernel_name for s in exe.steps)
        feeds = {"a": a, "sa": sa, "sb": sb, "c": bias,
                 **({"bt": np.ascontiguousarray(b.T)} if b_t else {"b": b})}
        return exe.run(feeds)[0], kinds
    lt, kinds = run("0,1")
    ref, _ = run("1")
    s_ab = sa.reshape(-1, 1).astype(np.float64) * sb.reshape(1, -1) if scales == "rowwise" \
        else float(sa) * float(sb)
    want, bound = _scaled_bound(a, b, s_ab, bias, out, 2.0 ** -13)
    assert (np.abs(lt.astype(np.float64) - want) <= bound).all()
    assert (np.abs(ref.astype(np.float64) - want) <= bound).all()
    assert "cublasLt" in kinds, kinds
    if outer == "0" and scales == "rowwise":
        assert "scale epilogue" in kinds, kinds


@pytest.mark.skipif(not ON_GPU, reason="cuBLASLt tiers: a GPU test")
@pytest.mark.parametrize("adt,az,bz,b_t", [("i8", 0, 0, True), ("u8", 0, 0, False),
                                           ("u8", 17, -5, True), ("i8", -3, 9, False)])
def test_gpu_qmatmul_lt_matches_numba(rng, monkeypatch, adt, az, bz, b_t):
    m, k, n = 67, 256, 96
    a = rng.integers(0 if adt == "u8" else -128, 256 if adt == "u8" else 128, (m, k)).astype(
        np.uint8 if adt == "u8" else np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    outs = []
    for tiers in ("0,1", "1"):
        monkeypatch.setenv("RLX_NUMBA_LOWP_TIERS", tiers)
        g = rlx.Graph("qmm")
        bi = g.transpose(g.input("bt", (n, k), "i8")) if b_t else g.input("b", (k, n), "i8")
        g.set_outputs([g.qmatmul(g.input("a", (m, k), adt), bi, a_zero=az, b_zero=bz)])
        outs.append(run_graph(g, {"a": a, **({"bt": np.ascontiguousarray(b.T)} if b_t
                                             else {"b": b})})[0])
    want = (a.astype(np.int64) - az) @ (b.astype(np.int64) - bz)
    np.testing.assert_array_equal(outs[0], want)
    np.testing.assert_array_equal(outs[1], want)



# ---- the cuBLASLt tiers' wiring, in the simulator, over a model of cuBLASLt ----------------
def _fake_lt(calls, outer_vec_ok=True):
    """A stand-in for cublas.gemm.lt_lowp_plan computing what cuBLASLt's documentation defines
    -- column-major D = scaleA * scaleB * op(A) @ op(B) (+ bias over D's rows), op from the
    transpose flags, A / B / D read and written through their pointers and leading dimensions
    -- so the tiers' operand swapping, TN layout, scale pointers, transposed-b copy, u8 shift,
    zero-point fix and epilogue run here as they would on a GPU. ``outer_vec`` scales are f32
    vectors along D's rows (A's) and columns (B's); ``outer_vec_ok=False`` refuses them as a
    cuBLAS without that mode does."""
    import ctypes
    from rlx_numba.cublas import api
    types = {api.R_8F_E4M3: E4, api.R_8F_E5M2: E5, api.R_8I: np.int8, api.R_32I: np.int32,
             api.R_16BF: md.bfloat16, api.R_16F: np.float16, api.R_32F: np.float32}

    def mem(ptr, count, dtype):
        nbytes = count * np.dtype(dtype).itemsize
        return np.frombuffer((ctypes.c_char * nbytes).from_address(ptr), dtype)

    def colmajor(ptr, dtype, rows, cols, ld):
        return mem(ptr, ld * (cols - 1) + rows, dtype), ld

    def plan(stream, cm, a_ptr, a_type, b_ptr, b_type, d_ptr, d_type, a_scale_ptr=None,
             b_scale_ptr=None, bias_ptr=None, outer_vec=False):
        if outer_vec and not outer_vec_ok:
            raise api.CublasError("cublasLtMatmulAlgoGetHeuristic (no algorithm)", 15)
        calls.append((cm, a_type, b_type, d_type, a_scale_ptr is not None, bias_ptr is not None,
                      outer_vec))
        assert (cm.opa, cm.opb) == (api.OP_T, api.OP_N), "fp8 / int8 cuBLASLt takes TN only"

        def read(ptr, t, rows, cols, ld):     # a column-major rows x cols matrix
            flat, ld = colmajor(ptr, types[t], rows, cols, ld)
            return np.stack([flat[c * ld:c * ld + rows] for c in range(cols)], 1)

        def run():
            lt_a = read(b_ptr, b_type, cm.k, cm.m, cm.lda).T      # op(A) = A^T, m x k
            lt_b = read(a_ptr, a_type, cm.k, cm.n, cm.ldb)        # op(B) = B, k x n
            if d_type == api.R_32I:
                d = lt_a.astype(np.int64) @ lt_b.astype(np.int64)
            else:
                d = lt_a.astype(np.float64) @ lt_b.astype(np.float64)
                if outer_vec:      # Lt's A scale (our b's) along D's rows, B's along columns
                    d = d * mem(b_scale_ptr, cm.m, np.float32).astype(np.float64)[:, None] \
                        * mem(a_scale_ptr, cm.n, np.float32).astype(np.float64)[None, :]
                else:
                    for p in (a_scale_ptr, b_scale_ptr):
                        d = d * (float(mem(p, 1, np.float32)[0]) if p is not None else 1.0)
                if bias_ptr is not None:
                    d = d + mem(bias_ptr, cm.m, types[d_type]).astype(np.float64)[:, None]
            flat, ld = colmajor(d_ptr, types[d_type], cm.m, cm.n, cm.ldc)
            for c in range(cm.n):
                flat[c * ld:c * ld + cm.m] = d[:, c].astype(np.float32).astype(types[d_type]) \
                    if d_type != api.R_32I else d[:, c].astype(np.int32)
        return run
    return plan


@pytest.fixture(params=[True, False], ids=["outer_vec", "no_outer_vec"])
def fake_lt(request, monkeypatch):
    if ON_GPU:
        pytest.skip("the real cuBLASLt runs these on a GPU (test_gpu_*)")
    from rlx_numba.cublas import gemm
    from rlx_numba.ir.opdef import opdef
    calls = []
    monkeypatch.setattr(gemm, "lt_lowp_plan", _fake_lt(calls, request.param), raising=False)
    for op in ("scaled_matmul", "qmatmul"):
        monkeypatch.setattr(opdef(op).tiers[0], "available", lambda ctx, n: None)
    return calls


@pytest.mark.parametrize("scales,out,b_t,has_bias", [("tensor", "bf16", True, True),
                                                     ("tensor", "f32", False, True),
                                                     ("rowwise", "f16", True, True),
                                                     ("rowwise", "f32", False, False),
                                                     ("rowwise", "f32", True, True)])
def test_scaled_matmul_lt_tier_wiring(rng, request, fake_lt, scales, out, b_t, has_bias):
    m, k, n = 3, 32, 16
    a, b = _fp8(rng, (m, k), "f8e4m3"), _fp8(rng, (k, n), "f8e5m2")
    sh = ((), ()) if scales == "tensor" else ((m, 1), (1, n))
    sa = rng.uniform(0.5, 2, sh[0]).astype(np.float32)
    sb = rng.uniform(0.001, 0.01, sh[1]).astype(np.float32)
    bias = (rng.standard_normal(n) * 20).astype(np.float32).astype(HOST[out])
    g = rlx.Graph("smm")
    bi = g.transpose(g.input("bt", (n, k), "f8e5m2")) if b_t else g.input("b", (k, n), "f8e5m2")
    y = g.scaled_matmul(g.input("a", (m, k), "f8e4m3"), bi, g.input("sa", sh[0], "f32"),
                        g.input("sb", sh[1], "f32"),
                        bias=g.input("c", (n,), out) if has_bias else None, out_dtype=out)
    g.set_outputs([y])
    exe = rlx.compile(g)
    names = [s.kernel_name for s in exe.steps]
    assert any(nm.startswith("cublasLt fp8") for nm in names), names
    assert any("transpose" in nm for nm in names) == (not b_t), names
    outer = any(c[-1] for c in fake_lt)    # a rowwise product on one call (outer vectors)
    assert outer == (scales == "rowwise" and not (out == "f32" and has_bias)
                     and request.node.callspec.params["fake_lt"]), (names, fake_lt)
    assert any("scale epilogue" in nm for nm in names) == (
        (scales == "rowwise" and not outer) or (out == "f32" and has_bias)), names
    (got,) = exe.run({"a": a, "sa": sa, "sb": sb, **({"c": bias} if has_bias else {}),
                      **({"bt": np.ascontiguousarray(b.T)} if b_t else {"b": b})})
    s_ab = sa.reshape(-1, 1).astype(np.float64) * sb.reshape(1, -1) if scales == "rowwise" \
        else float(sa) * float(sb)
    want, bound = _scaled_bound(a, b, s_ab, bias if has_bias else None, out, 2.0 ** -24)
    assert (np.abs(got.astype(np.float64) - want) <= bound).all()
    assert fake_lt, "the cuBLASLt plan was not made"


@pytest.mark.parametrize("adt,az,bz,b_t", [("u8", 200, -3, True), ("i8", 0, 0, False),
                                           ("i8", -5, 7, False)])
def test_qmatmul_lt_tier_wiring(rng, fake_lt, monkeypatch, caplog, adt, az, bz, b_t):
    m, k, n = 3, 12, 8
    a = rng.integers(0 if adt == "u8" else -128, 256 if adt == "u8" else 128, (m, k)).astype(
        np.uint8 if adt == "u8" else np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    g = rlx.Graph("qmm")
    bi = g.transpose(g.input("bt", (n, k), "i8")) if b_t else g.input("b", (k, n), "i8")
    g.set_outputs([g.qmatmul(g.input("a", (m, k), adt), bi, a_zero=az, b_zero=bz)])
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    with caplog.at_level("WARNING", logger="rlx_numba"):
        exe = rlx.compile(g)
    assert "qmatmul tier 0 (cublaslt int8)" in caplog.text
    assert ("a u8 a shifted to i8" in caplog.text) == (adt == "u8"), caplog.text
    names = [s.kernel_name for s in exe.steps]
    assert any(nm.startswith("cublasLt int8") for nm in names), names
    assert any("shift u8" in nm for nm in names) == (adt == "u8"), names
    (got,) = exe.run({"a": a, **({"bt": np.ascontiguousarray(b.T)} if b_t else {"b": b})})
    np.testing.assert_array_equal(got, (a.astype(np.int64) - az) @ (b.astype(np.int64) - bz))
