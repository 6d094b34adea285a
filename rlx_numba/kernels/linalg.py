"""The numba linear-algebra tier (ir/ops_linalg.py, runtime/lower_linalg.py): one block a
matrix (the grid strides over the batch), a working copy in global memory. For the
simulator and small batched matrices; a GPU runs cuSOLVER (tier 0) where it can.

Two kinds, f32 and f64 (``f64`` of the factories): the f64 kind keeps its scalars, shared
values and Jacobi thresholds in float64 (machine epsilon 2^-52), so nothing rounds through
f32. The kernels without a float scalar of their own (cholesky, trsm, the layout kernels)
are one dispatcher each that numba specialises on the arrays' dtype.

  lu_kernel        partial-pivot LU on [A | B] then back substitution (solve), or the
                   pivots' sign and sum of log|pivot| (slogdet); an exact zero (or NaN)
                   pivot marks the matrix singular: X NaN, det (0, -inf)
  cholesky_kernel  right-looking Cholesky of the lower triangle; a pivot that is not > 0
                   NaN-fills L
  trsm_kernel      forward / back substitution, a thread a right-hand column
  qr_kernel        Householder QR (LAPACK's sign choice: no cancellation in v0), the vector
                   norm scaled by the column's largest magnitude; Q = H_0 ... H_{k-1} I
  eigh_kernel      cyclic two-sided Jacobi (the small-tangent rotation), sorted ascending
  svd_kernel       one-sided Jacobi (Hestenes) on the columns, sorted descending
Scalar decisions (a pivot, a rotation) are taken by thread 0 and handed over in shared memory;
the row / column updates are spread over the block's threads.

Tier 0's (cuSOLVER / cuBLAS) layout and info kernels follow, and qr_form_q_kernel: Q from
cuBLAS's batched geqrf for a batch at once (orgqr has no batched form).
"""
import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, float64, int32

from .launch import jit, py_in_sim, register_geometry
from .mathfn import max_nan


@dataclass(frozen=True)
class Geometry:
    threads: int        # a block's threads (one block a matrix)


register_geometry("linalg", gpu=Geometry(threads=64), sim=Geometry(threads=2))

NAN = float32(math.nan)
EPS = float32(1.2e-7)           # f32's unit roundoff: a rotation below it is skipped
TINY = float32(2.4e-7)          # eigh: ... and one below this times max |A| (the rounding a
                                # rotation leaves: chasing it would only spend sweeps)
EPS64, TINY64 = float64(2.0**-52), float64(2.0**-51)    # the same in f64
SWEEPS = 30                     # Jacobi's cap (f32 converges in well under 10; f64, quadratic
                                # near the end, in a few more)


def _float(f64: bool):
    """The numba float type a kind computes in."""
    return float64 if f64 else float32


