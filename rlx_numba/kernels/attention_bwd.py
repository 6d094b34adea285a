"""Attention backward, f32, FlashAttention-2 style: nothing of size Sq x Sk is stored (except
dS itself, and only for a bias gradient, where that is the gradient's size before the
broadcast reduction).

The forward saves nothing; the backward recomputes the probabilities from the per-row
log-sum-exp: P = exp(s - LSE), s the forward's score (scale, softcap, bias and masks through
the forward's own ``_score``, so every mask is honoured exactly as there). With dO the output
gradient and Dl = rowsum(dO * O):

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - Dl)   (the gradient of the biased score),
    dS' = dS * (1 - tanh^2(scale q.k / softcap))       (softcap's chain rule; dS' = dS without),
    dQ = scale dS' K,   dK = scale dS'^T Q,   dbias = dS summed over bias's broadcast dims.

Kernels (the integer geometry is attention's ``GEOM`` array: q / o / dO / dQ share q's strides,
k / v / dK / dV k's; LSE and Dl are contiguous [B, Hq, Sq]):

* ``lse``: a block per (batch * query head, tile of BQ queries); per key tile the BQ x BC
  scores go through shared memory and one thread a row keeps its running (max, sum).
* ``delta``: Dl, a thread a row (grid-stride).
* ``dq``: a block per (batch * query head, query tile), looping over the key tiles the
  causal / window masks leave; Q, dO, K, V tiles in shared memory (rows of DMAX floats,
  zero-padded), dS' through shared memory, each thread accumulating fixed elements of the
  BQ x DMAX dQ tile in registers. With ``want_ds`` it writes dS instead of dQ (every key tile:
  the buffer is not zeroed).
* ``dkv``: a block per (batch * key/value head, tile of BC keys), looping over the GQA group's
  query heads and the query tiles that can see the tile's keys; P and dS' through shared
  memory, dK and dV accumulated in registers (a GQA group's heads summed in the block: no
  atomics, deterministic); output [2, *k.shape]: dK then dV.

Correctness first: the dot products read shared rows with a thread an element (bank
conflicts, no tensor cores, BQ = BC = 16). On a GPU the obvious next steps are the forward
flash kernel's register tiling (a thread a TR x 4 patch of S, 16-byte shared loads), LSE
written by the forward flash kernel itself instead of recomputed here (a residual_sum-style
node filled by the attention step), and larger tiles.
"""
import functools
import math

from numba import cuda, float32, int64

from ..device import SIMULATOR
from . import mathfn as m
from .attention import _divmod, _score
from .launch import jit

NT = 16 if SIMULATOR else 128       # threads a block
DQ = 4 if SIMULATOR else 32         # head dims are padded to a multiple of this (DMAX)
NEG_INF = float32(-math.inf)
ZERO = float32(0.0)
ONE = float32(1.0)


