"""batch_norm, group_norm, layer_norm2d, pad, resize and adaptive_avg_pool against NumPy
references written here (torch's formulas: np.pad's modes for pad, torch's float32 source-index
math for resize evaluated in 2-D/3-D directly, not one axis at a time), gradients against
finite differences."""
import itertools

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph
from gradcheck import check


def bn_ref(x, mean, var, gamma, beta, eps):
    b = (1, -1) + (1,) * (x.ndim - 2)
    y = (x - mean.reshape(b)) / np.sqrt(var.reshape(b) + eps)
    if gamma is not None:
        y = y * gamma.reshape(b)
    return y if beta is None else y + beta.reshape(b)


def gn_ref(x, groups, gamma, beta, eps):
    n, c = x.shape[:2]
    xr = x.reshape(n, groups, -1)
    y = ((xr - xr.mean(-1, keepdims=True)) / np.sqrt(xr.var(-1, keepdims=True) + eps)).reshape(x.shape)
    b = (1, -1) + (1,) * (x.ndim - 2)
    return y * gamma.reshape(b) + beta.reshape(b)


def ln2d_ref(x, gamma, beta, eps):
    u = x.mean(1, keepdims=True)
    s = ((x - u) ** 2).mean(1, keepdims=True)
    b = (1, -1) + (1,) * (x.ndim - 2)
    return (x - u) / np.sqrt(s + eps) * gamma.reshape(b) + beta.reshape(b)


