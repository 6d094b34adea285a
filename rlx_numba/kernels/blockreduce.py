"""Reductions across the threads of a group (a row's threads), for the row kernels.

A block is split into groups of G consecutive threads (G a power of two, G divides the block);
``group_reduce(v, smem, G, OP)`` returns the group's reduction of ``v`` to every member. On a
GPU it uses warp shuffles, then shared memory across the warps of a group when G > 32. The
simulator has no warp intrinsics, so there the same function goes through shared memory. Every
thread of the block must call it (it synchronises), and ``smem`` must be a shared array of
``SLOTS`` elements of v's type, declared by the kernel.

OP is SUM, MAX or MIN (MAX/MIN propagate NaN, like torch). Pass G and OP as compile-time
constants (closure values of a kernel factory) so the branches fold away.
"""
from numba import cuda

from ..device import SIMULATOR

SUM, MAX, MIN, PROD = 0, 1, 2, 3
MAX_THREADS = 64 if SIMULATOR else 1024   # largest block the row kernels launch
SLOTS = MAX_THREADS if SIMULATOR else 32   # shared slots group_reduce needs


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
