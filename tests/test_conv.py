"""conv and conv_transpose (1/2/3-d) against NumPy references written here (a sum over kernel
offsets of strided slices of the zero-padded input; the transpose as the scatter of each input
element through the kernel, then cropped), gradients against finite differences."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from gradcheck import check


def conv_ref(x, w, b=None, stride=1, padding=0, dilation=1, groups=1):
    d = w.ndim - 2
    st, dl = (stride,) * d if np.isscalar(stride) else stride, \
        (dilation,) * d if np.isscalar(dilation) else dilation
    k = w.shape[2:]
    if padding == "same":
        tot = [dl[i] * (k[i] - 1) for i in range(d)]
        pads = [(t // 2, t - t // 2) for t in tot]
    elif padding == "valid":
        pads = [(0, 0)] * d
    else:
        p = (padding,) * d if np.isscalar(padding) else padding
        pads = [(q, q) for q in p]
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + pads)
    n, c = x.shape[:2]
    cout, cg, cog = w.shape[0], c // groups, w.shape[0] // groups
    out = [(xp.shape[2 + i] - dl[i] * (k[i] - 1) - 1) // st[i] + 1 for i in range(d)]
    y = np.zeros((n, cout, *out))
    for kidx in np.ndindex(*k):
        sl = tuple(slice(kidx[i] * dl[i], kidx[i] * dl[i] + st[i] * (out[i] - 1) + 1, st[i])
                   for i in range(d))
        patch = xp[(slice(None), slice(None)) + sl]
        for gi in range(groups):
            wk = w[(slice(gi * cog, (gi + 1) * cog), slice(None)) + kidx].astype(np.float64)
            y[:, gi * cog:(gi + 1) * cog] += np.einsum("oc,nc...->no...", wk,
                                                       patch[:, gi * cg:(gi + 1) * cg])
    if b is not None:
        y += b.reshape((1, -1) + (1,) * d)
    return y


def conv_t_ref(x, w, b=None, stride=1, padding=0, output_padding=0, dilation=1, groups=1):
    d = w.ndim - 2
    tup = lambda v: (v,) * d if np.isscalar(v) else v    # noqa: E731
    st, p, op, dl = tup(stride), tup(padding), tup(output_padding), tup(dilation)
    n, c = x.shape[:2]
    size, k = x.shape[2:], w.shape[2:]
    cg, cog = c // groups, w.shape[1]
    full = [(size[i] - 1) * st[i] + dl[i] * (k[i] - 1) + 1 + op[i] for i in range(d)]
    y = np.zeros((n, cog * groups, *full))
    for kidx in np.ndindex(*k):
        sl = tuple(slice(kidx[i] * dl[i], kidx[i] * dl[i] + st[i] * (size[i] - 1) + 1, st[i])
                   for i in range(d))
        for gi in range(groups):
            wk = w[(slice(gi * cg, (gi + 1) * cg), slice(None)) + kidx].astype(np.float64)
            y[(slice(None), slice(gi * cog, (gi + 1) * cog)) + sl] += np.einsum(
                "co,nc...->no...", wk, x[:, gi * cg:(gi + 1) * cg].astype(np.float64))
    y = y[(slice(None), slice(None)) + tuple(slice(p[i], full[i] - p[i]) for i in range(d))]
    if b is not None:
        y += b.reshape((1, -1) + (1,) * d)
    return y


CONV_CASES = [
    # x shape, w shape, kwargs
    ((2, 3, 11), (4, 3, 3), dict(stride=2, padding=1)),                          # 1-d
    ((1, 4, 9), (4, 1, 5), dict(padding="same", dilation=2, groups=4)),          # depthwise same
    ((2, 4, 7, 6), (6, 2, 3, 2), dict(stride=(2, 1), padding=(1, 2), dilation=(1, 2),
                                      groups=2)),
    ((1, 3, 8, 7), (5, 3, 1, 1), dict()),                                        # 1x1
    ((2, 2, 9, 8), (3, 2, 4, 3), dict(padding="same")),                          # even kernel
    ((1, 2, 7, 5), (3, 2, 7, 3), dict(stride=2, padding=3)),                     # 7x7 s2
    ((1, 2, 5, 4, 6), (3, 2, 2, 3, 3), dict(stride=(1, 2, 1), padding=(0, 1, 1))),   # 3-d
    ((2, 5, 6), (2, 5, 6), dict(padding="valid")),                               # whole input
]


@pytest.mark.parametrize("xs,ws,kw", CONV_CASES)
def test_conv(rng, xs, ws, kw):
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ws).astype(np.float32)
    b = rng.standard_normal(ws[0]).astype(np.float32)
    g = rlx.Graph("conv")
    y = g.conv(g.input("x", xs), g.param("w", ws), g.param("b", (ws[0],)), **kw)
    g.set_outputs([y])
    (got,) = run_graph(g, {"x": x}, {"w": w, "b": b})
    want = conv_ref(x, w, b, **kw)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_unbatched_and_no_bias(rng):
    x = rng.standard_normal((3, 6, 5)).astype(np.float32)
    w = rng.standard_normal((2, 3, 3, 3)).astype(np.float32)
    g = rlx.Graph("conv")
    y = g.conv(g.input("x", x.shape), g.input("w", w.shape), padding=1)
    assert y.shape == (2, 6, 5)
    g.set_outputs([y])
    (got,) = run_graph(g, {"x": x, "w": w})
    np.testing.assert_allclose(got, conv_ref(x[None], w, padding=1)[0], rtol=1e-4, atol=1e-4)


CONV_T_CASES = [
    ((2, 3, 5), (3, 2, 3), dict(stride=2, padding=1, output_padding=1)),          # 1-d
    ((1, 4, 4, 3), (4, 3, 2, 2), dict(stride=2)),                                 # U-Net 2x2 s2
    ((2, 4, 3, 4), (4, 1, 3, 2), dict(stride=(2, 3), padding=(1, 0), dilation=(2, 1),
                                      groups=2, output_padding=(1, 2))),
    ((1, 2, 2, 3, 2), (2, 3, 3, 2, 2), dict(stride=(1, 2, 2), padding=(1, 0, 1))),  # 3-d
]


@pytest.mark.parametrize("xs,ws,kw", CONV_T_CASES)
def test_conv_transpose(rng, xs, ws, kw):
    x = rng.standard_normal(xs).astype(np.float32)
    w = rng.standard_normal(ws).astype(np.float32)
    groups = kw.get("groups", 1)
    b = rng.standard_normal(ws[1] * groups).astype(np.float32)
    g = rlx.Graph("convt")
    y = g.conv_transpose(g.input("x", xs), g.param("w", ws), g.param("b", b.shape), **kw)
    g.set_outputs([y])
    (got,) = run_graph(g, {"x": x}, {"w": w, "b": b})
    want = conv_t_ref(x, w, b, **kw)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_conv_gradients(rng):
    x = rng.standard_normal((2, 4, 5, 4))
    w = rng.standard_normal((4, 2, 3, 2))
    b = rng.standard_normal(4)
    kw = dict(stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=2)
    g = rlx.Graph("convg")
    xs, ws, bs = g.input("x", x.shape), g.input("w", w.shape), g.input("b", b.shape)
    y = g.conv(xs, ws, bs, **kw)
    seed = rng.standard_normal(y.shape).astype(np.float32)
    check(g, y, {"x": xs, "w": ws, "b": bs}, {"x": x, "w": w, "b": b},
          lambda x, w, b: conv_ref(x, w, b, **kw), seed=seed)


def test_conv_transpose_gradients(rng):
    x = rng.standard_normal((1, 2, 3, 4))
    w = rng.standard_normal((2, 3, 3, 2))
    kw = dict(stride=2, padding=(1, 0), output_padding=(1, 0))
    g = rlx.Graph("convtg")
    xs, ws = g.input("x", x.shape), g.input("w", w.shape)
    y = g.conv_transpose(xs, ws, **kw)
    seed = rng.standard_normal(y.shape).astype(np.float32)
    check(g, y, {"x": xs, "w": ws}, {"x": x, "w": w},
          lambda x, w: conv_t_ref(x, w, **kw), seed=seed)


def test_conv_1d_3d_gradients(rng):
    for xs, ws, kw in (((1, 2, 7), (3, 2, 3), dict(stride=2, padding="valid")),
                       ((1, 1, 3, 4, 3), (2, 1, 2, 2, 2), dict(padding=1))):
        x, w = rng.standard_normal(xs), rng.standard_normal(ws)
        g = rlx.Graph("convg")
        xt, wt = g.input("x", xs), g.input("w", ws)
        y = g.conv(xt, wt, **kw)
        check(g, y, {"x": xt, "w": wt}, {"x": x, "w": w},
              lambda x, w, kw=kw: conv_ref(x, w, **kw), seed=rng.standard_normal(y.shape))


def test_conv_errors():
    g = rlx.Graph("e")
    x = g.input("x", (1, 4, 5, 5))
    cases = [
        (lambda: g.conv(x, g.input("w1", (6, 3, 3, 3)), groups=2),
         "w f32 [6, 3, 3, 3] must have C/groups = 2 input channels"),
        (lambda: g.conv(x, g.input("w2", (6, 4, 3, 3)), groups=3),
         "channels must divide into groups=3"),
        (lambda: g.conv(x, g.input("w3", (2, 4, 3, 3)), padding="full"),
         "padding must be an int, a tuple, 'same' or 'valid', got 'full'"),
        (lambda: g.conv(x, g.input("w4", (2, 4, 3, 3)), padding="same", stride=2),
         "padding='same' needs stride 1"),
        (lambda: g.conv(x, g.input("w5", (2, 4, 7, 3))),
         "is larger than the padded input [5, 5]"),
        (lambda: g.conv(x, g.input("w6", (2, 4, 3))), "x must be [N, C, *spatial] or [C, "
         "*spatial] with 1 spatial dims"),
        (lambda: g.conv(x, g.input("w7", (2, 4, 3, 3)), stride=(1, 0)),
         "stride must be an int >= 1 or 2 of them, got (1, 0)"),
        (lambda: g.conv(x, g.input("w8", (2, 4, 3, 3)), g.input("b8", (3,))),
         "bias must be f32 [2] (one per output channel), got f32 [3]"),
        (lambda: g.conv(x, g.input("w9", (2, 4, 3, 3, 3, 3))), "w must be 3-, 4- or 5-D"),
        (lambda: g.conv_transpose(x, g.input("w10", (3, 2, 2, 2))),
         "w f32 [3, 2, 2, 2] must be [C, Cout/groups, *kernel] with C = 4"),
        (lambda: g.conv_transpose(x, g.input("w11", (4, 2, 2, 2)), stride=2, output_padding=2),
         "output_padding [2, 2] must be smaller than stride [2, 2] or dilation [1, 1]"),
        (lambda: g.conv_transpose(x, g.input("w12", (4, 2, 1, 1)), padding=3),
         "the output would be [-1, -1]"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value), str(e.value)
        assert str(e.value).startswith(("conv:", "conv_transpose:")), str(e.value)


def pool_ref(x, kind, k, stride=None, padding=0, dilation=1, ceil_mode=False,
             count_include_pad=True):
    d = len(k)
    tup = lambda v: (v,) * d if np.isscalar(v) else v    # noqa: E731
    st, p, dl = tup(stride or k), tup(padding), tup(dilation)
    size = x.shape[2:]
    out = []
    for i in range(d):
        span = dl[i] * (k[i] - 1) + 1
        num = size[i] + 2 * p[i] - span
        o = (-(-num // st[i]) if ceil_mode else num // st[i]) + 1
        if ceil_mode and (o - 1) * st[i] >= size[i] + p[i]:
            o -= 1
        out.append(o)
    y = np.empty(x.shape[:2] + tuple(out))
    for o in np.ndindex(*out):
        starts = [o[i] * st[i] - p[i] for i in range(d)]
        idx = [[s + j * dl[i] for j in range(k[i]) if 0 <= s + j * dl[i] < size[i]]
               for i, s in enumerate(starts)]
        win = x[(slice(None), slice(None)) + np.ix_(*idx)].reshape(x.shape[:2] + (-1,))
        if kind == "max":
            y[(slice(None), slice(None)) + o] = win.max(-1)
        else:
            div = (np.prod([min(starts[i] + k[i], size[i] + p[i]) - starts[i] for i in range(d)])
                   if count_include_pad else np.prod([len(v) for v in idx]))
            y[(slice(None), slice(None)) + o] = win.sum(-1) / div
    return y


POOL_CASES = [
    ((2, 3, 11), "max", (3,), dict(stride=2, padding=1)),
    ((1, 2, 10), "avg", (4,), dict(stride=3, ceil_mode=True)),
    ((2, 3, 7, 6), "max", (3, 2), dict(stride=(2, 1), padding=(1, 1), dilation=(2, 1))),
    ((2, 3, 7, 6), "max", (3, 3), dict(stride=2, padding=1, ceil_mode=True)),   # ResNet stem
    ((1, 2, 7, 5), "avg", (3, 3), dict(stride=2, padding=1)),
    ((1, 2, 7, 5), "avg", (3, 3), dict(stride=2, padding=1, count_include_pad=False,
                                       ceil_mode=True)),
    ((1, 2, 5, 4, 6), "max", (2, 2, 3), dict(stride=(1, 2, 2), padding=(1, 0, 1))),
    ((1, 2, 5, 4, 6), "avg", (3, 2, 2), dict(padding=(1, 1, 0), count_include_pad=False)),
]


@pytest.mark.parametrize("xs,kind,k,kw", POOL_CASES)
def test_pool(rng, xs, kind, k, kw):
    x = rng.standard_normal(xs)
    g = rlx.Graph("pool")
    xt = g.input("x", xs)
    y = g.pool(xt, kind, k, **kw)
    seed = rng.standard_normal(y.shape)
    check(g, y, {"x": xt}, {"x": x}, lambda x: pool_ref(x, kind, k, **kw), seed=seed)
    g2 = rlx.Graph("pool2")
    g2.set_outputs([g2.pool(g2.input("x", xs), kind, k, **kw)])
    (got,) = run_graph(g2, {"x": x.astype(np.float32)})
    np.testing.assert_allclose(got, pool_ref(x, kind, k, **kw), rtol=1e-5, atol=1e-6)


def test_max_pool_is_not_avg_pool_and_nan_wins(rng):
    x = rng.standard_normal((1, 2, 6, 6)).astype(np.float32)
    x[0, 1, 2, 3] = np.nan
    g = rlx.Graph("p")
    xt = g.input("x", x.shape)
    unbatched = g.pool(g.reshape(xt, (2, 6, 6)), "max", (3, 3))
    g.set_outputs([g.pool(xt, "max", 2), g.pool(xt, "avg", 2), unbatched])
    mx, av, unb = run_graph(g, {"x": x})
    ref = pool_ref(x.astype(np.float64), "max", (2, 2))
    np.testing.assert_array_equal(np.isnan(mx), np.isnan(ref))
    assert np.isnan(mx[0, 1, 1, 1])
    keep = ~np.isnan(ref)
    np.testing.assert_allclose(mx[keep], ref[keep])
    assert not np.allclose(mx[0, 0], av[0, 0])
    np.testing.assert_allclose(unb, pool_ref(x[0:1].reshape(1, 2, 6, 6), "max", (3, 3))[0])


def test_pool_errors():
    g = rlx.Graph("e")
    x = g.input("x", (1, 2, 5, 5))
    cases = [
        (lambda: g.pool(x, "min", 2), "kind must be 'max' or 'avg', got 'min'"),
        (lambda: g.pool(x, "avg", 3, dilation=2), "avg pooling has no dilation"),
        (lambda: g.pool(x, "max", 3, padding=2), "padding [2, 2] must be at most half the "
         "window [3, 3]"),
        (lambda: g.pool(x, "max", (7, 2)), "the window [7, 2] is larger than the padded input"),
        (lambda: g.pool(x, "max", (2, 2, 2, 2)), "with 1-3 spatial dims"),
        (lambda: g.pool(x, "max", 0), "kernel_size must be an int >= 1"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value) and str(e.value).startswith("pool:"), str(e.value)


@pytest.mark.parametrize("tiers", [
    pytest.param("0", marks=pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on a GPU")),
    "1", "2"])
def test_conv_tiers(rng, monkeypatch, tiers):
    """Forward and both gradients of conv and conv_transpose through each tier (RLX_NUMBA_CONV_
    TIERS): cuDNN, im2col / col2im and the matmul ladder, the numba implicit-GEMM kernels."""
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", tiers)
    x = rng.standard_normal((2, 4, 9, 8))
    w = rng.standard_normal((6, 2, 3, 3))
    kw = dict(stride=(2, 1), padding=1, dilation=(1, 2), groups=2)
    g = rlx.Graph("tiers")
    xs, ws = g.input("x", x.shape), g.input("w", w.shape)
    y = g.conv(xs, ws, **kw)
    yt = g.conv_transpose(y, g.reshape(ws, (6, 2, 3, 3)), stride=2, padding=1, groups=2)
    seed = rng.standard_normal(yt.shape)
    dx, dw = g.grad(g.reduce_sum(g.mul(yt, g.constant(seed))), [xs, ws])
    g.set_outputs([y, yt, dx, dw])
    exe = rlx.compile(g)
    got = exe.run({"x": x.astype(np.float32), "w": w.astype(np.float32)})
    y_ref = conv_ref(x, w, **kw)
    yt_ref = conv_t_ref(y_ref, w, stride=2, padding=1, groups=2)
    for a, b in ((got[0], y_ref), (got[1], yt_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(b).max())
    eps, i = 1e-3, (1, 2, 4, 3)                   # one finite difference each for dx and dw
    f = lambda x, w: float((conv_t_ref(conv_ref(x, w, **kw), w, stride=2, padding=1,  # noqa: E731
                                       groups=2) * seed).sum())
    xp, xm = x.copy(), x.copy()
    xp[i] += eps
    xm[i] -= eps
    assert abs(got[2][i] - (f(xp, w) - f(xm, w)) / (2 * eps)) < 1e-3 * (1 + abs(got[2][i]))
    j = (3, 1, 2, 0)
    wp, wm = w.copy(), w.copy()
    wp[j] += eps
    wm[j] -= eps
    assert abs(got[3][j] - (f(x, wp) - f(x, wm)) / (2 * eps)) < 1e-3 * (1 + abs(got[3][j]))
    names = " ".join(s.kernel_name for s in exe.steps)
    assert ("cudnn" in names) == (tiers == "0"), names
    assert ("implicit-GEMM" in names) == (tiers == "2"), names
    assert ("im2col" in names) == (tiers != "0"), names   # tier 2's weight gradient: im2col


def test_conv_tier_choice(monkeypatch):
    """What conv_tier picks and says, and a bad RLX_NUMBA_CONV_TIERS."""
    from rlx_numba.runtime.lower_vision import conv_tier
    g = rlx.Graph("choice")
    x = g.input("x", (1, 2, 6, 6))
    w = g.input("w", (3, 2, 3, 3))
    y3 = g.conv(x, w, padding=1)
    y1 = g.conv(x, g.input("w1", (3, 2, 1, 1)))
    dw = g.grad(g.reduce_sum(y3), [w])[0]
    nodes = {t: t.node for t in (y3, y1)}
    wgrad = next(n for n in g.nodes if n.op == "conv_wgrad")
    assert dw.shape == (3, 2, 3, 3)
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", "2")
    assert conv_tier(g, nodes[y3])[0] == 2 and conv_tier(g, nodes[y1])[0] == 2
    assert conv_tier(g, wgrad) == (1, "tier 0 not allowed by RLX_NUMBA_CONV_TIERS; "
                                      "the weight gradient has no tier-2 kernel")
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", "1,2")
    assert conv_tier(g, nodes[y1])[0] == 1          # a 1x1 is one product: no im2col
    if not ON_GPU:
        assert conv_tier(g, nodes[y3]) == (2, "tier 0 not allowed by RLX_NUMBA_CONV_TIERS; "
                                              "the simulator runs the numba kernel")
    if ON_GPU:       # a strided 1x1 in half: im2col + product; in f32 cuDNN
        monkeypatch.delenv("RLX_NUMBA_CONV_TIERS")
        h = rlx.Graph("strided")
        for d, want in (("bf16", 1), ("f32", 0)):
            ys = h.conv(h.input(f"x{d}", (2, 8, 9, 9), d), h.input(f"w{d}", (4, 8, 1, 1), d),
                        stride=2)
            assert conv_tier(h, ys.node)[0] == want, conv_tier(h, ys.node)
    monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", "0,3")
    with pytest.raises(ValueError, match="RLX_NUMBA_CONV_TIERS='0,3': expected"):
        conv_tier(g, nodes[y3])


@pytest.mark.parametrize("tier", [
    pytest.param(None, marks=pytest.mark.skipif(not ON_GPU, reason="cuDNN runs on a GPU")),
    "2"])
def test_conv_epilogue_fused(rng, monkeypatch, tier):
    """relu(conv + bias + z) and relu(conv + bias) fold into one cuDNN call each (fusion
    pass; the default ladder: cuDNN on a GPU), or into one implicit-GEMM kernel each (tier 2:
    its tile store), against NumPy; NaN in z propagates through the relu as torch's does."""
    if tier is None:
        monkeypatch.delenv("RLX_NUMBA_CONV_TIERS", raising=False)
    else:
        monkeypatch.setenv("RLX_NUMBA_CONV_TIERS", tier)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    z = rng.standard_normal((2, 4, 7, 6)).astype(np.float32)
    z[1, 2, 3, 4] = np.nan
    g = rlx.Graph("epi")
    xs, zs = g.input("x", x.shape), g.input("z", z.shape)
    ws, bs = g.param("w", w.shape), g.param("b", b.shape)
    y1 = g.relu(g.add(g.conv(xs, ws, bs, padding=1), zs))
    y2 = g.relu(g.conv(xs, ws, bs, padding=1))
    g.set_outputs([y1, y2])
    exe = rlx.compile(g)
    exe.set_param("w", w)
    exe.set_param("b", b)
    got1, got2 = exe.run({"x": x, "z": z})
    conv = conv_ref(x, w, b, padding=1)
    want1, want2 = conv + z, np.maximum(conv, 0)
    want1 = np.where(np.isnan(want1), np.nan, np.maximum(want1, 0))
    np.testing.assert_allclose(got1, want1, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got2, want2, rtol=1e-4, atol=1e-4)
    names = [s.kernel_name for s in exe.steps]
    what = "cudnn fwd" if tier is None else "numba implicit-GEMM conv"
    assert sum(f"{what} +bias +z relu" in k for k in names) == 1 and len(names) == 2, names
    assert sum(f"{what} +bias relu" in k for k in names) == 1, names


