"""c64 (complex64): the dtype, its ops against NumPy complex128 computed from the same
complex64 inputs, the FFTs on c64 beside the [..., 2] form, products, every error with its
message, and gradients in torch's convention (dL/dRe + i dL/dIm of a real loss) checked by
central differences of a float64 NumPy loss and against torch's VJP formulas."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from test_mma import _toolkit, assemble_sm80
from rlx_numba.ir import dtypes as dt

EPS = 2.0 ** -24          # f32's unit roundoff


def crand(rng, shape):
    return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(np.complex64)


def close(got, want, dtype, k=8, scale=None, what=""):
    """|got - want| <= k u (|want| + scale): k roundings of the inputs' magnitude."""
    assert got.dtype == dtype and got.shape == want.shape, (what, got.dtype, got.shape)
    scale = np.abs(want) if scale is None else scale
    err = np.abs(got.astype(np.complex128) - want)
    bound = k * EPS * (np.abs(want) + scale)
    assert np.all(err <= bound), (what, np.max(err / np.maximum(bound, 1e-300)))


# ---- the dtype and its promotion -------------------------------------------------------------
def test_dtype_and_promotion():
    for spelling in ("c64", "complex64", np.complex64, np.dtype("complex64"), dt.C64):
        assert dt.dtype(spelling) is dt.C64
    assert dt.C64.host == np.complex64 and dt.C64.storage == np.complex64 and dt.C64.itemsize == 8
    # torch.promote_types(torch.complex64, t): complex64 for every real dtype but float64
    for other in ("f32", "f16", "bf16", "i64", "i32", "i16", "i8", "u8", "bool", "c64"):
        o = dt.dtype(other)
        assert dt.promote(dt.C64, o) is dt.C64 and dt.promote(o, dt.C64) is dt.C64, other
    with pytest.raises(ValueError, match="complex128"):
        dt.promote(dt.F64, dt.C64)
    g = rlx.Graph("p")
    z = g.input("z", (3,), "c64")
    for other in ("f32", "f16", "bf16", "i32", "bool"):
        y = g.input(f"y_{other}", (3,), other)
        assert (z + y).dtype is dt.C64 and (y * z).dtype is dt.C64, other
    x = g.input("x", (3,), "f32")
    assert (z * 2).dtype is dt.C64 and (z + 0.5).dtype is dt.C64 and (x * 1j).dtype is dt.C64
    assert g.abs(z).dtype is dt.F32 and g.angle(z).dtype is dt.F32 and g.real(z).dtype is dt.F32
    assert g.cast(x, "c64").dtype is dt.C64 and g.real(x) is x and g.conj(x) is x
    assert g.constant(np.exp(1j * np.arange(3.0))).dtype is dt.C64     # complex128 -> c64


def test_the_ops_declaring_c64():
    """The one enforcement point: these OpDefs take c64; every other op raises (test_errors)."""
    from rlx_numba.ir.opdef import OPS
    assert {n for n, d in OPS.items() if d.c64} == {"reshape", "view_as_real",
                                                    "view_as_complex", "cmatmul"}


