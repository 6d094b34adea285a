"""Matrix products: the register-tiled SGEMM, the tier that runs everywhere (simulator included)
and the fallback when cuBLAS is absent. C[z] = op(A[z]) @ op(B[z]) for each batch z, row-major,
with per-batch element offsets given as arrays so batch broadcasting needs no copies.

A block computes a BM x BN tile of C; each of its NT = (BM/TM) * (BN/TN) threads holds a
TM x TN micro-tile of accumulators in registers. K is walked BK at a time: the A tile is staged
transposed (As[k][row]) and the B tile as is (Bs[k][col]) in shared memory, then for each k a
thread reads TM values of A and TN of B into registers and does TM*TN FMAs, so every shared
load feeds TM (or TN) FMAs. The thread's rows are ty + i*TY and its columns tx + j*TX (strided,
not contiguous): a warp then reads 16 consecutive Bs words and 2 As words per k, free of bank
conflicts, and its stores of C are 16 consecutive floats.

The next K tile is loaded from global memory into registers before the current one is
computed and stored into the other half of a double-buffered shared tile after it, so the
load latency hides behind the FMAs and one barrier per K tile suffices.
"""
import functools

import numpy as np
from numba import cuda, float32, float64, uint64

from ..device import SIMULATOR
from . import halfio
from .launch import grid_3d, jit, inline as _inline

# Each simulated thread is an OS thread: keep the simulator's blocks tiny (16 threads).
BM, BN, BK, TM, TN = (8, 8, 4, 2, 2) if SIMULATOR else (128, 128, 8, 8, 8)
TX, TY = BN // TN, BM // TM        # threads along a tile's columns / rows
NT = TX * TY                       # threads a block (256 on a GPU)
PAD = 4   # row padding of the shared tiles: a warp's transposing stores (A, or B when trans_b)
          # hit 8 k-rows x 4 columns, 8 to a bank without it (rows of BM % 32 == 0 words)
SA, SB = (2, BK, BM + PAD), (2, BK, BN + PAD)   # double-buffered shared tiles
LA, LB = BM * BK // NT, BN * BK // NT   # A / B tile elements each thread loads
assert BM % TM == 0 and BN % TN == 0 and NT % BM == 0 and NT % BN == 0 and NT % BK == 0

# 256 threads x at most 128 registers: two blocks an SM, and the 64 accumulators, the
# fragments and the tile in flight still fit without spills (tools/ptx_report.py checks)
LAUNCH_BOUNDS = (NT, 2)
_jit = jit(launch_bounds=LAUNCH_BOUNDS)

# index math is uint64 throughout (as in rows.py): no signed wraparound checks, no mixed types
_u = np.uint64
uBM, uBN, uBK, uTX, uTY, uNT = _u(BM), _u(BN), _u(BK), _u(TX), _u(TY), _u(NT)
U0, U1 = _u(0), _u(1)
ZERO = float32(0.0)


# ---- the register tile, shared with kernels/grouped.py ------------------------------------
@_inline
def zero_acc(acc):
    for i in range(TM):
        for j in range(TN):
            acc[i, j] = ZERO


@_inline
def mma(As, Bs, buf, acc, fa, fb, tx, ty):
    """acc += this thread's TM x TN share (rows ty + i TY, columns tx + j TX) of shared tile
    ``buf``'s BK-deep product."""
    q = U0
    while q < uBK:   # not range(): its int64 count and signed index cost ~10 instructions a k
                     # (LLVM keeps this loop rolled)
        for i in range(TM):
            fa[i] = As[buf, q, ty + _u(i) * uTY]
        for j in range(TN):
            fb[j] = Bs[buf, q, tx + _u(j) * uTX]
        for i in range(TM):
            for j in range(TN):
                acc[i, j] += fa[i] * fb[j]
        q += U1


@_inline
def store_tile(c, acc, base, rows, cols, n):
    """c[base + i TY n + j TX] = acc[i, j] where i TY < rows and j TX < cols: bounds as
    "constant < rows / columns left", one register each, not 64-bit indices per i and j
    (those spilled around the live accumulators)."""
    for i in range(TM):
        if _u(i * TY) < rows:
            for j in range(TN):
                if _u(j * TX) < cols:
                    c[base + _u(i * TY) * n + _u(j * TX)] = acc[i, j]


