"""Skinny products (matmul tier 3): y[M, N] = act(x[M, K] @ W^T + bias) + residual, M <= 16.

W is stored [N, K] row-major (the executable stores weights read only by products that way,
as nn.Linear does), f32, or f16 / bf16 (``set_param_half``; bf16 as uint16 bit patterns,
widened by a shift). x, y, bias and residual are f32; sums are f32.

At decode sizes the product is a stream over W's bytes with almost no arithmetic, so the
kernel is shaped for the load queue: a block owns cpw consecutive columns (rows of W) and
its threads walk their K together, thread t taking the 16-byte vectors at
k = (nt j + t) VEC (VEC = 4 f32 or 8 half values; one element when K or a pointer is not
16-byte aligned), u vectors of each column issued before any arithmetic. x is read straight
from global memory: every block of the GPU reads the same few kilobytes, so after the first
touch they are L1 hits; a vector of x is loaded once for all the block's columns. Each
thread keeps M x cpw partial sums; a warp reduce-scatter (``attention.reduce_scatter``:
shuffles on a GPU, shared memory in the simulator) leaves one sum a lane, the warps' sums
meet in shared memory, and a thread a (row, column) adds them in warp order and stores the
result with the epilogue (bias, activation, residual) applied. One block a column group,
rather than one warp, so that short products still have enough blocks for every SM
without splitting K across blocks.

Too few column groups to fill the GPU all the same (a small N with a long K): K is split
over ``splits`` blocks (grid.y). Each writes its sums to a partials buffer; the last block
of a column group to finish (an acquire-release ticket, as decode attention does) adds the
partials in split order -- the same result every run -- applies the epilogue and writes y;
it also resets the ticket, so CUDA graph replays find it at zero. Blocks grid-stride over
the column groups (the simulator launches two).
"""
import functools

from numba import cuda, float32, int32, int64, uint32, uint64

from ..runtime.device import SIMULATOR
from . import elementwise as ew
from . import mathfn as mf
from . import ptx
from .attention import reduce_scatter
from .launch import jit, pow2_at_least

NW = 1 if SIMULATOR else 4          # warps a block (all on the block's columns, K shared)
MAX_M = 16                          # rows of x the tier takes
KINDS = ("f32", "f16", "bf16")
ZERO = float32(0.0)
_HI = uint32(0xFFFF0000)
_S16 = uint32(16)

_inline = cuda.jit(device=True) if SIMULATOR else cuda.jit(device=True, forceinline=True)


def vec_width(kind: str) -> int:
    """Weights a 16-byte vector load brings: 4 f32 or 8 half values."""
    return 4 if kind == "f32" else 8


