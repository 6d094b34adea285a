"""Low precision: ONNX QuantizeLinear / DequantizeLinear, torch._scaled_mm and ONNX
MatMulInteger. Kernels: kernels/lowp.py; lowering: runtime/lower_lowp.py.

``quantize(x, scale, zero_point=None, *, axis=None, dtype=None)`` is ONNX QuantizeLinear
(opset 21, saturate=1): for the integer dtypes (i8, u8, i16)

    q = saturate(round_half_even(x / scale) + zero_point)          (f32 arithmetic)

and for f8e4m3 / f8e5m2 ``q = fp8(saturate(x / scale + zero_point))``: the float8 cast rounds to
nearest even itself (no integer rounding), and saturation clamps to +-448 / +-57344 first,
+-inf included (onnx.helper.float32_to_float8e5m2 / _e4m3 with saturate=True); NaN stays NaN
(e5m2's NaN byte is ml_dtypes' 0x7e, where ONNX's reference writes 0x7f: both NaN). The zero
point has the quantised dtype and decides it when given (``dtype`` must then agree); scale is
f32 (or any float, cast). ``dequantize_linear(q, scale,
zero_point=None, *, axis=None)`` is ``(f32(q) - f32(zero_point)) * scale`` -> f32. Both take
scale / zero point of shape () or [1] (per tensor) or [C] with ``axis`` (per channel, C =
x.shape[axis]). They are graph functions of element-wise ops (division, round, add, clamp,
cast), which the fusion pass makes one kernel; their tier is the element-wise kernel's. Neither
has a gradient to its quantised side: quantize's result is stopped (an integer has none and
ONNX defines none for fp8), dequantize_linear's q is integer (an fp8 q's gradient is dy *
scale through the cast) -- its scale does get dy * (q - zero_point), the true derivative.

``scaled_matmul(a, b, scale_a, scale_b, *, bias=None, out_dtype="bf16")`` is torch._scaled_mm:
a [M, K], b [K, N] fp8 (e4m3 or e5m2, not both e5m2), K and N multiples of 16 (torch's check),
scale_a f32 () / [1] (per tensor) or [M, 1] (a row each), scale_b () / [1] or [1, N] (a column
each; rowwise needs both rowwise, as torch), bias [N] in out_dtype (bf16, f16 or f32):

    out[i, j] = out_dtype(sum_k f32(a[i, k]) * f32(b[k, j]) * scale_a[i] * scale_b[j] + bias[j])

with f32 accumulation (the products of two fp8 values are exact in f32). No gradient.

``qmatmul(a, b, *, a_zero=0, b_zero=0)`` is ONNX MatMulInteger: a i8 / u8 [M, K], b i8 [K, N]
-> i32 [M, N], ``sum_k (a[i, k] - a_zero) * (b[k, j] - b_zero)`` exactly (zero points Python
ints in the operand's range; the sum wraps mod 2^32 as int32 arithmetic would where it does
not fit, ONNX's int32 accumulation).
"""
from __future__ import annotations

from . import dtypes as dt
from .autodiff import vjp
from .opdef import EXACT, F32, defop
from .ops import fmt

QUANT_DTYPES = (dt.I8, dt.U8, dt.I16, dt.F8E4M3, dt.F8E5M2)
FP8_MAX = {dt.F8E4M3: 448.0, dt.F8E5M2: 57344.0}
SCALED_OUT = (dt.BF16, dt.F16, dt.F32)


def _desc(t) -> str:
    return f"{t.dtype} {fmt(t.shape)}"


def _per_channel(g, op, x, axis, args):
    """(axis or None, broadcast shape or None) for scale-like ``args`` [(name, tensor)]: () / [1]
    without axis, [x.shape[axis]] with it; ValueError naming the op, argument and shapes."""
    nd = len(x.shape)
    if axis is None:
        for name, t in args:
            if t is not None and tuple(t.shape) not in ((), (1,)):
                raise ValueError(f"{op}: per tensor (axis=None) {name} must be () or [1], got "
                                 f"{fmt(t.shape)}; pass axis= for per-channel {name}")
        return None, None
    if isinstance(axis, bool) or not isinstance(axis, int) or not -nd <= axis < nd:
        raise ValueError(f"{op}: axis must be an int in [{-nd}, {nd}) for x {_desc(x)}, got "
                         f"{axis!r}")
    axis %= nd
    for name, t in args:
        if t is not None and tuple(t.shape) != (x.shape[axis],):
            raise ValueError(f"{op}: per-channel {name} must be [{x.shape[axis]}] (x "
                             f"{_desc(x)} on axis {axis}), got {fmt(t.shape)}")
    return axis, (x.shape[axis],) + (1,) * (nd - axis - 1)


