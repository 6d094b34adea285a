"""attention tier 1, the tensor-core flash kernel (kernels/attention_tc.py): f16 / bf16 q, k, v
on mma.sync, against float64 NumPy on the same half-rounded inputs: causal (Sq < Sk and Sq >
Sk), window, bool mask, bias in f32 and in q's dtype, scale, softcap, GQA, the [B, S, H * D]
layout, the LSE (through the numba backward, which reads it), rows that keep no key, and a
long row that a kernel accumulating in half would get wrong.

Tolerance: the kernel rounds P to the io dtype before P V (as cuDNN and FlashAttention-2 do)
and the output once; the scores and every sum are f32. So an output is within k u
(|o| + sum_j p_j |v_j|) of float64 math (``pv_abs``), not k u |o|. In the simulator the tier
runs only where RLX_NUMBA_ATTENTION_TIERS names it, with its small geometry (one warp, 16-key
tiles); the mma twins are slow, so the shapes here are a few tiles (Sq 19: two query tiles,
Sk 37: three key tiles, the last partial). The GPU's geometry runs on GPU-only tests (and
tests/test_gpu_geometry.py in the simulator)."""

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from halfref import HOST, assert_half_close, f64, rounded
from test_attention_half import _half_online_softmax, _keep, attention64, masked_softmax
from test_mma import _toolkit, assemble_sm80, compile_sm80

from rlx_numba.kernels import attention as A
from rlx_numba.kernels import attention_tc as ATC


@pytest.fixture(autouse=True)
def _tier1(monkeypatch):
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "1")


