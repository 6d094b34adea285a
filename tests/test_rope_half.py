"""rope, rope_kv_write and kv_write with f16 / bf16 activations (kernels/rope.py: loads widen to
f32, the rotation in f32 with the f32 cos / sin tables, each store rounded once; the v cache
and kv_write copy bits) against float64 NumPy on the same half-rounded inputs
(tests/halfref.py): NeoX and GPT-J pairs, partial rotation, offsets and position tensors, the
VJP, half KV caches feeding the decode kernel, and a cancelling rotation that half arithmetic
gets wrong."""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HALVES, HOST, assert_half_close, f64, rounded
from test_attention_half import attention64
from test_fused_decoder import np_rope_kv_write
from test_rope import np_rope, tables

# (x shape, n_rot, position_offset, positions): odd S, partial rotation, [B, S] positions,
# rank 3 (one head)
CASES = [((2, 3, 7, 16), None, 0, None), ((1, 2, 5, 12), 8, 3, None),
         ((2, 3, 4, 8), 6, 0, "bs"), ((2, 5, 10), None, 1, None)]


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,n_rot,offset,posmode", CASES)
def test_rope(rng, dt, interleaved, shape, n_rot, offset, posmode):
    """f32 tables, or tables in x's dtype (a model converted to half: HF casts them so) for
    every other case."""
    b, s, d = shape[0], shape[-2], shape[-1]
    nr = d if n_rot is None else n_rot
    max_pos = offset + s + 4
    cos, sin = tables(max_pos, nr)
    if (CASES.index((shape, n_rot, offset, posmode)) + interleaved) % 2:
        cos, sin = rounded(cos, dt), rounded(sin, dt)
    xv = rounded(rng.standard_normal(shape), dt)
    g = rlx.Graph("rope_half")
    x = g.input("x", shape, dt)
    feed, positions, pos = {"x": xv}, None, offset + np.arange(s)
    if posmode == "bs":
        pos = rng.integers(0, max_pos, (b, s))
        positions = g.input("pos", (b, s), "i32")
        feed["pos"] = pos.astype(np.int32)
    y = g.rope(x, g.constant(cos), g.constant(sin), n_rot=n_rot, interleaved=interleaved,
               position_offset=0 if positions is not None else offset, positions=positions)
    assert y.dtype == x.dtype
    g.set_outputs([y])
    (got,) = rlx.compile(g).run(feed)
    assert_half_close(got, np_rope(f64(xv), f64(cos), f64(sin), pos, nr, interleaved), dt)


@pytest.mark.parametrize("dt", HALVES)
def test_rope_cancellation_half_arithmetic_would_fail(rng, dt):
    """x1 = x0 cos / sin (1 + ~2^-5): the first rotated value x0 cos - x1 sin cancels to ~2^-5
    of its terms. The kernel computes it in f32 from the f32 tables and rounds once (error
    u |y|); half arithmetic rounds cos, sin and both products first, errors of u |x0 cos|,
    ~2^5 times u |y|: its emulation fails the bound (no slack: scale 0) the kernel passes."""
    b, h, s, d = 1, 2, 5, 8
    half = d // 2
    ang = rng.uniform(0.3, 1.2, (s, half))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    x0 = rng.standard_normal((b, h, s, half))
    x1 = x0 * cos / sin * (1 + rng.choice([-1, 1], x0.shape) * rng.uniform(2**-6, 2**-4, x0.shape))
    xv = rounded(np.concatenate([x0, x1], -1), dt)
    g = rlx.Graph("rope_cancel")
    x = g.input("x", xv.shape, dt)
    g.set_outputs([g.rope(x, g.constant(cos), g.constant(sin))])
    (got,) = rlx.compile(g).run({"x": xv})
    want = np_rope(f64(xv), cos, sin, np.arange(s), d, False)
    assert_half_close(got, want, dt, scale=0.0, what="rope")
    rd = lambda v: np.asarray(v, np.float32).astype(HOST[dt]).astype(np.float64)    # noqa: E731
    a, bb, c, sn = f64(xv[..., :half]), f64(xv[..., half:]), rd(cos), rd(sin)
    emul = np.concatenate([rd(rd(a * c) - rd(bb * sn)), rd(rd(bb * c) + rd(a * sn))], -1)
    with pytest.raises(AssertionError):
        assert_half_close(emul.astype(HOST[dt]), want, dt, scale=0.0, what="half arithmetic")


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("half_tables", [False, True])
def test_rope_grad(rng, dt, half_tables):
    """dx (x's dtype): dy rotated back; d cos / d sin of param tables (the tables' dtype,
    summed in f32): per position, sum over batch and heads of dy0 x0 + dy1 x1 and
    dy1 x0 - dy0 x1."""
    shape, nr, off = (2, 3, 5, 8), 6, 2
    tdt = dt if half_tables else "f32"
    cos, sin = (rounded(t, tdt) for t in tables(off + 5 + 2, nr))
    xv, dyv = rounded(rng.standard_normal(shape), dt), rounded(rng.standard_normal(shape), dt)
    g = rlx.Graph("rope_grad")
    x = g.input("x", shape, dt)
    c, sn = g.param("cos", cos.shape, tdt), g.param("sin", sin.shape, tdt)
    y = g.rope(x, c, sn, n_rot=nr, position_offset=off)
    dx, dc, ds = g.grad(y, [x, c, sn], seed=g.constant(dyv))
    assert (dx.dtype.name, dc.dtype.name, ds.dtype.name) == (dt, tdt, tdt)
    g.set_outputs([dx, dc, ds])
    exe = rlx.compile(g)
    exe.set_param("cos", cos)
    exe.set_param("sin", sin)
    got = exe.run({"x": xv})
    assert_half_close(got[0], np_rope(f64(dyv), f64(cos), -f64(sin), off + np.arange(5), nr,
                                      False), dt)
    x64, d64 = f64(xv), f64(dyv)
    x0, x1, d0, d1 = x64[..., :3], x64[..., 3:6], d64[..., :3], d64[..., 3:6]
    want_c, want_s = np.zeros(cos.shape), np.zeros(sin.shape)
    want_c[off:off + 5] = (d0 * x0 + d1 * x1).sum((0, 1))
    want_s[off:off + 5] = (d1 * x0 - d0 * x1).sum((0, 1))
    for gv, wv in zip(got[1:], (want_c, want_s)):
        if half_tables:
            assert_half_close(gv, wv, dt)
        else:                         # f32 sums of exact products of half values
            np.testing.assert_allclose(gv, wv, rtol=1e-5, atol=1e-5)


