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
(warp.reduce_scatter) and the row group's warps' sums, added in warp order, give each
y value: deterministic, no atomics. x is not rounded: the contract is f32 arithmetic.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from numba import cuda, float32, int32, int64, uint32

from ..device import SIMULATOR
from ..ir.ops_quant import GGUF, UNIT
from . import elementwise as ew
from . import ptx
from .launch import default_geometry, inline as _inline, jit, pow2_at_least, register_geometry
from .warp import reduce_scatter

ZERO = float32(0.0)

SPLIT16 = ("q4_0", "q4_1", "q5_0", "q5_1")   # byte j holds weights j and j + 16 of a block


@_inline
def _f16(w, i):
    """float32 of the f16 at halfword i of w (a read-only load)."""
    return ptx.h2f(ptx.ldh(w, i))[0]


# Each decoder returns (fa, fb, d, m): the two quads of its weights' integer fields less the
# scheme's offset, as float32, and the lane's scale and bias: weight = f * d + m. The products
# keep d and m out of the inner sum (d * sum f x + m * sum x). The fields are cut out of 32-bit
# words by ptx.fld4 (32-bit integer ops, and the field made a float by OR-ing it into the
# mantissa of 2**23: no int-to-float conversions).
# Offsets: q4_0 8, q5_0 16, q3_k 4 (its field is q + 4 * the hmask bit), q6_k 32, q8_0 / int8
# 128 (the byte ^ 0x80), the others 0.
_OFF0, _OFF4, _OFF8, _OFF16, _OFF32, _OFF128 = (float32(8388608 + o) for o in (0, 4, 8, 16, 32, 128))


@_inline
def _bytes(word, sh, mask, bias):
    """The 4 bytes of word, (b >> sh) & mask less the offset in bias."""
    return ptx.fld4(word, 8, sh, mask, 0, 0, 0, 0, 0, 0, bias)


@_inline
def _bytes_hi(word, sh, mask, hw, hsh, hmask, hpos, bias):
    """As _bytes, OR-ed with bits (hb >> hsh) & hmask << hpos of the matching bytes of hw."""
    return ptx.fld4(word, 8, sh, mask, 0, hw, 8, hsh, hmask, hpos, bias)


# ---- GGUF: w a uint16 view, hb the block's first halfword, s the unit of the block, t the
# lane quarter ------------------------------------------------------------------------------
@_inline
def _q4_0(w, hb, s, t):
    q = ptx.ldw(w, hb + 1 + 2 * t)
    return _bytes(q, 0, 15, _OFF8), _bytes(q, 4, 15, _OFF8), _f16(w, hb), ZERO


@_inline
def _q4_1(w, hb, s, t):
    q = ptx.ldw(w, hb + 2 + 2 * t)
    return _bytes(q, 0, 15, _OFF0), _bytes(q, 4, 15, _OFF0), _f16(w, hb), _f16(w, hb + 1)


@_inline
def _q5_0(w, hb, s, t):
    q, qh = ptx.ldw(w, hb + 3 + 2 * t), ptx.ldw(w, hb + 1)
    return (_bytes_hi(q, 0, 15, ptx.spread4(qh, 4 * t), 0, 1, 4, _OFF16),
            _bytes_hi(q, 4, 15, ptx.spread4(qh, 4 * t + 16), 0, 1, 4, _OFF16), _f16(w, hb), ZERO)


@_inline
def _q5_1(w, hb, s, t):
    q, qh = ptx.ldw(w, hb + 4 + 2 * t), ptx.ldw(w, hb + 2)
    return (_bytes_hi(q, 0, 15, ptx.spread4(qh, 4 * t), 0, 1, 4, _OFF0),
            _bytes_hi(q, 4, 15, ptx.spread4(qh, 4 * t + 16), 0, 1, 4, _OFF0),
            _f16(w, hb), _f16(w, hb + 1))


@_inline
def _signed8(w, h, d):
    """8 int8 bytes from halfword h (b ^ 0x80 = q + 128, less 128)."""
    return (ptx.fld4(ptx.ldw(w, h), 8, 0, 255, 128, 0, 0, 0, 0, 0, _OFF128),
            ptx.fld4(ptx.ldw(w, h + 2), 8, 0, 255, 128, 0, 0, 0, 0, 0, _OFF128), d, ZERO)


