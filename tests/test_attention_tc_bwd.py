"""attention_bwd_dq tier 1, the tensor-core backward (kernels/attention_tc_bwd.py): dQ, dK, dV
for f16 / bf16 on mma.sync against float64 NumPy gradients of the same half-rounded inputs
(tests/test_attention_half.py's oracle): causal with Sq < Sk, Sq = Sk and Sq > Sk (rows that
keep no key), a key padding mask with a batch row that keeps none, scale, GQA (dK / dV summed
over a group in the kernel), the [B, S, H * D] layout, a sliding window, softcap, a bias in
f32 or q's dtype (with its gradient: attention_bwd_ds reads the delta this tier writes); what
it does not run (f32, a head dim not a multiple of 16) declined with the reason, to tier 2.

Tolerance: as cuDNN and FlashAttention-2 the kernels round P and dS to the io dtype for the
tensor-core products and read O rounded (delta = rowsum(dO * O)): each gradient within a few
u of the magnitudes of the sums that make it (test_attention_half's ``_magnitudes``), the
bound tier 0 meets; with a window or softcap (which that oracle has not) a few u of the
largest entry, test_attention_half's backward bound. In the simulator the tier runs only
where RLX_NUMBA_ATTENTION_BWD_TIERS names it, with one warp and 16-column tiles (its mma twins
are slow: Sq / Sk 19 and 33 are a few tiles, the last partial); the forward there is tier 2's
f32 kernel (its LSE convention is tier 1's). The GPU geometry runs here at small shapes (the
slow tests, ~10 s each), and at S 200 / 333 on a GPU."""
import threading

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from halfref import assert_half_close, f64, rounded
from test_attention_half import _cudnn_grad_run, _feed, _graph, attention64
from test_mma import _toolkit, assemble_sm80, compile_sm80

from rlx_numba.kernels import attention_tc_bwd as ATB
from rlx_numba.kernels.ptx import flat


@pytest.fixture(autouse=True)
def _tier1(monkeypatch):
    # the forward: tier 1 on a GPU; in the simulator tier 2 (its mma twins would double the time)
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "1" if ON_GPU else "2")
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_BWD_TIERS", "1")


def _steps(exe):
    return [s.kernel_name for s in exe.steps]


def check_case(rng, dt, qs, ks, kw, k=4.0):
    """Run attention and its gradients with the backward on tier 1 (asserting both tc kernels
    ran and no other backward kernel did); O, dQ, dK, dV within k u of their magnitudes."""
    exe, got, want, mags = _cudnn_grad_run(rng, dt, qs, ks, kw)
    _tc_names(_steps(exe), dt)
    for i, what in enumerate(["o", "dq", "dk", "dv"]):
        assert not np.isnan(f64(got[i])).any(), what
        assert_half_close(got[i], want[i], dt, k=k, scale=mags[i], what=f"tc bwd {what}")
    return got, want


