"""Lowering of scaled_matmul and qmatmul (ir/ops_lowp.py; kernels: kernels/lowp.py).

Tiers, tried in order (``RLX_NUMBA_LOWP_TIERS=1`` keeps only the numba one;
RLX_NUMBA_LOG_FALLBACK=1 logs each node's tier and path, and why tiers were passed over):

  0  cuBLASLt. scaled_matmul: fp8 tensor cores (compute capability 8.9+), f32 accumulation.
     Per-tensor scales go to Lt as A / B_SCALE_POINTER and a bf16 / f16 bias to its BIAS
     epilogue: one call. Rowwise scales try the same call with A / B_SCALE_MODE =
     OUTER_VEC_32F (cuBLAS 12.9+; RLX_NUMBA_LT_OUTER_VEC=0 skips it); where that cuBLAS or GPU
     has no such algorithm, or for an f32 output with a bias (Lt's fp8 kernels take only a
     bf16 bias beside an f32 D), Lt runs with unit scales into f32 sums and one epilogue
     kernel applies the scales and bias and rounds (the step names say which ran).
     qmatmul: int8 tensor cores (COMPUTE_32I, i32 D; K and N multiples of 4, Lt's int8
     alignment); a u8 a is
     shifted to i8 (a - 128) by a small kernel and its zero point moved by 128, and nonzero
     zero points are exact integer corrections from a's row sums and b's column sums:
     sum (a - az)(b - bz) = a.b - bz rowsum(a) - az colsum(b) + K az bz.
     Both take Lt's "TN" layout, b stored [N, K]: b given as a transpose of an [N, K] tensor
     (``g.transpose(bt)``, as torch._scaled_mm's column-major mat2) is read in place; any
     other b is transposed into a scratch first (a 1-byte copy of b).
  1  numba (kernels/lowp.py): a thread an output, exact f32 products of the decoded fp8 values
     summed in f32 / exact integer sums; the simulator's tier, and the fallback.
"""
from __future__ import annotations

import os

import numpy as np

from .. import cublas
from ..device import SIMULATOR
from ..ir import dtypes as dt
from ..ir.opdef import opdef
from ..kernels import lowp as L
from ..kernels.halfio import io_kind
from ..kernels.launch import grid_1d
from .lower import CallStep, Step, data_ptr, log_tier, lowering, step_name
from .lower_matmul import f32_dummy, operand

TIER_ENV = "RLX_NUMBA_LOWP_TIERS"
for _op in ("scaled_matmul", "qmatmul"):
    opdef(_op).tier_env = TIER_ENV


def _scratch(ctx, size, dtype):
    """A device scratch of ``size`` elements the node's steps own (uninitialised: no host copy
    of the 64-256 MB a large product's operands take)."""
    a = ctx.cuda.device_array(max(1, size), dtype)
    ctx.keep([a])
    return a


