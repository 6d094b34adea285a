"""Skinny products (matmul tier 3): y[M, N] = act(x[M, K] @ W^T + bias) + residual, M <= 16.

W is stored [N, K] row-major (the executable stores weights read only by products that way,
as nn.Linear does), f32, or f16 / bf16 (``set_param_half``; bf16 as uint16 bit patterns,
widened by a shift). x, y, bias and residual are f32 -- or, for a product in f16 / bf16,
of the weight's half type (kernels/halfio.py loads and stores) --; sums are f32. With half weights x is
not rounded (tier 0 casts it to the half type for cuBLAS): rounding it here cost ~4
instructions an x value for every column group reading it, which made half weights slower
than f32 at M = 8 (H200, SmolLM2 shapes); the product is the exactly widened weight times x.

At decode sizes the product is a stream over W's bytes with almost no arithmetic, so the
kernel is shaped for the load queue: a block owns cpw consecutive columns (rows of W) and
its threads walk their K together, thread t taking the 16-byte vectors at
k = (nt j + t) VEC (VEC = 4 f32 or 8 half values; one element when K or a pointer is not
16-byte aligned), u vectors of each column issued before any arithmetic. x is read straight
from global memory: every block of the GPU reads the same few kilobytes, so after the first
touch they are L1 hits; a vector of x is loaded once for all the block's columns. Each
thread keeps M x cpw partial sums; a warp reduce-scatter (``warp.reduce_scatter``:
shuffles on a GPU, shared memory in the simulator) leaves one sum a lane, the warps' sums
meet in shared memory, and a thread a (row, column) adds them in warp order and stores the
result with the epilogue (bias, activation, residual) applied -- or, ``gated``, pairs the
block's columns 2j, 2j + 1 (gate and up rows interleaved in the weight) into act(gate) * up,
SwiGLU with no [M, N] product stored (passes/fusion.py). One block a column group,
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
from dataclasses import dataclass

from numba import cuda, float32, int32, int64, uint32, uint64

from ..device import SIMULATOR
from . import elementwise as ew
from . import halfio
from . import mathfn as mf
from . import ptx
from .launch import default_geometry, inline as _inline, jit, pow2_at_least, register_geometry
from .warp import reduce_scatter



@dataclass(frozen=True)
class Geometry:
    """``plan``'s shapes: nw warps a block; small: the simulator's plan (wide groups, K split
    past 64 values: few threads and few barriers) instead of the GPU's tuned one."""
    nw: int
    small: bool


GPU = Geometry(nw=4, small=False)
SIM = Geometry(nw=2, small=True)
register_geometry("gemv", gpu=GPU, sim=SIM)
MAX_M = 16                          # rows of x the tier takes
REGS = 96                           # register budget of the plan (see plan)
KINDS = ("f32", "f16", "bf16")
ZERO = float32(0.0)
ONE = float32(1.0)
_HI = uint32(0xFFFF0000)
_S16 = uint32(16)



def vec_width(kind: str) -> int:
    """Weights a 16-byte vector load brings: 4 f32 or 8 half values."""
    return 4 if kind == "f32" else 8


@_inline
def _quad(wr, uu, c, h, wkind, vec):
    """Weights 4h .. 4h + 3 of column c's vector load uu as float32 (wr[uu, c]: f32 values,
    or uint32 words of half pairs); element by element (vec 1) only weight 0, widened at the
    load already."""
    # (every branch is typed whatever wr holds: the casts keep the returns float32)
    if vec == 1:
        return float32(wr[uu, c, 0]), ZERO, ZERO, ZERO
    if wkind == 0:
        return (float32(wr[uu, c, 4 * h]), float32(wr[uu, c, 4 * h + 1]),
                float32(wr[uu, c, 4 * h + 2]), float32(wr[uu, c, 4 * h + 3]))
    return _widen(uint32(wr[uu, c, 2 * h]), uint32(wr[uu, c, 2 * h + 1]), wkind)


