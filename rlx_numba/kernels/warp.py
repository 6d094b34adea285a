"""What the threads of a warp or a block compute together, in one place for every kernel:
group reductions (``group_reduce``, ``group_reduce_pair``), the warp's barrier (``warp_sync``),
lane exchange (``xor_shfl``) and reduce-scatter (``reduce_scatter``), and the block's bitonic
sort (``bitonic_sort``). Each has a GPU body (warp shuffles) and, where the simulator lacks
the warp intrinsics, a shared-memory equivalent there.

Group reductions, for the row kernels: a block is split into groups of G consecutive threads
(G a power of two, G divides the block); ``group_reduce(v, smem, G, OP)`` returns the group's reduction of ``v`` to every member. On a
GPU it uses warp shuffles, then shared memory across the warps of a group when G > 32. The
simulator has no warp intrinsics, so there the same function goes through shared memory. Every
thread of the block must call it (it synchronises), and ``smem`` must be a shared array of
``SLOTS`` elements of v's type, declared by the kernel.

OP is SUM, MAX or MIN (MAX/MIN propagate NaN, like torch). Pass G and OP as compile-time
constants (closure values of a kernel factory) so the branches fold away.
"""
import functools

from numba import cuda, float32, uint64

from ..device import SIMULATOR
from .launch import inline

SUM, MAX, MIN, PROD = 0, 1, 2, 3
MAX_THREADS = 1024                         # largest block a kernel launches
# shared slots group_reduce needs: a warp's one on a GPU, a thread's one in the simulator
# (there at any block size, so the simulator can run the GPU's tile geometry)
SLOTS = MAX_THREADS if SIMULATOR else 32


@cuda.jit(device=True)
def combine(a, b, op):
    if op == SUM:
        return a + b
    if op == PROD:
        return a * b
    if op == MAX:
        return a if (a > b or a != a) else b
    return a if (a < b or a != a) else b


