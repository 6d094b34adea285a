"""The tensor-core GEMM (matmul tier 5): C[z] = act(op(A[z]) @ op(B[z]) + bias) + residual for
f16 / bf16 operands, f32 sums in mma fragments, the result rounded once to the operands' dtype.
Built on kernels/mma.py's m16n8k16 mma, ldmatrix and cp.async (sm_80+).

Structure (geometry ``TcGeometry``, the family "matmul_tc" of kernels/launch.py). A block
computes a BM x BN tile of C with (BM / WM) x (BN / WN) warps, each warp a WM x WN sub-tile:
MI = WM / 16 by NI = WN / 8 m16n8 accumulators (4 floats a lane each). K is walked BK at a
time through STAGES shared-memory stages filled by cp.async (16-byte chunks, one commit group
a K tile): the CUTLASS "multistage" loop, one barrier a K tile --

    prologue: tiles 0 .. STAGES-2 issued, a group each
    for kt:   wait until tile kt's group landed (cp.async.wait_group STAGES-2); barrier;
              issue tile kt + STAGES-1 into the stage tile kt-1 used (its readers passed the
              barrier); commit; the mmas of tile kt (overlapping the copies in flight).

Shared layout: each operand's tile is stored with its global contiguous axis contiguous (A
[BM][BK] or, trans_a, [BK][BM]; B [BK][BN] or, trans_b, [BN][BK]), rows padded by 8 halves (16
bytes): a row stride of 48, 80 or 272 bytes (rows of 16, 32 or 128 halves) puts the 8 rows an
ldmatrix phase reads (and a cp.async phase writes) in 8 distinct 4-bank groups -- conflict-
free, and rows stay 16-byte aligned. Fragments: A by ldmatrix_x4 (trans_a: .trans from the
[k][m] tile), B by ldmatrix_x4_trans from the [k][n] tile (trans_b: plain ldmatrix_x4 from
[n][k]), each x4 giving two n8 B fragments.

Edges: tile loads are guarded (zero-filled outside the matrices), stores too. ``vec``: every
operand row is 8-element (16-byte) aligned (the contiguous extents and batch offsets multiples
of 8, the pointers 16-byte aligned), so a chunk is wholly inside or outside: cp.async or
zeros; otherwise element loads (plain shared stores, same pipeline). The epilogue is fused:
bias [N] and residual (C's shape) read in the half dtype, the activation in f32, one rounding.
Every lane of every warp reaches each ldmatrix and mma (the guards are on loads and stores
only), as the warp-collective instructions (and their simulator twins) require.

Operands are read as uint16 bit patterns (an f16 array is passed as its uint16 view); C,
bias and residual in their own storage (kernels/halfio.py). Every array argument is flat
(1-D; the compile fails otherwise): the kernel indexes them by flat element offset, and
numba's ``x[i] = v`` on a 2-D ``x`` would assign row i. ``direct_launch`` launches one
product on device arrays of any shape (the geometry sweep and the GPU tests).

Grouped mode (``grouped_kernel``: grouped_matmul in f16 / bf16, mixture of experts): the same
tile loop over the row tiles of kernels/grouped.py's routing (each expert's rows padded to
whole tiles of this geometry's ``bm``): a tile's A rows are gathered through the routing's
``rows`` (-1, the padding, loads zeros), its B is the tile's expert's matrix (``tile_expert``),
and its output rows are scattered back through ``rows``; the few places that differ are
functions chosen when the kernel is built (``_batches_*``, ``_row_tiles_*``, ``_*base*``,
``_out_row_*``, the loader's ``gather``), so each compiled kernel is straight-line code for one
mode. ``grouped_direct_launch`` runs routing + product on device arrays.
"""
import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int64, types, uint16, uint32, uint64
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

from ..device import SIMULATOR
from . import elementwise as ew
from . import grouped as G
from . import halfio
from . import mma as tc
from .launch import default_geometry, grid_3d, inline as _inline, jit, register_geometry
from .ptx import Intrinsic

