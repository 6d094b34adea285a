"""Shape and index ops: transpose, narrow, concat, expand, gather, scatter_add.

NumPy is the oracle (np.transpose, slicing, np.concatenate, np.broadcast_to, fancy indexing,
np.add.at). Shapes are odd and small (the simulator runs one OS thread per CUDA thread)."""

import numpy as np
import pytest
from numba import cuda

import rlx_numba as rlx
from conftest import run_graph

DTYPES = ["f32", "f16", "bf16", "i32", "i64", "bool"]


def rand(rng, shape, dtype):
    d = rlx.dtype(dtype)
    if d.is_float:
        return rng.standard_normal(shape).astype(d.host)
    if d.is_int:
        return rng.integers(-100, 100, shape).astype(d.host)
    return rng.random(shape) < 0.5


def steps_of(g):
    return [s.kernel_name for s in rlx.compile(g).steps]


# ---- transpose -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_transpose_every_dtype(rng, dtype):
    perms = [(0, 1, 2), (2, 1, 0), (1, 0, 2), (0, 2, 1), (2, 0, 1), (1, 2, 0), None]
    x = rand(rng, (5, 11, 9), dtype)
    g = rlx.Graph()
    xi = g.input("x", x.shape, dtype)
    g.set_outputs([g.transpose(xi, p) for p in perms])
    for p, y in zip(perms, run_graph(g, {"x": x})):
        assert y.dtype == x.dtype
        np.testing.assert_array_equal(y, np.transpose(x, p), err_msg=f"perm {p}")


@pytest.mark.parametrize("shape,perms", [
    ((7,), [(0,), (-1,), None]),
    ((33, 37), [(1, 0), (-1, -2), (0, 1)]),
    ((1, 17), [(1, 0)]),
    ((3, 1, 7), [(2, 1, 0), (1, 0, 2), (0, 2, 1)]),
    ((2, 3, 4, 5), [(3, 1, 0, 2), (0, 1, 3, 2), (1, 0, 2, 3), (2, 3, 0, 1), (-1, 0, -2, 1),
                    (0, 2, 1, 3)]),
    ((2, 3, 2, 3, 2, 3), [(5, 3, 1, 0, 2, 4), (4, 2, 0, 3, 1, 5)]),   # > 3 batch / row dims
])
def test_transpose_ranks_and_perms(rng, shape, perms):
    x = rng.standard_normal(shape).astype(np.float32)
    g = rlx.Graph()
    xi = g.input("x", shape)
    g.set_outputs([g.transpose(xi, p) for p in perms])
    for p, y in zip(perms, run_graph(g, {"x": x})):
        np.testing.assert_array_equal(y, np.transpose(x, p), err_msg=f"perm {p}")


def test_transpose_paths(rng):
    """Last axis moves: tiled kernel (edge and full tiles, batch); last axis stays: row copies;
    nothing moves (after dropping size-1 axes): a flat copy."""
    g = rlx.Graph()
    x = g.input("x", (3, 19, 17))
    u = g.input("u", (19, 1, 17))
    outs = [g.transpose(x, (0, 2, 1)), g.transpose(x, (1, 0, 2)), g.transpose(u, (1, 0, 2))]
    g.set_outputs(outs)
    names = steps_of(g)
    assert names[0].startswith("transpose_tiled 3x19x17"), names
    assert names[1].startswith("copy_rows 57x17"), names
    assert names[2].startswith("elementwise"), names
    xv = rng.standard_normal((3, 19, 17)).astype(np.float32)
    uv = rng.standard_normal((19, 1, 17)).astype(np.float32)
    ys = run_graph(g, {"x": xv, "u": uv})
    for y, ref in zip(ys, [xv.transpose(0, 2, 1), xv.transpose(1, 0, 2), uv.transpose(1, 0, 2)]):
        np.testing.assert_array_equal(y, ref)