@pytest.mark.skipif(not ON_GPU, reason="cuDNN steps inside CUDA graphs and on several streams")
@pytest.mark.parametrize("mode", ["graph", "multistream"])
def test_conv_exec_modes_on_gpu(rng, mode):
    """A conv / pool / conv_transpose graph with gradients gives the STREAM results when
    captured into a CUDA graph (replayed twice) and when spread over streams."""
    x = rng.standard_normal((2, 3, 10, 9)).astype(np.float32)
    w1 = rng.standard_normal((6, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((6, 4, 2, 2)).astype(np.float32)

    def build():
        g = rlx.Graph("modes")
        xs, a, b = g.input("x", x.shape), g.input("w1", w1.shape), g.input("w2", w2.shape)
        h = g.pool(g.relu(g.conv(xs, a, padding=1)), "max", 2)
        y = g.conv_transpose(h, b, stride=2)
        g.set_outputs([y] + g.grad(g.reduce_sum(g.mul(y, y)), [xs, a, b]))
        return g

    feed = {"x": x, "w1": w1, "w2": w2}
    want = rlx.compile(build(), exec_mode="stream").run(feed)
    exe = rlx.compile(build(), exec_mode=mode if mode == "graph" else rlx.ExecMode.MULTISTREAM(2))
    for _ in range(2):
        got = exe.run(feed)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_compile_train_through_a_conv(rng):
    """compile_train over a conv net (whose convolutions the compiler rewrites into im2col and
    products where cuDNN does not run them: new node ids) takes the SGD step that NumPy's
    finite-difference gradient gives."""
    from gradcheck import numeric_grad
    x = rng.standard_normal((2, 2, 6, 5))
    w = rng.standard_normal((3, 2, 3, 3)) * 0.5
    b = rng.standard_normal(3) * 0.1

    def loss_ref(x, w, b):
        h = np.maximum(conv_ref(x, w, b, stride=2, padding=1), 0)
        return float((h * h).mean())

    g = rlx.Graph("cnn")
    xs, ws, bs = g.input("x", x.shape), g.param("w", w.shape), g.param("b", b.shape)
    h = g.relu(g.conv(xs, ws, bs, stride=2, padding=1))
    loss = g.reduce_mean(g.mul(h, h))
    tr = rlx.compile_train(g, loss, optimizer=rlx.optim.SGD(lr=0.1), exec_mode="stream")
    tr.set_param("w", w.astype(np.float32))
    tr.set_param("b", b.astype(np.float32))
    got = tr.step({"x": x.astype(np.float32)})
    assert abs(got - loss_ref(x, w, b)) < 1e-5 * (1 + abs(got))
    feed = {"x": x, "w": w.copy(), "b": b.copy()}
    for name, v in (("w", w), ("b", b)):
        want = v - 0.1 * numeric_grad(loss_ref, feed, name)
        np.testing.assert_allclose(tr.get_param(name), want, rtol=1e-4, atol=1e-5)
