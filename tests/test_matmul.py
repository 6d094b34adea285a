"""matmul / linear against float64 NumPy: shapes, batch broadcasting, transposed operands,
every epilogue, half weights, and each tier of the ladder (the cuBLAS tiers on a GPU)."""
import logging

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph
from rlx_numba.ir.ops import ACTIVATIONS

GPU = not rlx.simulator_enabled()


def act_np(kind, x):
    from math import erf
    x = x.astype(np.float64)
    table = {
        "gelu": lambda v: 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2))),
        "gelu_tanh": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))),
        "silu": lambda v: v / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0),
        "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "tanh": np.tanh, "exp": np.exp,
        "log": lambda v: np.log(np.abs(v) + 0.5), "sqrt": lambda v: np.sqrt(np.abs(v)),
        "rsqrt": lambda v: 1 / np.sqrt(np.abs(v) + 0.5), "neg": np.negative, "abs": np.abs,
        "sin": np.sin, "cos": np.cos, "tan": np.tan, "atan": np.arctan, "round": np.round,
    }
    return table[kind](x)


def positive_domain(kind):
    """log/sqrt/rsqrt are tested on |h| + 0.5 style inputs: the graph feeds them that."""
    return kind in ("log", "sqrt", "rsqrt")


def close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (3, 5, 7), (17, 33, 65), (2, 9, 1), (1, 17, 3)])
def test_matmul_shapes(rng, m, k, n):
    g = rlx.Graph("mm")
    a, b = g.input("a", (m, k)), g.input("b", (k, n))
    g.set_outputs([g.matmul(a, b)])
    av = rng.standard_normal((m, k)).astype(np.float32)
    bv = rng.standard_normal((k, n)).astype(np.float32)
    (got,) = run_graph(g, {"a": av, "b": bv})
    close(got, av.astype(np.float64) @ bv)


@pytest.mark.parametrize("sa,sb", [((2, 1, 3, 5), (3, 5, 4)), ((4, 3, 5), (5, 4)),
                                   ((1, 3, 5), (2, 5, 4)), ((2, 3, 3, 5), (1, 3, 5, 2))])
def test_batch_broadcast(rng, sa, sb):
    g = rlx.Graph("bmm")
    a, b = g.input("a", sa), g.input("b", sb)
    g.set_outputs([a @ b])
    av = rng.standard_normal(sa).astype(np.float32)
    bv = rng.standard_normal(sb).astype(np.float32)
    (got,) = run_graph(g, {"a": av, "b": bv})
    want = np.matmul(av.astype(np.float64), bv)
    assert got.shape == want.shape
    close(got, want)


@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_transposed_operands_cost_no_copy(rng, ta, tb):
    g = rlx.Graph("mmT")
    a = g.input("a", (2, 7, 3) if ta else (2, 3, 7))        # logical [2, 3, 7]
    b = g.input("b", (5, 7) if tb else (7, 5))              # logical [7, 5]
    at = g.transpose(a, (0, 2, 1)) if ta else a
    bt = g.transpose(b, (1, 0)) if tb else b
    g.set_outputs([g.matmul(at, bt)])
    exe = rlx.compile(g)
    assert not any("transpose" in s.kernel_name for s in exe.steps), [s.kernel_name for s in exe.steps]
    av = rng.standard_normal(a.shape).astype(np.float32)
    bv = rng.standard_normal(b.shape).astype(np.float32)
    (got,) = exe.run({"a": av, "b": bv})
    a64 = av.transpose(0, 2, 1).astype(np.float64) if ta else av.astype(np.float64)
    b64 = bv.T.astype(np.float64) if tb else bv.astype(np.float64)
    close(got, a64 @ b64)


