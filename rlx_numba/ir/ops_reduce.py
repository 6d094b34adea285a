"""Reductions: reduce (sum mean max min prod), argmax/argmin, cumsum.

Their OpDefs (ir/opdef.py), shape/dtype rules and the Graph builder methods (mixed into
Graph). Kernels: kernels/reduce.py; lowering: runtime/lower_reduce.py.

Dtypes follow PyTorch: sum/prod of bool/i32/i64 give i64, of a float the same float; mean gives
the same float (ints and bool: f32); max/min keep the dtype; argmax/argmin give i64; cumsum
keeps a float dtype and gives i64 for ints and bool. Floats accumulate in f32, f64 in f64.
``axes=None`` reduces every axis; ``axes=()`` reduces none (NumPy's rule: the result is x
converted to the result dtype).
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes as dt
from .autodiff import vjp
from .opdef import EXACT, defop
from .ops import fmt, normalize_axes, normalize_axis

REDUCE = ("sum", "mean", "max", "min", "prod")


def _keep_dim(op, keep_dim):
    if not isinstance(keep_dim, bool):
        raise ValueError(f"{op}: keep_dim must be a bool, got {keep_dim!r}")


def _out_shape(shape, axes, keep_dim):
    if keep_dim:
        return tuple(1 if a in axes else d for a, d in enumerate(shape))
    return tuple(d for a, d in enumerate(shape) if a not in axes)


def _axes_arg(op, axes):
    """axes as None, an int or a tuple (NumPy integers accepted), else a ValueError."""
    if axes is None:
        return None
    if isinstance(axes, np.integer):
        return int(axes)
    if isinstance(axes, int):
        return axes
    try:
        seq = tuple(axes)
    except TypeError:
        raise ValueError(f"{op}: axes must be an int, a sequence of ints or None, got "
                         f"{axes!r}") from None
    return tuple(int(a) if isinstance(a, np.integer) else a for a in seq)


def reduce_dtype(kind: str, d: dt.DType) -> dt.DType:
    if kind in ("sum", "prod"):
        return d if d.is_float else dt.I64
    if kind == "mean":
        return d if d.is_float else dt.F32
    return d


def no_fp8(op: str, x) -> None:
    """fp8 is a storage format for casts, element-wise ops, shape ops and scaled_matmul (as in
    torch): a reduction of it raises at build time, naming the op."""
    if x.dtype in dt.FP8:
        raise ValueError(f"{op}: x is {x.dtype} {fmt(x.shape)}; fp8 tensors take casts, "
                         f"element-wise and shape ops and scaled_matmul -- cast to f32 / bf16 "
                         f"first")


def reduce_axes(x, kind: str, axes, keep_dim: bool) -> tuple:
    """The normalised axes of reduce(kind, x, axes, keep_dim), checked."""
    if kind not in REDUCE:
        raise ValueError(f"reduce: unknown kind {kind!r}; expected one of {', '.join(REDUCE)}")
    op = f"reduce {kind}"
    no_fp8(op, x)
    _keep_dim(op, keep_dim)
    axes = normalize_axes(op, "axes", _axes_arg(op, axes), len(x.shape))
    count = math.prod(x.shape[a] for a in axes)
    if count == 0 and kind in ("max", "min"):
        raise ValueError(f"{op}: cannot reduce x {fmt(x.shape)} over axes {list(axes)}: the reduced "
                         f"extent is empty and {kind} has no identity")
    return axes


def infer_reduce(x, kind: str, axes, keep_dim: bool):
    axes = reduce_axes(x, kind, axes, keep_dim)
    return _out_shape(x.shape, axes, keep_dim), reduce_dtype(kind, x.dtype)


def argreduce_axes(x, op: str, axis, keep_dim: bool) -> tuple:
    """The axes of argmax/argmin over ``axis`` (None: the flattened tensor), checked."""
    _keep_dim(op, keep_dim)
    no_fp8(op, x)
    if axis is None:
        axes = tuple(range(len(x.shape)))
    else:
        axis = int(axis) if isinstance(axis, np.integer) else axis
        axes = (normalize_axis(op, "axis", axis, len(x.shape)),)
    if math.prod(x.shape[a] for a in axes) == 0:
        where = "" if axis is None else f" along axis {axis}"
        raise ValueError(f"{op}: x {fmt(x.shape)} is empty{where}; {op} of nothing is undefined")
    return axes


def _infer_argreduce(op: str):
    def infer(x, axes, keep_dim: bool):
        """The node's axes: one axis, or every axis (over the flattened tensor)."""
        axes = tuple(axes)
        if axes != tuple(range(len(x.shape))):
            if len(axes) != 1:
                raise ValueError(f"{op}: axes {axes} must be one axis or all of x "
                                 f"{fmt(x.shape)}'s")
            argreduce_axes(x, op, axes[0], keep_dim)
        else:
            argreduce_axes(x, op, None, keep_dim)
        return _out_shape(x.shape, axes, keep_dim), dt.I64
    return infer


def cumsum_axis(x, axis, exclusive: bool) -> int:
    if not isinstance(exclusive, bool):
        raise ValueError(f"cumsum: exclusive must be a bool, got {exclusive!r}")
    if len(x.shape) == 0:
        raise ValueError("cumsum: x must have rank >= 1, got a scalar")
    no_fp8("cumsum", x)
    axis = int(axis) if isinstance(axis, np.integer) else axis
    return normalize_axis("cumsum", "axis", axis, len(x.shape))


def infer_cumsum(x, axis, exclusive: bool):
    cumsum_axis(x, axis, exclusive)
    return x.shape, (x.dtype if x.dtype.is_float else dt.I64)


