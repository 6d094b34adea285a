"""f64: a first-class dtype whose kernels compute in f64 end to end.

Every oracle is float64 NumPy written here; each check uses values where f32 math gives a
visibly different answer (asserted too), so a kernel that rounded through f32 anywhere
would fail the 1e-12 relative tolerance."""
import math

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from rlx_numba.ir import dtypes as dt

RTOL = 1e-12


def close(got, want, rtol=RTOL, what="", scale=None):
    """Relative to each entry, or with ``scale`` (a product's |a| @ |b|: entries that cancel
    to near 0) to that."""
    assert got.dtype == np.float64, (what, got.dtype)
    if scale is None:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=0, err_msg=what)
    else:
        assert np.all(np.abs(got - want) <= rtol * scale), (what, np.max(np.abs(got - want) / scale))


def beyond_f32(want, f32_answer, rtol=RTOL):
    """The f32 computation of the same thing misses the f64 answer by far more than rtol."""
    err = np.max(np.abs(np.asarray(f32_answer, np.float64) - want) / np.maximum(np.abs(want), 1e-300))
    assert err > 1e3 * rtol, err


# ---- the dtype, and promotion written out as torch's rules --------------------------------------
# torch.promote_types(torch.float64, t) for every other dtype: f64 wins over every float and
# every integer and bool (torch has no fp8 promotion: here fp8 computes as any float)
TORCH_F64_WITH = {"f32": "f64", "f16": "f64", "bf16": "f64", "i64": "f64", "i32": "f64",
                  "i16": "f64", "i8": "f64", "u8": "f64", "bool": "f64", "f8e4m3": "f64",
                  "f8e5m2": "f64", "f64": "f64"}


def test_dtype_names_and_promotion():
    assert rlx.Graph("d").input("x", (2,), "float64").dtype is dt.F64
    for spelling in ("f64", "float64", np.float64, np.dtype("float64"), dt.F64):
        assert dt.dtype(spelling) is dt.F64
    assert dt.F64.host == np.float64 and dt.F64.storage == np.float64 and dt.F64.itemsize == 8
    for other, want in TORCH_F64_WITH.items():
        o = dt.dtype(other)
        assert dt.promote(dt.F64, o).name == want and dt.promote(o, dt.F64).name == want, other
    # through the graph: binary results, and Python scalars are weak (torch's rule: an f64
    # tensor with a Python float or int stays f64; an f32 tensor with a Python float stays f32)
    g = rlx.Graph("p")
    x = g.input("x", (3,), "f64")
    for other in ("f32", "f16", "bf16", "i32", "i64", "u8", "bool"):
        y = g.input(f"y_{other}", (3,), other)
        assert (x + y).dtype is dt.F64 and (y * x).dtype is dt.F64, other
    assert (x * 2).dtype is dt.F64 and (x + 0.5).dtype is dt.F64 and (x > 1).dtype is dt.BOOL
    assert (g.input("z", (3,), "f32") + 0.5).dtype is dt.F32
    assert g.where(x > 0, x, g.input("i", (3,), "i32")).dtype is dt.F64
    assert g.sum(x).dtype is dt.F64 and g.argmax(x).dtype is dt.I64 and g.exp(x).dtype is dt.F64
    # a float64 NumPy array without a dtype stays f32 (NumPy's default float, as before f64
    # existed); dtype="f64" keeps it
    assert g.constant(np.ones(3)).dtype is dt.F32
    assert g.constant(np.ones(3), "f64").dtype is dt.F64


def test_autocast_leaves_f64_alone():
    """torch.autocast casts only float32 (and half) operands: f64 products stay f64."""
    g = rlx.Graph("ac")
    a, w = g.input("a", (3, 4), "f64"), g.param("w", (4, 5), "f64")
    x, v = g.input("x", (3, 4), "f32"), g.param("v", (4, 5), "f32")
    g.set_outputs([g.linear(a, w), x @ v, g.sum(a)])
    h = g.autocast("bf16")
    assert [h.nodes[o].dtype for o in h.outputs] == [dt.F64, dt.BF16, dt.F64]


