"""softmax, log_softmax, layer_norm, rms_norm against NumPy, over every axis and row length."""
import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph


def np_softmax(x, ax):
    e = np.exp(x - x.max(ax, keepdims=True))
    return e / e.sum(ax, keepdims=True)


def np_log_softmax(x, ax):
    z = x - x.max(ax, keepdims=True)
    return z - np.log(np.exp(z).sum(ax, keepdims=True))


def bshape(shape, ax):
    s = [1] * len(shape)
    s[ax] = shape[ax]
    return s


def np_layer_norm(h, gam, bet, ax, eps):
    mu = h.mean(ax, keepdims=True)
    y = (h - mu) / np.sqrt(h.var(ax, keepdims=True) + eps) * gam.reshape(bshape(h.shape, ax))
    return y if bet is None else y + bet.reshape(bshape(h.shape, ax))


def np_rms_norm(h, gam, bet, ax, eps):
    y = h / np.sqrt((h * h).mean(ax, keepdims=True) + eps) * gam.reshape(bshape(h.shape, ax))
    return y if bet is None else y + bet.reshape(bshape(h.shape, ax))


# rows of 1, 3, 1000 and 5000 (register and streamed kernels), middle and leading axes; rows
# exactly g*vpt long (no bounds tests) and more rows than the grid holds at once (prefetching)
SHAPES = [((4, 1), -1), ((5, 3), 1), ((2, 1000), -1), ((1, 5000), -1), ((3, 7, 5), 1),
          ((7, 64), -1), ((37, 24), -1),
          ((6, 4, 3), -3), ((3, 37), 0), ((2, 3, 4, 5), 2)]


