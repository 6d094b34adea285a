"""Lowerings of reduce, argmax/argmin and cumsum (kernels in kernels/reduce.py).

reduce: the input's dims are collapsed (size-1 dims dropped, adjacent reduced or kept dims
merged), giving alternating kept/reduced blocks, e.g. [K0, R0, K1, R1]. Each reduced block is
one pass, innermost first: a row pass when it is last ([rows, n]), else a column pass over
[outer, r, inner] (threads on the contiguous inner positions, no transpose). Interleaved
reduced axes (axes (0, 2) of [A, B, C]) thus take two passes through a temporary of the
accumulator type (f32, f64 or i64), which only the last pass converts to the output dtype (and for
mean divides by the full count). A pass whose output cannot fill the GPU splits its reduced
extent across blocks into partials, combined by a second, small pass of the same kind.

Temporaries are small device arrays owned by the executable (``ctx.device_array``).
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import dtypes as dt
from ..kernels import reduce as K
from ..kernels.launch import SIM_BLOCK, col_geometry, grid_1d, pow2_at_least, row_geometry, sm_count
from ..device import SIMULATOR
from .lower import Step, elementwise_step, lowering, step_name

_U = np.uint64


def _ld(d: dt.DType) -> str:
    return d.name if d.is_float else "int"


def _acc(d: dt.DType) -> str:
    return ("f64" if d == dt.F64 else "f32") if d.is_float else "i64"


_ACC_LD = {"f32": "f32", "f64": "f64", "i64": "int"}
_ACC_NP = {"f32": np.float32, "f64": np.float64, "i64": np.int64}


def _store(d: dt.DType, mean: bool = False) -> str:
    if mean:
        return "mean_" + d.name
    return {"f32": "same", "f64": "same", "i64": "same", "f16": "f16", "bf16": "bf16", "i32": "i32",
            "bool": "bool", "u8": "same", "i8": "same", "i16": "same"}[d.name]   # (max / min
    # of a small int: the i64 accumulator holds one of x's values, stored as it is)


def _collapse(shape, axes):
    """[[size, reduced], ...] with size-1 dims dropped and neighbours of one kind merged."""
    dims = []
    for a, d in enumerate(shape):
        if d == 1:
            continue
        red = a in axes
        if dims and dims[-1][1] == red:
            dims[-1][0] *= d
        else:
            dims.append([d, red])
    return dims


def _fill_step(ctx, name, out, size, value, d: dt.DType):
    src = ctx.device_array(np.array([value], dtype=d.host).view(d.storage))
    blocks, threads = grid_1d(size)
    return Step(name, f"fill {value}", K.fill, (blocks,), (threads,), (out, src, _U(size)),
                {"bytes": size * d.itemsize})


def _cast_step(ctx, name, n, x):
    """Nothing to reduce: out = x converted to the output dtype."""
    return elementwise_step(name, ("cast", None, n.dtype, ("in", 0, x.dtype)), ctx.buf(n),
                            (n.size,), [ctx.buf(x)], [(n.size,)], [x.dtype])


def _tmp(ctx, size, acc):
    return ctx.device_array(np.empty(max(size, 1), _ACC_NP[acc]))


# ---- reduce ----------------------------------------------------------------------------------
def _row_pass(ctx, name, op, ld, st, acc, dst, src, rows, n, div, itemsize):
    """Reduce src [rows, n] over n into dst [rows] (two kernels when the rows are split)."""
    g, block, blocks, nseg, seg = row_geometry(rows, n)
    if nseg == 1:
        k = K.row_reduce(op, ld, st, acc, g, block)
        return [Step(name, f"reduce_rows g={g} [{rows}, {n}]", k, (blocks,), (block,),
                     (dst, src, _U(rows), _U(n), _U(n), _U(1), div),
                     {"bytes": rows * n * itemsize})]
    part = _tmp(ctx, rows * nseg, acc)
    k = K.row_reduce(op, ld, "same", acc, g, block)
    steps = [Step(name + " partials", f"reduce_rows g={g} [{rows}, {n}] in {nseg} segments", k,
                  (blocks,), (block,), (part, src, _U(rows * nseg), _U(n), _U(seg), _U(nseg), div),
                  {"bytes": rows * n * itemsize})]
    g2, block2, blocks2, _, _ = row_geometry(rows, nseg, split=False)
    k2 = K.row_reduce(op, _ACC_LD[acc], st, acc, g2, block2)
    steps.append(Step(name, f"reduce_rows g={g2} [{rows}, {nseg}] (partials)", k2, (blocks2,),
                      (block2,), (dst, part, _U(rows), _U(nseg), _U(nseg), _U(1), div),
                      {"bytes": rows * nseg * 8}))
    return steps


def _col_pass(ctx, name, op, ld, st, acc, dst, src, outer, r, inner, div, itemsize):
    """Reduce src [outer, r, inner] over r into dst [outer, inner]."""
    bx, by, nbx, bxs, nsplit, rchunk = col_geometry(outer, r, inner)
    nbytes = outer * r * inner * itemsize
    if nsplit == 1:
        k = K.col_reduce(op, ld, st, acc, bx, by)
        return [Step(name, f"reduce_cols {bx}x{by} [{outer}, {r}, {inner}]", k, (bxs, 1),
                     (bx * by,), (dst, src, _U(nbx), _U(nbx * outer), _U(r), _U(inner), _U(r),
                                  _U(1), div), {"bytes": nbytes})]
    part = _tmp(ctx, outer * nsplit * inner, acc)
    k = K.col_reduce(op, ld, "same", acc, bx, by)
    steps = [Step(name + " partials", f"reduce_cols {bx}x{by} [{outer}, {r}, {inner}] in "
                  f"{nsplit} chunks", k, (bxs, nsplit), (bx * by,),
                  (part, src, _U(nbx), _U(nbx * outer), _U(r), _U(inner), _U(rchunk), _U(nsplit),
                   div), {"bytes": nbytes})]
    bx2, by2, nbx2, bxs2, _, _ = col_geometry(outer, nsplit, inner, split=False)
    k2 = K.col_reduce(op, _ACC_LD[acc], st, acc, bx2, by2)
    steps.append(Step(name, f"reduce_cols {bx2}x{by2} [{outer}, {nsplit}, {inner}] (partials)",
                      k2, (bxs2, 1), (bx2 * by2,),
                      (dst, part, _U(nbx2), _U(nbx2 * outer), _U(nsplit), _U(inner), _U(nsplit),
                       _U(1), div), {"bytes": outer * nsplit * inner * 8}))
    return steps


_EMPTY = {"sum": 0, "prod": 1, "mean": math.nan}


@lowering("reduce")
def _lower_reduce(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    kind, axes = n.attrs["kind"], n.attrs["axes"]
    name = step_name(n)
    if n.size == 0:
        return []
    count = math.prod(x.shape[a] for a in axes)
    if count == 0:                  # max/min were refused when the graph was built
        return [_fill_step(ctx, name, ctx.buf(n), n.size, _EMPTY[kind], n.dtype)]
    dims = _collapse(x.shape, axes)
    if not any(red for _, red in dims):
        return [_cast_step(ctx, name, n, x)]
    op, acc = K.OPS[kind], _acc(x.dtype)
    div = (np.float64 if acc == "f64" else np.float32)(count)   # mean's count (f64 for f64)
    src, ld, itemsize = ctx.buf(x), _ld(x.dtype), x.dtype.itemsize
    steps = []
    while True:
        k = max(i for i, (_, red) in enumerate(dims) if red)
        final = sum(red for _, red in dims) == 1
        outer = math.prod(s for s, _ in dims[:k])
        r = dims[k][0]
        inner = math.prod(s for s, _ in dims[k + 1:])
        if final:
            dst, st = ctx.buf(n), _store(n.dtype, kind == "mean")
        else:
            dst, st = _tmp(ctx, outer * inner, acc), "same"
        pname = name if final else f"{name} pass {len(steps) + 1}"
        if inner == 1:
            steps += _row_pass(ctx, pname, op, ld, st, acc, dst, src, outer, r, div, itemsize)
        else:
            steps += _col_pass(ctx, pname, op, ld, st, acc, dst, src, outer, r, inner, div,
                               itemsize)
        if final:
            return steps
        src, ld, itemsize = dst, _ACC_LD[acc], np.dtype(_ACC_NP[acc]).itemsize
        del dims[k]
        if 0 < k < len(dims) and not dims[k - 1][1] and not dims[k][1]:
            dims[k - 1][0] *= dims.pop(k)[0]    # the kept neighbours are now adjacent


# ---- argmax / argmin -------------------------------------------------------------------------
@lowering("argmax", "argmin")
def _lower_argreduce(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    axes = n.attrs["axes"]
    name = step_name(n)
    if n.size == 0:
        return []
    r = math.prod(x.shape[a] for a in axes)
    if r == 1:
        return [_fill_step(ctx, name, ctx.buf(n), n.size, 0, n.dtype)]
    outer = math.prod(x.shape[:axes[0]])
    inner = math.prod(x.shape[axes[-1] + 1:])
    op, acc, ld = K.OPS[n.op], _acc(x.dtype), _ld(x.dtype)
    nbytes = x.size * x.dtype.itemsize + n.size * 8
    if inner == 1:
        out, xb = ctx.buf(n), ctx.buf(x)
        g, block, blocks, nseg, seg = row_geometry(outer, r)
        if nseg == 1:
            k = K.arg_rows(op, ld, acc, g, block, K.WHOLE)
            return [Step(name, f"{n.op}_rows g={g} [{outer}, {r}]", k, (blocks,), (block,),
                         (out, _tmp(ctx, 1, acc), xb, out, _U(outer), _U(r), _U(r), _U(1)),
                         {"bytes": nbytes})]
        # long rows, too few to fill the GPU: the best (value, index) of each segment, then
        # the best of those
        pv, pi = _tmp(ctx, outer * nseg, acc), _tmp(ctx, outer * nseg, "i64")
        k = K.arg_rows(op, ld, acc, g, block, K.PARTIAL)
        g2, block2, blocks2, _, _ = row_geometry(outer, nseg, split=False)
        k2 = K.arg_rows(op, _ACC_LD[acc], acc, g2, block2, K.COMBINE)
        return [Step(name + " partials", f"{n.op}_rows g={g} [{outer}, {r}] in {nseg} segments",
                     k, (blocks,), (block,),
                     (pi, pv, xb, pi, _U(outer * nseg), _U(r), _U(seg), _U(nseg)),
                     {"bytes": nbytes}),
                Step(name, f"{n.op}_rows g={g2} [{outer}, {nseg}] (partials)", k2, (blocks2,),
                     (block2,), (out, pv, pv, pi, _U(outer), _U(nseg), _U(nseg), _U(1)),
                     {"bytes": outer * nseg * 16})]
    bx, by, nbx, bxs, _, _ = col_geometry(outer, r, inner, split=False)
    k = K.arg_cols(op, ld, acc, bx, by)
    return [Step(name, f"{n.op}_cols {bx}x{by} [{outer}, {r}, {inner}]", k, (bxs,), (bx * by,),
                 (ctx.buf(n), ctx.buf(x), _U(nbx), _U(nbx * outer), _U(r), _U(inner)),
                 {"bytes": nbytes})]


# ---- cumsum ----------------------------------------------------------------------------------
SCAN_K = 128 if SIMULATOR else 8        # consecutive elements a thread scans per chunk


def scan_geometry(rows: int, n: int):
    """(g, block, blocks) of scan_rows: g threads a row (1: a thread scans a row alone)."""
    if SIMULATOR:   # barriers cost milliseconds there: few, long chunks
        g = 1 if n < 128 else min(8, pow2_at_least(-(-n // SCAN_K)))
        block = SIM_BLOCK
    else:
        g = 1 if n <= 16 else min(256, pow2_at_least(-(-n // SCAN_K)))
        block = max(g, 256)
    per_block = block // g
    cap = 2 if SIMULATOR else sm_count() * 8
    return g, block, max(1, min(-(-rows // per_block), cap))


@lowering("cumsum")
def _lower_cumsum(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    axis, excl = n.attrs["axis"], n.attrs["exclusive"]
    name = step_name(n)
    if n.size == 0:
        return []
    r = x.shape[axis]
    if r == 1:
        return [_fill_step(ctx, name, ctx.buf(n), n.size, 0, n.dtype) if excl
                else _cast_step(ctx, name, n, x)]
    outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1:])
    acc, ld, st = _acc(x.dtype), _ld(x.dtype), _store(n.dtype)
    nbytes = x.size * x.dtype.itemsize + n.size * n.dtype.itemsize
    if inner == 1:
        g, block, blocks = scan_geometry(outer, r)
        k = K.scan_rows(ld, st, acc, g, block, SCAN_K, excl)
        return [Step(name, f"cumsum_rows g={g} [{outer}, {r}]", k, (blocks,), (block,),
                     (ctx.buf(n), ctx.buf(x), _U(outer), _U(r)), {"bytes": nbytes})]
    blocks, threads = grid_1d(outer * inner)
    k = K.scan_cols(ld, st, acc, excl)
    return [Step(name, f"cumsum_cols [{outer}, {r}, {inner}]", k, (blocks,), (threads,),
                 (ctx.buf(n), ctx.buf(x), _U(outer * inner), _U(r), _U(inner)),
                 {"bytes": nbytes})]
