"""g.autocast(dtype), g.to_dtype(dtype) and compile(..., precision=).

Oracle: the autocast recipe written here in NumPy (torch.autocast's CUDA policy: products on
half-rounded operands with the result rounded to half, norms / softmax / sums in f32 on the
values they are given), in float64, with tolerances from the unit roundoff (tests/halfref.py).
"""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HOST, UNIT, assert_half_close, f64, rounded


def _block(g, b=3, s=5, d=16, f=24):
    """x -> linear -> gelu -> linear (+ x) -> layer_norm -> softmax; sum; mean; exp."""
    x = g.input("x", (b, s, d))
    w1, b1 = g.param("w1", (d, f)), g.param("b1", (f,))
    w2 = g.param("w2", (f, d))
    gam, bet = g.param("gamma", (d,)), g.param("beta", (d,))
    h = g.linear(x, w1, b1, activation="gelu")
    y = g.matmul(h, w2) + x
    n = g.layer_norm(y, gam, bet, eps=1e-5)
    p = g.softmax(n, axis=-1)
    g.set_outputs([p, g.reduce_sum(y, axes=-1), g.reduce_mean(h, axes=-1), g.exp(h)])
    return g


def _params(rng, d=16, f=24):
    return {"w1": rng.standard_normal((d, f)).astype(np.float32) / 4,
            "b1": rng.standard_normal(f).astype(np.float32),
            "w2": rng.standard_normal((f, d)).astype(np.float32) / 5,
            "gamma": (1 + rng.standard_normal(d) / 4).astype(np.float32),
            "beta": rng.standard_normal(d).astype(np.float32) / 4}


def _erf(x):
    from math import erf
    return np.vectorize(erf)(x)


def _oracle(x, p, dt_):
    """The autocast recipe in float64: products of half-rounded operands, rounded to half."""
    def r(a):
        return f64(rounded(a, dt_))
    h = r(x) @ r(p["w1"]) + r(p["b1"])                  # linear + bias + gelu in the
    h = r(0.5 * h * (1 + _erf(h / np.sqrt(2))))         # product's epilogue: one rounding
    y = r(r(h) @ r(p["w2"])) + f64(x)                   # matmul half, + f32 residual -> f32
    mu = y.mean(-1, keepdims=True)
    n = (y - mu) / np.sqrt(((y - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
    n = n * p["gamma"] + p["beta"]
    e = np.exp(n - n.max(-1, keepdims=True))
    return [e / e.sum(-1, keepdims=True), y.sum(-1), h.mean(-1), np.exp(h)], h


def test_autocast_dtypes_follow_torch_policy():
    g = _block(rlx.Graph("blk"))
    before = str(g)
    g16 = g.autocast("bf16")
    assert str(g) == before, "autocast changed the user's graph"
    outs = [g16.tensor(o) for o in g16.outputs]
    # softmax (f32 policy) of an f32 stream; sum in f32; mean of a half tensor stays half;
    # exp is on torch's f32 list
    assert [str(t.dtype) for t in outs] == ["f32", "f32", "bf16", "f32"]
    ops = [n for n in g16.nodes if n.op == "linear" or n.op == "matmul"]
    assert all(str(g16.nodes[i].dtype) == "bf16" for n in ops for i in n.inputs)
    # one cast per (tensor, dtype): h feeds the matmul, the mean and exp but is cast once
    casts = [(n.inputs[0], str(n.dtype)) for n in g16.nodes if n.op == "cast"]
    assert len(casts) == len(set(casts))
    # params stay f32 leaves (cast on the way in) unless half_params
    assert str(g16.leaf("w1").dtype) == "f32"
    gp = g.autocast("f16", half_params=True)
    assert str(gp.leaf("w1").dtype) == "f16" and str(gp.leaf("gamma").dtype) == "f32"


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_precision_compile_matches_recipe(rng, dtype):
    g = _block(rlx.Graph("blk"))
    p = _params(rng)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    exe = rlx.compile(g, precision=dtype)
    for k, v in p.items():
        exe.set_param(k, v)
    got = exe.run({"x": x})
    want, _ = _oracle(x, p, dtype)
    u = UNIT[dtype]
    # f32 outputs downstream of half products: a few half roundings propagated
    for gv, wv, what in zip(got[:2], want[:2], ["softmax", "sum"]):
        assert gv.dtype == np.float32
        np.testing.assert_allclose(gv, wv, rtol=64 * u, atol=64 * u * np.abs(wv).max(),
                                   err_msg=what)
    assert_half_close(got[2], want[2], dtype, k=4, what="mean")
    assert got[3].dtype == np.float32
    np.testing.assert_allclose(got[3], want[3], rtol=1e-5, err_msg="exp")
    # the user's graph still compiles to f32
    assert rlx.compile(g).graph.nodes[-1].dtype.name == "f32"


def test_precision_errors():
    g = _block(rlx.Graph("blk"))
    with pytest.raises(ValueError, match="precision must be one of"):
        rlx.compile(g, precision="fp8")
    with pytest.raises(ValueError, match="autocast: dtype must be bf16 or f16, got i32"):
        g.autocast("i32")


def test_op_that_cannot_take_half_raises_at_build():
    g = rlx.Graph("scan")
    x = g.input("x", (1, 3, 4))
    w = g.param("w", (4, 4))
    h = g.matmul(x, w)                          # half under autocast: u of the scan
    dt_ = g.param("dt", (1, 3, 4))
    a = g.param("A", (3, 2))
    b = g.param("B", (1, 2, 4))
    c = g.param("C", (1, 2, 4))
    g.set_outputs([g.selective_scan(h, dt_, a, b, c)])
    with pytest.raises(ValueError, match=r"selective_scan.*bf16"):
        g.autocast("bf16")


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_to_dtype_is_module_to(rng, dtype):
    g = rlx.Graph("m")
    x = g.input("x", (4, 9))
    w = g.param("w", (9, 7))
    gam = g.param("gamma", (7,))
    y = g.rms_norm(g.matmul(x, w), gam, eps=1e-6)
    g.set_outputs([y])
    gh = g.to_dtype(dtype)
    assert str(gh.leaf("x").dtype) == "f32"          # fed f32, cast on the device
    assert str(gh.leaf("w").dtype) == dtype and str(gh.leaf("gamma").dtype) == dtype
    xv = rng.standard_normal((4, 9)).astype(np.float32)
    wv = rng.standard_normal((9, 7)).astype(np.float32)
    gv = (1 + rng.standard_normal(7) / 4).astype(np.float32)
    exe = rlx.compile(gh)
    exe.set_param("w", wv)
    exe.set_param("gamma", gv)
    got = exe.run({"x": xv})[0]
    assert got.dtype == np.dtype(HOST[dtype])
    h = f64(rounded(f64(rounded(xv, dtype)) @ f64(rounded(wv, dtype)), dtype))
    want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * f64(rounded(gv, dtype))
    assert_half_close(got, want, dtype, k=4, what="to_dtype rms_norm")
