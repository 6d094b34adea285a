"""cast(x, dtype) between every ordered pair of the eight dtypes.

Oracle: NumPy's astype (and ml_dtypes for bf16), written here. float -> int truncates toward
zero like astype on in-range values, saturates out of range and sends NaN to 0 (to u8 / i8:
through i32, then wrapped like PyTorch's casts); int -> narrower int wraps; float -> f16 and
float -> bf16 round to nearest even; int -> bool is "nonzero"; bool -> number is 0/1; a cast to
the dtype the tensor already has is a view (no copy, no kernel). f64 -> f16 / bf16 / fp8
rounds the f64 value once (oracle: rounding over the narrow dtype's bit patterns, written here).
"""
import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph

BF16 = ml_dtypes.bfloat16
HOST = {"f32": np.float32, "f16": np.float16, "bf16": BF16, "i32": np.int32, "i64": np.int64,
        "u8": np.uint8, "i8": np.int8, "bool": np.bool_}
DTYPES = tuple(HOST)
FLOATS = ("f32", "f16", "bf16")
INTS = ("i32", "i64", "u8", "i8")
I32_MAX, I32_MIN = 2**31 - 1, -2**31
I64_MAX, I64_MIN = 2**63 - 1, -2**63

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # simulator's NumPy scalars

# Values chosen to hit truncation, round-to-nearest-even ties and overflow of the narrower
# float types. Every one is in range of every integer dtype (out-of-range: its own test).
F32_VALUES = [
    0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.7, 3.99, -3.99, 7.0, -8.0, 100.25, -100.75,
    1 + 2**-11, 1 + 3 * 2**-11,          # f16 ties: to 1 and to 1 + 2**-9 (even)
    2049.0, 2051.0, -2049.0,             # f16 ties between integers
    1 + 2**-8, 1 + 3 * 2**-8,            # bf16 ties: to 1 and to 1 + 2**-6
    257.0, 259.0, -257.0,                # bf16 ties between integers
    65504.0, 65519.0, 65520.0, 1e5,      # f16 max, below/at the overflow tie, overflow
    1e-6, 3e-8, 6.1e-5,                  # f16 subnormals / underflow
    1e-40, -3e-39,                       # f32 subnormals (bf16 keeps them)
    16777217.0, 2147483520.0, -2147483648.0,   # large, still in i32 range
    np.inf, -np.inf, np.nan,
]
F32_FINITE_INT_RANGE = [v for v in F32_VALUES if np.isfinite(v)]
I32_VALUES = [0, 1, -1, 2, -7, 100, 255, 257, 259, -257, 2047, 2049, 2051, 65504, 65519, 65520,
              70000, -70000, 16777216, 16777217, 123456789, I32_MAX, I32_MIN]
I64_VALUES = I32_VALUES + [2**40, -(2**40) - 4096, 2**53, 2**62, I64_MAX, I64_MIN]


def _source(rng, dtype):
    """The test values of ``dtype`` plus random ones (never all zero)."""
    if dtype == "bool":
        v = rng.random(13) < 0.5
        v[:2] = [True, False]
        return v
    if dtype == "i32":
        return np.concatenate([I32_VALUES, rng.integers(-10**6, 10**6, 14)]).astype(np.int32)
    if dtype == "i64":
        return np.concatenate([I64_VALUES, rng.integers(-10**12, 10**12, 14)]).astype(np.int64)
    if dtype in ("u8", "i8"):
        info = np.iinfo(HOST[dtype])
        edge = [0, 1, 2, 7, 100, 127, info.min, info.max, info.max - 1]
        return np.concatenate([edge, rng.integers(info.min, info.max + 1, 14)]).astype(HOST[dtype])
    rand = rng.uniform(-300, 300, 14).astype(np.float32)
    v = np.concatenate([np.array(F32_VALUES, np.float32), rand])
    if dtype == "f32":
        return v
    return v.astype(HOST[dtype])      # f16 / bf16: the same values, rounded (inf where too big)


