"""Each inline-PTX / LLVM intrinsic of kernels/ptx.py against its Python twin (what the
simulator runs in its place), on random inputs: a small kernel calls the GPU body, the host
calls the twin on the same NumPy arrays, and both must agree bit for bit. On a GPU only
(under the simulator the kernels would call the twin itself), except the first test."""
import numpy as np
import pytest
from numba import cuda, float32, int64, uint32, uint64

import rlx_numba as rlx
from rlx_numba.kernels import ptx

ON_GPU = not rlx.simulator_enabled()
gpu = pytest.mark.skipif(not ON_GPU, reason="compares the GPU bodies with their twins")
P = ptx.INTRINSICS
N = 64                  # threads (one call each)


def test_kernels_call_the_body_of_this_device():
    for name, it in P.items():
        assert getattr(ptx, name) is it.fn is (it.gpu if ON_GPU else it.twin), name


if ON_GPU:   # (the kernels below compile the GPU bodies: numba intrinsics, GPU only)
    LD2, LD4, VLD4, LD4W = P["ld2"].gpu, P["ld4"].gpu, P["vld4"].gpu, P["ld4w"].gpu
    H2F, LDH, LDW = P["h2f"].gpu, P["ldh"].gpu, P["ldw"].gpu
    FLD4, FBITS, SPREAD4 = P["fld4"].gpu, P["fbits"].gpu, P["spread4"].gpu
    VST2, VST4, TICKET = P["vst2"].gpu, P["vst4"].gpu, P["ticket"].gpu
    VLD4W, F2H2, ST4W = P["vld4w"].gpu, P["f2h2"].gpu, P["st4w"].gpu

    @cuda.jit
    def k_loads(out2, out4, outv, a, b):
        t = cuda.grid(1)
        if t < N:
            x = LD2(a, uint64(2 * t))
            out2[t, 0], out2[t, 1] = x[0], x[1]
            y = LD4(b, uint64(4 * t))             # b is 2-D: the index is flat
            z = VLD4(a, uint64(4 * (t % 32)))
            for i in range(4):
                out4[t, i] = y[i]
                outv[t, i] = z[i]

    @cuda.jit
    def k_words(out4w, outh, outw, h):
        t = cuda.grid(1)
        if t < N:
            w = LD4W(h, uint64(8 * t))
            v = VLD4W(h, uint64(8 * (N - 1 - t)))
            for i in range(4):
                out4w[t, i] = w[i]
                out4w[t, 4 + i] = v[i]
            outh[t] = LDH(h, uint64(t))
            outw[t] = LDW(h, uint64(3 * t + 1))    # any index, odd too

    @cuda.jit
    def k_bits(out_h2f, out_fld4, out_fbits, out_spread, words, hws, prm, bias):
        t = cuda.grid(1)
        if t < N:
            w = words[t]
            a, b = H2F(w)
            out_h2f[t, 0], out_h2f[t, 1] = a, b
            f = FLD4(w, prm[0], prm[1], prm[2], prm[3], hws[t], prm[4], prm[5], prm[6], prm[7],
                     bias)
            for i in range(4):
                out_fld4[t, i] = f[i]
            out_fbits[t] = FBITS(w, uint32(t % 25), uint32(0xFF))
            out_spread[t] = SPREAD4(w, uint32(t % 29))

    @cuda.jit
    def k_stores(f2, f4, u4, x, u):
        t = cuda.grid(1)
        if t < N:
            VST2(f2, uint64(2 * t), x[t], -x[t])
            VST4(f4, uint64(4 * t), x[t], x[t] * float32(2), x[t] + float32(1), float32(t))
            VST4(u4, uint64(4 * t), u[t], u[t] ^ uint32(1), uint32(t), u[t] >> uint32(3))

    @cuda.jit
    def k_halves(packed, h16, b16, lo, hi, u):
        t = cuda.grid(1)
        if t < N:
            packed[t] = F2H2(lo[t], hi[t])
            ST4W(h16, uint64(8 * t), u[4 * t], u[4 * t + 1], u[4 * t + 2], u[4 * t + 3])
            ST4W(b16, uint64(8 * t), u[4 * t + 3], u[4 * t + 2], u[4 * t + 1], u[4 * t])

    @cuda.jit
    def k_ticket(got, counter):
        t = cuda.grid(1)
        if t < N:
            got[t] = TICKET(counter, int64(t % 3))


def _run(kernel, *arrays):
    dev = [cuda.to_device(a) for a in arrays]
    kernel[2, 32](*dev)
    cuda.synchronize()
    return [d.copy_to_host() for d in dev]


