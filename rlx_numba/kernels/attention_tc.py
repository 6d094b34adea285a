"""The tensor-core flash kernel (attention tier 1): a FlashAttention-2 forward for f16 / bf16
q, k, v on mma.sync (kernels/mma.py's m16n8k16, ldmatrix and cp.async; sm_80+), with the
masking contract of kernels/attention.py's f32 ``flash`` (its GEOM array, ``scorer`` and LSE
convention), so the numba backward consumes the LSE it writes.

Structure (geometry ``TcAttnGeometry``, the family "attention_tc" of kernels/launch.py). A
block owns BR = 16 MI W query rows of one (batch, query head), W warps of MI m16 row tiles
each, and streams the keys of its kv head (h // (Hq / Hkv): GQA reads K / V in place) BC at
a time through shared memory:

    Q's A fragments are loaded once into registers (MI D / 4 words a lane, straight from
    global memory; above 32 words they are re-read every key tile instead, from L1, as
    FlashAttention-2 re-reads them from shared memory); K tile 0 is issued by cp.async.
    for each key tile:
        wait for K; barrier (every warp is past the last tile's P V: V's buffer is free);
        issue V's tile (its copy overlaps the scores and the softmax);
        S = Q K^T: ldmatrix_x4 of K ([key][dim] rows: the "col" B operand), f32 fragments;
        scale (exp2 units: scale log2 e folded in), softcap, bias and masks -- a tile that
        needs none skips the tests -- and the online softmax in registers: a lane holds two
        rows (g, g + 8) of each of its warp's m16 tiles, a row's max over a quad's 4 lanes
        (two shuffles); its own share of the row sums l (the quad's summed once at the end);
        wait for V; barrier (every warp is past its scores: K's buffer is free);
        issue the next K tile (its copy overlaps P V);
        O += P V: P rounded to the io dtype (cvt.rn.{bf16,f16}x2) straight from the score
        fragments (two m16n8 C tiles are one m16k16 A tile), V's B fragments by
        ldmatrix_x4_trans of its [key][dim] rows; O in f32 fragments. (Each K / V fragment
        feeds MI mma pairs: MI 2 halves the shared-memory reads a product.)
    O / l rounded once to the io dtype; with WITH_LSE the rows' log-sum-exp (natural units,
    -inf for a row that keeps no key, whose output is 0) as kernels/attention.py writes it.

Key tiles wholly masked by causal / window are skipped; causal blocks start from the
heaviest query tiles. Shared memory: K and V tiles of BC x (D + 8) halves, rows padded by 16
bytes (a row stride of an odd number of 16-byte units: the 8 rows an ldmatrix phase reads
fall in 8 distinct bank groups), within 48 KB of static shared memory (``keys`` halves BC
until it fits: 128 keys at D 64, 64 at D 128; 64 at most with a window, mask, bias or
softcap). Rows past Sk are zero-filled (P is 0 there, and 0 times stale bits could be NaN). K / V rows must be 16-byte aligned (cp.async): the
lowering checks the pointers (q's, k's, v's; else tier 2 runs it); D a multiple of 16 makes
every row stride a multiple of 8. A warp's rows that are all in range and see every key of a
tile skip the mask tests (``plain``), so only diagonal / edge tiles pay for them.

Precision: as cuDNN and FlashAttention-2, P is rounded to the io dtype before P V (the row
sums l are of the f32 P), so an output's error is a few units of roundoff of
sum_j p_j |v_j| / l, plus the scores' f32 sums. k / v are passed as uint16 bit patterns
(f16 as its uint16 view), q as uint32 words of two (so 4-byte aligned: the lowering asks 16);
out in its own storage (kernels/halfio.py), the bias in ``bkind``. ``direct_launch`` runs one
attention on device arrays without a graph (bench/sweep_attention_tc.py, the GPU tests).
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int64, uint16, uint32, uint64

from ..device import SIMULATOR
from . import halfio
from . import mathfn as m
from . import mma as tc
from . import ptx
from .attention import NO_LSE, WITH_LSE, divmod_small, scorer
from .launch import inline as _inline, jit, register_geometry
from .warp import xor_shfl

ALIGN = tc.SMEM_ALIGN   # (a module constant: shared.array needs a literal alignment)
PAD = 8                 # halves of padding a shared row (see the module docstring)
SMEM_LIMIT = 48 * 1024  # static shared memory a kernel may declare
MAX_D = 128             # head dims: multiples of 16 up to this (Q's and O's registers)
KINDS = tc.KINDS        # q / k / v storage kinds it takes
MASKED_KEYS = 64        # keys a tile at most with per-element mask work (TcAttnGeometry.keys)

_u = np.uint64
NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)
ZERO16 = uint16(0)
ZERO32 = uint32(0)
LOG2E = float32(1.0 / math.log(2.0))
LN2 = float32(math.log(2.0))


def shared_bytes(bc: int, d: int) -> int:
    """Static shared memory of a kernel with key tiles of ``bc`` keys at head dim ``d``."""
    return 2 * bc * (d + PAD) * 2


@dataclass(frozen=True)
class TcAttnGeometry:
    warps: int           # warps a block
    bc: int              # keys a tile (at most: ``keys`` halves it until shared memory fits)
    min_blocks: int = 1  # launch bounds' blocks an SM
    mi: int = 1          # m16 row tiles a warp (16 mi query rows; K / V fragments reused mi x)

    @property
    def br(self) -> int:
        return 16 * self.mi * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def keys(self, d: int, masked: bool = False) -> int:
        """Keys a tile at head dim ``d``: bc, halved until the K and V tiles fit; at most
        MASKED_KEYS for a kernel with per-element mask work (``masked``: a window, a mask, a
        bias or softcap), whose score loop over 128 keys the compiler did not unroll (S then
        lived in local memory: 256 bytes of stack at D 64; none at 64 keys)."""
        bc = min(self.bc, MASKED_KEYS) if masked else self.bc
        while bc > 16 and shared_bytes(bc, d) > SMEM_LIMIT:
            bc //= 2
        return bc

    def q_regs(self, d: int) -> bool:
        """Whether Q's A fragments stay in registers for the whole key loop (mi d / 4 words a
        lane, at most 32), else re-read from global memory (L1) every key tile, as
        FlashAttention-2 re-reads them from shared memory."""
        return self.mi * d <= 128


# GPU: 4 warps of 16 query rows (64 a block), 128 keys a tile at D <= 64 and 64 at D 128; two
# blocks an SM (ptxas, sm_90, causal bf16: 241 registers at D 64, 247 at D 128, no spills).
# Untimed: two row tiles a warp halve the K / V shared-memory reads a product (an ldmatrix
# of K or V feeds mi mma pairs), which may matter more than occupancy, but at D 128 they spill
# (255 registers; 4 warps x 64 keys, mi 2: 816 bytes of stack, x 32 keys: 1120 with 576
# spilled -- at D 64 mi 2 x 32 keys fits in 230) and 3 blocks an SM (168 registers) spills
# 12 bytes at D 64, 364 at D 128: bench/sweep_attention_tc.py times SWEEP_GEOMETRIES. Simulator: one warp, 16-key tiles (every simulated lane is an OS thread).
GPU_GEOMETRY = TcAttnGeometry(4, 128, 2)
SIM_GEOMETRY = TcAttnGeometry(1, 16, 1)
register_geometry("attention_tc", gpu=GPU_GEOMETRY, sim=SIM_GEOMETRY)
# what bench/sweep_attention_tc.py times (the shipped one first); tests/test_attention_tc.py's
# GPU test launches each, so the sweep meets no kernel the tests have not run
SWEEP_GEOMETRIES = (GPU_GEOMETRY,) + tuple(TcAttnGeometry(*g) for g in (
    (4, 64, 2, 1), (4, 64, 3, 1), (8, 64, 1, 1), (4, 64, 1, 2), (4, 32, 1, 2)))


def check(geo: TcAttnGeometry, d: int):
    """ValueError unless the kernel can be built for ``geo`` at head dim ``d``."""
    if d % 16 or not 16 <= d <= MAX_D:
        raise ValueError(f"tensor-core flash: head dim {d}, expected a multiple of 16 up to "
                         f"{MAX_D}")
    bc = geo.keys(d)
    if geo.warps < 1 or bc % 16 or shared_bytes(bc, d) > SMEM_LIMIT:
        raise ValueError(f"tensor-core flash geometry {geo} at D {d}: at least one warp, key "
                         f"tiles a multiple of 16 within {SMEM_LIMIT} bytes of shared memory "
                         f"({shared_bytes(bc, d)})")


@functools.lru_cache(maxsize=None)
def tile_loader(rows: int, d: int, nt: int):
    """load_tile(sm, src, base, rs, r0, n, tid): rows r0 .. r0 + ``rows`` of the [n, d] matrix
    at src[base:] (a uint16 array, row stride rs) into the shared tile sm (rows of d + PAD
    halves) by cp.async, a 16-byte chunk a thread (tid of ``nt``) a step; rows past n
    zero-filled (0 times stale bits could be NaN). Also the backward's (attention_tc_bwd)."""
    LD = d + PAD
    CPR = d // 8                   # 16-byte chunks a row
    CH = rows * CPR                # chunks a tile
    PT = -(-CH // nt)              # chunks a thread
    FULL = CH % nt == 0
    uLD, uCPR, uCH = _u(LD), _u(CPR), _u(CH)

    @_inline
    def load_tile(sm, src, base, rs, r0, n, tid):
        for p in range(PT):
            ch = tid + _u(p * nt)
            if FULL or ch < uCH:
                r = ch // uCPR
                c = (ch % uCPR) * _u(8)
                at = r * uLD + c
                row = r0 + int64(r)
                if row < n:
                    tc.cp_async16(sm, at, src, uint64(base + row * rs) + c)
                else:
                    for e in range(8):
                        sm[at + _u(e)] = ZERO16

    return load_tile


@functools.lru_cache(maxsize=None)
def flash_tc(geo: TcAttnGeometry, d: int, causal: bool, has_window: bool, has_mask: bool,
             has_bias: bool, has_softcap: bool, lse: int = NO_LSE, kind: str = "bf16",
             bkind: str = "f32"):
    """kernel(out, lse_out, q, k, v, mask, bias, geom, scale, softcap) for head dim ``d``:
    kernels/attention.py's ``flash`` arguments, q as uint32 words (pairs of ``kind`` halves:
    its uint16 bits viewed as uint32, 4-byte aligned), k / v as uint16 bit patterns, out in
    ``kind``'s storage, the bias in ``bkind``'s (f32 or kind); ``lse`` NO_LSE or WITH_LSE
    (lse_out [B, Hq, Sq] f32). Launch with flash_tc_launch."""
    if kind not in tc.KINDS:
        raise ValueError(f"tensor-core flash: q / k / v of kind {kind!r}, expected one of "
                         f"{tc.KINDS}")
    if lse not in (NO_LSE, WITH_LSE):
        raise ValueError(f"tensor-core flash: lse mode {lse} (NO_LSE or WITH_LSE)")
    check(geo, d)
    W, NT, BR, MI = geo.warps, geo.threads, geo.br, geo.mi
    WR = 16 * MI                   # a warp's query rows
    BC = geo.keys(d, has_window or has_mask or has_bias or has_softcap)
    QREG = geo.q_regs(d)
    LD = d + PAD                   # a shared row (halves)
    KD, DN = d // 16, d // 8       # k16 steps over the head dims; n8 tiles of O
    NS, KC = BC // 8, BC // 16     # n8 tiles of S; k16 steps of P V
    TILE = BC * LD
    uLD = _u(LD)
    load_tile = tile_loader(BC, d, NT)
    MMA = tc.mma(kind)
    PACK = tc.f2bf2 if kind == "bf16" else ptx.f2h2
    score = scorer(bkind)
    st = halfio.store(kind)
    with_lse = lse == WITH_LSE
    XS = (W, 32) if SIMULATOR else (1, 1)     # the simulator's shuffle stand-in

    @_inline
    def load_q(fq, q, qbase, qs, q0w, sq, kk, gl, tl):
        """Q's A fragments of k16 step kk into fq[:, kk] (word r: row g + 8 (r & 1), cols
        2t + 8 (r >> 1) and the next: one uint32 of q), zeros past sq."""
        for mi in range(MI):
            for r in range(4):
                row = q0w + int64(gl + _u(16 * mi + 8 * (r & 1)))
                col = _u(16 * kk + 8 * (r >> 1)) + _u(2) * tl
                fq[mi, kk, r] = q[(uint64(qbase + row * qs) + col) >> _u(1)] if row < sq \
                    else ZERO32

    @jit(launch_bounds=(NT, geo.min_blocks))
    def kernel(out, lse_out, q, k, v, mask, bias, geom, scale, softcap):
        Ks = cuda.shared.array(TILE, uint16, alignment=ALIGN)
        Vs = cuda.shared.array(TILE, uint16, alignment=ALIGN)
        xs = cuda.shared.array(XS, float32)
        fq = cuda.local.array((MI, KD, 4), uint32)     # Q's A fragments (constant indices
        s = cuda.local.array((MI, NS, 4), float32)     # only: registers); S, then P
        o = cuda.local.array((MI, DN, 4), float32)
        mr = cuda.local.array((MI, 2), float32)    # rows g and g + 8: max (exp2 units)
        lr = cuda.local.array((MI, 2), float32)    # ... and this lane's share of the sum
        pa = cuda.local.array((MI, 4), uint32)     # P's A fragment of a k16 step
        hq, g, sq, sk = geom[0], geom[1], geom[2], geom[3]
        tid = uint64(cuda.threadIdx.x)
        lane, w = tid % _u(32), tid // _u(32)
        gl, tl = lane >> _u(2), lane & _u(3)
        bh = int64(cuda.blockIdx.y)
        b, h = divmod_small(bh, hq)
        hk = divmod_small(h, g)[0]
        nqt = (sq + BR - 1) // BR
        q0 = (nqt - 1 - int64(cuda.blockIdx.x)) * BR      # heaviest causal tiles first
        q0w = q0 + int64(w) * WR                          # this warp's rows
        qbase = b * geom[5] + h * geom[6]
        qs = geom[7]
        kbase = b * geom[8] + hk * geom[9]
        ks = geom[10]
        off = geom[23]
        scale2 = scale * LOG2E
        if QREG:
            for kk in range(KD):
                load_q(fq, q, qbase, qs, q0w, sq, kk, gl, tl)
        for mi in range(MI):
            for r in range(2):
                mr[mi, r] = NEG_INF
                lr[mi, r] = ZERO
            for dn in range(DN):
                for i in range(4):
                    o[mi, dn, i] = ZERO
        kv_end = sk
        if causal or has_window:          # keys past the tile's last query position: masked
            kv_end = min(sk, max(int64(0), off + q0 + BR))
        kv0 = int64(0)
        if has_window:                    # keys before the first query's window: masked
            kv0 = max(int64(0), off + q0 - geom[22] + 1) // BC * BC
        # this lane's ldmatrix row (module mma's docstring: lanes 8j .. 8j+7 give matrix j's
        # rows). K, [key][dim] as B^T: matrix j at key + 8 (j >> 1), dim + 8 (j & 1); V,
        # [key][dim] as B: matrix j at key + 8 (j & 1), dim + 8 (j >> 1)
        k_lane = ((lane & _u(7)) + _u(8) * (lane >> _u(4))) * uLD \
            + _u(8) * ((lane >> _u(3)) & _u(1))
        v_lane = ((lane & _u(7)) + _u(8) * ((lane >> _u(3)) & _u(1))) * uLD \
            + _u(8) * (lane >> _u(4))
        if kv0 < kv_end:
            load_tile(Ks, k, kbase, ks, kv0, sk, tid)
        tc.cp_async_commit()
        while kv0 < kv_end:               # uniform across the block (barriers inside)
            tc.cp_async_wait(0)           # K's tile has landed (this thread's copies) ...
            cuda.syncthreads()            # ... everyone's; every warp is past P V: V is free
            load_tile(Vs, v, kbase, ks, kv0, sk, tid)
            tc.cp_async_commit()
            for mi in range(MI):
                for ni in range(NS):
                    for i in range(4):
                        s[mi, ni, i] = ZERO
            for kk in range(KD):          # S = Q K^T
                if not QREG:              # re-read (L1) every tile
                    load_q(fq, q, qbase, qs, q0w, sq, kk, gl, tl)
                for nj in range(KC):
                    wd = tc.ldmatrix_x4(Ks, k_lane + _u(nj * 16 * LD + kk * 16))
                    for mi in range(MI):
                        d0 = MMA(fq[mi, kk, 0], fq[mi, kk, 1], fq[mi, kk, 2], fq[mi, kk, 3],
                                 wd[0], wd[1], s[mi, 2 * nj, 0], s[mi, 2 * nj, 1],
                                 s[mi, 2 * nj, 2], s[mi, 2 * nj, 3])
                        d1 = MMA(fq[mi, kk, 0], fq[mi, kk, 1], fq[mi, kk, 2], fq[mi, kk, 3],
                                 wd[2], wd[3], s[mi, 2 * nj + 1, 0], s[mi, 2 * nj + 1, 1],
                                 s[mi, 2 * nj + 1, 2], s[mi, 2 * nj + 1, 3])
                        for i in range(4):
                            s[mi, 2 * nj, i] = d0[i]
                            s[mi, 2 * nj + 1, i] = d1[i]
            # a warp whose rows are all in range and (causal) see every key of the tile needs
            # no mask test (uniform across the warp). C float i of tile ni: row g + 8 (i >> 1),
            # key 8 ni + 2t + (i & 1)
            plain = (not has_window and not has_mask and not has_bias and q0w + WR <= sq
                     and kv0 + BC <= sk and (not causal or kv0 + BC - 1 <= off + q0w))
            for mi in range(MI):
                for ni in range(NS):
                    for i in range(4):
                        x = s[mi, ni, i]
                        if plain:
                            if has_softcap:
                                x = softcap * m.tanh(x * scale / softcap) * LOG2E
                            else:
                                x = x * scale2
                        else:
                            qi = q0w + int64(gl + _u(16 * mi + 8 * (i >> 1)))
                            kj = kv0 + int64(_u(8 * ni + (i & 1)) + _u(2) * tl)
                            x = score(x, qi, kj, off + qi, b, h, mask, bias, geom, scale,
                                      softcap, causal, has_window, has_mask, has_bias,
                                      has_softcap, sq, sk) * LOG2E
                        s[mi, ni, i] = x
            for mi in range(MI):          # the online softmax, rows g and g + 8
                for r in range(2):
                    mx = NEG_INF
                    for ni in range(NS):
                        mx = m.max_nan(m.max_nan(s[mi, ni, 2 * r], s[mi, ni, 2 * r + 1]), mx)
                    mx = m.max_nan(mx, xor_shfl(mx, 1, xs, w, lane))     # over the row's quad
                    mx = m.max_nan(mx, xor_shfl(mx, 2, xs, w, lane))
                    mnew = m.max_nan(mx, mr[mi, r])
                    alpha = ONE
                    if mnew != NEG_INF:
                        alpha = m.exp2(mr[mi, r] - mnew)
                    rs = ZERO
                    for ni in range(NS):
                        for c in range(2):
                            p_ = m.exp2(s[mi, ni, 2 * r + c] - mnew) if mnew != NEG_INF \
                                else ZERO
                            s[mi, ni, 2 * r + c] = p_
                            rs += p_
                    lr[mi, r] = lr[mi, r] * alpha + rs
                    mr[mi, r] = mnew
                    for dn in range(DN):
                        o[mi, dn, 2 * r] *= alpha
                        o[mi, dn, 2 * r + 1] *= alpha
            tc.cp_async_wait(0)           # V's tile has landed ...
            cuda.syncthreads()            # ... everyone's; every warp is past S: K is free
            if kv0 + BC < kv_end:
                load_tile(Ks, k, kbase, ks, kv0 + BC, sk, tid)
            tc.cp_async_commit()          # (an empty group at the end: uniform count)
            for kc in range(KC):          # O += P V; P's C tiles 2 kc, 2 kc + 1 are one A tile
                for mi in range(MI):
                    pa[mi, 0] = PACK(s[mi, 2 * kc, 0], s[mi, 2 * kc, 1])
                    pa[mi, 1] = PACK(s[mi, 2 * kc, 2], s[mi, 2 * kc, 3])
                    pa[mi, 2] = PACK(s[mi, 2 * kc + 1, 0], s[mi, 2 * kc + 1, 1])
                    pa[mi, 3] = PACK(s[mi, 2 * kc + 1, 2], s[mi, 2 * kc + 1, 3])
                for nd in range(KD):
                    wd = tc.ldmatrix_x4_trans(Vs, v_lane + _u(kc * 16 * LD + nd * 16))
                    for mi in range(MI):
                        d0 = MMA(pa[mi, 0], pa[mi, 1], pa[mi, 2], pa[mi, 3], wd[0], wd[1],
                                 o[mi, 2 * nd, 0], o[mi, 2 * nd, 1], o[mi, 2 * nd, 2],
                                 o[mi, 2 * nd, 3])
                        d1 = MMA(pa[mi, 0], pa[mi, 1], pa[mi, 2], pa[mi, 3], wd[2], wd[3],
                                 o[mi, 2 * nd + 1, 0],
                                 o[mi, 2 * nd + 1, 1], o[mi, 2 * nd + 1, 2],
                                 o[mi, 2 * nd + 1, 3])
                        for i in range(4):
                            o[mi, 2 * nd, i] = d0[i]
                            o[mi, 2 * nd + 1, i] = d1[i]
            kv0 += BC
        tc.cp_async_wait_all()
        obase = b * geom[11] + h * geom[12]
        for mi in range(MI):
            for r in range(2):
                li = lr[mi, r]
                li += xor_shfl(li, 1, xs, w, lane)
                li += xor_shfl(li, 2, xs, w, lane)
                qi = q0w + int64(gl + _u(16 * mi + 8 * r))
                if qi < sq:
                    if with_lse and tl == _u(0):
                        lse_out[uint64(bh * sq + qi)] = mr[mi, r] * LN2 + m.log(li) \
                            if li > ZERO else NEG_INF
                    inv = ONE / li if li > ZERO else ZERO     # no key at all: zeros
                    at = uint64(obase + qi * geom[13]) + _u(2) * tl
                    for dn in range(DN):
                        for c in range(2):
                            st(out, at + _u(8 * dn + c), o[mi, dn, 2 * r + c] * inv)

    return kernel


def flash_tc_launch(geo: TcAttnGeometry, b: int, hq: int, sq: int):
    """(grid, block) of a flash_tc launch: a block per BR query rows and (batch, head)."""
    return (-(-sq // geo.br), b * hq), (geo.threads,)


def direct_launch(out, q, k, v, kind: str, causal: bool = False, scale: float | None = None,
                  lse=None, geo: TcAttnGeometry | None = None):
    """launch(stream=0), which enqueues out = attention(q, k, v) (no mask, bias, window or
    softcap; ``lse``: also the rows' LSE) by the kernel of ``geo`` (the device's default
    unless given), launched directly: no graph (bench/sweep_attention_tc.py, the GPU tests).
    q, out [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D]: C-contiguous device arrays (NumPy ones in
    the simulator) in ``kind``'s storage (bf16: uint16 bit patterns; f16: float16, or its
    uint16 bits for q, k, v); lse None or f32 [B, Hq, Sq]. The kernel gets flat views."""
    from .attention import GEOM
    from .launch import default_geometry
    if kind not in KINDS:
        raise ValueError(f"tensor-core flash: q / k / v of kind {kind!r}, expected one of {KINDS}")
    if q.ndim != 4 or k.ndim != 4 or tuple(k.shape) != tuple(v.shape) \
            or tuple(out.shape) != tuple(q.shape) or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3] or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"tensor-core flash: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, out {tuple(out.shape)}: expected q and out [B, Hq, "
                         "Sq, D], k and v [B, Hkv, Sk, D] with Hkv dividing Hq")
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    half = np.dtype(np.uint16 if kind == "bf16" else np.float16)
    for name, x, dts in (("q", q, (np.uint16, half)), ("k", k, (np.uint16, half)),
                         ("v", v, (np.uint16, half)), ("out", out, (half,))):
        if not x.flags["C_CONTIGUOUS"] or np.dtype(x.dtype) not in dts:
            raise ValueError(f"tensor-core flash {kind}: {name} is {x.dtype} {tuple(x.shape)} "
                             f"(C-contiguous: {x.flags['C_CONTIGUOUS']}); expected C-contiguous "
                             f"{' or '.join(np.dtype(t).name for t in dts)}")
    if lse is not None and (tuple(lse.shape) != (b, hq, sq) or np.dtype(lse.dtype) != np.float32):
        raise ValueError(f"tensor-core flash: lse is {lse.dtype} {tuple(lse.shape)}, expected "
                         f"float32 {(b, hq, sq)}")
    geo = geo or default_geometry("attention_tc")
    vals = dict(hq=hq, g=hq // hkv, sq=sq, sk=sk, d=d, q_b=hq * sq * d, q_h=sq * d, q_s=d,
                k_b=hkv * sk * d, k_h=sk * d, k_s=d, o_b=hq * sq * d, o_h=sq * d, o_s=d,
                window=0, off=sk - sq)
    geom = cuda.to_device(np.array([vals.get(n, 0) for n in GEOM], np.int64))
    flat = lambda x: x.reshape(x.size)                                    # noqa: E731
    mask, bias = cuda.to_device(np.zeros(1, np.bool_)), cuda.to_device(np.zeros(1, np.float32))
    lse_f = flat(lse) if lse is not None else cuda.to_device(np.zeros(1, np.float32))
    kern = flash_tc(geo, d, bool(causal), False, False, False, False,
                    NO_LSE if lse is None else WITH_LSE, kind, "f32")
    grid, block = flash_tc_launch(geo, b, hq, sq)
    args = (flat(out), lse_f, flat(q).view(np.uint16).view(np.uint32),
            *(flat(x).view(np.uint16) for x in (k, v)), mask, bias, geom,
            np.float32(1 / math.sqrt(d) if scale is None else scale), np.float32(1.0))

    def launch(stream=0):
        kern[grid, block, stream](*args)
    return launch
