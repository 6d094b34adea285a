"""The linear-algebra family's tiers (ir/ops_linalg.py), chosen at compile time in this order
(``RLX_NUMBA_LINALG_TIERS``, a subset of 0,1; RLX_NUMBA_LOG_FALLBACK=1 logs the choice):

  0 cuSOLVER / cuBLAS (cusolver.py, cublas/api.py): getrf + getrs (solve; cuBLAS's batched
    pair for a batch of n <= 128), getrf alone (slogdet: U's diagonal and the pivots reduced
    by a small kernel), potrf / potrfBatched (cholesky), cuBLAS trsmBatched (triangular
    solve), geqrf (qr: cuBLAS batched for a batch of tall m <= 128, then a kernel forms
    every Q; else cuSOLVER geqrf + orgqr), syevd / syevjBatched for n <= 32 (eigh), gesvdj /
    gesvdjBatched for m <= 32 (svd); the routines without a batched form loop over the
    matrices inside one step. Not in the simulator. Workspaces are arrays the step owns.
    The info codes stay on the device: a kernel after the call NaN-fills the results of a
    matrix whose info is not 0 (torch raises; see ops_linalg.py), no host sync.
  1 numba (kernels/linalg.py): one block a matrix.

Every buffer is row-major [batch, ...]; cuSOLVER is column-major, so it sees A^T: potrf
"upper" of A^T is our lower factor, getrs "transposed" solves A X = B with B handed over
transposed (a transpose kernel either side), and so on (each lowering says how).

f64 nodes take the same routines' D forms (cusolverDnD*, cublasD*: the same arguments on
double data) and the numba kernels' f64 kind; the scratch, workspaces and pointer tables
follow the node's dtype (``_Kind``).
"""
from __future__ import annotations

import math

import numpy as np

from ctypes import byref, c_double, c_float, c_int, c_void_p

from .. import cusolver
from ..device import SIMULATOR
from ..ir import dtypes as dt
from ..kernels import linalg as K
from ..kernels.launch import default_geometry, grid_1d, grid_3d
from .lower import CallStep, Step, data_ptr, lowering, step_name

_I = np.int64


def _batch(shape, tail: int = 2) -> int:
    return math.prod(shape[:-tail])


def _block():
    return (default_geometry("linalg").threads,)


# ---- tier 0: cuSOLVER / cuBLAS ------------------------------------------------------------------
# sizes where one batched call beats a loop of single calls (the batched routines are for
# small matrices: cuBLAS's LU / QR read a matrix per block; syevj / gesvdj batched take n <= 32)
LU_BATCHED_N, QR_BATCHED_N, JACOBI_BATCHED_N = 128, 128, 32


def _solver_available(ctx, n):
    if SIMULATOR:
        return "the simulator has no cuSOLVER"
    ok, err = cusolver.available()
    if not ok:
        return err
    from ..cublas import available as blas_available
    ok, err = blas_available()
    return None if ok else err


def _solver_available_uncaptured(ctx, n):
    """eigh and svd: cuSOLVER's eigen / singular value routines synchronize with the host
    (syevd failed stream capture with CUSOLVER_STATUS_INTERNAL_ERROR on an H100), so an
    executable that captures CUDA graphs takes the numba tier for them."""
    why = _solver_available(ctx, n)
    if why is None and ctx.exec_mode.kind == "graph":
        why = f"cuSOLVER's {n.op} cannot be captured into a CUDA graph (ExecMode.{ctx.exec_mode})"
    return why


class _Kind:
    """A node's float: f32 (cusolverDnS* / cublasS*, the kernels' f32 kind) or f64 (the D
    forms, the f64 kind)."""

    def __init__(self, node):
        self.f64 = node.dtype == dt.F64
        self.np = np.float64 if self.f64 else np.float32
        self.t = "D" if self.f64 else "S"           # the routines' type letter
        self.one = c_double(1.0) if self.f64 else c_float(1.0)

    def scratch(self, ctx, count: int):
        """A device array of ``count`` floats a step owns."""
        return ctx.device_array(np.zeros(max(count, 1), self.np))

    def workspace(self, lwork: int):
        from numba import cuda
        return cuda.device_array(lwork, self.np)

    def solver(self, lib, name: str):
        """cuSOLVER's ``cusolverDn<S|D><name>``."""
        return getattr(lib, f"cusolverDn{self.t}{name}")

    def blas(self, blas, name: str):
        """cuBLAS's ``cublas<S|D><name>``."""
        return getattr(blas, f"cublas{self.t}{name}")

    def dummy(self, ctx):
        """The placeholder for an argument a kernel does not use."""
        return ctx.shared(f"linalg_dummy_{self.t}", lambda: np.zeros(1, self.np))


