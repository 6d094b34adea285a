"""Row kernels: softmax, log_softmax, layer_norm and rms_norm (with the fused residual).

Three shapes of the same math, all f32:

* ``rows_reg``: the reduced axis is the last one and a row fits on chip. A group of G threads
  owns a row (several rows per block when rows are short); the row is read once into
  registers (VPT values a thread), reduced with ``group_reduce``, and written once.
* ``rows_loop``: the last axis is too long for registers. One block per row streams it twice
  (an online max/sum or shifted sums first, then the write), four loads in flight per thread.
* ``cols``: the reduced axis is not the last. The tensor is seen as [outer, n, inner]; each
  thread owns one (outer, inner) column, so consecutive threads read consecutive addresses,
  and walks the n elements twice. No transpose.

KIND is SOFTMAX, LOG_SOFTMAX, LAYER_NORM or RMS_NORM. For the norms, ``gamma`` (and ``beta``
when HAS_BETA) are indexed by the position along the axis; with HAS_RES the input is
``x + res``, and with WRITE_SUM that sum is also stored to ``sum_out``. The flags are
compile-time constants of each factory, so unused branches cost nothing.
"""
import functools
import math

import numpy as np
from numba import cuda, float32, uint64

from ..runtime.device import SIMULATOR
from . import mathfn as m
from .blockreduce import MAX, SLOTS, SUM, group_reduce

SOFTMAX, LOG_SOFTMAX, LAYER_NORM, RMS_NORM = 0, 1, 2, 3
KINDS = {"softmax": SOFTMAX, "log_softmax": LOG_SOFTMAX, "layer_norm": LAYER_NORM,
         "rms_norm": RMS_NORM}