def test_transpose_chain_and_zero_size(rng):
    g = rlx.Graph()
    x = g.input("x", (4, 0, 3))
    y = g.input("y", (6, 5))
    g.set_outputs([g.transpose(x, (2, 0, 1)), g.transpose(g.transpose(y) * 2.0)])
    xv = np.zeros((4, 0, 3), np.float32)
    yv = rng.standard_normal((6, 5)).astype(np.float32)
    a, b = run_graph(g, {"x": xv, "y": yv})
    assert a.shape == (3, 4, 0)
    np.testing.assert_array_equal(b, yv * 2)


# ---- narrow ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_narrow(rng, dtype):
    x = rand(rng, (4, 7, 5), dtype)
    cases = [(0, 1, 2), (1, 2, 4), (-1, 0, 5), (2, 3, 2), (-2, 6, 1), (1, 3, 0)]
    g = rlx.Graph()
    xi = g.input("x", x.shape, dtype)
    g.set_outputs([g.narrow(xi, a, s, n) for a, s, n in cases])
    for (a, s, n), y in zip(cases, run_graph(g, {"x": x})):
        ref = x[(slice(None),) * (a % 3) + (slice(s, s + n),)]
        assert y.shape == ref.shape
        np.testing.assert_array_equal(y, ref, err_msg=f"narrow({a}, {s}, {n})")


# ---- concat ------------------------------------------------------------------------------
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_concat_axes_and_counts(rng, axis):
    base = (3, 4, 5)
    lens = [2, 1, 3, 0]
    xs = []
    for n in lens:
        s = list(base)
        s[axis] = n
        xs.append(rng.standard_normal(s).astype(np.float32))
    g = rlx.Graph()
    ins = [g.input(f"x{i}", x.shape) for i, x in enumerate(xs)]
    g.set_outputs([g.concat(ins[:k], axis) for k in range(1, 5)])
    ys = run_graph(g, {f"x{i}": x for i, x in enumerate(xs)})
    for k, y in zip(range(1, 5), ys):
        np.testing.assert_array_equal(y, np.concatenate(xs[:k], axis), err_msg=f"{k} inputs")


@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_dtypes(rng, dtype):
    a, b, c = rand(rng, (3, 2, 5), dtype), rand(rng, (3, 7, 5), dtype), rand(rng, (3, 1, 5), dtype)
    g = rlx.Graph()
    ins = [g.input(n, v.shape, dtype) for n, v in zip("abc", (a, b, c))]
    g.set_outputs([g.concat(ins, 1), g.concat([ins[0], ins[0]], -1)])
    y, z = run_graph(g, {"a": a, "b": b, "c": c})
    np.testing.assert_array_equal(y, np.concatenate([a, b, c], 1))
    np.testing.assert_array_equal(z, np.concatenate([a, a], -1))


@pytest.mark.parametrize("dtype", ["f16", "i64", "bool"])
def test_narrow_concat_long_rows(rng, dtype):
    """Rows long enough for the unrolled part of the row copy, at several element widths."""
    a, b = rand(rng, (3, 301), dtype), rand(rng, (3, 150), dtype)
    g = rlx.Graph()
    ai, bi = g.input("a", a.shape, dtype), g.input("b", b.shape, dtype)
    g.set_outputs([g.narrow(ai, 1, 7, 290), g.concat([ai, bi], 1), g.concat([bi, bi], 0)])
    x, y, z = run_graph(g, {"a": a, "b": b})
    np.testing.assert_array_equal(x, a[:, 7:297])
    np.testing.assert_array_equal(y, np.concatenate([a, b], 1))
    np.testing.assert_array_equal(z, np.concatenate([b, b], 0))


