"""Grouped (mixture-of-experts) products: routing rows to experts on the device, then one
tiled GEMM launch over every expert. Nothing is read back to the host, so the steps can be
captured in a CUDA graph.

Routing (``route_kernel``, one block) is a stable counting sort of the rows by expert id:
the rows are cut into ``nchunks`` chunks of ``ch``; a thread counts its chunk's rows per
expert, a thread per expert turns those counts into the exclusive prefix over chunks (where
each chunk's rows go inside the expert's segment), a block scan lays the segments out with
each one padded to whole tiles of BM rows (vLLM's moe_align_block_size), and the chunks then
scatter their row indices in order. Out:

  start [E + 1]     expert e's rows are rows[start[e] : start[e] + count[e]]; start[E] is the
                    padded total, so start[E] / BM row tiles
  count [E]         rows a expert
  tile_expert [T]   the expert of each row tile (a tile never crosses a segment)
  rows [T * BM]     x's row indices by expert, in row order within one; -1 in the padding

A row with an id outside [0, E) is routed nowhere and its output row (when there is one) is
written as zeros here. ``route_kernel`` pads to this module's BM; ``route_kernel_for(bm)`` to
another product's row tile (kernels/matmul_tc.py's grouped mode, f16 / bf16 on tensor cores).

``rows_kernel`` computes out[r] = x[r] @ W_e for every routed row (f32, or f16 / bf16 loaded
and stored through kernels/halfio.py, f32 sums): a block takes a BM-row tile
of ``rows`` (one expert) and a BN-column tile, and runs kernels/matmul.py's register-tiled,
double-buffered main loop with the A tile's rows gathered through ``rows``; empty experts have
no tiles. ``wgrad_kernel`` computes dw[e] = sum over e's rows of a[r]^T b[r], a block a
(BM x BN tile, expert), its K loop walking the expert's rows in order: deterministic, no
atomics; an expert without rows gets zeros.
"""
import functools

import numpy as np
from numba import cuda, float32, int64, uint64

from ..device import SIMULATOR
from . import halfio
from .launch import grid_3d, jit, inline as _inline
from .matmul import (BK, BM, BN, LA, LAUNCH_BOUNDS, LB, NT, SA, SB, TM, TN, TX, TY,
                     mma, store_tile, zero_acc)

ROUTE_T = 16 if SIMULATOR else 256      # the routing block's threads (also its chunk cap)

_jit = jit(launch_bounds=LAUNCH_BOUNDS)

_u = np.uint64
uBM, uBN, uBK, uTX = _u(BM), _u(BN), _u(BK), _u(TX)
U0, U1 = _u(0), _u(1)
ZERO = float32(0.0)


