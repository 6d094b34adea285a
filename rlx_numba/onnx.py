"""ONNX models on rlx_numba: ``rlx.onnx.load(path_or_model)`` -> an OnnxModel.

Each ONNX node is converted by one function of the ``CONVERTERS`` table onto the graph
builder (ir/). Shapes are static per compile, so a model is converted once per set of input
shapes (symbolic dims bind on the first run with those shapes), and every node whose inputs are
all known at convert time (initializers, Constant, Shape of a tensor, ...) is folded with NumPy
(onnx's reference implementation of that one node): shape arithmetic never reaches the device.

The ``onnx`` package is an extra (``pip install 'rlx_numba[onnx]'``): it is imported on use.
"""
from __future__ import annotations

import math

import numpy as np

from .ir import dtypes as dt
from .ir.ops_lowp import FP8_MAX

MIN_OPSET = 13

# ONNX TensorProto data type -> rlx dtype name (the others have no rlx dtype)
_ONNX_DTYPES = {1: "f32", 2: "u8", 3: "i8", 5: "i16", 6: "i32", 7: "i64", 9: "bool", 10: "f16",
                11: "f64", 16: "bf16", 17: "f8e4m3", 19: "f8e5m2"}
_ONNX_TYPE_NAMES = {0: "UNDEFINED", 1: "FLOAT", 2: "UINT8", 3: "INT8", 4: "UINT16", 5: "INT16",
                    6: "INT32", 7: "INT64", 8: "STRING", 9: "BOOL", 10: "FLOAT16",
                    11: "DOUBLE", 12: "UINT32", 13: "UINT64", 14: "COMPLEX64",
                    15: "COMPLEX128", 16: "BFLOAT16", 17: "FLOAT8E4M3FN", 18: "FLOAT8E4M3FNUZ",
                    19: "FLOAT8E5M2", 20: "FLOAT8E5M2FNUZ", 21: "UINT4", 22: "INT4",
                    23: "FLOAT4E2M1"}


def _onnx():
    try:
        import onnx
    except ImportError as e:    # an extra, never a hard dependency
        raise ImportError("rlx_numba.onnx needs the onnx package: pip install "
                          "'rlx_numba[onnx]' (or pip install onnx)") from e
    return onnx


def _dtype_of(elem_type: int, what: str):
    name = _ONNX_DTYPES.get(elem_type)
    if name is None:
        raise NotImplementedError(f"{what} has ONNX type {_onnx_type_name(elem_type)}"
                                  f", which rlx.onnx does not take (it takes "
                                  f"{', '.join(_ONNX_DTYPES.values())})")
    return dt.dtype(name)


class ConvertError(ValueError):
    """A node that cannot be converted as given (an attribute value, a shape, a runtime input
    where a constant is needed): the message names the node, op, attribute and shapes."""


class _NeedValue(Exception):
    """A run() input whose value a shape / axes / pads slot needs: the model is converted
    again with that input's value known (and recompiled when the value changes)."""

    def __init__(self, names):
        super().__init__(sorted(names))
        self.names = set(names)


class _Ctx:
    """What a converter sees: the graph, the node, and helpers to read its attributes and turn
    values into Tensors. A value is a NumPy array (known now) or a Tensor (computed on the
    device)."""

    def __init__(self, conv, node, ins):
        self.conv, self.g, self.node, self.ins = conv, conv.g, node, ins
        self.attrs = {a.name: a for a in node.attribute}
        self.used = set()

    # ---- messages ----
    def where(self) -> str:
        shapes = ", ".join("-" if v is None else _fmt(v) for v in self.ins)
        return f"node {self.node.name or '?'!r} ({self.node.op_type}; inputs {shapes})"

    def fail(self, msg: str):
        raise ConvertError(f"{self.where()}: {msg}")

    def refuse(self, attr, value, why=""):
        self.fail(f"attribute {attr}={value!r} is not supported{': ' + why if why else ''}")

    # ---- attributes ----
    def attr(self, name, default=None):
        a = self.attrs.get(name)
        self.used.add(name)
        if a is None:
            return default
        onnx = _onnx()
        v = onnx.helper.get_attribute_value(a)
        if isinstance(v, bytes):
            v = v.decode()
        elif isinstance(v, list) and v and isinstance(v[0], bytes):
            v = [s.decode() for s in v]
        elif isinstance(v, onnx.TensorProto):
            v = onnx.numpy_helper.to_array(v)
        return v

    # ---- inputs ----
    def n(self):
        return len(self.ins)

    def opt(self, i):
        return self.ins[i] if i < len(self.ins) else None

    def const(self, i, what, default=None):
        """Input i as a NumPy array, which it must be (a shape, axes, pads, ...)."""
        v = self.opt(i)
        if v is None:
            return default
        if not isinstance(v, np.ndarray):
            feeds = self.conv.input_ancestors(v)
            if feeds:      # a run() input: the model is then specialised on its value
                raise _NeedValue(feeds)
            self.fail(f"input {i} ({what}) must be known when the model is converted (an "
                      f"initializer, Constant or shape arithmetic), not computed at run time")
        return v

    def t(self, i):
        """Input i as a Tensor."""
        return self.conv.tensor(self.ins[i])


def _fmt(v) -> str:
    if isinstance(v, np.ndarray):
        return f"const {v.dtype}[{', '.join(map(str, v.shape))}]"
    return f"{v.dtype.name}[{', '.join(map(str, v.shape))}]"


# ---------------------------------------------------------------------------------------------
# converters: f(c: _Ctx) -> list of output values (or one value)
# ---------------------------------------------------------------------------------------------
CONVERTERS: dict = {}


def conv(*names):
    def deco(f):
        for n in names:
            CONVERTERS[n] = f
        return f
    return deco


def _f(c, x):
    """x as a float Tensor (f32 when integer)."""
    return x if x.dtype.is_float else c.g.cast(x, dt.F32)


def _f32(c, x):
    return x if x.dtype == dt.F32 else c.g.cast(x, dt.F32)


def _like(c, y, x):
    """y cast back to x's dtype."""
    return y if y.dtype == x.dtype else c.g.cast(y, x.dtype)


_UNARY = {"Abs": "abs", "Neg": "neg", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Sin": "sin",
          "Cos": "cos", "Tan": "tan", "Atan": "atan", "Tanh": "tanh", "Sigmoid": "sigmoid",
          "Relu": "relu", "Round": "round"}


@conv(*_UNARY)
def _unary(c):
    x = c.t(0)
    return _like(c, c.g.activation(_UNARY[c.node.op_type], x), x)


def _float_unary(fn):
    def f(c):
        x = c.t(0)
        if not x.dtype.is_float:
            c.fail(f"needs a float input, got {x.dtype}")
        return _like(c, fn(c, c.g, _f(c, x)), x)
    return f


def _erf(c, g, x):
    # erf from the exact gelu: gelu(y) = y/2 (1 + erf(y / sqrt 2)), with y = x sqrt 2
    y = x * math.sqrt(2.0)
    safe = g.where(g.eq(y, 0.0), 1.0, y)
    return g.where(g.eq(y, 0.0), 0.0, g.gelu(safe) * 2.0 / safe - 1.0)


def _floor(c, g, x):
    # truncation (cast) corrected by one below zero; |x| >= 2**23 is already an integer
    t = g.cast(g.cast(x, dt.I64), x.dtype)
    fl = g.where(g.gt(t, x), t - 1.0, t)
    return g.where(g.ge(g.abs(x), 2.0 ** 23), x, fl)


def _ceil(c, g, x):
    return -_floor(c, g, -x)


def _softplus(c, g, x):
    # log(1 + e^x) without overflow: max(x, 0) + log(1 + e^-|x|)
    return g.relu(x) + g.log(g.exp(-g.abs(x)) + 1.0)


_FLOAT_UNARY = {
    "Reciprocal": lambda c, g, x: 1.0 / x,
    "Floor": _floor, "Ceil": _ceil, "Erf": _erf, "Softplus": _softplus,
    "Softsign": lambda c, g, x: x / (g.abs(x) + 1.0),
    "Sinh": lambda c, g, x: (g.exp(x) - g.exp(-x)) * 0.5,
    "Cosh": lambda c, g, x: (g.exp(x) + g.exp(-x)) * 0.5,
    "Asin": lambda c, g, x: g.atan(x * g.rsqrt(1.0 - x * x)),
    "Acos": lambda c, g, x: math.pi / 2 - g.atan(x * g.rsqrt(1.0 - x * x)),
    "Asinh": lambda c, g, x: g.log(x + g.sqrt(x * x + 1.0)),
    "Acosh": lambda c, g, x: g.log(x + g.sqrt(x * x - 1.0)),
    "Atanh": lambda c, g, x: g.log((1.0 + x) / (1.0 - x)) * 0.5,
    "Mish": lambda c, g, x: x * g.tanh(_softplus(c, g, x)),
}
for _k, _fn in _FLOAT_UNARY.items():
    CONVERTERS[_k] = _float_unary(_fn)


@conv("Sign")
def _sign(c):
    x, g = c.t(0), c.g
    return _like(c, g.cast(g.gt(x, 0), dt.I32) - g.cast(g.lt(x, 0), dt.I32), x)


@conv("IsNaN")
def _isnan(c):
    x = c.t(0)
    return c.g.ne(x, x)


@conv("IsInf")
def _isinf(c):
    x, g = _f(c, c.t(0)), c.g
    pos, neg = c.attr("detect_positive", 1), c.attr("detect_negative", 1)
    p, n = g.eq(x, float("inf")), g.eq(x, float("-inf"))
    if pos and neg:
        return g.max(p, n)
    return p if pos else n if neg else g.lt(x, x)      # (neither: all False)


@conv("Not")
def _not(c):
    return c.g.eq(c.t(0), c.g.constant(np.array(False)))


@conv("Identity")
def _identity(c):
    return c.ins[0]


def _alpha_act(fn, defaults):
    def f(c):
        x = c.t(0)
        if not x.dtype.is_float:
            c.fail(f"needs a float input, got {x.dtype}")
        vals = [float(c.attr(k, d)) for k, d in defaults]
        return _like(c, fn(c.g, _f(c, x), *vals), x)
    return f


CONVERTERS.update({
    "Elu": _alpha_act(lambda g, x, a: g.where(g.gt(x, 0.0), x, (g.exp(x) - 1.0) * a),
                      [("alpha", 1.0)]),
    "Selu": _alpha_act(lambda g, x, a, s: g.where(g.gt(x, 0.0), x * s, (g.exp(x) - 1.0) * (a * s)),
                       [("alpha", 1.67326319217681884765625),
                        ("gamma", 1.05070102214813232421875)]),
    "Celu": _alpha_act(lambda g, x, a: g.relu(x) + g.min(g.exp(x / a) - 1.0, 0.0) * a,
                       [("alpha", 1.0)]),
    "LeakyRelu": _alpha_act(lambda g, x, a: g.where(g.lt(x, 0.0), x * a, x), [("alpha", 0.01)]),
    "ThresholdedRelu": _alpha_act(lambda g, x, a: g.where(g.gt(x, a), x, 0.0), [("alpha", 1.0)]),
    "HardSigmoid": _alpha_act(lambda g, x, a, b: g.max(g.min(x * a + b, 1.0), 0.0),
                              [("alpha", 0.2), ("beta", 0.5)]),
    "HardSwish": _alpha_act(lambda g, x: x * g.max(g.min(x * (1 / 6) + 0.5, 1.0), 0.0), []),
    "Shrink": _alpha_act(lambda g, x, lam, b: g.where(g.lt(x, -lam), x + b,
                                                      g.where(g.gt(x, lam), x - b, x * 0.0)),
                         [("lambd", 0.5), ("bias", 0.0)]),
})


@conv("Swish", "SwiGLU")
def _swish(c):
    x = c.t(0)
    if not x.dtype.is_float:
        c.fail(f"needs a float input, got {x.dtype}")
    a = float(c.attr("alpha", 1.0))
    xf = _f32(c, x)
    y = xf * c.g.sigmoid(xf * a)
    if c.node.op_type == "SwiGLU":
        b = c.t(1)
        if b.shape != x.shape:
            c.fail(f"A {list(x.shape)} and B {list(b.shape)} must have one shape")
        y = y * _f32(c, b)
    return _like(c, y, x)


@conv("Det")
def _det(c):
    x = c.t(0)
    return _like(c, c.g.det(_f32(c, x)), x)


