"""rms_norm's prologue fold (passes/fusion.py): ``rms_norm(x)`` read only as the A of a
skinny product (M <= 16, a 2-D weight) becomes the product itself. Tier 3 (kernels/gemv.py)
normalises x as it reads it (f32 sums of squares, x * gamma in f32, the normed x never
rounded); the other tiers run the norm as a row step into a scratch first. Against float64
NumPy on the half-rounded inputs (tests/halfref.py), f32 / f16 / bf16, with bias, the gated
(SwiGLU) epilogue, and a residual stream h = x + r normed and read again later (a decode
layer's: the add's own kernel here)."""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HOST, UNIT, assert_half_close, f64, rounded

EPS = 1e-5


def _graph(d, lead, k, n, residual, bias, gated):
    g = rlx.Graph("norm_prologue")
    x = g.input("x", (*lead, k), d)
    gamma = g.param("gamma", (k,), d)
    h = x + g.input("r", (*lead, k), d) if residual else None
    y = g.rms_norm(h if residual else x, gamma, eps=EPS)
    p = g.linear(y, g.param("w", (k, n), d), g.param("b", (n,), d) if bias else None)
    if gated:
        p = g.gated(p, "silu", interleaved=True)
    g.set_outputs([p] + ([h + h] if h is not None else []))    # h read after the product
    return g


def _compile(d, lead, k, n, residual=False, bias=False, gated=False):
    """The executable, checked to have folded the norm into the product: no norm step of
    its own on tier 3; on the others the product's own row step."""
    exe = rlx.compile(_graph(d, lead, k, n, residual, bias, gated))
    assert [kind for kind, _ in exe.fusion.folds.values() if "norm prologue" in kind]
    (prod,) = [s for s in exe.steps if "tier" in s.info]
    norms = [s for s in exe.steps if "rows_" in s.kernel_name]
    if prod.info["tier"] == 3:
        assert not norms and prod.kernel_name.startswith("numba gemv rms_norm"), exe.steps
    else:
        (norm,) = norms
        assert norm.name.endswith(" norm prologue")
        assert norm.name.split()[0] == prod.name.split()[0]
    return exe, prod.info["tier"]


def _want(d, xv, rv, gv, wv, bv, gated):
    """(product, h, the normed x, |normed| @ |w|) in float64; h rounded to d as the add
    stores it (f32 too: the sum is exact in float64)."""
    h = f64(rounded(f64(xv) + (f64(rv) if rv is not None else 0), d))
    yn = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + EPS) * f64(gv)
    p = yn @ f64(wv) + (f64(bv) if bv is not None else 0)
    if gated:
        p = p[..., 0::2] / (1 + np.exp(-p[..., 0::2])) * p[..., 1::2]
    return p, h, yn, np.abs(yn) @ np.abs(f64(wv))


