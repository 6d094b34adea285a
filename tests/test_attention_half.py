"""attention with f16 / bf16 q, k, v (kernels/attention.py, attention_bwd.py: loads widen to
f32, the scores, the online softmax and P V in f32, the output rounded once) against float64
NumPy on the same half-rounded inputs (tests/halfref.py): causal or not, bool mask, a bias in
f32 or q's dtype, window, softcap, scale, GQA, rank 3, the flash and the (split) decode
kernels, the backward against float64 gradients written here, and a long row that a kernel
accumulating in half would get wrong."""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HALVES, HOST, assert_half_close, f64, rounded

from rlx_numba.kernels import attention as A


def _keep(b, hq, sq, sk, causal, window, mask):
    """The kept (query, key) pairs [B, Hq, Sq, Sk] (masks aligned to the keys' end)."""
    pos = sk - sq + np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    keep = np.ones((b, hq, sq, sk), bool)
    if causal:
        keep &= j <= pos
    if window is not None:
        keep &= (j > pos - window) & (j <= pos)
    if mask is not None:
        keep &= mask
    return keep


def masked_softmax(s, keep):
    """(p, row max, row sum) of softmax(s) over the last axis where ``keep``; a row that keeps
    nothing gives p = 0 (float64)."""
    s = np.where(keep, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
    den = e.sum(-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1), 0), mx, den


def _sum_to(x, shape):
    """x [B, Hq, Sq, Sk] summed back to a broadcast operand's shape."""
    x = x.sum(axis=tuple(range(x.ndim - len(shape))))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def attention64(q, k, v, dy=None, *, causal=False, window=None, mask=None, bias=None,
                scale=None, softcap=None):
    """float64 attention of q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D]; with dy also its
    gradients: (o, dq, dk, dv, dbias) (FlashAttention's algebra: dS = P (dP - rowsum(dP P)))."""
    q, k, v = f64(q), f64(k), f64(v)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    K, V = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    sc = 1 / np.sqrt(d) if scale is None else scale
    u = q @ K.transpose(0, 1, 3, 2) * sc
    t = np.tanh(u / softcap) if softcap is not None else None
    s = softcap * t if softcap is not None else u
    if bias is not None:
        s = s + f64(bias)
    p, _, _ = masked_softmax(s, _keep(b, hq, sq, sk, causal, window, mask))
    o = p @ V
    if dy is None:
        return o
    dy = f64(dy)
    group = lambda x: x.reshape(b, hkv, g, *x.shape[2:]).sum(2)        # noqa: E731
    dv = group(p.transpose(0, 1, 3, 2) @ dy)
    dp = dy @ V.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    du = ds * (1 - t * t) if softcap is not None else ds
    dq = sc * du @ K
    dk = group(sc * du.transpose(0, 1, 3, 2) @ q)
    return o, dq, dk, dv, (None if bias is None else _sum_to(ds, np.shape(bias)))


def _graph(dt, qs, ks, mask_shape=None, bias_shape=None, bias_dtype=None, **kw):
    g = rlx.Graph("attn_half")
    q, k, v = g.input("q", qs, dt), g.input("k", ks, dt), g.input("v", ks, dt)
    extra = {}
    if mask_shape is not None:
        extra["mask"] = g.input("m", mask_shape, "bool")
    if bias_shape is not None:
        extra["bias"] = g.input("bias", bias_shape, bias_dtype or dt)
    y = g.attention(q, k, v, **extra, **kw)
    assert y.dtype == q.dtype and y.shape == q.shape
    return g, (q, k, v), extra, y


def _feed(rng, dt, qs, ks, mask_shape=None, bias_shape=None, bias_dtype=None):
    feed = {n: rounded(rng.standard_normal(s), dt) for n, s in (("q", qs), ("k", ks), ("v", ks))}
    if mask_shape is not None:
        feed["m"] = rng.random(mask_shape) < 0.7
    if bias_shape is not None:
        feed["bias"] = rounded(rng.standard_normal(bias_shape), bias_dtype or dt)
    return feed


