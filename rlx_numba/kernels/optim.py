"""Optimizer updates (rlx_numba/optim.py, train.py): one launch updates every trained param.

The trainer packs the params it trains into one flat f32 device buffer (each at a 256-byte
aligned offset) and each optimizer state (momentum_buffer, exp_avg, exp_avg_sq,
max_exp_avg_sq) into a buffer of the same layout; the grads stay where the memory plan put
them in the arena. A table of chunks, rows ``(param offset, grad offset, length, half
offset)`` in elements with at most CHUNK elements each, covers every param: a block takes a
chunk at a time (torch's multi_tensor_apply), so one launch updates all params, however many
and however unequal in size.

Global-norm clipping (torch.nn.utils.clip_grad_norm_): ``grad_sumsq`` writes each chunk's sum
of squares; every block of the update then sums those partials in the same order (so every
block gets the same total, no grid-wide sync needed) and scales the grads it reads by
``min(max_norm / (norm + 1e-6), 1)``.

Per-step values (lr, Adam's bias corrections, SGD's first step) come from ``hyper`` on the
device, which the host writes before each step: a CUDA graph replays the same launch with new
values, and a new lr needs no recompile.

Mixed precision (compile_train's ``precision=``): a table row's 4th column is the offset of
the param's half copy in ``halves`` (-1: none); the update writes the new f32 master
value and its rounding to the half dtype in the same pass, so the forward's casts of the
weights become leaves refreshed here. Loss scaling (f16, torch.amp.GradScaler's rules):
``scaler`` = [scale, growth tracker, found inf of the last step]; ``grad_nonfinite`` flags the
chunks holding an inf / NaN gradient, every block of the update sums the flags (as it sums the
clipping partials) and, on any, leaves params and state untouched; otherwise it multiplies the
grads by 1 / scale. ``amp_update_scale`` (one block, after the update) then halves the scale,
or doubles it after ``growth_interval`` clean steps in a row (torch's _amp_update_scale_).

    sgd:  hyper = [lr, first step (1 or 0)]
    adam: hyper = [lr, -lr / (1 - beta1^t), sqrt(1 - beta2^t), 1 - lr * weight_decay]
"""
import math

from numba import cuda, float32

from ..device import SIMULATOR
from . import halfio
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
def _block_sum(partials, npart, smem):
    """The sum of partials[0:npart], the same in every block (same order). Every thread of
    the block must call it."""
    acc = float32(0.0)
    i = cuda.threadIdx.x
    while i < npart:
        acc += partials[i]
        i += BLOCK
    return group_reduce(acc, smem, BLOCK, SUM)


@cuda.jit(device=True)
def _clip_coef(partials, npart, max_norm, smem, inv_scale):
    """min(max_norm / (||g|| + 1e-6), 1) from the chunks' sums of squares of the grads scaled
    by 1 / inv_scale (NaN stays NaN, as torch.clamp). Every thread of the block must call it."""
    total = _block_sum(partials, npart, smem) * inv_scale * inv_scale
    c = max_norm / (float32(math.sqrt(total)) + CLIP_EPS)
    return ONE if c >= ONE else c


@cuda.jit(device=True)
def _grad_coef(partials, npart, max_norm, scaler, flags, nflags, smem):
    """What the update multiplies the grads by: 1 / the loss scale (``nflags`` > 0), times
    the clip coefficient (``npart`` > 0); -1 when a chunk flagged an inf / NaN gradient (the
    step is skipped). Every thread of the block must call it."""
    inv = ONE
    if nflags > 0:
        if _block_sum(flags, nflags, smem) > float32(0.0):
            return float32(-1.0)
        inv = ONE / scaler[0]
    if npart > 0:
        return _clip_coef(partials, npart, max_norm, smem, inv) * inv
    return inv


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
def grad_nonfinite(flags, grads, table, nchunks):
    """flags[c] = 1 when chunk c's grads hold an inf or a NaN, else 0."""
    smem = cuda.shared.array(SLOTS, float32)
    c = cuda.blockIdx.x
    while c < nchunks:
        go = table[c, 1]
        n = table[c, 2]
        bad = float32(0.0)
        i = cuda.threadIdx.x
        while i < n:
            v = grads[go + i]
            if math.isinf(v) or math.isnan(v):
                bad = ONE
            i += BLOCK
        total = group_reduce(bad, smem, BLOCK, SUM)
        if cuda.threadIdx.x == 0:
            flags[c] = ONE if total > float32(0.0) else float32(0.0)
        c += cuda.gridDim.x


