"""Lowering of dequant_matmul and dequant_grouped_matmul (the GEMV of kernels/quant.py) and
dequantize (the GEMM path's operand: the matmul after it takes the cuBLAS tiers). A dequantised
weight that only products read as their weight is written bf16 on a GPU with cuBLAS, into the
first half of its own f32 buffer, and the products read it as a half weight: tier 0, bf16
tensor cores with f32 accumulation (x rounded to bf16, as a bf16 weight's products do)."""
from __future__ import annotations

import numpy as np

from .. import cublas
from ..device import SIMULATOR
from ..ir import dtypes as dt
from ..ir.ops_quant import GGUF, INTS, MAX_M, UNIT, units_ok
from ..kernels import quant as Q
from ..kernels.launch import default_geometry, grid_1d, sm_count
from .lower import Step, data_ptr, elementwise_step, lowering, step_name
from .lower_matmul import (PRODUCTS, consumers_of, f32_dummy, matmul_env_tiers,
                           read_as_weight)


def _layout(ctx, n, w_at):
    """(scheme, has_zeros, w as the kernels read it, scales, zeros, k, rowhw, ng, gs) of a
    quantised node whose packed weight is input ``w_at``."""
    g = ctx.graph
    a = n.attrs
    scheme, has_zeros = a["scheme"], a["has_zeros"]
    w = g.nodes[n.inputs[w_at]]
    rows, cols = w.shape
    k = cols // GGUF[scheme][1] * GGUF[scheme][0] if scheme in GGUF else (
        cols if scheme == "int8" else 2 * cols)
    gs = k if a["group_size"] is None or scheme in GGUF else a["group_size"]
    nq = (scheme in INTS) + has_zeros           # scales, zeros (epilogue inputs may follow)
    extra = [ctx.buf(i) for i in n.inputs[w_at + 1:w_at + 1 + nq]]
    sc = extra[0] if extra else f32_dummy(ctx)
    zr = extra[1] if has_zeros else f32_dummy(ctx)
    wbuf = ctx.buf(w)
    if units_ok(scheme, k, gs):
        wbuf = wbuf.view(np.uint16)
    return scheme, has_zeros, wbuf, sc, zr, k, cols // 2, k // gs, gs


def _aligned_x(ctx, n, x, m, k):
    """(x's buffer, steps): x as is, or an aligned copy where its pointer is not 16-byte
    aligned (the GEMV's 16-byte x loads)."""
    xbuf = ctx.buf(x)
    if SIMULATOR or data_ptr(xbuf) % 16 == 0:
        return xbuf, []
    copy = ctx.device_array(np.zeros(m * k, np.float32))
    return copy, [elementwise_step(step_name(n) + " align x", ("in", 0, dt.F32), copy, (m * k,),
                                   [xbuf], [(m * k,)], [dt.F32])]