def test_unsupported_op_raises_naming_op_and_dtype():
    g = rlx.Graph("u")
    x = g.input("x", (4, 3), "f64")
    with pytest.raises(ValueError, match=r"cross_entropy: dtype f64 is not supported \(input 0 "
                                         r"is f64 \[4, 3\]\)"):
        g.cross_entropy(x, g.input("labels", (4,), "i64"))
    q = g.input("q", (1, 2, 4, 8), "f64")
    with pytest.raises(ValueError, match=r"attention: dtype f64 is not supported \(input 0 is "
                                         r"f64 \[1, 2, 4, 8\]\)"):
        g.attention(q, q, q)
    with pytest.raises(ValueError, match=r"gated: dtype f64 is not supported"):
        g.gated(g.input("h", (2, 6), "f64"))
    with pytest.raises(ValueError, match=r"layer_norm: f64 needs every operand f64 \(x f64\), got "
                                         r"gamma f32 \[3\]"):
        g.layer_norm(x, g.param("gamma", (3,), "f32"))
    g2 = rlx.Graph("run")
    exe = rlx.compile(_one_output(g2, g2.exp(g2.input("x", (4, 3), "f64"))))
    with pytest.raises(ValueError, match=r"input 'x' must be f64 \(float64\), got float32"):
        exe.run({"x": np.ones((4, 3), np.float32)})


def test_ops_declared_f64_are_the_ones_with_f64_kernels():
    """An op takes f64 only by declaring it (its OpDef's f64=True, written out here so that a
    new one is a deliberate change) or by only moving values (STORAGE); every other op is
    refused at build time."""
    from rlx_numba.ir.opdef import OPS
    declared = {n for n, d in OPS.items() if d.f64}
    assert declared == {"activation", "activation_grad", "argmax", "argmin", "binary", "compare",
                        "cumsum", "fused", "linear", "matmul", "reduce", "scatter_add",
                        "where", "cholesky", "eigh", "lu_solve", "qr", "slogdet", "svd",
                        "trsm"}, declared
    assert not OPS["softmax"].takes_f64 and not OPS["layer_norm"].takes_f64   # (built from
    # f64 ops by their builders instead)


def _one_output(g, t):
    g.set_outputs([t])
    return g


# ---- element-wise -------------------------------------------------------------------------------
def _gelu(v):
    return 0.5 * v * (1 + np.vectorize(math.erf)(v / math.sqrt(2)))


def _gelu_tanh(v):
    return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v ** 3)))


UNARY = {"gelu": _gelu, "gelu_tanh": _gelu_tanh, "silu": lambda v: v / (1 + np.exp(-v)),
         "relu": lambda v: np.maximum(v, 0), "sigmoid": lambda v: 1 / (1 + np.exp(-v)),
         "tanh": np.tanh, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
         "rsqrt": lambda v: 1 / np.sqrt(v), "neg": np.negative, "abs": np.abs, "sin": np.sin,
         "cos": np.cos, "tan": np.tan, "atan": np.arctan, "round": np.round}


