"""Channels-last (NHWC) vision ops (issue 32): conv, pool and adaptive_avg_pool with
``channels_last=True`` against float64 NumPy written here in the channels-last layout, in f32,
f16 and bf16 (tests/halfref.py); the 1x1 conv built as a product; gradients by finite
differences; ResNet channels_last against the channels-first model. In the simulator a 3x3
NHWC conv runs as transposes around the numba implicit-GEMM kernel; on a GPU the same tests
run it through cuDNN's NHWC descriptors (and the GPU-only tests below check that they do)."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from gradcheck import check
from halfref import HOST, assert_half_close, f64, half_accumulated, rounded
from rlx_numba.models import ResNet, ResNetConfig


def _tup(v, d):
    return (v,) * d if np.isscalar(v) else tuple(v)


def conv_nhwc_ref(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """y [N, *O, K] = sum over (tap, c) of x[n, o*stride - pad + tap*dilation, c] * w[k, tap, c]
    (x [N, *S, C], w [K, *k, C/groups]), in float64."""
    x, w = f64(x), f64(w)
    d = w.ndim - 2
    st, pd, dl, k = _tup(stride, d), _tup(padding, d), _tup(dilation, d), w.shape[1:-1]
    xp = np.pad(x, [(0, 0)] + [(p, p) for p in pd] + [(0, 0)])
    out = [(xp.shape[1 + i] - dl[i] * (k[i] - 1) - 1) // st[i] + 1 for i in range(d)]
    c, kc = x.shape[-1], w.shape[0]
    cg, kg = c // groups, kc // groups
    y = np.zeros((x.shape[0], *out, kc))
    for tap in np.ndindex(*k):
        sl = tuple(slice(tap[i] * dl[i], tap[i] * dl[i] + st[i] * (out[i] - 1) + 1, st[i])
                   for i in range(d))
        patch = xp[(slice(None),) + sl]                       # [N, *O, C]
        for gi in range(groups):
            y[..., gi * kg:(gi + 1) * kg] += np.einsum(
                "...c,kc->...k", patch[..., gi * cg:(gi + 1) * cg],
                w[(slice(gi * kg, (gi + 1) * kg),) + tap])
    return y if bias is None else y + f64(bias)


def pool_nhwc_ref(x, kind, k, stride, pad):
    """2-D max / avg pool (count_include_pad) over x [N, H, W, C], float64."""
    x = f64(x)
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, [(0, 0), (pad, pad), (pad, pad), (0, 0)], constant_values=fill)
    oh, ow = ((s + 2 * pad - k) // stride + 1 for s in x.shape[1:3])
    y = np.full((x.shape[0], oh, ow, x.shape[3]), fill)
    for i in range(k):
        for j in range(k):
            win = xp[:, i:i + stride * (oh - 1) + 1:stride, j:j + stride * (ow - 1) + 1:stride]
            y = np.maximum(y, win) if kind == "max" else y + win
    return y if kind == "max" else y / (k * k)


def _run(build, feed, params):
    g = rlx.Graph("nhwc")
    outs = build(g)
    g.set_outputs(outs if isinstance(outs, list) else [outs])
    exe = rlx.compile(g)
    for name, v in params.items():
        exe.set_param(name, v)
    return exe, exe.run(feed)


# ---- conv -------------------------------------------------------------------------------------
CASES = [  # x shape (channels last), w shape (channels last), conv kwargs
    ((2, 5, 7, 3), (4, 3, 3, 3), dict(padding=1)),
    ((1, 7, 6, 4), (6, 3, 2, 2), dict(stride=(2, 1), padding=(1, 0), dilation=(1, 2), groups=2)),
    ((2, 9, 3), (5, 3, 3), dict(stride=2, padding=1)),                       # 1-d [N, L, C]
    ((1, 3, 4, 5, 2), (3, 2, 1, 2, 2), dict(padding=(1, 0, 1))),             # 3-d
    ((2, 5, 6, 5), (4, 1, 1, 5), dict()),                                    # 1x1: a product
    ((1, 6, 4, 3), (5, 1, 1, 3), dict(stride=2)),                            # strided 1x1
    ((1, 5, 4, 3), (5, 1, 1, 3), dict(stride=2)),                            # 5 % 2: a conv node
]


# every case in f32 and bf16; f16 (the paths bf16 takes) on a general conv and the 1x1 product
@pytest.mark.parametrize("case, dtype", [(c, d) for c in range(len(CASES)) for d in ("f32", "bf16")]
                         + [(0, "f16"), (4, "f16")])
def test_conv_nhwc(rng, dtype, case):
    xs, ws, kw = CASES[case]
    x = rounded(rng.standard_normal(xs), dtype)
    w = rounded(rng.standard_normal(ws) / np.sqrt(np.prod(ws[1:])), dtype)
    b = rounded(rng.standard_normal(ws[0]), dtype)
    exe, (got,) = _run(lambda g: g.conv(g.input("x", xs, dtype), g.param("w", ws, dtype),
                                        g.param("b", (ws[0],), dtype), channels_last=True, **kw),
                       {"x": x}, {"w": w, "b": b})
    conv = conv_nhwc_ref(x, w, **kw)
    want = conv + f64(b)
    if dtype == "f32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:   # f32 sums, the conv rounded, then conv + bias rounded (one rounding where the
        # product fuses the bias): a rounding of |conv| and one of |want| per element
        assert_half_close(got, want, dtype, k=2.0, scale=np.abs(conv) + 2.0 ** -6,
                          what=f"conv nhwc {xs} {ws} {kw}")


def test_conv_nhwc_unbatched_and_no_bias(rng):
    x = rng.standard_normal((6, 5, 3)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    _, (got,) = _run(lambda g: g.conv(g.input("x", x.shape), g.param("w", w.shape), padding=1,
                                      channels_last=True), {"x": x}, {"w": w})
    np.testing.assert_allclose(got, conv_nhwc_ref(x[None], w, padding=1)[0], rtol=1e-5,
                               atol=1e-5)


def test_pointwise_conv_is_a_product(rng):
    """A channels-last 1x1 conv (stride dividing the size) is built as one linear: no conv
    node; relu(linear) folds into the linear (one product step, no element-wise kernel)."""
    g = rlx.Graph("pw")
    x = g.input("x", (2, 4, 6, 8), "bf16")
    w, b = g.param("w", (5, 1, 1, 8), "bf16"), g.param("b", (5,), "bf16")
    y = g.relu(g.conv(x, w, b, stride=2, channels_last=True))
    assert y.shape == (2, 2, 3, 5)
    ops = [n.op for n in g.nodes]
    assert "conv" not in ops and ops.count("linear") == 1, ops
    g.set_outputs([y])
    exe = rlx.compile(g)
    xv = rounded(rng.standard_normal((2, 4, 6, 8)), "bf16")
    wv = rounded(rng.standard_normal((5, 1, 1, 8)), "bf16")
    bv = rounded(rng.standard_normal(5), "bf16")
    exe.set_param("w", wv)
    exe.set_param("b", bv)
    (got,) = exe.run({"x": xv})
    assert_half_close(got, np.maximum(conv_nhwc_ref(xv, wv, bv, stride=2), 0), "bf16",
                      what="relu(1x1 conv)")
    names = [s.kernel_name for s in exe.steps]
    assert not [k for k in names if k.startswith("elementwise activation.relu")], names
    # a stride that does not divide the size, or padding, or groups: a conv node
    for kw, xs, ws in ((dict(stride=2), (1, 5, 4, 8), (5, 1, 1, 8)),
                       (dict(padding=1), (1, 4, 4, 8), (5, 1, 1, 8)),
                       (dict(groups=2), (1, 4, 4, 8), (6, 1, 1, 4))):
        h = rlx.Graph("conv")
        h.conv(h.input("x", xs), h.param("w", ws), channels_last=True, **kw)
        assert [n.op for n in h.nodes].count("conv") == 1, kw


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_pointwise_conv_residual_relu_folds(rng, dtype):
    """A bottleneck's last 1x1 conv, its skip and relu: relu(conv + bias + skip) is one product
    with a residual_first epilogue (cuBLASLt's C on a GPU; here the numba product and one
    epilogue kernel), the relu after the skip; the values as the float64 oracle's."""
    xs, ws = (2, 3, 5, 8), (6, 1, 1, 8)
    x, skip = rounded(rng.standard_normal(xs), dtype), rounded(rng.standard_normal((2, 3, 5, 6)),
                                                              dtype)
    w, b = rounded(rng.standard_normal(ws) / 3, dtype), rounded(rng.standard_normal(6), dtype)

    def build(g):
        y = g.conv(g.input("x", xs, dtype), g.param("w", ws, dtype), g.param("b", (6,), dtype),
                   channels_last=True)
        return g.relu(g.add(y, g.input("skip", skip.shape, dtype)))

    exe, (got,) = _run(build, {"x": x, "skip": skip}, {"w": w, "b": b})
    folds = [f for f, _ in exe.fusion.folds.values()]
    assert folds == ["relu epilogue"], exe.fusion.folds
    (node,) = exe.fusion.nodes.values()
    assert node.op == "linear" and node.attrs["residual_first"]
    assert node.attrs["activation"] == "relu"
    conv = conv_nhwc_ref(x, w)
    want = np.maximum(conv + f64(b) + f64(skip), 0)
    if dtype == "f32":
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    else:       # one rounding here (the graph unfused: three); cuBLASLt in half precision
        # rounds once more before it adds C (H100: 1.25 ulp off at 6.06): two roundings of
        # the product's magnitude
        assert_half_close(got, want, dtype, k=2.0,
                          scale=float(np.abs(conv + f64(b)).max()) if ON_GPU else None)
    names = [s.kernel_name for s in exe.steps]
    assert len([k for k in names if k.startswith("elementwise")]) <= 1, names
    if ON_GPU:   # one cuBLASLt call, C = skip: the values above check that C precedes the relu
        assert [k for k in names if "cublasLt" in k and "relu+residual" in k], names