@_inline
def _q8_0(w, hb, s, t):
    return _signed8(w, hb + 1 + 4 * t, _f16(w, hb))


@_inline
def _q2_k(w, hb, s, t):
    # scales[16] qs[64] d dmin; unit s = 4 h + j: 2-bit fields j of qs[32 h + l], scale bytes
    # 2 s (l < 16) and 2 s + 1 (low nibble the scale, high the min)
    sw, ss = ptx.ldw(w, hb + s), 8 * (t >> 1)
    h, sh = hb + 8 + 16 * (s >> 2) + 4 * t, 2 * (s & 3)
    return (_bytes(ptx.ldw(w, h), sh, 3, _OFF0), _bytes(ptx.ldw(w, h + 2), sh, 3, _OFF0),
            _f16(w, hb + 40) * ptx.fbits(sw, ss, 15), -_f16(w, hb + 41) * ptx.fbits(sw, ss + 4, 15))


@_inline
def _q3_k(w, hb, s, t):
    # hmask[32] qs[64] scales[12] d: 6-bit scale si = low 4 bits of byte 96 + si % 8 (its
    # high nibble past 8) and high 2 bits of byte 104 + si % 4; the field is q + 4 * (hmask
    # bit s), offset 4
    si = 2 * s + (t >> 1)
    sc = (ptx.fbits(ptx.ldw(w, hb + 48 + 2 * ((si & 7) >> 2)), 8 * (si & 3) + 4 * (si >> 3), 15)
          + float32(16.0) * ptx.fbits(ptx.ldw(w, hb + 52), 8 * (si & 3) + 2 * (si >> 2), 3))
    h, sh = hb + 16 + 16 * (s >> 2) + 4 * t, 2 * (s & 3)
    return (_bytes_hi(ptx.ldw(w, h), sh, 3, ptx.ldw(w, hb + 4 * t), s, 1, 2, _OFF4),
            _bytes_hi(ptx.ldw(w, h + 2), sh, 3, ptx.ldw(w, hb + 4 * t + 2), s, 1, 2, _OFF4),
            _f16(w, hb + 54) * (sc - float32(32.0)), ZERO)


@_inline
def _scale_min_k4(w, hb, j):
    """ggml's get_scale_min_k4 (scales at byte 4), branch-free: the 6-bit scale and min of
    sub-block j as floats."""
    a, b, c = ptx.ldw(w, hb + 2), ptx.ldw(w, hb + 4), ptx.ldw(w, hb + 6)
    sh = 8 * (j & 3)
    sc_lo, mn_lo = ptx.fbits(a, sh, 63), ptx.fbits(b, sh, 63)
    sc_hi = ptx.fbits(c, sh, 15) + float32(16.0) * ptx.fbits(a, sh + 6, 3)
    mn_hi = ptx.fbits(c, sh + 4, 15) + float32(16.0) * ptx.fbits(b, sh + 6, 3)
    return (sc_hi if j >= 4 else sc_lo), (mn_hi if j >= 4 else mn_lo)


@_inline
def _q4_k(w, hb, s, t):
    # d dmin scales[12] qs[128]; unit s: nibble (s % 2) of qs[32 (s // 2) + l]
    sc, mn = _scale_min_k4(w, hb, s)
    h, sh = hb + 8 + 16 * (s >> 1) + 4 * t, 4 * (s & 1)
    return (_bytes(ptx.ldw(w, h), sh, 15, _OFF0), _bytes(ptx.ldw(w, h + 2), sh, 15, _OFF0),
            _f16(w, hb) * sc, -_f16(w, hb + 1) * mn)


@_inline
def _q5_k(w, hb, s, t):
    # d dmin scales[12] qh[32] qs[128]; the fifth bit of unit s is bit s of qh[l]
    sc, mn = _scale_min_k4(w, hb, s)
    h, sh, hh = hb + 24 + 16 * (s >> 1) + 4 * t, 4 * (s & 1), hb + 8 + 4 * t
    return (_bytes_hi(ptx.ldw(w, h), sh, 15, ptx.ldw(w, hh), s, 1, 4, _OFF0),
            _bytes_hi(ptx.ldw(w, h + 2), sh, 15, ptx.ldw(w, hh + 2), s, 1, 4, _OFF0),
            _f16(w, hb) * sc, -_f16(w, hb + 1) * mn)


