"""The numba FFT tier (ir/ops_fft.py): radix-2 Stockham over rows of n = 2^p complex values
(interleaved re, im), unnormalised, sign -1 forward (numpy's convention) or +1 inverse.

Stockham autosort (Govindaraju et al., SC'08): stage s (span Ns = 2^s) reads butterfly j's
two inputs at j and j + n/2, turns the second by the twiddle w^(k n / (2 Ns)) with k = j % Ns,
and writes a + b and a - b at (j / Ns) 2 Ns + k and that + Ns; after p stages the row is in
natural order, with no bit reversal. Twiddles w^t = exp(-2 pi i t / n), t < n/2, come from
a table made on the host in float64 (conjugated for the inverse: the kernels themselves do
not know the direction).

  fft_row_kernel(n): a block a row, the two ping-pong buffers in shared memory (n <= SHARED_N);
  fft_stage_kernel: one stage over every row in global memory, a launch a stage (larger n).
"""
import functools

from numba import cuda, float32, uint64

from ..device import SIMULATOR
from .launch import jit

# complex values a row the shared-memory kernel takes (2 x 16 KiB); the simulator sends
# longer rows through the stage kernel, so tests of small sizes run both
SHARED_N = 16 if SIMULATOR else 2048
THREADS = 16 if SIMULATOR else 256
U1, U2 = uint64(1), uint64(2)


@functools.lru_cache(maxsize=None)
def fft_row_kernel(n: int):
    """kernel(out, x, tw, rows): out[r] = DFT(x[r]) for rows of n complex values."""
    half = n // 2
    un, uhalf, u2n = uint64(n), uint64(half), uint64(2 * n)
    shape = (2, 2 * n)                       # a compile-time constant for the shared array

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
            src = 0
            ns = uint64(1)
            while ns < un:
                j = tid
                while j < uhalf:
                    k = j % ns
                    t = k * (un // (ns * U2))          # twiddle w^t
                    wr, wi = tw[U2 * t], tw[U2 * t + U1]
                    ar, ai = buf[src, U2 * j], buf[src, U2 * j + U1]
                    br0, bi0 = buf[src, U2 * (j + uhalf)], buf[src, U2 * (j + uhalf) + U1]
                    br = br0 * wr - bi0 * wi
                    bi = br0 * wi + bi0 * wr
                    d = (j // ns) * ns * U2 + k
                    buf[1 - src, U2 * d] = ar + br
                    buf[1 - src, U2 * d + U1] = ai + bi
                    buf[1 - src, U2 * (d + ns)] = ar - br
                    buf[1 - src, U2 * (d + ns) + U1] = ai - bi
                    j += uint64(cuda.blockDim.x)
                cuda.syncthreads()
                src = 1 - src
                ns *= uint64(2)
            i = tid
            while i < u2n:
                out[base + i] = buf[src, i]
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
