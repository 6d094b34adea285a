"""Row ops over one axis: softmax, log_softmax, layer_norm, rms_norm (the norms optionally
fused with a residual add), their closed-form backward ops (softmax_bwd, norm_bwd) and VJPs.
Kernels: kernels/rows.py; lowering: runtime/lower_norm.py.

x may be f32, f16 or bf16; the kernels read it in its own dtype, compute and accumulate in
f32 and round the result once to x's dtype (as torch's CUDA kernels do). An f64 x (every
operand f64) is built by the builders from f64 reductions and element-wise ops instead (no
row-kernel node: those compute in f32). The dtype rules
(checked with a ValueError naming op, argument, dtypes and shapes):

* the result, residual_sum and dx (norm_bwd's dh, softmax_bwd's dx): x's dtype;
* residual, dy (and softmax_bwd's y and dy): x's dtype;
* gamma: f32 or x's dtype (a bf16 model keeps bf16 norm weights, torch's autocast keeps them
  f32), beta gamma's dtype; d gamma / d beta (norm_param_bwd) in gamma's dtype;
* the row statistics (norm_bwd_stats' mean and rstd) f32.

With a half x and a residual, h = x + residual is rounded to x's dtype (the residual_sum a
stored sum would hold) before the norm reads it.
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .autodiff import vjp, zeros
from .opdef import F32, defop
from .ops import fmt, normalize_axis


def _float(op, arg, t):
    if not t.dtype.is_float:
        raise ValueError(f"{op}: {arg} must be a float tensor, got {t.dtype} {fmt(t.shape)}")


FLOATS = (dt.F32, dt.F16, dt.BF16)


# ---- inference (ir/opdef.py) and the dtype rules of the module docstring -------------------
def _x_operand(op, x):
    if x.dtype not in FLOATS:
        raise ValueError(f"{op}: x must be f32, f16 or bf16, got {x.dtype} {fmt(x.shape)}")


def _like_x(op, arg, t, x, xname="x"):
    """t (residual, dy) must have x's dtype."""
    if t.dtype != x.dtype:
        raise ValueError(f"{op}: {arg} must have {xname}'s dtype {x.dtype} ({xname} "
                         f"{fmt(x.shape)}), got {t.dtype} {fmt(t.shape)}")


def _param_dtype(op, x, gamma, beta):
    """gamma f32 or x's dtype, beta gamma's."""
    if gamma.dtype not in (dt.F32, x.dtype):
        raise ValueError(f"{op}: gamma must be f32 or x's dtype {x.dtype} (x {fmt(x.shape)}), "
                         f"got {gamma.dtype} {fmt(gamma.shape)}")
    if beta is not None and beta.dtype != gamma.dtype:
        raise ValueError(f"{op}: beta must have gamma's dtype {gamma.dtype}, got {beta.dtype} "
                         f"{fmt(beta.shape)}")


def _row_axis(op, x, axis):
    _x_operand(op, x)
    if len(x.shape) == 0:
        raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
    if not isinstance(axis, int) or not 0 <= axis < len(x.shape):
        raise ValueError(f"{op}: axis must be in [0, {len(x.shape)}) for x {fmt(x.shape)}, "
                         f"got {axis!r}")
    return axis


def _infer_row(op):
    def infer(x, axis):
        _row_axis(op, x, axis)
        return x.shape, x.dtype
    return infer


