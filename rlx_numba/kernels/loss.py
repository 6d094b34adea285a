"""Cross-entropy row kernels (logits [rows, C] f32, f16 or bf16, integer labels [rows]).

Forward: one block per row (grid-stride over rows) reads the row ONCE: each thread keeps an
online (max, sum of exp) over its strided columns, the sum of the logits and the picked
logit; four group reductions give the row's log-sum-exp L, the sum S and the picked x[y]:

    loss = (1 - eps) (L - x[y]) + eps / C * sum_c (L - x_c) = L - (1 - eps) x[y] - eps / C * S

(torch's label smoothing), 0 for a row whose label is ``ignore``, NaN for a label outside
[0, C) (torch raises there; a NaN shows the bad row instead of reading out of bounds).

Backward: the same pass for (max, sum of exp), then each element is written once:

    dx_c = dy[row] * (softmax(x)_c - eps / C - (1 - eps) [c == y])

so nothing of size [rows, C] is stored between the passes beyond the logits themselves (the
softmax is recomputed; the forward's reduction scale, 1/count for "mean", arrives in dy). An
ignored row gets 0, or NaN where softmax(x)_c is NaN (a NaN, a +inf or only -inf in the row),
as torch's log_softmax backward makes it from a zero dy (0 - exp(log p) * 0).

Half logits (``xk``, kernels/halfio.py) are widened as they are read; the log-sum-exp, the
sums and the row loss are f32 (the loss is stored f32), and dx is rounded once to the logits'
kind. The kind is a factory argument, so the f32 kernels compile as they always did.
"""
import functools
import math

from numba import cuda, float32, int64

from ..device import SIMULATOR
from . import halfio
from . import mathfn as m
from .warp import MAX, SLOTS, SUM, group_reduce
from .launch import jit

NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)
NAN = float32(math.nan)


def block_for(c: int) -> int:
    """Threads of a row's block: ~8 columns a thread, 32..1024 (16 in the simulator)."""
    if SIMULATOR:
        return 16
    b = 32
    while b < 1024 and b * 8 < c:
        b *= 2
    return b


@functools.lru_cache(maxsize=None)
def _row_stats(xk):
    """row_stats(x, base, c, tid, block, smem, lab): (max, sum exp(x - max), sum x, x[lab]) of
    the row at x[base:base + c] (an ``xk`` array), in f32, to every thread."""
    ld = halfio.load(xk)

    @cuda.jit(device=True)
    def row_stats(x, base, c, tid, block, smem, lab):
        mx = NEG_INF
        s = ZERO
        sx = ZERO
        picked = ZERO
        i = tid
        while i < c:
            v = ld(x, base + i)
            if v > mx:
                s = s * m.exp(mx - v) + ONE
                mx = v
            elif v != NEG_INF:         # (-inf - -inf would be NaN)
                s += m.exp(v - mx)
            sx += v
            if i == lab:
                picked = v
            i += block
        top = group_reduce(mx, smem, block, MAX)
        if mx != NEG_INF:              # a thread with no columns (or only -inf) adds nothing
            s = s * m.exp(mx - top)
        return top, group_reduce(s, smem, block, SUM), group_reduce(sx, smem, block, SUM), \
            group_reduce(picked, smem, block, SUM)
    return row_stats


@functools.lru_cache(maxsize=None)
def ce_forward(block: int, xk: str = "f32"):
    """loss[r] (f32) of logits x (``xk``)."""
    row_stats = _row_stats(xk)

    @jit(launch_bounds=block)
    def kernel(loss, x, labels, rows, c, ignore, eps):
        smem = cuda.shared.array(SLOTS, float32)
        tid = cuda.threadIdx.x
        r = cuda.blockIdx.x
        keep = ONE - eps
        per_class = eps / float32(c)
        while r < rows:
            lab = int64(labels[r])
            top, s, sx, picked = row_stats(x, int64(r) * int64(c), int64(c), tid, block, smem, lab)
            if tid == 0:
                if lab == ignore:
                    loss[r] = ZERO
                elif lab < 0 or lab >= c:
                    loss[r] = NAN
                else:
                    v = top + m.log(s) - keep * picked
                    if eps != ZERO:        # (0 * the -inf sum of masked logits is NaN)
                        v -= per_class * sx
                    loss[r] = v
            r += cuda.gridDim.x
    return kernel


@functools.lru_cache(maxsize=None)
def ce_backward(block: int, xk: str = "f32"):
    """dx (``xk``) from logits x (``xk``) and the f32 row gradients dy."""
    row_stats = _row_stats(xk)
    ld = halfio.load(xk)
    st = halfio.store(xk)

    @jit(launch_bounds=block)
    def kernel(dx, x, labels, dy, rows, c, ignore, eps):
        smem = cuda.shared.array(SLOTS, float32)
        tid = cuda.threadIdx.x
        r = cuda.blockIdx.x
        keep = ONE - eps
        per_class = eps / float32(c)
        while r < rows:
            lab = int64(labels[r])
            base = int64(r) * int64(c)
            top, s, _, _ = row_stats(x, base, int64(c), tid, block, smem, lab)
            g = dy[r]
            inv = ONE / s
            bad = lab != ignore and (lab < 0 or lab >= c)
            i = tid
            while i < c:
                if bad:
                    st(dx, base + i, NAN)
                else:
                    p = m.exp(ld(x, base + i) - top) * inv - per_class
                    if lab == ignore:   # torch's 0 - exp(log p) * 0: NaN where log p is NaN
                        p = ZERO if p == p else p
                    else:
                        if i == lab:
                            p -= keep
                        p = g * p
                    st(dx, base + i, p)
                i += block
            r += cuda.gridDim.x
    return kernel
