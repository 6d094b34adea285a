"""Row kernels: softmax, log_softmax, layer_norm and rms_norm (with the fused residual), and
their backward kernels (softmax_bwd, norm_bwd, norm_param_bwd: at the end of the file).

Three shapes of the same math, all f32:

* ``rows_reg``: the reduced axis is the last one and a row fits on chip. A group of G threads
  owns a row (several rows per block when rows are short); the row is read once into
  registers (VPT values a thread), reduced with ``group_reduce``, and written once. Optionally
  the next rows' loads are issued before the current rows' reductions (prefetch).
* ``rows_loop``: the last axis is too long for registers. One block per row streams it twice
  in chunks (an online max/sum or shifted sums first, then the write), ``unroll`` loads in
  flight per thread.
* ``cols``: the reduced axis is not the last. The tensor is seen as [outer, n, inner]; each
  thread owns one (outer, inner) column, so consecutive threads read consecutive addresses,
  and walks the n elements twice. No transpose.

KIND is SOFTMAX, LOG_SOFTMAX, LAYER_NORM or RMS_NORM. For the norms, ``gamma`` (and ``beta``
when HAS_BETA) are indexed by the position along the axis; with HAS_RES the input is
``x + res``, and with WRITE_SUM that sum is also stored to ``sum_out``. The flags are
compile-time constants of each factory, so unused branches cost nothing.

Storage kinds (kernels/halfio.py): ``xk`` is the kind of x, res, sum_out, out (and of dy / dx
in the backward kernels), ``gk`` the kind of gamma and beta (f32, or x's kind: a bf16 model
keeps bf16 norm weights, torch's autocast keeps them f32). Loads widen to f32, all math and
every accumulation is f32, stores round once. With a half ``xk`` and HAS_RES, h = x + res is
rounded to ``xk`` before it is used: the fused norm then equals the norm of the stored sum
(the unfused graph; passes/fusion.py folds half adds on that ground) and sum_out holds h
exactly. Row statistics (norm_bwd's stats, the param kernels' partial sums) stay f32. The
kinds are factory arguments, so the f32 kernels compile to the code they always did.
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint64

from ..device import SIMULATOR
from . import mathfn as m
from . import halfio
from .warp import MAX, SLOTS, SUM, group_reduce
from .launch import default_geometry, inline as _inline, jit, register_geometry

SOFTMAX, LOG_SOFTMAX, LAYER_NORM, RMS_NORM = 0, 1, 2, 3
KINDS = {"softmax": SOFTMAX, "log_softmax": LOG_SOFTMAX, "layer_norm": LAYER_NORM,
         "rms_norm": RMS_NORM}


def _jit(block):
    """cuda.jit with launch bounds on a GPU: ptxas keeps a thread within 64 registers, so a
    1024-thread block can launch at all and smaller blocks keep 1024 threads an SM resident
    (without bounds layer_norm took 92 registers: one 512-thread block an SM). The simulator
    takes no bounds."""
    return jit(launch_bounds=(block, max(1, 1024 // block)))


NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)


@cuda.jit(device=True)
def nonneg(v):
    """max(v, 0) keeping a NaN: the shifted-sums variance E[d^2] - E[d]^2 can round below 0,
    and is NaN when the row holds an infinity (inf - inf) or a NaN, which must reach every
    output as torch's does. The builtin max is fmaxf on a GPU, which drops the NaN (the
    simulator's Python max kept it, so only the GPU gave inf or a plain normalised value)."""
    return ZERO if v < ZERO else v


@functools.lru_cache(maxsize=None)
def _finisher(kind, has_beta, gk):
    """finish(v, c, a, b, gamma, beta): the output value of element v at axis position c, given
    the row statistics: softmax: a = max, b = 1/sum;  log_softmax: a = max + log(sum);
    layer_norm: a = mean, b = rstd;  rms_norm: b = rstd. gamma / beta are ``gk`` arrays."""
    ldg = halfio.load(gk)

    @_inline
    def finish(v, c, a, b, gamma, beta):
        if kind == SOFTMAX:
            return m.exp(v - a) * b
        if kind == LOG_SOFTMAX:
            return v - a
        y = ((v - a) if kind == LAYER_NORM else v) * b * ldg(gamma, c)
        if has_beta:
            y += ldg(beta, c)
        return y
    return finish


