"""The numba FFT tier (ir/ops_fft.py): Stockham FFTs of rows of n = 2^p complex values
(interleaved re, im), unnormalised, sign -1 forward (numpy's convention) or +1 inverse.

Stockham autosort (Govindaraju et al., SC'08): a radix-r stage of span Ns reads butterfly j's
r inputs at j + q n / r, turns input q by w_(r Ns)^(q k) with k = j % Ns, and writes its
r-point DFT at (j / Ns) r Ns + k + s Ns; after the stages the row is in natural order, with
no bit reversal. In shared memory the stages are radix 4 (one radix 2 first for odd p).

  fft_pass_kernel(radix, lines, first): one pass over memory of radix-``radix`` butterflies,
    each a shared-memory DFT, ``lines`` of them a block. A row of n <= shared_n is one pass
    of radix n (a block a row); longer rows take passes of radix up to max_radix, 3 for 2^20
    points, each reading and writing runs of ``lines`` values;
  bluestein_row_kernel(n, m): a block a row of any length n with m = 2^p >= 2n - 1 <=
    ir/ops_fft.py's BLUESTEIN_M: the chirp, m-point transform, the product with the chirp
    filter's transform, the inverse (as conj(FFT(conj))) and the chirp again, in shared memory.
Twiddles are computed (precise sinf / cosf of angles in [-2 pi, 2 pi]: libdevice's slow path
for huge arguments, the PTX's only float64, never runs).
"""
import functools
import math
from dataclasses import dataclass

from numba import cuda, float32, uint32, uint64

from .launch import inline, jit, register_geometry



@dataclass(frozen=True)
class Geometry:
    """runtime/lower_fft.py's plan: shared_n complex values a row one pass takes; longer rows
    take passes of DFTs of up to max_radix points, pass_lines of them a block; threads a
    block."""
    shared_n: int
    max_radix: int
    pass_lines: int
    threads: int


GPU = Geometry(shared_n=2048, max_radix=128, pass_lines=16, threads=256)   # 2 x 16 KiB
# (the simulator's small sizes send short rows through every kernel)
SIM = Geometry(shared_n=16, max_radix=4, pass_lines=2, threads=16)
register_geometry("fft", gpu=GPU, sim=SIM)
U1, U2 = uint64(1), uint64(2)


@functools.lru_cache(maxsize=None)
def line_floats(n: int, lines: int) -> int:
    """Floats from one line to the next in shared memory: 2n, plus one complex value when a
    block holds several lines (the loads and stores that walk across lines, at a stride of
    a multiple of 32 floats, would all hit one bank)."""
    return 2 * n + (2 if lines > 1 else 0)


