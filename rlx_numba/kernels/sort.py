"""A stable sort of rows (ir/ops_sort.py): each element becomes one uint64 key, its value's
order-preserving bits above its index, so every key is distinct and sorting the keys sorts the
values with ties in index order (stable), for either direction:
  f32: -0.0 as +0.0, a NaN as the largest (after +inf, as torch); bits b -> b | 2^31 for a
  sign bit 0, ~b (32 bits) for 1; i32: b ^ 2^31; descending: the bits inverted (ties still by index).
  1. key_kernel: the keys;
  2. tile_sort_kernel(P): a block a tile of P keys of a row (a power of two: the whole row
     when it fits in shared memory), bitonic in shared memory, padded with 2^64 - 1;
  3. merge_tile_kernel(P): pairs of sorted runs of ``width`` merged, a block P outputs by
     merge path: the runs' slices it needs loaded into shared memory, each key moved to its
     rank (its place in its slice + the other slice's keys below it, by binary search),
     ping-ponging between two arrays, until one run spans the row;
  4. the indices are the keys' low 32 bits (index_kernel); values gather them.
"""
import functools
from dataclasses import dataclass

from numba import cuda, int32, uint8, uint32, uint64

from .launch import jit, register_geometry
from .warp import bitonic_sort



@dataclass(frozen=True)
class Geometry:
    """tile keys a block sorts in shared memory (and merges a pass), threads a block, probes:
    the points a merge split's search probes a round (threads // 2 at most)."""
    tile: int
    threads: int
    probes: int


GPU = Geometry(tile=2048, threads=512, probes=32)       # a tile: 16 KiB of shared memory
SIM = Geometry(tile=8, threads=4, probes=2)
register_geometry("sort", gpu=GPU, sim=SIM)
F32, I32 = 0, 1
_HI = uint64(32)
_SIGN = uint32(0x80000000)
_ONES = uint32(0xFFFFFFFF)      # (XOR, not ~: numba widens a uint32 before inverting it)
_MAX = uint64(0xFFFFFFFFFFFFFFFF)


