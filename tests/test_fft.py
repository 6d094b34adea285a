"""fft / ifft / rfft / irfft against numpy.fft (every norm, the lengths of issue 20, batched),
their gradients against finite differences, welch against a NumPy transcription of SciPy's
defaults, welch_peaks, and the errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph
from gradcheck import check
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
