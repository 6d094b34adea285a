"""g.gated_delta_net against a float64 NumPy port of fla's naive recurrent reference
(fused_recurrent_gated_delta_rule's torch reference: S <- S exp(g_t); u = beta (v - S^T k);
S <- S + k u^T; o = S^T q), with an initial state, the q/k l2 norm, T not a multiple of the
chunk, chunk sizes that must agree; gradients by finite differences; errors."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU
from gradcheck import check
from test_mma import _toolkit, assemble_sm80
from rlx_numba.ir import dtypes as dt


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
    with pytest.raises(ValueError, match=r"gated_delta_net: Dk must be at most 256, got q "
                                         r"\[1, 3, 1, 257\]"):
        build(dict(shapes, q=(1, 3, 1, 257), k=(1, 3, 1, 257)))
    g = rlx.Graph()
    x = g.input("q", (1, 3, 1, 4), "bf16")
    with pytest.raises(ValueError, match=r"gated_delta_net: q must be f32 \(cast half tensors "
                                         r"first\), got bf16"):
        g.gated_delta_net(x, x, x, g.input("g", (1, 3, 1)), g.input("b", (1, 3, 1)))


# ---- the sequential state pass alone (the op "delta_state_scan", kernels/delta.py) ----------
def state_scan_ref(p, q, a, d, s0, bias=None, reverse=False):
    """(X, the states entering each chunk, the final state) in float64."""
    gg, n, c, k = p.shape
    states, x, s = np.zeros((gg, n, k, a.shape[3])), np.zeros(a.shape), s0.copy()
    for i in (range(n - 1, -1, -1) if reverse else range(n)):
        states[:, i] = s
        x[:, i] = a[:, i] + p[:, i] @ s
        s = d[:, i, None, None] * s + q[:, i].transpose(0, 2, 1) @ x[:, i]
        if bias is not None:
            s = s + bias[:, i]
    return x, states, s


def scan_feed(rng, gg, n, c, k, v, bias):
    f = dict(p=rng.standard_normal((gg, n, c, k)) * 0.5, q=rng.standard_normal((gg, n, c, k)) * 0.5,
             a=rng.standard_normal((gg, n, c, v)), d=rng.uniform(0.5, 1.0, (gg, n)),
             s0=rng.standard_normal((gg, k, v)))
    if bias:
        f["bias"] = rng.standard_normal((gg, n, k, v))
    return f


def scan_graph(f, reverse):
    g = rlx.Graph()
    ts = {name: g.input(name, x.shape) for name, x in f.items()}
    return g, ts, g.bind("delta_state_scan", list(ts.values()), reverse=reverse)


@pytest.mark.parametrize("reverse,bias,gpu_geo,k", [(False, False, False, 3),
                                                    (True, True, False, 8),
                                                    (False, True, True, 3),
                                                    (True, False, True, 8)])
def test_state_scan_kernel(rng, reverse, bias, gpu_geo, k):
    """V = 7 spans two column slices of the simulator's geometry (4 columns, the last one
    part-filled) and 3 heads x 2 slices outnumber its 2 blocks (the grid-stride loop); the
    GPU's geometry (128 threads, 32 columns) runs on tiny sizes too. K = 3 copies P and Q a
    float at a time, K = 8 16 bytes at a time (cp.async)."""
    import contextlib

    from rlx_numba.kernels.launch import gpu_geometry, override_geometry
    f = scan_feed(rng, 3, 3, 5, k, 7, bias)
    g, _, ys = scan_graph(f, reverse)
    g.set_outputs(list(ys))
    geo = override_geometry("delta_state_scan", gpu_geometry("delta_state_scan")) \
        if gpu_geo else contextlib.nullcontext()
    with geo:
        got = rlx.compile(g).run({k: x.astype(np.float32) for k, x in f.items()})
    want = state_scan_ref(*(f[k] for k in ("p", "q", "a", "d", "s0")), f.get("bias"), reverse)
    for x, w in zip(got, want):
        np.testing.assert_allclose(x, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reverse,bias,used", [(False, True, (0, 1, 2)), (True, False, (0, 1, 2)),
                                               (False, False, (1,)), (True, True, (2,)),
                                               (False, False, (0,))])
def test_state_scan_gradients(rng, reverse, bias, used):
    """Through any subset of the three results (a result's VJP hands the scan a zero that
    the scan's VJP drops; an unused X gets a zero cotangent)."""
    f = scan_feed(rng, 2, 3, 2, 2, 3, bias)
    g, ts, ys = scan_graph(f, reverse)
    seeds = [rng.standard_normal(y.shape) for y in ys]
    y = None
    for i in used:
        term = g.reduce_sum(ys[i] * g.constant(seeds[i].astype(np.float32)))
        y = term if y is None else y + term

    def oracle(**kw):
        out = state_scan_ref(**kw, reverse=reverse)
        return sum(float((out[i] * seeds[i]).sum()) for i in used)
    check(g, y, ts, f, oracle, rtol=1e-3, atol=1e-4)


def test_state_scan_errors():
    g = rlx.Graph()
    p = g.input("p", (2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"delta_state_scan: A must be \[G, N, C, V\] = "
                                         r"\[2, 3, 4, V\], got \[2, 3, 5, 6\]"):
        g.bind("delta_state_scan", [p, p, g.input("a", (2, 3, 5, 6)), g.input("d", (2, 3)),
                                    g.input("s", (2, 5, 6))])
    with pytest.raises(ValueError, match=r"delta_state_scan: s0 must be \[2, 5, 6\], got "
                                         r"\[2, 6, 5\]"):
        g.bind("delta_state_scan", [p, p, g.input("a2", (2, 3, 4, 6)), g.input("d2", (2, 3)),
                                    g.input("s2", (2, 6, 5))])


def test_state_scan_fits_the_gpu():
    """The layout the lowering takes for a GPU's shared memory a block: on sm_86/89 (99 KiB,
    the least of sm_80+) the GPU geometry with P and Q resident, for every Dk and the chunk
    gated_delta_net picks for it; below, fewer columns, then P and Q in one buffer, then an
    error. Sizes in f32 words of scan_shared_layout, written out: K = 128 (rows of 132
    words), C = 64 takes S 128 x (VS + 4), X 64 x (VS + 4) and P, Q 64 x 132 each."""
    from rlx_numba.ir.ops_delta import scan_chunk_fits
    from rlx_numba.kernels import delta as K
    from rlx_numba.kernels.launch import gpu_geometry
    geo = gpu_geometry("delta_state_scan")
    assert geo == K.StateScanGeometry(16, 8, 32)
    for dk in range(1, 257):
        c = 64
        while not scan_chunk_fits(dk, c):
            c //= 2
        assert K.fit_state_scan(dk, c, 128, geo, 99 << 10) == (geo, 32, False), (dk, c)
    pq = 64 * 132
    assert K.shared_bytes(128, 64, 32, geo) == 4 * (192 * 36 + 2 * pq) == 95232
    # sm_75 (64 KiB): 16 or 8 columns still need 4 (192 * 20 + 2 pq) = 82944 and 76800
    # bytes; P and Q in one buffer at 32 columns need 4 (192 * 36 + pq) = 61440
    assert K.fit_state_scan(128, 64, 128, geo, 64 << 10) == (geo, 32, True)
    # 48 KiB: 4 (192 * 20 + pq) = 49152 at 16 columns
    half = K.StateScanGeometry(16, 4, 16)
    assert K.fit_state_scan(128, 64, 128, geo, 48 << 10) == (half, 16, True)
    # K = 256 (rows of 260), C = 16 on sm_75: 4 (272 * 20 + 2 * 16 * 260) = 55040 bytes
    assert K.fit_state_scan(256, 16, 128, geo, 64 << 10) == (half, 16, False)
    with pytest.raises(ValueError, match=r"delta_state_scan: Dk=128, chunk 64 needs at least "
                                         r"43008 bytes of shared memory a block \(8 columns, "
                                         r"P and Q in one buffer\); this GPU allows 40000"):
        K.fit_state_scan(128, 64, 128, geo, 40000)


@pytest.mark.parametrize("gpu_geo,layout,want", [
    (True, ((16, 4, 16), False), "16 columns a block"),
    (True, ((16, 2, 8), True), "8 columns a block, P and Q in one buffer"),
    (False, ((2, 1, 4), True), "4 columns a block, P and Q in one buffer")])
def test_state_scan_in_less_shared_memory(rng, monkeypatch, gpu_geo, layout, want):
    """A GPU allowing a block just the bytes of a smaller layout (the lowering reads the
    limit from max_shared_per_block) runs that layout: fewer columns, P and Q in one buffer
    (both at the GPU geometry, on tiny sizes), and at the simulator's. Forward against the
    reference, then the gradients (the same kernel run in reverse); K = 8 copies with
    cp.async, K = 3 a float at a time."""
    from rlx_numba.kernels import delta as K
    from rlx_numba.kernels.launch import gpu_geometry, override_geometry, sim_geometry
    from rlx_numba.runtime import lower_delta
    (rt, ct, vs), shared_pq = layout
    pick = gpu_geometry if gpu_geo else sim_geometry
    with override_geometry("delta_state_scan", pick("delta_state_scan")):
        for k, reverse, bias in ((8, False, True), (3, True, False)):
            f = scan_feed(rng, 2, 3, 5, k, 7, bias)
            monkeypatch.setattr(lower_delta, "max_shared_per_block", lambda: K.shared_bytes(
                k, 5, vs, K.StateScanGeometry(rt, ct, vs), shared_pq))
            g, _, ys = scan_graph(f, reverse)
            g.set_outputs(list(ys))
            exe = rlx.compile(g)
            (step,) = [s for s in exe.steps if s.kernel_name.startswith("delta state scan")]
            assert step.kernel_name.endswith(want), step.kernel_name
            got = exe.run({n: x.astype(np.float32) for n, x in f.items()})
            ref = state_scan_ref(*(f[n] for n in ("p", "q", "a", "d", "s0")), f.get("bias"),
                                 reverse)
            for x, w in zip(got, ref):
                np.testing.assert_allclose(x, w, rtol=1e-5, atol=1e-5)
        f = scan_feed(rng, 2, 3, 2, 3, 7, True)
        monkeypatch.setattr(lower_delta, "max_shared_per_block", lambda: K.shared_bytes(
            3, 2, vs, K.StateScanGeometry(rt, ct, vs), shared_pq))
        g, ts, ys = scan_graph(f, False)
        seeds = [rng.standard_normal(y.shape) for y in ys]
        y = sum((g.reduce_sum(r * g.constant(sd.astype(np.float32))) for r, sd in zip(ys, seeds)),
                start=g.constant(np.zeros((), np.float32)))

        def oracle(**kw):
            return sum(float((o * sd).sum()) for o, sd in zip(state_scan_ref(**kw), seeds))
        check(g, y, ts, f, oracle, rtol=1e-3, atol=1e-4)


# ---- the decode step ------------------------------------------------------------------------
@pytest.mark.parametrize("l2,scale,init", [(False, None, True), (True, 0.7, True),
                                           (True, None, False)])
def test_step_matches_the_recurrent_reference(rng, l2, scale, init):
    b, h, dk, dv = 2, 3, 5, 4
    f = make(rng, b, 1, h, dk, dv)
    f["s0"] = rng.standard_normal((b, h, dk, dv)) if init else np.zeros((b, h, dk, dv))
    g = rlx.Graph()
    ts = {n: g.input(n, x.shape) for n, x in f.items() if init or n != "s0"}
    o, s = g.gated_delta_step(ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"],
                              ts.get("s0"), scale=scale, use_qk_l2norm=l2)
    assert o.shape == (b, 1, h, dv) and s.shape == (b, h, dk, dv)
    g.set_outputs([o, s])
    got_o, got_s = rlx.compile(g).run({k: x.astype(np.float32) for k, x in f.items()
                                       if init or k != "s0"})
    want_o, want_s = naive(f["q"], f["k"], f["v"], f["g"], f["beta"], scale, f["s0"], l2)
    np.testing.assert_allclose(got_o, want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_s, want_s, rtol=2e-5, atol=2e-5)


def test_step_continues_the_chunked_form(rng):
    """gated_delta_net over T tokens, then a step: the T + 1 tokens' reference."""
    b, t, h, dk, dv = 1, 6, 2, 4, 3
    f = make(rng, b, t + 1, h, dk, dv)
    g = rlx.Graph()
    ts = {n: g.input(n, x.shape) for n, x in f.items()}
    head = {n: g.narrow(x, 1, 0, t) for n, x in ts.items()}
    tail = {n: g.narrow(x, 1, t, 1) for n, x in ts.items()}
    _, s = g.gated_delta_net(*(head[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=4,
                             use_qk_l2norm=True)
    o, s = g.gated_delta_step(*(tail[n] for n in ("q", "k", "v", "g", "beta")), s,
                              use_qk_l2norm=True)
    g.set_outputs([o, s])
    got_o, got_s = rlx.compile(g).run({k: x.astype(np.float32) for k, x in f.items()})
    want_o, want_s = naive(f["q"], f["k"], f["v"], f["g"], f["beta"], l2=True)
    np.testing.assert_allclose(got_o[:, 0], want_o[:, t], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(got_s, want_s, rtol=2e-4, atol=2e-4)


def test_step_gradients(rng):
    b, h, dk, dv = 1, 2, 3, 2
    f = make(rng, b, 1, h, dk, dv)
    f["s0"] = rng.standard_normal((b, h, dk, dv))
    g = rlx.Graph()
    ts = {n: g.input(n, x.shape) for n, x in f.items()}
    o, s = g.gated_delta_step(ts["q"], ts["k"], ts["v"], ts["g"], ts["beta"], ts["s0"],
                              use_qk_l2norm=True)
    seed_o, seed_s = rng.standard_normal(o.shape), rng.standard_normal(s.shape)
    y = g.reduce_sum(o * g.constant(seed_o.astype(np.float32))) + \
        g.reduce_sum(s * g.constant(seed_s.astype(np.float32)))

    def oracle(q, k, v, g, beta, s0):
        oo, ss = naive(q, k, v, g, beta, None, s0, True)
        return (oo * seed_o).sum() + (ss * seed_s).sum()
    check(g, y, ts, f, oracle, rtol=1e-3, atol=1e-4)


def test_step_errors():
    g = rlx.Graph()
    q = g.input("q", (2, 1, 2, 4))
    v = g.input("v", (2, 1, 2, 3))
    gb = g.input("g", (2, 1, 2))
    with pytest.raises(ValueError, match=r"gated_delta_step: state must be f32 \[2, 2, 4, 3\], "
                                         r"got f32 \[2, 2, 3, 4\]"):
        g.gated_delta_step(q, q, v, gb, gb, g.input("s", (2, 2, 3, 4)))
    q2 = g.input("q2", (2, 2, 2, 4))
    with pytest.raises(ValueError, match=r"gated_delta_step: one token a step: q must be "
                                         r"\[B, 1, H, Dk\], got \[2, 2, 2, 4\]"):
        g.gated_delta_step(q2, q2, g.input("v2", (2, 2, 2, 3)), g.input("g2", (2, 2, 2)),
                           g.input("b2", (2, 2, 2)), None)
    with pytest.raises(ValueError, match=r"gated_delta_step: v must be \[B, T, H, Dv\] = "
                                         r"\[2, 1, 2, Dv\], got \[2, 1, 3, 3\]"):
        g.gated_delta_step(q, q, g.input("v3", (2, 1, 3, 3)), gb, gb, None)


# ---- the chunk's triangular system (the op "unit_lower_inverse") ----------------------------
def test_unit_lower_inverse(rng):
    """(I - A)^-1 from A's strictly lower triangle only (the rest is noise that must not
    count), 3 matrices (more than the simulator's 2 blocks: the grid-stride loop) of 5 x 5
    (its VJP by finite differences), 20 x 20, 40 x 40 and 64 x 64; then the column-scaled
    form gated_delta_net uses."""
    a = rng.standard_normal((3, 5, 5)) * 0.5

    def oracle(a):
        return np.linalg.inv(np.eye(5) - np.tril(a, -1))
    g = rlx.Graph()
    x = g.input("a", a.shape)
    g.set_outputs([g.bind("unit_lower_inverse", [x])])
    (got,) = rlx.compile(g).run({"a": a.astype(np.float32)})
    np.testing.assert_allclose(got, oracle(a), rtol=1e-5, atol=1e-5)
    g = rlx.Graph()
    x = g.input("a", a.shape)
    y = g.bind("unit_lower_inverse", [x])
    check(g, y, {"a": x}, {"a": a}, oracle, seed=rng.standard_normal(a.shape), rtol=1e-3,
          atol=1e-4)
    # C = 20 (padded to 32: one warp), 40 and 64 (padded to 64: the second warp starts at
    # its first column's row block); A's noise above the diagonal must not count
    for c, sd in ((20, 0.3), (40, 0.3), (64, 0.15)):
        a = rng.standard_normal((3, c, c)) * sd
        g = rlx.Graph()
        x = g.input("a", a.shape)
        g.set_outputs([g.bind("unit_lower_inverse", [x])])
        (got,) = rlx.compile(g).run({"a": a.astype(np.float32)})
        want = np.linalg.inv(np.eye(c) - np.tril(a, -1))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    # the column-scaled form (gated_delta_net's): T diag(s1), T diag(s2), T from one kernel,
    # each result's gradient by finite differences (T alone read: the further result whose
    # kernel store is conditional)
    a = rng.standard_normal((2, 3, 6, 6)) * 0.5
    s1, s2 = rng.standard_normal((2, 3, 6)), rng.standard_normal((2, 3, 6))

    def scaled(a, s1, s2):
        t = np.linalg.inv(np.eye(6) - np.tril(a, -1))
        return t * s1[..., None, :], t * s2[..., None, :], t
    for pick in range(3):
        g = rlx.Graph()
        xs = {n: g.input(n, v.shape) for n, v in (("a", a), ("s1", s1), ("s2", s2))}
        outs = g.bind("unit_lower_inverse_scaled", list(xs.values()))
        if pick == 0:
            g.set_outputs(list(outs))
            got = rlx.compile(g).run({"a": a.astype(np.float32), "s1": s1.astype(np.float32),
                                      "s2": s2.astype(np.float32)})
            for x, want in zip(got, scaled(a, s1, s2)):
                np.testing.assert_allclose(x, want, rtol=1e-5, atol=1e-5)
        y = outs[pick] if pick else outs[0] * 0.5 + outs[1]
        check(g, y, xs, {"a": a, "s1": s1, "s2": s2},
              lambda a, s1, s2: (scaled(a, s1, s2)[pick] if pick else
                                 scaled(a, s1, s2)[0] * 0.5 + scaled(a, s1, s2)[1]),
              seed=rng.standard_normal(a.shape), rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match=r"unit_lower_inverse_scaled: s2 must be f32 \[2, 3, 6\] "
                                         r"\(a column scale of each matrix of A \[2, 3, 6, 6\]\), "
                                         r"got f32 \[2, 6\]"):
        g.bind("unit_lower_inverse_scaled", [xs["a"], xs["s1"], g.input("b2", (2, 6))])
    with pytest.raises(ValueError, match=r"unit_lower_inverse: A must be f32 \[\.\.\., C, C\] "
                                         r"with C <= 64, got f32 \[2, 3, 4\]"):
        g.bind("unit_lower_inverse", [g.input("b", (2, 3, 4))])


@pytest.mark.skipif(rlx.simulator_enabled(), reason="needs a GPU (Qwen3-Next's head size: "
                                                    "too slow in the simulator)")
def test_gpu_qwen3_next_head_size(rng):
    """Dk = Dv = 128, T = 300 (5 chunks of 64, the last part-filled), l2 norm, an initial
    state: the GPU geometries of both kernels against the recurrent reference, then a step."""
    b, t, h, dk, dv = 2, 300, 3, 128, 128
    f = make(rng, b, t + 1, h, dk, dv)
    f["s0"] = 0.1 * rng.standard_normal((b, h, dk, dv))
    g = rlx.Graph()
    ts = {n: g.input(n, x.shape) for n, x in f.items()}
    head = [g.narrow(ts[n], 1, 0, t) for n in ("q", "k", "v", "g", "beta")]
    o, s = g.gated_delta_net(*head, initial_state=ts["s0"], use_qk_l2norm=True)
    o1, s1 = g.gated_delta_step(*(g.narrow(ts[n], 1, t, 1) for n in ("q", "k", "v", "g", "beta")),
                                s, use_qk_l2norm=True)
    g.set_outputs([o, s, o1, s1])
    got = rlx.compile(g, exec_mode="graph").run({k: x.astype(np.float32) for k, x in f.items()})
    want_o, want_s = naive(f["q"], f["k"], f["v"], f["g"], f["beta"], None, f["s0"], True)
    _, mid = naive(f["q"][:, :t], f["k"][:, :t], f["v"][:, :t], f["g"][:, :t],
                   f["beta"][:, :t], None, f["s0"], True)
    for x, want in ((got[0], want_o[:, :t]), (got[1], mid), (got[2], want_o[:, t:]),
                    (got[3], want_s)):
        np.testing.assert_allclose(x, want, rtol=1e-3, atol=1e-3 * np.abs(want).max())


def test_a_converted_model_keeps_the_delta_rule_in_f32(rng):
    """A model converted to bf16 (Graph.to_dtype, the models' dtype=) runs the chunk inverse
    and the state pass in f32, as transformers does its delta rule, and hands bf16 on; under
    autocast they widen half operands. o against the float64 recurrence of the same
    bf16-rounded inputs: the bf16 products around the f32 scan, a few bf16 roundoffs."""
    b, t, h, dk, dv = 1, 5, 2, 4, 3
    f = make(rng, b, t, h, dk, dv)
    g, _, o, s = build({k: v.shape for k, v in f.items()}, chunk_size=4)
    g.set_outputs([o, s])
    half = g.to_dtype("bf16")
    scans = [n for n in half.nodes if n.op in ("delta_state_scan", "unit_lower_inverse_scaled")]
    assert len(scans) == 2
    assert all(half.nodes[i].dtype == dt.F32 for n in scans for i in n.inputs
               if half.nodes[i].dtype.is_float)
    assert [half.nodes[i].dtype for i in half.outputs] == [dt.BF16, dt.BF16]
    auto = g.autocast("bf16")
    assert all(auto.nodes[i].dtype == dt.F32 for n in auto.nodes if n.op == "delta_state_scan"
               for i in n.inputs if auto.nodes[i].dtype.is_float)
    bf = {k: v.astype(np.float32).astype(dt.BF16.host).astype(np.float64)
          for k, v in f.items()}
    got_o, _ = rlx.compile(half).run({k: v.astype(np.float32) for k, v in bf.items()})
    want_o, _ = naive(bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"])
    err = np.abs(np.asarray(got_o, np.float64) - want_o).max() / np.abs(want_o).max()
    assert err < 16 * 2.0 ** -8, err


@pytest.mark.skipif(ON_GPU or _toolkit() is None, reason="needs ptxas + libnvvm, no GPU")
def test_gpu_bodies_of_the_delta_kernels_compile(tmp_path):
    """Without a GPU: the state pass at the GPU geometry (K = V = 128, C = 64, with a bias and
    cp.async copies; K = 127, reversed, element copies; P and Q in one buffer with element
    copies, as on sm_75) and the chunk inverse (C = 64, both column-scaled copies and T: no
    local memory either), compiled through NVVM and assembled by ptxas with nothing spilled.
    The simulator takes a shared array sized by an expression; NVVM needs a constant (the
    inverse's C * C failed on an H200)."""
    script = textwrap.dedent(f"""
        import os
        os.environ["RLX_NUMBA_SIMULATOR"] = "0"
        from numba import cuda
        from numba.cuda import types as T
        import numba.cuda.dispatcher as D

        class Dev:                # (device functions compile for the current device's cc)
            compute_capability = (8, 0)
        D.get_current_device = lambda: Dev()
        from rlx_numba.kernels import delta as K
        from rlx_numba.kernels.launch import default_geometry
        f32 = T.float32[::1]
        geo = default_geometry("delta_state_scan")
        inv = K.unit_lower_inverse_kernel(64, True, True)
        for name, k, sig in (
                ("scan", K.state_scan_kernel(128, 64, K.columns(geo, 128), geo, False, True,
                                             True), (f32,) * 9 + (T.int64,) * 3),
                ("scan1", K.state_scan_kernel(127, 64, K.columns(geo, 128), geo, True, False,
                                              False), (f32,) * 9 + (T.int64,) * 3),
                ("scan_pq", K.state_scan_kernel(128, 64, K.columns(geo, 128), geo, False, True,
                                                False, True), (f32,) * 9 + (T.int64,) * 3),
                ("inverse", inv, (f32,) * 6 + (T.int64,))):
            ptx, _ = cuda.compile_ptx(k.py_func, sig, cc=(8, 0),
                                      launch_bounds=k.targetoptions.get("launch_bounds"))
            open(os.path.join({str(tmp_path)!r}, name + ".ptx"), "w").write(ptx)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1], timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    # the inverse's register arrays (T's 16 rows, indexed by constants once unrolled) stay in
    # registers: no local memory at all
    for name in ("scan", "scan1", "scan_pq", "inverse"):
        assemble_sm80(tmp_path / f"{name}.ptx", no_stack=name == "inverse")
    # element copies (K % 4 != 0) take no cp.async: they also run below sm_80
    assert "cp.async.cg.shared.global" in (tmp_path / "scan.ptx").read_text()
    assert "cp.async" not in (tmp_path / "scan1.ptx").read_text()
    assert "cp.async" not in (tmp_path / "scan_pq.ptx").read_text()