@_inline
def _widen(a, b, hkind):
    """The 4 half values of words a, b (f16: hkind 1, bf16: 2) as float32."""
    if hkind == 1:
        w0, w1 = ptx.h2f(a)
        w2, w3 = ptx.h2f(b)
        return w0, w1, w2, w3
    # bf16: the f32 bits are the half's bits << 16
    return (mf.bits_f32(int32(a << _S16)), mf.bits_f32(int32(a & _HI)),
            mf.bits_f32(int32(b << _S16)), mf.bits_f32(int32(b & _HI)))


@functools.lru_cache(maxsize=None)
def gemv_kernel(m: int, nw: int, tw: int, cpw: int, u: int, kind: str, vec: int, has_bias: bool,
                act, has_res: bool, minb: int = 1, gated: bool = False, xkind: str = "f32",
                norm: bool = False, pdl: bool = False):
    """The kernel for M = m rows; a block of nw warps in teams of tw warps, a team on cpw
    columns; u vectors of each column in flight a thread; weights of ``kind`` read ``vec``
    at a time (1: element by element); the epilogue act(. + bias) + residual (act: an
    element-wise activation name, or None); minb: blocks a SM the registers are capped for.
    ``gated``: columns 2j and 2j + 1 are gate and up (a packed weight with their rows
    interleaved, a block holding whole pairs: nw // tw * cpw even), and y [M, N / 2] takes
    act(gate + bias) * (up + bias) + residual -- SwiGLU with no [M, N] product stored.
    ``xkind``: the dtype of x, y, bias and residual (f32, or f16 / bf16 read and written
    through kernels/halfio.py: a half product's activations, its weight of the same kind;
    x is read 16 bytes at a time where the weight is (vec 8: the lowering checked x's
    alignment), the sums stay f32 and y is rounded once).
    ``norm``: the product of rms_norm(x) (gamma of x's kind, over K): each thread also sums
    the squares of the x values it reads, a team sees all of K (one split only), and the
    epilogue scales the row's sums by 1 / sqrt(mean + eps) -- x * gamma in f32, the normed x
    never rounded to the half type (passes/fusion.py's norm prologue).
    ``pdl``: launched as a programmatic dependent (kernels/ptx.py ``grid_wait``): the block
    issues its first batch of weight loads -- params, which no kernel writes -- while the
    kernel before it may still run, then waits for it before reading x or the residual or
    writing anything; x is then read with coherent loads (not ld.global.nc, whose cache a
    kernel that started early may hold stale lines in). It lets the next kernel start too.

    Launch: grid (groups, splits), block nw * 32; arguments (y, x, w, bias, res, part,
    count, n, k, kchunk, splits, gamma, eps) -- bias / res / part / count / gamma any
    1-element arrays when unused; part holds splits * m * n floats and count a
    zeroed int32 a column group when splits > 1 (never with ``norm``)."""
    wkind = KINDS.index(kind)
    nv = m * cpw                          # sums a thread holds (then m sums of squares: norm)
    nvp = pow2_at_least(nv + (m if norm else 0))
    nq = min(32, nvp)                     # values a reduce-scatter round takes
    rounds = nvp // nq
    rep = 32 // nq                        # lanes holding each reduced value
    words = vec if wkind == 0 or vec == 1 else vec // 2   # registers a vector load fills
    xr_shape = (nw, 32, nq) if SIMULATOR else (1, 1, 1)
    actf = getattr(ew, act) if act else ew.neg
    has_act = bool(act)
    nt = nw * 32
    teams = nw // tw
    tnt = tw * 32                         # a team's threads
    cpb = teams * cpw                     # columns a block (a column group)
    step = tnt * vec                      # a team's k per vector
    wtype = float32 if wkind == 0 or vec == 1 else uint32
    quads = max(1, vec // 4)              # groups of 4 weights a vector
    qw = 1 if vec == 1 else 4             # weights a group
    assert nw % tw == 0 and (not gated or cpb % 2 == 0)
    ocb = cpb // 2 if gated else cpb      # output columns a block
    xhalf = xkind != "f32"
    xvec = xhalf and vec > 1              # x (and gamma) 8 half values a 16-byte load
    xhk = KINDS.index(xkind)
    ldx, stx = halfio.load(xkind), halfio.store(xkind)
    xw4, x4f = (ptx.vld4w, ptx.vld4) if pdl else (ptx.ld4w, ptx.ld4)   # x's 16-byte loads

    @_inline
    def team_sum(red, r, cb):
        """Column cb of the block, row r: its team's warps' sums in warp order."""
        tm, c = cb // cpw, cb % cpw
        v = red[tm * tw, r * cpw + c]
        for ww in range(1, tw):
            v += red[tm * tw + ww, r * cpw + c]
        return v

    @_inline
    def store(y, bias, res, v, g, r, col, n, rsc):
        """The epilogue of column col (and col + 1, g, when gated), row r, into y; rsc the
        row's norm scale (norm)."""
        if norm:
            v *= rsc
            g *= rsc
        if has_bias:
            v += ldx(bias, col) if xhalf else bias[col]
            if gated:
                g += ldx(bias, col + 1) if xhalf else bias[col + 1]
        if has_act:
            v = actf(v)
        no, oc = n, col
        if gated:
            v *= g
            no, oc = n // 2, col // 2
        if has_res:
            v += ldx(res, r * no + oc) if xhalf else res[r * no + oc]
        if xhalf:
            stx(y, r * no + oc, v)
        else:
            y[r * no + oc] = v

    @jit(launch_bounds=(nt, minb))
    def kernel(y, x, w, bias, res, part, count, n, k, kchunk, splits, gamma, eps):
        xs = cuda.shared.array((nw, 32), float32)     # shuffle stand-in (simulator)
        xr = cuda.shared.array(xr_shape, float32)
        red = cuda.shared.array((nw, nvp), float32)   # the warps' sums
        tk = cuda.shared.array(1, int32)
        acc = cuda.local.array(nvp, float32)
        tmp = cuda.local.array(nq, float32)
        wr = cuda.local.array((u, cpw, words), wtype)
        xf = cuda.local.array((m, 4), float32)
        xw = cuda.local.array((m, 4), uint32)     # x's 16-byte vectors (xvec)
        gw = cuda.local.array(4, uint32)          # gamma's (xvec and norm)
        gf = cuda.local.array(4, float32)
        tid = cuda.threadIdx.x
        lane, wp = tid % 32, tid // 32
        team = int64(wp // tw)
        tt = int64(tid % tnt)             # my thread of the team
        sp = int64(cuda.blockIdx.y)
        groups = (n + cpb - 1) // cpb
        k_lo = sp * kchunk
        k_hi = min(k, k_lo + kchunk)
        grp = int64(cuda.blockIdx.x)
        if pdl:
            ptx.grid_launch_dependents()
        while grp < groups:               # uniform across the block (barriers inside)
            col0 = grp * cpb + team * cpw
            for i in range(nvp):
                acc[i] = ZERO
            kb = k_lo
            while kb < k_hi:
                for uu in range(u):       # every load of the batch, then the arithmetic
                    kk = kb + (uu * tnt + tt) * vec
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
                if pdl:                   # (returns at once after the first batch)
                    ptx.grid_wait()
                for uu in range(u):
                    kk = kb + (uu * tnt + tt) * vec
                    if kk < k_hi:
                        if xvec:                 # every row's 8 x values, one load each
                            for r in range(m):
                                x4 = xw4(x, uint64(r * k + kk))
                                for e in range(4):
                                    xw[r, e] = x4[e]
                            if norm:
                                g4 = ptx.ld4w(gamma, uint64(kk))
                                for e in range(4):
                                    gw[e] = g4[e]
                        for h in range(quads):   # 4 values of every row of x, read once
                            if norm:             # gamma's 4 values
                                go = uint64(kk + 4 * h)
                                if xvec:
                                    gf[0], gf[1], gf[2], gf[3] = _widen(gw[2 * h], gw[2 * h + 1], xhk)
                                elif xhalf or vec == 1:
                                    for e in range(qw):
                                        gf[e] = ldx(gamma, go + uint64(e))
                                else:
                                    g4 = ptx.ld4(gamma, go)
                                    for e in range(4):
                                        gf[e] = g4[e]
                            for r in range(m):   # for all the columns
                                xo = uint64(r * k + kk + 4 * h)
                                if xvec:
                                    xf[r, 0], xf[r, 1], xf[r, 2], xf[r, 3] = _widen(
                                        xw[r, 2 * h], xw[r, 2 * h + 1], xhk)
                                elif xhalf:      # widened an element at a time
                                    for e in range(qw):
                                        xf[r, e] = ldx(x, xo + uint64(e))
                                elif vec == 1:
                                    xf[r, 0] = x[xo]
                                else:
                                    x4 = x4f(x, xo)
                                    for e in range(4):
                                        xf[r, e] = x4[e]
                                if norm:         # x's squares, then x * gamma
                                    for e in range(qw):
                                        acc[nv + r] += xf[r, e] * xf[r, e]
                                        xf[r, e] *= gf[e]
                            for c in range(cpw):
                                w4 = _quad(wr, uu, c, h, wkind, vec)
                                for r in range(m):
                                    for e in range(qw):
                                        acc[r * cpw + c] += xf[r, e] * w4[e]
                kb += u * step
            for q in range(rounds):       # the warp's sums, one a lane, to shared memory
                for i in range(nq):
                    tmp[i] = acc[q * nq + i]
                reduce_scatter(tmp, nq, xs, xr, wp, lane)
                if lane % rep == 0:
                    red[wp, q * nq + lane // rep] = tmp[0]
            cuda.syncthreads()
            if splits == 1:               # the epilogue, an output value a thread
                e = int64(tid)
                while e < m * ocb:
                    r, cb = e // ocb, e % ocb * (2 if gated else 1)
                    col = grp * cpb + cb
                    if col < n:
                        rsc = ONE
                        if norm:         # the row's sum of squares over the team's warps
                            tm = cb // cpw
                            ss = red[tm * tw, nv + r]
                            for ww in range(1, tw):
                                ss += red[tm * tw + ww, nv + r]
                            rsc = ONE / mf.sqrt(ss / float32(k) + eps)
                        store(y, bias, res, team_sum(red, r, cb),
                              team_sum(red, r, cb + 1) if gated else ZERO, r, col, n, rsc)
                    e += nt
            else:                         # the block's sums to the partials
                e = int64(tid)
                while e < m * cpb:
                    r, cb = e // cpb, e % cpb
                    col = grp * cpb + cb
                    if col < n:
                        part[(sp * m + r) * n + col] = team_sum(red, r, cb)
                    e += nt
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
                    while e < m * ocb:
                        r, cb = e // ocb, e % ocb * (2 if gated else 1)
                        col = grp * cpb + cb
                        if col < n:
                            s = ZERO
                            t = ZERO
                            for p in range(splits):
                                s += part[(p * m + r) * n + col]
                                if gated:
                                    t += part[(p * m + r) * n + col + 1]
                            store(y, bias, res, s, t, r, col, n, ONE)
                        e += nt
            cuda.syncthreads()            # red is rewritten by the next group
            grp += cuda.gridDim.x
        if pdl:                           # a block with no group still waits: this kernel
            ptx.grid_wait()               # ends only after the one before it

    return kernel


def plan(m: int, n: int, k: int, kind: str, vec: int, sm: int, nw=None, tw=None, cpw=None,
         u=None, target=None, geo=None, whole_k=False):
    """(nw, tw, cpw, u, groups, splits, kchunk, minb) for a product: warps a block, warps a
    team, columns a team, vectors of a column in flight a thread, column groups (blocks), K
    splits, the K range a split, and the blocks a SM the kernel's registers are capped for.

    A team is the fewest warps that cover K in one batch of at most 4 vectors a thread (one
    round trip to memory; fewer idle lanes on a short K than a whole block). cpw starts at 4
    -- x is read once for all of a team's columns -- and halves while the registers would
    pass REGS (fewer registers, more warps resident: on an H100 at M = 8 a budget of ~100
    ran 49152x576 f32 at 69% of copy, 35% at ~140) or there would be fewer than 2 blocks a
    SM; then teams grow to the whole block while blocks are still short. K is split across
    blocks only when the groups cannot reach ``target`` blocks (default: one a SM). ``geo``:
    the device's default geometry unless given; ``whole_k``: the simulator's plan keeps K in
    one split (a norm prologue needs it; on a GPU the caller declines a split plan)."""
    geo = geo or default_geometry("gemv")
    nw = nw or geo.nw
    if geo.small:   # few threads and few barriers: wide groups, K split past 64 values;
        tw = tw or (1 if m <= 4 else nw)     # both team shapes
        cpw = cpw or (4 if m <= 4 else 2)
        u = u or 2
        kchunk = 64 if k > 64 and not whole_k else k
        kchunk = -(-kchunk // (tw * 32 * vec)) * tw * 32 * vec
        return nw, tw, cpw, u, -(-n // (cpw * nw // tw)), -(-k // kchunk), kchunk, 1
    nvec = -(-k // vec)
    if tw is None:                        # the smallest team covering K in one batch of 4
        tw = 1
        while tw < nw and nvec > 4 * 32 * tw:
            tw *= 2
    minb = 1
    if kind != "f32" and m >= 8:          # arithmetic-heavy: whole-block teams, capped registers
        tw, minb = nw, 4                  # (H100, M = 8 bf16: 49152x576 56 us against 68)
    elif kind != "f32":   # 3 blocks a SM: a norm prologue or an epilogue took the half kernel
        minb = 3          # to ~186 registers, 2 blocks (H100, 1x3072x2048 bf16 + rms_norm:
                          # 4.45 us against 6.06; the plain kernel has ~159 and is unchanged)
    uk = min(4, -(-nvec // (32 * tw)))    # vectors a thread to cover K (at most 4)
    if cpw is None:   # registers: m cpw sums + 4 m of x + 4 u cpw of loads, within REGS;
        cpw = 4       # and >= 2 blocks a SM
        while cpw > 1 and (m * cpw + 4 * m + 4 * uk * cpw > REGS
                           or n // (cpw * nw // tw) < 2 * sm):
            cpw //= 2
    while tw < nw and n // (cpw * nw // tw) < 2 * sm:   # more blocks: bigger teams
        tw *= 2
    groups = -(-n // (cpw * nw // tw))
    tnt = tw * 32
    target = target or sm
    splits = 1
    if groups < target and nvec > 2 * tnt:
        splits = min(-(-target // groups), nvec // tnt)
    kchunk = -(-(-(-k // splits)) // (tnt * vec)) * tnt * vec
    splits = -(-k // kchunk)
    if u is None:
        u = min(4, -(-kchunk // (tnt * vec)))
        while u > 1 and u * cpw > 16:
            u -= 1
        if kind != "f32" and m < 8 and kchunk > 4 * tnt * vec:
            u = min(u, 2)     # a long K in batches of 2: fewer registers, 4 blocks a SM (H100,
                              # 1x2048x8192 bf16, cold weights: 512 groups in one wave, 12.9 us
                              # against 15.5 at u = 4)
    return nw, tw, cpw, u, groups, splits, kchunk, minb


# ---- timing (runtime/lower_matmul.py times tier 3 against cuBLAS at compile time) --------------
SPIN_NS = 3_000_000     # the sleep the timed launches queue behind: longer than enqueuing them


@jit
def spin(ns):
    """One thread sleeping ~ns nanoseconds: the GPU is busy while the host enqueues the timed
    launches behind it, so the events around them time the device, not the host."""
    t = int64(0)
    while t < ns:
        cuda.nanosleep(uint32(1000))
        t += 1000