@functools.lru_cache(maxsize=None)
def _lines_fft(n: int, lines: int):
    """device fn(buf, sign) -> the offset (0 or lines * line_floats) of the half of buf
    holding the result: ``lines`` transforms of n points in place in the 1-D shared buf [2
    lines line_floats] (line l at l * line_floats), of sign ``sign`` (-1 forward, +1
    inverse). Radix-4 Stockham stages (a radix-2 one first when log2 n is odd): half the
    stages, and half the trips through shared memory, of radix 2. A butterfly computes its
    twiddle w = exp(sign 2 pi i k / 4 ns) (sinf / cosf) and squares it for w^2, w^3: a
    table in memory is gathered at strides that conflict on every bank, and the kernels
    were bound by those loads. Index math is 32-bit shifts and masks."""
    p = n.bit_length() - 1
    odd = p % 2 == 1
    up = uint32(p)
    ls = uint32(line_floats(n, lines))
    span = uint32(lines * line_floats(n, lines))
    total2 = uint32(lines * (n // 2))
    total4 = uint32(lines * (n // 4))
    q4 = uint32(max(p - 2, 0))                 # log2(n / 4)
    m2, m4 = uint32(max(n // 2 - 1, 0)), uint32(max(n // 4 - 1, 0))
    quarter = uint32(n // 4)
    one, two = uint32(1), uint32(2)
    pi2 = float32(2.0 * math.pi)

    @inline
    def run(buf, sign):
        tid = uint32(cuda.threadIdx.x)
        step = uint32(cuda.blockDim.x)
        so = uint32(0)                         # the half being read
        lg = uint32(0)                         # span ns = 2^lg
        if odd:                                # radix 2, span 1: no twiddles
            j = tid
            while j < total2:
                base = (j >> (up - one)) * ls
                jj = j & m2
                a0 = so + base + two * jj
                a1 = a0 + (one << up)
                ar, ai = buf[a0], buf[a0 + one]
                br, bi = buf[a1], buf[a1 + one]
                d = span - so + base + two * two * jj
                buf[d] = ar + br
                buf[d + one] = ai + bi
                buf[d + two] = ar - br
                buf[d + two + one] = ai - bi
                j += step
            cuda.syncthreads()
            so = span - so
            lg = one
        while lg < up:
            ns = one << lg
            c = sign * pi2 / float32(ns << two)       # the angle of w_(4 ns)
            j = tid
            while j < total4:
                base = (j >> q4) * ls
                jj = j & m4
                k = jj & (ns - one)
                ang = c * float32(k)
                w1r, w1i = math.cos(ang), math.sin(ang)
                w2r, w2i = w1r * w1r - w1i * w1i, float32(2.0) * w1r * w1i
                w3r, w3i = w2r * w1r - w2i * w1i, w2r * w1i + w2i * w1r
                a = so + base + two * jj
                b = a + two * quarter
                x0r, x0i = buf[a], buf[a + one]
                yr, yi = buf[b], buf[b + one]
                v0r, v0i = yr * w1r - yi * w1i, yr * w1i + yi * w1r
                yr, yi = buf[b + two * quarter], buf[b + two * quarter + one]
                v1r, v1i = yr * w2r - yi * w2i, yr * w2i + yi * w2r
                yr, yi = buf[b + uint32(4) * quarter], buf[b + uint32(4) * quarter + one]
                v2r, v2i = yr * w3r - yi * w3i, yr * w3i + yi * w3r
                # the 4-point DFT: y1 = d0 + sign i d1, y3 = d0 - sign i d1 (i a = (-ai, ar))
                s0r, s0i = x0r + v1r, x0i + v1i
                d0r, d0i = x0r - v1r, x0i - v1i
                s1r, s1i = v0r + v2r, v0i + v2i
                d1r, d1i = v0r - v2r, v0i - v2i
                d = span - so + base + two * (((jj >> lg) << (lg + two)) + k)
                e = two * ns
                buf[d] = s0r + s1r
                buf[d + one] = s0i + s1i
                buf[d + e] = d0r - sign * d1i
                buf[d + e + one] = d0i + sign * d1r
                buf[d + two * e] = s0r - s1r
                buf[d + two * e + one] = s0i - s1i
                buf[d + uint32(3) * e] = d0r + sign * d1i
                buf[d + uint32(3) * e + one] = d0i - sign * d1r
                j += step
            cuda.syncthreads()
            so = span - so
            lg += two
        return so

    return run


@functools.lru_cache(maxsize=None)
def fft_pass_kernel(radix: int, lines: int, first: bool):
    """One radix-``radix`` Stockham pass of span ns over rows of n complex values (n / radix
    a multiple of ``lines``; ``first``: ns == 1). kernel(out, x, rows, n, nr, ns, lg_ns,
    sign) with nr = n / radix, lg_ns = log2 ns, sign -1 (forward) or +1: for j < nr,
    k = j % ns,
      v_r = x[j + r nr] w_(ns radix)^(r k),  V = DFT_radix(v),
      out[(j / ns) ns radix + k + s ns] = V_s.
    A block takes ``lines`` consecutive j: its loads are runs of ``lines`` values, its
    stores runs of ``lines`` (ns >= lines) or of the block's whole output (the first pass);
    the radix-point DFTs run in shared memory (_lines_fft)."""
    size = 2 * lines * line_floats(radix, lines)
    ul, ur, uls = uint64(lines), uint64(radix), uint64(line_floats(radix, lines))
    items = uint64(lines * radix)
    lr = uint64(radix.bit_length() - 1)
    fft = _lines_fft(radix, lines)

    @jit
    def kernel(out, x, rows, n, nr, ns, lg_ns, sign):
        buf = cuda.shared.array(size, float32)
        tid = uint64(cuda.threadIdx.x)
        groups = nr // ul
        span = float32(2.0 * math.pi) * sign / float32(ns * ur)
        task = uint64(cuda.blockIdx.x)
        while task < rows * groups:
            r = task // groups
            j0 = (task - r * groups) * ul
            base = r * n * U2
            i = tid
            while i < items:                 # consecutive j fastest: runs of ``lines``
                c = i % ul
                q = i // ul                  # the input r of the radix
                j = j0 + c
                at = base + U2 * (j + q * nr)
                vr, vi = x[at], x[at + U1]
                if not first:                # the twiddle w_(ns radix)^(q k), computed: a
                    # table of n would be gathered at strides of nr / ns
                    ang = span * float32(q * (j & (ns - U1)))
                    wr, wi = math.cos(ang), math.sin(ang)
                    vr, vi = vr * wr - vi * wi, vr * wi + vi * wr
                d = c * uls + U2 * q
                buf[d] = vr
                buf[d + U1] = vi
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            so = uint64(fft(buf, sign))
            i = tid
            while i < items:
                if first:                    # out[j radix + s]: the block's run
                    c = i // ur
                    q = i % ur
                    at = base + U2 * ((j0 + c) * ur + q)
                else:                        # runs of ``lines`` (ns >= lines)
                    c = i % ul
                    q = i // ul
                    j = j0 + c
                    at = base + U2 * (((j >> lg_ns) << (lg_ns + lr)) + (j & (ns - U1))
                                      + q * ns)
                d = so + c * uls + U2 * q
                out[at] = buf[d]
                out[at + U1] = buf[d + U1]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            task += uint64(cuda.gridDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def bluestein_row_kernel(n: int, m: int):
    """kernel(out, x, chirp, filt, rows): for rows of n complex values, out_k = c_k sum_j
    (x_j c_j) conj(c)_(k - j) (the DFT by Bluestein's identity): chirp c [n], filt the m-point
    transform of the wrapped conj(c) with the inverse's 1 / m [m]."""
    un, um, u2n = uint64(n), uint64(m), uint64(2 * n)
    size = 4 * m
    fft = _lines_fft(m, 1)

    @jit
    def kernel(out, x, chirp, filt, rows):
        buf = cuda.shared.array(size, float32)
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
                buf[U2 * i] = vr
                buf[U2 * i + U1] = vi
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            s = uint64(fft(buf, float32(-1.0)))
            i = tid
            while i < um:                    # times the filter, conjugated for the inverse
                ar, ai = buf[s + U2 * i], buf[s + U2 * i + U1]
                fr, fi = filt[U2 * i], filt[U2 * i + U1]
                buf[U2 * i] = ar * fr - ai * fi
                buf[U2 * i + U1] = -(ar * fi + ai * fr)
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            s = uint64(fft(buf, float32(-1.0)))
            i = tid
            while i < un:                    # conj again, times the chirp
                ar, ai = buf[s + U2 * i], -buf[s + U2 * i + U1]
                cr, ci = chirp[U2 * i], chirp[U2 * i + U1]
                out[base + U2 * i] = ar * cr - ai * ci
                out[base + U2 * i + U1] = ar * ci + ai * cr
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            r += uint64(cuda.gridDim.x)

    return kernel
