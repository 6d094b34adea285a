"""Lowerings of softmax, log_softmax, layer_norm, rms_norm and their backward ops
softmax_bwd, norm_bwd, norm_param_bwd (kernels/rows.py). Each kernel is built for its
operands' storage kinds (kernels/halfio.py): x's (and dy's) and gamma's."""
from __future__ import annotations

import math

import numpy as np

from ..kernels import rows
from ..kernels.halfio import io_kind
from ..kernels.launch import sm_count
from ..device import SIMULATOR
from .lower import Step, lowering, step_name


def _dummy(ctx, dtype=None):
    """A one-element stand-in for an absent operand, in that operand's storage dtype (a kernel
    compiled for bf16 x then sees uint16 wherever it would have seen x's dtype)."""
    if dtype is None or dtype.storage == np.float32:
        return ctx.shared("rows_dummy", lambda: np.zeros(1, np.float32))
    return ctx.shared(f"rows_dummy_{dtype}", lambda: np.zeros(1, dtype.storage))


@lowering("softmax", "log_softmax", "layer_norm", "rms_norm")
def _lower_rows(ctx, n):
    g = ctx.graph
    x = g.nodes[n.inputs[0]]
    if x.size == 0:
        return []
    kind = rows.KINDS[n.op]
    norm = kind in (rows.LAYER_NORM, rows.RMS_NORM)
    xk = io_kind(x.dtype)
    gk = io_kind(g.nodes[n.inputs[1]].dtype) if norm else "f32"
    gamma = beta = _dummy(ctx)
    res = sum_out = _dummy(ctx, x.dtype)
    has_beta = has_res = write_sum = False
    eps = np.float32(n.attrs.get("eps", 0.0))
    if norm:
        ins = list(n.inputs[1:])
        gamma = ctx.buf(ins.pop(0))
        beta = _dummy(ctx, g.nodes[n.inputs[1]].dtype)
        if n.attrs["has_beta"]:
            beta, has_beta = ctx.buf(ins.pop(0)), True
        if n.attrs["has_residual"]:
            res, has_res = ctx.buf(ins.pop(0)), True
        for r in g.nodes[n.id].results:   # a live residual_sum: the kernel stores x + residual
            if r in ctx.live:
                sum_out, write_sum = ctx.buf(r), True
    axis = n.attrs["axis"]
    shape = x.shape
    outer, length, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    flags = (has_beta, has_res, write_sum)
    args = [ctx.buf(n), ctx.buf(x), gamma, beta, res, sum_out]
    info = {"bytes": _bytes(x.size, x.dtype.itemsize, flags)}
    name = step_name(n)
    if inner == 1:
        return _row_steps(name, kind, flags, args, outer, length, eps, xk, gk, info)
    threads = 32 if SIMULATOR else 256
    blocks = max(1, min(-(-(outer * inner) // threads), 2 if SIMULATOR else sm_count() * 8))
    k = rows.cols(kind, *flags, xk, gk)
    return [Step(name, "rows_cols", k, (blocks,), (threads,),
                 (*args, outer, length, inner, eps), info)]


def _bytes(size, itemsize, flags):
    _, has_res, write_sum = flags
    return itemsize * size * (2 + has_res + write_sum)


def _row_steps(name, kind, flags, args, outer, length, eps, xk, gk, info):
    """The one step of a row op along contiguous rows (the register kernel where the row fits,
    else the looping one)."""
    plan = rows.row_plan(length, kind in (rows.SOFTMAX, rows.LOG_SOFTMAX))
    if plan is not None:
        gsize, vpt, block, prefetch, per_sm = plan
        rpb = block // gsize
        blocks = min(-(-outer // rpb), 2 if SIMULATOR else sm_count() * per_sm)
        k = rows.rows_reg(kind, gsize, vpt, block, *flags, prefetch, gsize * vpt == length,
                          xk, gk)
        return [Step(name, f"rows_reg g={gsize} vpt={vpt}{' prefetch' if prefetch else ''}",
                     k, (blocks,), (block,),
                     (*args, np.uint64(outer), np.uint64(length), eps), info)]
    block = 32 if SIMULATOR else rows.LOOP_BLOCK
    blocks = min(outer, 2 if SIMULATOR else sm_count() * 2 * (1024 // block))
    # keep the row's head on chip when that saves a good share of pass 2 (on an H200 it
    # lifted 32k-column softmax from 0.89 to 0.92 of torch and hurt 128k-column rms_norm)
    cached = rows.LOOP_CACHED if length <= 4 * rows.LOOP_CACHED else 0
    k = rows.rows_loop(kind, block, rows.LOOP_UNROLL, cached, *flags, xk, gk)
    return [Step(name, f"rows_loop unroll={rows.LOOP_UNROLL}", k, (blocks,), (block,),
                 (*args, np.uint64(outer), np.uint64(length), eps), info)]


def rms_norm_steps(ctx, name, out, x, gamma, outer, length, eps, x_dtype, g_dtype) -> list:
    """rms_norm of the ``outer`` contiguous rows of ``length`` in device array ``x`` (of
    x_dtype) with ``gamma`` (of g_dtype) into ``out``: for a product with a norm prologue
    (passes/fusion.py) on a tier that does not take it."""
    dx = _dummy(ctx, x_dtype)
    flags = (False, False, False)
    return _row_steps(name, rows.RMS_NORM, flags, [out, x, gamma, _dummy(ctx, g_dtype), dx, dx],
                      outer, length, np.float32(eps), io_kind(x_dtype), io_kind(g_dtype),
                      {"bytes": _bytes(outer * length, x_dtype.itemsize, flags)})


@lowering("residual_sum")
def _lower_residual_sum(ctx, n):
    return []   # written by the norm's kernel (see _lower_rows)


# ---- backward row ops (ir/ops_norm.py VJPs; kernels at the end of kernels/rows.py) -----------
def _bwd_geometry(shape, axis):
    """(outer, n, inner, rowwise, grid, block, group) of a backward row kernel over ``axis``:
    rows of the last axis get ``group`` threads each (rows.bwd_group), block // group rows a
    block, the grid striding over the rest; other axes one thread a column."""
    outer, n, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    block = 32 if SIMULATOR else 256
    cap = 2 if SIMULATOR else sm_count() * 8
    if inner == 1:
        group = rows.bwd_group(n, block)
        return outer, n, inner, True, max(1, min(-(-outer // (block // group)), cap)), block, group
    return outer, n, inner, False, max(1, min(-(-(outer * inner) // block), cap)), block, 1


@lowering("softmax_bwd")
def _lower_softmax_bwd(ctx, n):
    dy, y = (ctx.graph.nodes[i] for i in n.inputs)
    if y.size == 0:
        return []
    outer, length, inner, rowwise, grid, block, group = _bwd_geometry(y.shape, n.attrs["axis"])
    k = rows.softmax_bwd(rows.KINDS[n.attrs["kind"]], block, group, rowwise, io_kind(y.dtype))
    label = f"softmax_bwd rows g={group}" if rowwise else "softmax_bwd cols"
    return [Step(step_name(n), label, k, (grid,),
                 (block,), (ctx.buf(n), ctx.buf(dy), ctx.buf(y), np.int64(outer),
                            np.int64(length), np.int64(inner)), {"bytes": 5 * y.nbytes})]


@lowering("norm_bwd")
def _lower_norm_bwd(ctx, n):
    g = ctx.graph
    dy, x, gamma = (g.nodes[i] for i in n.inputs[:3])
    if x.size == 0:
        return []
    has_res = n.attrs["has_residual"]
    res = ctx.buf(n.inputs[3]) if has_res else _dummy(ctx, x.dtype)
    stats, write = _dummy(ctx), False
    for r in g.nodes[n.id].results:   # a live norm_bwd_stats: the kernel stores each row's stats
        if r in ctx.live:
            stats, write = ctx.buf(r), True
    outer, length, inner, rowwise, grid, block, group = _bwd_geometry(x.shape, n.attrs["axis"])
    k = rows.norm_bwd(rows.KINDS[n.attrs["kind"]], block, group, rowwise, has_res, write,
                      io_kind(x.dtype), io_kind(gamma.dtype))
    label = f"norm_bwd rows g={group}" if rowwise else "norm_bwd cols"
    return [Step(step_name(n), label, k, (grid,), (block,),
                 (ctx.buf(n), stats, ctx.buf(dy), ctx.buf(x), ctx.buf(gamma), res,
                  np.int64(outer), np.int64(length), np.int64(inner),
                  np.float32(n.attrs["eps"])),
                 {"bytes": x.nbytes * (5 + 2 * has_res)})]


@lowering("norm_bwd_stats")
def _lower_norm_bwd_stats(ctx, n):
    return []   # written by the norm_bwd kernel (see _lower_norm_bwd)


@lowering("norm_param_bwd")
def _lower_norm_param_bwd(ctx, n):
    """Partial column sums over P row chunks (a grid of 32-column tiles x P, enough blocks to
    fill the GPU), then one kernel adding the chunks; P = 1 writes the result directly."""
    g = ctx.graph
    dy, x = g.nodes[n.inputs[0]], g.nodes[n.inputs[1]]
    has_res = n.attrs["has_residual"]
    res = ctx.buf(n.inputs[2]) if has_res else _dummy(ctx, x.dtype)
    stats = ctx.buf(n.inputs[-1])
    axis = n.attrs["axis"]
    outer, length, inner = math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1:])
    if length == 0:
        return []
    rows_, size = outer * inner, n.size
    lanes = 2 if SIMULATOR else 8
    tiles = -(-length // 32)
    if SIMULATOR:   # two chunks whenever there are rows for them, so both kernels run
        chunks = max(1, min(2, -(-rows_ // lanes)))
    else:           # ~8 blocks an SM, each chunk at least 16 rows a lane
        chunks = max(1, min(-(-sm_count() * 8 // tiles), -(-rows_ // (lanes * 16))))
    name = step_name(n)
    args = (ctx.buf(dy), ctx.buf(x), res, stats, np.int64(outer), np.int64(length),
            np.int64(inner))
    xk, pk = io_kind(x.dtype), io_kind(n.dtype)   # (pk: gamma's dtype, the result's)
    info = {"bytes": x.nbytes * (2 + has_res)}
    if chunks == 1:
        k = rows.norm_param_bwd(n.shape[0] == 2, has_res, lanes, xk, pk)
        return [Step(name, "norm_param_bwd", k, (tiles, 1), (32 * lanes,), (ctx.buf(n),) + args,
                     info)]
    k = rows.norm_param_bwd(n.shape[0] == 2, has_res, lanes, xk)   # f32 partial sums
    part = ctx.device_array(np.zeros(chunks * size, np.float32))
    threads = 32 if SIMULATOR else 256
    return [Step(name, f"norm_param_bwd chunks={chunks}", k, (tiles, chunks), (32 * lanes,),
                 (part,) + args, info),
            Step(name, "norm_param_sum", rows.norm_param_sum(pk), (max(1, min(-(-size // threads),
                 2 if SIMULATOR else sm_count() * 4)),), (threads,),
                 (ctx.buf(n), part, np.int64(chunks), np.int64(size)),
                 {"bytes": 4 * size * (chunks + 1)})]
