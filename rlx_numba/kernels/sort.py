"""A stable sort of rows (ir/ops_sort.py): each element becomes one uint64 key, its value's
order-preserving bits above its index, so every key is distinct and sorting the keys sorts the
values with ties in index order (stable), for either direction:
  f32: -0.0 as +0.0, a NaN as the largest (after +inf, as torch); bits b -> b | 2^31 for a
  sign bit 0, ~b (32 bits) for 1; i32: b ^ 2^31; descending: the bits inverted (ties still by index).
  1. key_kernel: the keys;
  2. tile_sort_kernel(P): a block a tile of P keys of a row (a power of two: the whole row
     when it fits in shared memory), bitonic in shared memory, padded with 2^64 - 1;
  3. merge_kernel: pairs of sorted runs of ``width`` merged in global memory, each key moved
     to its rank (its place in its run + the number of smaller keys in the other run, by
     binary search), ping-ponging between two arrays, until one run spans the row;
  4. the indices are the keys' low 32 bits (index_kernel); values gather them.
"""
import functools

from numba import cuda, uint32, uint64

from ..device import SIMULATOR
from .launch import jit

TILE = 8 if SIMULATOR else 2048        # keys a block sorts in shared memory (16 KiB)
THREADS = 4 if SIMULATOR else 512
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
    half = p // 2
    up = uint64(p)

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
            size = uint64(2)
            while size <= up:
                stride = size // uint64(2)
                while stride > uint64(0):
                    j = tid
                    while j < uint64(half):
                        lo = uint64(2) * j - (j & (stride - uint64(1)))
                        hi = lo + stride
                        a, b = s[lo], s[hi]
                        if (a > b) == ((lo & size) == uint64(0)):
                            s[lo], s[hi] = b, a
                        j += uint64(cuda.blockDim.x)
                    cuda.syncthreads()
                    stride //= uint64(2)
                size *= uint64(2)
            i = tid
            while i < count:
                keys[base + i] = s[i]
                i += uint64(cuda.blockDim.x)
            cuda.syncthreads()
            t += uint64(cuda.gridDim.x)

    return kernel


@jit
def merge_kernel(out, keys, rows, n, width):
    """Runs of ``width`` sorted keys merged in pairs: keys -> out, each row of n."""
    i = uint64(cuda.grid(1))
    while i < rows * n:
        r, p = i // n, i % n
        q = p // width
        start = q * width
        other = (q ^ uint64(1)) * width
        key = keys[i]
        dest = p
        if other < n:
            lo = uint64(0)
            hi = min(width, n - other)
            base = r * n + other
            while lo < hi:                      # the other run's keys below key
                mid = (lo + hi) // uint64(2)
                if keys[base + mid] < key:
                    lo = mid + uint64(1)
                else:
                    hi = mid
            dest = min(start, other) + (p - start) + lo
        out[r * n + dest] = key
        i += uint64(cuda.gridsize(1))


@jit
def index_kernel(idx, keys, total):
    """idx[i] = the index held in keys[i] (its low 32 bits), as i64."""
    i = uint64(cuda.grid(1))
    while i < total:
        idx[i] = keys[i] & uint64(0xFFFFFFFF)
        i += uint64(cuda.gridsize(1))