# ---- expand ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_expand(rng, dtype):
    x = rand(rng, (3, 1, 5), dtype)
    s = rand(rng, (1,), dtype)
    if dtype in ("f16", "bf16"):   # a signalling NaN and -0.0 must pass bit for bit
        x.view(np.uint16)[0, 0, :2] = (0x7F81, 0x8000) if dtype == "bf16" else (0x7C01, 0x8000)
    g = rlx.Graph()
    xi = g.input("x", x.shape, dtype)
    si = g.input("s", (1,), dtype)
    shapes = [(2, 3, 4, 5), (-1, 7, -1), (3, 1, 5), (2, 3, 1, -1)]
    g.set_outputs([g.expand(xi, sh) for sh in shapes] + [g.expand(si, (4, 3))])
    ys = run_graph(g, {"x": x, "s": s})
    refs = [np.broadcast_to(x, (2, 3, 4, 5)), np.broadcast_to(x, (3, 7, 5)), x,
            np.broadcast_to(x, (2, 3, 1, 5)), np.broadcast_to(s, (4, 3))]
    for y, ref in zip(ys, refs):
        assert y.shape == ref.shape and y.dtype == ref.dtype
        if dtype in ("f16", "bf16"):
            y, ref = y.view(np.uint16), ref.view(np.uint16)
        np.testing.assert_array_equal(y, ref)


# ---- gather ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("idx_dtype", ["i32", "i64"])
def test_gather_each_axis(rng, dtype, idx_dtype):
    t = rand(rng, (5, 6, 7), dtype)
    idx = rng.integers(-5, 5, (2, 3)).astype(rlx.dtype(idx_dtype).host)
    idx[0, 0] = -5
    g = rlx.Graph()
    ti = g.input("t", t.shape, dtype)
    ii = g.input("i", idx.shape, idx_dtype)
    g.set_outputs([g.gather(ti, ii, a) for a in (0, 1, -1, -2)])
    ys = run_graph(g, {"t": t, "i": idx})
    refs = [t[idx], t[:, idx], t[:, :, idx], t[:, idx]]
    for a, y, ref in zip((0, 1, -1, -2), ys, refs):
        assert y.shape == ref.shape and y.dtype == t.dtype
        np.testing.assert_array_equal(y, ref, err_msg=f"axis {a}")


def test_gather_embedding_and_scalar_index(rng):
    emb = rng.standard_normal((11, 133)).astype(np.float32)   # long rows: the unrolled copy loop
    tok = rng.integers(0, 11, (3, 5)).astype(np.int64)
    g = rlx.Graph()
    e = g.param("emb", emb.shape)
    ti = g.input("tok", tok.shape, "i64")
    one = g.constant(np.array(-2, np.int32))   # a 0-d index removes the axis
    g.set_outputs([g.gather(e, ti), g.gather(e, one, 1)])
    y, z = run_graph(g, {"tok": tok}, params={"emb": emb})
    np.testing.assert_array_equal(y, emb[tok])
    np.testing.assert_array_equal(z, emb[:, -2])


def test_gather_run_input_index_error(rng):
    g = rlx.Graph()
    t = g.input("t", (6, 4))
    i = g.input("i", (2, 3), "i32")
    g.set_outputs([g.gather(t, i, axis=0), g.gather(t, g.reshape(i, (6,)), axis=-1)])
    exe = rlx.compile(g)
    tv = rng.standard_normal((6, 4)).astype(np.float32)
    ok = np.array([[0, -4, 3], [1, 2, -1]], np.int32)
    a, b = exe.run({"t": tv, "i": ok})
    np.testing.assert_array_equal(a, tv[ok])
    np.testing.assert_array_equal(b, tv[:, ok.reshape(-1)])
    # axis 1 has 4 entries: 5 and -5 fail that check; the axis-0 check (6 entries) passes 5
    with pytest.raises(IndexError, match=r"gather %\d+ \(table \[6, 4\], axis 1\): input 'i' holds "
                                         r"index 5 at \[1, 0\], out of range \[-4, 3\]"):
        exe.run({"t": tv, "i": np.array([[0, 1, 2], [5, 0, 0]], np.int32)})
    with pytest.raises(IndexError, match=r"gather %\d+ \(table \[6, 4\], axis 0\): input 'i' holds "
                                         r"index -7 at \[0, 2\], out of range \[-6, 5\]"):
        exe.run({"t": tv, "i": np.array([[0, 1, -7], [0, 0, 0]], np.int32)})