def _f32(g, t):
    return t if t.dtype == dt.F32 else g.cast(t, dt.F32)


def _along(g, t, shape):
    return t if shape is None else g.reshape(t, shape)


def _check_scale(g, op, scale):
    scale = g.check(op, "scale", scale)
    if not scale.dtype.is_float:
        raise ValueError(f"{op}: scale must be a float tensor (f32), got {_desc(scale)}")
    return scale


# ---- scaled_matmul / qmatmul: nodes of their own -------------------------------------------
def infer_scaled_matmul(a, b, scale_a, scale_b, *bias, out_dtype):
    op = "scaled_matmul"
    for name, t in (("a", a), ("b", b)):
        if len(t.shape) != 2 or t.dtype not in dt.FP8:
            raise ValueError(f"{op}: {name} must be a 2-D fp8 tensor (f8e4m3 / f8e5m2), got "
                             f"{_desc(t)}")
    if a.dtype == b.dtype == dt.F8E5M2:
        raise ValueError(f"{op}: a and b are both f8e5m2; one must be f8e4m3 (torch._scaled_mm, "
                         f"cuBLASLt)")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"{op}: a {_desc(a)} and b {_desc(b)} disagree on K ({k} != {k2})")
    if k % 16 or n % 16:
        raise ValueError(f"{op}: K and N must be multiples of 16 (torch._scaled_mm), got a "
                         f"{_desc(a)}, b {_desc(b)}")
    for name, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if t.dtype != dt.F32:
            raise ValueError(f"{op}: {name} must be f32, got {_desc(t)}")
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    tensorwise = sa in ((), (1,)) and sb in ((), (1,))
    if not tensorwise and (sa != (m, 1) or sb != (1, n)):
        raise ValueError(f"{op}: scales must be both per tensor (() or [1]) or both rowwise "
                         f"(scale_a [{m}, 1], scale_b [1, {n}]) for a {_desc(a)}, b {_desc(b)}; "
                         f"got scale_a {fmt(sa)}, scale_b {fmt(sb)}")
    if out_dtype not in SCALED_OUT:
        raise ValueError(f"{op}: out_dtype must be one of bf16, f16, f32, got {out_dtype}")
    if bias:
        (bt,) = bias
        if tuple(bt.shape) != (n,) or bt.dtype != out_dtype:
            raise ValueError(f"{op}: bias must be {out_dtype} [{n}] (out_dtype, N of b "
                             f"{_desc(b)}), got {_desc(bt)}")
    return (m, n), out_dtype


