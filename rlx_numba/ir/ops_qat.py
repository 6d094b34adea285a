"""Quantisation-aware training: fake quantisation with torch's rules.

``g.fake_quantize(x, scale, zero_point, quant_min=, quant_max=, axis=)`` is
torch.fake_quantize_per_tensor_affine (``axis=None``; scale and zero point () or [1]) and
torch.fake_quantize_per_channel_affine (``axis``; scale and zero point [x.shape[axis]]):

    q = nearbyint(x * (1 / scale)) + zero_point       (f32; half to even; 1 / scale in f32)
    y = (clamp(q, quant_min, quant_max) - zero_point) * scale

in f32 whatever x's float dtype, y rounded once to it. The gradient is straight-through:
dy where quant_min <= q <= quant_max, 0 outside; none reaches scale or zero point (torch's
non-learnable ops). ``g.fake_quantize_lsq(x, scale, quant_min=, quant_max=)`` is LSQ as
torch's _fake_quantize_learnable_per_tensor_affine (zero point 0, grad_factor 1): the same
forward and x gradient, and the scale learns with

    d scale = sum(dy * (q * scale - x) / scale)  inside the range,
              sum(dy * quant_min) below it, sum(dy * quant_max) above it (q = nearbyint(x / scale)).

Both are graph functions with a hand-written backward (ir/ops_custom.py ``custom_vjp``) made of
element-wise ops. The residuals are x and the scale (and zero point), as torch's backward
takes them: the backward recomputes q (one more fused element-wise pass) rather than the
forward storing it, so the forward is one fused kernel over x (q and the clamp in registers)
beside the small ones for the scale's reciprocal and the zero point's cast. A zero point outside
[quant_min, quant_max] is not checked (its value lives on the device); NaN stays NaN.
"""
from __future__ import annotations

from . import dtypes as dt
from .ops import fmt
from .ops_custom import custom_vjp


def _desc(t) -> str:
    return f"{t.dtype}{fmt(t.shape)}"


