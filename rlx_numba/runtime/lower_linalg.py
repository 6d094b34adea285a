"""The linear-algebra family's tiers (ir/ops_linalg.py), chosen at compile time in this order
(``RLX_NUMBA_LINALG_TIERS``, a subset of 0,1; RLX_NUMBA_LOG_FALLBACK=1 logs the choice):

  0 cuSOLVER / cuBLAS (cusolver.py): getrf + getrs (solve), getrf alone (slogdet: the
    diagonal and pivots reduced by a small kernel), potrf (cholesky), cuBLAS trsm
    (triangular solve), geqrf + orgqr (qr), syevd (eigh), gesvd (svd). Not in the
    simulator. The info codes stay on the device: a kernel after the call NaN-fills the
    results of a matrix whose info is not 0 (torch raises; see ops_linalg.py).
  1 numba (kernels/linalg.py): one block a matrix.

Every buffer is row-major [batch, ...]; cuSOLVER is column-major, so it sees A^T: potrf
"upper" of A^T is our lower factor, getrs "transposed" solves A X = B with B handed over
transposed (a transpose kernel either side), and so on (each lowering says how).
"""
from __future__ import annotations

import math

import numpy as np

from ..device import SIMULATOR
from ..ir.ops import fmt
from ..kernels import linalg as K
from ..kernels.launch import default_geometry, grid_3d
from .lower import Step, lowering, step_name

_I = np.int64


def _batch(shape, tail: int = 2) -> int:
    return math.prod(shape[:-tail])


def _block():
    return (default_geometry("linalg").threads,)


def _scratch(ctx, count: int):
    return ctx.device_array(np.zeros(max(count, 1), np.float32))


# ---- tier 1: numba ---------------------------------------------------------------------------
@lowering("lu_solve", tier="numba")
def _numba_lu_solve(ctx, n):
    if n.size == 0:
        return []
    a, b = (ctx.graph.nodes[i] for i in n.inputs)
    k, m = a.shape[-1], n.shape[-1]
    batch = _batch(a.shape)
    args = (ctx.buf(a), _scratch(ctx, batch * k * k), ctx.buf(b), ctx.buf(n),
            ctx.shared("linalg_dummy", lambda: np.zeros(1, np.float32)), _I(batch), _I(k), _I(m))
    return [Step(step_name(n), f"lu solve {batch}x{k}x{k} ({m} rhs)", K.lu_kernel(True),
                 grid_3d(batch), _block(), args, {"flops": batch * (2 * k**3 / 3 + 2 * k * k * m)})]


@lowering("slogdet", tier="numba")
def _numba_slogdet(ctx, n):
    if n.size == 0:
        return []
    a = ctx.graph.nodes[n.inputs[0]]
    k, batch = a.shape[-1], _batch(a.shape)
    dummy = ctx.shared("linalg_dummy", lambda: np.zeros(1, np.float32))
    args = (ctx.buf(a), _scratch(ctx, batch * k * k), dummy, dummy, ctx.buf(n), _I(batch),
            _I(k), _I(0))
    return [Step(step_name(n), f"lu slogdet {batch}x{k}x{k}", K.lu_kernel(False),
                 grid_3d(batch), _block(), args, {"flops": batch * 2 * k**3 / 3})]


@lowering("cholesky", tier="numba")
def _numba_cholesky(ctx, n):
    if n.size == 0:
        return []
    k, batch = n.shape[-1], _batch(n.shape)
    return [Step(step_name(n), f"cholesky {batch}x{k}x{k}", K.cholesky_kernel, grid_3d(batch),
                 _block(), (ctx.buf(n.inputs[0]), ctx.buf(n), _I(batch), _I(k)),
                 {"flops": batch * k**3 / 3})]


@lowering("trsm", tier="numba")
def _numba_trsm(ctx, n):
    if n.size == 0:
        return []
    a = ctx.graph.nodes[n.inputs[0]]
    k, m, batch = a.shape[-1], n.shape[-1], _batch(a.shape)
    upper = n.attrs["upper"]
    args = (ctx.buf(a), ctx.buf(n.inputs[1]), ctx.buf(n), _I(batch), _I(k), _I(m))
    return [Step(step_name(n), f"trsm {'upper' if upper else 'lower'} {batch}x{k}x{k} "
                 f"({m} rhs)", K.trsm_kernel(upper), grid_3d(batch), _block(), args,
                 {"flops": batch * k * k * m})]


@lowering("qr", tier="numba")
def _numba_qr(ctx, n):
    if n.size == 0:
        return []
    a = ctx.graph.nodes[n.inputs[0]]
    m, nn = a.shape[-2:]
    k, batch = min(m, nn), _batch(a.shape)
    args = (ctx.buf(a), _scratch(ctx, batch * (m * nn + 2 * k)), ctx.buf(n), _I(batch), _I(m),
            _I(nn))
    return [Step(step_name(n), f"householder qr {batch}x{m}x{nn}", K.qr_kernel, grid_3d(batch),
                 _block(), args, {"flops": batch * 4 * m * nn * k})]


@lowering("eigh", tier="numba")
def _numba_eigh(ctx, n):
    if n.size == 0:
        return []
    a = ctx.graph.nodes[n.inputs[0]]
    k, batch = a.shape[-1], _batch(a.shape)
    args = (ctx.buf(a), _scratch(ctx, batch * k * k), ctx.buf(n), _I(batch), _I(k))
    return [Step(step_name(n), f"jacobi eigh {batch}x{k}x{k}", K.eigh_kernel, grid_3d(batch),
                 _block(), args, {})]


@lowering("svd", tier="numba")
def _numba_svd(ctx, n):
    if n.size == 0:
        return []
    a = ctx.graph.nodes[n.inputs[0]]
    m, k = a.shape[-2:]
    batch = _batch(a.shape)
    args = (ctx.buf(a), _scratch(ctx, batch * k * k), ctx.buf(n), _I(batch), _I(m), _I(k))
    return [Step(step_name(n), f"one-sided jacobi svd {batch}x{m}x{k}", K.svd_kernel,
                 grid_3d(batch), _block(), args, {})]
