"""g.grad through the network ops: matmul (batched, broadcast batch dims), linear with every
epilogue, the fused product nodes, gated, softmax / log_softmax (the softmax_bwd row kernel),
layer_norm / rms_norm (norm_bwd + norm_param_bwd, residual, return_residual); each against
central finite differences of a float64 NumPy oracle written here (tests/gradcheck.py)."""
from math import erf

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir import dtypes as dt
from gradcheck import check

ERF = np.vectorize(erf)
ACTS = {
    None: lambda z: z,
    "gelu": lambda z: 0.5 * z * (1 + ERF(z / np.sqrt(2))),
    "gelu_tanh": lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3))),
    "silu": lambda z: z / (1 + np.exp(-z)), "relu": lambda z: np.maximum(z, 0),
    "sigmoid": lambda z: 1 / (1 + np.exp(-z)), "tanh": np.tanh, "exp": np.exp,
    "sin": np.sin, "atan": np.arctan, "abs": np.abs,
}


def _inputs(g, rng, **shapes):
    feed = {k: rng.standard_normal(s) for k, s in shapes.items()}
    return feed, {k: g.input(k, s) for k, s in shapes.items()}


def _weighted(g, y, r):
    return g.reduce_sum(y * r)


# ---- matmul ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sa,sb", [((2, 1, 3, 4), (3, 4, 5)),    # both batched, broadcast
                                   ((3, 4), (2, 4, 5)),          # 2-D a, batched b
                                   ((2, 3, 4), (4, 5)),          # batched a, a weight b
                                   ((1, 5), (5, 3))])
def test_matmul_vjp_sums_broadcast_batch_dims(rng, sa, sb):
    g = rlx.Graph("d_matmul")
    out = np.broadcast_shapes(sa[:-2], sb[:-2]) + (sa[-2], sb[-1])
    feed, t = _inputs(g, rng, a=sa, b=sb, r=out)
    y = _weighted(g, t["a"] @ t["b"], t["r"])
    check(g, y, {"a": t["a"], "b": t["b"]}, feed, lambda a, b, r: float(((a @ b) * r).sum()))


# ---- linear -----------------------------------------------------------------------------------
@pytest.mark.parametrize("act", list(ACTS))
def test_linear_vjp_every_activation_with_bias(rng, act):
    """kernel activations go through matmul_bias_activation_bwd's activation_grad, the others
    (exp, sin, atan, abs) through their own VJP on the recomputed pre-activation."""
    g = rlx.Graph("d_linear")
    feed, t = _inputs(g, rng, x=(2, 3, 5), w=(5, 7), b=(7,), r=(2, 3, 7))
    feed["x"] *= 0.5
    y = _weighted(g, g.linear(t["x"], t["w"], t["b"], activation=act), t["r"])
    f = ACTS[act]
    check(g, y, {"x": t["x"], "w": t["w"], "b": t["b"]}, feed,
          lambda x, w, b, r: float((f(x @ w + b) * r).sum()), rtol=5e-4)


@pytest.mark.parametrize("act,bias", [(None, False), ("gelu", False), ("gelu", True),
                                      ("exp", True), ("tanh", True)])
def test_linear_vjp_residual_and_vector_x(rng, act, bias):
    g = rlx.Graph("d_linear_res")
    feed, t = _inputs(g, rng, x=(3, 4), w=(4, 6), b=(6,), res=(3, 6), r=(3, 6))
    feed["x"] *= 0.5
    h = g.linear(t["x"], t["w"], t["b"] if bias else None, activation=act, residual=t["res"])
    y = _weighted(g, h, t["r"])
    f = ACTS[act]
    wrt = {k: t[k] for k in (("x", "w", "res") + (("b",) if bias else ()))}
    check(g, y, wrt, feed,
          lambda x, w, b, res, r: float(((f(x @ w + (b if bias else 0)) + res) * r).sum()))

    g = rlx.Graph("d_linear_vec")        # x a vector: [K] @ [K, N]
    feed, t = _inputs(g, rng, x=(5,), w=(5, 3), b=(3,), r=(3,))
    y = _weighted(g, g.linear(t["x"], t["w"], t["b"], activation=act), t["r"])
    check(g, y, {"x": t["x"], "w": t["w"], "b": t["b"]}, feed,
          lambda x, w, b, r: float((f(x @ w + b) * r).sum()))