def test_errors():
    g = rlx.Graph("e")
    z = g.input("z", (3,), "c64")
    w = g.input("w", (2, 3), "c64")
    d = g.input("d", (3,), "f64")
    x = g.input("x", (3,), "f32")
    cases = [
        (lambda: g.exp(z), r"activation: dtype c64 is not supported \(input 0 is c64 \[3\]\)"),
        (lambda: g.reduce_sum(w, -1), r"reduce: dtype c64 is not supported \(input 0 is c64 \[2, 3\]\)"),
        (lambda: g.transpose(w, (1, 0)), r"transpose: dtype c64 is not supported"),
        (lambda: z > z, r"gt: dtype c64|compare: dtype c64"),
        (lambda: g.max(z, z), r"max: c64 operands take add, sub, mul, div only, got a c64 \[3\]"),
        (lambda: z + d, r"add: b is f64 \[3\] beside a c64 operand .*complex128"),
        (lambda: z + g.input("q", (4,), "c64"),
         r"add: shapes do not broadcast: a \[3\], b \[4\]"),
        (lambda: g.matmul(w, x), r"matmul: a and b must have the same dtype, got a c64 \[2, 3\] "
                                 r"and b f32 \[3\]"),
        (lambda: g.matmul(w, w), r"matmul: inner dimensions differ: a \[2, 3\] has K=3, b \[2, 3\] "
                                 r"has K=2"),
        (lambda: g.imag(x), r"imag: z must be c64, got f32 \[3\]"),
        (lambda: g.complex(z, x), r"complex: re must be a real f32 .* got c64 \[3\]"),
        (lambda: g.complex(x, d), r"complex: im must be a real f32 .* got f64 \[3\]"),
        (lambda: g.view_as_complex(g.input("p", (3, 3), "f32")),
         r"view_as_complex: x must be f32 \[\.\.\., 2\] \(re, im\), got f32 \[3, 3\]"),
        (lambda: g.view_as_real(x), r"view_as_real: x must be c64, got f32 \[3\]"),
        (lambda: g.cast(d, "c64"), r"cast: x is f64 \[3\]"),
        (lambda: g.cast(z, "f32"), r"cast: dtype c64 is not supported \(input 0 is c64 \[3\]\)"),
        (lambda: g.rfft(z), r"rfft: x must be f32, got c64 \[3\]"),
        (lambda: g.grad(g.mul(z, z), z), r"grad: y .* is c64; a gradient without seed="),
    ]
    for build, msg in cases:
        with pytest.raises(ValueError, match=msg):
            build()
    h = rlx.Graph("run")
    h.set_outputs([h.input("z", (3,), "c64") * 2])
    with pytest.raises(ValueError, match=r"run: input 'z' must be c64 \(complex64\), got complex128"):
        rlx.compile(h).run({"z": np.ones(3, np.complex128)})


# ---- forward against NumPy complex128 -------------------------------------------------------
def test_elementwise_ops(rng):
    a_np = crand(rng, (3, 5))
    a_np[0, :4] = [0, -2, 3j, -1 + 1e-3j]       # angle's axes and its branch cut's edge
    b_np = crand(rng, (5,))
    x_np = rng.standard_normal((3, 1)).astype(np.float32)
    g = rlx.Graph("ew")
    a, b, x = g.input("a", a_np.shape, "c64"), g.input("b", (5,), "c64"), g.input("x", (3, 1))
    outs = {"add": a + b, "sub": b - a, "mul": a * b, "div": a / b, "rdiv": x / b,
            "mul_real": a * x, "div_real": a / x, "sub_real": x - a, "scalar": 2.5 * a + 1j,
            "neg": -a, "conj": g.conj(a), "abs": g.abs(a), "angle": g.angle(a),
            "real": g.real(a), "imag": g.imag(a), "complex": g.complex(x, g.real(b)),
            "cast": g.cast(x, "c64")}
    g.set_outputs(list(outs.values()))
    got = dict(zip(outs, run_graph(g, {"a": a_np, "b": b_np, "x": x_np})))
    A, B, X = a_np.astype(np.complex128), b_np.astype(np.complex128), x_np.astype(np.float64)
    want = {"add": A + B, "sub": B - A, "mul": A * B, "div": A / B, "rdiv": X / B,
            "mul_real": A * X, "div_real": A / X, "sub_real": X - A, "scalar": 2.5 * A + 1j,
            "neg": -A, "conj": A.conj(), "abs": np.abs(A), "angle": np.angle(A), "real": A.real,
            "imag": A.imag, "complex": X + 1j * B.real, "cast": X + 0j}
    mag = np.abs(A) * np.abs(B)      # the products' and quotients' cancellation scales
    scale = {"add": np.abs(A) + np.abs(B), "sub": np.abs(A) + np.abs(B), "mul": mag,
             "div": np.abs(A) / np.abs(B), "rdiv": np.abs(X) / np.abs(B),
             "sub_real": np.abs(A) + np.abs(X), "scalar": 2.5 * np.abs(A) + 1}
    for k, w in want.items():
        real = k in ("abs", "angle", "real", "imag")
        close(got[k], w, np.float32 if real else np.complex64, scale=scale.get(k), what=k)
    assert got["angle"][0, 0] == 0 and got["abs"][0, 0] == 0
    # the naive atan(im / (|z| + re)) near the negative real axis cancels to ~1e-5 there
    assert abs(got["angle"][0, 3] - np.angle(A[0, 3])) < 4 * EPS * np.pi


