"""Attention kernels, f32: a FlashAttention-style prefill kernel and a split-K decode kernel.

``flash``: one block per (batch * query head, tile of BR queries). For each tile of BC keys
the block computes S = Q K^T in registers (each thread a TR x SC patch: rows tr + i*RG,
columns tc + j*NC), with Q and K staged through shared memory DC dims at a time (stored
transposed, rows padded against bank conflicts); applies scale, softcap, bias and the masks;
updates each query's running max m and sum l (online softmax: the accumulator is rescaled by
exp(m_old - m_new) when the max grows); writes P to shared memory; and adds P V to the output
accumulator (each thread TR rows x DPT columns of the head dim), V staged JC keys at a time.
Nothing of size Sq x Sk is ever stored. A row's NC threads are consecutive lanes, so its max
and sum are a ``group_reduce`` (warp shuffles on a GPU). Causal and window tiles that are
entirely masked are skipped; causal blocks start from the heaviest query tiles.

``decode_split`` + ``decode_combine``: few queries (decode). The keys of one key/value head
are split across blocks; a block takes all the query rows that read that head (GQA group x
Sq, at most DEC_ROWS), each warp a share of the block's keys. Per chunk of 32 keys a warp
stages K transposed in shared memory, each lane scores one key against every row, the rows'
max and sum are warp reductions, and the lanes then switch to the head dim to add P V
(coalesced V reads). Each block writes (m, l, acc) partials; ``decode_combine`` merges them.
K and V are read once, whatever the GQA ratio.

Integer geometry comes in one int64 array ``geom`` (see GEOM) so launches stay short.
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int64, uint64

from ..runtime.device import SIMULATOR
from . import mathfn as m
from .blockreduce import MAX, SLOTS, SUM, group_reduce
from .launch import jit

GEOM = ("hq", "g", "sq", "sk", "d", "q_b", "q_h", "q_s", "k_b", "k_h", "k_s", "o_b", "o_h", "o_s",
        "m_b", "m_h", "m_q", "m_k", "b_b", "b_h", "b_q", "b_k", "window", "off")

# prefill geometry: BR queries x BC keys a tile; RG row groups of NC threads (TR rows each)
BR, BC, TR, NC, DC = (8, 8, 2, 4, 4) if SIMULATOR else (64, 64, 4, 16, 16)
RG = BR // TR
NT = RG * NC
QT_SHAPE, KT_SHAPE, PS_SHAPE = (DC, BR + 1), (DC, BC + 1), (BR, BC + 1)   # padded: no bank conflicts
SC = BC // NC
assert (DC * BR) % NT == 0 and (DC * BC) % NT == 0

NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)
_u = np.uint64


def _jit(threads, min_blocks):
    return jit(launch_bounds=(threads, min_blocks))


if SIMULATOR:   # no warp intrinsics there: the block barrier (every warp calls it together)
    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncthreads()
else:
    @cuda.jit(device=True)
    def warp_sync():
        cuda.syncwarp(0xFFFFFFFF)


def head_split(d: int) -> int:
    """Head-dim columns a prefill thread accumulates (DPT)."""
    return -(-d // NC)


@cuda.jit(device=True)
def _score(x, qi, kj, pos, b, h, mask, bias, geom, scale, softcap, causal, has_window, has_mask,
           has_bias, has_softcap, sq, sk):
    """scale * q.k -> softcapped, biased, masked score (-inf when masked)."""
    x = x * scale
    if has_softcap:
        x = softcap * m.tanh(x / softcap)
    keep = qi < sq and kj < sk
    if keep and has_bias:
        x += bias[uint64(b * geom[18] + h * geom[19] + qi * geom[20] + kj * geom[21])]
    if causal:
        keep = keep and kj <= pos
    if has_window:                    # pos - w < j <= pos (a window is causal too)
        keep = keep and kj > pos - geom[22] and kj <= pos
    if keep and has_mask:
        keep = mask[uint64(b * geom[14] + h * geom[15] + qi * geom[16] + kj * geom[17])] != 0
    return x if keep else NEG_INF


@functools.lru_cache(maxsize=None)
def flash(dpt, causal, has_window, has_mask, has_bias, has_softcap):
    dmax = NC * dpt
    jc = (32 if dmax <= 128 else 16) if not SIMULATOR else 4    # V keys staged at a time
    ql, kl, vl = DC * BR // NT, DC * BC // NT, jc * dmax // NT
    uNC, uRG, uDC, uNT = _u(NC), _u(RG), _u(DC), _u(NT)
    udmax = _u(dmax)
    vs_shape = (jc, dmax)

    @_jit(NT, 2 if dpt <= 8 else 1)
    def kernel(out, q, k, v, mask, bias, geom, scale, softcap):
        Qt = cuda.shared.array(QT_SHAPE, float32)
        Kt = cuda.shared.array(KT_SHAPE, float32)
        Vs = cuda.shared.array(vs_shape, float32)
        Ps = cuda.shared.array(PS_SHAPE, float32)
        red = cuda.shared.array(SLOTS, float32)
        s = cuda.local.array((TR, SC), float32)
        o = cuda.local.array((TR, dpt), float32)
        mr = cuda.local.array(TR, float32)
        lr = cuda.local.array(TR, float32)
        fa = cuda.local.array(TR, float32)
        fb = cuda.local.array(SC, float32)
        fv = cuda.local.array(dpt, float32)
        rq = cuda.local.array(ql, float32)       # tile loads in flight
        rk = cuda.local.array(kl, float32)
        rv = cuda.local.array(vl, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        tid = uint64(cuda.threadIdx.x)
        tr, tc = tid // uNC, tid % uNC
        bh = int64(cuda.blockIdx.y)
        b, h = bh // hq, bh % hq
        hk = h // g
        nqt = (sq + BR - 1) // BR
        q0 = (nqt - 1 - int64(cuda.blockIdx.x)) * BR     # heaviest causal tiles first
        qbase = b * geom[5] + h * geom[6]
        kbase = b * geom[8] + hk * geom[9]
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
        while kv0 < kv_end:               # uniform across the block (barriers inside)
            for i in range(TR):
                for j in range(SC):
                    s[i, j] = ZERO
            d0 = int64(0)
            while d0 < d:                 # S += Q[:, d0:d0+DC] K[:, d0:d0+DC]^T
                for p in range(ql):       # every load issued before the first shared store
                    e = tid + _u(p) * uNT  # (a store may alias a later load: see rows.py)
                    qi, dg = q0 + int64(e // uDC), d0 + int64(e % uDC)
                    rq[p] = q[uint64(qbase + qi * geom[7] + dg)] if qi < sq and dg < d else ZERO
                for p in range(kl):
                    e = tid + _u(p) * uNT
                    kj, dg = kv0 + int64(e // uDC), d0 + int64(e % uDC)
                    rk[p] = k[uint64(kbase + kj * geom[10] + dg)] if kj < sk and dg < d else ZERO
                for p in range(ql):
                    e = tid + _u(p) * uNT
                    Qt[e % uDC, e // uDC] = rq[p]
                for p in range(kl):
                    e = tid + _u(p) * uNT
                    Kt[e % uDC, e // uDC] = rk[p]
                cuda.syncthreads()
                for dd in range(DC):
                    for i in range(TR):
                        fa[i] = Qt[dd, tr + _u(i) * uRG]
                    for j in range(SC):
                        fb[j] = Kt[dd, tc + _u(j) * uNC]
                    for i in range(TR):
                        for j in range(SC):
                            s[i, j] += fa[i] * fb[j]
                cuda.syncthreads()
                d0 += DC
            for i in range(TR):           # masks and the online softmax, row by row
                qi = q0 + int64(tr + _u(i) * uRG)
                pos = off + qi
                rmax = NEG_INF
                for j in range(SC):
                    kj = kv0 + int64(tc + _u(j) * uNC)
                    x = _score(s[i, j], qi, kj, pos, b, h, mask, bias, geom, scale, softcap, causal,
                               has_window, has_mask, has_bias, has_softcap, sq, sk)
                    s[i, j] = x
                    rmax = x if (x > rmax or x != x) else rmax
                rmax = group_reduce(rmax, red, NC, MAX)
                mnew = rmax if (rmax > mr[i] or rmax != rmax) else mr[i]
                alpha = ONE
                if mnew != NEG_INF:
                    alpha = m.exp(mr[i] - mnew)
                rsum = ZERO
                for j in range(SC):
                    p_ = m.exp(s[i, j] - mnew) if mnew != NEG_INF else ZERO
                    s[i, j] = p_
                    rsum += p_
                rsum = group_reduce(rsum, red, NC, SUM)
                lr[i] = lr[i] * alpha + rsum
                mr[i] = mnew
                for c in range(dpt):
                    o[i, c] *= alpha
                for j in range(SC):
                    Ps[tr + _u(i) * uRG, tc + _u(j) * uNC] = s[i, j]
            j0 = int64(0)
            while j0 < BC:                # O += P[:, j0:j0+jc] V[j0:j0+jc]
                cuda.syncthreads()        # Ps complete; Vs free
                for p in range(vl):
                    e = tid + _u(p) * uNT
                    c, kj = int64(e % udmax), kv0 + j0 + int64(e // udmax)
                    rv[p] = v[uint64(kbase + kj * geom[10] + c)] if kj < sk and c < d else ZERO
                for p in range(vl):
                    e = tid + _u(p) * uNT
                    Vs[e // udmax, e % udmax] = rv[p]
                cuda.syncthreads()
                for jj in range(jc):
                    for i in range(TR):
                        fa[i] = Ps[tr + _u(i) * uRG, uint64(j0) + _u(jj)]
                    for c in range(dpt):
                        fv[c] = Vs[jj, tc + _u(c) * uNC]
                    for i in range(TR):
                        for c in range(dpt):
                            o[i, c] += fa[i] * fv[c]
                j0 += jc
            cuda.syncthreads()            # before the next tile overwrites Qt/Kt/Ps
            kv0 += BC
        obase = b * geom[11] + h * geom[12]
        for i in range(TR):
            qi = q0 + int64(tr + _u(i) * uRG)
            if qi < sq:
                inv = ONE / lr[i] if lr[i] > ZERO else ZERO     # no key at all: zeros
                for c in range(dpt):
                    col = int64(tc + _u(c) * uNC)
                    if col < d:
                        out[uint64(obase + qi * geom[13] + col)] = o[i, c] * inv

    return kernel


def flash_launch(b: int, hq: int, sq: int, d: int):
    return (-(-sq // BR), b * hq), (NT,)


# ---- decode: split-K over the keys of one key/value head ---------------------------------------
DEC_NW = 2 if SIMULATOR else 4      # warps a block
DEC_ROWS = 8                        # at most this many query rows share a key/value head
KT_DEC = (DEC_NW, 32, 33)


def decode_rows(g: int, sq: int) -> int | None:
    """Rows a decode block holds (a power of two >= g * sq), or None: use the prefill kernel."""
    rows = g * sq
    if rows > DEC_ROWS:
        return None
    r = 1
    while r < rows:
        r *= 2
    return r


@functools.lru_cache(maxsize=None)
def decode_split(dpl, rows_c, causal, has_window, has_mask, has_bias, has_softcap):
    """Partials (m, l, acc) of each (split, warp) for every row reading one kv head."""
    dmax = 32 * dpl
    qs_shape, ps_shape = (rows_c, dmax), (DEC_NW, rows_c, 32)
    nt = DEC_NW * 32
    U32 = _u(32)

    @_jit(nt, 4)
    def kernel(pm, pl, pacc, q, k, v, mask, bias, geom, scale, softcap, chunk, nparts):
        Qs = cuda.shared.array(qs_shape, float32)
        Kt = cuda.shared.array(KT_DEC, float32)
        Ps = cuda.shared.array(ps_shape, float32)
        red = cuda.shared.array(SLOTS, float32)
        s = cuda.local.array(rows_c, float32)
        mr = cuda.local.array(rows_c, float32)
        lr = cuda.local.array(rows_c, float32)
        acc = cuda.local.array((rows_c, dpl), float32)
        rk = cuda.local.array(32, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        rows = g * sq
        tid = uint64(cuda.threadIdx.x)
        lane, w = tid % U32, tid // U32
        bk = int64(cuda.blockIdx.y)
        hkv = hq // g
        b, hk = bk // hkv, bk % hkv
        off = geom[23]
        e = tid
        while e < _u(rows_c * dmax):      # the group's query rows, into shared memory
            r, dd = int64(e // _u(dmax)), int64(e % _u(dmax))
            gi, qi = r // sq, r % sq
            Qs[r, dd] = q[uint64(b * geom[5] + (hk * g + gi) * geom[6] + qi * geom[7] + dd)] \
                if r < rows and dd < d else ZERO
            e += _u(nt)
        cuda.syncthreads()                # Qs is read by every warp
        for r in range(rows_c):
            mr[r] = NEG_INF
            lr[r] = ZERO
            for u in range(dpl):
                acc[r, u] = ZERO
        k_lo = int64(cuda.blockIdx.x) * chunk
        k_hi = min(sk, k_lo + chunk)
        kbase = b * geom[8] + hk * geom[9]
        ks = geom[10]
        t0 = k_lo + int64(w) * 32
        while t0 < k_lo + chunk:          # same trip count in every warp (chunk % (NW*32) == 0)
            for r in range(rows_c):
                s[r] = ZERO
            d0 = int64(0)
            while d0 < d:                 # scores: lane scores key t0 + lane, DC dims at a time
                dg = d0 + int64(lane)
                for i in range(32):       # coalesced: the warp reads 32 dims of key t0 + i,
                    kk = min(t0 + i, k_hi - 1)    # all 32 in flight before the shared stores
                    rk[i] = k[uint64(kbase + kk * ks + dg)] if dg < d else ZERO   # (past k_hi:
                    # a duplicate of the last key, scored -inf below)
                for i in range(32):
                    Kt[w, lane, i] = rk[i]
                warp_sync()               # Kt[w] and Ps[w] are this warp's own
                for dd in range(32):
                    kv_ = Kt[w, dd, lane]
                    for r in range(rows_c):
                        s[r] += Qs[r, d0 + dd] * kv_ if d0 + dd < d else ZERO
                warp_sync()
                d0 += 32
            key = t0 + int64(lane)
            for r in range(rows_c):
                gi, qi = int64(r) // sq, int64(r) % sq
                if r >= rows:             # a padding row: qi = sq masks it before any read
                    gi, qi = int64(0), sq
                x = _score(s[r], qi, key, off + qi, b, hk * g + gi, mask, bias, geom, scale,
                           softcap, causal, has_window, has_mask, has_bias, has_softcap, sq, k_hi)
                cm = group_reduce(x, red, 32, MAX)
                mnew = cm if (cm > mr[r] or cm != cm) else mr[r]
                alpha = ONE
                p_ = ZERO
                if mnew != NEG_INF:
                    alpha = m.exp(mr[r] - mnew)
                    p_ = m.exp(x - mnew)
                lr[r] = lr[r] * alpha + group_reduce(p_, red, 32, SUM)
                mr[r] = mnew
                Ps[w, r, lane] = p_
                for u in range(dpl):
                    acc[r, u] *= alpha
            warp_sync()
            for j in range(32):           # lanes switch to the head dim: coalesced V reads;
                kk = min(t0 + j, k_hi - 1)    # no branch on the key (P is 0 past k_hi), so the
                for u in range(dpl):          # loads can all be issued ahead of the FMAs
                    dg = int64(lane) + u * 32
                    vv = v[uint64(kbase + kk * ks + dg)] if dg < d else ZERO
                    for r in range(rows_c):
                        acc[r, u] += Ps[w, r, j] * vv
            warp_sync()
            t0 += DEC_NW * 32
        part = (bk * nparts + int64(cuda.blockIdx.x) * DEC_NW + int64(w)) * rows_c
        for r in range(rows_c):
            if lane == 0:
                pm[part + r] = mr[r]
                pl[part + r] = lr[r]
            for u in range(dpl):
                pacc[(part + r) * dmax + int64(lane) + u * 32] = acc[r, u]

    return kernel


@functools.lru_cache(maxsize=None)
def decode_combine(dpl, rows_c):
    """out[row] = sum_p acc_p exp(m_p - M) / sum_p l_p exp(m_p - M); a block per (row, head)."""
    dmax = 32 * dpl

    @jit
    def kernel(out, pm, pl, pacc, geom, nparts):
        hq, g, sq, d = geom[0], geom[1], geom[2], geom[4]
        r, bk = int64(cuda.blockIdx.x), int64(cuda.blockIdx.y)
        dd = int64(cuda.threadIdx.x)
        if r >= g * sq:
            return
        hkv = hq // g
        b, hk = bk // hkv, bk % hkv
        gi, qi = r // sq, r % sq
        base = bk * nparts * rows_c + r
        mx = NEG_INF
        for p in range(nparts):
            mp = pm[base + p * rows_c]
            mx = mp if mp > mx else mx
        den, num = ZERO, ZERO
        if mx != NEG_INF:
            for p in range(nparts):
                mp = pm[base + p * rows_c]
                if mp != NEG_INF:
                    wgt = m.exp(mp - mx)
                    den += pl[base + p * rows_c] * wgt
                    num += pacc[(base + p * rows_c) * dmax + dd] * wgt
        if dd < d:
            out[uint64(b * geom[11] + (hk * g + gi) * geom[12] + qi * geom[13] + dd)] = \
                num / den if den > ZERO else ZERO

    return kernel


def decode_plan(b: int, hkv: int, sk: int, sm: int):
    """(splits, keys a split): enough blocks to fill the GPU, each warp at least 32 keys."""
    step = DEC_NW * 32
    want = max(1, -(-sm * 8 // (b * hkv)))
    splits = max(1, min(want, -(-sk // step)))
    chunk = -(-(-(-sk // splits)) // step) * step
    return -(-sk // chunk), chunk