@pytest.mark.parametrize("shape,ax", SHAPES)
def test_softmax_and_log_softmax(rng, shape, ax):
    g = rlx.Graph("sm")
    x = g.input("x", shape)
    g.set_outputs([g.softmax(x, ax), g.log_softmax(x, axis=ax)])
    xv = (rng.standard_normal(shape) * 4).astype(np.float32)
    sm, lsm = run_graph(g, {"x": xv})
    x64 = xv.astype(np.float64)
    np.testing.assert_allclose(sm, np_softmax(x64, ax), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lsm, np_log_softmax(x64, ax), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("shape,ax", [((3, 9), -1), ((2, 700), -1), ((5, 4), 0)])
def test_softmax_large_magnitudes_and_neg_inf(rng, shape, ax):
    xv = (rng.standard_normal(shape) * 3e4).astype(np.float32)     # exp would overflow naively
    xv.flat[::3] = -np.inf                                           # masked entries
    g = rlx.Graph("big")
    x = g.input("x", shape)
    g.set_outputs([g.softmax(x, ax), g.log_softmax(x, ax)])
    sm, lsm = run_graph(g, {"x": xv})
    assert np.isfinite(sm).all() and not np.isnan(lsm).any()
    x64 = xv.astype(np.float64)
    np.testing.assert_allclose(sm, np_softmax(x64, ax), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lsm, np_log_softmax(x64, ax), rtol=1e-5, atol=1e-2)
    assert (sm.reshape(-1)[::3] == 0).all() and np.isneginf(lsm.reshape(-1)[::3]).all()


def test_softmax_nan_row_stays_nan(rng):
    xv = rng.standard_normal((3, 6)).astype(np.float32)
    xv[1, 2] = np.nan
    g = rlx.Graph("nan")
    x = g.input("x", (3, 6))
    g.set_outputs([g.softmax(x)])
    (sm,) = run_graph(g, {"x": xv})
    assert np.isnan(sm[1]).all() and np.isfinite(sm[[0, 2]]).all()


@pytest.mark.parametrize("dtype", ["f16", "bf16"])
def test_half_inputs_compute_in_f32(rng, dtype):
    host = np.float16 if dtype == "f16" else ml_dtypes.bfloat16
    xv = rng.standard_normal((3, 40)).astype(host)
    gv = rng.standard_normal(40).astype(host)
    g = rlx.Graph("half")
    x = g.input("x", (3, 40), dtype)
    gam = g.param("g", (40,), dtype)
    y, z = g.softmax(x), g.rms_norm(x, gam)
    assert y.dtype == rlx.dtype(dtype) and z.dtype == rlx.dtype(dtype)
    g.set_outputs([y, z])
    sm, rms = run_graph(g, {"x": xv}, {"g": gv})
    x64 = xv.astype(np.float64)
    tol = 1e-3 if dtype == "f16" else 1e-2
    np.testing.assert_allclose(sm.astype(np.float64), np_softmax(x64, -1), rtol=tol, atol=tol / 10)
    np.testing.assert_allclose(rms.astype(np.float64), np_rms_norm(x64, gv.astype(np.float64), None, -1, 1e-6),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("shape,ax", SHAPES)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norms(rng, shape, ax, op):
    n = shape[ax]
    xv = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)     # a mean far from 0
    rv = rng.standard_normal(shape).astype(np.float32)
    gv, bv = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    eps = 1e-3
    g = rlx.Graph(op)
    x, r = g.input("x", shape), g.input("r", shape)
    gam, bet = g.param("g", (n,)), g.param("b", (n,))
    f = getattr(g, op)
    plain = f(x, gam, axis=ax, eps=eps)
    with_beta = f(x, gam, bet, axis=ax, eps=eps)
    fused, h = f(x, gam, bet, axis=ax, eps=eps, residual=r, return_residual=True)
    fused_only = f(x, gam, axis=ax, eps=eps, residual=r)
    g.set_outputs([plain, with_beta, fused, h, fused_only])
    outs = run_graph(g, {"x": xv, "r": rv}, {"g": gv, "b": bv})
    ref = np_layer_norm if op == "layer_norm" else np_rms_norm
    x64, h64 = xv.astype(np.float64), xv.astype(np.float64) + rv
    refs = [ref(x64, gv, None, ax, eps), ref(x64, gv, bv, ax, eps), ref(h64, gv, bv, ax, eps),
            h64, ref(h64, gv, None, ax, eps)]
    for got, want in zip(outs, refs):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_default_eps_and_constant_rows():
    g = rlx.Graph("eps")
    x = g.input("x", (2, 8))
    gam = g.param("g", (8,))
    g.set_outputs([g.layer_norm(x, gam), g.rms_norm(x, gam)])
    xv = np.full((2, 8), 3.0, np.float32)                           # zero variance
    ln, rms = run_graph(g, {"x": xv}, {"g": np.ones(8, np.float32)})
    np.testing.assert_allclose(ln, 0.0, atol=1e-6)                  # default eps 1e-5: no NaN
    np.testing.assert_allclose(rms, 3 / np.sqrt(9 + 1e-6), rtol=1e-6)


def test_residual_sum_does_not_share_memory_with_inputs(rng):
    """The sum output is written by the norm's kernel: the planner must not put it on top of
    buffers that kernel still reads (a dead-after-the-norm intermediate)."""
    g = rlx.Graph("alias")
    x0 = g.input("x", (4, 300))
    gam = g.param("g", (300,))
    x = g.exp(x0 * 0.1)           # intermediates that die at the norm
    r = g.sin(x0)
    y, h = g.layer_norm(x, gam, residual=r, return_residual=True)
    g.set_outputs([g.tanh(y) + h])
    xv = rng.standard_normal((4, 300)).astype(np.float32)
    gv = rng.standard_normal(300).astype(np.float32)
    (got,) = run_graph(g, {"x": xv}, {"g": gv})
    x64 = xv.astype(np.float64)
    hh = np.exp(x64 * 0.1) + np.sin(x64)
    np.testing.assert_allclose(got, np.tanh(np_layer_norm(hh, gv, None, -1, 1e-5)) + hh, rtol=1e-4, atol=1e-4)


def test_row_op_errors():
    g = rlx.Graph("err")
    x = g.input("x", (3, 4))
    i = g.input("i", (3, 4), "i32")
    gam = g.param("g", (4,))
    with pytest.raises(ValueError, match=r"softmax: axis 2 is out of range for rank 2"):
        g.softmax(x, 2)
    with pytest.raises(ValueError, match=r"log_softmax: x must be a float tensor, got i32 \[3, 4\]"):
        g.log_softmax(i)
    with pytest.raises(ValueError, match=r"layer_norm: gamma must have shape \[3\] \(x \[3, 4\] along axis 0\), got \[4\]"):
        g.layer_norm(x, gam, axis=0)
    with pytest.raises(ValueError, match=r"rms_norm: residual must have x's shape \[3, 4\], got \[4\]"):
        g.rms_norm(x, gam, residual=gam)
    with pytest.raises(ValueError, match=r"rms_norm: return_residual=True needs a residual"):
        g.rms_norm(x, gam, return_residual=True)
    with pytest.raises(ValueError, match=r"layer_norm: eps must be a number >= 0, got -1"):
        g.layer_norm(x, gam, eps=-1)
    with pytest.raises(ValueError, match=r"softmax: x must have rank >= 1"):
        g.softmax(g.input("s", (), "f32"))