# (B, S, Hq, Hkv, D, n_rot, max_S, cache position, interleaved, positions)
RKV_CASES = [(1, 1, 4, 1, 16, None, 8, 5, False, None),       # decode, GQA 4:1
             (2, 3, 3, 1, 12, 8, 7, 2, True, None),             # prefill, partial, GPT-J
             (2, 2, 2, 2, 8, None, 5, 1, False, "bs")]          # per-row positions


@pytest.mark.parametrize("dt", HALVES)
@pytest.mark.parametrize("b,s,hq,hkv,d,n_rot,max_s,cpos,inter,posmode", RKV_CASES)
def test_rope_kv_write_half_caches(rng, dt, b, s, hq, hkv, d, n_rot, max_s, cpos, inter, posmode):
    """q in qkv's dtype; the rotated keys rounded once into the half k cache; the values copied
    bit for bit into the v cache; every other cache row untouched."""
    nr = d if n_rot is None else n_rot
    max_pos = max_s + 3
    cos, sin = tables(max_pos, nr)
    if inter:                         # tables in qkv's dtype
        cos, sin = rounded(cos, dt), rounded(sin, dt)
    qkv = rounded(rng.standard_normal((b, s, (hq + 2 * hkv) * d)), dt)
    kc0 = rounded(rng.standard_normal((b, hkv, max_s, d)), dt)
    vc0 = rounded(rng.standard_normal((b, hkv, max_s, d)), dt)
    g = rlx.Graph("rkv_half")
    x = g.input("qkv", qkv.shape, dt)
    kc, vc = g.param("kc", kc0.shape, dt), g.param("vc", vc0.shape, dt)
    feed, positions = {"qkv": qkv}, None
    pos = np.broadcast_to(cpos + np.arange(s), (b, s))
    if posmode == "bs":
        pos = rng.integers(0, max_pos, (b, s))
        positions = g.input("pos", (b, s), "i32")
        feed["pos"] = pos.astype(np.int32)
    q, k, v = g.rope_kv_write(x, g.constant(cos), g.constant(sin), kc, vc, cpos, num_heads=hq,
                              num_kv_heads=hkv, n_rot=n_rot, interleaved=inter,
                              positions=positions)
    assert q.dtype.name == k.dtype.name == v.dtype.name == dt
    g.set_outputs([q, k, v])
    exe = rlx.compile(g)
    exe.set_param("kc", kc0)
    exe.set_param("vc", vc0)
    got = exe.run(feed)
    wq, wk, wv = np_rope_kv_write(f64(qkv), f64(cos), f64(sin), f64(kc0), f64(vc0), cpos, pos,
                                  hq, hkv, nr, inter)
    assert_half_close(got[0], wq, dt, what="q")
    assert_half_close(got[1], wk, dt, what="k cache")
    rows = np.zeros(max_s, bool)
    rows[cpos:cpos + s] = True
    assert np.array_equal(got[1][:, :, ~rows].view(np.uint16), kc0[:, :, ~rows].view(np.uint16))
    assert np.array_equal(got[2].view(np.uint16), rounded(wv, dt).view(np.uint16))


