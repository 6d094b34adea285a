"""Tensor-core primitives of kernels/mma.py: mma.m16n8k16 (bf16 / f16 in, f32 accumulate),
ldmatrix .x4 / .x4.trans, cp.async, f2bf2. Each kernel here is one warp; it runs the twins
under the simulator and the inline PTX on a GPU, and both must match NumPy. The fragment
layouts are restated here from the PTX ISA ("Matrix Fragments for mma.m16n8k16 with floating
point type", "ldmatrix"), independently of the module's a_coord / b_coord / c_coord.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, float32, uint16, uint32

import rlx_numba as rlx
from rlx_numba.kernels import mma
from halfref import rounded

ON_GPU = not rlx.simulator_enabled()
M = mma.INTRINSICS
SA = mma.SMEM_ALIGN


def bits(x):
    return np.ascontiguousarray(x).view(np.uint16)


# ---- the ISA's layouts, restated (g = lane >> 2, t = lane % 4) --------------------------------
def isa_a(lane, i):       # element a_i (i = 0..7) of A 16x16 -> (row, col)
    g, t = lane >> 2, lane % 4
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = t * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def isa_b(lane, i):       # element b_i (i = 0..3) of B 16x8 -> (row k, col n)
    g, t = lane >> 2, lane % 4
    return t * 2 + (i & 1) + (8 if i >= 2 else 0), g


def isa_c(lane, i):       # element c_i (i = 0..3) of C/D 16x8 -> (row, col)
    g, t = lane >> 2, lane % 4
    return (g if i < 2 else g + 8), t * 2 + (i & 1)


def test_module_layouts_match_the_isa():
    for lane in range(32):
        for i in range(8):
            assert mma.a_coord(lane, i // 2, i % 2) == isa_a(lane, i)
        for i in range(4):
            assert mma.b_coord(lane, i // 2, i % 2) == isa_b(lane, i)
            assert mma.c_coord(lane, i) == isa_c(lane, i)


def test_kernels_call_the_body_of_this_device():
    for name, it in M.items():
        assert getattr(mma, name) is it.fn is (it.gpu if ON_GPU else it.twin), name
    assert mma.mma("bf16") is mma.mma_bf16 and mma.mma("f16") is mma.mma_f16
    with pytest.raises(ValueError):
        mma.mma("f32")


# ---- kernels ------------------------------------------------------------------------------------
def _k_mma(kind):
    """D = A[:, :16] B[:16] + C, then D = A[:, 16:] B[16:] + D: A [16, 32], B [32, 8] bit
    patterns, C and D [16, 8] float32, each lane loading its fragments by the ISA formulas."""
    MMA = mma.mma(kind)

    @cuda.jit
    def k(d, a, b, c):
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane & 3
        c0 = c[g, 2 * t]
        c1 = c[g, 2 * t + 1]
        c2 = c[g + 8, 2 * t]
        c3 = c[g + 8, 2 * t + 1]
        for kk in range(2):
            o = 16 * kk
            a0 = uint32(a[g, o + 2 * t]) | (uint32(a[g, o + 2 * t + 1]) << uint32(16))
            a1 = uint32(a[g + 8, o + 2 * t]) | (uint32(a[g + 8, o + 2 * t + 1]) << uint32(16))
            a2 = uint32(a[g, o + 2 * t + 8]) | (uint32(a[g, o + 2 * t + 9]) << uint32(16))
            a3 = uint32(a[g + 8, o + 2 * t + 8]) | (uint32(a[g + 8, o + 2 * t + 9]) << uint32(16))
            b0 = uint32(b[o + 2 * t, g]) | (uint32(b[o + 2 * t + 1, g]) << uint32(16))
            b1 = uint32(b[o + 2 * t + 8, g]) | (uint32(b[o + 2 * t + 9, g]) << uint32(16))
            r = MMA(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
            c0 = r[0]
            c1 = r[1]
            c2 = r[2]
            c3 = r[3]
        d[g, 2 * t] = c0
        d[g, 2 * t + 1] = c1
        d[g + 8, 2 * t] = c2
        d[g + 8, 2 * t + 1] = c3
    return k


def _k_raw(kind):
    """One mma on registers given per lane: out[lane] = D registers of lane."""
    MMA = mma.mma(kind)

    @cuda.jit
    def k(out, aw, bw, cw):
        L = cuda.threadIdx.x
        r = MMA(aw[L, 0], aw[L, 1], aw[L, 2], aw[L, 3], bw[L, 0], bw[L, 1],
                cw[L, 0], cw[L, 1], cw[L, 2], cw[L, 3])
        for i in range(4):
            out[L, i] = r[i]
    return k


@cuda.jit
def k_ldmatrix(out, outt, tile, perm):
    """tile [32, 8] uint16 into shared; lane L points ldmatrix at row perm[L]."""
    L = cuda.threadIdx.x
    sm = cuda.shared.array((32, 8), uint16, alignment=SA)
    for j in range(8):
        sm[L, j] = tile[L, j]
    cuda.syncthreads()
    w = mma.ldmatrix_x4(sm, perm[L] * 8)
    v = mma.ldmatrix_x4_trans(sm, perm[L] * 8)
    for j in range(4):
        out[L, j] = w[j]
        outt[L, j] = v[j]


def _k_chain(kind):
    """A [16, 16] via ldmatrix_x4, B [16 k, 16 n] row-major via ldmatrix_x4_trans (two B
    fragments: n 0-7 and 8-15), two mmas with zero C: d [16, 16] = A B."""
    MMA = mma.mma(kind)

    @cuda.jit
    def k(d, a, b):
        L = cuda.threadIdx.x
        sa = cuda.shared.array((16, 16), uint16, alignment=SA)
        sb = cuda.shared.array((16, 16), uint16, alignment=SA)
        for j in range(8):
            sa[L >> 1, 8 * (L & 1) + j] = a[L >> 1, 8 * (L & 1) + j]
            sb[L >> 1, 8 * (L & 1) + j] = b[L >> 1, 8 * (L & 1) + j]
        cuda.syncthreads()
        fa = mma.ldmatrix_x4(sa, (L & 15) * 16 + 8 * (L >> 4))
        fb = mma.ldmatrix_x4_trans(sb, ((L & 7) + 8 * ((L >> 3) & 1)) * 16 + 8 * (L >> 4))
        g = L >> 2
        t = L & 3
        z = float32(0)
        for nb in range(2):
            r = MMA(fa[0], fa[1], fa[2], fa[3], fb[2 * nb], fb[2 * nb + 1], z, z, z, z)
            d[g, 8 * nb + 2 * t] = r[0]
            d[g, 8 * nb + 2 * t + 1] = r[1]
            d[g + 8, 8 * nb + 2 * t] = r[2]
            d[g + 8, 8 * nb + 2 * t + 1] = r[3]
    return k


@cuda.jit
def k_cp_async(out, src):
    """src [64, 8] uint16 -> shared in two cp.async groups (rows L, then rows 32 + L); after
    wait(1) lane L reads back its own first row, after wait_all + syncthreads row 63 - L."""
    L = cuda.threadIdx.x
    sm = cuda.shared.array((64, 8), uint16, alignment=SA)
    mma.cp_async16(sm, L * 8, src, L * 8)
    mma.cp_async_commit()
    mma.cp_async16(sm, (32 + L) * 8, src, (32 + L) * 8)
    mma.cp_async_commit()
    mma.cp_async_wait(1)
    for j in range(8):
        out[L, j] = sm[L, j]
    mma.cp_async_wait_all()
    cuda.syncthreads()
    for j in range(8):
        out[32 + L, j] = sm[63 - L, j]


@cuda.jit
def k_f2bf2(out, lo, hi):
    i = cuda.grid(1)
    if i < out.shape[0]:
        out[i] = mma.f2bf2(lo[i], hi[i])


def _run(kernel, *arrays, threads=32):
    dev = [cuda.to_device(x) for x in arrays]
    kernel[1, threads](*dev)
    cuda.synchronize()
    return [x.copy_to_host() for x in dev]


KIND_PARAMS = pytest.mark.parametrize("kind", ["bf16", "f16"])


# ---- mma ----------------------------------------------------------------------------------------
@KIND_PARAMS
def test_mma_against_numpy(rng, kind):
    a = rounded(rng.standard_normal((16, 32)), kind)
    b = rounded(rng.standard_normal((32, 8)), kind)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    (d, *_) = _run(_k_mma(kind), np.zeros((16, 8), np.float32), bits(a), bits(b), c)
    A, B, C = (x.astype(np.float64) for x in (a, b, c))
    want = A @ B + C
    # products of halves are exact in f32; each f32 add rounds: k = 32 terms, 2 rounds of C
    bound = 2.0 ** -18 * (np.abs(A) @ np.abs(B) + np.abs(C))
    assert np.all(np.abs(d - want) <= bound), np.max(np.abs(d - want) / bound)


def _one_hot_b(sel):
    B = np.zeros((16, 8))
    B[sel, np.arange(8)] = 1.0
    return B


def _words(vals, coord, nregs):
    """[32, nregs] uint32 words: half h of word r of lane L holds vals[coord(L, 2 r + h)]."""
    w = np.zeros((32, nregs), np.uint32)
    for L in range(32):
        for r in range(nregs):
            lo, hi = (int(vals[coord(L, 2 * r + h)]) for h in range(2))
            w[L, r] = lo | (hi << 16)
    return w


@KIND_PARAMS
def test_mma_fragment_layout(kind):
    """Every (lane, word, half) of A, of B and of C/D lands where the ISA says: A holds the
    distinct integers 0..255 (exact in bf16 / f16) indexed by lane, word and half; a one-hot
    B picks 8 of A's columns into D, so D, read back through the ISA's C layout, names which
    A register went to each (row, col). Then A = I shows B's layout, and A = 0 C's."""
    host = rounded(0, kind).dtype
    tag = np.zeros((16, 16))        # A[row, col] = the id 8 lane + i of the a_i landing there
    for L in range(32):
        for i in range(8):
            tag[isa_a(L, i)] = 8 * L + i
    aw = _words(bits(tag.astype(host)), isa_a, 4)
    zeros_c = np.zeros((32, 4), np.float32)
    k = _k_raw(kind)
    for half in range(2):
        sel = np.arange(8) + 8 * half
        bw = _words(bits(_one_hot_b(sel).astype(host)), isa_b, 2)
        (out, *_) = _run(k, np.zeros((32, 4), np.float32), aw, bw, zeros_c)
        for L in range(32):
            for i in range(4):
                row, col = isa_c(L, i)
                assert out[L, i] == tag[row, sel[col]], (L, i)
    # A = identity: D = B, with B's entries the ids 4 lane + i of b_i
    btag = np.zeros((16, 8))
    for L in range(32):
        for i in range(4):
            btag[isa_b(L, i)] = 4 * L + i
    aw = _words(bits(np.eye(16).astype(host)), isa_a, 4)
    bw = _words(bits(btag.astype(host)), isa_b, 2)
    ctag = np.arange(128, dtype=np.float32).reshape(32, 4)
    (out, *_) = _run(k, np.zeros((32, 4), np.float32), aw, bw, zeros_c)
    for L in range(32):
        for i in range(4):
            assert out[L, i] == btag[isa_c(L, i)], (L, i)
    # A = 0: D = C register for register
    (out, *_) = _run(k, np.zeros((32, 4), np.float32), np.zeros_like(aw), bw, ctag)
    np.testing.assert_array_equal(out, ctag)


@KIND_PARAMS
def test_warp_mma_host_twin(rng, kind):
    """The host-side twin on every lane's registers against NumPy (what the GPU tests below
    compare the tensor cores with)."""
    a = rounded(rng.standard_normal((16, 16)), kind)
    b = rounded(rng.standard_normal((16, 8)), kind)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    aw, bw = _words(bits(a), isa_a, 4), _words(bits(b), isa_b, 2)
    cw = np.array([[c[isa_c(L, i)] for i in range(4)] for L in range(32)], np.float32)
    d = mma.warp_mma(kind, aw, bw, cw)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    for L in range(32):
        for i in range(4):
            assert d[L, i] == np.float32(want[isa_c(L, i)])


# ---- ldmatrix -----------------------------------------------------------------------------------
def test_ldmatrix_x4_and_trans(rng):
    tile = rng.integers(0, 1 << 16, (32, 8), dtype=np.uint16)
    perm = rng.permutation(32).astype(np.int32)
    out, outt, *_ = _run(k_ldmatrix, np.zeros((32, 4), np.uint32), np.zeros((32, 4), np.uint32),
                         tile, perm)
    for L in range(32):
        g, t = L >> 2, L % 4
        for j in range(4):
            m = tile[perm[8 * j: 8 * j + 8]].astype(np.uint32)   # matrix j: lanes 8j..8j+7's rows
            assert out[L, j] == m[g, 2 * t] | (m[g, 2 * t + 1] << 16), (L, j)
            assert outt[L, j] == m[2 * t, g] | (m[2 * t + 1, g] << 16), (L, j)
    np.testing.assert_array_equal(out, mma.warp_ldmatrix(tile[perm], False))
    np.testing.assert_array_equal(outt, mma.warp_ldmatrix(tile[perm], True))


@KIND_PARAMS
def test_ldmatrix_then_mma(rng, kind):
    a = rounded(rng.standard_normal((16, 16)), kind)
    b = rounded(rng.standard_normal((16, 16)), kind)
    (d, *_) = _run(_k_chain(kind), np.zeros((16, 16), np.float32), bits(a), bits(b))
    A, B = a.astype(np.float64), b.astype(np.float64)
    bound = 2.0 ** -19 * (np.abs(A) @ np.abs(B))
    assert np.all(np.abs(d - A @ B) <= bound)


# ---- cp.async, f2bf2 ----------------------------------------------------------------------------
def test_cp_async(rng):
    src = rng.integers(0, 1 << 16, (64, 8), dtype=np.uint16)
    (out, *_) = _run(k_cp_async, np.zeros((64, 8), np.uint16), src)
    np.testing.assert_array_equal(out[:32], src[:32])
    np.testing.assert_array_equal(out[32:], src[::-1][:32])


def test_f2bf2(rng):
    lo = (rng.standard_normal(64) * 100).astype(np.float32)
    hi = rng.standard_normal(64).astype(np.float32)
    lo[:8] = [1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 3.4e38, -3.4e38, np.inf, -0.0, 1e-40, np.nan]
    (out, *_) = _run(k_f2bf2, np.zeros(64, np.uint32), lo, hi, threads=64)
    got = out.view(np.uint16).reshape(64, 2)
    want = np.stack([lo, hi], 1).astype(ml_dtypes.bfloat16)
    nan = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)), nan)
    np.testing.assert_array_equal(got[~nan], want.view(np.uint16)[~nan])


# ---- the twins' rendezvous ----------------------------------------------------------------------
def test_twin_needs_a_kernel_and_full_warps():
    if ON_GPU:
        pytest.skip("simulator twins")
    with pytest.raises(RuntimeError, match="inside a simulated kernel"):
        M["mma_bf16"].twin(*([np.uint32(0)] * 6), *([np.float32(0)] * 4))
    with pytest.raises(RuntimeError, match="partial warp"):
        _run(_k_raw("f16"), np.zeros((32, 4), np.float32), np.zeros((32, 4), np.uint32),
             np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32), threads=16)


def test_every_intrinsic_is_covered():
    """A new primitive needs its kernel above."""
    assert set(M) == {"mma_bf16", "mma_f16", "ldmatrix_x4", "ldmatrix_x4_trans", "cp_async16",
                      "cp_async_commit", "cp_async_wait", "cp_async_wait_all", "f2bf2"}


# ---- the GPU bodies through NVVM and ptxas (where a CUDA toolkit is installed) ----------------
def _toolkit():
    import shutil
    ptxas = shutil.which("ptxas")
    nvvm = [p for d in ("/usr/local/cuda/nvvm/lib64", "/usr/local/cuda/lib", "/usr/local/cuda/lib64")
            for p in Path(d).glob("libnvvm.so*")] if ptxas else []
    return ptxas if nvvm else None


SM80_PREAMBLE = """
import os
os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
from numba import cuda, types
import numba.cuda.dispatcher as D