defop("reduce", infer_reduce, f64=True,
      doc="sum / mean / max / min / prod over axes (torch's result dtypes, f32 accumulation; "
          "f64 in f64)")
defop("argmax", _infer_argreduce("argmax"), dtype_rule=EXACT, f64=True,
      doc="i64 index of the largest value over one axis or all (first on ties, NaN largest)")
defop("argmin", _infer_argreduce("argmin"), dtype_rule=EXACT, f64=True,
      doc="i64 index of the smallest value over one axis or all (first on ties, NaN smallest)")
defop("cumsum", infer_cumsum, f64=True, doc="running sum along axis (exclusive: starting at 0)")


class ReduceOps:
    """Builder methods; ``self`` is the Graph (_check, bind).

    ``g.max``/``g.min`` are the element-wise binary ops, so the reductions are named
    ``reduce_sum reduce_mean reduce_max reduce_min reduce_prod`` (and ``sum``, ``mean``)."""

    def reduce(self, kind: str, x, axes=None, keep_dim: bool = False):
        """Reduce x over ``axes`` (int, sequence, or None for all) with sum/mean/max/min/prod."""
        self.check(f"reduce {kind}", "x", x)
        return self.bind("reduce", [x], kind=kind, axes=reduce_axes(x, kind, axes, keep_dim),
                         keep_dim=keep_dim)

    def reduce_sum(self, x, axes=None, keep_dim: bool = False):
        return self.reduce("sum", x, axes, keep_dim)

    def reduce_mean(self, x, axes=None, keep_dim: bool = False):
        return self.reduce("mean", x, axes, keep_dim)

    def reduce_max(self, x, axes=None, keep_dim: bool = False):
        return self.reduce("max", x, axes, keep_dim)

    def reduce_min(self, x, axes=None, keep_dim: bool = False):
        return self.reduce("min", x, axes, keep_dim)

    def reduce_prod(self, x, axes=None, keep_dim: bool = False):
        return self.reduce("prod", x, axes, keep_dim)

    sum = reduce_sum     # no clash: the element-wise ops are add/mul/max/min
    mean = reduce_mean

    def _argreduce(self, op, x, axis, keep_dim):
        self.check(op, "x", x)
        return self.bind(op, [x], axes=argreduce_axes(x, op, axis, keep_dim), keep_dim=keep_dim)

    def argmax(self, x, axis=None, keep_dim: bool = False):
        """i64 index of the largest value along ``axis`` (None: of the flattened x). The first
        one wins ties; NaN counts as the largest (the first NaN wins), like torch."""
        return self._argreduce("argmax", x, axis, keep_dim)

    def argmin(self, x, axis=None, keep_dim: bool = False):
        """i64 index of the smallest value along ``axis``; first on ties; NaN counts as smallest."""
        return self._argreduce("argmin", x, axis, keep_dim)

    def cumsum(self, x, axis: int, exclusive: bool = False):
        """Running sum along ``axis``; ``exclusive`` starts at 0 and leaves the element out."""
        self.check("cumsum", "x", x)
        return self.bind("cumsum", [x], axis=cumsum_axis(x, axis, exclusive),
                         exclusive=exclusive)


# ---- VJPs (ir/autodiff.py) ------------------------------------------------------------------------
def _kept(g, n, t):
    """A reduction's result (or its gradient) reshaped to keep_dim form: broadcasts over x."""
    x = g.tensor(n.inputs[0])
    return g.reshape(t, _out_shape(x.shape, n.attrs["axes"], True))


@vjp("reduce")
def _vjp_reduce(g, n, dy):
    """sum/mean: dy spread back; max/min: dy shared evenly by the elements equal to the result
    (torch's amax/amin); prod: the product of the others (zeros handled, as torch)."""
    x = g.tensor(n.inputs[0])
    if not x.dtype.is_float:
        return [None]
    k, axes = n.attrs["kind"], n.attrs["axes"]
    c = dt.compute_dtype(x.dtype)        # f32 (halves widened), or f64
    xf = x if x.dtype == c else g.cast(x, c)
    d = _kept(g, n, dy if dy.dtype == c else g.cast(dy, c))
    if k == "sum":
        dx = g.expand(d, x.shape)
    elif k == "mean":
        dx = g.expand(d * (1.0 / max(1, math.prod(x.shape[a] for a in axes))), x.shape)
    elif k in ("max", "min"):
        y = _kept(g, n, g.tensor(n.id) if n.dtype == c else g.cast(g.tensor(n.id), c))
        hit = g.cast(g.eq(xf, y), c)
        dx = hit * d / g.reduce_sum(hit, axes, keep_dim=True)
    else:       # prod: y / x where x != 0; at a zero the product of the others (0 if two zeros)
        zero = g.eq(xf, 0.0)
        others = g.reduce_prod(g.where(zero, 1.0, xf), axes, keep_dim=True)
        zeros = g.reduce_sum(g.cast(zero, c), axes, keep_dim=True)
        y = _kept(g, n, g.tensor(n.id) if n.dtype == c else g.cast(g.tensor(n.id), c))
        at_zero = g.where(g.eq(zeros, 1.0), others, 0.0)
        dx = d * g.where(zero, at_zero, y / g.where(zero, 1.0, xf))
    return [dx]


@vjp("cumsum")
def _vjp_cumsum(g, n, dy):
    """The reverse running sum of dy: its total minus the running sum that stops short."""
    x = g.tensor(n.inputs[0])
    if not x.dtype.is_float:
        return [None]
    axis = n.attrs["axis"]
    total = g.reduce_sum(dy, axis, keep_dim=True)
    return [total - g.cumsum(dy, axis, exclusive=not n.attrs["exclusive"])]
