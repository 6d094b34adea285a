"""The sequential pass of the chunked gated delta rule (ir/ops_delta.py's "delta_state_scan"):
per head g, through its N chunks in order (or reversed), with the state S [K, V]:

    states[g, n] = S                      (the state entering chunk n)
    X[g, n]      = A[g, n] + P[g, n] S    ([C, K] @ [K, V])
    S            = d[g, n] S + Q[g, n]^T X[g, n] (+ Bias[g, n])

and final[g] = S after the last chunk. One launch for all chunks: a block per (head, slice
of VS columns of V). The columns a block owns never mix with others' (both products keep V's
columns apart), so blocks run independently: no atomics, no grid barrier.

Thread (ty, tx) of RT x CT owns TC = VS / CT consecutive columns (tx TC ..) and holds, in
registers, TR2 consecutive rows of its columns of S (ty TR2 ..; TR2 a multiple of 4) and
TR1 rows of X (ty, ty + RT, ..: the rows a warp reads at once are consecutive). Dynamic
shared memory (ir/ops_delta.py's ``scan_shared_layout``) holds S and X of the block's
columns and the chunk's P and Q, each as rows (padded by 16 bytes), and every inner step is
16-byte loads: X += P S reads 4 of P's columns of each of the thread's rows and TC of S per 4
rows of K (4 TR1 TC FMAs from TR1 + TC loads of 16 bytes); S += Q^T X reads TR2 of a row of
Q and TC of X (TR2 TC FMAs from (TR2 + TC) / 4 loads). Two barriers a chunk:

    X = A + P S  (P, S);  wait for Q;  barrier;  P of the next chunk starts copying (cp.async);
    S = d S + Q^T X  (Q, X) and S to shared memory;  wait for P;  barrier;
    Q of the next chunk starts copying

so the copies of P and Q run under the other product. Rows of P and S past C and K, and
columns of P and Q past K, are zeros, written once (the products read them whole). Without
16-byte aligned rows (K % 4, or an unaligned buffer) P and Q are copied a float at a time,
at the same points.

That layout takes 95 KB at K = 128, C = 64 (sm_80+ and sm_86/89's 99 KB allow it). On GPUs
allowing a block less (sm_75: 64 KB; 48 KB before) the lowering (``fit_state_scan``) takes
fewer columns a block, then P and Q in one buffer, staged in turn (four barriers a chunk).

unit_lower_inverse: (I - A)^-1, a thread a column by forward substitution (below)."""
import functools
from dataclasses import dataclass

from numba import cuda, float32

from ..ir.ops_delta import SCAN_MAX_COLUMNS, SCAN_MAX_ROWS, SCAN_SHARED_FLOATS, \
    scan_shared_layout
from . import mma as tc
from . import ptx
from .launch import inline, jit, register_geometry

ALIGN = tc.SMEM_ALIGN      # (a module constant: shared.array needs a literal alignment)


@dataclass(frozen=True)
class StateScanGeometry:
    rt: int      # thread rows
    ct: int      # thread columns (rt * ct threads a block)
    vs: int      # columns of V a block owns: a multiple of 4 ct (each thread's, 16-byte groups)

    def __post_init__(self):
        if self.vs % (4 * self.ct) or not (1 <= self.rt <= SCAN_MAX_ROWS
                                           and 1 <= self.vs <= SCAN_MAX_COLUMNS):
            raise ValueError(f"delta_state_scan geometry: vs must be a multiple of 4 ct, rt "
                             f"and vs at most {SCAN_MAX_ROWS} / {SCAN_MAX_COLUMNS} (what "
                             f"ir/ops_delta.py sizes chunks for), got {self}")


# GPU: 128 threads, 32 columns of V a block (K = 128, C = 64: 95 KB of shared memory, two
# blocks a multiprocessor; 4 x 4 tiles of X, 8 x 4 of S); the simulator: 2 threads (each CUDA
# thread is a Python thread)
register_geometry("delta_state_scan", StateScanGeometry(16, 8, 32), StateScanGeometry(2, 1, 4))


