"""Element-wise ops: the 17 activations, the 7 binary ops, the 6 compares and where.

Reached three ways: g.activation(kind, x) / g.binary(kind, a, b) / g.compare(kind, a, b), the
per-kind methods (g.gelu(x), g.add(a, b), g.lt(a, b)) and the Tensor operators. The oracle is
NumPy written here (float64, math.erf for the exact GELU), never project code. Each test builds
one graph with many outputs and compiles it once, so the simulator has little to launch.
"""
import math

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph

# the simulator computes with NumPy scalars, which warn on 1/0, inf*0, ...: IEEE results wanted
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

BF16 = ml_dtypes.bfloat16
HOST = {"f32": np.float32, "f16": np.float16, "bf16": BF16, "i32": np.int32, "i64": np.int64,
        "bool": np.bool_}
FLOATS = ("f32", "f16", "bf16")
# a float result computed in float32, then rounded to the output dtype: few-ulp error in f32,
# half an ulp of rounding in f16 (2^-11) / bf16 (2^-8)
TOL = {"f32": dict(rtol=1e-5, atol=1e-6), "f16": dict(rtol=1e-3, atol=1e-6),
       "bf16": dict(rtol=8e-3, atol=1e-6)}

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt",
               "rsqrt", "neg", "abs", "sin", "cos", "tan", "atan", "round")
BINARY = ("add", "sub", "mul", "div", "max", "min", "pow")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
EXACT_ACTS = ("relu", "neg", "abs", "round")      # no rounding error at all
INT_KEEP = ("relu", "neg", "abs", "round")        # integer in, same integer dtype out
POSITIVE = ("log", "sqrt", "rsqrt")               # fed a positive input
TAN_DOMAIN = ("tan",)                              # fed |x| < 1.4, away from the poles


def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _act_oracle(kind, x):
    """float64 reference of each activation."""
    x = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        return {
            "gelu": lambda: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
            "gelu_tanh": lambda: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi)
                                                          * (x + 0.044715 * x ** 3))),
            "silu": lambda: x / (1.0 + np.exp(-x)),
            "relu": lambda: np.where(x < 0, 0.0, x),
            "sigmoid": lambda: 1.0 / (1.0 + np.exp(-x)),
            "tanh": lambda: np.tanh(x),
            "exp": lambda: np.exp(x),
            "log": lambda: np.log(x),
            "sqrt": lambda: np.sqrt(x),
            "rsqrt": lambda: 1.0 / np.sqrt(x),
            "neg": lambda: -x,
            "abs": lambda: np.abs(x),
            "sin": lambda: np.sin(x),
            "cos": lambda: np.cos(x),
            "tan": lambda: np.tan(x),
            "atan": lambda: np.arctan(x),
            "round": lambda: np.round(x),     # NumPy rounds half to even
        }[kind]()


def _int_pow(a, b):
    """Integer power as documented: b < 0 gives 1/a**|b| truncated (0 unless |a| == 1)."""
    a, b = np.broadcast_arrays(np.asarray(a, np.int64), np.asarray(b, np.int64))
    out = np.empty(a.shape, np.int64)
    for i in np.ndindex(a.shape):
        x, y = int(a[i]), int(b[i])
        if y >= 0:
            out[i] = x ** y
        elif x == 1:
            out[i] = 1
        elif x == -1:
            out[i] = -1 if y % 2 else 1
        else:
            out[i] = 0
    return out


def _bin_oracle(kind, a, b, out_dtype):
    """float64 (or int64) reference of each binary op; ``out_dtype`` picks float or int math."""
    if out_dtype in ("i32", "i64", "bool"):
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        if kind == "pow":
            return _int_pow(a, b)
        return {"add": np.add, "sub": np.subtract, "mul": np.multiply,
                "max": np.maximum, "min": np.minimum}[kind](a, b)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(all="ignore"):
        return {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
                "max": np.maximum, "min": np.minimum, "pow": np.power}[kind](a, b)


def _cmp_oracle(kind, a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}[kind](a, b)


def _f64(a):
    return np.asarray(a).astype(np.float64)


def _check(got, want, dtype, exact=False, what=""):
    """got: the run() output; want: float64/int reference (rounded here to ``dtype``)."""
    assert got.dtype == np.dtype(HOST[dtype]), f"{what}: dtype {got.dtype}, expected {dtype}"
    want = np.broadcast_to(want, got.shape)
    if dtype in ("i32", "i64", "bool"):
        np.testing.assert_array_equal(got, np.asarray(want).astype(HOST[dtype]), err_msg=what)
    elif exact:
        np.testing.assert_array_equal(_f64(got), _f64(np.asarray(want).astype(HOST[dtype])),
                                      err_msg=what)
    else:
        np.testing.assert_allclose(_f64(got), want, err_msg=what, **TOL[dtype])


