"""g.grad: every VJP against central finite differences of a float64 NumPy oracle written here
(tests/gradcheck.py), on random data with odd shapes; and the errors of bad requests."""
from math import erf

import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check

ERF = np.vectorize(erf)
ACTS = {
    "gelu": lambda x: 0.5 * x * (1 + ERF(x / np.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1 + np.exp(-x)), "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "tanh": np.tanh, "exp": np.exp, "log": np.log,
    "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x), "neg": np.negative, "abs": np.abs,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "atan": np.arctan, "round": np.round,
}
POSITIVE = ("log", "sqrt", "rsqrt")


def _away_from_zero(rng, shape, lo=-2.0, hi=2.0):
    """Random values at least 0.05 from 0 (kinks of relu / abs) and from .5 (round's steps)."""
    v = rng.uniform(lo, hi, shape)
    v = np.where(np.abs(v) < 0.05, 0.3, v)
    frac = np.abs(v - np.floor(v) - 0.5)
    return np.where(frac < 0.05, v + 0.2, v)


@pytest.mark.parametrize("kind", list(ACTS))
def test_activation_vjps(rng, kind):
    shape = (3, 5)
    x = rng.uniform(0.2, 3.0, shape) if kind in POSITIVE else (
        rng.uniform(-1.2, 1.2, shape) if kind == "tan" else _away_from_zero(rng, shape))
    r = rng.standard_normal(shape)
    g = rlx.Graph(f"d_{kind}")
    xt, rt = g.input("x", shape), g.input("r", shape)
    y = g.reduce_sum(g.activation(kind, xt) * rt)
    check(g, y, {"x": xt, "r": rt}, {"x": x, "r": r},
          lambda x, r: float((ACTS[kind](x) * r).sum()))


BIN = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
       "max": np.maximum, "min": np.minimum, "pow": np.power}


@pytest.mark.parametrize("kind", list(BIN))
def test_binary_vjps_reduce_broadcast_operands(rng, kind):
    """a [3, 1, 5] and b [4, 5]: each gradient summed back to its operand's shape."""
    a = rng.uniform(0.5, 2.0, (3, 1, 5)) if kind == "pow" else rng.standard_normal((3, 1, 5))
    b = rng.uniform(-1.5, 1.5, (4, 5)) if kind == "pow" else rng.standard_normal((4, 5))
    if kind == "div":
        b = np.where(np.abs(b) < 0.3, 0.7, b)
    r = rng.standard_normal((3, 4, 5))
    g = rlx.Graph(f"d_{kind}")
    at, bt, rt = g.input("a", a.shape), g.input("b", b.shape), g.input("r", r.shape)
    y = g.reduce_sum(g.binary(kind, at, bt) * rt)
    check(g, y, {"a": at, "b": bt}, {"a": a, "b": b, "r": r},
          lambda a, b, r: float((BIN[kind](a, b) * r).sum()))


def test_max_min_split_ties_and_pow_at_zero():
    """Equal operands share max/min's gradient evenly; d(0 ** b)/db is 0 for b >= 0 (torch)."""
    g = rlx.Graph("ties")
    a, b = g.input("a", (3,)), g.input("b", (3,))
    y = g.reduce_sum(g.max(a, b) + 3.0 * g.min(a, b) + g.pow(a, b))
    da, db = g.grad(y, [a, b])
    g.set_outputs([da, db])
    av, bv = np.array([1.0, 0.0, 2.0], np.float32), np.array([1.0, 2.0, 1.0], np.float32)
    got_a, got_b = rlx.compile(g).run({"a": av, "b": bv})
    # a=1,b=1: max/min halves (0.5 + 1.5), pow: b*a^(b-1) = 1, a^b ln a = 0
    np.testing.assert_allclose(got_a, [0.5 + 1.5 + 1.0, 3.0 + 0.0, 1.0 + 1.0], rtol=1e-6)
    np.testing.assert_allclose(got_b, [0.5 + 1.5 + 0.0, 1.0 + 0.0, 3.0 + 2 * np.log(2)], rtol=1e-6)


def test_where_cast_reshape_and_stop_gradient(rng):
    x, z = rng.standard_normal((2, 6)), rng.standard_normal((6,))
    c = rng.random((2, 6)) < 0.5
    g = rlx.Graph("misc")
    xt, zt, ct = g.input("x", (2, 6)), g.input("z", (6,)), g.input("c", (2, 6), "bool")
    w = g.where(ct, xt * 2.0, zt)                     # z broadcast: its gradient summed
    h = g.reshape(g.cast(g.cast(w, "f16"), "f32"), (3, 4))
    frozen = g.stop_gradient(xt)                      # counts as a constant
    y = g.reduce_sum(h * h) + g.reduce_sum(frozen * xt)
    x0 = x.copy()                                     # stop_gradient's x: a constant
    check(g, y, {"x": xt, "z": zt}, {"x": x, "z": z, "c": c},
          lambda x, z, c: float((np.where(c, 2 * x, z) ** 2).sum() + (x0 * x).sum()),
          rtol=3e-3, atol=3e-3)   # (the f16 round trip in the forward)