def test_conv_nhwc_half_accumulation(rng):
    """256 channels x 3 taps of positive terms: the sums reach ~100 where a bf16 ulp is 0.5,
    so a running sum kept in bf16 drops most of each late term (its error is many ulps of the
    result); the f32 accumulator ends one rounding from the float64 value."""
    c = 256
    x = rounded(rng.uniform(0.5, 1.0, (1, 1, 3, c)), "bf16")
    w = rounded(rng.uniform(0.1, 0.2, (2, 1, 3, c)), "bf16")
    _, (got,) = _run(lambda g: g.conv(g.input("x", x.shape, "bf16"), g.param("w", w.shape, "bf16"),
                                      channels_last=True), {"x": x}, {"w": w})
    want = conv_nhwc_ref(x, w)
    assert_half_close(got, want, "bf16", k=1.0)
    bad = half_accumulated(x.reshape(1, -1), w.reshape(2, -1).T, "bf16").reshape(want.shape)
    with pytest.raises(AssertionError):
        assert_half_close(bad, want, "bf16", k=1.0)


def test_conv_nhwc_grad(rng):
    """dx, dw (and db) of a channels-last conv (stride, padding, groups) and of a 1x1 one by
    finite differences of the float64 oracle."""
    x = rng.standard_normal((1, 5, 4, 4))
    w = rng.standard_normal((4, 3, 2, 2))
    b = rng.standard_normal(4)
    seed = rng.standard_normal((1, 3, 5, 4)).astype(np.float32)
    g = rlx.Graph("grad")
    xs, ws, bs = g.input("x", x.shape), g.input("w", w.shape), g.input("b", b.shape)
    y = g.conv(xs, ws, bs, stride=(2, 1), padding=1, groups=2, channels_last=True)
    assert y.shape == seed.shape
    check(g, y, {"x": xs, "w": ws, "b": bs}, {"x": x, "w": w, "b": b},
          lambda x, w, b: conv_nhwc_ref(x, w, b, stride=(2, 1), padding=1, groups=2),
          seed=seed)
    w1 = rng.standard_normal((3, 1, 1, 4))
    seed1 = rng.standard_normal((1, 2, 2, 3)).astype(np.float32)
    g = rlx.Graph("grad1")
    xs, ws = g.input("x", (1, 5, 4, 4)), g.input("w", w1.shape)
    x5 = g.narrow(xs, 1, 0, 4)       # 4 rows: the stride 2 divides them (a product)
    y = g.conv(x5, ws, stride=2, channels_last=True)
    check(g, y, {"x": xs, "w": ws}, {"x": x, "w": w1},
          lambda x, w: conv_nhwc_ref(x[:, :4], w, stride=2), seed=seed1)