def _norm_operands(op, x, gamma, rest, axis, eps, has_beta, has_residual):
    """(beta or None, residual or None) of a norm's inputs [x, gamma, (beta), (residual)],
    checked."""
    _row_axis(op, x, axis)
    rest = list(rest)
    if len(rest) != has_beta + has_residual:
        raise ValueError(f"{op}: {2 + len(rest)} inputs do not match has_beta={has_beta}, "
                         f"has_residual={has_residual}")
    beta = rest.pop(0) if has_beta else None
    residual = rest.pop(0) if has_residual else None
    n = x.shape[axis]
    for arg, t in (("gamma", gamma), ("beta", beta)):
        if t is not None and tuple(t.shape) != (n,):
            raise ValueError(f"{op}: {arg} must have shape [{n}] (x {fmt(x.shape)} along axis "
                             f"{axis}), got {fmt(t.shape)}")
    _param_dtype(op, x, gamma, beta)
    if residual is not None:
        _like_x(op, "residual", residual, x)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{op}: residual must have x's shape {fmt(x.shape)}, got "
                             f"{fmt(residual.shape)}")
    if not isinstance(eps, float) or eps < 0:
        raise ValueError(f"{op}: eps must be a float >= 0, got {eps!r}")
    return beta, residual


def _infer_norm(op):
    def infer(x, gamma, *rest, axis, eps, has_beta, has_residual, return_residual=False):
        """The normed x; with ``return_residual`` also the x + residual its kernel computes
        (a residual_sum node the norm's kernel fills)."""
        _norm_operands(op, x, gamma, rest, axis, eps, has_beta, has_residual)
        if return_residual and not has_residual:
            raise ValueError(f"{op}: return_residual=True needs a residual")
        return [(x.shape, x.dtype)] * (2 if return_residual else 1)
    return infer


def further_result(op, producer):
    """The inference of an op that only ``producer``'s bind makes (its kernel fills it: a
    further result bound on its own would be filled by nothing)."""
    def infer(*inputs, **attrs):
        raise ValueError(f"{op}: a further result of {producer}: that op's bind makes it, "
                         f"not a bind of its own")
    return infer


def infer_softmax_bwd(dy, y, kind, axis):
    op = "softmax_bwd"
    if kind not in ("softmax", "log_softmax"):
        raise ValueError(f"{op}: kind must be 'softmax' or 'log_softmax', got {kind!r}")
    _row_axis(op, y, axis)
    _like_x(op, "dy", dy, y, "y")
    if tuple(dy.shape) != tuple(y.shape):
        raise ValueError(f"{op}: dy must have y's shape {fmt(y.shape)}, got {fmt(dy.shape)}")
    return y.shape, y.dtype


def _norm_rows(x, axis):
    return math.prod(x.shape) // max(1, x.shape[axis])


def infer_norm_bwd(dy, x, gamma, *rest, kind, axis, eps, has_residual):
    """dh (x's shape) and each row's (mean, rstd) [rows, 2] (norm_bwd_stats, its kernel's)."""
    if kind not in ("layer_norm", "rms_norm"):
        raise ValueError(f"norm_bwd: kind must be 'layer_norm' or 'rms_norm', got {kind!r}")
    op = f"{kind}_bwd"
    _norm_operands(op, x, gamma, rest, axis, eps, False, has_residual)
    _like_x(op, "dy", dy, x)
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"{op}: dy must have x's shape {fmt(x.shape)}, got {fmt(dy.shape)}")
    return [(x.shape, x.dtype), ((_norm_rows(x, axis), 2), dt.F32)]


def infer_norm_param_bwd(dy, x, *rest, axis, has_residual, has_beta, param_dtype="f32"):
    """d gamma (and d beta) [1 + has_beta, N] in ``param_dtype`` (gamma's: f32 or x's dtype)
    from dy, x (, residual) and norm_bwd's stats."""
    op = "norm_param_bwd"
    _row_axis(op, x, axis)
    if len(rest) != 1 + has_residual:
        raise ValueError(f"{op}: {2 + len(rest)} inputs do not match has_residual={has_residual}")
    if param_dtype not in ("f32", x.dtype.name):
        raise ValueError(f"{op}: param_dtype must be f32 or x's dtype {x.dtype} (x "
                         f"{fmt(x.shape)}), got {param_dtype!r}")
    for arg, t in (("dy", dy),) + ((("residual", rest[0]),) if has_residual else ()):
        _like_x(op, arg, t, x)
        if tuple(t.shape) != tuple(x.shape):
            raise ValueError(f"{op}: {arg} must have x's shape {fmt(x.shape)}, got "
                             f"{fmt(t.shape)}")
    stats = rest[-1]
    if tuple(stats.shape) != (_norm_rows(x, axis), 2) or stats.dtype != dt.F32:
        raise ValueError(f"{op}: stats must be f32 [{_norm_rows(x, axis)}, 2] (norm_bwd's of x "
                         f"{fmt(x.shape)}), got {stats.dtype} {fmt(stats.shape)}")
    return (1 + bool(has_beta), x.shape[axis]), dt.dtype(param_dtype)