@gpu
def test_loads(rng):
    a = rng.standard_normal(2 * N).astype(np.float32)
    b = rng.standard_normal((N, 4)).astype(np.float32)
    out2, out4, outv, _, _ = _run(k_loads, np.zeros((N, 2), np.float32),
                                  np.zeros((N, 4), np.float32), np.zeros((N, 4), np.float32), a, b)
    for t in range(N):
        np.testing.assert_array_equal(out2[t], P["ld2"].twin(a, 2 * t))
        np.testing.assert_array_equal(out4[t], P["ld4"].twin(b, 4 * t))
        np.testing.assert_array_equal(outv[t], P["vld4"].twin(a, 4 * (t % 32)))


@gpu
def test_word_loads(rng):
    h = rng.integers(0, 1 << 16, 8 * N + 8, dtype=np.uint16)
    out4w, outh, outw, _ = _run(k_words, np.zeros((N, 8), np.uint32), np.zeros(N, np.uint32),
                                np.zeros(N, np.uint32), h)
    for t in range(N):
        np.testing.assert_array_equal(out4w[t, :4], P["ld4w"].twin(h, 8 * t))
        np.testing.assert_array_equal(out4w[t, 4:], P["vld4w"].twin(h, 8 * (N - 1 - t)))
        assert outh[t] == P["ldh"].twin(h, t)
        assert outw[t] == P["ldw"].twin(h, 3 * t + 1)


# fld4's parameters as the quantised kernels use them: (stride, sh, mask, xo, hstride, hsh,
# hmask, hpos) and the offset in the bias 2**23 + offset
FLD4_CASES = [((8, 0, 255, 128, 0, 0, 0, 0), 128), ((4, 16, 15, 0, 0, 0, 0, 0), 0),
              ((8, 2, 3, 0, 1, 4, 1, 2), 4), ((8, 4, 15, 0, 8, 1, 3, 4), 32)]


@gpu
@pytest.mark.parametrize("prm,off", FLD4_CASES)
def test_bit_fields(rng, prm, off):
    words = rng.integers(0, 1 << 32, N, dtype=np.uint32)
    hws = rng.integers(0, 1 << 32, N, dtype=np.uint32)
    bias = np.float32(8388608 + off)
    prm_a = np.array(prm, np.uint32)
    dev = [cuda.to_device(x) for x in (np.zeros((N, 2), np.float32), np.zeros((N, 4), np.float32),
                                       np.zeros(N, np.float32), np.zeros(N, np.uint32), words,
                                       hws, prm_a)]
    k_bits[2, 32](*dev, bias)
    h2f, fld4, fbits, spread = (d.copy_to_host() for d in dev[:4])
    for t in range(N):
        np.testing.assert_array_equal(h2f[t], P["h2f"].twin(words[t]))   # NaNs where both are
        np.testing.assert_array_equal(
            fld4[t], P["fld4"].twin(words[t], *prm[:4], hws[t], *prm[4:], bias))
        assert fbits[t] == P["fbits"].twin(words[t], np.uint32(t % 25), np.uint32(0xFF))
        assert spread[t] == P["spread4"].twin(words[t], np.uint32(t % 29))


@gpu
def test_stores(rng):
    x = rng.standard_normal(N).astype(np.float32)
    u = rng.integers(0, 1 << 32, N, dtype=np.uint32)
    f2, f4, u4, _, _ = _run(k_stores, np.zeros(2 * N, np.float32), np.zeros((N, 4), np.float32),
                            np.zeros(4 * N, np.uint32), x, u)
    w2, w4 = np.zeros(2 * N, np.float32), np.zeros((N, 4), np.float32)
    wu = np.zeros(4 * N, np.uint32)
    for t in range(N):
        P["vst2"].twin(w2, 2 * t, x[t], -x[t])
        P["vst4"].twin(w4, 4 * t, x[t], x[t] * np.float32(2), x[t] + np.float32(1), np.float32(t))
        P["vst4"].twin(wu, 4 * t, u[t], u[t] ^ np.uint32(1), np.uint32(t), u[t] >> np.uint32(3))
    np.testing.assert_array_equal(f2, w2)
    np.testing.assert_array_equal(f4, w4)
    np.testing.assert_array_equal(u4, wu)


# f32 -> f16 edge cases: ties to even (1 + 2^-11 -> 1, 1 + 3 * 2^-11 -> 1 + 2^-9), the
# largest finite, overflow to inf, the smallest subnormal and half of it (a tie -> 0), -0.0
HALF_EDGES = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65504.0, 65520.0, 1e6, -1e6,
                       2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25, -0.0, np.inf, -np.inf,
                       np.nan, -np.nan, 1.0 / 3, -2.0 / 3], np.float32)


