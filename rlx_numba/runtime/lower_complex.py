"""The c64 product's tiers (ir/ops_complex.py "cmatmul"): tier 0 cublasCgemm (strided batched,
or pointer-array batched for any other batch broadcast) on a GPU with cuBLAS; tier 1 the numba
kernel (kernels/complex.py: the simulator, no cuBLAS). ``RLX_NUMBA_CMATMUL_TIERS`` (a subset of
0,1) limits the choice. The conjugate-transpose flags reach cuBLAS as OP_C (no copies)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from .. import cublas
from ..device import SIMULATOR
from ..kernels import complex as K
from ..kernels.launch import grid_1d
from .lower import CallStep, Step, data_ptr, lowering, step_name


def _operands(ctx, n):
    """(m, n, k, batch, offs_a, offs_b): the product's sizes and each batch entry's element
    offsets into a and b (broadcast batch axes repeat them)."""
    g = ctx.graph
    a, b = (g.nodes[i] for i in n.inputs)
    m, cols = n.shape[-2:]
    k = a.shape[-1] if not n.attrs["ha"] else a.shape[-2]
    out_batch = tuple(n.shape[:-2])
    batch = math.prod(out_batch)

    def offs(t):
        own = tuple(t.shape[:-2])
        idx = np.arange(math.prod(own), dtype=np.int64).reshape(own)
        lead = (1,) * (len(out_batch) - len(own)) + own
        return (np.broadcast_to(idx.reshape(lead), out_batch).reshape(-1)
                * (t.shape[-2] * t.shape[-1])).astype(np.int64)
    return m, cols, k, batch, offs(a), offs(b)


def _cublas_unavailable(ctx, n):
    if SIMULATOR:
        return "the simulator has no cuBLAS"
    ok, why = cublas.available()
    return None if ok else why.splitlines()[0]


def _stride(offs):
    if len(offs) < 2:
        return 0
    s = int(offs[1] - offs[0])
    return s if np.array_equal(offs, s * np.arange(len(offs))) else None


@lowering("cmatmul", tier="cublas Cgemm", available=_cublas_unavailable)
def _lower_cgemm(ctx, n):
    if n.size == 0 or min(_operands(ctx, n)[:3]) == 0:
        return None                     # (an empty or K = 0 product: the numba tier)
    from ..cublas import api, gemm
    m, cols, k, batch, offs_a, offs_b = _operands(ctx, n)
    a, b, out = ctx.buf(n.inputs[0]), ctx.buf(n.inputs[1]), ctx.buf(n)
    cm = gemm.colmajor(m, cols, k, n.attrs["ha"], n.attrs["hb"])
    opa = api.OP_C if n.attrs["hb"] else cm.opa        # (cuBLAS's A is our b)
    opb = api.OP_C if n.attrs["ha"] else cm.opb
    sa, sb = _stride(offs_a), _stride(offs_b)
    ptrs = None
    call = "cublasCgemm" if batch == 1 else "cublasCgemmStridedBatched"
    if batch > 1 and (sa is None or sb is None):
        ptrs = (gemm.pointer_array(data_ptr(a), offs_a, 8),
                gemm.pointer_array(data_ptr(b), offs_b, 8),
                gemm.pointer_array(data_ptr(out), np.arange(batch) * m * cols, 8))
        ctx.keep(ptrs)
        call = "cublasCgemmBatched"
    make = lambda stream: gemm.cgemm_plan(stream, dataclasses.replace(cm, opa=opa, opb=opb),  # noqa: E731
                                          data_ptr(a), data_ptr(b), data_ptr(out), batch=batch,
                                          stride_a=sa or 0, stride_b=sb or 0, ptr_arrays=ptrs)
    return [CallStep(step_name(n), f"{call} {batch}x{m}x{cols}x{k}", make,
                     {"flops": 8 * batch * m * cols * k, "tier": 0})]


@lowering("cmatmul", tier="numba cgemm")
def _lower_numba(ctx, n):
    if n.size == 0:
        return []
    m, cols, k, batch, offs_a, offs_b = _operands(ctx, n)
    grid, block = grid_1d(n.size)
    return [Step(step_name(n), f"numba cgemm {batch}x{m}x{cols}x{k}",
                 K.cgemm_kernel(n.attrs["ha"], n.attrs["hb"]), (grid,), (block,),
                 (ctx.buf(n), ctx.buf(n.inputs[0]), ctx.buf(n.inputs[1]), np.int64(m),
                  np.int64(cols), np.int64(k), ctx.device_array(offs_a),
                  ctx.device_array(offs_b), np.int64(batch)),
                 {"flops": 8 * n.size * k, "tier": 1})]
