"""Rotary position embedding and the KV-cache row write.

``rope``: x and out are the flat f32 storage of [B, H, S, D]. A row is one (b, h, s); its
``ncols = n_rot/2 + (D - n_rot)`` work items are the rotated pairs followed by the passed-through
dims. Threads along grid x take consecutive items of a row, so the loads and stores of a warp
are contiguous (NeoX pairs (i, i + n_rot/2): two coalesced streams; GPT-J pairs (2i, 2i + 1):
one stream read as two strided halves of the same cache lines). A thread owns the same item in
HPT heads of one (b, s): it loads cos/sin once and issues all 2 x HPT loads of x before its
first store. Grid y walks the rows (b, head group, s), s fastest, so neighbouring y threads
touch neighbouring rows. Pair i's columns are (i * pair_mul, i * pair_mul + pair_gap): (1,
n_rot/2) for NeoX, (2, 1) for GPT-J, so one kernel serves both with no branch.

``kv_write``: rows (b, h, j) of new [B, H, s, D] go to row position + j of the cache
[B, H, max_S, D]; rows landing outside [0, max_S) are dropped.

``rope_kv_write``: the packed [B, S, (Hq + 2 Hkv) * D] output of a fused Q/K/V product read in
place; a row is one (token, head) (heads fastest, so neighbouring rows read neighbouring bytes):
query heads rotate into q [B, Hq, S, D], key heads rotate into the k cache, value heads are
copied into the v cache, both at row cache_position + s of [B, Hkv, max_S, D].

x, q, qkv and the caches are f32, f16 or bf16 (one storage ``kind`` a kernel, the cos / sin
tables ``tkind``: f32 or the same; kernels made by the factories below through
kernels/halfio.py): loads widen to f32, the rotation is f32 math, and each store rounds once;
the values copied into the v cache move bit for bit.

All index math is uint64 (every scalar argument is np.uint64, literals are wrapped), see
kernels/shape.py; only positions, which may be negative, are int64 until clamped.
"""
import functools

from numba import cuda, float32, int64, uint64

from ..device import SIMULATOR
from . import halfio, ptx
from .launch import inline, jit
from .shape import copy_span

HPT = 2 if SIMULATOR else 4     # heads a thread (the same pair of each)


@functools.cache
def rope(kind: str = "f32", tkind: str = "f32"):
    """The rope kernel for x and out of storage ``kind``, cos / sin of ``tkind``."""
    ld, st, ldt = halfio.load(kind), halfio.store(kind), halfio.load(tkind)

    @jit
    def rope_kernel(out, x, cos, sin, pos, nrows, S, H, ngroups, D, half, ncols, pair_mul,
                    pair_gap, offset, pos_bstride, use_pos, max_pos):
        """out = x rotated; see the module docstring. Row r = (b * ngroups + hg) * S + s covers
        heads hg * HPT .. hg * HPT + HPT - 1 (those < H). The position of (b, s) is
        positions[b * pos_bstride + s] clamped to [0, max_pos - 1] when ``use_pos``, else
        offset + s. Grid: x along the row's items, y over rows."""
        va = cuda.local.array(HPT, float32)
        vb = cuda.local.array(HPT, float32)
        c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
        xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
        r = uint64(cuda.threadIdx.y) + uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y)
        ystep = uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
        hstride = S * D
        hpt = uint64(HPT)
        while r < nrows:
            q = r // S
            s = r - q * S
            b = q // ngroups
            h0 = (q - b * ngroups) * hpt
            if use_pos:
                v = int64(pos[b * pos_bstride + s])
                if v < int64(0):
                    v = int64(0)
                if v >= max_pos:
                    v = max_pos - int64(1)
                p = uint64(v)
            else:
                p = offset + s
            base = ((b * H + h0) * S + s) * D
            c = c0
            while c < ncols:
                if c < half:
                    cs = ldt(cos, p * half + c)
                    sn = ldt(sin, p * half + c)
                    i0 = base + c * pair_mul
                    i1 = i0 + pair_gap
                    for u in range(HPT):
                        if h0 + uint64(u) < H:
                            va[u] = ld(x, i0 + uint64(u) * hstride)
                            vb[u] = ld(x, i1 + uint64(u) * hstride)
                    for u in range(HPT):
                        if h0 + uint64(u) < H:
                            st(out, i0 + uint64(u) * hstride, va[u] * cs - vb[u] * sn)
                            st(out, i1 + uint64(u) * hstride, vb[u] * cs + va[u] * sn)
                else:   # passed through: column n_rot + (c - half) = c + half
                    i0 = base + c + half
                    for u in range(HPT):
                        if h0 + uint64(u) < H:
                            va[u] = ld(x, i0 + uint64(u) * hstride)
                    for u in range(HPT):
                        if h0 + uint64(u) < H:
                            st(out, i0 + uint64(u) * hstride, va[u])
                c += xstep
            r += ystep

    return rope_kernel