def test_matmul(rng):
    """Batched and broadcast c64 products (the numba tier here), and their gradients for a
    cotangent dy summed back over the broadcast axes: dy b^H, a^H dy."""
    a_np, b_np = crand(rng, (2, 3, 5)), crand(rng, (5, 7))
    p_np, q_np, dy_np = crand(rng, (2, 1, 3, 5)), crand(rng, (3, 5, 4)), crand(rng, (2, 3, 3, 4))
    g = rlx.Graph("mm")
    a, b = g.input("a", a_np.shape, "c64"), g.input("b", b_np.shape, "c64")
    p, q = g.input("p", p_np.shape, "c64"), g.input("q", q_np.shape, "c64")
    dy = g.input("dy", dy_np.shape, "c64")
    g.set_outputs([a @ b, p @ q] + g.grad(p @ q, [p, q], seed=dy))
    got = run_graph(g, {"a": a_np, "b": b_np, "p": p_np, "q": q_np, "dy": dy_np})
    A, B, P, Q, DY = (t.astype(np.complex128) for t in (a_np, b_np, p_np, q_np, dy_np))
    H = lambda t: np.swapaxes(t, -1, -2).conj()       # noqa: E731
    close(got[0], A @ B, np.complex64, k=16, scale=np.abs(A) @ np.abs(B))
    close(got[1], P @ Q, np.complex64, k=16, scale=np.abs(P) @ np.abs(Q))
    close(got[2], (DY @ H(Q)).sum(1, keepdims=True), np.complex64, k=32,
          scale=(np.abs(DY) @ np.abs(H(Q))).sum(1, keepdims=True))
    close(got[3], (H(P) @ DY).sum(0), np.complex64, k=32, scale=(np.abs(H(P)) @ np.abs(DY)).sum(0))


