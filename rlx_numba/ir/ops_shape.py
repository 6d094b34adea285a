"""shape ops: their OpDefs (ir/opdef.py), shape/dtype rules and the Graph builder methods
(mixed into Graph).

transpose, concat, expand, gather and scatter_add materialise their output (each node owns
contiguous memory); narrow is a view of its input when it is an aligned contiguous slice
(``narrow_aliases``), else a copy (or a strided view: runtime/lower.py ``strided_narrows``);
``reshape`` (a view) lives in ir/ops.py and graph.py.
"""
from __future__ import annotations

import math
import operator

from . import dtypes as dt
from ..memory import ALIGN
from .autodiff import scatter_grad, sum_to, vjp, zeros
from .opdef import F32_ONLY, STORAGE, VIEW, defop
from .ops import fmt

INDEX_DTYPES = (dt.I32, dt.I64)
SCATTER_DTYPES = (dt.F32, dt.I32, dt.I64, dt.F64)   # what cuda.atomic.add takes


def _int(op: str, arg: str, v) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{op}: {arg} must be an int, got {v!r}")
    try:
        return operator.index(v)
    except TypeError:
        raise ValueError(f"{op}: {arg} must be an int, got {v!r}") from None


def _axis(op: str, arg: str, axis, x, xname: str = "x") -> int:
    """A possibly negative axis of x as 0..rank-1, or a ValueError naming op, arg and shape."""
    axis = _int(op, arg, axis)
    rank = len(x.shape)
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: {arg} {axis} is out of range for {xname} {fmt(x.shape)} "
                         f"(rank {rank})")
    return axis % rank


def _ints(op: str, arg: str, seq) -> tuple:
    try:
        items = tuple(seq)
    except TypeError:
        raise ValueError(f"{op}: {arg} must be a sequence of ints, got {seq!r}") from None
    return tuple(_int(op, f"{arg} entry", v) for v in items)


# ---- shape rules (each op's arguments checked and normalised, then its inference) ----------
def transpose_perm(x, perm=None) -> tuple:
    """perm as non-negative axes (output axis i is input axis perm[i]); None reverses them."""
    rank = len(x.shape)
    if perm is None:
        return tuple(range(rank - 1, -1, -1))
    raw = _ints("transpose", "perm", perm)
    if len(raw) != rank:
        raise ValueError(f"transpose: perm {list(raw)} has {len(raw)} axes but x "
                         f"{fmt(x.shape)} has rank {rank}")
    for p in raw:
        if not -rank <= p < rank:
            raise ValueError(f"transpose: perm {list(raw)} holds axis {p}, out of range for "
                             f"x {fmt(x.shape)} (rank {rank})")
    perm = tuple(p % rank for p in raw)
    if len(set(perm)) != rank:
        raise ValueError(f"transpose: perm {list(raw)} is not a permutation of the axes of "
                         f"x {fmt(x.shape)}")
    return perm


def infer_transpose(x, perm):
    return tuple(x.shape[p] for p in transpose_perm(x, perm)), x.dtype


def narrow_args(x, axis, start, length) -> tuple:
    """(axis, start, length) of x's elements start..start+length-1 along axis, checked."""
    if len(x.shape) == 0:
        raise ValueError("narrow: x must have rank >= 1, got []")
    axis = _axis("narrow", "axis", axis, x)
    start = _int("narrow", "start", start)
    length = _int("narrow", "length", length)
    dim = x.shape[axis]
    if start < 0 or length < 0 or start + length > dim:
        raise ValueError(f"narrow: start {start} and length {length} must satisfy 0 <= start, "
                         f"0 <= length, start + length <= {dim} (axis {axis} of x {fmt(x.shape)})")
    return axis, start, length


def infer_narrow(x, axis, start, length):
    axis, start, length = narrow_args(x, axis, start, length)
    shape = list(x.shape)
    shape[axis] = length
    return tuple(shape), x.dtype


def narrow_layout(node, graph) -> tuple:
    """(offset, rows, row length, row stride) in elements of a narrow inside its input's
    contiguous storage: the input is [rows, dim * inner], the slice [rows, length * inner]."""
    x = graph.nodes[node.inputs[0]]
    axis, start, length = node.attrs["axis"], node.attrs["start"], node.attrs["length"]
    inner = math.prod(x.shape[axis + 1:])
    return start * inner, math.prod(x.shape[:axis]), length * inner, x.shape[axis] * inner