def gemm_tiles(trans_a: bool, trans_b: bool, fetch_a, fetch_b, column, put=None, acc_type=float32):
    """The tiled product as an inline device function tiles(c, a, b, m, n, k, a_off, b_off,
    batch, geo): c[z] (flat [batch, m, n]) = A[z] @ B[z], where element (r, q) of A[z] is
    fetch_a(a, a_off[z], r, q, m, k, geo) and (q, col) of B[z] is fetch_b(b, b_off[z], q, col,
    column(c0, n, geo), n, k, geo) (called inside the bounds only; c0 the thread's first
    column of the tile: ``column`` works out, once a tile rather than once a load, what
    fetch_b needs of it). ``trans_a`` / ``trans_b`` say which axis of
    each source is contiguous, so consecutive threads load along it. sgemm_kernel fetches
    plain row-major matrices; kernels/conv.py's implicit-GEMM convolutions gather B (and A)
    from the image and the weight as they go, described by ``geo`` (B not transposed: a
    thread loads one column of each B tile). ``put(c, i, v)`` stores an f32 sum (a
    kernels/halfio.py store: rounds once to c's dtype); None: c is f32, plain stores.
    Fetches return float32 (a half source widens in its fetch), sums are f32; with
    ``acc_type`` float64 (the f64 product) the tiles, fetches and sums are all float64."""
    Z = acc_type(0.0)

    # Tile loads: consecutive threads walk each source's contiguous axis. Thread tid's p-th
    # element of the A tile is (row ar + p*ARS, k aq + p*AQS); of the B tile (k bq + p*BQS,
    # column bc + p*BCS): one of each pair of steps is 0, so p only adds constants.
    ARS, AQS = (0, NT // BM) if trans_a else (NT // BK, 0)
    BQS, BCS = (0, NT // BK) if trans_b else (NT // BN, 0)

    @_inline
    def load(ra, rb, a, b, ao, bo, r0, c0, col, k0, aq, bq, m, n, k, geo):
        """This thread's elements of the A and B tiles at K offset k0 into registers (r0, c0:
        its first row / column; col: column(c0, n, geo)), zero outside the matrices."""
        for p in range(LA):
            r, q = r0 + _u(p * ARS), k0 + aq + _u(p * AQS)
            ra[p] = fetch_a(a, ao, r, q, m, k, geo) if r < m and q < k else Z
        for p in range(LB):
            q, cl = k0 + bq + _u(p * BQS), c0 + _u(p * BCS)
            rb[p] = fetch_b(b, bo, q, cl, col, n, k, geo) if cl < n and q < k else Z

    @_inline
    def stage(As, Bs, ra, rb, buf, ar, aq, bq, bc):
        """The registers from load() into shared buffer ``buf``."""
        for p in range(LA):
            As[buf, aq + _u(p * AQS), ar + _u(p * ARS)] = ra[p]
        for p in range(LB):
            Bs[buf, bq + _u(p * BQS), bc + _u(p * BCS)] = rb[p]

    if put is None:
        store = store_tile
    else:
        @_inline
        def store(c, acc, base, rows, cols, n):     # store_tile through put
            for i in range(TM):
                if _u(i * TY) < rows:
                    for j in range(TN):
                        if _u(j * TX) < cols:
                            put(c, base + _u(i * TY) * n + _u(j * TX), acc[i, j])

    @_inline
    def tiles(c, a, b, m, n, k, a_off, b_off, batch, geo):
        As = cuda.shared.array(SA, acc_type)
        Bs = cuda.shared.array(SB, acc_type)
        acc = cuda.local.array((TM, TN), acc_type)  # constant indices only: registers
        fa = cuda.local.array(TM, acc_type)
        fb = cuda.local.array(TN, acc_type)
        ra = cuda.local.array(LA, acc_type)         # the next K tile, in flight
        rb = cuda.local.array(LB, acc_type)
        m, n, k, batch = uint64(m), uint64(n), uint64(k), uint64(batch)
        tid = uint64(cuda.threadIdx.x)
        tx, ty = tid % uTX, tid // uTX
        ar, aq = (tid % uBM, tid // uBM) if trans_a else (tid // uBK, tid % uBK)
        bq, bc = (tid % uBK, tid // uBK) if trans_b else (tid // uBN, tid % uBN)
        tiles_m = (m + uBM - U1) // uBM
        tiles_n = (n + uBN - U1) // uBN
        z = uint64(cuda.blockIdx.z)
        while z < batch:      # every loop bound is uniform across the block (barriers inside)
            ao, bo = uint64(a_off[z]), uint64(b_off[z])
            co = z * m * n
            by = uint64(cuda.blockIdx.y)
            while by < tiles_m:
                row0 = by * uBM
                bx = uint64(cuda.blockIdx.x)
                while bx < tiles_n:
                    col0 = bx * uBN
                    r0, c0 = row0 + ar, col0 + bc   # this thread's first row of A / column of B
                    col = column(c0, n, geo)
                    zero_acc(acc)
                    load(ra, rb, a, b, ao, bo, r0, c0, col, U0, aq, bq, m, n, k, geo)
                    stage(As, Bs, ra, rb, U0, ar, aq, bq, bc)
                    cuda.syncthreads()
                    buf = U0
                    k0 = U0
                    while k0 < k:
                        more = k0 + uBK < k
                        if more:   # issue the next tile's loads now, store them after the FMAs
                            load(ra, rb, a, b, ao, bo, r0, c0, col, k0 + uBK, aq, bq, m, n, k,
                                 geo)
                        mma(As, Bs, buf, acc, fa, fb, tx, ty)
                        if more:   # the other buffer: its last readers passed the barrier below
                            stage(As, Bs, ra, rb, buf ^ U1, ar, aq, bq, bc)
                        cuda.syncthreads()
                        buf ^= U1
                        k0 += uBK
                    r, cl = row0 + ty, col0 + tx
                    store(c, acc, co + r * n + cl, m - min(r, m), n - min(cl, n), n)
                    bx += uint64(cuda.gridDim.x)
                by += uint64(cuda.gridDim.y)
            z += uint64(cuda.gridDim.z)

    return tiles


def sgemm_kernel(trans_a: bool, trans_b: bool, kind: str = "f32", out_kind: str = "f32"):
    """The kernel below, one per (trans_a, trans_b, kind, out_kind) however it is asked for
    (positional or default arguments: the same object)."""
    return _sgemm_kernel(bool(trans_a), bool(trans_b), kind, out_kind)


@functools.lru_cache(maxsize=None)
def _sgemm_kernel(trans_a: bool, trans_b: bool, kind: str, out_kind: str):
    """kernel(c, a, b, m, n, k, a_off, b_off, batch): c[z] (flat [batch, m, n]) =
    A[z] @ B[z]; A[z] starts at a[a_off[z]], row-major [m, k] ([k, m] when trans_a, A being its
    transpose), B[z] at b[b_off[z]], [k, n] ([n, k] when trans_b); a_off/b_off int64 arrays.
    a and b hold ``kind`` data (f32, f16, or bf16 as uint16 bits: kernels/halfio.py widens
    each load to f32), c ``out_kind``: the f32 sums rounded once on the store. ``kind``
    "f64" (with out_kind "f64") is the DGEMM: the same tiles in float64 throughout. Launch with
    sgemm_launch(m, n, batch); the grid strides over tiles and batches, so any grid works.
    k == 0 writes zeros."""
    f64 = kind == "f64"
    if f64 != (out_kind == "f64"):
        raise ValueError(f"sgemm_kernel: f64 operands give an f64 result, got kind {kind!r} "
                         f"and out_kind {out_kind!r}")
    ld = None if f64 else halfio.load(kind)

    if kind in ("f32", "f64"):   # (plain subscripts: the f32 kernel's code stays as it was)
        @_inline
        def fetch_a(a, ao, r, q, m, k, geo):
            return a[ao + (q * m + r if trans_a else r * k + q)]

        @_inline
        def fetch_b(b, bo, q, cl, col, n, k, geo):
            return b[bo + (cl * k + q if trans_b else q * n + cl)]
    else:
        @_inline
        def fetch_a(a, ao, r, q, m, k, geo):
            return ld(a, ao + (q * m + r if trans_a else r * k + q))

        @_inline
        def fetch_b(b, bo, q, cl, col, n, k, geo):
            return ld(b, bo + (cl * k + q if trans_b else q * n + cl))

    @_inline
    def column(c0, n, geo):
        return c0

    tiles = gemm_tiles(trans_a, trans_b, fetch_a, fetch_b, column,
                       None if out_kind in ("f32", "f64") else halfio.store(out_kind),
                       float64 if f64 else float32)

    # f64: 64 double accumulators are 128 registers alone, so one block an SM (no forced
    # spills); the f32 kernel keeps its two
    @(jit(launch_bounds=(NT, 1)) if f64 else _jit)
    def kernel(c, a, b, m, n, k, a_off, b_off, batch):
        tiles(c, a, b, m, n, k, a_off, b_off, batch, a_off)     # (no geometry: a_off unused)

    return kernel


def sgemm_launch(m: int, n: int, batch: int) -> tuple[tuple, tuple]:
    """(grid, block) for an sgemm_kernel launch: a block per C tile and batch, clamped to the
    hardware limits (and to a few blocks in the simulator); the kernel strides over the rest."""
    return grid_3d(-(-n // BN), -(-m // BM), batch), (NT,)