def test_transpose_also_used_elsewhere_is_materialised(rng):
    g = rlx.Graph("mmT2")
    a, b = g.input("a", (4, 3)), g.input("b", (4, 2))
    at = g.transpose(a, (1, 0))
    g.set_outputs([g.matmul(at, b), at * 2.0])
    av = rng.standard_normal((4, 3)).astype(np.float32)
    bv = rng.standard_normal((4, 2)).astype(np.float32)
    mm, t2 = run_graph(g, {"a": av, "b": bv})
    close(mm, av.T.astype(np.float64) @ bv)
    close(t2, av.T * 2.0)


def test_linear_folds_leading_dims_and_empty_k(rng):
    g = rlx.Graph("lin")
    x = g.input("x", (2, 3, 4))
    w, b = g.param("w", (4, 5)), g.param("b", (5,))
    x0, w0 = g.input("x0", (3, 0)), g.param("w0", (0, 2))
    g.set_outputs([g.linear(x, w, b), g.linear(x0, w0, activation="sigmoid")])
    xv = rng.standard_normal((2, 3, 4)).astype(np.float32)
    wv = rng.standard_normal((4, 5)).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    y, y0 = run_graph(g, {"x": xv, "x0": np.zeros((3, 0), np.float32)},
                      {"w": wv, "b": bv, "w0": np.zeros((0, 2), np.float32)})
    close(y, xv.astype(np.float64) @ wv + bv)
    np.testing.assert_array_equal(y0, np.full((3, 2), 0.5, np.float32))   # sigmoid(0)


@pytest.mark.parametrize("act", [None, *ACTIVATIONS])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_epilogue_every_activation(rng, act, bias):
    g = rlx.Graph("epi")
    x = g.input("x", (3, 6))
    w = g.param("w", (6, 5))
    bt = g.param("b", (5,)) if bias else None
    if act and positive_domain(act):          # keep log/sqrt/rsqrt on positive inputs
        h = g.linear(x, w, bt)
        pre = g.abs(h) + 0.5
        y = g.activation(act, pre)
    else:
        y = g.linear(x, w, bt, activation=act)
    g.set_outputs([y])
    xv = (rng.standard_normal((3, 6)) * 0.5).astype(np.float32)
    wv = (rng.standard_normal((6, 5)) * 0.5).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    params = {"w": wv, **({"b": bv} if bias else {})}
    (got,) = run_graph(g, {"x": xv}, params)
    h = xv.astype(np.float64) @ wv + (bv if bias else 0)
    if act is None:
        want = h
    elif positive_domain(act):
        want = {"log": np.log, "sqrt": np.sqrt, "rsqrt": lambda v: 1 / np.sqrt(v)}[act](np.abs(h) + 0.5)
    elif act == "round":
        want = np.round(h.astype(np.float32))
    else:
        want = act_np(act, h)
    close(got, want, 1e-4)


@pytest.mark.parametrize("act", [None, "relu", "gelu"])
def test_linear_residual(rng, act):
    g = rlx.Graph("res")
    x, r = g.input("x", (2, 3, 4)), g.input("r", (2, 3, 5))
    w, b = g.param("w", (4, 5)), g.param("b", (5,))
    g.set_outputs([g.linear(x, w, b, activation=act, residual=r)])
    xv = rng.standard_normal((2, 3, 4)).astype(np.float32)
    rv = rng.standard_normal((2, 3, 5)).astype(np.float32)
    wv = rng.standard_normal((4, 5)).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    (got,) = run_graph(g, {"x": xv, "r": rv}, {"w": wv, "b": bv})
    h = xv.astype(np.float64) @ wv + bv
    close(got, (act_np(act, h) if act else h) + rv, 1e-4)


