"""sort and argsort: argsort's OpDef (ir/opdef.py), argument checks and the Graph builder
methods (mixed into Graph). The "argsort" node (kernels/sort.py, lowering
runtime/lower_sort.py) gives each row's stable order along the last axis as i64 (f32 / i32
rows; f16 / bf16 ones are ordered by their f32 cast, which is exact); values are
topk_values' row gather of those indices (whose VJP scatters the gradient back). A non-last
axis is moved last by a transpose and back."""
from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .opdef import EXACT, defop
from .ops import fmt


def _sortable(op, x, halves=False):
    ok = (dt.F32, dt.I32) + ((dt.F16, dt.BF16) if halves else ())
    if x.dtype not in ok:
        raise ValueError(f"{op}: x must be {', '.join(map(str, ok[:-1]))} or {ok[-1]}, got "
                         f"{x.dtype} {fmt(x.shape)}")
    if len(x.shape) == 0:
        raise ValueError(f"{op}: x must have at least one axis, got a scalar")


def infer_argsort(x, descending):
    """Each row's stable order along the last axis, i64."""
    _sortable("argsort", x)
    if x.shape[-1] >= 2**32:
        raise ValueError(f"argsort: an axis of {x.shape[-1]} is too long (at most 2^32 - 1)")
    if not isinstance(descending, bool):
        raise ValueError(f"argsort: descending must be a bool, got {descending!r}")
    return x.shape, dt.I64


defop("argsort", infer_argsort, dtype_rule=EXACT,
      doc="i64 stable sort order of each row along the last axis (NaN largest)")


class SortOps:
    """Builder methods; ``self`` is the Graph."""

    def _argsort_last(self, op, x, axis, descending):
        self.check(op, "x", x)
        _sortable(op, x, halves=True)
        rank = len(x.shape)
        if not isinstance(axis, (int, np.integer)) or not -rank <= axis < rank:
            raise ValueError(f"{op}: axis {axis!r} out of range for x {x.dtype} {fmt(x.shape)}")
        if x.shape[axis] >= 2**32:
            raise ValueError(f"{op}: an axis of {x.shape[axis]} is too long (at most 2^32 - 1)")
        axis = int(axis) % rank
        perm = None
        if axis != rank - 1:
            perm = [a for a in range(rank) if a != axis] + [axis]
            x = self.transpose(x, perm)
        # f16 / bf16 are ordered by their exact f32 values (the kernels sort f32 and i32);
        # the values are then gathered from x itself, in its dtype
        key = self.cast(x, "f32") if x.dtype in (dt.F16, dt.BF16) else x
        idx = self.bind("argsort", [key], descending=bool(descending))
        return x, idx, perm

    def _back(self, t, perm):
        return t if perm is None else self.transpose(t, [int(a) for a in np.argsort(perm)])

    def sort(self, x, axis: int = -1, descending: bool = False):
        """torch.sort(x, dim=axis, descending, stable=True) of f32, f16, bf16 or i32 x:
        (values in x's dtype, i64 indices); ties keep their order; NaN is the largest value
        (last ascending, first descending)."""
        xt, idx, perm = self._argsort_last("sort", x, axis, descending)
        vals = self.bind("topk_values", [xt, idx], k=xt.shape[-1])
        return self._back(vals, perm), self._back(idx, perm)

    def argsort(self, x, axis: int = -1, descending: bool = False):
        """torch.argsort(x, dim=axis, descending, stable=True): i64 indices."""
        _, idx, perm = self._argsort_last("argsort", x, axis, descending)
        return self._back(idx, perm)
