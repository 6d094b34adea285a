"""attention against a float64 NumPy attention written here: masks and their combinations,
scale, softcap, GQA/MQA, decode shapes, odd lengths, head dims, rank-3 inputs."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph

GPU = not rlx.simulator_enabled()


def ref_attention(q, k, v, causal=False, window=None, mask=None, bias=None, scale=None,
                  softcap=None):
    q, k, v = (t.astype(np.float64) for t in (q, k, v))
    b, hq, sq, d = q.shape
    g = hq // k.shape[1]
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    sk = k.shape[2]
    s = q @ k.transpose(0, 1, 3, 2) * (1 / np.sqrt(d) if scale is None else scale)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    pos = sk - sq + np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    keep = np.ones((b, hq, sq, sk), bool)
    if causal:
        keep &= j <= pos
    if window is not None:              # DESIGN.md: pos - w < j <= pos
        keep &= (j > pos - window) & (j <= pos)
    if mask is not None:
        keep &= mask
    s = np.where(keep, s, -np.inf)
    mx = s.max(-1, keepdims=True)
    e = np.where(keep, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
    den = e.sum(-1, keepdims=True)
    return np.where(den > 0, e / np.where(den > 0, den, 1), 0) @ v


def run_attention(rng, b, hq, hkv, sq, sk, d, mask_shape=None, bias_shape=None, **kw):
    g = rlx.Graph("attn")
    q = g.input("q", (b, hq, sq, d))
    k, v = g.input("k", (b, hkv, sk, d)), g.input("v", (b, hkv, sk, d))
    ins = {"q": rng.standard_normal((b, hq, sq, d)).astype(np.float32),
           "k": rng.standard_normal((b, hkv, sk, d)).astype(np.float32),
           "v": rng.standard_normal((b, hkv, sk, d)).astype(np.float32)}
    extra = {}
    if mask_shape is not None:
        ins["m"] = rng.random(mask_shape) < 0.7
        extra["mask"] = g.input("m", mask_shape, "bool")
    if bias_shape is not None:
        ins["bias"] = rng.standard_normal(bias_shape).astype(np.float32)
        extra["bias"] = g.input("bias", bias_shape)
    g.set_outputs([g.attention(q, k, v, **extra, **kw)])
    (got,) = run_graph(g, ins)
    want = ref_attention(ins["q"], ins["k"], ins["v"], mask=ins.get("m"), bias=ins.get("bias"), **kw)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)
    return got


@pytest.mark.parametrize("sq,sk", [(1, 1), (7, 7), (1, 9), (3, 10), (7, 5), (13, 21)])
@pytest.mark.parametrize("causal", [False, True])
def test_lengths_and_causal(rng, sq, sk, causal):
    out = run_attention(rng, 2, 2, 2, sq, sk, 16, causal=causal)
    if causal and sq > sk:      # queries before the first key see nothing: zeros, not NaN
        assert (out[:, :, : sq - sk] == 0).all()


@pytest.mark.parametrize("window", [1, 3])
def test_sliding_window(rng, window):
    run_attention(rng, 1, 2, 1, 9, 12, 16, window=window)
    run_attention(rng, 1, 2, 1, 9, 12, 16, window=window, causal=True)
    run_attention(rng, 1, 1, 1, 24, 24, 16, window=window)     # several query and key tiles
    run_attention(rng, 1, 1, 1, 4, 24, 16, window=window)      # the decode kernel


@pytest.mark.parametrize("mask_shape", [(2, 1, 5, 11), (11,), (5, 11), (2, 3, 1, 11)])
def test_bool_mask(rng, mask_shape):
    run_attention(rng, 2, 3, 3, 5, 11, 16, mask_shape=mask_shape)


@pytest.mark.parametrize("bias_shape", [(1, 3, 5, 11), (5, 11), (2, 1, 1, 11)])
def test_additive_bias_with_everything(rng, bias_shape):
    run_attention(rng, 2, 3, 1, 5, 11, 16, bias_shape=bias_shape, mask_shape=(5, 11),
                  causal=True, window=6, scale=0.3, softcap=2.5)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
def test_gqa(rng, hq, hkv):
    run_attention(rng, 2, hq, hkv, 6, 9, 16, causal=True)


@pytest.mark.parametrize("d", [10, 16, 64, 80, 128, 256])
def test_head_dims(rng, d):
    run_attention(rng, 1, 2, 1, 5 if d > 64 else 9, 7, d, causal=d % 32 == 0)


DEC_SHAPES = [(4, 1, 4, 21, 64), (2, 2, 13, 13, 16), (8, 2, 2, 9, 128),
              (4, 2, 1, 11, 36),    # 36: dim pairs past d / 2
              (2, 1, 2, 10, 112)]   # 112: 16-byte groups past d
# decode-split in the simulator: 2-3 splits and 1-2 row groups a head cost the same blocks of
# Python threads as the plain decode kernel times splits x groups (13 rows: 56 blocks, 32 s),
# so there it takes the shapes that reach each split path cheaply: several splits (all),
# several row groups (112), a last group half empty (3 rows in groups of 2), the head dims
# past d / 2 and past d (36, 112); the flash and decode cases keep every shape
SPLIT_SIM = [(4, 2, 1, 11, 36), (2, 1, 2, 10, 112), (3, 1, 1, 10, 16)]
DEC_CASES = ([(k, *s) for k in ("flash", "decode", "decode-split") for s in DEC_SHAPES] if GPU else
             [(k, *s) for k in ("flash", "decode") for s in DEC_SHAPES]
             + [("decode-split", *s) for s in SPLIT_SIM])


@pytest.mark.parametrize("kernel,hq,hkv,sq,sk,d", DEC_CASES)
def test_decode_kernel_and_flash_kernel(rng, monkeypatch, kernel, hq, hkv, sq, sk, d):
    """The shapes both kernels can take (GQA group x Sq <= 16), each kernel forced, every
    option at once. decode-split: the keys split over blocks of 8 (partials combined by the
    last block of a head) and the rows over blocks of 2, as a GPU's plan does for long and
    for short sequences (the simulator's one SM would not)."""
    from rlx_numba.kernels import attention as A
    if kernel == "flash":
        monkeypatch.setattr(A, "decode_rows", lambda g, sq, d: None)
    else:
        assert A.decode_rows(hq // hkv, sq, d) is not None
    if kernel == "decode-split":
        monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // 8), 8))
        monkeypatch.setattr(A, "decode_groups", lambda rows_c, rows, blocks, sm: (2, -(-rows // 2)))
    run_attention(rng, 2, hq, hkv, sq, sk, d, bias_shape=(sq, sk), mask_shape=(sq, sk),
                  causal=True, window=7, scale=0.2, softcap=3.0)
    run_attention(rng, 1, hq, hkv, sq, sk, d, causal=True)



def test_decode_more_splits_than_one_combine_round(rng, monkeypatch):
    """More splits than the combine loads at once (CB): the last block takes the max over
    every split first, then the partials in rounds of CB (fewer: one round, its own max)."""
    from rlx_numba.kernels import attention as A
    sk = 4 * A.CB + 9
    monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // 4), 4))
    assert -(-sk // 4) > A.CB
    run_attention(rng, 1, 2, 1, 1, sk, 16, causal=True, window=sk - 6, softcap=2.0)

def test_decode_one_block_a_head_for_short_caches():
    """The GPU plan of the 1B shape's b1 decode (8 kv heads, 128 cache rows, 132 SMs): one
    16-warp block a head, no splits; long caches and many heads keep the split plan. (The
    simulator runs this plan in the decode cases above at b1: 21 keys, one 4-warp block.)"""
    from rlx_numba.kernels import attention as A
    assert A.decode_warps(1, 8, 128, 132, 4) == 16 and A.decode_plan(1, 8, 128, 132, 16) == (1, 128)
    assert A.decode_warps(1, 8, 40, 132, 4) == 8
    assert A.decode_warps(1, 8, 256, 132, 4) == 4       # past 16 warps of 8 keys
    assert A.decode_warps(32, 8, 128, 132, 4) == 4      # 256 heads fill the GPU already
    assert A.decode_warps(1, 1, 21, 1, 2) == 4


def test_long_odd_sequence(rng):
    run_attention(rng, 1, 1, 1, 37 if not GPU else 129, 37 if not GPU else 129, 16, causal=True)


def test_fully_masked_rows_give_zeros(rng):
    g = rlx.Graph("masked")
    q, k, v = g.input("q", (1, 1, 3, 8)), g.input("k", (1, 1, 4, 8)), g.input("v", (1, 1, 4, 8))
    m = g.input("m", (3, 4), "bool")
    g.set_outputs([g.attention(q, k, v, mask=m)])
    mv = np.array([[1, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 1]], bool)
    ins = {n: rng.standard_normal(s).astype(np.float32) for n, s in
           (("q", (1, 1, 3, 8)), ("k", (1, 1, 4, 8)), ("v", (1, 1, 4, 8)))}
    (got,) = run_graph(g, {**ins, "m": mv})
    assert np.isfinite(got).all() and (got[0, 0, 1] == 0).all()
    np.testing.assert_allclose(got, ref_attention(ins["q"], ins["k"], ins["v"], mask=mv),
                               rtol=1e-4, atol=1e-5)


def test_rank3_inputs(rng):
    b, s, hq, hkv, d = 2, 6, 4, 2, 16
    g = rlx.Graph("rank3")
    q = g.input("q", (b, s, hq * d))
    k, v = g.input("k", (b, s + 2, hkv * d)), g.input("v", (b, s + 2, hkv * d))
    g.set_outputs([g.attention(q, k, v, causal=True, num_heads=hq)])
    qv = rng.standard_normal((b, s, hq * d)).astype(np.float32)
    kv = rng.standard_normal((b, s + 2, hkv * d)).astype(np.float32)
    vv = rng.standard_normal((b, s + 2, hkv * d)).astype(np.float32)
    (got,) = run_graph(g, {"q": qv, "k": kv, "v": vv})
    split = lambda t, h: t.reshape(t.shape[0], t.shape[1], h, d).transpose(0, 2, 1, 3)  # noqa: E731
    want = ref_attention(split(qv, hq), split(kv, hkv), split(vv, hkv), causal=True)
    np.testing.assert_allclose(got, want.transpose(0, 2, 1, 3).reshape(b, s, hq * d),
                               rtol=2e-4, atol=2e-5)


def test_large_scores_do_not_overflow(rng):
    g = rlx.Graph("big")
    q, k, v = g.input("q", (1, 1, 4, 8)), g.input("k", (1, 1, 6, 8)), g.input("v", (1, 1, 6, 8))
    g.set_outputs([g.attention(q, k, v, scale=1.0)])
    ins = {"q": (rng.standard_normal((1, 1, 4, 8)) * 30).astype(np.float32),
           "k": (rng.standard_normal((1, 1, 6, 8)) * 30).astype(np.float32),
           "v": rng.standard_normal((1, 1, 6, 8)).astype(np.float32)}
    (got,) = run_graph(g, ins)
    np.testing.assert_allclose(got, ref_attention(ins["q"], ins["k"], ins["v"], scale=1.0),
                               rtol=1e-4, atol=1e-4)


def test_errors():
    g = rlx.Graph("err")
    q, k = g.input("q", (1, 4, 5, 16)), g.input("k", (1, 3, 7, 16))
    with pytest.raises(ValueError, match=r"attention: q heads \(4\) must be a multiple of k/v heads \(3\)"):
        g.attention(q, k, k)
    k2 = g.input("k2", (1, 2, 7, 16))
    with pytest.raises(ValueError, match=r"attention: k and v must have the same shape, got k "
                                         r"\[1, 2, 7, 16\], v \[1, 3, 7, 16\]"):
        g.attention(q, k2, k)
    with pytest.raises(ValueError, match=r"attention: mask must be bool, got f32 \[5, 7\]"):
        g.attention(q, k2, k2, mask=g.input("m", (5, 7)))
    with pytest.raises(ValueError, match=r"attention: shapes do not broadcast: mask \[5, 6\], "
                                         r"scores \[1, 4, 5, 7\]"):
        g.attention(q, k2, k2, mask=g.input("m2", (5, 6), "bool"))
    with pytest.raises(ValueError, match=r"attention: rank-3 q \[1, 5, 64\] needs num_heads"):
        g.attention(g.input("q3", (1, 5, 64)), g.input("k3", (1, 5, 64)), g.input("v3", (1, 5, 64)))
    with pytest.raises(ValueError, match=r"attention: window must be a positive int, got 0"):
        g.attention(q, k2, k2, window=0)
    with pytest.raises(ValueError, match=r"attention: softcap must be > 0, got -1"):
        g.attention(q, k2, k2, softcap=-1)