def test_conv_nhwc_autocast(rng):
    """g.autocast("bf16") keeps a conv channels last (the node's attrs go with it) and runs
    the conv and the 1x1 product in bf16."""
    x = rng.standard_normal((1, 5, 4, 3)).astype(np.float32)
    w3 = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) / 5
    w1 = rng.standard_normal((2, 1, 1, 4)).astype(np.float32) / 2
    g = rlx.Graph("ac")
    xs = g.input("x", x.shape)
    h = g.relu(g.conv(xs, g.param("w3", w3.shape), padding=1, channels_last=True))
    g.set_outputs([g.conv(h, g.param("w1", w1.shape), channels_last=True)])
    g16 = g.autocast("bf16")
    assert [n.attrs.get("channels_last") for n in g16.nodes if n.op == "conv"] == [True]
    assert {n.dtype.name for n in g16.nodes if n.op in ("conv", "linear")} == {"bf16"}
    exe = rlx.compile(g16)
    exe.set_param("w3", w3)
    exe.set_param("w1", w1)
    (got,) = exe.run({"x": x})
    xb, w3b, w1b = (f64(rounded(v, "bf16")) for v in (x, w3, w1))
    hb = f64(rounded(np.maximum(conv_nhwc_ref(xb, w3b, padding=1), 0), "bf16"))
    want = conv_nhwc_ref(hb, w1b)
    assert_half_close(np.asarray(got).astype(HOST["bf16"]), want, "bf16", k=2.0)


