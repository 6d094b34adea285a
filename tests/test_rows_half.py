"""The row family, cross_entropy and dropout in f16 and bf16 (issue 32): the kernels read half
data in its own dtype, compute and accumulate in f32 and round the result once. Each result is
checked against float64 NumPy computed from the same half-rounded inputs (tests/halfref.py),
in every kernel shape: rows_reg (rows of 37 and 129), rows_loop (a row too long for registers)
and cols (a reduction over a leading axis); gamma f32 (torch autocast) and gamma in x's dtype
(a bf16 model); residual and return_residual; the backward ops; and the cases that a kernel
accumulating in half would fail."""
import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir import dtypes as dt
from rlx_numba.ir.opdef import F32, opdef
from rlx_numba.kernels import rows
from rlx_numba.kernels.launch import override_geometry
from conftest import ON_GPU
from halfref import HALVES, HOST, assert_half_close, f64, rounded

# (shape, axis, the kernel the forward takes under the simulator's row geometry, which every
# test here runs, on a GPU too: rows_reg holds at most 32 x 16 values a row, longer rows
# stream through rows_loop, a leading axis goes to cols)
LAYOUTS = [((3, 37), -1, "rows_reg"), ((2, 129), -1, "rows_reg"), ((1, 600), -1, "rows_loop"),
           ((37, 3), 0, "rows_cols")]


@pytest.fixture(autouse=True)
def small_row_geometry():
    with override_geometry("rows", rows.SIM):
        yield


def run(g, feeds):
    """(outputs, the kernel names of its steps)."""
    exe = rlx.compile(g)
    return exe.run(feeds), [s.kernel_name for s in exe.steps]


def bshape(shape, ax):
    s = [1] * len(shape)
    s[ax] = shape[ax]
    return s


def np_softmax(x, ax):
    e = np.exp(x - x.max(ax, keepdims=True))
    return e / e.sum(ax, keepdims=True)


def np_log_softmax(x, ax):
    z = x - x.max(ax, keepdims=True)
    return z - np.log(np.exp(z).sum(ax, keepdims=True))


def np_norm(kind, h, gam, bet, ax, eps):
    """(y, mean, rstd) of layer_norm / rms_norm of h along ax, float64."""
    mu = h.mean(ax, keepdims=True) if kind == "layer_norm" else 0 * h.sum(ax, keepdims=True)
    rstd = 1 / np.sqrt(((h - mu) ** 2).mean(ax, keepdims=True) + eps)
    y = (h - mu) * rstd * gam.reshape(bshape(h.shape, ax))
    return (y if bet is None else y + bet.reshape(bshape(h.shape, ax))), mu, rstd


def half_sum(v, dtype):
    """A serial sum rounded to ``dtype`` after every addition: what a kernel that
    accumulated in half would compute."""
    acc = HOST[dtype](0)
    for t in np.asarray(v, np.float64).ravel():
        acc = HOST[dtype](np.float32(acc) + np.float32(HOST[dtype](t)))
    return float(acc)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("shape,ax,kernel", LAYOUTS)
def test_softmax_and_log_softmax(rng, dtype, shape, ax, kernel):
    xv = rounded(rng.standard_normal(shape) * 3, dtype)
    g = rlx.Graph("sm")
    x = g.input("x", shape, dtype)
    y, ly = g.softmax(x, ax), g.log_softmax(x, ax)
    assert y.dtype == ly.dtype == dt.dtype(dtype)
    assert [n.op for n in g.nodes if n.op == "cast"] == []     # no decomposition
    g.set_outputs([y, ly])
    (sm, lsm), kernels = run(g, {"x": xv})
    assert all(k.startswith(kernel) for k in kernels), kernels
    assert_half_close(sm, np_softmax(f64(xv), ax), dtype, what="softmax")
    assert_half_close(lsm, np_log_softmax(f64(xv), ax), dtype, what="log_softmax")


