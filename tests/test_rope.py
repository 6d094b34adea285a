"""rope and kv_write against NumPy: both pair layouts, partial rotation, offsets and position
tensors, range checks; the in-place KV-cache write, its persistence in a param across runs and
the ordering of the reads around it."""
import numpy as np
import pytest
from numba import cuda

import rlx_numba as rlx
from conftest import run_graph
from rlx_numba.memory import ALIGN


def tables(max_pos, n_rot, base=10000.0):
    """cos/sin [max_pos, n_rot/2] of the usual RoPE frequencies."""
    inv = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def np_rope(x, cos, sin, pos, n_rot, interleaved):
    """x [B, H, S, D] (or [B, S, D]); pos [S] or [B, S] integer positions."""
    x4 = x if x.ndim == 4 else x[:, None]
    b, _, s, _ = x4.shape
    p = np.broadcast_to(np.asarray(pos), (b, s))
    c = cos.astype(np.float64)[p][:, None]        # [B, 1, S, n_rot/2]
    sn = sin.astype(np.float64)[p][:, None]
    x64 = x4.astype(np.float64)
    out = x64.copy()
    half = n_rot // 2
    if interleaved:
        i0, i1 = np.arange(0, n_rot, 2), np.arange(1, n_rot, 2)
    else:
        i0, i1 = np.arange(half), np.arange(half, n_rot)
    a, bb = x64[..., i0], x64[..., i1]
    out[..., i0] = a * c - bb * sn
    out[..., i1] = bb * c + a * sn
    return out if x.ndim == 4 else out[:, 0]


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)