defop("softmax", _infer_row("softmax"), dtype_rule=F32,
      doc="exp(x - max) / sum(exp(x - max)) along axis")
defop("log_softmax", _infer_row("log_softmax"), dtype_rule=F32,
      doc="x - max - log(sum(exp(x - max))) along axis")
for _op in ("layer_norm", "rms_norm"):
    defop(_op, _infer_norm(_op), dtype_rule=F32, results=(("residual_sum", None),),
          doc=f"{_op} of h = x (+ residual) along axis, * gamma (+ beta); return_residual=True "
              f"also gives h (residual_sum)")
defop("residual_sum", further_result("residual_sum", "layer_norm / rms_norm"), written_by=0,
      dtype_rule=F32, doc="the x + residual a norm's kernel computed (return_residual=True)")
defop("softmax_bwd", infer_softmax_bwd, dtype_rule=F32,
      doc="dx of softmax (y * (dy - sum(dy * y))) or log_softmax (dy - exp(y) * sum(dy))")
defop("norm_bwd", infer_norm_bwd, dtype_rule=F32, results=(("norm_bwd_stats", None),),
      doc="dh of layer_norm / rms_norm in one row pass, and each row's (mean, rstd)")
defop("norm_bwd_stats", further_result("norm_bwd_stats", "norm_bwd"), written_by=0,
      dtype_rule=F32, doc="each row's (mean, rstd), stored by norm_bwd's kernel")
defop("norm_param_bwd", infer_norm_param_bwd, dtype_rule=F32,
      doc="d gamma (and d beta) of a norm: one column reduction over the rows")


