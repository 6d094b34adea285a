"""Optimizer updates (rlx_numba/optim.py, train.py): one launch updates every trained param.

The trainer packs the params it trains into one flat f32 device buffer (each at a 256-byte
aligned offset) and each optimizer state (momentum_buffer, exp_avg, exp_avg_sq,
max_exp_avg_sq) into a buffer of the same layout; the grads stay where the memory plan put
them in the arena. A table of chunks, rows ``(param offset, grad offset, length)`` in f32
elements with at most CHUNK elements each, covers every param: a block takes a chunk at a
time (torch's multi_tensor_apply), so one launch updates all params, however many and however
unequal in size.

Global-norm clipping (torch.nn.utils.clip_grad_norm_): ``grad_sumsq`` writes each chunk's sum
of squares; every block of the update then sums those partials in the same order (so every
block gets the same total, no grid-wide sync needed) and scales the grads it reads by
``min(max_norm / (norm + 1e-6), 1)``.

Per-step values (lr, Adam's bias corrections, SGD's first step) come from ``hyper`` on the
device, which the host writes before each step: a CUDA graph replays the same launch with new
values, and a new lr needs no recompile.

    sgd:  hyper = [lr, first step (1 or 0)]
    adam: hyper = [lr, -lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * weight_decay]
"""
import math

from numba import cuda, float32

from ..device import SIMULATOR
from .warp import SLOTS, SUM, group_reduce
from .launch import jit

BLOCK = 16 if SIMULATOR else 512          # threads a block (group_reduce over the whole block)
CHUNK = 32 if SIMULATOR else 65536        # elements a chunk at most (torch's chunk size)
ONE = float32(1.0)
HALF = float32(0.5)
CLIP_EPS = float32(1e-6)                  # clip_grad_norm_'s 1e-6


def grid(nchunks: int) -> tuple:
    """(blocks, threads) of the update and sum-of-squares launches: a block a chunk."""
    return (max(1, min(nchunks, 2 if SIMULATOR else 2**31 - 1)), BLOCK)


@cuda.jit(device=True)
def _clip_coef(partials, npart, max_norm, smem):
    """min(max_norm / (||g|| + 1e-6), 1) from the chunks' sums of squares (NaN stays NaN, as
    torch.clamp). Every thread of the block must call it."""
    acc = float32(0.0)
    i = cuda.threadIdx.x
    while i < npart:
        acc += partials[i]
        i += BLOCK
    total = group_reduce(acc, smem, BLOCK, SUM)
    c = max_norm / (float32(math.sqrt(total)) + CLIP_EPS)
    return ONE if c >= ONE else c


@jit
def grad_sumsq(partials, grads, table, nchunks):
    """partials[c] = sum of squares of chunk c's grads."""
    smem = cuda.shared.array(SLOTS, float32)
    c = cuda.blockIdx.x
    while c < nchunks:
        go = table[c, 1]
        n = table[c, 2]
        acc = float32(0.0)
        i = cuda.threadIdx.x
        while i < n:
            v = grads[go + i]
            acc += v * v
            i += BLOCK
        total = group_reduce(acc, smem, BLOCK, SUM)
        if cuda.threadIdx.x == 0:
            partials[c] = total
        c += cuda.gridDim.x


@jit
def sgd_update(params, grads, buf, table, nchunks, hyper, momentum, dampening, weight_decay,
               nesterov, partials, npart, max_norm):
    """torch.optim.SGD: g += wd * p; buf = g on the first step, else momentum * buf +
    (1 - dampening) * g; g = g + momentum * buf (nesterov) or buf; p -= lr * g. ``buf`` is
    unused when momentum is 0; ``npart`` > 0: clip first (see the module docstring)."""
    smem = cuda.shared.array(SLOTS, float32)
    coef = ONE
    if npart > 0:
        coef = _clip_coef(partials, npart, max_norm, smem)
    lr = hyper[0]
    first = hyper[1] != float32(0.0)
    keep = ONE - dampening
    c = cuda.blockIdx.x
    while c < nchunks:
        po = table[c, 0]
        go = table[c, 1]
        n = table[c, 2]
        i = cuda.threadIdx.x
        while i < n:
            k = po + i
            g = grads[go + i]
            if npart > 0:
                g = g * coef
            p = params[k]
            if weight_decay != float32(0.0):
                g = g + weight_decay * p
            if momentum != float32(0.0):
                b = g if first else buf[k] * momentum + keep * g
                buf[k] = b
                g = g + momentum * b if nesterov else b
            params[k] = p - lr * g
            i += BLOCK
        c += cuda.gridDim.x


@jit
def adam_update(params, grads, exp_avg, exp_avg_sq, max_sq, table, nchunks, hyper, w1, beta2,
                w2, eps, weight_decay, decoupled, amsgrad, partials, npart, max_norm):
    """torch.optim.Adam / AdamW (``decoupled``): p *= 1 - lr * wd (AdamW) or g += wd * p
    (Adam); m = lerp(m, g, 1 - beta1) (``w1``); v = beta2 * v + (1 - beta2) (``w2``) * g * g;
    with amsgrad v = max(max_sq, v) kept in max_sq; p += -lr / (1 - beta1^t) * m /
    (sqrt(v) / sqrt(1 - beta2^t) + eps). ``max_sq`` is unused without amsgrad."""
    smem = cuda.shared.array(SLOTS, float32)
    coef = ONE
    if npart > 0:
        coef = _clip_coef(partials, npart, max_norm, smem)
    step = hyper[1]
    bc2_sqrt = hyper[2]
    decay = hyper[3]
    w1_rest = ONE - w1
    c = cuda.blockIdx.x
    while c < nchunks:
        po = table[c, 0]
        go = table[c, 1]
        n = table[c, 2]
        i = cuda.threadIdx.x
        while i < n:
            k = po + i
            g = grads[go + i]
            if npart > 0:
                g = g * coef
            p = params[k]
            if weight_decay != float32(0.0):
                if decoupled:
                    p = p * decay
                else:
                    g = g + weight_decay * p
            m = exp_avg[k]
            # torch's lerp: the form that is exact at its end nearer the weight
            m = m + w1 * (g - m) if w1 < HALF else g - (g - m) * w1_rest
            v = exp_avg_sq[k] * beta2 + w2 * g * g
            exp_avg[k] = m
            exp_avg_sq[k] = v
            if amsgrad:
                mv = max_sq[k]
                if not mv >= v:      # torch.maximum: a NaN wins
                    mv = v
                max_sq[k] = mv
                v = mv
            denom = float32(math.sqrt(v)) / bc2_sqrt + eps
            params[k] = p + step * (m / denom)
            i += BLOCK
        c += cuda.gridDim.x