def test_every_activation_and_binary_op_in_f64(rng):
    # positive values away from the zeros of sin / cos / tan, with a 1e-9 detail f32 drops
    xv = (rng.uniform(0.2, 1.4, (3, 7)) + 1e-9).astype(np.float64)
    xv[0, :3] = [1 + 1e-10, 2.5, 3.5]            # log(1 + 1e-10); round half to even
    yv = rng.uniform(0.5, 2.0, (7,))
    g = rlx.Graph("ew")
    x, y = g.input("x", (3, 7), "f64"), g.input("y", (7,), "f64")
    outs = [g.activation(k, x) for k in UNARY]
    binary = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
              "max": np.maximum, "min": np.minimum, "pow": np.power}
    outs += [g.binary(k, x, y) for k in binary]          # y broadcast along the rows
    chain = g.exp(g.tanh(x) * 3.0 - y) / (g.sqrt(x) + 1e-3)   # a fused chain
    outs += [chain, g.where(x > y, x, y * 2), g.cast(x <= y, "f64")]
    got = run_graph(_one_output_many(g, outs), {"x": xv, "y": yv})
    want = [f(xv) for f in UNARY.values()] + [f(xv, yv) for f in binary.values()]
    want += [np.exp(np.tanh(xv) * 3 - yv) / (np.sqrt(xv) + 1e-3), np.where(xv > yv, xv, yv * 2),
             (xv <= yv).astype(np.float64)]
    names = list(UNARY) + list(binary) + ["chain", "where", "compare"]
    for gv, wv, name in zip(got, want, names):
        close(gv, wv, what=name)
    assert got[list(UNARY).index("log")][0, 0] == pytest.approx(1e-10, rel=1e-6)
    # the chain alone is one fused kernel, in f64 throughout
    g1 = rlx.Graph("chain")
    x1, y1 = g1.input("x", (3, 7), "f64"), g1.input("y", (7,), "f64")
    exe = rlx.compile(_one_output(g1, g1.exp(g1.tanh(x1) * 3.0 - y1) / (g1.sqrt(x1) + 1e-3)))
    assert [s.name.split(" ")[1][:5] for s in exe.steps] == ["fused"], [s.name for s in exe.steps]
    close(exe.run({"x": xv, "y": yv})[0], want[len(UNARY) + len(binary)], what="fused chain")
    beyond_f32(np.log(xv[0, 0]), np.log(np.float32(xv[0, 0])))   # f32: log(1) = 0


def _one_output_many(g, outs):
    g.set_outputs(outs)
    return g


def test_math_functions_where_f32_differs():
    """exp / log / tanh / erf (gelu) / sin at arguments an f32 kernel cannot resolve (exp(700)
    overflows f32)."""
    xv = np.array([20.123456789012, 0.5 + 1e-9, 1 + 3e-12, 700.123456789, -2.75 + 1e-8])
    g = rlx.Graph("fn")
    x = g.input("x", (5,), "f64")
    got = run_graph(_one_output_many(g, [g.exp(x), g.tanh(x), g.log(x * x), g.gelu(x),
                                         g.sin(x), g.pow(x * x, 0.5)]), {"x": xv})
    want = [np.exp(xv), np.tanh(xv), np.log(xv * xv), _gelu(xv), np.sin(xv), np.abs(xv)]
    for gv, wv, name in zip(got, want, ("exp", "tanh", "log", "gelu", "sin", "pow")):
        close(gv, wv, what=name)
    x32 = xv.astype(np.float32)
    with np.errstate(over="ignore"):
        beyond_f32(want[0], np.exp(x32))
    beyond_f32(want[2], np.log(x32 * x32))
    beyond_f32(want[4], np.sin(x32))