@functools.lru_cache(maxsize=None)
def lu_kernel(solve: bool, f64: bool = False):
    """solve: kernel(a, w, b, x, det, batch, n, k): w scratch [batch, n, n], x = A^-1 B
    [batch, n, k]; else det[2 mat] = sign, det[2 mat + 1] = log|det| (b, x unused)."""
    ft = _float(f64)

    @jit
    def kernel(a, w, b, x, det, batch, n, k):
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        sh = cuda.shared.array(2, int32)           # pivot row, singular
        shf = cuda.shared.array(2, ft)             # sign, log|det|
        mat = cuda.blockIdx.x
        while mat < batch:
            base, xb = mat * n * n, mat * n * k
            for i in range(tid, n * n, nt):
                w[base + i] = a[base + i]
            if solve:
                for i in range(tid, n * k, nt):
                    x[xb + i] = b[xb + i]
            if tid == 0:
                sh[1] = 0
                shf[0] = 1.0
                shf[1] = 0.0
            cuda.syncthreads()
            for c in range(n):
                if tid == 0 and sh[1] == 0:
                    p = c
                    best = abs(w[base + c * n + c])
                    for i in range(c + 1, n):
                        v = abs(w[base + i * n + c])
                        if v > best:
                            best, p = v, i
                    sh[0] = p
                    if not best > 0.0:          # zero or NaN
                        sh[1] = 1
                    else:
                        piv = w[base + p * n + c]
                        if (p != c) != (piv < 0.0):
                            shf[0] = -shf[0]
                        shf[1] += math.log(abs(piv))
                cuda.syncthreads()
                p = sh[0]
                if sh[1] == 0:
                    if p != c:
                        for j in range(tid, n, nt):
                            t = w[base + c * n + j]
                            w[base + c * n + j] = w[base + p * n + j]
                            w[base + p * n + j] = t
                        if solve:
                            for j in range(tid, k, nt):
                                t = x[xb + c * k + j]
                                x[xb + c * k + j] = x[xb + p * k + j]
                                x[xb + p * k + j] = t
                cuda.syncthreads()
                if sh[1] == 0:
                    pivot = w[base + c * n + c]
                    for i in range(c + 1 + tid, n, nt):
                        f = w[base + i * n + c] / pivot
                        w[base + i * n + c] = f
                        for j in range(c + 1, n):
                            w[base + i * n + j] -= f * w[base + c * n + j]
                        if solve:
                            for j in range(k):
                                x[xb + i * k + j] -= f * x[xb + c * k + j]
                cuda.syncthreads()
            singular = sh[1] != 0
            if solve:
                for j in range(tid, k, nt):
                    for i in range(n - 1, -1, -1):
                        if singular:
                            x[xb + i * k + j] = NAN
                        else:
                            s = x[xb + i * k + j]
                            for q in range(i + 1, n):
                                s -= w[base + i * n + q] * x[xb + q * k + j]
                            x[xb + i * k + j] = s / w[base + i * n + i]
            elif tid == 0:
                det[2 * mat] = 0.0 if singular else shf[0]
                det[2 * mat + 1] = -math.inf if singular else shf[1]
            cuda.syncthreads()
            mat += cuda.gridDim.x

    return kernel


@jit
def cholesky_kernel(a, el, batch, n):
    """el [batch, n, n] = the lower Cholesky factor of a's lower triangle (NaN when a pivot
    is not > 0)."""
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    bad = cuda.shared.array(1, int32)
    mat = cuda.blockIdx.x
    while mat < batch:
        base = mat * n * n
        for idx in range(tid, n * n, nt):
            el[base + idx] = a[base + idx] if idx % n <= idx // n else 0.0
        if tid == 0:
            bad[0] = 0
        cuda.syncthreads()
        for c in range(n):
            if tid == 0 and bad[0] == 0:
                d = el[base + c * n + c]
                if not d > 0.0:
                    bad[0] = 1
                else:
                    el[base + c * n + c] = math.sqrt(d)
            cuda.syncthreads()
            if bad[0] == 0:
                dc = el[base + c * n + c]
                for i in range(c + 1 + tid, n, nt):
                    el[base + i * n + c] /= dc
            cuda.syncthreads()
            if bad[0] == 0:
                for i in range(c + 1 + tid, n, nt):
                    lic = el[base + i * n + c]
                    for j in range(c + 1, i + 1):
                        el[base + i * n + j] -= lic * el[base + j * n + c]
            cuda.syncthreads()
        if bad[0] != 0:
            for idx in range(tid, n * n, nt):
                el[base + idx] = NAN
        cuda.syncthreads()
        mat += cuda.gridDim.x


