"""Lowerings of the shape ops (registered with lower.lowering).

transpose  collapsed first (size-1 axes dropped, axes that stay adjacent merged); then a flat
           copy (identity), ``copy_rows`` (the last axis stays last: whole rows move), or the
           shared-memory ``transpose_tiled`` (the last axis moves)
narrow     ``copy_rows`` over [outer, length * inner] rows
concat     one ``copy_rows`` per non-empty input into its column range of the output
expand     a generated element-wise copy with broadcasting (lower.elementwise_step)
gather     ``gather`` over [outer, indices, inner]; run()-fed indices are range-checked
scatter_add an element-wise copy of target, then atomic adds (``scatter_add``), or with
           ``deterministic`` adds in index order (``scatter_add_ordered``)
"""
from __future__ import annotations

import math

import numpy as np

from ..ir import dtypes as dt
from ..ir.ops import fmt
from ..kernels import shape as k
from ..kernels.launch import block_rows, grid_3d, waves_cap
from .lower import Step, elementwise_step, lowering, step_name

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
U = np.uint64


def _raw(ctx, node):
    """The node's flat storage as unsigned ints of its width (copies ignore values)."""
    return ctx.buf(node).view(_UINT[node.dtype.itemsize])


def _copy_step(name, ctx, node, src_node):
    """out = src broadcast to out's shape (NumPy rules), bit for bit: a generated element-wise
    kernel over the raw unsigned views. The i32 "cast" expression is only the template of a
    plain ``out[i] = in0[j]`` (no conversion code for a same-dtype cast); numba types it by the
    arrays' actual widths, so bf16 NaNs and bool bytes pass through untouched."""
    return elementwise_step(name, ("cast", None, dt.I32, ("in", 0, dt.I32)), _raw(ctx, node),
                            node.shape, [_raw(ctx, src_node)], [src_node.shape], [dt.I32])


def _strides(shape) -> list:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def split_dims(dims, *strides):
    """Index spaces for the kernels, which decompose a flat index over at most three dims
    (scalars: no table loads before the data loads). Returns [(bases, count, (d1, d2),
    strides3...)]: one entry per coordinate of the dims beyond the last three (usually a single
    entry), where bases[j] is that coordinate's offset under strides[j] and strides3[j] the
    last three strides (padded at the end with dims of 1)."""
    dims = list(dims)
    strides = [list(st) for st in strides]
    outer, inner = dims[:-3], dims[-3:]
    pad = 3 - len(inner)
    inner = inner + [1] * pad
    tails = [st[len(outer):] + [0] * pad for st in strides]
    out = []
    for coord in np.ndindex(*outer):
        bases = [sum(c * st[i] for i, c in enumerate(coord)) for st in strides]
        out.append((bases, math.prod(inner), (inner[1], inner[2]), *tails))
    return out