def dmax_of(d: int) -> int:
    return max(DQ, -(-d // DQ) * DQ)


def tile(dmax: int) -> int:
    """Rows of a query tile and of a key tile (BQ = BC): four DMAX-wide tiles fit 32 KB of
    shared memory."""
    if SIMULATOR:
        return 4
    return 16 if dmax <= 128 else 8


@cuda.jit(device=True)
def _load(dst, src, base, rs, r0, nrows, d, dmax, rows, tid):
    """dst[r * dmax + c] <- src[base + (r0 + r) * rs + c] for r < rows, c < dmax; zeros past
    nrows and d."""
    e = int64(tid)
    while e < rows * dmax:
        r, c = e // dmax, e % dmax
        dst[e] = src[base + (r0 + r) * rs + c] if r0 + r < nrows and c < d else ZERO
        e += NT


@cuda.jit(device=True)
def _dot(a, ia, b, ib, d):
    acc = ZERO
    for c in range(d):
        acc += a[ia + c] * b[ib + c]
    return acc


@cuda.jit(device=True)
def _grads(Qs, Ks, Vs, Os, Ls, Dls, Ps, Ss, i, j, q0, k0, b, h, mask, bias, geom, scale, softcap,
           causal, has_window, has_mask, has_bias, has_softcap, sq, sk, d, dmax, bc):
    """Recompute P[i, j] of the tile at (q0, k0) and dS[i, j] into Ps, and dS' * scale into
    Ss (index i * bc + j)."""
    qi, kj = q0 + i, k0 + j
    raw = _dot(Qs, i * dmax, Ks, j * dmax, d)
    x = _score(raw, qi, kj, geom[23] + qi, b, h, mask, bias, geom, scale, softcap, causal,
               has_window, has_mask, has_bias, has_softcap, sq, sk)
    lse = Ls[i]
    p = ZERO if x == NEG_INF or lse == NEG_INF else m.exp(x - lse)
    ds = ZERO
    if p != ZERO:
        ds = p * (_dot(Os, i * dmax, Vs, j * dmax, d) - Dls[i])
    Ps[i * bc + j] = p
    dsr = ds
    if has_softcap:                   # d softcap tanh(u / softcap) / du = 1 - tanh^2
        t = m.tanh(raw * scale / softcap)
        dsr = ds * (ONE - t * t)
    Ss[i * bc + j] = dsr * scale
    return ds


@functools.lru_cache(maxsize=None)
def lse(dmax, causal, has_window, has_mask, has_bias, has_softcap):
    """LSE[b, h, i] = log sum_j exp(s_ij) (-inf for a row with every key masked)."""
    B = tile(dmax)
    BD, BB = B * dmax, B * B          # shared sizes must be compile-time constants
    assert B <= NT

    @jit
    def kernel(out, q, k, mask, bias, geom, scale, softcap):
        Qs = cuda.shared.array(BD, float32)
        Ks = cuda.shared.array(BD, float32)
        Ss = cuda.shared.array(BB, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        tid = int64(cuda.threadIdx.x)
        b, h = _divmod(int64(cuda.blockIdx.y), hq)
        hk = _divmod(h, g)[0]
        q0 = int64(cuda.blockIdx.x) * B
        off = geom[23]
        _load(Qs, q, b * geom[5] + h * geom[6], geom[7], q0, sq, d, dmax, B, tid)
        kv0, kv_end = int64(0), sk
        if causal or has_window:
            kv_end = min(sk, max(int64(0), off + q0 + B))
        if has_window:
            kv0 = max(int64(0), off + q0 - geom[22] + 1) // B * B
        mr, lr = NEG_INF, ZERO        # thread tid < B: row tid's running max and sum
        while kv0 < kv_end:
            cuda.syncthreads()        # the last tile's Ks and Ss are read
            _load(Ks, k, b * geom[8] + hk * geom[9], geom[10], kv0, sk, d, dmax, B, tid)
            cuda.syncthreads()
            e = tid
            while e < B * B:
                i, j = e // B, e % B
                Ss[e] = _score(_dot(Qs, i * dmax, Ks, j * dmax, d), q0 + i, kv0 + j,
                               off + q0 + i, b, h, mask, bias, geom, scale, softcap, causal,
                               has_window, has_mask, has_bias, has_softcap, sq, sk)
                e += NT
            cuda.syncthreads()
            if tid < B:
                tmax = NEG_INF
                for j in range(B):
                    tmax = max(tmax, Ss[tid * B + j])
                mnew = max(mr, tmax)
                if mnew != NEG_INF:
                    lr = lr * (m.exp(mr - mnew) if mr != NEG_INF else ZERO)
                    for j in range(B):
                        x = Ss[tid * B + j]
                        if x != NEG_INF:
                            lr += m.exp(x - mnew)
                    mr = mnew
            kv0 += B
        if tid < B and q0 + tid < sq:
            out[(b * hq + h) * sq + q0 + tid] = mr + m.log(lr) if lr > ZERO else NEG_INF

    return kernel


@functools.lru_cache(maxsize=None)
def delta():
    """Dl[b, h, i] = sum_c dO[b, h, i, c] * O[b, h, i, c], a thread a row."""
    @jit
    def kernel(out, o, do, geom, rows):
        hq, sq, d = geom[0], geom[2], geom[4]
        r = int64(cuda.grid(1))
        while r < rows:
            bh, i = _divmod(r, sq)
            b, h = _divmod(bh, hq)
            at = b * geom[11] + h * geom[12] + i * geom[13]
            acc = ZERO
            for c in range(d):
                acc += o[at + c] * do[at + c]
            out[r] = acc
            r += int64(cuda.gridDim.x) * int64(cuda.blockDim.x)

    return kernel


@functools.lru_cache(maxsize=None)
def dq(dmax, causal, has_window, has_mask, has_bias, has_softcap, want_ds):
    """dQ (or, with want_ds, dS [B, Hq, Sq, Sk]) of a query tile a block."""
    B = tile(dmax)
    BD, BB = B * dmax, B * B          # shared sizes must be compile-time constants
    EPT = -(-B * dmax // NT)          # dQ elements a thread accumulates

    @jit
    def kernel(out, q, k, v, do, lse_, dl, mask, bias, geom, scale, softcap):
        Qs = cuda.shared.array(BD, float32)
        Os = cuda.shared.array(BD, float32)     # dO
        Ks = cuda.shared.array(BD, float32)
        Vs = cuda.shared.array(BD, float32)
        Ps = cuda.shared.array(BB, float32)
        Ss = cuda.shared.array(BB, float32)
        Ls = cuda.shared.array(B, float32)
        Dls = cuda.shared.array(B, float32)
        acc = cuda.local.array(EPT, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        tid = int64(cuda.threadIdx.x)
        b, h = _divmod(int64(cuda.blockIdx.y), hq)
        hk = _divmod(h, g)[0]
        q0 = int64(cuda.blockIdx.x) * B
        off = geom[23]
        qbase, kbase = b * geom[5] + h * geom[6], b * geom[8] + hk * geom[9]
        _load(Qs, q, qbase, geom[7], q0, sq, d, dmax, B, tid)
        _load(Os, do, qbase, geom[7], q0, sq, d, dmax, B, tid)
        if tid < B:
            r = (b * hq + h) * sq + q0 + tid
            Ls[tid] = lse_[r] if q0 + tid < sq else NEG_INF
            Dls[tid] = dl[r] if q0 + tid < sq else ZERO
        for p in range(EPT):
            acc[p] = ZERO
        kv0, kv_end = int64(0), sk
        if not want_ds:               # (dS is written everywhere: its buffer is not zeroed)
            if causal or has_window:
                kv_end = min(sk, max(int64(0), off + q0 + B))
            if has_window:
                kv0 = max(int64(0), off + q0 - geom[22] + 1) // B * B
        while kv0 < kv_end:
            cuda.syncthreads()        # the last tile's Ks, Vs, Ss are read
            _load(Ks, k, kbase, geom[10], kv0, sk, d, dmax, B, tid)
            _load(Vs, v, kbase, geom[10], kv0, sk, d, dmax, B, tid)
            cuda.syncthreads()
            e = tid
            while e < B * B:
                i, j = e // B, e % B
                ds = _grads(Qs, Ks, Vs, Os, Ls, Dls, Ps, Ss, i, j, q0, kv0, b, h, mask, bias,
                            geom, scale, softcap, causal, has_window, has_mask, has_bias,
                            has_softcap, sq, sk, d, dmax, B)
                if want_ds and q0 + i < sq and kv0 + j < sk:
                    out[((b * hq + h) * sq + q0 + i) * sk + kv0 + j] = ds
                e += NT
            cuda.syncthreads()
            if not want_ds:
                for p in range(EPT):  # dQ[i, c] += sum_j dS'[i, j] K[j, c]
                    e = tid + p * NT
                    if e < B * dmax:
                        i, c = e // dmax, e % dmax
                        s = ZERO
                        for j in range(B):
                            s += Ss[i * B + j] * Ks[j * dmax + c]
                        acc[p] += s
            kv0 += B
        if not want_ds:
            for p in range(EPT):
                e = tid + p * NT
                if e < B * dmax:
                    i, c = e // dmax, e % dmax
                    if q0 + i < sq and c < d:
                        out[qbase + (q0 + i) * geom[7] + c] = acc[p]

    return kernel


@functools.lru_cache(maxsize=None)
def dkv(dmax, causal, has_window, has_mask, has_bias, has_softcap):
    """dK and dV of a key tile a block, into out = [dK, dV] (each k's shape and strides)."""
    B = tile(dmax)
    BD, BB = B * dmax, B * B          # shared sizes must be compile-time constants
    EPT = -(-B * dmax // NT)

    @jit
    def kernel(out, q, k, v, do, lse_, dl, mask, bias, geom, scale, softcap, nk):
        Qs = cuda.shared.array(BD, float32)
        Os = cuda.shared.array(BD, float32)
        Ks = cuda.shared.array(BD, float32)
        Vs = cuda.shared.array(BD, float32)
        Ps = cuda.shared.array(BB, float32)
        Ss = cuda.shared.array(BB, float32)
        Ls = cuda.shared.array(B, float32)
        Dls = cuda.shared.array(B, float32)
        dk = cuda.local.array(EPT, float32)
        dv = cuda.local.array(EPT, float32)
        hq, g, sq, sk, d = geom[0], geom[1], geom[2], geom[3], geom[4]
        hkv = hq // g
        tid = int64(cuda.threadIdx.x)
        b, hk = _divmod(int64(cuda.blockIdx.y), hkv)
        k0 = int64(cuda.blockIdx.x) * B
        off = geom[23]
        kbase = b * geom[8] + hk * geom[9]
        _load(Ks, k, kbase, geom[10], k0, sk, d, dmax, B, tid)
        _load(Vs, v, kbase, geom[10], k0, sk, d, dmax, B, tid)
        for p in range(EPT):
            dk[p] = ZERO
            dv[p] = ZERO
        q_lo, q_end = int64(0), sq     # the queries that can see this tile's keys
        if causal or has_window:       # pos = off + i >= key
            q_lo = max(int64(0), k0 - off) // B * B
        if has_window:                 # pos - w < key
            q_end = min(sq, max(int64(0), k0 + B + geom[22] - 1 - off))
        for gi in range(g):
            h = hk * g + gi
            qbase = b * geom[5] + h * geom[6]
            q0 = q_lo
            while q0 < q_end:
                cuda.syncthreads()     # the last tile's Qs, Os, Ps, Ss are read
                _load(Qs, q, qbase, geom[7], q0, sq, d, dmax, B, tid)
                _load(Os, do, qbase, geom[7], q0, sq, d, dmax, B, tid)
                if tid < B:
                    r = (b * hq + h) * sq + q0 + tid
                    Ls[tid] = lse_[r] if q0 + tid < sq else NEG_INF
                    Dls[tid] = dl[r] if q0 + tid < sq else ZERO
                cuda.syncthreads()
                e = tid
                while e < B * B:
                    _grads(Qs, Ks, Vs, Os, Ls, Dls, Ps, Ss, e // B, e % B, q0, k0, b, h, mask,
                           bias, geom, scale, softcap, causal, has_window, has_mask, has_bias,
                           has_softcap, sq, sk, d, dmax, B)
                    e += NT
                cuda.syncthreads()
                for p in range(EPT):   # dV[j] += sum_i P[i, j] dO[i]; dK[j] += sum_i dS'[i, j] Q[i]
                    e = tid + p * NT
                    if e < B * dmax:
                        j, c = e // dmax, e % dmax
                        sv, sk_ = ZERO, ZERO
                        for i in range(B):
                            sv += Ps[i * B + j] * Os[i * dmax + c]
                            sk_ += Ss[i * B + j] * Qs[i * dmax + c]
                        dv[p] += sv
                        dk[p] += sk_
                q0 += B
        for p in range(EPT):
            e = tid + p * NT
            if e < B * dmax:
                j, c = e // dmax, e % dmax
                if k0 + j < sk and c < d:
                    at = kbase + (k0 + j) * geom[10] + c
                    out[at] = dk[p]
                    out[nk + at] = dv[p]

    return kernel


def launch_q(b: int, hq: int, sq: int, d: int):
    """(grid, block) of ``lse`` and ``dq``: a block per (query tile, batch * head)."""
    return (-(-sq // tile(dmax_of(d))), b * hq), (NT,)


def launch_kv(b: int, hkv: int, sk: int, d: int):
    """(grid, block) of ``dkv``: a block per (key tile, batch * key/value head)."""
    return (-(-sk // tile(dmax_of(d))), b * hkv), (NT,)
