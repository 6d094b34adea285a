"""Quantised weights: dequantise-in-registers GEMV, and dequantise to f32 (the GEMM path).

A weight is [N, K] like nn.Linear, one row of packed data per output column. Every scheme
is read as *units* of 32 consecutive weights of a row: a GGUF block of 32 (q4_0 .. q8_0) is
one unit, a K-quant super-block of 256 is 8 (each with its own scale and min, in the layouts
of ggml-quants.c: ``dequantize_row_*``), int8 / int4 take 32 of a row with the scale (and
zero) of its group. ``unit_fn(scheme)`` returns the device function that writes a unit's 32
values into a local array; the GEMV and the dequantise kernels share it.

The packed bytes are read as uint16 halfwords (every GGUF block is an even number of bytes,
2-byte aligned at least; int8 / int4 rows of a multiple of 32 weights are too): half the
load instructions of byte loads, and a halfword's two bytes are split in registers.

GEMV (decode, M <= MAX_M rows of x): a warp holds ``r`` rows of W; lane l takes units
l, l + 32 wpr, ... of its rows (``wpr`` warps of a block share a row group, splitting its K:
short-N products still fill the GPU), so the x values of a unit are loaded once for the r
rows (held in registers when M = 1). Sums are f32 in a fixed order; a warp reduce-scatter
(attention.reduce_scatter) and the row group's warps' sums, added in warp order, give each
y value: deterministic, no atomics. x is not rounded: the contract is f32 arithmetic.
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int32, int64

from ..device import SIMULATOR
from ..ir.ops_quant import GGUF, UNIT
from . import ptx
from .attention import reduce_scatter
from .launch import jit, pow2_at_least

ZERO = float32(0.0)

_inline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


@_inline
def _f16(h):
    """float32 of the f16 bit pattern h (a halfword)."""
    return ptx.h2f(int32(h) & int32(0xFFFF))[0]


@_inline
def _byte(w, hb, c):
    """Byte c of the block starting at halfword hb (c a constant after unrolling)."""
    return (int32(w[hb + (c >> 1)]) >> ((c & 1) * 8)) & 0xFF


@_inline
def _u32(w, hb, c):
    """The little-endian uint32 at byte c (even) of the block at halfword hb, as int64."""
    return int64(w[hb + (c >> 1)]) | (int64(w[hb + (c >> 1) + 1]) << 16)


@_inline
def _i8(b):
    return b - ((b & 0x80) << 1)


# ---- GGUF units: w a uint16 view, hb the block's first halfword, s the unit of the block ----
@_inline
def _q4_0(w, hb, s, wv):
    d = _f16(w[hb])
    for j in range(16):
        b = _byte(w, hb, 2 + j)
        wv[j] = float32((b & 15) - 8) * d
        wv[j + 16] = float32((b >> 4) - 8) * d


@_inline
def _q4_1(w, hb, s, wv):
    d, m = _f16(w[hb]), _f16(w[hb + 1])
    for j in range(16):
        b = _byte(w, hb, 4 + j)
        wv[j] = float32(b & 15) * d + m
        wv[j + 16] = float32(b >> 4) * d + m


@_inline
def _q5_0(w, hb, s, wv):
    d = _f16(w[hb])
    qh = _u32(w, hb, 2)
    for j in range(16):
        b = _byte(w, hb, 6 + j)
        lo = (b & 15) | int32(((qh >> j) << 4) & 16)
        hi = (b >> 4) | int32((qh >> (j + 12)) & 16)
        wv[j] = float32(lo - 16) * d
        wv[j + 16] = float32(hi - 16) * d


@_inline
def _q5_1(w, hb, s, wv):
    d, m = _f16(w[hb]), _f16(w[hb + 1])
    qh = _u32(w, hb, 4)
    for j in range(16):
        b = _byte(w, hb, 8 + j)
        lo = (b & 15) | int32(((qh >> j) << 4) & 16)
        hi = (b >> 4) | int32((qh >> (j + 12)) & 16)
        wv[j] = float32(lo) * d + m
        wv[j + 16] = float32(hi) * d + m


@_inline
def _q8_0(w, hb, s, wv):
    d = _f16(w[hb])
    for j in range(32):
        wv[j] = float32(_i8(_byte(w, hb, 2 + j))) * d


@_inline
def _q2_k(w, hb, s, wv):
    # scales[16] qs[64] d dmin; unit s = 4 h + j: qs[32 h + l] >> 2 j, scales 2 s, 2 s + 1
    d, dmin = _f16(w[hb + 40]), _f16(w[hb + 41])
    qo, shift = 16 + 32 * (s >> 2), 2 * (s & 3)
    for half in range(2):
        sc = _byte(w, hb, 2 * s + half)
        dl, ml = d * float32(sc & 15), dmin * float32(sc >> 4)
        for l in range(16):
            q = (_byte(w, hb, qo + 16 * half + l) >> shift) & 3
            wv[16 * half + l] = dl * float32(q) - ml


@_inline
def _q3_k(w, hb, s, wv):
    # hmask[32] qs[64] scales[12] d; 6-bit scales: low 4 bits from bytes 0..7, high 2 from 8..11
    d = _f16(w[hb + 54])
    qo, shift, hbit = 32 + 32 * (s >> 2), 2 * (s & 3), 1 << s
    for half in range(2):
        si = 2 * s + half
        lo4 = (_byte(w, hb, 96 + (si & 7)) >> (4 * (si >> 3))) & 15
        hi2 = (_byte(w, hb, 104 + (si & 3)) >> (2 * (si >> 2))) & 3
        dl = d * float32((lo4 | (hi2 << 4)) - 32)
        for l in range(16):
            q = (_byte(w, hb, qo + 16 * half + l) >> shift) & 3
            if (_byte(w, hb, 16 * half + l) & hbit) == 0:
                q -= 4
            wv[16 * half + l] = dl * float32(q)


@_inline
def _scale_min_k4(w, hb, j):
    """ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (scales at byte 4)."""
    if j < 4:
        return _byte(w, hb, 4 + j) & 63, _byte(w, hb, 8 + j) & 63
    sc = (_byte(w, hb, 8 + j) & 15) | ((_byte(w, hb, j) >> 6) << 4)
    mn = (_byte(w, hb, 8 + j) >> 4) | ((_byte(w, hb, 4 + j) >> 6) << 4)
    return sc, mn


@_inline
def _q4_k(w, hb, s, wv):
    # d dmin scales[12] qs[128]; unit s: qs[32 (s // 2) + l], low nibble for even s
    d, dmin = _f16(w[hb]), _f16(w[hb + 1])
    sc, mn = _scale_min_k4(w, hb, s)
    dl, ml = d * float32(sc), dmin * float32(mn)
    qo, shift = 16 + 32 * (s >> 1), 4 * (s & 1)
    for l in range(32):
        wv[l] = dl * float32((_byte(w, hb, qo + l) >> shift) & 15) - ml


@_inline
def _q5_k(w, hb, s, wv):
    # d dmin scales[12] qh[32] qs[128]; the fifth bit of unit s is bit s of qh[l]
    d, dmin = _f16(w[hb]), _f16(w[hb + 1])
    sc, mn = _scale_min_k4(w, hb, s)
    dl, ml = d * float32(sc), dmin * float32(mn)
    qo, shift = 48 + 32 * (s >> 1), 4 * (s & 1)
    for l in range(32):
        q = ((_byte(w, hb, qo + l) >> shift) & 15) | (((_byte(w, hb, 16 + l) >> s) & 1) << 4)
        wv[l] = dl * float32(q) - ml


@_inline
def _q6_k(w, hb, s, wv):
    # ql[128] qh[64] scales[16] (int8) d; unit s = 4 h + j
    d = _f16(w[hb + 104])
    h, j = s >> 2, s & 3
    lo, nib, ho, hs = 64 * h + 32 * (j & 1), 4 * (j >> 1), 128 + 32 * h, 2 * j
    for half in range(2):
        dl = d * float32(_i8(_byte(w, hb, 192 + 8 * h + 2 * j + half)))
        for l in range(16):
            ll = 16 * half + l
            q = ((_byte(w, hb, lo + ll) >> nib) & 15) | (((_byte(w, hb, ho + ll) >> hs) & 3) << 4)
            wv[ll] = dl * float32(q - 32)


_GGUF_UNITS = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
               "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


@functools.lru_cache(maxsize=None)
def unit_fn(scheme: str, has_zero: bool = False):
    """``unit(w, sc, zr, row, u, rowhw, ng, gsu, wv)``: wv[0..31] <- weights 32 u .. 32 u + 31
    of ``row``. w: the packed data as uint16 (rowhw halfwords a row); int8 / int4: sc / zr the
    f32 scales / zeros [N, ng] (zr unused unless has_zero; the zero is 8 then), gsu units a
    group."""
    if scheme in GGUF:
        f = _GGUF_UNITS[scheme]
        qk, bb = GGUF[scheme]
        upb, bhw = qk // UNIT, bb // 2

        @_inline
        def unit(w, sc, zr, row, u, rowhw, ng, gsu, wv):
            f(w, row * rowhw + (u // upb) * bhw, u % upb, wv)
        return unit
    if scheme == "int8":
        @_inline
        def unit(w, sc, zr, row, u, rowhw, ng, gsu, wv):
            s = sc[row * ng + u // gsu]
            hb = row * rowhw + 16 * u
            for j in range(32):
                wv[j] = float32(_i8(_byte(w, hb, j))) * s
        return unit

    @_inline
    def unit(w, sc, zr, row, u, rowhw, ng, gsu, wv):
        g = row * ng + u // gsu
        s = sc[g]
        z = zr[g] if has_zero else float32(8.0)
        hb = row * rowhw + 8 * u
        for j in range(16):
            b = _byte(w, hb, j)
            wv[2 * j] = (float32(b & 15) - z) * s
            wv[2 * j + 1] = (float32(b >> 4) - z) * s
    return unit


# ---- GEMV ---------------------------------------------------------------------------------
def plan(m: int, n: int, sm: int):
    """(nw, r, wpr, tiles): warps a block, rows a warp, warps sharing a row group, and row
    groups (blocks). r * m <= 32 sums a lane (one reduce-scatter round); warps split K
    (wpr > 1) while there would be fewer than 4 blocks a SM."""
    if SIMULATOR:
        nw, r = 2, min(2, max(1, 32 // m))
        wpr = 2 if n <= 4 else 1
    else:
        nw, r = 4, max(1, min(4, 32 // m))
        wpr = 1
        while wpr < nw and -(-n // (r * nw // wpr)) < 4 * sm:
            wpr *= 2
    return nw, r, wpr, -(-n // (r * nw // wpr))


@functools.lru_cache(maxsize=None)
def gemv_kernel(scheme: str, m: int, nw: int, r: int, wpr: int, has_zero: bool, xvec: bool):
    """y[M, N] = x[M, K] @ dequant(W)^T for M = m. Launch: grid (blocks,), block nw * 32;
    arguments (y, x, w, sc, zr, n, k, units, rowhw, ng, gsu). ``xvec``: x's rows are
    16-byte aligned (16-byte loads)."""
    unit = unit_fn(scheme, has_zero)
    nv = r * m
    nvp = pow2_at_least(nv)
    assert nvp <= 32 and nw % wpr == 0
    rep = 32 // nvp
    teams = nw // wpr
    rows_blk = teams * r
    xr_shape = (nw, 32, nvp) if SIMULATOR else (1, 1, 1)

    @_inline
    def dot_x(wv, x, base):
        s = ZERO
        if xvec:
            for i in range(8):
                x4 = ptx.ld4(x, base + 4 * i)
                s += wv[4 * i] * x4[0] + wv[4 * i + 1] * x4[1] + wv[4 * i + 2] * x4[2] \
                    + wv[4 * i + 3] * x4[3]
        else:
            for i in range(32):
                s += wv[i] * x[base + i]
        return s

    @jit
    def kernel(y, x, w, sc, zr, n, k, units, rowhw, ng, gsu):
        xs = cuda.shared.array((nw, 32), float32)        # shuffle stand-in (simulator)
        xr = cuda.shared.array(xr_shape, float32)
        red = cuda.shared.array((nw, nvp), float32)
        acc = cuda.local.array(nvp, float32)
        wv = cuda.local.array(UNIT, float32)
        xv = cuda.local.array(UNIT, float32)
        tid = cuda.threadIdx.x
        lane, wp = tid % 32, tid // 32
        team, tw = wp // wpr, wp % wpr
        tiles = (n + rows_blk - 1) // rows_blk
        tile = int64(cuda.blockIdx.x)
        while tile < tiles:                   # uniform across the block (barriers inside)
            row0 = tile * rows_blk + team * r
            for i in range(nvp):
                acc[i] = ZERO
            u = int64(tw * 32 + lane)
            while u < units:
                kb = u * UNIT
                if m == 1:                    # x of the unit in registers for the r rows
                    for i in range(UNIT):
                        xv[i] = x[kb + i]
                for rr in range(r):
                    unit(w, sc, zr, min(row0 + rr, n - 1), u, rowhw, ng, gsu, wv)
                    if m == 1:
                        s = ZERO
                        for i in range(UNIT):
                            s += wv[i] * xv[i]
                        acc[rr] += s
                    else:
                        for mm in range(m):
                            acc[rr * m + mm] += dot_x(wv, x, mm * k + kb)
                u += 32 * wpr
            reduce_scatter(acc, nvp, xs, xr, wp, lane)
            if lane % rep == 0:
                red[wp, lane // rep] = acc[0]
            cuda.syncthreads()
            if tid < teams * nv:
                tm, i = tid // nv, tid % nv
                v = red[tm * wpr, i]
                for ww in range(1, wpr):
                    v += red[tm * wpr + ww, i]
                row = tile * rows_blk + tm * r + i // m
                if row < n:
                    y[(i % m) * n + row] = v
            cuda.syncthreads()
            tile += cuda.gridDim.x

    return kernel


# ---- dequantise to f32 (the GEMM path) ----------------------------------------------------
@functools.lru_cache(maxsize=None)
def dequant_units_kernel(scheme: str, has_zero: bool):
    """out[N, K] f32 <- W, a thread a unit (grid-stride). Arguments (out, w, sc, zr, n, k,
    units, rowhw, ng, gsu)."""
    unit = unit_fn(scheme, has_zero)

    @jit
    def kernel(out, w, sc, zr, n, k, units, rowhw, ng, gsu):
        wv = cuda.local.array(UNIT, float32)
        i = int64(cuda.grid(1))
        while i < n * units:
            row, u = i // units, i % units
            unit(w, sc, zr, row, u, rowhw, ng, gsu, wv)
            base = row * k + u * UNIT
            for j in range(UNIT):
                out[base + j] = wv[j]
            i += cuda.gridsize(1)

    return kernel


@functools.lru_cache(maxsize=None)
def dequant_ints_kernel(scheme: str, has_zero: bool):
    """out[N, K] f32 <- an int8 / int4 W of any (for int4 even) K and group size, a thread an element
    (grid-stride). w: the bytes (uint8 / int8); arguments (out, w, sc, zr, n, k, ng, gs)."""
    int4 = scheme == "int4"

    @jit
    def kernel(out, w, sc, zr, n, k, ng, gs):
        i = int64(cuda.grid(1))
        while i < n * k:
            row, c = i // k, i % k
            g = row * ng + c // gs
            if int4:
                b = int32(w[row * (k // 2) + c // 2])
                q = float32((b >> (4 * (c % 2))) & 15)
                out[i] = (q - (zr[g] if has_zero else float32(8.0))) * sc[g]
            else:
                out[i] = float32(w[i]) * sc[g]
            i += cuda.gridsize(1)

    return kernel