@functools.lru_cache(maxsize=None)
def _reader(has_res, xk):
    """get(x, res, i): h = x[i] (+ res[i], rounded to ``xk``: see the module docstring) as
    float32."""
    ld = halfio.load(xk)
    rd = halfio.round_to(xk)
    half = xk != "f32"

    @_inline
    def get(x, res, i):
        v = ld(x, i)
        if has_res:
            v += ld(res, i)
            if half:
                v = rd(v)
        return v
    return get


@functools.lru_cache(maxsize=None)
def _loader(n, has_res, write_sum, exact=False, xk="f32"):
    """load(vals, x, res, sum_out, base, c0, stride, limit, ok, fill): vals[u] = x[base + c]
    (+ res, stored to sum_out when asked) for c = c0 + u*stride, u < n, where ok and c < limit,
    else ``fill`` (``exact``: every c is < limit, no test); x, res and sum_out are ``xk``
    arrays. Every load of the chunk is issued before the first store: a store may alias
    a later load (numba arrays are not restrict), so interleaving them would serialise the
    loads one memory latency each."""
    ld = halfio.load(xk)
    st = halfio.store(xk)
    rd = halfio.round_to(xk)
    half = xk != "f32"

    @_inline
    def load(vals, x, res, sum_out, base, c0, stride, limit, ok, fill):
        for u in range(n):
            c = c0 + uint64(u) * stride
            vals[u] = ld(x, base + c) if ok and (exact or c < limit) else fill
        if has_res:
            for u in range(n):
                c = c0 + uint64(u) * stride
                if ok and (exact or c < limit):
                    vals[u] += ld(res, base + c)
                    if half:      # h as stored in x's dtype (module docstring)
                        vals[u] = rd(vals[u])
            if write_sum:
                for u in range(n):
                    c = c0 + uint64(u) * stride
                    if ok and (exact or c < limit):
                        st(sum_out, base + c, vals[u])
    return load


@functools.lru_cache(maxsize=None)
def _storer(n, kind, has_beta, exact=False, xk="f32", gk="f32"):
    """store(vals, out, gamma, beta, base, c0, stride, limit, ok, a, b): the outputs of a chunk,
    all computed (gamma/beta loads together) before the first store, for the reason above;
    out is an ``xk`` array, gamma / beta ``gk`` arrays."""
    finish = _finisher(kind, has_beta, gk)
    st = halfio.store(xk)

    @_inline
    def store(vals, out, gamma, beta, base, c0, stride, limit, ok, a, b):
        for u in range(n):
            c = c0 + uint64(u) * stride
            if ok and (exact or c < limit):       # (a row past the last holds no values)
                if kind == SOFTMAX:
                    vals[u] *= b
                else:
                    vals[u] = finish(vals[u], c, a, b, gamma, beta)
        if ok:
            for u in range(n):
                c = c0 + uint64(u) * stride
                if exact or c < limit:
                    st(out, base + c, vals[u])
    return store