@jit
def kv_write(cache, new, pos, position, use_pos, nrows, s, max_s, D):
    """cache[bh, p + j, :] = new[bh, j, :] for the nrows = B * H * s rows (bh, j) of new, with
    p = pos[0] when ``use_pos`` else ``position`` (int64); rows with p + j outside
    [0, max_s) are skipped. cache and new are same-width raw views. Grid: x along D, y over
    rows."""
    c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
    xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
    r = uint64(cuda.threadIdx.y) + uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y)
    ystep = uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
    p = int64(pos[0]) if use_pos else position
    while r < nrows:
        bh = r // s
        j = r - bh * s
        t = p + int64(j)
        if t >= int64(0) and t < int64(max_s):
            copy_span(cache, (bh * max_s + uint64(t)) * D, new, r * D, c0, D, xstep)
        r += ystep


@functools.cache
def rotate_row_fn(kind: str, tkind: str):
    """_rotate_row for src and dst of storage ``kind``, cos / sin of ``tkind`` (also the decode
    attention kernel's, which folds rope_kv_write in: kernels/attention.py, with ``rope_pos``
    below)."""
    ld, st, ldt = halfio.load(kind), halfio.store(kind), halfio.load(tkind)

    @cuda.jit(device=True)
    def _rotate_row(dst, do, src, so, cos, sin, cb, c, ncols, half, pair_mul, pair_gap, step):
        """One head's items c, c + step, ... < ncols (rope's: rotated pairs, then the
        passed-through dims) from src[so:] to dst[do:]; cos/sin of its position start at cb."""
        while c < ncols:
            if c < half:
                i0 = c * pair_mul
                i1 = i0 + pair_gap
                a = ld(src, so + i0)
                b = ld(src, so + i1)
                cs = ldt(cos, cb + c)
                sn = ldt(sin, cb + c)
                st(dst, do + i0, a * cs - b * sn)
                st(dst, do + i1, b * cs + a * sn)
            else:
                dst[do + c + half] = src[so + c + half]     # (same dtype: the bits as they are)
            c += step

    return _rotate_row


@inline
def rope_pos(pos, i, use_pos, t, max_pos):
    """A token's rope position: pos[i] when ``use_pos`` else t (int64), clamped to
    [0, max_pos - 1] (rope_kv_write's rule)."""
    v = int64(pos[i]) if use_pos else t
    if v < int64(0):
        v = int64(0)
    if v >= max_pos:
        v = max_pos - int64(1)
    return v


@functools.cache
def rope_kv_write(kind: str = "f32", tkind: str = "f32", pdl: bool = False):
    """The rope_kv_write kernel for qkv, q and the caches of storage ``kind``, cos / sin of
    ``tkind``; ``pdl``: launched as a programmatic dependent (kernels/ptx.py), it lets the next
    kernel start and waits for the one before first."""
    _rotate_row = rotate_row_fn(kind, tkind)

    @jit
    def rope_kv_write_kernel(q, k_cache, v_cache, qkv, cos, sin, cpos, cache_position, use_cpos,
                             pos, pos_bstride, use_pos, nrows, S, Hq, Hkv, NH, D, half, ncols,
                             pair_mul, pair_gap, max_s, max_pos):
        """See the module docstring. Row r = (b * S + s) * NH + h over the NH = Hq + 2 Hkv heads
        of token (b, s); its cache row is t = p0 + s with p0 = cpos[0] when ``use_cpos`` else
        ``cache_position`` (rows outside [0, max_s) are dropped); its rope position is
        pos[b * pos_bstride + s] when ``use_pos`` else t, clamped to [0, max_pos - 1].
        Grid: x along the head's items, y over rows."""
        if pdl:
            ptx.grid_launch_dependents()
            ptx.grid_wait()
        c0 = uint64(cuda.threadIdx.x) + uint64(cuda.blockIdx.x) * uint64(cuda.blockDim.x)
        xstep = uint64(cuda.gridDim.x) * uint64(cuda.blockDim.x)
        r = uint64(cuda.threadIdx.y) + uint64(cuda.blockIdx.y) * uint64(cuda.blockDim.y)
        ystep = uint64(cuda.gridDim.y) * uint64(cuda.blockDim.y)
        p0 = int64(cpos[0]) if use_cpos else cache_position
        while r < nrows:
            tok = r // NH
            h = r - tok * NH
            b = tok // S
            s = tok - b * S
            src = r * D                  # rows of qkv are the (token, head) rows themselves
            t = p0 + int64(s)
            cb = uint64(rope_pos(pos, b * pos_bstride + s, use_pos, t, max_pos)) * half
            if h < Hq:
                _rotate_row(q, ((b * Hq + h) * S + s) * D, qkv, src, cos, sin, cb, c0, ncols,
                            half, pair_mul, pair_gap, xstep)
            elif t >= int64(0) and t < int64(max_s):
                hk = h - Hq
                if hk < Hkv:
                    _rotate_row(k_cache, ((b * Hkv + hk) * max_s + uint64(t)) * D, qkv, src, cos,
                                sin, cb, c0, ncols, half, pair_mul, pair_gap, xstep)
                else:
                    do = ((b * Hkv + hk - Hkv) * max_s + uint64(t)) * D
                    c = c0
                    while c < D:
                        v_cache[do + c] = qkv[src + c]
                        c += xstep
            r += ystep

    return rope_kv_write_kernel