@_inline
def _q6_k(w, hb, s, t):
    # ql[128] qh[64] scales[16] (int8) d; unit s = 4 h + j: nibble (j // 2) of
    # ql[64 h + 32 (j % 2) + l], 2-bit field j of qh[32 h + l], scale 8 h + 2 j + l // 16
    h, j = s >> 2, s & 3
    lo, hi, nb, hs = hb + 32 * h + 16 * (j & 1) + 4 * t, hb + 64 + 16 * h + 4 * t, 4 * (j >> 1), 2 * j
    si = 8 * h + 2 * j + (t >> 1)                 # int8 scale: byte si of bytes 192 ..
    sc = ptx.fbits(ptx.ldw(w, hb + 96 + 2 * (si >> 2)), 8 * (si & 3), 255)
    d = _f16(w, hb + 104) * (sc - float32(256.0) if sc >= float32(128.0) else sc)
    return (_bytes_hi(ptx.ldw(w, lo), nb, 15, ptx.ldw(w, hi), hs, 3, 4, _OFF32),
            _bytes_hi(ptx.ldw(w, lo + 2), nb, 15, ptx.ldw(w, hi + 2), hs, 3, 4, _OFF32), d, ZERO)


_GGUF_UNITS = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0,
               "q2_k": _q2_k, "q3_k": _q3_k, "q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


