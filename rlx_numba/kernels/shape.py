"""Shape-op kernels: the tiled transpose, row copies (transpose that keeps the last axis,
narrow, concat), gather and scatter_add.

Arrays are the flat 1-D storage views of the arena. The copies never look at values, so the
lowerings pass unsigned views of the element width (uint8/16/32/64): one compiled kernel per
width, not per dtype. Every scalar argument is a np.uint64 and all index math is uint64: numba
adds a negative-index wraparound to signed subscripts, and a signed operand (a bare int literal)
would make the result signed again, so every literal is wrapped in uint64() too.

Launch geometry comes from kernels/launch.py; each kernel grid-strides over every grid axis, so
any clamped grid (the simulator's 2 x 2 x 1 blocks included) covers the whole tensor.
"""
from numba import cuda, int64, uint64

from ..device import SIMULATOR
from .launch import jit

# Transpose tile: TILE x TILE elements through shared memory (one padding column, so reading a
# column hits 32 different banks), TILE x ROWS threads, each moving ELEMS = TILE // ROWS
# elements. 32 x 2 threads with 16 elements each measured fastest on an H200 (3.5 TB/s at
# 32768 x 4096 f32, against 2.6 TB/s for 32 x 8 threads with 4 and 1.9 for 64-wide tiles).
TILE = 8 if SIMULATOR else 32
ROWS = 2
ELEMS = TILE // ROWS
PADDED = TILE + 1     # a literal for cuda.shared.array (an expression there is not constant)
# Row copies (copy_rows, gather): elements per thread per loop trip, all loaded before stored.
SPAN = 4 if SIMULATOR else 8


@cuda.jit(device=True)
def _batch_offset(z, d1, d2, s0, s1, s2):
    """sum c_i * s_i for z = (c0 * d1 + c1) * d2 + c2 (no division when d1 = d2 = 1)."""
    if d1 == uint64(1) and d2 == uint64(1):
        return z * s0
    q = z // d2
    c2 = z - q * d2
    c0 = q // d1
    return c0 * s0 + (q - c0 * d1) * s1 + c2 * s2


@jit
def transpose_tiled(dst, src, na, nb, src_sb, dst_sa, tiles_a, tiles_b, nbatch, d1, d2,
                    s0, s1, s2, t0, t1, t2, src_base, dst_base):
    """dst[a, b] = src[b, a] for each batch z: ``a`` runs along src's contiguous axis (na
    elements), ``b`` along dst's (nb). The src offset of (z, b, a) is src_base + S(z) + b *
    src_sb + a and the dst offset of (z, a, b) is dst_base + T(z) + a * dst_sa + b, with z
    split into up to three batch coordinates (see _batch_offset; strides s* for src, t* for
    dst). Every parameter is a scalar: no dependent loads before the tile's loads.

    Grid: x over tiles of a, y over tiles of b, z over the batch. A block reads a TILE x TILE
    tile with rows along a (coalesced) and writes it back with rows along b (coalesced); each
    thread issues its ELEMS loads before any store. Edge tiles guard every element.
    """
    tile = cuda.shared.array((TILE, PADDED), src.dtype)
    regs = cuda.local.array(ELEMS, src.dtype)
    t_ = uint64(TILE)
    r_ = uint64(ROWS)
    tx = uint64(cuda.threadIdx.x)
    ty = uint64(cuda.threadIdx.y)
    z = uint64(cuda.blockIdx.z)
    while z < nbatch:
        so = src_base + _batch_offset(z, d1, d2, s0, s1, s2)
        do = dst_base + _batch_offset(z, d1, d2, t0, t1, t2)
        tb = uint64(cuda.blockIdx.y)
        while tb < tiles_b:
            b0 = tb * t_
            ta = uint64(cuda.blockIdx.x)
            while ta < tiles_a:
                a0 = ta * t_
                if a0 + t_ <= na and b0 + t_ <= nb:
                    s = r_ * src_sb
                    i = so + (b0 + ty) * src_sb + a0 + tx
                    for j in range(ELEMS):
                        regs[j] = src[i + uint64(j) * s]
                    for j in range(ELEMS):
                        tile[ty + uint64(j) * r_, tx] = regs[j]
                    cuda.syncthreads()
                    for j in range(ELEMS):
                        regs[j] = tile[tx, ty + uint64(j) * r_]
                    t = r_ * dst_sa
                    o = do + (a0 + ty) * dst_sa + b0 + tx
                    for j in range(ELEMS):
                        dst[o + uint64(j) * t] = regs[j]
                else:   # an edge tile: every element guarded
                    a = a0 + tx
                    for j in range(ELEMS):
                        row = ty + uint64(j) * r_
                        b = b0 + row
                        if a < na and b < nb:
                            tile[row, tx] = src[so + b * src_sb + a]
                    cuda.syncthreads()
                    b = b0 + tx
                    for j in range(ELEMS):
                        row = ty + uint64(j) * r_
                        a = a0 + row
                        if a < na and b < nb:
                            dst[do + a * dst_sa + b] = tile[tx, row]
                cuda.syncthreads()   # the tile is reused by the next trip
                ta += uint64(cuda.gridDim.x)
            tb += uint64(cuda.gridDim.y)
        z += uint64(cuda.gridDim.z)


