"""Attention backward, FlashAttention-2 style: nothing of size Sq x Sk is stored (except
dS itself, and only for a bias gradient, where that is the gradient's size before the
broadcast reduction).

The forward saves nothing; the backward recomputes the probabilities from the per-row
log-sum-exp: P = exp(s - LSE), s the forward's score (scale, softcap, bias and masks through
the forward's own ``score``, so every mask is honoured exactly as there). With dO the output
gradient and Dl = rowsum(dO * O):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - Dl)   (the gradient of the biased score),
    dS' = dS * (1 - tanh^2(scale q.k / softcap))       (softcap's chain rule; dS' = dS without),
    dQ = scale dS' K,   dK = scale dS'^T Q,   dbias = dS summed over bias's broadcast dims.

Kernels (the integer geometry is attention's ``GEOM`` array: q / o / dO / dQ share q's strides,
k / v / dK / dV k's; LSE and Dl are contiguous [B, Hq, Sq]):

* LSE: saved by the forward's flash kernel (``WITH_LSE``: the attention node's step fills the
  ``attention_lse`` node, as norm_bwd fills norm_bwd_stats; cuDNN's forward writes the same
  numbers, its softmax stats); where the forward ran the decode kernel, the flash kernel with
  ``LSE_ONLY`` (its Q K^T and online softmax, no P V).
* ``delta``: Dl, NC lanes a row. It, dQ and dK / dV are the steps of one node
  (``attention_bwd_dq``, runtime/lower_attention.py), whose cuDNN tier is one fused call.
* ``grads``: dQ (or dS), or dK and dV, on the forward flash kernel's geometry and its staging
  helpers (kernels/attention.py's docstring): a block of NT threads holds a tile of BR "rows"
  (thread (tr, tc): TR consecutive rows, keys/queries 4 tc .. of a column tile of BC), and
  for each column tile computes two products in registers, S and dP, Q/K and dO/V staged DC
  head dims at a time through two shared slots; turns them into P and dS' (scores masked
  exactly as the forward's); then accumulates TR x DPT patches of the output as the forward's
  O += P V, the column operand staged JC rows at a time:
    - dQ: rows are queries (a block per query tile and batch * query head), columns keys;
      S = Q K^T, dP = dO V^T, dQ += dS' K.
    - dK, dV: rows are keys (a block per key tile and batch * key/value head), columns the
      queries of every head of its GQA group that can see the tile; S^T = K Q^T,
      dP^T = V dO^T, dV += P^T dO, then dK += dS'^T Q (through the same P^T buffer, one after
      the other: both do not fit 48 KB of static shared memory beside the slots). A group's
      heads are summed in the block: no atomics, deterministic. Output [2, *k.shape].
    - dS (bias gradient only): rows queries, every key tile, dS written from registers.
  Seven products of Sq x Sk x D where FlashAttention-2 does five (it adds dQ with atomics
  from the dK/dV kernel): deterministic, and each kernel is the forward's proven loop.

Storage kinds (kernels/halfio.py): q, k, v, O, dO and the gradients dQ / dK / dV are one
``kind`` (f32, f16 or bf16), the bias ``bkind``; LSE, Dl and dS are f32, and all math in f32.
"""
import functools

import numpy as np
from numba import cuda, float32, int64, uint64

from . import halfio
from . import mathfn as m
from . import ptx
from .attention import (LSE_ONLY, NEG_INF, ONE, PAD, ZERO, divmod_small, flash, flash_jc,
                        flash_launch, flash_occ, flash_rows, head_split, prefill_helpers, scorer)
from .warp import SLOTS, SUM, group_reduce
from .launch import inline as _inline, jit

_u = np.uint64   # (compile-time index constants)


def lse(geo, dpt, vec, causal, has_window, has_mask, has_bias, has_softcap, kind="f32",
        bkind="f32"):
    """LSE[b, h, i] = log sum_j exp(s_ij) (-inf for a row with every key masked): the forward
    kernel without its P V (launched as the forward, ``flash_launch``), for a forward that
    did not save it (the decode kernel's)."""
    return flash(geo, dpt, vec, causal, has_window, has_mask, has_bias, has_softcap, LSE_ONLY,
                 kind, bkind)