def _oracle(src, sdt, ddt):
    """Expected result of cast(src: sdt -> ddt), from NumPy / ml_dtypes alone."""
    if ddt == "bool":
        return src.astype(np.float64) != 0 if sdt != "bool" else src.copy()
    if sdt in FLOATS and ddt in ("u8", "i8"):      # truncated to i32, then wrapped
        return _oracle(src, sdt, "i32").astype(HOST[ddt])
    if sdt in FLOATS and ddt in INTS:
        f = src.astype(np.float64)
        lo, hi = (I32_MIN, I32_MAX) if ddt == "i32" else (I64_MIN, I64_MAX)
        out = np.zeros(f.shape, HOST[ddt])
        ok = np.isfinite(f) & (f > lo - 1) & (f < hi + 1)
        out[ok] = np.trunc(f[ok]).astype(HOST[ddt])      # exact: in range
        out[~np.isnan(f) & (f >= hi + 1)] = hi
        out[~np.isnan(f) & (f <= lo - 1)] = lo
        return out                                        # NaN -> 0
    if sdt in ("f16", "bf16") or ddt in ("f16", "bf16"):
        if sdt in FLOATS:       # widening to f32 is exact; then one round-to-nearest-even
            return src.astype(np.float32).astype(HOST[ddt])
        if ddt == "bf16":       # int -> bf16: through f32 like every backend (RNE each step)
            return src.astype(np.float32).astype(BF16)
    return src.astype(HOST[ddt])


