"""Dense linear algebra (torch.linalg semantics, batched [..., n, n], f32 and f64): the nodes'
OpDefs (ir/opdef.py), argument checks, the Graph builder methods (mixed into Graph) and the
VJPs (torch's formulas, built from graph ops). Tiers: runtime/lower_linalg.py (0 cuSOLVER /
cuBLAS, 1 numba, ``RLX_NUMBA_LINALG_TIERS``).

f32 or f64: an f64 op computes in f64 throughout (cuSOLVER's / cuBLAS's D routines, the numba
kernels' f64 kind) and gives f64 results; its gradient is f64 too. Half operands raise (no
half kernels: cast to f32). A and B of solve / triangular_solve must share the dtype, as a
product's operands (torch's rule: no promotion inside linalg.solve; cast one first).

Nodes (leading batch axes flattened; one matrix a block in the numba tier):
  "lu_solve"  (A [..., n, n], B [..., n, k]) -> X = A^-1 B (partial-pivot LU)
  "cholesky"  A [..., n, n] -> L lower (reads A's lower triangle only)
  "trsm"      (A [..., n, n], B [..., n, k]) -> A^-1 B, A triangular (attr ``upper``; only
              that triangle read); right-side solves are this on transposes
  "slogdet"   A [..., n, n] -> [..., 2]: (sign, log|det|)
  "qr"        A [..., m, n] -> packed [..., m + k, n], k = min(m, n): rows 0..m-1 hold Q
              [m, k] (columns k.. zero), rows m.. hold R [k, n]
  "eigh"      A [..., n, n] -> packed [..., n + 1, n]: row 0 the eigenvalues ascending, rows
              1.. the eigenvectors as columns (reads the lower triangle, UPLO='L')
  "svd"       A [..., m, n], m >= n -> packed [..., m + 1 + n, n]: U [m, n], S [n]
              descending, Vh [n, n] (m < n runs on the transpose)
A multi-result op is one packed node so that its VJP sees every result's gradient at once
(the builder's narrows are views; their VJPs pad the unused parts with zeros).

A singular matrix (an exact zero pivot) or a matrix that is not positive definite: torch
raises; raising would need a device sync after every run, so the result is NaN-filled
instead -- solve / inv give NaN X, cholesky NaN L; det gives 0 and slogdet (0, -inf), as
torch. triangular_solve divides by the diagonal as torch does (inf / NaN on a zero).

Sign conventions (gauge): qr's R diagonal has LAPACK's Householder signs (not normalised, as
torch); eigh's and svd's vectors are scaled so that each eigenvector / each left singular
vector has its largest-magnitude component positive (torch leaves LAPACK's). Compare
gauge-invariant quantities (reconstructions, |V^T V_ref|). Gradients of svd / eigh assume
distinct values (torch's formulas divide by their differences).
"""
from __future__ import annotations

import numpy as np

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32_ONLY, defop
from .ops import fmt


def _desc(t):
    return f"{t.dtype} {fmt(t.shape)}"


LINALG_DTYPES = (dt.F32, dt.F64)


def _float(op, arg, t):
    if t.dtype not in LINALG_DTYPES:
        raise ValueError(f"{op}: {arg} must be f32 or f64 (linalg has no half or integer "
                         f"kernels: cast it first), got {_desc(t)}")


def _same_dtype(op, a, b):
    """A and B of one dtype (both f32 or both f64), as a product's operands."""
    _float(op, "B", b)
    if a.dtype != b.dtype:
        raise ValueError(f"{op}: A and B must have the same dtype, got A {_desc(a)} and B "
                         f"{_desc(b)}; cast one of them first")


def _square(op, arg, a):
    _float(op, arg, a)
    if len(a.shape) < 2 or a.shape[-1] != a.shape[-2] or a.shape[-1] < 1:
        raise ValueError(f"{op}: {arg} must be square [..., n, n] with n >= 1, got {_desc(a)}")


def _matrix(op, arg, a):
    _float(op, arg, a)
    if len(a.shape) < 2 or a.shape[-1] < 1 or a.shape[-2] < 1:
        raise ValueError(f"{op}: {arg} must be [..., m, n] with m, n >= 1, got {_desc(a)}")