def reference(q, k, v, *, causal=False, window=None, mask=None, bias=None, scale=None,
              softcap=None):
    """float64 (o, sum_j p_j |v_j|, lse) of q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D]: lse the
    rows' log-sum-exp of the scaled, capped, biased scores over the kept keys (-inf where
    none), o 0 on such rows."""
    q, k, v = f64(q), f64(k), f64(v)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    K, V = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
    s = q @ K.transpose(0, 1, 3, 2) * (1 / np.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + f64(bias)
    p, mx, den = masked_softmax(s, _keep(b, hq, sq, sk, causal, window, mask))
    with np.errstate(divide="ignore"):
        lse = np.where(den[..., 0] > 0, mx[..., 0] + np.log(den[..., 0]), -np.inf)
    return p @ V, p @ np.abs(V), lse


def assert_pv_close(got, o, pv_abs, dt, k=2.0, what="tc attention"):
    """|got - o| <= k u (|o| + sum_j p_j |v_j|) (the module docstring)."""
    assert_half_close(got, o, dt, k=k, scale=pv_abs, what=what)


def _steps(exe):
    return [s.kernel_name for s in exe.steps]


def run_case(rng, dt, qs, ks, mask_shape=None, bias_shape=None, bias_dtype=None, **kw):
    """Compile and run one attention at tier 1 (asserting it took it) against reference()."""
    g = rlx.Graph("attn_tc")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    feed = {n: rounded(rng.standard_normal(s), dt) for n, s in (("q", qs), ("k", ks), ("v", ks))}
    extra = {}
    if mask_shape is not None:
        extra["mask"] = g.input("m", mask_shape, "bool")
        feed["m"] = rng.random(mask_shape) < 0.7
    if bias_shape is not None:
        extra["bias"] = g.input("bias", bias_shape, bias_dtype or dt)
        feed["bias"] = rounded(rng.standard_normal(bias_shape), bias_dtype or dt)
    g.set_outputs([g.attention(q, k, v, **extra, **kw)])
    exe = rlx.compile(g)
    assert any("tc-flash" in s for s in _steps(exe)), _steps(exe)
    (got,) = exe.run(feed)
    attrs = {a: x for a, x in kw.items() if a != "num_heads"}
    if len(qs) == 3:           # [B, S, H * D]: the reference's [B, H, S, D] and back
        hq = kw["num_heads"]
        hkv = hq * ks[2] // qs[2]
        four = [np.moveaxis(feed[n].reshape(t[0], t[1], h, -1), 1, 2)
                for n, t, h in (("q", qs, hq), ("k", ks, hkv), ("v", ks, hkv))]
        o, pv, _ = reference(*four, mask=feed.get("m"), bias=feed.get("bias"), **attrs)
        o, pv = (np.moveaxis(x, 1, 2).reshape(qs) for x in (o, pv))
    else:
        o, pv, _ = reference(feed["q"], feed["k"], feed["v"], mask=feed.get("m"),
                             bias=feed.get("bias"), **attrs)
    assert_pv_close(got, o, pv, dt)
    return got, o


# name: (q shape, k shape, attributes); Sq 19 / Sk 37 at the simulator's 16 x 16 tiles
CASES = {
    "causal_bf16": ("bf16", (1, 1, 19, 16), (1, 1, 37, 16), {"causal": True}),
    "causal_f16": ("f16", (1, 1, 19, 16), (1, 1, 37, 16), {"causal": True}),
    "gqa_window_softcap_scale": ("f16", (1, 2, 19, 32), (1, 1, 37, 32),
                                 {"window": 9, "softcap": 2.5, "scale": 0.3}),
    "mask_f32_bias": ("bf16", (1, 1, 19, 16), (1, 1, 37, 16),
                      {"mask_shape": (19, 37), "bias_shape": (1, 1, 19, 37),
                       "bias_dtype": "f32"}),
    "half_bias_causal_sq_gt_sk": ("f16", (1, 1, 19, 16), (1, 1, 7, 16),   # 12 rows see nothing
                                  {"bias_shape": (7,), "causal": True}),
    "bshd_gqa": ("bf16", (1, 19, 2 * 16), (1, 37, 16), {"num_heads": 2, "causal": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tc_forward(rng, name):
    dt, qs, ks, kw = CASES[name]
    got, o = run_case(rng, dt, qs, ks, **kw)
    if name == "half_bias_causal_sq_gt_sk":      # rows past the keys' end keep none: zeros
        assert not np.any(f64(got)[..., :12, :]) and np.all(o[..., :12, :] == 0)


def test_tc_lse_through_the_backward(rng, monkeypatch):
    """The forward at tier 1 saves the rows' LSE (attention_lse), which the numba backward
    (tier 2's kernels) reads: its gradients match float64 ones only if the LSE has the f32
    kernel's convention. bf16 (test_tc_lse_direct checks f16's LSE), GQA, causal, one query
    tile and one partial key tile (the backward kernels are the slow part here)."""
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "1,2")
    dt = "bf16"
    qs, ks = (1, 2, 9, 16), (1, 1, 13, 16)
    g = rlx.Graph("attn_tc_grad")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    y = g.attention(q, k, v, causal=True)
    seed = rounded(rng.standard_normal(qs), dt)
    grads = g.grad(y, [q, k, v], seed=g.constant(seed))
    g.set_outputs([y, *grads])
    exe = rlx.compile(g)
    assert any("tc-flash" in s and "+lse" in s for s in _steps(exe)), _steps(exe)
    feed = {n: rounded(rng.standard_normal(s), dt) for n, s in (("q", qs), ("k", ks), ("v", ks))}
    got = exe.run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, causal=True)[:4]
    o, pv, _ = reference(feed["q"], feed["k"], feed["v"], causal=True)
    assert_pv_close(got[0], o, pv, dt)
    for gv, wv, what in zip(got[1:], want[1:], ("dq", "dk", "dv")):
        # (P rounded in the forward's O enters Dl = rowsum(dO O): test_attention_half's
        # backward bound, a few u of the largest entry)
        assert_half_close(gv, wv, dt, k=6.0, scale=np.abs(wv).max(), what=what)


def direct(dt, q, k, v, geo, *, causal=False, lse=True):
    """(out, lse or None) of attention_tc.direct_launch on host copies (simulator) or device
    copies (GPU) of q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] (the sweep's launch)."""
    from numba import cuda
    dev = cuda.to_device if ON_GPU else (lambda x: x)
    host = (lambda x: x.copy_to_host()) if ON_GPU else (lambda x: x)
    out = dev(np.zeros(q.shape, np.uint16 if dt == "bf16" else np.float16))
    lse_ = dev(np.zeros(q.shape[:3], np.float32)) if lse else None
    ins = [dev(np.ascontiguousarray(x).view(np.uint16)) for x in (q, k, v)]
    ATC.direct_launch(out, *ins, dt, causal=causal, lse=lse_, geo=geo)()
    return host(out).view(HOST[dt]), host(lse_) if lse else None


def test_tc_lse_direct(rng):
    """The kernel's LSE against float64 (natural log, -inf where a row keeps no key: causal
    with Sq > Sk) and its output; f16, GQA."""
    dt = "f16"
    q = rounded(rng.standard_normal((1, 2, 19, 16)), dt)
    k, v = (rounded(rng.standard_normal((1, 1, 11, 16)), dt) for _ in range(2))
    out, lse = direct(dt, q, k, v, ATC.SIM_GEOMETRY, causal=True)
    o, pv, want = reference(q, k, v, causal=True)
    assert_pv_close(out, o, pv, dt)
    assert np.all(np.isneginf(lse[..., :8])) and np.all(np.isfinite(lse[..., 8:]))
    np.testing.assert_allclose(lse[..., 8:], want[..., 8:], rtol=0, atol=1e-5)


def test_tc_two_row_tiles_a_warp_q_reread(rng):
    """A warp of two m16 row tiles (K / V fragments shared by both), at D 80, where Q's
    fragments are re-read every key tile (mi d > 128); causal Sq < Sk, partial tiles."""
    geo = ATC.TcAttnGeometry(1, 16, 1, mi=2)
    assert not geo.q_regs(80) and geo.br == 32
    dt = "bf16"
    q = rounded(rng.standard_normal((1, 1, 19, 80)), dt)
    k, v = (rounded(rng.standard_normal((1, 1, 37, 80)), dt) for _ in range(2))
    out, lse = direct(dt, q, k, v, geo, causal=True)
    o, pv, want = reference(q, k, v, causal=True)
    assert_pv_close(out, o, pv, dt)
    np.testing.assert_allclose(lse, want, rtol=0, atol=1e-5)


def test_tc_long_row_half_accumulation_would_fail(rng, monkeypatch):
    """300 keys (19 tiles) of nearly equal scores, values in [2, 3] (test_attention_half's
    case): this kernel's f32 sums pass the bound of f32 accumulation (P rounded, k u |o|, as
    the p_j are positive and v_j > 0: sum_j p_j |v_j| = |o|); a kernel that kept its sums in
    bf16 fails it."""
    dt, sq, sk, d = "bf16", 2, 300, 16
    monkeypatch.setattr(A, "decode_rows", lambda g, sq, d: None)      # (2 rows: a prefill)
    q = rounded(0.1 * rng.standard_normal((1, 1, sq, d)), dt)
    k = rounded(rng.standard_normal((1, 1, sk, d)), dt)
    v = rounded(rng.uniform(2, 3, (1, 1, sk, d)), dt)
    g = rlx.Graph("long")
    ins = [g.input(n, x.shape, dt) for n, x in (("q", q), ("k", k), ("v", v))]
    g.set_outputs([g.attention(*ins)])
    exe = rlx.compile(g)
    assert any("tc-flash" in s for s in _steps(exe))
    (got,) = exe.run({"q": q, "k": k, "v": v})
    o, pv, _ = reference(q, k, v)
    np.testing.assert_allclose(pv, o)
    assert_pv_close(got, o, pv, dt)
    with pytest.raises(AssertionError):
        assert_pv_close(_half_online_softmax(q, k, v, dt), o, pv, dt, what="half accumulation")


def _why(dt, qs, ks, **kw):
    g = rlx.Graph("decline")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    g.set_outputs([g.attention(q, k, v, **kw)])
    with pytest.raises(NotImplementedError) as e:
        rlx.compile(g)
    return str(e.value)


@pytest.mark.parametrize("dt,qs,ks,why", [
    ("f32", (1, 1, 19, 16), (1, 1, 37, 16), "f32 operands (it takes f16 / bf16)"),
    ("bf16", (1, 1, 19, 24), (1, 1, 37, 24), "head dim 24 (a multiple of 16 up to 128)"),
    ("bf16", (1, 1, 19, 144), (1, 1, 37, 144), "head dim 144"),
    ("f16", (1, 4, 1, 16), (1, 1, 37, 16), "few queries a kv head (the split decode kernel)"),
    ("bf16", (1, 1, 19, 16), (1, 1, 0, 16), "no keys"),
])
def test_tc_declines_with_a_reason(dt, qs, ks, why):
    """Only tier 1 allowed: what it cannot run fails to compile, naming the tier and why."""
    msg = _why(dt, qs, ks)
    assert "tier 1 (numba tensor-core flash): " + why in msg, msg


def test_tc_not_by_default_in_the_simulator(monkeypatch, caplog):
    """The simulator's default ladder passes tier 1 over (its mma twins are slow), saying
    why, and takes tier 2."""
    if ON_GPU:
        pytest.skip("the simulator's ladder")
    monkeypatch.delenv("RLX_NUMBA_ATTENTION_TIERS")
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    g = rlx.Graph("default")
    q, k, v = (g.input(n, (1, 1, 19, 16), "bf16") for n in "qkv")
    g.set_outputs([g.attention(q, k, v)])
    with caplog.at_level("WARNING", logger="rlx_numba"):
        exe = rlx.compile(g)
    assert not any("tc-flash" in s for s in _steps(exe)), _steps(exe)
    assert "tier 1 (numba tensor-core flash): the simulator runs it only where " \
           "RLX_NUMBA_ATTENTION_TIERS names it" in caplog.text, caplog.text


def test_tc_geometry():
    gpu = ATC.GPU_GEOMETRY
    assert (gpu.warps, gpu.keys(64), gpu.keys(128)) == (4, 128, 64)
    assert gpu.keys(64, masked=True) == 64 and ATC.SIM_GEOMETRY.keys(64, masked=True) == 16
    for geo in ATC.SWEEP_GEOMETRIES:
        for d in (16, 64, 128):
            ATC.check(geo, d)
            assert ATC.shared_bytes(geo.keys(d), d) <= ATC.SMEM_LIMIT
    with pytest.raises(ValueError, match="head dim 40"):
        ATC.check(gpu, 40)


# ---- the GPU kernels through NVVM and ptxas (where a CUDA toolkit is installed) --------------
@pytest.mark.skipif(ON_GPU or _toolkit() is None, reason="needs ptxas + libnvvm, no GPU")
def test_gpu_kernel_assembles_without_spills(tmp_path):
    """Without a GPU: the GPU geometry's kernel with every flag (causal, window, mask, an f16
    bias, softcap, the LSE; f16, D 128) compiled to PTX with the GPU bodies and assembled by
    ptxas for sm_80 under the launch bounds: the mma / ldmatrix / cp.async instructions are
    there and nothing spills. (One kernel: a compile takes ~10 s of CPU.)"""
    compile_sm80(f"""
        from rlx_numba.kernels import attention_tc as T
        u16, u32, f16, f32, i64, b1 = (types.uint16, types.uint32, types.float16,
                                       types.float32, types.int64, types.boolean)
        geo = T.GPU_GEOMETRY
        k = T.flash_tc(geo, 128, True, True, True, True, True, 1, "f16", "f16")
        sig = (f16[::1], f32[::1], u32[::1], u16[::1], u16[::1], b1[::1], f16[::1], i64[::1],
               f32, f32)
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(8, 0),
                                  launch_bounds=(geo.threads, geo.min_blocks))
        open(os.path.join({str(tmp_path)!r}, "k.ptx"), "w").write(ptx)
    """, timeout=900)
    assemble_sm80(tmp_path / "k.ptx", insns=(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "ldmatrix.sync.aligned.m8n8.x4.shared", "ldmatrix.sync.aligned.m8n8.x4.trans",
        "cp.async.cg.shared.global", "cp.async.wait_group 0", "cvt.rn.f16x2.f32",
        "ex2.approx", "shfl.sync.bfly", "bar.sync"))


# ---- on a GPU (the lead runs these) -----------------------------------------------------------
gpu_only = pytest.mark.skipif(not ON_GPU, reason="the tensor-core flash kernel at GPU sizes")

GPU_CASES = {
    "causal_gqa_d128_s333": ("bf16", (2, 8, 333, 128), (2, 2, 333, 128), {"causal": True}),
    "d64_s200": ("f16", (2, 4, 200, 64), (2, 4, 200, 64), {}),
    "causal_gqa_d64_s200_f16": ("f16", (1, 8, 200, 64), (1, 1, 333, 64), {"causal": True}),
    "d128_s200_bf16": ("bf16", (1, 4, 200, 128), (1, 4, 200, 128), {}),
    "window_softcap_mask_bias": ("bf16", (1, 4, 200, 64), (1, 2, 333, 64),
                                 {"window": 77, "softcap": 20.0, "mask_shape": (1, 1, 200, 333),
                                  "bias_shape": (4, 200, 333), "bias_dtype": "f32"}),
    "bshd_d128": ("f16", (2, 200, 4 * 128), (2, 333, 2 * 128), {"num_heads": 4}),
}


@gpu_only
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_tc_forward(rng, name):
    dt, qs, ks, kw = GPU_CASES[name]
    run_case(rng, dt, qs, ks, **kw)


@gpu_only
@pytest.mark.parametrize("geo", ATC.SWEEP_GEOMETRIES, ids=str)
@pytest.mark.parametrize("dt,d,causal,lse", [("bf16", 128, True, False),
                                             ("f16", 64, False, True)])
def test_gpu_tc_sweep_geometries(rng, geo, dt, d, causal, lse):
    """Every geometry bench/sweep_attention_tc.py times, launched directly as the sweep does
    (bf16 D 128 causal without the LSE: the sweep's first kernels, compiled here), S 333 with
    GQA, output (and LSE) against float64."""
    q = rounded(rng.standard_normal((2, 4, 333, d)), dt)
    k, v = (rounded(rng.standard_normal((2, 2, 333, d)), dt) for _ in range(2))
    out, got_lse = direct(dt, q, k, v, geo, causal=causal, lse=lse)
    o, pv, want = reference(q, k, v, causal=causal)
    assert_pv_close(out, o, pv, dt, what=f"{geo} D{d}")
    if lse:
        np.testing.assert_allclose(got_lse, want, rtol=0, atol=2e-4)   # (tensor-core f32 sums)


@gpu_only
def test_gpu_tc_lse_through_the_backward(rng, monkeypatch):
    """The backward reading tier 1's LSE at GPU sizes (D 64, causal GQA, S 200)."""
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "1,2")
    dt, qs, ks = "bf16", (1, 4, 200, 64), (1, 2, 200, 64)
    g = rlx.Graph("attn_tc_grad_gpu")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    y = g.attention(q, k, v, causal=True)
    seed = rounded(rng.standard_normal(qs), dt)
    g.set_outputs([y, *g.grad(y, [q, k, v], seed=g.constant(seed))])
    exe = rlx.compile(g)
    assert any("tc-flash" in s and "+lse" in s for s in _steps(exe)), _steps(exe)
    feed = {n: rounded(rng.standard_normal(s), dt) for n, s in (("q", qs), ("k", ks), ("v", ks))}
    got = exe.run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, causal=True)[:4]
    for gv, wv, what in zip(got[1:], want[1:], ("dq", "dk", "dv")):
        assert_half_close(gv, wv, dt, k=6.0, scale=np.abs(wv).max(), what=what)


@gpu_only
def test_gpu_default_ladder_takes_tier1_where_cudnn_declines(rng, monkeypatch):
    """Unrestricted on a GPU: a sliding window (which cuDNN's tier passes over) runs on the
    tensor-core flash kernel, not the f32 one."""
    monkeypatch.delenv("RLX_NUMBA_ATTENTION_TIERS")
    run_case(rng, "bf16", (1, 4, 200, 64), (1, 4, 200, 64), window=50)