@functools.lru_cache(maxsize=None)
def key_kernel(kind: int, descending: bool):
    """kernel(keys, bits, total, n): keys[i] = order bits of element i << 32 | i % n (bits:
    the input's 32-bit words)."""

    @jit
    def kernel(keys, bits, total, n):
        i = uint64(cuda.grid(1))
        while i < total:
            b = uint32(bits[i])
            if kind == F32:
                if (b & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
                    b = uint32(0xFFFFFFFF)                       # NaN: the largest
                else:
                    if b == _SIGN:
                        b = uint32(0)                            # -0.0 ties with +0.0
                    b = (b | _SIGN) if (b & _SIGN) == uint32(0) else b ^ _ONES
            else:
                b = b ^ _SIGN
            if descending:
                b = b ^ _ONES
            keys[i] = (uint64(b) << _HI) | (i % n)
            i += uint64(cuda.gridsize(1))

    return kernel


@functools.lru_cache(maxsize=None)
def tile_sort_kernel(p: int):
    """kernel(keys, rows, n): each tile of p keys of each row sorted in place (bitonic)."""
    up = uint64(p)
    sort = bitonic_sort(False)

    @jit
    def kernel(keys, rows, n):
        s = cuda.shared.array(p, uint64)
        tid = uint64(cuda.threadIdx.x)
        tiles = (n + up - uint64(1)) // up
        t = uint64(cuda.blockIdx.x)
        while t < rows * tiles:
            r, q = t // tiles, t % tiles
            base = r * n + q * up
            count = min(up, n - q * up)
            i = tid
            while i < up:
                s[i] = keys[base + i] if i < count else _MAX
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            sort(s, uint64(0), up, tid, uint64(cuda.blockDim.x))
            i = tid
            while i < count:
                keys[base + i] = s[i]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            t += uint64(cuda.gridDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def merge_tile_kernel(tile: int, probes: int):
    """kernel(out, keys, rows, n, width): runs of ``width`` sorted keys merged in pairs, keys
    -> out, each row of n; a block makes ``tile`` consecutive outputs of a row (2 width is a
    multiple of tile). Merge path (Odeh et al.): the block's first and last output split the
    pair's two runs at i and d - i (a 32-ary search each); the block loads those slices of
    the runs into shared memory (coalesced) and moves each key to its rank there."""
    PROBES = probes
    ut, up = uint64(tile), uint64(PROBES)
    nflags = 2 * PROBES                      # (a compile-time constant for the shared array)

    @jit
    def kernel(out, keys, rows, n, width):
        sh = cuda.shared.array(tile, uint64)
        cut = cuda.shared.array(2, uint64)
        flags = cuda.shared.array(nflags, uint8)
        tid = uint64(cuda.threadIdx.x)
        per_row = (n + ut - uint64(1)) // ut
        task = uint64(cuda.blockIdx.x)
        while task < rows * per_row:
            r = task // per_row
            o0 = (task - r * per_row) * ut                  # the tile's first output in the row
            start = o0 // (uint64(2) * width) * (uint64(2) * width)   # its pair of runs
            la = min(width, n - start)
            lb = min(width, n - start - la)
            a = r * n + start                           # run A; run B at a + la
            # the splits at outputs d0 and d0 + tile: the first i with A[i] > B[d - i - 1]
            # (i keys of A among the first d outputs), PROBES threads each probing one of
            # PROBES points of the range a round (a 32-ary search: 3 rounds of global loads
            # for a range of 2048, not 11)
            side, lane = tid // up, tid % up
            active = side < uint64(2)
            d = min(o0 - start + side * ut, la + lb)
            lo = d - min(d, lb) if active else uint64(0)
            hi = min(d, la) if active else uint64(0)
            while cuda.syncthreads_or(int32(lo < hi)):
                if lo < hi:
                    q = lo + (hi - lo) * lane // up
                    flags[tid] = keys[a + q] < keys[a + la + d - q - uint64(1)]
                cuda.syncthreads()
                if lo < hi:
                    cnt = uint64(0)
                    for j in range(PROBES):
                        cnt += uint64(flags[side * up + uint64(j)])
                    if cnt == uint64(0):
                        hi = lo
                    else:
                        nlo = lo + (hi - lo) * (cnt - uint64(1)) // up + uint64(1)
                        if cnt < up:
                            hi = lo + (hi - lo) * cnt // up
                        lo = nlo
                cuda.syncthreads()
            if active and lane == uint64(0):
                cut[side] = lo
            cuda.syncthreads()
            i0, i1 = cut[0], cut[1]
            d0 = o0 - start
            j0 = d0 - i0
            na = i1 - i0
            nb = min(d0 + ut, la + lb) - d0 - na
            k = tid
            while k < na + nb:                          # A's slice, then B's
                sh[k] = keys[a + i0 + k] if k < na else keys[a + la + j0 + k - na]
                k += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            k = tid
            while k < na + nb:
                key = sh[k]
                if k < na:                              # B's keys below it
                    lo, hi, base, own = uint64(0), nb, na, k
                else:                                   # A's keys below it
                    lo, hi, base, own = uint64(0), na, uint64(0), k - na
                while lo < hi:
                    mid = (lo + hi) // uint64(2)
                    if sh[base + mid] < key:
                        lo = mid + uint64(1)
                    else:
                        hi = mid
                out[a + d0 + own + lo] = key
                k += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            task += uint64(cuda.gridDim.x)

    return kernel


@jit
def index_kernel(idx, keys, total):
    """idx[i] = the index held in keys[i] (its low 32 bits), as i64."""
    i = uint64(cuda.grid(1))
    while i < total:
        idx[i] = keys[i] & uint64(0xFFFFFFFF)
        i += uint64(cuda.gridsize(1))