def _rhs(op, a, b):
    _square(op, "A", a)
    _same_dtype(op, a, b)
    if tuple(b.shape[:-2]) != tuple(a.shape[:-2]) or len(b.shape) < 2 \
            or b.shape[-2] != a.shape[-1]:
        raise ValueError(f"{op}: B must be [..., n, k] with A's batch axes and n rows, got A "
                         f"{_desc(a)}, B {_desc(b)}")


def infer_lu_solve(a, b):
    _rhs("lu_solve", a, b)
    return b.shape, a.dtype


def infer_trsm(a, b, upper):
    _rhs("trsm", a, b)
    return b.shape, a.dtype


def infer_cholesky(a):
    _square("cholesky", "A", a)
    return a.shape, a.dtype


def infer_slogdet(a):
    _square("slogdet", "A", a)
    return tuple(a.shape[:-2]) + (2,), a.dtype


def infer_qr(a):
    _matrix("qr", "A", a)
    m, n = a.shape[-2:]
    return tuple(a.shape[:-2]) + (m + min(m, n), n), a.dtype


def infer_eigh(a):
    _square("eigh", "A", a)
    n = a.shape[-1]
    return tuple(a.shape[:-2]) + (n + 1, n), a.dtype


def infer_svd(a):
    _matrix("svd", "A", a)
    m, n = a.shape[-2:]
    if m < n:
        raise ValueError(f"svd: the node takes m >= n (the builder transposes), got {_desc(a)}")
    return tuple(a.shape[:-2]) + (m + 1 + n, n), a.dtype


LINALG_NODES = ("lu_solve", "cholesky", "trsm", "slogdet", "qr", "eigh", "svd")
_TIERS = "RLX_NUMBA_LINALG_TIERS"
defop("lu_solve", infer_lu_solve, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="X = A^-1 B by partial-pivot LU (NaN X for a singular A)")
defop("cholesky", infer_cholesky, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="lower Cholesky factor from A's lower triangle (NaN when not positive definite)")
defop("trsm", infer_trsm, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="A^-1 B for a triangular A (attr upper)")
defop("slogdet", infer_slogdet, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="(sign, log|det A|) as [..., 2]")
defop("qr", infer_qr, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="reduced Householder QR, packed [..., m + k, n]: Q over R")
defop("eigh", infer_eigh, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="symmetric eigendecomposition (lower triangle), packed [..., n + 1, n]: w over V")
defop("svd", infer_svd, dtype_rule=F32_ONLY, f64=True, tier_env=_TIERS,
      doc="thin SVD of m >= n, packed [..., m + 1 + n, n]: U, S, Vh")


# ---- helpers for the VJPs (graph ops) ----------------------------------------------------------
def mT(g, x):
    """x with its last two axes swapped."""
    r = len(x.shape)
    return g.transpose(x, list(range(r - 2)) + [r - 1, r - 2])


def _eye(g, n, like):
    """The n x n identity in ``like``'s dtype (f32 or f64)."""
    return g.constant(np.eye(n), like.dtype)


def _tri_mask(g, n, lower: bool, like, k: int = 0):
    ones = np.ones((n, n))
    m = np.tril(ones, k) if lower else np.triu(ones, k)
    return g.constant(m, like.dtype)


def _diag_embed(g, v):
    """[..., n] -> [..., n, n] with v on the diagonal."""
    n = v.shape[-1]
    return g.mul(g.reshape(v, tuple(v.shape) + (1,)), _eye(g, n, v))


def _col(g, v):
    """[..., n] -> [..., n, 1]"""
    return g.reshape(v, tuple(v.shape) + (1,))


def _row(g, v):
    """[..., n] -> [..., 1, n]"""
    return g.reshape(v, tuple(v.shape[:-1]) + (1, v.shape[-1]))


@vjp("lu_solve")
def _vjp_lu_solve(g, n, dx):
    # X = A^-1 B: dB = A^-T dX, dA = -dB X^T
    a = g.tensor(n.inputs[0])
    db = g.bind("lu_solve", [mT(g, a), dx])
    return [g.neg(g.matmul(db, mT(g, g.tensor(n.id)))), db]


