"""Counter-based randomness: Philox4x32-10 (Salmon et al., SC'11; Random123), the dropout and
random-tensor kernels built on it, and their NumPy twins (the tests' oracle).

A counter-based generator is a pure function of (counter, key), so a GPU and the simulator
produce the same bits, any thread can draw any element without state, and a backward pass
can redraw the forward's dropout mask instead of storing it.

The stream of ``dropout`` and ``random`` (one definition, used by both the kernels and the
twins): element i of a tensor (row-major) is word ``i % 4`` of
``philox4x32_10(counter=(j & 0xFFFFFFFF, j >> 32, stream, DOMAIN), key=(seed & 0xFFFFFFFF,
seed >> 32))`` with ``j = i // 4``; ``stream`` tells apart the random ops of one graph (the
order they were built in) and DOMAIN keeps them off ``sample``'s per-row draws (counter
(row, 0, 0, 0)). A 32-bit word w becomes the uniform ``(w >> 8) * 2^-24`` in [0, 1) (exact
in f32). Normals are Box-Muller over the words' pairs (0, 1) and (2, 3): u1 =
((w0 >> 8) + 1) * 2^-24 in (0, 1], u2 = (w1 >> 8) * 2^-24, element 0 gets
sqrt(-2 ln u1) cos(2 pi u2) and element 1 sqrt(-2 ln u1) sin(2 pi u2).
"""
import functools
import math

import numpy as np
from numba import cuda, float32, int64, uint64

from ..device import SIMULATOR
from . import halfio
from . import mathfn as m
from .launch import jit, py_in_sim

if SIMULATOR:   # numba's types as converters cost ~2 us a call in the simulator
    float32, int64, uint64 = np.float32, np.int64, np.uint64

DOMAIN = 0x524C5801       # counter word 3 of dropout / random ("RLX", 1)
UNIFORM, NORMAL = 0, 1

_UNIFORM = uint64(UNIFORM)
_U32 = uint64(0xFFFFFFFF)
_S32 = uint64(32)
_S8 = uint64(8)
_DOMAIN = uint64(DOMAIN)
_PM0 = uint64(0xD2511F53)
_PM1 = uint64(0xCD9E8D57)
_PW0 = uint64(0x9E3779B9)
_PW1 = uint64(0xBB67AE85)
_INV24 = float32(2.0 ** -24)
_ZERO = float32(0.0)
_TWO_PI = float32(2 * math.pi)
_M2 = float32(-2.0)




