"""The selective scan (Mamba's S6; ir/ops_scan.py), chunked over the sequence.

For each batch b and channel d, with N states x[n] (registers: a thread holds all N of one
(b, d)):
    x_l = exp(delta_l A[d, n]) x_{l-1} + delta_l B[b, n, l] u_l,    y_l = sum_n C[b, n, l] x_l
u, delta, y [B, D, L]; A [D, N]; B, C [B, N, L]. The sequence is cut into chunks of T steps
so that B * D * chunks threads run at once, never holding [B, D, N, L]:
  1. scan_kernel(FIRST): each chunk scans from a zero state; writes its end state and the sum
     of its deltas (the chunk's decay is exp(A * that sum), the product of its steps' decays);
  2. carry_kernel: per (b, d, n), walks the chunks in order: a chunk's start state is
     decay * the previous start + the previous chunk's zero-start end state; writes the start
     states over the end states, and the last state;
  3. scan_kernel(FINAL): each chunk scans again from its start state, writing y.
A thread's index is ((b * chunks + c) * D + d): a warp shares (b, c), so its B and C loads
are one broadcast each. The backward (scan_grad_kernel) runs a thread per (b, d) through the
chunks in reverse: it rescans a chunk from its start state (from the forward's scratch) into
a local history, then walks it backwards with the adjoint state g:
    gx = g + C_l dy_l,   g <- gx exp(delta_l A)   (the adjoint handed to x_{l-1})
    du_l = sum_n gx delta_l B,  ddelta_l = sum_n gx (x_{l-1} A a + B u),  dA += gx x_{l-1} a delta_l
and dB, dC (sums over d) and dA (over b) by atomics into zeroed memory.
"""
import functools
import math

from numba import cuda, float32, uint64

from ..device import SIMULATOR
from .launch import jit

CHUNK = 4 if SIMULATOR else 32       # steps a chunk (the simulator: several chunks in tests)
FIRST, FINAL = 0, 1


@functools.lru_cache(maxsize=None)
def scan_kernel(n_state: int, mode: int):
    """kernel(y, states, dsum, u, delta, A, B, C, batch, dim, length, chunks): mode FIRST
    writes states[b, d, c, :] (the chunk's end state from zero) and dsum[b, d, c]; FINAL
    reads states as start states and writes y."""
    N = n_state

    @jit
    def kernel(y, states, dsum, u, delta, A, B, C, batch, dim, length, chunks):
        x = cuda.local.array(N, float32)
        a = cuda.local.array(N, float32)
        t = uint64(cuda.grid(1))
        total = batch * chunks * dim
        while t < total:
            d, r = t % dim, t // dim
            c, b = r % chunks, r // chunks
            bd = b * dim + d
            st = (bd * chunks + c) * uint64(N)
            for n in range(N):
                a[n] = A[d * uint64(N) + uint64(n)]
                x[n] = float32(0.0) if mode == FIRST or c == 0 else states[st + uint64(n)]
            s = float32(0.0)
            l0 = c * uint64(CHUNK)
            l1 = min(l0 + uint64(CHUNK), length)
            l = l0
            while l < l1:
                dl = delta[bd * length + l]
                du = dl * u[bd * length + l]
                s += dl
                acc = float32(0.0)
                for n in range(N):
                    bn = (b * uint64(N) + uint64(n)) * length + l
                    x[n] = math.exp(dl * a[n]) * x[n] + du * B[bn]
                    if mode == FINAL:
                        acc += x[n] * C[bn]
                if mode == FINAL:
                    y[bd * length + l] = acc
                l += uint64(1)
            if mode == FIRST:
                for n in range(N):
                    states[st + uint64(n)] = x[n]
                dsum[bd * chunks + c] = s
            t += uint64(cuda.gridsize(1))

    return kernel