@vjp("trsm")
def _vjp_trsm(g, n, dx):
    # X = A^-1 B, A triangular: dB = A^-T dX, dA = -dB X^T on A's triangle
    a, upper = g.tensor(n.inputs[0]), n.attrs["upper"]
    db = g.bind("trsm", [mT(g, a), dx], upper=not upper)
    da = g.mul(g.neg(g.matmul(db, mT(g, g.tensor(n.id)))),
               _tri_mask(g, a.shape[-1], not upper, a))
    return [da, db]


@vjp("cholesky")
def _vjp_cholesky(g, n, dl):
    # torch's cholesky_backward: P = tril(L^T dL), P = (P + tril(P, -1)^T) / 2,
    # dA = L^-T P L^-1 (symmetric)
    L = g.tensor(n.id)
    k = L.shape[-1]
    p = g.mul(g.matmul(mT(g, L), dl), _tri_mask(g, k, True, L))
    p = g.mul(g.add(p, mT(g, g.mul(p, _tri_mask(g, k, True, L, -1)))), 0.5)
    lt = mT(g, L)
    s = g.bind("trsm", [lt, p], upper=True)                          # S = L^-T P
    return [mT(g, g.bind("trsm", [lt, mT(g, s)], upper=True))]       # S L^-1 = (L^-T S^T)^T


@vjp("slogdet")
def _vjp_slogdet(g, n, dy):
    # d log|det A| = A^-T; the sign has no gradient
    a = g.tensor(n.inputs[0])
    k = a.shape[-1]
    dl = g.narrow(dy, -1, 1, 1)                                       # [..., 1]
    inv_t = g.bind("lu_solve", [mT(g, a), g.expand(_eye(g, k, a), a.shape)])
    return [g.mul(inv_t, g.reshape(dl, tuple(dl.shape) + (1,)))]


def _qr_back_tall(g, q, r, dq, dr):
    # m >= n (Liao et al. / torch): M = R dR^T - dQ^T Q, dA = (dQ + Q copyltu(M)) R^-T
    k = r.shape[-1]
    m_ = g.sub(g.matmul(r, mT(g, dr)), g.matmul(mT(g, dq), q))
    low = g.mul(m_, _tri_mask(g, k, True, r))
    sym = g.add(low, mT(g, g.mul(m_, _tri_mask(g, k, True, r, -1))))
    y = g.add(dq, g.matmul(q, sym))
    # Y R^-T = (R^-1 Y^T)^T
    return mT(g, g.bind("trsm", [r, mT(g, y)], upper=True))


@vjp("qr")
def _vjp_qr(g, n, dy):
    a = g.tensor(n.inputs[0])
    m, nn = a.shape[-2:]
    k = min(m, nn)
    out = g.tensor(n.id)
    q = g.narrow(g.narrow(out, -2, 0, m), -1, 0, k)
    r = g.narrow(out, -2, m, k)
    dq = g.narrow(g.narrow(dy, -2, 0, m), -1, 0, k)
    dr = g.narrow(dy, -2, m, k)
    if m >= nn:
        return [_qr_back_tall(g, q, r, dq, dr)]
    # wide (torch): A = [X | Y], R = [U | V]; dY = Q dV, dX = square case with dQ + Y dV^T
    u, v = g.narrow(r, -1, 0, m), g.narrow(r, -1, m, nn - m)
    du, dv = g.narrow(dr, -1, 0, m), g.narrow(dr, -1, m, nn - m)
    ya = g.narrow(a, -1, m, nn - m)
    dx = _qr_back_tall(g, q, u, g.add(dq, g.matmul(ya, mT(g, dv))), du)
    return [g.concat([dx, g.matmul(q, dv)], -1)]


@vjp("eigh")
def _vjp_eigh(g, n, dy):
    # torch (hermitian): K = skew(V^T dV) / 2, F_ij = K_ij / (w_j - w_i), dA = V (F + diag(dw)) V^T
    k = n.shape[-1]
    out = g.tensor(n.id)
    w, v = g.reshape(g.narrow(out, -2, 0, 1), tuple(out.shape[:-2]) + (k,)), g.narrow(out, -2, 1, k)
    dw = g.reshape(g.narrow(dy, -2, 0, 1), tuple(out.shape[:-2]) + (k,))
    dv = g.narrow(dy, -2, 1, k)
    x = g.matmul(mT(g, v), dv)
    skew = g.mul(g.sub(x, mT(g, x)), 0.5)
    e = g.add(g.sub(_row(g, w), _col(g, w)), _eye(g, k, w))          # w_j - w_i, 1 on the diagonal
    inner = g.add(g.div(skew, e), _diag_embed(g, dw))
    return [g.matmul(g.matmul(v, inner), mT(g, v))]


