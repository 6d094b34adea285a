"""Fewer kernels a decoder layer: narrow as a view (contiguous slices at an offset; strided
slices read in place by element-wise kernels), rope_kv_write (RoPE of q and k and the KV-cache
write in one kernel, from a packed q/k/v product) against NumPy, and build_llama's fused graph
against its unfused one (fused=False)."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import run_graph
from rlx_numba.models.llama import (LlamaConfig, LlamaForCausalLM, build_llama, cache_names,
                                    graph_param_reader, graph_param_shapes, graph_params,
                                    llama_param_shapes, pad_name, product_weights)
from rlx_numba.runtime.schedule import node_units


def kernel_nodes(exe):
    """The graph ops that got a kernel (a step) in this executable."""
    return [exe.graph.nodes[nid].op for nid, steps in exe._node_steps.items() if steps]


# ---- narrow as a view ----------------------------------------------------------------------------
def test_contiguous_narrows_are_views_at_an_offset(rng):
    """Contiguous slices at 256-byte offsets are plain views (outputs, products, anything
    reads them); at other offsets only element-wise readers take them in place."""
    xv = rng.standard_normal((1, 5, 64)).astype(np.float32)
    wv = rng.standard_normal((4, 64)).astype(np.float32)
    g = rlx.Graph()
    x = g.input("x", xv.shape)
    a = g.narrow(x, 1, 2, 3)                       # outer dims all 1: one run at offset 128
    b = g.narrow(g.narrow(x, 1, 1, 4), 1, 2, 2)    # a view of a view: offsets add up
    c = g.narrow(g.reshape(x, (5, 64)), 1, 0, 64)  # the whole rows
    d = g.linear(g.narrow(x, 1, 4, 1), g.transpose(g.constant(wv), (1, 0)))  # a product reads one
    odd = g.narrow(g.reshape(x, (320,)), 0, 3, 70)  # offset 12 bytes: read in place by exp
    g.set_outputs([a, b, c, g.exp(a), d, g.exp(odd)])
    exe = rlx.compile(g)
    ya, yb, yc, ye, yd, yo = exe.run({"x": xv})
    np.testing.assert_array_equal(ya, xv[:, 2:5])
    np.testing.assert_array_equal(yb, xv[:, 3:5])
    np.testing.assert_array_equal(yc, xv[0])
    np.testing.assert_allclose(ye, np.exp(xv[:, 2:5]), rtol=1e-6)
    np.testing.assert_allclose(yd, xv[:, 4:5] @ wv.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(yo, np.exp(xv.reshape(-1)[3:73]), rtol=1e-6)
    assert "narrow" not in kernel_nodes(exe)
    assert exe.memory_report()["views"] >= 6
    g2 = rlx.Graph()                               # the same odd slice into a product: a copy
    x = g2.input("x", (1, 70))
    y = g2.narrow(g2.reshape(x, (70,)), 0, 3, 64)
    g2.set_outputs([g2.linear(g2.reshape(y, (1, 64)), g2.transpose(g2.constant(wv), (1, 0)))])
    exe = rlx.compile(g2)
    xv = rng.standard_normal((1, 70)).astype(np.float32)
    (got,) = exe.run({"x": xv})
    np.testing.assert_allclose(got, xv[:, 3:67] @ wv.T, rtol=1e-5, atol=1e-5)
    assert "narrow" in kernel_nodes(exe)


@pytest.mark.parametrize("fusion", ["1", "0"])
def test_strided_narrows_feed_elementwise_kernels_in_place(rng, monkeypatch, fusion):
    """silu(gate) * up over a packed [.., 2I] tensor (odd I, rows > 1): no narrow copy, with
    and without fusion, broadcasting against a [I] bias and a narrow on a middle axis."""
    monkeypatch.setenv("RLX_NUMBA_FUSION", fusion)
    i = 37
    xv = rng.standard_normal((2, 3, 2 * i)).astype(np.float32)
    bv = rng.standard_normal((i,)).astype(np.float32)
    yv = rng.standard_normal((2, 5, 4)).astype(np.float32)
    g = rlx.Graph()
    x = g.relu(g.input("x", xv.shape))           # a computed (arena) tensor, not an input
    gate, up = g.narrow(x, 2, 0, i), g.narrow(x, 2, i, i)
    act = g.silu(gate) * up + g.constant(bv)
    y = g.input("y", yv.shape)
    mid = g.narrow(y, 1, 1, 3) * 2.0             # [2, 3, 4] of [2, 5, 4]: rows of 12 apart 20
    g.set_outputs([act, mid])
    exe = rlx.compile(g)
    got, gm = exe.run({"x": xv, "y": yv})
    r = np.maximum(xv, 0)
    ga, u = r[..., :i], r[..., i:]
    np.testing.assert_allclose(got, ga / (1 + np.exp(-ga)) * u + bv, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(gm, yv[:, 1:4] * 2)
    assert "narrow" not in kernel_nodes(exe)


def test_strided_narrows_other_readers_get_a_copy(rng):
    """A strided narrow read by a kernel that wants dense operands (a norm, a reshape) or
    that is an output is still copied; one added to a product stays a view, and the add then
    keeps its own kernel (the product's epilogue reads dense operands)."""
    xv = rng.standard_normal((3, 10)).astype(np.float32)
    wv = rng.standard_normal((4, 6)).astype(np.float32)
    g = rlx.Graph()
    x = g.exp(g.input("x", xv.shape))
    n1 = g.narrow(x, 1, 2, 6)                    # read by a norm and a reshape
    n2 = g.narrow(x, 1, 6, 4)                    # added to a product: not in its epilogue
    n3 = g.narrow(x, 1, 0, 3)                    # an output
    nrm = g.rms_norm(n1, g.constant(np.ones(6, np.float32)))
    lin = g.linear(n1, g.transpose(g.constant(wv), (1, 0))) + n2
    g.set_outputs([nrm, g.reshape(n1, (18,)), lin, n3])
    exe = rlx.compile(g)
    a, b, c, d = exe.run({"x": xv})
    e = np.exp(xv)
    np.testing.assert_allclose(a, e[:, 2:8] / np.sqrt((e[:, 2:8] ** 2).mean(-1, keepdims=True)
                                                       + 1e-6), rtol=1e-5)
    np.testing.assert_allclose(b, e[:, 2:8].reshape(-1), rtol=1e-6)
    np.testing.assert_allclose(c, e[:, 2:8] @ wv.T + e[:, 6:], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(d, e[:, :3], rtol=1e-6)
    ops = kernel_nodes(exe)
    assert ops.count("narrow") == 2 and "binary" in ops
    assert not exe.fusion.folds


# ---- rope_kv_write ------------------------------------------------------------------------------
def tables(max_pos, n_rot):
    inv = 10000.0 ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = np.arange(max_pos)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def np_rot(x, cos, sin, p, n_rot, interleaved):
    """x [..., D] of one token at position p, rotated like Graph.rope (float64)."""
    half = n_rot // 2
    i0 = np.arange(0, n_rot, 2) if interleaved else np.arange(half)
    i1 = i0 + 1 if interleaved else i0 + half
    out = x.astype(np.float64).copy()
    a, b = out[..., i0].copy(), out[..., i1].copy()
    c, s = cos[p].astype(np.float64), sin[p].astype(np.float64)
    out[..., i0], out[..., i1] = a * c - b * s, b * c + a * s
    return out


def np_rope_kv_write(qkv, cos, sin, kc, vc, cpos, pos, hq, hkv, n_rot, interleaved):
    b, s, _ = qkv.shape
    d = kc.shape[-1]
    x = qkv.reshape(b, s, hq + 2 * hkv, d)
    q = np.zeros((b, hq, s, d))
    k, v = kc.astype(np.float64).copy(), vc.astype(np.float64).copy()
    for r in range(b):
        for t in range(s):
            p = pos[r, t]
            q[r, :, t] = np_rot(x[r, t, :hq], cos, sin, p, n_rot, interleaved)
            k[r, :, cpos + t] = np_rot(x[r, t, hq:hq + hkv], cos, sin, p, n_rot, interleaved)
            v[r, :, cpos + t] = x[r, t, hq + hkv:]
    return q, k, v


# (B, S, Hq, Hkv, D, n_rot, max_S, cache position, interleaved, positions): decode (S 1) and
# prefill (S > 1), GQA / MQA / MHA with odd head counts, partial rotation
RKV_CASES = [
    (1, 1, 3, 1, 16, None, 8, 5, False, None),
    (2, 3, 3, 1, 16, None, 7, 2, True, None),
    (2, 1, 5, 5, 8, 4, 4, 3, False, "bs"),
    (3, 4, 6, 3, 10, 6, 9, 0, True, "s"),
    (2, 5, 4, 2, 12, None, 5, 0, False, "bs"),
]


@pytest.mark.parametrize("cpos_tensor", [False, True])
@pytest.mark.parametrize("b,s,hq,hkv,d,n_rot,max_s,cpos,inter,posmode", RKV_CASES)
def test_rope_kv_write_matches_numpy(rng, b, s, hq, hkv, d, n_rot, max_s, cpos, inter, posmode,
                                     cpos_tensor):
    nr = d if n_rot is None else n_rot
    max_pos = max_s + 3
    cos, sin = tables(max_pos, nr)
    qkv = rng.standard_normal((b, s, (hq + 2 * hkv) * d)).astype(np.float32)
    kc0 = rng.standard_normal((b, hkv, max_s, d)).astype(np.float32)
    vc0 = rng.standard_normal((b, hkv, max_s, d)).astype(np.float32)
    g = rlx.Graph()
    x = g.input("qkv", qkv.shape)
    kc, vc = g.param("kc", kc0.shape), g.param("vc", vc0.shape)
    inputs = {"qkv": qkv}
    cp = cpos
    if cpos_tensor:
        cp = g.input("cp", (1,), "i64")
        inputs["cp"] = np.array([cpos], np.int64)
    pos = np.broadcast_to(cpos + np.arange(s), (b, s))
    positions = None
    if posmode == "bs":       # per-row positions (left-padded rows)
        pos = rng.integers(0, max_pos, (b, s))
        positions = g.input("pos", (b, s), "i32")
        inputs["pos"] = pos.astype(np.int32)
    elif posmode == "s":
        pos = np.broadcast_to(rng.integers(0, max_pos, s), (b, s))
        positions = g.input("pos", (s,), "i64")
        inputs["pos"] = pos[0].astype(np.int64)
    q, k, v = g.rope_kv_write(x, g.constant(cos), g.constant(sin), kc, vc, cp, num_heads=hq,
                              num_kv_heads=hkv, n_rot=n_rot, interleaved=inter,
                              positions=positions)
    assert q.shape == (b, hq, s, d) and k.shape == v.shape == (b, hkv, max_s, d)
    g.set_outputs([q, k, v])
    exe = rlx.compile(g)
    exe.set_param("kc", kc0)
    exe.set_param("vc", vc0)
    got = exe.run(inputs)
    want = np_rope_kv_write(qkv, cos, sin, kc0, vc0, cpos, pos, hq, hkv, nr, inter)
    for gv, wv in zip(got, want):
        np.testing.assert_allclose(gv, wv, rtol=1e-5, atol=2e-6)
    assert kernel_nodes(exe) == ["rope_kv_write"]       # one kernel for everything


def test_rope_kv_write_caches_persist_and_feed_attention(rng):
    """Decode: two runs write rows 0 and 1 of param caches in place; attention reads them
    through the returned tensors; the schedule sees the kernel write the caches (the
    attention's: the fusion pass folds the rope_kv_write into it)."""
    hq, hkv, d, max_s = 3, 1, 8, 4
    cos, sin = tables(max_s, d)
    g = rlx.Graph()
    x = g.input("qkv", (1, 1, (hq + 2 * hkv) * d))
    p = g.input("p", (1,), "i32")
    kc, vc = g.param("kc", (1, hkv, max_s, d)), g.param("vc", (1, hkv, max_s, d))
    q, k, v = g.rope_kv_write(x, g.constant(cos), g.constant(sin), kc, vc, p, num_heads=hq,
                              num_kv_heads=hkv)
    keep = g.constant(np.arange(max_s, dtype=np.int32)) <= p
    g.set_outputs([g.attention(q, k, v, mask=keep)])
    exe = rlx.compile(g)
    zeros = np.zeros((1, hkv, max_s, d), np.float32)
    exe.set_param("kc", zeros)
    exe.set_param("vc", zeros)
    ks, vs = [], []
    for t in range(2):
        xv = rng.standard_normal((1, 1, (hq + 2 * hkv) * d)).astype(np.float32)
        (out,) = exe.run({"qkv": xv, "p": np.array([t], np.int32)})
        xr = xv.reshape(hq + 2 * hkv, d)
        qr = np_rot(xr[:hq], cos, sin, t, d, False)
        ks.append(np_rot(xr[hq], cos, sin, t, d, False))
        vs.append(xr[hq + 1].astype(np.float64))
        sc = qr @ np.array(ks).T / np.sqrt(d)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        want = (pr / pr.sum(-1, keepdims=True)) @ np.array(vs)
        np.testing.assert_allclose(out[0, :, 0], want, rtol=1e-4, atol=1e-5)
    (unit,) = [u for u in node_units(exe) if exe.graph.nodes[u[0]].op == "attention"]
    assert exe.fusion.folds[unit[0]][0] == "rope_kv_write prologue"
    for cache in (kc, vc):
        buf = exe.buffers[cache.node.id]
        assert (buf.offset, buf.offset + buf.size) in unit[3]
    with pytest.raises(IndexError, match=r"rope_kv_write %\d+ .*input 'p' holds index 4 at \[0\], "
                                         r"out of range \[0, 3\]"):
        exe.run({"qkv": xv, "p": np.array([4], np.int32)})


def test_rope_kv_write_stale_cache_reads_are_rejected():
    g = rlx.Graph()
    x = g.input("qkv", (1, 1, 24))
    cs = g.constant(np.ones((4, 4), np.float32))
    kc, vc = g.param("kc", (1, 1, 4, 8)), g.param("vc", (1, 1, 4, 8))
    q, k, v = g.rope_kv_write(x, cs, cs, kc, vc, 0, num_heads=1, num_kv_heads=1)
    g.set_outputs([q, g.sum(kc)])
    with pytest.raises(ValueError, match=r"compile: %\d+ reduce reads %\d+ \(param\) after "
                                         r"kv_written %\d+ overwrote its memory in place"):
        rlx.compile(g)
    g.set_outputs([q])      # nothing reads the caches: the write still runs
    exe = rlx.compile(g)
    assert kernel_nodes(exe) == ["rope_kv_write"]


def _rkv_err(build, match):
    g = rlx.Graph("e")
    x = g.input("qkv", (2, 3, 40))            # (3 + 2 * 1) * 8
    cs = g.input("cos", (9, 4))
    kc, vc = g.param("kc", (2, 1, 6, 8)), g.param("vc", (2, 1, 6, 8))
    with pytest.raises(ValueError, match=match):
        build(g, x, cs, kc, vc)


def _rkv(**kw):
    def build(g, x, cs, kc, vc):
        args = dict(qkv=x, cos=cs, sin=cs, k_cache=kc, v_cache=vc, cache_position=0,
                    num_heads=3, num_kv_heads=1)
        args.update({k: (v(g, x, cs, kc, vc) if callable(v) else v) for k, v in kw.items()})
        return g.rope_kv_write(**args)
    return build


@pytest.mark.parametrize("build,match", [
    (_rkv(num_heads=2), r"rope_kv_write: qkv must be \[B, S, \(num_heads \+ 2 num_kv_heads\) \* "
                        r"D\] = \[2, S, 32\] \(heads 2/1, caches \[2, 1, 6, 8\]\), got "
                        r"\[2, 3, 40\]"),
    (_rkv(num_heads=3, num_kv_heads=2), r"rope_kv_write: num_heads \(3\) and num_kv_heads \(2\) "
                                        r"must be positive ints, num_heads a multiple"),
    (_rkv(num_heads=0), r"rope_kv_write: num_heads \(0\)"),
    (_rkv(k_cache=lambda g, *a: g.param("k3", (2, 6, 8))),
     r"rope_kv_write: k_cache must be \[B, Hkv, max_S, D\], got \[2, 6, 8\]"),
    (_rkv(v_cache=lambda g, *a: g.param("v2", (2, 1, 7, 8))),
     r"rope_kv_write: v_cache \[2, 1, 7, 8\] must have k_cache's shape \[2, 1, 6, 8\]"),
    (_rkv(v_cache=lambda g, x, cs, kc, vc: kc),
     r"rope_kv_write: k_cache and v_cache share the memory of %\d+"),
    (_rkv(k_cache=lambda g, *a: g.reshape(g.constant(np.zeros((2, 48), np.float32)),
                                          (2, 1, 6, 8))),
     r"rope_kv_write: k_cache \[2, 1, 6, 8\] is \(a view of\) constant %\d+"),
    (_rkv(qkv=lambda g, *a: g.input("q2", (2, 3, 40), "f16")),
     r"rope_kv_write: k_cache is f32 \[2, 1, 6, 8\] but qkv is f16 \[2, 3, 40\]; the caches "
     r"hold qkv's dtype"),
    (_rkv(cache_position=4), r"rope_kv_write: cache_position 4 \+ S 3 \(qkv \[2, 3, 40\]\) must "
                             r"lie in \[0, max_S\] = \[0, 6\]"),
    (_rkv(cache_position=-1), r"rope_kv_write: cache_position -1 \+ S 3"),
    (_rkv(cache_position=lambda g, *a: g.input("p", (2,), "i32")),
     r"rope_kv_write: cache_position must be a scalar tensor, shape \[\] or \[1\], got \[2\]"),
    (_rkv(cache_position=lambda g, *a: g.input("p", (1,), "f32")),
     r"rope_kv_write: cache_position must be i32 or i64, got f32 \[1\]"),
    (_rkv(cache_position=1.0), r"rope_kv_write: cache_position must be an int or an i32/i64 "
                               r"tensor of shape \[\] or \[1\], got float"),
    (_rkv(positions=lambda g, *a: g.input("pp", (2, 2), "i32")),
     r"rope_kv_write: positions must be \[S\] = \[3\] or \[B, S\] = \[2, 3\] \(qkv \[2, 3, 40\]\), "
     r"got \[2, 2\]"),
    (_rkv(positions=lambda g, *a: g.input("pp", (3,), "f32")),
     r"rope_kv_write: positions must be i32 or i64, got f32 \[3\]"),
    (_rkv(n_rot=6), r"rope_kv_write: cos must be \[max_pos, n_rot/2\] = \[max_pos, 3\] with "
                    r"max_pos >= 1 \(n_rot 6\), got \[9, 4\]"),
    (_rkv(n_rot=5), r"rope_kv_write: n_rot must be an even int in \[2, D\] with D = 8, got 5"),
    (_rkv(sin=lambda g, *a: g.input("s2", (8, 4))),
     r"rope_kv_write: cos \[9, 4\] and sin \[8, 4\] must have the same shape"),
    (_rkv(interleaved=1), r"rope_kv_write: interleaved must be a bool, got 1"),
    (_rkv(cos=lambda g, *a: g.input("c2", (2, 4)), sin=lambda g, *a: g.input("s3", (2, 4))),
     r"rope_kv_write: positions cache_position 0 \+ S 3 exceed max_pos 2"),
    (_rkv(qkv=lambda g, *a: g.input("q7", (2, 7, 40))),
     r"rope_kv_write: qkv \[2, 7, 40\] has 7 tokens but the caches \[2, 1, 6, 8\] hold only 6"),
])
def test_rope_kv_write_errors(build, match):
    _rkv_err(build, match)


# ---- build_llama(fused=True) against fused=False -----------------------------------------
# hidden 24 (3 query heads of 8 on one kv head), an odd intermediate size: the simulator's
# cost is the product tiles (8 x 8, k steps of 4), so every dimension is kept small
CFG = LlamaConfig(vocab_size=53, hidden_size=24, intermediate_size=13, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                  max_position_embeddings=64, attention_bias=True)


@pytest.fixture(scope="module")
def hf_params():
    return LlamaForCausalLM.from_config(CFG, seed=5, std=0.2).params


def _exe(cfg, params, kind, b, s, cache_len, fused):
    exe = rlx.compile(build_llama(cfg, b, s, kind=kind, cache_len=cache_len, fused=fused))
    for name, arr in graph_params(cfg, params, fused).items():
        exe.set_param(name, arr)
    return exe


def test_graph_params_pack_the_projections(hf_params):
    shapes = graph_param_shapes(CFG)
    p = "model.layers.1."
    assert shapes[p + "self_attn.qkv_proj.weight"] == (40, 24)      # (3 + 2) * 8 rows
    assert shapes[p + "self_attn.qkv_proj.bias"] == (40,)
    assert shapes[p + "mlp.gate_up_proj.weight"] == (26, 24)
    assert p + "self_attn.k_proj.weight" not in shapes and p + "mlp.up_proj.weight" not in shapes
    assert graph_param_shapes(CFG, fused=False) == llama_param_shapes(CFG)
    gp = graph_params(CFG, hf_params)
    assert {k: v.shape for k, v in gp.items()} == shapes
    np.testing.assert_array_equal(gp[p + "self_attn.qkv_proj.weight"][24:32],
                                  hf_params[p + "self_attn.k_proj.weight"])
    np.testing.assert_array_equal(gp[p + "mlp.gate_up_proj.weight"][0::2],   # interleaved
                                  hf_params[p + "mlp.gate_proj.weight"])
    np.testing.assert_array_equal(gp[p + "mlp.gate_up_proj.weight"][1::2],
                                  hf_params[p + "mlp.up_proj.weight"])
    assert p + "self_attn.qkv_proj.weight" in product_weights(CFG)
    assert set(product_weights(CFG)) <= set(shapes)


@pytest.mark.parametrize("fused", [True, False])
def test_graph_param_reader_reads_what_graph_params_packs(hf_params, fused):
    """read(name) equals graph_params' value (weights and biases, concatenated and
    interleaved packs), read in any order; a packed value's buffer is reused by the next read
    of its shape, so each is checked before the next read."""
    gp = graph_params(CFG, hf_params, fused)
    read = graph_param_reader(CFG, hf_params, fused)
    names = sorted(gp, reverse=True)
    for name in names:
        got = read(name)
        assert got.dtype == gp[name].dtype
        np.testing.assert_array_equal(got, gp[name])
    qkv = "model.layers.{}.self_attn.qkv_proj.weight"
    if fused:   # layer 1's pack overwrote layer 0's buffer: a value is good until the next read
        first = read(qkv.format(0))
        read(qkv.format(1))
        np.testing.assert_array_equal(first, gp[qkv.format(1)])
    with pytest.raises(KeyError):
        read("model.layers.9.mlp.up_proj.weight")


@pytest.mark.parametrize("tiers", [None, "3,4"])
def test_fused_llama_equals_unfused(hf_params, monkeypatch, tiers):
    """Prefill (batch 2, row 1 left-padded by 2) then two decode steps from the prefill's
    caches: next ids, logits and caches of the fused graphs equal the unfused ones'; the
    forward logits too. The decode's gate/up product takes silu(gate) * up as its epilogue:
    with tier 3 in its kernel, else through a scratch and the gated kernel. The forward
    graph only with the default tiers: under "3,4" its products are the prefill's (the same
    8 rows a layer), which that run compares already."""
    if tiers:
        monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    b, s, cache_len = 2, 4, 8
    ids = np.array([[3, 17, 52, 9], [0, 0, 28, 1]], np.int32)
    pad = np.array([[0], [2]], np.int32)
    seed = np.array([0], np.int64)
    res = {}
    for fused in (True, False):
        pre = _exe(CFG, hf_params, "prefill", b, s, cache_len, fused)
        dec = _exe(CFG, hf_params, "decode", b, 1, cache_len, fused)
        zeros = np.zeros((b, CFG.num_key_value_heads, cache_len, CFG.head_dim), np.float32)
        for name in cache_names(CFG):
            pre.set_param(name, zeros)
        out = [] if tiers else [_exe(CFG, hf_params, "forward", b, s, None, fused).run(
            {"input_ids": ids})[0]]
        got = pre.run({"input_ids": ids, "pad": pad, "seed": seed})
        out += got
        for name, cache in zip(cache_names(CFG), got[2:]):
            dec.set_param(name, cache)
        dec.set_param(pad_name(cache_len), pad)
        tok = got[0]
        for step in range(2):
            nxt, logits = dec.run({"input_ids": tok.reshape(b, 1).astype(np.int32),
                                   "pos": np.array([s + step], np.int32), "seed": seed})
            out += [nxt, logits]
            tok = nxt
        res[fused] = out
    for k, (f, u) in enumerate(zip(res[True], res[False])):
        assert f.shape == u.shape and f.dtype == u.dtype, k
        if f.dtype.kind in "iu":
            np.testing.assert_array_equal(f, u, err_msg=f"output {k}")
        else:
            np.testing.assert_allclose(f, u, rtol=1e-5, atol=1e-5, err_msg=f"output {k}")


def test_fused_decode_layer_kernel_count(monkeypatch):
    """Batch-1 decode with the skinny-product tier: 5 kernels a layer (qkv product with the
    rms_norm as its prologue, attention with the rope_kv_write as its prologue, o product +
    the residual, gate/up product with the rms_norm as its prologue and silu(gate) * up as
    its epilogue, down product + the residual), against 15 unfused. A layer's count is the
    difference between 3 and 2 layers' graphs."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    def steps(layers, fused):
        cfg = LlamaConfig(vocab_size=53, hidden_size=48, intermediate_size=37,
                          num_hidden_layers=layers, num_attention_heads=3, num_key_value_heads=1,
                          head_dim=16, max_position_embeddings=64)
        exe = rlx.compile(build_llama(cfg, 1, 1, kind="decode", cache_len=8, fused=fused))
        return exe.steps

    fused3, fused2 = steps(3, True), steps(2, True)
    per_layer = len(fused3) - len(fused2)
    assert per_layer == 5, [s.name for s in fused3]
    assert not [s for s in fused3 if s.kernel_name.startswith("rows_")], "a norm kernel is left"
    assert len(fused3) - 3 * per_layer == len(fused2) - 2 * per_layer   # the rest: mask, embed,
    assert len(steps(3, False)) - len(steps(2, False)) >= 15            # final norm, head, sample
    names = [s.kernel_name.split()[0] for s in fused3]
    assert "rope_kv_write" not in names and "rope" not in names and "kv_write" not in names
    assert sum("+rope_kv_write" in s.kernel_name for s in fused3) == 3


def _cache_layer_graph(s):
    """kv_write into layer 1 of a [2, 1, 1, s, 4] cache param, through a narrow."""
    g = rlx.Graph(f"layer_write_{s}")
    c = g.param("c", (2, 1, 1, s, 4), "f32")
    layer1 = g.reshape(g.narrow(c, 0, 1, 1), (1, 1, s, 4))
    p = g.input("p", (1,), "i64")
    g.set_outputs([g.kv_write(layer1, g.input("new", (1, 1, 1, 4), "f32"), p)])
    return g


def test_in_place_write_through_a_narrow():
    """An aligned slice is a view: the write lands in the param. An unaligned one would be a
    copy, which the write would not reach: compile() refuses it."""
    exe = rlx.compile(_cache_layer_graph(16))          # layer offset 16*4*4 B = 256 B
    exe.set_param("c", np.zeros((2, 1, 1, 16, 4), np.float32))
    for t in range(2):
        exe.run({"new": np.full((1, 1, 1, 4), t + 1.0, np.float32), "p": np.array([t])})
    want = np.zeros((2, 1, 1, 16, 4), np.float32)
    want[1, 0, 0, 0], want[1, 0, 0, 1] = 1.0, 2.0
    np.testing.assert_array_equal(exe.get_param("c"), want)
    with pytest.raises(ValueError, match=r"compile: kv_write %\d+ writes in place into narrow "
                                         r"%\d+ \[1, 1, 1, 7, 4\], which is a copy here"):
        rlx.compile(_cache_layer_graph(7))


def test_narrow_read_after_an_in_place_write_sees_the_old_values():
    """A narrow of a cache read after a kv_write into the cache stays a copy made before the
    write (a view would see the new rows)."""
    for s in (16, 7):
        g = rlx.Graph("snapshot")
        c = g.param("c", (1, 1, s, 4), "f32")
        old = g.narrow(c, 2, 0, 2)
        new_c = g.kv_write(c, g.input("new", (1, 1, 1, 4), "f32"), 0)
        g.set_outputs([g.exp(old), new_c])
        exe = rlx.compile(g)
        exe.set_param("c", np.zeros((1, 1, s, 4), np.float32))
        before, after = exe.run({"new": np.full((1, 1, 1, 4), 3.0, np.float32)})
        np.testing.assert_array_equal(before, np.ones((1, 1, 2, 4), np.float32))
        assert after[0, 0, 0, 0] == 3.0


def test_rope_kv_write_tensor_position_is_checked_against_cos_sin():
    """Without positions the cache row is also the rope position: a run() value past the
    cos/sin table is an IndexError, as an int cache_position past it is a ValueError."""
    max_pos, max_s, d = 4, 8, 4
    ang = np.arange(max_pos)[:, None] * np.array([1.0, 0.01])[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    g = rlx.Graph("rkw")
    qkv = g.input("qkv", (1, 1, 3 * d), "f32")
    kc, vc = g.param("kc", (1, 1, max_s, d), "f32"), g.param("vc", (1, 1, max_s, d), "f32")
    q, _, _ = g.rope_kv_write(qkv, g.constant(cos), g.constant(sin), kc, vc,
                              g.input("cp", (1,), "i64"), num_heads=1, num_kv_heads=1)
    g.set_outputs([q])
    exe = rlx.compile(g)
    for name in ("kc", "vc"):
        exe.set_param(name, np.zeros((1, 1, max_s, d), np.float32))
    feed = {"qkv": np.ones((1, 1, 3 * d), np.float32)}
    exe.run({**feed, "cp": np.array([3])})                  # the last position cos/sin hold
    with pytest.raises(IndexError, match=r"cos/sin \[4, 2\]\): input 'cp' holds index 5 at "
                                         r"\[0\], out of range \[0, 3\]"):
        exe.run({**feed, "cp": np.array([5])})