# ---- Philox4x32-10 ---------------------------------------------------------------------------
@py_in_sim
def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Random123's philox4x32_10: four 32-bit counter words, two key words (each held in a
    uint64) -> four 32-bit output words."""
    for _ in range(10):
        p0 = _PM0 * c0
        p1 = _PM1 * c2
        n0 = (p1 >> _S32) ^ c1 ^ k0
        n1 = p1 & _U32
        n2 = (p0 >> _S32) ^ c3 ^ k1
        n3 = p0 & _U32
        c0 = n0
        c1 = n1
        c2 = n2
        c3 = n3
        k0 = (k0 + _PW0) & _U32
        k1 = (k1 + _PW1) & _U32
    return c0, c1, c2, c3


@jit
def philox_kernel(out, ctr, key, n):
    """out[i, :] = philox4x32_10(ctr[i, :], key[i, :]) (all uint64 arrays of 32-bit words);
    for tests and for checking a GPU against the known answers."""
    i = uint64(cuda.grid(1))
    while i < n:
        a, b, c, d = philox4x32_10(ctr[i, 0], ctr[i, 1], ctr[i, 2], ctr[i, 3], key[i, 0], key[i, 1])
        out[i, 0] = a
        out[i, 1] = b
        out[i, 2] = c
        out[i, 3] = d
        i += uint64(cuda.gridsize(1))


@py_in_sim
def _block(j, stream, seed):
    """The four words of block j of ``stream``; ``seed`` an int64 array, seed[0] the seed."""
    s = seed[0]
    k0 = uint64(s & int64(0xFFFFFFFF))
    k1 = uint64((s >> int64(32)) & int64(0xFFFFFFFF))
    return philox4x32_10(j & _U32, j >> _S32, stream, _DOMAIN, k0, k1)


@py_in_sim
def _unit(w):
    return float32(w >> _S8) * _INV24


@functools.lru_cache(maxsize=None)
def dropout_kernel(kind: str = "f32"):
    """The kernel out[i] = x[i] * scale where the element's uniform is >= p, else 0 (a thread
    per block of four elements: one Philox call); out and x are ``kind`` arrays
    (kernels/halfio.py: a half x is widened, scaled in f32 and rounded once)."""
    ld = halfio.load(kind)
    st = halfio.store(kind)

    @py_in_sim
    def drop_one(out, x, i, n, w, p, scale):
        if i < n:
            st(out, i, ld(x, i) * scale if _unit(w) >= p else _ZERO)

    @jit
    def kernel(out, x, seed, stream, n, p, scale):
        j = uint64(cuda.grid(1))
        nb = (n + uint64(3)) >> uint64(2)
        while j < nb:
            w0, w1, w2, w3 = _block(j, stream, seed)
            i = j << uint64(2)
            drop_one(out, x, i, n, w0, p, scale)
            drop_one(out, x, i + uint64(1), n, w1, p, scale)
            drop_one(out, x, i + uint64(2), n, w2, p, scale)
            drop_one(out, x, i + uint64(3), n, w3, p, scale)
            j += uint64(cuda.gridsize(1))
    return kernel


@py_in_sim
def _normal_pair(out, i, n, wa, wb):
    r = m.sqrt(_M2 * m.log(float32((wa >> _S8) + uint64(1)) * _INV24))
    t = _TWO_PI * _unit(wb)
    if i < n:
        out[i] = r * m.cos(t)
    if i + uint64(1) < n:
        out[i + uint64(1)] = r * m.sin(t)


@jit
def random_kernel(out, seed, stream, n, dist):
    """out[i]: the stream's uniform (dist UNIFORM) or normal (NORMAL) draw of element i."""
    j = uint64(cuda.grid(1))
    nb = (n + uint64(3)) >> uint64(2)
    while j < nb:
        w0, w1, w2, w3 = _block(j, stream, seed)
        i = j << uint64(2)
        if dist == _UNIFORM:
            if i < n:
                out[i] = _unit(w0)
            if i + uint64(1) < n:
                out[i + uint64(1)] = _unit(w1)
            if i + uint64(2) < n:
                out[i + uint64(2)] = _unit(w2)
            if i + uint64(3) < n:
                out[i + uint64(3)] = _unit(w3)
        else:
            _normal_pair(out, i, n, w0, w1)
            _normal_pair(out, i + uint64(2), n, w2, w3)
        j += uint64(cuda.gridsize(1))


# ---- NumPy twins (the tests' oracle; also handy on the host) ---------------------------------
def philox_np(c0, c1, c2, c3, k0, k1):
    """philox4x32_10 over uint64 arrays of 32-bit words (broadcast), NumPy."""
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(*(np.asarray(v, np.uint64) for v in
                                                   (c0, c1, c2, c3, k0, k1)))
    c0, c1, c2, c3, k0, k1 = (v.copy() for v in (c0, c1, c2, c3, k0, k1))
    m32 = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & m32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & m32)
        k0 = (k0 + np.uint64(0x9E3779B9)) & m32
        k1 = (k1 + np.uint64(0xBB67AE85)) & m32
    return c0, c1, c2, c3


def words_np(n: int, seed: int, stream: int) -> np.ndarray:
    """The stream's first n 32-bit words (uint64), element order."""
    seed %= 2**64
    j = np.arange(-(-n // 4), dtype=np.uint64)
    w = philox_np(j & np.uint64(0xFFFFFFFF), j >> np.uint64(32), stream, DOMAIN,
                  seed & 0xFFFFFFFF, seed >> 32)
    return np.stack(w, axis=1).reshape(-1)[:n]


def uniform_np(n: int, seed: int, stream: int) -> np.ndarray:
    """The stream's uniforms in [0, 1), f32, exactly as the kernels draw them."""
    return (words_np(n, seed, stream) >> np.uint64(8)).astype(np.float32) * np.float32(2.0 ** -24)


def normal_np(n: int, seed: int, stream: int) -> np.ndarray:
    """The stream's normals (float64 math: the kernels' f32 differ in the last bits)."""
    w = words_np(-(-n // 2) * 2, seed, stream).reshape(-1, 2)
    u1 = ((w[:, 0] >> np.uint64(8)) + np.uint64(1)).astype(np.float64) * 2.0 ** -24
    u2 = (w[:, 1] >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
    r = np.sqrt(-2 * np.log(u1))
    return np.stack([r * np.cos(2 * np.pi * u2), r * np.sin(2 * np.pi * u2)], 1).reshape(-1)[:n]
