"""The GPU's tile geometry, run by the simulator on small problems (against NumPy oracles):
the kernel factories and plans take a geometry, so the shapes a GPU launches (128-thread
attention blocks, 4-warp decode and GEMV blocks, the tensor-core GEMMs' 8-warp tiles,
512-thread reduction rows, 256-thread row, sort and FFT blocks, ...) run in CI too, not only
the simulator's small ones. Warp shuffles stay the simulator's shared-memory stand-ins
(kernels/warp.py); tests/test_ptx_gpu.py checks the inline-PTX twins. On a GPU these
geometries are the defaults (the rest of the suite covers them), so the file is skipped there.
"""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.kernels import attention as A
from rlx_numba.kernels.launch import default_geometry, gpu_geometry, override_geometry
from test_attention import run_attention
from test_attention_grad import _grad_case

pytestmark = pytest.mark.skipif(not rlx.simulator_enabled(),
                                reason="on a GPU the GPU geometry is the default one")


def test_geometry_is_chosen_in_one_place():
    for family in ("attention", "gemv", "quant", "sample", "reduce", "sort", "fft", "rows"):
        assert default_geometry(family) != gpu_geometry(family), family   # the simulator's
    assert default_geometry("attention") == A.SIM and gpu_geometry("attention") == A.GPU
    assert A.GPU == A.Geometry(nt=128, nc=16, bc=64, dc=16, jc=16, tr=8, halve_jc=True,
                               dec_nw=4)
    with override_geometry("attention", A.GPU):
        assert default_geometry("attention") == A.GPU
    assert default_geometry("attention") == A.SIM


def test_attention_flash_gpu_geometry(rng, monkeypatch):
    """The prefill kernel at 128 threads, 64 x 64 tiles: two key tiles (the second partial),
    head dims past a 16-dim chunk, causal with everything."""
    monkeypatch.setattr(A, "decode_rows", lambda g, sq, d: None)
    with override_geometry("attention", A.GPU):
        run_attention(rng, 1, 1, 1, 3, 70, 20, bias_shape=(3, 70), mask_shape=(3, 70),
                      causal=True, window=68, scale=0.2, softcap=3.0)


def test_attention_flash_gpu_geometry_wide_heads(rng, monkeypatch):
    """Above 8 head dims a thread (D > 128): 4 rows a thread and V staged JC / 2 keys at a
    time."""
    monkeypatch.setattr(A, "decode_rows", lambda g, sq, d: None)
    assert A.flash_rows(A.GPU, A.head_split(A.GPU, 136)) == 4
    assert A.flash_jc(A.GPU, A.head_split(A.GPU, 136)) == 8
    with override_geometry("attention", A.GPU):
        run_attention(rng, 1, 1, 1, 3, 5, 136)


def test_attention_decode_gpu_geometry(rng, monkeypatch):
    """The split-K decode kernel with 4 warps a block, the keys over several splits."""
    monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // 40), 40))
    gpu_launch(monkeypatch)
    with override_geometry("attention", A.GPU):
        run_attention(rng, 1, 4, 2, 2, 100, 64, causal=True, window=90, softcap=2.0)


def test_attention_backward_gpu_geometry(rng):
    """dQ, dK, dV (and the delta and LSE kernels) at the GPU's tile shapes."""
    with override_geometry("attention", A.GPU):
        _grad_case(rng, (1, 1, 3, 5), (1, 1, 4, 5), causal=True, softcap=1.5)


def gpu_launch(monkeypatch):
    """Kernels as a GPU of compute capability 9.0 builds them: programmatic dependents (the
    skinny product, decode attention, rope_kv_write; grid_wait a no-op in the simulator,
    whose launches run one by one)."""
    from rlx_numba.runtime import lower_attention, lower_matmul, lower_rope
    for mod in (lower_matmul, lower_attention, lower_rope):
        monkeypatch.setattr(mod, "pdl_supported", lambda: True)


@pytest.mark.parametrize("wdt", ["f32", "bf16"])
def test_gemv_gpu_geometry(rng, monkeypatch, wdt):
    """The skinny product (matmul tier 3) with the GPU's plan: 4 warps a block, its team and
    column shapes, 16-byte vectors, a fused epilogue."""
    from rlx_numba.kernels import gemv as gv
    from test_gemv import act_np, build, product_step, set_weight
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    gpu_launch(monkeypatch)
    lead, k, n = (3,), 264, 9
    assert gv.plan(3, n, k, wdt, gv.vec_width(wdt), 1, geo=gv.GPU)[0] == 4
    with override_geometry("gemv", gv.GPU):
        exe = rlx.compile(build(lead, k, n, True, "silu", True))
        wv = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
        bv = rng.standard_normal(n).astype(np.float32)
        w64 = set_weight(exe, wv, wdt)
        exe.set_param("b", bv)
        assert product_step(exe).info["tier"] == 3 and product_step(exe).pdl
        xv = rng.standard_normal((*lead, k)).astype(np.float32)
        rv = rng.standard_normal((*lead, n)).astype(np.float32)
        (got,) = exe.run({"x": xv, "r": rv})
    want = act_np("silu", xv.astype(np.float64) @ w64 + bv) + rv
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("d", ["f16", "bf16"])
def test_gemv_norm_prologue_gpu_geometry(rng, monkeypatch, d):
    """The skinny product with an rms_norm prologue at the GPU's plan: half x and gamma read
    16 bytes at a time, the sums of squares meeting over a team's warps, a residual."""
    from rlx_numba.kernels import gemv as gv
    from test_norm_prologue import check_case
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    gpu_launch(monkeypatch)
    assert gv.plan(2, 9, 264, d, 8, 1, geo=gv.GPU)[5] == 1      # one split: K whole
    with override_geometry("gemv", gv.GPU):
        check_case(rng, d, (2,), 264, 9, True, True, False, 3)