# ---- pools ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool_nhwc(rng, dtype, kind):
    x = rounded(rng.standard_normal((2, 7, 6, 3)), dtype)
    _, (got, ada) = _run(lambda g: [
        g.pool(g.input("x", x.shape, dtype), kind, 3, 2, 1, channels_last=True),
        g.adaptive_avg_pool(g.tensor(0), (3, 2), channels_last=True)], {"x": x}, {})
    want = pool_nhwc_ref(x, kind, 3, 2, 1)
    # adaptive windows of 7 -> 3: [0, 3), [2, 5), [4, 7); 6 -> 2: [0, 3), [3, 6)
    xf = f64(x)
    ada_want = np.stack([np.stack([xf[:, r0:r1, c0:c1].mean((1, 2))
                                   for c0, c1 in ((0, 3), (3, 6))], 1)
                         for r0, r1 in ((0, 3), (2, 5), (4, 7))], 1)
    if dtype == "f32":
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(ada, ada_want, rtol=1e-6, atol=1e-6)
    else:
        assert_half_close(got, want, dtype, k=1.0, what="pool")
        # two resample nodes (axes 1 and 2: not the last two, which one node would take): the
        # first's result is rounded too, a rounding of numbers up to max |x|
        assert_half_close(ada, ada_want, dtype, k=2.0, scale=np.abs(xf).max(), what="adaptive")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_pool_nhwc_ranks(rng, dtype):
    """1-d max (dilation, ceil_mode), 3-d avg (count_include_pad off) and an unbatched 2-d max
    channels last: the channels-first pool's values, transposed (bit for bit: the same f32
    window math, one rounding)."""
    cases = [((2, 11, 5), dict(kind="max", kernel_size=(3,), stride=2, padding=1, dilation=2,
                                ceil_mode=True)),
             ((1, 4, 5, 3, 6), dict(kind="avg", kernel_size=(2, 3, 2), stride=(1, 2, 1),
                                    padding=1, count_include_pad=False)),
             ((6, 5, 7), dict(kind="max", kernel_size=(2, 2)))]
    for shape, kw in cases:
        x = rounded(rng.standard_normal(shape), dtype)
        perm = (0, len(shape) - 1) + tuple(range(1, len(shape) - 1))
        if len(shape) == 3 and len(kw["kernel_size"]) == 2:        # unbatched [H, W, C]
            perm = (2, 0, 1)
        back = tuple(int(i) for i in np.argsort(perm))
        _, (got, want) = _run(lambda g: [
            g.pool(g.input("x", shape, dtype), channels_last=True, **kw),
            g.transpose(g.pool(g.transpose(g.tensor(0), perm), **kw), back)], {"x": x}, {})
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["avg", "max"])
def test_pool_nhwc_grad(rng, kind):
    x = rng.standard_normal((1, 5, 4, 2))
    seed = rng.standard_normal((1, 3, 3, 2)).astype(np.float32)
    g = rlx.Graph("pgrad")
    xs = g.input("x", x.shape)
    y = g.pool(xs, kind, 2, 2, 1, channels_last=True)
    check(g, y, {"x": xs}, {"x": x}, lambda x: pool_nhwc_ref(x, kind, 2, 2, 1), seed=seed)


