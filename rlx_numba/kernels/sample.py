"""topk and sample kernels (ops in ir/ops_sample.py, lowering in runtime/lower_sample.py).

Everything here orders elements by one 64-bit key, so "sorted descending, ties to the smaller
index" is a plain unsigned comparison and every key of a row is distinct:

    key = ord(value) << 32 | (0xFFFFFFFF - index)

``ord`` maps a float32 to an order-preserving uint32 (negatives have their bits inverted,
positives their sign bit set; -0.0 counts as +0.0 so the two tie by index). A NaN gets the
highest ord for topk (NaN is larger than every number, like torch.topk) and the lowest for
sample (a NaN logit is never drawn and never takes a top_k slot). Key 0 is no element's key:
it pads candidate lists. Indices are packed in 32 bits, so a row has fewer than 2^32 - 1
elements.

Kernels
-------
* ``topk_small``: a thread per row, for rows of at most SMALL_N elements: each element's rank
  is the number of keys above it (O(n^2), no barriers).
* ``topk_segments`` (stage 1 of long rows): a block per (row, segment) selects the exact top
  k keys of its segment (in no order) into a candidate list [rows, S, k], 0-padded. The
  global top k is a subset of the union, since the key order is total.
* ``topk_rows``: a block per row selects the exact top k of its source (the row itself, or
  its S*k candidates), compacts them into a buffer of KP = pow2 >= k slots (shared memory
  when it fits, else a global scratch row), bitonic-sorts them, and writes the indices
  (sorted by key) or, for sample, the keys sorted by index.
* ``gather_rows``: topk's values, out[r, j] = x[r, idx[r, j]] (x's own storage dtype).

The selection is a radix select over the 64-bit keys, 8 bits a pass from the top: each pass
histograms the digit of the keys that still match the prefix chosen so far (shared-memory
atomics), a suffix scan over the bins finds the bin holding the k-th key, and the select stops
as soon as that bin holds exactly the keys still needed. Random data stops after 3-4 passes;
ties run on into the index bits (8 passes at most). The selected set is then "key & mask >=
prefix", exactly k keys.

* ``sample_small``: a thread per row (rows of at most SMALL_N), all of sample's rules in
  O(n^2) per row.
* ``sample_rows``: a block per row over a source in index order (the logits row, or the
  index-sorted top_k keys from ``topk_rows``): the max key (a block reduction), then for
  top_p the same radix descent with histograms of probability mass instead of counts, then
  the inverse CDF: every thread sums the mass of a contiguous chunk, a block prefix scan,
  and the thread whose chunk holds the target walks it.
* ``sample_seg_max``, ``sample_seg_mass``, ``sample_pick`` (no top_k, no top_p, long rows):
  grid-wide passes for each segment's max, then its mass under the row's max; a block per
  row then finds the segment holding the draw and the token inside it.

The streaming loops keep four loads in flight per thread.

Probabilities are fixed point: w = exp((v - max) / temperature) in [0, 1] (1 at the max,
exact) scaled by 2^FRAC with n * 2^FRAC <= 2^62, so every sum, scan and comparison is exact
uint64 arithmetic, and the GPU and the simulator pick the same token from the same uniform
(the only difference left is the last bit of exp). A token whose weight is below 2^-FRAC of
the most likely token's (about 1e-14 for a 128k vocabulary) is never drawn.

Randomness: Philox4x32-10 (Salmon et al., SC'11; Random123), counter (row, 0, 0, 0), key
(seed low 32 bits, seed high 32 bits); word 0 is the row's uniform u in [0, 2^32), the target
mass is floor(Z * u / 2^32) and the drawn token is the first (in index order) whose running
kept mass exceeds it.

Expected cost on an H100/H200 for logits [8, 128256] (estimates from the design, not yet
measured): topk k=64 is two stages, 8 x 33 segment blocks staging 3904 keys each and 3-4
shared-memory passes (~5-8 us, the 4 MB read once), then 8 blocks over 2112 candidates and a
64-key bitonic sort (~5 us), then the gather: ~10-15 us. sample with top_k (e.g. 50, with or
without top_p) is that topk plus a block over the k keys: ~12-15 us. sample with neither is
three grid-wide kernels: ~6-10 us. sample with top_p and no top_k is the slow path: a block
per row streams its 513 KB row from L2 five or six times (max, 3-4 mass passes, the chunk
pass), ~15-20 us a pass, ~100 us; a grid-wide mass descent would fix it.
"""
import functools
import math
from dataclasses import dataclass

import numpy as np
from numba import boolean, cuda, float32, int32, int64, uint32, uint64

from ..device import SIMULATOR
from . import mathfn as m
from .warp import MAX, MIN, SLOTS, SUM, bitonic_sort, group_reduce
from .launch import jit, py_in_sim, register_geometry
from .random import philox4x32_10, philox_kernel  # noqa: F401 (Philox lives in kernels/random.py)

