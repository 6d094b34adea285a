"""Lowering of grouped_matmul and grouped_matmul_wgrad (kernels/grouped.py): each node is a
routing step (one block: the rows bucketed by expert, on the device) and one GEMM launch over
every expert. An f16 / bf16 grouped_matmul (x and w of that dtype, the result too) runs the
tensor-core grouped kernel (kernels/matmul_tc.py's grouped mode, its routing padded to that
kernel's row tile) where matmul tier 5 is offered (lower_matmul.tier5_offered: opt-in beside
cuBLAS until GPU timings say where it wins), else the CUDA-core kernel loading the halves
through kernels/halfio.py; the step name says which ran. The routing tables are the node's
own small device arrays, sized at compile time from the static shapes (so no run-time
allocation and no host sync). Each node routes its
ids itself, so a forward and backward route the same ids three times (one block each, small
beside the GEMMs; sharing them would need the routing as a graph node of its own)."""
from __future__ import annotations

import numpy as np

from ..kernels import grouped as G
from ..kernels import matmul_tc as mtc
from ..kernels.halfio import io_kind
from ..kernels.launch import default_geometry
from ..device import SIMULATOR
from .lower import Step, data_ptr, lowering, step_name
from .lower_matmul import tier5_offered


def _check_ids(ctx, n, ids, num_e):
    """run() rejects host-array ids outside [0, E) (device-array ones: the kernels skip them)."""
    ctx.add_index_check(ids, 0, num_e - 1, f"{n.op} %{n.id} (expert_ids of {num_e} experts)")


def _route(ctx, n, ids, num_e, out, n_out, bm=G.BM):
    """The routing step of node n and its (start, count, tile_expert, rows) arrays, plus the
    bound on the row tiles (of ``bm`` rows: the product's row tile); ``out`` / ``n_out``: the
    output whose rows with a bad id it zeroes (n_out 0: none)."""
    m = ids.size
    nchunks, ch, max_tiles = G.route_plan(m, num_e, bm)
    counts, start, count, tile_expert, rows = (
        ctx.device_array(np.zeros(max(1, size), np.int32))
        for size in (nchunks * num_e, num_e + 1, num_e, max_tiles, max_tiles * bm))
    step = Step(step_name(n) + " route", f"moe route {m} rows to {num_e} experts"
                + (f" in tiles of {bm}" if bm != G.BM else ""),
                G.route_kernel_for(bm), (1,), (G.ROUTE_T,),
                (ctx.buf(ids), np.int64(m), np.int64(num_e), np.int64(ch), np.int64(nchunks),
                 counts, start, count, tile_expert, rows, out, np.int64(n_out)),
                {"bytes": 2 * ids.nbytes + 4 * (m + nchunks * num_e)})
    return step, (start, count, tile_expert, rows), max_tiles


@lowering("grouped_matmul")
def _lower_grouped_matmul(ctx, n):
    g = ctx.graph
    x, w, ids = (g.nodes[i] for i in n.inputs)
    num_e = w.shape[0]
    m, k = x.shape
    cols = n.shape[1]
    _check_ids(ctx, n, ids, num_e)
    if m * cols == 0:
        return []
    trans = n.attrs["trans_w"]
    kind = io_kind(n.dtype)
    if kind != "f32" and tier5_offered() and k:
        return _tensor_core(ctx, n, x, w, ids, num_e, m, k, cols, trans, kind)
    route, (start, _, tile_expert, rows), max_tiles = _route(ctx, n, ids, num_e, ctx.buf(n),
                                                             cols)
    grid, block = G.rows_launch(cols, max_tiles)
    return [route, Step(step_name(n), f"grouped gemm {m}x{cols}x{k} over {num_e} experts"
                        + (" (w^T)" if trans else "") + ("" if kind == "f32" else f" {kind}"),
                        G.rows_kernel(trans, kind), grid, block,
                        (ctx.buf(n), ctx.buf(x), ctx.buf(w), np.int64(cols), np.int64(k),
                         np.int64(num_e), start, tile_expert, rows),
                        {"bytes": x.nbytes + w.nbytes + n.nbytes, "flops": 2 * m * k * cols})]


def _tensor_core(ctx, n, x, w, ids, num_e, m, k, cols, trans, kind):
    """The routing (in the tensor-core geometry's row tiles) and the grouped tensor-core step:
    x and w read as their uint16 bits, the output written in the node's dtype."""
    geo = default_geometry("grouped_tc")
    route, (start, _, tile_expert, rows), max_tiles = _route(ctx, n, ids, num_e, ctx.buf(n),
                                                             cols, geo.bm)
    bits = (lambda buf: buf) if kind == "bf16" else (lambda buf: buf.view(np.uint16))
    xbuf, wbuf = bits(ctx.buf(x)), bits(ctx.buf(w))
    ptrs = () if SIMULATOR else (data_ptr(xbuf), data_ptr(wbuf))
    vec, _ = mtc.vec_ok(False, trans, m, cols, k, [0], [0], ptrs)
    grid, block = mtc.grouped_launch(cols, max_tiles, geo)
    dummy = ctx.shared(f"tc_dummy_{kind}", lambda: np.zeros(1, np.dtype(ctx.buf(n).dtype)))
    return [route, Step(step_name(n), f"numba tc grouped gemm {kind} "
                        f"{'NT'[trans]} {m}x{cols}x{k} over {num_e} experts "
                        f"{geo.bm}x{geo.bn}x{geo.bk}/{geo.warps}w "
                        + ("cp.async" if vec else "element loads"),
                        mtc.grouped_kernel(trans, kind, vec, geo), grid, block,
                        (ctx.buf(n), xbuf, wbuf, dummy, dummy, np.int64(m), np.int64(cols),
                         np.int64(k), rows, tile_expert, start),
                        {"bytes": x.nbytes + w.nbytes + n.nbytes, "flops": 2 * m * k * cols})]


@lowering("grouped_matmul_wgrad")
def _lower_grouped_wgrad(ctx, n):
    g = ctx.graph
    a, b, ids = (g.nodes[i] for i in n.inputs)
    num_e, ka, nb = n.shape
    _check_ids(ctx, n, ids, num_e)
    if n.size == 0:
        return []
    route, (start, count, _, rows), _ = _route(ctx, n, ids, num_e, ctx.buf(n), 0)
    grid, block = G.wgrad_launch(ka, nb, num_e)
    return [route, Step(step_name(n), f"grouped wgrad {num_e}x{ka}x{nb} over {ids.size} rows",
                        G.wgrad_kernel, grid, block,
                        (ctx.buf(n), ctx.buf(a), ctx.buf(b), np.int64(ka), np.int64(nb),
                         np.int64(num_e), start, count, rows),
                        {"bytes": a.nbytes + b.nbytes + n.nbytes,
                         "flops": 2 * ids.size * ka * nb})]