@functools.lru_cache(maxsize=None)
def trsm_kernel(upper: bool):
    """kernel(a, b, x, batch, n, k): x = A^-1 B, A triangular [batch, n, n] (only that
    triangle read), B [batch, n, k]; a thread a column of B."""

    @jit
    def kernel(a, b, x, batch, n, k):
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        mat = cuda.blockIdx.x
        while mat < batch:
            base, xb = mat * n * n, mat * n * k
            for j in range(tid, k, nt):
                for r in range(n):
                    i = n - 1 - r if upper else r
                    s = b[xb + i * k + j]
                    lo, hi = (i + 1, n) if upper else (0, i)
                    for q in range(lo, hi):
                        s -= a[base + i * n + q] * x[xb + q * k + j]
                    x[xb + i * k + j] = s / a[base + i * n + i]
            mat += cuda.gridDim.x

    return kernel


@py_in_sim
def _reflect(q, qo, ldq, v, vo, ldv, lo, hi, v0, beta):
    """q <- (I - beta u u^T) q on rows lo..hi-1 of the strided vector q[qo + i ldq], where
    u[lo] = v0 and u[i] = v[vo + i ldv] below it (one Householder reflector on one column: the
    numba tier's QR and tier 0's Q formation, in global or shared memory)."""
    s = v0 * q[qo + lo * ldq]
    for i in range(lo + 1, hi):
        s += v[vo + i * ldv] * q[qo + i * ldq]
    s *= beta
    q[qo + lo * ldq] -= s * v0
    for i in range(lo + 1, hi):
        q[qo + i * ldq] -= s * v[vo + i * ldv]


@functools.lru_cache(maxsize=None)
def qr_kernel(f64: bool = False):
    """kernel(a, w, out, batch, m, n): reduced QR of a [batch, m, n] into out [batch, m + k, n]
    (Q [m, k] over R [k, n]); w scratch [batch, m * n + 2 k]: the Householder vectors below
    R, then (beta, alpha) a column."""
    ft = _float(f64)

    @jit
    def kernel(a, w, out, batch, m, n):
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        k = min(m, n)
        mat = cuda.blockIdx.x
        while mat < batch:
            base = mat * (m * n + 2 * k)
            tau = base + m * n
            ob = mat * (m + k) * n
            for i in range(tid, m * n, nt):
                w[base + i] = a[mat * m * n + i]
            cuda.syncthreads()
            for c in range(k):
                if tid == 0:
                    tail = ft(0.0)
                    for i in range(c + 1, m):
                        tail = max_nan(tail, abs(w[base + i * n + c]))
                    x0 = w[base + c * n + c]
                    mx = max_nan(tail, abs(x0))
                    if tail == 0.0:             # H = I, as LAPACK's larfg (R keeps x0's sign)
                        w[tau + 2 * c] = 0.0
                        w[tau + 2 * c + 1] = x0
                    else:
                        s = ft(0.0)
                        for i in range(c, m):
                            v = w[base + i * n + c] / mx
                            s += v * v
                        norm = mx * math.sqrt(s)
                        alpha = -norm if x0 >= 0.0 else norm
                        v0 = x0 - alpha                    # |v0| = |x0| + norm: no cancellation
                        w[base + c * n + c] = v0
                        w[tau + 2 * c] = 1.0 / (norm * abs(v0))    # 2 / |v|^2
                        w[tau + 2 * c + 1] = alpha
                cuda.syncthreads()
                beta, v0 = w[tau + 2 * c], w[base + c * n + c]
                for j in range(c + 1 + tid, n, nt):
                    _reflect(w, base + j, n, w, base + c, n, c, m, v0, beta)
                cuda.syncthreads()
            for idx in range(tid, k * n, nt):           # R
                i, j = idx // n, idx % n
                r = w[base + i * n + j] if j > i else (w[tau + 2 * i + 1] if j == i else 0.0)
                out[ob + (m + i) * n + j] = r
            for idx in range(tid, m * n, nt):           # Q's columns k.. of the packing are 0
                out[ob + idx] = 1.0 if idx // n == idx % n and idx % n < k else 0.0
            cuda.syncthreads()
            for j in range(tid, k, nt):                 # Q e_j = H_0 ... H_{k-1} e_j
                for c in range(k - 1, -1, -1):
                    _reflect(out, ob + j, n, w, base + c, n, c, m, w[base + c * n + c],
                             w[tau + 2 * c])
            cuda.syncthreads()
            mat += cuda.gridDim.x

    return kernel