@_inline
def _widen(wr, uu, wf, cpw, wkind, vec):
    """Registers of the columns' vector loads (wr[uu, c]: f32 values, or uint32 words of half
    pairs) -> float32 weights wf[c, 0: vec]. Element by element (vec 1) they were widened at
    the load already."""
    for c in range(cpw):
        if wkind == 0 or vec == 1:
            for e in range(vec):
                wf[c, e] = wr[uu, c, e]
        else:
            for j in range(vec // 2):
                h = uint32(wr[uu, c, j])
                if wkind == 1:
                    lo, hi = ptx.h2f(h)
                    wf[c, 2 * j] = lo
                    wf[c, 2 * j + 1] = hi
                else:                     # bf16: the f32 bits are the half's bits << 16
                    wf[c, 2 * j] = mf.bits_f32(int32(h << _S16))
                    wf[c, 2 * j + 1] = mf.bits_f32(int32(h & _HI))


@functools.lru_cache(maxsize=None)
def gemv_kernel(m: int, nw: int, cpw: int, u: int, kind: str, vec: int, has_bias: bool, act,
                has_res: bool):
    """The kernel for M = m rows, a block of nw warps on cpw columns, u vectors of each column
    in flight a thread, weights of ``kind`` read ``vec`` at a time (1: element by element),
    the epilogue act(. + bias) + residual (act: an element-wise activation name, or None).

    Launch: grid (groups, splits), block nw * 32; arguments (y, x, w, bias, res, part,
    count, n, k, kchunk, splits) -- bias / res / part / count any 1-element arrays when unused;
    part holds splits * m * n floats and count a zeroed int32 a column group when splits > 1."""
    wkind = KINDS.index(kind)
    nv = m * cpw                          # sums a thread holds
    nvp = pow2_at_least(nv)
    nq = min(32, nvp)                     # values a reduce-scatter round takes
    rounds = nvp // nq
    rep = 32 // nq                        # lanes holding each reduced value
    words = vec if wkind == 0 or vec == 1 else vec // 2   # registers a vector load fills
    xr_shape = (nw, 32, nq) if SIMULATOR else (1, 1, 1)
    actf = getattr(ew, act) if act else ew.neg
    has_act = bool(act)
    nt = nw * 32
    step = nt * vec                       # the block's k per vector
    wtype = float32 if wkind == 0 or vec == 1 else uint32
    xv = max(1, vec // 4)                 # 16-byte loads of a row of x a vector

    @jit(launch_bounds=(nt, 1))
    def kernel(y, x, w, bias, res, part, count, n, k, kchunk, splits):
        xs = cuda.shared.array((nw, 32), float32)     # shuffle stand-in (simulator)
        xr = cuda.shared.array(xr_shape, float32)
        red = cuda.shared.array((nw, nvp), float32)   # the warps' sums
        tk = cuda.shared.array(1, int32)
        acc = cuda.local.array(nvp, float32)
        tmp = cuda.local.array(nq, float32)
        wr = cuda.local.array((u, cpw, words), wtype)
        wf = cuda.local.array((cpw, vec), float32)
        xf = cuda.local.array(vec, float32)
        tid = cuda.threadIdx.x
        lane, wp = tid % 32, tid // 32
        sp = int64(cuda.blockIdx.y)
        groups = (n + cpw - 1) // cpw
        k_lo = sp * kchunk
        k_hi = min(k, k_lo + kchunk)
        grp = int64(cuda.blockIdx.x)
        while grp < groups:               # uniform across the block (barriers inside)
            col0 = grp * cpw
            for i in range(nvp):
                acc[i] = ZERO
            kb = k_lo
            while kb < k_hi:
                for uu in range(u):       # every load of the batch, then the arithmetic
                    kk = kb + (uu * nt + int64(tid)) * vec
                    ok = kk < k_hi
                    for c in range(cpw):
                        wo = uint64(min(col0 + c, n - 1) * k + kk)
                        if vec == 1:
                            if not ok:
                                wr[uu, c, 0] = ZERO
                            elif wkind == 0:
                                wr[uu, c, 0] = w[wo]
                            elif wkind == 1:
                                wr[uu, c, 0] = float32(w[wo])
                            else:
                                wr[uu, c, 0] = ew.bf16_to_f32(w[wo])
                        elif wkind == 0:
                            if ok:
                                v4 = ptx.ld4(w, wo)
                                for e in range(4):
                                    wr[uu, c, e] = v4[e]
                            else:
                                for e in range(4):
                                    wr[uu, c, e] = ZERO
                        else:
                            if ok:
                                v4 = ptx.ld4w(w, wo)
                                for e in range(4):
                                    wr[uu, c, e] = v4[e]
                            else:
                                for e in range(4):
                                    wr[uu, c, e] = uint32(0)
                for uu in range(u):
                    kk = kb + (uu * nt + int64(tid)) * vec
                    if kk < k_hi:
                        _widen(wr, uu, wf, cpw, wkind, vec)
                        for r in range(m):   # a row of x read once, used by every column
                            xo = uint64(r * k + kk)
                            if vec == 1:
                                xf[0] = x[xo]
                            else:
                                for h in range(xv):
                                    x4 = ptx.ld4(x, xo + uint64(4 * h))
                                    for e in range(4):
                                        xf[4 * h + e] = x4[e]
                            for c in range(cpw):
                                for e in range(vec):
                                    acc[r * cpw + c] += xf[e] * wf[c, e]
                kb += u * step
            for q in range(rounds):       # the warp's sums, one a lane, to shared memory
                for i in range(nq):
                    tmp[i] = acc[q * nq + i]
                reduce_scatter(tmp, nq, xs, xr, wp, lane)
                if lane % rep == 0:
                    red[wp, q * nq + lane // rep] = tmp[0]
            cuda.syncthreads()
            e = int64(tid)
            while e < nv:                 # the block's sum of value e: warps in order
                v = red[0, e]
                for ww in range(1, nw):
                    v += red[ww, e]
                r, c = e // cpw, e % cpw
                col = col0 + c
                if col < n:
                    if splits == 1:
                        if has_bias:      # the epilogue: act(v + bias) + residual
                            v += bias[col]
                        if has_act:
                            v = actf(v)
                        if has_res:
                            v += res[r * n + col]
                        y[r * n + col] = v
                    else:
                        part[(sp * m + r) * n + col] = v
                e += nt
            if splits > 1:
                # every thread's partials are written, then the ticket (acq_rel: release
                # covers what the barrier made visible; acquire, for the last block)
                cuda.syncthreads()
                if tid == 0:
                    tk[0] = ptx.ticket(count, grp)
                cuda.syncthreads()
                if tk[0] == splits - 1:   # the last block of this group: add the splits
                    if tid == 0:
                        count[grp] = 0    # ready for the next launch
                    e = int64(tid)
                    while e < nv:
                        r, c = e // cpw, e % cpw
                        col = col0 + c
                        if col < n:
                            s = ZERO
                            for p in range(splits):
                                s += part[(p * m + r) * n + col]
                            if has_bias:
                                s += bias[col]
                            if has_act:
                                s = actf(s)
                            if has_res:
                                s += res[r * n + col]
                            y[r * n + col] = s
                        e += nt
            cuda.syncthreads()            # red is rewritten by the next group
            grp += cuda.gridDim.x

    return kernel


def plan(m: int, n: int, k: int, kind: str, vec: int, sm: int, nw=None, cpw=None, u=None,
         target=None):
    """(nw, cpw, u, groups, splits, kchunk) for a product: warps a block, columns a block,
    vectors of a column in flight a thread, column groups (blocks), K splits and the K range
    a split.

    A block's threads share its columns' K, so a column group is one block: cpw grows (x is
    then read once for more columns) while there are still >= 4 blocks a SM. u covers a
    split's K in one batch where it can (at most 4, and 16 vectors a thread). K is split
    across blocks only when the groups cannot reach ``target`` blocks (default: one a SM)."""
    nw = nw or NW
    nt = nw * 32
    if SIMULATOR:   # few threads and few barriers: wide groups, K split past 64 values
        cpw = cpw or (4 if m <= 4 else 2)
        u = u or 2
        kchunk = 64 if k > 64 else k
        kchunk = -(-kchunk // (nt * vec)) * nt * vec
        return nw, cpw, u, -(-n // cpw), -(-k // kchunk), kchunk
    if cpw is None:
        cpw = 1
        while cpw < 4 and n // (2 * cpw) >= 4 * sm and m * 2 * cpw <= 32:
            cpw *= 2
    groups = -(-n // cpw)
    target = target or sm
    splits = 1
    nvec = -(-k // vec)
    if groups < target and nvec > 2 * nt:
        splits = min(-(-target // groups), nvec // nt)
    kchunk = -(-(-(-k // splits)) // (nt * vec)) * nt * vec
    splits = -(-k // kchunk)
    if u is None:
        u = min(4, pow2_at_least(-(-kchunk // (nt * vec))))
        while u > 1 and u * cpw > 16:
            u //= 2
    return nw, cpw, u, groups, splits, kchunk


# ---- timing (runtime/lower_matmul.py times tier 3 against cuBLAS at compile time) --------------
SPIN_NS = 3_000_000     # the sleep the timed launches queue behind: longer than enqueuing them


@functools.cache
def spin_kernel():
    """One thread sleeping ~ns nanoseconds: the GPU is busy while the host enqueues the timed
    launches behind it, so the events around them time the device, not the host."""
    @jit
    def spin(ns):
        t = int64(0)
        while t < ns:
            cuda.nanosleep(uint32(1000))
            t += 1000
    return spin