@functools.lru_cache(maxsize=None)
def rows_reg(kind, g, vpt, block, has_beta, has_res, write_sum, prefetch, exact, xk="f32",
             gk="f32"):
    """Rows of <= g*vpt elements held in registers; g threads a row, blocks of ``block``.

    With ``prefetch`` a block loads its next rows while it reduces the current ones, so
    each thread keeps loads in flight through the reductions (launch about one grid of
    resident blocks; each then walks many rows). ``exact``: rows are exactly g*vpt long, so
    no column needs a bounds test."""
    softmaxish = kind == SOFTMAX or kind == LOG_SOFTMAX
    fill = NEG_INF if softmaxish else ZERO
    gu = np.uint64(g)   # index math is uint64 throughout: signed subscripts cost a wraparound
                        # check each, and a signed operand would make the result signed again
    load = _loader(vpt, has_res, write_sum, exact, xk)
    store = _storer(vpt, kind, has_beta, exact, xk, gk)

    @_jit(block)
    def kernel(out, x, gamma, beta, res, sum_out, rows, cols, eps):
        smem = cuda.shared.array(SLOTS, float32)
        vals = cuda.local.array(vpt, float32)
        nxt = cuda.local.array(vpt, float32)
        tid = uint64(cuda.threadIdx.x)
        lane = tid % gu
        rpb = uint64(cuda.blockDim.x) // gu
        step = uint64(cuda.gridDim.x) * rpb
        r0 = uint64(cuda.blockIdx.x) * rpb
        if prefetch:
            row = r0 + tid // gu
            load(vals, x, res, sum_out, row * cols, lane, gu, cols, row < rows, fill)
        while r0 < rows:                     # uniform across the block: everyone reduces
            row = r0 + tid // gu
            ok = row < rows
            base = row * cols
            if prefetch:   # the next rows' loads, issued before this row's reductions
                nrow = row + step
                load(nxt, x, res, sum_out, nrow * cols, lane, gu, cols, nrow < rows, fill)
            else:
                load(vals, x, res, sum_out, base, lane, gu, cols, ok, fill)
            acc = fill
            for j in range(vpt):
                v = vals[j]
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
                    if ok and (exact or lane + uint64(j) * gu < cols):
                        e = m.exp(vals[j] - a)
                        s += e
                        if kind == SOFTMAX:
                            vals[j] = e      # one exp an element: the store scales it
                s = group_reduce(s, smem, g, SUM)
                b = ONE / s if ok else ZERO      # (rows past the last: s = 0)
                if kind == LOG_SOFTMAX:
                    a = a + m.log(s)
            elif kind == LAYER_NORM:
                a = group_reduce(acc, smem, g, SUM) / n
                d2 = ZERO
                for j in range(vpt):
                    if exact or lane + uint64(j) * gu < cols:
                        d = vals[j] - a
                        d2 += d * d
                b = ONE / m.sqrt(group_reduce(d2, smem, g, SUM) / n + eps)
            else:
                a = ZERO
                b = ONE / m.sqrt(group_reduce(acc, smem, g, SUM) / n + eps)
            store(vals, out, gamma, beta, base, lane, gu, cols, ok, a, b)
            if prefetch:
                for j in range(vpt):
                    vals[j] = nxt[j]
            r0 += step

    return kernel