def narrow_contiguous(node, graph) -> bool:
    """The narrow is one contiguous run of its input (one row, or the whole rows)."""
    _, rows, width, stride = narrow_layout(node, graph)
    return rows <= 1 or width == stride


def narrow_aliases(node, graph) -> bool:
    """narrow's view_if: a contiguous slice at an ALIGN-multiple byte offset into its input,
    which every kernel and cuBLAS may read as its own buffer."""
    off = narrow_layout(node, graph)[0] * node.dtype.storage.itemsize
    return narrow_contiguous(node, graph) and off % ALIGN == 0


def concat_axis(xs, axis) -> int:
    """xs joined along axis; every other dim, the rank and the dtype must match."""
    first = xs[0]
    if len(first.shape) == 0:
        raise ValueError("concat: xs[0] must have rank >= 1, got []")
    axis = _axis("concat", "axis", axis, first, "xs[0]")
    for i, t in enumerate(xs):
        if len(t.shape) != len(first.shape):
            raise ValueError(f"concat: xs[{i}] {fmt(t.shape)} has rank {len(t.shape)} but xs[0] "
                             f"{fmt(first.shape)} has rank {len(first.shape)}")
        if t.dtype != first.dtype:
            raise ValueError(f"concat: xs[{i}] is {t.dtype} {fmt(t.shape)} but xs[0] is "
                             f"{first.dtype} {fmt(first.shape)}; cast them to one dtype first")
        for a, (d0, d) in enumerate(zip(first.shape, t.shape)):
            if a != axis and d0 != d:
                raise ValueError(f"concat: xs[{i}] {fmt(t.shape)} does not match xs[0] "
                                 f"{fmt(first.shape)} on axis {a} (only axis {axis} may differ)")
    return axis


def infer_concat(*xs, axis):
    axis = concat_axis(xs, axis)
    shape = list(xs[0].shape)
    shape[axis] = sum(t.shape[axis] for t in xs)
    return tuple(shape), xs[0].dtype


def infer_expand(x, shape):
    """NumPy broadcast_to: x's dims align to the right of shape; a dim of 1 may grow, -1 keeps
    x's dim (not allowed on the new leading dims)."""
    target = _ints("expand", "shape", shape)
    rank, new = len(x.shape), len(target)
    if new < rank:
        raise ValueError(f"expand: shape {list(target)} has fewer dims than x {fmt(x.shape)}")
    out = []
    for i, d in enumerate(target):
        j = i - (new - rank)       # x's axis, or < 0 for a new leading dim
        if j < 0:
            if d < 0:
                raise ValueError(f"expand: shape {list(target)} has {d} at new leading axis {i}; "
                                 f"-1 only keeps one of x's dims (x {fmt(x.shape)})")
            out.append(d)
            continue
        have = x.shape[j]
        if d == -1:
            d = have
        elif d < 0:
            raise ValueError(f"expand: shape {list(target)} has a negative dim {d}")
        if have != d and have != 1:
            raise ValueError(f"expand: cannot expand x {fmt(x.shape)} to {list(target)}: axis {j} "
                             f"of x is {have}, not 1 or {d}")
        out.append(d)
    return tuple(out), x.dtype


def _index_operand(op, indices):
    if indices.dtype not in INDEX_DTYPES:
        raise ValueError(f"{op}: indices must be i32 or i64, got {indices.dtype} "
                         f"{fmt(indices.shape)}")


def gather_axis(table, indices, axis) -> int:
    if len(table.shape) == 0:
        raise ValueError("gather: table must have rank >= 1, got []")
    axis = _axis("gather", "axis", axis, table, "table")
    _index_operand("gather", indices)
    return axis


def infer_gather(table, indices, axis=0):
    """out = table.shape[:axis] + indices.shape + table.shape[axis+1:], dtype of table."""
    axis = gather_axis(table, indices, axis)
    shape = tuple(table.shape[:axis]) + tuple(indices.shape) + tuple(table.shape[axis + 1:])
    if table.shape[axis] == 0 and math.prod(shape):
        raise ValueError(f"gather: table {fmt(table.shape)} is empty along axis {axis}, so no "
                         f"index of indices {fmt(indices.shape)} can be valid")
    return shape, table.dtype