@py_in_sim
def _pick(x, o, i, n, largest):
    """The index of the smallest (largest) of x[o + i .. o + n - 1]: a selection sort's step
    (eigh's ascending values, svd's descending ones; n is small, one thread sorts)."""
    best = i
    for j in range(i + 1, n):
        if (x[o + j] > x[o + best]) if largest else (x[o + j] < x[o + best]):
            best = j
    return best


@py_in_sim
def _swap(x, o, i, j):
    t = x[o + i]
    x[o + i] = x[o + j]
    x[o + j] = t


@py_in_sim
def _swap_cols(a, o, rows, ld, i, j):
    """Columns i and j of the row-major [rows, ld] matrix at a[o:] change places."""
    for r in range(rows):
        t = a[o + r * ld + i]
        a[o + r * ld + i] = a[o + r * ld + j]
        a[o + r * ld + j] = t


@functools.lru_cache(maxsize=None)
def _rotation(f64: bool):
    """The kind's rotation(app, aqq, apq, tol, floor) -> (c, s), in its float."""
    ft = _float(f64)

    @py_in_sim
    def rotation(app, aqq, apq, tol, floor):
        """(c, s) of the Jacobi rotation that zeroes apq (the smaller angle), or (1, 0) when apq
        is negligible: below tol * sqrt(|app aqq|) or below ``floor``."""
        if abs(apq) <= max(tol * math.sqrt(abs(app * aqq)), floor):
            return ft(1.0), ft(0.0)
        theta = (aqq - app) / (2.0 * apq)
        if abs(theta) > 1e18:
            t = 0.5 / theta
        else:
            t = 1.0 / (abs(theta) + math.sqrt(theta * theta + 1.0))
            if theta < 0.0:
                t = -t
        c = 1.0 / math.sqrt(t * t + 1.0)
        return ft(c), ft(t * c)

    return rotation


@functools.lru_cache(maxsize=None)
def eigh_kernel(f64: bool = False):
    """kernel(a, w, out, batch, n): eigh of a's lower triangle [batch, n, n] into out
    [batch, n + 1, n] (w ascending over V's columns); w scratch [batch, n, n]."""
    ft, eps, tiny = (float64, EPS64, TINY64) if f64 else (float32, EPS, TINY)
    rotation = _rotation(f64)

    @jit
    def kernel(a, w, out, batch, n):
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        sh = cuda.shared.array(2, int32)            # rotate this pair, any rotation this sweep
        shf = cuda.shared.array(3, ft)              # c, s, scale
        mat = cuda.blockIdx.x
        while mat < batch:
            base, ob = mat * n * n, mat * (n + 1) * n
            vb = ob + n
            for idx in range(tid, n * n, nt):
                i, j = idx // n, idx % n
                w[base + idx] = a[base + idx] if j <= i else a[base + j * n + i]
                out[vb + idx] = 1.0 if i == j else 0.0
            cuda.syncthreads()
            if tid == 0:
                s = ft(0.0)
                for idx in range(n * n):
                    s = max_nan(s, abs(w[base + idx]))
                shf[2] = s
            for sweep in range(SWEEPS):
                if tid == 0:
                    sh[1] = 0
                cuda.syncthreads()
                for p in range(n - 1):
                    for q in range(p + 1, n):
                        if tid == 0:
                            c, s = rotation(w[base + p * n + p], w[base + q * n + q],
                                            w[base + p * n + q], eps, tiny * shf[2])
                            shf[0], shf[1] = c, s
                            sh[0] = 1 if s != 0.0 else 0
                            if s != 0.0:
                                sh[1] = 1
                        cuda.syncthreads()
                        if sh[0] != 0:
                            c, s = shf[0], shf[1]
                            for r in range(tid, n, nt):        # W <- W J, V <- V J
                                x, y = w[base + r * n + p], w[base + r * n + q]
                                w[base + r * n + p] = c * x - s * y
                                w[base + r * n + q] = s * x + c * y
                                x, y = out[vb + r * n + p], out[vb + r * n + q]
                                out[vb + r * n + p] = c * x - s * y
                                out[vb + r * n + q] = s * x + c * y
                            cuda.syncthreads()
                            for r in range(tid, n, nt):        # W <- J^T W
                                x, y = w[base + p * n + r], w[base + q * n + r]
                                w[base + p * n + r] = c * x - s * y
                                w[base + q * n + r] = s * x + c * y
                        cuda.syncthreads()
                done = sh[1] == 0
                cuda.syncthreads()
                if done:
                    break
            if tid == 0:                                # ascending, V's columns along
                for i in range(n):
                    out[ob + i] = w[base + i * n + i]
                for i in range(n - 1):
                    lo = _pick(out, ob, i, n, False)
                    if lo != i:
                        _swap(out, ob, i, lo)
                        _swap_cols(out, vb, n, n, i, lo)
            cuda.syncthreads()
            for j in range(tid, n, nt):                 # the largest component positive
                big = 0
                for r in range(1, n):
                    if abs(out[vb + r * n + j]) > abs(out[vb + big * n + j]):
                        big = r
                if out[vb + big * n + j] < 0.0:
                    for r in range(n):
                        out[vb + r * n + j] = -out[vb + r * n + j]
            cuda.syncthreads()
            mat += cuda.gridDim.x

    return kernel