def _check(g, op, x, scale, zero_point, quant_min, quant_max, axis):
    """The checked (x, scale, zero point, axis or None, per-channel shape for broadcasting)."""
    x = g.check(op, "x", x)
    if not x.dtype.is_float:
        raise ValueError(f"{op}: x must be a float tensor (f32, f16, bf16), got {_desc(x)}")
    for arg, v in (("quant_min", quant_min), ("quant_max", quant_max)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{op}: {arg} must be an int, got {v!r}")
    if quant_min > quant_max:
        raise ValueError(f"{op}: quant_min ({quant_min}) must be <= quant_max ({quant_max})")
    scale = g.check(op, "scale", scale)
    if scale.dtype != dt.F32:
        raise ValueError(f"{op}: scale must be an f32 tensor, got {_desc(scale)}")
    if zero_point is not None:
        zero_point = g.check(op, "zero_point", zero_point)
        if zero_point.dtype != dt.I32:
            raise ValueError(f"{op}: zero_point must be an i32 tensor, got {_desc(zero_point)}")
        if tuple(zero_point.shape) != tuple(scale.shape):
            raise ValueError(f"{op}: zero_point {fmt(zero_point.shape)} must have scale's shape "
                             f"{fmt(scale.shape)}")
    if axis is None:
        if tuple(scale.shape) not in ((), (1,)):
            raise ValueError(f"{op}: per tensor (axis=None) scale must be () or [1], got "
                             f"{fmt(scale.shape)}; pass axis= for per-channel scales")
        return x, scale, zero_point, None, None
    nd = len(x.shape)
    if isinstance(axis, bool) or not isinstance(axis, int) or not -nd <= axis < nd:
        raise ValueError(f"{op}: axis must be an int in [{-nd}, {nd}) for x {fmt(x.shape)}, got "
                         f"{axis!r}")
    axis %= nd
    if tuple(scale.shape) != (x.shape[axis],):
        raise ValueError(f"{op}: per-channel scale must be [{x.shape[axis]}] (x {fmt(x.shape)} "
                         f"on axis {axis}), got {fmt(scale.shape)}")
    return x, scale, zero_point, axis, (x.shape[axis],) + (1,) * (nd - axis - 1)


def _along(g, t, shape):
    """A per-channel [C] tensor shaped to broadcast along its axis (or as it is)."""
    return t if shape is None else g.reshape(t, shape)


def _quantize(g, x, scale, zp, qmin, qmax, shape):
    """(y in x's dtype, q = nearbyint(x / scale) + zero point, clamped q) in f32."""
    xf = x if x.dtype == dt.F32 else g.cast(x, dt.F32)
    s = _along(g, scale, shape)
    q = g.activation("round", xf * g.binary("div", 1.0, s))
    z = _along(g, g.cast(zp, dt.F32), shape) if zp is not None else None
    if z is not None:
        q = q + z
    qc = g.binary("min", g.binary("max", q, float(qmin)), float(qmax))
    y = ((qc - z) if z is not None else qc) * s
    return (y if x.dtype == dt.F32 else g.cast(y, x.dtype)), q, qc


def _inside(g, q, qmin, qmax, v):
    """v where quant_min <= q <= quant_max, else 0."""
    return g.where(g.compare("ge", q, float(qmin)),
                   g.where(g.compare("le", q, float(qmax)), v, 0.0), 0.0)


def _fq_fwd(g, x, scale, zero_point, qmin, qmax, shape):
    y, _, _ = _quantize(g, x, scale, zero_point, qmin, qmax, shape)
    return y, (x, scale, zero_point, qmin, qmax, shape)


def _fq_bwd(g, res, dy):
    x, scale, zero_point, qmin, qmax, shape = res
    _, q, _ = _quantize(g, x, scale, zero_point, qmin, qmax, shape)   # (y unused: dropped)
    xd = x.dtype
    dyf = dy if dy.dtype == dt.F32 else g.cast(dy, dt.F32)
    dx = _inside(g, q, qmin, qmax, dyf)
    return [dx if xd == dt.F32 else g.cast(dx, xd), None, None, None, None, None]


def _lsq_fwd(g, x, scale, qmin, qmax):
    y, _, _ = _quantize(g, x, scale, None, qmin, qmax, None)
    return y, (x, scale, qmin, qmax)


def _lsq_bwd(g, res, dy):
    x, scale, qmin, qmax = res
    _, q, qc = _quantize(g, x, scale, None, qmin, qmax, None)
    dyf = dy if dy.dtype == dt.F32 else g.cast(dy, dt.F32)
    xf = x if x.dtype == dt.F32 else g.cast(x, dt.F32)
    dx = _inside(g, q, qmin, qmax, dyf)
    inside = dyf * ((qc * scale - xf) * g.binary("div", 1.0, scale))
    ds = g.where(g.compare("lt", q, float(qmin)), dyf * float(qmin),
                 g.where(g.compare("gt", q, float(qmax)), dyf * float(qmax), inside))
    ds = g.reshape(g.reduce_sum(ds), scale.shape)
    return [dx if x.dtype == dt.F32 else g.cast(dx, x.dtype), ds, None, None]


_fake_quantize = custom_vjp(_fq_fwd, _fq_bwd)
_fake_quantize_lsq = custom_vjp(_lsq_fwd, _lsq_bwd)


class QatOps:
    """Builder methods; ``self`` is the Graph."""

    def fake_quantize(self, x, scale, zero_point, *, quant_min: int = -128, quant_max: int = 127,
                      axis=None):
        """torch.fake_quantize_per_tensor_affine (axis None) / _per_channel_affine (module
        docstring): x quantised to [quant_min, quant_max] with scale (f32) and zero point
        (i32; None: 0, symmetric) and dequantised again, in x's dtype; straight-through
        gradient."""
        x, scale, zero_point, axis, shape = _check(self, "fake_quantize", x, scale, zero_point,
                                                   quant_min, quant_max, axis)
        return _fake_quantize(self, x, scale, zero_point, quant_min, quant_max, shape)

    def fake_quantize_lsq(self, x, scale, *, quant_min: int = -128, quant_max: int = 127):
        """LSQ (module docstring): fake_quantize with zero point 0 and a learned per-tensor
        scale (f32 () or [1]) whose gradient is torch's learnable fake quantize's."""
        x, scale, _, _, _ = _check(self, "fake_quantize_lsq", x, scale, None, quant_min,
                                   quant_max, None)
        return _fake_quantize_lsq(self, x, scale, quant_min, quant_max)