@functools.lru_cache(maxsize=None)
def delta(geo, kind="f32"):
    """Dl[b, h, i] = sum_c dO[b, h, i, c] * O[b, h, i, c]: NC lanes a row (launch_delta), each
    summing every NC-th element, then a shuffle reduction (O and dO of storage ``kind``; Dl
    f32)."""
    NT, NC = geo.nt, geo.nc
    ld = halfio.load(kind)

    @jit
    def kernel(out, o, do, geom, rows):
        red = cuda.shared.array(SLOTS, float32)
        hq, sq, d = geom[0], geom[2], geom[4]
        tid = int64(cuda.threadIdx.x)
        r = int64(cuda.blockIdx.x) * (NT // NC) + tid // NC
        acc = ZERO
        if r < rows:
            bh, i = divmod_small(r, sq)
            b, h = divmod_small(bh, hq)
            at = b * geom[11] + h * geom[12] + i * geom[13]
            c = tid % NC
            while c < d:
                acc += ld(o, at + c) * ld(do, at + c)
                c += NC
        acc = group_reduce(acc, red, NC, SUM)      # (every thread: a barrier in the simulator)
        if r < rows and tid % NC == 0:
            out[r] = acc

    return kernel


def launch_delta(geo, rows: int):
    return (max(1, -(-rows // geo.rg)),), (geo.nt,)


@functools.cache
def _acc_fn(geo, kind="f32"):
    """The backward's O += P . src device function for one geometry and storage kind of src
    (see prefill_helpers)."""
    NT, BC = geo.nt, geo.bc
    h_ = prefill_helpers(geo, kind)
    fetch_rows, pv_key = h_.fetch_rows, h_.pv_key

    @_inline
    def _acc(o, fa, fv, fa2, fv2, stage, slot, Pt, rv, src, base, rs, c0, nrows, d, tid, vec, vl,
             jc, dmax, tr, dpt, row0, tc, qw, slot_size):
        """o[tr, dpt] += P[rows, BC columns] . src[c0 .., :d] (P in Pt column-major, as the
        forward's P^T), src staged jc rows at a time; rv holds the first chunk's loads on entry.
        Returns the next slot."""
        j0 = int64(0)
        while j0 < BC:
            sb = slot * slot_size
            for p in range(vl):           # (a row's dmax dims in a row: group e at 4 e)
                ptx.vst4(stage, sb + (tid + _u(p * NT)) * _u(4), rv[4 * p], rv[4 * p + 1],
                         rv[4 * p + 2], rv[4 * p + 3])
            cuda.syncthreads()            # (the first also completes Pt)
            if j0 + jc < BC:
                fetch_rows(rv, vl, dmax // 4, src, base, rs, c0 + j0 + jc, nrows, int64(0), d,
                           tid, vec)
            pa = uint64(j0) * qw + row0
            va = sb + tc * _u(4)
            ju = int64(0)                 # two columns a trip: the second's loads fly during
            while ju < jc:                # the first one's FMAs
                pv_key(o, fa, fv, Pt, pa, stage, va, tr, dpt)
                pv_key(o, fa2, fv2, Pt, pa + qw, stage, va + _u(dmax), tr, dpt)
                pa += _u(2) * qw
                va += _u(2 * dmax)
                ju += 2
            slot ^= _u(1)
            j0 += jc
        return slot

    return _acc


@_inline
def _put_pt(Pt, s, tr, sc, row0, col0, qw):
    """Pt[col][row] <- s[row][col] of this thread's patch (16-byte stores)."""
    for j in range(sc):
        for i4 in range(tr // 4):
            ptx.vst4(Pt, (col0 + _u(j)) * qw + row0 + _u(4 * i4), s[4 * i4, j],
                     s[4 * i4 + 1, j], s[4 * i4 + 2, j], s[4 * i4 + 3, j])


DQ, DKV, DS = 0, 1, 2               # what ``grads`` computes


@functools.lru_cache(maxsize=None)
def grads(geo, kind, dpt, vec, causal, has_window, has_mask, has_bias, has_softcap,
          io="f32", bkind="f32"):
    """The backward kernel ``kind`` (DQ, DKV or DS) for DPT = head_split(d) (vec: d a multiple
    of 4 and q, k, v, dO f32 and 16-byte aligned); ``io`` the storage kind of q, k, v, dO and
    dQ / dK / dV (dS is f32), ``bkind`` the bias's."""
    NT, NC, BC, DC, RG, SC = geo.nt, geo.nc, geo.bc, geo.dc, geo.rg, geo.sc
    h_ = prefill_helpers(geo, io)
    fetch_rows, stage_product, _acc = h_.fetch_rows, h_.stage_product, _acc_fn(geo, io)
    score = scorer(bkind)
    st = halfio.store(io)
    TR = flash_rows(geo, dpt)
    BR = RG * TR
    dmax = NC * dpt
    jc = flash_jc(geo, dpt)
    QW, KW = BR + PAD, BC + PAD
    KOFF = DC * QW
    SLOT = max(DC * (QW + KW), jc * dmax)
    STAGE, PT = 2 * SLOT, BC * QW
    al, bl, vl = BR * DC // (4 * NT), BC * DC // (4 * NT), jc * dmax // (4 * NT)
    assert BR * DC % (4 * NT) == 0 and jc * dmax % (4 * NT) == 0 and BC % jc == 0
    NA, NB, NV = 4 * al, 4 * bl, 4 * vl
    rows_q = kind != DKV              # rows are queries (dQ, dS) or keys (dK / dV)
    uQW, uKW, uKOFF, uSLOT = _u(QW), _u(KW), _u(KOFF), _u(SLOT)

    @jit(launch_bounds=(NT, flash_occ(dpt)))
    def kernel(out, q, k, v, do, lse_, dl, mask, bias, geom, scale, softcap, nk):
        stage = cuda.shared.array(STAGE, float32, alignment=16)
        Pt = cuda.shared.array(PT, float32, alignment=16)
        s = cuda.local.array((TR, SC), float32)
        dp = cuda.local.array((TR, SC), float32)
        o1 = cuda.local.array((TR, dpt), float32)     # dQ, or dV
        o2 = cuda.local.array((TR, dpt), float32)     # dK
        lq = cuda.local.array(TR, float32)            # LSE and Dl of this thread's queries
        dq_ = cuda.local.array(TR, float32)
        fa = cuda.local.array(TR, float32)
        fb = cuda.local.array(SC, float32)
        fv = cuda.local.array(dpt, float32)
        fa2 = cuda.local.array(TR, float32)
        fv2 = cuda.local.array(dpt, float32)
        ra = cuda.local.array(NA, float32)
        rb = cuda.local.array(NB, float32)
        rv = cuda.local.array(NV, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        off, qs, ks = geom[23], geom[7], geom[10]
        tid = uint64(cuda.threadIdx.x)
        tr, tc = tid // _u(NC), tid % _u(NC)
        row0, col0 = tr * _u(TR), tc * _u(SC)
        bx = int64(cuda.blockIdx.y)
        for i in range(TR):
            for c in range(dpt):
                o1[i, c] = ZERO
                o2[i, c] = ZERO
        slot = _u(0)
        if rows_q:
            b, h = divmod_small(bx, hq)
            hk = divmod_small(h, g)[0]
            nrt = (sq + BR - 1) // BR
            r0 = (nrt - 1 - int64(cuda.blockIdx.x)) * BR     # heaviest causal tiles first
            heads, c_lo, c_end = int64(1), int64(0), sk
            if kind == DQ and (causal or has_window):     # (dS is written everywhere)
                c_end = min(sk, max(int64(0), off + r0 + BR))
            if kind == DQ and has_window:
                c_lo = max(int64(0), off + r0 - geom[22] + 1) // BC * BC
            for i in range(TR):
                qi = r0 + int64(row0 + _u(i))
                at = uint64(bx * sq + qi)
                lq[i] = lse_[at] if qi < sq else NEG_INF
                dq_[i] = dl[at] if qi < sq else ZERO
        else:
            hkv = hq // g
            b, hk = divmod_small(bx, hkv)
            h = hk * g
            r0 = int64(cuda.blockIdx.x) * BR                  # (the first key tiles see most)
            heads, c_lo, c_end = g, int64(0), sq
            if causal or has_window:  # queries at or after the tile's first key: pos >= key
                c_lo = max(int64(0), r0 - off)
            if has_window:            # and before its last key's window ends: pos - w < key
                c_end = min(sq, max(int64(0), r0 + BR + geom[22] - 1 - off))
        kbase = b * geom[8] + hk * geom[9]
        for hi in range(heads):
            hh = h + hi
            qbase = b * geom[5] + hh * geom[6]
            if rows_q:                # A = Q / dO rows, B = K / V columns
                abase, as_, na, bbase, bs, nb = qbase, qs, sq, kbase, ks, sk
            else:                     # A = K / V rows, B = Q / dO columns
                abase, as_, na, bbase, bs, nb = kbase, ks, sk, qbase, qs, sq
            c0 = c_lo
            if c0 < c_end:
                fetch_rows(ra, al, DC // 4, q if rows_q else k, abase, as_, r0, na, int64(0), d,
                       tid, vec)
                fetch_rows(rb, bl, DC // 4, k if rows_q else q, bbase, bs, c0, nb, int64(0), d,
                       tid, vec)
            while c0 < c_end:         # uniform across the block (barriers inside)
                # S (or S^T), then dP (or dP^T); each product's first loads fly during the last
                slot = stage_product(s, fa, fb, stage, slot, ra, rb, q if rows_q else k, abase, as_, r0,
                             na, k if rows_q else q, bbase, bs, c0, nb, d, tid, vec, al, bl, TR,
                             SC, uQW, uKW, uKOFF, uSLOT, row0, col0)
                fetch_rows(ra, al, DC // 4, do if rows_q else v, abase, as_, r0, na, int64(0), d,
                       tid, vec)
                fetch_rows(rb, bl, DC // 4, v if rows_q else do, bbase, bs, c0, nb, int64(0), d,
                       tid, vec)
                slot = stage_product(dp, fa, fb, stage, slot, ra, rb, do if rows_q else v, abase, as_,
                             r0, na, v if rows_q else do, bbase, bs, c0, nb, d, tid, vec, al,
                             bl, TR, SC, uQW, uKW, uKOFF, uSLOT, row0, col0)
                if kind != DS:        # the first chunk of the accumulated product's operand
                    fetch_rows(rv, vl, dmax // 4, k if kind == DQ else do, bbase, bs, c0, nb,
                           int64(0), d, tid, vec)
                if not rows_q:        # LSE and Dl of this thread's query columns
                    for j in range(SC):
                        qj = c0 + int64(col0 + _u(j))
                        at = uint64((b * hq + hh) * sq + qj)
                        lq[j] = lse_[at] if qj < sq else NEG_INF
                        dq_[j] = dl[at] if qj < sq else ZERO
                if rows_q:            # a tile needing no mask test (uniform across the block)
                    plain = (r0 + BR <= sq and c0 + BC <= sk
                             and (not causal or c0 + BC - 1 <= off + r0))
                else:
                    plain = (c0 + BC <= sq and r0 + BR <= sk
                             and (not causal or r0 + BR - 1 <= off + c0))
                plain = plain and not has_window and not has_mask and not has_bias
                for i in range(TR):
                    for j in range(SC):
                        ri, cj = r0 + int64(row0 + _u(i)), c0 + int64(col0 + _u(j))
                        qi, kj = (ri, cj) if rows_q else (cj, ri)
                        raw = s[i, j]
                        if plain:
                            x = raw * scale
                            if has_softcap:
                                x = softcap * m.tanh(x / softcap)
                        else:
                            x = score(raw, qi, kj, off + qi, b, hh, mask, bias, geom, scale,
                                       softcap, causal, has_window, has_mask, has_bias,
                                       has_softcap, sq, sk)
                        lse_i = lq[i] if rows_q else lq[j]
                        p = ZERO if x == NEG_INF else m.fast_exp(x - lse_i)
                        ds = p * (dp[i, j] - (dq_[i] if rows_q else dq_[j]))
                        if kind == DS:
                            if qi < sq and kj < sk:
                                out[uint64(((b * hq + hh) * sq + qi) * sk + kj)] = ds
                        elif has_softcap:         # d softcap tanh(u / softcap) / du
                            t = m.tanh(raw * scale / softcap)
                            ds = ds * (ONE - t * t)
                        s[i, j] = p
                        dp[i, j] = ds * scale
                if kind == DQ:        # dQ += dS' K
                    _put_pt(Pt, dp, TR, SC, row0, col0, uQW)
                    slot = _acc(o1, fa, fv, fa2, fv2, stage, slot, Pt, rv, k, bbase, bs, c0, nb,
                                d, tid, vec, vl, jc, dmax, TR, dpt, row0, tc, uQW, uSLOT)
                elif kind == DKV:     # dV += P^T dO, then dK += dS'^T Q
                    _put_pt(Pt, s, TR, SC, row0, col0, uQW)
                    slot = _acc(o1, fa, fv, fa2, fv2, stage, slot, Pt, rv, do, bbase, bs, c0,
                                nb, d, tid, vec, vl, jc, dmax, TR, dpt, row0, tc, uQW, uSLOT)
                    fetch_rows(rv, vl, dmax // 4, q, bbase, bs, c0, nb, int64(0), d, tid, vec)
                    cuda.syncthreads()            # every thread is done reading P^T
                    _put_pt(Pt, dp, TR, SC, row0, col0, uQW)
                    slot = _acc(o2, fa, fv, fa2, fv2, stage, slot, Pt, rv, q, bbase, bs, c0,
                                nb, d, tid, vec, vl, jc, dmax, TR, dpt, row0, tc, uQW, uSLOT)
                c0 += BC                  # (Pt is rewritten after the next two products'
                                          # barriers: no barrier here)
                if c0 < c_end:
                    fetch_rows(ra, al, DC // 4, q if rows_q else k, abase, as_, r0, na, int64(0),
                           d, tid, vec)
                    fetch_rows(rb, bl, DC // 4, k if rows_q else q, bbase, bs, c0, nb, int64(0),
                           d, tid, vec)
        if kind == DS:
            return
        obase = b * geom[5] + h * geom[6] if rows_q else kbase
        ostride = qs if rows_q else ks
        nrows = sq if rows_q else sk
        for i in range(TR):
            ri = r0 + int64(row0 + _u(i))
            if ri < nrows:
                for c in range(dpt):
                    col = int64(_u(4 * NC * (c // 4) + c % 4) + tc * _u(4))
                    if col < d:
                        at = uint64(obase + ri * ostride + col)
                        if kind == DKV:   # out = [dK, dV]
                            st(out, at, o2[i, c])
                            st(out, at + uint64(nk), o1[i, c])
                        else:
                            st(out, at, o1[i, c])

    return kernel


def launch(geo, kind, b: int, hq: int, hkv: int, sq: int, sk: int, d: int):
    """(grid, block) of ``grads``: a block per row tile and batch * (query or kv) head."""
    br = geo.rg * flash_rows(geo, head_split(geo, d))
    if kind == DKV:
        return (-(-sk // br), b * hkv), (geo.nt,)
    return (-(-sq // br), b * hq), (geo.nt,)


__all__ = ["DKV", "DQ", "DS", "delta", "flash_launch", "grads", "launch", "launch_delta", "lse"]