if not SIMULATOR:
    @cuda.jit(device=True)
    def group_reduce(v, smem, g, op):
        off = 16 if g >= 32 else g // 2
        while off > 0:
            v = combine(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, off), op)
            off //= 2
        if g > 32:
            tid = cuda.threadIdx.x
            w = tid >> 5
            wpg = g >> 5
            if (tid & 31) == 0:
                smem[w] = v
            cuda.syncthreads()
            base = (w // wpg) * wpg
            v = smem[base]
            for k in range(1, wpg):
                v = combine(v, smem[base + k], op)
            cuda.syncthreads()   # smem is free again when this returns
        return v
else:
    @cuda.jit(device=True)
    def group_reduce(v, smem, g, op):
        tid = cuda.threadIdx.x
        smem[tid] = v
        cuda.syncthreads()
        base = tid - tid % g
        v = smem[base]
        for k in range(1, g):
            v = combine(v, smem[base + k], op)
        cuda.syncthreads()
        return v


# ---- (value, index) pairs, for argmax / argmin ---------------------------------------------
ARGMAX, ARGMIN = 4, 5


@cuda.jit(device=True)
def pair_better(v, i, w, j, op):
    """True when (w, j) beats (v, i) under ARGMAX/ARGMIN: a NaN beats any number (the first
    NaN wins, like torch), then the larger (smaller) value, then the smaller index."""
    if w != w:
        return v == v or j < i
    if v != v:
        return False
    if op == ARGMAX:
        if w > v:
            return True
    elif w < v:
        return True
    return w == v and j < i


if not SIMULATOR:
    @cuda.jit(device=True)
    def group_reduce_pair(v, i, smem_v, smem_i, g, op):
        """``group_reduce`` for (value, index) pairs; returns the group's best pair to every
        member. ``smem_v``/``smem_i``: shared arrays of SLOTS elements of v's / i's type."""
        off = 16 if g >= 32 else g // 2
        while off > 0:
            w = cuda.shfl_xor_sync(0xFFFFFFFF, v, off)
            j = cuda.shfl_xor_sync(0xFFFFFFFF, i, off)
            if pair_better(v, i, w, j, op):
                v = w
                i = j
            off //= 2
        if g > 32:
            tid = cuda.threadIdx.x
            w_ = tid >> 5
            wpg = g >> 5
            if (tid & 31) == 0:
                smem_v[w_] = v
                smem_i[w_] = i
            cuda.syncthreads()
            base = (w_ // wpg) * wpg
            v = smem_v[base]
            i = smem_i[base]
            for k in range(1, wpg):
                if pair_better(v, i, smem_v[base + k], smem_i[base + k], op):
                    v = smem_v[base + k]
                    i = smem_i[base + k]
            cuda.syncthreads()
        return v, i
else:
    @cuda.jit(device=True)
    def group_reduce_pair(v, i, smem_v, smem_i, g, op):
        tid = cuda.threadIdx.x
        smem_v[tid] = v
        smem_i[tid] = i
        cuda.syncthreads()
        base = tid - tid % g
        v = smem_v[base]
        i = smem_i[base]
        for k in range(1, g):
            if pair_better(v, i, smem_v[base + k], smem_i[base + k], op):
                v = smem_v[base + k]
                i = smem_i[base + k]
        cuda.syncthreads()
        return v, i


# ---- one warp: barrier, lane exchange, reduce-scatter -----------------------------------------
if SIMULATOR:   # no warp intrinsics there: the block barrier (every warp calls it together)
    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncthreads()

else:
    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncwarp(0xFFFFFFFF)


if SIMULATOR:   # no shuffles there: exchange through the warp's row of shared memory
    @cuda.jit(device=True)
    def xor_shfl(v, off, xs, w, lane):
        """The value of lane ``lane ^ off`` (``xs``: shared [warps, 32] scratch, simulator only)."""
        xs[w, lane] = v
        cuda.syncthreads()
        r = xs[w, lane ^ off]
        cuda.syncthreads()
        return r
else:
    @cuda.jit(device=True)
    def xor_shfl(v, off, xs, w, lane):
        return cuda.shfl_xor_sync(0xFFFFFFFF, v, off)


@cuda.jit(device=True)
def _rs_stage(vals, cnt, off, xs, w, lane):
    """One stage of a warp reduce-scatter of ``cnt`` values a lane (lanes paired by ``off``):
    each lane keeps half the values (the upper half when its ``off`` bit is set) plus its
    partner's copy of them. Once one value is left the stage is a plain butterfly sum."""
    if cnt > 1:
        h = cnt // 2
        up = (lane & off) != 0
        for i in range(h):
            a, b = vals[i], vals[i + h]
            vals[i] = (b if up else a) + xor_shfl(a if up else b, off, xs, w, lane)
    else:
        vals[0] += xor_shfl(vals[0], off, xs, w, lane)


if SIMULATOR:   # the same sums through shared memory in one exchange (each barrier is costly)
    @cuda.jit(device=True)
    def reduce_scatter(vals, nv, xs, xr, w, lane):
        """vals[0] <- the warp's sum of value lane // (32 // nv) (see the GPU version)."""
        for i in range(nv):
            xr[w, lane, i] = vals[i]
        cuda.syncthreads()
        idx = lane // (32 // nv)
        t = float32(0.0)
        for src in range(32):
            t += xr[w, src, idx]
        cuda.syncthreads()
        vals[0] = t
else:
    @cuda.jit(device=True)
    def reduce_scatter(vals, nv, xs, xr, w, lane):
        """vals[0] <- the warp's sum of value lane // (32 // nv): 5 shuffle stages, halving
        the values a lane holds while there are several (see _rs_stage). ``xr``: shared
        [warps, 32, nv] scratch of the simulator's version (a dummy here)."""
        _rs_stage(vals, max(1, nv), 16, xs, w, lane)
        _rs_stage(vals, max(1, nv >> 1), 8, xs, w, lane)
        _rs_stage(vals, max(1, nv >> 2), 4, xs, w, lane)
        _rs_stage(vals, max(1, nv >> 3), 2, xs, w, lane)
        _rs_stage(vals, max(1, nv >> 4), 1, xs, w, lane)


# ---- one block: bitonic sort of uint64 keys ---------------------------------------------------
_Z, _ONE64, _LOW32 = uint64(0), uint64(1), uint64(0xFFFFFFFF)


@functools.cache
def bitonic_sort(descending: bool, low32: bool = False):
    """sort(buf, base, n, tid, step): buf[base:base+n] (n a power of two) sorted in place by
    the block's threads (thread tid takes every step-th compare-exchange; every thread of the
    block calls it: it synchronises), ascending or descending by key, or with ``low32`` by
    the key's low 32 bits. Inlined, so a constant n folds its loops."""
    @inline
    def sort(buf, base, n, tid, step):
        half = n >> _ONE64
        size = uint64(2)
        while size <= n:
            stride = size >> _ONE64
            while stride > _Z:
                i = tid
                while i < half:
                    lo = i + i - (i & (stride - _ONE64))   # i's pair: (lo, lo + stride)
                    hi = lo + stride
                    a = buf[base + lo]
                    b = buf[base + hi]
                    ka = a & _LOW32 if low32 else a
                    kb = b & _LOW32 if low32 else b
                    # the run holding lo sorts one way ((lo & size) == 0) or the other
                    if ((lo & size) == _Z) == descending:
                        swap = ka < kb
                    else:
                        swap = ka > kb
                    if swap:
                        buf[base + lo] = b
                        buf[base + hi] = a
                    i += step
                cuda.syncthreads()
                stride = stride >> _ONE64
            size += size
    return sort
