"""The sequential pass of the chunked gated delta rule (ir/ops_delta.py's "delta_state_scan"):
per head g, through its N chunks in order (or reversed), with the state S [K, V]:

    states[g, n] = S                      (the state entering chunk n)
    X[g, n]      = A[g, n] + P[g, n] S    ([C, K] @ [K, V])
    S            = d[g, n] S + Q[g, n]^T X[g, n] (+ Bias[g, n])

and final[g] = S after the last chunk. One launch for all chunks: a block per (head, slice
of VS columns of V) keeps its [K, VS] slice of S in registers (a thread holds a TR x TC tile,
rows ty + RT i, columns tx + CT j) and in shared memory (where the product P S reads it),
stages P[g, n] and then Q[g, n] in shared memory (rows padded to K + 1 floats: the RT rows a
warp reads at once fall in distinct banks), and X's [C, VS] slice beside them. The columns a
block owns never mix with others' (both products keep V's columns apart), so blocks run
independently: no atomics, no grid barrier."""
import functools
from dataclasses import dataclass

from numba import cuda, float32

from ..ir.ops_delta import SCAN_MAX_COLUMNS, SCAN_MAX_ROWS, SCAN_SHARED_FLOATS
from .launch import jit, register_geometry


@dataclass(frozen=True)
class StateScanGeometry:
    rt: int      # thread rows
    ct: int      # thread columns (rt * ct threads a block)
    vs: int      # columns of V a block owns (a multiple of ct)

    def __post_init__(self):
        if self.vs % self.ct or not (1 <= self.rt <= SCAN_MAX_ROWS
                                     and 1 <= self.vs <= SCAN_MAX_COLUMNS):
            raise ValueError(f"delta_state_scan geometry: vs must be a multiple of ct, rt and "
                             f"vs at most {SCAN_MAX_ROWS} / {SCAN_MAX_COLUMNS} (what "
                             f"ir/ops_delta.py sizes chunks for), got {self}")


# GPU: 128 threads, 16 columns of V a block (K = 128, C = 64: 45 KB of shared memory, 8 x 2
# and 4 x 2 register tiles); the simulator: 4 threads (each CUDA thread is a Python thread)
register_geometry("delta_state_scan", StateScanGeometry(16, 8, 16), StateScanGeometry(2, 2, 4))


