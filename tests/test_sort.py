"""sort / argsort against NumPy's stable argsort: ties in index order both ways, NaN and
signed zeros, i32, a non-last axis, rows that cross the tile size (8 in the simulator) and
need merge passes, the values' gradient, and the errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from gradcheck import check


def ref_order(x, axis, descending):
    """torch.sort(stable=True)'s order: NaN largest; descending keeps ties in index order."""
    if descending:
        if x.dtype.kind != "f":
            return np.argsort(-x.astype(np.int64), axis=axis, kind="stable")
        key = -x.astype(np.float64)
        key[np.isneginf(key)] = -np.finfo(np.float64).max     # +inf: after NaN
        key[np.isnan(key)] = -np.inf                           # NaN: first
        return np.argsort(key, axis=axis, kind="stable")
    return np.argsort(x, axis=axis, kind="stable")


@pytest.mark.parametrize("shape,axis", [((3, 1), -1), ((2, 5), -1), ((4, 8), 1), ((3, 9), -1),
                                        ((2, 37), -1), ((5, 3, 4), 0), ((2, 6, 3), 1)])
@pytest.mark.parametrize("descending", [False, True])
def test_sort(rng, shape, axis, descending):
    x = rng.integers(-3, 4, shape).astype(np.float32)     # many ties
    flat = x.reshape(-1)
    flat[rng.choice(flat.size, min(3, flat.size), replace=False)] = [np.nan, -0.0, np.inf][
        :min(3, flat.size)]
    g = rlx.Graph("sort")
    t = g.input("x", shape)
    v, i = g.sort(t, axis=axis, descending=descending)
    g.set_outputs([v, i, g.argsort(t, axis=axis, descending=descending)])
    vals, idx, idx2 = run_graph(g, {"x": x})
    want = ref_order(x, axis, descending)
    assert idx.dtype == np.int64 and idx.shape == shape
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(idx2, want)
    np.testing.assert_array_equal(vals, np.take_along_axis(x, want, axis))


@pytest.mark.parametrize("descending", [False, True])
def test_sort_i32(rng, descending):
    x = rng.integers(-2**31, 2**31 - 1, (3, 21), dtype=np.int64).astype(np.int32)
    x[0, :4] = [-2**31, 2**31 - 1, 0, -1]
    x[1, :] = x[1, 0]                                      # all ties
    g = rlx.Graph("sort_i32")
    v, i = g.sort(g.input("x", x.shape, "i32"), descending=descending)
    g.set_outputs([v, i])
    vals, idx = run_graph(g, {"x": x})
    want = ref_order(x, -1, descending)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(vals, np.take_along_axis(x, want, -1))
    assert vals.dtype == np.int32


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
@pytest.mark.parametrize("descending", [False, True])
def test_sort_half(rng, dtype, descending):
    """f16 / bf16 (as torch): ordered by their exact f32 values, the values returned in x's
    dtype bit for bit; ties (many), NaN, +-inf and -0.0; a middle axis."""
    import ml_dtypes
    host = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}[dtype]
    x = (rng.integers(-6, 7, (3, 13, 2)) * 0.375).astype(np.float64)
    x[0, :4, 0] = [np.nan, np.inf, -np.inf, -0.0]
    x[2, 5:8, 1] = [np.nan, 1e4, -1e4]
    xh = x.astype(host)
    g = rlx.Graph("sort_half")
    t = g.input("x", x.shape, dtype)
    v, i = g.sort(t, axis=1, descending=descending)
    g.set_outputs([v, i, g.argsort(t, axis=1, descending=descending)])
    vals, idx, idx2 = run_graph(g, {"x": xh})
    want = ref_order(xh.astype(np.float32), 1, descending)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(idx2, want)
    assert vals.dtype == np.dtype(host)
    np.testing.assert_array_equal(vals.view(np.uint16),
                                  np.take_along_axis(xh, want, 1).view(np.uint16))


def test_sort_values_gradient(rng):
    x = rng.standard_normal((3, 11))
    g = rlx.Graph("sort_grad")
    t = g.input("x", x.shape)
    v, _ = g.sort(t, axis=0, descending=True)
    check(g, v, {"x": t}, {"x": x}, lambda x: -np.sort(-x, axis=0),
          seed=rng.standard_normal(v.shape))


def test_sort_errors():
    g = rlx.Graph("e")
    cases = [
        (lambda: g.sort(g.input("a", (3,), "i64")), "sort: x must be f32, i32, f16 or bf16"),
        (lambda: g.argsort(g.input("d", (3,), "f64")), "argsort: x must be f32, i32, f16 or "
                                                       "bf16, got f64 [3]"),
        (lambda: g.sort(g.input("b", (3, 4)), axis=2), "sort: axis 2 out of range"),
        (lambda: g.argsort(g.input("c", ())), "argsort: x must have at least one axis"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value), str(e.value)


@pytest.mark.skipif(not ON_GPU, reason="rows longer than a tile on the GPU")
def test_sort_long_rows_gpu(rng):
    x = rng.standard_normal((3, 70000)).astype(np.float32)
    x[:, ::7] = 0.5
    g = rlx.Graph("sort_long")
    v, i = g.sort(g.input("x", x.shape), descending=True)
    g.set_outputs([v, i])
    vals, idx = run_graph(g, {"x": x})
    want = ref_order(x, -1, True)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(vals, np.take_along_axis(x, want, -1))