# ---- errors -----------------------------------------------------------------------------------
def test_nhwc_errors():
    g = rlx.Graph("bad")
    x = g.input("x", (1, 5, 5, 3))
    with pytest.raises(ValueError, match="conv: channels_last must be True or False"):
        g.conv(x, g.param("w0", (4, 3, 3, 3)), channels_last="NHWC")
    with pytest.raises(ValueError, match=r"conv: w .*must have C/groups = 3 input channels"):
        g.conv(x, g.param("w1", (4, 3, 3, 2)), channels_last=True)    # KRSC: C last
    with pytest.raises(ValueError, match=r"conv: w .*must have C/groups = 3"):
        g.conv(x, g.param("w2", (4, 1, 1, 5)), channels_last=True)    # the 1x1 product path
    with pytest.raises(ValueError, match=r"conv: bias must be f32 \[4\]"):
        g.conv(x, g.param("w3", (4, 1, 1, 3)), g.param("b", (3,)), channels_last=True)
    with pytest.raises(ValueError, match=r"conv: x must be \[N, \*spatial, C\]"):
        g.conv(g.input("x2", (5, 3)), g.param("w4", (4, 3, 3, 3)), channels_last=True)
    with pytest.raises(ValueError, match="pool: x must be \\[N, \\*spatial, C\\]"):
        g.pool(g.input("x3", (5, 3)), "max", (2, 2), channels_last=True)
    with pytest.raises(ValueError, match="adaptive_avg_pool: channels_last must be"):
        g.adaptive_avg_pool(x, 1, channels_last=1)
    with pytest.raises(ValueError, match="ResNet: channels_last must be"):
        ResNet.from_config(ResNetConfig("basic", (1, 1, 1, 1), width=4, num_classes=5),
                           channels_last="yes")


# ---- ResNet -----------------------------------------------------------------------------------
def test_resnet_channels_last(rng):
    """Channels last gives the channels-first logits (same weights): f32 to f32 rounding; bf16
    (channels last by default) within bf16 roundings of them."""
    cfg = ResNetConfig("bottleneck", (1, 1, 1, 1), width=2, num_classes=3)
    x = rng.standard_normal((1, 3, 32, 33)).astype(np.float32)
    first = ResNet.from_config(cfg, seed=1).logits(x)
    last = ResNet.from_config(cfg, seed=1, channels_last=True)
    assert last.channels_last and not ResNet.from_config(cfg).channels_last
    np.testing.assert_allclose(last.logits(x), first, rtol=1e-4, atol=1e-5)
    half = ResNet.from_config(cfg, seed=1, dtype="bf16")
    assert half.channels_last
    got = half.logits(x)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, first, rtol=0.05, atol=0.05 * np.abs(first).max())


def test_cudnn_nhwc_strides():
    """The strides cuDNN's descriptors get: dims in its [N, C, *S] order, memory [N, *S, C]
    (a KRSC filter alike); channels first packed as before."""
    from rlx_numba.cudnn import packed_strides
    assert packed_strides([2, 3, 5, 7]) == [105, 35, 7, 1]
    assert packed_strides([2, 3, 5, 7], True) == [105, 1, 21, 3]
    assert packed_strides([4, 3, 1, 9], True) == [27, 1, 27, 3]          # 1-d as height 1
    assert packed_strides([2, 3, 4, 5, 6], True) == [360, 1, 90, 18, 3]  # 3-d