def _jit(block):
    """cuda.jit with launch bounds on a GPU: ptxas keeps a thread within 64 registers, so a
    1024-thread block can launch at all and smaller blocks keep 1024 threads an SM resident
    (without bounds layer_norm took 92 registers: one 512-thread block an SM). The simulator
    takes no bounds."""
    return cuda.jit if SIMULATOR else cuda.jit(launch_bounds=(block, max(1, 1024 // block)))


NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)
U2, U3, U4 = np.uint64(2), np.uint64(3), np.uint64(4)


@cuda.jit(device=True)
def _finish(kind, v, c, a, b, gamma, beta, has_beta):
    """The output value of element v at axis position c, given the row statistics:
    softmax: a = max, b = 1/sum;  log_softmax: a = max + log(sum);
    layer_norm: a = mean, b = rstd;  rms_norm: b = rstd."""
    if kind == SOFTMAX:
        return m.exp(v - a) * b
    if kind == LOG_SOFTMAX:
        return v - a
    y = ((v - a) if kind == LAYER_NORM else v) * b * gamma[c]
    if has_beta:
        y += beta[c]
    return y


@functools.lru_cache(maxsize=None)
def rows_reg(kind, g, vpt, block, has_beta, has_res, write_sum):
    """Rows of <= g*vpt elements held in registers; g threads a row, blocks of ``block``."""
    softmaxish = kind == SOFTMAX or kind == LOG_SOFTMAX
    gu = np.uint64(g)   # index math is uint64 throughout: signed subscripts cost a wraparound
                        # check each, and a signed operand would make the result signed again

    @_jit(block)
    def kernel(out, x, gamma, beta, res, sum_out, rows, cols, eps):
        smem = cuda.shared.array(SLOTS, float32)
        vals = cuda.local.array(vpt, float32)
        tid = uint64(cuda.threadIdx.x)
        lane = tid % gu
        rpb = uint64(cuda.blockDim.x) // gu
        r0 = uint64(cuda.blockIdx.x) * rpb
        while r0 < rows:                     # uniform across the block: everyone reduces
            row = r0 + tid // gu
            ok = row < rows
            base = row * cols
            acc = NEG_INF if softmaxish else ZERO
            for j in range(vpt):
                c = lane + uint64(j) * gu
                v = NEG_INF if softmaxish else ZERO
                if ok and c < cols:
                    v = x[base + c]
                    if has_res:
                        v += res[base + c]
                        if write_sum:
                            sum_out[base + c] = v
                vals[j] = v
                if softmaxish:
                    acc = v if (v > acc or v != v) else acc   # NaN sticks, like torch
                elif kind == LAYER_NORM:
                    acc += v
                else:
                    acc += v * v
            n = float32(cols)
            if softmaxish:
                a = group_reduce(acc, smem, g, MAX)
                s = ZERO
                for j in range(vpt):
                    if ok and lane + uint64(j) * gu < cols:
                        e = m.exp(vals[j] - a)
                        s += e
                        if kind == SOFTMAX:
                            vals[j] = e      # one exp an element: the write scales it
                s = group_reduce(s, smem, g, SUM)
                b = ONE / s
                if kind == LOG_SOFTMAX:
                    a = a + m.log(s)
            elif kind == LAYER_NORM:
                a = group_reduce(acc, smem, g, SUM) / n
                d2 = ZERO
                for j in range(vpt):
                    if lane + uint64(j) * gu < cols:
                        d = vals[j] - a
                        d2 += d * d
                b = ONE / m.sqrt(group_reduce(d2, smem, g, SUM) / n + eps)
            else:
                a = ZERO
                b = ONE / m.sqrt(group_reduce(acc, smem, g, SUM) / n + eps)
            if ok:
                for j in range(vpt):
                    c = lane + uint64(j) * gu
                    if c < cols:
                        if kind == SOFTMAX:
                            out[base + c] = vals[j] * b
                        else:
                            out[base + c] = _finish(kind, vals[j], c, a, b, gamma, beta, has_beta)
            r0 += uint64(cuda.gridDim.x) * rpb

    return kernel


@cuda.jit(device=True)
def _online(mx, s, v):
    """Fold v into a running (max, sum of exp(x - max))."""
    if v > mx:
        return v, s * m.exp(mx - v) + ONE
    if v == NEG_INF:
        return mx, s
    return mx, s + m.exp(v - mx)


@cuda.jit(device=True)
def _fold(kind, p, q, v, shift):
    """Fold v into a streamed kernel's running statistics (p, q): softmax (max, sum of exp),
    layer_norm shifted (sum, sum of squares), rms_norm (-, sum of squares)."""
    if kind == SOFTMAX or kind == LOG_SOFTMAX:
        return _online(p, q, v)
    if kind == LAYER_NORM:
        return p + (v - shift), q + (v - shift) * (v - shift)
    return p, q + v * v


@functools.lru_cache(maxsize=None)
def rows_loop(kind, has_beta, has_res, write_sum):
    """One block per row, the row streamed twice from memory (rows too long for registers)."""
    softmaxish = kind == SOFTMAX or kind == LOG_SOFTMAX

    @_jit(1024)
    def kernel(out, x, gamma, beta, res, sum_out, rows, cols, eps):
        smem = cuda.shared.array(SLOTS, float32)
        tid = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)       # uint64 index math, as in rows_reg
        g = cuda.blockDim.x                # the block is the group
        row = uint64(cuda.blockIdx.x)
        while row < rows:
            base = row * cols
            shift = ZERO
            if kind == LAYER_NORM:   # shifted sums: var = E[(x-k)^2] - E[x-k]^2 stays accurate
                shift = x[base] + (res[base] if has_res else ZERO)
            p = NEG_INF if softmaxish else ZERO
            q = ZERO
            c = tid
            while c < cols:          # four loads in flight per thread
                v0 = x[base + c]
                v1 = x[base + c + nt] if c + nt < cols else ZERO
                v2 = x[base + c + U2 * nt] if c + U2 * nt < cols else ZERO
                v3 = x[base + c + U3 * nt] if c + U3 * nt < cols else ZERO
                for u in range(4):
                    cu = c + uint64(u) * nt
                    if cu < cols:
                        v = v0 if u == 0 else (v1 if u == 1 else (v2 if u == 2 else v3))
                        if has_res:
                            v += res[base + cu]
                            if write_sum:
                                sum_out[base + cu] = v
                        p, q = _fold(kind, p, q, v, shift)
                c += U4 * nt
            n = float32(cols)
            a = ZERO
            if softmaxish:
                a = group_reduce(p, smem, g, MAX)
                q = q * m.exp(p - a) if p != NEG_INF else ZERO
                s = group_reduce(q, smem, g, SUM)
                b = ONE / s
                if kind == LOG_SOFTMAX:
                    a = a + m.log(s)
            elif kind == LAYER_NORM:
                mean = group_reduce(p, smem, g, SUM) / n
                var = max(group_reduce(q, smem, g, SUM) / n - mean * mean, ZERO)
                a = shift + mean
                b = ONE / m.sqrt(var + eps)
            else:
                b = ONE / m.sqrt(group_reduce(q, smem, g, SUM) / n + eps)
            src = sum_out if write_sum else x
            c = tid
            while c < cols:
                for u in range(4):
                    cu = c + uint64(u) * nt
                    if cu < cols:
                        v = src[base + cu]
                        if has_res and not write_sum:
                            v += res[base + cu]
                        out[base + cu] = _finish(kind, v, cu, a, b, gamma, beta, has_beta)
                c += U4 * nt
            row += uint64(cuda.gridDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def cols(kind, has_beta, has_res, write_sum):
    """The reduced axis in the middle: [outer, n, inner], one thread per (outer, inner)."""
    softmaxish = kind == SOFTMAX or kind == LOG_SOFTMAX

    @cuda.jit
    def kernel(out, x, gamma, beta, res, sum_out, outer, n, inner, eps):
        t = cuda.grid(1)
        while t < outer * inner:
            o = t // inner
            base = o * n * inner + (t - o * inner)
            shift = ZERO
            if kind == LAYER_NORM:
                shift = x[base] + (res[base] if has_res else ZERO)
            p = NEG_INF if softmaxish else ZERO
            q = ZERO
            for c in range(n):
                i = base + c * inner
                v = x[i]
                if has_res:
                    v += res[i]
                    if write_sum:
                        sum_out[i] = v
                p, q = _fold(kind, p, q, v, shift)
            fn = float32(n)
            a = ZERO
            if softmaxish:
                a = p
                b = ONE / q
                if kind == LOG_SOFTMAX:
                    a = p + m.log(q)
            elif kind == LAYER_NORM:
                mean = p / fn
                a = shift + mean
                b = ONE / m.sqrt(max(q / fn - mean * mean, ZERO) + eps)
            else:
                b = ONE / m.sqrt(q / fn + eps)
            src = sum_out if write_sum else x
            for c in range(n):
                i = base + c * inner
                v = src[i]
                if has_res and not write_sum:
                    v += res[i]
                out[i] = _finish(kind, v, c, a, b, gamma, beta, has_beta)
            t += cuda.gridsize(1)

    return kernel


# values a thread holds in registers (a 1024-thread block allows 64 registers a thread; with 16
# values ptxas wanted 110 on an H200)
VPT_MAX = 8


def row_plan(cols_: int):
    """(g, vpt) for the register kernel, or None when the row must be streamed."""
    max_g = 32 if SIMULATOR else 1024
    if cols_ > max_g * VPT_MAX:
        return None
    target = 4 if SIMULATOR else 8          # values a thread, when the row allows it
    g = 1
    while g < max_g and g * target < cols_:
        g *= 2
    g = max(g, 1 if SIMULATOR else 32)
    vpt = 1
    while g * vpt < cols_:
        vpt *= 2
    return g, vpt
