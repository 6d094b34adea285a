"""The tensor-core attention backward (attention_bwd_dq's tier 1): FlashAttention-2's dQ and
dK / dV for f16 / bf16 q, k, v on mma.sync (kernels/mma.py), with the forward tier 1's
operand loader (attention_tc.tile_loader), shared-row padding and fragment addressing, and
the f32 kernels' score (kernels/attention.py ``scorer``: causal top-left / bottom-right,
sliding window, bool masks, an additive bias in f32 or the io dtype and softcap, exactly as
the forward's). The delta Dl = rowsum(dO * O) is
kernels/attention_bwd.py's ``delta`` kernel; LSE the forward's (natural units, -inf for a
row that keeps no key). With P = exp(s - LSE), dP = dO V^T, dS = P (dP - Dl):

    dV = P^T dO,   dK = scale dS'^T Q,   dQ = scale dS' K,
    dS' = dS (1 - tanh^2(scale q.k / softcap))     (softcap's chain rule; dS' = dS without)

One kernel factory, two kinds (``tiles`` of geometry ``TcBwdGeometry``, family
"attention_tc_bwd"). A block owns BR = 16 W "rows" (W warps of one m16 tile each) and streams
BC "columns" a tile through shared memory:

* DKV: rows are keys of one (batch, kv head), columns the queries of every head of its GQA
  group (the group's sum in registers: no atomics, deterministic). S^T = K Q^T,
  dP^T = V dO^T; dV += P^T dO, dK += dS^T Q.
* DQ: rows are queries of one (batch, query head), columns keys of its kv head.
  S = Q K^T, dP = dO V^T; dQ += dS K.

The row tiles X1, X2 (K, V or Q, dO) sit in shared memory for the whole loop, their A
fragments read by ldmatrix_x4 every product (FlashAttention-2's way: registers are for the
two f32 accumulators); the column tiles Y1, Y2 (Q, dO or K, V) are each re-filled by cp.async
as soon as every warp is past its last use in a tile, so each copy overlaps the other tile's
products. Per column tile:

    wait for the first tile (DKV: Y1; DQ: Y2); barrier; its product (S or dP) in f32 fragments
    wait for the second; barrier; the other product
    P = exp2(s log2 e - LSE log2 e), s the score (scaled, capped, biased and masked through
    ``scorer`` where a warp's tile needs the tests: diagonal and edge tiles, or every tile
    with a window, mask or bias), dS' = P (dP - Dl) (times softcap's factor), in registers
    DKV: dK += dS^T Q (dS rounded to the io dtype, an A fragment from two C tiles); barrier;
         refill Y1; dV += P^T dO (P rounded); barrier; refill Y2
    DQ:  barrier; refill Y2 (V); dQ += dS K; barrier; refill Y1 (K)

Rounding as FlashAttention-2 and cuDNN: P and dS to the io dtype for the tensor-core products,
every sum f32, each gradient rounded once (so a result is within a few u of the magnitudes of
the sums that make it, tests/test_attention_half.py ``_magnitudes``). q, k, v, dO are uint16
bit patterns (16-byte aligned rows: cp.async; the lowering checks), outputs in the io
storage (kernels/halfio.py): dQ, or [dK, dV] with dV ``nk`` elements after dK; the bias in
``bkind``'s. Column tiles wholly masked by causal or the window are skipped. A bias's
gradient is attention_bwd_ds's (tier 2's kernel), which reads the delta this node writes.
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int64, uint16, uint32, uint64

from . import halfio
from . import mathfn as m
from . import mma as tc
from . import ptx
from .attention import divmod_small, scorer
from .attention_tc import ALIGN, KINDS, MAX_D, PAD, SMEM_LIMIT, tile_loader
from .launch import inline as _inline, jit, register_geometry

_u = np.uint64
NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
LOG2E = float32(1.0 / math.log(2.0))
DQ, DKV = 0, 1


def shared_bytes(br: int, bc: int, d: int) -> int:
    """Static shared memory of the row tiles (two of ``br`` rows) and column tiles (two of
    ``bc``) at head dim ``d``."""
    return 2 * (br + bc) * (d + PAD) * 2


@dataclass(frozen=True)
class TcBwdGeometry:
    warps: int           # warps a block: 16 rows each
    bc: int              # columns a tile (at most: ``cols`` halves it until shared memory fits)
    min_blocks: int = 1  # launch bounds' blocks an SM

    @property
    def br(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def cols(self, d: int, flags: int = 0) -> int:
        """Columns a tile at head dim ``d``: bc, halved until the four tiles fit; at most
        HEAVY_COLS for a kernel with ``flags`` >= HEAVY_FLAGS of causal, window, mask, bias and
        softcap, whose element loop over 64 columns the compiler did not unroll (ptxas,
        sm_80: S and dP then lived in local memory, 256 bytes of stack at D 32 and 64, with
        mask, bias, softcap and causal or window)."""
        bc = min(self.bc, HEAVY_COLS) if flags >= HEAVY_FLAGS else self.bc
        while bc > 16 and shared_bytes(self.br, bc, d) > SMEM_LIMIT:
            bc //= 2
        return bc


HEAVY_FLAGS, HEAVY_COLS = 4, 32

# GPU: 4 warps (64 rows), 64 columns a tile at D <= 64, 16 at D 128 (the two 64-row tiles take
# 34 KB there); two blocks an SM. Untimed against alternatives. Simulator: one warp, 16 x 16.
GPU_GEOMETRY = TcBwdGeometry(4, 64, 2)
SIM_GEOMETRY = TcBwdGeometry(1, 16, 1)
register_geometry("attention_tc_bwd", gpu=GPU_GEOMETRY, sim=SIM_GEOMETRY)


def check(geo: TcBwdGeometry, d: int):
    """ValueError unless the kernels can be built for ``geo`` at head dim ``d``."""
    if d % 16 or not 16 <= d <= MAX_D:
        raise ValueError(f"tensor-core attention backward: head dim {d}, expected a multiple of "
                         f"16 up to {MAX_D}")
    bc = geo.cols(d)
    if geo.warps < 1 or bc % 16 or shared_bytes(geo.br, bc, d) > SMEM_LIMIT:
        raise ValueError(f"tensor-core attention backward geometry {geo} at D {d}: at least one "
                         f"warp, column tiles a multiple of 16 within {SMEM_LIMIT} bytes of "
                         f"shared memory ({shared_bytes(geo.br, bc, d)})")


@functools.lru_cache(maxsize=None)
def grads_tc(geo: TcBwdGeometry, which: int, d: int, causal: bool, has_window: bool,
             has_mask: bool, has_bias: bool, has_softcap: bool, kind: str = "bf16",
             bkind: str = "f32"):
    """kernel(out, q, k, v, do, lse, dl, mask, bias, geom, scale, softcap, nk) for head dim
    ``d``: ``which`` DQ (out dQ, q's strides) or DKV (out [dK, dV], k's strides, dV at element
    nk); q, k, v, dO uint16 bit patterns of ``kind``, lse / dl f32 [B, Hq, Sq], the mask
    bool and the bias of storage ``bkind`` (each read only with its flag), geom
    kernels/attention.py's GEOM (the window its ``window``). Launch with ``launch``."""
    if kind not in KINDS:
        raise ValueError(f"tensor-core attention backward: q / k / v of kind {kind!r}, "
                         f"expected one of {KINDS}")
    if which not in (DQ, DKV):
        raise ValueError(f"tensor-core attention backward: kernel kind {which} (DQ or DKV)")
    check(geo, d)
    NT, BR = geo.threads, geo.br
    BC = geo.cols(d, causal + has_window + has_mask + has_bias + has_softcap)
    LD = d + PAD
    KD, DN = d // 16, d // 8       # k16 steps over the head dims; n8 tiles of an accumulator
    NS, KC = BC // 8, BC // 16     # n8 tiles of S; k16 steps over the columns
    XT, YT = BR * LD, BC * LD      # a row / column tile (halves)
    uLD = _u(LD)
    rows_q = which == DQ
    load_x = tile_loader(BR, d, NT)
    load_y = tile_loader(BC, d, NT)
    MMA = tc.mma(kind)
    PACK = tc.f2bf2 if kind == "bf16" else ptx.f2h2
    score = scorer(bkind)
    masked = has_window or has_mask or has_bias   # every tile needs the score's tests
    st = halfio.store(kind)

    @_inline
    def product(acc, xs, a_lane, ys, k_lane):
        """acc[NS, 4] = X Y^T over the head dims: the warp's 16 rows of X (A by ldmatrix_x4)
        times BC rows of Y ([column][dim]: the "col" B operand, ldmatrix_x4)."""
        for ni in range(NS):
            for i in range(4):
                acc[ni, i] = ZERO
        for kk in range(KD):
            a = tc.ldmatrix_x4(xs, a_lane + _u(kk * 16))
            for nj in range(KC):
                wd = tc.ldmatrix_x4(ys, k_lane + _u(nj * 16 * LD + kk * 16))
                d0 = MMA(a[0], a[1], a[2], a[3], wd[0], wd[1], acc[2 * nj, 0],
                         acc[2 * nj, 1], acc[2 * nj, 2], acc[2 * nj, 3])
                d1 = MMA(a[0], a[1], a[2], a[3], wd[2], wd[3], acc[2 * nj + 1, 0],
                         acc[2 * nj + 1, 1], acc[2 * nj + 1, 2], acc[2 * nj + 1, 3])
                for i in range(4):
                    acc[2 * nj, i] = d0[i]
                    acc[2 * nj + 1, i] = d1[i]

    @_inline
    def accumulate(o, src, ys, v_lane):
        """o[DN, 4] += src Y: src the warp's [16, BC] f32 C fragments rounded to the io dtype
        (two C tiles are one A tile), Y's BC rows [column][dim] the "row" B operand
        (ldmatrix_x4_trans)."""
        for kc in range(KC):
            a0 = PACK(src[2 * kc, 0], src[2 * kc, 1])
            a1 = PACK(src[2 * kc, 2], src[2 * kc, 3])
            a2 = PACK(src[2 * kc + 1, 0], src[2 * kc + 1, 1])
            a3 = PACK(src[2 * kc + 1, 2], src[2 * kc + 1, 3])
            for nd in range(KD):
                wd = tc.ldmatrix_x4_trans(ys, v_lane + _u(kc * 16 * LD + nd * 16))
                d0 = MMA(a0, a1, a2, a3, wd[0], wd[1], o[2 * nd, 0], o[2 * nd, 1],
                         o[2 * nd, 2], o[2 * nd, 3])
                d1 = MMA(a0, a1, a2, a3, wd[2], wd[3], o[2 * nd + 1, 0], o[2 * nd + 1, 1],
                         o[2 * nd + 1, 2], o[2 * nd + 1, 3])
                for i in range(4):
                    o[2 * nd, i] = d0[i]
                    o[2 * nd + 1, i] = d1[i]

    @jit(launch_bounds=(NT, geo.min_blocks))
    def kernel(out, q, k, v, do, lse_, dl, mask, bias, geom, scale, softcap, nk):
        X1 = cuda.shared.array(XT, uint16, alignment=ALIGN)   # K or Q
        X2 = cuda.shared.array(XT, uint16, alignment=ALIGN)   # V or dO
        Y1 = cuda.shared.array(YT, uint16, alignment=ALIGN)   # Q or K
        Y2 = cuda.shared.array(YT, uint16, alignment=ALIGN)   # dO or V
        s = cuda.local.array((NS, 4), float32)      # S, then P
        dp = cuda.local.array((NS, 4), float32)     # dP, then dS
        o1 = cuda.local.array((DN, 4), float32)     # dV (DKV)
        o2 = cuda.local.array((DN, 4), float32)     # dK or dQ
        rl = cuda.local.array(2, float32)           # DQ: LSE (log2 units) of rows g, g + 8
        rd = cuda.local.array(2, float32)           # ... and their Dl
        hq, g, sq, sk = geom[0], geom[1], geom[2], geom[3]
        qs, ks, off = geom[7], geom[10], geom[23]
        tid = uint64(cuda.threadIdx.x)
        lane, w = tid % _u(32), tid // _u(32)
        gl, tl = lane >> _u(2), lane & _u(3)
        bx = int64(cuda.blockIdx.y)
        scale2 = scale * LOG2E
        if rows_q:
            b, h = divmod_small(bx, hq)
            hk = divmod_small(h, g)[0]
            nrt = (sq + BR - 1) // BR
            r0 = (nrt - 1 - int64(cuda.blockIdx.x)) * BR     # heaviest causal tiles first
            heads, c_lo, c_end = int64(1), int64(0), sk
            if causal or has_window:      # keys past the tile's last query position: masked
                c_end = min(sk, max(int64(0), off + r0 + BR))
            if has_window:                # keys before the first query's window: masked
                c_lo = max(int64(0), off + r0 - geom[22] + 1)
            xbase, xs_, xn = b * geom[5] + h * geom[6], qs, sq
        else:
            b, hk = divmod_small(bx, hq // g)
            h = hk * g
            r0 = int64(cuda.blockIdx.x) * BR                  # (the first key tiles see most)
            heads, c_lo, c_end = g, int64(0), sq
            if causal or has_window:      # queries at or after the tile's first key
                c_lo = max(int64(0), r0 - off)
            if has_window:                # and before its last key's window ends
                c_end = min(sq, max(int64(0), r0 + BR + geom[22] - 1 - off))
            xbase, xs_, xn = b * geom[8] + hk * geom[9], ks, sk
        kbase = b * geom[8] + hk * geom[9]
        rw0 = r0 + int64(w) * 16          # this warp's first row
        for dn in range(DN):
            for i in range(4):
                o1[dn, i] = ZERO
                o2[dn, i] = ZERO
        if rows_q:
            for r in range(2):
                qi = rw0 + int64(gl + _u(8 * r))
                at = uint64(bx * sq + qi)
                rl[r] = lse_[at] * LOG2E if qi < sq else NEG_INF
                rd[r] = dl[at] if qi < sq else ZERO
        # ldmatrix rows of this lane (kernels/mma.py's docstring): A of the warp's 16 X rows,
        # lane L at row L % 16, dim 8 (L >> 4); Y as B^T ([column][dim], attention_tc's K)
        # and as B (attention_tc's V)
        a_lane = (_u(16) * w + (lane & _u(15))) * uLD + _u(8) * (lane >> _u(4))
        k_lane = ((lane & _u(7)) + _u(8) * (lane >> _u(4))) * uLD \
            + _u(8) * ((lane >> _u(3)) & _u(1))
        v_lane = ((lane & _u(7)) + _u(8) * ((lane >> _u(3)) & _u(1))) * uLD \
            + _u(8) * (lane >> _u(4))
        nct = max(int64(0), (c_end - c_lo + BC - 1) // BC)   # column tiles a head
        ntot = heads * nct
        # the first group: X1, X2 and the first column tile read (DKV: Q; DQ: V); then the other
        load_x(X1, q if rows_q else k, xbase, xs_, r0, xn, tid)
        load_x(X2, do if rows_q else v, xbase, xs_, r0, xn, tid)
        if ntot > 0:
            if rows_q:
                load_y(Y2, v, kbase, ks, c_lo, sk, tid)
            else:
                load_y(Y1, q, b * geom[5] + h * geom[6], qs, c_lo, sq, tid)
        tc.cp_async_commit()
        if ntot > 0:
            if rows_q:
                load_y(Y1, k, kbase, ks, c_lo, sk, tid)
            else:
                load_y(Y2, do, b * geom[5] + h * geom[6], qs, c_lo, sq, tid)
        tc.cp_async_commit()
        t = int64(0)
        while t < ntot:                   # uniform across the block (barriers inside)
            hi, ct = divmod_small(t, nct)
            hh = h + hi
            c0 = c_lo + ct * BC
            hn, cn = divmod_small(t + 1, nct)     # the next tile's head and column start
            cn = c_lo + cn * BC
            ybase = kbase if rows_q else b * geom[5] + (h + hn) * geom[6]
            tc.cp_async_wait(1)           # the first tile of this step has landed ...
            cuda.syncthreads()            # ... everyone's
            if rows_q:
                product(dp, X2, a_lane, Y2, k_lane)     # dP = dO V^T
            else:
                product(s, X1, a_lane, Y1, k_lane)      # S^T = K Q^T
            tc.cp_async_wait(0)
            cuda.syncthreads()
            if rows_q:
                product(s, X1, a_lane, Y1, k_lane)      # S = Q K^T
            else:
                product(dp, X2, a_lane, Y2, k_lane)     # dP^T = V dO^T
            # a warp whose rows are all in range and see every column of the tile (causal)
            # needs no mask test (uniform across the warp). C float i of tile ni: row
            # g + 8 (i >> 1), column 8 ni + 2t + (i & 1)
            if rows_q:
                plain = (rw0 + 16 <= sq and c0 + BC <= sk
                         and (not causal or c0 + BC - 1 <= off + rw0))
            else:
                plain = (c0 + BC <= sq and rw0 + 16 <= sk
                         and (not causal or rw0 + 15 <= off + c0))
            plain = plain and not masked
            for ni in range(NS):
                for c in range(2):
                    col = c0 + int64(_u(8 * ni + c) + _u(2) * tl)
                    cl, cd = NEG_INF, ZERO        # DKV: the column (query)'s LSE and Dl
                    if not rows_q and col < sq:
                        at = uint64((b * hq + hh) * sq + col)
                        cl, cd = lse_[at] * LOG2E, dl[at]
                    for r in range(2):
                        i = 2 * r + c
                        row = rw0 + int64(gl + _u(8 * r))
                        if rows_q:
                            qi, kj, l2, dlt = row, col, rl[r], rd[r]
                        else:
                            qi, kj, l2, dlt = col, row, cl, cd
                        raw = s[ni, i]
                        if plain:
                            if has_softcap:
                                x = softcap * m.tanh(raw * scale / softcap) * LOG2E
                            else:
                                x = raw * scale2
                        else:
                            x = score(raw, qi, kj, off + qi, b, hh, mask, bias, geom, scale,
                                      softcap, causal, has_window, has_mask, has_bias,
                                      has_softcap, sq, sk) * LOG2E
                        p = ZERO if x == NEG_INF else m.exp2(x - l2)
                        ds = p * (dp[ni, i] - dlt)
                        if has_softcap:           # d softcap tanh(u / softcap) / du
                            th = m.tanh(raw * scale / softcap)
                            ds = ds * (float32(1.0) - th * th)
                        s[ni, i] = p
                        dp[ni, i] = ds
            if rows_q:
                cuda.syncthreads()        # every warp is past dP: V's buffer is free
                if t + 1 < ntot:
                    load_y(Y2, v, kbase, ks, cn, sk, tid)
                tc.cp_async_commit()      # (an empty group at the end: uniform count)
                accumulate(o2, dp, Y1, v_lane)          # dQ += dS K
                cuda.syncthreads()        # every warp is past K
                if t + 1 < ntot:
                    load_y(Y1, k, kbase, ks, cn, sk, tid)
                tc.cp_async_commit()
            else:
                accumulate(o2, dp, Y1, v_lane)          # dK += dS^T Q
                cuda.syncthreads()        # every warp is past Q
                if t + 1 < ntot:
                    load_y(Y1, q, ybase, qs, cn, sq, tid)
                tc.cp_async_commit()
                accumulate(o1, s, Y2, v_lane)           # dV += P^T dO
                cuda.syncthreads()        # every warp is past dO
                if t + 1 < ntot:
                    load_y(Y2, do, ybase, qs, cn, sq, tid)
                tc.cp_async_commit()
            t += 1
        tc.cp_async_wait_all()
        obase = xbase
        for r in range(2):
            ri = rw0 + int64(gl + _u(8 * r))
            if ri < xn:
                at = uint64(obase + ri * xs_) + _u(2) * tl
                for dn in range(DN):
                    for c in range(2):
                        st(out, at + _u(8 * dn + c), o2[dn, 2 * r + c] * scale)
                        if not rows_q:            # out = [dK, dV]
                            st(out, at + uint64(nk) + _u(8 * dn + c), o1[dn, 2 * r + c])

    return kernel


def launch(geo: TcBwdGeometry, which: int, b: int, hq: int, hkv: int, sq: int, sk: int):
    """(grid, block) of a grads_tc kernel: a block per BR rows and (batch, query head) for
    DQ, (batch, kv head) for DKV."""
    if which == DKV:
        return (-(-sk // geo.br), b * hkv), (geo.threads,)
    return (-(-sq // geo.br), b * hq), (geo.threads,)