def copy_rows_steps(name, dst, src, ncols, dst_stride, src_off, rdims, rstrides, info=None):
    """``copy_rows`` launches: rows over rdims (src strides rstrides), ncols elements each, row
    r of dst at r * dst_stride (see the kernel)."""
    nrows = math.prod(rdims)
    if nrows * ncols == 0:
        return []
    tx, ty = block_rows(-(-ncols // k.SPAN))    # each thread takes SPAN elements of a row
    cap = waves_cap(tx * ty)
    parts = split_dims(rdims, rstrides, [st * dst_stride for st in _strides(rdims)])
    steps = []
    for (sb, db), count, (d1, d2), ss, _ in parts:
        gx = min(-(-ncols // (tx * k.SPAN)), cap)      # each thread moves SPAN elements a trip
        gy = min(-(-count // ty), max(1, cap // gx))
        args = (dst, src, U(count), U(ncols), U(db), U(dst_stride), U(src_off + sb), U(d1), U(d2),
                *(U(v) for v in ss))
        steps.append(Step(name if len(parts) == 1 else f"{name} @{db}", f"copy_rows {count}x{ncols}",
                          k.copy_rows, grid_3d(gx, gy), (tx, ty), args,
                          dict(info or {}, bytes=2 * count * ncols * dst.dtype.itemsize)))
    return steps


# ---- transpose ---------------------------------------------------------------------------------
def collapse_transpose(shape, perm):
    """(shape, perm) with size-1 axes dropped and axes that stay next to each other (in the
    same order) in both input and output merged. Returns the collapsed input shape and perm."""
    keep = [a for a in range(len(shape)) if shape[a] != 1]
    renum = {a: i for i, a in enumerate(keep)}
    s = [shape[a] for a in keep]
    p = [renum[a] for a in perm if shape[a] != 1]
    groups = []                              # runs of consecutive input axes, in output order
    for a in p:
        if groups and groups[-1][-1] + 1 == a:
            groups[-1].append(a)
        else:
            groups.append([a])
    order = sorted(range(len(groups)), key=lambda g: groups[g][0])   # groups in input order
    new_shape = [math.prod(s[a] for a in groups[g]) for g in order]
    pos = {g: i for i, g in enumerate(order)}
    return new_shape, [pos[g] for g in range(len(groups))]


@lowering("transpose")
def _lower_transpose(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    name = step_name(n)
    if n.size == 0:
        return []
    shape, perm = collapse_transpose(x.shape, n.attrs["perm"])
    r = len(shape)
    if perm == list(range(r)):              # nothing moves: a flat copy
        return [_copy_step(name, ctx, n, x)]
    src_st = _strides(shape)
    out_shape = [shape[p] for p in perm]
    dst_st = _strides(out_shape)
    info = {"collapsed": (tuple(shape), tuple(perm))}
    if perm[-1] == r - 1:                   # the last axis stays: rows of it move whole
        ncols = shape[-1]
        return copy_rows_steps(name, _raw(ctx, n), _raw(ctx, x), ncols, ncols, 0, out_shape[:-1],
                               [src_st[p] for p in perm[:-1]], info)
    na = shape[r - 1]                       # along src's contiguous axis
    pb = perm[r - 1]                        # src axis that becomes dst's contiguous axis
    nb = shape[pb]
    dst_sa = dst_st[perm.index(r - 1)]
    bdims, bsrc, bdst = [], [], []
    for i, p in enumerate(perm):            # the other axes, in output order, form the batch
        if p not in (r - 1, pb):
            bdims.append(shape[p])
            bsrc.append(src_st[p])
            bdst.append(dst_st[i])
    tiles_a, tiles_b = -(-na // k.TILE), -(-nb // k.TILE)
    parts = split_dims(bdims, bsrc, bdst)
    steps = []
    for (sb, db), nbatch, (d1, d2), ss, ts in parts:
        args = (_raw(ctx, n), _raw(ctx, x), U(na), U(nb), U(src_st[pb]), U(dst_sa), U(tiles_a),
                U(tiles_b), U(nbatch), U(d1), U(d2), *(U(v) for v in ss), *(U(v) for v in ts),
                U(sb), U(db))
        steps.append(Step(name if len(parts) == 1 else f"{name} @{db}",
                          f"transpose_tiled {nbatch}x{nb}x{na}", k.transpose_tiled,
                          grid_3d(tiles_a, tiles_b, nbatch), (k.TILE, k.ROWS), args,
                          dict(info, bytes=2 * nbatch * na * nb * n.dtype.itemsize)))
    return steps


def transpose_matrix(dst, src, rows: int, cols: int, stream) -> None:
    """dst[c, r] = src[r, c] for flat device arrays of one element width (f32, or f16 / bf16
    bits), now, on ``stream`` (set_param of a weight stored transposed, see
    lower_matmul.transposed_weights)."""
    z = U(0)
    ta, tb = -(-cols // k.TILE), -(-rows // k.TILE)
    raw = _UINT[dst.dtype.itemsize]
    k.transpose_tiled[grid_3d(ta, tb, 1), (k.TILE, k.ROWS), stream](
        dst.view(raw), src.view(raw), U(cols), U(rows), U(cols), U(rows), U(ta), U(tb),
        U(1), U(1), U(1), z, z, z, z, z, z, z, z)


# ---- narrow, concat, expand -----------------------------------------------------------------
@lowering("narrow")
def _lower_narrow(ctx, n):
    x = ctx.graph.nodes[n.inputs[0]]
    axis, start, length = n.attrs["axis"], n.attrs["start"], n.attrs["length"]
    outer = math.prod(x.shape[:axis])
    inner = math.prod(x.shape[axis + 1:])
    dim = x.shape[axis]
    return copy_rows_steps(step_name(n), _raw(ctx, n), _raw(ctx, x), length * inner,
                           length * inner, start * inner, [outer], [dim * inner])


@lowering("concat")
def _lower_concat(ctx, n):
    axis = n.attrs["axis"]
    outer = math.prod(n.shape[:axis])
    inner = math.prod(n.shape[axis + 1:])
    total = n.shape[axis] * inner
    steps, col = [], 0
    for j, i in enumerate(n.inputs):
        x = ctx.graph.nodes[i]
        w = x.shape[axis] * inner
        steps += copy_rows_steps(f"{step_name(n)} [{j}]", _raw(ctx, n)[col:], _raw(ctx, x), w,
                                 total, 0, [outer], [w])
        col += w
    return steps


@lowering("expand")
def _lower_expand(ctx, n):
    return [_copy_step(step_name(n), ctx, n, ctx.graph.nodes[n.inputs[0]])]


# ---- gather, scatter_add --------------------------------------------------------------------
def _index_geometry(nouter, nidx, inner):
    tx, ty = block_rows(-(-inner // k.SPAN))
    gx = -(-inner // (tx * k.SPAN))
    gy = -(-nidx // ty)
    cap = waves_cap(tx * ty)
    gx = min(gx, cap)
    gy = min(gy, max(1, cap // gx))
    gz = min(nouter, max(1, cap // (gx * gy)))
    return grid_3d(gx, gy, gz), (tx, ty)


def _check_indices(ctx, n, idx, dim, axis, what):
    ctx.add_index_check(idx, -dim, dim - 1,
                        f"{n.op} %{n.id} ({what} {fmt(ctx.graph.nodes[n.inputs[0]].shape)}, "
                        f"axis {axis})")


@lowering("gather")
def _lower_gather(ctx, n):
    table, idx = (ctx.graph.nodes[i] for i in n.inputs)
    axis = n.attrs["axis"]
    dim = table.shape[axis]
    _check_indices(ctx, n, idx, dim, axis, "table")
    if n.size == 0:
        return []
    nouter = math.prod(table.shape[:axis])
    inner = math.prod(table.shape[axis + 1:])
    grid, block = _index_geometry(nouter, idx.size, inner)
    args = (_raw(ctx, n), _raw(ctx, table), ctx.buf(idx), U(nouter), U(idx.size), U(inner), U(dim))
    return [Step(step_name(n), f"gather {nouter}x{idx.size}x{inner} of {dim}", k.gather, grid, block,
                 args, {"bytes": 2 * n.nbytes + idx.nbytes})]


@lowering("scatter_add")
def _lower_scatter_add(ctx, n):
    target, idx, upd = (ctx.graph.nodes[i] for i in n.inputs)
    axis = n.attrs["axis"]
    dim = target.shape[axis]
    _check_indices(ctx, n, idx, dim, axis, "target")
    if n.size == 0:
        return []
    steps = [_copy_step(step_name(n) + " copy", ctx, n, target)]
    nouter = math.prod(target.shape[:axis])
    inner = math.prod(target.shape[axis + 1:])
    if upd.size and n.attrs.get("deterministic"):
        tx = min(256, -(-inner // 32) * 32)
        gx, gz = -(-inner // tx), min(nouter, 65535)
        # ~1024 blocks, each scanning every index; its rows from the grid as launched (the
        # simulator's is 2 x 2 x 1)
        grid = grid_3d(gx, max(1, min(dim, 1024 // (gx * gz))), gz)
        rows_per = -(-dim // grid[1])
        args = (ctx.buf(n), ctx.buf(upd), ctx.buf(idx), U(nouter), U(idx.size), U(inner), U(dim),
                U(rows_per))
        steps.append(Step(step_name(n), f"scatter_add ordered {nouter}x{idx.size}x{inner} into "
                          f"{dim}", k.scatter_add_ordered, grid, (tx, 1), args, {"bytes": 3 * upd.nbytes + idx.nbytes}))
    elif upd.size:
        grid, block = _index_geometry(nouter, idx.size, inner)
        args = (ctx.buf(n), ctx.buf(upd), ctx.buf(idx), U(nouter), U(idx.size), U(inner), U(dim))
        steps.append(Step(step_name(n), f"scatter_add {nouter}x{idx.size}x{inner} into {dim}",
                          k.scatter_add, grid, block, args,
                          {"bytes": 3 * upd.nbytes + idx.nbytes}))
    return steps