def _grid_2d(rows, cols):
    """(grid, block) for the thread-an-output kernels: x along the columns."""
    if SIMULATOR:
        return (min(2, -(-cols // 8)), min(2, -(-rows // 4))), (8, 4)
    return (min(-(-cols // 16), 4096), min(-(-rows // 16), 4096)), (16, 16)


def _lt_available(ctx, n):
    if SIMULATOR:
        return "the simulator has no cuBLAS"
    if 0 in n.shape or 0 in ctx.graph.nodes[n.inputs[0]].shape:
        return "an empty product"
    ok, why = cublas.available()
    if not ok:
        return f"cuBLAS not loaded: {why}"
    if n.op == "scaled_matmul":
        from ..device import device_info
        cc = tuple(device_info()["cc"])
        if cc < (8, 9):
            return f"fp8 tensor cores need compute capability 8.9+, this GPU is {cc}"
    else:
        k, nn = ctx.graph.nodes[n.inputs[0]].shape[1], n.shape[1]
        if k % 4 or nn % 4:
            return f"cuBLASLt's int8 kernels need K and N multiples of 4 (K={k}, N={nn})"
    return None


def _tn_b(ctx, n, b_id, name):
    """(b's [N, K] bytes, steps): in place for an absorbed transpose, else a transposed copy."""
    b = operand(ctx, b_id)
    if b.trans:
        return b.buf, []
    k, nn = b.shape
    bt = _scratch(ctx, k * nn, b.buf.dtype)
    tiles = (-(-nn // L.TILE), -(-k // L.TILE))
    grid = (min(tiles[0], 2), min(tiles[1], 2)) if SIMULATOR else (min(tiles[0], 65535),
                                                                   min(tiles[1], 65535))
    step = Step(name + " b to [N, K]", f"transpose bytes {k}x{nn}", L.transpose_bytes, grid,
                (L.TILE, L.TROWS), (bt.view(np.uint8), b.buf.view(np.uint8), np.int64(k),
                                    np.int64(nn)), {"bytes": 2 * k * nn})
    return bt, [step]


_LT_TYPE = {dt.F8E4M3: "R_8F_E4M3", dt.F8E5M2: "R_8F_E5M2", dt.BF16: "R_16BF", dt.F16: "R_16F",
            dt.F32: "R_32F"}


def _lt_call(ctx, name, label, m, nn, k, a_buf, a_dt, b_buf, b_dt, d_buf, d_type, **kw):
    """A planned cuBLASLt step (TN: b stored [N, K]); CublasError when Lt refuses it."""
    from ..cublas import api, gemm
    cm = gemm.colmajor(m, nn, k, False, True)
    ta, tb = (getattr(api, _LT_TYPE[d]) if d in _LT_TYPE else api.R_8I for d in (a_dt, b_dt))
    ptrs = dict(a_ptr=data_ptr(a_buf), a_type=ta, b_ptr=data_ptr(b_buf), b_type=tb,
                d_ptr=data_ptr(d_buf), d_type=d_type, **kw)
    first = gemm.lt_lowp_plan(ctx.stream, cm, **ptrs)
    own = ctx.stream
    make = lambda stream: first if stream is own else gemm.lt_lowp_plan(stream, cm, **ptrs)  # noqa: E731
    return CallStep(name, f"cublasLt {label} {m}x{nn}x{k}", make, {"flops": 2 * m * nn * k})


@lowering("scaled_matmul", tier="cublaslt", available=_lt_available)
def _scaled_lt(ctx, n):
    """One Lt call with the scales (per tensor; rowwise through the outer-vector scale mode
    where this cuBLAS has it) and the bias fused, else Lt's f32 sums and the scale epilogue."""
    from ..cublas import api
    g = ctx.graph
    a, b, sa, sb = (g.nodes[i] for i in n.inputs[:4])
    bias = g.nodes[n.inputs[4]] if len(n.inputs) > 4 else None
    (m, k), nn, od = a.shape, n.shape[1], n.dtype
    rowwise = sa.shape == (m, 1)
    name = step_name(n)
    bt, steps = _tn_b(ctx, n, n.inputs[1], name)
    out = ctx.buf(n)
    fused = dict(a_scale_ptr=data_ptr(ctx.buf(sa)), b_scale_ptr=data_ptr(ctx.buf(sb)),
                 bias_ptr=data_ptr(ctx.buf(bias)) if bias is not None else None)
    why = []
    if bias is not None and od == dt.F32:
        why.append("an f32 bias: Lt's fp8 kernels take a bf16 one beside an f32 D")
    else:
        if rowwise and os.environ.get("RLX_NUMBA_LT_OUTER_VEC", "1") == "0":
            why.append("outer-vector scales off (RLX_NUMBA_LT_OUTER_VEC=0)")
        else:
            label = f"fp8 {a.dtype}x{b.dtype}->{od}{' outer-vector scales' if rowwise else ''}"
            try:
                steps.append(_lt_call(ctx, name, label, m, nn, k, ctx.buf(a), a.dtype, bt,
                                      b.dtype, out, getattr(api, _LT_TYPE[od]),
                                      outer_vec=rowwise, **fused))
                log_tier(n, n.op, "0 (cublaslt, one call)", [])
                return steps
            except cublas.CublasError as e:
                why.append(f"{label}: {e}")
    acc = out if od == dt.F32 else _scratch(ctx, m * nn, np.float32)
    label = f"fp8 {a.dtype}x{b.dtype}->f32"
    try:
        steps.append(_lt_call(ctx, name, label, m, nn, k, ctx.buf(a), a.dtype, bt, b.dtype, acc,
                              api.R_32F))
    except cublas.CublasError as e:
        log_tier(n, n.op, "1 (numba)", why + [f"tier 0 (cublaslt) {label}: {e}"])
        return None
    log_tier(n, n.op, "0 (cublaslt, f32 sums + scale epilogue)", why)
    kern = L.scale_epilogue(io_kind(od), rowwise, bias is not None)
    grid, block = grid_1d(m * nn)
    steps.append(Step(name + " scale", f"scale epilogue {'rowwise' if rowwise else 'tensor'}"
                      f"{'+bias' if bias is not None else ''} -> {od}", kern, (grid,),
                      (block,), (out, acc, ctx.buf(sa), ctx.buf(sb),
                                 ctx.buf(bias) if bias is not None else f32_dummy(ctx),
                                 np.int64(m), np.int64(nn)),
                      {"bytes": m * nn * (4 + od.itemsize)}))
    return steps


@lowering("scaled_matmul", tier="numba")
def _scaled_numba(ctx, n):
    g = ctx.graph
    a, b, sa, sb = (g.nodes[i] for i in n.inputs[:4])
    bias = g.nodes[n.inputs[4]] if len(n.inputs) > 4 else None
    (m, k), nn = a.shape, n.shape[1]
    if m == 0:
        return []
    bo = operand(ctx, n.inputs[1])
    rowwise = sa.shape == (m, 1)
    kern = L.scaled_mm(a.dtype.name, b.dtype.name, io_kind(n.dtype), rowwise, bias is not None,
                       bo.trans)
    grid, block = _grid_2d(m, nn)
    return [Step(step_name(n), f"numba scaled_mm {a.dtype}x{b.dtype}->{n.dtype} {m}x{nn}x{k}"
                 f"{' rowwise' if rowwise else ''}{' +bias' if bias is not None else ''}",
                 kern, grid, block,
                 (ctx.buf(n), ctx.buf(a), bo.buf, ctx.buf(sa), ctx.buf(sb),
                  ctx.buf(bias) if bias is not None else f32_dummy(ctx),
                  np.int64(m), np.int64(nn), np.int64(k)),
                 {"flops": 2 * m * nn * k, "bytes": m * k + k * nn + n.nbytes})]


@lowering("qmatmul", tier="cublaslt", available=_lt_available)
def _qmatmul_lt(ctx, n):
    from ..cublas import api
    g = ctx.graph
    a, b = (g.nodes[i] for i in n.inputs)
    (m, k), nn = a.shape, n.shape[1]
    az, bz = n.attrs["a_zero"], n.attrs["b_zero"]
    name = step_name(n)
    bt, steps = _tn_b(ctx, n, n.inputs[1], name)
    abuf = ctx.buf(a)
    if a.dtype == dt.U8:      # a - az == (a - 128) - (az - 128): the i8 kernels take it
        shifted = _scratch(ctx, m * k, np.int8)
        grid, block = grid_1d(m * k)
        steps.append(Step(name + " u8 to i8", f"shift u8 {m}x{k}", L.shift_u8, (grid,), (block,),
                          (shifted, abuf, np.int64(m * k)), {"bytes": 2 * m * k}))
        abuf, az = shifted, az - 128
    out = ctx.buf(n)
    try:
        steps.append(_lt_call(ctx, name, "int8", m, nn, k, abuf, dt.I8, bt, dt.I8, out,
                              api.R_32I))
    except cublas.CublasError as e:
        log_tier(n, n.op, "1 (numba)", [f"tier 0 (cublaslt): {e}"])
        return None
    log_tier(n, n.op, "0 (cublaslt int8)", ["a u8 a shifted to i8" if a.dtype == dt.U8 else "",
                                          "zero points by row / column sums" if az or bz else ""])
    if az or bz:
        ra, cb = _scratch(ctx, m, np.int32), _scratch(ctx, nn, np.int32)
        grid, block = grid_1d(m + nn)
        steps.append(Step(name + " sums", f"qmm row / column sums {m}x{nn}x{k}", L.qmm_sums,
                          (grid,), (block,), (ra, cb, abuf, bt, np.int64(m), np.int64(nn),
                                              np.int64(k), True),
                          {"bytes": m * k + k * nn}))
        grid, block = grid_1d(m * nn)
        steps.append(Step(name + " zero points", f"qmm zero-point fix {m}x{nn}", L.qmm_fix,
                          (grid,), (block,), (out, ra, cb, np.int64(az), np.int64(bz),
                                              np.int64(k * az * bz), np.int64(m), np.int64(nn)),
                          {"bytes": 8 * m * nn}))
    return steps


@lowering("qmatmul", tier="numba")
def _qmatmul_numba(ctx, n):
    g = ctx.graph
    a = g.nodes[n.inputs[0]]
    (m, k), nn = a.shape, n.shape[1]
    if m == 0 or nn == 0:
        return []
    bo = operand(ctx, n.inputs[1])
    grid, block = _grid_2d(m, nn)
    return [Step(step_name(n), f"numba qmm {a.dtype}xi8 {m}x{nn}x{k}", L.qmm(bo.trans), grid,
                 block, (ctx.buf(n), ctx.buf(a), bo.buf, np.int64(n.attrs["a_zero"]),
                         np.int64(n.attrs["b_zero"]), np.int64(m), np.int64(nn), np.int64(k)),
                 {"flops": 2 * m * nn * k, "bytes": m * k + k * nn + 4 * m * nn})]