@pytest.mark.parametrize("half,tol", [("f16", 3e-3), ("bf16", 2e-2)])
def test_half_weights(rng, half, tol):
    g = rlx.Graph("half")
    x = g.input("x", (5, 33))
    w, b = g.param("w", (33, 17)), g.param("b", (17,))
    g.set_outputs([g.linear(x, w, b, activation="gelu_tanh"), w * 1.0])
    xv = rng.standard_normal((5, 33)).astype(np.float32)
    wv = rng.standard_normal((33, 17)).astype(np.float32)
    bv = rng.standard_normal(17).astype(np.float32)
    exe = rlx.compile(g)
    exe.set_param("b", bv)
    exe.set_param_half("w", wv, half)
    y, w_seen = exe.run({"x": xv})
    hdt = np.float16 if half == "f16" else ml_dtypes.bfloat16
    wh = wv.astype(hdt).astype(np.float64)
    np.testing.assert_array_equal(w_seen, wh.astype(np.float32))       # other readers: rounded
    want = act_np("gelu_tanh", xv.astype(hdt).astype(np.float64) @ wh + bv)
    close(y, want, tol)
    if GPU:
        assert any(s.info.get("tier") == 0 for s in exe.steps)
    exe.set_param("w", wv)                                                # back to f32
    y32, _ = exe.run({"x": xv})
    close(y32, act_np("gelu_tanh", xv.astype(np.float64) @ wv + bv), 1e-4)
    assert not any(s.info.get("tier") == 0 for s in exe.steps)