def test_cast_round_trips(rng):
    big = np.array([2**53 - 1, -(2**53 - 3), 123456789012345, 7, 0, -1], np.int64)
    fv = np.array([-2.7, -0.5, 0.0, 0.49999999999, 1e10 + 0.5, 3.999999999], np.float64)
    hv = rng.standard_normal(6).astype(np.float32).astype(np.float64)   # exact in f32
    g = rlx.Graph("cast")
    i, f, h = g.input("i", (6,), "i64"), g.input("f", (6,), "f64"), g.input("h", (6,), "f64")
    outs = [g.cast(i, "f64"), g.cast(g.cast(i, "f64"), "i64"), g.cast(f, "i64"),
            g.cast(f, "i32"), g.cast(g.cast(f, "f32"), "f64"), g.cast(g.cast(h, "f16"), "f64"),
            g.cast(g.cast(h, "bf16"), "f64"), g.cast(f, "bool"), g.cast(g.cast(f, "bool"), "f64"),
            g.cast(g.cast(h, "f32"), "f64")]
    small = {"u8": np.array([0, 255, 7, 128, 1, 9], np.uint8),
             "i8": np.array([-128, 127, -1, 0, 5, -7], np.int8),
             "i16": np.array([-32768, 32767, -3, 0, 300, 11], np.int16)}
    ins = {n: g.input(n, (6,), n) for n in small}
    outs += [g.cast(t, "f64") for t in ins.values()]
    outs += [g.cast(g.cast(f, n), "f64") for n in small]
    outs += [g.cast(g.cast(h, n), "f64") for n in ("f8e4m3", "f8e5m2")]
    got = run_graph(_one_output_many(g, outs), {"i": big, "f": fv, "h": hv, **small})
    for k, (n, v) in enumerate(small.items()):
        np.testing.assert_array_equal(got[10 + k], v.astype(np.float64), err_msg=n)
    # to a small int: through i32, wrapping, as torch's casts (0.5 and 1e10 + 0.5 included)
    wrapped = np.clip(np.trunc(fv), -2**31, 2**31 - 1).astype(np.int32)
    for k, n in enumerate(small):
        np.testing.assert_array_equal(got[13 + k], wrapped.astype(small[n].dtype).astype(np.float64),
                                      err_msg=n)
    import ml_dtypes
    for k, t in enumerate((ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)):
        np.testing.assert_array_equal(got[16 + k], hv.astype(t).astype(np.float64), err_msg=str(t))
    np.testing.assert_array_equal(got[0], big.astype(np.float64))
    assert got[0][0] == 2.0**53 - 1                       # f32 would give 2**53
    np.testing.assert_array_equal(got[1], big)
    np.testing.assert_array_equal(got[2], np.trunc(fv).astype(np.int64))   # toward zero
    # (to i32 saturating, as CUDA's cvt.rzi.sat: 1e10 + 0.5 gives 2**31 - 1)
    np.testing.assert_array_equal(got[3], np.clip(np.trunc(fv), -2**31, 2**31 - 1).astype(np.int32))
    np.testing.assert_array_equal(got[4], fv.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(got[5], hv.astype(np.float16).astype(np.float64))
    np.testing.assert_array_equal(got[6], hv.astype(ml_dtypes.bfloat16).astype(np.float64))
    np.testing.assert_array_equal(got[7], fv != 0)
    np.testing.assert_array_equal(got[8], (fv != 0).astype(np.float64))
    np.testing.assert_array_equal(got[9], hv)             # exact both ways


def test_half_inputs_widen_exactly_into_f64(rng):
    """f16 / bf16 tensors (the vector kernel's 16-byte loads: 17 elements, two vectors and a
    tail) meeting f64 ones: widened exactly, the product in f64."""
    import ml_dtypes
    hv = rng.standard_normal(17).astype(np.float16)
    bv = rng.standard_normal(17).astype(ml_dtypes.bfloat16)
    fv = rng.standard_normal(17) + 1e-9
    g = rlx.Graph("widen")
    h, b, f = g.input("h", (17,), "f16"), g.input("b", (17,), "bf16"), g.input("f", (17,), "f64")
    got = run_graph(_one_output_many(g, [h * f, g.cast(b, "f64") + f, g.cast(h, "f64")]),
                    {"h": hv, "b": bv, "f": fv})
    close(got[0], hv.astype(np.float64) * fv, what="f16 * f64")
    close(got[1], bv.astype(np.float64) + fv, what="bf16 + f64")
    np.testing.assert_array_equal(got[2], hv.astype(np.float64))


# ---- reductions ------------------------------------------------------------------------------------
def test_reductions_accumulate_in_f64(rng):
    n = 1001
    tiny = np.full((2, n), 1e-10)
    tiny[:, 0] = 1.0                    # 1 + 1000 * 1e-10: every term lost in f32
    xv = rng.standard_normal((3, 5, 9)) * 1e-3 + 1.0
    g = rlx.Graph("red")
    t, x = g.input("t", (2, n), "f64"), g.input("x", (3, 5, 9), "f64")
    outs = [g.sum(t, 1), g.mean(t, -1), g.sum(x, (0, 2)), g.mean(x, (0, 2), keep_dim=True),
            g.reduce_max(x, 1), g.reduce_min(x, 0), g.reduce_prod(x, -1), g.argmax(x, 2),
            g.argmin(x, 0), g.cumsum(t, 1), g.cumsum(x, 1, exclusive=True),
            g.mean((x - g.mean(x, 2, keep_dim=True)) ** 2.0, 2)]          # a variance
    got = run_graph(_one_output_many(g, outs), {"t": tiny, "x": xv})
    want_sum = 1.0 + (n - 1) * 1e-10
    close(got[0], np.full(2, want_sum), what="sum")
    beyond_f32(want_sum, np.float32(1) + np.float32(1e-10) * 0)   # f32 cannot hold 1 + 1e-10
    close(got[1], np.full(2, want_sum / n), what="mean")
    close(got[2], xv.sum((0, 2)), what="sum over 0, 2")
    close(got[3], xv.mean((0, 2), keepdims=True), what="mean keep_dim")
    close(got[4], xv.max(1), what="max")
    close(got[5], xv.min(0), what="min")
    close(got[6], xv.prod(-1), what="prod")
    np.testing.assert_array_equal(got[7], xv.argmax(2))
    np.testing.assert_array_equal(got[8], xv.argmin(0))
    close(got[9], np.cumsum(tiny, 1), what="cumsum")
    ex = np.cumsum(xv, 1) - xv
    close(got[10], ex, rtol=1e-11, what="exclusive cumsum")   # (its subtraction above rounds)
    close(got[11], xv.var(2), rtol=1e-10, what="variance")    # (the oracle's own rounding)
    beyond_f32(xv.var(2), xv.astype(np.float32).var(2))


# ---- products ---------------------------------------------------------------------------------------
def test_matmul_linear_batched_ill_conditioned(rng):
    # rows of +-1e8 that cancel: the exact product keeps the small terms; f32 loses them
    m, k, n = 5, 7, 6
    av = rng.standard_normal((m, k))
    av[:, 0], av[:, 1] = 1e8, -1e8
    wv = rng.standard_normal((k, n))
    wv[0], wv[1] = 1.0 + 1e-7, 1.0
    bv = rng.standard_normal(n)
    xb = rng.standard_normal((2, 3, m, k))
    yb = rng.standard_normal((3, k, 4))
    g = rlx.Graph("mm")
    a, w, b = g.input("a", (m, k), "f64"), g.param("w", (k, n), "f64"), g.param("b", (n,), "f64")
    x, y = g.input("x", (2, 3, m, k), "f64"), g.input("y", (3, k, 4), "f64")
    r = g.input("r", (m, n), "f64")
    outs = [a @ w, g.linear(a, w, b, activation="gelu"), x @ y,
            g.matmul(g.transpose(w, (1, 0)), g.transpose(a, (1, 0))),
            g.einsum("mk,nk->mn", a, g.transpose(w, (1, 0))),
            g.linear(a, w, b) + r, g.silu(a @ w + b) + r]     # residual / epilogue folds
    exe = rlx.compile(_one_output_many(g, outs))
    exe.set_param("w", wv)
    exe.set_param("b", bv)
    rv = rng.standard_normal((m, n))
    got = exe.run({"a": av, "x": xb, "y": yb, "r": rv})
    tiers = {s.info["tier"] for s in exe.steps if "tier" in s.info}
    assert tiers == ({2} if ON_GPU else {4}), tiers      # cuBLAS Dgemm / the numba f64 GEMM
    want, scale = av @ wv, np.abs(av) @ np.abs(wv)       # (the sums' 1e8-sized terms)
    close(got[0], want, scale=scale, what="matmul")
    beyond_f32(want, av.astype(np.float32) @ wv.astype(np.float32), rtol=1e-9)
    close(got[1], _gelu(want + bv), scale=scale + np.abs(bv), what="linear gelu")
    close(got[2], xb @ yb, scale=np.abs(xb) @ np.abs(yb), what="batched, broadcast")
    close(got[3], want.T, scale=scale.T, what="transposed operands")
    close(got[4], want, scale=scale, what="einsum")
    close(got[5], want + bv + rv, scale=scale + np.abs(bv) + np.abs(rv), what="residual")
    z = want + bv
    close(got[6], z / (1 + np.exp(-z)) + rv, scale=scale + np.abs(bv) + np.abs(rv), what="silu")


# ---- rows -------------------------------------------------------------------------------------------
def test_softmax_and_norms_beyond_f32(rng):
    logits = 1000.0 + rng.standard_normal((3, 11)) * 1e-6     # large logits, tiny gaps
    # 1e6 + k 2^-20 (f32's spacing there is 2^-4): rows of 8, so the sums, the means and the
    # squares of the deviations are exact in f64 and only the last few roundings remain
    xv = 1e6 + rng.integers(-500, 500, (5, 8)) * 2.0**-20
    gv, bv, rv = rng.standard_normal(8), rng.standard_normal(8), rng.standard_normal((5, 8))
    g = rlx.Graph("rows")
    lg, x = g.input("lg", (3, 11), "f64"), g.input("x", (5, 8), "f64")
    gam, bet, r = g.param("gam", (8,), "f64"), g.param("bet", (8,), "f64"), g.input("r", (5, 8), "f64")
    ln = g.layer_norm(x, gam, bet)
    rms, h = g.rms_norm(x, gam, residual=r, return_residual=True)
    outs = [g.softmax(lg), g.log_softmax(lg, 0), ln, rms, h,
            g.layer_norm(g.transpose(x, (1, 0)), gam, axis=0)]
    exe = rlx.compile(_one_output_many(g, outs))
    exe.set_param("gam", gv)
    exe.set_param("bet", bv)
    got = exe.run({"lg": logits, "x": xv, "r": rv})
    e = np.exp(logits - logits.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    close(got[0], want, what="softmax")
    beyond_f32(want, np.full_like(want, 1 / 11))    # f32 rounds every logit to 1000
    z = logits - logits.max(0, keepdims=True)
    close(got[1], z - np.log(np.exp(z).sum(0, keepdims=True)), what="log_softmax")
    mu, var = xv.mean(-1, keepdims=True), xv.var(-1, keepdims=True)
    want_ln = (xv - mu) / np.sqrt(var + 1e-5) * gv + bv
    close(got[2], want_ln, what="layer_norm")
    beyond_f32(want_ln, _ln32(xv, gv, bv))
    hv = xv + rv
    close(got[3], hv / np.sqrt((hv * hv).mean(-1, keepdims=True) + 1e-6) * gv, what="rms_norm")
    close(got[4], hv, what="residual sum")
    close(got[5], ((xv - mu) / np.sqrt(var + 1e-5) * gv).T, what="layer_norm along axis 0")


def _ln32(x, gam, bet):
    x = x.astype(np.float32)
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + np.float32(1e-5)) * gam + bet


# ---- storage ops -------------------------------------------------------------------------------------
def test_shape_ops_move_f64_exactly(rng):
    xv = rng.standard_normal((4, 5)) + 1e-12
    iv = np.array([3, 0, 3], np.int64)               # a repeated index: atomic adds in f64
    cv = rng.standard_normal((3, 5)) + 1e-12
    g = rlx.Graph("shape")
    x, i, c = g.input("x", (4, 5), "f64"), g.input("i", (3,), "i64"), g.input("c", (3, 5), "f64")
    outs = [g.transpose(x, (1, 0)), g.concat([x, x * 2], 1), g.narrow(x, 1, 1, 3),
            g.expand(g.reshape(x, (1, 4, 5)), (2, 4, 5)), g.gather(x, i, 0),
            g.scatter_add(x, i, c), g.scatter_add(x, i, c, deterministic=True)]
    loss = g.sum(g.gather(x, i, 0) * c) + g.sum(g.narrow(g.transpose(x, (1, 0)), 0, 1, 2))
    outs.append(g.grad(loss, x))
    got = run_graph(_one_output_many(g, outs), {"x": xv, "i": iv, "c": cv})
    added = xv.copy()
    np.add.at(added, iv, cv)
    dx = np.zeros_like(xv)
    np.add.at(dx, iv, cv)
    dx[:, 1:3] += 1
    for k, (gv, wv) in enumerate(zip(got, [xv.T, np.concatenate([xv, xv * 2], 1), xv[:, 1:4],
                                           np.broadcast_to(xv, (2, 4, 5)), xv[iv]])):
        assert gv.dtype == np.float64
        np.testing.assert_array_equal(gv, wv, err_msg=str(k))
    close(got[5], added, what="scatter_add")
    np.testing.assert_array_equal(got[6], added)      # (np.add.at's order, the same bits)
    close(got[7], dx, what="gather's gradient")
    beyond_f32(dx[3], (cv[0].astype(np.float32) + cv[2].astype(np.float32)))


# ---- autodiff ------------------------------------------------------------------------------------------
def _model_np(xv, wv, bv, gv):
    h = _gelu(xv @ wv + bv)
    mu, var = h.mean(-1, keepdims=True), h.var(-1, keepdims=True)
    h = (h - mu) / np.sqrt(var + 1e-5) * gv
    e = np.exp(2 * h - (2 * h).max(-1, keepdims=True))
    p = e / e.sum(-1, keepdims=True)
    y = np.tanh(h) * p + np.exp(np.sin(xv) @ wv) + (1 / (1 + np.exp(-h))) ** 2
    return np.log(np.abs(y) + 1).sum() + np.cumsum(y, 1).sum() * 0.1 + (y * y).mean()


def test_grad_matches_finite_differences(rng):
    xv, wv = rng.standard_normal((3, 5)), rng.standard_normal((5, 4)) * 0.5
    bv, gv = rng.standard_normal(4), rng.standard_normal(4)
    g = rlx.Graph("fd")
    x, w = g.input("x", (3, 5), "f64"), g.param("w", (5, 4), "f64")
    b, gam = g.param("b", (4,), "f64"), g.param("gam", (4,), "f64")
    h = g.layer_norm(g.linear(x, w, b, activation="gelu"), gam)
    y = g.tanh(h) * g.softmax(h * 2.0) + g.exp(g.sin(x) @ w) + g.sigmoid(h) ** 2.0
    loss = g.sum(g.log(g.abs(y) + 1.0)) + g.sum(g.cumsum(y, 1)) * 0.1 + g.mean(y * y)
    grads = g.grad(loss, [x, w, b, gam])
    assert all(t.dtype is dt.F64 for t in grads)
    exe = rlx.compile(_one_output_many(g, [loss] + grads))
    for name, v in (("w", wv), ("b", bv), ("gam", gv)):
        exe.set_param(name, v)
    got = exe.run({"x": xv})
    args = [xv, wv, bv, gv]
    close(got[0], np.float64(_model_np(*args)), rtol=1e-12, what="loss")
    eps = 1e-6
    for j, (arg, dgot) in enumerate(zip(args, got[1:])):
        num = np.zeros_like(arg)
        for idx in np.ndindex(arg.shape):
            up, dn = [a.copy() for a in args], [a.copy() for a in args]
            up[j][idx] += eps
            dn[j][idx] -= eps
            num[idx] = (_model_np(*up) - _model_np(*dn)) / (2 * eps)
        # central differences: O(eps^2) truncation and 1e-16 / 1e-6 roundoff: ~1e-9, far
        # below f32's 1e-3
        np.testing.assert_allclose(dgot, num, rtol=0, atol=1e-7 * np.abs(num).max(),
                                   err_msg=f"d arg {j}")


# ---- the GPU: cuBLAS Dgemm and the numba f64 GEMM at real sizes -----------------------------------------
gpu_only = pytest.mark.skipif(not ON_GPU, reason="cuBLAS Dgemm runs on a GPU only")


@gpu_only
@pytest.mark.parametrize("tier", [2, 4])
def test_gpu_dgemm(rng, monkeypatch, tier):
    """300 x 257 x 129 linear (bias, gelu) and a [3, 1] x [1, 4] broadcast batched product:
    cublasDgemm / the pointer-array batched Dgemm (tier 2) or the numba f64 GEMM (tier 4)."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", str(tier))
    m, k, n = 300, 257, 129
    g = rlx.Graph("dgemm")
    x, w, b = g.input("x", (m, k), "f64"), g.param("w", (k, n), "f64"), g.param("b", (n,), "f64")
    p, q = g.input("p", (3, 1, 65, 33), "f64"), g.input("q", (1, 4, 33, 17), "f64")
    exe = rlx.compile(_one_output_many(g, [g.linear(x, w, b, activation="gelu"), p @ q,
                                           g.matmul(p, g.transpose(p, (0, 1, 3, 2)))]))
    steps = [s for s in exe.steps if "tier" in s.info]
    assert {s.info["tier"] for s in steps} == {tier}, [(s.kernel_name, s.info["why"]) for s in steps]
    if tier == 2:
        assert all("cublasDgemm" in s.kernel_name for s in steps), [s.kernel_name for s in steps]
    xv, wv, bv = rng.standard_normal((m, k)), rng.standard_normal((k, n)), rng.standard_normal(n)
    pv, qv = rng.standard_normal((3, 1, 65, 33)), rng.standard_normal((1, 4, 33, 17))
    exe.set_param("w", wv)
    exe.set_param("b", bv)
    got = exe.run({"x": xv, "p": pv, "q": qv})
    close(got[0], _gelu(xv @ wv + bv), scale=np.abs(xv) @ np.abs(wv) + np.abs(bv), what="linear")
    close(got[1], pv @ qv, scale=np.abs(pv) @ np.abs(qv), what="broadcast batch")
    pt = pv.transpose(0, 1, 3, 2)
    close(got[2], pv @ pt, scale=np.abs(pv) @ np.abs(pt), what="transposed batch")


@gpu_only
def test_gpu_f64_reductions_rows_and_elementwise_at_size(rng):
    """The GPU's geometries: long rows split into f64 partials and combined by a second pass,
    split columns, a block-wide cumsum, a million-element fused chain, softmax rows of 4097."""
    a = 1.0 + rng.random((3, 400_001)) * 1e-9
    c = 1.0 + rng.random((4097, 129)) * 1e-9
    s = rng.standard_normal((2, 100_003))
    lg = 1000.0 + rng.standard_normal((64, 4097)) * 1e-6
    g = rlx.Graph("size")
    x, y, z, w = (g.input("a", a.shape, "f64"), g.input("c", c.shape, "f64"),
                  g.input("s", s.shape, "f64"), g.input("lg", lg.shape, "f64"))
    outs = [g.sum(x, 1), g.mean(x), g.sum(y, 0), g.reduce_max(y, 0), g.argmax(x, 1),
            g.cumsum(z, 1), g.exp(g.tanh(z) * 2.0) - z, g.softmax(w)]
    got = run_graph(_one_output_many(g, outs), {"a": a, "c": c, "s": s, "lg": lg})
    close(got[0], a.sum(1), what="sum of long rows")
    close(got[1], np.float64(a.mean()), what="mean of everything")
    close(got[2], c.sum(0), what="sum of columns")
    close(got[3], c.max(0), what="max of columns")
    np.testing.assert_array_equal(got[4], a.argmax(1))
    cs = np.cumsum(s, 1)
    close(got[5], cs, scale=np.cumsum(np.abs(s), 1), what="cumsum")
    close(got[6], np.exp(np.tanh(s) * 2) - s, scale=np.exp(2) + np.abs(s), what="chain")
    e = np.exp(lg - lg.max(-1, keepdims=True))
    close(got[7], e / e.sum(-1, keepdims=True), what="softmax")
