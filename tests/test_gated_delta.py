"""g.gated_delta_net against a float64 NumPy port of fla's naive recurrent reference
(fused_recurrent_gated_delta_rule's torch reference: S <- S exp(g_t); u = beta (v - S^T k);
S <- S + k u^T; o = S^T q), with an initial state, the q/k l2 norm, T not a multiple of the
chunk, chunk sizes that must agree; gradients by finite differences; errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check


def naive(q, k, v, g, beta, scale=None, s0=None, l2=False):
    """fla's recurrent reference in float64: o [B, T, H, Dv], final state [B, H, Dk, Dv]."""
    b, t, h, dk = q.shape
    if l2:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q * (dk ** -0.5 if scale is None else scale)
    s = np.zeros((b, h, dk, v.shape[-1])) if s0 is None else s0.copy()
    o = np.zeros(v.shape)
    for i in range(t):
        s = s * np.exp(g[:, i])[..., None, None]
        u = beta[:, i][..., None] * (v[:, i] - np.einsum("bhkv,bhk->bhv", s, k[:, i]))
        s = s + np.einsum("bhk,bhv->bhkv", k[:, i], u)
        o[:, i] = np.einsum("bhkv,bhk->bhv", s, q[:, i])
    return o, s


def make(rng, b, t, h, dk, dv):
    return dict(q=rng.standard_normal((b, t, h, dk)), k=rng.standard_normal((b, t, h, dk)),
                v=rng.standard_normal((b, t, h, dv)),
                g=np.log(rng.uniform(0.7, 1.0, (b, t, h))),      # log decay <= 0
                beta=rng.uniform(0.1, 0.9, (b, t, h)))


def build(shape_of, init=False, **kw):
    g = rlx.Graph()
    ts = {n: g.input(n, s) for n, s in shape_of.items()}
    o, s = g.gated_delta_net(ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"],
                             initial_state=ts.get("s0"), **kw)
    return g, ts, o, s


@pytest.mark.parametrize("t,chunk,l2,init,scale", [(7, 64, False, False, None),
                                                   (7, 4, True, True, None),
                                                   (9, 4, True, False, 0.3),
                                                   (1, 64, False, True, None)])
def test_matches_the_recurrent_reference(rng, t, chunk, l2, init, scale):
    b, h, dk, dv = 2, 2, 4, 3
    f = make(rng, b, t, h, dk, dv)
    if init:
        f["s0"] = rng.standard_normal((b, h, dk, dv))
    g, _, o, s = build({k: v.shape for k, v in f.items()}, chunk_size=chunk,
                       use_qk_l2norm=l2, scale=scale)
    g.set_outputs([o, s])
    got_o, got_s = rlx.compile(g).run({k: v.astype(np.float32) for k, v in f.items()})
    want_o, want_s = naive(f["q"], f["k"], f["v"], f["g"], f["beta"], scale, f.get("s0"), l2)
    np.testing.assert_allclose(got_o, want_o, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got_s, want_s, rtol=2e-4, atol=2e-4)


def test_gradients(rng):
    b, t, h, dk, dv = 1, 5, 1, 3, 2
    f = make(rng, b, t, h, dk, dv)
    f["s0"] = rng.standard_normal((b, h, dk, dv))
    g, ts, o, _ = build({k: v.shape for k, v in f.items()}, chunk_size=2, use_qk_l2norm=True)
    check(g, o, {k: ts[k] for k in ("q", "k", "v", "g", "beta", "s0")}, f,
          lambda q, k, v, g, beta, s0: naive(q, k, v, g, beta, None, s0, True)[0],
          seed=rng.standard_normal((b, t, h, dv)), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bad,match", [
    (dict(v=(2, 5, 2, 3)), r"gated_delta_net: v must be \[B, T, H, Dv\] = \[2, 6, 2, Dv\], got "
                           r"\[2, 5, 2, 3\]"),
    (dict(k=(2, 6, 2, 5)), r"gated_delta_net: q and k must be \[B, T, H, Dk\] of one shape"),
    (dict(g=(2, 6, 3)), r"gated_delta_net: g must be \[B, T, H\] = \[2, 6, 2\], got \[2, 6, 3\]"),
    (dict(s0=(2, 2, 4, 4)), r"gated_delta_net: initial_state must be f32 \[2, 2, 4, 3\], got "
                            r"f32 \[2, 2, 4, 4\]"),
])
def test_errors(bad, match):
    shapes = dict(q=(2, 6, 2, 4), k=(2, 6, 2, 4), v=(2, 6, 2, 3), g=(2, 6, 2), beta=(2, 6, 2))
    shapes.update(bad)
    with pytest.raises(ValueError, match=match):
        build(shapes)


def test_option_errors():
    shapes = dict(q=(1, 3, 1, 4), k=(1, 3, 1, 4), v=(1, 3, 1, 2), g=(1, 3, 1), beta=(1, 3, 1))
    with pytest.raises(ValueError, match=r"gated_delta_net: chunk_size must be a power of two, "
                                         r"got 3"):
        build(shapes, chunk_size=3)
    with pytest.raises(ValueError, match=r"gated_delta_net: use_qk_l2norm must be a bool"):
        build(shapes, use_qk_l2norm=1)
    g = rlx.Graph()
    x = g.input("q", (1, 3, 1, 4), "bf16")
    with pytest.raises(ValueError, match=r"gated_delta_net: q must be f32 \(cast half tensors "
                                         r"first\), got bf16"):
        g.gated_delta_net(x, x, x, g.input("g", (1, 3, 1)), g.input("b", (1, 3, 1)))