# name: (dtype, q shape, k shape, attributes); 19 / 33 rows at the simulator's 16 x 16 tiles
CASES = {
    "causal_gqa_bf16": ("bf16", (1, 2, 19, 16), (1, 1, 33, 16), {"causal": True}),
    "causal_square_f16": ("f16", (1, 1, 33, 16), (1, 1, 33, 16), {"causal": True, "scale": 0.3}),
    "causal_sq_gt_sk_f16": ("f16", (1, 1, 33, 16), (1, 1, 19, 16), {"causal": True}),
    "plain_bf16": ("bf16", (1, 1, 19, 32), (1, 1, 33, 32), {}),
    "key_mask_gqa_f16": ("f16", (2, 2, 19, 16), (2, 1, 33, 16), {"mask_shape": (2, 1, 1, 33)}),
    "bshd_causal_bf16": ("bf16", (1, 19, 2 * 16), (1, 33, 16), {"num_heads": 2, "causal": True}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tc_backward(rng, name):
    dt, qs, ks, kw = CASES[name]
    got, want = check_case(rng, dt, qs, ks, kw)
    if name == "causal_sq_gt_sk_f16":     # the first 14 rows keep no key: zero dQ
        assert not f64(got[1])[..., :14, :].any() and not want[1][..., :14, :].any()
    if name == "key_mask_gqa_f16":        # batch row 1 keeps no key (_cudnn_grad_run)
        assert not any(f64(x[1]).any() for x in got)


def _tc_names(names, dt):
    """The tensor-core backward's two kernels ran, tier 2's none."""
    for kern in ("attention_bwd_dq tc ", "attention_bwd_dkv tc "):
        assert sum(x.startswith(kern) for x in names) == 1, names
    assert not any(x.startswith(("attention_bwd_dq " + dt, "attention_bwd_dkv " + dt))
                   for x in names), names


# window / softcap / bias: (dtype, q shape, k shape, attributes)
MASK_CASES = {
    "window_softcap_gqa_f16": ("f16", (1, 2, 19, 32), (1, 1, 33, 32),
                               {"window": 9, "softcap": 2.5, "scale": 0.3}),
    "mask_f32_bias_causal_bf16": ("bf16", (1, 1, 19, 16), (1, 1, 33, 16),
                                  {"mask_shape": (19, 33), "bias_shape": (1, 1, 19, 33),
                                   "bias_dtype": "f32", "causal": True}),
    "half_bias_gradient_f16": ("f16", (1, 2, 19, 16), (1, 1, 33, 16),
                               {"bias_shape": (2, 19, 33), "wrt_bias": True}),
}


def check_general(rng, name, dt, qs, ks, kw):
    """check_case for attributes _magnitudes does not take (window, softcap; a bias's
    gradient): O within 4 u of its magnitudes sum_j p_j |v_j| (on a GPU the tier 1 forward
    rounds P to the io dtype, so an O that cancels is off by u of those), every gradient within
    4 u of its largest entry."""
    kw = dict(kw)
    mask_shape, bias_shape = kw.pop("mask_shape", None), kw.pop("bias_shape", None)
    bias_dtype, wrt_bias = kw.pop("bias_dtype", None), kw.pop("wrt_bias", False)
    g, (q, k, v), extra, y = _graph(dt, qs, ks, mask_shape, bias_shape, bias_dtype, **kw)
    feed = _feed(rng, dt, qs, ks, mask_shape, bias_shape, bias_dtype)
    seed = rounded(rng.standard_normal(qs), dt)
    g.set_outputs([y, *g.grad(y, [q, k, v] + ([extra["bias"]] if wrt_bias else []),
                              seed=g.constant(seed))])
    exe = rlx.compile(g)
    _tc_names(_steps(exe), dt)
    got = exe.run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, mask=feed.get("m"),
                       bias=feed.get("bias"), **kw)
    o_mag = attention64(feed["q"], feed["k"], np.abs(feed["v"]), seed, mask=feed.get("m"),
                        bias=feed.get("bias"), **kw)[0]
    for i, what in enumerate(["o", "dq", "dk", "dv", "dbias"][:len(got)]):
        assert_half_close(got[i], want[i], dt, k=4.0, scale=np.abs(want[i]).max() if i else o_mag,
                          what=f"tc bwd {name} {what}")


@pytest.mark.parametrize("name", list(MASK_CASES))
def test_tc_backward_window_softcap_bias(rng, name):
    check_general(rng, name, *MASK_CASES[name])


def test_tc_backward_deterministic(rng, monkeypatch):
    """grad(deterministic=True) takes tier 1 (no atomics: a GQA group's dK / dV are summed in
    one block, dQ has a kernel of its own): two runs give the same bits."""
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_BWD_TIERS", "1,2")
    dt, qs, ks = "bf16", (1, 2, 19, 16), (1, 1, 19, 16)
    g = rlx.Graph("tc_bwd_det")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    y = g.attention(q, k, v, causal=True)
    seed = rounded(rng.standard_normal(qs), dt)
    g.set_outputs(g.grad(y, [q, k, v], seed=g.constant(seed), deterministic=True))
    exe = rlx.compile(g)
    _tc_names(_steps(exe), dt)
    feed = {n: rounded(rng.standard_normal(s), dt) for n, s in (("q", qs), ("k", ks), ("v", ks))}
    first, second = exe.run(feed), exe.run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, causal=True)[1:4]
    for a, b, w in zip(first, second, want):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        assert_half_close(a, w, dt, k=4.0, scale=np.abs(w).max(), what="deterministic")