@pytest.mark.parametrize("dtype", HALVES)
def test_softmax_masked_and_large(rng, dtype):
    """-inf entries (masked) give 0 / -inf; large logits do not overflow (exp of x - max)."""
    xv = rng.standard_normal((2, 37)) * (3e3 if dtype == "bf16" else 3e2)
    xv.flat[::4] = -np.inf
    xv = rounded(xv, dtype)
    g = rlx.Graph("mask")
    x = g.input("x", (2, 37), dtype)
    g.set_outputs([g.softmax(x), g.log_softmax(x)])
    (sm, lsm), _ = run(g, {"x": xv})
    assert (f64(sm).ravel()[::4] == 0).all() and np.isneginf(f64(lsm).ravel()[::4]).all()
    keep = ~np.isinf(f64(xv))
    assert_half_close(f64(sm)[keep].astype(HOST[dtype]), np_softmax(f64(xv), -1)[keep], dtype)
    assert_half_close(f64(lsm)[keep].astype(HOST[dtype]), np_log_softmax(f64(xv), -1)[keep],
                      dtype)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("gdtype", ["f32", "half"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,ax,kernel", LAYOUTS)
def test_norms(rng, dtype, gdtype, kind, shape, ax, kernel):
    gdtype = dtype if gdtype == "half" else "f32"
    n, eps = shape[ax], 1e-4
    xv = rounded(rng.standard_normal(shape) * 2 + 3, dtype)      # a mean away from 0
    rv = rounded(rng.standard_normal(shape), dtype)
    gv, bv = (rounded(rng.standard_normal(n), gdtype) for _ in range(2))
    g = rlx.Graph(kind)
    x, r = g.input("x", shape, dtype), g.input("r", shape, dtype)
    gam, bet = g.input("g", (n,), gdtype), g.input("b", (n,), gdtype)
    f = getattr(g, kind)
    plain = f(x, gam, axis=ax, eps=eps)
    fused, h = f(x, gam, bet, axis=ax, eps=eps, residual=r, return_residual=True)
    assert plain.dtype == fused.dtype == h.dtype == dt.dtype(dtype)
    assert [n.op for n in g.nodes if n.op == "cast"] == []
    g.set_outputs([plain, fused, h])
    (y0, y1, hs), kernels = run(g, {"x": xv, "r": rv, "g": gv, "b": bv})
    assert all(k.startswith(kernel) for k in kernels), kernels
    # the sum is rounded to x's dtype (as the stored x + residual would be) before the norm
    want_h = rounded(np.float32(xv) + np.float32(rv), dtype)
    np.testing.assert_array_equal(hs.view(np.uint16), want_h.view(np.uint16))
    assert_half_close(y0, np_norm(kind, f64(xv), f64(gv), None, ax, eps)[0], dtype, k=3,
                      what=f"{kind} plain")
    assert_half_close(y1, np_norm(kind, f64(want_h), f64(gv), f64(bv), ax, eps)[0], dtype, k=3,
                      what=f"{kind} residual + beta")


@pytest.mark.parametrize("dtype", HALVES)
def test_layer_norm_large_mean_accumulation(rng, dtype):
    """A row of 129 values 300 + N(0, 3^2) (bf16: multiples of 2 near 300). Its sum is ~38,700,
    where a bf16 ulp is 256 and an f16 ulp 32: a half accumulator rounds every addition by up
    to half of that, so its mean is off by several units, larger than the row's spread, and
    the normalised values are off by O(1). f32 accumulation keeps the mean to ~1e-3."""
    xv = rounded(300 + rng.standard_normal((2, 129)) * 3, dtype)
    gv = np.ones(129, np.float32)
    g = rlx.Graph("ln300")
    x, gam = g.input("x", (2, 129), dtype), g.input("g", (129,))
    g.set_outputs([g.layer_norm(x, gam)])
    (y,), _ = run(g, {"x": xv, "g": gv})
    want = np_norm("layer_norm", f64(xv), f64(gv), None, -1, 1e-5)[0]
    assert_half_close(y, want, dtype, k=3)
    # the half accumulator's mean really does fail the same check
    mean_half = np.array([half_sum(row, dtype) / 129 for row in f64(xv)])[:, None]
    std = f64(xv).std(-1, keepdims=True)
    with pytest.raises(AssertionError):
        assert_half_close(rounded((f64(xv) - mean_half) / std, dtype), want, dtype, k=3)


@pytest.mark.parametrize("dtype", HALVES)
def test_softmax_long_row_accumulation(rng, dtype):
    """softmax of a row of 2000 near-equal logits (rows_loop): every exp is ~1, the sum ~2000.
    In bf16 the sum stops growing at 256 (an ulp there is 2: adding ~1 rounds back to the
    same value), in f16 every addition past 1024 drops the fraction; outputs off by up to
    8x. The kernel's f32 sum is good to ~1e-7."""
    xv = rounded(rng.uniform(0, 0.1, (1, 2000)), dtype)
    g = rlx.Graph("sm2000")
    x = g.input("x", (1, 2000), dtype)
    g.set_outputs([g.softmax(x)])
    (y,), kernels = run(g, {"x": xv})
    assert kernels[0].startswith("rows_loop")
    e = np.exp(f64(xv) - f64(xv).max())
    assert_half_close(y, e / e.sum(), dtype)
    with pytest.raises(AssertionError):     # what a half accumulator would give
        assert_half_close(rounded(e / half_sum(e, dtype), dtype), e / e.sum(), dtype)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("shape,ax", [((3, 37), -1), ((2, 129), -1), ((37, 3), 0)])
def test_softmax_bwd(rng, dtype, log, shape, ax):
    xv = rng.standard_normal(shape) * 2
    yv = rounded(np_log_softmax(xv, ax) if log else np_softmax(xv, ax), dtype)
    dyv = rounded(rng.standard_normal(shape), dtype)
    g = rlx.Graph("smb")
    dy, y = g.input("dy", shape, dtype), g.input("y", shape, dtype)
    dx = g.softmax_bwd(dy, y, ax, log=log)
    assert dx.dtype == dt.dtype(dtype)
    g.set_outputs([dx])
    (got,), _ = run(g, {"dy": dyv, "y": yv})
    d, yy = f64(dyv), f64(yv)
    if log:
        want = d - np.exp(yy) * d.sum(ax, keepdims=True)
    else:
        want = yy * (d - (d * yy).sum(ax, keepdims=True))
    assert_half_close(got, want, dtype, k=3, what="softmax_bwd")


def np_norm_bwd(kind, dy, h, gam, ax, eps):
    """(dh, dgamma, dbeta, mean, rstd) of kind(h) * gamma (+ beta) for dy, float64."""
    _, mu, rstd = np_norm(kind, h, gam, None, ax, eps)
    xh = (h - mu) * rstd
    gg = dy * gam.reshape(bshape(h.shape, ax))
    dh = rstd * (gg - (gg.mean(ax, keepdims=True) if kind == "layer_norm" else 0.0)
                 - xh * (gg * xh).mean(ax, keepdims=True))
    over = tuple(i for i in range(h.ndim) if i != ax % h.ndim)
    return dh, (dy * xh).sum(over), dy.sum(over), mu, rstd


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("gdtype", ["f32", "half"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,ax,res", [((3, 37), -1, True), ((2, 129), -1, False),
                                          ((37, 3), 0, True)])
def test_norm_bwd(rng, dtype, gdtype, kind, shape, ax, res):
    """norm_bwd (dh, each row's f32 mean / rstd) and norm_param_bwd (dgamma, dbeta in gamma's
    dtype: one chunk writes them directly, several go through f32 partial sums)."""
    gdtype = dtype if gdtype == "half" else "f32"
    n, eps = shape[ax], 1e-4
    xv = rounded(rng.standard_normal(shape) + 1, dtype)
    rv = rounded(rng.standard_normal(shape), dtype)
    dyv = rounded(rng.standard_normal(shape), dtype)
    gv, bv = (rounded(rng.standard_normal(n), gdtype) for _ in range(2))
    g = rlx.Graph("nb")
    x, r, dy = (g.input(k, shape, dtype) for k in ("x", "r", "dy"))
    gam, bet = g.input("g", (n,), gdtype), g.input("b", (n,), gdtype)
    dh, dgam, dbet = g.norm_bwd(kind, dy, x, gam, bet, axis=ax, eps=eps,
                                residual=r if res else None)
    assert dh.dtype == dt.dtype(dtype) and dgam.dtype == dbet.dtype == dt.dtype(gdtype)
    (stats,) = dh.node.results
    g.set_outputs([dh, dgam, dbet, g.tensor(stats)])
    (gdh, gdg, gdb, gst), kernels = run(g, {"x": xv, "r": rv, "dy": dyv, "g": gv, "b": bv})
    nrows = int(np.prod(shape)) // n
    if not ON_GPU:   # the simulator's plan: two row chunks whenever there are 3+ rows
        assert any(k.startswith("norm_param_sum") for k in kernels) == (nrows > 2), kernels
    h = rounded(np.float32(xv) + np.float32(rv), dtype) if res else xv
    want = np_norm_bwd(kind, f64(dyv), f64(h), f64(gv), ax, eps)
    assert_half_close(gdh, want[0], dtype, k=3, what="dh")
    # an f32 dgamma is held to f32's roundoff: the row statistics and xhat carry a few
    # dozen f32 ulps of the n-term sums behind them
    # dozen f32 ulps of the n-term sums behind them; the sums over rows cancel, so the f32
    # bound is normwise (the order of the GPU's sums differs from the simulator's)
    kp = 64 if gdtype == "f32" else 3
    for got_, want_, what in ((gdg, want[1], "dgamma"), (gdb, want[2], "dbeta")):
        sc = np.abs(want_).max() if gdtype == "f32" else None
        assert_half_close(got_, want_, gdtype, k=kp, scale=sc, what=what)
    assert gst.dtype == np.float32 and gst.shape == (nrows, 2)
    mu, rstd = (np.moveaxis(v, ax, -1).reshape(-1) for v in want[3:])
    np.testing.assert_allclose(gst[:, 1], rstd, rtol=1e-5)
    np.testing.assert_allclose(gst[:, 0], mu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", HALVES)
def test_norm_grad_residual_and_return_residual(rng, dtype):
    """The VJPs end to end: (y, s) = rms_norm(x, gamma, residual=r, return_residual=True) in
    half, the loss reading both; the gradients come back in their operands' dtypes."""
    shape = (3, 37)
    xv, rv = (rounded(rng.standard_normal(shape), dtype) for _ in range(2))
    gv = rounded(rng.standard_normal(37), dtype)
    w1, w2 = rng.standard_normal(shape), rng.standard_normal(shape)
    g = rlx.Graph("ngrad")
    x, r, gam = g.input("x", shape, dtype), g.input("r", shape, dtype), g.input("g", (37,), dtype)
    y, s = g.rms_norm(x, gam, residual=r, return_residual=True)
    loss = g.reduce_sum(g.cast(y, "f32") * g.constant(w1.astype(np.float32))
                        + g.cast(s, "f32") * g.constant(w2.astype(np.float32)))
    dx, dr, dg = g.grad(loss, [x, r, gam])
    assert dx.dtype == dr.dtype == dg.dtype == dt.dtype(dtype)
    g.set_outputs([dx, dr, dg])
    (gdx, gdr, gdg), _ = run(g, {"x": xv, "r": rv, "g": gv})
    h = f64(rounded(np.float32(xv) + np.float32(rv), dtype))
    # dy in the dtype of y: the cast's VJP rounds w1 to it
    dh, dgam, _, _, _ = np_norm_bwd("rms_norm", f64(rounded(w1, dtype)), h, f64(gv), -1, 1e-6)
    want = dh + f64(rounded(w2, dtype))
    # dh is rounded to the dtype before ds is added (two half tensors, one add): up to u |dh|
    # beyond the sum's own rounding, however much the two cancel
    assert_half_close(gdx, want, dtype, k=2, scale=float(np.abs(dh).max()), what="dx")
    np.testing.assert_array_equal(gdx.view(np.uint16), gdr.view(np.uint16))
    assert_half_close(gdg, dgam, dtype, k=3, what="dgamma")


@pytest.mark.parametrize("dtype", HALVES)
def test_half_residual_add_folds_into_the_norm(rng, dtype):
    """layer_norm(a + b) in half: the add folds into the norm as its residual, and the fused
    result is bit for bit the unfused one (the kernel rounds a + b to the dtype as the add's
    own kernel does)."""
    shape = (3, 37)
    av, bv = (rounded(rng.standard_normal(shape) * 4, dtype) for _ in range(2))
    gv = rounded(rng.standard_normal(37), dtype)
    g = rlx.Graph("fold")
    a, b, gam = g.input("a", shape, dtype), g.input("b", shape, dtype), g.input("g", (37,), dtype)
    y = g.layer_norm(a + b, gam)
    g.set_outputs([y])
    exe = rlx.compile(g)
    assert [k for k, _ in exe.fusion.folds.values()] == ["norm residual"]
    (got,) = exe.run({"a": av, "b": bv, "g": gv})
    g2 = rlx.Graph("unfused")
    h, gam2 = g2.input("h", shape, dtype), g2.input("g", (37,), dtype)
    g2.set_outputs([g2.layer_norm(h, gam2)])
    (want,) = rlx.compile(g2).run({"h": rounded(np.float32(av) + np.float32(bv), dtype),
                                   "g": gv})
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def np_cross_entropy(x, lab, ignore, eps):
    """(row losses, d row loss / d logits) float64; ignored rows 0."""
    c = x.shape[-1]
    z = x - x.max(-1, keepdims=True)
    lse = np.log(np.exp(z).sum(-1, keepdims=True))
    logp = z - lse
    safe = np.where(lab == ignore, 0, lab)
    picked = np.take_along_axis(logp, safe[..., None], -1)[..., 0]
    loss = -(1 - eps) * picked - eps / c * logp.sum(-1)
    onehot = np.eye(c)[safe]
    grad = np.exp(logp) - eps / c - (1 - eps) * onehot
    keep = lab != ignore
    return np.where(keep, loss, 0.0), np.where(keep[..., None], grad, 0.0)


@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(4, 37), (2, 2, 129)])
def test_cross_entropy(rng, dtype, reduction, eps, shape):
    """Half logits, f32 log-sum-exp; the loss (and its grad) in the logits' dtype, as torch's
    F.cross_entropy; one row ignored (ignore_index=-1)."""
    c, ignore = shape[-1], -1
    xv = rounded(rng.standard_normal(shape) * 3, dtype)
    lab = rng.integers(0, c, shape[:-1]).astype(np.int64)
    lab.flat[1] = ignore
    g = rlx.Graph("ce")
    x, y = g.input("x", shape, dtype), g.input("y", shape[:-1], "i64")
    loss = g.cross_entropy(x, y, reduction=reduction, ignore_index=ignore, label_smoothing=eps)
    assert loss.dtype == dt.dtype(dtype)
    assert not [n for n in g.nodes if n.op == "cast" and n.inputs[0] == x.id]
    total = loss if reduction != "none" else g.reduce_sum(g.cast(loss, "f32"))
    (dx,) = g.grad(total, [x])
    assert dx.dtype == dt.dtype(dtype)
    g.set_outputs([loss, dx])
    (got, gdx), _ = run(g, {"x": xv, "y": lab})
    per_row, grad = np_cross_entropy(f64(xv), lab, ignore, eps)
    count = (lab != ignore).sum()
    want = {"none": per_row, "sum": per_row.sum(), "mean": per_row.sum() / count}[reduction]
    assert_half_close(got, np.asarray(want), dtype, k=3, what="loss")
    scale = 1.0 / count if reduction == "mean" else 1.0   # (the f32 row gradient dy)
    assert_half_close(gdx, grad * scale, dtype, k=4, what="d logits")
    assert (f64(gdx).reshape(-1, c)[1] == 0).all()


@pytest.mark.parametrize("dtype", HALVES)
def test_dropout(rng, dtype):
    """Half dropout: kept elements are exactly x * 1/(1-p) rounded once, the rest 0; the mask
    is the f32 op's (the same Philox stream) and drops a fraction p; its VJP redraws it."""
    n, p = 4000, 0.3
    xv = rounded(rng.uniform(0.5, 2.0, n), dtype)     # no zeros: a zero output is a drop
    dyv = rounded(rng.standard_normal(n), dtype)
    masks = {}
    for kind in (dtype, "f32"):
        g = rlx.Graph("drop")
        x = g.input("x", (n,), kind)
        y = g.dropout(x, p, seed=1234)
        assert y.dtype == dt.dtype(kind)
        outs = [y]
        if kind != "f32":
            dy = g.input("dy", (n,), kind)
            (dx,) = g.grad(g.reduce_sum(g.cast(y * dy, "f32")), [x])
            assert dx.dtype == dt.dtype(kind)
            outs.append(dx)
        g.set_outputs(outs)
        feeds = {"x": xv.astype(HOST[kind])}
        if kind != "f32":
            feeds["dy"] = dyv
        got, _ = run(g, feeds)
        masks[kind] = f64(got[0]) != 0
        if kind != "f32":
            out, gdx = got
    keep = masks[dtype]
    np.testing.assert_array_equal(keep, masks["f32"])
    frac = 1 - keep.mean()
    assert abs(frac - p) < 5 * np.sqrt(p * (1 - p) / n), frac
    scale = np.float32(1 / (1 - p))
    want = np.where(keep, rounded(np.float32(xv) * scale, dtype), HOST[dtype](0))
    np.testing.assert_array_equal(out.view(np.uint16), want.view(np.uint16))
    # dx = dy * mask * scale (dy rounded to the product's dtype first: y * dy is half)
    assert ((f64(gdx) != 0) <= keep).all() and (f64(gdx)[~keep] == 0).all()
    assert_half_close(gdx, f64(dyv) * keep * float(scale), dtype, k=2, what="d dropout")


def test_dtype_rules_and_errors():
    g = rlx.Graph("err")
    x16, xb = g.input("x16", (3, 8), "f16"), g.input("xb", (3, 8), "bf16")
    g32, gb = g.input("g32", (8,)), g.input("gb", (8,), "bf16")
    with pytest.raises(ValueError, match=r"layer_norm: gamma must be f32 or x's dtype f16 "
                                         r"\(x \[3, 8\]\), got bf16 \[8\]"):
        g.layer_norm(x16, gb)
    with pytest.raises(ValueError, match=r"rms_norm: residual must have x's dtype bf16 "
                                         r"\(x \[3, 8\]\), got f16 \[3, 8\]"):
        g.rms_norm(xb, g32, residual=x16)
    with pytest.raises(ValueError, match=r"layer_norm: beta must have gamma's dtype f32, got "
                                         r"bf16 \[8\]"):
        g.layer_norm(xb, g32, gb)
    with pytest.raises(ValueError, match=r"softmax_bwd: dy must have y's dtype bf16"):
        g.softmax_bwd(x16, xb)
    with pytest.raises(ValueError, match=r"layer_norm_bwd: dy must have x's dtype bf16"):
        g.norm_bwd("layer_norm", x16, xb, g32)
    with pytest.raises(ValueError, match=r"dropout: x must be f32, f16 or bf16, got i32"):
        g.bind("dropout", [g.cast(x16, "i32")], p=0.5, seed=0, stream=0)
    # f32 x with half gamma: torch refuses it too
    with pytest.raises(ValueError, match=r"rms_norm: gamma must be f32 or x's dtype f32"):
        g.rms_norm(g.input("x32", (3, 8)), gb)
    for op in ("softmax", "log_softmax", "layer_norm", "rms_norm", "residual_sum", "softmax_bwd",
               "norm_bwd", "norm_bwd_stats", "norm_param_bwd", "cross_entropy",
               "cross_entropy_bwd", "dropout"):
        assert opdef(op).dtype_rule == F32, op