def test_tc_gemm_gpu_geometry(rng):
    """The tensor-core GEMM at the GPU's tile (128 x 128, 8 warps, 4 cp.async stages) on one
    partial tile, K over three K tiles; f16 with A transposed, loaded by cp.async."""
    from rlx_numba.kernels import matmul_tc as mtc
    from test_matmul_tc import _direct
    assert _direct(rng, "f16", True, False, 24, 40, 24, mtc.GPU_GEOMETRY).vec   # (A^T rows: 24)


def test_grouped_tc_gpu_geometry(rng):
    """The grouped tensor-core product at the GPU's tile: expert 0 empty, expert 1's rows one
    routed 128-row tile (its weight past expert 0's), gathered and scattered through the
    routing table."""
    from rlx_numba.kernels import matmul_tc as mtc
    from halfref import assert_half_close
    from test_grouped_tc import _data, grouped_tc, oracle
    ids = np.array([1, 1, 1, 1, 1, 1, 1])
    x, w = _data(rng, "bf16", ids.size, 40, 24, 2, False)
    got, vec = grouped_tc(x, w, ids, "bf16", geo=mtc.GPU_GEOMETRY)
    assert vec
    assert_half_close(got, oracle(x, w, ids, False), "bf16", what="grouped tc, GPU tile")