def test_fused_product_nodes(rng):
    """The product nodes the fusion pass lowers carry activation / has_bias / has_residual /
    gated attrs; their VJP honours each (here built directly, batched weight included)."""
    g = rlx.Graph("d_fused")
    feed, t = _inputs(g, rng, x=(2, 3, 4), w=(4, 6), b=(6,), res=(2, 3, 6), r=(2, 3, 6),
                      wb=(2, 4, 6), r2=(2, 3, 3))
    x, w, b, res = t["x"], t["w"], t["b"], t["res"]
    y1 = g._add("matmul", (x, w, b, res), (2, 3, 6), dt.F32, activation="gelu", has_bias=True,
                has_residual=True)
    y2 = g._add("matmul", (x, t["wb"], b), (2, 3, 6), dt.F32, activation="sigmoid",
                has_bias=True, has_residual=False)
    y3 = g._add("matmul", (x, w, b), (2, 3, 3), dt.F32, activation=None, has_bias=True,
                has_residual=False, gated="silu")    # interleaved gate / up columns
    loss = _weighted(g, y1 + y2, t["r"]) + _weighted(g, y3, t["r2"])

    def oracle(x, w, b, res, r, wb, r2):
        z = x @ w + b
        silu = ACTS["silu"]
        return float(((ACTS["gelu"](z) + res + ACTS["sigmoid"](x @ wb + b)) * r).sum()
                     + (silu(z[..., 0::2]) * z[..., 1::2] * r2).sum())

    check(g, loss, {k: t[k] for k in ("x", "w", "b", "res", "wb")}, feed, oracle)


# ---- gated --------------------------------------------------------------------------------------
@pytest.mark.parametrize("act,interleaved", [("silu", False), ("silu", True), ("gelu", True),
                                             ("gelu_tanh", False), ("exp", True), ("sin", False)])
def test_gated_vjp(rng, act, interleaved):
    g = rlx.Graph("d_gated")
    feed, t = _inputs(g, rng, x=(3, 2, 10), r=(3, 2, 5))
    y = _weighted(g, g.gated(t["x"], act, interleaved=interleaved), t["r"])
    f = ACTS[act]

    def oracle(x, r):
        gate, up = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :5], x[..., 5:])
        return float((f(gate) * up * r).sum())

    check(g, y, {"x": t["x"]}, feed, oracle)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gated_vjp_of_a_strided_view(rng, interleaved):
    """gated of a narrow of the last axis (a strided view read in place) and a dy that is
    itself a narrow: gated_bwd reads both through their strides."""
    g = rlx.Graph("d_gated_view")
    feed, t = _inputs(g, rng, x=(3, 13), r=(3, 7))
    h = g.gated(g.narrow(t["x"], -1, 2, 10), "silu", interleaved=interleaved)
    y = g.reduce_sum(h * g.narrow(t["r"], -1, 1, 5))
    silu = ACTS["silu"]

    def oracle(x, r):
        v = x[:, 2:12]
        gate, up = (v[:, 0::2], v[:, 1::2]) if interleaved else (v[:, :5], v[:, 5:])
        return float((silu(gate) * up * r[:, 1:6]).sum())

    check(g, y, {"x": t["x"], "r": t["r"]}, feed, oracle)


# ---- softmax / log_softmax -----------------------------------------------------------------------
def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,axis", [((3, 5), -1), ((2, 3, 5), 1), ((3, 2, 4), 0),
                                        ((2, 71), -1),    # a row longer than the block
                                        ((37, 3), -1)])   # short rows: blocks stride the rows
def test_softmax_vjps(rng, op, shape, axis):
    g = rlx.Graph(f"d_{op}")
    feed, t = _inputs(g, rng, x=shape, r=shape)
    y = _weighted(g, getattr(g, op)(t["x"], axis), t["r"])
    steps = [n.op for n in g.nodes]
    f = (lambda x: _softmax(x, axis)) if op == "softmax" else (
        lambda x: np.log(_softmax(x, axis)))
    check(g, y, {"x": t["x"], "r": t["r"]}, feed, lambda x, r: float((f(x) * r).sum()))
    assert "softmax_bwd" in [n.op for n in g.nodes[len(steps):]]


def test_softmax_vjp_of_half_input(rng):
    """An f16 input is decomposed to f32 by the builder; its gradient comes back as f16."""
    g = rlx.Graph("d_softmax_f16")
    x = g.input("x", (2, 6), "f16")
    r = rng.standard_normal((2, 6)).astype(np.float32)
    y = g.reduce_sum(g.cast(g.softmax(x), "f32") * g.constant(r))
    dx = g.grad(y, x)
    assert dx.dtype == dt.F16
    g.set_outputs([dx])
    xv = rng.standard_normal((2, 6)).astype(np.float16)
    (got,) = rlx.compile(g).run({"x": xv})
    s = _softmax(xv.astype(np.float64), -1)
    want = s * (r - (r * s).sum(-1, keepdims=True))
    np.testing.assert_allclose(got.astype(np.float64), want, atol=2e-3)