@jit
def amp_update_scale(scaler, flags, nflags, growth, backoff, interval):
    """GradScaler.update: scaler = [scale, clean steps in a row, found inf]; one block."""
    smem = cuda.shared.array(SLOTS, float32)
    found = _block_sum(flags, nflags, smem)
    if cuda.threadIdx.x == 0:
        if found > float32(0.0):
            scaler[0] = scaler[0] * backoff
            scaler[1] = float32(0.0)
            scaler[2] = ONE
        else:
            clean = scaler[1] + ONE
            if clean >= interval:
                grown = scaler[0] * growth
                if not math.isinf(grown):       # torch keeps the old scale else
                    scaler[0] = grown
                clean = float32(0.0)
            scaler[1] = clean
            scaler[2] = float32(0.0)


def _make_sgd(half):
    """torch.optim.SGD's update (see ``sgd_update``) writing half copies of kind ``half``
    ("f32": none)."""
    st = halfio.store(half)
    with_half = half != "f32"

    def sgd_update(params, grads, buf, table, nchunks, hyper, momentum, dampening,
                   weight_decay, nesterov, partials, npart, max_norm, halves, scaler, flags,
                   nflags):
        """torch.optim.SGD: g += wd * p; buf = g on the first step, else momentum * buf +
        (1 - dampening) * g; g = g + momentum * buf (nesterov) or buf; p -= lr * g. ``buf``
        is unused when momentum is 0; ``npart`` > 0: clip first; ``nflags`` > 0: loss scaling
        (see the module docstring)."""
        smem = cuda.shared.array(SLOTS, float32)
        coef = _grad_coef(partials, npart, max_norm, scaler, flags, nflags, smem)
        if coef < float32(0.0):
            return                # an inf / NaN gradient: the step is skipped
        lr = hyper[0]
        first = hyper[1] != float32(0.0)
        keep = ONE - dampening
        c = cuda.blockIdx.x
        while c < nchunks:
            po = table[c, 0]
            go = table[c, 1]
            n = table[c, 2]
            ho = table[c, 3]
            i = cuda.threadIdx.x
            while i < n:
                k = po + i
                g = grads[go + i]
                if npart > 0 or nflags > 0:
                    g = g * coef
                p = params[k]
                if weight_decay != float32(0.0):
                    g = g + weight_decay * p
                if momentum != float32(0.0):
                    b = g if first else buf[k] * momentum + keep * g
                    buf[k] = b
                    g = g + momentum * b if nesterov else b
                p = p - lr * g
                params[k] = p
                if with_half:
                    if ho >= 0:
                        st(halves, ho + i, p)
                i += BLOCK
            c += cuda.gridDim.x
    return jit(sgd_update)


def _make_adam(half):
    """torch.optim.Adam / AdamW's update (see ``adam_update``) writing half copies of kind
    ``half`` ("f32": none)."""
    st = halfio.store(half)
    with_half = half != "f32"

    def adam_update(params, grads, exp_avg, exp_avg_sq, max_sq, table, nchunks, hyper, w1,
                    beta2, w2, eps, weight_decay, decoupled, amsgrad, partials, npart, max_norm,
                    halves, scaler, flags, nflags):
        """torch.optim.Adam / AdamW (``decoupled``): p *= 1 - lr * wd (AdamW) or g += wd * p
        (Adam); m = lerp(m, g, 1 - beta1) (``w1``); v = beta2 * v + (1 - beta2) (``w2``) * g
        * g; with amsgrad v = max(max_sq, v) kept in max_sq; p += -lr / (1 - beta1^t) * m /
        (sqrt(v) / sqrt(1 - beta2^t) + eps). ``max_sq`` is unused without amsgrad."""
        smem = cuda.shared.array(SLOTS, float32)
        coef = _grad_coef(partials, npart, max_norm, scaler, flags, nflags, smem)
        if coef < float32(0.0):
            return                # an inf / NaN gradient: the step is skipped
        step = hyper[1]
        bc2_sqrt = hyper[2]
        decay = hyper[3]
        w1_rest = ONE - w1
        c = cuda.blockIdx.x
        while c < nchunks:
            po = table[c, 0]
            go = table[c, 1]
            n = table[c, 2]
            ho = table[c, 3]
            i = cuda.threadIdx.x
            while i < n:
                k = po + i
                g = grads[go + i]
                if npart > 0 or nflags > 0:
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
                p = p + step * (m / denom)
                params[k] = p
                if with_half:
                    if ho >= 0:
                        st(halves, ho + i, p)
                i += BLOCK
            c += cuda.gridDim.x
    return jit(adam_update)


_KERNELS = {}


def update_kernel(rule: str, half: str = "f32"):
    """The multi-tensor update kernel of ``rule`` ("sgd" or "adam") that writes half copies
    of kind ``half`` ("f32": none): compiled once per pair."""
    key = (rule, halfio.io_kind(half))
    k = _KERNELS.get(key)
    if k is None:
        k = _KERNELS[key] = {"sgd": _make_sgd, "adam": _make_adam}[rule](key[1])
    return k