def test_batch_norm(rng):
    x = rng.standard_normal((2, 3, 5, 4))
    mean, var = rng.standard_normal(3), rng.uniform(0.5, 2, 3)
    gamma, beta = rng.standard_normal(3), rng.standard_normal(3)
    g = rlx.Graph("bn")
    t = {k: g.input(k, v.shape) for k, v in dict(x=x, m=mean, v=var, ga=gamma, be=beta).items()}
    y = g.batch_norm(t["x"], t["m"], t["v"], t["ga"], t["be"], eps=1e-3)
    feed = dict(x=x, m=mean, v=var, ga=gamma, be=beta)
    check(g, y, {"x": t["x"], "ga": t["ga"], "be": t["be"], "m": t["m"], "v": t["v"]}, feed,
          lambda x, m, v, ga, be: bn_ref(x, m, v, ga, be, 1e-3),
          seed=rng.standard_normal(x.shape))
    g2 = rlx.Graph("bn2")
    x3 = rng.standard_normal((4, 3, 6)).astype(np.float32)
    g2.set_outputs([g2.batch_norm(g2.input("x", x3.shape), g2.constant(mean), g2.constant(var))])
    (got,) = run_graph(g2, {"x": x3})
    np.testing.assert_allclose(got, bn_ref(x3, mean, var, None, None, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,groups", [((2, 6, 5, 3), 3), ((1, 4, 7), 1), ((2, 4, 2, 3, 2), 4)])
def test_group_norm(rng, shape, groups):
    x = rng.standard_normal(shape)
    gamma, beta = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    g = rlx.Graph("gn")
    t = {k: g.input(k, v.shape) for k, v in dict(x=x, ga=gamma, be=beta).items()}
    y = g.group_norm(t["x"], groups, t["ga"], t["be"], eps=1e-5)
    check(g, y, t, dict(x=x, ga=gamma, be=beta),
          lambda x, ga, be: gn_ref(x, groups, ga, be, 1e-5), seed=rng.standard_normal(shape))


def test_layer_norm2d(rng):
    x = rng.standard_normal((2, 5, 3, 4))
    gamma, beta = rng.standard_normal(5), rng.standard_normal(5)
    g = rlx.Graph("ln2d")
    t = {k: g.input(k, v.shape) for k, v in dict(x=x, ga=gamma, be=beta).items()}
    y = g.layer_norm2d(t["x"], t["ga"], t["be"])
    check(g, y, t, dict(x=x, ga=gamma, be=beta), lambda x, ga, be: ln2d_ref(x, ga, be, 1e-6),
          seed=rng.standard_normal(x.shape))


def pad_ref(x, pads, mode, value):
    width = [(0, 0)] * x.ndim
    for j in range(len(pads) // 2):
        width[x.ndim - 1 - j] = (pads[2 * j], pads[2 * j + 1])
    crop = tuple(slice(-lo if lo < 0 else 0, x.shape[i] + hi if hi < 0 else None)
                 for i, (lo, hi) in enumerate(width))
    x = x[crop]
    width = [(max(lo, 0), max(hi, 0)) for lo, hi in width]
    if mode == "constant":
        return np.pad(x, width, constant_values=value)
    return np.pad(x, width, mode={"reflect": "reflect", "replicate": "edge"}[mode])


@pytest.mark.parametrize("shape,pads,mode", [
    ((2, 3, 5), (2, 1), "reflect"),
    ((1, 2, 4, 5), (1, 2, 3, 0), "reflect"),
    ((1, 2, 4, 5), (3, 1, 0, 2), "replicate"),
    ((1, 1, 3, 4, 2), (1, 1, 2, 0, 1, 1), "replicate"),
    ((2, 3, 4), (1, -2, -1, 2), "constant"),
    ((2, 3), (1, 1, 2, 0), "constant"),
])
def test_pad(rng, shape, pads, mode):
    x = rng.standard_normal(shape)
    g = rlx.Graph("pad")
    xt = g.input("x", shape)
    y = g.pad(xt, pads, mode, value=0.5)
    want = pad_ref(x, pads, mode, 0.5)
    assert y.shape == want.shape
    check(g, y, {"x": xt}, {"x": x}, lambda x: pad_ref(x, pads, mode, 0.5),
          seed=rng.standard_normal(want.shape))


def _src_index(mode, o, n_in, n_out, align_corners, factor):
    """torch's float32 source index (nearest: the index; linear: (i0, i1, lambda))."""
    f32 = np.float32
    if align_corners:
        scale = f32((n_in - 1) / (n_out - 1)) if n_out > 1 else f32(0)
    else:
        scale = f32(1.0 / factor) if factor else f32(n_in / n_out)
    if mode == "nearest":
        return min(int(np.floor(f32(o) * scale)), n_in - 1)
    src = scale * f32(o) if align_corners else max(scale * (f32(o) + f32(0.5)) - f32(0.5), f32(0))
    i0 = min(int(src), n_in - 1)
    return i0, min(i0 + 1, n_in - 1), float(src - f32(i0))


def resize_ref(x, out, mode, align_corners=False, factors=None):
    d = x.ndim - 2
    factors = factors or (None,) * d
    y = np.zeros(x.shape[:2] + tuple(out))
    for o in itertools.product(*[range(v) for v in out]):
        if mode == "nearest":
            src = tuple(_src_index("nearest", o[i], x.shape[2 + i], out[i], False, factors[i])
                        for i in range(d))
            y[(slice(None), slice(None)) + o] = x[(slice(None), slice(None)) + src]
            continue
        per = [_src_index("linear", o[i], x.shape[2 + i], out[i], align_corners, factors[i])
               for i in range(d)]
        for corner in itertools.product((0, 1), repeat=d):   # the 2^d corners, weights multiplied
            wgt = np.prod([per[i][2] if c else 1 - per[i][2] for i, c in enumerate(corner)])
            src = tuple(per[i][c] for i, c in enumerate(corner))
            y[(slice(None), slice(None)) + o] += wgt * x[(slice(None), slice(None)) + src]
    return y


@pytest.mark.parametrize("shape,kw,out", [
    ((1, 2, 5), dict(size=9, mode="linear"), (9,)),
    ((1, 2, 5), dict(scale_factor=2.5, mode="nearest"), (12,)),
    ((2, 2, 4, 5), dict(size=(7, 3), mode="bilinear"), (7, 3)),
    ((1, 2, 4, 5), dict(size=(7, 8), mode="bilinear", align_corners=True), (7, 8)),
    ((1, 2, 4, 5), dict(scale_factor=2, mode="nearest"), (8, 10)),
    ((1, 1, 6, 7), dict(scale_factor=(0.5, 1.5), mode="bilinear"), (3, 10)),
    ((1, 1, 3, 2, 4), dict(size=(5, 3, 2), mode="trilinear"), (5, 3, 2)),
])
def test_resize(rng, shape, kw, out):
    x = rng.standard_normal(shape)
    g = rlx.Graph("resize")
    xt = g.input("x", shape)
    y = g.resize(xt, **kw)
    assert y.shape == shape[:2] + out
    factors = None
    if "scale_factor" in kw:
        f = kw["scale_factor"]
        factors = tuple(f) if isinstance(f, tuple) else (f,) * len(out)
    mode = "nearest" if kw["mode"] == "nearest" else "linear"
    ref = lambda x: resize_ref(x, out, mode, kw.get("align_corners", False), factors)  # noqa: E731
    check(g, y, {"x": xt}, {"x": x}, ref, seed=rng.standard_normal(y.shape))


def test_last_two_axes_resample_in_one_node():
    """pad / resize / adaptive_avg_pool over the last two axes: one resample node (one kernel,
    no intermediate); a third axis is a node of its own."""
    g = rlx.Graph("r")
    x = g.input("x", (1, 2, 3, 4, 5))
    count = lambda t: sum(n.op == "resample" for n in g.nodes if n.id <= t.id)  # noqa: E731
    assert count(g.resize(x, scale_factor=2)) == 2
    y = g.pad(x, (1, 1, 2, 0), "reflect")
    assert y.node.op == "resample" and "idx2" in y.node.attrs and y.shape == (1, 2, 3, 6, 7)
    z = g.adaptive_avg_pool(x, (None, 2, 1))
    assert z.node.attrs["axis"] == 3 and g.nodes[z.node.inputs[0]].op == "input"


def adaptive_ref(x, out):
    d = len(out)
    size = x.shape[2:]
    y = np.zeros(x.shape[:2] + tuple(out))
    for o in itertools.product(*[range(v) for v in out]):
        sl = tuple(slice((o[i] * size[i]) // out[i], -(-((o[i] + 1) * size[i]) // out[i]))
                   for i in range(d))
        y[(slice(None), slice(None)) + o] = x[(slice(None), slice(None)) + sl].mean(
            axis=tuple(range(2, 2 + d)))
    return y


@pytest.mark.parametrize("shape,out", [((2, 3, 7, 5), (3, 2)), ((1, 2, 10), (4,)),
                                       ((1, 2, 5, 4, 3), (2, 3, 3)), ((2, 3, 7, 5), (1, 1))])
def test_adaptive_avg_pool(rng, shape, out):
    x = rng.standard_normal(shape)
    g = rlx.Graph("aap")
    xt = g.input("x", shape)
    y = g.adaptive_avg_pool(xt, out if len(out) > 1 else out[0])
    assert y.shape == shape[:2] + out
    check(g, y, {"x": xt}, {"x": x}, lambda x: adaptive_ref(x, out),
          seed=rng.standard_normal(y.shape))


def test_adaptive_none_keeps_a_dim(rng):
    x = rng.standard_normal((1, 2, 6, 5)).astype(np.float32)
    g = rlx.Graph("aap")
    g.set_outputs([g.adaptive_avg_pool(g.input("x", x.shape), (3, None))])
    (got,) = run_graph(g, {"x": x})
    np.testing.assert_allclose(got, adaptive_ref(x.astype(np.float64), (3, 5)), rtol=1e-5,
                               atol=1e-6)


def test_resample_splits_few_long_lines_over_blocks(rng):
    """A channels-last pool over axis 1 of [1, 4, 3, 40] is 2 lines of 120: the kernel's
    blocks split each line along x too (one block a line was 10x slower than torch on a
    GPU); every element still written once, right."""
    from rlx_numba.kernels import conv
    grid, (tx, _) = conv.lines_launch(2, 120, split=True)
    assert grid[0] == (2 if tx < 120 else 1)    # split where a line outgrows a block (simulator)
    x = rng.standard_normal((1, 4, 3, 40)).astype(np.float32)
    g = rlx.Graph("aap_cl")
    g.set_outputs([g.adaptive_avg_pool(g.input("x", x.shape), (2, None), channels_last=True)])
    (got,) = run_graph(g, {"x": x})
    want = np.moveaxis(adaptive_ref(np.moveaxis(x.astype(np.float64), -1, 1), (2, 3)), 1, -1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_vision_op_errors():
    g = rlx.Graph("e")
    x = g.input("x", (1, 4, 5, 5))
    c4 = g.input("c4", (4,))
    cases = [
        (lambda: g.batch_norm(x, g.input("m", (3,)), c4), "batch_norm: mean must be f32 [4]"),
        (lambda: g.batch_norm(x, c4, c4, eps=-1), "batch_norm: eps must be a number >= 0"),
        (lambda: g.group_norm(x, 3, c4, c4), "group_norm: the 4 channels of x f32 [1, 4, 5, 5] "
         "do not divide into num_groups=3"),
        (lambda: g.group_norm(x, 2, g.input("ga", (2,))), "group_norm: gamma must be f32 [4]"),
        (lambda: g.pad(x, (1, 2, 3)), "pad: pads must be (left, right) int pairs"),
        (lambda: g.pad(x, (5, 0), "reflect"), "pad: reflect pads must be smaller than the axis"),
        (lambda: g.pad(x, (1, 0), "wrap"), "pad: mode must be 'constant', 'reflect' or "
         "'replicate', got 'wrap'"),
        (lambda: g.pad(x, (-1, 0), "replicate"), "pad: replicate pads must be >= 0"),
        (lambda: g.pad(x, (-3, -3)), "pad: pads (-3, -3) crop more than axis 3"),
        (lambda: g.resize(x, size=3, mode="linear"), "resize: mode must be 'nearest' or the "
         "interpolating mode of 2 spatial dims (bilinear), got 'linear'"),
        (lambda: g.resize(x, size=3, scale_factor=2), "resize: give exactly one of size and "
         "scale_factor"),
        (lambda: g.resize(x, size=3, align_corners=True), "resize: align_corners is for the "
         "interpolating modes"),
        (lambda: g.resize(x, scale_factor=0.1), "resize: scale_factor 0.1 makes an empty output"),
        (lambda: g.adaptive_avg_pool(x, (2, 2, 2, 2)), "adaptive_avg_pool: x must be [N, C, "
         "*spatial] or [C, *spatial] with 1-3 spatial dims"),
        (lambda: g.adaptive_avg_pool(x, (2, 0)), "adaptive_avg_pool: output_size must be an int "
         ">= 1"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value), str(e.value)


def test_unet_block(rng):
    """conv -> group_norm -> silu -> nearest 2x resize -> conv_transpose 2x2 s2, and the
    gradients of its input and first weight, against NumPy (the references above and
    test_conv's)."""
    from test_conv import conv_ref, conv_t_ref
    x = rng.standard_normal((1, 2, 5, 4))
    w1, b1 = rng.standard_normal((4, 2, 3, 3)) * 0.3, rng.standard_normal(4)
    gamma, beta = rng.standard_normal(4), rng.standard_normal(4)
    w2 = rng.standard_normal((4, 3, 2, 2)) * 0.3

    def ref(x, w1):
        h = gn_ref(conv_ref(x, w1, b1, padding=1), 2, gamma, beta, 1e-5)
        h = h / (1 + np.exp(-h))
        h = resize_ref(h, (10, 8), "nearest", factors=(2.0, 2.0))
        return conv_t_ref(h, w2, stride=2)

    g = rlx.Graph("unet")
    xt, w1t = g.input("x", x.shape), g.input("w1", w1.shape)
    h = g.conv(xt, w1t, g.constant(b1), padding=1)
    h = g.silu(g.group_norm(h, 2, g.constant(gamma), g.constant(beta)))
    h = g.resize(h, scale_factor=2, mode="nearest")
    y = g.conv_transpose(h, g.constant(w2), stride=2)
    assert y.shape == (1, 3, 20, 16)
    check(g, y, {"x": xt, "w1": w1t}, {"x": x, "w1": w1}, ref,
          seed=rng.standard_normal(y.shape), sample=12)