def _i32(ctx, count: int):
    return ctx.device_array(np.zeros(max(count, 1), np.int32))


def _ptrs(ctx, buf, count: int, stride: int):
    """A device array of ``count`` pointers into ``buf``, ``stride`` elements apart."""
    from ..cublas import gemm
    a = gemm.pointer_array(data_ptr(buf), np.arange(count) * stride, buf.dtype.itemsize)
    ctx.keep([a])
    return a


def _p(buf, offset: int = 0) -> c_void_p:
    """The address of ``buf``'s element ``offset`` (its dtype's size)."""
    return c_void_p(data_ptr(buf) + offset * buf.dtype.itemsize)


def _kstep(n, what, kernel, total, args):
    """A grid-stride layout / info kernel of tier 0."""
    blocks, threads = grid_1d(max(total, 1))
    return Step(step_name(n), what, kernel, (blocks,), (threads,), args, {"tier": 0})


def _call(n, what, make, flops=0.0):
    """A library call's step; an f64 node's says so (its routines are the D forms)."""
    what += " (f64)" if n.dtype == dt.F64 else ""
    return CallStep(step_name(n), what, make, {"flops": flops, "tier": 0})


def _copy_in(stream, dst, src):
    dst.copy_to_device(src, stream=stream)


@lowering("lu_solve", tier="cuSOLVER", available=_solver_available)
def _solver_lu_solve(ctx, n):
    """LU of A^T (the column-major view of A) and a transposed solve: (A^T)^T X = A X = B.
    B goes over transposed (column-major [n, k]) and X comes back the same way. Batched
    cuBLAS getrf / getrs up to LU_BATCHED_N, else cuSOLVER a matrix at a time."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    a, b = (ctx.graph.nodes[i] for i in n.inputs)
    k, m = a.shape[-1], n.shape[-1]
    batch = _batch(a.shape)
    lu, xt = kd.scratch(ctx, batch * k * k), kd.scratch(ctx, batch * k * m)
    ipiv, info = _i32(ctx, batch * k), _i32(ctx, batch)
    a_buf, out = ctx.buf(a), ctx.buf(n)
    what = f"{batch}x{k}x{k} ({m} rhs)"
    steps = [_kstep(n, f"B^T {what}", K.transpose_kernel, b.size,
                    (ctx.buf(b), xt, _I(batch), _I(k), _I(m)))]
    if k <= LU_BATCHED_N and batch > 1:
        a_ptrs, x_ptrs = _ptrs(ctx, lu, batch, k * k), _ptrs(ctx, xt, batch, k * m)

        def make(stream):
            from ..cublas import api, gemm
            blas = api.libs()[0]
            h = gemm.blas_handle(stream, False)
            host_info = c_int()
            getrf, getrs = kd.blas(blas, "getrfBatched"), kd.blas(blas, "getrsBatched")

            def go():
                _copy_in(stream, lu, a_buf)
                getrf(h, k, _p(a_ptrs), k, _p(ipiv), _p(info), batch)
                getrs(h, cusolver.OP_T, k, m, _p(a_ptrs), k, _p(ipiv), _p(x_ptrs), k,
                      byref(host_info), batch)
            return go
        steps.append(_call(n, f"cublas getrf/getrs batched {what}", make,
                           batch * (2 * k**3 / 3 + 2 * k * k * m)))
    else:
        rs_info = _i32(ctx, 1)      # getrs writes 0 to its info: not getrf's singular flag

        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            ws = kd.workspace(cusolver.buffer_size(f"{kd.t}getrf", h, k, k, _p(lu), k))
            calls = [(_p(lu, i * k * k), _p(ipiv, i * k), _p(xt, i * k * m), _p(info, i))
                     for i in range(batch)]
            getrf, getrs = kd.solver(lib, "getrf"), kd.solver(lib, "getrs")

            def go():
                _copy_in(stream, lu, a_buf)
                for pa, pp, px, pi in calls:
                    getrf(h, k, k, pa, k, _p(ws), pp, pi)
                    getrs(h, cusolver.OP_T, k, m, pa, k, pp, px, k, _p(rs_info))
            return go
        steps.append(_call(n, f"cusolver getrf/getrs {what}", make,
                           batch * (2 * k**3 / 3 + 2 * k * k * m)))
    steps.append(_kstep(n, f"X^T {what}", K.transpose_kernel, n.size,
                        (xt, out, _I(batch), _I(m), _I(k))))
    steps.append(_kstep(n, "NaN where singular", K.nan_where_kernel, n.size,
                        (out, info, _I(batch), _I(k * m))))
    return steps


@lowering("slogdet", tier="cuSOLVER", available=_solver_available)
def _solver_slogdet(ctx, n):
    """getrf of A^T (det A^T = det A); a kernel reduces U's diagonal and the pivots."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    k, batch = a.shape[-1], _batch(a.shape)
    lu, ipiv, info = kd.scratch(ctx, batch * k * k), _i32(ctx, batch * k), _i32(ctx, batch)
    a_buf = ctx.buf(a)
    if k <= LU_BATCHED_N and batch > 1:
        a_ptrs = _ptrs(ctx, lu, batch, k * k)

        def make(stream):
            from ..cublas import api, gemm
            blas, h = api.libs()[0], gemm.blas_handle(stream, False)
            getrf = kd.blas(blas, "getrfBatched")

            def go():
                _copy_in(stream, lu, a_buf)
                getrf(h, k, _p(a_ptrs), k, _p(ipiv), _p(info), batch)
            return go
    else:
        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            ws = kd.workspace(cusolver.buffer_size(f"{kd.t}getrf", h, k, k, _p(lu), k))
            calls = [(_p(lu, i * k * k), _p(ipiv, i * k), _p(info, i)) for i in range(batch)]
            getrf = kd.solver(lib, "getrf")

            def go():
                _copy_in(stream, lu, a_buf)
                for pa, pp, pi in calls:
                    getrf(h, k, k, pa, k, _p(ws), pp, pi)
            return go
    return [_call(n, f"getrf {batch}x{k}x{k}", make, batch * 2 * k**3 / 3),
            _kstep(n, "slogdet from LU", K.slogdet_lu(kd.f64), batch,
                   (lu, ipiv, info, ctx.buf(n), _I(batch), _I(k)))]