def test_gather_in_graph_and_device_indices_are_clamped(rng):
    t = rng.standard_normal((5, 3)).astype(np.float32)
    bad = np.array([-9, -5, -1, 0, 4, 5, 70], np.int64)
    clamped = np.clip(bad, -5, 4)
    g = rlx.Graph()
    ti = g.input("t", t.shape)
    di = g.input("d", bad.shape, "i64")
    g.set_outputs([g.gather(ti, g.constant(bad)), g.gather(ti, di * 1)])   # in-graph indices
    a, b = run_graph(g, {"t": t, "d": bad})
    np.testing.assert_array_equal(a, t[clamped])
    np.testing.assert_array_equal(b, t[clamped])
    g2 = rlx.Graph()
    ti = g2.input("t", t.shape)
    di = g2.input("d", bad.shape, "i64")
    g2.set_outputs([g2.gather(ti, di)])
    (c,) = rlx.compile(g2).run({"t": t, "d": cuda.to_device(bad)})   # device arrays: not checked
    np.testing.assert_array_equal(c, t[clamped])


# ---- scatter_add -------------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "i32", "i64"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_add(rng, dtype, axis, deterministic):
    """Atomic adds, or (deterministic) adds in index order: np.add.at's bits exactly."""
    tshape = (4, 6, 3)
    idx = np.array([1, -1, 1, 0, 3, 1, -4], np.int64)
    ushape = list(tshape)
    ushape[axis] = len(idx)
    target = rand(rng, tshape, dtype)
    upd = rand(rng, tuple(ushape), dtype)
    dim = tshape[axis]
    idx = np.where(idx < -dim, idx % dim, np.minimum(idx, dim - 1))   # valid for every axis
    g = rlx.Graph()
    ti = g.input("t", tshape, dtype)
    ii = g.input("i", idx.shape, "i64")
    ui = g.input("u", upd.shape, dtype)
    g.set_outputs([g.scatter_add(ti, ii, ui, axis=axis, deterministic=deterministic),
                   g.scatter_add(ti, g.cast(ii, "i32"), ui, axis, deterministic=deterministic)])
    ys = run_graph(g, {"t": target, "i": idx, "u": upd})
    ref = target.copy()
    np.add.at(ref, (slice(None),) * (axis % 3) + (idx,), upd)
    for y in ys:
        assert y.dtype == target.dtype
        if dtype == "f32" and not deterministic:
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(y, ref)


def test_scatter_add_deterministic_many_rows_and_repeats(rng):
    """The ordered kernel over more rows than a block owns and columns than a block has
    threads (on a GPU; the simulator grid-strides both): each element's adds in index order,
    bit for bit np.add.at's, the same on every run; a bad flag is refused."""
    t = rng.standard_normal((300, 70)).astype(np.float32)
    idx = rng.integers(-300, 300, 60)
    idx[::7] = 5                                   # one row hit many times
    u = (rng.standard_normal((60, 70)) * 10 ** rng.uniform(-3, 3, (60, 1))).astype(np.float32)
    g = rlx.Graph()
    ti, ii, ui = g.input("t", t.shape), g.input("i", idx.shape, "i64"), g.input("u", u.shape)
    g.set_outputs([g.scatter_add(ti, ii, ui, deterministic=True)])
    exe = rlx.compile(g)
    ref = t.copy()
    np.add.at(ref, idx, u)
    for _ in range(2):
        (y,) = exe.run({"t": t, "i": idx, "u": u})
        np.testing.assert_array_equal(y, ref)
    with pytest.raises(ValueError, match="scatter_add: deterministic must be a bool"):
        g.scatter_add(ti, ii, ui, deterministic="yes")