@pytest.mark.parametrize("kind", ["sum", "mean", "max", "min", "prod"])
@pytest.mark.parametrize("axes,keep", [((1,), False), ((0, 2), True), (None, False)])
def test_reduce_vjps(rng, kind, axes, keep):
    x = rng.uniform(0.5, 1.5, (3, 4, 5)) if kind == "prod" else rng.standard_normal((3, 4, 5))
    g = rlx.Graph(f"d_{kind}")
    xt = g.input("x", x.shape)
    red = g.reduce(kind, xt, axes, keep)
    r = rng.standard_normal(red.shape)
    rt = g.input("r", red.shape)
    y = g.reduce_sum(red * rt)
    f = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[kind]
    check(g, y, {"x": xt}, {"x": x, "r": r},
          lambda x, r: float((f(x, axis=axes, keepdims=keep) * r).sum()))


def test_reduce_max_ties_and_prod_zeros():
    g = rlx.Graph("ties")
    x = g.input("x", (2, 4))
    y = g.reduce_sum(g.reduce_max(x, 1)) + g.reduce_sum(g.reduce_prod(x, 1))
    g.set_outputs([g.grad(y, x)])
    xv = np.array([[2.0, 1.0, 2.0, 0.0], [0.0, 3.0, 0.0, 1.0]], np.float32)
    (got,) = rlx.compile(g).run({"x": xv})
    # row 0: the two maxima share 1; one zero: d prod / d x3 = 2 * 1 * 2 = 4, others 0
    # row 1: one max; two zeros: every prod gradient 0
    np.testing.assert_allclose(got, [[0.5, 0.0, 0.5, 4.0], [0.0, 1.0, 0.0, 0.0]])


@pytest.mark.parametrize("exclusive", [False, True])
def test_cumsum_vjp(rng, exclusive):
    x, r = rng.standard_normal((3, 7)), rng.standard_normal((3, 7))
    g = rlx.Graph("d_cumsum")
    xt, rt = g.input("x", x.shape), g.input("r", r.shape)
    y = g.reduce_sum(g.cumsum(xt, 1, exclusive=exclusive) * rt)

    def ref(x, r):
        c = np.cumsum(x, 1)
        return float(((c - x if exclusive else c) * r).sum())
    check(g, y, {"x": xt}, {"x": x, "r": r}, ref)


def test_seed_for_a_non_scalar_y_and_unreachable_wrt(rng):
    x = rng.standard_normal((2, 3))
    seed = rng.standard_normal((2, 3)).astype(np.float32)
    g = rlx.Graph("seeded")
    xt, other = g.input("x", (2, 3)), g.input("other", (4,))
    y = g.tanh(xt) * 3.0
    dx, dother = g.grad(y, [xt, other], seed=g.constant(seed))
    g.set_outputs([dx, dother])
    got_x, got_o = rlx.compile(g).run({"x": x.astype(np.float32), "other": np.ones(4, np.float32)})
    np.testing.assert_allclose(got_x, seed * 3 * (1 - np.tanh(x) ** 2), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_o, np.zeros(4, np.float32))


def test_grad_errors():
    g = rlx.Graph("bad")
    x, i = g.input("x", (2, 3)), g.input("i", (2,), "i32")
    y = g.tanh(x)
    with pytest.raises(ValueError, match=r"grad: y .* has shape \[2, 3\], not a scalar; pass seed="):
        g.grad(y, x)
    s = g.reduce_sum(y)
    with pytest.raises(ValueError, match=r"grad: wrt\[1\] .* is i32 \[2\]; only float tensors"):
        g.grad(s, [x, i])
    other = rlx.Graph("other")
    with pytest.raises(ValueError, match="grad: wrt\\[0\\] .* belongs to graph 'other'"):
        g.grad(s, [other.input("z", (1,))])
    with pytest.raises(ValueError, match=r"grad: seed has shape \[3\], y \[2, 3\]"):
        g.grad(y, x, seed=g.constant(np.ones(3, np.float32)))
    am = g.reduce_sum(g.cast(g.argmax(x, 1), "f32") * g.reduce_sum(x, 1))   # argmax: no gradient
    g.grad(am, x)                               # flows through the sum only: fine