if SIMULATOR:
    # Kernels run as Python there, where calling a numba type as a converter costs ~2 us
    # (NumPy's scalar types, which it calls in the end, cost a fifth of that).
    boolean, float32, int32, int64, uint32, uint64 = (np.bool_, np.float32, np.int32, np.int64,
                                                      np.uint32, np.uint64)

SMALL_N = 32            # rows up to this long: a thread per row (O(n^2) per row)
RADIX_BITS = 8          # digit of one select pass
NBINS = 1 << RADIX_BITS


@dataclass(frozen=True)
class Geometry:
    """The family's shapes (runtime/lower_sample.py plans with them). Shared memory (48 KB of
    static shared memory a block on a GPU; small in the simulator, so the tests reach the
    global-memory paths): seg_max keys a segment block stages, smem_sort the largest k
    (rounded up to a power of two) topk_rows sorts there, smem_keys the key slots topk_rows
    may hold there in all (the staged source plus the sort buffer). Threads: block, those of
    a block-per-row kernel (0: from the row, ~8 elements a thread, 64..1024), seg_block those
    of the segment kernels. Segments: seg_want blocks at least (0: 2 a SM), each of min_seg
    elements at least."""
    seg_max: int
    smem_sort: int
    smem_keys: int
    block: int
    seg_block: int
    seg_want: int
    min_seg: int


GPU = Geometry(seg_max=4096, smem_sort=2048, smem_keys=5120, block=0, seg_block=256,
               seg_want=0, min_seg=512)          # 32, 16 and 40 KB of shared memory
# (a barrier costs the simulator ~1 ms at 16 threads a block)
SIM = Geometry(seg_max=1024, smem_sort=256, smem_keys=1024, block=8, seg_block=8, seg_want=4,
               min_seg=128)
register_geometry("sample", gpu=GPU, sim=SIM)




def _jit(block):
    return jit(launch_bounds=block)


_U0 = uint64(0)
_U1 = uint64(1)
_U32 = uint64(0xFFFFFFFF)
_S32 = uint64(32)
_NEG_INF = float32(-math.inf)
_ZERO = float32(0.0)
_ONE = float32(1.0)
_NONE = int64(2**62)
_I0 = int64(0)

@py_in_sim
def row_uniform(row, seed):
    """The row's 32-bit uniform: word 0 of Philox4x32-10 at counter (row, 0, 0, 0) with the
    seed's two 32-bit halves as the key. ``seed`` is an int64 array, seed[0] the seed."""
    s = seed[0]
    k0 = uint64(s & int64(0xFFFFFFFF))
    k1 = uint64((s >> int64(32)) & int64(0xFFFFFFFF))
    r, _, _, _ = philox4x32_10(row & _U32, row >> _S32, _U0, _U0, k0, k1)
    return r


@py_in_sim
def mulhi32(z, u):
    """floor(z * u / 2^32) for a uint64 z and u < 2^32, without overflow."""
    return (z >> _S32) * u + (((z & _U32) * u) >> _S32)


# ---- keys --------------------------------------------------------------------------------------
@py_in_sim
def ord_hi(v):
    """float32 -> order-preserving uint32 (in a uint64); NaN above +inf, -0.0 == +0.0."""
    if v != v:
        return _U32
    if v == _ZERO:
        return uint64(0x80000000)
    b = int64(m.f32_bits(v))
    if b < int64(0):
        return uint64(int64(-1) - b)
    return uint64(b + int64(0x80000000))


@py_in_sim
def ord_lo(v):
    """As ord_hi, but NaN below -inf (ord 0)."""
    if v != v:
        return _U0
    return ord_hi(v)


@py_in_sim
def value_of(o):
    """The float32 of an ord (NaN for 0 and 0xFFFFFFFF)."""
    if o == _U0 or o == _U32:
        return float32(math.nan)
    if o >= uint64(0x80000000):
        b = int64(o) - int64(0x80000000)
    else:
        b = int64(-1) - int64(o)
    return m.bits_f32(int32(b))


@py_in_sim
def ld_f32(x, i):
    return x[i]


@py_in_sim
def ld_f16(x, i):
    return float32(x[i])


@py_in_sim
def ld_bf16(x, i):
    return m.bits_f32(int32(int64(x[i]) << int64(16)))


LOADS = {"f32": ld_f32, "f16": ld_f16, "bf16": ld_bf16}


@functools.lru_cache(maxsize=None)
def _x_loader(ld: str, nan_low: bool):
    """load(x, base, i, off) -> (value, key) of element base + i of a row, index off + i."""
    LD = LOADS[ld]
    ORD = ord_lo if nan_low else ord_hi

    @py_in_sim
    def load(x, base, i, off):
        v = LD(x, base + i)
        return v, (ORD(v) << _S32) | (_U32 - (off + i))
    return load


@py_in_sim
def _key_only(src, base, i, off):
    """load for a list of keys when only the key matters: (0, key)."""
    return _ZERO, src[base + i]