@functools.lru_cache(maxsize=None)
def rows_loop(kind, block, unroll, cached, has_beta, has_res, write_sum, xk="f32", gk="f32"):
    """One block per row, the row streamed twice (rows too long for registers): chunks of
    block*unroll elements, each thread issuing its ``unroll`` loads of a chunk before it uses
    any (loads in flight are what keep the memory system busy). The first ``cached`` columns
    (whole chunks) stay in shared memory from pass 1 to pass 2, so pass 2 reads that much less:
    each thread keeps its own columns there, so no barrier is needed."""
    softmaxish = kind == SOFTMAX or kind == LOG_SOFTMAX
    fill = NEG_INF if softmaxish else ZERO
    load = _loader(unroll, has_res, write_sum, False, xk)
    reload = _loader(unroll, has_res and not write_sum, False, False, xk)
    store = _storer(unroll, kind, has_beta, False, xk, gk)
    head = _reader(has_res, xk)

    ucached = np.uint64(cached)
    cache_len = max(cached, 1)

    @_jit(block)
    def kernel(out, x, gamma, beta, res, sum_out, rows, cols, eps):
        smem = cuda.shared.array(SLOTS, float32)
        cache = cuda.shared.array(cache_len, float32)
        vals = cuda.local.array(unroll, float32)
        tid = uint64(cuda.threadIdx.x)
        nt = uint64(cuda.blockDim.x)       # uint64 index math, as in rows_reg
        g = cuda.blockDim.x                # the block is the group
        row = uint64(cuda.blockIdx.x)
        while row < rows:
            base = row * cols
            shift = ZERO
            if kind == LAYER_NORM:   # shifted sums: var = E[(x-k)^2] - E[x-k]^2 stays accurate
                shift = head(x, res, base)
            p = fill                 # softmax: running max; layer_norm: sum of (x - shift)
            q = ZERO                 # softmax: sum of exp(x - p); norms: sum of squares
            c0 = tid
            while c0 < cols:
                load(vals, x, res, sum_out, base, c0, nt, cols, True, fill)
                if c0 < ucached:     # a chunk kept on chip for pass 2
                    for u in range(unroll):
                        cache[c0 + uint64(u) * nt] = vals[u]
                if softmaxish:       # the chunk's max first: one rescale a chunk, not an element
                    cm = p
                    for u in range(unroll):
                        v = vals[u]
                        cm = v if (v > cm or v != v) else cm
                    if cm != NEG_INF:
                        q = q * m.exp(p - cm)
                        p = cm
                        for u in range(unroll):
                            q += m.exp(vals[u] - p)
                elif kind == LAYER_NORM:
                    for u in range(unroll):
                        if c0 + uint64(u) * nt < cols:
                            d = vals[u] - shift
                            p += d
                            q += d * d
                else:
                    for u in range(unroll):
                        q += vals[u] * vals[u]
                c0 += uint64(unroll) * nt
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
                var = nonneg(group_reduce(q, smem, g, SUM) / n - mean * mean)
                a = shift + mean
                b = ONE / m.sqrt(var + eps)
            else:
                b = ONE / m.sqrt(group_reduce(q, smem, g, SUM) / n + eps)
            src = sum_out if write_sum else x
            c0 = tid
            while c0 < cols:
                if c0 < ucached:
                    for u in range(unroll):
                        vals[u] = cache[c0 + uint64(u) * nt]
                else:
                    reload(vals, src, res, res, base, c0, nt, cols, True, ZERO)
                if kind == SOFTMAX:
                    for u in range(unroll):
                        vals[u] = m.exp(vals[u] - a)
                store(vals, out, gamma, beta, base, c0, nt, cols, True, a, b)
                c0 += uint64(unroll) * nt
            row += uint64(cuda.gridDim.x)

    return kernel


@cuda.jit(device=True)
def _online(mx, s, v):
    """Fold v into a running (max, sum of exp(x - max)). A +inf max adds exp(inf - inf), a
    NaN, as torch's x - max does: the row is all NaN (a NaN v makes the sum NaN below)."""
    if v > mx:
        return v, s * m.exp(mx - v) + m.exp(v - v)
    if v == NEG_INF:
        return mx, s
    return mx, s + m.exp(v - mx)


@cuda.jit(device=True)
def _fold(kind, p, q, v, shift):
    """Fold v into the column kernel's running statistics (p, q): softmax (max, sum of exp),
    layer_norm shifted (sum, sum of squares), rms_norm (-, sum of squares)."""
    if kind == SOFTMAX or kind == LOG_SOFTMAX:
        return _online(p, q, v)
    if kind == LAYER_NORM:
        return p + (v - shift), q + (v - shift) * (v - shift)
    return p, q + v * v


@functools.lru_cache(maxsize=None)
def cols(kind, has_beta, has_res, write_sum, xk="f32", gk="f32"):
    """The reduced axis in the middle: [outer, n, inner], one thread per (outer, inner)."""
    softmaxish = kind == SOFTMAX or kind == LOG_SOFTMAX
    get = _reader(has_res, xk)
    reget = _reader(has_res and not write_sum, xk)
    finish = _finisher(kind, has_beta, gk)
    st = halfio.store(xk)

    @jit
    def kernel(out, x, gamma, beta, res, sum_out, outer, n, inner, eps):
        t = cuda.grid(1)
        while t < outer * inner:
            o = t // inner
            base = o * n * inner + (t - o * inner)
            shift = ZERO
            if kind == LAYER_NORM:
                shift = get(x, res, base)
            p = NEG_INF if softmaxish else ZERO
            q = ZERO
            for c in range(n):
                i = base + c * inner
                v = get(x, res, i)
                if write_sum:
                    st(sum_out, i, v)
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
                b = ONE / m.sqrt(nonneg(q / fn - mean * mean) + eps)
            else:
                b = ONE / m.sqrt(q / fn + eps)
            src = sum_out if write_sum else x
            for c in range(n):
                i = base + c * inner
                st(out, i, finish(reget(src, res, i), c, a, b, gamma, beta))
            t += cuda.gridsize(1)

    return kernel


