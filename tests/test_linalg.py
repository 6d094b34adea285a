"""Linear algebra (ir/ops_linalg.py): every op against numpy.linalg in float64, reconstructions,
gradients against float64 finite differences, the singular / not-positive-definite results,
the argument errors; on a GPU the cuSOLVER tier (0) at larger sizes."""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir.ops_linalg import mT

from conftest import ON_GPU
from gradcheck import check

T = lambda x: np.swapaxes(x, -1, -2)  # noqa: E731


def _wellcond(rng, shape):
    n = shape[-1]
    return (rng.standard_normal(shape) / np.sqrt(n) + 2 * np.eye(n)).astype(np.float32)


def _spd(rng, shape):
    a = rng.standard_normal(shape) / np.sqrt(shape[-1])
    return (a @ T(a) + np.eye(shape[-1])).astype(np.float32)


def _lower_sym(a):
    """The symmetric matrix that a's lower triangle describes (UPLO='L')."""
    return np.tril(a) + T(np.tril(a, -1))


def _sign_fix(u, *others):
    """Flip columns of u (and the same columns / rows of the others) so that each column's
    largest-magnitude component is positive: the ops' documented gauge."""
    big = np.take_along_axis(u, np.abs(u).argmax(-2)[..., None, :], -2)
    s = np.where(big < 0, -1.0, 1.0)
    return (u * s,) + tuple(o * s for o in others)


def _run(g, outs, feed):
    g.set_outputs(list(outs))
    return rlx.compile(g).run(feed)


def test_solve_broadcasts_batch_axes(rng):
    """torch.linalg.solve broadcasts A [2, 1, n, n] against B [3, n, k] to [2, 3, n, k]."""
    a, b = _wellcond(rng, (2, 1, 3, 3)), rng.standard_normal((3, 3, 2)).astype(np.float32)
    g = rlx.Graph("broadcast")
    A, B = g.input("a", a.shape, "f32"), g.input("b", b.shape, "f32")
    x, t = _run(g, [g.linalg_solve(A, B), g.triangular_solve(A, B, upper=True)], {"a": a, "b": b})
    assert x.shape == t.shape == (2, 3, 3, 2)
    np.testing.assert_allclose(x, np.linalg.solve(a.astype(np.float64), b), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(t, np.linalg.solve(np.triu(a.astype(np.float64)), b), rtol=2e-5,
                               atol=2e-5)


@pytest.mark.parametrize("n", [3, 7])
def test_ops_against_numpy(rng, n):
    a, b = _wellcond(rng, (2, n, n)), rng.standard_normal((2, n, 2)).astype(np.float32)
    spd, v = _spd(rng, (2, n, n)), rng.standard_normal(n).astype(np.float32)
    g = rlx.Graph("linalg")
    A, B = g.input("a", a.shape, "f32"), g.input("b", b.shape, "f32")
    S, V = g.input("s", spd.shape, "f32"), g.input("v", v.shape, "f32")
    sign, logabs = g.slogdet(A)
    outs = _run(g, [g.linalg_solve(A, B), g.linalg_solve(A, V), g.inv(A), g.det(A), sign, logabs,
                    g.cholesky(S), g.cholesky(S, upper=True),
                    g.triangular_solve(A, B, upper=True),
                    g.triangular_solve(A, g.narrow(mT(g, B), -1, 0, n), upper=False, left=False)],
                {"a": a, "b": b, "s": spd, "v": v})
    a64, b64, s64 = a.astype(np.float64), b.astype(np.float64), spd.astype(np.float64)
    ref_sign, ref_log = np.linalg.slogdet(a64)
    chol = np.linalg.cholesky(s64)
    want = [np.linalg.solve(a64, b64), np.linalg.solve(a64, v[None, :, None])[..., 0],
            np.linalg.inv(a64), np.linalg.det(a64), ref_sign, ref_log, chol, T(chol),
            np.linalg.solve(np.triu(a64), b64),
            T(np.linalg.solve(T(np.tril(a64)), b64))]
    for k, (got, ref) in enumerate(zip(outs, want)):
        assert got.shape == ref.shape, (k, got.shape, ref.shape)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5, err_msg=f"output {k}")