@py_in_sim
def _key_loader(src, base, i, off):
    """load for a list of keys (candidates): (value, key)."""
    e = src[base + i]
    return value_of(e >> _S32), e


@py_in_sim
def weight(v, mx, inv_t, scale):
    """exp((v - max) / temperature) in fixed point: scale at the max, 0 for NaN."""
    if v != v:
        return _U0
    w = _ONE
    if v != mx:
        w = m.exp((v - mx) * inv_t)
    return uint64(w * scale)


# ---- block building blocks (every thread of the block calls them) -----------------------------
@cuda.jit(device=True)
def _prefix_scan(buf, tid, nt):
    """buf[t] = sum of buf[0:t+1] for t < nt (Hillis-Steele; uint64)."""
    off = _U1
    while off < nt:
        v = _U0
        if tid < nt and tid >= off:
            v = buf[tid - off]
        cuda.syncthreads()
        if tid < nt:
            buf[tid] += v
        cuda.syncthreads()
        off += off


def _bins(block):
    """(bins per scanning thread, scanning threads): the NBINS bins are summed by the first
    min(32, block) threads; each then adds up the totals above its own (a short serial
    suffix sum: two barriers, where a Hillis-Steele scan takes two a step)."""
    nt = min(32, block, NBINS)
    return NBINS // nt, nt


@py_in_sim
def _find_bin(hist, tot, tid, bpt, nt, need):
    """The radix step's bin search, by the first ``nt`` threads (thread t sums bins
    [t*bpt, (t+1)*bpt) into tot[t] before): walking the bins from the highest, the one where the
    running total (counts or masses) reaches ``need``. Returns (found, bin, its total, what is
    still needed inside it); found only in the one thread that owns that bin."""
    if tid >= nt:
        return False, _U0, _U0, _U0
    gt = _U0                                  # the total of the bins above this thread's
    j = tid + _U1
    while j < nt:
        gt += tot[j]
        j += _U1
    if not (gt < need <= gt + tot[tid]):
        return False, _U0, _U0, _U0
    acc = gt
    j = _U0
    while j < bpt:
        d = tid * bpt + (bpt - _U1 - j)
        c = uint64(hist[d])
        if acc + c >= need:
            return True, d, c, need - acc
        acc += c
        j += _U1
    return False, _U0, _U0, _U0


@functools.lru_cache(maxsize=None)
def _select_count(load, block: int):
    """select(src, base, m, off, need, hist, tot, ctl) -> (prefix, mask): the ``need`` largest
    keys of src[base:base+m] are those with key & mask >= prefix. hist: uint32[NBINS],
    tot: uint64[>= scanning threads], ctl: uint64[4], all shared."""
    B, B2, B3, B4 = uint64(block), uint64(2 * block), uint64(3 * block), uint64(4 * block)
    BPT, NT = _bins(block)
    BPTU, NTU = uint64(BPT), uint64(NT)
    NB = uint64(NBINS)
    DM = uint64(NBINS - 1)
    BITS = uint64(RADIX_BITS)

    @cuda.jit(device=True)
    def select(src, base, mm, off, need, hist, tot, ctl):
        tid = uint64(cuda.threadIdx.x)
        prefix = _U0
        mask = _U0
        shift = uint64(64)
        while shift > _U0:
            shift -= BITS
            b = tid
            while b < NB:
                hist[b] = uint32(0)
                b += B
            cuda.syncthreads()
            i = tid
            while i + B3 < mm:                # four loads in flight
                _, e0 = load(src, base, i, off)
                _, e1 = load(src, base, i + B, off)
                _, e2 = load(src, base, i + B2, off)
                _, e3 = load(src, base, i + B3, off)
                if (e0 & mask) == prefix:
                    cuda.atomic.add(hist, int64((e0 >> shift) & DM), uint32(1))
                if (e1 & mask) == prefix:
                    cuda.atomic.add(hist, int64((e1 >> shift) & DM), uint32(1))
                if (e2 & mask) == prefix:
                    cuda.atomic.add(hist, int64((e2 >> shift) & DM), uint32(1))
                if (e3 & mask) == prefix:
                    cuda.atomic.add(hist, int64((e3 >> shift) & DM), uint32(1))
                i += B4
            while i < mm:
                _, e = load(src, base, i, off)
                if (e & mask) == prefix:
                    cuda.atomic.add(hist, int64((e >> shift) & DM), uint32(1))
                i += B
            cuda.syncthreads()
            if tid < NTU:
                s = _U0
                for j in range(BPT):
                    s += uint64(hist[tid * BPTU + uint64(j)])
                tot[tid] = s
            cuda.syncthreads()
            found, d, c, left = _find_bin(hist, tot, tid, BPTU, NTU, need)
            if found:                         # done when the bin holds exactly what is left
                ctl[0], ctl[1] = d, left
                ctl[2] = _U1 if c == left else _U0
            cuda.syncthreads()
            d = ctl[0]
            need = ctl[1]
            done = ctl[2]
            prefix |= d << shift
            mask |= DM << shift
            if done != _U0:
                break
        cuda.syncthreads()   # ctl, hist and tot are free again
        return prefix, mask
    return select