# Launch plans, from sweeps on an H200 (bench/bench_rows.py and the issue-3 notes): 16 values a
# thread (a 256-thread group a 4096-long row) beat 8 by 15-60%; softmax wants the prefetching
# kernel (its exps and two reductions sit between load and store), the norms do better with
# plenty of non-prefetching blocks; long rows stream in 256-thread blocks, 8 loads in flight.
VPT_MAX = 16          # values a thread holds in registers (64 registers a thread at most)
MAX_G = 512           # threads a row in rows_reg: rows up to MAX_G * VPT_MAX stay on chip
LOOP_BLOCK, LOOP_UNROLL = 256, 8
# columns of a long row rows_loop keeps in shared memory between its passes: 5 chunks of
# 256 x 8 (40 KiB a block, 4 blocks an SM); 2 chunks of 32 x 8 in the simulator
LOOP_CACHED = 2 * 32 * LOOP_UNROLL if SIMULATOR else 5 * LOOP_BLOCK * LOOP_UNROLL


@dataclass(frozen=True)
class Geometry:
    """row_plan's shapes: at most max_g threads a row, target values a thread when the row
    allows it, at least min_g threads a row and min_block a block."""
    max_g: int
    target: int
    min_g: int
    min_block: int


GPU = Geometry(max_g=MAX_G, target=VPT_MAX, min_g=32, min_block=256)
SIM = Geometry(max_g=32, target=4, min_g=1, min_block=32)     # small groups and blocks
register_geometry("rows", gpu=GPU, sim=SIM)


def row_plan(cols_: int, softmaxish: bool, geo: Geometry | None = None):
    """rows_reg's (g, vpt, block, prefetch, blocks_per_sm) for rows of cols_, or None when
    the row must be streamed (rows_loop). ``geo``: the device's default geometry unless
    given."""
    geo = geo or default_geometry("rows")
    max_g = geo.max_g
    if cols_ > max_g * VPT_MAX:
        return None
    g = 1
    while g < max_g and g * geo.target < cols_:
        g *= 2
    g = max(g, geo.min_g)
    vpt = 1
    while g * vpt < cols_:
        vpt *= 2
    block = max(g, geo.min_block)
    per_sm = 1024 // block
    return g, vpt, block, softmaxish, 2 * per_sm if softmaxish else 16 * per_sm


# ---- backward row kernels (the VJPs in ir/ops_norm.py) ------------------------------------------
# Same [outer, n, inner] view as the forward: ``rowwise`` (inner == 1) puts a group of G
# threads on a row (block // G rows a block, as rows_reg), its threads striding the columns
# (coalesced) and reducing through ``group_reduce``; otherwise one thread owns an (outer,
# inner) column, like ``cols``. Each reads its row twice: once for the row sums, once to
# write dx.


def bwd_group(n: int, block: int) -> int:
    """Threads a row for the rowwise backward kernels: a power of two giving each about four
    columns, at most the block."""
    g = 1
    while g < block and g * 4 < n:
        g *= 2
    return g