def test_scatter_add_embedding_grad_and_checks(rng):
    """The embedding-gradient shape: [vocab, hidden] += rows of [tokens, hidden] at token ids."""
    grads = rng.standard_normal((9, 37)).astype(np.float32)
    tok = np.array([3, 0, 3, 3, 8, 0, 1, 2, 7], np.int32)
    g = rlx.Graph()
    ti = g.input("tok", tok.shape, "i32")
    gi = g.input("g", grads.shape)
    zero = g.constant(np.zeros((10, 37), np.float32))
    g.set_outputs([g.scatter_add(zero, ti, gi)])
    exe = rlx.compile(g)
    (y,) = exe.run({"tok": tok, "g": grads})
    ref = np.zeros((10, 37), np.float32)
    np.add.at(ref, tok, grads)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(IndexError, match=r"scatter_add %\d+ \(target \[10, 37\], axis 0\): input "
                                         r"'tok' holds index 10 at \[4\], out of range \[-10, 9\]"):
        exe.run({"tok": np.where(tok == 8, 10, tok).astype(np.int32), "g": grads})


def test_scatter_add_in_graph_out_of_range_dropped(rng):
    t = rng.standard_normal((4, 2)).astype(np.float32)
    u = rng.standard_normal((5, 2)).astype(np.float32)
    idx = np.array([0, 9, -1, -5, 2], np.int64)   # 9 and -5 are outside [-4, 3]: dropped
    g = rlx.Graph()
    ti = g.input("t", t.shape)
    ui = g.input("u", u.shape)
    g.set_outputs([g.scatter_add(ti, g.constant(idx), ui),
                   g.scatter_add(ti, g.constant(idx), ui, deterministic=True)])
    ref = t.copy()
    keep = (idx >= -4) & (idx < 4)
    np.add.at(ref, idx[keep], u[keep])
    for y in run_graph(g, {"t": t, "u": u}):
        np.testing.assert_allclose(y, ref, rtol=1e-6)


# ---- errors ----------------------------------------------------------------------------------
def _err(build, match):
    g = rlx.Graph("e")
    x = g.input("x", (3, 4, 5))
    with pytest.raises(ValueError, match=match):
        build(g, x)