@py_in_sim
def _mass_add(hist_m, hist_c, v, e, mask, prefix, shift, mx, inv_t, scale):
    """One key into the mass histogram of the digit at ``shift`` (if it matches prefix)."""
    if (e & mask) == prefix:
        d = int64((e >> shift) & uint64(NBINS - 1))
        cuda.atomic.add(hist_m, d, weight(v, mx, inv_t, scale))
        cuda.atomic.add(hist_c, d, uint32(1))


@functools.lru_cache(maxsize=None)
def _select_mass(load, block: int):
    """select(src, base, m, off, mx, inv_t, scale, p, hist_m, hist_c, tot, ctl) -> (prefix,
    mask): top_p. With Z the total weight and T = max(1, floor(Z * p / 2^32)), the kept keys
    (key & mask >= prefix) are the largest ones up to and including the first whose running
    mass (in key order) reaches T. (0, 0) (everything) when Z is 0."""
    B, B2, B3, B4 = uint64(block), uint64(2 * block), uint64(3 * block), uint64(4 * block)
    BPT, NT = _bins(block)
    BPTU, NTU = uint64(BPT), uint64(NT)
    NB = uint64(NBINS)
    DM = uint64(NBINS - 1)
    BITS = uint64(RADIX_BITS)

    @cuda.jit(device=True)
    def select(src, base, mm, off, mx, inv_t, scale, p, hist_m, hist_c, tot, ctl):
        tid = uint64(cuda.threadIdx.x)
        prefix = _U0
        mask = _U0
        shift = uint64(64)
        target = _U0
        while shift > _U0:
            shift -= BITS
            b = tid
            while b < NB:
                hist_m[b] = _U0
                hist_c[b] = uint32(0)
                b += B
            cuda.syncthreads()
            i = tid
            while i + B3 < mm:                # four loads in flight
                v0, e0 = load(src, base, i, off)
                v1, e1 = load(src, base, i + B, off)
                v2, e2 = load(src, base, i + B2, off)
                v3, e3 = load(src, base, i + B3, off)
                _mass_add(hist_m, hist_c, v0, e0, mask, prefix, shift, mx, inv_t, scale)
                _mass_add(hist_m, hist_c, v1, e1, mask, prefix, shift, mx, inv_t, scale)
                _mass_add(hist_m, hist_c, v2, e2, mask, prefix, shift, mx, inv_t, scale)
                _mass_add(hist_m, hist_c, v3, e3, mask, prefix, shift, mx, inv_t, scale)
                i += B4
            while i < mm:
                v, e = load(src, base, i, off)
                _mass_add(hist_m, hist_c, v, e, mask, prefix, shift, mx, inv_t, scale)
                i += B
            cuda.syncthreads()
            if tid < NTU:
                s = _U0
                for j in range(BPT):
                    s += hist_m[tid * BPTU + uint64(j)]
                tot[tid] = s
            cuda.syncthreads()
            if mask == _U0:                   # first pass: the total mass sets the target
                z = _U0
                for j in range(NT):
                    z += tot[j]
                if z == _U0:
                    break
                target = max(_U1, mulhi32(z, p))
            found, d, c, left = _find_bin(hist_m, tot, tid, BPTU, NTU, target)
            if found:                         # done when the bin holds a single key
                ctl[0], ctl[1] = d, left
                ctl[2] = _U1 if hist_c[d] == uint32(1) else _U0
            cuda.syncthreads()
            d = ctl[0]
            target = ctl[1]
            done = ctl[2]
            prefix |= d << shift
            mask |= DM << shift
            if done != _U0:
                break
        cuda.syncthreads()
        return prefix, mask
    return select


# ---- topk ------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def topk_small(ld: str):
    """A thread per row (rows of n <= SMALL_N): out[r, rank] = i for each element of rank < k."""
    load = _x_loader(ld, False)

    @jit
    def kernel(out, x, rows, n, k):
        r = uint64(cuda.grid(1))
        while r < rows:
            base = r * n
            i = _U0
            while i < n:
                _, ki = load(x, base, i, _U0)
                rank = _U0
                j = _U0
                while j < n:
                    _, kj = load(x, base, j, _U0)
                    if kj > ki:
                        rank += _U1
                    j += _U1
                if rank < k:
                    out[r * k + rank] = int64(i)
                i += _U1
            r += uint64(cuda.gridsize(1))
    return kernel