# ---- rope --------------------------------------------------------------------------------------
# (x shape, n_rot, position_offset): odd S, D 16 / 64 / 80, partial rotation, H not a multiple of
# the heads a thread takes
CASES = [((2, 3, 7, 16), None, 0), ((1, 2, 1, 64), 32, 5), ((2, 3, 7, 80), 64, 2),
         ((1, 1, 7, 80), None, 0), ((2, 5, 3, 64), 2, 9)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,n_rot,offset", CASES)
def test_rope_layouts_and_offsets(rng, shape, n_rot, offset, interleaved):
    d, s = shape[-1], shape[-2]
    nr = d if n_rot is None else n_rot
    cos, sin = tables(offset + s + 3, nr)
    xv = rng.standard_normal(shape).astype(np.float32)
    g = rlx.Graph("rope")
    x = g.input("x", shape)
    y = g.rope(x, g.constant(cos), g.param("sin", sin.shape), n_rot=n_rot, interleaved=interleaved,
               position_offset=offset)
    assert y.shape == shape and str(y.dtype) == "f32"
    g.set_outputs([y])
    (out,) = run_graph(g, {"x": xv}, params={"sin": sin})
    close(out, np_rope(xv, cos, sin, np.arange(offset, offset + s), nr, interleaved))
    np.testing.assert_array_equal(out[..., nr:], xv[..., nr:])     # passed through bit for bit


def test_rope_layouts_differ(rng):
    """The two layouts pair different dims (a swapped pairing would pass a symmetric test)."""
    cos, sin = tables(8, 8)
    xv = rng.standard_normal((1, 1, 4, 8)).astype(np.float32)
    g = rlx.Graph()
    x = g.input("x", xv.shape)
    c, s_ = g.constant(cos), g.constant(sin)
    g.set_outputs([g.rope(x, c, s_), g.rope(x, c, s_, interleaved=True)])
    a, b = run_graph(g, {"x": xv})
    assert np.abs(a - b).max() > 0.1
    # NeoX pairs (0, 4): at position 1 the pair (x0, x4) turns by angle 1 rad
    t = 1.0
    close(a[0, 0, 1, 0], xv[0, 0, 1, 0] * np.cos(t) - xv[0, 0, 1, 4] * np.sin(t))
    close(b[0, 0, 1, 1], xv[0, 0, 1, 1] * np.cos(t) + xv[0, 0, 1, 0] * np.sin(t))


@pytest.mark.parametrize("idx_dtype", ["i32", "i64"])
def test_rope_positions_as_run_inputs(rng, idx_dtype):
    b, h, s, d, max_pos = 2, 3, 7, 16, 40
    cos, sin = tables(max_pos, d)
    xv = rng.standard_normal((b, h, s, d)).astype(np.float32)
    g = rlx.Graph()
    x = g.input("x", xv.shape)
    c, sn = g.input("cos", cos.shape), g.input("sin", sin.shape)
    p1 = g.input("p1", (s,), idx_dtype)
    p2 = g.input("p2", (b, s), idx_dtype)
    g.set_outputs([g.rope(x, c, sn, positions=p1), g.rope(x, c, sn, positions=p2, interleaved=True),
                   g.rope(x, g.constant(cos[:, :3]), g.constant(sin[:, :3]), n_rot=6,
                          positions=p2)])
    exe = rlx.compile(g)
    host = np.int32 if idx_dtype == "i32" else np.int64
    for step in range(2):   # the same executable, moved forward: positions change per run
        pv1 = (np.arange(s) + 11 * step).astype(host)
        pv2 = rng.integers(0, max_pos, (b, s)).astype(host)
        a, bb, cc = exe.run({"x": xv, "cos": cos, "sin": sin, "p1": pv1, "p2": pv2})
        close(a, np_rope(xv, cos, sin, pv1, d, False))
        close(bb, np_rope(xv, cos, sin, pv2, d, True))
        close(cc, np_rope(xv, cos[:, :3], sin[:, :3], pv2, 6, False))


def test_rope_rank3_one_head(rng):
    cos, sin = tables(12, 10)
    xv = rng.standard_normal((2, 5, 14)).astype(np.float32)
    g = rlx.Graph()
    x = g.input("x", xv.shape)
    p = g.input("p", (2, 5), "i64")
    g.set_outputs([g.rope(x, g.constant(cos), g.constant(sin), n_rot=10, positions=p,
                          interleaved=True)])
    pv = np.array([[0, 1, 2, 3, 4], [11, 7, 7, 0, 3]], np.int64)
    (out,) = run_graph(g, {"x": xv, "p": pv})
    close(out, np_rope(xv, cos, sin, pv, 10, True))


def test_rope_positions_out_of_range(rng):
    cos, sin = tables(6, 4)
    xv = rng.standard_normal((1, 2, 3, 4)).astype(np.float32)
    g = rlx.Graph()
    x = g.input("x", xv.shape)
    p = g.input("p", (3,), "i32")
    g.set_outputs([g.rope(x, g.constant(cos), g.constant(sin), positions=p),
                   g.rope(x, g.constant(cos), g.constant(sin), positions=p * 2 - 1)])  # in-graph
    exe = rlx.compile(g)
    with pytest.raises(IndexError, match=r"rope %\d+ \(x \[1, 2, 3, 4\], positions of cos/sin "
                                         r"\[6, 2\]\): input 'p' holds index 6 at \[2\], out of "
                                         r"range \[0, 5\]"):
        exe.run({"x": xv, "p": np.array([0, 1, 6], np.int32)})
    with pytest.raises(IndexError, match=r"holds index -1 at \[0\]"):
        exe.run({"x": xv, "p": np.array([-1, 1, 2], np.int32)})
    pv = np.array([0, 3, 5], np.int32)
    a, b = exe.run({"x": xv, "p": pv})
    close(a, np_rope(xv, cos, sin, pv, 4, False))
    close(b, np_rope(xv, cos, sin, np.clip(pv * 2 - 1, 0, 5), 4, False))   # -1, 5, 9 clamped
    bad = np.array([-3, 2, 40], np.int32)                                  # device: clamped too
    (c, _) = exe.run({"x": xv, "p": cuda.to_device(bad)})
    close(c, np_rope(xv, cos, sin, np.clip(bad, 0, 5), 4, False))


def _rope_err(build, match):
    g = rlx.Graph("e")
    x = g.input("x", (2, 3, 5, 8))
    cs = g.input("cs", (16, 4))
    with pytest.raises(ValueError, match=match):
        build(g, x, cs)


@pytest.mark.parametrize("build,match", [
    (lambda g, x, cs: g.rope(g.input("y", (5, 8)), cs, cs),
     r"rope: x must be \[B, H, S, D\] \(or \[B, S, D\]\), got \[5, 8\]"),
    (lambda g, x, cs: g.rope(g.cast(x, "i32"), cs, cs),
     r"rope: x must be f32, f16 or bf16, got i32 \[2, 3, 5, 8\]"),
    (lambda g, x, cs: g.rope(x, cs, cs, n_rot=5),
     r"rope: n_rot must be an even int in \[2, D\] with D = 8 \(x \[2, 3, 5, 8\]\), got 5"),
    (lambda g, x, cs: g.rope(x, cs, cs, n_rot=10), r"rope: n_rot must be an even int .* got 10"),
    (lambda g, x, cs: g.rope(x, cs, cs, n_rot=0), r"rope: n_rot must be an even int .* got 0"),
    (lambda g, x, cs: g.rope(x, cs, cs, n_rot=4.0), r"rope: n_rot must be an even int .* got 4.0"),
    (lambda g, x, cs: g.rope(g.input("y", (2, 3, 5, 7)), cs, cs),
     r"rope: n_rot must be an even int in \[2, D\] with D = 7 \(x \[2, 3, 5, 7\]\), got 7"),
    (lambda g, x, cs: g.rope(x, cs, cs, n_rot=6),
     (r"rope: cos must be \[max_pos, n_rot/2\] = \[max_pos, 3\] \(n_rot 6, x \[2, 3, 5, 8\]\), "
      r"got \[16, 4\]")),
    (lambda g, x, cs: g.rope(x, cs, g.input("s", (16, 4, 1))),
     r"rope: sin must be \[max_pos, n_rot/2\] = \[max_pos, 4\] .* got \[16, 4, 1\]"),
    (lambda g, x, cs: g.rope(x, cs, g.input("s", (12, 4))),
     r"rope: cos \[16, 4\] and sin \[12, 4\] must have the same shape"),
    (lambda g, x, cs: g.rope(x, g.input("c", (16, 4), "f16"), cs),
     r"rope: cos must be f32, got f16 \[16, 4\]"),
    (lambda g, x, cs: g.rope(x, g.input("c", (0, 4)), g.input("s", (0, 4))),
     r"rope: cos and sin \[0, 4\] hold no positions"),
    (lambda g, x, cs: g.rope(x, cs, cs, position_offset=12),
     (r"rope: position_offset 12 \+ S 5 \(x \[2, 3, 5, 8\]\) exceeds max_pos 16 \(cos/sin "
      r"\[16, 4\]\)")),
    (lambda g, x, cs: g.rope(x, cs, cs, position_offset=-1),
     r"rope: position_offset must be an int >= 0, got -1"),
    (lambda g, x, cs: g.rope(x, cs, cs, position_offset=1.5),
     r"rope: position_offset must be an int >= 0, got 1.5"),
    (lambda g, x, cs: g.rope(x, cs, cs, interleaved=1), r"rope: interleaved must be a bool, got 1"),
    (lambda g, x, cs: g.rope(x, cs, cs, positions=g.input("p", (5,), "f32")),
     r"rope: positions must be i32 or i64, got f32 \[5\]"),
    (lambda g, x, cs: g.rope(x, cs, cs, positions=g.input("p", (4,), "i32")),
     (r"rope: positions must be \[S\] = \[5\] or \[B, S\] = \[2, 5\] \(x \[2, 3, 5, 8\]\), "
      r"got \[4\]")),
    (lambda g, x, cs: g.rope(x, cs, cs, positions=g.input("p", (3, 5), "i64")),
     r"rope: positions must be \[S\] = \[5\] or \[B, S\] = \[2, 5\] .* got \[3, 5\]"),
    (lambda g, x, cs: g.rope(x, cs, cs, position_offset=2, positions=g.input("p", (5,), "i32")),
     r"rope: pass either position_offset \(2\) or positions \[5\], not both"),
    (lambda g, x, cs: g.rope(x, np.zeros((16, 4), np.float32), cs),
     r"rope: cos must be a Tensor of this graph, got ndarray"),
])
def test_rope_errors(build, match):
    _rope_err(build, match)


# ---- kv_write ----------------------------------------------------------------------------------
def np_write(cache, new, p):
    out = cache.copy()
    s = new.shape[2]
    for j in range(s):
        if 0 <= p + j < cache.shape[2]:
            out[:, :, p + j] = new[:, :, j]
    return out


@pytest.mark.parametrize("pos", [0, 5, 8])   # 8 = max_S - s: the last rows
def test_kv_write_int_position(rng, pos):
    b, h, max_s, s, d = 2, 3, 10, 2, 5
    cv = rng.standard_normal((b, h, max_s, d)).astype(np.float32)
    nv = rng.standard_normal((b, h, s, d)).astype(np.float32)
    g = rlx.Graph()
    c = g.input("cache", cv.shape)
    n = g.input("new", nv.shape)
    y = g.kv_write(c, n, pos)
    assert y.shape == cv.shape
    g.set_outputs([y, g.sum(y, (2, 3))])       # the updated cache, and a read of it afterwards
    out, tot = run_graph(g, {"cache": cv, "new": nv})
    want = np_write(cv, nv, pos)
    np.testing.assert_array_equal(out, want)
    close(tot, want.astype(np.float64).sum((2, 3)))


def test_kv_write_into_an_intermediate_keeps_it_alive(rng):
    """The cache is a computed tensor: its buffer must outlive the reads of the kv_write's
    result, though buffers made in between could otherwise take its place."""
    cv = rng.standard_normal((1, 2, 6, 4)).astype(np.float32)
    nv = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    g = rlx.Graph()
    c = g.input("c", cv.shape) * 2.0                 # an intermediate cache
    n = g.input("n", nv.shape)
    k = g.kv_write(c, n * 3.0, 3)
    z = [g.exp(n * float(i)) for i in range(4)]      # intermediates live after the write
    out = g.sum(k, (2, 3))
    for t in z:
        out = out + g.sum(t, (2, 3))
    g.set_outputs([out])
    exe = rlx.compile(g, compile_mode="aot")
    (got,) = exe.run({"c": cv, "n": nv})
    want = np_write(cv.astype(np.float64) * 2, nv.astype(np.float64) * 3, 3).sum((2, 3))
    for i in range(4):
        want = want + np.exp(nv.astype(np.float64) * i).sum((2, 3))
    close(got, want)


def test_kv_write_param_cache_persists_across_runs(rng):
    b, h, max_s, d = 1, 2, 9, 16
    g = rlx.Graph("decode")
    kc = g.param("k_cache", (b, h, max_s, d))
    before = g.sum(kc, (2, 3))                  # built before the write: sees the old contents
    new = g.input("new", (b, h, 1, d))
    pos = g.input("pos", (1,), "i32")
    k_all = g.kv_write(kc, new, pos)
    keep = g.reshape(g.constant(np.arange(max_s)) <= pos, (max_s, 1))   # keys 0..pos are valid
    masked = g.sum(g.where(keep, k_all, 0.0), (2, 3))
    g.set_outputs([before, masked, k_all])
    exe = rlx.compile(g)
    rep = exe.memory_report()
    # k_all is an output but owns no memory: only the two [1, 2] sums are output buffers
    assert rep["output_bytes"] == 2 * ALIGN and rep["param_bytes"] >= b * h * max_s * d * 4
    ref = rng.standard_normal((b, h, max_s, d)).astype(np.float32)   # garbage past the cursor
    exe.set_param("k_cache", ref)
    cache = ref.astype(np.float64)
    for t in range(3):        # three decode steps of the same executable
        nv = rng.standard_normal((b, h, 1, d)).astype(np.float32)
        bef, m, kall = exe.run({"new": nv, "pos": np.array([t], np.int32)})
        close(bef, cache.sum((2, 3)))
        cache[:, :, t] = nv[:, :, 0]
        np.testing.assert_array_equal(kall, cache.astype(np.float32))
        close(m, cache[:, :, :t + 1].sum((2, 3)))
    with pytest.raises(IndexError, match=r"run: kv_write %\d+ \(cache \[1, 2, 9, 16\], new "
                                         r"\[1, 2, 1, 16\]\): input 'pos' holds index 9 at \[0\], "
                                         r"out of range \[0, 8\]"):
        exe.run({"new": nv, "pos": np.array([9], np.int32)})


def test_kv_write_runs_when_nothing_reads_it(rng):
    """A write into a param is kept even though no output depends on it."""
    g = rlx.Graph()
    kc = g.param("c", (1, 1, 4, 3))
    total = g.sum(kc)
    g.kv_write(kc, g.input("n", (1, 1, 1, 3)), g.input("p", (), "i64"))
    g.set_outputs([total])
    exe = rlx.compile(g)
    exe.set_param("c", np.zeros((1, 1, 4, 3)))
    n1 = rng.standard_normal((1, 1, 1, 3)).astype(np.float32)
    (a,) = exe.run({"n": n1, "p": np.array(2)})
    (b,) = exe.run({"n": n1, "p": np.array(3)})
    assert a == 0
    close(b, n1.astype(np.float64).sum())


def test_kv_write_chain_rope_and_chunk(rng):
    """A chunk of s=3 rotated keys written at a run-input position, then a second write
    into the result; readers see both."""
    b, h, max_s, s, d = 2, 2, 12, 3, 8
    cos, sin = tables(max_s, d)
    g = rlx.Graph()
    kc = g.param("kc", (b, h, max_s, d))
    k = g.input("k", (b, h, s, d))
    pos = g.input("pos", (1,), "i64")
    ks = g.rope(k, g.constant(cos), g.constant(sin), positions=pos + g.constant(np.arange(s)))
    k1 = g.kv_write(kc, ks, pos)
    sums = g.sum(k1, 3)       # built before the second write: runs before it, sees k1
    k2 = g.kv_write(k1, g.input("k2", (b, h, 1, d)), 0)
    g.set_outputs([sums, k2])
    exe = rlx.compile(g)
    c0 = rng.standard_normal((b, h, max_s, d)).astype(np.float32)
    exe.set_param("kc", c0)
    kv, k2v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for n in (s, 1))
    p = 4
    sums, out = exe.run({"k": kv, "pos": np.array([p]), "k2": k2v})
    rot = np_rope(kv, cos, sin, np.arange(p, p + s), d, False).astype(np.float32)
    want = np_write(np_write(c0, rot, p), k2v, 0)
    close(out, want)
    close(sums, np_write(c0, rot, p).astype(np.float64).sum(3))


