"""fft, rfft, irfft and welch: the FFT nodes' OpDefs (ir/opdef.py), argument checks, the Graph
builder methods (mixed into Graph), the nodes' VJPs and their expansion for the numba tier.
Complex values are a trailing axis of 2 (re, im).

Three nodes, the unnormalised transforms along the complex axis, any length:
  "dft"    x [..., n, 2] -> [..., n, 2], sign -1 (or +1 with ``inverse``)
  "rdft"   x [..., n] real -> its first n // 2 + 1 bins [..., n // 2 + 1, 2]
  "irdft"  x [..., n // 2 + 1, 2] (one-sided, imaginary parts of bins 0 and n / 2 zero) ->
           the real inverse [..., n] (attr ``n``)
The compiler (compiler.py legalise, runtime/lower_fft.py fft_tier) keeps them for cuFFT (tier
0: C2C, R2C, C2R) or rewrites them with ``expand_fft`` into the numba tier: the "fft" node,
radix-2 Stockham kernels for n a power of two (kernels/fft.py), and for other lengths
Bluestein's chirp-z: one "bluestein" node (a row in shared memory) while the padded length
fits BLUESTEIN_M, else graph ops over the "fft" node: x_j c_j (c_j = exp(-+ i pi j^2 / n)) zero-padded to a
power of two m >= 2n - 1, convolved with conj(c) by two m-point transforms and the transform
of conj(c) made on the host (float64), times c_k. rdft there is the complex transform of x
with a zero imaginary part (its first bins); irdft builds the Hermitian spectrum and keeps the
real part of the inverse. The norms are torch's scales, as graph ops. fft and irfft also
take c64 tensors (ir/ops_complex.py): their [..., 2] pairs are viewed, the same nodes run. welch is SciPy's
(framing by a gather, detrend "constant", the window, rfft, density scaling, one-sided, the
mean over segments).
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32_ONLY, defop
from .ops import fmt

NORMS = ("backward", "ortho", "forward")


def _desc(t):
    return f"{t.dtype} {fmt(t.shape)}"


def _pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _scale(norm: str, n: int, inverse: bool) -> float:
    if norm == "ortho":
        return 1.0 / math.sqrt(n)
    return 1.0 / n if (norm == "backward") == inverse else 1.0


def _cmul(g, a, b):
    """a * b for complex tensors [..., 2] (b broadcast)."""
    ar, ai = g.narrow(a, -1, 0, 1), g.narrow(a, -1, 1, 1)
    br, bi = g.narrow(b, -1, 0, 1), g.narrow(b, -1, 1, 1)
    return g.concat([g.sub(g.mul(ar, br), g.mul(ai, bi)), g.add(g.mul(ar, bi), g.mul(ai, br))], -1)


def _complex_const(z: np.ndarray) -> np.ndarray:
    return np.stack([z.real, z.imag], -1).astype(np.float32)


FFT_NODES = ("dft", "rdft", "irdft")


# the longest padded length m of the one-kernel Bluestein ("bluestein" node: a row in shared
# memory, kernels/fft.py); longer ones are graph ops over two "fft" nodes
BLUESTEIN_M = 2048


def bluestein_length(n: int) -> int:
    """Bluestein's padded length m: the power of two >= 2n - 1."""
    return 1 << (2 * n - 2).bit_length()


def bluestein_tables(n: int, inverse: bool):
    """(m, chirp c [n], filter [m]) of Bluestein's n-point DFT, complex128: c_j = exp(-+ i pi
    j^2 / n), the filter the m-point DFT of conj(c) wrapped around, times the inverse's 1 / m."""
    m = bluestein_length(n)
    s = 1.0 if inverse else -1.0
    j = np.arange(n)
    c = np.exp(1j * s * math.pi * ((j * j) % (2 * n)) / n)          # the chirp, float64
    b = np.zeros(m, np.complex128)
    b[:n] = np.conj(c)
    b[m - n + 1:] = np.conj(c[1:])[::-1]
    return m, c, np.fft.fft(b) / m


def _complex(op, x):
    if x.dtype != dt.F32 or len(x.shape) < 2 or x.shape[-1] != 2 or x.shape[-2] < 1:
        raise ValueError(f"{op}: x must be f32 complex as [..., n, 2] (re, im) with n >= 1, got "
                         f"{_desc(x)}")


def infer_dft(x, inverse):
    _complex("dft", x)
    return x.shape, dt.F32


