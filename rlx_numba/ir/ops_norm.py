"""Row ops over one axis: softmax, log_softmax, layer_norm, rms_norm (the norms optionally
fused with a residual add). Kernels: kernels/rows.py; lowering: runtime/lower_norm.py.

The kernels compute in f32. An f16/bf16 input is decomposed here, visibly in the graph, into
cast -> op in f32 -> cast back (activations are f32 on the device; half types are storage).
"""
from __future__ import annotations

from . import dtypes as dt
from .ops import fmt, normalize_axis


def _float(op, arg, t):
    if not t.dtype.is_float:
        raise ValueError(f"{op}: {arg} must be a float tensor, got {t.dtype} {fmt(t.shape)}")


class NormOps:
    """Builder methods; ``self`` is the Graph."""

    def _f32(self, t):
        return t if t.dtype == dt.F32 else self.cast(t, dt.F32)

    def _row_op(self, op, x, axis, **attrs):
        self._check(op, "x", x)
        _float(op, "x", x)
        if len(x.shape) == 0:
            raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
        axis = normalize_axis(op, "axis", axis, len(x.shape))
        return axis

    def softmax(self, x, axis: int = -1):
        """exp(x - max) / sum(exp(x - max)) along ``axis``."""
        axis = self._row_op("softmax", x, axis)
        y = self._add("softmax", (self._f32(x),), x.shape, dt.F32, axis=axis)
        return y if x.dtype == dt.F32 else self.cast(y, x.dtype)

    def log_softmax(self, x, axis: int = -1):
        """x - max - log(sum(exp(x - max))) along ``axis``."""
        axis = self._row_op("log_softmax", x, axis)
        y = self._add("log_softmax", (self._f32(x),), x.shape, dt.F32, axis=axis)
        return y if x.dtype == dt.F32 else self.cast(y, x.dtype)

    def _norm(self, op, x, gamma, beta, axis, eps, residual, return_residual):
        axis = self._row_op(op, x, axis)
        n = x.shape[axis]
        for arg, t in (("gamma", gamma), ("beta", beta)):
            if t is None:
                if arg == "gamma":
                    raise ValueError(f"{op}: gamma is required")
                continue
            self._check(op, arg, t)
            _float(op, arg, t)
            if tuple(t.shape) != (n,):
                raise ValueError(f"{op}: {arg} must have shape [{n}] (x {fmt(x.shape)} along axis "
                                 f"{axis}), got {fmt(t.shape)}")
        if residual is not None:
            self._check(op, "residual", residual)
            _float(op, "residual", residual)
            if tuple(residual.shape) != tuple(x.shape):
                raise ValueError(f"{op}: residual must have x's shape {fmt(x.shape)}, got "
                                 f"{fmt(residual.shape)}")
        elif return_residual:
            raise ValueError(f"{op}: return_residual=True needs a residual")
        if not isinstance(eps, (int, float)) or eps < 0:
            raise ValueError(f"{op}: eps must be a number >= 0, got {eps!r}")
        ins = [self._f32(x), self._f32(gamma)] + ([self._f32(beta)] if beta is not None else [])
        if residual is not None:
            ins.append(self._f32(residual))
        y = self._add(op, ins, x.shape, dt.F32, axis=axis, eps=float(eps),
                      has_beta=beta is not None, has_residual=residual is not None)
        out = y if x.dtype == dt.F32 else self.cast(y, x.dtype)
        if not return_residual:
            return out
        s = self._add("residual_sum", (y,), x.shape, dt.F32)   # the x + residual the norm computed
        return out, (s if x.dtype == dt.F32 else self.cast(s, x.dtype))

    def layer_norm(self, x, gamma, beta=None, axis: int = -1, eps: float = 1e-5, residual=None,
                   return_residual: bool = False):
        """(h - mean(h)) / sqrt(var(h) + eps) * gamma (+ beta), h = x (+ residual), along axis.
        With ``return_residual=True`` returns (normed, h) for pre-norm residual streams."""
        return self._norm("layer_norm", x, gamma, beta, axis, eps, residual, return_residual)

    def rms_norm(self, x, gamma, beta=None, axis: int = -1, eps: float = 1e-6, residual=None,
                 return_residual: bool = False):
        """h * rsqrt(mean(h^2) + eps) * gamma (+ beta), h = x (+ residual), along axis.
        With ``return_residual=True`` returns (normed, h)."""
        return self._norm("rms_norm", x, gamma, beta, axis, eps, residual, return_residual)