@functools.lru_cache(maxsize=None)
def topk_segments(ld: str, block: int, nan_low: bool, seg_max: int):
    """Stage 1: block per (row, segment) q: cand[q*k : q*k+k] = the top min(k, len) keys of
    segment q % nseg of row q // nseg (elements [s*seg, min((s+1)*seg, n)), seg <= seg_max),
    in no order, 0-padded. The segment's keys are computed once into shared memory."""
    load = _x_loader(ld, nan_low)
    select = _select_count(_key_only, block)
    B = uint64(block)
    _, NT = _bins(block)

    @_jit(block)
    def kernel(cand, x, nq, n, nseg, seg, k):
        hist = cuda.shared.array(NBINS, uint32)
        tot = cuda.shared.array(NT, uint64)
        ctl = cuda.shared.array(4, uint64)
        slot = cuda.shared.array(1, uint32)
        kbuf = cuda.shared.array(seg_max, uint64)
        tid = uint64(cuda.threadIdx.x)
        q = uint64(cuda.blockIdx.x)
        while q < nq:                         # uniform across the block
            row = q // nseg
            lo = (q - row * nseg) * seg
            hi = min(lo + seg, n)
            mm = hi - lo
            need = min(k, mm)
            if tid == _U0:
                slot[0] = uint32(0)
            i = tid
            while i < mm:
                _, e = load(x, row * n + lo, i, lo)
                kbuf[i] = e
                i += B
            # (select begins with a barrier: kbuf and slot are ready when it reads them)
            prefix, mask = select(kbuf, _U0, mm, _U0, need, hist, tot, ctl)
            out0 = q * k
            i = tid
            while i < mm:
                e = kbuf[i]
                if (e & mask) >= prefix:
                    s = uint64(cuda.atomic.add(slot, 0, uint32(1)))
                    cand[out0 + s] = e
                i += B
            j = need + tid
            while j < k:
                cand[out0 + j] = _U0
                j += B
            cuda.syncthreads()                # kbuf and slot are rewritten by the next segment
            q += uint64(cuda.gridDim.x)
    return kernel


IDX_OUT, KEYS_BY_INDEX = 0, 1   # topk_rows outputs


@functools.lru_cache(maxsize=None)
def topk_rows(src: str, block: int, kp: int, smem: bool, stage: int, out_kind: int,
              nan_low: bool):
    """A block per row: the top k keys of the row's source, m elements: src "f32"/"f16"/
    "bf16" is the row of x itself (m = n), "keys" its candidate list (m = S*k). ``stage`` > 0
    (>= m): the keys are put in that many shared-memory slots once; 0: every pass reads the
    source.
    The k winners are sorted in kp slots, in shared memory when ``smem``, else in
    scratch[row*kp : row*kp+kp]; out [rows, k] gets the indices in key order (IDX_OUT) or the
    keys in index order (KEYS_BY_INDEX)."""
    load = _key_only if src == "keys" else _x_loader(src, nan_low)
    select_staged = _select_count(_key_only, block)
    select_src = _select_count(load, block)
    # descending by key, or by index: ascending, as descending low 32 bits (0 pads sort last)
    sort = bitonic_sort(True, out_kind == KEYS_BY_INDEX)
    B = uint64(block)
    KP = uint64(kp)
    _, NT = _bins(block)
    SM_SLOTS = kp if smem else 1
    KB_SLOTS = max(1, stage)
    USE_SMEM = smem
    STAGED = stage > 0
    IDX = out_kind == IDX_OUT

    @_jit(block)
    def kernel(out, x, scratch, rows, mm, k):
        hist = cuda.shared.array(NBINS, uint32)
        tot = cuda.shared.array(NT, uint64)
        ctl = cuda.shared.array(4, uint64)
        slot = cuda.shared.array(1, uint32)
        sbuf = cuda.shared.array(SM_SLOTS, uint64)
        kbuf = cuda.shared.array(KB_SLOTS, uint64)
        tid = uint64(cuda.threadIdx.x)
        row = uint64(cuda.blockIdx.x)
        while row < rows:                     # uniform across the block
            if tid == _U0:
                slot[0] = uint32(0)
            base = row * mm
            if STAGED:
                i = tid
                while i < mm:
                    _, e = load(x, base, i, _U0)
                    kbuf[i] = e
                    i += B
                prefix, mask = select_staged(kbuf, _U0, mm, _U0, k, hist, tot, ctl)
            else:
                prefix, mask = select_src(x, base, mm, _U0, k, hist, tot, ctl)
            sb = _U0 if USE_SMEM else row * KP
            i = tid
            while i < mm:
                if STAGED:
                    e = kbuf[i]
                else:
                    _, e = load(x, base, i, _U0)
                if (e & mask) >= prefix:
                    s = uint64(cuda.atomic.add(slot, 0, uint32(1)))
                    if USE_SMEM:
                        sbuf[s] = e
                    else:
                        scratch[sb + s] = e
                i += B
            j = k + tid
            while j < KP:
                if USE_SMEM:
                    sbuf[j] = _U0
                else:
                    scratch[sb + j] = _U0
                j += B
            cuda.syncthreads()
            if USE_SMEM:
                sort(sbuf, sb, KP, tid, B)
            else:
                sort(scratch, sb, KP, tid, B)
            j = tid
            while j < k:
                e = sbuf[j] if USE_SMEM else scratch[sb + j]
                if IDX:
                    out[row * k + j] = int64(_U32 - (e & _U32))
                else:
                    out[row * k + j] = e
                j += B
            cuda.syncthreads()                # sbuf, kbuf and slot are reused by the next row
            row += uint64(cuda.gridDim.x)
    return kernel