ALIGN = tc.SMEM_ALIGN   # (a module constant: shared.array needs a literal alignment)
VERSION = 1   # bump when the kernel or its geometry changes (old tier_choices.json verdicts drop)
PAD = 8     # halves of padding a shared row (see the module docstring)


@dataclass(frozen=True)
class TcGeometry:
    bm: int          # block tile rows (of C)
    bn: int          # block tile columns
    bk: int          # K a stage
    wm: int          # warp tile rows (a multiple of 16)
    wn: int          # warp tile columns (a multiple of 16: ldmatrix x4 gives two n8 fragments)
    stages: int = 2  # shared-memory stages (cp.async pipeline depth)
    min_blocks: int = 1   # launch bounds' blocks an SM

    @property
    def warps(self) -> int:
        return (self.bm // self.wm) * (self.bn // self.wn)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared_bytes(self) -> int:
        """Static shared memory of a kernel (bytes; the larger layout of each operand)."""
        a = max(self.bm * (self.bk + PAD), self.bk * (self.bm + PAD))
        b = max(self.bk * (self.bn + PAD), self.bn * (self.bk + PAD))
        return 2 * self.stages * (a + b)


# GPU: 128 x 128 tiles, 8 warps of 64 x 32 (4 x 4 mmas a k16 step, 64 f32 accumulators a
# lane), K 16 a stage through 4 stages: 41 KB of static shared memory (a static declaration may
# take 48 KB), and launch bounds for 2 blocks an SM: ptxas (sm_90, numba-cuda 0.30 here) gives
# 126 registers, no spills, 16 warps an SM. Untimed so far: bench/sweep_matmul_tc.py compares
# it with 128 x 128 x 32 in 2 stages (162 registers, 1 block an SM) and others.
# Simulator: one 32 x 16 x 16 tile of 2 warps (every simulated lane is an OS thread).
GPU_GEOMETRY = TcGeometry(128, 128, 16, 64, 32, stages=4, min_blocks=2)
SIM_GEOMETRY = TcGeometry(32, 16, 16, 16, 16, stages=2)
register_geometry("matmul_tc", gpu=GPU_GEOMETRY, sim=SIM_GEOMETRY)
# the grouped mode's own family (the routing pads every expert to its bm, so a smaller tile
# may win there: bench/sweep_grouped_tc.py times the candidates); the same tiles until then
register_geometry("grouped_tc", gpu=GPU_GEOMETRY, sim=SIM_GEOMETRY)
# the geometries bench/sweep_matmul_tc.py times (the shipped one first); the GPU tests launch
# each of them, so the sweep meets no kernel the tests have not run
SWEEP_GEOMETRIES = (GPU_GEOMETRY,) + tuple(TcGeometry(*g) for g in (
    (128, 128, 32, 64, 32, 2, 1), (128, 128, 32, 64, 32, 2, 2), (128, 128, 16, 64, 32, 4, 1),
    (128, 128, 16, 64, 32, 3, 2), (128, 64, 32, 64, 32, 2, 2), (128, 64, 32, 32, 32, 3, 2),
    (64, 128, 32, 32, 64, 2, 2)))

_u = np.uint64
U0, U1 = _u(0), _u(1)
ZERO16 = uint16(0)
ZERO = float32(0.0)


def _check(geo: TcGeometry):
    """ValueError unless ``geo`` tiles as the kernel needs and fits static shared memory."""
    if (geo.bm % geo.wm or geo.bn % geo.wn or geo.wm % 16 or geo.wn % 16 or geo.bk % 16
            or geo.stages < 2 or geo.shared_bytes() > 48 * 1024):
        raise ValueError(f"tensor-core GEMM geometry {geo}: warp tiles must divide the block "
                         "tile, be multiples of 16 (as bk), stages >= 2, and the stages fit "
                         f"48 KB of static shared memory ({geo.shared_bytes()} bytes)")


def _flat_msg(arr) -> str:
    return (f"tensor-core GEMM kernel: array arguments are flat (1-D, indexed by element "
            f"offset), got {arr}: pass flat views (direct_launch does)")


@intrinsic
def _gpu_flat_only(typingctx, arr):
    """No code; the compile fails unless ``arr`` is a 1-D array (a 2-D C made the store
    ``c[o] = v`` assign row o, far past the matrix: bench/sweep_matmul_tc.py's first GPU run,
    CUDA_ERROR_INVALID_ADDRESS_SPACE)."""
    if not isinstance(arr, types.Array) or arr.ndim != 1:
        raise TypingError(_flat_msg(arr))

    def codegen(context, builder, sig, args):
        return context.get_dummy_value()
    return types.void(arr), codegen


def _twin_flat_only(arr):
    if getattr(arr, "ndim", None) != 1:
        raise ValueError(_flat_msg(f"{getattr(arr, 'ndim', '?')}-D {type(arr).__name__}"))


flat_only = Intrinsic("flat_only", _gpu_flat_only, _twin_flat_only).fn


@_inline
def _row_plain(tab, gr, rows):
    return gr, gr < rows


@_inline
def _row_gathered(tab, gr, rows):
    sr = int64(tab[gr])
    return uint64(max(sr, 0)), sr >= 0


def _loader(R: int, C: int, LD: int, NT: int, vec: bool, gather: bool = False):
    """load(sm, so, src, base, r0, c0, rows, cols, tid, tab): the R x C tile at (r0, c0) of
    the row-major rows x cols matrix at src[base:] into shared ``sm`` from element offset
    ``so`` (rows of LD elements), zeros outside the matrix; a 16-byte chunk (8 halves) a
    thread a step, consecutive threads along the contiguous axis. ``gather``: tile row r is
    the matrix's row tab[r0 + r] (-1: none, zeros; the grouped mode's routed rows); tab is
    unused otherwise."""
    CPR = C // 8                 # chunks a row
    CH = R * CPR                 # chunks a tile
    PT = -(-CH // NT)            # chunks a thread
    FULL = CH % NT == 0
    uCPR, uLD, uCH = _u(CPR), _u(LD), _u(CH)
    src_row = _row_gathered if gather else _row_plain

    @_inline
    def load(sm, so, src, base, r0, c0, rows, cols, tid, tab):
        for p in range(PT):
            ch = tid + _u(p * NT)
            if FULL or ch < uCH:
                r = ch // uCPR
                c = (ch % uCPR) * _u(8)
                d = so + r * uLD + c
                gr, ok = src_row(tab, r0 + r, rows)
                gc = c0 + c
                if vec:
                    if ok and gc < cols:
                        tc.cp_async16(sm, d, src, base + gr * cols + gc)
                    else:
                        for e in range(8):
                            sm[d + _u(e)] = ZERO16
                else:
                    for e in range(8):
                        ge = gc + _u(e)
                        sm[d + _u(e)] = (src[base + gr * cols + ge] if ok and ge < cols
                                         else ZERO16)
    return load


def tc_gemm_kernel(trans_a: bool, trans_b: bool, kind: str, vec: bool, has_bias: bool = False,
                   act=None, has_res: bool = False, geo: TcGeometry | None = None,
                   grouped: bool = False):
    """The kernel for these compile-time choices (one object however it is asked for); geo:
    the device's default "matmul_tc" geometry unless given; ``grouped``: the grouped mode
    (grouped_kernel's docstring)."""
    return _tc_gemm_kernel(bool(trans_a), bool(trans_b), kind, bool(vec), bool(has_bias),
                           act or None, bool(has_res), geo or default_geometry("matmul_tc"),
                           bool(grouped))


def grouped_kernel(trans_w: bool, kind: str, vec: bool, geo: TcGeometry | None = None):
    """The grouped (mixture-of-experts) mode of the same kernel: out[r] = x[r] @ W_e for every
    row r routed to expert e by kernels/grouped.py's routing (its tables padded to this
    geometry's ``bm``: ``route_kernel_for(geo.bm)``), W_e = w[e] ([E, k, n]) or with trans_w
    w[e]^T ([E, n, k]). Called as kernel(out, x, w, d, d, m, n, k, rows, tile_expert, start):
    out [m, n] of ``kind``, x [m, k] and w as uint16 bits, d any 1-element array (no
    epilogue), rows / tile_expert / start the routing's int32 tables. A block takes a routed
    row tile (one expert: B's offset is tile_expert's expert times k n) and a column tile;
    its A rows are gathered through ``rows`` and its output rows scattered back the same way
    (-1, the padding: neither loaded nor stored). geo: the "grouped_tc" family's default
    unless given. Launch with grouped_launch."""
    return tc_gemm_kernel(False, trans_w, kind, vec, geo=geo or default_geometry("grouped_tc"),
                          grouped=True)


@_inline
def _batches_plain(batch):
    return uint64(batch)


@_inline
def _batches_grouped(start):
    return U1


@_inline
def _row_tiles_plain(batch, m, bm):
    return (m + bm - U1) // bm


@_inline
def _row_tiles_grouped(start, m, bm):
    return uint64(start[start.shape[0] - 1]) // bm   # the routed ones (the grid is a bound)


@_inline
def _base_plain(off, z, by, k, n):
    return uint64(off[z])


@_inline
def _a_base_grouped(rows, z, by, k, n):
    return U0


@_inline
def _b_base_grouped(tile_expert, z, by, k, n):
    return uint64(tile_expert[by]) * k * n


@_inline
def _out_row_plain(tab, r, m):
    return int64(r) if r < m else int64(-1)


@_inline
def _out_row_grouped(rows, r, m):
    return int64(rows[r])


@functools.lru_cache(maxsize=None)
def _tc_gemm_kernel(trans_a, trans_b, kind, vec, has_bias, act, has_res, geo, grouped):
    """kernel(c, a, b, bias, res, m, n, k, a_off, b_off, batch): c[z] (flat [batch, m, n], of
    ``kind``) = act(A[z] @ B[z] + bias) + res[z]; A[z] starts at a[a_off[z]], row-major [m, k]
    ([k, m] when trans_a), B[z] at b[b_off[z]], [k, n] ([n, k] when trans_b); a, b uint16 bit
    patterns of ``kind`` (bf16 / f16); bias [n] and res [batch * m * n] of ``kind`` (any
    1-element array when unused); a_off / b_off int64. ``vec``: 16-byte cp.async loads (the
    caller checked alignment: the module docstring). k >= 1. Launch with tc_launch."""
    if kind not in tc.KINDS:
        raise ValueError(f"tensor-core GEMM: operands of kind {kind!r}, expected one of {tc.KINDS}")
    _check(geo)
    if grouped and (trans_a or has_bias or act or has_res):
        raise ValueError("tensor-core GEMM: the grouped mode reads x row-major [m, k] and has "
                         "no epilogue")
    BM, BN, BK, WM, WN, S = geo.bm, geo.bn, geo.bk, geo.wm, geo.wn, geo.stages
    NT = geo.threads
    WARPS_N = BN // WN
    MI, NI, NJ, KS = WM // 16, WN // 8, WN // 16, BK // 16
    # shared tiles (rows, cols), cols the global contiguous axis
    AR, AC = (BK, BM) if trans_a else (BM, BK)
    BR, BC = (BN, BK) if trans_b else (BK, BN)
    LDA, LDB = AC + PAD, BC + PAD
    SA, SB = AR * LDA, BR * LDB                    # elements a stage
    SHA, SHB = (S * SA,), (S * SB,)
    NE = MI * NI * 4                               # accumulators a lane
    # ldmatrix address steps (elements) between m16 tiles (A), n16 pairs (B) and k16 steps
    A_MI, A_KS = (16, 16 * LDA) if trans_a else (16 * LDA, 16)
    B_NJ, B_KS = (16 * LDB, 16) if trans_b else (16, 16 * LDB)
    LDM_A = tc.ldmatrix_x4_trans if trans_a else tc.ldmatrix_x4
    LDM_B = tc.ldmatrix_x4 if trans_b else tc.ldmatrix_x4_trans
    MMA = tc.mma(kind)
    ld, st = halfio.load(kind), halfio.store(kind)
    actf = getattr(ew, act) if act else ew.neg
    has_act = act is not None
    load_a = _loader(AR, AC, LDA, NT, vec, gather=grouped)
    load_b = _loader(BR, BC, LDB, NT, vec)
    # the grouped mode's differences, as functions (one tile loop): a_off / b_off / batch are
    # then rows / tile_expert / start (grouped_kernel's docstring)
    batches = _batches_grouped if grouped else _batches_plain
    row_tiles = _row_tiles_grouped if grouped else _row_tiles_plain
    a_base = _a_base_grouped if grouped else _base_plain
    b_base = _b_base_grouped if grouped else _base_plain
    out_row = _out_row_grouped if grouped else _out_row_plain
    WAIT = S - 2                                   # groups left in flight at a K tile's start
    uBM, uBN, uBK, uS = _u(BM), _u(BN), _u(BK), _u(S)
    uSA, uSB = _u(SA), _u(SB)

    @_inline
    def issue(As, Bs, a, b, ao, bo, row0, col0, k0, stage, m, n, k, tid, tab):
        """The A and B tiles at K offset k0 into ``stage`` (tab: the grouped mode's rows)."""
        if trans_a:
            load_a(As, stage * uSA, a, ao, k0, row0, k, m, tid, tab)
        else:
            load_a(As, stage * uSA, a, ao, row0, k0, m, k, tid, tab)
        if trans_b:
            load_b(Bs, stage * uSB, b, bo, col0, k0, n, k, tid, tab)
        else:
            load_b(Bs, stage * uSB, b, bo, k0, col0, k, n, tid, tab)

    @jit(launch_bounds=(NT, geo.min_blocks))
    def kernel(c, a, b, bias, res, m, n, k, a_off, b_off, batch):
        flat_only(c)
        flat_only(a)
        flat_only(b)
        flat_only(bias)
        flat_only(res)
        flat_only(a_off)
        flat_only(b_off)
        As = cuda.shared.array(SHA, uint16, alignment=ALIGN)
        Bs = cuda.shared.array(SHB, uint16, alignment=ALIGN)
        acc = cuda.local.array((MI, NI, 4), float32)   # constant indices only: registers
        fa = cuda.local.array((MI, 4), uint32)
        fb = cuda.local.array((NI, 2), uint32)
        ep = cuda.local.array(NE, float32)             # the accumulators, for the epilogue
        m, n, k = uint64(m), uint64(n), uint64(k)
        nz = batches(batch)
        tid = uint64(cuda.threadIdx.x)
        lane, warp = tid % _u(32), tid // _u(32)
        wm, wn = warp // _u(WARPS_N), warp % _u(WARPS_N)
        g, t = lane >> _u(2), lane & _u(3)
        # this lane's ldmatrix row within a stage (module mma's docstring: lanes 8j..8j+7
        # give matrix j's rows), before the m16 / n16 / k16 steps
        if trans_a:     # [k][m]: matrix j at k + 8 (j >> 1), m + 8 (j & 1)
            a_lane = ((lane & _u(7)) + _u(8) * (lane >> _u(4))) * _u(LDA) + wm * _u(WM) \
                + _u(8) * ((lane >> _u(3)) & U1)
        else:           # [m][k]: matrix j at m + 8 (j & 1), k + 8 (j >> 1)
            a_lane = (wm * _u(WM) + (lane & _u(15))) * _u(LDA) + _u(8) * (lane >> _u(4))
        if trans_b:     # [n][k]: matrix j at n + 8 (j >> 1), k + 8 (j & 1)
            b_lane = (wn * _u(WN) + (lane & _u(7)) + _u(8) * (lane >> _u(4))) * _u(LDB) \
                + _u(8) * ((lane >> _u(3)) & U1)
        else:           # [k][n]: matrix j at k + 8 (j & 1), n + 8 (j >> 1)
            b_lane = ((lane & _u(7)) + _u(8) * ((lane >> _u(3)) & U1)) * _u(LDB) \
                + wn * _u(WN) + _u(8) * (lane >> _u(4))
        tiles_m = row_tiles(batch, m, uBM)
        tiles_n = (n + uBN - U1) // uBN
        ktiles = (k + uBK - U1) // uBK
        z = uint64(cuda.blockIdx.z)
        while z < nz:      # every loop bound is uniform across the block (barriers inside)
            ao = a_base(a_off, z, U0, k, n)
            co = z * m * n
            by = uint64(cuda.blockIdx.y)
            while by < tiles_m:
                row0 = by * uBM
                bo = b_base(b_off, z, by, k, n)
                bx = uint64(cuda.blockIdx.x)
                while bx < tiles_n:
                    col0 = bx * uBN
                    for mi in range(MI):
                        for ni in range(NI):
                            for i in range(4):
                                acc[mi, ni, i] = ZERO
                    for s in range(S - 1):          # prologue: a group a stage
                        if _u(s) < ktiles:
                            issue(As, Bs, a, b, ao, bo, row0, col0, _u(s) * uBK, _u(s), m, n,
                                  k, tid, a_off)
                        tc.cp_async_commit()
                    kt = U0
                    while kt < ktiles:
                        tc.cp_async_wait(WAIT)      # tile kt's group has landed (this thread's)
                        cuda.syncthreads()          # ... everyone's; stage (kt-1) % S is free
                        nxt = kt + uS - U1
                        if nxt < ktiles:
                            issue(As, Bs, a, b, ao, bo, row0, col0, nxt * uBK, nxt % uS, m, n,
                                  k, tid, a_off)
                        tc.cp_async_commit()        # (an empty group at the end: uniform count)
                        sa = (kt % uS) * uSA + a_lane
                        sb = (kt % uS) * uSB + b_lane
                        for ks in range(KS):
                            for mi in range(MI):
                                w = LDM_A(As, sa + _u(mi * A_MI + ks * A_KS))
                                for r in range(4):
                                    fa[mi, r] = w[r]
                            for nj in range(NJ):
                                w = LDM_B(Bs, sb + _u(nj * B_NJ + ks * B_KS))
                                fb[2 * nj, 0] = w[0]
                                fb[2 * nj, 1] = w[1]
                                fb[2 * nj + 1, 0] = w[2]
                                fb[2 * nj + 1, 1] = w[3]
                            for mi in range(MI):
                                for ni in range(NI):
                                    d = MMA(fa[mi, 0], fa[mi, 1], fa[mi, 2], fa[mi, 3],
                                            fb[ni, 0], fb[ni, 1], acc[mi, ni, 0], acc[mi, ni, 1],
                                            acc[mi, ni, 2], acc[mi, ni, 3])
                                    for i in range(4):
                                        acc[mi, ni, i] = d[i]
                        kt += U1
                    tc.cp_async_wait_all()
                    cuda.syncthreads()    # the next tile's prologue overwrites stage 0
                    # the fused epilogue, through ``ep``: a loop this long stays rolled, and
                    # indexing acc in it would put acc in local memory for the whole kernel
                    for mi in range(MI):
                        for ni in range(NI):
                            for i in range(4):
                                ep[(mi * NI + ni) * 4 + i] = acc[mi, ni, i]
                    r_base = row0 + wm * _u(WM) + g
                    c_base = col0 + wn * _u(WN) + _u(2) * t
                    for e in range(NE):     # C/D float i of tile (mi, ni): row g + 8 (i >> 1),
                        mi, ni, i = e // (NI * 4), (e >> 2) % NI, e & 3   # col 2 t + (i & 1)
                        orow = out_row(a_off, r_base + _u(mi * 16 + 8 * (i >> 1)), m)
                        cl = c_base + _u(ni * 8 + (i & 1))
                        if orow >= 0 and cl < n:
                            v = ep[e]
                            if has_bias:
                                v += ld(bias, cl)
                            if has_act:
                                v = actf(v)
                            o = co + uint64(orow) * n + cl
                            if has_res:
                                v += ld(res, o)
                            st(c, o, v)
                    bx += uint64(cuda.gridDim.x)
                by += uint64(cuda.gridDim.y)
            z += uint64(cuda.gridDim.z)

    return kernel


def tc_launch(m: int, n: int, batch: int, geo: TcGeometry | None = None):
    """(grid, block) for a tc_gemm_kernel launch: a block per C tile and batch, clamped (and
    to a few blocks in the simulator); the kernel strides over the rest."""
    geo = geo or default_geometry("matmul_tc")
    return grid_3d(-(-n // geo.bn), -(-m // geo.bm), batch), (geo.threads,)


def grouped_launch(n: int, max_tiles: int, geo: TcGeometry | None = None):
    """(grid, block) for a grouped_kernel launch: a block per column tile and routed row tile
    up to the routing's bound ``max_tiles`` (blocks past the routed ones return at once),
    clamped; the kernel strides over the rest."""
    geo = geo or default_geometry("grouped_tc")
    return grid_3d(-(-n // geo.bn), max(1, max_tiles), 1), (geo.threads,)


def direct_launch(c, a, b, m: int, n: int, k: int, kind: str, trans_a: bool = False,
                  trans_b: bool = False, geo: TcGeometry | None = None):
    """launch(stream=0), which enqueues C = op(A) @ op(B) (one product, no epilogue) by the
    kernel of ``geo`` (the device's default unless given), launched directly: no graph
    (bench/sweep_matmul_tc.py, the GPU tests). a, b, c: C-contiguous device arrays (NumPy
    ones in the simulator) of any shape holding A ([m, k], [k, m] when trans_a), B ([k, n],
    [n, k] when trans_b) and C [m, n] in ``kind``'s storage (bf16: uint16 bit patterns; f16:
    float16, or its uint16 bits for A and B); the kernel gets flat views of them. cp.async
    loads where vec_ok allows, element loads otherwise."""
    if kind not in tc.KINDS:
        raise ValueError(f"tensor-core GEMM: operands of kind {kind!r}, expected one of {tc.KINDS}")
    out_dt = np.dtype(np.uint16 if kind == "bf16" else np.float16)
    flat = {}
    operands = (("a", a, m * k, (np.uint16, out_dt)), ("b", b, k * n, (np.uint16, out_dt)),
                ("c", c, m * n, (out_dt,)))
    for name, x, size, dts in operands:
        if x.size != size or not x.flags["C_CONTIGUOUS"] or np.dtype(x.dtype) not in dts:
            raise ValueError(f"tensor-core GEMM {m}x{k}x{n} {kind}: {name} is {x.dtype} "
                             f"{tuple(x.shape)} (C-contiguous: {x.flags['C_CONTIGUOUS']}); "
                             f"expected {size} C-contiguous elements of "
                             f"{' or '.join(np.dtype(d).name for d in dts)}")
        flat[name] = x.reshape(size) if x.ndim != 1 else x
    fa, fb, fc = flat["a"].view(np.uint16), flat["b"].view(np.uint16), flat["c"]
    geo = geo or default_geometry("matmul_tc")
    ptrs = () if SIMULATOR else (fa.device_ctypes_pointer.value, fb.device_ctypes_pointer.value)
    zero = cuda.to_device(np.zeros(1, np.int64))
    vec = vec_ok(trans_a, trans_b, m, n, k, [0], [0], ptrs)[0]
    kern = tc_gemm_kernel(trans_a, trans_b, kind, vec, geo=geo)
    grid, block = tc_launch(m, n, 1, geo)
    dummy = cuda.to_device(np.zeros(1, out_dt))
    args = (fc, fa, fb, dummy, dummy, np.int64(m), np.int64(n), np.int64(k), zero, zero,
            np.int64(1))

    def launch(stream=0):
        kern[grid, block, stream](*args)
    launch.vec = vec     # (which loads the launch takes)
    return launch


def grouped_direct_launch(out, x, w, ids, num_e: int, kind: str, trans_w: bool = False,
                          geo: TcGeometry | None = None):
    """launch(stream=0), which enqueues the routing (kernels/grouped.py, at ``geo``'s row
    tile) and the grouped tensor-core product out[r] = x[r] @ W_{ids[r]}, launched directly:
    no graph (bench/sweep_grouped_tc.py, tests/test_grouped_tc.py). x [m, k], w [E, k, n]
    ([E, n, k] with trans_w) and out [m, n]: C-contiguous device arrays (NumPy ones in the
    simulator) in ``kind``'s storage (bf16: uint16 bits; f16: float16 or its uint16 bits for
    x and w); ids int32 [m] on the device. The routing tables are allocated here."""
    geo = geo or default_geometry("grouped_tc")
    m, k = x.shape
    n = w.shape[1] if trans_w else w.shape[2]
    if tuple(out.shape) != (m, n) or w.shape[0] != num_e or tuple(ids.shape) != (m,):
        raise ValueError(f"grouped tensor-core GEMM: out {tuple(out.shape)}, x {tuple(x.shape)}"
                         f", w {tuple(w.shape)}, ids {tuple(ids.shape)} for {num_e} experts")
    nchunks, ch, max_tiles = G.route_plan(m, num_e, geo.bm)
    counts, start, count, tile_expert, rows = (
        cuda.to_device(np.zeros(max(1, size), np.int32))
        for size in (nchunks * num_e, num_e + 1, num_e, max_tiles, max_tiles * geo.bm))
    fx, fw = x.reshape(x.size).view(np.uint16), w.reshape(w.size).view(np.uint16)
    fo = out.reshape(out.size)
    ptrs = () if SIMULATOR else (fx.device_ctypes_pointer.value, fw.device_ctypes_pointer.value)
    vec = vec_ok(False, trans_w, m, n, k, [0], [0], ptrs)[0]
    route = G.route_kernel_for(geo.bm)
    kern = grouped_kernel(trans_w, kind, vec, geo)
    grid, block = grouped_launch(n, max_tiles, geo)
    dummy = cuda.to_device(np.zeros(1, fo.dtype))
    args = (fo, fx, fw, dummy, dummy, np.int64(m), np.int64(n), np.int64(k), rows, tile_expert,
            start)

    def launch(stream=0):
        route[(1,), (G.ROUTE_T,), stream](ids, m, num_e, ch, nchunks, counts, start, count,
                                          tile_expert, rows, fo, 0)
        kern[grid, block, stream](*args)
    launch.vec = vec
    return launch


def vec_ok(trans_a: bool, trans_b: bool, m: int, n: int, k: int, offs_a, offs_b,
           ptrs=()) -> tuple[bool, str]:
    """(whether every operand row is 16-byte aligned for cp.async, why not): the contiguous
    extent of each stored operand (k or m for A, n or k for B), every batch offset a
    multiple of 8 elements, and the device pointers ``ptrs`` multiples of 16 bytes."""
    a_row, b_row = (m if trans_a else k), (k if trans_b else n)
    if a_row % 8 or b_row % 8:
        return False, f"rows of {a_row} / {b_row} elements (not multiples of 8)"
    if np.any(np.asarray(offs_a) % 8) or np.any(np.asarray(offs_b) % 8):
        return False, "batch offsets not multiples of 8 elements"
    if any(p % 16 for p in ptrs):
        return False, "an operand pointer not 16-byte aligned"
    return True, ""