def _same(got, want, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert got.shape == want.shape
    if got.dtype.kind == "f" or got.dtype == np.dtype(BF16):
        g, w = got.astype(np.float64), want.astype(np.float64)
        np.testing.assert_array_equal(g, w, err_msg=what)       # NaNs compare equal here
        mism = (np.signbit(g) != np.signbit(w)) & ~np.isnan(w)
        assert not mism.any(), f"{what}: sign of zero differs at {np.flatnonzero(mism)}"
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


PAIRS = [(s, d) for s in DTYPES for d in DTYPES]


@pytest.mark.parametrize("sdt,ddt", PAIRS, ids=[f"{s}->{d}" for s, d in PAIRS])
def test_cast_pair(rng, sdt, ddt):
    src = _source(rng, sdt)
    if sdt == "i64" and ddt == "i32":       # narrowing int casts: only in-range values
        src = src[(src >= I32_MIN) & (src <= I32_MAX)]
    if sdt in FLOATS and ddt in INTS:       # out of range / inf / NaN: test_float_to_int_saturates
        f = src.astype(np.float64)
        src = src[np.isfinite(f) & (np.abs(f) < 2**31)]
    g = rlx.Graph("cast")
    x = g.input("x", src.shape, sdt)
    y = g.cast(x, ddt)
    assert y.shape == src.shape and str(y.dtype) == ddt
    g.set_outputs([y])
    exe = rlx.compile(g)
    (got,) = exe.run({"x": src})
    want = _oracle(src, sdt, ddt)
    _same(got, want, f"cast {sdt}->{ddt}")
    if sdt in FLOATS and ddt in INTS:       # truncation toward zero, like numpy astype
        np.testing.assert_array_equal(got, np.trunc(src.astype(np.float64)).astype(np.int64)
                                      .astype(HOST[ddt]))
    assert exe.memory_report()["views"] == (1 if sdt == ddt else 0)


def test_cast_rounding_spelled_out():
    """A few results written out, independent of the oracle function."""
    v = np.array([1 + 2**-11, 1 + 3 * 2**-11, 2049, 65519, 65520, 1 + 2**-8, 1 + 3 * 2**-8,
                  257, 259, -2.7, 2.7, -0.5], np.float32)
    g = rlx.Graph("spelled")
    x = g.input("x", v.shape, "f32")
    g.set_outputs([g.cast(x, "f16"), g.cast(x, "bf16"), g.cast(x, "i32"), g.cast(x, "i64")])
    h, b, i, q = run_graph(g, {"x": v})
    assert h[0] == 1.0 and h[1] == 1 + 2**-9 and h[2] == 2048 and h[3] == 65504 and h[4] == np.inf
    assert b[5] == 1.0 and b[6] == 1 + 2**-6 and b[7] == 256 and b[8] == 260
    assert list(i[9:]) == [-2, 2, 0] and list(q[9:]) == [-2, 2, 0]


@pytest.mark.parametrize("sdt", FLOATS)
def test_float_to_int_saturates(sdt):
    vals = np.array([3e9, -3e9, 1e19, -1e19, 1e30, -1e30, np.inf, -np.inf, np.nan, -np.nan,
                     2147483520.0, -2147483648.0, 9.2e18, -9.2e18, 1.5, -1.5], np.float32)
    src = vals.astype(HOST[sdt])
    f = src.astype(np.float64)
    g = rlx.Graph("sat")
    x = g.input("x", src.shape, sdt)
    g.set_outputs([g.cast(x, "i32"), g.cast(x, "i64")])
    r32, r64 = run_graph(g, {"x": src})
    for got, lo, hi, dt in ((r32, I32_MIN, I32_MAX, np.int32), (r64, I64_MIN, I64_MAX, np.int64)):
        want = []
        for val in f:
            if np.isnan(val):
                want.append(0)
            elif val >= hi:
                want.append(hi)
            elif val <= lo:
                want.append(lo)
            else:
                want.append(int(val))            # int() truncates toward zero
        assert got.dtype == dt
        np.testing.assert_array_equal(got, np.array(want, dt), err_msg=f"{sdt}->{dt.__name__}")
    # the headline cases, spelled out (f32 source)
    if sdt == "f32":
        assert list(r32[:4]) == [I32_MAX, I32_MIN, I32_MAX, I32_MIN]
        assert list(r32[6:10]) == [I32_MAX, I32_MIN, 0, 0]
        assert list(r64[2:4]) == [I64_MAX, I64_MIN] and list(r64[6:10]) == [I64_MAX, I64_MIN, 0, 0]
        assert r64[0] == 3000000000 and r64[1] == -3000000000


def test_cast_bool_and_nonzero():
    f = np.array([0.0, -0.0, 0.25, -3.0, np.nan, np.inf], np.float32)
    i = np.array([0, 5, -1, 0, I32_MIN, 2], np.int32)
    b = np.array([True, False, True, True, False, True])
    g = rlx.Graph("bools")
    xf, xi, xb = g.input("f", f.shape, "f32"), g.input("i", i.shape, "i32"), g.input("b", b.shape, "bool")
    outs = [g.cast(xf, "bool"), g.cast(xi, "bool")] + [g.cast(xb, d) for d in DTYPES]
    g.set_outputs(outs)
    res = run_graph(g, {"f": f, "i": i, "b": b})
    np.testing.assert_array_equal(res[0], [False, False, True, True, True, True])
    np.testing.assert_array_equal(res[1], [False, True, True, False, True, True])
    for d, r in zip(DTYPES, res[2:]):
        assert r.dtype == np.dtype(HOST[d])
        np.testing.assert_array_equal(r.astype(np.float64), b.astype(np.float64), err_msg=d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_same_dtype_cast_is_view(rng, dtype):
    src = _source(rng, dtype)[:11]
    g = rlx.Graph("view")
    x = g.input("x", src.shape, dtype)
    y = g.cast(x, dtype)
    z = g.cast(y, dtype)                    # a view of a view
    g.set_outputs([y, z])
    exe = rlx.compile(g)
    rep = exe.memory_report()
    assert rep["views"] == 2 and rep["buffers"] == 1
    assert rep["intermediate_bytes"] == 0 and rep["output_bytes"] == 0
    y_np, z_np = exe.run({"x": src})
    _same(y_np, src, f"view {dtype}")
    _same(z_np, src, f"view of view {dtype}")


def test_cast_dtype_spellings_and_chain(rng):
    v = rng.uniform(-5, 5, (3, 7)).astype(np.float32)
    g = rlx.Graph("spell")
    x = g.input("x", v.shape, "f32")
    a = g.cast(x, "float16")
    b = g.cast(x, np.int32)
    c = g.cast(x, "bfloat16")
    d = g.cast(g.cast(x, "f16"), "f32")     # round trip through f16 rounds once
    e = g.cast(g.cast(c, "f32"), "i64")
    assert [str(t.dtype) for t in (a, b, c, d, e)] == ["f16", "i32", "bf16", "f32", "i64"]
    g.set_outputs([a, b, c, d, e])
    ra, rb, rc, rd, re_ = run_graph(g, {"x": v})
    _same(ra, v.astype(np.float16), "float16")
    _same(rb, v.astype(np.int32), "np.int32")
    _same(rc, v.astype(BF16), "bfloat16")
    _same(rd, v.astype(np.float16).astype(np.float32), "f32->f16->f32")
    _same(re_, v.astype(BF16).astype(np.float32).astype(np.int64), "f32->bf16->f32->i64")


def test_u8_i8_wrap_and_promote():
    """u8 / i8 results spelled out: float casts truncate then wrap, arithmetic wraps in the
    dtype (PyTorch), u8 with i8 promotes to i16, and fused chains wrap each stored value."""
    f = np.array([300.7, -1.5, 255.9, -129.2, 127.0], np.float32)
    a = np.array([200, 100, 255, 0, 7], np.uint8)
    b = np.array([-128, 127, -1, 5, -7], np.int8)
    g = rlx.Graph("wrap")
    xf, xa, xb = g.input("f", f.shape, "f32"), g.input("a", a.shape, "u8"), g.input("b", b.shape, "i8")
    s = g.add(xa, xa)                                 # u8 + u8 stays u8 (wraps)
    g.set_outputs([g.cast(xf, "u8"), g.cast(xf, "i8"), s, g.add(xa, xb), g.mul(g.add(s, xa), 1),
                   g.cast(xa, "f32")])
    cu, ci, ss, ab, chain, fl = run_graph(g, {"f": f, "a": a, "b": b})
    assert cu.dtype == np.uint8 and list(cu) == [44, 255, 255, 127, 127]
    assert ci.dtype == np.int8 and list(ci) == [44, -1, -1, 127, 127]
    assert ss.dtype == np.uint8 and list(ss) == [144, 200, 254, 0, 14]
    assert ab.dtype == np.int16 and list(ab) == [72, 227, 254, 5, 0]
    assert chain.dtype == np.uint8 and list(chain) == [88, 44, 253, 0, 21]
    np.testing.assert_array_equal(fl, a.astype(np.float32))


# ---- f64 -> f16 / bf16 / fp8: one rounding (an H200 gave an f16 1 ulp off: f64 -> f32 -> f16) --
NARROW = {"f16": (np.float16, np.uint16), "bf16": (BF16, np.uint16),
          "f8e4m3": (ml_dtypes.float8_e4m3fn, np.uint8), "f8e5m2": (ml_dtypes.float8_e5m2, np.uint8)}


def _grid(dtype):
    """The float64 values of dtype's positive bit patterns 0, 1, ..., up to the first that is
    not finite, which stands for the next step past the largest (2^16 for f16, 2^128 for bf16,
    480 for e4m3fn): round to nearest even over this grid is IEEE's rounding with overflow."""
    host, bits = NARROW[dtype]
    pats = np.arange(np.iinfo(bits).max // 2 + 1, dtype=bits)
    vals = pats.view(host).astype(np.float64)
    top = int(np.argmax(~np.isfinite(vals)))
    grid = vals[:top + 1].copy()
    grid[top] = 2 * grid[top - 1] - grid[top - 2]
    return grid


def _round_once(x, dtype):
    """x (float64) rounded to nearest, ties to the even bit pattern, once, as dtype's bit
    patterns: midpoints of grid neighbours have one bit more than they do, so the float64
    comparisons are exact. Past the grid (or at its top): inf, NaN for e4m3fn (no inf)."""
    host, bits = NARROW[dtype]
    grid = _grid(dtype)
    top = len(grid) - 1
    inf_pat = np.asarray(np.inf, np.float64).astype(host).view(bits)
    out = np.zeros(x.shape, bits)
    for k, v in enumerate(x):
        if v != v:
            out[k] = np.asarray(np.nan).astype(host).view(bits)
            continue
        a = abs(v)
        i = int(np.searchsorted(grid, a, side="right")) - 1
        if i >= top:
            p = top
        else:
            mid = (grid[i] + grid[i + 1]) / 2
            p = i + 1 if a > mid or (a == mid and i % 2) else i
        if p == top:
            p = int(inf_pat) & (np.iinfo(bits).max // 2)     # inf, or e4m3fn's NaN pattern
        out[k] = p | (np.iinfo(bits).max // 2 + 1 if np.signbit(v) else 0)
    return out


def _ties(dtype):
    """float64 values a hair either side of dtype's rounding ties, each close enough that its
    nearest float32 is the tie itself (so f64 -> f32 -> dtype rounds it a second time, to the
    even side), across normals, subnormals and the overflow threshold; then specials."""
    grid = _grid(dtype)
    idx = np.unique(np.concatenate([np.arange(0, 6), np.linspace(6, len(grid) - 6, 40).astype(int),
                                    np.arange(len(grid) - 5, len(grid) - 1)]))
    mids = (grid[idx] + grid[idx + 1]) / 2
    delta = np.where(mids >= 2.0**-126, mids * 2.0**-30, 2.0**-155)
    x = np.concatenate([mids - delta, mids + delta])
    x = np.concatenate([x, -x])
    assert (np.abs(x.astype(np.float32).astype(np.float64)) == np.tile(mids, 4)).all()
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e300, -1e300, 1e-300, -1e-300, 3.5e38,
               -3.4e38, 1.0 / 3, 2.0 / 3, np.pi, 1e-7, 65519.99, 65520.0, 464.0, 464.01]
    return np.concatenate([x, special])


@pytest.mark.parametrize("ddt", list(NARROW))
def test_f64_to_narrow_float_rounds_once(rng, ddt):
    """cast f64 -> f16 / bf16 / fp8 rounds the f64 value once (nearest even, inf past the
    largest, e4m3fn's NaN), not through the nearest f32: at a hair from a tie of the narrow
    type the nearest f32 is the tie, which then rounds to the even side, an ulp off half the
    time. Oracle: _round_once over the dtype's bit patterns (and NumPy's direct f64 -> f16)."""
    host, bits = NARROW[ddt]
    x = np.concatenate([_ties(ddt), rng.standard_normal(16) * 10.0 ** rng.integers(-9, 6, 16)])
    want = _round_once(x, ddt)
    if ddt == "f16":
        np.testing.assert_array_equal(want, x.astype(np.float16).view(np.uint16))
    twice = x.astype(np.float32).astype(host).view(bits)
    assert (twice != want).sum() >= 40          # the values do tell one rounding from two
    g = rlx.Graph("cast64")
    a = g.input("x", x.shape, "f64")
    g.set_outputs([g.cast(a, ddt), g.cast(g.cast(a, ddt), "f32")])   # the stored and the
    got, widened = run_graph(g, {"x": x})                            # chained value
    assert got.dtype == np.dtype(host)
    for out, what in ((got.view(bits), "stored"), (widened.astype(host).view(bits), "chained")):
        bad = np.flatnonzero(out != want)
        nan = np.isnan(x) | (np.isnan(want.view(host).astype(np.float64)))
        bad = bad[~(nan[bad] & np.isnan(out.view(host).astype(np.float64))[bad])]
        assert not bad.size, (f"f64 -> {ddt} {what}: {bad.size} wrong, e.g. x={x[bad[0]]!r}: got "
                              f"{out.view(host)[bad[0]]!r}, want {want.view(host)[bad[0]]!r}")