@functools.lru_cache(maxsize=None)
def softmax_bwd(kind, block, g, rowwise, xk="f32"):
    """dx of softmax (y = softmax: dx = y * (dy - sum(dy * y))) or log_softmax (y = log_softmax:
    dx = dy - exp(y) * sum(dy)) along the axis; rowwise: G threads a row. dx, dy, y: ``xk``."""
    soft = kind == SOFTMAX
    rpb = block // g
    ld = halfio.load(xk)
    st = halfio.store(xk)

    @jit
    def kernel(dx, dy, y, outer, n, inner):
        if rowwise:
            smem = cuda.shared.array(SLOTS, float32)
            tid = cuda.threadIdx.x
            lane = tid % g
            r0 = cuda.blockIdx.x * rpb
            while r0 < outer:            # uniform across the block: everyone reduces
                row = r0 + tid // g
                base = row * n
                acc = ZERO
                c = lane if row < outer else n
                while c < n:
                    acc += ld(dy, base + c) * ld(y, base + c) if soft else ld(dy, base + c)
                    c += g
                s = group_reduce(acc, smem, g, SUM)
                c = lane if row < outer else n
                while c < n:
                    i = base + c
                    yv = ld(y, i)
                    st(dx, i, yv * (ld(dy, i) - s) if soft else ld(dy, i) - m.exp(yv) * s)
                    c += g
                r0 += cuda.gridDim.x * rpb
        else:
            t = cuda.grid(1)
            while t < outer * inner:
                o = t // inner
                base = o * n * inner + (t - o * inner)
                s = ZERO
                for c in range(n):
                    i = base + c * inner
                    s += ld(dy, i) * ld(y, i) if soft else ld(dy, i)
                for c in range(n):
                    i = base + c * inner
                    yv = ld(y, i)
                    st(dx, i, yv * (ld(dy, i) - s) if soft else ld(dy, i) - m.exp(yv) * s)
                t += cuda.gridsize(1)

    return kernel


@cuda.jit(device=True)
def _norm_bwd_stats(kind, p1, p2, p3, p4, k, n, eps):
    """(mean, rstd, mean(g), mean(g * xhat)) of a row from its sums: layer_norm p1 = sum(h-k),
    p2 = sum((h-k)^2), p3 = sum(g), p4 = sum(g*(h-k)) (shifted by the row's first value k, so
    the variance keeps its digits); rms_norm p2 = sum(h^2), p4 = sum(g*h). g = dy * gamma."""
    if kind == LAYER_NORM:
        m1 = p1 / n
        rstd = ONE / m.sqrt(nonneg(p2 / n - m1 * m1) + eps)
        mg = p3 / n
        return k + m1, rstd, mg, (p4 / n - m1 * mg) * rstd
    rstd = ONE / m.sqrt(p2 / n + eps)
    return ZERO, rstd, ZERO, p4 / n * rstd


@functools.lru_cache(maxsize=None)
def norm_bwd(kind, block, g, rowwise, has_res, write_stats, xk="f32", gk="f32"):
    """dh of layer_norm / rms_norm (h = x + res with HAS_RES), gamma applied, beta irrelevant:
    layer_norm dh = rstd * (g - mean(g) - xhat * mean(g * xhat)), rms_norm dh = rstd * (g -
    xhat * mean(g * xhat)) (its -h * mean(g * h) / rms^3 term), g = dy * gamma. With
    WRITE_STATS each row's (mean, rstd) go to ``stats`` (f32) for the gamma / beta kernel.
    Rowwise: G threads a row. dx, dy, x, res: ``xk``; gamma: ``gk``."""
    ln = kind == LAYER_NORM
    rpb = block // g
    get = _reader(has_res, xk)
    ld = halfio.load(xk)
    ldg = halfio.load(gk)
    st = halfio.store(xk)

    @jit
    def kernel(dx, stats, dy, x, gamma, res, outer, n, inner, eps):
        fn = float32(n)
        if rowwise:
            smem = cuda.shared.array(SLOTS, float32)
            tid = cuda.threadIdx.x
            lane = tid % g
            r0 = cuda.blockIdx.x * rpb
            while r0 < outer:            # uniform across the block: everyone reduces
                row = r0 + tid // g
                ok = row < outer
                base = row * n
                k = ZERO
                if ln and ok:
                    k = get(x, res, base)
                p1 = p2 = p3 = p4 = ZERO
                c = lane if ok else n
                while c < n:
                    i = base + c
                    h = get(x, res, i) - k
                    gv = ld(dy, i) * ldg(gamma, c)
                    p1 += h
                    p2 += h * h
                    p3 += gv
                    p4 += gv * h
                    c += g
                p2 = group_reduce(p2, smem, g, SUM)
                p4 = group_reduce(p4, smem, g, SUM)
                if ln:
                    p1 = group_reduce(p1, smem, g, SUM)
                    p3 = group_reduce(p3, smem, g, SUM)
                mean, rstd, mg, mgx = _norm_bwd_stats(kind, p1, p2, p3, p4, k, fn, eps)
                if write_stats and ok and lane == 0:
                    stats[2 * row] = mean
                    stats[2 * row + 1] = rstd
                c = lane if ok else n
                while c < n:
                    i = base + c
                    xh = (get(x, res, i) - mean) * rstd
                    st(dx, i, rstd * (ld(dy, i) * ldg(gamma, c) - mg - xh * mgx))
                    c += g
                r0 += cuda.gridDim.x * rpb
        else:
            t = cuda.grid(1)
            while t < outer * inner:
                o = t // inner
                base = o * n * inner + (t - o * inner)
                k = ZERO
                if ln:
                    k = get(x, res, base)
                p1 = p2 = p3 = p4 = ZERO
                for c in range(n):
                    i = base + c * inner
                    h = get(x, res, i) - k
                    gv = ld(dy, i) * ldg(gamma, c)
                    p1 += h
                    p2 += h * h
                    p3 += gv
                    p4 += gv * h
                mean, rstd, mg, mgx = _norm_bwd_stats(kind, p1, p2, p3, p4, k, fn, eps)
                if write_stats:
                    stats[2 * t] = mean
                    stats[2 * t + 1] = rstd
                for c in range(n):
                    i = base + c * inner
                    xh = (get(x, res, i) - mean) * rstd
                    st(dx, i, rstd * (ld(dy, i) * ldg(gamma, c) - mg - xh * mgx))
                t += cuda.gridsize(1)

    return kernel