def test_tc_backward_gpu_geometry(rng):
    """The GPU's geometry (4 warps: 64 rows a block, 64-column tiles) in the simulator: two
    row blocks, the second partial; GQA, causal. (Slow: 128 simulated threads.)"""
    from rlx_numba.kernels.launch import override_geometry
    if ON_GPU:
        pytest.skip("on a GPU it is the default (the GPU tests)")
    with override_geometry("attention_tc_bwd", ATB.GPU_GEOMETRY):
        check_case(rng, "bf16", (1, 2, 70, 16), (1, 1, 70, 16), {"causal": True})


class LazyCpAsync:
    """cp.async twins whose copies land only when a wait retires their group (the simulator's
    own twins copy at once): a kernel that reads a tile before waiting for its group reads
    stale data here, as it might on a GPU. Per simulated thread: its open group and its
    committed ones, oldest first. (The source is read when the copy is issued: it is read-only
    global memory.)"""

    def __init__(self):
        self.local = threading.local()

    def _state(self):
        if not hasattr(self.local, "groups"):
            self.local.open, self.local.groups = [], []
        return self.local

    def copy(self, dst, di, src, si):
        d, sv = flat(dst), flat(src)
        data = sv[si: si + 16 // sv.itemsize].view(np.uint8).copy()
        self._state().open.append((d, int(di), data))

    def commit(self):
        st = self._state()
        st.groups.append(st.open)
        st.open = []

    def wait(self, n):
        st = self._state()
        while len(st.groups) > n:
            for d, di, data in st.groups.pop(0):
                d[di: di + 16 // d.itemsize].view(np.uint8)[:] = data

    def wait_all(self):
        self.commit()
        self.wait(0)


@pytest.mark.parametrize("geo", ["sim", "gpu"])
def test_tc_backward_cp_async_groups(rng, monkeypatch, geo):
    """The kernels' cp.async groups and waits: with copies landing only at the wait that
    retires them, the gradients are still right (each tile read after its group's wait and a
    barrier). On the simulator's geometry and the GPU's (4 warps; slow)."""
    from rlx_numba.kernels import mma
    from rlx_numba.kernels.launch import override_geometry
    if ON_GPU:
        pytest.skip("the simulator's twins")
    lazy = LazyCpAsync()
    for name, fn in (("cp_async16", lazy.copy), ("cp_async_commit", lazy.commit),
                     ("cp_async_wait", lazy.wait), ("cp_async_wait_all", lazy.wait_all)):
        monkeypatch.setattr(mma, name, fn)
    g = ATB.GPU_GEOMETRY if geo == "gpu" else ATB.SIM_GEOMETRY
    with override_geometry("attention_tc_bwd", g):
        check_case(rng, "f16", (1, 2, 70 if geo == "gpu" else 33, 16),
                   (1, 1, 70 if geo == "gpu" else 19, 16), {"causal": True})


def _grad_graph(dt, qs, ks, **kw):
    g = rlx.Graph("tc_bwd")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    extra = {}
    if "bias_shape" in kw:
        extra["bias"] = g.input("bias", kw.pop("bias_shape"), dt)
    y = g.attention(q, k, v, **extra, **kw)
    g.set_outputs([y, *g.grad(y, [q, k, v], seed=g.constant(np.ones(qs, np.float32)))])
    return g


DECLINES = [
    ("f32", (1, 1, 19, 16), (1, 1, 33, 16), {}, "f32 operands (it takes f16 / bf16)"),
    ("bf16", (1, 1, 19, 24), (1, 1, 33, 24), {}, "head dim 24 (a multiple of 16 up to 128)"),
    ("f16", (1, 1, 19, 144), (1, 1, 33, 144), {}, "head dim 144"),
]


@pytest.mark.parametrize("dt,qs,ks,kw,why", DECLINES)
def test_tc_backward_declines_with_a_reason(monkeypatch, dt, qs, ks, kw, why):
    """Only backward tier 1 allowed: what it does not run fails to compile, naming the tier
    and why. (The forward on tier 2: tier 1's forward declines these cases first.)"""
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "2")
    with pytest.raises(NotImplementedError) as e:
        rlx.compile(_grad_graph(dt, qs, ks, **dict(kw)))
    assert "tier 1 (numba tensor-core backward): " + why in str(e.value), str(e.value)


def test_tc_backward_declined_falls_to_tier2(rng, monkeypatch, caplog):
    """Tiers 1 and 2 allowed: head dim 24 passes tier 1 over (logged) and tier 2's f32 kernels
    compute the gradients (with softcap and a window), right."""
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "2")    # head dim 24: not tier 1's forward
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_BWD_TIERS", "1,2")
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    dt, qs, ks, kw = "bf16", (1, 2, 9, 24), (1, 1, 13, 24), {"softcap": 2.0, "window": 6}
    g = rlx.Graph("tc_bwd_fall")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    y = g.attention(q, k, v, **kw)
    seed = rounded(rng.standard_normal(qs), dt)
    g.set_outputs([y, *g.grad(y, [q, k, v], seed=g.constant(seed))])
    with caplog.at_level("WARNING", logger="rlx_numba"):
        exe = rlx.compile(g)
    names = _steps(exe)
    assert not any(" tc " in x for x in names if x.startswith("attention_bwd")), names
    assert any(x.startswith("attention_bwd_dkv bf16") for x in names), names
    assert "tier 1 (numba tensor-core backward): head dim 24 (a multiple of 16 up to 128)" \
        in caplog.text, caplog.text
    feed = {n: rounded(rng.standard_normal(s), dt) for n, s in (("q", qs), ("k", ks), ("v", ks))}
    got = exe.run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, **kw)
    for i, what in enumerate(["o", "dq", "dk", "dv"]):
        assert_half_close(got[i], want[i], dt, k=4.0, scale=np.abs(want[i]).max() if i else None,
                          what=what)