class Dev:                # (device functions compile for the current device's cc)
    compute_capability = (8, 0)
D.get_current_device = lambda: Dev()
"""


def compile_sm80(body: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``body`` (it writes PTX with cuda.compile_ptx) in a fresh interpreter with numba's GPU
    target and a stand-in sm_80 device: no driver is needed. It must exit 0."""
    script = SM80_PREAMBLE + textwrap.dedent(body)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1], timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def assemble_sm80(ptx: Path, no_spills: bool = True, no_stack: bool = False,
                  insns=()) -> None:
    """ptxas the PTX file for sm_80 (-v): it must hold each of ``insns``, assemble and, with
    ``no_spills``, spill nothing; with ``no_stack``, keep nothing in local memory at all
    (0 bytes stack frame)."""
    text = ptx.read_text()
    for insn in insns:
        assert insn in text, (ptx.name, insn)
    r = subprocess.run([_toolkit(), "-arch=sm_80", "-v", str(ptx), "-o",
                        str(ptx.with_suffix(".cubin"))], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{ptx.name}: {r.stderr}"
    if no_spills:
        assert "0 bytes spill stores, 0 bytes spill loads" in r.stderr, (ptx.name, r.stderr)
    if no_stack:
        assert "0 bytes stack frame" in r.stderr, (ptx.name, r.stderr)


@pytest.mark.skipif(ON_GPU or _toolkit() is None, reason="needs ptxas + libnvvm, no GPU")
def test_gpu_bodies_assemble_for_sm80(tmp_path):
    """Without a GPU: compile this file's kernels with the GPU bodies to PTX (NUMBA_ENABLE_CUDASIM=0)
    and assemble them with ptxas for sm_80, so a typo in the inline PTX fails here."""
    script = textwrap.dedent(f"""
        import os, sys
        os.environ["NUMBA_ENABLE_CUDASIM"] = "0"
        from numba import cuda, types
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import test_mma as T
        u16, u32, f32, i32 = types.uint16, types.uint32, types.float32, types.int32
        jobs = [(T.k_ldmatrix, (u32[:, :], u32[:, :], u16[:, :], i32[:])),
                (T.k_cp_async, (u16[:, :], u16[:, :])),
                (T.k_f2bf2, (u32[:], f32[:], f32[:]))]
        for kind in ("bf16", "f16"):
            jobs += [(T._k_mma(kind), (f32[:, :], u16[:, :], u16[:, :], f32[:, :])),
                     (T._k_chain(kind), (f32[:, :], u16[:, :], u16[:, :])),
                     (T._k_raw(kind), (f32[:, :], u32[:, :], u32[:, :], f32[:, :]))]
        for n, (k, sig) in enumerate(jobs):
            ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(8, 0))
            open(os.path.join({str(tmp_path)!r}, f"k{{n}}.ptx"), "w").write(ptx)
        print(len(jobs))
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    ptxs = sorted(tmp_path.glob("k*.ptx"))
    assert len(ptxs) == int(r.stdout.split()[-1])
    text = "".join(p.read_text() for p in ptxs)
    for insn in ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                 "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                 "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                 "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "cp.async.cg.shared.global",
                 "cp.async.commit_group", "cp.async.wait_group 1", "cp.async.wait_all",
                 "cvt.rn.bf16x2.f32"):
        assert insn in text, insn
    for p in ptxs:
        assemble_sm80(p, no_spills=False)