@functools.lru_cache(maxsize=None)
def norm_param_bwd(has_beta, has_res, lanes, xk="f32", pk="f32"):
    """The column reduction of a norm's backward, in partial sums: block (bx, by) sums the
    rows by, by + P, ... (P = gridDim.y row chunks) of 32 columns: part[by, 0, c] = sum of
    dy * xhat (d gamma), with HAS_BETA part[by, 1, c] = sum of dy (d beta), xhat recomputed
    from x (+ res) and the (mean, rstd) norm_bwd stored per row. A block is 32 columns x
    ``lanes`` rows: consecutive threads read consecutive columns, the lanes' sums are added
    in shared memory in a fixed order (deterministic). ``norm_param_sum`` adds the P chunks.
    dy, x, res: ``xk``; part: ``pk`` (gamma's kind when it is the result itself, P = 1; else
    the f32 partials)."""
    nt = 32 * lanes
    w = 2 if has_beta else 1
    get = _reader(has_res, xk)
    ld = halfio.load(xk)
    st = halfio.store(pk)

    @jit
    def kernel(part, dy, x, res, stats, outer, n, inner):
        sg_s = cuda.shared.array(nt, float32)
        sb_s = cuda.shared.array(nt, float32)
        tid = cuda.threadIdx.x
        tx = tid % 32
        c = cuda.blockIdx.x * 32 + tx
        rows_ = outer * inner
        sg = ZERO
        sb = ZERO
        if c < n:
            r = cuda.blockIdx.y * lanes + tid // 32
            while r < rows_:
                o = r // inner
                i = (o * n + c) * inner + (r - o * inner)
                xh = (get(x, res, i) - stats[2 * r]) * stats[2 * r + 1]
                d = ld(dy, i)
                sg += d * xh
                sb += d
                r += cuda.gridDim.y * lanes
        sg_s[tid] = sg
        sb_s[tid] = sb
        cuda.syncthreads()
        if tid < 32 and c < n:
            for k in range(1, lanes):
                sg += sg_s[k * 32 + tid]
                sb += sb_s[k * 32 + tid]
            base = cuda.blockIdx.y * w * n
            st(part, base + c, sg)
            if has_beta:
                st(part, base + n + c, sb)

    return kernel


@functools.lru_cache(maxsize=None)
def norm_param_sum(pk="f32"):
    """out[k] = the sum over the P chunks of part[p, k] (in order), k < w * n; out: ``pk``."""
    st = halfio.store(pk)

    @jit
    def kernel(out, part, chunks, size):
        k = cuda.grid(1)
        while k < size:
            s = ZERO
            for p in range(chunks):
                s += part[p * size + k]
            st(out, k, s)
            k += cuda.gridsize(1)

    return kernel