def test_kv_write_unchecked_positions_drop_out_of_range_rows(rng):
    b, h, max_s, s, d = 1, 2, 6, 2, 3
    cv = rng.standard_normal((b, h, max_s, d)).astype(np.float32)
    nv = rng.standard_normal((b, h, s, d)).astype(np.float32)
    g = rlx.Graph()
    c = g.input("c", cv.shape)
    n = g.input("n", nv.shape)
    p = g.input("p", (1,), "i32")
    g.set_outputs([g.kv_write(c, n, p)])
    exe = rlx.compile(g)
    for bad in (5, -1, 9):   # device arrays are not checked: rows off the cache are dropped
        (out,) = exe.run({"c": cv, "n": nv, "p": cuda.to_device(np.array([bad], np.int32))})
        np.testing.assert_array_equal(out, np_write(cv, nv, bad))
    g2 = rlx.Graph()      # an in-graph position (computed) is not checked either
    c = g2.input("c", cv.shape)
    p = g2.input("p", (1,), "i32")
    g2.set_outputs([g2.kv_write(c, g2.input("n", nv.shape), p + 3)])
    (out,) = run_graph(g2, {"c": cv, "n": nv, "p": np.array([2], np.int32)})
    np.testing.assert_array_equal(out, np_write(cv, nv, 5))