def scatter_axis(target, indices, updates, axis) -> int:
    """out = target, then out[..., indices[j], ...] += updates[..., j, ...] along axis."""
    if len(target.shape) == 0:
        raise ValueError("scatter_add: target must have rank >= 1, got []")
    axis = _axis("scatter_add", "axis", axis, target, "target")
    if target.dtype not in SCATTER_DTYPES:
        raise ValueError(f"scatter_add: target is {target.dtype} {fmt(target.shape)}; atomic add "
                         f"supports f32, i32 and i64 only (and f64), so cast it first")
    _index_operand("scatter_add", indices)
    if len(indices.shape) != 1:
        raise ValueError(f"scatter_add: indices must be 1-D, got {fmt(indices.shape)}")
    if updates.dtype != target.dtype:
        raise ValueError(f"scatter_add: updates is {updates.dtype} {fmt(updates.shape)} but target "
                         f"is {target.dtype} {fmt(target.shape)}; they must match")
    want = tuple(target.shape[:axis]) + tuple(indices.shape) + tuple(target.shape[axis + 1:])
    if tuple(updates.shape) != want:
        raise ValueError(f"scatter_add: updates must be {fmt(want)} (target {fmt(target.shape)} with "
                         f"axis {axis} replaced by indices {fmt(indices.shape)}), got "
                         f"{fmt(updates.shape)}")
    if target.shape[axis] == 0 and math.prod(want):
        raise ValueError(f"scatter_add: target {fmt(target.shape)} is empty along axis {axis}, so "
                         f"no index of indices {fmt(indices.shape)} can be valid")
    return axis


def infer_scatter_add(target, indices, updates, axis=0, deterministic=False):
    if not isinstance(deterministic, bool):
        raise ValueError(f"scatter_add: deterministic must be a bool, got {deterministic!r}")
    scatter_axis(target, indices, updates, axis)
    return tuple(target.shape), target.dtype


defop("transpose", infer_transpose, dtype_rule=STORAGE,
      doc="x's axes permuted (perm), materialised")
defop("narrow", infer_narrow, memory=VIEW, view_if=narrow_aliases, dtype_rule=STORAGE,
      doc="x[start:start+length] along axis: a view when an aligned contiguous slice")
defop("concat", infer_concat, dtype_rule=STORAGE, doc="its inputs joined along axis")
defop("expand", infer_expand, dtype_rule=STORAGE,
      doc="x broadcast to shape (NumPy broadcast_to), materialised")
defop("gather", infer_gather, dtype_rule=STORAGE,
      doc="table's slices along axis at i32/i64 indices")
defop("scatter_add", infer_scatter_add, dtype_rule=F32_ONLY, f64=True,
      doc="target with updates added at indices along axis (atomic, or ordered: deterministic)")


class ShapeOps:
    """Builder methods; self is the Graph (_check, bind)."""

    def transpose(self, x, perm=None):
        """Permute the axes: output axis i is x's axis perm[i] (negative allowed); perm None
        reverses them."""
        self.check("transpose", "x", x)
        return self.bind("transpose", [x], perm=transpose_perm(x, perm))

    def narrow(self, x, axis: int, start: int, length: int):
        """x[..., start:start+length, ...] along axis (0 <= start, start + length <= dim)."""
        self.check("narrow", "x", x)
        axis, start, length = narrow_args(x, axis, start, length)
        return self.bind("narrow", [x], axis=axis, start=start, length=length)

    def concat(self, xs, axis: int):
        """Join one or more tensors of one rank and dtype along axis."""
        if not isinstance(xs, (list, tuple)) or not xs:
            raise ValueError(f"concat: xs must be a non-empty list of Tensors, got {xs!r}")
        for i, t in enumerate(xs):
            self.check("concat", f"xs[{i}]", t)
        return self.bind("concat", xs, axis=concat_axis(xs, axis))

    def expand(self, x, shape):
        """Broadcast x to shape (NumPy broadcast_to; -1 keeps a dim), materialised."""
        self.check("expand", "x", x)
        return self.bind("expand", [x], shape=infer_expand(x, shape)[0])

    def gather(self, table, indices, axis: int = 0):
        """table's slices along axis at indices (i32/i64): out shape table.shape[:axis] +
        indices.shape + table.shape[axis+1:]. Negative indices wrap; indices fed to run() are
        range-checked there (IndexError); in-graph and device-array indices are clamped."""
        self.check("gather", "table", table)
        self.check("gather", "indices", indices)
        return self.bind("gather", [table, indices], axis=gather_axis(table, indices, axis))

    def scatter_add(self, target, indices, updates, axis: int = 0, deterministic: bool = False):
        """A copy of target with updates[..., j, ...] added at target[..., indices[j], ...]
        along axis (torch.index_add / np.add.at). indices 1-D i32/i64, negative wrap, repeats
        accumulate: atomically (f32 sums may differ in the last bits from run to run), or with
        ``deterministic`` in index order, np.add.at's, the same bits every run (each block
        owns a range of target rows and scans every index: slower with many rows).
        target f32, i32 or i64. Indices fed to run() are range-checked there (IndexError);
        out-of-range in-graph or device-array indices are dropped."""
        if not isinstance(deterministic, bool):
            raise ValueError(f"scatter_add: deterministic must be a bool, got {deterministic!r}")
        self.check("scatter_add", "target", target)
        self.check("scatter_add", "indices", indices)
        self.check("scatter_add", "updates", updates)
        axis = scatter_axis(target, indices, updates, axis)
        extra = {"deterministic": True} if deterministic else {}    # (printed only when set)
        return self.bind("scatter_add", [target, indices, updates], axis=axis, **extra)