def columns(geo: StateScanGeometry, v: int) -> int:
    """The columns of V a block owns for V = v: geo.vs, or v rounded up to geo.ct if less."""
    return min(geo.vs, -(-v // geo.ct) * geo.ct)


def shared_floats(k: int, c: int, vs: int, geo: StateScanGeometry) -> int:
    return k * vs + c * vs + _pq_floats(k, c, geo)


def _pq_floats(k, c, geo):
    # P / Q staged with rows of K + 1; rows up to the thread tiles' last row are read (and
    # never used) past C rows and K columns, so the array runs that far
    rows = max(c, -(-c // geo.rt) * geo.rt)
    return rows * (k + 1) + -(-k // geo.rt) * geo.rt


@functools.lru_cache(maxsize=None)
def state_scan_kernel(k_dim: int, chunk: int, vs: int, geo: StateScanGeometry, reverse: bool,
                      has_bias: bool):
    """kernel(states, xo, final, P, Q, A, d, s0, bias, heads, chunks, v_dim): flat f32 arrays
    states [G, N, K, V], xo [G, N, C, V], final [G, K, V], P / Q [G, N, C, K], A [G, N, C, V],
    d [G, N], s0 [G, K, V], bias [G, N, K, V] (read only when ``has_bias``); launch with
    rt * ct threads a block, blocks over G * ceil(V / vs) (a grid-stride loop)."""
    K, C, VS, RT, CT = k_dim, chunk, vs, geo.rt, geo.ct
    NT, TC = RT * CT, VS // CT
    TR1, TR2 = -(-C // RT), -(-K // RT)   # row tiles of X (C rows) and of S (K rows)
    KS = K + 1
    NS, NX, NPQ = K * VS, C * VS, _pq_floats(K, C, geo)
    if NS + NX + NPQ > SCAN_SHARED_FLOATS:
        raise ValueError(f"delta_state_scan: K={K}, chunk {C}, {VS} columns need "
                         f"{4 * (NS + NX + NPQ)} bytes of shared memory, over "
                         f"{4 * SCAN_SHARED_FLOATS}")
    NSR, NX1 = TR2 * TC, TR1 * TC
    # P / Q staging: a thread's NPER elements in groups of U loads issued before any store
    # (a load then its store, element by element, would wait out a memory latency each)
    NPER = -(-(C * K) // NT)
    U = min(16, NPER)
    NG = -(-NPER // U)

    @jit
    def kernel(states, xo, final, P, Q, A, d, s0, bias, heads, chunks, v_dim):
        s_sh = cuda.shared.array(NS, float32)
        x_sh = cuda.shared.array(NX, float32)
        pq = cuda.shared.array(NPQ, float32)
        sr = cuda.local.array(NSR, float32)       # this thread's tile of S
        acc = cuda.local.array(NSR, float32)
        x1 = cuda.local.array(NX1, float32)
        sv = cuda.local.array(TC, float32)
        stg = cuda.local.array(U, float32)
        t = cuda.threadIdx.x
        ty, tx = t // CT, t % CT
        nvs = (v_dim + VS - 1) // VS
        blk = cuda.blockIdx.x
        while blk < heads * nvs:
            gi = blk // nvs
            v0 = (blk % nvs) * VS
            for i in range(TR2):
                k = ty + RT * i
                for j in range(TC):
                    col = v0 + tx + CT * j
                    val = float32(0.0)
                    if k < K and col < v_dim:
                        val = s0[(gi * K + k) * v_dim + col]
                    sr[i * TC + j] = val
                    if k < K:
                        s_sh[k * VS + tx + CT * j] = val
            cuda.syncthreads()
            for step in range(chunks):
                n = chunks - 1 - step if reverse else step
                gn = gi * chunks + n
                for i in range(TR2):
                    k = ty + RT * i
                    for j in range(TC):
                        col = v0 + tx + CT * j
                        if k < K and col < v_dim:
                            states[(gn * K + k) * v_dim + col] = sr[i * TC + j]
                base = gn * (C * K)
                for grp in range(NG):
                    for u in range(U):
                        e = (grp * U + u) * NT + t
                        stg[u] = P[base + e] if e < C * K else float32(0.0)
                    for u in range(U):
                        e = (grp * U + u) * NT + t
                        if e < C * K:
                            pq[(e // K) * KS + e % K] = stg[u]
                cuda.syncthreads()
                # X = A + P S: rows ty + RT i of C, this thread's columns
                for i in range(TR1):
                    r = ty + RT * i
                    for j in range(TC):
                        col = v0 + tx + CT * j
                        x1[i * TC + j] = A[(gn * C + r) * v_dim + col] \
                            if r < C and col < v_dim else float32(0.0)
                for kk in range(K):
                    for j in range(TC):
                        sv[j] = s_sh[kk * VS + tx + CT * j]
                    for i in range(TR1):
                        pv = pq[(ty + RT * i) * KS + kk]
                        for j in range(TC):
                            x1[i * TC + j] += pv * sv[j]
                for i in range(TR1):
                    r = ty + RT * i
                    if r < C:
                        for j in range(TC):
                            x_sh[r * VS + tx + CT * j] = x1[i * TC + j]
                            col = v0 + tx + CT * j
                            if col < v_dim:
                                xo[(gn * C + r) * v_dim + col] = x1[i * TC + j]
                cuda.syncthreads()                # P and X's slice read / written
                for grp in range(NG):
                    for u in range(U):
                        e = (grp * U + u) * NT + t
                        stg[u] = Q[base + e] if e < C * K else float32(0.0)
                    for u in range(U):
                        e = (grp * U + u) * NT + t
                        if e < C * K:
                            pq[(e // K) * KS + e % K] = stg[u]
                cuda.syncthreads()
                # S = d S + Q^T X (+ bias)
                dn = d[gn]
                for i in range(TR2):
                    k = ty + RT * i
                    for j in range(TC):
                        col = v0 + tx + CT * j
                        b = float32(0.0)
                        if has_bias and k < K and col < v_dim:
                            b = bias[(gn * K + k) * v_dim + col]
                        acc[i * TC + j] = dn * sr[i * TC + j] + b
                for c in range(C):
                    for j in range(TC):
                        sv[j] = x_sh[c * VS + tx + CT * j]
                    for i in range(TR2):
                        qv = pq[c * KS + ty + RT * i]
                        for j in range(TC):
                            acc[i * TC + j] += qv * sv[j]
                cuda.syncthreads()                # every read of S, X and Q done
                for i in range(TR2):
                    k = ty + RT * i
                    for j in range(TC):
                        col = v0 + tx + CT * j
                        # columns past V stay 0 (their P S terms must add nothing)
                        val = acc[i * TC + j] if col < v_dim else float32(0.0)
                        sr[i * TC + j] = val
                        if k < K:
                            s_sh[k * VS + tx + CT * j] = val
                cuda.syncthreads()
            for i in range(TR2):
                k = ty + RT * i
                for j in range(TC):
                    col = v0 + tx + CT * j
                    if k < K and col < v_dim:
                        final[(gi * K + k) * v_dim + col] = sr[i * TC + j]
            blk += cuda.gridDim.x

    return kernel


@functools.lru_cache(maxsize=None)
def unit_lower_inverse_kernel(c: int):
    """kernel(out, a, count): out[m] = (I - A[m])^-1 for each of ``count`` [C, C] matrices,
    reading only A's strictly lower triangle. A block a matrix (grid-stride), C threads:
    thread j runs column j's forward substitution T[i, j] = sum_{j <= l < i} A[i, l] T[l, j]
    (T[j, j] = 1), A and T in shared memory (T's rows are contiguous over j: the lanes hit
    distinct banks; A[i, l] is one broadcast)."""
    C = c
    CC = C * C                    # a constant for shared.array (C * C in the kernel is a value)
    U = min(16, C)                # rows loaded a group (all loads issued before the stores)
    NG = -(-C // U)

    @jit
    def kernel(out, a, count):
        a_sh = cuda.shared.array(CC, float32)
        t_sh = cuda.shared.array(CC, float32)
        stg = cuda.local.array(U, float32)
        j = cuda.threadIdx.x
        m = cuda.blockIdx.x
        while m < count:
            base = m * (C * C)
            for grp in range(NG):
                for u in range(U):
                    r = grp * U + u
                    stg[u] = a[base + r * C + j] if r < C else float32(0.0)
                for u in range(U):
                    r = grp * U + u
                    if r < C:
                        a_sh[r * C + j] = stg[u]
                        t_sh[r * C + j] = float32(1.0) if r == j else float32(0.0)
            cuda.syncthreads()
            for i in range(j + 1, C):
                acc = float32(0.0)
                for l in range(j, i):
                    acc += a_sh[i * C + l] * t_sh[l * C + j]
                t_sh[i * C + j] = acc
            cuda.syncthreads()
            for r in range(C):
                out[base + r * C + j] = t_sh[r * C + j]
            cuda.syncthreads()            # before the next matrix overwrites A and T
            m += cuda.gridDim.x

    return kernel