def test_kv_write_stale_reads_are_rejected():
    g = rlx.Graph()
    c = g.param("c", (1, 1, 4, 2))
    n = g.input("n", (1, 1, 1, 2))
    y = g.kv_write(c, n, 1)
    g.set_outputs([g.sum(y), g.sum(c)])         # sum(c) is built after the write
    with pytest.raises(ValueError, match=r"compile: %\d+ reduce reads %0 \(param\) after kv_write "
                                         r"%2 overwrote its memory in place; read %2's result"):
        rlx.compile(g)
    g.set_outputs([y, c])
    with pytest.raises(ValueError, match=r"compile: output 1 reads %0 \(param\) after kv_write %2"):
        rlx.compile(g)
    g2 = rlx.Graph()
    c = g2.param("c", (1, 1, 4, 2))
    n = g2.input("n", (1, 1, 1, 2))
    a = g2.kv_write(c, n, 1)
    b = g2.kv_write(c, n, 2)                     # a second write into the old version
    g2.set_outputs([a, b])
    with pytest.raises(ValueError, match=r"compile: %3 kv_write reads %0 \(param\) after kv_write "
                                         r"%2 overwrote"):
        rlx.compile(g2)
    g3 = rlx.Graph()
    c = g3.param("c", (1, 1, 4, 2))
    a = g3.kv_write(c, g3.input("n", (1, 1, 1, 2)), 1)
    g3.set_outputs([g3.reshape(c, (8,)), a])     # a view of the old version, built after
    with pytest.raises(ValueError, match=r"compile: %3 reshape reads %0 \(param\) after kv_write"):
        rlx.compile(g3)
    g3.set_outputs([g3.sum(g3.reshape(a, (8,)))])   # a view of the result is fine
    exe = rlx.compile(g3)
    exe.set_param("c", np.ones((1, 1, 4, 2)))
    (t,) = exe.run({"n": np.full((1, 1, 1, 2), 5, np.float32)})
    assert t == 16


