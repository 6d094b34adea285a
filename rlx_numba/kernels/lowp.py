"""Kernels of the low-precision products (ir/ops_lowp.py; lowering: runtime/lower_lowp.py).

``scaled_mm``: the numba tier of scaled_matmul, a thread an output element: the fp8 bytes
decoded to f32 (kernels/elementwise.py), their products (exact in f32) summed in f32 in k
order, times scale_a * scale_b, plus the bias, rounded once to the output dtype.
``qmm``: the numba tier of qmatmul, exact integer sums (int64, wrapped to int32 on the store).
The rest serve the cuBLASLt tiers: ``scale_epilogue`` (rowwise scales and bias on Lt's f32
sums), ``transpose_bytes`` (cuBLASLt's fp8 / int8 kernels take only the "TN" layout: b stored
[N, K]), ``shift_u8`` (u8 - 128 as i8, so a u8 operand runs on the i8 kernels), and
``qmm_sums`` / ``qmm_fix`` (the zero-point corrections from row and column sums).
Simple, correct kernels: these are the fallback and the simulator's; the GPU speed is Lt's.
"""
from __future__ import annotations

import functools

from numba import cuda, float32, int8, int32, int64, uint8

from ..device import SIMULATOR
from . import elementwise as ew
from . import halfio
from .launch import jit

# the plain Python conversions in the simulator (a device-function call there costs ~15 us)
_DECODE = {k: (f.fn if SIMULATOR else f) for k, f in
           (("f8e4m3", ew.f8e4m3_to_f32), ("f8e5m2", ew.f8e5m2_to_f32))}


@functools.cache
def scaled_mm(akind: str, bkind: str, okind: str, rowwise: bool, has_bias: bool, b_trans: bool):
    """out[i, j] = okind(sum_k a[i, k] * b[k, j] * scale + bias[j]) over flat byte arrays; b
    stored [N, K] when ``b_trans``; scale = sa[i] * sb[j] (rowwise) or sa[0] * sb[0]."""
    da, db = _DECODE[akind], _DECODE[bkind]
    st, ldo = halfio.store(okind), halfio.load(okind)

    @jit
    def scaled_mm_kernel(out, a, b, sa, sb, bias, M, N, K):
        j0, i0 = cuda.grid(2)
        sj, si = cuda.gridsize(2)
        for i in range(i0, M, si):
            for j in range(j0, N, sj):
                acc = float32(0.0)
                for k in range(K):
                    bv = b[j * K + k] if b_trans else b[k * N + j]
                    acc += da(a[i * K + k]) * db(bv)
                s = sa[i] * sb[j] if rowwise else sa[0] * sb[0]
                v = acc * s
                if has_bias:
                    v += ldo(bias, j)
                st(out, i * N + j, v)
    return scaled_mm_kernel


@functools.cache
def qmm(b_trans: bool):
    """out[i, j] = int32(sum_k (a[i, k] - az) * (b[k, j] - bz)), exact in int64, wrapped."""
    @jit
    def qmm_kernel(out, a, b, az, bz, M, N, K):
        j0, i0 = cuda.grid(2)
        sj, si = cuda.gridsize(2)
        for i in range(i0, M, si):
            for j in range(j0, N, sj):
                acc = int64(0)
                for k in range(K):
                    bv = b[j * K + k] if b_trans else b[k * N + j]
                    acc += (int64(a[i * K + k]) - az) * (int64(bv) - bz)
                out[i * N + j] = _wrap32(acc)
    return qmm_kernel


@cuda.jit(device=True)
def _wrap32_dev(v):
    return int32(v)          # int64 -> int32 truncates: the value mod 2^32


def _wrap32_py(v):           # (NumPy refuses or warns on out-of-range integer casts)
    v = int(v) & 0xFFFFFFFF
    return int32(v - (1 << 32) if v & 0x80000000 else v)


_wrap32 = _wrap32_py if SIMULATOR else _wrap32_dev


@functools.cache
def scale_epilogue(okind: str, rowwise: bool, has_bias: bool):
    """out[i, j] = okind(acc[i, j] * scale + bias[j]) over M * N (Lt's f32 sums; ``out`` may
    be ``acc`` itself for an f32 output)."""
    st, ldo = halfio.store(okind), halfio.load(okind)

    @jit
    def scale_epilogue_kernel(out, acc, sa, sb, bias, M, N):
        t0 = cuda.grid(1)
        for t in range(t0, M * N, cuda.gridsize(1)):
            i = t // N
            j = t - i * N
            s = sa[i] * sb[j] if rowwise else sa[0] * sb[0]
            v = acc[t] * s
            if has_bias:
                v += ldo(bias, j)
            st(out, t, v)
    return scale_epilogue_kernel


# transpose tiles: TILE x TILE bytes through shared memory, a block of TILE x TROWS threads
TILE, TROWS = (8, 2) if SIMULATOR else (32, 8)
TILE_PAD = TILE + 1     # a padded row: no bank conflicts (a global, as numba's shared arrays
                        # need a constant shape: ``TILE + 1`` inline fails to type on a GPU)


@jit
def transpose_bytes(dst, src, R, C):
    """dst [C, R] = src [R, C]^T for 1-byte elements (uint8 views): a tile is read along src's
    rows and written along dst's, both coalesced; grid-stride over the tiles (x: C, y: R)."""
    tile = cuda.shared.array((TILE, TILE_PAD), uint8)
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    for bc in range(cuda.blockIdx.x * TILE, C, cuda.gridDim.x * TILE):
        for br in range(cuda.blockIdx.y * TILE, R, cuda.gridDim.y * TILE):
            for j in range(ty, TILE, TROWS):
                if br + j < R and bc + tx < C:
                    tile[j, tx] = src[(br + j) * C + bc + tx]
            cuda.syncthreads()
            for j in range(ty, TILE, TROWS):
                if bc + j < C and br + tx < R:
                    dst[(bc + j) * R + br + tx] = tile[tx, j]
            cuda.syncthreads()


@jit
def shift_u8(dst, src, n):
    """dst (i8) = src (u8) - 128: the same products as i8 with the zero point moved by 128."""
    for t in range(cuda.grid(1), n, cuda.gridsize(1)):
        dst[t] = int8(int32(src[t]) - 128)


@jit
def qmm_sums(ra, cb, a, b, M, N, K, b_trans):
    """ra[i] = sum_k a[i, k] (M threads), cb[j] = sum_k b[k, j] (N threads), int32 (|sum| <=
    128 K: exact for K < 2^24)."""
    for t in range(cuda.grid(1), M + N, cuda.gridsize(1)):
        acc = int32(0)
        if t < M:
            for k in range(K):
                acc += int32(a[t * K + k])
            ra[t] = acc
        else:
            j = t - M
            for k in range(K):
                acc += int32(b[j * K + k] if b_trans else b[k * N + j])
            cb[j] = acc


@jit
def qmm_fix(out, ra, cb, az, bz, kazbz, M, N):
    """out[i, j] += K az bz - bz ra[i] - az cb[j]: (a - az)(b - bz) from Lt's a b (int32
    arithmetic wrapping mod 2^32, as the exact result reduced to int32)."""
    for t in range(cuda.grid(1), M * N, cuda.gridsize(1)):
        i = t // N
        j = t - i * N
        v = int64(out[t]) + kazbz - bz * int64(ra[i]) - az * int64(cb[j])
        out[t] = _wrap32(v)