def _rand(rng, shape, dtype, lo=-4.0, hi=4.0):
    """Random values of ``dtype`` in [lo, hi); never all zeros."""
    if dtype == "bool":
        v = rng.random(shape) < 0.5
        v.flat[0] = True
        return v
    if dtype in ("i32", "i64"):
        v = rng.integers(int(lo), int(hi) + 1, size=shape)
        v.flat[0] = int(hi) if int(hi) != 0 else int(lo)
        return v.astype(HOST[dtype])
    return rng.uniform(lo, hi, size=shape).astype(HOST[dtype])


# ---- activations --------------------------------------------------------------------------
ACT_SHAPE = (5, 7, 3)


@pytest.mark.parametrize("dtype", FLOATS)
def test_activations_float(rng, dtype):
    g = rlx.Graph("act")
    x = g.input("x", ACT_SHAPE, dtype)
    p = g.input("p", ACT_SHAPE, dtype)
    t = g.input("t", ACT_SHAPE, dtype)
    srcs = {}
    outs = []
    for k in ACTIVATIONS:
        src = p if k in POSITIVE else t if k in TAN_DOMAIN else x
        srcs[k] = src.node.name
        a, m = g.activation(k, src), getattr(g, k)(src)     # both spellings
        assert a.shape == ACT_SHAPE and str(a.dtype) == dtype and str(m.dtype) == dtype
        outs += [a, m]
    g.set_outputs(outs)
    data = {"x": _rand(rng, ACT_SHAPE, dtype), "p": _rand(rng, ACT_SHAPE, dtype, 0.05, 9.0),
            "t": _rand(rng, ACT_SHAPE, dtype, -1.4, 1.4)}
    res = run_graph(g, data)
    for i, k in enumerate(ACTIVATIONS):
        want = _act_oracle(k, _f64(data[srcs[k]]))
        _check(res[2 * i], want, dtype, exact=k in EXACT_ACTS, what=f"{k} {dtype}")
        _check(res[2 * i + 1], want, dtype, exact=k in EXACT_ACTS, what=f"g.{k} {dtype}")


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gated(rng, dtype, interleaved):
    """activation(gate) * up over the halves (or even / odd entries) of the last axis, also
    of a strided narrow read in place."""
    g = rlx.Graph("gated")
    x = g.input("x", (3, 5, 14), dtype)
    outs = [g.gated(x, k, interleaved) for k in ("silu", "gelu", "sigmoid")]
    outs.append(g.gated(g.narrow(x, 2, 2, 10), "gelu_tanh", interleaved))
    g.set_outputs(outs)
    xv = _rand(rng, (3, 5, 14), dtype)
    res = run_graph(g, {"x": xv})

    def ref(v, k):
        v = _f64(v)
        a, b = (v[..., 0::2], v[..., 1::2]) if interleaved else np.split(v, 2, axis=-1)
        # the op rounds act(gate) to the dtype before the product, as the unfused pair does
        return _f64(np.asarray(_act_oracle(k, a)).astype(HOST[dtype])) * b
    for got, k in zip(res, ("silu", "gelu", "sigmoid")):
        assert got.shape == (3, 5, 7)
        _check(got, ref(xv, k), dtype, what=f"gated {k} {dtype}")
    _check(res[3], ref(xv[..., 2:12], "gelu_tanh"), dtype, what="gated of a narrow")


def test_gated_errors():
    g = rlx.Graph("gated")
    with pytest.raises(ValueError, match=r"gated: x's last axis must have an even length .*\[3, 5\]"):
        g.gated(g.input("x", (3, 5)))
    with pytest.raises(ValueError, match="gated: unknown activation 'swish'"):
        g.gated(g.input("y", (3, 4)), "swish")
    with pytest.raises(ValueError, match="gated: x must be a float tensor, got i32"):
        g.gated(g.input("z", (3, 4), "i32"))