def qmatmul_check(a, b, a_zero, b_zero):
    """ValueError naming qmatmul, the argument and the shapes, or None."""
    op = "qmatmul"
    if len(a.shape) != 2 or a.dtype not in (dt.I8, dt.U8):
        raise ValueError(f"{op}: a must be a 2-D i8 or u8 tensor, got {_desc(a)}")
    if len(b.shape) != 2 or b.dtype != dt.I8:
        raise ValueError(f"{op}: b must be a 2-D i8 tensor, got {_desc(b)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"{op}: a {_desc(a)} and b {_desc(b)} disagree on K ({a.shape[1]} != "
                         f"{b.shape[0]})")
    for name, z, t in (("a_zero", a_zero, a), ("b_zero", b_zero, b)):
        lo, hi = (0, 255) if t.dtype == dt.U8 else (-128, 127)
        if isinstance(z, bool) or not isinstance(z, int) or not lo <= z <= hi:
            raise ValueError(f"{op}: {name} must be a Python int in [{lo}, {hi}] ({t.dtype}), "
                             f"got {z!r}")


def infer_qmatmul(a, b, *, a_zero, b_zero):
    qmatmul_check(a, b, a_zero, b_zero)
    return (a.shape[0], b.shape[1]), dt.I32


defop("scaled_matmul", infer_scaled_matmul, dtype_rule=F32,
      doc="torch._scaled_mm: fp8 a @ b, f32 sums, scaled per tensor or rowwise (+ bias), "
          "rounded once to out_dtype")
defop("qmatmul", infer_qmatmul, dtype_rule=EXACT,
      doc="ONNX MatMulInteger: (a - a_zero) @ (b - b_zero), i8 / u8 x i8 -> i32, exact")


@vjp("scaled_matmul")
def _scaled_matmul_vjp(g, node, dy):
    raise ValueError(f"grad: scaled_matmul %{node.id} {fmt(node.shape)} has no gradient "
                     f"(torch._scaled_mm defines none); take the gradient through an f32 / bf16 "
                     f"matmul instead")


@vjp("qmatmul")
def _qmatmul_vjp(g, node, dy):
    raise ValueError(f"grad: qmatmul %{node.id} {fmt(node.shape)} is integer arithmetic and has "
                     f"no gradient")


class LowPrecisionOps:
    """Builder methods; ``self`` is the Graph."""

    def quantize(self, x, scale, zero_point=None, *, axis=None, dtype=None):
        """ONNX QuantizeLinear (module docstring): x float -> ``dtype`` (default: the zero
        point's dtype, else i8) with scale / zero point () / [1] or [C] along ``axis``."""
        op = "quantize"
        x = self.check(op, "x", x)
        if not x.dtype.is_float:
            raise ValueError(f"{op}: x must be a float tensor, got {_desc(x)}")
        scale = _check_scale(self, op, scale)
        if zero_point is not None:
            zero_point = self.check(op, "zero_point", zero_point)
        want = dt.dtype(dtype) if dtype is not None else (
            zero_point.dtype if zero_point is not None else dt.I8)
        if want not in QUANT_DTYPES:
            raise ValueError(f"{op}: dtype must be one of {', '.join(d.name for d in QUANT_DTYPES)}"
                             f", got {want}")
        if zero_point is not None and zero_point.dtype != want:
            raise ValueError(f"{op}: zero_point {_desc(zero_point)} must have the quantised dtype "
                             f"{want} (it sets the dtype when given)")
        _, shape = _per_channel(self, op, x, axis, [("scale", scale), ("zero_point", zero_point)])
        v = self.binary("div", _f32(self, x), _along(self, _f32(self, scale), shape))
        if want in FP8_MAX:
            if zero_point is not None:
                v = v + _along(self, _f32(self, zero_point), shape)
            top = FP8_MAX[want]      # ONNX saturate: +-inf too become +-top (both formats)
            c = self.binary("min", self.binary("max", v, -top), top)
        else:
            v = self.activation("round", v)
            if zero_point is not None:
                v = v + _along(self, _f32(self, zero_point), shape)
            info = {dt.I8: (-128, 127), dt.U8: (0, 255), dt.I16: (-32768, 32767)}[want]
            # NaN: min/max propagate it and the cast gives 0 (CUDA's cvt, as ONNX leaves it
            # undefined); the clamp makes every other value exact in the cast
            c = self.binary("min", self.binary("max", v, float(info[0])), float(info[1]))
        return self.stop_gradient(self.cast(c, want))

    def dequantize_linear(self, q, scale, zero_point=None, *, axis=None):
        """ONNX DequantizeLinear: (f32(q) - f32(zero_point)) * scale -> f32; q of i8, u8, i16,
        i32, f8e4m3 or f8e5m2, the zero point of q's dtype."""
        op = "dequantize_linear"
        q = self.check(op, "q", q)
        if q.dtype not in QUANT_DTYPES + (dt.I32,):
            raise ValueError(f"{op}: q must be i8, u8, i16, i32, f8e4m3 or f8e5m2, got "
                             f"{_desc(q)}")
        scale = _check_scale(self, op, scale)
        if zero_point is not None:
            zero_point = self.check(op, "zero_point", zero_point)
            if zero_point.dtype != q.dtype:
                raise ValueError(f"{op}: zero_point {_desc(zero_point)} must have q's dtype "
                                 f"{q.dtype}")
        _, shape = _per_channel(self, op, q, axis, [("scale", scale), ("zero_point", zero_point)])
        v = _f32(self, q)
        if zero_point is not None:
            v = v - _along(self, _f32(self, zero_point), shape)
        return v * _along(self, _f32(self, scale), shape)

    def scaled_matmul(self, a, b, scale_a, scale_b, *, bias=None, out_dtype="bf16"):
        """torch._scaled_mm (module docstring): fp8 a [M, K] @ b [K, N] with f32 scales per
        tensor or rowwise ([M, 1] and [1, N]), an optional bias [N] of out_dtype."""
        op = "scaled_matmul"
        ins = [self.check(op, n, t) for n, t in (("a", a), ("b", b), ("scale_a", scale_a),
                                                 ("scale_b", scale_b))]
        if bias is not None:
            ins.append(self.check(op, "bias", bias))
        return self.bind(op, ins, out_dtype=dt.dtype(out_dtype))

    def qmatmul(self, a, b, *, a_zero=0, b_zero=0):
        """ONNX MatMulInteger (module docstring): i8 / u8 a [M, K] @ i8 b [K, N] -> exact i32,
        with Python-int zero points."""
        op = "qmatmul"
        a, b = self.check(op, "a", a), self.check(op, "b", b)
        return self.bind(op, [a, b], a_zero=a_zero, b_zero=b_zero)