class NormOps:
    """Builder methods; ``self`` is the Graph."""

    def _row_op(self, op, x, axis, **attrs):
        self.check(op, "x", x)
        _float(op, "x", x)
        if len(x.shape) == 0:
            raise ValueError(f"{op}: x must have rank >= 1, got a scalar")
        axis = normalize_axis(op, "axis", axis, len(x.shape))
        return axis

    def softmax(self, x, axis: int = -1):
        """exp(x - max) / sum(exp(x - max)) along ``axis``."""
        axis = self._row_op("softmax", x, axis)
        if x.dtype == dt.F64:
            e = self.exp(x - self._row_max(x, axis))
            return e / self.reduce_sum(e, axis, keep_dim=True)
        return self.bind("softmax", [x], axis=axis)

    def log_softmax(self, x, axis: int = -1):
        """x - max - log(sum(exp(x - max))) along ``axis``."""
        axis = self._row_op("log_softmax", x, axis)
        if x.dtype == dt.F64:
            z = x - self._row_max(x, axis)
            return z - self.log(self.reduce_sum(self.exp(z), axis, keep_dim=True))
        return self.bind("log_softmax", [x], axis=axis)

    # f64 rows: the row kernels (kernels/rows.py) compute in f32, so an f64 softmax or norm is
    # built from f64 reductions and element-wise ops (which fuse); their VJPs are those ops'
    def _row_max(self, x, axis):
        """The row maxima, kept as dims, as a constant to grad (softmax is shift-invariant)."""
        return self.stop_gradient(self.reduce_max(x, axis, keep_dim=True))

    def _norm_f64(self, op, x, gamma, beta, axis, eps, residual):
        """(y, h) of an f64 norm from f64 ops; gamma / beta shaped to broadcast along axis."""
        h = x if residual is None else x + residual
        along = (x.shape[axis],) + (1,) * (len(x.shape) - 1 - axis)
        d = h - self.reduce_mean(h, axis, keep_dim=True) if op == "layer_norm" else h
        y = d * self.rsqrt(self.reduce_mean(d * d, axis, keep_dim=True) + float(eps))
        y = y * self.reshape(gamma, along)
        return (y if beta is None else y + self.reshape(beta, along)), h

    def _norm_args(self, op, x, gamma, beta, axis, eps, residual):
        """The checks of a norm's arguments; the axis, normalised."""
        axis = self._row_op(op, x, axis)
        n = x.shape[axis]
        for arg, t in (("gamma", gamma), ("beta", beta)):
            if t is None:
                if arg == "gamma":
                    raise ValueError(f"{op}: gamma is required")
                continue
            self.check(op, arg, t)
            _float(op, arg, t)
            if tuple(t.shape) != (n,):
                raise ValueError(f"{op}: {arg} must have shape [{n}] (x {fmt(x.shape)} along axis "
                                 f"{axis}), got {fmt(t.shape)}")
        if residual is not None:
            self.check(op, "residual", residual)
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
        if dt.F64 in (x.dtype, gamma.dtype, getattr(beta, "dtype", None),
                      getattr(residual, "dtype", None)):
            for arg, t in (("x", x), ("gamma", gamma), ("beta", beta), ("residual", residual)):
                if t is not None and t.dtype != dt.F64:
                    raise ValueError(f"{op}: f64 needs every operand f64 (x {x.dtype}), got "
                                     f"{arg} {t.dtype} {fmt(t.shape)}")
            y, h = self._norm_f64(op, x, gamma, beta, axis, eps, residual)
            return (y, h) if return_residual else y
        ins = [x, gamma] + ([beta] if beta is not None else [])
        if residual is not None:
            ins.append(residual)
        # return_residual is stored only when asked (printed graphs of plain norms unchanged)
        ys = self.bind(op, ins, axis=axis, eps=float(eps), has_beta=beta is not None,
                       has_residual=residual is not None,
                       **({"return_residual": True} if return_residual else {}))
        # (y, the x + residual the norm computed): a residual_sum node its kernel fills
        return tuple(ys) if return_residual else ys[0]

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
        self.check(op, "dy", dy)
        _float(op, "dy", dy)
        if tuple(dy.shape) != tuple(y.shape):
            raise ValueError(f"{op}: dy must have y's shape {fmt(y.shape)}, got {fmt(dy.shape)}")
        return self.bind("softmax_bwd", [dy, y], kind="log_softmax" if log else "softmax",
                         axis=axis)

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
        self.check(op, "dy", dy)
        _float(op, "dy", dy)
        if tuple(dy.shape) != tuple(x.shape):
            raise ValueError(f"{op}: dy must have x's shape {fmt(x.shape)}, got {fmt(dy.shape)}")
        length = x.shape[axis]
        extra = (residual,) if residual is not None else ()
        if beta is not None:
            _param_dtype(op, x, gamma, beta)
        # stats: each row's (mean, rstd), a norm_bwd_stats node norm_bwd's kernel fills
        dh, stats = self.bind("norm_bwd", (dy, x, gamma) + extra, kind=kind,
                              axis=axis, eps=float(eps), has_residual=bool(extra))
        # d gamma / d beta in gamma's dtype (the attr stored only when it is not f32)
        pdt = {} if gamma.dtype == dt.F32 else {"param_dtype": gamma.dtype.name}
        pg = self.bind("norm_param_bwd", (dy, x) + extra + (stats,), axis=axis,
                       has_residual=bool(extra), has_beta=beta is not None, **pdt)
        dgamma = self.reshape(self.narrow(pg, 0, 0, 1), (length,))
        dbeta = self.reshape(self.narrow(pg, 0, 1, 1), (length,)) if beta is not None else None
        return dh, dgamma, dbeta


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
    _zero_marker(g)[y.id] = (z.id, ds)
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