def test_tc_backward_not_by_default_in_the_simulator(monkeypatch, caplog):
    """The simulator's default backward ladder passes tier 1 over (its mma twins are slow),
    saying why, and takes tier 2 (cuDNN, tier 0, is absent here)."""
    if ON_GPU:
        pytest.skip("the simulator's ladder (on a GPU cuDNN may take this case first)")
    monkeypatch.delenv("RLX_NUMBA_ATTENTION_BWD_TIERS")
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    with caplog.at_level("WARNING", logger="rlx_numba"):
        exe = rlx.compile(_grad_graph("bf16", (1, 1, 19, 16), (1, 1, 19, 16)))
    assert any(x.startswith("attention_bwd_dq bf16") for x in _steps(exe)), _steps(exe)
    assert "tier 1 (numba tensor-core backward): the simulator runs it only where " \
           "RLX_NUMBA_ATTENTION_BWD_TIERS names it" in caplog.text, caplog.text


def test_tc_backward_geometry():
    gpu = ATB.GPU_GEOMETRY
    assert (gpu.br, gpu.cols(32), gpu.cols(64), gpu.cols(128)) == (64, 64, 64, 16)
    for d in range(16, 129, 16):
        ATB.check(gpu, d)
        assert ATB.shared_bytes(gpu.br, gpu.cols(d), d) <= 48 * 1024
    with pytest.raises(ValueError, match="head dim 40"):
        ATB.check(gpu, 40)


# ---- the GPU kernels through NVVM and ptxas (where a CUDA toolkit is installed) --------------
@pytest.mark.skipif(ON_GPU or _toolkit() is None, reason="needs ptxas + libnvvm, no GPU")
@pytest.mark.parametrize("which,d,flags", [
    (ATB.DQ, 128, (True, False, False, False, False)),
    (ATB.DKV, 128, (True, False, False, False, False)),
    (ATB.DQ, 64, (True, True, True, True, True)),
    (ATB.DKV, 64, (True, True, True, True, True))], ids=["dq128", "dkv128", "dq64all", "dkv64all"])