@pytest.mark.parametrize("tiers", ["0,3", "2"])
def test_half_weight_holds_f32_only_for_a_tier_reading_it(rng, monkeypatch, tiers):
    """A half weight stored [N, K] keeps no f32 copy unless a product of it takes a tier that
    reads f32 (a tier restriction, no cuBLAS: tier 4 in the simulator); then the store makes
    the copy again from the half one. Batched, with A op-T: tier 0 on a GPU."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    g = rlx.Graph("half_f32")
    x, w = g.input("x", (2, 7, 3)), g.param("w", (7, 5))
    g.set_outputs([g.matmul(g.transpose(x, (0, 2, 1)), w)])
    exe = rlx.compile(g)
    assert exe.transposed and exe.absorbed
    xv = rng.standard_normal((2, 7, 3)).astype(np.float32)
    wv = rng.standard_normal((7, 5)).astype(np.float32)
    exe.set_param_half("w", wv, "f16")
    (step,) = [s for s in exe.steps if "tier" in s.info]
    reads_f32 = step.info["tier"] not in (0, 3)
    assert reads_f32 == (tiers == "2" or not GPU), step.info
    assert ("reads the half weight's f32 copy" in " ".join(step.info["why"])) == reads_f32
    want = {"f16": 7 * 5 * 2, **({"f32": 7 * 5 * 4} if reads_f32 else {})}
    assert exe.params.bytes_by_format() == want
    xt = xv.transpose(0, 2, 1).astype(np.float64)
    if step.info["tier"] == 0:
        xt = xt.astype(np.float16).astype(np.float64)
    close(exe.run({"x": xv})[0], xt @ wv.astype(np.float16).astype(np.float64), 3e-3)


@pytest.mark.parametrize("half", [None, "f16"])
def test_weights_stored_transposed(rng, half):
    """A 2-D param read only as a product's weight is stored [N, K] (op-T products); one
    also read by anything else keeps its layout. Host and device set_param both land right."""
    from numba import cuda
    g = rlx.Graph("wt")
    x = g.input("x", (2, 3, 37))
    w1, w2, w3 = g.param("w1", (37, 29)), g.param("w2", (29, 37)), g.param("w3", (37, 5))
    h = g.linear(x, w1, activation="relu")
    y = h @ w2 + x
    g.set_outputs([y @ w3, g.linear(x, w3) + g.narrow(w3, 0, 0, 1)])
    exe = rlx.compile(g)
    ids = {n.name: n.id for n in g.nodes if n.op == "param"}
    assert exe.transposed == {ids["w1"], ids["w2"]}          # w3 is also sliced: kept [K, N]
    xv = rng.standard_normal((2, 3, 37)).astype(np.float32)
    wv = {n: rng.standard_normal(s).astype(np.float32) / 6
          for n, s in (("w1", (37, 29)), ("w2", (29, 37)), ("w3", (37, 5)))}
    exe.set_param("w1", cuda.to_device(wv["w1"]))             # device to device, transposed
    with pytest.raises(ValueError, match="C-contiguous"):      # w3 is kept [K, N]
        exe.set_param("w3", cuda.to_device(np.asfortranarray(wv["w3"])))
    if half:
        exe.set_param_half("w2", wv["w2"], half)
        w2v = wv["w2"].astype(np.float16).astype(np.float64)
        xh = lambda a: a.astype(np.float16).astype(np.float64)  # noqa: E731
    else:
        exe.set_param("w2", wv["w2"])
        w2v, xh = wv["w2"].astype(np.float64), (lambda a: a)
    exe.set_param("w3", wv["w3"])
    a, b = exe.run({"x": xv})
    x64 = xv.astype(np.float64)
    hh = np.maximum(x64 @ wv["w1"], 0)
    # an F-contiguous device weight (torch's linear.weight.t()) is already the stored layout
    exe.set_param("w1", cuda.to_device(np.asfortranarray(wv["w1"])))
    a2, _ = exe.run({"x": xv})
    np.testing.assert_array_equal(a2, a)
    yy = xh(hh) @ w2v + x64
    close(a, yy @ wv["w3"], 3e-3 if half else 1e-4)
    close(b, x64 @ wv["w3"] + wv["w3"][0], 1e-4)


def _tier_graph():
    g = rlx.Graph("tiers")
    x, r = g.input("x", (9, 20)), g.input("r", (9, 11))
    w, b = g.param("w", (20, 11)), g.param("b", (11,))
    g.set_outputs([g.linear(x, w, b, activation="gelu_tanh"), g.linear(x, w, b, residual=r)])
    return g


@pytest.mark.parametrize("tier", [0, 1, 2, 4])
def test_every_tier_reachable_and_same_answer(rng, monkeypatch, caplog, tier):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", str(tier))
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    xv = rng.standard_normal((9, 20)).astype(np.float32)
    rv = rng.standard_normal((9, 11)).astype(np.float32)
    wv = rng.standard_normal((20, 11)).astype(np.float32)
    bv = rng.standard_normal(11).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="rlx_numba"):
        exe = rlx.compile(_tier_graph())
        exe.set_param("b", bv)
        if tier == 0:
            exe.set_param_half("w", wv, "f16")
        else:
            exe.set_param("w", wv)
    y1, y2 = exe.run({"x": xv, "r": rv})
    expected = tier if GPU else 4
    tiers = [s.info["tier"] for s in exe.steps if "tier" in s.info]
    assert tiers == [expected, expected], [(s.kernel_name, s.info.get("why")) for s in exe.steps]
    assert f"matmul tier {expected}" in caplog.text
    if not GPU and tier != 4:
        assert "simulator has no cuBLAS" in caplog.text
    w = wv.astype(np.float16).astype(np.float64) if tier == 0 else wv.astype(np.float64)
    x = xv.astype(np.float16).astype(np.float64) if (tier == 0 and GPU) else xv.astype(np.float64)
    h = x @ w + bv
    tol = 3e-3 if tier == 0 else 1e-4
    close(y1, act_np("gelu_tanh", h), tol)
    close(y2, h + rv, tol)


def test_tf32_flag(rng, monkeypatch):
    from rlx_numba import cublas
    monkeypatch.setattr(cublas, "allow_tf32", True)
    g = rlx.Graph("tf32")
    a, b = g.input("a", (16, 64)), g.input("b", (64, 8))
    g.set_outputs([a @ b])
    av = rng.standard_normal((16, 64)).astype(np.float32)
    bv = rng.standard_normal((64, 8)).astype(np.float32)
    exe = rlx.compile(g)
    (got,) = exe.run({"a": av, "b": bv})
    close(got, av.astype(np.float64) @ bv, 5e-3)        # TF32 keeps 10 mantissa bits
    if GPU:
        assert "tf32" in exe.steps[0].kernel_name


def test_errors():
    g = rlx.Graph("err")
    x, w = g.input("x", (2, 3)), g.param("w", (3, 4))
    with pytest.raises(ValueError, match=r"linear: residual must have the output's shape \[2, 4\] "
                                         r"\(x \[2, 3\] @ w \[3, 4\]\), got \[4\]"):
        g.linear(x, w, residual=g.param("r", (4,)))
    with pytest.raises(ValueError, match=r"matmul: inner dimensions differ: a \[2, 3\] has K=3, "
                                         r"b \[2, 3\] has K=2"):
        g.matmul(x, g.input("y", (2, 3)))
    g.set_outputs([g.linear(x, w)])
    exe = rlx.compile(g)
    with pytest.raises(ValueError, match=r"set_param_half 'w': dtype must be 'f16' or 'bf16', got 'f8'"):
        exe.set_param_half("w", np.zeros((3, 4)), "f8")
    with pytest.raises(ValueError, match=r"set_param_half 'w': expected shape \[3, 4\], got \[4, 3\]"):
        exe.set_param_half("w", np.zeros((4, 3)), "bf16")
    with pytest.raises(ValueError, match=r"set_param_half: graph 'err' has no param 'v'"):
        exe.set_param_half("v", np.zeros((3, 4)), "bf16")


@pytest.mark.parametrize("act", [None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"])
def test_matmul_bias_activation_bwd_against_finite_differences(rng, act):
    g = rlx.Graph("bwd")
    a, b = g.input("a", (2, 3, 4)), g.input("b", (4, 5))
    bias, grad = g.input("bias", (5,)), g.input("grad", (2, 3, 5))
    d_a, d_b, d_bias = g.matmul_bias_activation_bwd(grad, a, b, bias, act)
    g.set_outputs([d_a, d_b, d_bias])
    av = rng.standard_normal((2, 3, 4))
    bv = rng.standard_normal((4, 5))
    cv = rng.standard_normal(5)
    gv = rng.standard_normal((2, 3, 5))
    ins = {"a": av, "b": bv, "bias": cv, "grad": gv}
    got = run_graph(g, {k: v.astype(np.float32) for k, v in ins.items()})

    def loss(a_, b_, c_):   # L = sum(grad * activation(a @ b + bias)), float64
        h = a_ @ b_ + c_
        return float((gv * (act_np(act, h) if act else h)).sum())
    eps = 1e-6
    for arr, res in ((av, got[0]), (bv, got[1]), (cv, got[2])):
        fd = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + eps
            up = loss(av, bv, cv)
            arr[i] = old - eps
            fd[i] = (up - loss(av, bv, cv)) / (2 * eps)
            arr[i] = old
        np.testing.assert_allclose(res, fd, rtol=2e-3, atol=2e-3)


def test_bwd_errors():
    g = rlx.Graph("bwd_err")
    a, b, grad = g.input("a", (3, 4)), g.input("b", (4, 5)), g.input("grad", (3, 5))
    with pytest.raises(ValueError, match=r"matmul_bias_activation_bwd: activation must be one of "
                                         r"None, relu, gelu, gelu_tanh, silu, sigmoid, tanh, got 'exp'"):
        g.matmul_bias_activation_bwd(grad, a, b, activation="exp")
    with pytest.raises(ValueError, match=r"matmul_bias_activation_bwd: grad must be \[3, 5\] "
                                         r"\(a \[3, 4\] @ b \[4, 5\]\), got \[5, 3\]"):
        g.matmul_bias_activation_bwd(g.input("g2", (5, 3)), a, b)
    with pytest.raises(ValueError, match=r"matmul_bias_activation_bwd: bias must be \[5\], got \[4\]"):
        g.matmul_bias_activation_bwd(grad, a, b, g.input("c", (4,)))
