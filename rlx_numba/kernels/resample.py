"""resample (ir/ops_vision.py): x viewed as [A, I, B] (the axis between), out [A, O, B],
out[a, o, b] = const[o] + sum_t w[o, t] * x[a, idx[o, t], b] with tables made on the host (pad,
resize, adaptive_avg_pool and their adjoints). Taps of weight 0 are skipped, so a padded or
clamped position never multiplies an inf or NaN by zero."""
from numba import cuda, float32, uint64

from .launch import jit


@jit
def resample_kernel(out, x, idx, w, const, total, olen, ilen, inner, taps):
    i = uint64(cuda.grid(1))
    while i < total:
        b, t = i % inner, i // inner
        o, a = t % olen, t // olen
        acc = const[o]
        base = a * ilen * inner + b
        for j in range(taps):
            wt = w[o * taps + j]
            if wt != 0:
                acc += wt * x[base + uint64(idx[o * taps + j]) * inner]
        out[i] = acc
        i += uint64(cuda.gridsize(1))
