"""Attention kernels: a FlashAttention-style prefill kernel and a split-K decode kernel.

q, k, v and the output are f32, f16 or bf16 (one ``kind``, kernels/halfio.py; the bias
``bkind``: f32 or q's): loads widen to f32, every product, the online softmax and the P V
accumulation run in f32, and the output is rounded once. Half q / k / v are read one element
a load for now (no 16-byte vectors: ``vec`` and the decode's pairs are f32's).

``flash``: one block of NT = 128 threads per (batch * query head, tile of BR queries), the
threads in RG = 8 row groups of NC = 16 consecutive lanes. Thread (tr, tc) holds TR = 8
consecutive query rows (BR = 64; TR = 4, BR = 32, above D = 128, to keep the accumulators
at 64 registers), and for each tile of BC = 64 keys:

* S = Q K^T in registers: a TR x 4 patch (keys 4 tc ..), 32 FMAs per head dim from three
  16-byte shared loads. Q and K are staged DC = 16 head dims at a time, transposed (rows
  padded by 16 bytes), through two shared slots: chunk n goes to slot n % 2, so one barrier a
  chunk, and the next chunk's global loads (16 bytes each when d % 4 == 0) are in flight in
  registers while this one computes. Q is re-staged with every key tile: it does not fit in
  48 KB of static shared memory beside P^T and the slots.
* scale, softcap, bias and masks (a tile that needs none skips the tests); the online
  softmax: each row's max is a ``group_reduce`` over its NC lanes (shuffles), the accumulator
  rescaled by exp(m_old - m_new); each thread keeps its own share of a row's sum l, summed
  over the lanes once at the end.
* P^T to shared memory (key-major: a key's TR probabilities are two 16-byte loads), then
  O += P V with V staged JC = 16 keys at a time through the same two slots: each thread a
  TR x DPT patch (DPT = ceil(D / NC) head dims in groups of 4, 64 apart: 4 tc .., 4 tc + 64
  ..), 64 FMAs per key from four 16-byte loads, two keys a loop trip.

Registers: up to D = 64 the kernel fits 168 a thread (3 blocks an SM); at D = 128 it takes
~250 (2 blocks an SM: at 168 it spilled, and measured slower). Nothing of size Sq x Sk is ever
stored. Causal and window tiles that are entirely masked are skipped; causal blocks start
from the heaviest query tiles.

``decode_split``: few queries (decode). The keys of one key/value head are split across
blocks; a block takes all the query rows that read that head (GQA group x Sq, at most
DEC_ROWS, 16 when D <= 64: short sequences too), each warp a share of the block's keys, kt
keys at a time. Lane l holds head dims l, l+32, ... of every row and of the tile's keys and
values (registers, all loads of a tile issued together; when a lane holds a multiple of 4
dims, as at D = 128 and 256, they are 4l .. 4l+3, 4l+128 .., read as 16-byte vectors: see
``decode_pair``); the partial dot products are reduce-scattered across the warp with
shuffles, so each lane ends with one (row, key) score; the online softmax runs on those and
P reaches the lanes through shared memory for the P V update. The warps' (m, l, acc) merge
in shared memory into one partial a block; the last block of a head to finish (an
acquire-release atomic ticket) merges the splits and writes the output, so decode is one
launch (one split: the block writes the output itself). A launch of fewer blocks than SMs
splits the rows over blocks too. K and V are read once, whatever the GQA
ratio (once per row group when the rows are split). With ``rope`` it also does
rope_kv_write's work for its kv head first (see ``decode_split``).

Integer geometry comes in one int64 array ``geom`` (see GEOM) so launches stay short. Tile
geometry (NT, NC, BC, DC, JC, TR and the decode block's warps) is a ``Geometry``: each kernel
factory takes one, the GPU's (GPU) or the simulator's small one (SIM), chosen in one place
(``launch.default_geometry("attention")``); the simulator can run the GPU's too (tests do).
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, int32, int64, uint16, uint32, uint64
from numba.core.types import float16

from ..device import SIMULATOR
from . import halfio
from . import mathfn as m
from . import ptx
from . import rope as R
from .warp import MAX, SLOTS, SUM, group_reduce, reduce_scatter, warp_sync, xor_shfl
from .launch import default_geometry, inline as _inline, jit, register_geometry

GEOM = ("hq", "g", "sq", "sk", "d", "q_b", "q_h", "q_s", "k_b", "k_h", "k_s", "o_b", "o_h", "o_s",
        "m_b", "m_h", "m_q", "m_k", "b_b", "b_h", "b_q", "b_k", "window", "off")


@dataclass(frozen=True)
class Geometry:
    """Prefill (module docstring): nt threads, nt / nc row groups of nc lanes; bc keys a tile,
    Q and K staged dc head dims at a time, V jc keys at a time (jc / 2 above 8 head dims a
    thread when halve_jc); tr query rows a thread up to 8 head dims a thread, 4 above
    (flash_rows). Decode: dec_nw warps a block."""
    nt: int
    nc: int
    bc: int
    dc: int
    jc: int
    tr: int
    halve_jc: bool
    dec_nw: int

    def __post_init__(self):
        assert self.sc % 4 == 0 and (self.bc * self.dc) % (4 * self.nt) == 0
        assert self.bc % self.jc == 0 and self.jc % 4 == 0 and self.tr in (4, 8)

    @property
    def rg(self):       # row groups
        return self.nt // self.nc

    @property
    def sc(self):       # keys of a tile a thread scores
        return self.bc // self.nc


GPU = Geometry(nt=128, nc=16, bc=64, dc=16, jc=16, tr=8, halve_jc=True, dec_nw=4)
# the simulator's: every CUDA thread is Python there, and most tests' shapes are tiny
SIM = Geometry(nt=16, nc=4, bc=16, dc=8, jc=4, tr=4, halve_jc=False, dec_nw=2)
register_geometry("attention", gpu=GPU, sim=SIM)
PAD = 4                 # rows of Q^T, K^T and P^T padded by 16 bytes: no bank conflicts

NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)
_u = np.uint64


def _jit(threads, min_blocks):
    return jit(launch_bounds=(threads, min_blocks))


def head_split(geo: Geometry, d: int) -> int:
    """Head dims of the output a prefill thread accumulates (DPT): ceil(d / NC) rounded up to
    a multiple of 4, so they come in 16-byte groups."""
    return -(-d // (4 * geo.nc)) * 4


def flash_occ(dpt: int) -> int:
    """Blocks an SM the prefill kernel's registers aim at: 3 (168 registers a thread) up to
    4 head dims a thread (D <= 64); 2 (255) above, where 168 spilled. (H100, causal B8 H32
    S4096: D64 31.2 TFLOP/s at 3, 28.0 at 2; D128 32.8 at 2, 30.3 at 3 with DC = JC = 8 and
    32 bytes spilled.)"""
    return 3 if dpt <= 4 else 2


def flash_rows(geo: Geometry, dpt: int) -> int:
    """Query rows a prefill thread holds (TR): geo.tr (8 on a GPU), or 4 above 8 head dims a
    thread (its TR x DPT accumulators stay at 64 registers)."""
    return geo.tr if dpt <= 8 else 4


def flash_jc(geo: Geometry, dpt: int) -> int:
    """Rows of the accumulated operand (V) staged at a time: JC, or JC / 2 above 8 head dims a
    thread when geo.halve_jc (V's chunk in 16 registers a thread)."""
    return geo.jc // 2 if dpt > 8 and geo.halve_jc else geo.jc


@cuda.jit(device=True)
def divmod_small(x, y):
    """(x // y, x % y) of small non-negative indices with one 32-bit division: numba's int64
    floor division is ~150 instructions, which a short decode block's prologue paid 5 times."""
    qt = int64(uint32(x) // uint32(y))
    return qt, x - qt * y


@functools.cache
def scorer(bkind: str = "f32"):
    """``score`` for a bias of storage kind ``bkind`` (f32, or q's half kind)."""
    ldb = halfio.load(bkind)

    @cuda.jit(device=True)
    def score(x, qi, kj, pos, b, h, mask, bias, geom, scale, softcap, causal, has_window,
              has_mask, has_bias, has_softcap, sq, sk):
        """scale * q.k -> softcapped, biased, masked score (-inf when masked)."""
        x = x * scale
        if has_softcap:
            x = softcap * m.tanh(x / softcap)
        keep = qi < sq and kj < sk
        if keep and has_bias:
            x += ldb(bias, uint64(b * geom[18] + h * geom[19] + qi * geom[20] + kj * geom[21]))
        if causal:
            keep = keep and kj <= pos
        if has_window:                    # pos - w < j <= pos (a window is causal too)
            keep = keep and kj > pos - geom[22] and kj <= pos
        if keep and has_mask:
            keep = mask[uint64(b * geom[14] + h * geom[15] + qi * geom[16] + kj * geom[17])] != 0
        return x if keep else NEG_INF

    return score


@_inline
def _ld4(r, p, src, idx, n, vec):
    """r[p: p + 4] <- src[idx: idx + 4], zeros from element n on (n <= 0: all zeros); one
    16-byte load when vec (idx a multiple of 4, the data aligned: n is then <= 0 or >= 4)."""
    if vec:
        x = ptx.ld4(src, uint64(idx)) if n > 0 else (ZERO, ZERO, ZERO, ZERO)
        for i in range(4):
            r[p + i] = x[i]
    else:
        for i in range(4):
            r[p + i] = src[uint64(idx + i)] if i < n else ZERO


@functools.cache
def _ld4_fn(kind: str):
    """_ld4 for q / k / v of storage kind ``kind``: f32's own, or four widening scalar loads
    (``vec`` ignored: half data is read an element at a time)."""
    if kind == "f32":
        return _ld4
    ld = halfio.load(kind)

    @_inline
    def _ld4h(r, p, src, idx, n, vec):
        for i in range(4):
            r[p + i] = ld(src, uint64(idx + i)) if i < n else ZERO

    return _ld4h


@dataclass(frozen=True)
class PrefillHelpers:
    fetch_rows: object
    put_t: object
    pv_key: object
    stage_product: object


@functools.cache
def prefill_helpers(geo: Geometry, kind: str = "f32") -> PrefillHelpers:
    """The prefill kernels' staging device functions for one geometry and storage kind of the
    staged operands (inlined into the kernel, so their loop counts are constants and their
    arrays stay registers; shared memory holds f32 whatever the kind)."""
    NT, NC, DC = geo.nt, geo.nc, geo.dc
    _ld4 = _ld4_fn(kind)

    @_inline
    def fetch_rows(r, n4, g, src, base, rs, row0, nrows, c0, d, tid, vec):
        """Registers r <- this thread's n4 groups of 4 of a chunk of rows from row0 (stride rs),
        g groups a row from column c0: group e = tid + p NT is row e // g, columns
        c0 + 4 (e % g) ..; zeros past nrows and d."""
        if NT % g == 0:                   # the same columns every p, rows NT / g apart: one
            row = row0 + int64(tid // _u(g))      # address computed, the others added
            col = c0 + int64(tid % _u(g)) * 4
            at = base + row * rs + col
            n = min(d - col, 4)
            for p in range(n4):
                _ld4(r, 4 * p, src, at + (p * (NT // g)) * rs,
                     n if row + p * (NT // g) < nrows else 0, vec)
        else:
            for p in range(n4):
                e = tid + _u(p * NT)
                row = row0 + int64(e // _u(g))
                col = c0 + int64(e % _u(g)) * 4
                _ld4(r, 4 * p, src, base + row * rs + col, min(d - col, 4) if row < nrows else 0,
                     vec)


    @_inline
    def _put_t(stage, at, width, r, n4, tid):
        """The groups of fetch_rows (g = DC / 4) into shared memory transposed: head dim
        major, rows of ``width`` floats from ``at``."""
        for p in range(n4):
            e = tid + _u(p * NT)
            row, f = e // _u(DC // 4), e % _u(DC // 4)
            for i in range(4):
                stage[at + (f * _u(4) + _u(i)) * _u(width) + row] = r[4 * p + i]


    @_inline
    def pv_key(o, fp, fv, Pt, pa, stage, va, tr, dpt):
        """O += P[:, key] V[key]: this thread's tr rows of P^T from Pt[pa:], its dpt head dims of
        V (groups of 4, NC groups apart) from stage[va:]."""
        for i4 in range(tr // 4):
            x = ptx.vld4(Pt, pa + _u(4 * i4))
            for t in range(4):
                fp[4 * i4 + t] = x[t]
        for c4 in range(dpt // 4):
            x = ptx.vld4(stage, va + _u(4 * NC * c4))
            for t in range(4):
                fv[4 * c4 + t] = x[t]
        for i in range(tr):
            for c in range(dpt):
                o[i, c] += fp[i] * fv[c]


    @_inline
    def stage_product(s, fa, fb, stage, slot, ra, rb, a, abase, as_, a0, na, bm, bbase, bs, b0,
                      nb, d, tid, vec, al, bl, tr, sc, qw, kw, koff, slot_size, row0, col0):
        """s[tr, sc] = A[a0 + row0 ..] . B[b0 + col0 ..] over the head dims (A's rows stride as_,
        B's bs; zeros past na / nb rows), staged DC dims at a time, transposed, through stage's
        two slots from ``slot``; ra / rb hold the first chunk's loads on entry (the caller issues
        them early). Returns the next slot."""
        for i in range(tr):
            for j in range(sc):
                s[i, j] = ZERO
        d0 = int64(0)
        while d0 < d:
            sb = slot * slot_size
            _put_t(stage, sb, qw, ra, al, tid)
            _put_t(stage, sb + koff, kw, rb, bl, tid)
            cuda.syncthreads()
            if d0 + DC < d:               # the next chunk's loads fly while this one computes
                fetch_rows(ra, al, DC // 4, a, abase, as_, a0, na, d0 + DC, d, tid, vec)
                fetch_rows(rb, bl, DC // 4, bm, bbase, bs, b0, nb, d0 + DC, d, tid, vec)
            du = _u(0)                    # (a while loop: numba's range() state hides the
            while du < _u(DC):            # trip count from LLVM, which then does not unroll)
                for i4 in range(tr // 4):
                    x = ptx.vld4(stage, sb + du * qw + row0 + _u(4 * i4))
                    for t in range(4):
                        fa[4 * i4 + t] = x[t]
                for j4 in range(sc // 4):
                    x = ptx.vld4(stage, sb + koff + du * kw + col0 + _u(4 * j4))
                    for t in range(4):
                        fb[4 * j4 + t] = x[t]
                for i in range(tr):
                    for j in range(sc):
                        s[i, j] += fa[i] * fb[j]
                du += _u(1)
            slot ^= _u(1)
            d0 += DC
        return slot

    return PrefillHelpers(fetch_rows, _put_t, pv_key, stage_product)


NO_LSE, WITH_LSE, LSE_ONLY = 0, 1, 2     # flash's lse modes


@functools.lru_cache(maxsize=None)
def flash(geo, dpt, vec, causal, has_window, has_mask, has_bias, has_softcap, lse=NO_LSE,
          kind="f32", bkind="f32"):
    """The prefill kernel for DPT = head_split(d) (vec: d a multiple of 4 and q, k, v f32 and
    16-byte aligned, so their loads are 16 bytes). ``lse``: WITH_LSE also writes each row's
    log-sum-exp (-inf where every key is masked; f32) into lse_out [B, Hq, Sq] (saved for the
    backward); LSE_ONLY writes only that (no P V; ``out`` is not touched). ``kind``: q, k, v
    and out's storage, ``bkind`` the bias's (kernels/halfio.py)."""
    lse_only = lse == LSE_ONLY
    NT, NC, BC, DC, RG, SC = geo.nt, geo.nc, geo.bc, geo.dc, geo.rg, geo.sc
    h_ = prefill_helpers(geo, kind)
    score = scorer(bkind)
    st = halfio.store(kind)
    fetch_rows, pv_key, stage_product = h_.fetch_rows, h_.pv_key, h_.stage_product
    TR = flash_rows(geo, dpt)
    BR = RG * TR
    dmax = NC * dpt
    jc = flash_jc(geo, dpt)
    QW, KW = BR + PAD, BC + PAD       # row widths of Q^T and K^T (and P^T: QW)
    KOFF = DC * QW                    # K^T's offset in a slot
    SLOT = max(DC * (QW + KW), jc * dmax)
    STAGE, PT = 2 * SLOT, BC * QW     # (array sizes: constants)
    ql, kl, vl = BR * DC // (4 * NT), BC * DC // (4 * NT), jc * dmax // (4 * NT)
    assert BR * DC % (4 * NT) == 0 and jc * dmax % (4 * NT) == 0 and BC % jc == 0
    NQ, NK, NV = 4 * ql, 4 * kl, 4 * vl
    uNC, uTR, uSC, uQW, uKW = _u(NC), _u(TR), _u(SC), _u(QW), _u(KW)
    uKOFF, uSLOT, udmax, ujc = _u(KOFF), _u(SLOT), _u(dmax), _u(jc)

    @_jit(NT, flash_occ(dpt))
    def kernel(out, lse_out, q, k, v, mask, bias, geom, scale, softcap):
        # two slots, each a Q^T and K^T chunk or a V chunk: staging n fills slot n % 2 while
        # the other may still be read, so one barrier a chunk
        stage = cuda.shared.array(STAGE, float32, alignment=16)
        Pt = cuda.shared.array(PT, float32, alignment=16)     # P^T: key-major
        red = cuda.shared.array(SLOTS, float32)
        s = cuda.local.array((TR, SC), float32)
        o = cuda.local.array((TR, dpt), float32)
        mr = cuda.local.array(TR, float32)
        lr = cuda.local.array(TR, float32)           # this thread's share of each row's sum
        fa = cuda.local.array(TR, float32)
        fb = cuda.local.array(SC, float32)
        fv = cuda.local.array(dpt, float32)
        fa2 = cuda.local.array(TR, float32)
        fv2 = cuda.local.array(dpt, float32)
        rq = cuda.local.array(NQ, float32)       # the next chunk's loads, in flight
        rk = cuda.local.array(NK, float32)
        rv = cuda.local.array(NV, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        tid = uint64(cuda.threadIdx.x)
        tr, tc = tid // uNC, tid % uNC
        row0, col0 = tr * uTR, tc * uSC      # this thread's rows and keys of a tile
        bh = int64(cuda.blockIdx.y)
        b, h = divmod_small(bh, hq)
        hk = divmod_small(h, g)[0]
        nqt = (sq + BR - 1) // BR
        q0 = (nqt - 1 - int64(cuda.blockIdx.x)) * BR     # heaviest causal tiles first
        qbase = b * geom[5] + h * geom[6]
        kbase = b * geom[8] + hk * geom[9]
        qs, ks = geom[7], geom[10]
        off = geom[23]
        kv_end = sk
        if causal or has_window:          # keys past the tile's last query position: masked
            kv_end = min(sk, max(int64(0), off + q0 + BR))
        kv0 = int64(0)
        if has_window:                    # keys before the first query's window: masked
            kv0 = max(int64(0), off + q0 - geom[22] + 1) // BC * BC
        for i in range(TR):
            mr[i] = NEG_INF
            lr[i] = ZERO
            for c in range(dpt):
                o[i, c] = ZERO
        slot = _u(0)
        if kv0 < kv_end:
            fetch_rows(rq, ql, DC // 4, q, qbase, qs, q0, sq, int64(0), d, tid, vec)
            fetch_rows(rk, kl, DC // 4, k, kbase, ks, kv0, sk, int64(0), d, tid, vec)
        while kv0 < kv_end:               # uniform across the block (barriers inside)
            # S = Q K^T (the chunk-0 loads are in flight)
            slot = stage_product(s, fa, fb, stage, slot, rq, rk, q, qbase, qs, q0, sq, k, kbase, ks, kv0,
                         sk, d, tid, vec, ql, kl, TR, SC, uQW, uKW, uKOFF, uSLOT, row0, col0)
            if lse_only:                  # the next tile's Q/K fly during the softmax
                if kv0 + BC < kv_end:
                    fetch_rows(rq, ql, DC // 4, q, qbase, qs, q0, sq, int64(0), d, tid, vec)
                    fetch_rows(rk, kl, DC // 4, k, kbase, ks, kv0 + BC, sk, int64(0), d, tid, vec)
            else:                         # V's first chunk: its loads fly during the softmax
                fetch_rows(rv, vl, dmax // 4, v, kbase, ks, kv0, sk, int64(0), d, tid, vec)
            # a tile with every query and key in range and (causal) every key at or before
            # every query's position needs no mask test (uniform across the block)
            plain = (not has_window and not has_mask and not has_bias and q0 + BR <= sq
                     and kv0 + BC <= sk and (not causal or kv0 + BC - 1 <= off + q0))
            for i in range(TR):
                qi = q0 + int64(row0 + _u(i))
                for j in range(SC):
                    if plain:
                        x = s[i, j] * scale
                        if has_softcap:
                            x = softcap * m.tanh(x / softcap)
                        s[i, j] = x
                    else:
                        s[i, j] = score(s[i, j], qi, kv0 + int64(col0 + _u(j)), off + qi, b, h,
                                         mask, bias, geom, scale, softcap, causal, has_window,
                                         has_mask, has_bias, has_softcap, sq, sk)
            for i in range(TR):           # the online softmax, row by row
                rmax = NEG_INF
                for j in range(SC):
                    x = s[i, j]
                    rmax = x if (x > rmax or x != x) else rmax
                rmax = group_reduce(rmax, red, NC, MAX)
                mnew = rmax if (rmax > mr[i] or rmax != rmax) else mr[i]
                alpha = ONE
                if mnew != NEG_INF:
                    alpha = m.fast_exp(mr[i] - mnew)
                rsum = ZERO
                for j in range(SC):
                    p_ = m.fast_exp(s[i, j] - mnew) if mnew != NEG_INF else ZERO
                    s[i, j] = p_
                    rsum += p_
                lr[i] = lr[i] * alpha + rsum      # (summed over the row's threads at the end)
                mr[i] = mnew
                for c in range(dpt):
                    o[i, c] *= alpha
            if lse_only:
                kv0 += BC
                continue
            for j in range(SC):           # P^T: (Pt was last read before this tile's barriers)
                for i4 in range(TR // 4):
                    ptx.vst4(Pt, (col0 + _u(j)) * uQW + row0 + _u(4 * i4), s[4 * i4, j],
                             s[4 * i4 + 1, j], s[4 * i4 + 2, j], s[4 * i4 + 3, j])
            j0 = int64(0)
            while j0 < BC:                # O += P[:, j0:j0+jc] V[j0:j0+jc]
                sb = slot * uSLOT
                for p in range(vl):       # (a key's dmax dims in a row: group e at 4 e)
                    ptx.vst4(stage, sb + (tid + _u(p * NT)) * _u(4), rv[4 * p], rv[4 * p + 1],
                             rv[4 * p + 2], rv[4 * p + 3])
                cuda.syncthreads()        # (the first also completes Pt)
                if j0 + jc < BC:          # prefetch: the next V chunk, or the next tile's Q/K
                    fetch_rows(rv, vl, dmax // 4, v, kbase, ks, kv0 + j0 + jc, sk, int64(0), d,
                           tid, vec)
                elif kv0 + BC < kv_end:
                    fetch_rows(rq, ql, DC // 4, q, qbase, qs, q0, sq, int64(0), d, tid, vec)
                    fetch_rows(rk, kl, DC // 4, k, kbase, ks, kv0 + BC, sk, int64(0), d, tid, vec)
                pa = uint64(j0) * uQW + row0      # this thread's P^T and V in shared memory
                va = sb + tc * _u(4)
                ju = _u(0)                # two keys a trip: the second key's loads are in
                while ju < ujc:           # flight during the first one's FMAs
                    pv_key(o, fa, fv, Pt, pa, stage, va, TR, dpt)
                    pv_key(o, fa2, fv2, Pt, pa + uQW, stage, va + udmax, TR, dpt)
                    pa += _u(2) * uQW
                    va += _u(2) * udmax
                    ju += _u(2)
                slot ^= _u(1)
                j0 += jc
            kv0 += BC
        obase = b * geom[11] + h * geom[12]
        for i in range(TR):
            qi = q0 + int64(row0 + _u(i))
            li = group_reduce(lr[i], red, NC, SUM)
            if lse != NO_LSE and qi < sq and tc == _u(0):
                lse_out[uint64(bh * sq + qi)] = mr[i] + m.log(li) if li > ZERO else NEG_INF
            if not lse_only and qi < sq:
                inv = ONE / li if li > ZERO else ZERO     # no key at all: zeros
                for c in range(dpt):
                    col = int64(_u(4 * NC * (c // 4) + c % 4) + tc * _u(4))
                    if col < d:
                        st(out, uint64(obase + qi * geom[13] + col), o[i, c] * inv)

    return kernel


def flash_launch(geo: Geometry, b: int, hq: int, sq: int, d: int):
    return (-(-sq // (geo.rg * flash_rows(geo, head_split(geo, d)))), b * hq), (geo.nt,)


# ---- decode: split-K over the keys of one key/value head ---------------------------------------
DEC_ROWS = 8                        # at most this many query rows share a key/value head
CB = 8                              # splits whose partials the combine loads at once
DEC_OCC = 2                         # blocks an SM the decode kernel's registers aim at
DEC_WARP_KEYS = 32                  # a split gives each warp a multiple of this many keys
# ... fewer on short caches: more splits, shorter serial chains (H100, b1 hq32 hkv8 d64 bf16:
# 128 keys 7.3 us at 32, 5.9 at 8; 1024 keys 9.2 at 32, 8.9 at 16, 10.7 at 8)
DEC_SHORT_WARP_KEYS = ((256, 8), (2048, 16))
DEC_SPLIT_KEYS = 2048               # longer splits get more waves of blocks


def decode_rows(g: int, sq: int, d: int) -> int | None:
    """Rows a decode block holds (a power of two >= g * sq), or None: use the prefill kernel.
    Up to DEC_ROWS rows, or 16 for head dims <= 64 (a lane's registers hold rows * d / 32
    query values and as many accumulators): short sequences (S = 16, a flash tile 3/4 empty)
    take this path too."""
    rows = g * sq
    if rows > (16 if d <= 64 else DEC_ROWS):
        return None
    r = 1
    while r < rows:
        r *= 2
    return r


def decode_keys(dpl: int, rows_c: int) -> int:
    """Keys a decode warp takes at once: rows_c * kt scores fill the 32 lanes, at most 8 keys
    (the K and V registers of a tile are 2 * kt * dpl)."""
    return max(1, min(32 // rows_c, 32 // dpl, 8))


@_inline
def _dec_fetch(r, src, kbase, ks, t0, k_hi, lane, d, kt, dpl, pair):
    """Registers <- K (or V) of keys t0 .. t0 + kt, the lane's head dims (see _dec_dim; a key
    past k_hi reads the last key again and is scored -inf; a dim past d reads the last one,
    and q is 0 there), pair dims in one load (fewer load instructions: the LSU queue, not
    DRAM, was what a warp waited on; B8 Hkv8 Sk1024 D128 on an H100, 32.5 us a launch with
    8-byte pairs, 32.2 with 16-byte groups of 4)."""
    for j in range(kt):
        kk = kbase + min(t0 + j, k_hi - 1) * ks
        if pair == 4:
            for u in range(dpl // 4):
                x4 = ptx.ld4(src, uint64(kk + min(_dec_dim(lane, 4 * u, 4), d - 4)))
                for i in range(4):
                    r[j, 4 * u + i] = x4[i]
        elif pair == 2:
            for u in range(dpl // 2):
                x2 = ptx.ld2(src, uint64(kk + min(_dec_dim(lane, 2 * u, 2), d - 2)))
                r[j, 2 * u] = x2[0]
                r[j, 2 * u + 1] = x2[1]
        else:
            for u in range(dpl):
                r[j, u] = src[uint64(kk + min(int64(lane) + u * 32, d - 1))]


@_inline
def _dec_fetch_coherent(r, src, kbase, ks, t0, k_hi, lane, d, kt, dpl, pair):
    """_dec_fetch of f32 K / V that this kernel wrote rows of (the decode with rope_kv_write
    folded in): no read-only-path loads (ld.global.nc may return what the row held before
    the write), 16-byte groups through the ordinary path, pairs as two loads."""
    for j in range(kt):
        kk = kbase + min(t0 + j, k_hi - 1) * ks
        if pair == 4:
            for u in range(dpl // 4):
                x4 = ptx.vld4(src, uint64(kk + min(_dec_dim(lane, 4 * u, 4), d - 4)))
                for i in range(4):
                    r[j, 4 * u + i] = x4[i]
        else:
            for u in range(dpl // pair):
                at = uint64(kk + min(_dec_dim(lane, pair * u, pair), d - pair))
                for i in range(pair):
                    r[j, pair * u + i] = src[at + uint64(i)]


@functools.cache
def _dec_fetch_fn(kind: str, coherent: bool = False):
    """_dec_fetch for K / V of storage kind ``kind``: f32's (vector loads; ``coherent``: none
    on the read-only path), or the same dims a lane read one widening load each."""
    if kind == "f32":
        return _dec_fetch_coherent if coherent else _dec_fetch
    ld = halfio.load(kind)

    @_inline
    def _dec_fetch_h(r, src, kbase, ks, t0, k_hi, lane, d, kt, dpl, pair):
        for j in range(kt):
            kk = kbase + min(t0 + j, k_hi - 1) * ks
            if pair == 1:
                for u in range(dpl):
                    r[j, u] = ld(src, uint64(kk + min(int64(lane) + u * 32, d - 1)))
            else:
                for u in range(dpl // pair):
                    at = uint64(kk + min(_dec_dim(lane, pair * u, pair), d - pair))
                    for i in range(pair):
                        r[j, pair * u + i] = ld(src, at + uint64(i))

    return _dec_fetch_h


def decode_pair(d: int) -> int:
    """4: the decode kernel reads K and V in 16-byte groups of 4 dims (d a multiple of 4, so
    every row starts on a group, and a multiple of 4 values a lane); 2: in 8-byte dim pairs
    (d even); else 1."""
    dpl = -(-d // 32)
    return 4 if d % 4 == 0 and dpl % 4 == 0 else 2 if d % 2 == 0 and dpl % 2 == 0 else 1


@_inline
def _dec_dim(lane, u, pair):
    """The head dim of a lane's value u: lane + 32 u, or with pairs 2 lane + 64 (u // 2) + u % 2."""
    return int64(lane) * pair + (u // pair) * 32 * pair + u % pair


@_inline
def _dec_scores(kr, qr, vals, rows_c, kt, dpl):
    """This lane's partial dot products of every (row, key) of the tile."""
    for r in range(rows_c):
        for j in range(kt):
            s_ = ZERO
            for u in range(dpl):
                s_ += qr[r, u] * kr[j, u]
            vals[r * kt + j] = s_


@functools.cache
def _dec_tile_fn(bkind: str):
    """_dec_tile with the score of a bias of storage kind ``bkind``."""
    score = scorer(bkind)

    @_inline
    def _dec_tile(vr, t0, acc, mr, st, vals, Ps, Ms, xs, xr, w, lane, idx, r_me, j_me,
                  qi_me, gi_me, rows_c, kt, dpl, mask, bias, geom, scale, softcap, causal,
                  has_window, has_mask, has_bias, has_softcap, sq, k_hi, off, b, hk, g):
        """One tile of kt keys through the online softmax, from the lane's partial scores
        ``vals``: reduce-scattered (this lane then holds score ``idx``), the rows' running max
        ``mr`` and the accumulators rescaled, P through shared memory into acc. st = (max, sum)
        of this lane's row."""
        nv = rows_c * kt
        rep = 32 // nv
        reduce_scatter(vals, nv, xs, xr, w, lane)
        x = score(vals[0], qi_me, t0 + j_me, off + qi_me, b, hk * g + gi_me, mask, bias, geom,
                   scale, softcap, causal, has_window, has_mask, has_bias, has_softcap, sq, k_hi)
        tm = x                            # the tile's max of my row: over the lanes of its keys
        o_ = rep
        while o_ < rep * kt:
            y = xor_shfl(tm, o_, xs, w, lane)
            tm = y if (y > tm or y != y) else tm
            o_ *= 2
        Ms[w, r_me] = tm
        warp_sync()
        for r in range(rows_c):
            tmr = Ms[w, r]
            mnew = tmr if (tmr > mr[r] or tmr != tmr) else mr[r]
            alpha = ONE if mnew == NEG_INF else m.fast_exp(mr[r] - mnew)
            mr[r] = mnew
            for u in range(dpl):
                acc[r, u] *= alpha
            if r == r_me:
                st[1] *= alpha
                st[0] = mnew
        p_ = ZERO if st[0] == NEG_INF else m.fast_exp(x - st[0])
        st[1] += p_
        Ps[w, idx] = p_
        warp_sync()
        for r in range(rows_c):
            for j in range(kt):
                pj = Ps[w, r * kt + j]
                for u in range(dpl):
                    acc[r, u] += pj * vr[j, u]
        warp_sync()                       # Ps and Ms are rewritten next tile

    return _dec_tile


@functools.lru_cache(maxsize=None)
def decode_split(geo, dpl, rows_c, pair, causal, has_window, has_mask, has_bias, has_softcap,
                 kind="f32", bkind="f32", pdl=False, rope=False, tkind="f32"):
    """Attention for every row reading one kv head, the keys split across blocks (see the
    module docstring); ``count`` holds a zeroed int32 ticket per (batch, kv head). ``kind``:
    q, k, v and out's storage, ``bkind`` the bias's; the partials are f32. ``pdl``: launched
    as a programmatic dependent (kernels/ptx.py): it lets the next kernel start early and
    waits for the one before before anything else.

    ``rope``: rope_kv_write folded in (kernels/rope.py; cos / sin of storage ``tkind``). ``q``
    is then the packed qkv [B, S, (Hq + 2 Hkv) D] (geom's q strides say where a query head's
    row lies) and k / v the caches. After the wait for the kernel before, a block writes the
    new rows of its kv head (the rotated key, the value's bits; rows cache_position + s) that
    lie among its own keys, then a block barrier behind a block fence makes them visible to
    its threads before any key is read (K and V not on the read-only path): a new row is read
    only by the blocks whose keys hold it, and each of those wrote it itself. Row groups of
    one head (blocks along z) each write the same rows, the same values from the same
    inputs, so whichever store a block reads sees them; the partials the last block combines
    hold no cache row. In the same phase the block's query rows are rotated into shared
    memory (in ``kind``, by rope_kv_write's own row rotation: kernels/rope.py rotate_row_fn),
    and the lanes load their dims from there: the same values as the two kernels. The rope
    arguments (cos .. max_pos: those of rope_kv_write's kernel) are dummies otherwise.

    Lane l holds head dims l, l+32, ... of every query row (registers) and of each key of a
    tile of kt keys (pair == 2: dims 2l, 2l+1, 2l+64, ..., K and V read as float64 pairs). A
    tile's K and V loads are all issued before any math. Each lane's rows_c * kt partial dot
    products are reduce-scattered across the warp (5 shuffle stages),
    after which lane l holds the full score of (row, key) number l // rep; row maxima and
    sums are shuffles among the lanes of a row, and P reaches every lane through shared
    memory for the P V update. No shared memory traffic on the K and V bytes."""
    DEC_NW = geo.dec_nw               # warps a block
    ld, st_ = halfio.load(kind), halfio.store(kind)
    _dec_fetch, _dec_tile = _dec_fetch_fn(kind, rope), _dec_tile_fn(bkind)
    _rotate_row = R.rotate_row_fn(kind, tkind)
    rope_pos = R.rope_pos
    dmax = 32 * dpl
    kt = decode_keys(dpl, rows_c)
    nv = rows_c * kt                  # scores a warp computes a tile
    rep = 32 // nv                    # lanes that end up holding each score
    xr_shape = (DEC_NW, 32, nv) if SIMULATOR else (1, 1, 1)   # (simulator's exchange)
    nt = DEC_NW * 32
    U32 = _u(32)
    tpr = dmax // pair                # threads a row in the block merge
    qs_size = rows_c * dmax if rope else 1
    qs_type = {"f32": float32, "f16": float16, "bf16": uint16}[kind]   # (q's storage)

    occ = max(1, min(DEC_OCC, DEC_OCC * 4 // DEC_NW))
    @_jit(nt, occ)   # up to 255 registers (2 blocks an SM): a tile's loads all in flight at once
    def kernel(out, pm, pl, pacc, count, q, k, v, mask, bias, geom, scale, softcap, chunk, splits,
               hkv, sk, kstride_b, kstride_h, ks, cos, sin, cpos, cache_position, use_cpos, pos,
               pos_bstride, use_pos, half, ncols, pair_mul, pair_gap, max_pos):
        # (hkv, sk and K/V's strides are also in geom; as parameters the first K/V loads
        # need no round trip to memory for their addresses)
        xs = cuda.shared.array((DEC_NW, 32), float32)    # shuffle stand-in (simulator)
        xr = cuda.shared.array(xr_shape, float32)
        Wm = cuda.shared.array((DEC_NW, rows_c), float32)
        Wl = cuda.shared.array((DEC_NW, rows_c), float32)
        Wa = cuda.shared.array((DEC_NW, rows_c, dmax), float32, alignment=16)
        Tk = cuda.shared.array(1, int32)
        fv = cuda.local.array(dpl, float32)
        wb = cuda.local.array(CB, float32)
        lb = cuda.local.array(CB, float32)
        ab = cuda.local.array((CB, dpl), float32)
        wg = cuda.local.array(DEC_NW, float32)
        Ps = cuda.shared.array((DEC_NW, nv), float32)
        Ms = cuda.shared.array((DEC_NW, rows_c), float32)
        qr = cuda.local.array((rows_c, dpl), float32)
        kr = cuda.local.array((kt, dpl), float32)
        vr = cuda.local.array((kt, dpl), float32)
        st = cuda.local.array(2, float32)            # (max, sum) of my lane's row
        acc = cuda.local.array((rows_c, dpl), float32)
        mr = cuda.local.array(rows_c, float32)
        vals = cuda.local.array(nv, float32)
        Qs = cuda.shared.array(qs_size, qs_type)     # the block's rotated queries (rope)
        if pdl:
            ptx.grid_launch_dependents()
            ptx.grid_wait()
        g, sq, d = geom[1], geom[2], geom[4]
        rows = g * sq
        tid = uint64(cuda.threadIdx.x)
        lane, w = tid % U32, tid // U32
        bk = int64(cuda.blockIdx.y)
        b, hk = divmod_small(bk, hkv)
        rb = int64(cuda.blockIdx.z) * rows_c    # this block's rows: rb .. rb + rows_c
        bkz = bk * int64(cuda.gridDim.z) + int64(cuda.blockIdx.z)   # its partials and ticket
        off = geom[23]
        idx = int64(lane) // rep          # the score this lane holds after the reduce-scatter
        r_me, j_me = idx // kt, idx % kt
        gi_me, qi_me = divmod_small(rb + r_me, sq)
        if rb + r_me >= rows:             # a padding row: qi = sq masks it before any read
            gi_me, qi_me = int64(0), sq
        kbase = b * kstride_b + hk * kstride_h
        k_lo = int64(cuda.blockIdx.x) * chunk     # this block's keys
        k_hi = min(sk, k_lo + chunk)
        if rope:                          # this kv head's new rows among the block's keys into
            p0 = int64(cpos[0]) if use_cpos else cache_position   # the caches, and the
            ntu = _u(nt)                                          # block's queries rotated
            for s_ in range(sq):
                t = p0 + s_
                if t >= k_lo and t < k_hi:        # (rows outside the cache are dropped)
                    cb = uint64(rope_pos(pos, b * pos_bstride + s_, use_pos, t, max_pos)) * half
                    src = uint64(b * geom[5] + s_ * geom[7] + (geom[0] + hk) * d)
                    dst = uint64(kbase + t * ks)
                    _rotate_row(k, dst, q, src, cos, sin, cb, tid, ncols, half, pair_mul,
                                pair_gap, ntu)
                    src += uint64(hkv * d)
                    c = tid
                    while c < uint64(d):
                        v[dst + c] = q[src + c]   # (same dtype: the bits as they are)
                        c += ntu
            # the queries rotated into shared memory by rope_kv_write's own _rotate_row (the
            # same products, rounded to kind as it stores q), a work item a thread at a time:
            # per-lane loops over rotations would not unroll, and the lanes' register arrays
            # would go to local memory
            e = int64(tid)
            while e < rows_c * ncols:
                r, c = divmod_small(e, int64(ncols))
                if rb + r < rows:
                    gi, qi = divmod_small(rb + r, sq)
                    cq = uint64(rope_pos(pos, b * pos_bstride + qi, use_pos, p0 + qi,
                                         max_pos)) * half
                    _rotate_row(Qs, uint64(r * dmax), q, uint64(b * geom[5] + (hk * g + gi)
                                                               * geom[6] + qi * geom[7]),
                                cos, sin, cq, uint64(c), ncols, half, pair_mul, pair_gap, ncols)
                e += nt
            cuda.threadfence_block()      # the rows written, then read by the block's warps
            cuda.syncthreads()
        for r in range(rows_c):
            gi, qi = divmod_small(rb + r, sq)
            mr[r] = NEG_INF
            for u in range(dpl):
                dg = _dec_dim(lane, u, pair)
                if rope:
                    qr[r, u] = ld(Qs, uint64(r * dmax + dg)) if rb + r < rows and dg < d else ZERO
                else:
                    qr[r, u] = ld(q, uint64(b * geom[5] + (hk * g + gi) * geom[6] + qi * geom[7]
                                            + dg)) if rb + r < rows and dg < d else ZERO
                acc[r, u] = ZERO
        st[0] = NEG_INF
        st[1] = ZERO
        t0 = k_lo + int64(w) * kt
        tile = DEC_NW * kt                # the block's keys a trip, the same trips every warp
        k_end = k_lo + (k_hi - k_lo + tile - 1) // tile * tile
        while t0 < k_end:
            # the whole tile's loads, then its math. Measured slower on an H100: the next
            # tile's loads into a second register set, or into K's and V's registers as soon
            # as each is used (Sk 1024: 60-61% of copy against 63%; 32k: 95% against 99%)
            _dec_fetch(kr, k, kbase, ks, t0, k_hi, lane, d, kt, dpl, pair)
            _dec_fetch(vr, v, kbase, ks, t0, k_hi, lane, d, kt, dpl, pair)
            _dec_scores(kr, qr, vals, rows_c, kt, dpl)
            _dec_tile(vr, t0, acc, mr, st, vals, Ps, Ms, xs, xr, w, lane, idx, r_me,
                      j_me, qi_me, gi_me, rows_c, kt, dpl, mask, bias, geom, scale, softcap,
                      causal, has_window, has_mask, has_bias, has_softcap, sq, k_hi, off, b, hk, g)
            t0 += tile
        m_me, l_me = st[0], st[1]
        o_ = rep                          # my row's sum: over the lanes of its keys
        while o_ < rep * kt:
            l_me += xor_shfl(l_me, o_, xs, w, lane)
            o_ *= 2
        if int64(lane) % (rep * kt) == 0:  # the block's warps merge in shared memory
            Wm[w, r_me] = m_me
            Wl[w, r_me] = l_me
        for r in range(rows_c):
            if pair == 4:                 # (the lane's 4 dims are consecutive: one store)
                for uu in range(dpl // 4):
                    ptx.vst4(Wa, (int64(w) * rows_c + r) * dmax + _dec_dim(lane, 4 * uu, 4),
                             acc[r, 4 * uu], acc[r, 4 * uu + 1], acc[r, 4 * uu + 2],
                             acc[r, 4 * uu + 3])
            else:
                for u in range(dpl):
                    Wa[w, r, _dec_dim(lane, u, pair)] = acc[r, u]
        cuda.syncthreads()
        # the block's partial: a thread takes pair dims of a row (4 consecutive ones, in one
        # 16-byte load a warp and one store, when pair == 4; else dims j, j + tpr, ..., which
        # keeps the shared loads free of bank conflicts) and the row's warp weights once.
        # (B8 Hkv8 Sk1024 D128, H100: this merge took 0.7-1.3 us of the tail with a thread
        # per element, 0.3-0.8 now; the j + i tpr layout there too, scalar loads and stores
        # in it and in the combine: 31.6 us a launch against 31.1)
        part = (bkz * splits + int64(cuda.blockIdx.x)) * rows_c
        e = int64(tid)
        while e < rows_c * tpr:
            r, j = e // tpr, e % tpr
            mx = NEG_INF
            for ww in range(DEC_NW):
                wg[ww] = Wm[ww, r]
                mx = m.max_nan(mx, wg[ww])
            den = ZERO
            for ww in range(DEC_NW):
                wg[ww] = ZERO if mx == NEG_INF else m.fast_exp(wg[ww] - mx)
                den += Wl[ww, r] * wg[ww]
            for i in range(pair):
                fv[i] = ZERO
            for ww in range(DEC_NW):
                if pair == 4:
                    a4 = ptx.vld4(Wa, (int64(ww) * rows_c + r) * dmax + j * 4)
                    for i in range(4):
                        fv[i] += a4[i] * wg[ww]
                else:
                    for i in range(pair):
                        fv[i] += Wa[ww, r, j + i * tpr] * wg[ww]
            if splits == 1:               # the block saw every key: the output itself
                gi, qi = divmod_small(rb + r, sq)
                for i in range(pair):
                    dd = j * 4 + i if pair == 4 else j + i * tpr
                    if rb + r < rows and dd < d:
                        st_(out, uint64(b * geom[11] + (hk * g + gi) * geom[12] + qi * geom[13]
                                        + dd), fv[i] / den if den != ZERO else ZERO)
            else:
                if pair == 4:
                    ptx.vst4(pacc, (part + r) * dmax + j * 4, fv[0], fv[1], fv[2], fv[3])
                else:
                    for i in range(pair):
                        pacc[(part + r) * dmax + j + i * tpr] = fv[i]
                if j == 0:
                    pm[part + r] = mx
                    pl[part + r] = den
            e += nt
        if splits == 1:
            return
        # The last block of the head to take a ticket combines the splits. (B8 Hkv8 Sk1024
        # D128 on an H100: ~2.4 us of a 31 us launch from the block's last key to its ticket
        # and then the combine; the keys' end itself varies by ~5 us across blocks. Measured
        # worse: a head's splits as one thread block cluster combining through distributed
        # shared memory -- the clusters left 8 SMs idle and one wave no longer fit; an
        # online combine in rounds of CB for every split count, staggered warp starts, a
        # partial per warp with no merge.)
        cuda.syncthreads()                # every thread's partials are written, then the
        if tid == 0:                      # ticket: an acq_rel atomic (release covers what the
            Tk[0] = ptx.ticket(count, bkz)  # barrier made visible; acquire, the last block)
        cuda.syncthreads()
        if Tk[0] != splits - 1:           # not the last block of this kv head to finish
            return
        if tid == 0:
            count[bkz] = 0                # ready for the next launch
        base = bkz * splits * rows_c
        r0 = int64(0)
        while r0 < rows_c:                # the last block combines: a warp per row
            r = r0 + int64(w)
            rr = min(r, rows_c - 1)       # (every warp runs the shuffles; rows past rows_c idle)
            mx = NEG_INF
            if splits > CB:               # more than one load round: the max pass first
                p = int64(lane)
                while p < splits:
                    mx = m.max_nan(mx, pm[base + p * rows_c + rr])
                    p += 32
                o_ = 16
                while o_ > 0:
                    mx = m.max_nan(mx, xor_shfl(mx, o_, xs, w, lane))
                    o_ //= 2
            den = ZERO                    # (each lane sums the weights itself: no round trip)
            for u in range(dpl):
                fv[u] = ZERO
            p0 = int64(0)
            while p0 < splits:            # CB splits' loads in flight, then their FMAs
                for i in range(CB):
                    ok = p0 + i < splits  # (no loads for the slots past the last split)
                    pp = (base + (p0 + i) * rows_c + rr) if ok else int64(0)
                    wb[i] = pm[pp] if ok else NEG_INF
                    lb[i] = pl[pp] if ok else ZERO
                    if pair == 4:         # lane l: dims 4l .. 4l + 3 (+ 128 ...), as stored
                        for uu in range(dpl // 4):
                            a4 = ptx.vld4(pacc, pp * dmax + _dec_dim(lane, 4 * uu, 4)) if ok \
                                else (ZERO, ZERO, ZERO, ZERO)
                            for i2 in range(4):
                                ab[i, 4 * uu + i2] = a4[i2]
                    else:                 # lane l: dims l, l + 32, ...
                        for u in range(dpl):
                            ab[i, u] = pacc[pp * dmax + int64(lane) + u * 32] if ok else ZERO
                if splits <= CB:          # one round (B8 Sk1024's 4 splits): its own max, so
                    for i in range(CB):   # the partials cost one trip to L2, not two
                        mx = m.max_nan(mx, wb[i])
                for i in range(CB):
                    wb[i] = ZERO if wb[i] == NEG_INF else m.fast_exp(wb[i] - mx)
                    den += lb[i] * wb[i]
                    for u in range(dpl):
                        fv[u] += ab[i, u] * wb[i]
                p0 += CB
            gi, qi = divmod_small(rb + rr, sq)
            if r < rows_c and rb + r < rows:   # (warps past rows_c hold a copy of the last row)
                for u in range(dpl):
                    dg = _dec_dim(lane, u, pair) if pair == 4 else int64(lane) + u * 32
                    if dg < d:
                        st_(out, uint64(b * geom[11] + (hk * g + gi) * geom[12] + qi * geom[13]
                                        + dg), fv[u] / den if den != ZERO else ZERO)
            r0 += DEC_NW

    return kernel


DEC_GROUP_ROWS = 2                  # rows a block when rows are split (S=16 on an H100: 4.2 us;
                                    # 4 rows: 5.4 us; unsplit: 13.1 us)


def decode_groups(rows_c: int, rows: int, blocks: int, sm: int) -> tuple[int, int]:
    """(rows a block, row groups): all rows in one block, or, when the launch has fewer
    blocks than SMs (a short sequence: S = 16 of a few heads is 4 blocks), DEC_GROUP_ROWS rows
    a block over more blocks -- a block's time is its lanes' serial work, which grows with
    its rows; the groups re-read K and V, from L2 at these sizes."""
    if blocks >= sm or rows_c <= DEC_GROUP_ROWS:
        return rows_c, 1
    return DEC_GROUP_ROWS, -(-rows // DEC_GROUP_ROWS)


DEC_BLOCK_WARPS = 16                # most warps a block: a short cache is one block a kv head


def decode_warps(b: int, hkv: int, sk: int, sm: int, nw: int) -> int:
    """Warps a decode block: ``nw`` (the geometry's), or where every kv head's keys fit one
    tile a warp of up to DEC_BLOCK_WARPS warps and the heads alone do not fill the GPU, that
    many -- one block a kv head sees every key, no partials and no combine (the split
    plan's ticket and second pass are two trips to L2 on a ~6 us critical path; H100, the
    1B shape's b1 decode at 128 cache rows: 16 decode launches 109.8 -> 93.2 us of a
    token's critical path, 890 -> 901 tok/s)."""
    wk = DEC_SHORT_WARP_KEYS[0][1]
    need = -(-sk // wk)
    if b * hkv > sm or need > DEC_BLOCK_WARPS or need <= nw:
        return nw
    w = nw
    while w < need:
        w *= 2
    return w


def decode_plan(b: int, hkv: int, sk: int, sm: int, nw: int | None = None):
    """(splits, keys a split): whole waves of blocks (DEC_OCC resident a SM), one wave unless
    a split would pass DEC_SPLIT_KEYS keys; each warp of the device's default geometry at
    least DEC_WARP_KEYS keys, fewer on short caches (DEC_SHORT_WARP_KEYS; a kernel of another
    geometry takes any chunk, just less evenly)."""
    wk = next((keys for most, keys in DEC_SHORT_WARP_KEYS if sk <= most), DEC_WARP_KEYS)
    step = (nw or default_geometry("attention").dec_nw) * wk
    per_wave = max(1, sm * DEC_OCC // (b * hkv))
    splits = per_wave * max(1, -(-sk // (per_wave * DEC_SPLIT_KEYS)))
    splits = max(1, min(splits, -(-sk // step)))
    chunk = -(-(-(-sk // splits)) // step) * step
    return -(-sk // chunk), chunk