@pytest.mark.parametrize("shape", [(2, 5, 5), (7, 3), (3, 5)])
def test_qr_svd_against_numpy(rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    g = rlx.Graph("qr_svd")
    A = g.input("a", shape, "f32")
    q, r, u, s, vh = _run(g, [*g.qr(A), *g.svd(A)], {"a": a})
    a64 = a.astype(np.float64)
    k = min(shape[-2:])
    qn, rn = np.linalg.qr(a64)
    assert q.shape == qn.shape and r.shape == rn.shape
    np.testing.assert_allclose(q @ r, a64, atol=1e-5)
    np.testing.assert_allclose(T(q) @ q, np.broadcast_to(np.eye(k), T(q).shape[:-1] + (k,)),
                               atol=2e-6)
    assert np.all(np.tril(r, -1) == 0)
    # LAPACK's Householder signs: R's diagonal as numpy's
    np.testing.assert_allclose(r, rn, atol=2e-5)
    un, sn, vhn = np.linalg.svd(a64, full_matrices=False)
    assert u.shape == un.shape and s.shape == sn.shape and vh.shape == vhn.shape
    np.testing.assert_allclose(s, sn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose((u * s[..., None, :]) @ vh, a64, atol=1e-5)
    if shape[-2] >= shape[-1]:
        un, vh_ref = _sign_fix(un, T(vhn))
        np.testing.assert_allclose(u, un, atol=2e-5)
        np.testing.assert_allclose(vh, T(vh_ref), atol=2e-5)
    else:       # the gauge is on the right singular vectors
        v_ref, u_ref = _sign_fix(T(vhn), un)
        np.testing.assert_allclose(T(vh), v_ref, atol=2e-5)
        np.testing.assert_allclose(u, u_ref, atol=2e-5)


@pytest.mark.parametrize("n", [3, 7])
def test_eigh_against_numpy(rng, n):
    a = rng.standard_normal((2, n, n)).astype(np.float32)
    a[0, 0, n - 1] = 1e3          # the strict upper triangle is not read (UPLO='L')
    g = rlx.Graph("eigh")
    A = g.input("a", a.shape, "f32")
    w, v = _run(g, g.eigh(A), {"a": a})
    sym = _lower_sym(a.astype(np.float64))
    wn, vn = np.linalg.eigh(sym)
    np.testing.assert_allclose(w, wn, atol=3e-6 * np.abs(wn).max())
    assert np.all(np.diff(w, axis=-1) >= 0)
    np.testing.assert_allclose((v * w[..., None, :]) @ T(v), sym, atol=1e-5)
    np.testing.assert_allclose(T(v) @ v, np.broadcast_to(np.eye(n), v.shape), atol=2e-6)
    np.testing.assert_allclose(v, _sign_fix(vn)[0], atol=1e-5)


def test_jacobi_accuracy_on_spread_values(rng):
    """Eigenvalues over 5 decades and singular values over 3: eigenvalues to f32's rounding of
    max |A|, vectors orthonormal, and the small singular values to relative accuracy (the
    one-sided Jacobi test is relative)."""
    n = 12
    q, _ = np.linalg.qr(rng.standard_normal((n, n)))
    sym = ((q * (np.logspace(-4, 1, n) * rng.choice([-1, 1], n))) @ q.T).astype(np.float32)
    m = (rng.standard_normal((10, 6)) @ np.diag(np.logspace(-3, 0, 6))).astype(np.float32)
    g = rlx.Graph("spread")
    A, M = g.input("a", sym.shape, "f32"), g.input("m", m.shape, "f32")
    w, v, u, s, vh = _run(g, [*g.eigh(A), *g.svd(M)], {"a": sym, "m": m})
    np.testing.assert_allclose(w, np.linalg.eigvalsh(sym.astype(np.float64)), atol=1e-5)
    np.testing.assert_allclose(v.T @ v, np.eye(n), atol=2e-6)
    np.testing.assert_allclose(s, np.linalg.svd(m.astype(np.float64), compute_uv=False),
                               rtol=2e-5)
    np.testing.assert_allclose(u.T @ u, np.eye(6), atol=2e-6)
    np.testing.assert_allclose(vh @ vh.T, np.eye(6), atol=2e-6)


def test_singular_and_not_positive_definite():
    """torch raises; here (no sync to raise from) solve / inv / cholesky give NaN, det 0 and
    slogdet (0, -inf); the other matrix of the batch is unaffected."""
    # a zero column: every LU (any pivot order, reciprocal or division) meets an exact zero
    # pivot there; rows merely proportional can leave a rounding residue (cuBLAS's batched
    # getrf gave a pivot of ~1.8e-7 and X ~ 5.6e6 for [[1,2,3],[2,4,6],[1,0,1]] on an H100)
    a = np.stack([np.array([[1, 0, 3], [2, 0, 6], [1, 0, 1]], np.float32),
                  np.eye(3, dtype=np.float32) * 2])
    npd = np.stack([np.diag([1.0, -1.0, 2.0]).astype(np.float32), np.eye(3, dtype=np.float32)])
    g = rlx.Graph("singular")
    A, P = g.input("a", a.shape, "f32"), g.input("p", npd.shape, "f32")
    sign, logabs = g.slogdet(A)
    x, inv, det, s, la, ch = _run(g, [g.linalg_solve(A, g.constant(np.ones((3, 1), np.float32))),
                                      g.inv(A), g.det(A), sign, logabs, g.cholesky(P)],
                                  {"a": a, "p": npd})
    assert np.isnan(x[0]).all() and np.isnan(inv[0]).all() and np.isnan(ch[0]).all()
    np.testing.assert_allclose(x[1], 0.5 * np.ones((3, 1)))
    np.testing.assert_allclose(inv[1], 0.5 * np.eye(3))
    np.testing.assert_allclose(ch[1], np.eye(3))
    assert det[0] == 0 and s[0] == 0 and la[0] == -np.inf
    np.testing.assert_allclose([det[1], s[1], la[1]], [8.0, 1.0, np.log(8.0)], rtol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_cholesky_of_one_matrix(rng, dtype):
    """An unbatched [n, n] (cuSOLVER's potrf "lower" on A transposed into column-major on a GPU,
    L transposed back; the numba kernel here): only A's lower triangle is read (noise above
    it changes nothing), and a matrix that is not positive definite gives NaN."""
    f = np.float32 if dtype == "f32" else np.float64
    n = 37 if ON_GPU else 7
    a = _spd(rng, (n, n)).astype(f)
    noisy = a + np.triu(rng.standard_normal((n, n)), 1).astype(f)
    npd = np.diag(np.r_[np.ones(n - 1), -1.0]).astype(f)
    g = rlx.Graph("chol1")
    A, P = g.input("a", (n, n), dtype), g.input("p", (n, n), dtype)
    el, bad = _run(g, [g.cholesky(A), g.cholesky(P)], {"a": noisy, "p": npd})
    want = np.linalg.cholesky(a.astype(np.float64))
    assert el.dtype == f and np.all(np.triu(el, 1) == 0)
    np.testing.assert_allclose(el, want, rtol=0, atol=(1e-5 if dtype == "f32" else 1e-12)
                               * np.abs(want).max())
    assert np.isnan(bad).all()


def _feed64(**kw):
    return {k: v.astype(np.float64) for k, v in kw.items()}


def test_grad_solve_inv_det_slogdet(rng):
    n = 3
    a, b = _wellcond(rng, (2, n, n)), rng.standard_normal((2, n, 2)).astype(np.float32)
    ca, cb = rng.standard_normal((2, n, n)), rng.standard_normal((2, n, 2))
    cd = rng.standard_normal(2)

    def oracle(a, b):
        s, la = np.linalg.slogdet(a)
        return (np.linalg.solve(a, b) * cb).sum() + (np.linalg.inv(a) * ca).sum() \
            + (np.linalg.det(a) * cd).sum() + (la * cd[::-1]).sum()
    g = rlx.Graph("grad_solve")
    A, B = g.input("a", a.shape, "f32"), g.input("b", b.shape, "f32")
    _, logabs = g.slogdet(A)
    c = lambda x: g.constant(x.astype(np.float32))  # noqa: E731
    loss = g.add(g.add(g.reduce_sum(g.mul(g.linalg_solve(A, B), c(cb))),
                       g.reduce_sum(g.mul(g.inv(A), c(ca)))),
                 g.add(g.reduce_sum(g.mul(g.det(A), c(cd))),
                       g.reduce_sum(g.mul(logabs, c(cd[::-1].copy())))))
    check(g, loss, {"a": A, "b": B}, {"a": a, "b": b}, oracle, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("upper,left", [(True, True), (False, False)])
def test_grad_triangular_solve(rng, upper, left):
    n = 3
    a = _wellcond(rng, (2, n, n))
    b = rng.standard_normal((2, n, 2) if left else (2, 2, n)).astype(np.float32)
    cx = rng.standard_normal(b.shape)

    def oracle(a, b):
        t = np.triu(a) if upper else np.tril(a)
        x = np.linalg.solve(t, b) if left else T(np.linalg.solve(T(t), T(b)))
        return (x * cx).sum()
    g = rlx.Graph("grad_trsm")
    A, B = g.input("a", a.shape, "f32"), g.input("b", b.shape, "f32")
    x = g.triangular_solve(A, B, upper=upper, left=left)
    loss = g.reduce_sum(g.mul(x, g.constant(cx.astype(np.float32))))
    check(g, loss, {"a": A, "b": B}, {"a": a, "b": b}, oracle, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("shape", [(2, 5, 3), (3, 5)])
def test_grad_qr(rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    k = min(shape[-2:])
    cq = rng.standard_normal(shape[:-1] + (k,))
    cr = rng.standard_normal(shape[:-2] + (k, shape[-1]))

    def oracle(a):
        q, r = np.linalg.qr(a)
        return (q * cq).sum() + (r * cr).sum()
    g = rlx.Graph("grad_qr")
    A = g.input("a", shape, "f32")
    q, r = g.qr(A)
    loss = g.add(g.reduce_sum(g.mul(q, g.constant(cq.astype(np.float32)))),
                 g.reduce_sum(g.mul(r, g.constant(cr.astype(np.float32)))))
    check(g, loss, {"a": A}, {"a": a}, oracle, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("shape", [(5, 3), (3, 5)])
def test_grad_svd(rng, shape):
    a = rng.standard_normal(shape).astype(np.float32)
    k = min(shape)
    cu, cs = rng.standard_normal((shape[0], k)), rng.standard_normal(k)
    cv = rng.standard_normal((k, shape[1]))

    def oracle(a):
        u, s, vh = np.linalg.svd(a, full_matrices=False)
        if shape[0] >= shape[1]:
            u, v = _sign_fix(u, T(vh))
        else:
            v, u = _sign_fix(T(vh), u)
        return (u * cu).sum() + (s * cs).sum() + (T(v) * cv).sum()
    g = rlx.Graph("grad_svd")
    A = g.input("a", shape, "f32")
    u, s, vh = g.svd(A)
    c = lambda x: g.constant(x.astype(np.float32))  # noqa: E731
    loss = g.add(g.add(g.reduce_sum(g.mul(u, c(cu))), g.reduce_sum(g.mul(s, c(cs)))),
                 g.reduce_sum(g.mul(vh, c(cv))))
    check(g, loss, {"a": A}, {"a": a}, oracle, rtol=2e-3, atol=2e-4)


def _sym_directional(g, loss, A, a, f, rng, rtol):
    """The gradient of a symmetric-input op (eigh, cholesky): symmetric, as torch's, and its
    derivative along random symmetric directions matches float64 central differences of f
    (directions off the diagonal and on it)."""
    (da,) = g.grad(loss, [A])
    g.set_outputs([loss, da])
    _, got = rlx.compile(g).run({"a": a})
    np.testing.assert_allclose(got, T(got), atol=1e-6 * np.abs(got).max())
    a64 = a.astype(np.float64)
    for _ in range(3):
        e = rng.standard_normal(a.shape)
        e = e + T(e)
        h = 1e-6
        fd = (f(a64 + h * e) - f(a64 - h * e)) / (2 * h)
        dot = float((got.astype(np.float64) * e).sum())
        assert abs(dot - fd) <= rtol * (abs(fd) + np.linalg.norm(got) * np.linalg.norm(e)
                                        / np.sqrt(a.size)), (dot, fd)


def test_grad_cholesky(rng):
    a = _spd(rng, (2, 4, 4))
    c = rng.standard_normal(a.shape)
    f = lambda x: (np.linalg.cholesky(_lower_sym(x)) * c).sum()  # noqa: E731
    g = rlx.Graph("grad_chol")
    A = g.input("a", a.shape, "f32")
    loss = g.reduce_sum(g.mul(g.cholesky(A), g.constant(c.astype(np.float32))))
    _sym_directional(g, loss, A, a, f, rng, 1e-3)


def test_grad_eigh(rng):
    a = rng.standard_normal((2, 4, 4)).astype(np.float32)
    a = (a + T(a)) / 2
    cw, cv = rng.standard_normal((2, 4)), rng.standard_normal(a.shape)

    def f(x):
        w, v = np.linalg.eigh(_lower_sym(x))
        return (w * cw).sum() + (_sign_fix(v)[0] * cv).sum()
    g = rlx.Graph("grad_eigh")
    A = g.input("a", a.shape, "f32")
    w, v = g.eigh(A)
    loss = g.add(g.reduce_sum(g.mul(w, g.constant(cw.astype(np.float32)))),
                 g.reduce_sum(g.mul(v, g.constant(cv.astype(np.float32)))))
    _sym_directional(g, loss, A, a, f, rng, 2e-3)


def test_errors():
    g = rlx.Graph("errors")
    sq, rect = g.input("sq", (2, 3, 3), "f32"), g.input("rect", (2, 3, 4), "f32")
    other = g.input("other", (4, 3, 3), "f32")
    half = g.input("half", (3, 3), "f16")
    cases = [
        (lambda: g.linalg_solve(rect, sq),
         r"linalg_solve: A must be square \[\.\.\., n, n\].*\[2, 3, 4\]"),
        (lambda: g.linalg_solve(sq, g.input("b4", (2, 4, 1), "f32")),
         r"linalg_solve: B must be.*n=3.*\[2, 4, 1\]"),
        (lambda: g.linalg_solve(sq, other),
         r"linalg_solve: the batch axes of A.*\[2, 3, 3\].*\[4, 3, 3\]"),
        (lambda: g.cholesky(half), r"cholesky: A must be f32 or f64.*f16"),
        (lambda: g.cholesky(sq, upper=1), r"cholesky: upper must be a bool"),
        (lambda: g.inv(rect), r"inv: A must be square"),
        (lambda: g.det(g.input("v", (3,), "f32")), r"det: A must be square.*\[3\]"),
        (lambda: g.slogdet(rect), r"slogdet: A must be square"),
        (lambda: g.eigh(rect), r"eigh: A must be square"),
        (lambda: g.triangular_solve(sq, rect, left=False),
         r"triangular_solve: B must be \[\.\.\., k, n\].*left=False"),
        (lambda: g.triangular_solve(sq, g.input("i", (2, 3, 1), "i32")),
         r"triangular_solve: B must be f32"),
        (lambda: g.qr(g.input("q1", (3,), "f32")), r"qr: A must be \[\.\.\., m, n\]"),
        (lambda: g.svd(half), r"svd: A must be f32"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def test_tier_choice(monkeypatch, caplog):
    """RLX_NUMBA_LINALG_TIERS limits the tiers; without a GPU tier 0 cannot run and says why."""
    g = rlx.Graph("tiers")
    A = g.input("a", (3, 3), "f32")
    g.set_outputs([g.cholesky(A)])
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "2")
    with pytest.raises(ValueError, match="RLX_NUMBA_LINALG_TIERS"):
        rlx.compile(g)
    if ON_GPU:
        return
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0")
    with pytest.raises(NotImplementedError, match="tier 0 .*cuSOLVER.*simulator"):
        rlx.compile(g)
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0,1")
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    with caplog.at_level("WARNING", logger="rlx_numba"):
        (ch,) = rlx.compile(g).run({"a": 4 * np.eye(3, dtype=np.float32)})
    np.testing.assert_allclose(ch, 2 * np.eye(3))
    assert any("cholesky" in r.message and "tier 1 (numba)" in r.message for r in caplog.records)


# ---- f64: every op computes in f64 (the numba tier's f64 kind here, cuSOLVER's D routines on a
# GPU); the oracles are float64 NumPy, the tolerance one that only f64 reaches --------------------
RTOL64 = 1e-12


def _close64(got, want, what, rtol=RTOL64):
    """f64 results, within rtol of the reference's largest magnitude (normwise: entries that
    are near 0 by cancellation are held to the same absolute error)."""
    assert got.dtype == np.float64, (what, got.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, (what, err)


def _orthonormal(rng, batch, m, k):
    return np.linalg.qr(rng.standard_normal(batch + (m, k)))[0]


def _sym64(rng, batch, n):
    """Symmetric with eigenvalues at least 0.6 apart (vectors well determined)."""
    q = _orthonormal(rng, batch, n, n)
    w = np.arange(n) * 0.7 - 1.3 + 0.1 * rng.random(batch + (n,))
    return (q * w[..., None, :]) @ T(q)


def _svd64(rng, batch, m, n):
    """[..., m, n] with singular values in [1, 1 + 0.6 (k - 1)], at least 0.5 apart."""
    k = min(m, n)
    s = 1 + 0.6 * np.arange(k)[::-1] + 0.1 * rng.random(batch + (k,))
    return (_orthonormal(rng, batch, m, k) * s[..., None, :]) @ T(_orthonormal(rng, batch, n, k))


def test_f64_ops_against_numpy(rng):
    """Every op in f64 on batched odd sizes: solve (matrix and vector right-hand sides, batch
    axes broadcast), inv, det, slogdet, cholesky, both triangular solves, qr / svd (square,
    tall, wide) and eigh against numpy.linalg in float64 at 1e-12, with the reconstructions
    and the gauges; f32 misses every one of them by orders of magnitude (the last check)."""
    n = 5
    a = rng.standard_normal((3, n, n)) / np.sqrt(n) + 2 * np.eye(n)
    b, v = rng.standard_normal((2, 1, n, 3)), rng.standard_normal(n)
    spd = _sym64(rng, (2,), n) + 3 * np.eye(n)                  # eigenvalues >= 1.7
    sym = _sym64(rng, (2,), n)
    sym_in = sym.copy()
    sym_in[:, 0, n - 1] = 1e3                                   # the upper triangle: not read
    tall, wide = _svd64(rng, (2,), 7, 4), _svd64(rng, (), 3, 6)
    feed = {"a": a, "b": b, "v": v, "s": spd, "e": sym_in, "t": tall, "w": wide}
    g = rlx.Graph("linalg64")
    A, B, V, S, E, Ta, W = (g.input(k, x.shape, "f64") for k, x in feed.items())
    sign, logabs = g.slogdet(A)
    outs = [g.linalg_solve(A, B), g.linalg_solve(A, V), g.inv(A), g.det(A), sign, logabs,
            g.cholesky(S), g.cholesky(S, upper=True), g.triangular_solve(A, g.narrow(B, 0, 0, 1),
                                                                        upper=True),
            g.triangular_solve(A, mT(g, g.narrow(B, 0, 1, 1)), left=False),
            *g.eigh(E), *g.qr(A), *g.qr(Ta), *g.qr(W), *g.svd(A), *g.svd(Ta), *g.svd(W)]
    assert all(t.dtype.name == "f64" for t in outs)
    got = _run(g, outs, feed)
    chol = np.linalg.cholesky(spd)
    want = [np.linalg.solve(a, b), np.linalg.solve(a, v[None, :, None])[..., 0],
            np.linalg.inv(a), np.linalg.det(a), *np.linalg.slogdet(a), chol, T(chol),
            np.linalg.solve(np.triu(a), b[:1]), T(np.linalg.solve(T(np.tril(a)), b[1:]))]
    names = ["solve", "solve vector", "inv", "det", "sign", "logabsdet", "cholesky",
             "cholesky upper", "trsm upper left", "trsm lower right"]
    for x, y, what in zip(got, want, names):
        _close64(x, y, what)
    w, vec = got[10:12]
    wn, vn = np.linalg.eigh(sym)
    _close64(w, wn, "eigenvalues")
    _close64(vec, _sign_fix(vn)[0], "eigenvectors (gauge)")
    _close64((vec * w[..., None, :]) @ T(vec), sym, "V diag(w) V^T")
    _close64(T(vec) @ vec, np.broadcast_to(np.eye(n), vec.shape), "V^T V")
    for (q, r), x, what in zip((got[12:14], got[14:16], got[16:18]), (a, tall, wide),
                               ("square", "tall", "wide")):
        qn, rn = np.linalg.qr(x)
        _close64(r, rn, f"qr {what}: R (LAPACK's signs)")
        _close64(q, qn, f"qr {what}: Q")
        _close64(q @ r, x, f"qr {what}: Q R")
        assert np.all(np.tril(r, -1) == 0)
    for (u, sv, vh), x, what in zip((got[18:21], got[21:24], got[24:27]), (a, tall, wide),
                                    ("square", "tall", "wide")):
        un, sn, vhn = np.linalg.svd(x, full_matrices=False)
        _close64(sv, sn, f"svd {what}: S")
        _close64((u * sv[..., None, :]) @ vh, x, f"svd {what}: U S Vh")
        if what == "wide":          # the gauge is on the right singular vectors
            v_ref, u_ref = _sign_fix(T(vhn), un)
            _close64(T(vh), v_ref, f"svd {what}: V (gauge)")
            _close64(u, u_ref, f"svd {what}: U")
        else:
            u_ref, v_ref = _sign_fix(un, T(vhn))
            _close64(u, u_ref, f"svd {what}: U (gauge)")
            _close64(vh, T(v_ref), f"svd {what}: Vh")
    # the same solve and eigenvalues in f32 are far outside this tolerance
    x32 = np.linalg.solve(a.astype(np.float32), b.astype(np.float32))
    assert np.abs(x32 - want[0]).max() / np.abs(want[0]).max() > 1e3 * RTOL64
    w32 = np.linalg.eigvalsh(sym.astype(np.float32))
    assert np.abs(w32 - wn).max() / np.abs(wn).max() > 1e3 * RTOL64


def test_f64_singular_and_mixed_dtypes():
    """The f64 kind's singular / not positive definite results as f32's; an f64 A with an f32
    B (or a half one) raises naming the op, the arguments and the shapes, as matmul does."""
    a = np.stack([np.array([[1, 0, 3], [2, 0, 6], [1, 0, 1]], np.float64), 2 * np.eye(3)])
    npd = np.stack([np.diag([1.0, -1.0, 2.0]), np.eye(3)])
    g = rlx.Graph("singular64")
    A, P = g.input("a", a.shape, "f64"), g.input("p", npd.shape, "f64")
    sign, logabs = g.slogdet(A)
    x, det, s, la, ch = _run(g, [g.linalg_solve(A, g.constant(np.ones((3, 1)), "f64")), g.det(A),
                                 sign, logabs, g.cholesky(P)], {"a": a, "p": npd})
    assert np.isnan(x[0]).all() and np.isnan(ch[0]).all()
    np.testing.assert_array_equal(x[1], 0.5 * np.ones((3, 1)))
    np.testing.assert_array_equal(ch[1], np.eye(3))
    assert det[0] == 0 and s[0] == 0 and la[0] == -np.inf
    _close64(np.array([det[1], la[1]]), np.array([8.0, np.log(8.0)]), "det, logabsdet")
    g = rlx.Graph("mixed")
    a64, b32 = g.input("a64", (2, 3, 3), "f64"), g.input("b32", (2, 3, 4), "f32")
    cases = [
        (lambda: g.linalg_solve(a64, b32), r"linalg_solve: A and B must have the same dtype, "
                                           r"got A f64 \[2, 3, 3\] and B f32 \[2, 3, 4\]"),
        (lambda: g.linalg_solve(g.input("a32", (3, 3), "f32"), g.input("b64", (3,), "f64")),
         r"linalg_solve: A and B must have the same dtype, got A f32 \[3, 3\] and B f64 \[3\]"),
        (lambda: g.triangular_solve(a64, b32, upper=True),
         r"triangular_solve: A and B must have the same dtype, got A f64 \[2, 3, 3\] and B f32"),
        (lambda: g.triangular_solve(a64, g.input("h", (2, 3, 4), "bf16")),
         r"triangular_solve: B must be f32 or f64.*bf16 \[2, 3, 4\]"),
        (lambda: g.eigh(g.input("i", (3, 3), "i64")), r"eigh: A must be f32 or f64.*i64"),
    ]
    for fn, msg in cases:
        with pytest.raises(ValueError, match=msg):
            fn()


def _grad64(g, loss, wrt, feed):
    """The gradients of ``loss`` in f64 (their dtype checked), with the loss."""
    grads = g.grad(loss, wrt)
    assert all(t.dtype.name == "f64" for t in grads)
    g.set_outputs([loss, *grads])
    return rlx.compile(g).run(feed)


def _central(f, x, h=1e-6):
    """df/dx by float64 central differences, element by element."""
    out = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        up, dn = x.copy(), x.copy()
        up[i] += h
        dn[i] -= h
        out[i] = (f(up) - f(dn)) / (2 * h)
    return out


def test_f64_grad_against_finite_differences(rng):
    """One loss over every general-matrix op in f64 (solve, inv, det, slogdet, both triangular
    solves, qr and svd square and wide) against float64 central differences of its NumPy
    oracle element by element, at 1e-7 of the largest entry (the differences' own error is
    ~1e-9; f32 gradients are good to ~1e-3)."""
    n = 3
    a = rng.standard_normal((2, n, n)) / np.sqrt(n) + 2 * np.eye(n)
    wide = _svd64(rng, (2,), 3, 5)
    b = rng.standard_normal((2, n, 2))
    c = {k: rng.standard_normal(shape) for k, shape in (
        ("x", (2, n, 2)), ("inv", (2, n, n)), ("det", (2,)), ("la", (2,)), ("tu", (2, n, 2)),
        ("tl", (2, 2, n)), ("q", (2, n, n)), ("r", (2, n, n)), ("u", (2, n, n)), ("s", (2, n)),
        ("vh", (2, n, n)), ("qw", (2, 3, 3)), ("rw", (2, 3, 5)), ("uw", (2, 3, 3)),
        ("sw", (2, 3)), ("vw", (2, 3, 5)))}

    def svd_gauged(x):
        u, s, vh = np.linalg.svd(x, full_matrices=False)
        if x.shape[-2] >= x.shape[-1]:
            u, v = _sign_fix(u, T(vh))
        else:
            v, u = _sign_fix(T(vh), u)
        return u, s, T(v)

    def oracle(a, b, wide):
        _, la = np.linalg.slogdet(a)
        terms = [(np.linalg.solve(a, b), "x"), (np.linalg.inv(a), "inv"),
                 (np.linalg.det(a), "det"), (la, "la"), (np.linalg.solve(np.triu(a), b), "tu"),
                 (T(np.linalg.solve(T(np.tril(a)), b)), "tl")]
        terms += list(zip(np.linalg.qr(a), ("q", "r"))) + list(zip(svd_gauged(a), ("u", "s", "vh")))
        terms += list(zip(np.linalg.qr(wide), ("qw", "rw")))
        terms += list(zip(svd_gauged(wide), ("uw", "sw", "vw")))
        return sum(float((t * c[k]).sum()) for t, k in terms)

    g = rlx.Graph("grad64")
    A, B, W = (g.input(k, x.shape, "f64") for k, x in (("a", a), ("b", b), ("w", wide)))
    _, logabs = g.slogdet(A)
    terms = [(g.linalg_solve(A, B), "x"), (g.inv(A), "inv"), (g.det(A), "det"), (logabs, "la"),
             (g.triangular_solve(A, B, upper=True), "tu"),
             (g.triangular_solve(A, mT(g, B), left=False), "tl")]
    terms += list(zip(g.qr(A), ("q", "r"))) + list(zip(g.svd(A), ("u", "s", "vh")))
    terms += list(zip(g.qr(W), ("qw", "rw"))) + list(zip(g.svd(W), ("uw", "sw", "vw")))
    loss = None
    for t, k in terms:
        term = g.reduce_sum(g.mul(t, g.constant(c[k], "f64")))
        loss = term if loss is None else g.add(loss, term)
    got = _grad64(g, loss, [A, B, W], {"a": a, "b": b, "w": wide})
    _close64(np.asarray(got[0]), np.asarray(oracle(a, b, wide)), "loss")
    for k, x, dgot in (("a", a, got[1]), ("b", b, got[2]), ("w", wide, got[3])):
        args = {"a": a, "b": b, "wide": wide}
        key = "wide" if k == "w" else k
        num = _central(lambda v: oracle(**{**args, key: v}), x)
        _close64(dgot, num, f"d/d{k}", rtol=1e-7)


def test_f64_grad_cholesky_eigh(rng):
    """cholesky's and eigh's f64 gradients: symmetric, as torch's, and their derivative along
    random symmetric directions (off the diagonal and on it) matches float64 central
    differences at 1e-7."""
    n = 4
    spd = _sym64(rng, (2,), n) + 3 * np.eye(n)
    sym = _sym64(rng, (2,), n)
    cl, cw, cv = (rng.standard_normal(s) for s in ((2, n, n), (2, n), (2, n, n)))

    def f_chol(x):
        return float((np.linalg.cholesky(_lower_sym(x)) * cl).sum())

    def f_eigh(x):
        w, v = np.linalg.eigh(_lower_sym(x))
        return float((w * cw).sum() + (_sign_fix(v)[0] * cv).sum())
    g = rlx.Graph("grad64_sym")
    S, E = g.input("s", spd.shape, "f64"), g.input("e", sym.shape, "f64")
    w, v = g.eigh(E)
    lc = g.reduce_sum(g.mul(g.cholesky(S), g.constant(cl, "f64")))
    le = g.add(g.reduce_sum(g.mul(w, g.constant(cw, "f64"))),
               g.reduce_sum(g.mul(v, g.constant(cv, "f64"))))
    _, ds, de = _grad64(g, g.add(lc, le), [S, E], {"s": spd, "e": sym})
    for x, d, f, what in ((spd, ds, f_chol, "cholesky"), (sym, de, f_eigh, "eigh")):
        _close64(d, T(d), f"{what}: symmetric gradient", rtol=1e-14)
        for _ in range(3):
            e = rng.standard_normal(x.shape)
            e = e + T(e)
            h = 1e-6
            fd = (f(x + h * e) - f(x - h * e)) / (2 * h)
            dot = float((d * e).sum())
            assert abs(dot - fd) <= 1e-7 * (abs(fd) + np.abs(d).max() * np.abs(e).max()), \
                (what, dot, fd)


# ---- tier 0's layout kernels, fed what cuSOLVER returns (made here in NumPy, column-major) -------
sim_only = pytest.mark.skipif(ON_GPU, reason="host arrays into the kernels: the simulator")


def _cm(x):
    """A matrix's column-major memory (what cuSOLVER reads and writes), flat."""
    return np.ascontiguousarray(np.swapaxes(x, -1, -2)).reshape(-1).astype(np.float32)


def _launch(kernel, *args):
    kernel[2, 16](*[np.int64(a) if isinstance(a, int) else a for a in args])


@sim_only
def test_tier0_layout_kernels(rng):
    """The conventions runtime/lower_linalg.py's tier 0 relies on: our row-major A is cuSOLVER's
    column-major A^T; each kernel turns the routine's column-major results into the packings
    and gauges the numba tier gives."""
    from rlx_numba.kernels import linalg as K
    b, m, n = 2, 5, 3
    a = rng.standard_normal((b, m, n)).astype(np.float32)
    # svd: gesvdj of A^T ([n, m]) = U' S V'^T; V' [m, n] (ld m), U' [n, n]
    up, sp, vph = np.linalg.svd(np.swapaxes(a, -1, -2).astype(np.float64), full_matrices=False)
    out = np.zeros((b, m + 1 + n, n), np.float32)
    _launch(K.svd_post_kernel, _cm(up), sp.astype(np.float32).reshape(-1),
            _cm(np.swapaxes(vph, -1, -2)),
            np.array([0, 1], np.int32), out.reshape(-1), b, m, n, n * n, m * n)
    u, s, vh = out[0, :m], out[0, m], out[0, m + 1:]
    np.testing.assert_allclose((u * s) @ vh, a[0], atol=1e-5)
    np.testing.assert_allclose(u, _sign_fix(u)[0])
    assert np.isnan(out[1]).all()                               # info != 0: not converged
    # eigh: syevd's ascending w and column-major vectors
    sym = _lower_sym(rng.standard_normal((b, n, n)))
    w, v = np.linalg.eigh(sym)
    out = np.zeros((b, n + 1, n), np.float32)
    _launch(K.eigh_post_kernel, _cm(v), w.astype(np.float32).reshape(-1), np.zeros(b, np.int32),
            out.reshape(-1), b, n)
    np.testing.assert_allclose(out[:, 0], w, atol=1e-6)
    np.testing.assert_allclose(out[:, 1:], _sign_fix(v)[0], atol=1e-6)
    # qr: geqrf's R in the upper triangle of the column-major [m, n] work, orgqr's Q in its
    # first k columns
    q, r = np.linalg.qr(a.astype(np.float64))
    out = np.zeros((b, m + n, n), np.float32)
    work = np.zeros((b, m, n))
    work[:, :n, :] = r
    work[:, n:, :] = 7.0                                        # Householder vectors: not read
    _launch(K.qr_r_kernel, _cm(work), out.reshape(-1), b, m, n)
    _launch(K.qr_q_kernel, _cm(q), out.reshape(-1), b, m, n)
    np.testing.assert_allclose(out[:, :m], q, atol=1e-6)
    np.testing.assert_allclose(out[:, m:], r, atol=1e-6)
    # slogdet: getrf of the column-major view (A^T), 1-based pivots
    sq = rng.standard_normal((b, n, n))
    lus, pivs = [], []
    for x in sq:
        mat, piv = x.T.copy(), []
        for c in range(n):
            p = c + int(np.abs(mat[c:, c]).argmax())
            mat[[c, p]] = mat[[p, c]]
            piv.append(p + 1)
            mat[c + 1:, c] /= mat[c, c]
            mat[c + 1:, c + 1:] -= np.outer(mat[c + 1:, c], mat[c, c + 1:])
        lus.append(mat)
        pivs.append(piv)
    det = np.zeros(2 * b, np.float32)
    _launch(K.slogdet_lu_kernel, _cm(np.array(lus)), np.array(pivs, np.int32).reshape(-1),
            np.array([0, 2], np.int32), det, b, n)
    sign, logabs = np.linalg.slogdet(sq[0])
    np.testing.assert_allclose(det[:2], [sign, logabs], rtol=1e-5)
    assert det[2] == 0 and det[3] == -np.inf                    # info > 0: singular
    # cholesky: potrf "upper" of A^T leaves L (row-major) in the lower triangle; the other
    # triangle is garbage (potrfBatched's scratch)
    el = np.linalg.cholesky(_spd(rng, (b, n, n)).astype(np.float64))
    junk = el + np.triu(np.full((n, n), 9.0), 1)
    flat = junk.astype(np.float32).reshape(-1)
    _launch(K.tril_kernel, flat, flat, np.array([0, 3], np.int32), b, n, 0)
    np.testing.assert_allclose(flat.reshape(b, n, n)[0], el[0], atol=1e-6)
    assert np.isnan(flat.reshape(b, n, n)[1]).all()
    # one matrix: potrf "lower" of the column-major A leaves L column-major (L^T row-major)
    # with garbage above; the kernel transposes it back
    col = _cm(junk[:1].astype(np.float32))
    el1 = np.full(n * n, 7.0, np.float32)
    _launch(K.tril_kernel, col, el1, np.array([0], np.int32), 1, n, 1)
    np.testing.assert_allclose(el1.reshape(n, n), el[0], atol=1e-6)
    # solve's B^T in and X^T out
    x = rng.standard_normal((b, n, 4)).astype(np.float32)
    xt, back = np.zeros(x.size, np.float32), np.zeros(x.size, np.float32)
    _launch(K.transpose_kernel, x.reshape(-1), xt, b, n, 4)
    np.testing.assert_array_equal(xt, _cm(x))
    _launch(K.transpose_kernel, xt, back, b, 4, n)
    np.testing.assert_array_equal(back, x.reshape(-1))


@sim_only
@pytest.mark.parametrize("shared", [True, False])
def test_qr_form_q_kernel(rng, shared):
    """Tier 0's batched Q from geqrf's reflectors, in shared memory and in place in global
    memory. NumPy's qr(mode='raw') is LAPACK's geqrf: its h is the column-major [m, n] work
    (reflectors below the diagonal, unit heads implied) and tau the scales; the same
    reflectors give LAPACK's orgqr Q (NumPy's reduced Q) exactly, up to the f32 rounding.
    Four threads a block: a thread owns several columns of Q; 3 matrices on 2 blocks."""
    from rlx_numba.kernels import linalg as K
    eps = np.finfo(np.float32).eps
    for m, n in ((7, 5), (9, 9), (4, 6)):
        b, k = 3, min(m, n)
        assert K.qr_q_in_shared(m, k)
        a = rng.standard_normal((b, m, n))
        raw = [np.linalg.qr(x, mode="raw") for x in a]
        work = np.stack([h for h, _ in raw]).astype(np.float32).reshape(-1)
        tau = np.stack([t for _, t in raw]).astype(np.float32).reshape(-1)
        out = np.full((b, m + k, n), 5.0, np.float32)              # R's rows: not written
        K.qr_form_q_kernel(shared)[2, 4](work, tau, out.reshape(-1), *map(np.int64, (b, m, n)))
        q = out[:, :m, :k].astype(np.float64)
        tol = 4 * m * eps
        np.testing.assert_allclose(q, np.linalg.qr(a)[0], rtol=0, atol=tol, err_msg=f"{m}x{n}")
        np.testing.assert_allclose(T(q) @ q, np.broadcast_to(np.eye(k), (b, k, k)), atol=tol)
        assert np.all(out[:, :m, k:] == 0) and np.all(out[:, m:] == 5.0)


def test_cusolver_loader():
    """cuSOLVER loads without a GPU where its wheel is installed (the cu12 / cu13 extras):
    every prototyped name resolves; elsewhere available() says why, never raises."""
    from rlx_numba import cusolver
    ok, why = cusolver.available()
    if ok:
        assert cusolver.version() >= 11000
        assert all(hasattr(cusolver.lib(), name) for name in cusolver.PROTOS)
    else:
        assert "cuSOLVER" in why or "lib" in why, why


# ---- GPU: the cuSOLVER / cuBLAS tier (0) -------------------------------------------------------
gpu = pytest.mark.skipif(not ON_GPU, reason="cuSOLVER (tier 0) runs on a GPU")


@gpu
@pytest.mark.parametrize("tier", ["0", "1"])
@pytest.mark.parametrize("batch,n", [((16,), 33), ((8,), 7), ((), 300)])
def test_tiers_on_gpu(rng, monkeypatch, tier, batch, n):
    """Every op on the GPU at n = 33 batched (cuBLAS batched LU / QR, syevd and gesvdj a
    matrix at a time), n = 7 batched (syevjBatched, gesvdjBatched) and one n = 300 matrix
    (cuSOLVER getrf / geqrf / syevd / gesvdj); tier 1 (numba) at the small sizes."""
    if tier == "1" and n > 64:
        pytest.skip("the numba tier is for small matrices")
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", tier)
    a, spd = _wellcond(rng, batch + (n, n)), _spd(rng, batch + (n, n))
    b = rng.standard_normal(batch + (n, 4)).astype(np.float32)
    g = rlx.Graph("gpu_linalg")
    A, S, B = (g.input(k, v.shape, "f32") for k, v in (("a", a), ("s", spd), ("b", b)))
    sign, logabs = g.slogdet(A)
    outs = _run(g, [g.linalg_solve(A, B), g.inv(A), sign, logabs, g.cholesky(S),
                    g.cholesky(S, upper=True), g.triangular_solve(A, B, upper=True),
                    g.triangular_solve(A, g.narrow(mT(g, B), -1, 0, n), left=False),
                    *g.qr(A), *g.eigh(S), *g.svd(A)], {"a": a, "s": spd, "b": b})
    x, inv, s, la, ch, chu, tu, tl, q, r, w, v, u, sv, vh = outs
    a64, b64, s64 = (t.astype(np.float64) for t in (a, b, spd))
    tol = dict(rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(x, np.linalg.solve(a64, b64), **tol)
    np.testing.assert_allclose(inv, np.linalg.inv(a64), **tol)
    rs, rl = np.linalg.slogdet(a64)
    np.testing.assert_allclose(s, rs)
    np.testing.assert_allclose(la, rl, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(ch, np.linalg.cholesky(s64), **tol)
    np.testing.assert_allclose(chu, T(np.linalg.cholesky(s64)), **tol)
    np.testing.assert_allclose(tu, np.linalg.solve(np.triu(a64), b64), **tol)
    np.testing.assert_allclose(tl, T(np.linalg.solve(T(np.tril(a64)), b64)), **tol)
    np.testing.assert_allclose(q @ r, a64, atol=1e-4)
    np.testing.assert_allclose(T(q) @ q, np.broadcast_to(np.eye(n), q.shape), atol=1e-4)
    assert np.all(np.tril(r, -1) == 0)
    wn = np.linalg.eigvalsh(s64)
    np.testing.assert_allclose(w, wn, atol=1e-4 * np.abs(wn).max())
    np.testing.assert_allclose((v * w[..., None, :]) @ T(v), s64, atol=1e-4 * np.abs(wn).max())
    np.testing.assert_allclose(T(v) @ v, np.broadcast_to(np.eye(n), v.shape), atol=1e-4)
    np.testing.assert_allclose(sv, np.linalg.svd(a64, compute_uv=False), rtol=1e-4, atol=1e-4)
    # a backward-stable SVD: ||U S Vh - A|| ~ n u ||A|| (n = 300 on tier 0: 1.8e-4 seen)
    rec = max(1e-4, 4 * n * np.finfo(np.float32).eps * np.abs(a64).sum(-1).max())
    np.testing.assert_allclose((u * sv[..., None, :]) @ vh, a64, atol=rec)
    # the documented gauges
    big = np.take_along_axis(v, np.abs(v).argmax(-2)[..., None, :], -2)
    assert np.all(big > 0)
    big = np.take_along_axis(u, np.abs(u).argmax(-2)[..., None, :], -2)
    assert np.all(big > 0)


@gpu
@pytest.mark.parametrize("batch,m,n,where", [((64,), 64, 64, "shared"), ((5, 3), 37, 21, "shared"),
                                             ((4,), 100, 100, "global"), ((3,), 128, 40, "global")])
def test_qr_batched_on_gpu(rng, monkeypatch, batch, m, n, where):
    """Tier 0's batched qr: cuBLAS's geqrf, then one kernel forms every matrix's Q (in shared
    memory when m x k fits, else in place in the output). R as NumPy's up to row signs (Q's
    columns along), Q R = A, Q^T Q = I."""
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0")
    a = (rng.standard_normal(batch + (m, n)) / np.sqrt(m) + 2 * np.eye(m, n)).astype(np.float32)
    g = rlx.Graph("qr_batched")
    A = g.input("a", a.shape, "f32")
    g.set_outputs(list(g.qr(A)))
    exe = rlx.compile(g)
    names = [s.kernel_name for s in exe.steps]
    assert any("Q from reflectors" in k and f"({where} memory)" in k for k in names), names
    assert not any("orgqr" in k for k in names), names
    q, r = exe.run({"a": a})
    a64 = a.astype(np.float64)
    qn, rn = np.linalg.qr(a64)
    d = np.sign(np.diagonal(r, 0, -2, -1)) * np.sign(np.diagonal(rn, 0, -2, -1))
    tol = 16 * m * np.finfo(np.float32).eps         # a few roundings of m-term sums, |A| ~ 2
    np.testing.assert_allclose(r * d[..., :, None], rn, atol=tol)
    np.testing.assert_allclose(q * d[..., None, :], qn, atol=tol)
    assert np.all(np.tril(r, -1) == 0)
    np.testing.assert_allclose(q @ r, a64, atol=tol)
    np.testing.assert_allclose(T(q) @ q, np.broadcast_to(np.eye(n), batch + (n, n)), atol=tol)


@gpu
def test_singular_on_gpu(monkeypatch):
    """Tier 0's info codes: the batched calls (cuBLAS getrf, potrfBatched) and the single
    ones (cuSOLVER getrf + getrs, potrf) NaN-fill as the numba tier does."""
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0")
    test_singular_and_not_positive_definite()
    a = np.array([[1, 0, 3], [2, 0, 6], [1, 0, 1]], np.float32)
    g = rlx.Graph("singular_single")
    A = g.input("a", a.shape, "f32")
    sign, logabs = g.slogdet(A)
    x, s, la, ch = _run(g, [g.linalg_solve(A, g.constant(np.ones((3, 2), np.float32))), sign,
                            logabs, g.cholesky(A)], {"a": a})
    assert np.isnan(x).all() and np.isnan(ch).all()
    assert s == 0 and la == -np.inf


@gpu
@pytest.mark.parametrize("tier", ["0", "1"])
def test_graph_mode_on_gpu(rng, monkeypatch, tier):
    """The tiers' steps (library calls, their loops a matrix at a time, the layout kernels)
    replay in a captured CUDA graph as they run on the stream. cuSOLVER's eigh / svd cannot
    be captured: a graph executable runs them on the numba tier (outputs 4.. : another
    algorithm, so a looser comparison on tier 0)."""
    a, spd = _wellcond(rng, (3, 40, 40)), _spd(rng, (3, 40, 40))
    g = rlx.Graph("graph_linalg")
    A, S = g.input("a", a.shape, "f32"), g.input("s", spd.shape, "f32")
    g.set_outputs([g.inv(A), g.cholesky(S), *g.qr(A), *g.eigh(S), *g.svd(A)])
    if tier == "0":            # tier 0 alone cannot run eigh in a graph: a clear error
        monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0")
        with pytest.raises(NotImplementedError, match="cannot be captured into a CUDA graph"):
            rlx.compile(g, exec_mode="graph")
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0,1" if tier == "0" else tier)
    feed = {"a": a, "s": spd}
    want = rlx.compile(g, exec_mode="stream").run(feed)
    exe = rlx.compile(g, exec_mode="graph")
    for _ in range(2):          # capture, then replay
        got = exe.run(feed)
        for k, (x, y) in enumerate(zip(got, want)):
            if tier == "0" and k in (5, 6, 8):
                continue        # eigenvectors / singular vectors: checked below, gauge-free
            tol = 2e-4 if tier == "0" and k >= 4 else 1e-5
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol, err_msg=f"output {k}")
        if tier == "0":         # another algorithm's vectors differ where values nearly tie:
            w, v, u, sv, vh = got[4:]           # compare what they reconstruct
            np.testing.assert_allclose(v @ (w[..., None] * np.swapaxes(v, -1, -2)), spd,
                                       rtol=2e-4, atol=2e-4, err_msg="eigh: V diag(w) V^T")
            np.testing.assert_allclose(u @ (sv[..., None] * vh), a, rtol=2e-4, atol=2e-4,
                                       err_msg="svd: U diag(s) Vh")


@gpu
@pytest.mark.parametrize("tier", ["0", "1"])
@pytest.mark.parametrize("batch,n", [((16,), 33), ((8,), 7), ((3,), 100), ((), 300)])
def test_f64_tiers_on_gpu(rng, monkeypatch, tier, batch, n):
    """Every op in f64 on the GPU: tier 0's D routines at n = 33 batched (cuBLAS
    DgetrfBatched / DgetrsBatched / DgeqrfBatched with the f64 Q kernel in shared memory,
    DpotrfBatched, DtrsmBatched; Dsyevd and Dgesvdj a matrix at a time), n = 7 batched
    (DsyevjBatched, DgesvdjBatched), n = 100 batched (the Q kernel in global memory) and one
    n = 300 matrix (Dgetrf / Dgetrs, Dpotrf, Dgeqrf / Dorgqr); tier 1's f64 kind at the small
    sizes. Normwise errors within 1e-13 n (f32 routines would miss by 1e4 or more)."""
    if tier == "1" and n > 64:
        pytest.skip("the numba tier is for small matrices")
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", tier)
    a = rng.standard_normal(batch + (n, n)) / np.sqrt(n) + 2 * np.eye(n)
    spd = _sym64(rng, batch, n) + 3 * np.eye(n)
    b = rng.standard_normal(batch + (n, 4))
    g = rlx.Graph("gpu_linalg64")
    A, S, B = (g.input(k, v.shape, "f64") for k, v in (("a", a), ("s", spd), ("b", b)))
    sign, logabs = g.slogdet(A)
    outs = _run(g, [g.linalg_solve(A, B), g.inv(A), sign, logabs, g.cholesky(S),
                    g.triangular_solve(A, B, upper=True),
                    g.triangular_solve(A, g.narrow(mT(g, B), -1, 0, n), left=False),
                    *g.qr(A), *g.eigh(S), *g.svd(A)], {"a": a, "s": spd, "b": b})
    x, inv, s, la, ch, tu, tl, q, r, w, v, u, sv, vh = outs
    rtol = 1e-13 * max(n, 10)
    _close64(x, np.linalg.solve(a, b), "solve", rtol)
    _close64(inv, np.linalg.inv(a), "inv", rtol)
    rs, rl = np.linalg.slogdet(a)
    np.testing.assert_array_equal(s, rs)
    _close64(la, rl, "logabsdet", rtol)
    _close64(ch, np.linalg.cholesky(spd), "cholesky", rtol)
    _close64(tu, np.linalg.solve(np.triu(a), b), "trsm upper", rtol)
    _close64(tl, T(np.linalg.solve(T(np.tril(a)), b)), "trsm lower right", rtol)
    _close64(q @ r, a, "Q R", rtol)
    _close64(T(q) @ q, np.broadcast_to(np.eye(n), q.shape), "Q^T Q", rtol)
    assert np.all(np.tril(r, -1) == 0)
    _close64(w, np.linalg.eigvalsh(spd), "eigenvalues", rtol)
    _close64((v * w[..., None, :]) @ T(v), spd, "V diag(w) V^T", rtol)
    _close64(T(v) @ v, np.broadcast_to(np.eye(n), v.shape), "V^T V", rtol)
    _close64(sv, np.linalg.svd(a, compute_uv=False), "singular values", rtol)
    _close64((u * sv[..., None, :]) @ vh, a, "U S Vh", rtol)
    _close64(T(u) @ u, np.broadcast_to(np.eye(n), u.shape), "U^T U", rtol)
    for vecs in (v, u):         # the documented gauges
        big = np.take_along_axis(vecs, np.abs(vecs).argmax(-2)[..., None, :], -2)
        assert np.all(big > 0)


@gpu
def test_f64_singular_on_gpu(monkeypatch):
    """Tier 0's info codes in f64: the batched calls (cuBLAS DgetrfBatched, DpotrfBatched) and
    the single ones (Dgetrf + Dgetrs, Dpotrf) NaN-fill as the numba tier does."""
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0")
    test_f64_singular_and_mixed_dtypes()
    a = np.array([[1, 0, 3], [2, 0, 6], [1, 0, 1]], np.float64)
    g = rlx.Graph("singular_single64")
    A = g.input("a", a.shape, "f64")
    sign, logabs = g.slogdet(A)
    x, s, la, ch = _run(g, [g.linalg_solve(A, g.constant(np.ones((3, 2)), "f64")), sign, logabs,
                            g.cholesky(A)], {"a": a})
    assert np.isnan(x).all() and np.isnan(ch).all()
    assert s == 0 and la == -np.inf


@gpu
@pytest.mark.parametrize("tier", ["0", "1"])
def test_f64_graph_mode_on_gpu(rng, monkeypatch, tier):
    """f64 steps (the D routines and their loops, the f64 kernels) replay in a captured CUDA
    graph as they run on the stream; eigh / svd run on the numba tier's f64 kind there."""
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "0,1" if tier == "0" else tier)
    a = rng.standard_normal((3, 40, 40)) / np.sqrt(40) + 2 * np.eye(40)
    spd = _sym64(rng, (3,), 40) + 3 * np.eye(40)
    g = rlx.Graph("graph_linalg64")
    A, S = g.input("a", a.shape, "f64"), g.input("s", spd.shape, "f64")
    g.set_outputs([g.inv(A), g.cholesky(S), *g.qr(A), *g.eigh(S), *g.svd(A)])
    feed = {"a": a, "s": spd}
    want = rlx.compile(g, exec_mode="stream").run(feed)
    exe = rlx.compile(g, exec_mode="graph")
    for _ in range(2):          # capture, then replay
        got = exe.run(feed)
        for k, (x, y) in enumerate(zip(got, want)):
            if k < 4 or tier == "1":        # the same steps: the same bits up to reordering
                _close64(x, y, f"output {k}", 1e-13)
        w, v, u, sv, vh = got[4:]
        _close64(v @ (w[..., None] * T(v)), spd, "eigh: V diag(w) V^T", 1e-12)
        _close64(u @ (sv[..., None] * vh), a, "svd: U diag(s) Vh", 1e-12)