@lowering("cholesky", tier="cuSOLVER", available=_solver_available)
def _solver_cholesky(ctx, n):
    """A batch: potrfBatched "upper" of A^T reads A's lower triangle and leaves U with
    A = U^T U, which is L = U^T in our row-major memory; a kernel zeros the other triangle
    (potrfBatched uses it as scratch) and NaN-fills where info != 0. One matrix: potrf "lower"
    (as torch calls it; twice as fast as "upper" at 4096 on an H200) on A transposed into
    column-major, and L transposed back by the same tril / NaN kernel."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    k, batch = n.shape[-1], _batch(n.shape)
    out, a_buf = ctx.buf(n), ctx.buf(n.inputs[0])
    info = _i32(ctx, batch)
    what = f"{batch}x{k}x{k}"
    if batch > 1:
        ptrs = _ptrs(ctx, out, batch, k * k)

        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            potrf = kd.solver(lib, "potrfBatched")

            def go():
                _copy_in(stream, out, a_buf)
                potrf(h, cusolver.UPPER, k, _p(ptrs), k, _p(info), batch)
            return go
        return [_call(n, f"cusolver potrf {what}", make, batch * k**3 / 3),
                _kstep(n, "tril / NaN where not positive definite", K.tril_kernel, n.size,
                       (out, out, info, _I(batch), _I(k), _I(0)))]
    col = kd.scratch(ctx, k * k)

    def make(stream):
        lib, h = cusolver.lib(), cusolver.handle(stream)
        ws = kd.workspace(cusolver.buffer_size(f"{kd.t}potrf", h, cusolver.LOWER, k, _p(col), k))
        lwork, potrf = ws.size, kd.solver(lib, "potrf")

        def go():
            potrf(h, cusolver.LOWER, k, _p(col), k, _p(ws), lwork, _p(info))
        return go
    return [_kstep(n, f"A^T {what}", K.transpose_kernel, n.size,
                   (a_buf, col, _I(1), _I(k), _I(k))),
            _call(n, f"cusolver potrf {what}", make, k**3 / 3),
            _kstep(n, "L^T / NaN where not positive definite", K.tril_kernel, n.size,
                   (col, out, info, _I(1), _I(k), _I(1)))]


@lowering("trsm", tier="cuSOLVER", available=_solver_available)
def _solver_trsm(ctx, n):
    """cuBLAS trsm on the column-major views: A X = B is X^T A^T = B^T, a right-side solve of
    B^T ([k, n] column-major, our B as it lies) by A^T, whose upper triangle is A's lower."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    k, m, batch = a.shape[-1], n.shape[-1], _batch(a.shape)
    out, b_buf = ctx.buf(n), ctx.buf(n.inputs[1])
    a_ptrs, x_ptrs = _ptrs(ctx, ctx.buf(a), batch, k * k), _ptrs(ctx, out, batch, k * m)
    uplo = cusolver.LOWER if n.attrs["upper"] else cusolver.UPPER
    alpha = kd.one

    def make(stream):
        from ..cublas import api, gemm
        blas, h = api.libs()[0], gemm.blas_handle(stream, False)
        trsm = kd.blas(blas, "trsmBatched")

        def go():
            _copy_in(stream, out, b_buf)
            trsm(h, cusolver.RIGHT, uplo, cusolver.OP_N, cusolver.NON_UNIT, m, k, byref(alpha),
                 _p(a_ptrs), k, _p(x_ptrs), m, batch)
        return go
    return [_call(n, f"cublas trsm batched {batch}x{k}x{k} ({m} rhs)", make, batch * k * k * m)]