@conv("LRN")
def _lrn(c):
    """x / (bias + alpha / size * sum of x^2 over a band of channels)^beta: the band sum is a
    product with a constant [C, C] band matrix."""
    x, g = c.t(0), c.g
    size = int(c.attr("size"))
    alpha, beta, bias = (float(c.attr(k, d)) for k, d in (("alpha", 1e-4), ("beta", 0.75),
                                                          ("bias", 1.0)))
    ch = x.shape[1]
    lo, hi = (size - 1) // 2, -(-(size - 1) // 2)
    band = np.array([[1.0 if i - lo <= j <= i + hi else 0.0 for i in range(ch)]
                     for j in range(ch)], np.float32)    # band[j, i]: channel j feeds i
    xf = _f32(c, x)
    r = len(x.shape)
    perm = (0,) + tuple(range(2, r)) + (1,)
    sq = g.transpose(xf * xf, perm)
    ssum = g.transpose(g.matmul(sq, g.constant(band)), np.argsort(perm).tolist())
    return _like(c, xf / g.pow(ssum * (alpha / size) + bias, beta), x)


@conv("CenterCropPad")
def _center_crop_pad(c):
    x, g = c.t(0), c.g
    shape = [int(v) for v in c.const(1, "shape")]
    r = len(x.shape)
    axes = c.attr("axes")
    axes = list(range(r)) if axes is None else [int(a) % r for a in axes]
    y = x
    for a, want in zip(axes, shape):
        n = y.shape[a]
        if want < n:           # crop: the window's start rounded down
            y = g.narrow(y, a, (n - want) // 2, want)
        elif want > n:         # pad with zeros, the extra one at the end
            lo = (want - n) // 2
            zl = np.zeros(tuple(lo if k == a else s for k, s in enumerate(y.shape)),
                          y.dtype.host if y.dtype != dt.BF16 else np.float32)
            zh = np.zeros(tuple(want - n - lo if k == a else s for k, s in enumerate(y.shape)),
                          zl.dtype)
            parts = [p for p in (g.cast(g.constant(zl), y.dtype) if zl.size or True else None,
                                 y, g.cast(g.constant(zh), y.dtype)) if p.shape[a] > 0]
            y = g.concat(parts, a)
    return y


@conv("Gelu")
def _gelu(c):
    x = c.t(0)
    a = c.attr("approximate", "none")
    if a not in ("none", "tanh"):
        c.refuse("approximate", a, "expected 'none' or 'tanh'")
    return _like(c, c.g.activation("gelu" if a == "none" else "gelu_tanh", _f(c, x)), x)


@conv("PRelu")
def _prelu(c):
    x, s = c.t(0), c.t(1)
    return c.g.where(c.g.lt(x, 0), x * s, x)


@conv("Clip")
def _clip(c):
    x = c.t(0)
    lo, hi = c.opt(1), c.opt(2)
    if lo is not None:
        x = c.g.max(x, c.conv.tensor(lo))
    if hi is not None:
        x = c.g.min(x, c.conv.tensor(hi))
    return x


_BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Pow": "pow"}


@conv(*_BINARY)
def _binary(c):
    a, b = c.t(0), c.t(1)
    y = c.g.binary(_BINARY[c.node.op_type], a, b)
    return _like(c, y, a)     # ONNX keeps the first operand's type (Pow's exponent may differ)


@conv("Div")
def _div(c):
    a, b = c.t(0), c.t(1)
    y = c.g.div(a, b)
    if a.dtype.is_int:       # integer division truncates (the cast does)
        return c.g.cast(y, a.dtype)
    return _like(c, y, a)


@conv("Mod")
def _mod(c):
    a, b, g = c.t(0), c.t(1), c.g
    fmod = c.attr("fmod", 0)
    af, bf = _f(c, a), _f(c, b)
    q = af / bf
    q = _floor(c, g, q) if not fmod else g.cast(g.cast(q, dt.I64), q.dtype)
    if a.dtype.is_int:
        return a - g.cast(q, a.dtype) * b
    return _like(c, af - q * bf, a)


@conv("Max", "Min", "Sum", "Mean")
def _variadic(c):
    op = c.node.op_type
    xs = [c.t(i) for i in range(c.n())]
    kind = {"Max": "max", "Min": "min", "Sum": "add", "Mean": "add"}[op]
    y = xs[0]
    for x in xs[1:]:
        y = c.g.binary(kind, y, x)
    if op == "Mean":
        y = y / float(len(xs))
    return _like(c, y, xs[0])


_COMPARE = {"Equal": "eq", "Less": "lt", "Greater": "gt", "LessOrEqual": "le",
            "GreaterOrEqual": "ge"}


@conv(*_COMPARE)
def _compare(c):
    return c.g.compare(_COMPARE[c.node.op_type], c.t(0), c.t(1))


@conv("And", "Or", "Xor")
def _logic(c):
    a, b, g = c.t(0), c.t(1), c.g
    op = c.node.op_type
    return g.min(a, b) if op == "And" else g.max(a, b) if op == "Or" else g.ne(a, b)


@conv("BitShift")
def _bitshift(c):
    x, s = c.t(0), c.t(1)
    if not x.dtype.is_int:
        c.fail(f"needs integer inputs, got {x.dtype}")
    d = c.attr("direction")
    # x * 2**s or x // 2**s (unsigned in ONNX: u8 only here)
    p = c.g.cast(c.g.pow(c.g.constant(np.array(2.0, np.float32)), c.g.cast(s, dt.F32)), dt.I64)
    xi = c.g.cast(x, dt.I64)
    if d == "LEFT":
        y = xi * p
        y = y - c.g.cast(c.g.cast(y / 256.0, dt.I64), dt.I64) * 256 if x.dtype == dt.U8 else y
    elif d == "RIGHT":           # arithmetic shift: floor division
        y = c.g.cast(_floor(c, c.g, c.g.cast(xi, dt.F32) / c.g.cast(p, dt.F32)), dt.I64)
    else:
        c.refuse("direction", d, "expected LEFT or RIGHT")
    return c.g.cast(y, x.dtype)


@conv("Where")
def _where(c):
    return c.g.where(c.t(0), c.t(1), c.t(2))


def _cast_to(c, x, to):
    """Cast with ONNX's ``saturate`` (float8 targets only; default 1): out-of-range values and
    +-inf clamp to the format's largest finite value first (NaN stays NaN); saturate=0 is the
    plain cast (e4m3fn: NaN, e5m2: inf), as torch's .to."""
    sat = c.attr("saturate", 1)
    if to in FP8_MAX and sat:
        top = FP8_MAX[to]
        x = c.g.binary("min", c.g.binary("max", _f32(c, x), -top), top)
    return c.g.cast(x, to)


@conv("Cast")
def _cast(c):
    return _cast_to(c, c.t(0), _dtype_of(c.attr("to"), f"{c.where()}: attribute to"))


@conv("CastLike")
def _castlike(c):
    return _cast_to(c, c.t(0), c.conv.dtype_of_value(c.ins[1]))


# ---- quantisation (ONNX QuantizeLinear / DequantizeLinear / MatMulInteger) --------------------
def _quant_axis(c, x, scale):
    """The axis of a per-channel scale ([C], C > 1), else None (per tensor); blocked
    quantisation (block_size) is refused."""
    axis, block = c.attr("axis", 1), c.attr("block_size", 0)
    if block:
        c.refuse("block_size", block, "blocked quantisation is not in g.quantize / "
                 "g.dequantize_linear (per tensor or per axis only)")
    if len(scale.shape) == 1 and scale.shape[0] > 1:
        return axis % len(x.shape)
    return None


@conv("QuantizeLinear")
def _quantize_linear(c):
    x, scale = c.t(0), c.t(1)
    zp = c.t(2) if c.opt(2) is not None else None
    axis = _quant_axis(c, x, scale)
    if not c.attr("saturate", 1):
        c.refuse("saturate", 0, "g.quantize saturates float8 (ONNX's default)")
    if c.attr("precision", 0):
        c.refuse("precision", c.attr("precision"), "the division runs in f32")
    out = c.attr("output_dtype", 0)
    dtype = _dtype_of(out, f"{c.where()}: attribute output_dtype") if out else None
    return c.g.quantize(x, scale, zp, axis=axis, dtype=dtype)


@conv("DequantizeLinear")
def _dequantize_linear(c):
    q, scale = c.t(0), c.t(1)
    zp = c.t(2) if c.opt(2) is not None else None
    axis = _quant_axis(c, q, scale)
    y = c.g.dequantize_linear(q, scale, zp, axis=axis)     # f32
    out = c.attr("output_dtype", 0)
    to = _dtype_of(out, f"{c.where()}: attribute output_dtype") if out else scale.dtype
    return y if to == y.dtype else c.g.cast(y, to)


@conv("MatMulInteger")
def _matmul_integer(c):
    """i8 / u8 products, exact i32: g.qmatmul, its zero points known at load (a run() input
    there specialises the model on its value). A u8 b moves to i8 by - 128, its zero point
    with it (the same differences b - b_zero)."""
    a, b, g = c.t(0), c.t(1), c.g
    if len(a.shape) != 2 or len(b.shape) != 2:
        c.fail("MatMulInteger: only 2-D A and B map onto g.qmatmul")
    zs = []
    for i, what in ((2, "a_zero_point"), (3, "b_zero_point")):
        z = c.const(i, what, np.zeros((), np.int64))
        if z.size != 1:
            c.fail(f"{what} must be one value (per-row / per-column zero points are not in "
                   f"g.qmatmul), got shape {list(z.shape)}")
        zs.append(int(z.reshape(-1)[0]))
    if b.dtype == dt.U8:
        b = g.cast(g.cast(b, dt.I32) - 128, dt.I8)
        zs[1] -= 128
    return g.qmatmul(a, b, a_zero=zs[0], b_zero=zs[1])


# ---- products --------------------------------------------------------------------------------
@conv("MatMul")
def _matmul(c):
    a, b, g = c.t(0), c.t(1), c.g
    va, vb = len(a.shape) == 1, len(b.shape) == 1
    if va:
        a = g.reshape(a, (1,) + a.shape)
    if vb:
        b = g.reshape(b, b.shape + (1,))
    y = g.matmul(a, b)
    if vb:
        y = g.reshape(y, y.shape[:-1])
    if va:
        y = g.reshape(y, y.shape[:-1] if vb else y.shape[:-2] + y.shape[-1:])
    return y


@conv("Gemm")
def _gemm(c):
    g = c.g
    a, b = c.t(0), c.t(1)
    alpha, beta = float(c.attr("alpha", 1.0)), float(c.attr("beta", 1.0))
    if c.attr("transA", 0):
        a = g.transpose(a, (1, 0))
    if c.attr("transB", 0):
        b = g.transpose(b, (1, 0))
    y = g.matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c.opt(2) is not None:
        cc = c.t(2)
        y = y + (cc * beta if beta != 1.0 else cc)
    return y


@conv("Einsum")
def _einsum(c):
    eq = c.attr("equation").replace(" ", "")
    xs = [c.t(i) for i in range(c.n())]
    if "..." in eq:
        c.refuse("equation", eq, "an ellipsis '...' is not supported")
    if "->" not in eq:     # implicit form: the letters seen once, in alphabetical order
        letters = eq.replace(",", "")
        eq = eq + "->" + "".join(sorted(ch for ch in set(letters) if letters.count(ch) == 1))
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    # a letter repeated inside one operand (a diagonal): the IR's einsum has none
    for t in terms:
        if len(set(t)) != len(t):
            c.refuse("equation", eq, f"operand {t!r} repeats a letter (a diagonal)")
    return c.g.einsum(f"{lhs}->{out}", *xs)


# ---- rows and normalisations -----------------------------------------------------------------
@conv("Softmax", "LogSoftmax")
def _softmax(c):
    x = c.t(0)
    axis = c.attr("axis", -1)
    f = c.g.softmax if c.node.op_type == "Softmax" else c.g.log_softmax
    return f(x, axis)


@conv("Hardmax")
def _hardmax(c):
    x, g = c.t(0), c.g
    axis = c.attr("axis", -1) % len(x.shape)
    i = g.argmax(x, axis, keep_dim=True)
    iota = np.arange(x.shape[axis]).reshape([-1 if k == axis else 1 for k in range(len(x.shape))])
    return g.cast(g.eq(i, g.constant(iota.astype(np.int64))), x.dtype)


def _row_norm(c, kind, x, axis, eps):
    """The IR's one-kernel layer_norm / rms_norm when the node fits it (the last axis alone,
    scale and bias [n] of x's float dtype, no Mean / InvStdDev output asked for), else None."""
    scale, bias = c.t(1), (c.t(2) if c.opt(2) is not None else None)
    n = x.shape[-1] if x.shape else 0
    if (axis != len(x.shape) - 1 or x.dtype not in (dt.F32, dt.F16, dt.BF16) or
            any(o for o in c.node.output[1:]) or
            any(t is not None and (t.dtype != x.dtype or tuple(t.shape) != (n,))
                for t in (scale, bias))):
        return None
    return getattr(c.g, kind)(x, scale, bias, axis=-1, eps=eps)


@conv("LayerNormalization")
def _layernorm(c):
    x, g = c.t(0), c.g
    axis = c.attr("axis", -1) % len(x.shape)
    eps = float(c.attr("epsilon", 1e-5))
    c.attr("stash_type")       # stats in f32 either way
    y = _row_norm(c, "layer_norm", x, axis, eps)
    if y is not None:
        return y
    axes = tuple(range(axis, len(x.shape)))
    xf = _f(c, x)
    mean = g.mean(xf, axes, keep_dim=True)
    d = xf - mean
    inv = g.rsqrt(g.mean(d * d, axes, keep_dim=True) + eps)
    y = d * inv * _f(c, c.t(1))
    if c.opt(2) is not None:
        y = y + _f(c, c.t(2))
    return [_like(c, y, x), mean, inv]    # Mean and InvStdDev in f32 (stash_type 1)


@conv("RMSNormalization")
def _rmsnorm(c):
    x, g = c.t(0), c.g
    axis = c.attr("axis", -1) % len(x.shape)
    eps = float(c.attr("epsilon", 1e-5))
    c.attr("stash_type")
    y = _row_norm(c, "rms_norm", x, axis, eps)
    if y is not None:
        return y
    axes = tuple(range(axis, len(x.shape)))
    xf = _f(c, x)
    y = xf * g.rsqrt(g.mean(xf * xf, axes, keep_dim=True) + eps) * _f(c, c.t(1))
    return _like(c, y, x)


@conv("BatchNormalization")
def _batchnorm(c):
    x, g = c.t(0), c.g
    eps = float(c.attr("epsilon", 1e-5))
    mom = float(c.attr("momentum", 0.9))
    shape = (1, -1) + (1,) * (len(x.shape) - 2)
    if c.attr("training_mode", 0):   # batch statistics; running ones updated by momentum
        axes = (0,) + tuple(range(2, len(x.shape)))
        xf = _f(c, x)
        mean = g.mean(xf, axes, keep_dim=True)
        var = g.mean((xf - mean) * (xf - mean), axes, keep_dim=True)
        sc, b = (g.reshape(_f(c, c.t(i)), shape) for i in (1, 2))
        y = (xf - mean) * g.rsqrt(var + eps) * sc + b
        rm = _f(c, c.t(3)) * mom + g.reshape(mean, (-1,)) * (1 - mom)
        rv = _f(c, c.t(4)) * mom + g.reshape(var, (-1,)) * (1 - mom)
        return [_like(c, y, x), _like(c, rm, c.t(3)), _like(c, rv, c.t(4))]
    if len([o for o in c.node.output if o]) > 1:
        c.fail("running mean / var outputs need training_mode=1")
    sc, b, m, v = (g.reshape(_f(c, c.t(i)), shape) for i in (1, 2, 3, 4))
    y = (_f(c, x) - m) * g.rsqrt(v + eps) * sc + b
    return _like(c, y, x)


def _norm_over(c, x, axes, eps):
    g = c.g
    mean = g.mean(x, axes, keep_dim=True)
    d = x - mean
    return d * g.rsqrt(g.mean(d * d, axes, keep_dim=True) + eps)


@conv("InstanceNormalization")
def _instnorm(c):
    x, g = c.t(0), c.g
    eps = float(c.attr("epsilon", 1e-5))
    shape = (1, -1) + (1,) * (len(x.shape) - 2)
    y = _norm_over(c, _f(c, x), tuple(range(2, len(x.shape))), eps)
    y = y * g.reshape(_f(c, c.t(1)), shape) + g.reshape(_f(c, c.t(2)), shape)
    return _like(c, y, x)


@conv("GroupNormalization")
def _groupnorm(c):
    x, g = c.t(0), c.g
    eps = float(c.attr("epsilon", 1e-5))
    c.attr("stash_type")
    ng = int(c.attr("num_groups"))
    n, ch = x.shape[:2]
    if ch % ng:
        c.refuse("num_groups", ng, f"the {ch} channels do not divide into groups")
    xf = g.reshape(_f(c, x), (n, ng, -1))
    y = g.reshape(_norm_over(c, xf, (2,), eps), x.shape)
    sc, b = _f(c, c.t(1)), _f(c, c.t(2))
    if sc.shape[0] == ng and ng != ch:     # opset 18: scale and bias per group
        sc = g.reshape(g.expand(g.reshape(sc, (ng, 1)), (ng, ch // ng)), (ch,))
        b = g.reshape(g.expand(g.reshape(b, (ng, 1)), (ng, ch // ng)), (ch,))
    shape = (1, -1) + (1,) * (len(x.shape) - 2)
    return _like(c, y * g.reshape(sc, shape) + g.reshape(b, shape), x)


@conv("LpNormalization")
def _lpnorm(c):
    x, g = _f(c, c.t(0)), c.g
    axis, p = c.attr("axis", -1), c.attr("p", 2)
    if p == 2:
        n = g.sqrt(g.sum(x * x, axis, keep_dim=True))
    elif p == 1:
        n = g.sum(g.abs(x), axis, keep_dim=True)
    else:
        c.refuse("p", p, "expected 1 or 2")
    return _like(c, g.where(g.eq(n, 0.0), 0.0, x / n), c.t(0))


@conv("MeanVarianceNormalization")
def _mvn(c):
    x = c.t(0)
    axes = tuple(c.attr("axes", [0, 2, 3]))
    return _like(c, _mvn_exact(c, _f(c, x), axes), x)


def _mvn_exact(c, x, axes):
    g = c.g
    mean = g.mean(x, axes, keep_dim=True)
    var = g.mean(x * x, axes, keep_dim=True) - mean * mean
    return (x - mean) / (g.sqrt(var) + 1e-9)


# ---- reductions ------------------------------------------------------------------------------
def _reduce_axes(c, x):
    """The axes of a Reduce* node (attribute before opset 18 and for a few ops, input after);
    None for all."""
    axes = c.attr("axes")
    noop = c.attr("noop_with_empty_axes", 0)
    if axes is None and c.n() > 1 and c.opt(1) is not None:
        axes = c.const(1, "axes")
    if axes is None or len(axes) == 0:
        if noop:
            return ()
        return tuple(range(len(x.shape)))
    return tuple(int(a) % max(len(x.shape), 1) for a in np.asarray(axes).reshape(-1))


_REDUCE = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max", "ReduceMin": "min",
           "ReduceProd": "prod"}


@conv(*_REDUCE, "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare")
def _reduce(c):
    x, g, op = c.t(0), c.g, c.node.op_type
    axes = _reduce_axes(c, x)
    keep = bool(c.attr("keepdims", 1))
    if not axes:
        return x
    if any(x.shape[a] == 0 for a in axes):     # nothing to reduce: the identity, known now
        shape = tuple(1 if k in axes else s for k, s in enumerate(x.shape) if keep or k not in axes)
        host = x.dtype.host if x.dtype != dt.BF16 else np.float32
        if op in ("ReduceMax", "ReduceMin"):
            big = (np.iinfo(host).max if np.dtype(host).kind in "iu" else
                   True if host == np.bool_ else np.inf)
            ident = (big if op == "ReduceMin" else
                     (np.iinfo(host).min if np.dtype(host).kind in "iu" else
                      False if host == np.bool_ else -np.inf))
        else:
            ident = {"ReduceProd": 1, "ReduceLogSum": -np.inf,
                     "ReduceLogSumExp": -np.inf}.get(op, 0)
        return c.g.cast(c.g.constant(np.full(shape, ident, host)), x.dtype) \
            if x.dtype == dt.BF16 else np.full(shape, ident, host)
    if op in _REDUCE:
        return g.reduce(_REDUCE[op], x, axes, keep)
    xf = _f(c, x)
    if op == "ReduceL1":
        y = g.sum(g.abs(xf), axes, keep)
    elif op == "ReduceL2":
        y = g.sqrt(g.sum(xf * xf, axes, keep))
    elif op == "ReduceSumSquare":
        y = g.sum(xf * xf, axes, keep)
    elif op == "ReduceLogSum":
        y = g.log(g.sum(xf, axes, keep))
    else:    # log-sum-exp, shifted by the max
        m = g.reduce_max(xf, axes, True)
        m = g.where(g.ne(m, m * 0.0), 0.0, m)      # (an infinite max: no shift)
        y = g.log(g.sum(g.exp(xf - m), axes, True)) + m
        if not keep:
            y = g.reshape(y, tuple(s for k, s in enumerate(x.shape) if k not in axes))
    return _like(c, y, x)


@conv("ArgMax", "ArgMin")
def _argreduce(c):
    x, g = c.t(0), c.g
    axis = c.attr("axis", 0) % len(x.shape)
    keep = bool(c.attr("keepdims", 1))
    last = c.attr("select_last_index", 0)
    f = g.argmax if c.node.op_type == "ArgMax" else g.argmin
    if not last:
        return f(x, axis, keep)
    n = x.shape[axis]   # the last one: argmax of the reversed axis, mapped back
    rev = g.gather(x, g.constant(np.arange(n - 1, -1, -1, dtype=np.int64)), axis)
    return (n - 1) - f(rev, axis, keep)


@conv("CumSum")
def _cumsum(c):
    x, g = c.t(0), c.g
    axis = int(c.const(1, "axis").reshape(-1)[0]) % len(x.shape)
    excl, rev = bool(c.attr("exclusive", 0)), bool(c.attr("reverse", 0))
    if rev:
        idx = g.constant(np.arange(x.shape[axis] - 1, -1, -1, dtype=np.int64))
        x = g.gather(x, idx, axis)
    y = g.cumsum(x, axis, excl)
    if rev:
        y = g.gather(y, idx, axis)
    return y


@conv("CumProd")
def _cumprod(c):
    """A running product as log2(n) element-wise products with shifted copies (Hillis-Steele:
    step s multiplies in the value s places back, ones shifted in)."""
    x, g = c.t(0), c.g
    axis = int(c.const(1, "axis").reshape(-1)[0]) % len(x.shape)
    excl, rev = bool(c.attr("exclusive", 0)), bool(c.attr("reverse", 0))
    n = x.shape[axis]
    host = x.dtype.host if x.dtype != dt.BF16 else np.float32

    def shifted(t, s):        # t moved s places along the axis, ones in front
        ones = g.constant(np.ones(tuple(s if k == axis else d for k, d in enumerate(t.shape)),
                                  host))
        ones = ones if ones.dtype == t.dtype else g.cast(ones, t.dtype)
        return ones if s >= n else g.concat([ones, g.narrow(t, axis, 0, n - s)], axis)
    idx = g.constant(np.arange(n - 1, -1, -1, dtype=np.int64)) if rev else None
    y = g.gather(x, idx, axis) if rev else x
    if n == 0:
        return x
    if excl:
        y = shifted(y, 1)
    s = 1
    while s < n:
        y = y * shifted(y, s)
        s *= 2
    return g.gather(y, idx, axis) if rev else y


@conv("TopK")
def _topk(c):
    x, g = c.t(0), c.g
    k = int(c.const(1, "k").reshape(-1)[0])
    axis = c.attr("axis", -1) % len(x.shape)
    largest = c.attr("largest", 1)
    c.attr("sorted")     # sorted output is a valid unsorted one
    xf = x if x.dtype.is_float else g.cast(x, dt.F32)   # integers exact up to 2**24
    v, i = g.topk(xf if largest else -xf, k, axis)
    return [_like(c, v if largest else -v, x), i]


# ---- losses ----------------------------------------------------------------------------------
def _nll(c, logp, target, weight):
    """NegativeLogLikelihoodLoss on log-probabilities [N, C, *d] and targets [N, *d]."""
    g = c.g
    red = c.attr("reduction", "mean")
    if red not in ("none", "sum", "mean"):
        c.refuse("reduction", red, "expected none, sum or mean")
    ign = c.attr("ignore_index")
    t = g.cast(target, dt.I64)
    valid = None
    if ign is not None:
        valid = g.ne(t, int(ign))
        t = g.where(valid, t, 0)
    idx = g.reshape(t, (t.shape[0], 1) + tuple(t.shape[1:]))
    picked = g.reshape(g.gather(g.reshape(logp, (-1,)), _flat_index(c, logp, idx, 1), 0),
                       t.shape)
    w = g.gather(weight, t, 0) if weight is not None else None
    if valid is not None:
        vf = g.cast(valid, dt.F32)
        w = vf if w is None else w * vf
    loss = -picked if w is None else -picked * w
    if red == "none":
        return loss
    tot = g.sum(loss, None)
    if red == "sum":
        return tot
    if w is None:
        return tot / float(math.prod(t.shape))
    return tot / g.sum(w, None)


@conv("NegativeLogLikelihoodLoss")
def _nll_loss(c):
    x = c.t(0)
    w = _f32(c, c.t(2)) if c.opt(2) is not None else None
    return _like(c, _nll(c, _f32(c, x), c.t(1), w), x)


@conv("SoftmaxCrossEntropyLoss")
def _sce_loss(c):
    x = c.t(0)
    logp = c.g.log_softmax(_f32(c, x), 1)
    w = _f32(c, c.t(2)) if c.opt(2) is not None else None
    return [_like(c, _nll(c, logp, c.t(1), w), x), _like(c, logp, x)]


# ---- shape ops -------------------------------------------------------------------------------
@conv("Reshape")
def _reshape(c):
    x = c.t(0)
    shape = [int(s) for s in c.const(1, "shape")]
    if not c.attr("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return c.g.reshape(x, shape)


@conv("Flatten")
def _flatten(c):
    x = c.t(0)
    axis = c.attr("axis", 1)
    axis = axis + len(x.shape) if axis < 0 else axis
    return c.g.reshape(x, (math.prod(x.shape[:axis]), math.prod(x.shape[axis:])))


@conv("Transpose")
def _transpose(c):
    x = c.t(0)
    perm = c.attr("perm")
    return c.g.transpose(x, tuple(perm) if perm is not None else None)


@conv("Squeeze")
def _squeeze(c):
    x = c.t(0)
    axes = c.const(1, "axes")
    if axes is None:
        axes = c.attr("axes")
    axes = None if axes is None else np.asarray(axes).reshape(-1)
    r = len(x.shape)
    axes = ({int(a) % r for a in axes} if axes is not None else
            {i for i, s in enumerate(x.shape) if s == 1})
    for a in axes:
        if x.shape[a] != 1:
            c.fail(f"axis {a} has size {x.shape[a]}, not 1")
    return c.g.reshape(x, tuple(s for i, s in enumerate(x.shape) if i not in axes))


@conv("Unsqueeze")
def _unsqueeze(c):
    x = c.t(0)
    axes = c.const(1, "axes")
    axes = np.asarray(axes if axes is not None else c.attr("axes")).reshape(-1)
    r = len(x.shape) + len(axes)
    axes = sorted(int(a) % r for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return c.g.reshape(x, shape)


@conv("Concat")
def _concat(c):
    xs = [c.t(i) for i in range(c.n()) if c.ins[i] is not None]
    axis = c.attr("axis")
    xs = [x for x in xs if x.shape[axis] != 0] or xs[:1]
    return xs[0] if len(xs) == 1 else c.g.concat(xs, axis)


@conv("Split")
def _split(c):
    x = c.t(0)
    axis = c.attr("axis", 0) % len(x.shape)
    n_out = len(c.node.output)
    split = c.const(1, "split")
    if split is None:
        split = c.attr("split")
    if split is None:
        n = int(c.attr("num_outputs", n_out))
        size = -(-x.shape[axis] // n)
        split = [min(size, x.shape[axis] - k * size) for k in range(n)]
    outs, start = [], 0
    for s in split:
        s = int(s)
        outs.append(c.g.narrow(x, axis, start, s))
        start += s
    return outs


@conv("Slice")
def _slice(c):
    x, g = c.t(0), c.g
    starts, ends = c.const(1, "starts"), c.const(2, "ends")
    axes = c.const(3, "axes")
    steps = c.const(4, "steps")
    r = len(x.shape)
    axes = range(len(starts)) if axes is None else [int(a) % r for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    for a, s, e, st in zip(axes, starts, ends, steps):
        n = x.shape[a]
        clip = lambda v: int(max(min(v, 2**62), -2**62))    # noqa: E731  (INT64_MAX ends)
        idx = range(n)[slice(clip(s), clip(e), int(st))]
        if st == 1:
            x = g.narrow(x, a, idx.start if len(idx) else 0, len(idx))
        else:
            x = g.gather(x, g.constant(np.array(list(idx), np.int64)), a)
    return x


@conv("Gather")
def _gather(c):
    x = c.t(0)
    axis = c.attr("axis", 0) % len(x.shape)
    idx = c.ins[1]
    if isinstance(idx, np.ndarray):    # wrap negatives now: in-graph indices are clamped
        idx = np.where(idx < 0, idx + x.shape[axis], idx).astype(np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= x.shape[axis]):
            c.fail(f"indices must lie in [-{x.shape[axis]}, {x.shape[axis]}) along axis "
                   f"{axis}, got {c.ins[1].reshape(-1).tolist()}")
        if idx.ndim == 0 or (idx.ndim == 1 and idx.size and
                             (np.diff(idx) == 1).all()):
            # one index or a run of them (a packed QKV's q / k / v): a narrow, which is a view
            # when it is along the leading axes, where a gather always copies
            y = c.g.narrow(x, axis, int(idx.reshape(-1)[0]), max(idx.size, 1))
            return y if idx.ndim else c.g.reshape(y, x.shape[:axis] + x.shape[axis + 1:])
    return c.g.gather(x, c.conv.tensor(idx), axis)


def _flat_index(c, x, idx, axis):
    """Indices into x flattened for GatherElements / ScatterElements: idx along ``axis``, the
    other coordinates of each index element its own."""
    g = c.g
    shape = idx.shape
    strides = np.cumprod((list(x.shape[1:]) + [1])[::-1])[::-1]
    i = g.cast(idx, dt.I64)
    i = g.where(g.lt(i, 0), i + x.shape[axis], i)
    flat = i * int(strides[axis])
    for k in range(len(shape)):
        if k == axis:
            continue
        iota = np.arange(shape[k], dtype=np.int64).reshape(
            [-1 if j == k else 1 for j in range(len(shape))])
        flat = flat + g.constant(iota * int(strides[k]))
    return flat


@conv("ReverseSequence")
def _reverse_sequence(c):
    """Each batch row's first sequence_lens[b] steps reversed: a gather at indices computed on
    the device (t < len ? len - 1 - t : t)."""
    x, g = c.t(0), c.g
    lens = g.cast(c.t(1), dt.I64)
    ta, ba = c.attr("time_axis", 0), c.attr("batch_axis", 1)
    r = len(x.shape)
    tshape = [1] * r
    tshape[ta] = x.shape[ta]
    bshape = [1] * r
    bshape[ba] = x.shape[ba]
    t = g.constant(np.arange(x.shape[ta], dtype=np.int64).reshape(tshape))
    ln = g.reshape(lens, bshape)
    src = g.where(g.lt(t, ln), ln - 1 - t, t)
    idx = g.expand(src, x.shape)
    return g.gather(g.reshape(x, (-1,)), _flat_index(c, x, idx, ta), 0)


@conv("GatherElements")
def _gather_elements(c):
    x, idx, g = c.t(0), c.t(1), c.g
    axis = c.attr("axis", 0) % len(x.shape)
    flat = _flat_index(c, x, idx, axis)
    return g.gather(g.reshape(x, (-1,)), flat, 0)


@conv("GatherND")
def _gather_nd(c):
    x, idx, g = c.t(0), c.t(1), c.g
    if c.attr("batch_dims", 0):
        c.refuse("batch_dims", c.attr("batch_dims"), "only 0")
    k = idx.shape[-1]
    rest = x.shape[k:]
    strides = np.cumprod((list(x.shape[1:k]) + [1])[::-1])[::-1].astype(np.int64)
    i = g.cast(idx, dt.I64)
    i = g.where(g.lt(i, 0), i + g.constant(np.array(x.shape[:k], np.int64)), i)
    flat = g.sum(i * g.constant(strides), -1)
    t = g.reshape(x, (math.prod(x.shape[:k]),) + tuple(rest))
    return g.gather(t, flat, 0)


def _scatter_replace(c, x, flat_idx, upd):
    """x flattened with upd written at flat_idx (distinct indices), as out-of-place adds."""
    g = c.g
    xf = g.reshape(x, (-1,) + () if len(upd.shape) == len(flat_idx.shape) else (-1,))
    fi = g.reshape(flat_idx, (-1,))
    u = g.reshape(upd, (-1,))
    if x.dtype not in (dt.F32, dt.I32, dt.I64):
        c.fail(f"scatter needs f32, i32 or i64 data, got {x.dtype}")
    old = g.gather(xf, fi, 0)
    return g.reshape(g.scatter_add(xf, fi, u - old, 0), x.shape)


@conv("ScatterElements")
def _scatter_elements(c):
    x, idx, upd, g = c.t(0), c.t(1), c.t(2), c.g
    axis = c.attr("axis", 0) % len(x.shape)
    red = c.attr("reduction", "none")
    flat = _flat_index(c, x, idx, axis)
    if red == "none":
        return _scatter_replace(c, x, flat, upd)
    if red == "add":
        return g.reshape(g.scatter_add(g.reshape(x, (-1,)), g.reshape(flat, (-1,)),
                                       g.reshape(upd, (-1,)), 0), x.shape)
    c.refuse("reduction", red, "expected 'none' or 'add'")


@conv("ScatterND")
def _scatter_nd(c):
    x, idx, upd, g = c.t(0), c.t(1), c.t(2), c.g
    red = c.attr("reduction", "none")
    k = idx.shape[-1]
    rest = tuple(x.shape[k:])
    strides = np.cumprod((list(x.shape[1:k]) + [1])[::-1])[::-1].astype(np.int64)
    i = g.cast(idx, dt.I64)
    i = g.where(g.lt(i, 0), i + g.constant(np.array(x.shape[:k], np.int64)), i)
    rows = g.reshape(g.sum(i * g.constant(strides), -1), (-1,))
    t = g.reshape(x, (math.prod(x.shape[:k]),) + rest)
    u = g.reshape(upd, (-1,) + rest)
    if red == "add":
        return g.reshape(g.scatter_add(t, rows, u, 0), x.shape)
    if red != "none":
        c.refuse("reduction", red, "expected 'none' or 'add'")
    old = g.gather(t, rows, 0)
    return g.reshape(g.scatter_add(t, rows, u - old, 0), x.shape)


@conv("Expand")
def _expand(c):
    x = c.t(0)
    shape = [int(s) for s in c.const(1, "shape")]
    out = np.broadcast_shapes(tuple(x.shape), tuple(shape))
    if len(out) > len(x.shape):
        x = c.g.reshape(x, (1,) * (len(out) - len(x.shape)) + tuple(x.shape))
    return c.g.expand(x, out) if tuple(out) != tuple(x.shape) else x


@conv("Tile")
def _tile(c):
    x, g = c.t(0), c.g
    reps = [int(r) for r in c.const(1, "repeats")]
    inter = []
    for r, s in zip(reps, x.shape):
        inter += [1, s]
    big = []
    for r, s in zip(reps, x.shape):
        big += [r, s]
    y = g.expand(g.reshape(x, inter), big)
    return g.reshape(y, [r * s for r, s in zip(reps, x.shape)])


@conv("Pad")
def _pad(c):
    x, g = c.t(0), c.g
    mode = c.attr("mode", "constant")
    pads = [int(p) for p in c.const(1, "pads")]
    val = c.opt(2)
    axes = c.const(3, "axes")
    r = len(x.shape)
    axes = list(range(r)) if axes is None else [int(a) % r for a in axes]
    lo, hi = [0] * r, [0] * r
    for k, a in enumerate(axes):
        lo[a], hi[a] = pads[k], pads[k + len(axes)]
    if not any(lo + hi):
        return x
    fp = []                      # g.pad takes F.pad's order (last axis first)
    for a in range(r - 1, -1, -1):
        fp += [lo[a], hi[a]]
    if mode == "wrap":          # a gather along each padded axis, indices known now
        y = x
        for a in range(r):
            if lo[a] or hi[a]:
                n = x.shape[a]
                idx = np.arange(-lo[a], n + hi[a]) % n
                y = g.gather(y, g.constant(idx.astype(np.int64)), a)
        return y
    m = {"constant": "constant", "reflect": "reflect", "edge": "replicate"}.get(mode)
    if m is None:
        c.refuse("mode", mode, "expected constant, reflect, edge or wrap")
    xf = _f(c, x)                # g.pad is float; integers up to 2**24 round-trip exactly
    if m != "constant" or val is None or isinstance(val, np.ndarray):
        v = float(np.asarray(val).reshape(-1)[0]) if val is not None and np.asarray(val).size \
            else 0.0
        return _like(c, g.pad(xf, fp, m, v if m == "constant" else 0.0), x)
    # a value computed at run time: pad with 0, then put it where the padding is
    inside = g.pad(g.constant(np.ones(x.shape, np.float32)), fp, "constant", 0.0)
    y = g.where(g.gt(inside, 0.5), g.pad(xf, fp, "constant", 0.0),
                g.reshape(_f(c, c.t(2)), ()))
    return _like(c, y, x)


@conv("Range")
def _range(c):
    s, l, d = (c.const(i, n) for i, n in ((0, "start"), (1, "limit"), (2, "delta")))
    s, l, d = (np.asarray(v).reshape(-1)[0] for v in (s, l, d))
    return np.arange(s, l, d).astype(np.asarray(s).dtype)


@conv("Shape")
def _shape(c):
    v = c.ins[0]
    shape = np.array(v.shape, np.int64)
    start, end = c.attr("start", 0), c.attr("end")
    return shape[start:end]


@conv("Size")
def _size(c):
    return np.array(math.prod(c.ins[0].shape), np.int64)


@conv("Trilu")
def _trilu(c):
    x, g = c.t(0), c.g
    k = int(c.const(1, "k", np.array(0)).reshape(-1)[0])
    n, m = x.shape[-2:]
    ones = np.ones((n, m), bool)
    keep = np.triu(ones, k) if c.attr("upper", 1) else np.tril(ones, k)
    return g.where(g.constant(keep), x, g.constant(np.zeros((), x.dtype.host)))


@conv("OneHot")
def _onehot(c):
    idx, g = c.t(0), c.g
    depth = int(c.const(1, "depth").reshape(-1)[0])
    vals = c.t(2)
    axis = c.attr("axis", -1)
    r = len(idx.shape) + 1
    axis %= r
    i = _f(c, idx) if not idx.dtype.is_int else g.cast(idx, dt.I64)
    i = g.cast(i, dt.I64) if i.dtype.is_float else i
    i = g.where(g.lt(i, 0), i + depth, i)
    shape = list(idx.shape)
    shape.insert(axis, 1)
    i = g.reshape(i, shape)
    iota = np.arange(depth, dtype=np.int64).reshape([-1 if k == axis else 1 for k in range(r)])
    hit = g.eq(i, g.constant(iota))
    off, on = g.narrow(vals, 0, 0, 1), g.narrow(vals, 0, 1, 1)
    return g.where(hit, g.reshape(on, ()), g.reshape(off, ()))


@conv("DepthToSpace", "SpaceToDepth")
def _depth_space(c):
    x, g = c.t(0), c.g
    b = int(c.attr("blocksize"))
    n, ch, h, w = x.shape
    if c.node.op_type == "SpaceToDepth":
        mode = c.attr("mode", "DCR")
        y = g.reshape(x, (n, ch, h // b, b, w // b, b))
        if mode not in ("DCR", "CRD"):
            c.refuse("mode", mode, "expected DCR or CRD")
        y = g.transpose(y, (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4))
        return g.reshape(y, (n, ch * b * b, h // b, w // b))
    mode = c.attr("mode", "DCR")
    if mode == "DCR":
        y = g.transpose(g.reshape(x, (n, b, b, ch // (b * b), h, w)), (0, 3, 4, 1, 5, 2))
    elif mode == "CRD":
        y = g.transpose(g.reshape(x, (n, ch // (b * b), b, b, h, w)), (0, 1, 4, 2, 5, 3))
    else:
        c.refuse("mode", mode, "expected DCR or CRD")
    return g.reshape(y, (n, ch // (b * b), h * b, w * b))


@conv("Dropout")
def _dropout(c):
    x = c.ins[0]
    train = c.const(2, "training_mode")
    c.attr("seed")
    if train is not None and bool(train.reshape(-1)[0]):
        ratio = c.const(1, "ratio")
        if ratio is None or float(ratio.reshape(-1)[0]) != 0.0:
            c.fail("training_mode=True with a non-zero ratio (random) is not supported")
    outs = [x]
    if len(c.node.output) > 1 and c.node.output[1]:
        outs.append(np.ones(x.shape, bool) if isinstance(x, np.ndarray) else
                    c.g.expand(c.g.constant(np.array(True)), tuple(x.shape)) if x.shape else
                    c.g.constant(np.array(True)))
    return outs


@conv("EyeLike")
def _eyelike(c):
    x = c.ins[0]
    k = c.attr("k", 0)
    d = c.attr("dtype")
    host = _dtype_of(d, "EyeLike dtype").host if d is not None else c.conv.dtype_of_value(x).host
    return np.eye(x.shape[0], x.shape[1], k, dtype=host)


# ---- vision ----------------------------------------------------------------------------------
def _spatial_pads(c, x_spatial, k, stride, dil, transpose=False):
    """ONNX pads / auto_pad -> (lo, hi) per spatial dim."""
    d = len(k)
    ap = c.attr("auto_pad", "NOTSET")
    pads = c.attr("pads")
    if ap in ("NOTSET",):
        p = list(pads) if pads is not None else [0] * (2 * d)
        return p[:d], p[d:]
    if ap == "VALID":
        return [0] * d, [0] * d
    if ap in ("SAME_UPPER", "SAME_LOWER"):
        lo, hi = [], []
        for s, kk, st, dl in zip(x_spatial, k, stride, dil):
            out = -(-s // st)
            tot = max(0, (out - 1) * st + dl * (kk - 1) + 1 - s)
            small, big = tot // 2, tot - tot // 2
            lo.append(small if ap == "SAME_UPPER" else big)
            hi.append(big if ap == "SAME_UPPER" else small)
        return lo, hi
    c.refuse("auto_pad", ap)


def _pre_pad(c, x, lo, hi, value=0.0):
    """x padded on its spatial dims by (lo, hi) (for asymmetric pads the ops take as one)."""
    d = len(lo)
    fp = []
    for a in range(d - 1, -1, -1):
        fp += [lo[a], hi[a]]
    return c.g.pad(x, fp, "constant", value)


@conv("Conv")
def _conv(c):
    x, w, g = c.t(0), c.t(1), c.g
    d = len(w.shape) - 2
    k = tuple(c.attr("kernel_shape", w.shape[2:]))
    stride = tuple(c.attr("strides", [1] * d))
    dil = tuple(c.attr("dilations", [1] * d))
    groups = c.attr("group", 1)
    lo, hi = _spatial_pads(c, x.shape[2:], k, stride, dil)
    b = c.t(2) if c.opt(2) is not None else None
    if lo != hi:
        x = _pre_pad(c, x, lo, hi)
        lo = [0] * d
    return g.conv(x, w, b, stride=stride, padding=tuple(lo), dilation=dil, groups=groups)


@conv("ConvTranspose")
def _conv_transpose(c):
    """The full transposed convolution (output_padding as zero rows at the high end), then
    cropped by the pads (negative: zero-extended), then the bias: ONNX's output size rule for
    pads, auto_pad and output_shape."""
    x, w, g = c.t(0), c.t(1), c.g
    d = len(w.shape) - 2
    k = tuple(c.attr("kernel_shape", w.shape[2:]))
    if tuple(k) != tuple(w.shape[2:]):
        c.refuse("kernel_shape", list(k), f"the weight's kernel is {list(w.shape[2:])}")
    stride = tuple(c.attr("strides", [1] * d))
    dil = tuple(c.attr("dilations", [1] * d))
    groups = c.attr("group", 1)
    opad = list(c.attr("output_padding", [0] * d))
    oshape = c.attr("output_shape")
    ap = c.attr("auto_pad", "NOTSET")
    pads = c.attr("pads")
    full = [(s - 1) * st + dl * (kk - 1) + 1 + op
            for s, st, dl, kk, op in zip(x.shape[2:], stride, dil, k, opad)]
    if oshape is not None or ap in ("SAME_UPPER", "SAME_LOWER"):
        want = (list(oshape)[-d:] if oshape is not None else
                [s * st for s, st in zip(x.shape[2:], stride)])
        tot = [f - o for f, o in zip(full, want)]
        lo = [t // 2 if ap == "SAME_UPPER" else t - t // 2 for t in tot]
        hi = [t - l for t, l in zip(tot, lo)]
    elif ap == "VALID" or pads is None:
        lo, hi = [0] * d, [0] * d
    elif ap == "NOTSET":
        lo, hi = list(pads[:d]), list(pads[d:])
    else:
        c.refuse("auto_pad", ap)
    y = g.conv_transpose(x, w, None, stride=stride, dilation=dil, groups=groups)
    if any(opad):
        y = _pre_pad(c, y, [0] * d, opad)
    if any(v < 0 for v in lo + hi):        # an output larger than the full one: zeros
        y = _pre_pad(c, y, [max(-v, 0) for v in lo], [max(-v, 0) for v in hi])
        lo, hi = [max(v, 0) for v in lo], [max(v, 0) for v in hi]
    for a in range(d):
        n = y.shape[2 + a]
        if lo[a] or hi[a]:
            y = g.narrow(y, 2 + a, lo[a], n - lo[a] - hi[a])
    if c.opt(2) is not None:
        y = y + g.reshape(c.t(2), (1, -1) + (1,) * d)
    return y


@conv("MaxPool", "AveragePool", "LpPool")
def _pool(c):
    x, g = c.t(0), c.g
    op = c.node.op_type
    if len([o for o in c.node.output if o]) > 1:
        c.fail("the Indices output of MaxPool is not supported")
    k = tuple(c.attr("kernel_shape"))
    d = len(k)
    stride = tuple(c.attr("strides", [1] * d))
    dil = tuple(c.attr("dilations", [1] * d))
    ceil = bool(c.attr("ceil_mode", 0))
    if c.attr("storage_order", 0):
        c.refuse("storage_order", 1, "column-major indices")
    cip = bool(c.attr("count_include_pad", 0))
    lo, hi = _spatial_pads(c, x.shape[2:], k, stride, dil)
    span = [dl * (kk - 1) + 1 for dl, kk in zip(dil, k)]
    if op != "MaxPool" and any(v != 1 for v in dil):   # the IR's avg pool has no dilation
        p = c.attr("p", 2) if op == "LpPool" else 1
        xf = _f(c, x)
        xp = xf if op == "AveragePool" else g.abs(xf) if p == 1 else g.pow(g.abs(xf), float(p))
        tot, n_pad, n_real = _window_sum(c, xp, k, stride, dil, lo, hi, ceil)
        if op == "LpPool":
            return _like(c, tot if p == 1 else g.pow(tot, 1.0 / p), x)
        return _like(c, tot / g.constant(n_pad if cip else n_real), x)
    if op == "LpPool":
        p = c.attr("p", 2)
        xf = _f(c, x)
        xp = g.abs(xf) if p == 1 else g.pow(g.abs(xf), float(p))
        if lo != hi or any(2 * l > s for l, s in zip(lo, span)):
            xp = _pre_pad(c, xp, lo, hi)
            lo = [0] * d
        y = g.pool(xp, "avg", k, stride, tuple(lo), dilation=dil, ceil_mode=ceil,
                   count_include_pad=True) * float(math.prod(k))
        return _like(c, y if p == 1 else g.pow(y, 1.0 / p), x)
    kind = "max" if op == "MaxPool" else "avg"
    if not x.dtype.is_float:     # integer max pool in f32 (exact up to 2**24), cast back
        c.ins = [c.g.cast(x, dt.F32)]
        return c.g.cast(_pool(c), x.dtype)
    if lo != hi or any(2 * l > s for l, s in zip(lo, span)):
        if kind == "max":
            x = _pre_pad(c, x, lo, hi, float("-inf"))
        else:
            if not cip:     # the divisor counts the real inputs only: divide a ones-pool
                one = g.constant(np.ones((1,) * len(x.shape), x.dtype.host))
                ones = _pre_pad(c, g.expand(one, x.shape), lo, hi)
                xs = _pre_pad(c, x, lo, hi)
                s = g.pool(xs, "avg", k, stride, 0, ceil_mode=ceil)
                n = g.pool(ones, "avg", k, stride, 0, ceil_mode=ceil)
                return s / n
            x = _pre_pad(c, x, lo, hi)
        lo = [0] * d
    return g.pool(x, kind, k, stride, tuple(lo), dilation=dil, ceil_mode=ceil,
                  count_include_pad=cip)


def _window_sum(c, x, k, stride, dil, lo, hi, ceil):
    """Sums of x [N, C, *S] over the dilated windows (one strided gather an offset), and the
    count of each window's positions inside the padded input and inside x (NumPy, now)."""
    import itertools
    g = c.g
    d = len(k)
    size = x.shape[2:]
    outs, extra = [], []
    for s_, l, h, kk, st, dl in zip(size, lo, hi, k, stride, dil):
        span = dl * (kk - 1) + 1
        o = (s_ + l + h - span + (st - 1 if ceil else 0)) // st + 1
        if ceil and (o - 1) * st >= s_ + l:
            o -= 1
        outs.append(o)
        extra.append(max(0, (o - 1) * st + span - (s_ + l + h)))
    xp = _pre_pad(c, x, list(lo), [h + e for h, e in zip(hi, extra)])
    tot = None
    n_pad = np.zeros(outs, np.float32)
    n_real = np.zeros(outs, np.float32)
    for off in itertools.product(*(range(kk) for kk in k)):
        t = xp
        in_pad, in_real = np.ones(outs, bool), np.ones(outs, bool)
        for a in range(d):
            idx = off[a] * dil[a] + np.arange(outs[a]) * stride[a]
            t = g.gather(t, g.constant(idx.astype(np.int64)), 2 + a)
            shape = [1] * d
            shape[a] = -1
            in_pad &= (idx < size[a] + lo[a] + hi[a]).reshape(shape)
            in_real &= ((idx >= lo[a]) & (idx < size[a] + lo[a])).reshape(shape)
        tot = t if tot is None else tot + t
        n_pad += in_pad
        n_real += in_real
    return tot, n_pad, n_real


@conv("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(c):
    x = c.t(0)
    axes = tuple(range(2, len(x.shape)))
    return c.g.reduce("mean" if c.node.op_type == "GlobalAveragePool" else "max", x, axes, True)


@conv("Resize")
def _resize(c):
    """Resize is separable and affine along each axis: y = M x + b for an [out, n] matrix M
    that depends only on the attributes and shapes. Each axis's M (and b, the extrapolation
    of tf_crop_and_resize) is computed now by onnx's reference Resize on the n basis vectors,
    so every mode / coordinate transform / cubic coefficient / antialias / exclude_outside is
    the reference's own; the graph applies it as a gather (a pure selection, e.g. nearest) or
    a product along that axis."""
    x, g = c.t(0), c.g
    r = len(x.shape)
    roi = c.const(1, "roi")
    scales = c.const(2, "scales")
    sizes = c.const(3, "sizes")
    scales = None if scales is None or scales.size == 0 else [float(v) for v in scales]
    sizes = None if sizes is None or sizes.size == 0 else [int(v) for v in sizes]
    axes = c.attr("axes")
    axes = list(range(r)) if axes is None else [int(a) % r for a in axes]
    policy = c.attr("keep_aspect_ratio_policy", "stretch")
    attrs = {k: c.attr(k) for k in ("mode", "coordinate_transformation_mode", "nearest_mode",
                                    "cubic_coeff_a", "exclude_outside", "extrapolation_value",
                                    "antialias")}
    attrs = {k: v for k, v in attrs.items() if v is not None}
    n_ax = len(axes)
    per_axis_scale = None
    if sizes is not None and policy != "stretch":
        ratios = [sizes[i] / x.shape[a] for i, a in enumerate(axes)]
        sc = min(ratios) if policy == "not_larger" else max(ratios)
        if policy not in ("not_larger", "not_smaller"):
            c.refuse("keep_aspect_ratio_policy", policy)
        per_axis_scale = [sc] * n_ax
        sizes = [int(math.floor(sc * x.shape[a] + 0.5)) for a in axes]
    y = x
    for i, a in enumerate(axes):
        n = x.shape[a]
        if per_axis_scale is not None:
            kw = dict(scales=np.array([per_axis_scale[i]], np.float32))
            out = sizes[i]
        elif sizes is not None:
            kw = dict(sizes=np.array([sizes[i]], np.int64))
            out = sizes[i]
        else:
            kw = dict(scales=np.array([scales[i]], np.float32))
            out = int(math.floor(n * scales[i]))
        if roi is not None and roi.size:
            kw["roi"] = np.array([roi[i], roi[i + n_ax]], np.float32)
        if out == n and "roi" not in kw and (sizes is not None or kw["scales"][0] == 1.0):
            continue
        m, bvec = c.conv.resize_matrix(n, kw, attrs, out)
        y = _apply_axis(c, y, a, m, bvec)
    return y


def _apply_axis(c, y, a, m, bvec):
    """y with axis a mapped by the [out, n] matrix m (+ bvec [out])."""
    g = c.g
    out, n = m.shape
    sel = (np.count_nonzero(m, axis=1) == 1) & np.isclose(m.max(axis=1), 1.0) & \
        (m.sum(axis=1) == 1.0)
    if sel.all() and not bvec.any():       # a selection: a gather along the axis
        return g.gather(y, g.constant(m.argmax(axis=1).astype(np.int64)), a)
    yf = _f(c, y)
    r = len(y.shape)
    perm = [k for k in range(r) if k != a] + [a]
    t = g.transpose(yf, perm) if a != r - 1 else yf
    t = g.matmul(t, g.constant(np.ascontiguousarray(m.T.astype(np.float32))))
    if bvec.any():
        t = t + g.constant(bvec.astype(np.float32))
    inv = np.argsort(perm).tolist()
    t = g.transpose(t, inv) if a != r - 1 else t
    return _like(c, t, y)


# ---- sequence models and attention -----------------------------------------------------------
@conv("Attention")
def _attention(c):
    """ONNX Attention (opset 23+) composed of products and a softmax, as onnx's reference:
    softcap(qk * scale) + bias -> softmax -> @ v, where bias = attn_mask (bool -> 0 / -inf,
    padded with -inf up to the key length) + causal / sliding-window / nonpad_kv_seqlen masks
    (aligned after the past keys, or per batch at nonpad_kv_seqlen - q_len); a row whose bias
    is -inf everywhere gives 0; GQA by repeating k / v heads. Math in f32. (The IR's fused
    g.attention also fits when no qk output is asked for and v's head size is q's: it matched
    the node suite as well, but costs twice as much in the simulator, so CI could not afford
    it; a GPU-only path would go untested.)"""
    g = c.g
    q, k, v = (_f32(c, c.t(i)) for i in range(3))
    in_dtype = c.t(0).dtype
    c.attr("softmax_precision")          # f32 softmax either way
    nq, nkv = c.attr("q_num_heads"), c.attr("kv_num_heads")
    rank3 = len(q.shape) == 3
    if rank3:
        b = q.shape[0]
        q = g.transpose(g.reshape(q, (b, q.shape[1], nq, -1)), (0, 2, 1, 3))
        k = g.transpose(g.reshape(k, (b, k.shape[1], nkv, -1)), (0, 2, 1, 3))
        v = g.transpose(g.reshape(v, (b, v.shape[1], nkv, -1)), (0, 2, 1, 3))
    past = None
    if c.opt(4) is not None:
        pk, pv = _f32(c, c.t(4)), _f32(c, c.t(5))
        past = pk.shape[2]
        k, v = g.concat([pk, k], 2), g.concat([pv, v], 2)
    present = [k, v]
    nonpad = c.const(6, "nonpad_kv_seqlen")
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:      # GQA: each kv head serves hq / hkv query heads
        r = hq // hkv
        rep = lambda t: g.reshape(g.expand(g.reshape(t, (t.shape[0], hkv, 1) + t.shape[2:]),
                                           (t.shape[0], hkv, r) + t.shape[2:]),
                                  (t.shape[0], hq) + t.shape[2:])
        kr, vr = rep(k), rep(v)
    else:
        kr, vr = k, v
    scale = c.attr("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    sq, sk = q.shape[2], k.shape[2]
    cap = c.attr("softcap")
    # the mask known now: causal / window / padding, [B or 1, 1, Sq, Sk] of 0 / -inf
    offset = (np.asarray(nonpad, np.int64).reshape(-1, 1, 1) - sq if nonpad is not None and
              past is None else np.array(past or 0).reshape(1, 1, 1))
    i_idx, j_idx = np.arange(sq).reshape(1, sq, 1), np.arange(sk).reshape(1, 1, sk)
    allowed = np.ones((offset.shape[0], sq, sk), bool)
    if c.attr("is_causal", 0):
        allowed &= j_idx <= i_idx + offset
    left, right = c.attr("left_window_size", -1), c.attr("right_window_size", -1)
    diff = i_idx + offset - j_idx
    if left is not None and left >= 0:
        allowed &= diff <= left
    if right is not None and right >= 0:
        allowed &= -diff <= right
    if nonpad is not None:
        allowed = allowed & (j_idx < np.asarray(nonpad, np.int64).reshape(-1, 1, 1))
    static = np.where(allowed, 0.0, -np.inf).astype(np.float32)[:, None]   # [B|1, 1, Sq, Sk]
    bias = None if allowed.all() else g.constant(static)
    s = g.matmul(q, g.transpose(kr, (0, 1, 3, 2))) * scale
    if cap is not None and float(cap) > 0:
        s = g.tanh(s / float(cap)) * float(cap)
    qk01 = s
    if c.opt(3) is not None:
        m = c.t(3)
        mb = g.where(m, 0.0, float("-inf")) if m.dtype == dt.BOOL else _f32(c, m)
        if mb.shape[-1] < sk:      # a mask shorter than the keys: the rest masked
            fill = g.constant(np.full(tuple(mb.shape[:-1]) + (sk - mb.shape[-1],), -np.inf,
                                      np.float32))
            mb = g.concat([mb, fill], len(mb.shape) - 1)
        bias = mb if bias is None else mb + bias
    if bias is not None:
        s = s + bias
    qk2 = s
    mx = g.reduce_max(s, -1, True)
    e = g.exp(s - g.where(g.eq(mx, float("-inf")), 0.0, mx))
    tot = g.sum(e, -1, True)
    p = e / g.where(g.eq(tot, 0.0), 1.0, tot)
    if bias is not None:       # rows the bias masks whole give 0 (not a NaN or a uniform row)
        dead = g.eq(g.reduce_max(bias, -1, True), float("-inf"))
        p = g.where(dead, 0.0, p)
    y = g.matmul(p, vr)
    if rank3:
        y = g.reshape(g.transpose(y, (0, 2, 1, 3)), (y.shape[0], y.shape[2], -1))
    mode = c.attr("qk_matmul_output_mode", 0)
    if mode not in (0, 1, 2, 3):
        c.refuse("qk_matmul_output_mode", mode)
    qk = [qk01, qk01, qk2, p][mode]
    cast = lambda t: t if t.dtype == in_dtype else g.cast(t, in_dtype)
    return [cast(y), cast(present[0]), cast(present[1]), cast(qk)]


@conv("RotaryEmbedding")
def _rotary(c):
    """ONNX RotaryEmbedding (opset 23) composed of element-wise ops, as its reference: x
    [B, S, H*D] (num_heads) or [B, H, S, D]; cos / sin [max_pos, R/2] gathered at position_ids
    [B, S] (or given [B, S, R/2]); the first R dims rotated, halves or interleaved pairs."""
    g = c.g
    x = c.t(0)
    xf = _f32(c, x)
    cos, sin = _f32(c, c.t(1)), _f32(c, c.t(2))
    if c.opt(3) is not None:
        pos = c.t(3)
        cos, sin = g.gather(cos, pos, 0), g.gather(sin, pos, 0)     # [B, S, R/2]
    r4 = len(x.shape) == 4
    if r4:
        t = g.transpose(xf, (0, 2, 1, 3))
    else:
        nh = c.attr("num_heads")
        if not nh:
            c.fail("a rank-3 input needs the num_heads attribute")
        t = g.reshape(xf, (x.shape[0], x.shape[1], nh, -1))
    b, s_, h, d = t.shape
    rd = c.attr("rotary_embedding_dim", 0) or d
    half = rd // 2
    if cos.shape[-1] != half:
        c.fail(f"cos_cache's last dim {cos.shape[-1]} is not rotary_embedding_dim / 2 = {half}")
    cos, sin = g.reshape(cos, (b, s_, 1, half)), g.reshape(sin, (b, s_, 1, half))
    rot = g.narrow(t, 3, 0, rd) if rd < d else t
    if c.attr("interleaved", 0):
        pairs = g.reshape(rot, (b, s_, h, half, 2))
        x1 = g.reshape(g.narrow(pairs, 4, 0, 1), (b, s_, h, half))
        x2 = g.reshape(g.narrow(pairs, 4, 1, 1), (b, s_, h, half))
    else:
        x1, x2 = g.narrow(rot, 3, 0, half), g.narrow(rot, 3, half, half)
    re, im = cos * x1 - sin * x2, sin * x1 + cos * x2
    if c.attr("interleaved", 0):
        out = g.reshape(g.concat([g.reshape(re, (b, s_, h, half, 1)),
                                  g.reshape(im, (b, s_, h, half, 1))], 4), (b, s_, h, rd))
    else:
        out = g.concat([re, im], 3)
    if rd < d:
        out = g.concat([out, g.narrow(t, 3, rd, d - rd)], 3)
    out = g.transpose(out, (0, 2, 1, 3)) if r4 else g.reshape(out, x.shape)
    return _like(c, out, x)


# ---- control flow ----------------------------------------------------------------------------
@conv("If")
def _if(c):
    cond = c.ins[0]
    then_g, else_g = c.attr("then_branch"), c.attr("else_branch")
    if isinstance(cond, np.ndarray):   # a known condition: inline the branch taken
        return c.conv.inline(then_g if bool(cond.reshape(-1)[0]) else else_g, c)
    t = c.conv.inline(then_g, c)
    e = c.conv.inline(else_g, c)
    pred = c.g.reshape(c.t(0), ())
    outs = []
    for a, b in zip(t, e):
        a, b = c.conv.tensor(a), c.conv.tensor(b)
        if a.shape != b.shape:
            c.fail(f"the branches give shapes {a.shape} and {b.shape}")
        outs.append(c.g.where(pred, a, b))
    return outs


@conv("Constant")
def _constant(c):
    for k in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        v = c.attr(k)
        if v is not None:
            if k in ("value_float", "value_floats"):
                return np.asarray(v, np.float32)
            if k in ("value_int", "value_ints"):
                return np.asarray(v, np.int64)
            return np.asarray(v)
    c.fail("has no value attribute rlx_numba reads (value_string / sparse_value)")


@conv("ConstantOfShape")
def _constant_of_shape(c):
    shape = c.const(0, "shape")
    v = c.attr("value")
    v = np.zeros(1, np.float32) if v is None else v
    return np.full(tuple(int(s) for s in shape), v.reshape(-1)[0], dtype=v.dtype)


# ops that always fold (their outputs are known at convert time from shapes alone, or need
# NumPy since their shape depends on values: the window functions' and MelWeightMatrix's
# shapes are their scalar inputs' values)
_FOLD_ONLY = ("NonZero", "Compress", "Unique", "HannWindow", "HammingWindow", "BlackmanWindow",
              "MelWeightMatrix")


def _fold_gather_elements(c, x, idx):
    # onnx's reference takes np.choose, which holds at most 64 choices (NPY_MAXARGS): past
    # 64 along the axis it falls back to a helper that reads only idx[:, 0] and fails to
    # reshape (BERT's token_type_ids buffer [1, 512] gathered by position_ids [1, S])
    axis = c.attr("axis", 0) % x.ndim
    n = x.shape[axis]
    if idx.size and (idx.min() < -n or idx.max() >= n):
        c.fail(f"indices must lie in [-{n}, {n}) along axis {axis}, got "
               f"[{idx.min()}, {idx.max()}]")
    for k in range(x.ndim):
        if k != axis and idx.shape[k] > x.shape[k]:
            c.fail(f"indices shape {list(idx.shape)} exceeds data shape {list(x.shape)} "
                   f"off axis {axis}")
    i = np.where(idx < 0, idx + n, idx).astype(np.int64)
    sub = x[tuple(slice(0, s) if k != axis else slice(None) for k, s in enumerate(idx.shape))]
    return np.take_along_axis(sub, i, axis)


_NUMPY_FOLDS = {"GatherElements": _fold_gather_elements}


# ---------------------------------------------------------------------------------------------
class _Converter:
    def __init__(self, model, params: dict, opset: int):
        from .ir.graph import Graph
        self.model, self.params, self.opset = model, params, opset
        self.g = Graph(model.graph.name or "onnx")
        self.env: dict = {}
        self.param_tensors: dict = {}
        self.param_ids = {id(v): k for k, v in params.items()}

    def tensor(self, v):
        from .ir.graph import Tensor
        if isinstance(v, Tensor):
            return v
        name = self.param_ids.get(id(v))
        if name is not None and v.dtype.kind == "f" and v.size > 1:   # a weight: a graph param
            if name not in self.param_tensors:
                self.param_tensors[name] = self.g.param(name, v.shape, dt.dtype(v.dtype))
            return self.param_tensors[name]
        return self.g.constant(v)

    def input_ancestors(self, t) -> set:
        """The names of the graph inputs a Tensor is computed from."""
        seen, todo, names = set(), [t.id], set()
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            n = self.g.nodes[i]
            if n.op == "input":
                names.add(n.name)
            todo.extend(n.inputs)
        return names

    def dtype_of_value(self, v):
        return v.dtype if not isinstance(v, np.ndarray) else dt.dtype(v.dtype)

    def run_nodes(self, nodes):
        for node in nodes:
            ins = [self.env[n] if n else None for n in node.input]
            outs = self.convert(node, ins)
            names = list(node.output)
            if not isinstance(outs, (list, tuple)):
                outs = [outs]
            for n, v in zip(names, outs):
                if n:
                    self.env[n] = v

    def convert(self, node, ins):
        op = node.op_type
        known = all(v is None or isinstance(v, np.ndarray) for v in ins)
        if known and op not in ("If", "Loop", "Scan") and (node.domain in ("", "ai.onnx")):
            if op in ("Constant", "Range", "ConstantOfShape", "Shape", "Size", "EyeLike"):
                return CONVERTERS[op](_Ctx(self, node, ins))
            return self.fold(node, ins)
        if op in ("Shape", "Size", "EyeLike"):     # need only the shape
            return CONVERTERS[op](_Ctx(self, node, ins))
        f = CONVERTERS.get(op)
        if f is None and op in _FOLD_ONLY:   # value-dependent shapes: specialise on the feeds
            feeds = set().union(*(self.input_ancestors(v) for v in ins
                                  if v is not None and not isinstance(v, np.ndarray)))
            if feeds:
                raise _NeedValue(feeds)
        if f is None:
            raise ConvertError(f"node {node.name!r}: {op} needs values known when the model is "
                               f"converted (it has no graph op), but an input is computed at "
                               f"run time")
        ctx = _Ctx(self, node, ins)
        try:
            out = f(ctx)
        except ConvertError:
            raise
        except ValueError as e:   # a builder's check: name the ONNX node too
            raise ConvertError(f"{ctx.where()}: {e}") from None
        unread = sorted(set(ctx.attrs) - ctx.used)
        if unread:    # every attribute is honoured (read by the converter) or refused
            ctx.fail(f"attribute(s) {', '.join(unread)} not supported by rlx_numba's {op}")
        return out

    def fold(self, node, ins):
        """One node on known inputs through onnx's reference implementation (NumPy), or through
        a NumPy twin of the few ops whose reference is wrong (_NUMPY_FOLDS)."""
        twin = _NUMPY_FOLDS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        if twin is not None:
            ctx = _Ctx(self, node, ins)
            return [twin(ctx, *ins)]
        onnx = _onnx()
        from onnx import helper
        from onnx.reference import ReferenceEvaluator
        names = [f"i{k}" if v is not None else "" for k, v in enumerate(ins)]
        n2 = helper.make_node(node.op_type, names, [f"o{k}" for k in range(len(node.output))],
                              domain=node.domain)
        n2.attribute.extend(node.attribute)
        gi = [helper.make_tensor_value_info(nm, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for nm, v in zip(names, ins) if v is not None]
        go = [helper.make_empty_tensor_value_info(f"o{k}") for k in range(len(node.output))]
        m = helper.make_model(helper.make_graph([n2], "fold", gi, go),
                              opset_imports=[helper.make_opsetid("", self.opset)])
        ref = ReferenceEvaluator(m)
        res = ref.run(None, {nm: v for nm, v in zip(names, ins) if v is not None})
        return [np.asarray(r) for r in res]

    def resize_matrix(self, n, kw, attrs, out):
        """The [out, n] matrix and [out] offset of onnx's reference Resize along one axis
        (basis vectors as rows of an [n + 1, n] input, axis 1; the last row zeros)."""
        from onnx import helper
        from onnx.reference import ReferenceEvaluator
        basis = np.concatenate([np.eye(n, dtype=np.float32), np.zeros((1, n), np.float32)])
        names = ["x", "roi" if "roi" in kw else "", "scales" if "scales" in kw else "",
                 "sizes" if "sizes" in kw else ""]
        while names and not names[-1]:
            names.pop()
        node = helper.make_node("Resize", names, ["y"], axes=[1], **attrs)
        feeds = {"x": basis, **{k: v for k, v in kw.items()}}
        gi = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
              for k, v in feeds.items()]
        m = helper.make_model(helper.make_graph([node], "resize", gi,
                                                [helper.make_empty_tensor_value_info("y")]),
                              opset_imports=[helper.make_opsetid("", max(self.opset, 19))])
        (y,) = ReferenceEvaluator(m).run(None, feeds)
        y = np.asarray(y, np.float64)
        if y.shape[1] != out:
            raise ConvertError(f"Resize: the reference gives {y.shape[1]} outputs along an "
                               f"axis, expected {out}")
        bvec = y[n]
        return (y[:n] - bvec).T, bvec

    def inline(self, body, c):
        """A subgraph (If's branches) converted into the same graph: it sees the outer names."""
        for init in body.initializer:
            self.env[init.name] = _onnx().numpy_helper.to_array(init)
        self.run_nodes(body.node)
        return [self.env[o.name] for o in body.output]


# ---- exporter patterns -> one op ------------------------------------------------------------
# torch.onnx.export writes exact GELU as x * 0.5 * (1 + Erf(x / sqrt 2)) and Llama's RMSNorm as
# w * (x * Reciprocal(Sqrt(ReduceMean(x^2) + eps))): node by node they cost four to six device
# passes each; as the IR's gelu / rms_norm they are one (and fuse with the product before /
# the residual add before). The rewritten nodes carry this domain, which no model uses: a
# converter then runs them even when every input is known (there is no fold for them).
_FUSED_DOMAIN = "rlx_numba.fused"


def _fuse_patterns(graph):
    """graph.node with the exporters' exact-GELU and RMSNorm subgraphs replaced by one
    Gelu / RMSNormalization node each (only where every inner value has that one reader and
    is not a graph output)."""
    onnx = _onnx()
    nodes = list(graph.node)
    consts = {t.name: t for t in graph.initializer}
    for n in nodes:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = n.attribute[0].t
    readers: dict = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    outs = {o.name for o in graph.output}
    for n in nodes:             # names a subgraph (If / Loop / Scan body) reads stay as they are
        for a in n.attribute:
            for sg in ([a.g] if a.type == 5 else list(a.graphs)):
                outs.update(i for m in _all_nodes(sg) for i in m.input)
    producer = {o: n for n in nodes for o in n.output}

    def scalar(name):
        t = consts.get(name)
        if t is None or math.prod(t.dims) != 1:
            return None
        return float(onnx.numpy_helper.to_array(t).reshape(-1)[0])

    def near(v, want):
        return v is not None and abs(v - want) <= 1e-6 * abs(want)

    def only_reader(name, op):
        r = readers.get(name, [])
        if name in outs or len(r) != 1 or r[0].op_type != op or r[0].domain not in ("", "ai.onnx"):
            return None
        return r[0]

    def other(n, name):
        """n's input that is not ``name`` (n binary, reading name once)."""
        ins = list(n.input)
        if len(ins) != 2 or ins.count(name) != 1:
            return None
        return ins[1 - ins.index(name)]

    dead, repl = set(), {}      # ids of removed nodes; id(last node) -> its replacement
    for e in nodes:
        if e.op_type != "Erf" or id(e) in dead:
            continue
        d = producer.get(e.input[0])
        if d is None or e.input[0] in outs or len(readers[e.input[0]]) != 1:
            continue
        if d.op_type == "Div" and near(scalar(d.input[1]), math.sqrt(2)):
            x = d.input[0]
        elif d.op_type == "Mul" and len(d.input) == 2:
            x = next((d.input[k] for k in (0, 1) if near(scalar(d.input[1 - k]),
                                                        math.sqrt(0.5))), None)
        else:
            continue
        a = only_reader(e.output[0], "Add")
        if x is None or a is None or not near(scalar(other(a, e.output[0]) or ""), 1.0):
            continue
        m1 = only_reader(a.output[0], "Mul")
        if m1 is None:
            continue
        z = other(m1, a.output[0])
        chain, y = None, None
        if z == x:                                   # (x * (1 + erf)) * 0.5
            y = only_reader(m1.output[0], "Mul")
            if y is not None and near(scalar(other(y, m1.output[0]) or ""), 0.5):
                chain = [d, e, a, m1, y]
        elif near(scalar(z or ""), 0.5):             # x * (0.5 * (1 + erf))
            y = only_reader(m1.output[0], "Mul")
            if y is not None and other(y, m1.output[0]) == x:
                chain = [d, e, a, m1, y]
        elif z in producer and z not in outs and len(readers[z]) == 1:   # (x * 0.5) * (1 + erf)
            h = producer[z]
            if h.op_type == "Mul" and other(h, x) is not None and \
                    near(scalar(other(h, x)), 0.5):
                chain, y = [d, e, a, h, m1], m1
        if chain is None:
            continue
        dead.update(id(n) for n in chain)
        repl[id(y)] = onnx.helper.make_node("Gelu", [x], [y.output[0]], name=f"{y.name}/gelu",
                                            domain=_FUSED_DOMAIN)
    for r in nodes:
        if r.op_type != "ReduceMean" or id(r) in dead:
            continue
        p = producer.get(r.input[0])
        if p is None or r.input[0] in outs or len(readers[r.input[0]]) != 1:
            continue
        if p.op_type == "Pow" and near(scalar(p.input[1]), 2.0):
            x = p.input[0]
        elif p.op_type == "Mul" and len(p.input) == 2 and p.input[0] == p.input[1]:
            x = p.input[0]
        else:
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in r.attribute}
        axes = attrs.get("axes")
        if axes is None and len(r.input) > 1 and r.input[1] in consts:
            axes = onnx.numpy_helper.to_array(consts[r.input[1]]).reshape(-1).tolist()
        if list(axes or []) != [-1] or not attrs.get("keepdims", 1):
            continue
        a = only_reader(r.output[0], "Add")
        eps = scalar(other(a, r.output[0]) or "") if a is not None else None
        sq = only_reader(a.output[0], "Sqrt") if eps is not None else None
        if sq is None:
            continue
        rc = only_reader(sq.output[0], "Reciprocal")
        if rc is None:
            rc = only_reader(sq.output[0], "Div")
            if rc is None or rc.input[1] != sq.output[0] or not near(scalar(rc.input[0]), 1.0):
                continue
        m = only_reader(rc.output[0], "Mul")
        if m is None or other(m, rc.output[0]) != x:
            continue
        mw = only_reader(m.output[0], "Mul")
        w = other(mw, m.output[0]) if mw is not None else None
        if w not in consts or len(consts[w].dims) != 1:
            continue
        dead.update(id(n) for n in (p, r, a, sq, rc, m, mw))
        repl[id(mw)] = onnx.helper.make_node("RMSNormalization", [x, w], [mw.output[0]],
                                             name=f"{mw.name}/rms_norm", domain=_FUSED_DOMAIN,
                                             epsilon=eps, axis=-1)
    return [repl.get(id(n), n) for n in nodes if id(n) not in dead or id(n) in repl]


def _all_nodes(graph):
    """The nodes of a graph and of its subgraphs (If / Loop / Scan bodies)."""
    for n in graph.node:
        yield n
        for a in n.attribute:
            if a.type == 5:     # GRAPH
                yield from _all_nodes(a.g)
            for sg in a.graphs:
                yield from _all_nodes(sg)


def _onnx_type_name(elem_type: int) -> str:
    try:
        return _onnx().TensorProto.DataType.Name(elem_type)
    except ValueError:
        return _ONNX_TYPE_NAMES.get(elem_type, str(elem_type))


def _needed_ops(graph, out: set):
    for n in graph.node:
        out.add((n.domain or "", n.op_type))
        for a in n.attribute:
            if a.g is not None and a.type == 5:     # GRAPH
                _needed_ops(a.g, out)
            for sg in a.graphs:
                _needed_ops(sg, out)
    return out


def supported_ops() -> list:
    """The ONNX op types (default domain) rlx_numba converts."""
    return sorted(set(CONVERTERS) | set(_FOLD_ONLY))


class OnnxModel:
    """A loaded ONNX model: ``run(feeds)`` converts it for the feeds' shapes (once a set of
    shapes) and runs it; ``graph`` is the Graph of the last shapes run (or of the declared
    shapes when they are all static)."""

    def __init__(self, model, compile_kw=None):
        onnx = _onnx()
        self.model = model
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
                          None)
        if self.opset is None or self.opset < MIN_OPSET:
            raise NotImplementedError(
                f"ONNX model {model.graph.name!r} uses opset {self.opset}; rlx_numba.onnx reads "
                f"opset {MIN_OPSET} and newer (convert it with onnx.version_converter."
                f"convert_version(model, {MIN_OPSET}))")
        bad = sorted(f"{d + '.' if d else ''}{op}" for d, op in _needed_ops(model.graph, set())
                     if d not in ("", "ai.onnx") or op not in supported_ops())
        if bad:
            raise NotImplementedError(
                f"ONNX model {model.graph.name!r} (opset {self.opset}) has node types rlx_numba "
                f"does not support: {', '.join(bad)}")
        casts = sorted({_onnx_type_name(a.i) for n in _all_nodes(model.graph)
                        if n.op_type == "Cast" for a in n.attribute
                        if a.name == "to" and a.i not in _ONNX_DTYPES})
        if casts:
            raise NotImplementedError(
                f"ONNX model {model.graph.name!r} (opset {self.opset}) casts to "
                f"{', '.join(casts)}, which rlx.onnx does not take")
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
        self.params = {k: v for k, v in inits.items()}
        self.inputs = [i for i in model.graph.input if i.name not in inits]
        self.input_names = [i.name for i in self.inputs]
        self.output_names = [o.name for o in model.graph.output]
        self._specs = {}
        for i in self.inputs:
            tt = i.type.tensor_type
            if not i.type.HasField("tensor_type"):
                raise NotImplementedError(f"input {i.name!r} is not a tensor (sequence, map or "
                                          f"optional inputs are not supported)")
            d = _dtype_of(tt.elem_type, f"input {i.name!r}")
            dims = [dd.dim_value if dd.HasField("dim_value") else (dd.dim_param or None)
                    for dd in tt.shape.dim] if tt.HasField("shape") else None
            self._specs[i.name] = (d, dims)
        for o in model.graph.output:
            if o.type.HasField("tensor_type"):
                _dtype_of(o.type.tensor_type.elem_type, f"output {o.name!r}")
            else:
                raise NotImplementedError(f"output {o.name!r} is not a tensor")
        for k, v in inits.items():
            _dtype_of(onnx.helper.np_dtype_to_tensor_dtype(v.dtype), f"initializer {k!r}")
        self._compile_kw = dict(compile_kw or {})
        self._nodes = _fuse_patterns(model.graph)
        self._value_inputs = set()   # inputs whose values the conversion needs (see _NeedValue)
        self._cache = {}          # input shapes -> (graph, executable, outputs plan)
        self._last = None
        static = all(dims is not None and all(isinstance(x, int) for x in dims)
                     for _, dims in self._specs.values())
        if static:
            try:
                self._last = self._build({n: tuple(self._specs[n][1]) for n in self.input_names},
                                         {})
            except _NeedValue as e:   # built on the first run, with those inputs' values
                self._value_inputs |= e.names

    # ---- public ----
    @property
    def graph(self):
        if self._last is None:
            sym = {n: dims for n, (_, dims) in self._specs.items()}
            raise ValueError(f"the model's inputs have symbolic dims {sym}: the graph is built "
                             f"for the shapes of the first run()")
        return self._last[0]

    @property
    def executable(self):
        """The compiled executable of the last run (None when every output is a constant)."""
        return None if self._last is None else self._last[1]

    @property
    def device_inputs(self) -> list:
        """The input names the executable takes (those not specialised on their values)."""
        return [n for n in self.input_names if n not in self._value_inputs]

    def compile(self, **kw):
        """Set rlx.compile's keywords (compile_mode, exec_mode, precision) for the
        executables built from here on; returns self."""
        self._compile_kw = dict(kw)
        self._cache.clear()
        self._last = None
        return self

    def run(self, feeds: dict) -> list:
        if not isinstance(feeds, dict):
            raise ValueError(f"run: feeds must be a dict of ONNX input name -> array, got "
                             f"{type(feeds).__name__}")
        unknown = sorted(set(feeds) - set(self.input_names))
        if unknown:
            raise ValueError(f"run: unknown input(s) {unknown}; the model's inputs are "
                             f"{self.input_names}")
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"run: missing input(s) {missing}; the model's inputs are "
                             f"{self.input_names}")
        arrays, shapes = {}, {}
        for n in self.input_names:
            d, dims = self._specs[n]
            a = np.asarray(feeds[n])
            if a.dtype != d.host:
                raise ValueError(f"run: input {n!r} must be {d.host} (ONNX), got {a.dtype}")
            if dims is not None:
                ok = len(dims) == a.ndim and all(not isinstance(w, int) or w == s
                                                 for w, s in zip(dims, a.shape))
                if not ok:
                    raise ValueError(f"run: input {n!r} has shape {list(a.shape)}, the model "
                                     f"declares {dims}")
            arrays[n], shapes[n] = a, tuple(a.shape)
        while True:
            key = self._key(shapes, arrays)
            built = self._cache.get(key)
            if built is not None:
                break
            try:
                built = self._build(shapes, arrays)
                break
            except _NeedValue as e:
                self._value_inputs |= e.names
        self._last = built
        g, exe, plan = built
        dev = exe.run({n: arrays[n] for n in self.input_names
                       if n not in self._value_inputs}) if exe is not None else []
        outs = []
        for kind, v, d in plan:
            # exe.run's host arrays are fresh each run (copy_to_host allocates): no copy
            y = np.asarray(dev[v]) if kind == "dev" else np.array(v, copy=True)
            outs.append(y.astype(d.host, copy=False) if y.dtype != d.host else y)
        return outs

    # ---- internals ----
    def _key(self, shapes, arrays):
        return tuple(shapes[n] if n not in self._value_inputs else
                     (shapes[n], arrays[n].tobytes()) for n in self.input_names)

    def _build(self, shapes: dict, arrays: dict):
        from .compiler import compile as rlx_compile
        cv = _Converter(self.model, self.params, self.opset)
        g = cv.g
        # symbolic dims: the same name must bind one size
        bound = {}
        for n in self.input_names:
            dims = self._specs[n][1]
            for w, s in zip(dims or [], shapes[n]):
                if isinstance(w, str):
                    if bound.setdefault(w, s) != s:
                        raise ValueError(f"run: symbolic dim {w!r} is {bound[w]} in one input "
                                         f"and {s} in input {n!r}")
        for n in self.input_names:
            cv.env[n] = (np.array(arrays[n]) if n in self._value_inputs else
                         g.input(n, shapes[n], self._specs[n][0]))
        for k, v in self.params.items():
            cv.env[k] = v
        cv.run_nodes(self._nodes)
        plan, outs = [], []
        for o in self.model.graph.output:
            v = cv.env[o.name]
            d = _dtype_of(o.type.tensor_type.elem_type, f"output {o.name!r}")
            if isinstance(v, np.ndarray):
                plan.append(("const", v, d))
                continue
            if v.dtype != d:
                v = g.cast(v, d)
            if v.node.op in ("input", "constant", "param") or any(v.id == o.id for o in outs):
                v = _copy(g, v)   # an output is its own buffer
            plan.append(("dev", len(outs), d))
            outs.append(v)
        exe = None
        if outs:
            g.set_outputs(outs)
            exe = rlx_compile(g, **self._compile_kw)
            for name in cv.param_tensors:
                exe.set_param(name, self.params[name])
        built = (g, exe, plan)
        self._cache[self._key(shapes, arrays)] = built
        return built


def _copy(g, v):
    return g.eq(v, True) if v.dtype == dt.BOOL else g.add(v, g.constant(np.zeros((), v.dtype.host)))


def load(model, **compile_kw) -> OnnxModel:
    """An ONNX model (a path or an onnx.ModelProto) on rlx_numba. Raises NotImplementedError
    naming every unsupported node type (and the opset), or for an opset older than 13."""
    onnx = _onnx()
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        model = onnx.load(model)
    elif not isinstance(model, onnx.ModelProto):
        raise ValueError(f"load: expected a path or an onnx.ModelProto, got "
                         f"{type(model).__name__}")
    return OnnxModel(model, compile_kw)