# ---- GPU: cuDNN's NHWC descriptors ---------------------------------------------------------------
@pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on the GPU only")
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_cudnn_nhwc_fused(rng, dtype, monkeypatch):
    """relu(conv + bias + z) and relu(conv + bias) channels last: each one cuDNN NHWC step
    with the fused epilogue, against the float64 oracle."""
    monkeypatch.delenv("RLX_NUMBA_CONV_TIERS", raising=False)
    monkeypatch.setattr(rlx.cublas, "allow_tf32", False)
    xs, ws = (2, 9, 8, 16), (32, 3, 3, 16)
    x = rounded(rng.standard_normal(xs), dtype)
    w = rounded(rng.standard_normal(ws) / 12.0, dtype)
    b = rounded(rng.standard_normal(32), dtype)
    z = rounded(rng.standard_normal((2, 5, 8, 32)), dtype)

    def build(g):
        xi, zi = g.input("x", xs, dtype), g.input("z", z.shape, dtype)
        wi, bi = g.param("w", ws, dtype), g.param("b", (32,), dtype)
        c1 = g.conv(xi, wi, bi, stride=(2, 1), padding=1, channels_last=True)
        c2 = g.conv(xi, wi, bi, stride=(2, 1), padding=1, channels_last=True)
        return [g.relu(g.add(c1, zi)), g.relu(c2)]

    exe, (got1, got2) = _run(build, {"x": x, "z": z}, {"w": w, "b": b})
    conv = conv_nhwc_ref(x, w, b, stride=(2, 1), padding=1)
    for got, want in ((got1, np.maximum(conv + f64(z), 0)), (got2, np.maximum(conv, 0))):
        if dtype == "f32":
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        else:
            assert_half_close(got, want, dtype, k=2.0)
    names = [s.kernel_name for s in exe.steps]
    assert sum("cudnn fwd +bias +z relu" in k and "NHWC" in k for k in names) == 1, names
    assert sum("cudnn fwd +bias relu" in k and "NHWC" in k for k in names) == 1, names
    assert len(names) == 2, names


@pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on the GPU only")
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cudnn_nhwc_plain_and_1d(rng, dtype, monkeypatch):
    """No epilogue (the graph API's engines timed beside the descriptor API's), grouped and
    dilated, and a 1-d conv as 2-d of height 1, channels last on cuDNN."""
    monkeypatch.delenv("RLX_NUMBA_CONV_TIERS", raising=False)
    monkeypatch.setattr(rlx.cublas, "allow_tf32", False)
    for xs, ws, kw in (((2, 11, 10, 8), (16, 3, 3, 4), dict(padding=2, dilation=2, groups=2)),
                       ((3, 17, 8), (8, 5, 8), dict(stride=2, padding=2))):
        x = rounded(rng.standard_normal(xs), dtype)
        w = rounded(rng.standard_normal(ws) / 8.0, dtype)
        exe, (got,) = _run(lambda g: g.conv(g.input("x", xs, dtype), g.param("w", ws, dtype),
                                            channels_last=True, **kw), {"x": x}, {"w": w})
        want = conv_nhwc_ref(x, w, **kw)
        assert any("cudnn fwd" in s.kernel_name and "NHWC" in s.kernel_name
                   for s in exe.steps), [s.kernel_name for s in exe.steps]
        if dtype == "f32":
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        else:
            assert_half_close(got, want, dtype, k=2.0)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on the GPU only")
def test_resnet50_channels_last_on_gpu(rng):
    """ResNet-50 in bf16 runs channels last: every 3x3 / 7x7 conv one cuDNN NHWC call (17),
    no im2col or numba conv kernel, the 1x1s products; its logits within bf16 roundings of the
    f32 channels-first model's."""
    ref = ResNet.from_config("resnet50", seed=0)
    m = ResNet(ref.config, ref.params, dtype="bf16")
    assert m.channels_last
    x = rng.standard_normal((2, 3, 64, 64)).astype(np.float32)
    got, want = m.logits(x), ref.logits(x)
    rel = np.abs(got - want).max() / np.abs(want).max()
    assert rel < 0.1, rel
    names = [s.kernel_name for s in m.executable(2, 64, 64).steps]
    assert sum("cudnn fwd" in k and "NHWC" in k for k in names) == 17, names
    assert not [k for k in names if "im2col" in k or "implicit-GEMM" in k], names