# ---- layer_norm / rms_norm ---------------------------------------------------------------
def _norm(op, x, gamma, beta, axis, eps):
    gshape = [1] * x.ndim
    gshape[axis] = -1
    if op == "layer_norm":
        mu = x.mean(axis, keepdims=True)
        y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(axis, keepdims=True) + eps)
    else:
        y = x / np.sqrt((x * x).mean(axis, keepdims=True) + eps)
    y = y * gamma.reshape(gshape)
    return y + beta.reshape(gshape) if beta is not None else y


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,axis,beta,eps", [((3, 7), -1, True, 1e-5), ((2, 5), 1, False, 0.1),
                                                 ((2, 5, 3), 1, True, 1e-3),   # a middle axis
                                                 ((4, 2, 3), 0, False, 1e-5),
                                                 ((2, 70), -1, True, 1e-5),    # row > block
                                                 ((37, 3), -1, True, 1e-5)])   # many short rows
def test_norm_vjps(rng, op, shape, axis, beta, eps):
    g = rlx.Graph(f"d_{op}")
    n = shape[axis]
    feed, t = _inputs(g, rng, x=shape, gamma=(n,), beta=(n,), r=shape)
    feed["x"] = feed["x"] * 2 + 0.5
    y = _weighted(g, getattr(g, op)(t["x"], t["gamma"], t["beta"] if beta else None, axis=axis,
                                    eps=eps), t["r"])
    wrt = {k: t[k] for k in ("x", "gamma") + (("beta",) if beta else ())}
    first = len(g.nodes)
    check(g, y, wrt, feed,
          lambda x, gamma, beta, r, use=beta: float(
              (_norm(op, x, gamma, beta if use else None, axis, eps) * r).sum()))
    bwd = [n.op for n in g.nodes[first:]]     # one row pass, one column reduction
    assert bwd.count("norm_bwd") == 1 and bwd.count("norm_param_bwd") == 1
    assert "reduce" not in bwd


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("axis", [-1, 0])
def test_norm_vjps_residual_and_return_residual(rng, op, axis):
    """norm(x + res): x and res get the same gradient; with return_residual=True the
    gradient of the returned sum adds to it (also when only the sum is used)."""
    shape = (3, 6)
    n = shape[axis]
    g = rlx.Graph(f"d_{op}_res")
    feed, t = _inputs(g, rng, x=shape, res=shape, gamma=(n,), beta=(n,), r=shape, q=shape)
    y, s = getattr(g, op)(t["x"], t["gamma"], t["beta"], axis=axis, residual=t["res"],
                          return_residual=True)
    loss = _weighted(g, y, t["r"]) + _weighted(g, g.tanh(s), t["q"])

    def oracle(x, res, gamma, beta, r, q):
        h = x + res
        return float((_norm(op, h, gamma, beta, axis, 1e-5 if op == "layer_norm" else 1e-6) * r
                      ).sum() + (np.tanh(h) * q).sum())

    check(g, loss, {k: t[k] for k in ("x", "res", "gamma", "beta")}, feed, oracle)

    g = rlx.Graph(f"d_{op}_sum_only")       # only the sum reaches the loss: gamma gets zeros
    feed, t = _inputs(g, rng, x=shape, res=shape, gamma=(n,), q=shape)
    _, s = getattr(g, op)(t["x"], t["gamma"], axis=axis, residual=t["res"], return_residual=True)
    loss = _weighted(g, g.tanh(s), t["q"])
    got = check(g, loss, {k: t[k] for k in ("x", "res", "gamma")}, feed,
                lambda x, res, gamma, q: float((np.tanh(x + res) * q).sum()))
    assert not got[3].any()
    assert "norm_bwd" not in [m.op for m in g.nodes]