@vjp("svd")
def _vjp_svd(g, n, dy):
    # torch's svd_backward (full_matrices=False), m >= n so k = n:
    # inner = (skew(U^T dU) S_col... ) / E + diag(dS), E_jk = S_k^2 - S_j^2;
    # dA = U inner Vh + (I - U U^T) dU S^-1 Vh
    a = g.tensor(n.inputs[0])
    m, k = a.shape[-2:]
    out = g.tensor(n.id)
    batch = tuple(out.shape[:-2])
    u, vh = g.narrow(out, -2, 0, m), g.narrow(out, -2, m + 1, k)
    s = g.reshape(g.narrow(out, -2, m, 1), batch + (k,))
    du, dvh = g.narrow(dy, -2, 0, m), g.narrow(dy, -2, m + 1, k)
    ds = g.reshape(g.narrow(dy, -2, m, 1), batch + (k,))
    v, dv = mT(g, vh), mT(g, dvh)
    x = g.matmul(mT(g, u), du)
    uhgu = g.sub(x, mT(g, x))
    z = g.matmul(mT(g, v), dv)
    vhgv = g.sub(z, mT(g, z))
    s2 = g.mul(s, s)
    e = g.add(g.sub(_row(g, s2), _col(g, s2)), _eye(g, k, s2))
    inner = g.div(g.add(g.mul(uhgu, _row(g, s)), g.mul(_col(g, s), vhgv)), e)
    inner = g.add(inner, _diag_embed(g, ds))
    da = g.matmul(u, inner)
    if m > k:
        dus = g.div(du, _row(g, s))
        da = g.sub(g.add(da, dus), g.matmul(u, g.matmul(mT(g, u), dus)))
    return [g.matmul(da, vh)]