@pytest.mark.parametrize("build,match", [
    (lambda g, x: g.transpose(x, (0, 1)),
     r"transpose: perm \[0, 1\] has 2 axes but x \[3, 4, 5\] has rank 3"),
    (lambda g, x: g.transpose(x, (0, 1, 3)),
     r"transpose: perm \[0, 1, 3\] holds axis 3, out of range for x \[3, 4, 5\] \(rank 3\)"),
    (lambda g, x: g.transpose(x, (0, 1, -3)),
     r"transpose: perm \[0, 1, -3\] is not a permutation of the axes of x \[3, 4, 5\]"),
    (lambda g, x: g.transpose(x, 1), r"transpose: perm must be a sequence of ints, got 1"),
    (lambda g, x: g.transpose(x, (0, 1.5, 2)), r"transpose: perm entry must be an int, got 1.5"),
    (lambda g, x: g.transpose(np.ones(3), None), r"transpose: x must be a Tensor"),
    (lambda g, x: g.narrow(x, 3, 0, 1), r"narrow: axis 3 is out of range for x \[3, 4, 5\] \(rank 3\)"),
    (lambda g, x: g.narrow(x, -1, 3, 3),
     (r"narrow: start 3 and length 3 must satisfy 0 <= start, 0 <= length, start \+ length <= 5 "
      r"\(axis 2 of x \[3, 4, 5\]\)")),
    (lambda g, x: g.narrow(x, 0, -1, 1), r"narrow: start -1 and length 1 must satisfy"),
    (lambda g, x: g.concat([], 0), r"concat: xs must be a non-empty list of Tensors, got \[\]"),
    (lambda g, x: g.concat(x, 0), r"concat: xs must be a non-empty list of Tensors"),
    (lambda g, x: g.concat([x, g.input("y", (3, 4))], 0),
     r"concat: xs\[1\] \[3, 4\] has rank 2 but xs\[0\] \[3, 4, 5\] has rank 3"),
    (lambda g, x: g.concat([x, g.input("y", (3, 4, 5), "f16")], 0),
     r"concat: xs\[1\] is f16 \[3, 4, 5\] but xs\[0\] is f32 \[3, 4, 5\]"),
    (lambda g, x: g.concat([x, g.input("y", (3, 2, 5))], -1),
     (r"concat: xs\[1\] \[3, 2, 5\] does not match xs\[0\] \[3, 4, 5\] on axis 1 \(only axis 2 "
      r"may differ\)")),
    (lambda g, x: g.concat([x], 3), r"concat: axis 3 is out of range for xs\[0\] \[3, 4, 5\]"),
    (lambda g, x: g.expand(x, (4, 5)), r"expand: shape \[4, 5\] has fewer dims than x \[3, 4, 5\]"),
    (lambda g, x: g.expand(x, (3, 8, 5)),
     r"expand: cannot expand x \[3, 4, 5\] to \[3, 8, 5\]: axis 1 of x is 4, not 1 or 8"),
    (lambda g, x: g.expand(x, (-1, 3, 4, 5)),
     r"expand: shape \[-1, 3, 4, 5\] has -1 at new leading axis 0"),
    (lambda g, x: g.gather(x, g.input("i", (2,), "f32")),
     r"gather: indices must be i32 or i64, got f32 \[2\]"),
    (lambda g, x: g.gather(x, g.input("i", (2,), "i32"), 3),
     r"gather: axis 3 is out of range for table \[3, 4, 5\]"),
    (lambda g, x: g.gather(g.input("t", (0, 2)), g.input("i", (2,), "i32")),
     r"gather: table \[0, 2\] is empty along axis 0"),
    (lambda g, x: g.scatter_add(g.cast(x, "f16"), g.input("i", (2,), "i32"), x),
     r"scatter_add: target is f16 \[3, 4, 5\]; atomic add supports f32, i32 and i64 only"),
    (lambda g, x: g.scatter_add(x, g.input("i", (2, 1), "i32"), x),
     r"scatter_add: indices must be 1-D, got \[2, 1\]"),
    (lambda g, x: g.scatter_add(x, g.input("i", (2,), "i32"), x, axis=1),
     (r"scatter_add: updates must be \[3, 2, 5\] \(target \[3, 4, 5\] with axis 1 replaced by "
      r"indices \[2\]\), got \[3, 4, 5\]")),
    (lambda g, x: g.scatter_add(x, g.input("i", (4,), "i32"), g.cast(x, "i32"), axis=1),
     r"scatter_add: updates is i32 \[3, 4, 5\] but target is f32 \[3, 4, 5\]"),
    (lambda g, x: g.scatter_add(x, g.input("i", (2,), "bool"), x),
     r"scatter_add: indices must be i32 or i64, got bool \[2\]"),
])
def test_errors(build, match):
    _err(build, match)


def test_graph_prints_shape_ops():
    g = rlx.Graph("p")
    x = g.input("x", (3, 4))
    i = g.input("i", (2,), "i32")
    g.set_outputs([g.transpose(x), g.narrow(x, 1, 1, 2), g.concat([x, x], 0), g.expand(x, (2, 3, 4)),
                   g.gather(x, i, 1), g.scatter_add(x, i, g.gather(x, i, 0))])
    s = str(g)
    for part in ("transpose(%0, perm=(1, 0))", "narrow(%0, axis=1, start=1, length=2)",
                 "concat(%0, %0, axis=0)", "f32[2, 3, 4] = expand(%0)", "gather(%0, %1, axis=1)",
                 "scatter_add(%0, %1, %7, axis=0)"):
        assert part in s, s