@pytest.mark.parametrize("dt", HALVES)
def test_half_cache_feeds_decode_attention(rng, dt):
    """A bf16 / f16 decode step: rope_kv_write into half param caches, then attention (the
    decode kernel, Sq = 1) over the caches read as half K / V, masked to the rows written."""
    hq, hkv, d, max_s, cpos = 4, 2, 8, 24, 20
    cos, sin = tables(max_s, d)
    qkv = rounded(rng.standard_normal((1, 1, (hq + 2 * hkv) * d)), dt)
    kc0 = rounded(rng.standard_normal((1, hkv, max_s, d)), dt)
    vc0 = rounded(rng.standard_normal((1, hkv, max_s, d)), dt)
    g = rlx.Graph("decode_half")
    x = g.input("qkv", qkv.shape, dt)
    kc, vc = g.param("kc", kc0.shape, dt), g.param("vc", vc0.shape, dt)
    q, k, v = g.rope_kv_write(x, g.constant(cos), g.constant(sin), kc, vc, cpos, num_heads=hq,
                              num_kv_heads=hkv)
    keep = np.arange(max_s) <= cpos
    y = g.attention(q, k, v, mask=g.constant(keep))
    assert y.dtype.name == dt
    g.set_outputs([y])
    exe = rlx.compile(g)
    exe.set_param("kc", kc0)
    exe.set_param("vc", vc0)
    (got,) = exe.run({"qkv": qkv})
    pos = np.full((1, 1), cpos)
    wq, wk, wv = np_rope_kv_write(f64(qkv), cos, sin, f64(kc0), f64(vc0), cpos, pos, hq, hkv, d,
                                  False)
    # the kernel's q and k are the rounded rotations: the oracle starts from those
    want = attention64(rounded(wq, dt), rounded(wk, dt), rounded(wv, dt), mask=keep)
    assert_half_close(got, want, dt)


def test_kv_write_half_and_dtype_errors():
    g = rlx.Graph("kvw")
    kc = g.param("kc", (1, 2, 6, 4), "bf16")
    with pytest.raises(ValueError, match=r"kv_write: new is f16 \[1, 2, 1, 4\] but cache is "
                                         r"bf16 \[1, 2, 6, 4\]; they must match"):
        g.kv_write(kc, g.input("n", (1, 2, 1, 4), "f16"), 0)
    qkv = g.input("qkv", (1, 1, 16), "f16")
    cs = g.constant(np.zeros((6, 2), np.float32))
    with pytest.raises(ValueError, match=r"rope_kv_write: k_cache is bf16 \[1, 2, 6, 4\] but "
                                         r"qkv is f16 \[1, 1, 16\]; the caches hold qkv's dtype"):
        g.rope_kv_write(qkv, cs, cs, kc, g.param("vc", (1, 2, 6, 4), "bf16"), 0, num_heads=2,
                        num_kv_heads=1)
    with pytest.raises(ValueError, match=r"rope_kv_write: cos must be f32 or f16 \(qkv's dtype\), "
                                         r"got bf16 \[6, 2\]"):
        g.rope_kv_write(qkv, g.cast(cs, "bf16"), cs, g.param("k2", (1, 1, 6, 4), "f16"),
                        g.param("v2", (1, 1, 6, 4), "f16"), 0, num_heads=2, num_kv_heads=1)
    x = g.input("x", (1, 2, 3, 4), "bf16")
    with pytest.raises(ValueError, match=r"rope: sin must be f32 or bf16 \(x's dtype\), got f16 "
                                         r"\[6, 2\]"):
        g.rope(x, cs, g.cast(cs, "f16"))
    with pytest.raises(ValueError, match=r"rope: cos f32 \[6, 2\] and sin bf16 \[6, 2\] must "
                                         r"have the same dtype"):
        g.rope(x, cs, g.cast(cs, "bf16"))


@pytest.mark.parametrize("dt", HALVES)
def test_kv_write_half_copies_bits(rng, dt):
    new = rounded(rng.standard_normal((1, 2, 3, 4)), dt)
    c0 = rounded(rng.standard_normal((1, 2, 6, 4)), dt)
    g = rlx.Graph("kvw_half")
    kc = g.param("kc", c0.shape, dt)
    out = g.kv_write(kc, g.input("n", new.shape, dt), 2)
    assert out.dtype.name == dt
    g.set_outputs([out])
    exe = rlx.compile(g)
    exe.set_param("kc", c0)
    (got,) = exe.run({"n": new})
    want = c0.copy()
    want[:, :, 2:5] = new
    assert got.dtype == want.dtype and np.array_equal(got.view(np.uint16), want.view(np.uint16))