@cuda.jit(device=True)
def copy_span(dst, do, src, so, c, n, step):
    """dst[do + i] = src[so + i] for i = c, c + step, ... < n; SPAN loads before SPAN stores
    (the last, partial trip too, guarded: a row shorter than SPAN x the threads on it still
    has all its loads in flight at once)."""
    regs = cuda.local.array(SPAN, src.dtype)
    while c + uint64(SPAN - 1) * step < n:
        for j in range(SPAN):
            regs[j] = src[so + c + uint64(j) * step]
        for j in range(SPAN):
            dst[do + c + uint64(j) * step] = regs[j]
        c += uint64(SPAN) * step
    if c < n and c + step >= n:   # one element left (e.g. a row of 1: gather on the last axis)
        dst[do + c] = src[so + c]
    elif c < n:
        for j in range(SPAN):
            if c + uint64(j) * step < n:
                regs[j] = src[so + c + uint64(j) * step]
        for j in range(SPAN):
            if c + uint64(j) * step < n:
                dst[do + c + uint64(j) * step] = regs[j]


@jit
def copy_rows(dst, src, nrows, ncols, dst_off, dst_stride, src_off, d1, d2, s0, s1, s2):
    """Row r (ncols contiguous elements) of dst at dst_off + r * dst_stride is copied from src
    at src_off + S(r), r split into up to three coordinates (see _batch_offset).
    Grid: x along the row, y over rows."""
    c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
    xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
    r = uint64(cuda.threadIdx.y) + uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y)
    ystep = uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
    while r < nrows:
        copy_span(dst, dst_off + r * dst_stride, src, src_off + _batch_offset(r, d1, d2, s0, s1, s2),
                   c0, ncols, xstep)
        r += ystep


@cuda.jit(device=True)
def _wrap(v, d):
    """An index as int64 with negative values wrapped once (v + d)."""
    v = int64(v)
    if v < int64(0):
        v += d
    return v


@jit
def gather(out, table, idx, nouter, nidx, inner, dim):
    """out[o, k, :] = table[o, idx[k], :] with table [nouter, dim, inner] and out [nouter, nidx,
    inner]; an index is clamped to [-dim, dim - 1], then a negative one wraps.
    Grid: x along inner, y over indices, z over nouter."""
    d = int64(dim)
    c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
    xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
    k0 = uint64(cuda.threadIdx.y) + uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y)
    ystep = uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
    o = uint64(cuda.blockIdx.z)
    while o < nouter:
        k = k0
        while k < nidx:
            v = _wrap(idx[k], d)
            if v < int64(0):
                v = int64(0)
            if v >= d:
                v = d - int64(1)
            copy_span(out, (o * nidx + k) * inner, table, (o * dim + uint64(v)) * inner,
                       c0, inner, xstep)
            k += ystep
        o += uint64(cuda.gridDim.z)


@jit
def scatter_add(out, upd, idx, nouter, nidx, inner, dim):
    """out[o, idx[k], :] += upd[o, k, :] (atomically) with out [nouter, dim, inner] and upd
    [nouter, nidx, inner]; a negative index wraps, one still outside [0, dim) is dropped.
    Grid: x along inner, y over indices, z over nouter."""
    d = int64(dim)
    c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
    xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
    k0 = uint64(cuda.threadIdx.y) + uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y)
    ystep = uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
    o = uint64(cuda.blockIdx.z)
    while o < nouter:
        k = k0
        while k < nidx:
            v = _wrap(idx[k], d)
            if v >= int64(0) and v < d:
                to = (o * dim + uint64(v)) * inner
                so = (o * nidx + k) * inner
                c = c0
                while c < inner:
                    cuda.atomic.add(out, to + c, upd[so + c])
                    c += xstep
            k += ystep
        o += uint64(cuda.gridDim.z)


@jit
def scatter_add_ordered(out, upd, idx, nouter, nidx, inner, dim, rows_per):
    """scatter_add with each element's adds in index order (np.add.at's), the same bits every
    run: a block (y: a range of rows_per target rows, z: outer; grid-strided) scans every
    index and adds the update rows that land in its rows, a thread its columns (x). No
    element is added to by two threads, so no atomics."""
    d = int64(dim)
    c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
    xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
    o = uint64(cuda.blockIdx.z)
    while o < nouter:
        r0 = int64(cuda.blockIdx.y) * int64(rows_per)
        while r0 < d:
            r1 = min(r0 + int64(rows_per), d)
            k = uint64(0)
            while k < nidx:
                v = _wrap(idx[k], d)
                if v >= r0 and v < r1:
                    to = (o * dim + uint64(v)) * inner
                    so = (o * nidx + k) * inner
                    c = c0
                    while c < inner:
                        out[to + c] += upd[so + c]
                        c += xstep
                k += uint64(1)
            r0 += int64(cuda.gridDim.y) * int64(rows_per)
        o += uint64(cuda.gridDim.z)