def infer_rdft(x):
    if x.dtype != dt.F32 or len(x.shape) < 1 or x.shape[-1] < 1:
        raise ValueError(f"rdft: x must be f32 [..., n] with n >= 1, got {_desc(x)}")
    return tuple(x.shape[:-1]) + (x.shape[-1] // 2 + 1, 2), dt.F32


def infer_irdft(x, n):
    _complex("irdft", x)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or x.shape[-2] != n // 2 + 1:
        raise ValueError(f"irdft: x must hold the n // 2 + 1 bins of n={n!r}, got {_desc(x)}")
    return tuple(x.shape[:-2]) + (n,), dt.F32


def infer_fft(x, inverse):
    _complex("fft", x)
    if not _pow2(x.shape[-2]):
        raise ValueError(f"fft: the Stockham kernels take a power-of-two length, got {_desc(x)}")
    return x.shape, dt.F32


def infer_bluestein(x, inverse):
    _complex("bluestein", x)
    n = x.shape[-2]
    if _pow2(n) or bluestein_length(n) > BLUESTEIN_M:
        raise ValueError(f"bluestein: takes a length that is not a power of two whose padded "
                         f"length fits {BLUESTEIN_M}, got {_desc(x)}")
    return x.shape, dt.F32


defop("dft", infer_dft, dtype_rule=F32_ONLY,
      doc="the unnormalised DFT along the complex axis, any length (inverse: sign +1)")
defop("rdft", infer_rdft, dtype_rule=F32_ONLY,
      doc="the first n // 2 + 1 bins of a real signal's unnormalised DFT")
defop("irdft", infer_irdft, dtype_rule=F32_ONLY,
      doc="the real unnormalised inverse of a one-sided spectrum of n // 2 + 1 bins (attr n)")
defop("fft", infer_fft, dtype_rule=F32_ONLY,
      doc="the numba tier's radix-2 Stockham DFT (a power-of-two length)")
defop("bluestein", infer_bluestein, dtype_rule=F32_ONLY,
      doc="the numba tier's one-kernel Bluestein DFT (a row in shared memory)")


def _stockham_or_bluestein(g, x, inverse: bool):
    """The numba tier's unnormalised DFT of x [..., n, 2] along axis -2, any n >= 1."""
    n = x.shape[-2]
    if _pow2(n):
        return g.bind("fft", [x], inverse=bool(inverse))
    m, c, bhat = bluestein_tables(n, inverse)
    if m <= BLUESTEIN_M:
        return g.bind("bluestein", [x], inverse=bool(inverse))
    pads = (0, 0, 0, m - n)
    a = g.pad(_cmul(g, x, g.constant(_complex_const(c))), pads)
    conv = g.bind("fft", [_cmul(g, g.bind("fft", [a], inverse=False),
                                g.constant(_complex_const(bhat)))], inverse=True)
    return _cmul(g, g.narrow(conv, -2, 0, n), g.constant(_complex_const(c)))


def expand_fft(g, node, ins):
    """An FFT node as the numba tier, on graph ``g`` (the compiler's rewrite when
    runtime/lower_fft.py fft_tier says 1)."""
    (x,) = ins
    if node.op == "dft":
        return _stockham_or_bluestein(g, x, node.attrs["inverse"])
    if node.op == "rdft":
        n = x.shape[-1]
        z = g.pad(g.reshape(x, tuple(x.shape) + (1,)), (0, 1))       # imaginary part 0
        return g.narrow(_stockham_or_bluestein(g, z, False), -2, 0, n // 2 + 1)
    n, h = node.attrs["n"], x.shape[-2]
    if n > h:           # bins h .. n-1 are conj(x[n - k])
        idx = g.constant(np.arange(n - h, 0, -1, dtype=np.int64))
        tail = g.mul(g.gather(x, idx, axis=len(x.shape) - 2),
                     g.constant(np.array([1.0, -1.0], np.float32)))
        x = g.concat([x, tail], -2)
    y = _stockham_or_bluestein(g, x, True)
    return g.reshape(g.narrow(y, -1, 0, 1), node.shape)


def _dft(g, x, inverse: bool):
    return g.bind("dft", [x], inverse=bool(inverse))


def _rdft(g, x):
    return g.bind("rdft", [x])


@vjp("dft")
def _dft_vjp(g, node, dy):
    # the adjoint of an unnormalised DFT is the unnormalised DFT the other way
    return [_dft(g, dy, not node.attrs["inverse"])]


@vjp("rdft")
def _rdft_vjp(g, node, dy):
    # dx_j = Re(sum_k dy_k e^{+2 pi i jk / n}) over the kept bins: the inverse transform of dy
    # zero-extended to n bins, its real part
    x = g.nodes[node.inputs[0]]
    n, h = x.shape[-1], dy.shape[-2]
    full = g.pad(dy, (0, 0, 0, n - h)) if n > h else dy
    return [g.reshape(g.narrow(_dft(g, full, True), -1, 0, 1), x.shape)]


@vjp("irdft")
def _irdft_vjp(g, node, dy):
    # y = Re(IDFT(X extended Hermitian)): dX_k = DFT(dy)_k, twice for the bins 1 .. n - h that
    # also stand (conjugated) in the extension; the imaginary parts of bins 0 and n / 2 get 0
    n = node.attrs["n"]
    h = n // 2 + 1
    w = np.ones((h, 1), np.float32)
    w[1:n - h + 1] = 2.0
    return [g.mul(_rdft(g, dy), g.constant(w))]


class FftOps:
    """Builder methods; ``self`` is the Graph."""

    def _fft_args(self, op, x, norm):
        self.check(op, "x", x)
        if x.dtype != dt.F32:
            raise ValueError(f"{op}: x must be f32, got {_desc(x)}")
        if norm not in NORMS:
            raise ValueError(f"{op}: norm must be one of {NORMS}, got {norm!r}")

    def fft(self, x, inverse: bool = False, norm: str = "backward"):
        """torch.fft.fft / ifft along the last complex axis: x f32 [..., n, 2] (re, im) ->
        [..., n, 2]; any n >= 1; norm "backward" (inverse scaled 1/n), "ortho", "forward".
        A c64 x [..., n] -> c64 [..., n]: the same transform on its pairs (views, no copy)."""
        op = "fft"
        if getattr(x, "dtype", None) == dt.C64:
            self.check(op, "x", x)
            if len(x.shape) < 1 or x.shape[-1] < 1:
                raise ValueError(f"{op}: a c64 x must be [..., n] with n >= 1, got {_desc(x)}")
            return self.view_as_complex(self.fft(self.view_as_real(x), inverse, norm))
        self._fft_args(op, x, norm)
        if len(x.shape) < 2 or x.shape[-1] != 2 or x.shape[-2] < 1:
            raise ValueError(f"{op}: x must be complex as [..., n, 2] (re, im) with n >= 1, got "
                             f"{_desc(x)}")
        y = _dft(self, x, inverse)
        scale = _scale(norm, x.shape[-2], inverse)
        return y if scale == 1.0 else self.mul(y, scale)

    def rfft(self, x, norm: str = "backward"):
        """torch.fft.rfft along the last axis: x f32 [..., n] -> [..., n // 2 + 1, 2]."""
        op = "rfft"
        self._fft_args(op, x, norm)
        if len(x.shape) < 1 or x.shape[-1] < 1:
            raise ValueError(f"{op}: x must be [..., n] with n >= 1, got {_desc(x)}")
        n = x.shape[-1]
        y = _rdft(self, x)
        scale = _scale(norm, n, False)
        return y if scale == 1.0 else self.mul(y, scale)

    def irfft(self, x, n: int | None = None, norm: str = "backward"):
        """torch.fft.irfft: x f32 [..., m, 2] (a one-sided spectrum) -> [..., n] real, n
        default 2 (m - 1); x is cut or zero-padded to n // 2 + 1 bins, the imaginary parts of
        bin 0 (and n / 2) do not count. A c64 x [..., m] is taken as its pairs."""
        op = "irfft"
        if getattr(x, "dtype", None) == dt.C64:
            self.check(op, "x", x)
            if len(x.shape) < 1:
                raise ValueError(f"{op}: a c64 x must be [..., m] with m >= 1, got {_desc(x)}")
            x = self.view_as_real(x)
        self._fft_args(op, x, norm)
        if len(x.shape) < 2 or x.shape[-1] != 2 or x.shape[-2] < 1:
            raise ValueError(f"{op}: x must be complex as [..., m, 2] (re, im) with m >= 1, got "
                             f"{_desc(x)}")
        m = x.shape[-2]
        n = 2 * (m - 1) if n is None else n
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"{op}: n must be a positive int, got {n!r} (x {_desc(x)})")
        h = n // 2 + 1
        xh = self.narrow(x, -2, 0, h) if m >= h else self.pad(x, (0, 0, 0, h - m))
        # the imaginary parts of bins 0 and n / 2 do not count (numpy.fft.irfft's meaning),
        # and the norm's scale goes on the half-size input; the product is also the fresh
        # buffer cuFFT's C2R may overwrite
        keep = np.full((h, 2), _scale(norm, n, True), np.float32)
        keep[0, 1] = 0.0
        if n % 2 == 0:
            keep[-1, 1] = 0.0
        xh = self.mul(xh, self.constant(keep))
        return self.bind("irdft", [xh], n=int(n))

    def welch(self, x, nperseg: int = 256, noverlap: int | None = None, window="hann",
              fs: float = 1.0):
        """scipy.signal.welch(x, fs, window, nperseg, noverlap) along the last axis with its
        defaults (detrend "constant", return_onesided, scaling "density", average "mean"):
        the PSD [..., nperseg // 2 + 1]. nperseg longer than x is cut to x's length, as SciPy
        does. ``window``: "hann" / "hamming" (periodic, SciPy's get_window), "boxcar", or an
        array of nperseg. Frequencies: welch_frequencies(nperseg, fs)."""
        op = "welch"
        self.check(op, "x", x)
        if x.dtype != dt.F32 or len(x.shape) < 1 or x.shape[-1] < 1:
            raise ValueError(f"{op}: x must be f32 [..., n] with n >= 1, got {_desc(x)}")
        t = x.shape[-1]
        if not isinstance(nperseg, (int, np.integer)) or isinstance(nperseg, bool) or nperseg < 1:
            raise ValueError(f"{op}: nperseg must be a positive int, got {nperseg!r}")
        nperseg = min(int(nperseg), t)
        noverlap = nperseg // 2 if noverlap is None else noverlap
        if not isinstance(noverlap, (int, np.integer)) or not 0 <= noverlap < nperseg:
            raise ValueError(f"{op}: noverlap must be an int in [0, nperseg={nperseg}), got "
                             f"{noverlap!r}")
        if not fs > 0:
            raise ValueError(f"{op}: fs must be > 0, got {fs!r}")
        win = welch_window(window, nperseg)
        step = nperseg - noverlap
        nseg = (t - noverlap) // step
        idx = np.arange(nseg)[:, None] * step + np.arange(nperseg)[None, :]
        frames = self.gather(x, self.constant(idx.astype(np.int64)), axis=len(x.shape) - 1)
        frames = self.sub(frames, self.reduce_mean(frames, -1, keep_dim=True))
        spec = self.rfft(self.mul(frames, self.constant(win.astype(np.float32))))
        power = self.reduce_sum(self.mul(spec, spec), -1)             # |X|^2
        bins = nperseg // 2 + 1
        scale = np.full(bins, 2.0 / (fs * float((win * win).sum())))
        scale[0] /= 2
        if nperseg % 2 == 0:
            scale[-1] /= 2
        power = self.mul(power, self.constant(scale.astype(np.float32)))
        return self.reduce_mean(power, -2)

    def welch_peaks(self, psd, k: int, nperseg: int, fs: float = 1.0):
        """The ``k`` largest bins of a welch PSD [..., bins]: (powers, frequencies), both
        [..., k], largest first (frequencies f32: bin * fs / nperseg)."""
        self.check("welch_peaks", "psd", psd)
        if psd.shape[-1] != nperseg // 2 + 1:
            raise ValueError(f"welch_peaks: psd {_desc(psd)} does not have the {nperseg // 2 + 1}"
                             f" bins of nperseg={nperseg}")
        vals, idx = self.topk(psd, k)
        return vals, self.mul(self.cast(idx, dt.F32), float(fs) / nperseg)


def welch_window(window, nperseg: int) -> np.ndarray:
    """SciPy's get_window(window, nperseg) (periodic) for "hann", "hamming", "boxcar"; an
    array of nperseg as is."""
    if isinstance(window, str):
        j = np.arange(nperseg)
        w = {"hann": lambda: 0.5 - 0.5 * np.cos(2 * np.pi * j / nperseg),
             "hamming": lambda: 0.54 - 0.46 * np.cos(2 * np.pi * j / nperseg),
             "boxcar": lambda: np.ones(nperseg)}.get(window)
        if w is None:
            raise ValueError(f"welch: window must be 'hann', 'hamming', 'boxcar' or an array of "
                             f"{nperseg}, got {window!r}")
        return w()
    arr = np.asarray(window, np.float64)
    if arr.shape != (nperseg,):
        raise ValueError(f"welch: a window array must have nperseg={nperseg} values, got shape "
                         f"{list(arr.shape)}")
    return arr


def welch_frequencies(nperseg: int, fs: float = 1.0) -> np.ndarray:
    """The frequencies of welch's bins: np.fft.rfftfreq(nperseg, 1 / fs)."""
    return np.fft.rfftfreq(nperseg, 1.0 / fs)
