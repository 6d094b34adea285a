"""Reduction kernels: reduce (sum mean max min prod), argmax/argmin, cumsum.

The graph op is planned into passes by runtime/lower_reduce.py; each pass is one of:

* ``row_reduce``: the reduced elements of an output are contiguous (the last axes). A group
  of G threads streams a row (or a segment of one) with UNROLL (8) independent loads in
  flight per thread, then ``group_reduce`` combines the group. Several rows a block when
  rows are short.
* ``col_reduce``: x seen as [outer, r, inner], reduced over r. A block is BX x BY threads:
  BX consecutive inner positions (coalesced loads), BY lanes taking every BY-th row, UNROLL
  rows in flight per thread; the BY partials are combined through shared memory. grid.y
  splits r into chunks whose partials a second pass combines.
* ``arg_rows`` / ``arg_cols``: the same two shapes for (value, index) pairs (``arg_rows``
  can cut long rows into segments too: best pair per segment, then the best of those).
* ``scan_rows`` (last axis: a group per row, chunk by chunk through shared memory: each
  thread scans K consecutive elements, the group scans the thread totals) and ``scan_cols``
  (other axes: a thread per (outer, inner) column walks r, coalesced across inner).

Values are loaded into an accumulator type, f32 for floats (f16/bf16 widened), f64 for f64, or
i64 for
integers and bool, and stored by a store function that converts to the output dtype (and for
mean divides by the count). Loads, stores, the op and the sizes are compile-time constants of
each factory, so each kernel is straight-line code. All index math is uint64 (numba adds a
negative-index wraparound to signed subscripts).
"""
import functools
import math

from numba import cuda, float32, float64, int32, int64, uint64
from numba.core.types import float16

from ..device import SIMULATOR
from . import warp as br
from . import elementwise as ew
from . import halfio
from .warp import ARGMAX, ARGMIN, MAX, MIN, PROD, SLOTS, SUM, group_reduce, group_reduce_pair
from .launch import jit, py_in_sim


def _inline(f):
    """A device function, or in the simulator its plain Python function: a device-function
    call there costs ~15 us (the cuda module is swapped in and out around it), and these
    helpers use no cuda.* API, so calling them directly computes the same thing."""
    return f.fn if SIMULATOR else f




def _jit(max_threads: int):
    """@cuda.jit with launch bounds: the block size the kernel is launched with, so the
    compiler keeps registers within what a block of that size may use (without, a kernel
    can compile to too many registers for a 1024-thread block and fail to launch)."""
    return jit(launch_bounds=max_threads)


combine = _inline(br.combine)
pair_better = _inline(br.pair_better)
_f32_to_bf16 = _inline(ew.f32_to_bf16)

OPS = {"sum": SUM, "mean": SUM, "max": MAX, "min": MIN, "prod": PROD,
       "argmax": ARGMAX, "argmin": ARGMIN}
ACC_TYPES = {"f32": float32, "f64": float64, "i64": int64}
UNROLL = 8   # loads in flight per thread in the reduce loops (4 or 8)
_I64_MAX = int64(2**63 - 1)
_U0 = uint64(0)
_U1 = uint64(1)


# ---- loads: element k of x as the accumulator type (floats through kernels/halfio.py) --------
@py_in_sim
def ld_int(x, k):
    return int64(x[k])


@py_in_sim
def ld_f64(x, k):
    return float64(x[k])


LOADS = {"f32": halfio.ld_f32, "f16": halfio.ld_f16, "bf16": halfio.ld_bf16, "int": ld_int,
         "f64": ld_f64}


# ---- stores: out[k] = v converted (d: the count, for mean) ------------------------------------
@py_in_sim
def st_same(out, k, v, d):
    out[k] = v


@py_in_sim
def st_f16(out, k, v, d):
    out[k] = float16(v)


@py_in_sim
def st_bf16(out, k, v, d):
    out[k] = _f32_to_bf16(v)


@py_in_sim
def st_i32(out, k, v, d):
    out[k] = int32(v)


@py_in_sim
def st_bool(out, k, v, d):
    out[k] = v != 0


@py_in_sim
def st_mean_f32(out, k, v, d):
    out[k] = float32(v) / d


@py_in_sim
def st_mean_f64(out, k, v, d):
    out[k] = float64(v) / float64(d)


@py_in_sim
def st_mean_f16(out, k, v, d):
    out[k] = float16(float32(v) / d)