@functools.lru_cache(maxsize=None)
def unit_fn(scheme: str, has_zero: bool = False, gshift: int = -1):
    """``unit(w, sc, zr, row, u, t, rowhw, ng, gsu) -> (fa, fb, d, m)``: lane quarter t (0..3)
    of unit u (weights 32 u .. 32 u + 31) of ``row``: weights p0 + i = fa[i] * d + m and
    p1 + i = fb[i] * d + m (i < 4; p0 = 4 t, p1 = 16 + 4 t for SPLIT16 schemes, else 8 t and
    8 t + 4). w: the packed data as uint16 (rowhw halfwords a row); int8 / int4: sc / zr the
    f32 scales / zeros [N, ng] (zr unused unless has_zero: the zero is 8), gsu units a
    group (2**gshift when gshift >= 0: a shift, not a 64-bit division)."""

    @_inline
    def group(row, u, ng, gsu):
        return row * ng + (u >> gshift if gshift >= 0 else u // gsu)

    if scheme in GGUF:
        f = _GGUF_UNITS[scheme]
        qk, bb = GGUF[scheme]
        upb, bhw = qk // UNIT, bb // 2

        @_inline
        def unit(w, sc, zr, row, u, t, rowhw, ng, gsu):
            return f(w, row * rowhw + (u // upb) * bhw, u % upb, t)
        return unit
    if scheme == "int8":
        @_inline
        def unit(w, sc, zr, row, u, t, rowhw, ng, gsu):
            return _signed8(w, row * rowhw + 16 * u + 4 * t, sc[group(row, u, ng, gsu)])
        return unit

    @_inline
    def unit(w, sc, zr, row, u, t, rowhw, ng, gsu):
        g = group(row, u, ng, gsu)
        s = sc[g]
        z = zr[g] if has_zero else float32(8.0)
        h = row * rowhw + 8 * u + 2 * t          # nibble i of the word: weight 8 t + i
        q = ptx.ldw(w, h)
        return (ptx.fld4(q, 4, 0, 15, 0, 0, 0, 0, 0, 0, _OFF0),
                ptx.fld4(q, 4, 16, 15, 0, 0, 0, 0, 0, 0, _OFF0), s, -z * s)
    return unit


# ---- GEMV ---------------------------------------------------------------------------------
def group_shift(gsu: int) -> int:
    """log2 of the units a scale group when a power of two, else -1."""
    return gsu.bit_length() - 1 if gsu & (gsu - 1) == 0 else -1


@dataclass(frozen=True)
class Geometry:
    """``plan``'s shapes: small, the simulator's (one or two warps a block, many rows a warp:
    a Python thread a CUDA thread, a barrier costly), or the GPU's tuned ones."""
    small: bool


GPU, SIM = Geometry(small=False), Geometry(small=True)
register_geometry("quant", gpu=GPU, sim=SIM)


def plan(m: int, n: int, sm: int, scheme: str = "q4_0", geo=None):
    """(nw, r, wpr, tiles, qpl): warps a block, rows a warp, warps sharing a row group, row
    groups (blocks), quarters a lane. r * m <= 32 sums a lane (one reduce-scatter round); at
    least 2 warps split K, more while there would be fewer than 4 blocks a SM. (H200, M = 1,
    11008 x 4096: wpr 2 and qpl 2 were the best of the shapes tried; qpl 4 -- a lane a unit
    -- loses the contiguous x loads and ran 1.4x slower.)

    The 32-bit block formats (SPLIT16: q4_0 .. q5_1) decode a quarter in a few instructions:
    where rows are short of filling the GPU (M = 1) or at M > 1, the block's warps share a row
    group's K and a lane takes one quarter (qpl 1). H200, q4_0, us: M = 1 576x576 2.58 ->
    1.95, 3072x576 3.45 -> 2.96, 2048x8192 7.54 -> 6.76 (16384x2048, 49152x576: 12.7 and 20.8
    as before, against 14.2 and 24.3 this way); M = 8 3072x576 7.98 -> 5.41, 3072x2048 11.0
    -> 8.5, 16384x2048 44.2 -> 33.8. q4_k and q8_0 ran slower so (4096x11008 at M = 1: 30.8
    -> 35.1 and 28.7 -> 35.0 us) and keep qpl 2. ``geo``: the device's default geometry unless
    given."""
    geo = geo or default_geometry("quant")
    cheap = scheme in SPLIT16
    if os.environ.get("RLX_NUMBA_QGEMV"):       # nw,r,wpr,qpl (tuning, tests)
        nw, r, wpr, qpl = (int(v) for v in os.environ["RLX_NUMBA_QGEMV"].split(","))
    elif geo.small:
        nw, r, wpr, qpl = (2, 2, 2, 2) if n <= 4 else (1, min(8, 32 // m) & ~1, 1, 2)
    elif cheap and m > 1:
        nw, r, wpr, qpl = 4, max(1, min(4, 32 // m)), 4, 1
    elif cheap and -(-n // 8) < 4 * sm:        # M = 1, fewer than 4 blocks a SM of 2 warps
        nw, r, wpr, qpl = 4, 4 if -(-n // 4) >= 2 * sm else 2, 4, 1
    else:
        nw, r, wpr, qpl = 4, max(1, min(4, 32 // m)), 2, 2
        while wpr < nw and -(-n // (r * nw // wpr)) < 4 * sm:
            wpr *= 2
    return nw, r, wpr, -(-n // (r * nw // wpr)), qpl


@_inline
def _sum8(xa, xb):
    return xa[0] + xa[1] + xa[2] + xa[3] + xb[0] + xb[1] + xb[2] + xb[3]


@_inline
def _dot8(v, xa, xb, sx):
    """The lane's 8 weights (a unit_fn result) dotted with its x values (sx their sum)."""
    qa, qb, d, m = v
    s = (qa[0] * xa[0] + qa[1] * xa[1] + qa[2] * xa[2] + qa[3] * xa[3]
         + qb[0] * xb[0] + qb[1] * xb[1] + qb[2] * xb[2] + qb[3] * xb[3])
    return d * s + m * sx


@functools.lru_cache(maxsize=None)
def gemv_kernel(scheme: str, m: int, nw: int, r: int, wpr: int, has_zero: bool, gshift: int = -1,
                qpl: int = 2, has_bias: bool = False, act=None, has_res: bool = False,
                gated: bool = False, grouped: bool = False):
    """y = epilogue(x[M, K] @ dequant(W)^T) for M = m. Launch: grid (blocks,), block nw * 32;
    arguments (y, x, w, sc, zr, bias, res, n, k, units, rowhw, ng, gsu, ids, ne); x's rows
    16-byte aligned; gshift: unit_fn's. Epilogue (passes/fusion.py): act(v + bias[col]) + res,
    or ``gated``: columns 2j, 2j + 1 (gate and up rows interleaved in W) give y[., j] =
    act(gate + bias) * (up + bias) + res, y [M, N / 2] (bias / res / ids any 1-element arrays
    when unused). ``grouped`` (m = 1; dequant_grouped_matmul): W holds ne experts of n rows,
    grid (blocks, slots), and slot s computes y[s] = x[s] @ dequant(W[ids[s]])^T -- zeros
    for an id outside [0, ne).

    A lane decodes ``qpl`` quarters (8 weights each, unit_fn) of a unit, 4 / qpl lanes a unit,
    so a warp takes 8 qpl units of its r rows a step: the lanes' x loads and weight loads
    are contiguous across the warp, what a lane's quarters share (the block's scales, index
    math) is computed once, and the x values (m = 1) or their sums (m > 1) of a unit once
    for the r rows."""
    unit = unit_fn(scheme, has_zero, gshift)
    nv = r * m
    nvp = pow2_at_least(nv)
    assert nvp <= 32 and nw % wpr == 0 and (not gated or r % 2 == 0)
    rep = 32 // nvp
    teams = nw // wpr
    rows_blk = teams * r
    xr_shape = (nw, 32, nvp) if SIMULATOR else (1, 1, 1)
    split = scheme in SPLIT16
    lpu = 4 // qpl                            # lanes a unit
    upw = 32 // lpu                           # units a warp step
    actf = getattr(ew, act) if act else ew.neg
    has_act = bool(act)

    @_inline
    def xoff(t):
        return (4 * t, 16 + 4 * t) if split else (8 * t, 8 * t + 4)

    @jit
    def kernel(y, x, w, sc, zr, bias, res, n, k, units, rowhw, ng, gsu, ids, ne):
        xs = cuda.shared.array((nw, 32), float32)        # shuffle stand-in (simulator)
        xr = cuda.shared.array(xr_shape, float32)
        red = cuda.shared.array((nw, nvp), float32)
        acc = cuda.local.array(nvp, float32)
        xv = cuda.local.array((qpl, 2, 4), float32)
        sx = cuda.local.array((m, qpl), float32)
        wq = cuda.local.array((r, 10), float32)         # m > 1: decoded quarters of the r rows
        tid = cuda.threadIdx.x
        lane, wp = tid % 32, tid // 32
        team, tw = wp // wpr, wp % wpr
        t0 = (lane % lpu) * qpl
        tiles = (n + rows_blk - 1) // rows_blk
        roff, xo, yo, live = int64(0), int64(0), int64(0), True
        if grouped:                       # this block's slot: its x row, expert and y row
            slot = int64(cuda.blockIdx.y)
            e = int64(ids[slot])
            live = e >= 0 and e < ne
            roff, xo, yo = min(max(e, 0), ne - 1) * n, slot * k, slot * n
        tile = int64(cuda.blockIdx.x)
        while tile < tiles:                   # uniform across the block (barriers inside)
            row0 = tile * rows_blk + team * r
            for i in range(nvp):
                acc[i] = ZERO
            u = int64(tw * upw + lane // lpu)
            while u < units:
                kb = u * UNIT
                for mm in range(m):           # the sums of the lane's x values, for all r rows
                    for q in range(qpl):
                        o0, o1 = xoff(t0 + q)
                        xa = ptx.ld4(x, xo + mm * k + kb + o0)
                        xb = ptx.ld4(x, xo + mm * k + kb + o1)
                        sx[mm, q] = _sum8(xa, xb)
                        if m == 1:            # and the values themselves
                            for e in range(4):
                                xv[q, 0, e] = xa[e]
                                xv[q, 1, e] = xb[e]
                if m == 1:
                    for rr in range(r):
                        row = roff + min(row0 + rr, n - 1)
                        for q in range(qpl):
                            v = unit(w, sc, zr, row, u, t0 + q, rowhw, ng, gsu)
                            acc[rr] += _dot8(v, (xv[q, 0, 0], xv[q, 0, 1], xv[q, 0, 2], xv[q, 0, 3]),
                                             (xv[q, 1, 0], xv[q, 1, 1], xv[q, 1, 2], xv[q, 1, 3]),
                                             sx[0, q])
                else:             # the r rows' weights decoded once, each x quad loaded once
                    for q in range(qpl):
                        for rr in range(r):
                            fa, fb, d, mb = unit(w, sc, zr, roff + min(row0 + rr, n - 1), u, t0 + q,
                                                 rowhw, ng, gsu)
                            for e in range(4):
                                wq[rr, e] = fa[e]
                                wq[rr, 4 + e] = fb[e]
                            wq[rr, 8] = d
                            wq[rr, 9] = mb
                        o0, o1 = xoff(t0 + q)
                        for mm in range(m):
                            xa = ptx.ld4(x, xo + mm * k + kb + o0)
                            xb = ptx.ld4(x, xo + mm * k + kb + o1)
                            for rr in range(r):
                                acc[rr * m + mm] += _dot8(
                                    ((wq[rr, 0], wq[rr, 1], wq[rr, 2], wq[rr, 3]),
                                     (wq[rr, 4], wq[rr, 5], wq[rr, 6], wq[rr, 7]), wq[rr, 8], wq[rr, 9]),
                                    xa, xb, sx[mm, q])
                u += upw * wpr
            reduce_scatter(acc, nvp, xs, xr, wp, lane)
            if lane % rep == 0:
                red[wp, lane // rep] = acc[0]
            cuda.syncthreads()
            if tid < teams * nv:
                tm, i = tid // nv, tid % nv
                rr, mm = i // m, i % m
                row = tile * rows_blk + tm * r + rr
                if row < n and (not gated or rr % 2 == 0):
                    v = red[tm * wpr, i]
                    for ww in range(1, wpr):
                        v += red[tm * wpr + ww, i]
                    if has_bias:
                        v += bias[row]
                    if has_act:
                        v = actf(v)
                    at = mm * n + row
                    if gated:                 # the up column is the next row of W
                        g = red[tm * wpr, i + m]
                        for ww in range(1, wpr):
                            g += red[tm * wpr + ww, i + m]
                        if has_bias:
                            g += bias[row + 1]
                        v *= g
                        at = mm * (n // 2) + row // 2
                    if has_res:
                        v += res[at]
                    y[yo + at] = v if live else ZERO
            cuda.syncthreads()
            tile += cuda.gridDim.x

    return kernel


# ---- dequantise to f32 (the GEMM path) ----------------------------------------------------
@functools.lru_cache(maxsize=None)
def dequant_units_kernel(scheme: str, has_zero: bool, gshift: int = -1, gather: bool = False,
                         bf16: bool = False):
    """out[n, K] f32 <- W, a thread a quarter unit (8 weights; grid-stride). Arguments (out, w,
    sc, zr, n, k, units, rowhw, ng, gsu, ids, nsrc); ``gather``: out row i is W's row ids[i]
    (clamped to [0, nsrc)), else row i (ids unused). ``bf16``: out is uint32 words, each two
    bf16 weights (round to nearest even; the low half the even column)."""
    unit = unit_fn(scheme, has_zero, gshift)
    split = scheme in SPLIT16

    @jit
    def kernel(out, w, sc, zr, n, k, units, rowhw, ng, gsu, ids, nsrc):
        i = int64(cuda.grid(1))
        while i < n * units * 4:
            q, t = i // 4, i % 4
            row, u = q // units, q % units
            src = min(max(int64(ids[row]), 0), nsrc - 1) if gather else row
            qa, qb, d, m = unit(w, sc, zr, src, u, t, rowhw, ng, gsu)
            p0, p1 = (4 * t, 16 + 4 * t) if split else (8 * t, 8 * t + 4)
            base = row * k + u * UNIT          # (the arena aligns out)
            if bf16:      # 8 weights: one 16-byte store, or two 8-byte ones (split formats)
                wa0 = _bf16x2(qa[0] * d + m, qa[1] * d + m)
                wa1 = _bf16x2(qa[2] * d + m, qa[3] * d + m)
                wb0 = _bf16x2(qb[0] * d + m, qb[1] * d + m)
                wb1 = _bf16x2(qb[2] * d + m, qb[3] * d + m)
                if split:
                    ptx.vst2(out, (base + p0) // 2, wa0, wa1)
                    ptx.vst2(out, (base + p1) // 2, wb0, wb1)
                else:
                    ptx.vst4(out, (base + p0) // 2, wa0, wa1, wb0, wb1)
            else:                              # two 16-byte stores
                ptx.vst4(out, base + p0, qa[0] * d + m, qa[1] * d + m, qa[2] * d + m,
                         qa[3] * d + m)
                ptx.vst4(out, base + p1, qb[0] * d + m, qb[1] * d + m, qb[2] * d + m,
                         qb[3] * d + m)
            i += cuda.gridsize(1)

    return kernel


@_inline
def _bf16x2(lo, hi):
    return uint32(ew.f32_to_bf16(lo)) | (uint32(ew.f32_to_bf16(hi)) << uint32(16))


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