@gpu
def test_half_packing(rng):
    """f2h2 (cvt.rn.f16x2.f32: its first source goes to the upper half) and st4w."""
    lo = rng.standard_normal(N).astype(np.float32) * 100
    hi = rng.standard_normal(N).astype(np.float32)
    lo[:16], hi[16:32] = HALF_EDGES, HALF_EDGES[::-1]
    u = rng.integers(0, 1 << 32, 4 * N, dtype=np.uint32)
    packed, h16, b16, *_ = _run(k_halves, np.zeros(N, np.uint32), np.zeros(8 * N, np.float16),
                                np.zeros(8 * N, np.uint16), lo, hi, u)
    want = np.array([P["f2h2"].twin(lo[t], hi[t]) for t in range(N)], np.uint32)
    got_h, want_h = packed.view(np.float16), want.view(np.float16)
    nan = np.isnan(want_h)
    np.testing.assert_array_equal(np.isnan(got_h), nan)      # (NaN payloads may differ)
    np.testing.assert_array_equal(got_h.view(np.uint16)[~nan], want_h.view(np.uint16)[~nan])
    wh, wb = np.zeros(8 * N, np.float16), np.zeros(8 * N, np.uint16)
    for t in range(N):
        P["st4w"].twin(wh, 8 * t, u[4 * t], u[4 * t + 1], u[4 * t + 2], u[4 * t + 3])
        P["st4w"].twin(wb, 8 * t, u[4 * t + 3], u[4 * t + 2], u[4 * t + 1], u[4 * t])
    np.testing.assert_array_equal(h16.view(np.uint16), wh.view(np.uint16))
    np.testing.assert_array_equal(b16, wb)


@gpu
def test_ticket():
    """Tickets race on a GPU, so not their order: each counter's tickets are 0, 1, ... once
    each, as the twin hands them out, and the counters end at the same values."""
    got, counter = _run(k_ticket, np.zeros(N, np.int32), np.full(3, 5, np.int32))
    want_counter = np.full(3, 5, np.int32)
    want = np.array([P["ticket"].twin(want_counter, t % 3) for t in range(N)], np.int32)
    np.testing.assert_array_equal(counter, want_counter)
    for slot in range(3):
        np.testing.assert_array_equal(np.sort(got[np.arange(N) % 3 == slot]),
                                      np.sort(want[np.arange(N) % 3 == slot]))


if ON_GPU:
    GRID_WAIT, GRID_DEPS = P["grid_wait"].gpu, P["grid_launch_dependents"].gpu

    @cuda.jit
    def k_slow_writer(out, ns):
        """Lets its dependent start at once, then sleeps ~ns before writing t + 1."""
        GRID_DEPS()
        t = cuda.grid(1)
        s = int64(0)
        while s < ns:
            cuda.nanosleep(uint32(1000))
            s += 1000
        if t < out.shape[0]:
            out[t] = float32(t + 1)

    @cuda.jit
    def k_dependent(y, w, src):
        """Reads its weight before the wait (no kernel writes it), src after."""
        t = cuda.grid(1)
        v = w[t] if t < y.shape[0] else float32(0)
        GRID_WAIT()
        if t < y.shape[0]:
            y[t] = 2 * src[t] + v


@gpu
def test_programmatic_dependent_launch():
    """A dependent launched with pdl (runtime/lower.fast_launch) sees every write of the slow
    kernel before it, though it starts while that kernel sleeps; the same without pdl."""
    from rlx_numba.runtime.lower import fast_launch, pdl_supported
    if not pdl_supported():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    n = 4099
    w = cuda.to_device(np.arange(n, dtype=np.float32) / 7)
    for pdl in (True, False):
        src, y = cuda.device_array(n, np.float32), cuda.device_array(n, np.float32)
        stream = cuda.stream()
        for _ in range(3):
            src.copy_to_device(np.zeros(n, np.float32), stream=stream)
            fast_launch(k_slow_writer, (-(-n // 128),), (128,), stream, (src, np.int64(200_000)))()
            fast_launch(k_dependent, (-(-n // 128),), (128,), stream, (y, w, src), pdl=pdl)()
            stream.synchronize()
            np.testing.assert_array_equal(y.copy_to_host(),
                                          2 * np.arange(1, n + 1, dtype=np.float32) + w.copy_to_host())


def test_every_intrinsic_is_compared():
    """A new intrinsic needs its kernel above."""
    assert set(P) == {"ld2", "ld4", "vld4", "ld4w", "vld4w", "h2f", "f2h2", "ldh", "ldw", "fld4",
                      "fbits", "spread4", "vst2", "vst4", "st4w", "ticket", "grid_wait",
                      "grid_launch_dependents"}
