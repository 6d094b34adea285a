"""dequantize / dequant_matmul against independent oracles: the gguf package's
``gguf.quants.dequantize`` (llama.cpp's own Python reference) for the GGUF block formats, and
NumPy written here for int8 / int4; products against float64 NumPy matmuls; gradients
against their closed forms in NumPy. Random valid blocks: random bytes with the f16 scale
fields set to finite values."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph

try:
    import gguf
    from gguf.quants import dequantize as gguf_dequantize
except ImportError:                 # the int8 / int4 tests need only NumPy
    gguf = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="the gguf package (the GGUF oracle) is "
                                "not installed")

GGUF = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
        "q8_0": (32, 34), "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144),
        "q5_k": (256, 176), "q6_k": (256, 210)}
# byte offsets of each block's f16 fields (ggml's block structs)
F16_AT = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q8_0": (0,),
          "q2_k": (80, 82), "q3_k": (108,), "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
QTYPE = {s: getattr(gguf.GGMLQuantizationType, s.upper()) for s in GGUF} if gguf else {}


def random_blocks(rng, scheme, n, k):
    """[n, k / block * bytes] u8: random bytes, each f16 field a random finite scale."""
    qk, bb = GGUF[scheme]
    raw = rng.integers(0, 256, (n, k // qk, bb), dtype=np.uint8)
    for at in F16_AT[scheme]:
        d = rng.uniform(-0.05, 0.05, (n, k // qk)).astype(np.float16)
        raw[:, :, at:at + 2] = d.view(np.uint8).reshape(n, k // qk, 2)
    return raw.reshape(n, -1)


def ref_int(scheme, q, scales, zeros, group_size):
    """f32 [N, K] of an int8 [N, K] / int4 [N, K / 2] weight, NumPy."""
    if scheme == "int4":
        q = np.stack([q & 15, q >> 4], axis=-1).reshape(q.shape[0], -1).astype(np.float64)
        q = q - (8.0 if zeros is None else np.repeat(zeros.reshape(q.shape[0], -1),
                                                    group_size or q.shape[1], axis=1))
    s = np.repeat(scales.reshape(q.shape[0], -1).astype(np.float64), group_size or q.shape[1],
                  axis=1)
    return q.astype(np.float64) * s


def _close(got, want, rel=1e-5):
    scale = max(np.abs(want).max(), 1e-30)
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * scale)


# the GEMM path's tolerance: on a GPU (cuBLAS) x and the dequantised weight are rounded to
# bf16 for tier 0's tensor cores (lower_quant.py); the simulator's products are f32
GEMM_REL = 1e-2 if ON_GPU else 1e-5


def _run_quant(scheme, raw, x, scales=None, zeros=None, group_size=None, wdtype="u8"):
    g = rlx.Graph("quant")
    w = g.param("w", raw.shape, wdtype)
    xs = g.input("x", x.shape)
    extra = {}
    feeds = {"x": x}
    if scales is not None:
        extra["scales"] = g.input("s", scales.shape)
        feeds["s"] = scales
    if zeros is not None:
        extra["zeros"] = g.input("z", zeros.shape, str(rlx.dtype(zeros.dtype)))
        feeds["z"] = zeros
    kw = dict(scheme=scheme, group_size=group_size)
    y = g.dequant_matmul(xs, w, **extra, **kw)
    wd = g.dequantize(w, **extra, **kw)
    g.set_outputs([y, wd])
    exe = rlx.compile(g)
    exe.set_param("w", raw)
    np.testing.assert_array_equal(exe.get_param("w"), raw)      # packed bytes kept as given
    return exe.run(feeds), g


@needs_gguf
@pytest.mark.parametrize("scheme", list(GGUF))
def test_gguf_gemv_and_dequantize(rng, scheme):
    qk, _ = GGUF[scheme]
    k = qk * (3 if qk == 32 else 1)
    raw = random_blocks(rng, scheme, 7, k)
    x = rng.standard_normal((3, k)).astype(np.float32)
    (y, wd), g = _run_quant(scheme, raw, x)
    want = gguf_dequantize(raw, QTYPE[scheme]).astype(np.float64)
    assert wd.shape == (7, k)
    _close(wd, want, 1e-6)
    _close(y, x.astype(np.float64) @ want.T)
    assert any(nd.op == "dequant_matmul" for nd in g.nodes)       # 3 rows: the GEMV path


@needs_gguf
@pytest.mark.parametrize("scheme", ["q4_0", "q4_k", "q8_0"])
def test_gemv_plan_of_a_lane_a_quarter(rng, monkeypatch, scheme):
    """The GPU's plan for few rows at M = 1 (warps sharing a row group's K, a lane a quarter
    unit: qpl 1), forced here through RLX_NUMBA_QGEMV (nw, r, wpr, qpl)."""
    monkeypatch.setenv("RLX_NUMBA_QGEMV", "2,2,2,1")
    qk, _ = GGUF[scheme]
    k = qk * (5 if qk == 32 else 2)
    raw = random_blocks(rng, scheme, 5, k)
    x = rng.standard_normal((1, k)).astype(np.float32)
    (y, _), g = _run_quant(scheme, raw, x)
    _close(y, x.astype(np.float64) @ gguf_dequantize(raw, QTYPE[scheme]).astype(np.float64).T)


@needs_gguf
@pytest.mark.parametrize("scheme", ["q4_0", "q5_1", "q6_k"])
def test_gguf_gemm_path(rng, scheme):
    """More than 16 rows of x: dequantize into the arena, then the matmul tiers."""
    qk, _ = GGUF[scheme]
    raw = random_blocks(rng, scheme, 5, qk)
    x = rng.standard_normal((2, 9, qk)).astype(np.float32)
    (y, _), g = _run_quant(scheme, raw, x)
    want = gguf_dequantize(raw, QTYPE[scheme]).astype(np.float64)
    assert y.shape == (2, 9, 5)
    _close(y, x.astype(np.float64) @ want.T, GEMM_REL)
    ops = [nd.op for nd in g.nodes]
    assert "dequant_matmul" not in ops and "dequantize" in ops and "matmul" in ops


@needs_gguf
@pytest.mark.parametrize("scheme", ["q4_0", "q4_k", "q6_k"])
def test_dequantize_to_bf16_kernel(rng, scheme):
    """The GEMM path's bf16 dequantisation (tier 0's weight on a GPU), run as a kernel: each
    weight the f32 value rounded to the nearest bf16 (ties to even), two a word, low first."""
    from numba import cuda

    from rlx_numba.kernels import quant as Q
    qk, _ = GGUF[scheme]
    n, k = 3, qk * (3 if qk == 32 else 1)
    raw = random_blocks(rng, scheme, n, k)
    want = gguf_dequantize(raw, QTYPE[scheme]).astype(np.float32)
    out = cuda.to_device(np.zeros(n * k // 2, np.uint32))
    dummy = cuda.to_device(np.zeros(1, np.float32))
    kern = Q.dequant_units_kernel(scheme, False, Q.group_shift(k // 32), bf16=True)
    kern[2, 32](out, cuda.to_device(raw.reshape(-1).view(np.uint16)), dummy, dummy, np.int64(n),
                np.int64(k), np.int64(k // 32), np.int64(raw.shape[1] // 2), np.int64(1),
                np.int64(k // 32), cuda.to_device(np.zeros(1, np.int64)), np.int64(n))
    bits = want.reshape(-1).view(np.uint32).astype(np.uint64)
    rne = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    as_f32 = lambda h: (h.astype(np.uint32) << 16).view(np.float32)   # noqa: E731
    np.testing.assert_array_equal(as_f32(out.copy_to_host().view(np.uint16)), as_f32(rne))


@pytest.mark.skipif(not ON_GPU, reason="the bf16 GEMM path needs cuBLAS (a GPU)")
def test_gemm_path_takes_bf16_tensor_cores(rng, monkeypatch):
    """On a GPU the dequantised weight is written bf16 and the product runs on tier 0; with
    tier 0 excluded it stays f32 (and exact to f32 rounding)."""
    k, n, m = 128, 40, 33
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    scales = rng.uniform(0.01, 0.1, (n,)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = x.astype(np.float64) @ ref_int("int8", q, scales, None, None).T
    for tiers, rel, step in (("0,1,2", 1e-2, "to bf16"), ("1,2", 1e-5, "int8 40x128")):
        monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
        g = rlx.Graph("q")
        w, xs, s = g.param("w", (n, k), "i8"), g.input("x", (m, k)), g.input("s", (n,))
        g.set_outputs([g.dequant_matmul(xs, w, s, scheme="int8")])
        exe = rlx.compile(g)
        exe.set_param("w", q)
        (y,) = exe.run({"x": x, "s": scales})
        _close(y, want, rel)
        assert any(st.kernel_name.startswith("dequantize") and st.kernel_name.endswith(step)
                   for st in exe.steps), [st.kernel_name for st in exe.steps]


@pytest.mark.parametrize("scheme,k,group_size,zeros,m", [
    ("int8", 64, None, False, 2),     # per channel, unit kernels
    ("int8", 96, 32, False, 1),       # per group
    ("int8", 192, 96, False, 2),      # groups of 3 units: a division, not a shift
    ("int8", 40, None, False, 3),     # K not whole units: element kernel + matmul
    ("int4", 64, 32, False, 2),       # zero 8
    ("int4", 128, 64, True, 4),       # zeros given (u8)
    ("int4", 50, 10, True, 1),        # groups of 10: element kernel + matmul
    ("int4", 64, None, True, 18),     # per channel, GEMM path
])
def test_int_schemes(rng, scheme, k, group_size, zeros, m):
    n = 6
    ng = 1 if group_size is None else k // group_size
    if scheme == "int8":
        q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    else:
        q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    sshape = (n,) if group_size is None else (n, ng)
    scales = rng.uniform(0.01, 0.1, sshape).astype(np.float32)
    zr = rng.integers(0, 16, sshape).astype(np.uint8) if zeros else None
    x = rng.standard_normal((m, k)).astype(np.float32)
    (y, wd), _ = _run_quant(scheme, q, x, scales, zr, group_size,
                             wdtype="i8" if scheme == "int8" else "u8")
    want = ref_int(scheme, q, scales, zr, group_size)
    _close(wd, want, 1e-6)
    _close(y, x.astype(np.float64) @ want.T, GEMM_REL if m > 16 else 1e-5)


def test_int4_nibble_order_spelled_out():
    """Weight 2j is the low nibble: byte 0x21 holds (1, 2); zero 8, scale 0.5."""
    q = np.array([[0x21, 0xF0] + [0x88] * 14], np.uint8)           # K = 32
    g = rlx.Graph("nib")
    w = g.param("w", q.shape, "u8")
    s = g.constant(np.array([0.5], np.float32))
    g.set_outputs([g.dequantize(w, s, scheme="int4")])
    exe = rlx.compile(g)
    exe.set_param("w", q)
    (wd,) = exe.run({})
    assert list(wd[0, :4]) == [-3.5, -3.0, -4.0, 3.5] and np.all(wd[0, 4:] == 0)


@needs_gguf
def test_half_x_and_leading_dims(rng):
    raw = random_blocks(rng, "q8_0", 4, 64)
    x = rng.standard_normal((2, 1, 64)).astype(np.float16)
    g = rlx.Graph("half")
    w = g.param("w", raw.shape, "u8")
    xs = g.input("x", x.shape, "f16")
    y = g.dequant_matmul(xs, w, scheme="q8_0")
    assert y.shape == (2, 1, 4) and str(y.dtype) == "f32"
    g.set_outputs([y])
    exe = rlx.compile(g)
    exe.set_param("w", raw)
    (got,) = exe.run({"x": x})
    want = x.astype(np.float64) @ gguf_dequantize(raw, QTYPE["q8_0"]).astype(np.float64).T
    _close(got, want)


@pytest.mark.parametrize("m", [2, 20])
def test_gradients(rng, m):
    """loss = sum(y * r): dx = r @ W; int4 dscale = sum over the group of (r^T x) (q - z),
    dzero = -sum over the group of (r^T x) scale (NumPy, closed form)."""
    n, k, gs = 5, 64, 32
    q = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (n, k // gs)).astype(np.float32)
    zr = rng.uniform(6, 9, (n, k // gs)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    g = rlx.Graph("qgrad")
    w = g.param("w", q.shape, "u8")
    xs, ss, zs = g.input("x", x.shape), g.input("s", scales.shape), g.input("z", zr.shape)
    rs = g.input("r", r.shape)
    y = g.dequant_matmul(xs, w, ss, zs, scheme="int4", group_size=gs)
    loss = g.reduce_sum(g.mul(y, rs))
    dx, ds, dz = g.grad(loss, [xs, ss, zs])
    g.set_outputs([dx, ds, dz])
    exe = rlx.compile(g)
    exe.set_param("w", q)
    got_dx, got_ds, got_dz = exe.run({"x": x, "s": scales, "z": zr, "r": r})
    W = ref_int("int4", q, scales, zr, gs)
    _close(got_dx, r.astype(np.float64) @ W)
    dW = (r.astype(np.float64).T @ x.astype(np.float64)).reshape(n, k // gs, gs)
    nib = np.stack([q & 15, q >> 4], axis=-1).reshape(n, k // gs, gs).astype(np.float64)
    _close(got_ds, (dW * (nib - zr[..., None])).sum(-1))
    _close(got_dz, -(dW.sum(-1) * scales))


@needs_gguf
def test_gguf_x_gradient(rng):
    raw = random_blocks(rng, "q4_k", 3, 256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    g = rlx.Graph("qgrad2")
    w = g.param("w", raw.shape, "u8")
    xs = g.input("x", x.shape)
    dx = g.grad(g.reduce_sum(g.dequant_matmul(xs, w, scheme="q4_k")), xs)
    g.set_outputs([dx])
    exe = rlx.compile(g)
    exe.set_param("w", raw)
    (got,) = exe.run({"x": x})
    _close(got, gguf_dequantize(raw, QTYPE["q4_k"]).astype(np.float64).sum(0, keepdims=True))


def test_errors():
    g = rlx.Graph("qerr")
    x = g.input("x", (2, 64))
    w = g.param("w", (4, 36), "u8")
    with pytest.raises(ValueError, match=r"dequant_matmul: unknown scheme 'q4_2'"):
        g.dequant_matmul(x, w, scheme="q4_2")
    with pytest.raises(ValueError, match=r"K = 100 is not a multiple of q4_0's block of 32"):
        g.dequant_matmul(g.input("x2", (1, 100)), w, scheme="q4_0")
    with pytest.raises(ValueError, match=r"K = 64 is not a multiple of q4_k's block of 256"):
        g.dequant_matmul(x, g.param("wk", (4, 144), "u8"), scheme="q4_k")
    with pytest.raises(ValueError, match=r"whole 20-byte blocks; w u8 \[4, 36\]"):
        g.dequant_matmul(x, w, scheme="q4_1")
    with pytest.raises(ValueError, match=r"w u8 \[4, 36\] is 64 weights a row .* x has K = 96"):
        g.dequant_matmul(g.input("x3", (1, 96)), w, scheme="q4_0")
    with pytest.raises(ValueError, match=r"raw GGUF bytes, u8; got i8"):
        g.dequant_matmul(x, g.param("wi", (4, 36), "i8"), scheme="q4_0")
    with pytest.raises(ValueError, match=r"q4_0 keeps its scales inside the blocks"):
        g.dequant_matmul(x, w, g.input("s", (4,)), scheme="q4_0")
    w8 = g.param("w8", (4, 64), "i8")
    with pytest.raises(ValueError, match=r"int8 needs scales"):
        g.dequant_matmul(x, w8, scheme="int8")
    with pytest.raises(ValueError, match=r"scales must be \[4, 2\] for w i8 \[4, 64\] and "
                                         r"group_size 32, got \[4, 3\]"):
        g.dequant_matmul(x, w8, g.input("s3", (4, 3)), scheme="int8", group_size=32)
    with pytest.raises(ValueError, match=r"K = 64 is not a multiple of group_size 24"):
        g.dequant_matmul(x, w8, g.input("s4", (4, 2)), scheme="int8", group_size=24)
    with pytest.raises(ValueError, match=r"an int4 w must be u8, got i8"):
        g.dequant_matmul(x, w8, g.input("s5", (4,)), scheme="int4")
    with pytest.raises(ValueError, match=r"int8 is symmetric"):
        g.dequant_matmul(x, w8, g.input("s6", (4,)), g.input("z6", (4,)), scheme="int8")
    with pytest.raises(ValueError, match=r"x must be a float tensor"):
        g.dequant_matmul(g.input("xi", (2, 64), "i32"), w, scheme="q4_0")


def test_u8_i8_params_and_io(rng):
    a = rng.integers(0, 256, (3, 5), dtype=np.uint8)
    b = rng.integers(-128, 128, (5,), dtype=np.int8)
    g = rlx.Graph("bytes")
    pa, xb = g.param("a", a.shape, "u8"), g.input("b", b.shape, "i8")
    g.set_outputs([g.add(g.cast(pa, "i32"), xb), pa])
    got, back = run_graph(g, {"b": b}, params={"a": a})
    np.testing.assert_array_equal(got, a.astype(np.int32) + b)
    assert back.dtype == np.uint8
    np.testing.assert_array_equal(back, a)


@needs_gguf
@pytest.mark.parametrize("scheme", ["q8_0", "q4_k"])
def test_dequantize_rows_is_an_embedding_lookup(rng, scheme):
    qk, _ = GGUF[scheme]
    raw = random_blocks(rng, scheme, 9, qk)
    ids = np.array([[3, 0, 8], [3, 5, 1]], np.int64)
    g = rlx.Graph("qgather")
    w = g.param("w", raw.shape, "u8")
    xi = g.input("ids", ids.shape, "i64")
    rows = g.dequantize(w, scheme=scheme, rows=xi)
    assert rows.shape == (2, 3, qk)
    g.set_outputs([rows])
    exe = rlx.compile(g)
    exe.set_param("w", raw)
    (got,) = exe.run({"ids": ids})
    _close(got, gguf_dequantize(raw, QTYPE[scheme]).astype(np.float64)[ids], 1e-6)
    with pytest.raises(IndexError, match=r"dequantize %\d+ \(rows of a 9-row table\)"):
        exe.run({"ids": np.array([[3, 0, 9], [0, 0, 0]], np.int64)})
    with pytest.raises(ValueError, match=r"dequantize: rows must be i32 or i64"):
        g.dequantize(w, scheme=scheme, rows=g.input("f", (2,)))


@pytest.mark.parametrize("m", [1, 3])
def test_fused_epilogues(rng, m):
    """bias + activation + residual, and a gated (SwiGLU) pair of interleaved columns, fold
    into the quantised GEMV (passes/fusion.py) and give the unfused values."""
    n, k = 6, 64
    q = rng.integers(-128, 128, (n, k), dtype=np.int8)
    s = rng.uniform(0.01, 0.05, (n,)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    res = rng.standard_normal((m, n)).astype(np.float32)
    res2 = rng.standard_normal((m, n // 2)).astype(np.float32)
    g = rlx.Graph("qepi")
    w, ss = g.param("w", q.shape, "i8"), g.constant(s)
    xs, bs, rs, r2 = (g.input(a, v.shape) for a, v in (("x", x), ("b", b), ("r", res), ("r2", res2)))
    y1 = g.gelu_tanh(g.dequant_matmul(xs, w, ss, scheme="int8") + bs) + rs
    y2 = g.gated(g.dequant_matmul(xs, w, ss, scheme="int8") + bs, "silu", interleaved=True) + r2
    g.set_outputs([y1, y2])
    exe = rlx.compile(g)
    exe.set_param("w", q)
    kinds = sorted(kind for kind, _ in exe.fusion.folds.values())
    assert kinds == ["gated epilogue", "matmul epilogue"], kinds
    # two GEMVs with their epilogues, and the add after the gated pair (not folded, as for f32)
    assert [st.kernel_name.split(" ")[:3] for st in exe.steps][:2] == [
        ["dequant", "gemv", "int8+bias+gelu_tanh+residual"], ["dequant", "gemv", "int8+bias+gated"]]
    assert len(exe.steps) == 3, [st.kernel_name for st in exe.steps]
    got1, got2 = exe.run({"x": x, "b": b, "r": res, "r2": res2})
    z = x.astype(np.float64) @ (q.astype(np.float64) * s[:, None]).T + b
    gelu = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    _close(got1, gelu + res)
    gate, up = z[:, 0::2], z[:, 1::2]
    _close(got2, gate / (1 + np.exp(-gate)) * up + res2)


@needs_gguf
@pytest.mark.parametrize("scheme", ["q4_k", "q4_0", "q5_1", "q8_0"])
def test_quantize_round_trip(rng, scheme):
    """rlx_numba.models.weights.quantize: blocks gguf's dequantize reads back within half a
    quantisation step (q4_k: the 4-bit step of each sub-block, plus its 6-bit scale's
    rounding); the GEMV reads the same blocks."""
    from rlx_numba.models.weights import quantize
    w = rng.standard_normal((3, 512)).astype(np.float32)
    raw = quantize(w, scheme)
    back = gguf_dequantize(raw, QTYPE[scheme]).reshape(w.shape)
    sub = w.reshape(3, -1, 32)
    step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / (255 if scheme == "q8_0" else 15)
    err = np.abs(back - w).reshape(3, -1, 32).max(-1)
    assert np.all(err <= 1.2 * step), (err / step).max()
    with pytest.raises(ValueError, match=r"K = 100 is not a multiple of q4_k's block of 256"):
        quantize(w[:, :100], "q4_k")


@needs_gguf
def test_llama_quantized_model(rng):
    """LlamaForCausalLM.quantized: every projection, the token table and the tied head packed
    (q5_1; K-quants need K = 256, too big a model for the simulator: test_quantize_round_trip
    covers q4_k's blocks), fused packs of one scheme; logits equal the f32 model holding the
    dequantised values, in NumPy (generate with packed weights: test_loaders)."""
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    q = LlamaForCausalLM.from_config(cfg, seed=0, exec_mode="stream").quantized("q5_1")
    assert len(q.packed) == 8 and {s for s, _ in q.packed.values()} == {"q5_1"}
    ref = LlamaForCausalLM(cfg, q.params, exec_mode="stream")
    ids = np.array([[3, 4, 5]], np.int32)
    exe = q.executable("forward", 1, 3)
    # qkv, o, gate_up, down and the table (the head too)
    assert sum(n.op == "param" and str(n.dtype) == "u8" for n in exe.graph.nodes) == 5
    (got,) = exe.run({"input_ids": ids})
    # the f32 model's logits: test_models' NumPy Llama over the dequantised values (that model
    # on the device equals it: test_models)
    from test_models import np_llama
    _close(got, np_llama(cfg, q.params, ids), rel=2e-5)
    ref.executable("forward", 1, 3)             # compiled, not run: its weights on the device
    assert q.device_bytes()["u8"] < 0.2 * ref.device_bytes()["f32"]


def _grouped_case(rng, scheme, e, n, k, group_size=None, zeros=False):
    """(packed w [E, N, ...], scales, zeros, the f32 experts [E, N, K] in float64)."""
    if scheme in GGUF:
        raw = np.stack([random_blocks(rng, scheme, n, k) for _ in range(e)])
        return raw, None, None, np.stack([gguf_dequantize(r, QTYPE[scheme]) for r in raw]).astype(np.float64)
    ng = k // group_size if group_size else 1
    sc = rng.uniform(0.01, 0.1, (e, n, ng) if group_size else (e, n)).astype(np.float32)
    zr = rng.uniform(6, 9, sc.shape).astype(np.float32) if zeros else None
    q = (rng.integers(0, 256, (e, n, k // 2), dtype=np.uint8) if scheme == "int4"
         else rng.integers(-128, 128, (e, n, k), dtype=np.int8))
    wd = np.stack([ref_int(scheme, q[i], sc[i], None if zr is None else zr[i], group_size)
                   for i in range(e)])
    return q, sc, zr, wd


@pytest.mark.parametrize("scheme,k,group_size,zeros", [
    pytest.param("q4_0", 64, None, False, marks=needs_gguf),
    pytest.param("q4_k", 256, None, False, marks=needs_gguf),
    ("int4", 64, 32, True),
    ("int8", 64, None, False),
])
@pytest.mark.parametrize("m", [4, 17])      # the GEMV a row, and dequantize + grouped_matmul
def test_dequant_grouped_matmul(rng, scheme, k, group_size, zeros, m):
    """out[i] = x[i] @ dequant(w[ids[i]])^T for 3 experts of 5 rows, ids with repeats and an
    unused expert; dx through g.grad (dy @ the row's expert); a host id out of range raises."""
    e, n = 3, 5
    w, sc, zr, wd = _grouped_case(rng, scheme, e, n, k, group_size, zeros)
    ids = np.array(([0, 2, 2, 0] * 5)[:m], np.int32)              # expert 1 unused
    x = rng.standard_normal((m, k)).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    g = rlx.Graph("dgmm")
    xs, ids_in, rs = g.input("x", x.shape), g.input("ids", (m,), "i32"), g.input("r", r.shape)
    pw = g.param("w", w.shape, "i8" if scheme == "int8" else "u8")
    extra = [g.param("s", sc.shape) if sc is not None else None,
             g.param("z", zr.shape) if zr is not None else None]
    y = g.dequant_grouped_matmul(xs, pw, ids_in, *extra, scheme=scheme, group_size=group_size)
    dx = g.grad(g.reduce_sum(g.mul(y, rs)), xs)
    g.set_outputs([y, dx])
    assert any(nd.op == "dequant_grouped_matmul" for nd in g.nodes) == (m <= 16)
    exe = rlx.compile(g)
    exe.set_param("w", w)
    for name, v in (("s", sc), ("z", zr)):
        if v is not None:
            exe.set_param(name, v)
    got, got_dx = exe.run({"x": x, "ids": ids, "r": r})
    _close(got, np.einsum("mk,mnk->mn", x.astype(np.float64), wd[ids]))
    _close(got_dx, np.einsum("mn,mnk->mk", r.astype(np.float64), wd[ids]))
    with pytest.raises(IndexError, match="dequant_grouped_matmul|grouped_matmul"):
        exe.run({"x": x, "ids": np.full(m, 3, np.int32), "r": r})


def test_dequant_grouped_matmul_errors():
    g = rlx.Graph("dgerr")
    x, ids = g.input("x", (2, 64)), g.input("ids", (2,), "i32")
    w = g.param("w", (3, 5, 36), "u8")
    with pytest.raises(ValueError, match=r"dequant_grouped_matmul: w must be 3-D \[E, N, packed "
                                         r"K\]"):
        g.dequant_grouped_matmul(x, g.param("w2", (15, 36), "u8"), ids, scheme="q4_0")
    with pytest.raises(ValueError, match=r"dequant_grouped_matmul: w u8 \[15, 36\] is 64 "
                                         r"weights a row .* x has K = 32 \(w u8 \[3, 5, 36\]: "
                                         r"its 3 experts' rows"):
        g.dequant_grouped_matmul(g.input("x3", (2, 32)), w, ids, scheme="q4_0")
    with pytest.raises(ValueError, match=r"expert_ids must be i32 / i64 \[2\]"):
        g.dequant_grouped_matmul(x, w, g.input("i3", (3,), "i32"), scheme="q4_0")
    with pytest.raises(ValueError, match=r"dequant_grouped_matmul: w u8 \[0, 5, 36\] has no experts"):
        g.dequant_grouped_matmul(x, g.param("w0", (0, 5, 36), "u8"), ids, scheme="q4_0")
    w4 = g.param("w4", (3, 5, 32), "u8")
    with pytest.raises(ValueError, match=r"scales must be \[E=3, N=5\] or \[E, N, K // "
                                         r"group_size\] for w u8 \[3, 5, 32\], got \[5, 2\]"):
        g.dequant_grouped_matmul(x, w4, ids, g.input("s", (5, 2)), scheme="int4", group_size=32)


@needs_gguf
def test_quantized_k_quant_falls_back_to_q5_0():
    """quantized("q4_k"): a weight whose K is not a multiple of 256 takes q5_0 (llama.cpp's
    fallback) instead of staying f32; logits equal the f32 model holding the same values
    (in NumPy)."""
    from rlx_numba.models import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    q = LlamaForCausalLM.from_config(cfg, seed=0, exec_mode="stream").quantized("q4_k")
    schemes = {name: s for name, (s, _) in q.packed.items()}
    assert schemes.pop("model.layers.0.mlp.down_proj.weight") == "q4_k"      # K = 256
    assert len(schemes) == 7 and set(schemes.values()) == {"q5_0"}           # K = 64
    ids = np.array([[3, 4, 5]], np.int32)
    (got,) = q.executable("forward", 1, 3).run({"input_ids": ids})
    from test_models import np_llama     # the f32 model holding these values, in NumPy
    _close(got, np_llama(cfg, q.params, ids), rel=2e-5)