@jit
def gather_rows(out, x, idx, total, n, k):
    """out[r*k + j] = x[r*n + idx[r*k + j]] for r*k + j < total (any storage dtype)."""
    t = uint64(cuda.grid(1))
    while t < total:
        r = t // k
        out[t] = x[r * n + uint64(idx[t])]
        t += uint64(cuda.gridsize(1))


# ---- sample ----------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def sample_small(ld: str):
    """A thread per row (rows of n <= SMALL_N, keys and weights in local arrays); every rule
    of sample in O(n^2) per row. top_k = 0: no top_k; has_p: top_p < 1 (p = floor(top_p *
    2^32))."""
    load = _x_loader(ld, True)

    @jit
    def kernel(out, x, seed, rows, n, top_k, has_p, p, inv_t, scale):
        ks = cuda.local.array(SMALL_N, uint64)
        ws = cuda.local.array(SMALL_N, uint64)
        drop = cuda.local.array(SMALL_N, boolean)
        r = uint64(cuda.grid(1))
        kk = top_k if top_k > _U0 else n
        while r < rows:
            base = r * n
            omax = _U0
            i = _U0
            while i < n:
                _, e = load(x, base, i, _U0)
                ks[i] = e
                omax = max(omax, e >> _S32)
                i += _U1
            mx = _NEG_INF if omax == _U0 else value_of(omax)
            z = _U0                           # mass of the top_k set
            i = _U0
            while i < n:
                w = weight(value_of(ks[i] >> _S32), mx, inv_t, scale)
                rank = _U0
                j = _U0
                while j < n:
                    if ks[j] > ks[i]:
                        rank += _U1
                    j += _U1
                if rank >= kk:
                    w = _U0
                ws[i] = w
                z += w
                i += _U1
            if has_p:   # keep a token when the mass of the larger kept keys is below target
                target = max(_U1, mulhi32(z, p))
                i = _U0
                while i < n:
                    better = _U0
                    j = _U0
                    while j < n:
                        if ks[j] > ks[i]:
                            better += ws[j]
                        j += _U1
                    drop[i] = better >= target
                    i += _U1
                z = _U0
                i = _U0
                while i < n:
                    if drop[i]:
                        ws[i] = _U0
                    z += ws[i]
                    i += _U1
            u = mulhi32(z, row_uniform(r, seed))
            acc = _U0
            pick = _U0                        # no weight at all (all NaN): index 0
            i = _U0
            while i < n:
                acc += ws[i]
                if acc > u:
                    pick = i
                    break
                i += _U1
            out[r] = int64(pick)
            r += uint64(cuda.gridsize(1))
    return kernel


@functools.lru_cache(maxsize=None)
def _chunks(load, block: int):
    """The inverse-CDF building blocks over elements [lo, hi) of a source in index order, kept
    when key & mask >= prefix. scan(...) -> (s, incl, z, clo, chi): this thread's contiguous
    chunk [clo, chi), its kept mass s, the inclusive prefix of the chunk masses and their
    total z (a block prefix scan through ``tot``, one slot a thread). walk(...): the position
    of the first kept element whose running mass exceeds ``target``, when it lies in this
    thread's chunk, else _NONE (a MIN over the block gives the draw)."""
    B = uint64(block)

    @cuda.jit(device=True)
    def scan(src, base, lo, hi, mask, prefix, mx, inv_t, scale, tot):
        tid = uint64(cuda.threadIdx.x)
        chunk = (hi - lo + B - _U1) // B
        clo = min(lo + tid * chunk, hi)
        chi = min(clo + chunk, hi)
        s = _U0
        i = clo
        while i < chi:
            v, e = load(src, base, i, _U0)
            if (e & mask) >= prefix:
                s += weight(v, mx, inv_t, scale)
            i += _U1
        tot[tid] = s
        cuda.syncthreads()
        _prefix_scan(tot, tid, B)
        incl = tot[tid]
        z = tot[B - _U1]
        cuda.syncthreads()                    # tot is free again
        return s, incl, z, clo, chi

    @py_in_sim
    def walk(src, base, clo, chi, mask, prefix, mx, inv_t, scale, s, incl, target):
        if s == _U0 or target < incl - s or target >= incl:
            return _NONE
        acc = incl - s
        i = clo
        while i < chi:
            v, e = load(src, base, i, _U0)
            if (e & mask) >= prefix:
                acc += weight(v, mx, inv_t, scale)
                if acc > target:
                    return int64(i)
            i += _U1
        return _NONE
    return scan, walk