@functools.lru_cache(maxsize=None)
def svd_kernel(f64: bool = False):
    """kernel(a, v, out, batch, m, n): thin SVD of a [batch, m, n], m >= n, into out
    [batch, m + 1 + n, n] (U, S descending, Vh); v scratch [batch, n, n] (V)."""
    ft, eps = (float64, EPS64) if f64 else (float32, EPS)
    rotation = _rotation(f64)

    @jit
    def kernel(a, v, out, batch, m, n):
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        sh = cuda.shared.array(2, int32)
        shf = cuda.shared.array(3, ft)
        mat = cuda.blockIdx.x
        while mat < batch:
            ob, vb = mat * (m + 1 + n) * n, mat * n * n
            sb = ob + m * n
            for idx in range(tid, m * n, nt):
                out[ob + idx] = a[mat * m * n + idx]
            for idx in range(tid, n * n, nt):
                v[vb + idx] = 1.0 if idx // n == idx % n else 0.0
            cuda.syncthreads()
            if tid == 0:
                shf[2] = eps * math.sqrt(ft(m))
            for sweep in range(SWEEPS):
                if tid == 0:
                    sh[1] = 0
                cuda.syncthreads()
                for p in range(n - 1):
                    for q in range(p + 1, n):
                        if tid == 0:
                            al, be, ga = ft(0.0), ft(0.0), ft(0.0)
                            for r in range(m):
                                x, y = out[ob + r * n + p], out[ob + r * n + q]
                                al += x * x
                                be += y * y
                                ga += x * y
                            # the rotation that diagonalises [[al, ga], [ga, be]] (U^T U's block);
                            # relative only (one-sided Jacobi's accuracy for small singular
                            # values), at the rounding of an m-term dot product, as LAPACK's gesvj
                            c, s = rotation(al, be, ga, shf[2], ft(0.0))
                            shf[0], shf[1] = c, s
                            sh[0] = 1 if s != 0.0 else 0
                            if s != 0.0:
                                sh[1] = 1
                        cuda.syncthreads()
                        if sh[0] != 0:
                            c, s = shf[0], shf[1]
                            for r in range(tid, m, nt):
                                x, y = out[ob + r * n + p], out[ob + r * n + q]
                                out[ob + r * n + p] = c * x - s * y
                                out[ob + r * n + q] = s * x + c * y
                            for r in range(tid, n, nt):
                                x, y = v[vb + r * n + p], v[vb + r * n + q]
                                v[vb + r * n + p] = c * x - s * y
                                v[vb + r * n + q] = s * x + c * y
                        cuda.syncthreads()
                done = sh[1] == 0
                cuda.syncthreads()
                if done:
                    break
            for j in range(tid, n, nt):                 # S_j = |U[:, j]|, U's columns normalised
                mx = ft(0.0)
                for r in range(m):
                    mx = max_nan(mx, abs(out[ob + r * n + j]))
                sj = ft(0.0)
                if mx != 0.0:                           # (a NaN column: S_j NaN, not 0)
                    s = ft(0.0)
                    for r in range(m):
                        y = out[ob + r * n + j] / mx
                        s += y * y
                    sj = mx * math.sqrt(s)
                    for r in range(m):
                        out[ob + r * n + j] /= sj
                out[sb + j] = sj
            cuda.syncthreads()
            if tid == 0:                                # descending, U's and V's columns along
                for i in range(n - 1):
                    hi = _pick(out, sb, i, n, True)
                    if hi != i:
                        _swap(out, sb, i, hi)
                        _swap_cols(out, ob, m, n, i, hi)
                        _swap_cols(v, vb, n, n, i, hi)
            cuda.syncthreads()
            for j in range(tid, n, nt):                 # U's largest component positive
                big = 0
                for r in range(1, m):
                    if abs(out[ob + r * n + j]) > abs(out[ob + big * n + j]):
                        big = r
                if out[ob + big * n + j] < 0.0:
                    for r in range(m):
                        out[ob + r * n + j] = -out[ob + r * n + j]
                    for r in range(n):
                        v[vb + r * n + j] = -v[vb + r * n + j]
            cuda.syncthreads()
            for idx in range(tid, n * n, nt):           # Vh = V^T
                out[sb + n + idx] = v[vb + (idx % n) * n + idx // n]
            cuda.syncthreads()
            mat += cuda.gridDim.x

    return kernel

# ---- tier 0's layout and info kernels (cuSOLVER / cuBLAS are column-major; a row-major
# [r, c] buffer is to them the column-major [c, r] transpose). Grid-stride, a thread an item.
@jit
def transpose_kernel(src, dst, batch, r, c):
    """dst[b] = src[b]^T: src [batch, r, c] -> dst [batch, c, r]."""
    idx = cuda.grid(1)
    total = batch * r * c
    while idx < total:
        b, rem = idx // (r * c), idx % (r * c)
        i, j = rem // c, rem % c
        dst[b * r * c + j * r + i] = src[idx]
        idx += cuda.gridsize(1)


@jit
def nan_where_kernel(x, info, batch, per):
    """x[b] (``per`` values) NaN where info[b] != 0 (singular, not converged)."""
    idx = cuda.grid(1)
    while idx < batch * per:
        if info[idx // per] != 0:
            x[idx] = NAN
        idx += cuda.gridsize(1)


@jit
def tril_kernel(src, el, info, batch, n, transposed):
    """el = the lower triangle of src (row-major; of src^T when ``transposed``: potrf "lower"
    on a column-major matrix), the rest zero; NaN-filled where info is not 0 (not positive
    definite). src may be el (``transposed`` 0)."""
    idx = cuda.grid(1)
    while idx < batch * n * n:
        rem = idx % (n * n)
        r, c = rem // n, rem % n
        if info[idx // (n * n)] != 0:
            el[idx] = NAN
        elif c > r:
            el[idx] = 0.0
        elif transposed:
            el[idx] = src[idx - rem + c * n + r]
        else:
            el[idx] = src[idx]
        idx += cuda.gridsize(1)


@functools.lru_cache(maxsize=None)
def slogdet_lu(f64: bool = False):
    """kernel(lu, ipiv, info, det, batch, n): (sign, log|det|) from getrf's factors (U's
    diagonal, 1-based pivots), summed in the kind's float; (0, -inf) where info > 0 (an
    exact zero pivot). A thread a matrix."""
    ft = _float(f64)

    @jit
    def kernel(lu, ipiv, info, det, batch, n):
        b = cuda.grid(1)
        while b < batch:
            if info[b] != 0:
                det[2 * b] = 0.0
                det[2 * b + 1] = -math.inf
            else:
                sign, logabs = ft(1.0), ft(0.0)
                for i in range(n):
                    u = lu[b * n * n + i * n + i]
                    if (u < 0.0) != (ipiv[b * n + i] != i + 1):
                        sign = -sign
                    logabs += math.log(abs(u))
                det[2 * b] = sign
                det[2 * b + 1] = logabs
            b += cuda.gridsize(1)

    return kernel


slogdet_lu_kernel = slogdet_lu()            # the f32 kind


@jit
def qr_r_kernel(work, out, batch, m, n):
    """R [k, n] from geqrf's column-major [m, n] result into the packing's rows m.."""
    k = min(m, n)
    idx = cuda.grid(1)
    while idx < batch * k * n:
        b, rem = idx // (k * n), idx % (k * n)
        i, j = rem // n, rem % n
        out[b * (m + k) * n + (m + i) * n + j] = work[b * m * n + j * m + i] if j >= i else 0.0
        idx += cuda.gridsize(1)


@jit
def qr_q_kernel(work, out, batch, m, n):
    """Q [m, k] from orgqr's column-major first k columns into the packing's rows 0..m-1
    (columns k.. zero)."""
    k = min(m, n)
    idx = cuda.grid(1)
    while idx < batch * m * n:
        b, rem = idx // (m * n), idx % (m * n)
        i, j = rem // n, rem % n
        out[b * (m + k) * n + i * n + j] = work[b * m * n + j * m + i] if j < k else 0.0
        idx += cuda.gridsize(1)


# tier 0's batched Q: a block keeps Q in shared memory when it fits (a 64x64 Q is 16 KB), with
# the reflector being applied staged beside it (double-buffered: one barrier a reflector)
QR_Q_SHARED, QR_V_SHARED = 4096, 128
ONE, ZERO = float32(1.0), float32(0.0)     # (a literal 0.0 in a conditional is f64)
ONE64, ZERO64 = float64(1.0), float64(0.0)


def qr_q_in_shared(m: int, k: int) -> bool:
    """Whether qr_form_q_kernel(True) can form an m x k Q (else qr_form_q_kernel(False))."""
    return m * k <= QR_Q_SHARED and m <= QR_V_SHARED


@functools.lru_cache(maxsize=None)
def qr_form_q_kernel(shared: bool, f64: bool = False):
    """kernel(work, tau, out, batch, m, n): Q [m, k] from geqrf's column-major [m, n] result
    (a reflector below each diagonal entry, its unit head implied; tau [batch, k]) straight
    into the packing's rows 0..m-1 (columns k.. zero), for a batch of matrices at once
    (cuSOLVER's orgqr takes one). Q = H_0 ... H_{k-1} I[:, :k], the reflectors applied last
    first, so H_c meets columns c.. only (LAPACK's org2r). A block a matrix, a thread a
    column of Q for the whole run (no barrier between a column's updates; consecutive
    threads, consecutive words). ``shared``: Q row-major [m, k] in shared memory (needs
    qr_q_in_shared(m, k)) and each reflector staged there; else Q formed in place in out and
    the reflectors read from work. ``f64``: the f64 kind (34 KB of shared memory)."""
    q_size, v_size = (QR_Q_SHARED, 2 * QR_V_SHARED) if shared else (1, 1)
    ft = _float(f64)
    one, zero = (ONE64, ZERO64) if f64 else (ONE, ZERO)

    @jit
    def kernel(work, tau, out, batch, m, n):
        tid, nt = cuda.threadIdx.x, cuda.blockDim.x
        k = min(m, n)
        qs = cuda.shared.array(q_size, ft)
        vs = cuda.shared.array(v_size, ft)
        mat = cuda.blockIdx.x
        while mat < batch:
            wb, ob = mat * m * n, mat * (m + k) * n
            if shared:                              # a thread's own columns: no barrier
                for j in range(tid, k, nt):
                    for i in range(m):
                        qs[i * k + j] = one if i == j else zero
            else:
                for idx in range(tid, m * n, nt):
                    out[ob + idx] = one if idx // n == idx % n else zero
                cuda.syncthreads()
            for c in range(k - 1, -1, -1):
                beta = tau[mat * k + c]
                if shared:
                    p = (c % 2) * QR_V_SHARED
                    for i in range(c + 1 + tid, m, nt):
                        vs[p + i] = work[wb + c * m + i]
                    cuda.syncthreads()
                    for j in range(tid, k, nt):
                        if j >= c:
                            _reflect(qs, j, k, vs, p, 1, c, m, one, beta)
                else:
                    for j in range(tid, k, nt):
                        if j >= c:
                            _reflect(out, ob + j, n, work, wb + c * m, 1, c, m, one, beta)
            if shared:
                cuda.syncthreads()
                for idx in range(tid, m * n, nt):
                    i, j = idx // n, idx % n
                    out[ob + idx] = qs[i * k + j] if j < k else zero
            cuda.syncthreads()
            mat += cuda.gridDim.x

    return kernel


@jit
def eigh_post_kernel(vec, w, info, out, batch, n):
    """The packing [n + 1, n] from syevd / syevj's ascending w and column-major vectors, each
    vector's largest component positive (the numba tier's gauge); NaN where info != 0. A
    thread a (matrix, vector)."""
    idx = cuda.grid(1)
    while idx < batch * n:
        b, j = idx // n, idx % n
        col = b * n * n + j * n
        ob = b * (n + 1) * n
        big = 0
        for r in range(1, n):
            if abs(vec[col + r]) > abs(vec[col + big]):
                big = r
        s = float32(-1.0) if vec[col + big] < 0.0 else float32(1.0)
        bad = info[b] != 0
        out[ob + j] = NAN if bad else w[b * n + j]
        for r in range(n):
            out[ob + (1 + r) * n + j] = NAN if bad else s * vec[col + r]
        idx += cuda.gridsize(1)


@jit
def svd_post_kernel(u1, s, v1, info, out, batch, m, n, ustride, vstride):
    """The packing [m + 1 + n, n] from gesvdj of A^T (column-major [n, m]): A^T = U' S V'^T,
    so U = V' (ld m) and Vh = U'^T (ld n); each U column's largest component positive, the
    Vh row along; NaN where info != 0. A thread a (matrix, singular triple)."""
    idx = cuda.grid(1)
    while idx < batch * n:
        b, j = idx // n, idx % n
        ucol = b * vstride + j * m
        vcol = b * ustride + j * n
        ob = b * (m + 1 + n) * n
        big = 0
        for r in range(1, m):
            if abs(v1[ucol + r]) > abs(v1[ucol + big]):
                big = r
        sg = float32(-1.0) if v1[ucol + big] < 0.0 else float32(1.0)
        bad = info[b] != 0
        for r in range(m):
            out[ob + r * n + j] = NAN if bad else sg * v1[ucol + r]
        out[ob + m * n + j] = NAN if bad else s[b * n + j]
        for r in range(n):
            out[ob + (m + 1 + j) * n + r] = NAN if bad else sg * u1[vcol + r]
        idx += cuda.gridsize(1)
