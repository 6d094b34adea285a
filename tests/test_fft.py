"""fft / ifft / rfft / irfft against numpy.fft (every norm, the lengths of issue 20, batched),
their gradients against finite differences, welch against a NumPy transcription of SciPy's
defaults, welch_peaks, and the errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from gradcheck import check
from rlx_numba.ir import dtypes as dt
from rlx_numba.ir.ops_fft import welch_frequencies

LENGTHS = [1, 7, 12, 30, 64, 1000]
NORMS = ["backward", "ortho", "forward"]
# (length, norm) pairs: every norm at the short lengths, the default at the long ones (the
# simulator runs a butterfly a Python call: 1000 is two 2048-point transforms, Bluestein's)
CASES = [(n, norm) for n in LENGTHS for norm in (NORMS if n <= 30 else NORMS[:1])]


def _c(a):
    return a[..., 0] + 1j * a[..., 1]


def _pair(z):
    return np.stack([z.real, z.imag], -1)


@pytest.mark.parametrize("n,norm", CASES)
def test_fft_ifft(rng, n, norm):
    x = rng.standard_normal((2, 3, n, 2) if n <= 30 else (1, n, 2)).astype(np.float32)
    g = rlx.Graph("fft")
    t = g.input("x", x.shape)
    outs = [g.fft(t, norm=norm)] + ([g.fft(t, inverse=True, norm=norm)] if n <= 64 else [])
    g.set_outputs(outs)
    got_all = run_graph(g, {"x": x})
    z = _c(x.astype(np.float64))
    for got, want in zip(got_all, (np.fft.fft(z, norm=norm), np.fft.ifft(z, norm=norm))):
        np.testing.assert_allclose(_c(got), want, rtol=1e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("n,norm", CASES)
def test_rfft_irfft(rng, n, norm):
    rows = 3 if n <= 30 else 1
    x = rng.standard_normal((rows, n)).astype(np.float32)
    spec = _pair(np.fft.rfft(rng.standard_normal((rows, n)), norm=norm)).astype(np.float32)
    g = rlx.Graph("rfft")
    t, s = g.input("x", x.shape), g.input("s", spec.shape)
    outs = [g.rfft(t, norm=norm), g.irfft(s, n=n, norm=norm)]
    if 1 < n <= 30:     # (one bin's default n is 0: an error, as torch's)
        outs.append(g.irfft(s, norm=norm))
    g.set_outputs(outs)
    r, back, *default = run_graph(g, {"x": x, "s": spec})
    want = np.fft.rfft(x.astype(np.float64), norm=norm)
    assert r.shape == (rows, n // 2 + 1, 2)
    np.testing.assert_allclose(_c(r), want, rtol=1e-5, atol=2e-5 * np.abs(want).max())
    for got, m in [(back, n)] + [(d, None) for d in default]:
        want = np.fft.irfft(_c(spec.astype(np.float64)), n=m, norm=norm)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("n", [32, 256])
def test_fft_kernel_paths(rng, n):
    # the simulator's shared rows are 16 points: longer ones take Stockham passes of radix 4
    # and 2 (32: radices 4, 4, 2; 256: 4, 4, 4, 4), two lines a block
    x = rng.standard_normal((2, n, 2)).astype(np.float32)
    g = rlx.Graph("fft_paths")
    t = g.input("x", x.shape)
    g.set_outputs([g.fft(t), g.fft(t, inverse=True)])
    got = run_graph(g, {"x": x})
    z = _c(x.astype(np.float64))
    for out, want in zip(got, (np.fft.fft(z), np.fft.ifft(z))):
        np.testing.assert_allclose(_c(out), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_bluestein_as_graph_ops(rng, monkeypatch):
    # past BLUESTEIN_M the chirp-z is graph ops over two power-of-two transforms
    from rlx_numba.ir import ops_fft
    monkeypatch.setattr(ops_fft, "BLUESTEIN_M", 8)
    x = rng.standard_normal((3, 7, 2)).astype(np.float32)
    g = rlx.Graph("bluestein_ops")
    t = g.input("x", x.shape)
    g.set_outputs([g.fft(t), g.fft(t, inverse=True)])
    exe = rlx.compile(g)
    assert not any("bluestein" in st.kernel_name for st in exe.steps)
    got = exe.run({"x": x})
    z = _c(x.astype(np.float64))
    for out, want in zip(got, (np.fft.fft(z), np.fft.ifft(z))):
        np.testing.assert_allclose(_c(out), want, rtol=1e-4, atol=1e-5)


def test_irfft_cuts_and_pads(rng):
    spec = _pair(rng.standard_normal((2, 5)) + 1j * rng.standard_normal((2, 5))).astype(np.float32)
    g = rlx.Graph("irfft")
    s = g.input("s", spec.shape)
    g.set_outputs([g.irfft(s, n=4), g.irfft(s, n=13), g.irfft(s, n=1)])
    got = run_graph(g, {"s": spec})
    for out, n in zip(got, (4, 13, 1)):
        want = np.fft.irfft(_c(spec.astype(np.float64)), n=n)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [6, 8])
def test_fft_gradients(rng, n):
    x = rng.standard_normal((2, n, 2))
    g = rlx.Graph("fft_grad")
    t = g.input("x", x.shape)
    y = g.fft(t, norm="ortho")
    check(g, y, {"x": t}, {"x": x},
          lambda x: _pair(np.fft.fft(_c(x), norm="ortho")), seed=rng.standard_normal(y.shape))


def test_rfft_irfft_gradients(rng):
    x = rng.standard_normal((2, 7))
    g = rlx.Graph("rfft_grad")
    t = g.input("x", x.shape)
    y = g.irfft(g.mul(g.rfft(t), g.constant(np.float32(1.5))), n=7)
    check(g, y, {"x": t}, {"x": x}, lambda x: np.fft.irfft(np.fft.rfft(x) * 1.5, n=7),
          seed=rng.standard_normal(y.shape))


@pytest.mark.parametrize("n", [8, 7])
def test_rfft_and_irfft_gradients_alone(rng, n):
    # irfft's VJP doubles the bins that also stand conjugated in the Hermitian extension; the
    # imaginary parts of bins 0 and n / 2 do not count (their finite differences are 0)
    x = rng.standard_normal((2, n))
    s = rng.standard_normal((2, n // 2 + 1, 2))
    g = rlx.Graph("rfft_grad")
    tx = g.input("x", x.shape)
    y = g.rfft(tx, norm="ortho")
    check(g, y, {"x": tx}, {"x": x}, lambda x: _pair(np.fft.rfft(x, norm="ortho")),
          seed=rng.standard_normal(y.shape))
    g = rlx.Graph("irfft_grad")
    ts = g.input("s", s.shape)
    y = g.irfft(ts, n=n)
    check(g, y, {"s": ts}, {"s": s}, lambda s: np.fft.irfft(_c(s), n=n),
          seed=rng.standard_normal(y.shape))


@pytest.mark.skipif(not ON_GPU, reason="cuFFT (tier 0) runs on a GPU")
@pytest.mark.parametrize("tier", ["0", "1"])
def test_fft_tiers_on_gpu(rng, monkeypatch, tier):
    monkeypatch.setenv("RLX_NUMBA_FFT_TIERS", tier)
    x = rng.standard_normal((3, 5000, 2)).astype(np.float32)     # Bluestein (tier 1): 16384
    r = rng.standard_normal((4, 4096)).astype(np.float32)        # past one block's shared memory
    s = _pair(np.fft.rfft(rng.standard_normal((2, 1000)))).astype(np.float32)
    g = rlx.Graph("fft_tiers")
    tx, tr, ts = g.input("x", x.shape), g.input("r", r.shape), g.input("s", s.shape)
    g.set_outputs([g.fft(tx), g.fft(tx, inverse=True, norm="ortho"), g.rfft(tr),
                   g.irfft(ts), g.irfft(ts, n=1001)])
    exe = rlx.compile(g)
    got = exe.run({"x": x, "r": r, "s": s})
    z = _c(x.astype(np.float64))
    wants = [np.fft.fft(z), np.fft.ifft(z, norm="ortho"), np.fft.rfft(r.astype(np.float64)),
             np.fft.irfft(_c(s.astype(np.float64))), np.fft.irfft(_c(s.astype(np.float64)), 1001)]
    for out, want in zip(got, wants):
        want = _pair(want) if np.iscomplexobj(want) else want
        np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())
    cufft_steps = [st for st in exe.steps if st.kernel_name.startswith("cufft")]
    assert len(cufft_steps) == (5 if tier == "0" else 0), [st.kernel_name for st in exe.steps]


@pytest.mark.skipif(not ON_GPU, reason="cuFFT (tier 0) runs on a GPU")
def test_cufft_c2r_keeps_an_input_it_does_not_own(rng):
    # cuFFT's C2R overwrites its input: a graph input fed straight to the node is copied first
    n = 64
    s = _pair(np.fft.rfft(rng.standard_normal((3, n)))).astype(np.float32)
    g = rlx.Graph("c2r")
    ts = g.input("s", s.shape)
    y = g._add("irdft", (ts,), (3, n), dt.F32, n=n)
    g.set_outputs([y, g.mul(ts, 1.0)])
    got, again = rlx.compile(g).run({"s": s})
    np.testing.assert_allclose(got, np.fft.irfft(_c(s.astype(np.float64)), n) * n, rtol=1e-4,
                               atol=1e-3)
    np.testing.assert_array_equal(again, s)


def welch_ref(x, fs, nperseg, noverlap, window):

    """scipy.signal.welch's defaults written out: periodic window, detrend constant, density,
    one-sided, mean."""
    nperseg = min(nperseg, x.shape[-1])
    noverlap = nperseg // 2 if noverlap is None else noverlap
    j = np.arange(nperseg)
    win = {"hann": 0.5 - 0.5 * np.cos(2 * np.pi * j / nperseg), "boxcar": np.ones(nperseg)}[window]
    step = nperseg - noverlap
    segs = [x[..., s:s + nperseg] for s in range(0, x.shape[-1] - nperseg + 1, step)]
    ps = []
    for seg in segs:
        seg = seg - seg.mean(-1, keepdims=True)
        p = np.abs(np.fft.rfft(seg * win)) ** 2 / (fs * (win * win).sum())
        p[..., 1:] *= 2
        if nperseg % 2 == 0:
            p[..., -1] /= 2
        ps.append(p)
    return np.mean(ps, 0)


@pytest.mark.parametrize("t,kw", [
    (100, dict(nperseg=32)),
    (77, dict(nperseg=20, noverlap=5, window="boxcar", fs=8.0)),
    (50, dict(nperseg=64)),                        # nperseg cut to the signal's length
    (90, dict(nperseg=15, fs=3.0)),                # odd nperseg: the last bin doubled
])
def test_welch(rng, t, kw):
    x = (rng.standard_normal((2, t)) + np.sin(np.arange(t) * 0.7)).astype(np.float32)
    g = rlx.Graph("welch")
    g.set_outputs([g.welch(g.input("x", x.shape), **kw)])
    (got,) = run_graph(g, {"x": x})
    want = welch_ref(x.astype(np.float64), kw.get("fs", 1.0), kw["nperseg"], kw.get("noverlap"),
                     kw.get("window", "hann"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
    try:
        from scipy.signal import welch
    except ImportError:
        return
    f, p = welch(x.astype(np.float64), fs=kw.get("fs", 1.0), nperseg=min(kw["nperseg"], t),
                 noverlap=kw.get("noverlap"), window=kw.get("window", "hann"))
    np.testing.assert_allclose(want, p, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(welch_frequencies(min(kw["nperseg"], t), kw.get("fs", 1.0)), f)


def test_welch_peaks(rng):
    t, fs, nperseg = 256, 100.0, 64
    x = (np.sin(2 * np.pi * 12.5 * np.arange(t) / fs) + 0.5 * np.sin(2 * np.pi * 31.25 *
         np.arange(t) / fs) + 0.01 * rng.standard_normal(t)).astype(np.float32)
    g = rlx.Graph("peaks")
    psd = g.welch(g.input("x", (t,)), nperseg=nperseg, fs=fs)
    g.set_outputs(list(g.welch_peaks(psd, 2, nperseg, fs)))
    vals, freqs = run_graph(g, {"x": x})
    np.testing.assert_allclose(freqs, [12.5, 31.25])
    assert vals[0] > vals[1] > 0


def test_fft_errors():
    g = rlx.Graph("e")
    x = g.input("x", (3, 4))
    cases = [
        (lambda: g.fft(g.input("a", (3, 5))), "fft: x must be complex as [..., n, 2]"),
        (lambda: g.fft(g.input("b", (4, 2)), norm="none"), "fft: norm must be one of"),
        (lambda: g.rfft(g.input("c", (4,), "i32")), "rfft: x must be f32"),
        (lambda: g.irfft(g.input("d", (3, 2)), n=0), "irfft: n must be a positive int"),
        (lambda: g.irfft(g.input("d1", (1, 2))), "irfft: n must be a positive int, got 0"),
        (lambda: g.welch(x, nperseg=4, noverlap=4), "welch: noverlap must be an int in [0, "),
        (lambda: g.welch(x, window="kaiser"), "welch: window must be 'hann'"),
        (lambda: g.welch(x, nperseg=4, window=np.ones(3)), "welch: a window array must have"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value), str(e.value)


def test_fft_tier_choice(monkeypatch):
    from rlx_numba import cufft
    from rlx_numba.runtime.lower_fft import fft_tier
    g = rlx.Graph("tier")
    y = g.rfft(g.input("x", (2, 8)))
    node = g.nodes[y.id]
    monkeypatch.setenv("RLX_NUMBA_FFT_TIERS", "1")
    assert fft_tier(node) == (1, "tier 0 not allowed by RLX_NUMBA_FFT_TIERS")
    monkeypatch.setenv("RLX_NUMBA_FFT_TIERS", "0,3")
    with pytest.raises(ValueError, match="RLX_NUMBA_FFT_TIERS='0,3': expected"):
        fft_tier(node)
    monkeypatch.delenv("RLX_NUMBA_FFT_TIERS")
    if not ON_GPU:
        assert fft_tier(node) == (1, "the simulator has no cuFFT")
    # a missing library is reported, never raised
    monkeypatch.setattr(cufft, "_lib", None)
    monkeypatch.setattr(cufft, "_candidates", lambda: ["/nonexistent/libcufft.so.12"])
    ok, why = cufft.available()
    assert not ok and "libcufft.so.12" in why