def run_half(rng, dt, qs, ks, *, mask_shape=None, bias_shape=None, bias_dtype=None, **kw):
    g, _, _, y = _graph(dt, qs, ks, mask_shape, bias_shape, bias_dtype, **kw)
    g.set_outputs([y])
    feed = _feed(rng, dt, qs, ks, mask_shape, bias_shape, bias_dtype)
    (got,) = rlx.compile(g).run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], mask=feed.get("m"),
                       bias=feed.get("bias"), **kw)
    assert_half_close(got, want, dt, what="attention")
    return got


@pytest.fixture(autouse=True)
def _numba_tier(monkeypatch):
    """These tests check the numba f32-accumulating kernels (tier 2); on a GPU cuDNN or the
    tensor-core flash kernel would take some (test_cudnn_tier sets tier 0 itself;
    tests/test_attention_tc.py checks tier 1)."""
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "2")


# name: (q shape, k shape, attributes); the simulator's tiles are 16 x 16 (16 threads)
CASES = {
    "plain": ((1, 2, 5, 16), (1, 2, 7, 16), {}),
    "causal_gqa": ((2, 4, 6, 16), (2, 2, 9, 16), {"causal": True}),
    "causal_sq_gt_sk": ((1, 1, 7, 8), (1, 1, 4, 8), {"causal": True}),     # rows see nothing
    "mask_f32_bias": ((2, 3, 5, 16), (2, 3, 11, 16),
                      {"mask_shape": (5, 11), "bias_shape": (1, 3, 5, 11), "bias_dtype": "f32"}),
    "everything": ((1, 2, 5, 16), (1, 1, 11, 16),
                   {"mask_shape": (5, 11), "bias_shape": (5, 11), "causal": True, "window": 6,
                    "scale": 0.3, "softcap": 2.5}),
    "d36_two_tiles": ((1, 1, 18, 36), (1, 1, 21, 36), {"causal": True}),
}


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("name", list(CASES))
def test_flash_forward(rng, monkeypatch, dt, name):
    qs, ks, kw = CASES[name]
    monkeypatch.setattr(A, "decode_rows", lambda g, sq, d: None)       # the flash kernel
    run_half(rng, dt, qs, ks, **kw)


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("hq,hkv,sq,sk,d", [(4, 1, 1, 45, 16),    # decode: Sq 1, GQA 4:1
                                           (2, 2, 2, 13, 36),     # dim pairs (8-byte for f32)
                                           (2, 1, 1, 21, 128)])   # groups of 4 (16-byte)