@pytest.mark.parametrize("ha,hb", [(False, True), (True, False), (True, True)])
def test_matmul_flags_and_their_gradients(rng, ha, hb):
    """The product node's conjugate-transpose flags (its VJP's products use them): forward
    against NumPy, gradients of a real loss against central differences."""
    feed = {"a": crand(rng, (3, 2) if ha else (2, 3)), "b": crand(rng, (4, 3) if hb else (3, 4)),
            "w": crand(rng, (2, 4))}
    op = lambda t, h: t.conj().T if h else t           # noqa: E731

    def loss(a, b, w):
        return np.real(op(a, ha) @ op(b, hb) * w).sum() + np.abs(op(a, ha) @ op(b, hb)).sum()

    g = rlx.Graph("flags")
    a, b, w = (g.input(k, v.shape, "c64") for k, v in feed.items())
    y = g.bind("cmatmul", [a, b], ha=ha, hb=hb)
    L = g.reduce_sum(g.real(y * w)) + g.reduce_sum(g.abs(y))
    g.set_outputs([y] + g.grad(L, [a, b]))
    got = run_graph(g, feed)
    A, B = (feed[k].astype(np.complex128) for k in "ab")
    close(got[0], op(A, ha) @ op(B, hb), np.complex64, k=16,
          scale=np.abs(op(A, ha)) @ np.abs(op(B, hb)))
    for name, gr in zip("ab", got[1:]):
        np.testing.assert_allclose(gr, _fd(loss, feed, name), rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.skipif(ON_GPU or _toolkit() is None, reason="needs ptxas + libnvvm, no GPU")
def test_gpu_body_of_the_cgemm_kernel_compiles(tmp_path):
    """Without a GPU: the numba c64 product in its four flag variants through NVVM and
    ptxas (the simulator runs Python complex arithmetic, which NVVM may refuse)."""
    script = textwrap.dedent(f"""
        import os
        os.environ["RLX_NUMBA_SIMULATOR"] = "0"
        from numba import cuda
        from numba.cuda import types as T
        from rlx_numba.kernels import complex as K
        c, i = T.complex64[::1], T.int64[::1]
        for ha in (False, True):
            for hb in (False, True):
                ptx, _ = cuda.compile_ptx(K.cgemm_kernel(ha, hb).py_func,
                                          (c, c, c) + (T.int64,) * 3 + (i, i, T.int64), cc=(8, 0))
                open(os.path.join({str(tmp_path)!r}, f"cgemm{{int(ha)}}{{int(hb)}}.ptx"), "w").write(ptx)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1], timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    for ha in (0, 1):
        for hb in (0, 1):
            assemble_sm80(tmp_path / f"cgemm{ha}{hb}.ptx")


@pytest.mark.parametrize("n", [6, 8])
def test_fft(rng, n):
    z_np = crand(rng, (2, n))
    g = rlx.Graph("fft")
    z = g.input("z", z_np.shape, "c64")
    pairs = g.view_as_real(z)
    outs = [g.fft(z), g.fft(z, inverse=True), g.fft(z, norm="ortho"), g.irfft(z, n=2 * n - 3),
            g.fft(pairs)]
    g.set_outputs(outs)
    y, yi, yo, r, old = run_graph(g, {"z": z_np})
    Z = z_np.astype(np.complex128)
    scale = np.sqrt(n) * np.linalg.norm(Z, axis=-1, keepdims=True)
    close(y, np.fft.fft(Z), np.complex64, k=16 * n, scale=scale)
    close(yi, np.fft.ifft(Z), np.complex64, k=16 * n, scale=scale / n)
    close(yo, np.fft.fft(Z, norm="ortho"), np.complex64, k=16 * n, scale=scale / np.sqrt(n))
    close(r, np.fft.irfft(Z, n=2 * n - 3), np.float32, k=32 * n, scale=scale / n)
    # the [..., 2] form: the same nodes, the same bits
    assert old.dtype == np.float32 and old.shape == (2, n, 2)
    np.testing.assert_array_equal(old, y.view(np.float32).reshape(2, n, 2))


# ---- gradients ------------------------------------------------------------------------------
def _fd(loss, arrays, name, h=1e-6):
    """dL/dRe + i dL/dIm of the float64 loss by central differences (each real component)."""
    base = {k: v.astype(np.complex128 if np.iscomplexobj(v) else np.float64)
            for k, v in arrays.items()}
    v = base[name]
    out = np.zeros(v.shape, v.dtype)
    for idx in np.ndindex(v.shape):
        for unit in ((1, 1j) if np.iscomplexobj(v) else (1,)):
            d = []
            for s in (h, -h):
                arr = dict(base)
                arr[name] = v.copy()
                arr[name][idx] += s * unit
                d.append(loss(**arr))
            out[idx] += unit * (d[0] - d[1]) / (2 * h)
    return out


def test_magnitudes_past_the_squares_range():
    """abs, angle and / where |z|^2 leaves f32's range (|z| ~ 1e30, 1e-30, 1e38): hypot's
    scaling and Smith's division keep them to a few roundings (|z|^2 formed directly gives inf
    or 0); b = 0 gives numpy's (Re a / 0, Im a / 0); an infinite part has |z| = inf."""
    a_np = np.array([3e30 + 4e30j, 3e-30 - 4e-30j, 1e38 + 1e38j, -2e-38 + 1e-39j, 5 - 7j,
                     1 + 1j, -1 + 0j, 0j, np.inf + 1j, complex(np.inf, np.nan),
                     complex(np.nan, -np.inf)], np.complex64)
    b_np = np.array([1e30 - 2e30j, 2e-30 + 1e-30j, 3e37 - 1e37j, 1e-38 + 1e-38j,
                     1e-30 + 2e-30j, 0j, 0j, 0j, 2 + 0j, 1 + 0j, 1 + 0j], np.complex64)
    g = rlx.Graph("big")
    a, b = g.input("a", a_np.shape, "c64"), g.input("b", b_np.shape, "c64")
    g.set_outputs([g.abs(a), g.angle(a), a / b])
    absa, ang, q = run_graph(g, {"a": a_np, "b": b_np})
    A, B = a_np.astype(np.complex128), b_np.astype(np.complex128)
    fin = np.isfinite(A)
    close(absa[fin], np.abs(A[fin]), np.float32, k=4, what="abs")
    assert (absa[~fin] == np.inf).all(), absa[~fin]      # inf beside 1 and beside NaN
    close(ang[fin], np.angle(A[fin]).astype(np.float64), np.float32, k=4, scale=np.pi,
          what="angle")
    nz = (B != 0) & fin
    close(q[nz], A[nz] / B[nz], np.complex64, k=8, what="div")
    with np.errstate(divide="ignore", invalid="ignore"):
        np.testing.assert_array_equal(q[B == 0], (a_np[B == 0] / b_np[B == 0]))


def test_gradient_finite_differences(rng):
    """A real loss over every op: its gradients against central differences of the same loss
    in float64 NumPy, for the c64 and the f32 inputs."""
    feed = {"a": crand(rng, (2, 3)), "b": crand(rng, (3,)), "c": crand(rng, (3, 2)),
            "x": rng.standard_normal((2, 1)).astype(np.float32)}

    def loss(a, b, c, x, np=np):
        y = a * b - a / b + np.conj(a) * x
        m = (a @ c) / (1.5 + 0.5j)
        f = np.fft.fft(a)
        return (np.abs(y).sum() + np.angle(y).sum() + (np.real(m) * np.imag(m)).sum()
                + np.abs(f).sum() + (np.abs(a + (x + 0.5j * np.real(b))) ** 2).sum())

    g = rlx.Graph("grad")
    t = {k: g.input(k, v.shape, "c64" if np.iscomplexobj(v) else "f32") for k, v in feed.items()}
    a, b, c, x = t["a"], t["b"], t["c"], t["x"]
    y = a * b - a / b + g.conj(a) * x
    m = (a @ c) / (1.5 + 0.5j)
    f = g.fft(a)
    e = a + g.complex(x, 0.5 * g.real(b))
    L = (g.reduce_sum(g.abs(y)) + g.reduce_sum(g.angle(y)) + g.reduce_sum(g.real(m) * g.imag(m))
         + g.reduce_sum(g.abs(f)) + g.reduce_sum(g.abs(e) * g.abs(e)))
    grads = g.grad(L, [a, b, c, x])
    g.set_outputs([L] + grads)
    got = run_graph(g, feed)
    assert abs(got[0] - loss(**{k: v.astype(np.complex128) for k, v in feed.items()})) < 1e-4 * abs(got[0])
    for name, gr in zip("abcx", got[1:]):
        want = _fd(loss, feed, name)
        assert gr.dtype == feed[name].dtype, name
        np.testing.assert_allclose(gr, want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_vjps_are_torch_formulas(rng):
    """Each op's VJP for a given cotangent dy, against torch's formulas (torch/csrc/autograd/
    FunctionsManual.cpp and derivatives.yaml) evaluated in complex128: mul dy conj(b), div
    dy / conj(b) and -dy conj(a) / conj(b)^2, abs dy z / |z| (0 at 0), angle dy i z / |z|^2
    (0 at 0), conj conj(dy), real dy, imag i dy, complex (Re dy, Im dy), matmul dy b^H and
    a^H dy, an unnormalised fft n ifft(dy); a real operand gets the real part, summed over
    its broadcast axes."""
    a_np, b_np, dy_np = crand(rng, (3, 5)), crand(rng, (5,)), crand(rng, (3, 5))
    a_np[1, 2] = 0
    x_np = rng.standard_normal((3, 1)).astype(np.float32)
    r_np = rng.standard_normal((3, 5)).astype(np.float32)
    c_np, dm_np = crand(rng, (5, 4)), crand(rng, (3, 4))
    g = rlx.Graph("vjp")
    a, b, x = g.input("a", (3, 5), "c64"), g.input("b", (5,), "c64"), g.input("x", (3, 1))
    c = g.input("c", (5, 4), "c64")
    dy, r, dm = g.input("dy", (3, 5), "c64"), g.input("r", (3, 5)), g.input("dm", (3, 4), "c64")
    dyr = g.real(dy)
    outs = (g.grad(a * b, [a, b], seed=dy) + g.grad(a / b, [a, b], seed=dy)
            + [g.grad(g.abs(a), a, seed=dyr), g.grad(g.angle(a), a, seed=dyr),
               g.grad(g.conj(a), a, seed=dy), g.grad(g.real(a), a, seed=dyr),
               g.grad(g.imag(a), a, seed=dyr)]
            + g.grad(g.complex(r, x), [r, x], seed=dy) + g.grad(a * x, [x, b], seed=dy)
            + g.grad(a @ c, [a, c], seed=dm) + [g.grad(g.fft(a), a, seed=dy)])
    g.set_outputs(outs)
    got = run_graph(g, {"a": a_np, "b": b_np, "x": x_np, "c": c_np, "dy": dy_np, "r": r_np,
                        "dm": dm_np})
    A, B, C = (v.astype(np.complex128) for v in (a_np, b_np, c_np))
    DY, DM = dy_np.astype(np.complex128), dm_np.astype(np.complex128)
    DR = DY.real
    absA = np.abs(A)
    sgn = np.divide(A, absA, out=np.zeros_like(A), where=absA > 0)
    ang = np.divide(1j * A, absA ** 2, out=np.zeros_like(A), where=absA > 0)
    want = [DY * B.conj(), (DY * A.conj()).sum(0), DY / B.conj(),
            (-DY * A.conj() / B.conj() ** 2).sum(0), DR * sgn, DR * ang, DY.conj(), DR + 0j,
            1j * DR, DY.real, DY.imag.sum(1, keepdims=True),
            (DY * A.conj()).real.sum(1, keepdims=True), np.zeros(5, np.complex128),
            DM @ C.conj().T, A.conj().T @ DM, 5 * np.fft.ifft(DY)]
    names = ["mul a", "mul b", "div a", "div b", "abs", "angle", "conj", "real", "imag",
             "complex re", "complex im", "mul real x", "unused b", "matmul a", "matmul b", "fft"]
    assert len(got) == len(want) == len(names)
    for k, gw, w in zip(names, got, want):
        np.testing.assert_allclose(gw, w, rtol=1e-5, atol=1e-5, err_msg=k)
        assert gw.dtype == (np.complex64 if np.iscomplexobj(w) else np.float32), k
    assert got[4][1, 2] == 0 and got[5][1, 2] == 0         # torch's 0 at z = 0, not NaN


@pytest.mark.skipif(not ON_GPU, reason="sizes for a GPU (cuFFT, cuBLAS, the GPU's geometries)")
@pytest.mark.parametrize("mode,tier", [("stream", "0"), ("graph", "0"), ("stream", "1")])
def test_gpu_complex_at_size(rng, monkeypatch, mode, tier):
    """A 300 x 257 x 129 c64 product (cublasCgemm: tier 0; the numba kernel: tier 1), cuFFT
    C2C on c64 rows of 4096 and 1000, element-wise ops over 100,003 entries, and the gradient
    of sum |a @ b| (dY = sgn(Y): dA = sgn(Y) b^H, dB = a^H sgn(Y): Cgemm's OP_C), in a stream
    and captured in a CUDA graph."""
    monkeypatch.setenv("RLX_NUMBA_CMATMUL_TIERS", tier)
    a_np, b_np = crand(rng, (300, 257)), crand(rng, (257, 129))
    f_np, h_np = crand(rng, (3, 4096)), crand(rng, (2, 1000))
    u_np, v_np = crand(rng, (100_003,)), crand(rng, (100_003,))
    g = rlx.Graph("gpu")
    a, b = g.input("a", a_np.shape, "c64"), g.input("b", b_np.shape, "c64")
    f, h = g.input("f", f_np.shape, "c64"), g.input("h", h_np.shape, "c64")
    u, v = g.input("u", u_np.shape, "c64"), g.input("v", v_np.shape, "c64")
    y = a @ b
    outs = [y, g.fft(f), g.fft(h, inverse=True), u * v / (v + 2.0), g.angle(u)]
    outs += g.grad(g.reduce_sum(g.abs(y)), [a, b])
    g.set_outputs(outs)
    exe = rlx.compile(g, exec_mode=mode)
    names = [s.kernel_name for s in exe.steps if "cgemm" in s.kernel_name.lower()]
    assert len(names) == 3 and all(n.startswith("cublasCgemm" if tier == "0" else "numba cgemm")
                                   for n in names), names
    got = exe.run({"a": a_np, "b": b_np, "f": f_np, "h": h_np, "u": u_np, "v": v_np})
    A, B, F, H, U, V = (t.astype(np.complex128) for t in (a_np, b_np, f_np, h_np, u_np, v_np))
    Y = A @ B
    close(got[0], Y, np.complex64, k=64, scale=np.abs(A) @ np.abs(B), what="matmul")
    close(got[1], np.fft.fft(F), np.complex64, k=64 * 12,
          scale=np.sqrt(4096) * np.linalg.norm(F, axis=-1, keepdims=True), what="fft 4096")
    close(got[2], np.fft.ifft(H), np.complex64, k=64 * 10,
          scale=np.linalg.norm(H, axis=-1, keepdims=True) / np.sqrt(1000), what="ifft 1000")
    W = U * V / (V + 2.0)
    close(got[3], W, np.complex64, k=16, scale=np.abs(U) * np.abs(V) / np.abs(V + 2.0) * 4,
          what="element-wise")
    close(got[4], np.angle(U), np.float32, k=8, scale=np.pi, what="angle")
    S = got[0].astype(np.complex128)      # sgn of the Y the backward reads (the forward's:
    S /= np.abs(S)                         # sgn of an exact Y near 0 would differ by far more)
    close(got[5], S @ B.conj().T, np.complex64, k=64, scale=np.ones((1, 129)) @ np.abs(B).T,
          what="grad a")
    close(got[6], A.conj().T @ S, np.complex64, k=64, scale=np.abs(A).T @ np.ones((300, 1)),
          what="grad b")