# ---- VJPs (ir/autodiff.py) -----------------------------------------------------------------------
@vjp("transpose")
def _vjp_transpose(g, n, dy):
    """dy moved back by the inverse permutation."""
    perm = n.attrs["perm"]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return [g.transpose(dy, inv)]


@vjp("narrow")
def _vjp_narrow(g, n, dy):
    """dy in its slice of a zero tensor of x's shape: zeros before and after, concatenated
    (no zero block is built where the slice touches an end)."""
    x = g.tensor(n.inputs[0])
    axis, start, length = n.attrs["axis"], n.attrs["start"], n.attrs["length"]
    parts = []
    for size in (start, None, x.shape[axis] - start - length):
        if size is None:
            parts.append(dy)
        elif size:
            shape = list(x.shape)
            shape[axis] = size
            parts.append(zeros(g, shape, dy.dtype))
    return [g.concat(parts, axis) if len(parts) > 1 else g.reshape(dy, x.shape)]


@vjp("concat")
def _vjp_concat(g, n, dy):
    """Each input's slice of dy."""
    axis, off, out = n.attrs["axis"], 0, []
    for i in n.inputs:
        length = g.nodes[i].shape[axis]
        out.append(g.narrow(dy, axis, off, length) if g.nodes[i].dtype.is_float else None)
        off += length
    return out


@vjp("expand")
def _vjp_expand(g, n, dy):
    """dy summed over the broadcast axes, back to x's shape."""
    return [sum_to(g, dy, g.tensor(n.inputs[0]).shape)]


def _flat_indices(g, n):
    idx = g.tensor(n.inputs[1])
    return g.reshape(idx, (math.prod(idx.shape),)) if len(idx.shape) != 1 else idx


@vjp("gather")
def _vjp_gather(g, n, dy):
    """d table: dy scatter-added into zeros at the gathered rows (np.add.at), so an index
    that appears several times collects every one of its rows. The adds are atomic f32 adds
    (f64 ones for an f64 table; with repeated indices the sum's order, so its last bits, may differ from run to run)
    unless grad(..., deterministic=True): then in index order. Negative indices
    wrap as in the forward; an out-of-range in-graph index, which the forward clamps, gets
    no gradient (scatter_add drops it)."""
    table, idx = g.tensor(n.inputs[0]), g.tensor(n.inputs[1])
    axis = n.attrs["axis"]
    flat = _flat_indices(g, n)
    acc = dt.compute_dtype(table.dtype)      # f32 adds (halves widened), f64 ones for f64
    upd = g.reshape(dy if dy.dtype == acc else g.cast(dy, acc),
                    tuple(table.shape[:axis]) + (math.prod(idx.shape),)
                    + tuple(table.shape[axis + 1:]))
    return [scatter_grad(g, zeros(g, table.shape, acc), flat, upd, axis), None]


@vjp("scatter_add")
def _vjp_scatter_add(g, n, dy):
    """d target = dy; d updates = dy gathered at the indices (each update was added once)."""
    target = g.tensor(n.inputs[0])
    if not target.dtype.is_float:
        return [None, None, None]
    return [dy, None, g.gather(dy, g.tensor(n.inputs[1]), n.attrs["axis"])]
