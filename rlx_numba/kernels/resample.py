"""resample (ir/ops_vision.py): x viewed as [A, I, B] (the axis between), out [A, O, B],
out[a, o, b] = const[o] + sum_t w[o, t] * x[a, idx[o, t], b] with tables made on the host (pad,
resize, adaptive_avg_pool and their adjoints). Taps of weight 0 add nothing, so a padded or
clamped position never multiplies an inf or NaN by zero. Launched as kernels/conv.py's lines
(threadIdx.y a line, the x threads along it, no division an element): for the last axis
(B = 1) a line is one row a, along o; otherwise a line is one (a, o), along b. A node over the
last two axes (tables idx2 / w2 / const2 for the last one, applied first) is one kernel:
resample2_kernel, a line one (a, o) along the last axis' outputs. The kernels are made per
tap count (1 for nearest and pad, 2 for linear): the tap loops unroll, so a thread's table
loads are in flight together rather than one loop trip after another (nearest 2x of
8x64x56x56 took 69 us with runtime counts on an H200). They take x's storage kind too
(kernels/halfio.py): loads widen to f32, the taps sum in f32 (the tables are f32), the store
rounds once, to ``okind`` where it differs (a half tensor resampled along several axes keeps
its intermediates in f32, so the result is rounded once, as torch's kernels do)."""
import functools

from numba import cuda, float32, uint64

from . import halfio
from .launch import inline, jit


@functools.lru_cache(maxsize=None)
def _tap_sum_fn(taps, kind):
    ld = halfio.load(kind)

    @inline
    def tap_sum(x, base, stride, idx, w, const, o, live):
        """const[o] + sum_t w[o, t] x[base + idx[o, t] stride]; ``live``: x is not empty
        (every index is in bounds, so x's load is not behind the weight's test)."""
        acc = const[o]
        for j in range(taps):
            wt = w[o * uint64(taps) + uint64(j)]
            v = ld(x, base + uint64(idx[o * uint64(taps) + uint64(j)]) * stride) if live \
                else float32(0.0)
            if wt != 0:
                acc += wt * v
        return acc

    return tap_sum


@functools.lru_cache(maxsize=None)
def resample_last_kernel(taps, kind="f32", okind=None):
    """B = 1: line a, threads along o. (out, x, idx, w, const, rows, olen, ilen)"""
    tap_sum = _tap_sum_fn(taps, kind)
    st = halfio.store(okind or kind)

    @jit
    def kernel(out, x, idx, w, const, rows, olen, ilen):
        a = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while a < rows:
            o = uint64(cuda.threadIdx.x)
            while o < olen:
                st(out, a * olen + o, tap_sum(x, a * ilen, uint64(1), idx, w, const, o,
                                              ilen != 0))
                o += uint64(cuda.blockDim.x)
            a += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel


@functools.lru_cache(maxsize=None)
def resample_kernel(taps, kind="f32", okind=None):
    """B > 1: line (a, o), threads (and blocks on x: conv.lines_launch's ``split``) along b.
    (out, x, idx, w, const, rows, olen, ilen, inner)"""
    tap_sum = _tap_sum_fn(taps, kind)
    st = halfio.store(okind or kind)

    @jit
    def kernel(out, x, idx, w, const, rows, olen, ilen, inner):
        line = uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)
        while line < rows * olen:
            o, a = line % olen, line // olen
            b = uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x) + uint64(cuda.threadIdx.x)
            while b < inner:
                st(out, line * inner + b, tap_sum(x, a * ilen * inner + b, inner, idx, w, const,
                                                  o, ilen != 0))
                b += uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
            line += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)

    return kernel


# lines a thread of resample2_kernel, their loads all issued before any store (numba's arrays
# may alias, so a store would hold back the next line's loads): a short kernel's time is a
# few load latencies a wave. On an H200, 8x64x56x56 2x: bilinear 53 -> 43 us, nearest 44 ->
# 33 us, pad reflect 1: 14.9 -> 12.4 us with 4 lines (2: 47, 36, 13.0; 8: no better)
GROUP = 4


@functools.lru_cache(maxsize=None)
def resample2_kernel(taps, taps2, kind="f32", okind=None):
    """The last two axes: x [A, I, I2] -> out [A, O, O2]; a line is (a, o), threads along o2,
    GROUP consecutive lines a thread. Launch over ceil(lines / GROUP) lines.
    (out, x, idx, w, const, idx2, w2, const2, rows, olen, ilen, olen2, ilen2)"""
    tap_sum = _tap_sum_fn(taps2, kind)
    st = halfio.store(okind or kind)
    t = uint64(taps)
    group, ug = GROUP, uint64(GROUP)

    @jit
    def kernel(out, x, idx, w, const, idx2, w2, const2, rows, olen, ilen, olen2, ilen2):
        live = ilen != 0 and ilen2 != 0
        vals = cuda.local.array(group, float32)
        lines = rows * olen
        first = (uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y) + uint64(cuda.threadIdx.y)) * ug
        while first < lines:
            o2 = uint64(cuda.threadIdx.x)
            while o2 < olen2:
                for r in range(group):
                    line = min(first + uint64(r), lines - uint64(1))
                    o, a = line % olen, line // olen
                    acc = const[o]
                    for j in range(taps):
                        wt = w[o * t + uint64(j)]
                        base = (a * ilen + uint64(idx[o * t + uint64(j)])) * ilen2
                        v = tap_sum(x, base, uint64(1), idx2, w2, const2, o2, live)
                        if wt != 0:
                            acc += wt * v
                    vals[r] = acc
                for r in range(group):
                    if first + uint64(r) < lines:
                        st(out, (first + uint64(r)) * olen2 + o2, vals[r])
                o2 += uint64(cuda.blockDim.x)
            first += uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y) * ug

    return kernel