@pytest.mark.parametrize("scheme,m", [("q4_0", 1), ("q4_k", 3)])
def test_quant_gemv_gpu_geometry(rng, scheme, m):
    """The quantised GEMV with the GPU's plan (4 warps a block; at M = 1 the cheap formats'
    lane-a-quarter shape)."""
    from rlx_numba.kernels import quant as Q
    from test_quant import GGUF, QTYPE, _close, _run_quant, gguf_dequantize, random_blocks
    qk, _ = GGUF[scheme]
    k = qk * (2 if qk == 32 else 1)
    raw = random_blocks(rng, scheme, 6, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    assert Q.plan(m, 6, 1, scheme, geo=Q.GPU)[0] == 4
    with override_geometry("quant", Q.GPU):
        (y, _), _ = _run_quant(scheme, raw, x)
    _close(y, x.astype(np.float64) @ gguf_dequantize(raw, QTYPE[scheme]).astype(np.float64).T)


def test_reduce_gpu_geometry(rng):
    """Reductions with the GPU's launch shapes: rows on a 512-thread block, 4 x 64 column
    blocks. (The split of long rows needs n >= 16384 at this geometry: the plan is checked,
    not run -- a 512-thread block costs the simulator seconds.)"""
    from rlx_numba.kernels.launch import col_geometry, gpu_geometry, row_geometry
    geo = gpu_geometry("reduce")
    g_, block, _, nseg, _ = row_geometry(1, 20000, geo=geo)
    assert (g_, block, nseg) == (512, 512, 4)
    assert row_geometry(2, 40, geo=geo)[:4] == (4, 512, 1, 1)
    assert col_geometry(2, 40, 3, geo=geo)[:2] == (4, 64)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    c = rng.standard_normal((2, 40, 3)).astype(np.float32)
    g = rlx.Graph("red")
    xt, ct = g.input("x", x.shape), g.input("c", c.shape)
    g.set_outputs([g.reduce("sum", xt, (1,)), g.reduce("max", ct, (1,))])
    with override_geometry("reduce", geo):
        s, m = rlx.compile(g).run({"x": x, "c": c})
    np.testing.assert_allclose(s, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(m, c.max(1))


def test_sample_gpu_geometry(rng):
    """topk and sample on the GPU's blocks (64 threads a row at these lengths, the row staged
    in shared memory, the winners sorted there) and its shared-memory limits."""
    from rlx_numba.kernels import sample as S
    from rlx_numba.runtime.lower_sample import topk_plan
    from test_sample import _check_sample, _check_topk
    with override_geometry("sample", S.GPU):
        plan = topk_plan(2, 40, 3)
        assert (plan["mode"], plan["block"], plan["smem"], plan["stage"]) == ("one", 64, True, 64)
        _check_topk(rng.standard_normal((2, 40)).astype(np.float32), 3)
        _check_sample((rng.standard_normal((1, 40)) * 3).astype(np.float32), temperature=0.8,
                      top_k=5, top_p=0.9, seed=3)


def test_sort_gpu_geometry(rng):
    """argsort with the GPU's shapes: a row of 300 keys is one bitonic tile of 512 on 256
    threads. (Merging tiles of 2048 needs rows past 2048 keys: too slow for the simulator.)"""
    from rlx_numba.kernels import sort as S
    from test_sort import ref_order
    x = rng.standard_normal((2, 300)).astype(np.float32)
    x[0, ::7] = x[0, 3]                                     # ties: index order
    g = rlx.Graph("sort")
    v, i = g.sort(g.input("x", x.shape), descending=True)
    g.set_outputs([v, i])
    with override_geometry("sort", S.GPU):
        exe = rlx.compile(g)
        assert any(s.kernel_name == "sort tiles of 512" and s.block == (256,) for s in exe.steps)
        got_v, got_i = exe.run({"x": x})
    want = ref_order(x, -1, True)
    np.testing.assert_array_equal(got_i, want)
    np.testing.assert_array_equal(got_v, np.take_along_axis(x, want, -1))


def test_fft_gpu_geometry(rng):
    """The numba FFT kernels on the GPU's 256-thread blocks: a 64-point row in one shared-memory
    pass and a 12-point row through Bluestein's kernel. (Rows past 2048 points, the multi-pass
    plan, are too slow for the simulator.)"""
    from rlx_numba.kernels import fft as F
    x = rng.standard_normal((2, 64, 2)).astype(np.float32)
    y = rng.standard_normal((1, 12, 2)).astype(np.float32)
    g = rlx.Graph("fft")
    g.set_outputs([g.fft(g.input("x", x.shape)), g.fft(g.input("y", y.shape), inverse=True)])
    with override_geometry("fft", F.GPU):
        exe = rlx.compile(g)
        blocks = [s.block for s in exe.steps if "fft" in s.kernel_name]
        assert len(blocks) >= 2 and all(b == (256,) for b in blocks), blocks
        gx, gy = exe.run({"x": x, "y": y})
    for got, z, f in ((gx, x, np.fft.fft), (gy, y, np.fft.ifft)):
        want = f(z[..., 0].astype(np.float64) + 1j * z[..., 1])
        np.testing.assert_allclose(got[..., 0] + 1j * got[..., 1], want, rtol=1e-5,
                                   atol=2e-5 * np.abs(want).max())


def test_rows_gpu_geometry(rng):
    """softmax (the prefetching kernel) and layer_norm with the GPU's row plan: 32 threads a
    row at least, 256-thread blocks (8 rows a block), values a thread up to 16."""
    from rlx_numba.kernels import rows as R
    from test_rows import np_layer_norm
    assert R.row_plan(40, True, R.GPU)[:3] == (32, 2, 256)
    assert R.row_plan(600, False, R.GPU)[:3] == (64, 16, 256)
    x = rng.standard_normal((9, 40)).astype(np.float32)
    z = rng.standard_normal((2, 600)).astype(np.float32)
    gam = rng.standard_normal(600).astype(np.float32)
    g = rlx.Graph("rows")
    xt, zt = g.input("x", x.shape), g.input("z", z.shape)
    g.set_outputs([g.softmax(xt, -1), g.layer_norm(zt, g.input("gam", gam.shape))])
    with override_geometry("rows", R.GPU):
        sm, ln = rlx.compile(g).run({"x": x, "z": z, "gam": gam})
    e = np.exp(x - x.max(-1, keepdims=True))
    np.testing.assert_allclose(sm, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ln, np_layer_norm(z.astype(np.float64), gam, None, -1, 1e-5),
                               rtol=1e-4, atol=1e-4)


def test_rope_kv_write_as_programmatic_dependent(rng, monkeypatch):
    """rope_kv_write built as a GPU of compute capability 9.0 builds it (grid_wait first)."""
    from test_fused_decoder import RKV_CASES, test_rope_kv_write_matches_numpy
    gpu_launch(monkeypatch)
    test_rope_kv_write_matches_numpy(rng, *RKV_CASES[2], cpos_tensor=True)



def test_attention_tc_gpu_geometry(rng):
    """The tensor-core flash kernel (attention tier 1) at the GPU's geometry: 4 warps of 16
    query rows, one 128-key tile (D 16), causal with Sq < Sk (diagonal warps take the mask
    path, the others none) and its LSE."""
    from halfref import rounded
    from rlx_numba.kernels import attention_tc as ATC
    from test_attention_tc import assert_pv_close, direct, reference
    assert default_geometry("attention_tc") == ATC.SIM_GEOMETRY
    assert gpu_geometry("attention_tc") == ATC.GPU_GEOMETRY
    q = rounded(rng.standard_normal((1, 1, 35, 16)), "bf16")
    k, v = (rounded(rng.standard_normal((1, 1, 70, 16)), "bf16") for _ in range(2))
    out, lse = direct("bf16", q, k, v, ATC.GPU_GEOMETRY, causal=True)
    o, pv, want = reference(q, k, v, causal=True)
    assert_pv_close(out, o, pv, "bf16")
    np.testing.assert_allclose(lse, want, rtol=0, atol=1e-5)
