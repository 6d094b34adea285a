"""NaN and Inf propagate as torch's CUDA kernels propagate them (issue 36): max / min
reductions and binary max / min carry a NaN; argmax / argmin and topk / sort take a NaN as the
largest value (the first NaN's index); a softmax / log_softmax row holding a NaN or a +inf is
all NaN, a -inf entry is 0 (-inf); norms of a row with a NaN or an infinity follow their
formulas (rms_norm: x * rsqrt(mean(x^2) + eps), so inf gives 0 * finite and NaN * inf);
sums and cumsum as IEEE addition. Oracles: float64 NumPy written here."""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HOST, UNIT

NAN, INF = np.nan, np.inf
X = np.array([[1.0, NAN, 3.0, -2.0, 0.5, 7.0, -3.0],
              [2.0, 5.0, -INF, 4.0, 1.0, -1.5, 0.25],
              [INF, 1.0, 2.0, 0.0, -1.0, 6.0, 3.5],
              [1.0, 2.0, 3.0, 4.0, 5.0, -6.0, 0.75],
              [-INF, 0.5, NAN, INF, 1.0, 2.0, -0.5]], np.float32)
Y = np.roll(X[::-1], 2, axis=1)
EPS = 1e-5


def softmax(x):
    m = x.max(-1, keepdims=True)          # NaN-propagating, as the kernels' row max
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True)


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def top2(x):
    """torch.topk(k=2): NaN above everything (rows here have no ties)."""
    key = np.where(np.isnan(x), INF, x)
    big = np.where(np.isnan(x), 1, 0)     # NaN before +inf
    idx = np.stack([np.lexsort((-key[r], -big[r]))[:2] for r in range(len(x))])
    return np.take_along_axis(x, idx, -1), idx


def close(got, want, dtype, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN places")
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)],
                                  err_msg=f"{what}: infinities")
    tol = 4 * UNIT[dtype] if dtype != "f32" else 1e-5
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_nan_and_inf_propagate_as_torch(dtype):
    x = X.astype(HOST[dtype]).astype(np.float64)
    y = Y.astype(HOST[dtype]).astype(np.float64)
    g = rlx.Graph()
    a, b = g.input("x", X.shape, dtype), g.input("y", Y.shape, dtype)
    gam = g.constant(np.linspace(0.5, 2.0, X.shape[1]).astype(np.float32), dtype)
    gv = np.linspace(0.5, 2.0, X.shape[1])
    with np.errstate(all="ignore"):
        mean = x.mean(-1, keepdims=True)
        cases = {
            "reduce_max": (g.reduce_max(a, [1]), x.max(1)),
            "reduce_min": (g.reduce_min(a, [1]), x.min(1)),
            "reduce_sum": (g.reduce_sum(a, [1]), x.sum(1)),
            "reduce_mean": (g.reduce_mean(a, [1]), x.mean(1)),
            "max": (g.binary("max", a, b), np.maximum(x, y)),
            "min": (g.binary("min", a, b), np.minimum(x, y)),
            "relu": (g.activation("relu", a), np.where(np.isnan(x), x, np.maximum(x, 0))),
            "cumsum": (g.cumsum(a, 1), np.cumsum(x, 1)),
            "softmax": (g.softmax(a, -1), softmax(x)),
            "log_softmax": (g.log_softmax(a, -1), log_softmax(x)),
            "rms_norm": (g.rms_norm(a, gam, eps=EPS),
                         x * (1 / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)) * gv),
            "layer_norm": (g.layer_norm(a, gam, eps=EPS),
                           (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS) * gv),
        }
    vals, idx = top2(x)
    tk = g.topk(a, 2, -1)
    exact = {"argmax": (g.argmax(a, 1), np.argmax(x, 1)),     # NumPy's: the first NaN
             "argmin": (g.argmin(a, 1), np.argmin(x, 1)),
             "topk values": (tk[0], vals), "topk indices": (tk[1], idx)}
    if dtype == "f32":
        s = g.sort(a, 1, descending=True)
        exact["sort"] = (s[0] if isinstance(s, tuple) else s,
                         np.take_along_axis(x, np.stack([np.lexsort((-np.where(np.isnan(r), INF, r),
                                                                     -np.isnan(r).astype(int))) for r in x]), 1))
    g.set_outputs([t for t, _ in cases.values()] + [t for t, _ in exact.values()])
    got = rlx.compile(g).run({"x": X.astype(HOST[dtype]), "y": Y.astype(HOST[dtype])})
    for (name, (_, want)), gv_ in zip(list(cases.items()) + list(exact.items()), got):
        if name in exact and np.asarray(gv_).dtype.kind in "iu":
            np.testing.assert_array_equal(gv_, want, err_msg=name)
        elif name in exact:
            close(gv_, want, dtype, name)
        else:
            close(gv_, want.astype(HOST[dtype]) if dtype != "f32" else want, dtype, name)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_softmax_over_a_middle_axis_carries_inf_and_nan(dtype):
    """softmax / log_softmax over an axis that is not the last (the column kernel, an online
    max and sum): a column holding +inf is all NaN, as torch's x - max = inf - inf makes it
    (the kernel had kept the sum at 1 and given 0 beside the NaN; the fuzzer's specials
    generator found it), a NaN column is all NaN, a -inf entry is 0 (-inf)."""
    xt = np.transpose(X, (1, 0))[:, :, None] * np.array([1.0, 0.5], np.float32)   # [7, 5, 2]
    x = xt.astype(HOST[dtype]).astype(np.float64)
    g = rlx.Graph()
    a = g.input("x", xt.shape, dtype)
    g.set_outputs([g.softmax(a, 0), g.log_softmax(a, 0)])
    got = rlx.compile(g).run({"x": xt.astype(HOST[dtype])})
    move = lambda f: np.moveaxis(f(np.moveaxis(x, 0, -1)), -1, 0)   # noqa: E731
    with np.errstate(all="ignore"):
        for gv_, want, name in zip(got, (move(softmax), move(log_softmax)),
                                   ("softmax", "log_softmax")):
            close(gv_, want, dtype, name)
    assert np.isnan(np.asarray(got[0], np.float64)[:, 2]).all()     # X's row 2 holds +inf
