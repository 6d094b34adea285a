"""The numba FFT tier (ir/ops_fft.py): radix-2 Stockham over rows of n = 2^p complex values
(interleaved re, im), unnormalised, sign -1 forward (numpy's convention) or +1 inverse.

Stockham autosort (Govindaraju et al., SC'08): stage s (span Ns = 2^s) reads butterfly j's
two inputs at j and j + n/2, turns the second by the twiddle w^(k n / (2 Ns)) with k = j % Ns,
and writes a + b and a - b at (j / Ns) 2 Ns + k and that + Ns; after p stages the row is in
natural order, with no bit reversal. Twiddles w^t = exp(-2 pi i t / n), t < n/2, come from
a table made on the host in float64 (conjugated for the inverse: the kernels themselves do
not know the direction).

  fft_row_kernel(n): a block a row, the two ping-pong buffers in shared memory (n <= SHARED_N);
  fft_cols_kernel / fft_rows_kernel: the four-step FFT of n = n1 n2 <= SHARED_N^2 (Bailey):
    element j1 n2 + j2 of a row; pass A transforms the n2 columns (length n1) and turns entry
    (k1, j2) by w^(j2 k1); pass B transforms the n1 rows (length n2) and writes bin k1 + n1 k2.
    A block takes 2 adjacent columns (rows) where they fit in SHARED_N, so its strided loads
    (stores) are 16 bytes long. Two passes over memory instead of log2 n;
  fft_stage_kernel: one stage over every row in global memory, a launch a stage (larger n);
  bluestein_row_kernel(n, m): a block a row of any length n with m = 2^p >= 2n - 1 <=
    ir/ops_fft.py's BLUESTEIN_M: the chirp, m-point transform, the product with the chirp filter's transform,
    the inverse (as conj(FFT(conj))) and the chirp again, all in shared memory.
"""
import functools

from numba import cuda, float32, uint64

from ..device import SIMULATOR
from .launch import inline, jit

# complex values a row the shared-memory kernels take (2 x 16 KiB); the simulator sends
# longer rows through the four-step and stage kernels, so tests of small sizes run them all
SHARED_N = 16 if SIMULATOR else 2048
THREADS = 16 if SIMULATOR else 256
U1, U2 = uint64(1), uint64(2)


