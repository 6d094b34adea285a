"""Row ops over one axis: softmax, log_softmax, layer_norm, rms_norm (the norms optionally
fused with a residual add), their closed-form backward ops (softmax_bwd, norm_bwd) and VJPs.
Kernels: kernels/rows.py; lowering: runtime/lower_norm.py.

The kernels compute in f32. An f16/bf16 input is decomposed here, visibly in the graph, into
cast -> op in f32 -> cast back (activations are f32 on the device; half types are storage).
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .autodiff import vjp, zeros
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

    def _norm_args(self, op, x, gamma, beta, axis, eps, residual):
        """The checks of a norm's arguments; the axis, normalised."""
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
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
            raise ValueError(f"{op}: eps must be a number >= 0, got {eps!r}")
        return axis

    def _norm(self, op, x, gamma, beta, axis, eps, residual, return_residual):
        axis = self._norm_args(op, x, gamma, beta, axis, eps, residual)
        if residual is None and return_residual:
            raise ValueError(f"{op}: return_residual=True needs a residual")
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

    # ---- closed-form backward ops (what the VJPs below build; usable on their own) ----------
    def softmax_bwd(self, dy, y, axis: int = -1, log: bool = False):
        """dx of y = softmax(x, axis) from dy and y: y * (dy - sum(dy * y)); with ``log`` y is
        log_softmax(x, axis): dy - exp(y) * sum(dy). One row kernel (kernels/rows.py)."""
        op = "log_softmax_bwd" if log else "softmax_bwd"
        axis = self._row_op(op, y, axis)
        self._check(op, "dy", dy)
        _float(op, "dy", dy)
        if tuple(dy.shape) != tuple(y.shape):
            raise ValueError(f"{op}: dy must have y's shape {fmt(y.shape)}, got {fmt(dy.shape)}")
        dx = self._add("softmax_bwd", (self._f32(dy), self._f32(y)), y.shape, dt.F32,
                       kind="log_softmax" if log else "softmax", axis=axis)
        return dx if y.dtype == dt.F32 else self.cast(dx, y.dtype)

    def norm_bwd(self, kind: str, dy, x, gamma, beta=None, axis: int = -1, eps=None,
                 residual=None):
        """The gradients of y = kind(x, gamma, beta, axis, eps, residual) (kind "layer_norm" or
        "rms_norm") for dL/dy = dy: (dh, dgamma, dbeta or None), dh the gradient of x (and of
        the residual: the norm reads their sum). dh is one row pass (norm_bwd, which stores
        each row's mean and rstd on the side), dgamma / dbeta one column reduction over the
        rows (norm_param_bwd). rms_norm's dh is the full rstd * (g - xhat * mean(g * xhat)),
        g = dy * gamma, xhat = h * rstd: its -h * mean(g * h) / rms^3 term included."""
        if kind not in ("layer_norm", "rms_norm"):
            raise ValueError(f"norm_bwd: kind must be 'layer_norm' or 'rms_norm', got {kind!r}")
        op = f"{kind}_bwd"
        eps = (1e-5 if kind == "layer_norm" else 1e-6) if eps is None else eps
        axis = self._norm_args(op, x, gamma, beta, axis, eps, residual)
        self._check(op, "dy", dy)
        _float(op, "dy", dy)
        if tuple(dy.shape) != tuple(x.shape):
            raise ValueError(f"{op}: dy must have x's shape {fmt(x.shape)}, got {fmt(dy.shape)}")
        length = x.shape[axis]
        extra = (self._f32(residual),) if residual is not None else ()
        dy, xf = self._f32(dy), self._f32(x)
        dh = self._add("norm_bwd", (dy, xf, self._f32(gamma)) + extra, x.shape, dt.F32,
                       kind=kind, axis=axis, eps=float(eps), has_residual=bool(extra))
        rows = math.prod(x.shape) // max(1, length)
        stats = self._add("norm_bwd_stats", (dh,), (rows, 2), dt.F32)   # norm_bwd writes it
        pg = self._add("norm_param_bwd", (dy, xf) + extra + (stats,),
                       (1 + (beta is not None), length), dt.F32, axis=axis,
                       has_residual=bool(extra))
        dgamma = self.reshape(self.narrow(pg, 0, 0, 1), (length,))
        dbeta = self.reshape(self.narrow(pg, 0, 1, 1), (length,)) if beta is not None else None
        def back(t, like):   # half operands get half gradients
            return t if t is None or like.dtype == dt.F32 else self.cast(t, like.dtype)
        return back(dh, x), back(dgamma, gamma), back(dbeta, beta)


# ---- VJPs (ir/autodiff.py): the backward row kernels above ---------------------------------
@vjp("softmax", "log_softmax")
def _vjp_softmax(g, n, dy):
    """One softmax_bwd row kernel from dy and the forward's output."""
    return [g.softmax_bwd(dy, g.tensor(n.id), n.attrs["axis"], log=n.op == "log_softmax")]


def _zero_marker(g):
    """norm node id -> (the zero its residual_sum's VJP handed it, d residual_sum), from the
    residual_sum's VJP to the norm's, which runs next in the same grad() walk."""
    return g.__dict__.setdefault("_norm_residual_grads", {})


@vjp("residual_sum")
def _vjp_residual_sum(g, n, ds):
    """s = x + residual is no function of the norm's output it hangs on (its input only
    orders the kernels), so ds is kept for the norm's VJP, which adds it to d(x + residual).
    The norm is handed a zero gradient so that its VJP runs even when only s is used; the
    norm's VJP drops that zero again."""
    y = g.tensor(n.inputs[0])
    z = zeros(g, y.shape, y.dtype)
    _zero_marker(g)[y.id] = (z.id, g._f32(ds))
    return [z]


def _drop_marker(g, dy, zid):
    """dy without the residual_sum VJP's zero term (None when dy is that zero)."""
    if dy.id == zid:
        return None
    node = dy.node
    if node.op == "binary" and node.attrs["kind"] == "add" and zid in node.inputs:
        other = [i for i in node.inputs if i != zid]
        return g.tensor(other[0]) if other else None
    return dy


@vjp("layer_norm", "rms_norm")
def _vjp_norm(g, n, dy):
    """dh (h = x + residual) in one norm_bwd row pass, which also stores each row's (mean,
    rstd); d gamma and d beta in one norm_param_bwd column reduction from them. The gradient
    of a returned residual sum (return_residual=True) is added to dh."""
    x, gamma = g.tensor(n.inputs[0]), g.tensor(n.inputs[1])
    has_beta, has_res, axis = n.attrs["has_beta"], n.attrs["has_residual"], n.attrs["axis"]
    res = g.tensor(n.inputs[-1]) if has_res else None
    marked = _zero_marker(g).pop(n.id, None)
    if marked is not None:
        dy = _drop_marker(g, dy, marked[0])
    dh = dgamma = dbeta = None
    if dy is not None:
        beta = g.tensor(n.inputs[2]) if has_beta else None
        dh, dgamma, dbeta = g.norm_bwd(n.op, dy, x, gamma, beta, axis, n.attrs["eps"], res)
    if marked is not None:
        dh = marked[1] if dh is None else dh + marked[1]
    return [dh, dgamma] + ([dbeta] if has_beta else []) + ([dh] if has_res else [])