@pytest.mark.parametrize("dtype", ["i32", "i64"])
def test_activations_int(rng, dtype):
    """relu/neg/abs/round keep an integer dtype; the rest give f32 of the integer's value."""
    shape = (37,)
    g = rlx.Graph("act_int")
    x = g.input("x", shape, dtype)
    p = g.input("p", shape, dtype)
    t = g.input("t", shape, dtype)
    outs, srcs = [], {}
    for k in ACTIVATIONS:
        src = p if k in POSITIVE else t if k in TAN_DOMAIN else x
        srcs[k] = src.node.name
        o = getattr(g, k)(src)
        assert str(o.dtype) == (dtype if k in INT_KEEP else "f32"), k
        outs.append(o)
    g.set_outputs(outs)
    data = {"x": _rand(rng, shape, dtype, -12, 12), "p": _rand(rng, shape, dtype, 1, 60),
            "t": _rand(rng, shape, dtype, -1, 1)}
    res = run_graph(g, data)
    for k, r in zip(ACTIVATIONS, res):
        want = _act_oracle(k, _f64(data[srcs[k]]))
        _check(r, want, dtype if k in INT_KEEP else "f32", what=f"{k} {dtype}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the simulator's NumPy scalars warn
def test_activation_special_values():
    v = np.array([0.0, -0.0, -1.0, 1.0, 100.0, -100.0, 89.0, np.inf, -np.inf, np.nan], np.float32)
    g = rlx.Graph("special")
    x = g.input("x", v.shape, "f32")
    g.set_outputs([g.activation(k, x) for k in ACTIVATIONS])
    res = dict(zip(ACTIVATIONS, run_graph(g, {"x": v})))
    finite = np.isfinite(v) | np.isnan(v)
    for k in ACTIVATIONS:
        with np.errstate(over="ignore"):
            want = _act_oracle(k, v.astype(np.float64)).astype(np.float32)  # overflow -> inf
        sel = finite if k in ("gelu", "gelu_tanh", "silu") else slice(None)
        np.testing.assert_allclose(res[k][sel], want[sel], rtol=1e-5, atol=1e-6, err_msg=k)
    # the ones that matter most, spelled out
    assert res["log"][0] == -np.inf and res["log"][1] == -np.inf and np.isnan(res["log"][2])
    assert np.isnan(res["sqrt"][2]) and res["sqrt"][7] == np.inf
    assert res["exp"][4] == np.inf and res["exp"][6] == np.inf and res["exp"][8] == 0.0
    assert res["rsqrt"][0] == np.inf and res["rsqrt"][7] == 0.0
    assert np.isnan(res["relu"][9]) and res["relu"][5] == 0.0 and res["relu"][7] == np.inf
    assert res["abs"][1] == 0.0 and not np.signbit(res["abs"][1])      # abs(-0.0) is +0.0
    assert res["sigmoid"][7] == 1.0 and res["sigmoid"][8] == 0.0
    assert res["tanh"][7] == 1.0 and res["tanh"][8] == -1.0
    for k in ACTIVATIONS:
        assert np.isnan(res[k][9]), f"{k}(nan) should be nan"
    for k in ("gelu", "gelu_tanh", "silu", "relu"):
        assert res[k][4] == pytest.approx(100.0) and abs(res[k][5]) < 1e-6, k


@pytest.mark.parametrize("dtype", FLOATS)
def test_round_half_to_even(dtype):
    ties = [-4.5, -3.5, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.5, 4.5, 63.5, 64.5]
    if dtype == "f32":
        ties += [4194304.5, 4194305.5, -4194305.5, 8388607.5]
    if dtype == "f16":
        ties += [512.5, 513.5, -1023.5]
    assert np.array_equal(np.array(ties).astype(HOST[dtype]).astype(np.float64), ties)
    others = [-0.4, 0.6, 1.25, -1.75, 7.0, -8.0]
    if dtype == "f32":   # the floats just below a tie
        others += [float(np.nextafter(np.float32(t), np.float32(0))) for t in (0.5, 2.5)]
    v = np.array(ties + others, np.float64).astype(HOST[dtype])
    g = rlx.Graph("round")
    x = g.input("x", v.shape, dtype)
    g.set_outputs([g.round(x), g.activation("round", x)])
    r1, r2 = run_graph(g, {"x": v})
    want = np.round(v.astype(np.float64))      # half to even
    assert want[4] == 0.0 and want[6] == 2.0 and want[8] == 4.0 and want[11] == 64.0
    np.testing.assert_array_equal(r1.astype(np.float64), want)
    np.testing.assert_array_equal(r2.astype(np.float64), want)
    # -0.5 and -0.4 round to -0.0, like numpy.round / torch.round
    neg04 = len(ties)
    assert np.signbit(r1.astype(np.float32)[4]) and np.signbit(r1.astype(np.float32)[neg04])


# ---- binary ops and compares: broadcasting -------------------------------------------------
PATTERNS = [
    ("same", (5, 7, 3), (5, 7, 3)),
    ("scalar_shape0", (5, 7), ()),
    ("scalar_shape1", (7,), (1,)),
    ("scalar_left", (), (4, 3)),
    ("one_left_rank3", (1,), (2, 3, 5)),
    ("row", (4, 5), (5,)),
    ("column", (4, 5), (4, 1)),
    ("middle_axis", (3, 4, 5), (3, 1, 5)),
    ("both_sides", (4, 1), (1, 5)),
    ("rank_mismatch", (2, 3, 4, 5), (4, 1)),
    ("rank_mismatch_left", (3, 1), (2, 1, 4)),
    ("interleaved", (2, 1, 3, 1), (1, 4, 1, 5)),
    ("size1", (1,), (1,)),
    ("rank0_both", (), ()),
    ("odd37", (37,), (37,)),
]


@pytest.mark.parametrize("name,sa,sb", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_binary_and_compare_broadcast_f32(rng, name, sa, sb):
    out_shape = np.broadcast_shapes(sa, sb)
    g = rlx.Graph("bcast")
    a = g.input("a", sa, "f32")
    b = g.input("b", sb, "f32")
    pa = g.input("pa", sa, "f32")       # positive base for pow
    ca = g.input("ca", sa, "f32")       # small integers, so eq/le/ge see ties
    cb = g.input("cb", sb, "f32")
    outs = []
    for k in BINARY:
        outs.append(g.binary(k, pa if k == "pow" else a, b))
    for k in COMPARE:
        outs.append(g.compare(k, ca, cb))
    for o in outs:
        assert o.shape == out_shape
    g.set_outputs(outs)
    sign = np.where(rng.random(sb) < 0.5, -1.0, 1.0)
    data = {"a": _rand(rng, sa, "f32"),
            "b": (sign * rng.uniform(0.25, 3.0, sb)).astype(np.float32),   # never 0
            "pa": _rand(rng, sa, "f32", 0.1, 3.0),
            "ca": rng.integers(-2, 3, sa).astype(np.float32),
            "cb": rng.integers(-2, 3, sb).astype(np.float32)}
    res = run_graph(g, data)
    for k, r in zip(BINARY, res):
        want = _bin_oracle(k, data["pa" if k == "pow" else "a"], data["b"], "f32")
        _check(r, want, "f32", exact=k in ("max", "min"), what=f"{name} {k}")
    for k, r in zip(COMPARE, res[len(BINARY):]):
        _check(r, _cmp_oracle(k, data["ca"], data["cb"]), "bool", what=f"{name} {k}")


# every dtype through the per-kind methods, in three layouts
DT_PATTERNS = [((3, 5), (3, 5)), ((4, 5), (5,)), ((3, 1), (1, 7))]


@pytest.mark.parametrize("sa,sb", DT_PATTERNS, ids=["same", "row", "both_sides"])
@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i32", "i64", "bool"])
def test_binary_and_compare_dtypes(rng, dtype, sa, sb):
    g = rlx.Graph("dtypes")
    a = g.input("a", sa, dtype)
    b = g.input("b", sb, dtype)
    pa = g.input("pa", sa, dtype)
    pb = g.input("pb", sb, dtype)
    kinds = ("max", "min") if dtype == "bool" else BINARY
    outs = []
    for k in kinds:
        outs.append(getattr(g, k)(pa, pb) if k == "pow" else getattr(g, k)(a, b))
    for k in COMPARE:
        outs.append(getattr(g, k)(a, b))
    g.set_outputs(outs)
    if dtype in FLOATS:
        data = {"a": _rand(rng, sa, dtype), "pa": _rand(rng, sa, dtype, 0.1, 3.0),
                "pb": _rand(rng, sb, dtype, -2.0, 2.0)}
        sign = np.where(rng.random(sb) < 0.5, -1.0, 1.0)
        data["b"] = (sign * rng.uniform(0.25, 3.0, sb)).astype(HOST[dtype])
        # some exact ties for the compares
        data["b"].flat[0] = data["a"].flat[0]
    elif dtype == "bool":
        data = {"a": _rand(rng, sa, dtype), "b": _rand(rng, sb, dtype),
                "pa": _rand(rng, sa, dtype), "pb": _rand(rng, sb, dtype)}
    else:
        data = {"a": _rand(rng, sa, dtype, -40, 40), "b": _rand(rng, sb, dtype, -5, 5),
                "pa": _rand(rng, sa, dtype, -4, 4), "pb": _rand(rng, sb, dtype, 0, 6)}
        data["b"][data["b"] == 0] = 3                       # no division by zero here
    res = run_graph(g, data)
    for k, r in zip(kinds, res):
        x, y = (data["pa"], data["pb"]) if k == "pow" else (data["a"], data["b"])
        out = "f32" if (k == "div" and dtype in ("i32", "i64")) else dtype
        want = _bin_oracle(k, x, y, out)
        _check(r, want, out, exact=k in ("max", "min") or out == "bool", what=f"{dtype} {k}")
    for k, r in zip(COMPARE, res[len(kinds):]):
        _check(r, _cmp_oracle(k, data["a"], data["b"]), "bool", what=f"{dtype} {k}")


# ---- mixed dtypes ----------------------------------------------------------------------------
# (a dtype, b dtype, result dtype): PyTorch's promotion, with f16 + bf16 -> f32
MIXED = [
    ("i32", "f32", "f32"), ("f32", "i32", "f32"), ("i32", "i64", "i64"), ("i64", "i32", "i64"),
    ("f16", "bf16", "f32"), ("bf16", "f16", "f32"), ("bool", "i32", "i32"),
    ("i64", "bool", "i64"), ("bool", "f32", "f32"), ("f16", "f32", "f32"),
    ("f32", "bf16", "f32"), ("i32", "f16", "f16"), ("i64", "bf16", "bf16"),
    ("bool", "bf16", "bf16"), ("f16", "i64", "f16"), ("bool", "f16", "f16"),
]


def _small(rng, shape, dtype):
    """Values exact in every dtype: integers in [-4, 4] (halves for floats), bools."""
    if dtype == "bool":
        return _rand(rng, shape, "bool")
    if dtype in ("i32", "i64"):
        return _rand(rng, shape, dtype, -4, 4)
    v = rng.integers(-8, 9, shape) / 2.0
    v.flat[0] = 1.5
    return v.astype(HOST[dtype])


@pytest.mark.parametrize("da,db,dout", MIXED, ids=[f"{a}-{b}" for a, b, _ in MIXED])
def test_mixed_dtype_promotion(rng, da, db, dout):
    sa, sb = (3, 5), (5,)
    g = rlx.Graph("mixed")
    a = g.input("a", sa, da)
    b = g.input("b", sb, db)
    outs = [g.binary(k, a, b) for k in BINARY] + [g.compare(k, a, b) for k in COMPARE]
    ints = dout in ("i32", "i64")
    expect = {k: ("f32" if (k == "div" and ints) else dout) for k in BINARY}
    for k, o in zip(BINARY, outs):
        assert str(o.dtype) == expect[k], f"{da} {k} {db} -> {o.dtype}, expected {expect[k]}"
    g.set_outputs(outs)
    data = {"a": _small(rng, sa, da), "b": _small(rng, sb, db)}
    res = run_graph(g, data)
    for k, r in zip(BINARY, res):
        want = _bin_oracle(k, data["a"], data["b"], expect[k])
        exact = k in ("add", "sub", "mul", "max", "min") or (k == "pow" and ints)
        _check(r, want, expect[k], exact=exact, what=f"{da} {k} {db}")
    for k, r in zip(COMPARE, res[len(BINARY):]):
        _check(r, _cmp_oracle(k, data["a"], data["b"]), "bool", what=f"{da} {k} {db}")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_int_division_is_true_division():
    a = np.array([7, -7, 1, -1, 0, 6, 5, -9], np.int32)
    b = np.array([2, 2, 0, 0, 0, -4, 3, 4], np.int64)
    g = rlx.Graph("intdiv")
    x = g.input("a", a.shape, "i32")
    y = g.input("b", b.shape, "i64")
    xb = g.input("c", a.shape, "bool")
    g.set_outputs([g.div(x, y), x / y, g.div(x, x), xb / x])
    c = np.array([True, False, True, False, True, True, False, True])
    q, q2, q3, q4 = run_graph(g, {"a": a, "b": b, "c": c})
    want = np.array([3.5, -3.5, np.inf, -np.inf, np.nan, -1.5, 5 / 3, -2.25], np.float32)
    for r in (q, q2):
        assert r.dtype == np.float32
        np.testing.assert_allclose(r, want, rtol=1e-6)
    assert q3.dtype == np.float32
    np.testing.assert_allclose(q3, np.where(a == 0, np.nan, 1.0))
    np.testing.assert_allclose(q4, np.where(a == 0, np.where(c, np.inf, np.nan), c / a.astype(float)),
                               rtol=1e-6)


@pytest.mark.parametrize("dtype", ["i32", "i64"])
def test_int_pow_negative_exponents(dtype):
    base = np.arange(-3, 4).reshape(7, 1).astype(HOST[dtype])      # -3 .. 3
    exp = np.arange(-3, 5).reshape(1, 8).astype(HOST[dtype])       # -3 .. 4
    g = rlx.Graph("ipow")
    a = g.input("a", base.shape, dtype)
    b = g.input("b", exp.shape, dtype)
    g.set_outputs([g.pow(a, b), a ** b])
    r1, r2 = run_graph(g, {"a": base, "b": exp})
    want = _int_pow(base, exp)
    # the oracle's corners, spelled out: 0**-k = 0, 1**-k = 1, (-1)**-k = +-1, 2**-1 = 0, 0**0 = 1
    assert want[3, 0] == 0 and want[4, 0] == 1 and want[2, 0] == -1 and want[2, 1] == 1
    assert want[5, 2] == 0 and want[3, 3] == 1 and want[0, 7] == 81
    for r in (r1, r2):
        assert r.dtype == HOST[dtype]
        np.testing.assert_array_equal(r, want.astype(HOST[dtype]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("dtype", FLOATS)
def test_max_min_propagate_nan(dtype):
    a = np.array([np.nan, 1.0, np.nan, -np.inf, 2.0, -0.5, 3.0], np.float32).astype(HOST[dtype])
    b = np.array([1.0, np.nan, np.nan, 3.0, np.inf, -0.75, 3.0], np.float32).astype(HOST[dtype])
    g = rlx.Graph("nan")
    x = g.input("a", a.shape, dtype)
    y = g.input("b", b.shape, dtype)
    g.set_outputs([g.max(x, y), g.min(x, y), g.binary("max", y, x), g.binary("min", y, x),
                   g.relu(x)] + [g.compare(k, x, y) for k in COMPARE])
    res = run_graph(g, {"a": a, "b": b})
    mx = np.array([np.nan, np.nan, np.nan, 3.0, np.inf, -0.5, 3.0])
    mn = np.array([np.nan, np.nan, np.nan, -np.inf, 2.0, -0.75, 3.0])
    for r, want in zip(res[:4], (mx, mn, mx, mn)):
        assert r.dtype == np.dtype(HOST[dtype])
        np.testing.assert_array_equal(r.astype(np.float64), want)   # NaNs compare equal here
    relu = res[4].astype(np.float64)
    assert np.isnan(relu[0]) and np.isnan(relu[2]) and relu[3] == 0.0 and relu[1] == 1.0
    for k, r in zip(COMPARE, res[5:]):
        with np.errstate(invalid="ignore"):
            np.testing.assert_array_equal(r, _cmp_oracle(k, a, b), err_msg=k)  # NaN: only ne


# ---- Python scalars and Tensor operators ------------------------------------------------
def _weak(tensor_dtype, scalar):
    """PyTorch's weak-scalar rule: the dtype a Python scalar takes beside a tensor."""
    if isinstance(scalar, bool):
        return "bool"
    if isinstance(scalar, int):
        return "i64" if tensor_dtype == "bool" else tensor_dtype
    return tensor_dtype if tensor_dtype in FLOATS else "f32"


def _promote(a, b):
    if a == b:
        return a
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    order = {"bool": 0, "i32": 1, "i64": 2, "f16": 3, "bf16": 3, "f32": 4}
    return a if order[a] > order[b] else b


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "i32", "i64", "bool"])
def test_python_scalars_and_operators(rng, dtype):
    shape = (3, 5)
    g = rlx.Graph("ops")
    x = g.input("x", shape, dtype)
    y = g.input("y", (5,), dtype)
    # (label, tensor, kind, the Python scalar or None, scalar on the left?, other operand is y?)
    cases = []

    def add(label, t, kind, scalar=None, left=False, other_is_y=False):
        cases.append((label, t, kind, scalar, left, other_is_y))

    scalars = [2, 1.5, True] if dtype != "bool" else [2, 1.5]
    for s in scalars:
        add(f"x+{s!r}", x + s, "add", s)
        add(f"{s!r}+x", s + x, "add", s, left=True)
        add(f"x-{s!r}", x - s, "sub", s)
        add(f"{s!r}-x", s - x, "sub", s, left=True)
        add(f"x*{s!r}", x * s, "mul", s)
        add(f"{s!r}*x", s * x, "mul", s, left=True)
        add(f"x/{s!r}", x / s, "div", s)
        add(f"{s!r}/x", s / x, "div", s, left=True)
        add(f"x**{s!r}", x ** s, "pow", s)
        add(f"{s!r}**x", s ** x, "pow", s, left=True)
    cmp_scalars = [2, -1.5] + ([True] if dtype != "bool" else [])
    for s in cmp_scalars:
        add(f"x=={s!r}", x == s, "eq", s)
        add(f"x!={s!r}", x != s, "ne", s)
        add(f"x<{s!r}", x < s, "lt", s)
        add(f"x<={s!r}", x <= s, "le", s)
        add(f"x>{s!r}", x > s, "gt", s)
        add(f"x>={s!r}", x >= s, "ge", s)
        add(f"{s!r}<x", s < x, "lt", s, left=True)       # Python reflects it to x > s
        add(f"{s!r}>=x", s >= x, "ge", s, left=True)
        add(f"{s!r}==x", s == x, "eq", s, left=True)
    if dtype != "bool":
        for kind, t in (("add", x + y), ("sub", x - y), ("mul", x * y), ("div", x / y),
                        ("neg", -x)):
            add(f"x {kind} y", t, kind, other_is_y=True)
        add("x ** y", x ** y, "pow", other_is_y=True)
    else:
        add("x max y", g.max(x, y), "max", other_is_y=True)
    for kind, t in (("eq", x == y), ("ne", x != y), ("lt", x < y), ("le", x <= y),
                    ("gt", x > y), ("ge", x >= y)):
        add(f"x {kind} y", t, kind, other_is_y=True)
    g.set_outputs([c[1] for c in cases])

    if dtype in FLOATS:
        xv = (rng.integers(-6, 7, shape) / 2.0).astype(HOST[dtype])
        yv = (rng.integers(1, 7, (5,)) / 2.0 * np.where(rng.random(5) < 0.5, -1, 1)).astype(HOST[dtype])
        xv.flat[0], xv.flat[1], xv.flat[2] = 2.0, -1.5, 1.0      # ties with the scalars
    elif dtype == "bool":
        xv, yv = _rand(rng, shape, "bool"), _rand(rng, (5,), "bool")
    else:
        xv = _rand(rng, shape, dtype, -3, 5)
        xv.flat[1] = 1
        yv = _rand(rng, (5,), dtype, -3, 4)
        yv[yv == 0] = 2
    res = run_graph(g, {"x": xv, "y": yv})

    for (label, t, kind, s, left, with_y), r in zip(cases, res):
        if kind == "neg":
            _check(r, -xv.astype(np.int64 if dtype in ("i32", "i64") else np.float64), dtype,
                   exact=True, what=label)
            continue
        if with_y:
            other, odt = yv, dtype
        else:
            odt = _weak(dtype, s)
            other = np.asarray(s, HOST[odt])
        arith = _promote(dtype, odt)
        a, b = (other, xv) if left else (xv, other)
        if kind in COMPARE:
            assert str(t.dtype) == "bool", label
            _check(r, _cmp_oracle(kind, a, b), "bool", what=label)
            continue
        out = "f32" if (kind == "div" and arith in ("i32", "i64", "bool")) else arith
        assert str(t.dtype) == out, f"{label}: {t.dtype}, expected {out}"
        want = _bin_oracle(kind, a, b, out)
        _check(r, want, out, exact=kind in ("add", "sub", "mul", "max"), what=label)


def test_scalar_constant_dtypes():
    """The weak-scalar rule, read from the graph (no run needed)."""
    g = rlx.Graph("weak")
    t = {d: g.input(d, (2,), d) for d in HOST}
    assert str((t["f16"] + 1.5).dtype) == "f16"            # float scalar keeps a float tensor's
    assert str((t["bf16"] * 3).dtype) == "bf16"
    assert str((t["i32"] + 1.5).dtype) == "f32"            # float scalar on an int tensor: f32
    assert str((t["i32"] + 7).dtype) == "i32"              # int scalar keeps i32 (no i64 upcast)
    assert str((t["i64"] - 7).dtype) == "i64"
    assert str((t["bool"] + 1).dtype) == "i64"             # int scalar on bool: i64
    assert str((t["bool"] * 0.5).dtype) == "f32"
    assert str((t["i32"] + True).dtype) == "i32"
    assert str((2 / t["i64"]).dtype) == "f32"
    assert str((t["bool"] == True).dtype) == "bool"        # noqa: E712 - the operator under test
    # the scalar becomes a shape-() constant of that dtype; beside a half tensor an f32 one
    # marked weak (the f32 arithmetic sees it unrounded, as torch's CUDA kernels do)
    s = (t["i32"] + 7).node.inputs[1]
    assert g.nodes[s].op == "constant" and g.nodes[s].shape == () and str(g.nodes[s].dtype) == "i32"
    s = g.nodes[(t["f16"] + 1.5).node.inputs[1]]
    assert s.op == "constant" and s.shape == () and str(s.dtype) == "f32" and s.attrs["weak"]


def test_matmul_operator(rng):
    a = rng.standard_normal((3, 4)).astype(np.float32)
    b = rng.standard_normal((2, 4, 5)).astype(np.float32)
    g = rlx.Graph("mm")
    x = g.input("a", a.shape, "f32")
    w = g.input("b", b.shape, "f32")
    y = x @ w
    assert y.shape == (2, 3, 5) and str(y.dtype) == "f32"
    g.set_outputs([y, -g.matmul(x, w)])
    r, rn = run_graph(g, {"a": a, "b": b})
    np.testing.assert_allclose(r, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rn, -(a.astype(np.float64) @ b), rtol=1e-5, atol=1e-5)


# ---- where ----------------------------------------------------------------------------------
WHERE_CASES = [
    ("same", (4, 5), (4, 5), "f32", (4, 5), "f32", "f32"),
    ("bcast", (4, 1), (5,), "f32", (), "f32", "f32"),
    ("middle", (3, 1, 5), (3, 4, 1), "i32", (1,), "f32", "f32"),
    ("f16_bf16", (5,), (2, 3, 5), "f16", (3, 1), "bf16", "f32"),
    ("scalar_cond", (), (7,), "i64", (7,), "i32", "i64"),
    ("bool", (2, 3), (2, 3), "bool", (3,), "bool", "bool"),
    ("bf16", (37,), (37,), "bf16", (1,), "bf16", "bf16"),
    ("f16", (1, 7), (3, 1), "f16", (3, 7), "f16", "f16"),
]


@pytest.mark.parametrize("name,sc,sa,da,sb,db,dout", WHERE_CASES, ids=[c[0] for c in WHERE_CASES])
def test_where(rng, name, sc, sa, da, sb, db, dout):
    g = rlx.Graph("where")
    c = g.input("c", sc, "bool")
    a = g.input("a", sa, da)
    b = g.input("b", sb, db)
    w = g.where(c, a, b)
    assert str(w.dtype) == dout and w.shape == np.broadcast_shapes(sc, sa, sb)
    g.set_outputs([w])
    cv = rng.random(sc) < 0.5
    cv = np.asarray(cv)
    cv.flat[0] = True
    if cv.size > 1:
        cv.flat[1] = False
    av, bv = _small(rng, sa, da), _small(rng, sb, db)
    (r,) = run_graph(g, {"c": cv, "a": av, "b": bv})
    want = np.where(cv, _f64(av), _f64(bv))
    _check(r, want, dout, exact=True, what=name)


def test_where_with_scalars(rng):
    g = rlx.Graph("where_s")
    c = g.input("c", (3, 4), "bool")
    x = g.input("x", (4,), "f16")
    i = g.input("i", (3, 1), "i32")
    outs = [g.where(c, x, 0.0), g.where(c, 1, 0), g.where(c, i, 2.5), g.where(c, 2, x),
            g.where(c, c, False)]
    assert [str(o.dtype) for o in outs] == ["f16", "i64", "f32", "f16", "bool"]
    g.set_outputs(outs)
    cv = rng.random((3, 4)) < 0.5
    cv[0, 0], cv[0, 1] = True, False
    xv = _small(rng, (4,), "f16")
    iv = _rand(rng, (3, 1), "i32", -9, 9)
    res = run_graph(g, {"c": cv, "x": xv, "i": iv})
    wants = [np.where(cv, _f64(xv), 0.0), np.where(cv, 1, 0), np.where(cv, _f64(iv), 2.5),
             np.where(cv, 2.0, _f64(xv)), cv]
    for r, want, d in zip(res, wants, ["f16", "i64", "f32", "f16", "bool"]):
        _check(r, want, d, exact=True, what=f"where -> {d}")


def test_zero_size_and_rank0():
    """Empty tensors launch nothing and come back empty; rank-0 tensors work like scalars."""
    g = rlx.Graph("edge")
    x = g.input("x", (0, 3), "f32")
    y = g.input("y", (3,), "i32")
    s = g.input("s", (), "f16")
    outs = [x + y, g.exp(x), x < y, g.where(x < 0.0, x, y), s * s + 1, g.neg(s)]
    assert [o.shape for o in outs] == [(0, 3)] * 4 + [(), ()]
    g.set_outputs(outs)
    res = run_graph(g, {"x": np.zeros((0, 3), np.float32), "y": np.arange(1, 4, dtype=np.int32),
                        "s": np.array(-1.5, np.float16)})
    for r, d in zip(res[:4], ["f32", "f32", "bool", "f32"]):
        assert r.shape == (0, 3) and r.dtype == np.dtype(HOST[d])
    assert res[4].shape == () and res[4].dtype == np.float16 and res[4] == 3.25
    assert res[5] == 1.5