@py_in_sim
def st_mean_bf16(out, k, v, d):
    out[k] = _f32_to_bf16(float32(v) / d)


STORES = {"same": st_same, "f16": st_f16, "bf16": st_bf16, "i32": st_i32, "bool": st_bool,
          "mean_f32": st_mean_f32, "mean_f16": st_mean_f16, "mean_bf16": st_mean_bf16,
          "mean_f64": st_mean_f64}


def identity(op: int, acc: str):
    """The value an empty thread contributes: 0, 1, or the far end of the type."""
    if acc in ("f32", "f64"):
        return ACC_TYPES[acc]({SUM: 0.0, PROD: 1.0, MAX: -math.inf, MIN: math.inf,
                        ARGMAX: -math.inf, ARGMIN: math.inf}[op])
    return int64({SUM: 0, PROD: 1, MAX: -2**63, MIN: 2**63 - 1,
                  ARGMAX: -2**63, ARGMIN: 2**63 - 1}[op])


# ---- reduce: rows ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def row_reduce(op: int, ld: str, st: str, acc: str, g: int, block: int, unroll: int = UNROLL):
    """out[q] = reduction of segment q: row q // nseg, elements [c*seg, min((c+1)*seg, n)) with
    c = q % nseg (nseg = 1: whole rows). g threads a segment, block // g segments a block,
    ``unroll`` (4 or 8) loads in flight per thread."""
    LD, ST, ACC = LOADS[ld], STORES[st], ACC_TYPES[acc]
    ID = identity(op, acc)
    OP = op
    GI = g
    U8 = unroll == 8
    G, G2, G3, G4 = uint64(g), uint64(2 * g), uint64(3 * g), uint64(4 * g)
    G5, G6, G7, G8 = uint64(5 * g), uint64(6 * g), uint64(7 * g), uint64(8 * g)
    LMASK = uint64(g - 1)
    GPB = uint64(block // g)

    @_jit(block)
    def kernel(out, x, ngroups, n, seg, nseg, div):
        smem = cuda.shared.array(SLOTS, ACC)
        tid = uint64(cuda.threadIdx.x)
        lane = tid & LMASK
        q0 = uint64(cuda.blockIdx.x) * GPB
        qstep = uint64(cuda.gridDim.x) * GPB
        while q0 < ngroups:                   # uniform across the block: all reach the barrier
            q = q0 + tid // G
            a0 = ID
            a1 = ID
            a2 = ID
            a3 = ID
            if q < ngroups:
                row = q // nseg
                lo = (q - row * nseg) * seg
                hi = min(lo + seg, n)
                j = row * n + lo + lane
                end = row * n + hi
                if U8:
                    while j + G7 < end:
                        v0 = LD(x, j)
                        v1 = LD(x, j + G)
                        v2 = LD(x, j + G2)
                        v3 = LD(x, j + G3)
                        v4 = LD(x, j + G4)
                        v5 = LD(x, j + G5)
                        v6 = LD(x, j + G6)
                        v7 = LD(x, j + G7)
                        a0 = combine(a0, combine(v0, v4, OP), OP)
                        a1 = combine(a1, combine(v1, v5, OP), OP)
                        a2 = combine(a2, combine(v2, v6, OP), OP)
                        a3 = combine(a3, combine(v3, v7, OP), OP)
                        j += G8
                while j + G3 < end:
                    v0 = LD(x, j)
                    v1 = LD(x, j + G)
                    v2 = LD(x, j + G2)
                    v3 = LD(x, j + G3)
                    a0 = combine(a0, v0, OP)
                    a1 = combine(a1, v1, OP)
                    a2 = combine(a2, v2, OP)
                    a3 = combine(a3, v3, OP)
                    j += G4
                while j < end:
                    a0 = combine(a0, LD(x, j), OP)
                    j += G
            a = combine(combine(a0, a1, OP), combine(a2, a3, OP), OP)
            if GI > 1:
                a = group_reduce(a, smem, GI, OP)
            if q < ngroups and lane == _U0:
                ST(out, q, a, div)
            q0 += qstep

    return kernel


# ---- reduce: columns -------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def col_reduce(op: int, ld: str, st: str, acc: str, bx: int, by: int, unroll: int = UNROLL):
    """x [outer, r, inner] -> out [outer, nsplit, inner]: chunk s = blockIdx.y of r
    (rows [s*rchunk, min((s+1)*rchunk, r))) reduced; nsplit = 1 gives the final result."""
    LD, ST, ACC = LOADS[ld], STORES[st], ACC_TYPES[acc]
    ID = identity(op, acc)
    OP = op
    U8 = unroll == 8
    BX, BY, BY4, BY8 = uint64(bx), uint64(by), uint64(4 * by), uint64(8 * by)
    BYI = by

    @_jit(bx * by)
    def kernel(out, x, nbx, ntiles, r, inner, rchunk, nsplit, div):
        smem = cuda.shared.array((BYI, bx), ACC)
        tid = uint64(cuda.threadIdx.x)
        tx = tid % BX
        ty = tid // BX
        s = uint64(cuda.blockIdx.y)
        r0 = s * rchunk
        r1 = min(r0 + rchunk, r)
        step = BY * inner
        b = uint64(cuda.blockIdx.x)
        while b < ntiles:                     # uniform across the block
            o = b // nbx
            i = (b - o * nbx) * BX + tx
            a0 = ID
            a1 = ID
            a2 = ID
            a3 = ID
            if i < inner:
                k = r0 + ty
                p = (o * r + k) * inner + i
                if U8:
                    while k + BY8 - BY < r1:
                        v0 = LD(x, p)
                        v1 = LD(x, p + step)
                        v2 = LD(x, p + step * uint64(2))
                        v3 = LD(x, p + step * uint64(3))
                        v4 = LD(x, p + step * uint64(4))
                        v5 = LD(x, p + step * uint64(5))
                        v6 = LD(x, p + step * uint64(6))
                        v7 = LD(x, p + step * uint64(7))
                        a0 = combine(a0, combine(v0, v4, OP), OP)
                        a1 = combine(a1, combine(v1, v5, OP), OP)
                        a2 = combine(a2, combine(v2, v6, OP), OP)
                        a3 = combine(a3, combine(v3, v7, OP), OP)
                        k += BY8
                        p += step * uint64(8)
                while k + BY4 - BY < r1:
                    v0 = LD(x, p)
                    v1 = LD(x, p + step)
                    v2 = LD(x, p + step + step)
                    v3 = LD(x, p + step + step + step)
                    a0 = combine(a0, v0, OP)
                    a1 = combine(a1, v1, OP)
                    a2 = combine(a2, v2, OP)
                    a3 = combine(a3, v3, OP)
                    k += BY4
                    p += step + step + step + step
                while k < r1:
                    a0 = combine(a0, LD(x, p), OP)
                    k += BY
                    p += step
            a = combine(combine(a0, a1, OP), combine(a2, a3, OP), OP)
            if BYI > 1:
                smem[ty, tx] = a
                cuda.syncthreads()
            if ty == _U0 and i < inner:
                for m in range(1, BYI):
                    a = combine(a, smem[m, tx], OP)
                ST(out, (o * nsplit + s) * inner + i, a, div)
            if BYI > 1:
                cuda.syncthreads()            # smem is rewritten by the next tile
            b += uint64(cuda.gridDim.x)

    return kernel


# ---- argmax / argmin ---------------------------------------------------------------------------
WHOLE, PARTIAL, COMBINE = 0, 1, 2   # arg_rows stages


@functools.lru_cache(maxsize=None)
def arg_rows(op: int, ld: str, acc: str, g: int, block: int, stage: int = WHOLE):
    """Index of the best element of each contiguous row of n (g threads a row).

    Segment q covers row q // nseg, elements [c*seg, min((c+1)*seg, n)), c = q % nseg.
    WHOLE (nseg = 1): out[q] = the index. PARTIAL: out[q], out_v[q] = the segment's best
    index and value. COMBINE: x/xi are such partials, [rows, n = earlier nseg]; out[q] = the
    index held in xi of the best pair. Unused arrays may be any array."""
    LD, ACC = LOADS[ld], ACC_TYPES[acc]
    ID = identity(op, acc)
    OP = op
    GI = g
    IDX_IN = stage == COMBINE
    PAIR_OUT = stage == PARTIAL
    G, G2, G3, G4 = uint64(g), uint64(2 * g), uint64(3 * g), uint64(4 * g)
    LMASK = uint64(g - 1)
    GPB = uint64(block // g)

    @_jit(block)
    def kernel(out, out_v, x, xi, ngroups, n, seg, nseg):
        smem_v = cuda.shared.array(SLOTS, ACC)
        smem_i = cuda.shared.array(SLOTS, int64)
        tid = uint64(cuda.threadIdx.x)
        lane = tid & LMASK
        q0 = uint64(cuda.blockIdx.x) * GPB
        qstep = uint64(cuda.gridDim.x) * GPB
        while q0 < ngroups:
            q = q0 + tid // G
            bv = ID
            bi = _I64_MAX
            if q < ngroups:
                row = q // nseg
                lo = (q - row * nseg) * seg
                hi = min(lo + seg, n)
                base = row * n
                j = lo + lane
                while j + G3 < hi:            # four loads in flight, compared in order
                    v0 = LD(x, base + j)
                    v1 = LD(x, base + j + G)
                    v2 = LD(x, base + j + G2)
                    v3 = LD(x, base + j + G3)
                    i0 = xi[base + j] if IDX_IN else int64(j)
                    i1 = xi[base + j + G] if IDX_IN else int64(j + G)
                    i2 = xi[base + j + G2] if IDX_IN else int64(j + G2)
                    i3 = xi[base + j + G3] if IDX_IN else int64(j + G3)
                    if pair_better(bv, bi, v0, i0, OP):
                        bv, bi = v0, i0
                    if pair_better(bv, bi, v1, i1, OP):
                        bv, bi = v1, i1
                    if pair_better(bv, bi, v2, i2, OP):
                        bv, bi = v2, i2
                    if pair_better(bv, bi, v3, i3, OP):
                        bv, bi = v3, i3
                    j += G4
                while j < hi:
                    v0 = LD(x, base + j)
                    i0 = xi[base + j] if IDX_IN else int64(j)
                    if pair_better(bv, bi, v0, i0, OP):
                        bv, bi = v0, i0
                    j += G
            if GI > 1:
                bv, bi = group_reduce_pair(bv, bi, smem_v, smem_i, GI, OP)
            if q < ngroups and lane == _U0:
                out[q] = bi
                if PAIR_OUT:
                    out_v[q] = bv
            q0 += qstep

    return kernel


@functools.lru_cache(maxsize=None)
def arg_cols(op: int, ld: str, acc: str, bx: int, by: int):
    """x [outer, r, inner] -> out [outer, inner]: index along r of the best element."""
    LD, ACC = LOADS[ld], ACC_TYPES[acc]
    ID = identity(op, acc)
    OP = op
    BX, BY, BY2, BY3, BY4 = uint64(bx), uint64(by), uint64(2 * by), uint64(3 * by), uint64(4 * by)
    BYI = by

    @_jit(bx * by)
    def kernel(out, x, nbx, ntiles, r, inner):
        smem_v = cuda.shared.array((BYI, bx), ACC)
        smem_i = cuda.shared.array((BYI, bx), int64)
        tid = uint64(cuda.threadIdx.x)
        tx = tid % BX
        ty = tid // BX
        step = BY * inner
        b = uint64(cuda.blockIdx.x)
        while b < ntiles:
            o = b // nbx
            i = (b - o * nbx) * BX + tx
            bv = ID
            bi = _I64_MAX
            if i < inner:
                k = ty
                p = (o * r + k) * inner + i
                while k + BY3 < r:            # four loads in flight, compared in order
                    v0 = LD(x, p)
                    v1 = LD(x, p + step)
                    v2 = LD(x, p + step + step)
                    v3 = LD(x, p + step + step + step)
                    if pair_better(bv, bi, v0, int64(k), OP):
                        bv, bi = v0, int64(k)
                    if pair_better(bv, bi, v1, int64(k + BY), OP):
                        bv, bi = v1, int64(k + BY)
                    if pair_better(bv, bi, v2, int64(k + BY2), OP):
                        bv, bi = v2, int64(k + BY2)
                    if pair_better(bv, bi, v3, int64(k + BY3), OP):
                        bv, bi = v3, int64(k + BY3)
                    k += BY4
                    p += step + step + step + step
                while k < r:
                    v = LD(x, p)
                    if pair_better(bv, bi, v, int64(k), OP):
                        bv, bi = v, int64(k)
                    k += BY
                    p += step
            if BYI > 1:
                smem_v[ty, tx] = bv
                smem_i[ty, tx] = bi
                cuda.syncthreads()
            if ty == _U0 and i < inner:
                for m in range(1, BYI):
                    if pair_better(bv, bi, smem_v[m, tx], smem_i[m, tx], OP):
                        bv, bi = smem_v[m, tx], smem_i[m, tx]
                out[o * inner + i] = bi
            if BYI > 1:
                cuda.syncthreads()
            b += uint64(cuda.gridDim.x)

    return kernel


# ---- cumsum ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def scan_rows(ld: str, st: str, acc: str, g: int, block: int, k: int, exclusive: bool):
    """Running sums of contiguous rows of n; g threads a row, the row taken in chunks of g*k:
    a coalesced load into shared memory, a serial scan of k consecutive elements a thread, a
    Hillis-Steele scan of the g thread totals, the carry from earlier chunks added."""
    LD, ST, ACC = LOADS[ld], STORES[st], ACC_TYPES[acc]
    Z = identity(SUM, acc)
    EXCL = exclusive
    NBUF = block * k
    KI = k
    GI = g
    G, K, GK = uint64(g), uint64(k), uint64(g * k)
    LMASK = uint64(g - 1)
    GPB = uint64(block // g)
    DIV = float32(1.0)

    @_jit(block)
    def kernel(out, x, nrows, n):
        buf = cuda.shared.array(NBUF, ACC)
        tot = cuda.shared.array(block, ACC)
        if GI == 1:                            # short rows: a thread scans a row on its own
            q = uint64(cuda.grid(1))
            while q < nrows:
                p = q * n
                end = p + n
                s = Z
                while p < end:
                    v = LD(x, p)
                    w = s
                    s = s + v
                    ST(out, p, w if EXCL else s, DIV)
                    p += _U1
                q += uint64(cuda.gridsize(1))
            return
        tid = uint64(cuda.threadIdx.x)
        lane = tid & LMASK
        grp = tid // G
        gb = grp * GK                          # this group's chunk in buf
        mine = gb + lane * K                   # this thread's k consecutive elements
        last = grp * G + G - _U1               # the group's last thread
        q0 = uint64(cuda.blockIdx.x) * GPB
        qstep = uint64(cuda.gridDim.x) * GPB
        while q0 < nrows:
            q = q0 + grp
            ok = q < nrows
            base = q * n
            carry = Z
            c0 = _U0
            while c0 < n:                      # n is the same for every row: uniform
                for t in range(KI):
                    e = c0 + lane + G * uint64(t)
                    v = Z
                    if ok and e < n:
                        v = LD(x, base + e)
                    buf[gb + lane + G * uint64(t)] = v
                cuda.syncthreads()
                s = Z
                for t in range(KI):
                    v = buf[mine + uint64(t)]
                    w = s
                    s = s + v
                    buf[mine + uint64(t)] = w if EXCL else s
                tot[tid] = s
                cuda.syncthreads()
                off = _U1
                while off < G:
                    t2 = Z
                    if lane >= off:
                        t2 = tot[tid - off]
                    cuda.syncthreads()
                    tot[tid] = tot[tid] + t2
                    cuda.syncthreads()
                    off += off
                pre = carry
                if lane > _U0:
                    pre = pre + tot[tid - _U1]
                carry = carry + tot[last]
                for t in range(KI):
                    buf[mine + uint64(t)] = pre + buf[mine + uint64(t)]
                cuda.syncthreads()
                for t in range(KI):
                    e = c0 + lane + G * uint64(t)
                    if ok and e < n:
                        ST(out, base + e, buf[gb + lane + G * uint64(t)], DIV)
                cuda.syncthreads()             # buf and tot are rewritten by the next chunk
                c0 += GK
            q0 += qstep

    return kernel


@functools.lru_cache(maxsize=None)
def scan_cols(ld: str, st: str, acc: str, exclusive: bool):
    """Running sums along r of x [outer, r, inner]; a thread per (outer, inner) column."""
    LD, ST = LOADS[ld], STORES[st]
    Z = identity(SUM, acc)
    EXCL = exclusive
    DIV = float32(1.0)

    @_jit(1024)
    def kernel(out, x, ncols, r, inner):
        t = uint64(cuda.grid(1))
        step = uint64(cuda.gridsize(1))
        while t < ncols:
            o = t // inner
            p = o * r * inner + (t - o * inner)
            s = Z
            k = _U0
            while k < r:
                v = LD(x, p)
                w = s
                s = s + v
                ST(out, p, w if EXCL else s, DIV)
                p += inner
                k += _U1
            t += step

    return kernel


# ---- fill ----------------------------------------------------------------------------------------
@jit
def fill(out, src, n):
    """out[:n] = src[0] (the results of reducing an empty extent: 0, 1, NaN)."""
    i = uint64(cuda.grid(1))
    step = uint64(cuda.gridsize(1))
    while i < n:
        out[i] = src[0]
        i += step