@pytest.mark.parametrize("d", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("tiers,lead,k,n,residual,bias,gated", [
    ("3,4", (1,), 37, 11, False, True, False),     # element loads
    ("3,4", (3,), 64, 10, True, False, False),     # vectors of 8 halves, residual + h
    ("3,4", (2,), 48, 12, True, True, True),       # gated epilogue after the norm
    ("3,4", (1, 2), 72, 9, True, False, False),    # K past the simulator's split: one split
    ("4", (2,), 37, 10, True, True, False),        # the row step, then the product
    ("4", (1,), 40, 8, False, False, True),
])
def test_norm_prologue(monkeypatch, rng, d, tiers, lead, k, n, residual, bias, gated):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    check_case(rng, d, lead, k, n, residual, bias, gated, int(tiers[0]))


def check_case(rng, d, lead, k, n, residual, bias, gated, want_tier):
    """Compile the case (the fold checked), run it on random data, compare with the oracle
    (also tests/test_gpu_geometry.py's, at the GPU's plan)."""
    exe, tier = _compile(d, lead, k, n, residual, bias, gated)
    assert tier == want_tier
    host = HOST[d]
    xv = rng.standard_normal((*lead, k)).astype(host)
    rv = rng.standard_normal((*lead, k)).astype(host) if residual else None
    gv = (1 + 0.5 * rng.standard_normal(k)).astype(host)
    wv = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(host)
    bv = rng.standard_normal(n).astype(host) if bias else None
    for name, v in (("gamma", gv), ("w", wv), ("b", bv)):
        if v is not None:
            exe.set_param(name, v)
    got = exe.run({"x": xv, **({"r": rv} if residual else {})})
    want, h, yn, mag = _want(d, xv, rv, gv, wv, bv, gated)
    # tier 4 rounds the normed x to d (u |yn| an element: u (|yn| @ |w|) on the product);
    # gated multiplies by |up| <= max |p|
    scale = mag.max() * (np.abs(yn @ f64(wv)).max() if gated else 1)
    if d == "f32":
        np.testing.assert_allclose(f64(got[0]), want, rtol=1e-5, atol=1e-5 * scale)
    else:
        assert_half_close(got[0], want, d, k=4, scale=scale, what=f"tier {tier}")
    if residual:     # h + h: exact doubling of the stored residual_sum
        np.testing.assert_array_equal(f64(got[1]), 2 * h)


@pytest.mark.parametrize("d", ["f16", "bf16"])
def test_norm_prologue_accumulation(monkeypatch, rng, d):
    """The sum of squares of 608 values near 0.81: kept in f32 it is ~490 (error ~ 500 u32);
    a half running sum rounds each 0.81 to the half spacing: bf16 stalls at 256 (spacing 2),
    f16 loses ~0.06 a term (spacing 0.125 to 0.25), which moves 1/sqrt(mean) and with it
    every output by far more than 4 u."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3")
    k, n = 608, 6
    exe, tier = _compile(d, (1,), k, n)
    assert tier == 3
    host = HOST[d]
    xv = (0.9 + 0.002 * rng.standard_normal((1, k))).astype(host)
    gv = np.ones(k, host)
    wv = (np.abs(rng.standard_normal((k, n))) / k).astype(host)    # no cancellation
    exe.set_param("gamma", gv)
    exe.set_param("w", wv)
    (got,) = exe.run({"x": xv})
    want, _, _, mag = _want(d, xv, None, gv, wv, None, False)
    assert_half_close(got, want, d, k=4, scale=mag.max(), what="f32 sum of squares")
    ss = np.zeros((), host)                    # the sum of squares a half accumulator keeps
    for v in f64(xv[0]):
        ss = (np.float32(ss) + np.float32(v * v)).astype(host)
    yn = f64(xv) / np.sqrt(f64(ss) / k + EPS)
    half = yn @ f64(wv)
    assert np.max(np.abs(half - want) / (np.abs(want) + mag.max())) > 4 * UNIT[d]


def test_norm_prologue_declined(monkeypatch):
    """No fold where the norm is read twice, has a beta, or feeds more than 16 rows."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    g = rlx.Graph("no_fold")
    x = g.input("x", (2, 24))
    gamma, w = g.param("gamma", (24,)), g.param("w", (24, 8))
    y = g.rms_norm(x, gamma)
    g.set_outputs([g.linear(y, w), y])              # y read twice (an output too)
    assert not [k for k, _ in rlx.compile(g).fusion.folds.values() if "norm prologue" in k]
    g = rlx.Graph("beta")
    x = g.input("x", (2, 24))
    y = g.rms_norm(x, g.param("gamma", (24,)), g.param("beta", (24,)))
    g.set_outputs([g.linear(y, g.param("w", (24, 8)))])
    assert not [k for k, _ in rlx.compile(g).fusion.folds.values() if "norm prologue" in k]
    g = rlx.Graph("tall")
    x = g.input("x", (17, 24))
    y = g.rms_norm(x, g.param("gamma", (24,)))
    g.set_outputs([g.linear(y, g.param("w", (24, 8)))])
    assert not [k for k, _ in rlx.compile(g).fusion.folds.values() if "norm prologue" in k]