def test_decode_forward(rng, monkeypatch, dt, split, hq, hkv, sq, sk, d):
    """The decode kernel reading half K / V; ``split``: the keys over blocks of 8 (partials
    combined by the last block of a head) and the rows over blocks of 2, as a GPU's plan does
    (45 keys: blocks of 16, 3 splits with the last one partial -- 6 splits of 8 cost the
    simulator twice the blocks for the same combine path)."""
    assert A.decode_rows(hq // hkv, sq, d) is not None
    if split:
        chunk = 16 if sk > 32 else 8
        monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // chunk), chunk))
        monkeypatch.setattr(A, "decode_groups",
                            lambda rows_c, rows, blocks, sm: (2, -(-rows // 2)))
    run_half(rng, dt, (1, hq, sq, d), (1, hkv, sk, d), mask_shape=(sq, sk),
             bias_shape=(sq, sk), causal=True, window=sk - 3, scale=0.2, softcap=3.0)
    run_half(rng, dt, (2, hq, sq, d), (2, hkv, sk, d))


@pytest.mark.parametrize("dt", HALVES)
def test_rank3(rng, dt):
    b, s, hq, hkv, d = 2, 6, 4, 2, 8
    g = rlx.Graph("rank3")
    q = g.input("q", (b, s, hq * d), dt)
    k, v = g.input("k", (b, s + 2, hkv * d), dt), g.input("v", (b, s + 2, hkv * d), dt)
    g.set_outputs([g.attention(q, k, v, causal=True, num_heads=hq)])
    feed = {"q": rounded(rng.standard_normal((b, s, hq * d)), dt),
            "k": rounded(rng.standard_normal((b, s + 2, hkv * d)), dt),
            "v": rounded(rng.standard_normal((b, s + 2, hkv * d)), dt)}
    (got,) = rlx.compile(g).run(feed)
    split = lambda t, h: f64(t).reshape(b, -1, h, d).transpose(0, 2, 1, 3)   # noqa: E731
    want = attention64(split(feed["q"], hq), split(feed["k"], hkv), split(feed["v"], hkv),
                       causal=True)
    assert_half_close(got, want.transpose(0, 2, 1, 3).reshape(b, s, hq * d), dt)


def _half_online_softmax(q, k, v, dt):
    """What a kernel accumulating in ``dt`` would output: the online softmax of one tile of
    all keys (the exact row max), each p = exp(s - max), the denominator and P V summed key by
    key with every partial sum rounded to dt, then one division."""
    h = HOST[dt]
    rd = lambda x: np.asarray(x, np.float32).astype(h).astype(np.float64)     # noqa: E731
    s = f64(q) @ f64(k).transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    p = rd(np.exp(s - s.max(-1, keepdims=True)))
    l, acc = np.zeros(s.shape[:-1] + (1,)), np.zeros(q.shape)
    for j in range(k.shape[2]):
        l = rd(l + p[..., j:j + 1])
        acc = rd(acc + rd(p[..., j:j + 1] * f64(v)[:, :, j:j + 1, :]))
    return rd(acc / l).astype(h)


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("kernel", ["flash", "decode"])
def test_long_row_half_accumulation_would_fail(rng, monkeypatch, dt, kernel):
    """300 keys with nearly equal scores (|s| < ~0.1) and values in [2, 3]: the softmax
    denominator is ~300 terms near 1 and P V ~300 terms near 2.5. In half each addition
    rounds at the partial sum's ulp: bf16 (8 significant bits) stalls -- past 256 the ulp is
    2, so adding p ~ 0.95 changes nothing, and P V (ulp 4 past 512) takes +4 for every term
    ~2.4 -- and f16's ~300 roundings of up to half an ulp (0.125 .. 0.25 on the sums) add up
    to several u. The emulation of that kernel fails the bound the f32-accumulating kernels
    pass."""
    sq, sk, d = 2, 300, 8
    if kernel == "flash":
        monkeypatch.setattr(A, "decode_rows", lambda g, sq, d: None)
    g = rlx.Graph("long")
    q = g.input("q", (1, 1, sq, d), dt)
    k, v = g.input("k", (1, 1, sk, d), dt), g.input("v", (1, 1, sk, d), dt)
    g.set_outputs([g.attention(q, k, v)])
    feed = {"q": rounded(0.1 * rng.standard_normal((1, 1, sq, d)), dt),
            "k": rounded(rng.standard_normal((1, 1, sk, d)), dt),
            "v": rounded(rng.uniform(2, 3, (1, 1, sk, d)), dt)}
    (got,) = rlx.compile(g).run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"])
    assert_half_close(got, want, dt, what=kernel)
    with pytest.raises(AssertionError):
        assert_half_close(_half_online_softmax(feed["q"], feed["k"], feed["v"], dt), want, dt,
                          what="half accumulation")


# ---- backward ----------------------------------------------------------------------------------
GRAD_CASES = {
    "causal_gqa": ((1, 2, 5, 8), (1, 1, 7, 8), {"causal": True}),
    "mask_softcap_window": ((2, 2, 6, 8), (2, 2, 9, 8),
                            {"mask_shape": (6, 9), "softcap": 2.0, "window": 4, "scale": 0.5}),
    "bias_half": ((1, 2, 4, 8), (1, 1, 5, 8), {"bias_shape": (1, 2, 4, 5), "causal": True}),
    "bias_f32": ((1, 2, 4, 8), (1, 2, 5, 8), {"bias_shape": (5,), "bias_dtype": "f32"}),
    "decode_lse": ((1, 4, 1, 8), (1, 1, 19, 8), {}),    # the decode kernel: LSE its own step
    "two_tiles": ((1, 1, 20, 12), (1, 1, 24, 12), {"causal": True}),
}


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("name", list(GRAD_CASES))
def test_backward(rng, dt, name):
    """dQ, dK, dV (and a bias's gradient, in the bias's dtype) against the float64 gradients
    of the same rounded inputs and seed, normwise: the backward reads the forward's output O
    rounded to dt (Dl = rowsum(dO * O), as FlashAttention's backward does in torch), an error
    of about u |dO| |O| in each row's Dl that dS = P (dP - Dl) carries into every entry of
    the gradients, however small the entry: so k u (|want| + max |want|)."""
    qs, ks, kw = GRAD_CASES[name]
    kw = dict(kw)
    mask_shape, bias_shape = kw.pop("mask_shape", None), kw.pop("bias_shape", None)
    bias_dtype = kw.pop("bias_dtype", None)
    g, (q, k, v), extra, y = _graph(dt, qs, ks, mask_shape, bias_shape, bias_dtype, **kw)
    feed = _feed(rng, dt, qs, ks, mask_shape, bias_shape, bias_dtype)
    seed = rounded(rng.standard_normal(qs), dt)
    wrt = [q, k, v] + ([extra["bias"]] if "bias" in extra else [])
    grads = g.grad(y, wrt, seed=g.constant(seed))
    assert [t.dtype for t in grads] == [t.dtype for t in wrt]
    assert {n.dtype.name for n in g.nodes if n.op in ("attention_lse", "attention_bwd_delta",
                                                      "attention_bwd_ds")} <= {"f32"}
    g.set_outputs([y, *grads])
    got = rlx.compile(g).run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, mask=feed.get("m"),
                       bias=feed.get("bias"), **kw)
    names = ["o", "dq", "dk", "dv", "dbias"]
    for i, (gv, wv) in enumerate(zip(got, want)):
        if i == 4 and bias_dtype == "f32":    # an f32 bias's gradient: f32, as accurate as the
            assert gv.dtype == np.float32      # half inputs allow (one more rounding to check)
            gv = rounded(gv, dt)
        assert_half_close(gv, wv, dt, k=4.0, scale=np.abs(wv).max() if i else None,
                          what=names[i])


# ---- the dtype rules -----------------------------------------------------------------------------
def test_dtype_errors():
    g = rlx.Graph("err")
    q, k = g.input("q", (1, 2, 5, 16), "f16"), g.input("k", (1, 2, 7, 16), "f16")
    with pytest.raises(ValueError, match=r"attention: k must have q's dtype f16, got bf16 "
                                         r"\[1, 2, 7, 16\] \(q f16 \[1, 2, 5, 16\]\)"):
        g.attention(q, g.input("kb", (1, 2, 7, 16), "bf16"), k)
    with pytest.raises(ValueError, match=r"attention: v must have q's dtype f16, got f32 "
                                         r"\[1, 2, 7, 16\]"):
        g.attention(q, k, g.input("v32", (1, 2, 7, 16)))
    with pytest.raises(ValueError, match=r"attention: bias must be f16 or f32, got bf16 \[5, 7\] "
                                         r"\(q f16 \[1, 2, 5, 16\]\)"):
        g.attention(q, k, k, bias=g.input("bb", (5, 7), "bf16"))
    with pytest.raises(ValueError, match=r"attention: mask must be bool, got f16 \[5, 7\]"):
        g.attention(q, k, k, mask=g.input("mh", (5, 7), "f16"))
    with pytest.raises(ValueError, match=r"attention: q must be f32, f16 or bf16, got i32"):
        qi = g.input("qi", (1, 2, 5, 16), "i32")
        g.attention(qi, qi, qi)


# ---- the GPU's tile geometry (the simulator runs it too; on a GPU it is the default) ----------
@pytest.mark.skipif(not rlx.simulator_enabled(), reason="on a GPU the GPU geometry is the default")
def test_gpu_geometry(rng, monkeypatch):
    """Half loads at the GPU's shapes: the flash kernel's 128 threads and 64 x 64 tiles (two key
    tiles, head dims past a 16-dim chunk), the decode kernel's 4 warps over splits, and the
    backward's dQ / dK / dV kernels."""
    from rlx_numba.kernels.launch import override_geometry
    with override_geometry("attention", A.GPU):
        with monkeypatch.context() as mp:
            mp.setattr(A, "decode_rows", lambda g, sq, d: None)
            run_half(rng, "bf16", (1, 1, 3, 20), (1, 1, 70, 20), mask_shape=(3, 70),
                     bias_shape=(3, 70), causal=True, window=68, scale=0.2, softcap=3.0)
        with monkeypatch.context() as mp:
            mp.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // 40), 40))
            run_half(rng, "f16", (1, 4, 1, 64), (1, 2, 100, 64), causal=True, softcap=2.0)
        g, (q, k, v), _, y = _graph("f16", (1, 1, 3, 5), (1, 1, 4, 5), causal=True)
        feed = _feed(rng, "f16", (1, 1, 3, 5), (1, 1, 4, 5))
        seed = rounded(rng.standard_normal((1, 1, 3, 5)), "f16")
        g.set_outputs(g.grad(y, [q, k, v], seed=g.constant(seed)))
        got = rlx.compile(g).run(feed)
        want = attention64(feed["q"], feed["k"], feed["v"], seed, causal=True)[1:4]
        for gv, wv in zip(got, want):
            assert_half_close(gv, wv, "f16", k=4.0, scale=np.abs(wv).max())


# tier 0 (cuDNN's fused attention) on a GPU: every case it takes, against the same oracle,
# with the tier checked; a bool mask (with a key-padding row that keeps no key: its output is
# 0, as the numba kernels give) and a bias of q's dtype; bigger shapes than the simulator's
CUDNN_CASES = {
    "plain": ((2, 4, 65, 64), (2, 4, 65, 64), {}),
    "causal_gqa": ((2, 8, 77, 64), (2, 2, 77, 64), {"causal": True}),
    "causal_bottom_right": ((1, 4, 33, 128), (1, 4, 100, 128), {"causal": True}),
    "bshd_layout": ((2, 37, 4 * 32), (2, 45, 2 * 32), {"num_heads": 4}),
    "key_mask": ((3, 4, 40, 32), (3, 4, 40, 32), {"mask_shape": (3, 1, 1, 40)}),
    "bias_scale": ((2, 4, 24, 32), (2, 4, 50, 32), {"bias_shape": (1, 4, 24, 50),
                                                    "scale": 0.2}),
}


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("name", list(CUDNN_CASES))
def test_cudnn_tier(rng, monkeypatch, dt, name):
    qs, ks, kw = CUDNN_CASES[name]
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "0")
    g, _, _, y = _graph(dt, qs, ks, kw.get("mask_shape"), kw.get("bias_shape"), None,
                        **{k: v for k, v in kw.items() if k not in ("mask_shape", "bias_shape")})
    g.set_outputs([y])
    feed = _feed(rng, dt, qs, ks, kw.get("mask_shape"), kw.get("bias_shape"))
    if "m" in feed:
        feed["m"][1] = False                      # batch row 1 keeps no key: zeros out
    exe = rlx.compile(g)
    assert any("cudnn sdpa" in s.kernel_name for s in exe.steps), [s.kernel_name for s in exe.steps]
    (got,) = exe.run(feed)
    attrs = {k: v for k, v in kw.items() if k not in ("mask_shape", "bias_shape", "num_heads")}
    if len(qs) == 3:           # [B, S, H * D]: the oracle's [B, H, S, D] and back
        hq, hkv = kw["num_heads"], kw["num_heads"] * ks[2] // qs[2]
        four = [np.moveaxis(feed[n].reshape(t[0], t[1], h, -1), 1, 2)
                for n, t, h in (("q", qs, hq), ("k", ks, hkv), ("v", ks, hkv))]
        want = np.moveaxis(attention64(*four, **attrs), 1, 2).reshape(qs)
    else:
        want = attention64(feed["q"], feed["k"], feed["v"], mask=feed.get("m"),
                           bias=feed.get("bias"), **attrs)
    if "m" in feed:
        assert not np.isnan(f64(got)).any() and not f64(got[1]).any()
    # cuDNN rounds P to the dtype for the P V product (tensor cores): the error is a few u
    # of sum_j p_j |v_j| <= max |v|, so the bound is normwise in v
    assert_half_close(got, want, dt, k=2, scale=np.abs(f64(feed["v"])).max(),
                      what=f"cudnn attention {name}")


# tier 0 for training (GPU): cuDNN's forward with its softmax stats (the LSE node) and its fused
# backward (dQ, dK, dV in one call), against the float64 gradients. cuDNN rounds P to the dtype
# for O = P V and dV = P^T dO, and dS for dQ = dS K and dK = dS^T Q (tensor cores), per-head
# dK / dV too before a GQA group's sum, and reads O rounded (delta = rowsum(dO * O)): each
# result's error is a few u of the magnitudes of the sums that make it (_magnitudes), not of
# the result, which may cancel.
def _to4(x, h):
    """[B, S, H * D] -> [B, H, S, D]."""
    return np.moveaxis(f64(x).reshape(x.shape[0], x.shape[1], h, -1), 1, 2)


def _to3(x):
    """[B, H, S, D] -> [B, S, H * D]."""
    return np.moveaxis(x, 1, 2).reshape(x.shape[0], x.shape[2], -1)


def _magnitudes(q, k, v, dy, *, causal=False, mask=None, bias=None, scale=None):
    """float64 |.|-sums bounding the rounding of each result (see above): O: P |V|;
    dV: P^T |dO|; dQ: scale |dS|' |K|; dK: scale |dS|'^T |Q|, with |dS|' = |dS| + P r and r
    = rowsum(|dO| P |V|) (the error of delta through O's); dbias: |dS|' summed as dbias is."""
    q, k, v, dy = f64(q), f64(k), f64(v), f64(dy)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    K, V = np.abs(np.repeat(k, g, axis=1)), np.abs(np.repeat(v, g, axis=1))
    sc = 1 / np.sqrt(d) if scale is None else scale
    s = q @ np.repeat(k, g, axis=1).transpose(0, 1, 3, 2) * sc
    if bias is not None:
        s = s + f64(bias)
    p, _, _ = masked_softmax(s, _keep(b, hq, sq, sk, causal, None, mask))
    pv = p @ V
    dp = dy @ np.repeat(v, g, axis=1).transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    r = (np.abs(dy) * pv).sum(-1, keepdims=True)
    dsm = np.abs(ds) + p * r
    group = lambda x: x.reshape(b, hkv, g, *x.shape[2:]).sum(2)        # noqa: E731
    return (pv, sc * dsm @ K, group(sc * dsm.transpose(0, 1, 3, 2) @ np.abs(q)),
            group(p.transpose(0, 1, 3, 2) @ np.abs(dy)),
            None if bias is None else _sum_to(dsm, np.shape(bias)))


CUDNN_GRAD_CASES = {
    "plain": ((2, 4, 65, 64), (2, 4, 65, 64), {}),
    "causal": ((2, 4, 77, 128), (2, 4, 77, 128), {"causal": True, "scale": 0.1}),
    "causal_gqa_8_2": ((2, 8, 77, 64), (2, 2, 77, 64), {"causal": True}),
    "causal_bottom_right": ((1, 4, 33, 128), (1, 4, 100, 128), {"causal": True}),
    "bshd_layout": ((2, 37, 4 * 32), (2, 45, 2 * 32), {"num_heads": 4, "causal": True}),
    "bias_no_grad": ((2, 4, 24, 32), (2, 4, 50, 32), {"bias_shape": (1, 4, 24, 50),
                                                      "scale": 0.2}),
    "key_mask": ((3, 4, 40, 32), (3, 4, 40, 32), {"mask_shape": (3, 1, 1, 40)}),
}


def _cudnn_grad_run(rng, dt, qs, ks, kw, wrt_bias=False):
    """(compiled executable, its outputs [O, dQ, dK, dV (, dbias)], the oracle's, the bounds'
    magnitudes) of attention with causal / mask / bias / layout ``kw`` and its gradients."""
    kw = dict(kw)
    mask_shape, bias_shape = kw.pop("mask_shape", None), kw.pop("bias_shape", None)
    g, (q, k, v), extra, y = _graph(dt, qs, ks, mask_shape, bias_shape, None, **kw)
    feed = _feed(rng, dt, qs, ks, mask_shape, bias_shape)
    if "m" in feed:
        feed["m"][1] = False                      # batch row 1 keeps no key: zeros out
    seed = rounded(rng.standard_normal(qs), dt)
    wrt = [q, k, v] + ([extra["bias"]] if wrt_bias else [])
    g.set_outputs([y, *g.grad(y, wrt, seed=g.constant(seed))])
    exe = rlx.compile(g)
    got = exe.run(feed)
    attrs = {n: kw[n] for n in ("causal", "scale") if n in kw}
    ins = [feed["q"], feed["k"], feed["v"], seed]
    if len(qs) == 3:           # [B, S, H * D]: the oracle's [B, H, S, D] and back
        hq = kw["num_heads"]
        hkv = hq * ks[2] // qs[2]
        ins = [_to4(x, h) for x, h in zip(ins, (hq, hkv, hkv, hq))]
    extra_in = dict(mask=feed.get("m"), bias=feed.get("bias"))
    want = attention64(*ins, **extra_in, **attrs)
    mags = _magnitudes(*ins, **extra_in, **attrs)
    if len(qs) == 3:
        want, mags = ([_to3(x) if x is not None else None for x in t] for t in (want, mags))
    n = 5 if wrt_bias else 4
    return exe, got, list(want)[:n], list(mags)[:n]


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("name", list(CUDNN_GRAD_CASES))
def test_cudnn_training(rng, monkeypatch, dt, name):
    """Forward (writing the LSE) and backward both on tier 0: O, dQ, dK, dV within 4 u of
    their sums' magnitudes; a bias without a gradient goes into both calls; a batch row
    that keeps no key gets zero output and gradients, and adds nothing to dK / dV."""
    qs, ks, kw = CUDNN_GRAD_CASES[name]
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "0")
    exe, got, want, mags = _cudnn_grad_run(rng, dt, qs, ks, kw)
    names = [s.kernel_name for s in exe.steps]
    assert [x for x in names if x.startswith("cudnn sdpa ")][0].endswith("+lse"), names
    assert any(x.startswith("cudnn sdpa_backward ") for x in names), names
    assert not any(x.startswith("attention") for x in names), names
    for i, what in enumerate(["o", "dq", "dk", "dv"]):
        assert not np.isnan(f64(got[i])).any(), what
        assert_half_close(got[i], want[i], dt, k=4.0, scale=mags[i],
                          what=f"cudnn {name} {what}")
    if "mask_shape" in kw:
        assert not f64(got[0][1]).any() and not f64(got[1][1]).any()


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dt", HALVES)
def test_cudnn_backward_half_accumulation_would_fail(rng, monkeypatch, dt):
    """1024 queries and keys with nearly equal scores, dO in [2, 3]: each dV entry sums 1024
    terms p dO ~ 2.5 / 1024 up to ~2.5. cuDNN's dV (P rounded to dt, f32 sums) is within 4 u
    of P^T |dO|; the same P^T dO with every partial sum rounded to dt is not (past 2 a bf16
    ulp is 2^-6, several terms; f16's roundings of ~1.3 ulp terms drift one way)."""
    from halfref import half_accumulated
    monkeypatch.setenv("RLX_NUMBA_ATTENTION_TIERS", "0")
    qs = (1, 1, 1024, 16)
    g, (q, k, v), _, y = _graph(dt, qs, qs)
    feed = {"q": rounded(0.1 * rng.standard_normal(qs), dt),
            "k": rounded(rng.standard_normal(qs), dt), "v": rounded(rng.uniform(2, 3, qs), dt)}
    seed = rounded(rng.uniform(2, 3, qs), dt)
    g.set_outputs(g.grad(y, [q, k, v], seed=g.constant(seed)))
    exe = rlx.compile(g)
    assert any(s.kernel_name.startswith("cudnn sdpa_backward ") for s in exe.steps)
    dv = exe.run(feed)[2]
    want = attention64(feed["q"], feed["k"], feed["v"], seed)[3]
    mag = _magnitudes(feed["q"], feed["k"], feed["v"], seed)[3]
    assert_half_close(dv, want, dt, k=4.0, scale=mag, what="cudnn dv")
    s = f64(feed["q"])[0, 0] @ f64(feed["k"])[0, 0].T / 4.0
    p = np.exp(s - s.max(-1, keepdims=True))
    p = rounded(p / p.sum(-1, keepdims=True), dt)
    emulated = half_accumulated(p.T, seed[0, 0], dt).reshape(want.shape)
    with pytest.raises(AssertionError):
        assert_half_close(emulated, want, dt, k=4.0, scale=mag, what="half accumulation")


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dt", HALVES)
def test_cudnn_deterministic_grad_falls_back(rng, monkeypatch, caplog, dt):
    """grad(deterministic=True): the backward is the numba kernels (no atomics), the same bits
    on two runs; the forward stays on cuDNN."""
    import logging
    monkeypatch.delenv("RLX_NUMBA_ATTENTION_TIERS")
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    qs, ks = (2, 4, 40, 32), (2, 2, 40, 32)
    g, (q, k, v), _, y = _graph(dt, qs, ks, causal=True)
    seed = rounded(rng.standard_normal(qs), dt)
    g.set_outputs(g.grad(y, [q, k, v], seed=g.constant(seed), deterministic=True))
    with caplog.at_level(logging.WARNING, logger="rlx_numba"):
        exe = rlx.compile(g)
    assert "grad(deterministic=True)" in caplog.text
    names = [s.kernel_name for s in exe.steps]
    assert any(x.startswith("cudnn sdpa ") for x in names), names
    assert not any(x.startswith("cudnn sdpa_backward") for x in names), names
    feed = _feed(rng, dt, qs, ks)
    first, second = exe.run(feed), exe.run(feed)
    want = attention64(feed["q"], feed["k"], feed["v"], seed, causal=True)[1:4]
    mags = _magnitudes(feed["q"], feed["k"], feed["v"], seed, causal=True)[1:4]
    for a, b, w, m in zip(first, second, want, mags):
        assert np.array_equal(a.view(np.uint16), b.view(np.uint16))
        assert_half_close(a, w, dt, k=4.0, scale=m, what="deterministic")


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("case,bias_shape,wrt_bias,why", [
    ("bias_gradient", (1, 4, 24, 50), True, "a bias gradient"),
    ("bias_over_queries", (50,), False, "a bias broadcast as [1, 1, 1, 50]")])
def test_cudnn_backward_falls_back(rng, monkeypatch, caplog, dt, case, bias_shape, wrt_bias, why):
    """A bias that takes a gradient (dS needs the delta, which cuDNN's fused backward keeps to
    itself), or one broadcast over the queries: the forward stays on cuDNN (its stats the LSE
    the numba backward reads), the backward is the numba kernels, the reason logged."""
    import logging
    monkeypatch.delenv("RLX_NUMBA_ATTENTION_TIERS")
    monkeypatch.setenv("RLX_NUMBA_LOG_FALLBACK", "1")
    with caplog.at_level(logging.WARNING, logger="rlx_numba"):
        exe, got, want, mags = _cudnn_grad_run(
            rng, dt, (2, 4, 24, 32), (2, 2, 50, 32),
            {"bias_shape": bias_shape, "scale": 0.2}, wrt_bias=wrt_bias)
    assert why in caplog.text
    names = [s.kernel_name for s in exe.steps]
    assert any(x.startswith("cudnn sdpa ") and x.endswith("+lse") for x in names), names
    assert not any(x.startswith("cudnn sdpa_backward") for x in names), names
    kernels = ["attention_bwd_delta", "attention_bwd_dq", "attention_bwd_dkv"]
    for kern in kernels + (["attention_bwd_ds"] if wrt_bias else []):
        assert any(x.startswith(kern) for x in names), (kern, names)
    for i, what in enumerate(["o", "dq", "dk", "dv", "dbias"][:len(want)]):
        assert_half_close(got[i], want[i], dt, k=4.0, scale=mags[i], what=f"{case} {what}")


@pytest.mark.skipif(rlx.simulator_enabled(), reason="cuDNN runs on a GPU")
@pytest.mark.parametrize("dt", HALVES)
def test_cudnn_backward_after_numba_decode(rng, monkeypatch, dt):
    """Few queries a key/value head: the forward is the numba decode kernel and the LSE its
    own numba step, the backward cuDNN's, reading that LSE as its stats."""
    monkeypatch.delenv("RLX_NUMBA_ATTENTION_TIERS")
    qs, ks = (2, 4, 8, 32), (2, 2, 40, 32)
    assert A.decode_rows(2, 8, 32) is not None
    exe, got, want, mags = _cudnn_grad_run(rng, dt, qs, ks, {"causal": True})
    names = [s.kernel_name for s in exe.steps]
    assert any(x.startswith("attention decode") for x in names), names
    assert any(x.startswith("attention_lse") for x in names), names
    assert any(x.startswith("cudnn sdpa_backward ") for x in names), names
    for i, what in enumerate(["o", "dq", "dk", "dv"]):
        assert_half_close(got[i], want[i], dt, k=4.0, scale=mags[i], what=f"decode {what}")