def columns(geo: StateScanGeometry, v: int) -> int:
    """The columns of V a block owns for V = v: geo.vs, or v rounded up to 4 geo.ct if less."""
    return min(geo.vs, -(-v // (4 * geo.ct)) * 4 * geo.ct)


def shared_bytes(k: int, c: int, vs: int, geo: StateScanGeometry,
                 shared_pq: bool = False) -> int:
    return 4 * scan_shared_layout(k, c, vs, geo.rt, shared_pq)["total"]


def fewer_columns(geo: StateScanGeometry) -> list:
    """geo, then geometries of a half and a quarter of its columns (and thread columns: each
    thread's columns stay the same), where those are geometries."""
    return [geo] + [StateScanGeometry(geo.rt, geo.ct >> i, geo.vs >> i) for i in (1, 2)
                    if geo.ct >> i and (geo.vs >> i) % (4 * (geo.ct >> i)) == 0]


def fit_state_scan(k: int, c: int, v: int, geo: StateScanGeometry, limit: int):
    """(geometry, columns, shared_pq) of the state pass for Dk = k, chunks of c and V = v on
    a GPU allowing ``limit`` bytes of shared memory a block: geo itself where its layout fits
    (always on sm_80+: the builder sized c for it), else fewer columns, else P and Q in one
    buffer (two more barriers a chunk, no copy under a product), at geo then fewer columns.
    Raises when nothing fits."""
    for shared_pq in (False, True):
        for g in fewer_columns(geo):
            vs = columns(g, v)
            if shared_bytes(k, c, vs, g, shared_pq) <= limit:
                return g, vs, shared_pq
    g = fewer_columns(geo)[-1]
    vs = columns(g, v)
    raise ValueError(f"delta_state_scan: Dk={k}, chunk {c} needs at least "
                     f"{shared_bytes(k, c, vs, g, True)} bytes of shared memory a block "
                     f"({vs} columns, P and Q in one buffer); this GPU allows {limit}")


@functools.lru_cache(maxsize=None)
def state_scan_kernel(k_dim: int, chunk: int, vs: int, geo: StateScanGeometry, reverse: bool,
                      has_bias: bool, vec: bool, shared_pq: bool = False):
    """kernel(states, xo, final, P, Q, A, d, s0, bias, heads, chunks, v_dim): flat f32 arrays
    states [G, N, K, V], xo [G, N, C, V], final [G, K, V], P / Q [G, N, C, K], A [G, N, C, V],
    d [G, N], s0 [G, K, V], bias [G, N, K, V] (read only when ``has_bias``); launch with
    rt * ct threads a block, ``shared_bytes`` of dynamic shared memory, blocks over
    G * ceil(V / vs) (a grid-stride loop). ``vec``: P and Q copied 16 bytes at a time by
    cp.async (K % 4 == 0, both 16-byte aligned, compute capability 8.0 or more).
    ``shared_pq``: P and Q take turns in one buffer (``fit_state_scan``), four barriers a
    chunk: X = A + P S; barrier; Q copied in; barrier; S's update; barrier; the next P
    copied in; barrier."""
    K, C, VS, RT, CT = k_dim, chunk, vs, geo.rt, geo.ct
    lay = scan_shared_layout(K, C, VS, RT, shared_pq)
    if lay["total"] > SCAN_SHARED_FLOATS:
        raise ValueError(f"delta_state_scan: K={K}, chunk {C}, {VS} columns, {RT} thread rows "
                         f"need {4 * lay['total']} bytes of shared memory, over "
                         f"{4 * SCAN_SHARED_FLOATS}")
    if vec and K % 4:
        raise ValueError(f"delta_state_scan: 16-byte copies need K % 4 == 0, got K={K}")
    NT, TC = RT * CT, VS // CT
    TR1, TR2, KS, VSP = lay["tr1"], lay["tr2"], lay["ks"], lay["vsp"]
    S_OFF, X_OFF, P_OFF, Q_OFF, NSH = lay["s"], lay["x"], lay["p"], lay["q"], lay["total"]
    K4 = -(-K // 4) * 4                     # P's columns read (past K: zeros)
    UC = 2 if C % 2 == 0 else 1             # rows of Q^T X's sum a loop trip
    NSR, NX1, NPV = TR2 * TC, TR1 * TC, 4 * TR1     # (shapes of local arrays: constants)
    NQV, NXV = UC * TR2, UC * TC
    CK, CK4, KV4 = C * K, C * K // 4, K // 4
    # element copies: a thread's NPER elements in groups of U loads issued before any store
    # (a load then its store, element by element, would wait out a memory latency each)
    NPER = -(-CK // NT)
    U = min(16, NPER)
    NG = -(-NPER // U)

    @inline
    def stage(sh, off, src, base, t):
        """Chunk [C, K] at src[base:] into shared rows of KS at sh[off:] (cp.async when vec:
        the caller waits before the barrier that publishes it)."""
        if vec:
            for f in range(t, CK4, NT):
                r = f // KV4
                tc.cp_async16(sh, off + r * KS + 4 * (f - r * KV4), src, base + 4 * f)
        else:
            stg = cuda.local.array(U, float32)
            for grp in range(NG):
                for u in range(U):
                    e = (grp * U + u) * NT + t
                    stg[u] = src[base + e] if e < CK else float32(0.0)
                for u in range(U):
                    e = (grp * U + u) * NT + t
                    if e < CK:
                        sh[off + (e // K) * KS + e % K] = stg[u]

    @jit
    def kernel(states, xo, final, P, Q, A, d, s0, bias, heads, chunks, v_dim):
        sh = cuda.shared.array(0, float32, alignment=ALIGN)
        sr = cuda.local.array(NSR, float32)           # this thread's rows of S
        bv = cuda.local.array(NSR, float32)           # the bias's (read only with one)
        x1 = cuda.local.array(NX1, float32)           # its rows of X
        a1 = cuda.local.array(NX1, float32)           # A's (loaded before X's product)
        pv = cuda.local.array(NPV, float32)           # 4 columns of P, each of its X rows
        qv = cuda.local.array(NQV, float32)           # UC rows: of Q (TR2 each), X (TC)
        sv = cuda.local.array(NXV, float32)           # (and a row of S: TC)
        t = cuda.threadIdx.x
        ty, tx = t // CT, t % CT
        c0 = tx * TC                                  # its first column in the block's
        for e in range(t, NSH, NT):                   # the padding stays 0 from here on
            sh[e] = float32(0.0)
        cuda.syncthreads()
        nvs = (v_dim + VS - 1) // VS
        blk = cuda.blockIdx.x
        while blk < heads * nvs:
            gi = blk // nvs
            v0 = (blk % nvs) * VS + c0                # the global column of its first
            gn = gi * chunks + (chunks - 1 if reverse else 0)
            stage(sh, P_OFF, P, gn * CK, t)
            if not shared_pq:
                stage(sh, Q_OFF, Q, gn * CK, t)
            for i in range(TR2):
                k = ty * TR2 + i
                for j in range(TC):
                    val = float32(0.0)
                    if k < K and v0 + j < v_dim:
                        val = s0[(gi * K + k) * v_dim + v0 + j]
                    sr[i * TC + j] = val
                for j4 in range(TC // 4):
                    ptx.vst4(sh, S_OFF + k * VSP + c0 + 4 * j4, sr[i * TC + 4 * j4],
                             sr[i * TC + 4 * j4 + 1], sr[i * TC + 4 * j4 + 2],
                             sr[i * TC + 4 * j4 + 3])
            if vec:
                tc.cp_async_wait_all()
            cuda.syncthreads()
            for step in range(chunks):
                n = chunks - 1 - step if reverse else step
                gn = gi * chunks + n
                for i in range(TR2):
                    k = ty * TR2 + i
                    for j in range(TC):
                        if k < K and v0 + j < v_dim:
                            states[(gn * K + k) * v_dim + v0 + j] = sr[i * TC + j]
                # d and the bias loaded now, used after X's product (their latency hidden)
                dn = d[gn]
                if has_bias:
                    for i in range(TR2):
                        k = ty * TR2 + i
                        for j in range(TC):
                            bv[i * TC + j] = bias[(gn * K + k) * v_dim + v0 + j] \
                                if k < K and v0 + j < v_dim else float32(0.0)
                # X = A + P S: rows ty + RT i of C, this thread's columns
                for i in range(TR1):
                    r = ty + RT * i
                    for j in range(TC):
                        a1[i * TC + j] = A[(gn * C + r) * v_dim + v0 + j] \
                            if r < C and v0 + j < v_dim else float32(0.0)
                        x1[i * TC + j] = float32(0.0)
                for k4 in range(K4 // 4):
                    for i in range(TR1):
                        p = ptx.vld4(sh, P_OFF + (ty + RT * i) * KS + 4 * k4)
                        for u in range(4):
                            pv[4 * i + u] = p[u]
                    for u in range(4):
                        for j4 in range(TC // 4):
                            s = ptx.vld4(sh, S_OFF + (4 * k4 + u) * VSP + c0 + 4 * j4)
                            for w in range(4):
                                sv[4 * j4 + w] = s[w]
                        for i in range(TR1):
                            for j in range(TC):
                                x1[i * TC + j] += pv[4 * i + u] * sv[j]
                for i in range(TR1):
                    r = ty + RT * i
                    if r < C:
                        for j in range(TC):
                            x1[i * TC + j] += a1[i * TC + j]
                            if v0 + j < v_dim:
                                xo[(gn * C + r) * v_dim + v0 + j] = x1[i * TC + j]
                        for j4 in range(TC // 4):
                            ptx.vst4(sh, X_OFF + r * VSP + c0 + 4 * j4, x1[i * TC + 4 * j4],
                                     x1[i * TC + 4 * j4 + 1], x1[i * TC + 4 * j4 + 2],
                                     x1[i * TC + 4 * j4 + 3])
                if shared_pq:
                    cuda.syncthreads()            # P read: Q takes its buffer
                    stage(sh, Q_OFF, Q, gn * CK, t)
                if vec:
                    tc.cp_async_wait_all()        # this chunk's Q
                cuda.syncthreads()                # P and S read, X and Q in place
                if step + 1 < chunks and not shared_pq:
                    stage(sh, P_OFF, P, (gn + (-1 if reverse else 1)) * CK, t)
                # S = d S + Q^T X (+ bias); columns past V stay 0 (X is 0 there)
                for i in range(NSR):
                    sr[i] = dn * sr[i] + bv[i] if has_bias else dn * sr[i]
                for cb in range(C // UC):         # UC rows of Q and X a trip: their loads
                    for h in range(UC):           # are in flight together
                        c = cb * UC + h
                        for i4 in range(TR2 // 4):
                            q = ptx.vld4(sh, Q_OFF + c * KS + ty * TR2 + 4 * i4)
                            for w in range(4):
                                qv[h * TR2 + 4 * i4 + w] = q[w]
                        for j4 in range(TC // 4):
                            s = ptx.vld4(sh, X_OFF + c * VSP + c0 + 4 * j4)
                            for w in range(4):
                                sv[h * TC + 4 * j4 + w] = s[w]
                    for h in range(UC):
                        for i in range(TR2):
                            for j in range(TC):
                                sr[i * TC + j] += qv[h * TR2 + i] * sv[h * TC + j]
                for i in range(TR2):              # (S was last read before the barrier)
                    for j4 in range(TC // 4):
                        ptx.vst4(sh, S_OFF + (ty * TR2 + i) * VSP + c0 + 4 * j4,
                                 sr[i * TC + 4 * j4], sr[i * TC + 4 * j4 + 1],
                                 sr[i * TC + 4 * j4 + 2], sr[i * TC + 4 * j4 + 3])
                if shared_pq:
                    cuda.syncthreads()            # Q read: the next P takes its buffer
                    if step + 1 < chunks:
                        stage(sh, P_OFF, P, (gn + (-1 if reverse else 1)) * CK, t)
                if vec:
                    tc.cp_async_wait_all()        # the next chunk's P
                cuda.syncthreads()                # Q and X read, S and P in place
                if step + 1 < chunks and not shared_pq:
                    stage(sh, Q_OFF, Q, (gn + (-1 if reverse else 1)) * CK, t)
            for i in range(TR2):
                k = ty * TR2 + i
                for j in range(TC):
                    if k < K and v0 + j < v_dim:
                        final[(gi * K + k) * v_dim + v0 + j] = sr[i * TC + j]
            blk += cuda.gridDim.x

    return kernel


# ---- the chunk's triangular system ----------------------------------------------------------
RB = 16                   # rows of T a thread holds in registers at a time


def inverse_size(c: int) -> int:
    """The padded size of a [c, c] system: 16, 32 or 64 (A zero-padded: T's corner is exact)."""
    return max(RB, 1 << max(0, c - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _triangle(cp: int):
    """tri(a_sh, o, acc): acc[r] += sum_{l < r} A[r, l] acc[l] in row order over a diagonal
    RB x RB block of A at a_sh[o:] (rows cp apart), A read 4 columns at a time. Written out
    as straight-line code: NVVM does not unroll the triangle's loops, and acc[] indexed by a
    loop variable would live in local memory."""
    lines = ["def tri(a_sh, o, acc):"]
    for r in range(1, RB):
        for q in range(-(-r // 4)):
            lines.append(f"    p = vld4(a_sh, o + {r * cp + 4 * q})")
            lines += [f"    acc[{r}] += p[{u}] * acc[{4 * q + u}]"
                      for u in range(min(4, r - 4 * q))]
    ns = {"vld4": ptx.vld4}
    exec("\n".join(lines), ns)         # noqa: S102 - the source is built just above
    return inline(ns["tri"])


@functools.lru_cache(maxsize=None)
def unit_lower_inverse_kernel(c: int, scaled: bool, write_t: bool):
    """kernel(out, out2, tout, a, s1, s2, count): T = (I - A[m])^-1 for each of ``count``
    [C, C] matrices, reading only A's strictly lower triangle, into out[m]; ``scaled``: the
    column-scaled T diag(s1[m]) into out[m] and T diag(s2[m]) into out2[m] (s1, s2 [count,
    C]), and T itself into tout[m] when ``write_t`` (out2, tout, s1 and s2 are not touched
    otherwise). A block a matrix (grid-stride), CP threads (CP = inverse_size(C), A
    zero-padded to CP).

    T = I + A T, so thread j solves column j by forward substitution,
    T[i, j] = [i == j] + sum_{l < i} A[i, l] T[l, j], 16 rows at a time in registers: first
    the rows above the block (T's rows already solved, from shared memory: 4 at a time, with
    16-byte loads of A's rows), then within the block (unrolled: acc[r] += A[r, l] acc[l]).
    A's reads are the same address across a warp (broadcasts), T's column is the thread's own
    (no barrier between row blocks). T[l, j] = 0 for l < j, so a warp starts at its first
    column's row block, and its sums at that row: the rows above stay zero.

    Two barriers a matrix (A in place; A read before the next matrix overwrites it)."""
    C = c
    CP = inverse_size(C)
    NR = CP // RB
    NA = CP * CP
    NTS = max(1, (CP - RB) * CP)   # T's rows that later row blocks read (not the last block's)
    tri = _triangle(CP)

    @jit(launch_bounds=(CP,))
    def kernel(out, out2, tout, a, s1, s2, count):
        a_sh = cuda.shared.array(NA, float32, alignment=ALIGN)
        t_sh = cuda.shared.array(NTS, float32)
        acc = cuda.local.array(RB, float32)       # rows 16 R + r of column j
        stg = cuda.local.array(RB, float32)
        tv = cuda.local.array(4, float32)
        j = cuda.threadIdx.x
        wf = j - j % 32                           # the warp's first column
        m = cuda.blockIdx.x
        while m < count:
            base = m * (C * C)
            sc1 = s1[m * C + j] if scaled and j < C else float32(1.0)   # column j's scales
            sc2 = s2[m * C + j] if scaled and j < C else float32(1.0)
            # A's row i, column j (a warp's loads coalesced), RB rows' loads in flight at once;
            # the diagonal, the upper triangle and the padding stored as zeros (16-byte loads of
            # a row read past its diagonal)
            for r0 in range(NR):
                for r in range(RB):
                    i = r0 * RB + r
                    stg[r] = a[base + i * C + j] if j < i and i < C else float32(0.0)
                for r in range(RB):
                    a_sh[(r0 * RB + r) * CP + j] = stg[r]
            cuda.syncthreads()
            for rb in range(NR):
                i0 = rb * RB
                if i0 + RB > wf:                  # (rows of the block above column wf: zeros)
                    for r in range(RB):
                        acc[r] = float32(1.0) if i0 + r == j else float32(0.0)
                    for l4 in range(wf // 4, i0 // 4):      # solved rows above the block
                        for u in range(4):
                            tv[u] = t_sh[(4 * l4 + u) * CP + j]
                        for r in range(RB):
                            p = ptx.vld4(a_sh, (i0 + r) * CP + 4 * l4)
                            for u in range(4):
                                acc[r] += p[u] * tv[u]
                    tri(a_sh, (i0 * CP + i0), acc)        # within the block
                else:
                    for r in range(RB):
                        acc[r] = float32(0.0)
                for r in range(RB):
                    if rb + 1 < NR:
                        t_sh[(i0 + r) * CP + j] = acc[r]
                    if i0 + r < C and j < C:
                        e = base + (i0 + r) * C + j
                        if scaled:
                            out[e] = acc[r] * sc1
                            out2[e] = acc[r] * sc2
                            if write_t:
                                tout[e] = acc[r]
                        else:
                            out[e] = acc[r]
            cuda.syncthreads()                    # A read before the next matrix overwrites it
            m += cuda.gridDim.x

    return kernel