def test_rms_norm_dx_has_the_rms_cubed_term(rng):
    """The true rms_norm dx, against the closed form dy*g/rms - x*mean(dy*g*x)/rms^3 (the
    term rlx-cuda's host backward drops)."""
    g = rlx.Graph("rms_closed_form")
    x, gm, dyv = rng.standard_normal((3, 9)), rng.standard_normal(9), rng.standard_normal((3, 9))
    xt, gt = g.input("x", x.shape), g.input("gamma", (9,))
    y = g.rms_norm(xt, gt, eps=1e-6)
    dx = g.grad(y, xt, seed=g.constant(dyv.astype(np.float32)))
    g.set_outputs([dx])
    (got,) = rlx.compile(g).run({"x": x.astype(np.float32), "gamma": gm.astype(np.float32)})
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    want = dyv * gm / rms - x * (dyv * gm * x).mean(-1, keepdims=True) / rms ** 3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_norm_vjp_of_half_input(rng):
    """f16 x / gamma go through the norm kernels as f16 (f32 math); the gradients come back as
    f16."""
    g = rlx.Graph("d_norm_f16")
    x, gm = g.input("x", (3, 8), "f16"), g.input("gamma", (8,), "f16")
    r = rng.standard_normal((3, 8)).astype(np.float32)
    y = g.reduce_sum(g.cast(g.layer_norm(x, gm), "f32") * g.constant(r))
    dx, dg = g.grad(y, [x, gm])
    assert dx.dtype == dt.F16 and dg.dtype == dt.F16
    g.set_outputs([dx, dg])
    xv = rng.standard_normal((3, 8)).astype(np.float16)
    gv = rng.standard_normal(8).astype(np.float16)
    got_x, got_g = rlx.compile(g).run({"x": xv, "gamma": gv})
    x64, g64 = xv.astype(np.float64), gv.astype(np.float64)
    mu = x64.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x64 - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    xh = (x64 - mu) * rstd
    gg = r * g64
    want_x = rstd * (gg - gg.mean(-1, keepdims=True) - xh * (gg * xh).mean(-1, keepdims=True))
    np.testing.assert_allclose(got_x.astype(np.float64), want_x, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(got_g.astype(np.float64), (r * xh).sum(0), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_norm_bwd_builder_against_the_closed_form(rng, kind):
    """g.norm_bwd on its own: (dh, dgamma, dbeta) of kind(x + residual) for a given dy, many
    rows (the column reduction in several row chunks)."""
    shape, eps = (9, 5), 1e-4
    x, res, dyv = (rng.standard_normal(shape) for _ in range(3))
    gm, bt = rng.standard_normal(5), rng.standard_normal(5)
    g = rlx.Graph("norm_bwd")
    xt, rt, dyt = g.input("x", shape), g.input("res", shape), g.input("dy", shape)
    gt, bb = g.input("gamma", (5,)), g.input("beta", (5,))
    dh, dgamma, dbeta = g.norm_bwd(kind, dyt, xt, gt, bb, axis=-1, eps=eps, residual=rt)
    g.set_outputs([dh, dgamma, dbeta])
    f32 = lambda v: v.astype(np.float32)
    got = rlx.compile(g).run({"x": f32(x), "res": f32(res), "dy": f32(dyv), "gamma": f32(gm),
                              "beta": f32(bt)})
    h = x + res
    mu = h.mean(-1, keepdims=True) if kind == "layer_norm" else 0.0
    rstd = 1 / np.sqrt(((h - mu) ** 2).mean(-1, keepdims=True) + eps)
    xh, gg = (h - mu) * rstd, dyv * gm
    want = rstd * (gg - (gg.mean(-1, keepdims=True) if kind == "layer_norm" else 0.0)
                   - xh * (gg * xh).mean(-1, keepdims=True))
    for a, b in zip(got, (want, (dyv * xh).sum(0), dyv.sum(0))):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_backward_builder_errors():
    g = rlx.Graph("bad")
    x, y = g.input("x", (3, 4)), g.input("y", (3, 5))
    gm, i = g.input("gamma", (4,)), g.input("i", (3, 4), "i32")
    with pytest.raises(ValueError,
                       match=r"softmax_bwd: dy must have y's shape \[3, 5\], got \[3, 4\]"):
        g.softmax_bwd(x, y)
    with pytest.raises(ValueError, match=r"log_softmax_bwd: axis 2 is out of range for rank 2"):
        g.softmax_bwd(y, y, axis=2, log=True)
    with pytest.raises(ValueError, match=r"softmax_bwd: dy must be a float tensor, got i32"):
        g.softmax_bwd(i, x)
    with pytest.raises(ValueError, match=r"norm_bwd: kind must be 'layer_norm' or 'rms_norm'"):
        g.norm_bwd("batch_norm", x, x, gm)
    with pytest.raises(ValueError, match=r"rms_norm_bwd: gamma must have shape \[3\] \(x \[3, 4\] "
                                         r"along axis 0\), got \[4\]"):
        g.norm_bwd("rms_norm", x, x, gm, axis=0)
    with pytest.raises(ValueError, match=r"layer_norm_bwd: dy must have x's shape \[3, 4\], got"):
        g.norm_bwd("layer_norm", y, x, gm)
    with pytest.raises(ValueError, match=r"layer_norm_bwd: residual must have x's shape"):
        g.norm_bwd("layer_norm", x, x, gm, residual=y)
    with pytest.raises(ValueError, match=r"layer_norm_bwd: eps must be a number >= 0, got -1"):
        g.norm_bwd("layer_norm", x, x, gm, eps=-1)