@lowering("qr", tier="cuSOLVER", available=_solver_available)
def _solver_qr(ctx, n):
    """A transposed into column-major [m, n]; geqrf (cuBLAS batched for tall m <= QR_BATCHED_N, else
    cuSOLVER a matrix at a time); R copied out. Q: for the cuBLAS batch, a kernel forms every
    matrix's Q from the reflectors at once, straight into the packing (cuSOLVER's orgqr a
    matrix at a time was most of the time: 316 ms of 4096 64x64 on an H100); else orgqr in
    place, copied out."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    m, nn = a.shape[-2:]
    k, batch = min(m, nn), _batch(a.shape)
    work, tau = kd.scratch(ctx, batch * m * nn), kd.scratch(ctx, batch * k)
    out = ctx.buf(n)
    what = f"{batch}x{m}x{nn}"
    steps = [_kstep(n, f"A^T {what}", K.transpose_kernel, a.size,
                    (ctx.buf(a), work, _I(batch), _I(m), _I(nn)))]
    batched = batch > 1 and nn <= m <= QR_BATCHED_N     # (cuBLAS's batched geqrf: m >= n)
    if batched:
        a_ptrs, t_ptrs = _ptrs(ctx, work, batch, m * nn), _ptrs(ctx, tau, batch, k)

        def make_qr(stream):
            from ..cublas import api, gemm
            blas, h = api.libs()[0], gemm.blas_handle(stream, False)
            host_info = c_int()
            geqrf = kd.blas(blas, "geqrfBatched")
            return lambda: geqrf(h, m, nn, _p(a_ptrs), m, _p(t_ptrs), byref(host_info), batch)
    else:
        info = _i32(ctx, batch)         # (geqrf's and orgqr's: argument errors only)

        def make_qr(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            ws = kd.workspace(cusolver.buffer_size(f"{kd.t}geqrf", h, m, nn, _p(work), m))
            calls = [(_p(work, i * m * nn), _p(tau, i * k), _p(info, i)) for i in range(batch)]
            geqrf = kd.solver(lib, "geqrf")

            def go():
                for pa, pt, pi in calls:
                    geqrf(h, m, nn, pa, m, pt, _p(ws), ws.size, pi)
            return go

    flops = batch * 2 * m * nn * k
    steps += [_call(n, f"geqrf {what}", make_qr, flops),
              _kstep(n, "R", K.qr_r_kernel, batch * k * nn, (work, out, _I(batch), _I(m), _I(nn)))]
    if batched:
        shared = K.qr_q_in_shared(m, k)
        return steps + [Step(step_name(n), f"Q from reflectors {what} "
                             f"({'shared' if shared else 'global'} memory)",
                             K.qr_form_q_kernel(shared, kd.f64), grid_3d(batch),
                             (min(128, 32 * -(-k // 32)),),      # a thread a column
                             (work, tau, out, _I(batch), _I(m), _I(nn)),
                             {"flops": flops, "tier": 0})]

    def make_q(stream):
        lib, h = cusolver.lib(), cusolver.handle(stream)
        ws = kd.workspace(cusolver.buffer_size(f"{kd.t}orgqr", h, m, k, k, _p(work), m,
                                               _p(tau)))
        calls = [(_p(work, i * m * nn), _p(tau, i * k), _p(info, i)) for i in range(batch)]
        orgqr = kd.solver(lib, "orgqr")

        def go():
            for pa, pt, pi in calls:
                orgqr(h, m, k, k, pa, m, pt, _p(ws), ws.size, pi)
        return go
    return steps + [_call(n, f"cusolver orgqr {what}", make_q, flops),
                    _kstep(n, "Q", K.qr_q_kernel, batch * m * nn,
                           (work, out, _I(batch), _I(m), _I(nn)))]


@lowering("eigh", tier="cuSOLVER", available=_solver_available_uncaptured)
def _solver_eigh(ctx, n):
    """syevd "upper" of A^T (A's lower triangle), or syevjBatched for a batch of n <= 32;
    a kernel lays out w and V (its columns the column-major vectors) with the gauge."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    k, batch = a.shape[-1], _batch(a.shape)
    vec, w, info = kd.scratch(ctx, batch * k * k), kd.scratch(ctx, batch * k), _i32(ctx, batch)
    a_buf = ctx.buf(a)
    if batch > 1 and k <= JACOBI_BATCHED_N:
        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            params = cusolver.sorted_params("syevj")
            ws = kd.workspace(cusolver.buffer_size(
                f"{kd.t}syevjBatched", h, cusolver.VECTOR, cusolver.UPPER, k, _p(vec), k, _p(w),
                None, params, batch))
            syevj = kd.solver(lib, "syevjBatched")

            def go():
                _copy_in(stream, vec, a_buf)
                syevj(h, cusolver.VECTOR, cusolver.UPPER, k, _p(vec), k, _p(w), _p(ws), ws.size,
                      _p(info), params, batch)
            return go
        what = f"cusolver syevjBatched {batch}x{k}x{k}"
    else:
        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            ws = kd.workspace(cusolver.buffer_size(f"{kd.t}syevd", h, cusolver.VECTOR,
                                                   cusolver.UPPER, k, _p(vec), k, _p(w)))
            calls = [(_p(vec, i * k * k), _p(w, i * k), _p(info, i)) for i in range(batch)]
            syevd = kd.solver(lib, "syevd")

            def go():
                _copy_in(stream, vec, a_buf)
                for pa, pw, pi in calls:
                    syevd(h, cusolver.VECTOR, cusolver.UPPER, k, pa, k, pw, _p(ws), ws.size, pi)
            return go
        what = f"cusolver syevd {batch}x{k}x{k}"
    return [_call(n, what, make, batch * 9 * k**3),
            _kstep(n, "eigh layout", K.eigh_post_kernel, batch * k,
                   (vec, w, info, ctx.buf(n), _I(batch), _I(k)))]


@lowering("svd", tier="cuSOLVER", available=_solver_available_uncaptured)
def _solver_svd(ctx, n):
    """gesvdj of A^T (the column-major view, [n, m]): A^T = U' S V'^T, so U = V' and
    Vh = U'^T (gesvdjBatched for a batch with m <= 32, else gesvdj econ a matrix at a time);
    a kernel lays them out with the gauge and NaN-fills where gesvdj did not converge."""
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    m, k = a.shape[-2:]
    batch = _batch(a.shape)
    batched = batch > 1 and m <= JACOBI_BATCHED_N
    vstride = m * m if batched else m * k          # V' is [m, m] batched, [m, k] econ
    work, s = kd.scratch(ctx, batch * m * k), kd.scratch(ctx, batch * k)
    u1, v1 = kd.scratch(ctx, batch * k * k), kd.scratch(ctx, batch * vstride)
    info = _i32(ctx, batch)
    a_buf = ctx.buf(a)
    V = cusolver.VECTOR
    if batched:
        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            params = cusolver.sorted_params("gesvdj")
            ws = kd.workspace(cusolver.buffer_size(
                f"{kd.t}gesvdjBatched", h, V, k, m, _p(work), k, _p(s), _p(u1), k, _p(v1), m,
                None, params, batch))
            gesvdj = kd.solver(lib, "gesvdjBatched")

            def go():
                _copy_in(stream, work, a_buf)
                gesvdj(h, V, k, m, _p(work), k, _p(s), _p(u1), k, _p(v1), m, _p(ws), ws.size,
                       _p(info), params, batch)
            return go
        what = f"cusolver gesvdjBatched {batch}x{m}x{k}"
    else:
        def make(stream):
            lib, h = cusolver.lib(), cusolver.handle(stream)
            params = cusolver.sorted_params("gesvdj")
            ws = kd.workspace(cusolver.buffer_size(
                f"{kd.t}gesvdj", h, V, 1, k, m, _p(work), k, _p(s), _p(u1), k, _p(v1), m, None,
                params))
            calls = [(_p(work, i * m * k), _p(s, i * k), _p(u1, i * k * k), _p(v1, i * vstride),
                      _p(info, i)) for i in range(batch)]
            gesvdj = kd.solver(lib, "gesvdj")

            def go():
                _copy_in(stream, work, a_buf)
                for pa, ps, pu, pv, pi in calls:
                    gesvdj(h, V, 1, k, m, pa, k, ps, pu, k, pv, m, _p(ws), ws.size, pi, params)
            return go
        what = f"cusolver gesvdj {batch}x{m}x{k}"
    return [_call(n, what, make, batch * 12 * m * k * k),
            _kstep(n, "svd layout", K.svd_post_kernel, batch * k,
                   (u1, s, v1, info, ctx.buf(n), _I(batch), _I(m), _I(k), _I(k * k),
                    _I(vstride)))]


# ---- tier 1: numba (the kernels' f32 or f64 kind, as the node's dtype) --------------------------
@lowering("lu_solve", tier="numba")
def _numba_lu_solve(ctx, n):
    if n.size == 0:
        return []
    kd = _Kind(n)
    a, b = (ctx.graph.nodes[i] for i in n.inputs)
    k, m = a.shape[-1], n.shape[-1]
    batch = _batch(a.shape)
    args = (ctx.buf(a), kd.scratch(ctx, batch * k * k), ctx.buf(b), ctx.buf(n), kd.dummy(ctx),
            _I(batch), _I(k), _I(m))
    return [Step(step_name(n), f"lu solve {batch}x{k}x{k} ({m} rhs)", K.lu_kernel(True, kd.f64),
                 grid_3d(batch), _block(), args, {"flops": batch * (2 * k**3 / 3 + 2 * k * k * m)})]


@lowering("slogdet", tier="numba")
def _numba_slogdet(ctx, n):
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    k, batch = a.shape[-1], _batch(a.shape)
    dummy = kd.dummy(ctx)
    args = (ctx.buf(a), kd.scratch(ctx, batch * k * k), dummy, dummy, ctx.buf(n), _I(batch),
            _I(k), _I(0))
    return [Step(step_name(n), f"lu slogdet {batch}x{k}x{k}", K.lu_kernel(False, kd.f64),
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
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    m, nn = a.shape[-2:]
    k, batch = min(m, nn), _batch(a.shape)
    args = (ctx.buf(a), kd.scratch(ctx, batch * (m * nn + 2 * k)), ctx.buf(n), _I(batch), _I(m),
            _I(nn))
    return [Step(step_name(n), f"householder qr {batch}x{m}x{nn}", K.qr_kernel(kd.f64),
                 grid_3d(batch), _block(), args, {"flops": batch * 4 * m * nn * k})]


@lowering("eigh", tier="numba")
def _numba_eigh(ctx, n):
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    k, batch = a.shape[-1], _batch(a.shape)
    args = (ctx.buf(a), kd.scratch(ctx, batch * k * k), ctx.buf(n), _I(batch), _I(k))
    return [Step(step_name(n), f"jacobi eigh {batch}x{k}x{k}", K.eigh_kernel(kd.f64),
                 grid_3d(batch), _block(), args, {})]


@lowering("svd", tier="numba")
def _numba_svd(ctx, n):
    if n.size == 0:
        return []
    kd = _Kind(n)
    a = ctx.graph.nodes[n.inputs[0]]
    m, k = a.shape[-2:]
    batch = _batch(a.shape)
    args = (ctx.buf(a), kd.scratch(ctx, batch * k * k), ctx.buf(n), _I(batch), _I(m), _I(k))
    return [Step(step_name(n), f"one-sided jacobi svd {batch}x{m}x{k}", K.svd_kernel(kd.f64),
                 grid_3d(batch), _block(), args, {})]