def route_plan(m: int, num_experts: int, bm: int = BM) -> tuple[int, int, int]:
    """(nchunks, ch, max row tiles of bm rows) for routing m rows: about sqrt(m) chunks of
    about sqrt(m) rows (the chunk pass and the per-expert pass over chunks cost about the
    same), at most ROUTE_T chunks (a thread each); every non-empty expert wastes less than a
    tile."""
    nchunks = max(1, min(ROUTE_T, int(np.ceil(np.sqrt(m)))))
    return nchunks, -(-m // nchunks), (m + min(num_experts, m) * (bm - 1)) // bm


@functools.lru_cache(maxsize=None)
def route_kernel_for(BM: int):
    """The routing kernel padding each expert's segment to tiles of BM rows (the product's
    block tile: kernels/matmul_tc.py's grouped mode routes with its own)."""
    @jit
    def route(ids, m, num_e, ch, nchunks, counts, start, count, tile_expert, rows, out, n_out):
        """Launch with one block of ROUTE_T threads. counts: int32 [nchunks * E] scratch; out:
        [m, n_out] of any float storage (its rows with a bad id are zeroed; n_out 0: none)."""
        sh = cuda.shared.array(ROUTE_T, int64)
        tid = cuda.threadIdx.x
        c = tid
        while c < nchunks:          # each chunk's rows a expert, counted by one thread in order
            base = c * num_e
            for q in range(num_e):
                counts[base + q] = 0
            for j in range(c * ch, min(m, c * ch + ch)):
                ex = ids[j]
                if 0 <= ex < num_e:
                    counts[base + ex] += 1
            c += ROUTE_T
        cuda.syncthreads()
        e = tid
        while e < num_e:            # chunk counts -> exclusive prefix over the chunks
            run = 0
            for q in range(nchunks):
                v = counts[q * num_e + e]
                counts[q * num_e + e] = run
                run += v
            count[e] = run
            e += ROUTE_T
        cuda.syncthreads()
        carry = 0                   # segment starts: a block scan of the tile-padded counts
        for e0 in range(0, num_e, ROUTE_T):
            e = e0 + tid
            v = 0
            if e < num_e:
                v = (count[e] + BM - 1) // BM * BM
            sh[tid] = v
            cuda.syncthreads()
            off = 1
            while off < ROUTE_T:
                t = sh[tid - off] if tid >= off else 0
                cuda.syncthreads()
                sh[tid] += t
                cuda.syncthreads()
                off *= 2
            if e < num_e:
                start[e] = carry + sh[tid] - v
            carry += sh[ROUTE_T - 1]
            cuda.syncthreads()      # (every start[e] written before the scatter reads it)
        if tid == 0:
            start[num_e] = carry
        e = tid
        while e < num_e:            # the padding (-1) and the tiles' expert
            s = start[e]
            end = s + (count[e] + BM - 1) // BM * BM
            for p in range(s + count[e], end):
                rows[p] = -1
            for t in range(s // BM, end // BM):
                tile_expert[t] = e
            e += ROUTE_T
        c = tid
        while c < nchunks:          # the stable scatter: each chunk's rows in order
            base = c * num_e
            for j in range(c * ch, min(m, c * ch + ch)):
                ex = ids[j]
                if 0 <= ex < num_e:
                    rows[start[ex] + counts[base + ex]] = j
                    counts[base + ex] += 1
                else:
                    for col in range(n_out):
                        out[j * n_out + col] = ZERO
            c += ROUTE_T

    return route


route_kernel = route_kernel_for(BM)    # the f32 product's tiles


@functools.lru_cache(maxsize=None)
def rows_kernel(trans_w: bool, kind: str = "f32"):
    """kernel(out, x, w, n, k, num_e, start, tile_expert, rows): out[r] ([M, n]) = x[r] @ W_e
    for every routed row r of expert e, x [M, k]; W_e = w[e], w [E, k, n], or with trans_w
    W_e = w[e]^T, w [E, n, k]; all three in ``kind``'s storage (kernels/halfio.py: halves
    widened on load, f32 sums, the store rounds once). Launch with rows_launch."""
    ARS = NT // BK              # A (gathered x rows): thread rows ar + p*ARS, at k aq
    BQS, BCS = (0, NT // BK) if trans_w else (NT // BN, 0)
    ld, st = halfio.load(kind), halfio.store(kind)

    @_inline
    def load(ra, rb, x, w, xrow, bo, c0, k0, aq, bq, n, k):
        q = k0 + aq
        for p in range(LA):
            ra[p] = ld(x, uint64(xrow[p]) * k + q) if xrow[p] >= 0 and q < k else ZERO
        for p in range(LB):
            qb, cl = k0 + bq + _u(p * BQS), c0 + _u(p * BCS)
            rb[p] = ld(w, bo + (cl * k + qb if trans_w else qb * n + cl)) if cl < n and qb < k \
                else ZERO

    @_inline
    def stage(As, Bs, ra, rb, buf, ar, aq, bq, bc):
        for p in range(LA):
            As[buf, aq, ar + _u(p * ARS)] = ra[p]
        for p in range(LB):
            Bs[buf, bq + _u(p * BQS), bc + _u(p * BCS)] = rb[p]

    @_jit
    def kernel(out, x, w, n, k, num_e, start, tile_expert, rows):
        As = cuda.shared.array(SA, float32)
        Bs = cuda.shared.array(SB, float32)
        acc = cuda.local.array((TM, TN), float32)
        fa = cuda.local.array(TM, float32)
        fb = cuda.local.array(TN, float32)
        ra = cuda.local.array(LA, float32)
        rb = cuda.local.array(LB, float32)
        xrow = cuda.local.array(LA, int64)           # x rows this thread loads (-1: padding)
        n, k = uint64(n), uint64(k)
        tid = uint64(cuda.threadIdx.x)
        tx, ty = tid % uTX, tid // uTX
        ar, aq = tid // uBK, tid % uBK
        bq, bc = (tid % uBK, tid // uBK) if trans_w else (tid // uBN, tid % uBN)
        tiles = uint64(start[num_e]) // uBM          # routed tiles; the grid's y is a bound
        tiles_n = (n + uBN - U1) // uBN
        by = uint64(cuda.blockIdx.y)
        while by < tiles:       # every loop bound is uniform across the block (barriers inside)
            row0 = by * uBM
            bo = uint64(tile_expert[by]) * k * n
            for p in range(LA):
                xrow[p] = rows[row0 + ar + _u(p * ARS)]
            bx = uint64(cuda.blockIdx.x)
            while bx < tiles_n:
                col0 = bx * uBN
                c0 = col0 + bc
                zero_acc(acc)
                load(ra, rb, x, w, xrow, bo, c0, U0, aq, bq, n, k)
                stage(As, Bs, ra, rb, U0, ar, aq, bq, bc)
                cuda.syncthreads()
                buf = U0
                k0 = U0
                while k0 < k:
                    more = k0 + uBK < k
                    if more:     # the next tile's loads in flight during the FMAs
                        load(ra, rb, x, w, xrow, bo, c0, k0 + uBK, aq, bq, n, k)
                    mma(As, Bs, buf, acc, fa, fb, tx, ty)
                    if more:
                        stage(As, Bs, ra, rb, buf ^ U1, ar, aq, bq, bc)
                    cuda.syncthreads()
                    buf ^= U1
                    k0 += uBK
                cl = col0 + tx
                cols = n - min(cl, n)
                for i in range(TM):
                    r = rows[row0 + ty + _u(i * TY)]
                    if r >= 0:
                        base = uint64(r) * n + cl
                        for j in range(TN):
                            if _u(j * TX) < cols:
                                st(out, base + _u(j * TX), acc[i, j])
                bx += uint64(cuda.gridDim.x)
            by += uint64(cuda.gridDim.y)

    return kernel


def rows_launch(n: int, max_tiles: int) -> tuple[tuple, tuple]:
    """(grid, block) of a rows_kernel launch: a block per (column tile, row tile) up to the
    routing's bound on the row tiles (blocks past the routed ones return at once), clamped
    like sgemm_launch (the kernel strides over the rest)."""
    return grid_3d(-(-n // BN), max_tiles), (NT,)


def wgrad_launch(ka: int, nb: int, num_e: int) -> tuple[tuple, tuple]:
    """(grid, block) of a wgrad_kernel launch: a block per dw tile and expert, clamped."""
    return grid_3d(-(-nb // BN), -(-ka // BM), num_e), (NT,)


WAQS, WBQS = NT // BM, NT // BN     # wgrad: the k (row) steps of a thread's A / B loads


@_inline
def _wload(ra, rb, a, b, rows, s, r0, c0, k0, aq, bq, ka, nb, cnt):
    for p in range(LA):
        q = k0 + aq + _u(p * WAQS)
        ra[p] = a[uint64(rows[s + q]) * ka + r0] if r0 < ka and q < cnt else ZERO
    for p in range(LB):
        q = k0 + bq + _u(p * WBQS)
        rb[p] = b[uint64(rows[s + q]) * nb + c0] if c0 < nb and q < cnt else ZERO


@_inline
def _wstage(As, Bs, ra, rb, buf, ar, aq, bq, bc):
    for p in range(LA):
        As[buf, aq + _u(p * WAQS), ar] = ra[p]
    for p in range(LB):
        Bs[buf, bq + _u(p * WBQS), bc] = rb[p]


@_jit
def wgrad_kernel(dw, a, b, ka, nb, num_e, start, count, rows):
    """dw[e] (f32 [E, ka, nb]) = sum over expert e's routed rows r of a[r]^T b[r], a f32
    [M, ka], b f32 [M, nb]: the GEMM a_e^T @ b_e with the rows as its K, gathered through
    ``rows``. Launch with wgrad_launch."""
    As = cuda.shared.array(SA, float32)
    Bs = cuda.shared.array(SB, float32)
    acc = cuda.local.array((TM, TN), float32)
    fa = cuda.local.array(TM, float32)
    fb = cuda.local.array(TN, float32)
    ra = cuda.local.array(LA, float32)
    rb = cuda.local.array(LB, float32)
    ka, nb, num_e = uint64(ka), uint64(nb), uint64(num_e)
    tid = uint64(cuda.threadIdx.x)
    tx, ty = tid % uTX, tid // uTX
    ar, aq = tid % uBM, tid // uBM     # a_e^T's tile is read along its contiguous columns
    bq, bc = tid // uBN, tid % uBN
    tiles_m = (ka + uBM - U1) // uBM
    tiles_n = (nb + uBN - U1) // uBN
    z = uint64(cuda.blockIdx.z)
    while z < num_e:
        s, cnt = uint64(start[z]), uint64(count[z])
        co = z * ka * nb
        by = uint64(cuda.blockIdx.y)
        while by < tiles_m:
            row0 = by * uBM
            bx = uint64(cuda.blockIdx.x)
            while bx < tiles_n:
                col0 = bx * uBN
                r0, c0 = row0 + ar, col0 + bc
                zero_acc(acc)
                _wload(ra, rb, a, b, rows, s, r0, c0, U0, aq, bq, ka, nb, cnt)
                _wstage(As, Bs, ra, rb, U0, ar, aq, bq, bc)
                cuda.syncthreads()
                buf = U0
                k0 = U0
                while k0 < cnt:
                    more = k0 + uBK < cnt
                    if more:
                        _wload(ra, rb, a, b, rows, s, r0, c0, k0 + uBK, aq, bq, ka, nb, cnt)
                    mma(As, Bs, buf, acc, fa, fb, tx, ty)
                    if more:
                        _wstage(As, Bs, ra, rb, buf ^ U1, ar, aq, bq, bc)
                    cuda.syncthreads()
                    buf ^= U1
                    k0 += uBK
                r, cl = row0 + ty, col0 + tx
                store_tile(dw, acc, co + r * nb + cl, ka - min(r, ka), nb - min(cl, nb), nb)
                bx += uint64(cuda.gridDim.x)
            by += uint64(cuda.gridDim.y)
        z += uint64(cuda.gridDim.z)