class LinalgOps:
    """Builder methods; ``self`` is the Graph."""

    def _batch(self, op, a, b):
        """A and B with their batch axes broadcast (B [..., n, k])."""
        ba, bb = tuple(a.shape[:-2]), tuple(b.shape[:-2])
        if ba == bb:
            return a, b
        try:
            batch = tuple(np.broadcast_shapes(ba, bb))
        except ValueError:
            raise ValueError(f"{op}: the batch axes of A {_desc(a)} and B {_desc(b)} do not "
                             f"broadcast") from None
        return (self.expand(a, batch + tuple(a.shape[-2:])),
                self.expand(b, batch + tuple(b.shape[-2:])))

    def linalg_solve(self, A, B):
        """torch.linalg.solve(A, B): X with A X = B; A [..., n, n], B [..., n, k] or [..., n]
        (a vector when B is 1-D or B.shape == A.shape[:-1]); batch axes broadcast. A singular A
        gives NaN (torch raises)."""
        op = "linalg_solve"
        self.check(op, "A", A)
        self.check(op, "B", B)
        _square(op, "A", A)
        _same_dtype(op, A, B)
        n = A.shape[-1]
        vector = len(B.shape) == 1 or tuple(B.shape) == tuple(A.shape[:-1])
        if vector:
            if B.shape[-1] != n:
                raise ValueError(f"{op}: B must have n={n} rows, got A {_desc(A)}, B {_desc(B)}")
            B = self.reshape(B, tuple(B.shape) + (1,))
        elif len(B.shape) < 2 or B.shape[-2] != n:
            raise ValueError(f"{op}: B must be [..., n, k] or [..., n] with n={n}, got A "
                             f"{_desc(A)}, B {_desc(B)}")
        a, b = self._batch(op, A, B)
        x = self.bind("lu_solve", [a, b])
        return self.reshape(x, tuple(x.shape[:-1])) if vector else x

    def inv(self, A):
        """torch.linalg.inv(A): A [..., n, n]; a singular A gives NaN (torch raises)."""
        self.check("inv", "A", A)
        _square("inv", "A", A)
        return self.bind("lu_solve", [A, self.expand(_eye(self, A.shape[-1], A), A.shape)])

    def cholesky(self, A, upper: bool = False):
        """torch.linalg.cholesky(A, upper): L (L L^T = A) from A's lower triangle, or its
        transpose when ``upper``; NaN when A is not positive definite (torch raises)."""
        self.check("cholesky", "A", A)
        _square("cholesky", "A", A)
        if not isinstance(upper, bool):
            raise ValueError(f"cholesky: upper must be a bool, got {upper!r}")
        L = self.bind("cholesky", [A])
        return mT(self, L) if upper else L

    def triangular_solve(self, A, B, upper: bool = False, left: bool = True):
        """torch.linalg.solve_triangular(A, B, upper=upper, left=left): X with A X = B (left)
        or X A = B; only A's ``upper`` / lower triangle is read. B [..., n, k] (left) or
        [..., k, n]; batch axes broadcast."""
        op = "triangular_solve"
        self.check(op, "A", A)
        self.check(op, "B", B)
        _square(op, "A", A)
        _same_dtype(op, A, B)
        for arg, v in (("upper", upper), ("left", left)):
            if not isinstance(v, bool):
                raise ValueError(f"{op}: {arg} must be a bool, got {v!r}")
        n = A.shape[-1]
        if len(B.shape) < 2 or B.shape[-2 if left else -1] != n:
            raise ValueError(f"{op}: B must be [..., {'n, k' if left else 'k, n'}] with n={n} "
                             f"(left={left}), got A {_desc(A)}, B {_desc(B)}")
        a, b = self._batch(op, A, B)
        if left:
            return self.bind("trsm", [a, b], upper=upper)
        # X A = B  <=>  A^T X^T = B^T
        return mT(self, self.bind("trsm", [mT(self, a), mT(self, b)], upper=not upper))

    def slogdet(self, A):
        """torch.linalg.slogdet(A) -> (sign, logabsdet), each [...]; a singular A gives
        (0, -inf)."""
        self.check("slogdet", "A", A)
        _square("slogdet", "A", A)
        out = self.bind("slogdet", [A])
        batch = tuple(A.shape[:-2])
        return (self.reshape(self.narrow(out, -1, 0, 1), batch),
                self.reshape(self.narrow(out, -1, 1, 1), batch))

    def det(self, A):
        """torch.linalg.det(A) [...] as sign * exp(logabsdet) (0 for a singular A; its
        gradient there is not finite, unlike torch's)."""
        self.check("det", "A", A)
        _square("det", "A", A)
        sign, logabs = self.slogdet(A)
        return self.mul(sign, self.exp(logabs))

    def qr(self, A):
        """torch.linalg.qr(A, mode="reduced") -> (Q [..., m, k], R [..., k, n]), k = min(m, n)."""
        self.check("qr", "A", A)
        _matrix("qr", "A", A)
        m, n = A.shape[-2:]
        k = min(m, n)
        out = self.bind("qr", [A])
        return self.narrow(self.narrow(out, -2, 0, m), -1, 0, k), self.narrow(out, -2, m, k)

    def eigh(self, A):
        """torch.linalg.eigh(A, UPLO="L") -> (w [..., n] ascending, V [..., n, n]); reads the
        lower triangle. Each eigenvector's largest-magnitude component is positive."""
        self.check("eigh", "A", A)
        _square("eigh", "A", A)
        n = A.shape[-1]
        out = self.bind("eigh", [A])
        return (self.reshape(self.narrow(out, -2, 0, 1), tuple(A.shape[:-2]) + (n,)),
                self.narrow(out, -2, 1, n))

    def svd(self, A):
        """torch.linalg.svd(A, full_matrices=False) -> (U [..., m, k], S [..., k] descending,
        Vh [..., k, n]), k = min(m, n). Each left singular vector's largest-magnitude
        component is positive (for m < n: each right singular vector's)."""
        self.check("svd", "A", A)
        _matrix("svd", "A", A)
        m, n = A.shape[-2:]
        wide = m < n
        a = mT(self, A) if wide else A
        mm, k = a.shape[-2:]
        out = self.bind("svd", [a])
        u = self.narrow(out, -2, 0, mm)
        s = self.reshape(self.narrow(out, -2, mm, 1), tuple(a.shape[:-2]) + (k,))
        vh = self.narrow(out, -2, mm + 1, k)
        if wide:        # A^T = U S Vh  =>  A = Vh^T S U^T
            return mT(self, vh), s, mT(self, u)
        return u, s, vh