@lowering("dequant_matmul")
def _lower_dequant_matmul(ctx, n):
    g = ctx.graph
    x = g.nodes[n.inputs[0]]
    scheme, has_zeros, w, sc, zr, k, rowhw, ng, gs = _layout(ctx, n, 1)
    rows = g.nodes[n.inputs[1]].shape[0]
    m = x.size // k if k else 0
    if m == 0 or rows == 0:
        return []
    xbuf, steps = _aligned_x(ctx, n, x, m, k)
    nw, r, wpr, tiles, qpl = Q.plan(m, rows, 1 if SIMULATOR else sm_count(), scheme,
                                     geo=default_geometry("quant"))
    a = n.attrs       # the epilogue passes/fusion.py folded in (inputs after the weight's)
    act, gated = a.get("activation"), a.get("gated")
    epi = [ctx.buf(i) for i in n.inputs[len(n.inputs) - a.get("has_bias", 0) - a.get("has_residual", 0):]]
    bias = epi.pop(0) if a.get("has_bias") else f32_dummy(ctx)
    res = epi.pop(0) if a.get("has_residual") else f32_dummy(ctx)
    kern = Q.gemv_kernel(scheme, m, nw, r, wpr, has_zeros, Q.group_shift(gs // UNIT), qpl,
                         bool(a.get("has_bias")), gated or act, bool(a.get("has_residual")),
                         bool(gated))
    grid = (min(tiles, 2) if SIMULATOR else tiles,)
    wbytes = g.nodes[n.inputs[1]].nbytes
    args = (ctx.buf(n), xbuf, w, sc, zr, bias, res, np.int64(rows), np.int64(k),
            np.int64(k // UNIT), np.int64(rowhw), np.int64(ng), np.int64(gs // UNIT),
            f32_dummy(ctx), np.int64(1))
    tags = "".join(f"+{t}" for t in ("bias" if a.get("has_bias") else "",
                                     f"gated {gated}" if gated else act or "",
                                     "residual" if a.get("has_residual") else "") if t)
    return steps + [Step(step_name(n), f"dequant gemv {scheme}{tags} {m}x{rows}x{k} nw{nw} r{r} "
                         f"wpr{wpr} qpl{qpl}",
                 kern, grid, (nw * 32,), args,
                 {"bytes": wbytes + 4 * (m * k + m * rows), "flops": 2 * m * rows * k})]


@lowering("dequant_grouped_matmul")
def _lower_dequant_grouped_matmul(ctx, n):
    """A GEMV a row of x (grid.y), each over its expert's packed rows."""
    g = ctx.graph
    x, ids = g.nodes[n.inputs[0]], g.nodes[n.inputs[-1]]
    scheme, has_zeros, w, sc, zr, k, rowhw, ng, gs = _layout(ctx, n, 1)
    e = n.attrs["experts"]
    m, rows = n.shape
    if m == 0 or rows == 0:
        return []
    ctx.add_index_check(ids, 0, e - 1, f"dequant_grouped_matmul %{n.id} (expert ids of {e} "
                        f"experts)")
    xbuf, steps = _aligned_x(ctx, n, x, m, k)
    nw, r, wpr, _, qpl = Q.plan(1, rows * m, 1 if SIMULATOR else sm_count(), scheme,
                                 geo=default_geometry("quant"))
    tiles = -(-rows // (r * nw // wpr))
    kern = Q.gemv_kernel(scheme, 1, nw, r, wpr, has_zeros, Q.group_shift(gs // UNIT), qpl,
                         grouped=True)
    grid = (min(tiles, 2) if SIMULATOR else tiles, m)
    args = (ctx.buf(n), xbuf, w, sc, zr, f32_dummy(ctx), f32_dummy(ctx), np.int64(rows), np.int64(k),
            np.int64(k // UNIT), np.int64(rowhw), np.int64(ng), np.int64(gs // UNIT),
            ctx.buf(ids), np.int64(e))
    wbytes = g.nodes[n.inputs[1]].nbytes // e * min(m, e)      # the experts a step can touch
    return steps + [Step(step_name(n), f"dequant grouped gemv {scheme} {m}x{rows}x{k} E{e} "
                         f"nw{nw} r{r} wpr{wpr} qpl{qpl}", kern, grid, (nw * 32,), args,
                         {"bytes": wbytes + 4 * (m * k + m * rows), "flops": 2 * m * rows * k})]


def _bf16_weight(ctx, n) -> bool:
    """Whether dequantize ``n`` is written bf16 for tier 0 (module docstring): a GPU with
    cuBLAS, tier 0 allowed, and every reader a product taking it as the weight (B) of an f32 A
    of more than MAX_M rows (fewer: the product is a GEMV reading the weight, where rounding x
    would buy nothing), directly or through absorbed transposes."""
    if SIMULATOR or n.id in ctx.outputs or 0 not in matmul_env_tiers() or not cublas.available()[0]:
        return False
    consumers = consumers_of(ctx.graph)
    if not read_as_weight(consumers, ctx.absorbed, n.id):
        return False
    products, todo = [], [n.id]
    while todo:
        for m, _ in consumers.get(todo.pop(), []):
            if m.op in PRODUCTS:
                products.append(m)
            else:
                todo.append(m.id)
    return all(ctx.graph.nodes[m.inputs[0]].dtype == dt.F32 and m.size // m.shape[-1] > MAX_M
               for m in products)


@lowering("dequantize")
def _lower_dequantize(ctx, n):
    scheme, has_zeros, w, sc, zr, k, rowhw, ng, gs = _layout(ctx, n, 0)
    g = ctx.graph
    gather = n.attrs["gather"]
    rows = n.size // k if k else 0
    if rows == 0:
        return []
    if not gather and units_ok(scheme, k, gs) and _bf16_weight(ctx, n):
        out = ctx.buf(n).view(np.uint32)[:n.size // 2]
        ctx.half_outputs[n.id] = (dt.BF16, ctx.buf(n).view(np.uint16)[:n.size])
        grid, block = grid_1d(rows * k // UNIT * 4)
        kern = Q.dequant_units_kernel(scheme, has_zeros, Q.group_shift(gs // UNIT), bf16=True)
        args = (out, w, sc, zr, np.int64(rows), np.int64(k), np.int64(k // UNIT),
                np.int64(rowhw), np.int64(ng), np.int64(gs // UNIT), f32_dummy(ctx), np.int64(rows))
        return [Step(step_name(n), f"dequantize {scheme} {rows}x{k} to bf16", kern, (grid,),
                     (block,), args, {"bytes": g.nodes[n.inputs[0]].nbytes + n.nbytes // 2})]
    wnode = g.nodes[n.inputs[0]]
    if gather:      # run() checks host-array indices; the kernel clamps device ones
        ids = g.nodes[n.inputs[-1]]
        ctx.add_index_check(ids, 0, wnode.shape[0] - 1, f"dequantize %{n.id} (rows of a "
                            f"{wnode.shape[0]}-row table)")
    if units_ok(scheme, k, gs):
        units = k // UNIT
        grid, block = grid_1d(rows * units * 4)
        kern = Q.dequant_units_kernel(scheme, has_zeros, Q.group_shift(gs // UNIT), gather)
        args = (ctx.buf(n), w, sc, zr, np.int64(rows), np.int64(k), np.int64(units),
                np.int64(rowhw), np.int64(ng), np.int64(gs // UNIT),
                ctx.buf(ids) if gather else f32_dummy(ctx), np.int64(wnode.shape[0]))
        return [Step(step_name(n), f"dequantize {scheme} {rows}x{k}{' rows' if gather else ''}",
                     kern, (grid,), (block,), args,
                     {"bytes": (wnode.nbytes * rows // wnode.shape[0] if gather else wnode.nbytes)
                      + n.nbytes})]
    if gather:
        raise NotImplementedError(f"dequantize %{n.id}: rows= needs K and the group size "
                                  f"multiples of {UNIT}")
    grid, block = grid_1d(rows * k)
    return [Step(step_name(n), f"dequantize {scheme} {rows}x{k} (by element)",
                 Q.dequant_ints_kernel(scheme, has_zeros), (grid,), (block,),
                 (ctx.buf(n), w, sc, zr, np.int64(rows), np.int64(k), np.int64(ng),
                  np.int64(gs)),
                 {"bytes": ctx.graph.nodes[n.inputs[0]].nbytes + n.nbytes})]
