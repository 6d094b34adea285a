"""reduce (sum mean max min prod), argmax/argmin and cumsum against NumPy oracles: every axis
(negative too), axis sets, keep_dim, every dtype each op takes, rows of 1 to 5000 (long rows
only with few rows: the simulator is slow), ties and NaN for argmax/argmin, the empty cases,
and the errors with their messages."""
import math

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph

KINDS = ("sum", "mean", "max", "min", "prod")
NP_REDUCE = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}
BF16 = ml_dtypes.bfloat16


def _run(x, build, dtype=None):
    """Build outputs from one input holding x, run once, return the numpy outputs."""
    g = rlx.Graph("reduce_test")
    xi = g.input("x", x.shape, dtype or rlx.dtype(x.dtype))
    outs = build(g, xi)
    g.set_outputs(outs if isinstance(outs, list) else [outs])
    return run_graph(g, {"x": x})


def _data(rng, shape, kind="sum"):
    """Random f32 data; for prod, magnitudes near 1 so long products stay finite."""
    if kind == "prod":
        return (rng.uniform(0.9, 1.1, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)
    return rng.standard_normal(shape).astype(np.float32)


def _oracle(kind, x, axes, keep_dim=False):
    ax = axes if axes is None or isinstance(axes, int) else tuple(axes)
    return NP_REDUCE[kind](x.astype(np.float64), axis=ax, keepdims=keep_dim)


def _count(shape, axes):
    if axes is None:
        return math.prod(shape)
    axes = (axes,) if isinstance(axes, int) else axes
    return math.prod(shape[a] for a in axes)


def _check_f32(y, ref, kind, count):
    assert y.dtype == np.float32 and y.shape == np.shape(ref), (y.shape, np.shape(ref))
    tol = 2e-6 * max(1.0, math.sqrt(count)) * (10 if kind == "prod" else 1)
    np.testing.assert_allclose(y, ref, rtol=max(tol, 1e-5), atol=tol)


# ---- f32, every kind, many layouts ---------------------------------------------------------
@pytest.mark.parametrize("shape,axes", [
    ((5, 1000), 1),            # one group a row
    ((5, 1000), -1),
    ((1, 5000), None),         # one long row: split into segments, then a second pass
    ((3, 1000), 1),
    ((1000, 3), -1),           # many short rows
    ((1000, 3), 0),            # leading axis, few columns: split across blocks
    ((7, 300), 0),             # leading axis, many columns
    ((5000, 2), 0),
    ((4, 5, 6), 1),            # middle axis: [outer, r, inner]
    ((4, 5, 6), (0, 2)),       # interleaved axes: two passes
    ((4, 5, 6), (-1, 0, 1)),
    ((2, 3, 4, 5), (1, 3)),
    ((2, 3, 4, 5), (0, 1)),
    ((3, 1, 4), 1),            # a size-1 axis: nothing to reduce
    ((3, 1, 4), (1, 2)),
    ((1, 7), 0),
    ((6,), 0),
    ((), None),                # a scalar
])
def test_reduce_f32(rng, shape, axes):
    xs = {k: _data(rng, shape, k) for k in KINDS}
    g = rlx.Graph("reduce_f32")
    g.set_outputs([g.reduce(k, g.input(f"x_{k}", shape, "f32"), axes) for k in KINDS])
    ys = run_graph(g, {f"x_{k}": xs[k] for k in KINDS})
    for k, y in zip(KINDS, ys):
        _check_f32(y, _oracle(k, xs[k], axes), k, _count(shape, axes))


@pytest.mark.parametrize("axes", [0, 1, -1, (0, 2), None])
def test_keep_dim(rng, axes):
    x = _data(rng, (3, 4, 5))
    ys = _run(x, lambda g, t: [g.reduce(k, t, axes, keep_dim=True) for k in ("sum", "max")]
              + [g.reduce("mean", t, axes, keep_dim=False)])
    for k, y in zip(("sum", "max"), ys[:2]):
        _check_f32(y, _oracle(k, x, axes, keep_dim=True), k, _count(x.shape, axes))
    _check_f32(ys[2], _oracle("mean", x, axes), "mean", _count(x.shape, axes))


def test_builder_methods(rng):
    x = _data(rng, (4, 6))
    ys = _run(x, lambda g, t: [g.sum(t, 1), g.mean(t, 0, keep_dim=True), g.reduce_sum(t),
                               g.reduce_mean(t, -1), g.reduce_max(t, 0), g.reduce_min(t, 1),
                               g.reduce_prod(t, (0, 1)), g.max(t, 0.5),
                               g.sum(t, np.int64(-1)), g.reduce_max(t, [np.int32(0)]),
                               g.argmax(t, np.int64(1)), g.cumsum(t, np.int32(0))])
    refs = [x.sum(1), x.mean(0, keepdims=True), x.sum(), x.mean(-1), x.max(0), x.min(1),
            x.astype(np.float64).prod(), np.maximum(x, 0.5),   # g.max stays element-wise
            x.sum(-1), x.max(0), x.argmax(1), x.cumsum(0)]
    for y, ref in zip(ys, refs):
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_axes_empty_tuple_is_identity(rng):
    x = rng.integers(-5, 5, (3, 4)).astype(np.int32)
    s, m, mx = _run(x, lambda g, t: [g.sum(t, ()), g.mean(t, ()), g.reduce_max(t, [])])
    assert s.dtype == np.int64 and m.dtype == np.float32 and mx.dtype == np.int32
    np.testing.assert_array_equal(s, x)
    np.testing.assert_array_equal(m, x.astype(np.float32))
    np.testing.assert_array_equal(mx, x)


def test_special_values():
    x = np.array([[1.0, np.nan, 3.0], [-np.inf, -np.inf, -np.inf], [np.inf, 1.0, -2.0],
                  [-0.0, 0.0, -1.0]], np.float32)
    mx, mn, s = _run(x, lambda g, t: [g.reduce_max(t, 1), g.reduce_min(t, 1), g.sum(t, 1)])
    np.testing.assert_array_equal(mx, [np.nan, -np.inf, np.inf, 0.0])
    np.testing.assert_array_equal(mn, [np.nan, -np.inf, -2.0, -1.0])
    np.testing.assert_array_equal(s, [np.nan, -np.inf, np.inf, -1.0])


# ---- other dtypes ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("shape,axes", [((3, 700), 1), ((600, 3), 0), ((4, 5, 6), (0, 2))])
def test_reduce_half(rng, dtype, shape, axes):
    host = np.float16 if dtype == "f16" else BF16
    xs = {k: _data(rng, shape, k).astype(host) for k in KINDS}
    g = rlx.Graph("reduce_half")
    outs = [g.reduce(k, g.input(f"x_{k}", shape, dtype), axes) for k in KINDS]
    g.set_outputs(outs)
    ys = run_graph(g, {f"x_{k}": xs[k] for k in KINDS})
    for k, y in zip(KINDS, ys):
        assert y.dtype == np.dtype(host), (k, y.dtype)
        ref = _oracle(k, xs[k].astype(np.float64), axes)
        if k in ("max", "min"):   # exact: the result is one of the inputs
            np.testing.assert_array_equal(y.astype(np.float64), ref)
        else:  # f32 accumulation, one rounding to the half type at the end
            rt = 1e-2 if dtype == "bf16" else 1e-3
            np.testing.assert_allclose(y.astype(np.float64), ref, rtol=rt, atol=rt * 0.1)


@pytest.mark.parametrize("dtype", ["i32", "i64"])
@pytest.mark.parametrize("shape,axes", [((3, 1000), 1), ((500, 3), 0), ((4, 5, 6), (0, 2)),
                                        ((4, 5, 6), None)])
def test_reduce_int(rng, dtype, shape, axes):
    host = np.int32 if dtype == "i32" else np.int64
    big = 2**30 if dtype == "i32" else 2**52   # sums past i32 and past f64 precision
    x = rng.integers(-big, big, shape).astype(host)
    xp = rng.integers(-2, 3, shape).astype(host)   # prod: small factors (i64 wraps like numpy)
    g = rlx.Graph("reduce_int")
    t, tp = g.input("x", shape, dtype), g.input("xp", shape, dtype)
    g.set_outputs([g.sum(t, axes), g.mean(t, axes), g.reduce_max(t, axes), g.reduce_min(t, axes),
                   g.reduce_prod(tp, axes)])
    s, m, mx, mn, p = run_graph(g, {"x": x, "xp": xp})
    assert s.dtype == np.int64 and m.dtype == np.float32 and mx.dtype == host
    assert mn.dtype == host and p.dtype == np.int64
    np.testing.assert_array_equal(s, np.sum(x.astype(np.int64), axis=axes))   # wraps like i64
    np.testing.assert_array_equal(mx, np.max(x, axis=axes))
    np.testing.assert_array_equal(mn, np.min(x, axis=axes))
    np.testing.assert_array_equal(p, np.prod(xp.astype(np.int64), axis=axes))
    if dtype == "i32":   # the exact i64 sum, converted once
        np.testing.assert_allclose(m, np.mean(x.astype(np.float64), axis=axes), rtol=1e-6)


def test_reduce_bool(rng):
    x = rng.random((6, 37)) < 0.5
    x[0] = True
    x[1] = False
    ys = _run(x, lambda g, t: [g.reduce(k, t, 1) for k in KINDS] + [g.sum(t, 0)])
    s, m, mx, mn, p, s0 = ys
    assert s.dtype == np.int64 and m.dtype == np.float32 and mx.dtype == np.bool_
    assert mn.dtype == np.bool_ and p.dtype == np.int64
    np.testing.assert_array_equal(s, x.sum(1))
    np.testing.assert_allclose(m, x.mean(1), rtol=1e-6)
    np.testing.assert_array_equal(mx, x.any(1))
    np.testing.assert_array_equal(mn, x.all(1))
    np.testing.assert_array_equal(p, x.all(1).astype(np.int64))
    np.testing.assert_array_equal(s0, x.sum(0))


def test_reduce_empty(rng):
    x = np.zeros((3, 0, 2), np.float32)
    ys = _run(x, lambda g, t: [g.sum(t, 1), g.reduce_prod(t, (1, 2)), g.mean(t, 1),
                               g.sum(t, 0), g.reduce_max(t, 0), g.sum(t, 1, keep_dim=True)])
    np.testing.assert_array_equal(ys[0], np.zeros((3, 2), np.float32))
    np.testing.assert_array_equal(ys[1], np.ones(3, np.float32))
    assert ys[2].shape == (3, 2) and np.isnan(ys[2]).all()
    assert ys[3].shape == (0, 2) and ys[4].shape == (0, 2)
    assert ys[5].shape == (3, 1, 2)
    xi = np.zeros((0, 4), np.int32)
    s, m = _run(xi, lambda g, t: [g.sum(t, 0), g.mean(t, 0)])
    assert s.dtype == np.int64 and (s == 0).all() and np.isnan(m).all() and m.dtype == np.float32


# ---- argmax / argmin -------------------------------------------------------------------------
@pytest.mark.parametrize("shape,axis", [((5, 1000), 1), ((2, 5000), -1), ((1000, 3), 0),
                                        ((1000, 3), 1), ((4, 5, 6), 1), ((4, 5, 6), -3),
                                        ((4, 5, 6), None), ((3, 1), 1), ((7,), 0)])
def test_argmax_argmin(rng, shape, axis):
    x = rng.standard_normal(shape).astype(np.float32)
    xt = rng.integers(0, 3, shape).astype(np.float32)        # many ties: the first one wins
    g = rlx.Graph("arg")
    a, b = g.input("a", shape, "f32"), g.input("b", shape, "f32")
    g.set_outputs([g.argmax(a, axis), g.argmin(a, axis), g.argmax(b, axis), g.argmin(b, axis),
                   g.argmax(a, axis, keep_dim=True)])
    ys = run_graph(g, {"a": x, "b": xt})
    refs = [np.argmax(x, axis), np.argmin(x, axis), np.argmax(xt, axis), np.argmin(xt, axis),
            np.expand_dims(np.argmax(x, axis), axis) if axis is not None
            else np.argmax(x).reshape((1,) * len(shape))]
    for y, ref in zip(ys, refs):
        assert y.dtype == np.int64
        np.testing.assert_array_equal(y, ref)


def test_argmax_nan_and_inf():
    x = np.array([[1.0, np.nan, 5.0, np.nan],      # NaN counts as the max and the min: first NaN
                  [-np.inf, -np.inf, -np.inf, -np.inf],
                  [2.0, 7.0, 7.0, np.inf],
                  [3.0, 3.0, -1.0, -1.0]], np.float32)
    xr = np.repeat(x, 40, axis=1)                  # the same rows, long enough for a group
    ys = _run(x, lambda g, t: [g.argmax(t, 1), g.argmin(t, 1), g.argmax(t, 0), g.argmin(t, 0)])
    np.testing.assert_array_equal(ys[0], [1, 0, 3, 0])
    np.testing.assert_array_equal(ys[1], [1, 0, 0, 2])
    np.testing.assert_array_equal(ys[2], np.argmax(x, 0))   # numpy: the first NaN wins too
    np.testing.assert_array_equal(ys[3], np.argmin(x, 0))
    yr = _run(xr, lambda g, t: [g.argmax(t, 1), g.argmin(t, 1)])
    np.testing.assert_array_equal(yr[0], [40, 0, 120, 0])
    np.testing.assert_array_equal(yr[1], [40, 0, 0, 80])
    yc = _run(np.ascontiguousarray(xr.T), lambda g, t: [g.argmax(t, 0), g.argmin(t, 0)])
    np.testing.assert_array_equal(yc[0], [40, 0, 120, 0])    # the same down the columns
    np.testing.assert_array_equal(yc[1], [40, 0, 0, 80])


def test_argmax_long_row_segments(rng):
    """A long single row is cut into segments (best pair each, then the best of those): ties
    and NaN across segment boundaries still give the first occurrence."""
    n = 3000
    a = rng.standard_normal((1, n)).astype(np.float32)
    a[0, [100, 2900]] = 9.0                      # tie across segments: 100
    a[0, [2500]] = -9.0
    b = a.copy()
    b[0, [2500, 2800]] = np.nan                  # NaNs in later segments: the first, 2500
    c = np.full((1, n), 7.0, np.float32)         # all equal: 0
    g = rlx.Graph("arg_long")
    ins = [g.input(k, (1, n), "f32") for k in "abc"]
    g.set_outputs([f(t, -1) for t in ins for f in (g.argmax, g.argmin)])
    ys = run_graph(g, {"a": a, "b": b, "c": c})
    np.testing.assert_array_equal(np.concatenate(ys), [100, 2500, 2500, 2500, 0, 0])


@pytest.mark.parametrize("dtype", ["f16", "bf16", "i32", "i64", "bool"])
def test_argmax_dtypes(rng, dtype):
    shape = (3, 200)
    if dtype in ("f16", "bf16"):
        x = rng.standard_normal(shape).astype(np.float16 if dtype == "f16" else BF16)
    elif dtype == "bool":
        x = rng.random(shape) < 0.3
    else:
        big = 2**31 - 1 if dtype == "i32" else 2**62
        x = rng.integers(-big, big, shape).astype(np.int32 if dtype == "i32" else np.int64)
    ys = _run(x, lambda g, t: [g.argmax(t, 1), g.argmin(t, 1), g.argmax(t, 0), g.argmin(t, 0)])
    xf = x.astype(np.float64) if dtype in ("f16", "bf16") else x
    for y, ref in zip(ys, [np.argmax(xf, 1), np.argmin(xf, 1), np.argmax(xf, 0),
                           np.argmin(xf, 0)]):
        np.testing.assert_array_equal(y, ref)


# ---- cumsum ----------------------------------------------------------------------------------
def _cumsum_ref(x, axis, exclusive):
    c = np.cumsum(x.astype(np.float64) if x.dtype.kind == "f" or x.dtype == BF16
                  else x.astype(np.int64), axis=axis)
    if exclusive:
        c = c - (x.astype(np.float64) if c.dtype.kind == "f" else x.astype(np.int64))
    return c


@pytest.mark.parametrize("shape,axis", [((4, 5, 6), 0), ((4, 5, 6), 1), ((4, 5, 6), 2),
                                        ((4, 5, 6), -1), ((4, 5, 6), -3), ((3, 1000), 1),
                                        ((1, 5000), -1), ((1000, 3), 0), ((1000, 3), 1),
                                        ((5, 1), 1), ((7,), 0)])
def test_cumsum_f32(rng, shape, axis):
    x = rng.standard_normal(shape).astype(np.float32)
    inc, exc = _run(x, lambda g, t: [g.cumsum(t, axis), g.cumsum(t, axis, exclusive=True)])
    for y, e in ((inc, False), (exc, True)):
        assert y.dtype == np.float32 and y.shape == shape
        tol = 2e-6 * math.sqrt(shape[axis]) + 1e-6
        np.testing.assert_allclose(y, _cumsum_ref(x, axis, e), rtol=1e-5, atol=tol)
    if shape[axis] > 1:   # exclusive: starts at exactly 0
        assert (np.take(exc, 0, axis) == 0).all()


@pytest.mark.parametrize("dtype", ["f16", "bf16", "i32", "i64", "bool"])
@pytest.mark.parametrize("shape,axis", [((3, 300), 1), ((40, 3), 0)])
def test_cumsum_dtypes(rng, dtype, shape, axis):
    if dtype in ("f16", "bf16"):
        x = rng.standard_normal(shape).astype(np.float16 if dtype == "f16" else BF16)
    elif dtype == "bool":
        x = rng.random(shape) < 0.5
    else:
        big = 2**31 - 1 if dtype == "i32" else 2**52
        x = rng.integers(-big, big, shape).astype(np.int32 if dtype == "i32" else np.int64)
    inc, exc = _run(x, lambda g, t: [g.cumsum(t, axis), g.cumsum(t, axis, exclusive=True)])
    for y, e in ((inc, False), (exc, True)):
        ref = _cumsum_ref(x, axis, e)
        if dtype in ("f16", "bf16"):   # f32 running sum, each output rounded once
            assert y.dtype == x.dtype
            rt = 1e-2 if dtype == "bf16" else 1e-3
            np.testing.assert_allclose(y.astype(np.float64), ref, rtol=rt,
                                       atol=rt * np.abs(ref).max())
        else:
            assert y.dtype == np.int64
            np.testing.assert_array_equal(y, ref)


def test_cumsum_empty():
    x = np.zeros((0, 3), np.float32)
    (y,) = _run(x, lambda g, t: [g.cumsum(t, 1)])
    assert y.shape == (0, 3)
    (y,) = _run(np.zeros((2, 0), np.int32), lambda g, t: [g.cumsum(t, 1, exclusive=True)])
    assert y.shape == (2, 0) and y.dtype == np.int64


# ---- graph printing and errors -----------------------------------------------------------------
def test_graph_str():
    g = rlx.Graph("p")
    x = g.input("x", (2, 3, 4), "f32")
    g.set_outputs([g.reduce("sum", x, (-1, 0), keep_dim=True), g.argmax(x, 1), g.cumsum(x, -1)])
    s = str(g)
    assert "reduce(%0, kind=sum, axes=(0, 2), keep_dim=True)" in s
    assert "f32[1, 3, 1]" in s and "i64[2, 4]" in s
    assert "argmax(%0, axes=(1,), keep_dim=False)" in s
    assert "cumsum(%0, axis=2, exclusive=False)" in s


@pytest.mark.parametrize("build,msg", [
    (lambda g, x: g.reduce("avg", x, 0),
     r"reduce: unknown kind 'avg'; expected one of sum, mean, max, min, prod"),
    (lambda g, x: g.reduce("sum", x, 3), r"reduce sum: axes 3 is out of range for rank 2"),
    (lambda g, x: g.reduce_max(x, -3), r"reduce max: axes -3 is out of range for rank 2"),
    (lambda g, x: g.sum(x, (0, -2)), r"reduce sum: axes \(0, -2\) repeats an axis"),
    (lambda g, x: g.mean(x, 1.0),
     r"reduce mean: axes must be an int, a sequence of ints or None, got 1.0"),
    (lambda g, x: g.mean(x, [0, 1.0]), r"reduce mean: axes must be an int, got 1.0"),
    (lambda g, x: g.sum(x, 0, keep_dim=1), r"reduce sum: keep_dim must be a bool, got 1"),
    (lambda g, x: g.argmax(x, 2), r"argmax: axis 2 is out of range for rank 2"),
    (lambda g, x: g.argmin(x, "0"), r"argmin: axis must be an int, got '0'"),
    (lambda g, x: g.argmax(x, 0, keep_dim=None), r"argmax: keep_dim must be a bool"),
    (lambda g, x: g.cumsum(x, -3), r"cumsum: axis -3 is out of range for rank 2"),
    (lambda g, x: g.cumsum(x, 0, exclusive="yes"), r"cumsum: exclusive must be a bool"),
])
def test_errors(build, msg):
    g = rlx.Graph("e")
    x = g.input("x", (3, 4), "f32")
    with pytest.raises(ValueError, match=msg):
        build(g, x)


def test_errors_empty_and_foreign():
    g = rlx.Graph("e")
    x = g.input("x", (3, 0), "f32")
    with pytest.raises(ValueError, match=r"reduce max: cannot reduce x \[3, 0\] over axes \[1\]: "
                                         r"the reduced extent is empty and max has no identity"):
        g.reduce_max(x, 1)
    with pytest.raises(ValueError, match=r"reduce min: cannot reduce x \[3, 0\] over axes "
                                         r"\[0, 1\]"):
        g.reduce_min(x)
    with pytest.raises(ValueError, match=r"argmin: x \[3, 0\] is empty along axis -1; argmin "
                                         r"of nothing is undefined"):
        g.argmin(x, -1)
    with pytest.raises(ValueError, match=r"argmax: x \[3, 0\] is empty; argmax of nothing"):
        g.argmax(x)
    s = g.input("s", (), "f32")
    with pytest.raises(ValueError, match=r"cumsum: x must have rank >= 1, got a scalar"):
        g.cumsum(s, 0)
    other = rlx.Graph("other").input("y", (2,), "f32")
    with pytest.raises(ValueError, match=r"reduce sum: x .* belongs to graph 'other', not 'e'"):
        g.sum(other)
    with pytest.raises(ValueError, match=r"cumsum: x must be a Tensor of this graph, got ndarray"):
        g.cumsum(np.zeros(3), 0)