@functools.lru_cache(maxsize=None)
def sample_rows(src: str, block: int, has_p: bool):
    """A block per row over a source in index order: the row of logits (src "f32"/"f16"/
    "bf16", m = n) or its top_k keys sorted by index (src "keys", m = k)."""
    keys = src == "keys"
    load = _key_loader if keys else _x_loader(src, True)
    sel = _select_mass(load, block)
    scan, walk = _chunks(load, block)
    B, B2, B3, B4 = uint64(block), uint64(2 * block), uint64(3 * block), uint64(4 * block)
    _, NT = _bins(block)
    TOT = max(NT, block)
    HAS_P = has_p

    @_jit(block)
    def kernel(out, x, seed, rows, mm, p, inv_t, scale):
        hist_m = cuda.shared.array(NBINS, uint64)
        hist_c = cuda.shared.array(NBINS, uint32)
        tot = cuda.shared.array(TOT, uint64)
        ctl = cuda.shared.array(4, uint64)
        red = cuda.shared.array(SLOTS, int64)
        tid = uint64(cuda.threadIdx.x)
        row = uint64(cuda.blockIdx.x)
        while row < rows:                     # uniform across the block
            base = row * mm
            omax = int64(0)                   # the largest ord (int64: shuffles take no uint64)
            i = tid
            while i + B3 < mm:                # four loads in flight
                _, e0 = load(x, base, i, _U0)
                _, e1 = load(x, base, i + B, _U0)
                _, e2 = load(x, base, i + B2, _U0)
                _, e3 = load(x, base, i + B3, _U0)
                omax = max(omax, int64(max(max(e0, e1), max(e2, e3)) >> _S32))
                i += B4
            while i < mm:
                _, e = load(x, base, i, _U0)
                omax = max(omax, int64(e >> _S32))
                i += B
            omax = group_reduce(omax, red, block, MAX)
            mx = _NEG_INF if omax == int64(0) else value_of(uint64(omax))
            prefix = _U0
            mask = _U0
            if HAS_P:
                prefix, mask = sel(x, base, mm, _U0, mx, inv_t, scale, p, hist_m, hist_c, tot,
                                   ctl)
            s, incl, z, clo, chi = scan(x, base, _U0, mm, mask, prefix, mx, inv_t, scale, tot)
            u = mulhi32(z, row_uniform(row, seed))
            pick = walk(x, base, clo, chi, mask, prefix, mx, inv_t, scale, s, incl, u)
            pick = group_reduce(pick, red, block, MIN)
            if tid == _U0:
                at = _U0 if pick == _NONE else uint64(pick)   # no weight (all NaN): the first
                if keys:
                    out[row] = int64(_U32 - (x[base + at] & _U32))
                else:
                    out[row] = int64(at)
            cuda.syncthreads()                # tot is reused by the next row
            row += uint64(cuda.gridDim.x)
    return kernel


# ---- sample without filters over long rows: three grid-wide passes ---------------------------
@functools.lru_cache(maxsize=None)
def sample_seg_max(ld: str, block: int):
    """segmax[q] = the largest ord (NaN lowest) of segment q (row q // nseg, elements
    [s*seg, min((s+1)*seg, n)))."""
    load = _x_loader(ld, True)
    B, B2, B3, B4 = uint64(block), uint64(2 * block), uint64(3 * block), uint64(4 * block)

    @_jit(block)
    def kernel(segmax, x, nq, n, nseg, seg):
        red = cuda.shared.array(SLOTS, int64)
        tid = uint64(cuda.threadIdx.x)
        q = uint64(cuda.blockIdx.x)
        while q < nq:                         # uniform across the block
            row = q // nseg
            lo = (q - row * nseg) * seg
            hi = min(lo + seg, n)
            base = row * n
            om = _U0
            i = lo + tid
            while i + B3 < hi:                # four loads in flight
                _, e0 = load(x, base, i, _U0)
                _, e1 = load(x, base, i + B, _U0)
                _, e2 = load(x, base, i + B2, _U0)
                _, e3 = load(x, base, i + B3, _U0)
                om = max(om, max(max(e0, e1), max(e2, e3)))
                i += B4
            while i < hi:
                _, e = load(x, base, i, _U0)
                om = max(om, e)
                i += B
            om32 = group_reduce(int64(om >> _S32), red, block, MAX)
            if tid == _U0:
                segmax[q] = om32
            q += uint64(cuda.gridDim.x)
    return kernel


@py_in_sim
def _row_max(segmax, row, nseg, tid, step):
    """This thread's share of the largest ord of a row, from its segments' (int64)."""
    om = int64(0)
    j = tid
    while j < nseg:
        om = max(om, segmax[row * nseg + j])
        j += step
    return om


