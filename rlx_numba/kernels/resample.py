"""resample (ir/ops_vision.py): x viewed as [A, I, B] (the axis between), out [A, O, B],
out[a, o, b] = const[o] + sum_t w[o, t] * x[a, idx[o, t], b] with tables made on the host (pad,
resize, adaptive_avg_pool and their adjoints). Taps of weight 0 are skipped, so a padded or
clamped position never multiplies an inf or NaN by zero. Launched as kernels/conv.py's lines
(threadIdx.y a line, the x threads along it, no division an element): for the last axis
(B = 1) a line is one row a, along o; otherwise a line is one (a, o), along b."""
from numba import cuda, uint64

from .launch import inline, jit


@inline
def _tap_sum(x, base, stride, idx, w, const, o, taps):
    acc = const[o]
    for j in range(taps):
        wt = w[o * taps + j]
        if wt != 0:
            acc += wt * x[base + uint64(idx[o * taps + j]) * stride]
    return acc


@jit
def resample_last_kernel(out, x, idx, w, const, rows, olen, ilen, taps):
    """B = 1: line a, threads along o."""
    a = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
    while a < rows:
        o = uint64(cuda.threadIdx.x)
        while o < olen:
            out[a * olen + o] = _tap_sum(x, a * ilen, uint64(1), idx, w, const, o, taps)
            o += uint64(cuda.blockDim.x)
        a += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)


@jit
def resample_kernel(out, x, idx, w, const, rows, olen, ilen, inner, taps):
    """B > 1: line (a, o), threads along b."""
    line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
    while line < rows * olen:
        o, a = line % olen, line // olen
        b = uint64(cuda.threadIdx.x)
        while b < inner:
            out[line * inner + b] = _tap_sum(x, a * ilen * inner + b, inner, idx, w, const, o,
                                             taps)
            b += uint64(cuda.blockDim.x)
        line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