@functools.lru_cache(maxsize=None)
def carry_kernel(n_state: int):
    """kernel(last, states, dsum, A, batch, dim, chunks): a thread per (b, d, n) walks the
    chunks: their start states over their zero-start end states, and last[b, d, n] the
    state after the last chunk."""
    N = uint64(n_state)

    @jit
    def kernel(last, states, dsum, A, batch, dim, chunks):
        t = uint64(cuda.grid(1))
        while t < batch * dim * N:
            n, bd = t % N, t // N
            a = A[(bd % dim) * N + n]
            x = float32(0.0)
            c = uint64(0)
            while c < chunks:
                i = (bd * chunks + c) * N + n
                end = states[i]
                states[i] = x
                x = math.exp(a * dsum[bd * chunks + c]) * x + end
                c += uint64(1)
            last[t] = x
            t += uint64(cuda.gridsize(1))

    return kernel


@functools.lru_cache(maxsize=None)
def scan_grad_kernel(n_state: int):
    """kernel(dA, dB, dC, du, ddelta, states, u, delta, A, B, C, dy, dlast, batch, dim, length,
    chunks): the scan's VJP (dy of y, dlast of the last state); dA, dB, dC must be zero
    (atomics add into them); states: the chunks' start states (steps 1-2 of the forward)."""
    N = n_state
    HIST = CHUNK * N                  # a chunk's states, rescanned (a compile-time size)

    @jit
    def kernel(dA, dB, dC, du, ddelta, states, u, delta, A, B, C, dy, dlast, batch, dim, length,
               chunks):
        g = cuda.local.array(N, float32)
        x0 = cuda.local.array(N, float32)
        a = cuda.local.array(N, float32)
        da = cuda.local.array(N, float32)
        hist = cuda.local.array(HIST, float32)
        t = uint64(cuda.grid(1))
        while t < batch * dim:
            d, b = t % dim, t // dim
            for n in range(N):
                g[n] = dlast[t * uint64(N) + uint64(n)]
                da[n] = float32(0.0)
                a[n] = A[d * uint64(N) + uint64(n)]
            c = chunks
            while c > uint64(0):
                c -= uint64(1)
                st = (t * chunks + c) * uint64(N)
                for n in range(N):
                    x0[n] = float32(0.0) if c == uint64(0) else states[st + uint64(n)]
                l0 = c * uint64(CHUNK)
                steps = min(l0 + uint64(CHUNK), length) - l0
                j = uint64(0)
                while j < steps:                    # rescan the chunk into hist
                    l = l0 + j
                    dl = delta[t * length + l]
                    dul = dl * u[t * length + l]
                    for n in range(N):
                        prev = x0[n] if j == uint64(0) else hist[(j - uint64(1)) * uint64(N)
                                                                 + uint64(n)]
                        hist[j * uint64(N) + uint64(n)] = (
                            math.exp(dl * a[n]) * prev
                            + dul * B[(b * uint64(N) + uint64(n)) * length + l])
                    j += uint64(1)
                while j > uint64(0):                # and walk it backwards
                    j -= uint64(1)
                    l = l0 + j
                    dl = delta[t * length + l]
                    ul = u[t * length + l]
                    dyl = dy[t * length + l]
                    acc_u = float32(0.0)
                    acc_d = float32(0.0)
                    for n in range(N):
                        bn = (b * uint64(N) + uint64(n)) * length + l
                        prev = x0[n] if j == uint64(0) else hist[(j - uint64(1)) * uint64(N)
                                                                 + uint64(n)]
                        cuda.atomic.add(dC, bn, dyl * hist[j * uint64(N) + uint64(n)])
                        gx = g[n] + C[bn] * dyl
                        e = math.exp(dl * a[n])
                        bv = B[bn]
                        cuda.atomic.add(dB, bn, gx * dl * ul)
                        acc_u += gx * dl * bv
                        acc_d += gx * (prev * a[n] * e + bv * ul)
                        da[n] += gx * prev * e * dl
                        g[n] = gx * e
                    du[t * length + l] = acc_u
                    ddelta[t * length + l] = acc_d
            for n in range(N):
                cuda.atomic.add(dA, d * uint64(N) + uint64(n), da[n])
            t += uint64(cuda.gridsize(1))

    return kernel