@functools.lru_cache(maxsize=None)
def sample_seg_mass(ld: str, block: int):
    """segmass[q] = the fixed-point mass of segment q, relative to its row's max (int64)."""
    load = _x_loader(ld, True)
    B, B2, B3, B4 = uint64(block), uint64(2 * block), uint64(3 * block), uint64(4 * block)

    @_jit(block)
    def kernel(segmass, segmax, x, nq, n, nseg, seg, inv_t, scale):
        red = cuda.shared.array(SLOTS, int64)
        tid = uint64(cuda.threadIdx.x)
        q = uint64(cuda.blockIdx.x)
        while q < nq:                         # uniform across the block
            row = q // nseg
            lo = (q - row * nseg) * seg
            hi = min(lo + seg, n)
            base = row * n
            om = group_reduce(_row_max(segmax, row, nseg, tid, B), red, block, MAX)
            mx = _NEG_INF if om == int64(0) else value_of(uint64(om))
            w = _U0
            i = lo + tid
            while i + B3 < hi:                # four loads in flight
                v0, _ = load(x, base, i, _U0)
                v1, _ = load(x, base, i + B, _U0)
                v2, _ = load(x, base, i + B2, _U0)
                v3, _ = load(x, base, i + B3, _U0)
                w += (weight(v0, mx, inv_t, scale) + weight(v1, mx, inv_t, scale)
                      + weight(v2, mx, inv_t, scale) + weight(v3, mx, inv_t, scale))
                i += B4
            while i < hi:
                v, _ = load(x, base, i, _U0)
                w += weight(v, mx, inv_t, scale)
                i += B
            w = group_reduce(int64(w), red, block, SUM)
            if tid == _U0:
                segmass[q] = w
            q += uint64(cuda.gridDim.x)
    return kernel


@functools.lru_cache(maxsize=None)
def sample_pick(ld: str, block: int):
    """A block per row: the segment holding the row's draw (the segment masses in chunks, a
    prefix scan, a walk), then the token inside it (the same over the segment's elements).
    The masses are exact integers, so this draws the token sample_rows would."""
    load = _x_loader(ld, True)
    scan, walk = _chunks(load, block)
    B = uint64(block)

    @_jit(block)
    def kernel(out, x, segmax, segmass, seed, rows, n, nseg, seg, inv_t, scale):
        tot = cuda.shared.array(block, uint64)
        red = cuda.shared.array(SLOTS, int64)
        ctl = cuda.shared.array(2, uint64)
        tid = uint64(cuda.threadIdx.x)
        row = uint64(cuda.blockIdx.x)
        while row < rows:                     # uniform across the block
            base = row * n
            om = group_reduce(_row_max(segmax, row, nseg, tid, B), red, block, MAX)
            mx = _NEG_INF if om == int64(0) else value_of(uint64(om))
            if tid == _U0:
                ctl[0] = _U32                 # no segment: the row has no weight at all
            # the segment: contiguous chunks of the row's segment masses, a prefix scan
            chunk = (nseg + B - _U1) // B
            clo = min(tid * chunk, nseg)
            chi = min(clo + chunk, nseg)
            s = _U0
            j = clo
            while j < chi:
                s += uint64(segmass[row * nseg + j])
                j += _U1
            tot[tid] = s
            cuda.syncthreads()
            _prefix_scan(tot, tid, B)
            incl = tot[tid]
            z = tot[B - _U1]
            u = mulhi32(z, row_uniform(row, seed))
            if s > _U0 and incl - s <= u < incl:
                acc = incl - s
                j = clo
                while j < chi:
                    w = uint64(segmass[row * nseg + j])
                    if acc + w > u:
                        ctl[0] = j
                        ctl[1] = u - acc      # the target inside segment j
                        break
                    acc += w
                    j += _U1
            cuda.syncthreads()
            sj = ctl[0]
            target = ctl[1]
            pick = _NONE
            if sj != _U32:                    # uniform: every thread read the same ctl
                lo = sj * seg
                hi = min(lo + seg, n)
                s, incl, _, clo, chi = scan(x, base, lo, hi, _U0, _U0, mx, inv_t, scale, tot)
                pick = walk(x, base, clo, chi, _U0, _U0, mx, inv_t, scale, s, incl, target)
            pick = group_reduce(pick, red, block, MIN)
            if tid == _U0:
                out[row] = _I0 if pick == _NONE else pick   # no weight (all NaN): 0
            cuda.syncthreads()                # ctl and tot are reused by the next row
            row += uint64(cuda.gridDim.x)
    return kernel


def frac_bits(n: int) -> int:
    """Fixed-point bits of the weights: n * 2^FRAC <= 2^62 (sums fit an int64 too)."""
    return min(61, 62 - int(n).bit_length())


def top_p_fixed(top_p: float) -> int:
    """top_p as a 32-bit fraction (top_p < 1)."""
    return min(int(top_p * 2**32), 2**32 - 1)