@functools.lru_cache(maxsize=None)
def _lines_fft(n: int, lines: int):
    """device fn(buf, tw, stride) -> the buffer (0 or 1) holding the result: ``lines``
    transforms of n points in place in buf [2, lines * 2n] (line l at l * 2n), twiddle
    w_n^t = tw[t * stride] (a table of a longer transform, stride = its length / n)."""
    half = n // 2
    un, uhalf, total = uint64(n), uint64(half), uint64(lines * half)

    @inline
    def run(buf, tw, stride):
        tid = uint64(cuda.threadIdx.x)
        src = 0
        ns = uint64(1)
        while ns < un:
            j = tid
            while j < total:
                line = j // uhalf               # (divisions by constants)
                jj = j - line * uhalf
                base = line * un * U2
                k = jj % ns
                t = k * (un // (ns * U2)) * stride
                wr, wi = tw[U2 * t], tw[U2 * t + U1]
                a0, a1 = base + U2 * jj, base + U2 * (jj + uhalf)
                ar, ai = buf[src, a0], buf[src, a0 + U1]
                br0, bi0 = buf[src, a1], buf[src, a1 + U1]
                br = br0 * wr - bi0 * wi
                bi = br0 * wi + bi0 * wr
                d = base + U2 * ((jj // ns) * ns * U2 + k)
                buf[1 - src, d] = ar + br
                buf[1 - src, d + U1] = ai + bi
                buf[1 - src, d + U2 * ns] = ar - br
                buf[1 - src, d + U2 * ns + U1] = ai - bi
                j += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            src = 1 - src
            ns *= uint64(2)
        return src

    return run


@functools.lru_cache(maxsize=None)
def fft_row_kernel(n: int):
    """kernel(out, x, tw, rows): out[r] = DFT(x[r]) for rows of n complex values."""
    u2n = uint64(2 * n)
    shape = (2, 2 * n)                       # a compile-time constant for the shared array
    fft = _lines_fft(n, 1)

    @jit
    def kernel(out, x, tw, rows):
        buf = cuda.shared.array(shape, float32)
        tid = uint64(cuda.threadIdx.x)
        r = uint64(cuda.blockIdx.x)
        while r < rows:
            base = r * u2n
            i = tid
            while i < u2n:
                buf[0, i] = x[base + i]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            src = fft(buf, tw, U1)
            i = tid
            while i < u2n:
                out[base + i] = buf[src, i]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            r += uint64(cuda.gridDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def fft_cols_kernel(n1: int, n2: int, lines: int):
    """Four-step pass A. kernel(out, x, tw, rows): for rows of n = n1 n2 complex values (tw:
    the n-point table), out[r, k1 n2 + j2] = w_n^(j2 k1) sum_j1 x[r, j1 n2 + j2] w_n1^(j1 k1).
    A block takes ``lines`` adjacent columns j2 (its loads and stores: that many values in a
    row)."""
    n = n1 * n2
    shape = (2, lines * 2 * n1)
    un2, u2n, un, uh = uint64(n2), uint64(2 * n), uint64(n), uint64(n // 2)
    ulines, items = uint64(lines), uint64(lines * n1)
    groups = uint64(n2 // lines)
    fft = _lines_fft(n1, lines)

    @jit
    def kernel(out, x, tw, rows):
        buf = cuda.shared.array(shape, float32)
        tid = uint64(cuda.threadIdx.x)
        task = uint64(cuda.blockIdx.x)
        while task < rows * groups:
            r = task // groups
            j20 = (task - r * groups) * ulines
            base = r * u2n
            i = tid
            while i < items:                 # the column index fastest: adjacent addresses
                c = i % ulines
                j1 = i // ulines
                src_at = base + U2 * (j1 * un2 + j20 + c)
                dst = c * uint64(2 * n1) + U2 * j1
                buf[0, dst] = x[src_at]
                buf[0, dst + U1] = x[src_at + U1]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            s = fft(buf, tw, un2)
            i = tid
            while i < items:
                c = i % ulines
                k1 = i // ulines
                at = c * uint64(2 * n1) + U2 * k1
                vr, vi = buf[s, at], buf[s, at + U1]
                t = ((j20 + c) * k1) % un        # w_n^t, w^(t + n/2) = -w^t
                sign = float32(1.0)
                if t >= uh:
                    t -= uh
                    sign = float32(-1.0)
                wr, wi = tw[U2 * t] * sign, tw[U2 * t + U1] * sign
                o = base + U2 * (k1 * un2 + j20 + c)
                out[o] = vr * wr - vi * wi
                out[o + U1] = vr * wi + vi * wr
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            task += uint64(cuda.gridDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def fft_rows_kernel(n1: int, n2: int, lines: int):
    """Four-step pass B. kernel(out, x, tw, rows): out[r, k1 + n1 k2] = sum_j2 x[r, k1 n2 +
    j2] w_n2^(j2 k2); a block takes ``lines`` adjacent k1 (its stores: that many values in a
    row)."""
    n = n1 * n2
    shape = (2, lines * 2 * n2)
    un1, un2, u2n = uint64(n1), uint64(n2), uint64(2 * n)
    ulines, items = uint64(lines), uint64(lines * n2)
    groups = uint64(n1 // lines)
    fft = _lines_fft(n2, lines)

    @jit
    def kernel(out, x, tw, rows):
        buf = cuda.shared.array(shape, float32)
        tid = uint64(cuda.threadIdx.x)
        task = uint64(cuda.blockIdx.x)
        while task < rows * groups:
            r = task // groups
            k10 = (task - r * groups) * ulines
            base = r * u2n + U2 * k10 * un2      # ``lines`` contiguous rows
            i = tid
            while i < U2 * items:
                buf[0, i] = x[base + i]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            s = fft(buf, tw, un1)
            i = tid
            while i < items:                 # the row index fastest: adjacent addresses
                c = i % ulines
                k2 = i // ulines
                at = c * uint64(2 * n2) + U2 * k2
                o = r * u2n + U2 * (k10 + c + un1 * k2)
                out[o] = buf[s, at]
                out[o + U1] = buf[s, at + U1]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            task += uint64(cuda.gridDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def bluestein_row_kernel(n: int, m: int):
    """kernel(out, x, chirp, filt, tw, rows): for rows of n complex values, out_k = c_k sum_j
    (x_j c_j) conj(c)_(k - j) (the DFT by Bluestein's identity): chirp c [n], filt the m-point
    transform of the wrapped conj(c) with the inverse's 1 / m [m], tw the m-point table."""
    un, um, u2n = uint64(n), uint64(m), uint64(2 * n)
    shape = (2, 2 * m)
    fft = _lines_fft(m, 1)

    @jit
    def kernel(out, x, chirp, filt, tw, rows):
        buf = cuda.shared.array(shape, float32)
        tid = uint64(cuda.threadIdx.x)
        r = uint64(cuda.blockIdx.x)
        while r < rows:
            base = r * u2n
            i = tid
            while i < um:                    # x c, zero-padded to m
                vr = float32(0.0)
                vi = float32(0.0)
                if i < un:
                    xr, xi = x[base + U2 * i], x[base + U2 * i + U1]
                    cr, ci = chirp[U2 * i], chirp[U2 * i + U1]
                    vr = xr * cr - xi * ci
                    vi = xr * ci + xi * cr
                buf[0, U2 * i] = vr
                buf[0, U2 * i + U1] = vi
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            s = fft(buf, tw, U1)
            i = tid
            while i < um:                    # times the filter, conjugated for the inverse
                ar, ai = buf[s, U2 * i], buf[s, U2 * i + U1]
                fr, fi = filt[U2 * i], filt[U2 * i + U1]
                buf[0, U2 * i] = ar * fr - ai * fi
                buf[0, U2 * i + U1] = -(ar * fi + ai * fr)
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            s = fft(buf, tw, U1)
            i = tid
            while i < un:                    # conj again, times the chirp
                ar, ai = buf[s, U2 * i], -buf[s, U2 * i + U1]
                cr, ci = chirp[U2 * i], chirp[U2 * i + U1]
                out[base + U2 * i] = ar * cr - ai * ci
                out[base + U2 * i + U1] = ar * ci + ai * cr
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            r += uint64(cuda.gridDim.x)

    return kernel


@jit
def fft_stage_kernel(out, x, tw, rows, n, ns):
    """One Stockham stage of span ``ns`` over every row (n complex values each), x -> out."""
    half = n // U2
    i = uint64(cuda.grid(1))
    while i < rows * half:
        j, r = i % half, i // half
        base = r * n * U2
        k = j % ns
        t = k * (n // (ns * U2))
        wr, wi = tw[U2 * t], tw[U2 * t + U1]
        ar, ai = x[base + U2 * j], x[base + U2 * j + U1]
        br0, bi0 = x[base + U2 * (j + half)], x[base + U2 * (j + half) + U1]
        br = br0 * wr - bi0 * wi
        bi = br0 * wi + bi0 * wr
        d = (j // ns) * ns * U2 + k
        out[base + U2 * d] = ar + br
        out[base + U2 * d + U1] = ai + bi
        out[base + U2 * (d + ns)] = ar - br
        out[base + U2 * (d + ns) + U1] = ai - bi
        i += uint64(cuda.gridsize(1))