def _kv_err(build, match):
    g = rlx.Graph("e")
    c = g.input("c", (2, 3, 10, 4))
    n = g.input("n", (2, 3, 2, 4))
    with pytest.raises(ValueError, match=match):
        build(g, c, n)


@pytest.mark.parametrize("build,match", [
    (lambda g, c, n: g.kv_write(g.input("x", (3, 10, 4)), n, 0),
     r"kv_write: cache must be \[B, H, max_S, D\], got \[3, 10, 4\]"),
    (lambda g, c, n: g.kv_write(c, g.input("x", (3, 2, 4)), 0),
     r"kv_write: new must be \[B, H, s, D\], got \[3, 2, 4\]"),
    (lambda g, c, n: g.kv_write(c, g.input("x", (2, 3, 2, 5)), 0),
     (r"kv_write: new must be \[B, H, s, D\] = \[2, 3, s, 4\] to match cache \[2, 3, 10, 4\], "
      r"got \[2, 3, 2, 5\]")),
    (lambda g, c, n: g.kv_write(c, g.input("x", (2, 3, 11, 4)), 0),
     r"kv_write: new \[2, 3, 11, 4\] has 11 rows but cache \[2, 3, 10, 4\] holds only 10"),
    (lambda g, c, n: g.kv_write(c, g.cast(n, "f16"), 0),
     r"kv_write: new is f16 \[2, 3, 2, 4\] but cache is f32 \[2, 3, 10, 4\]; they must match"),
    (lambda g, c, n: g.kv_write(c, n, 9),
     (r"kv_write: position 9 \+ s 2 \(new \[2, 3, 2, 4\]\) must lie in \[0, max_S\] = \[0, 10\] "
      r"\(cache \[2, 3, 10, 4\]\)")),
    (lambda g, c, n: g.kv_write(c, n, -1), r"kv_write: position -1 \+ s 2 .* must lie in"),
    (lambda g, c, n: g.kv_write(c, n, g.input("p", (2,), "i32")),
     r"kv_write: position must be a scalar tensor, shape \[\] or \[1\], got \[2\]"),
    (lambda g, c, n: g.kv_write(c, n, g.input("p", (1,), "f32")),
     r"kv_write: position must be i32 or i64, got f32 \[1\]"),
    (lambda g, c, n: g.kv_write(c, n, 1.0),
     r"kv_write: position must be an int or an i32/i64 tensor of shape \[\] or \[1\], got float"),
    (lambda g, c, n: g.kv_write(c, n, True), r"kv_write: position must be an int .* got bool"),
    (lambda g, c, n: g.kv_write(g.reshape(g.constant(np.zeros((2, 3, 40), np.float32)),
                                          (2, 3, 10, 4)), n, 0),
     (r"kv_write: cache \[2, 3, 10, 4\] is \(a view of\) constant %\d+; a cache is written in "
      r"place")),
])
def test_kv_write_errors(build, match):
    _kv_err(build, match)


def test_graph_prints_rope_and_kv_write():
    g = rlx.Graph("p")
    x = g.input("x", (1, 2, 3, 4))
    cs = g.input("cs", (8, 2))
    c = g.param("c", (1, 2, 8, 4))
    g.set_outputs([g.kv_write(c, g.rope(x, cs, cs, interleaved=True, position_offset=1), 2)])
    s = str(g)
    assert "rope(%0, %1, %1, n_rot=4, interleaved=True, position_offset=1)" in s, s
    assert "kv_write(%2, %3, position=2)" in s, s