def test_gpu_kernels_assemble_without_spills(tmp_path, which, d, flags):
    """Without a GPU: the GPU geometry's dQ / dK-dV kernel compiled to PTX with the GPU bodies
    and assembled by ptxas for sm_80 under the launch bounds: the mma / ldmatrix / cp.async
    instructions are there, nothing spills and nothing lives in local memory (no stack
    frame). Causal at D 128 (the most registers: 250 for dK / dV) and every flag (causal,
    window, mask, an f16 bias, softcap) at D 64 (the longest element loop, which the
    compiler left rolled at 64 columns: HEAVY_COLS). f16. (~10 s of CPU each.)"""
    compile_sm80(f"""
        from rlx_numba.kernels import attention_tc_bwd as T
        u16, f16, f32, i64, b1 = (types.uint16, types.float16, types.float32, types.int64,
                                  types.boolean)
        geo = T.GPU_GEOMETRY
        k = T.grads_tc(geo, {which}, {d}, *{flags!r}, "f16", "f16")
        sig = (f16[::1], u16[::1], u16[::1], u16[::1], u16[::1], f32[::1], f32[::1], b1[::1],
               f16[::1], i64[::1], f32, f32, i64)
        ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(8, 0),
                                  launch_bounds=(geo.threads, geo.min_blocks))
        open(os.path.join({str(tmp_path)!r}, "k.ptx"), "w").write(ptx)
    """, timeout=900)
    assemble_sm80(tmp_path / "k.ptx", no_stack=True, insns=(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "ldmatrix.sync.aligned.m8n8.x4.shared", "ldmatrix.sync.aligned.m8n8.x4.trans",
        "cp.async.cg.shared.global", "cp.async.wait_group 1", "cp.async.wait_group 0",
        "cvt.rn.f16x2.f32", "ex2.approx", "bar.sync"))


# ---- on a GPU (the lead runs these) -----------------------------------------------------------
gpu_only = pytest.mark.skipif(not ON_GPU, reason="the tensor-core backward at GPU sizes")

GPU_CASES = {
    "causal_gqa_d128_s333_bf16": ("bf16", (2, 8, 333, 128), (2, 2, 333, 128), {"causal": True}),
    "d64_s200_f16": ("f16", (2, 4, 200, 64), (2, 4, 200, 64), {}),
    "causal_bottom_right_d64_f16": ("f16", (1, 8, 200, 64), (1, 1, 333, 64), {"causal": True}),
    "causal_sq_gt_sk_d128_bf16": ("bf16", (1, 4, 333, 128), (1, 4, 200, 128), {"causal": True}),
    "key_mask_d128_bf16": ("bf16", (2, 4, 200, 128), (2, 4, 333, 128),
                           {"mask_shape": (2, 1, 1, 333), "scale": 0.1}),
    "bshd_d32_f16": ("f16", (2, 200, 4 * 32), (2, 333, 2 * 32), {"num_heads": 4, "causal": True}),
}


@gpu_only
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_tc_backward(rng, name):
    dt, qs, ks, kw = GPU_CASES[name]
    check_case(rng, dt, qs, ks, kw)


GPU_MASK_CASES = {
    "window_softcap_mask_bias_d64_bf16": ("bf16", (1, 4, 200, 64), (1, 2, 333, 64),
                                          {"window": 77, "softcap": 20.0,
                                           "mask_shape": (1, 1, 200, 333),
                                           "bias_shape": (4, 200, 333), "bias_dtype": "f32"}),
    "half_bias_gradient_d128_f16": ("f16", (2, 4, 200, 128), (2, 4, 200, 128),
                                    {"bias_shape": (1, 4, 200, 200), "wrt_bias": True,
                                     "causal": True}),
}


@gpu_only
@pytest.mark.parametrize("name", list(GPU_MASK_CASES))
def test_gpu_tc_backward_window_softcap_bias(rng, name):
    check_general(rng, name, *GPU_MASK_CASES[name])
