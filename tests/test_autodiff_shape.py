"""g.grad through the shape ops, rope and topk values: each VJP against central finite
differences of a float64 NumPy oracle written here (tests/gradcheck.py); the in-place cache
writes refuse a gradient with a clear error."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check


def _graph(name, **shapes):
    g = rlx.Graph(name)
    return g, {k: g.input(k, s) for k, s in shapes.items()}


def test_transpose_vjp(rng):
    x, r = rng.standard_normal((2, 3, 5)), rng.standard_normal((5, 2, 3))
    g, t = _graph("dT", x=x.shape, r=r.shape)
    y = g.reduce_sum(g.transpose(t["x"], (-1, 0, 1)) * t["r"])
    check(g, y, {"x": t["x"]}, {"x": x, "r": r},
          lambda x, r: float((np.transpose(x, (2, 0, 1)) * r).sum()))


@pytest.mark.parametrize("start,length", [(0, 2), (1, 3), (3, 2), (0, 5)])
def test_narrow_vjp(rng, start, length):
    """Slices at the start, the middle, the end, and the whole axis."""
    x, r = rng.standard_normal((3, 5, 2)), rng.standard_normal((3, length, 2))
    g, t = _graph("dN", x=x.shape, r=r.shape)
    y = g.reduce_sum(g.narrow(t["x"], -2, start, length) * t["r"])
    check(g, y, {"x": t["x"]}, {"x": x, "r": r},
          lambda x, r: float((x[:, start:start + length] * r).sum()))


def test_concat_vjp(rng):
    a, b, c = (rng.standard_normal((2, n, 3)) for n in (1, 3, 2))
    r = rng.standard_normal((2, 6, 3))
    g, t = _graph("dC", a=a.shape, b=b.shape, c=c.shape, r=r.shape)
    y = g.reduce_sum(g.concat([t["a"], t["b"], t["c"]], 1) * t["r"])
    check(g, y, {"a": t["a"], "b": t["b"], "c": t["c"]}, {"a": a, "b": b, "c": c, "r": r},
          lambda a, b, c, r: float((np.concatenate([a, b, c], 1) * r).sum()))


def test_expand_vjp(rng):
    """New leading axes and stretched 1-dims are summed back."""
    x, r = rng.standard_normal((3, 1, 5)), rng.standard_normal((2, 3, 4, 5))
    g, t = _graph("dE", x=x.shape, r=r.shape)
    y = g.reduce_sum(g.expand(t["x"], (2, 3, 4, -1)) * t["r"])
    check(g, y, {"x": t["x"]}, {"x": x, "r": r},
          lambda x, r: float((np.broadcast_to(x, r.shape) * r).sum()))


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_vjp_accumulates_repeats(rng, axis):
    """Repeated and negative indices: every gathered copy sends its gradient back."""
    table = rng.standard_normal((5, 4, 3))
    idx = np.array([[1, -1, 1], [0, 2, 1]], np.int64)
    n = table.shape[axis]
    idx = idx % n - (idx < 0) * n        # keep the negatives negative, in range
    shp = table.shape[:axis % 3] + idx.shape + table.shape[axis % 3 + 1:]
    r = rng.standard_normal(shp)
    g, t = _graph("dG", table=table.shape, r=r.shape)
    it = g.input("idx", idx.shape, "i64")
    y = g.reduce_sum(g.gather(t["table"], it, axis) * t["r"])
    check(g, y, {"table": t["table"]}, {"table": table, "r": r, "idx": idx},
          lambda table, r, idx: float((np.take(table, idx, axis) * r).sum()))


def test_gather_vjp_deterministic(rng):
    """grad(..., deterministic=True): the table's gradient sums repeated rows in index order
    (the ordered scatter_add), np.add.at's bits exactly; a bad flag is refused."""
    table = rng.standard_normal((7, 5)).astype(np.float32)
    idx = np.array([3, 1, 3, 3, -1, 0, 3, 6, 1], np.int64)
    seed = rng.standard_normal((9, 5)).astype(np.float32)
    g, t = _graph("dGd", table=table.shape)
    it = g.input("idx", idx.shape, "i64")
    y = g.gather(t["table"], it, 0)
    (d,) = g.grad(y, [t["table"]], seed=g.constant(seed), deterministic=True)
    assert [n.attrs["deterministic"] for n in g.nodes if n.op == "scatter_add"] == [True]
    g.set_outputs([d])
    (got,) = rlx.compile(g).run({"table": table, "idx": idx})
    want = np.zeros_like(table)
    np.add.at(want, idx, seed)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="grad: deterministic must be a bool"):
        g.grad(y, [t["table"]], seed=g.constant(seed), deterministic=1)


def test_gather_vjp_in_graph_indices_i32_and_half_table(rng):
    """Constant i32 indices with a repeat, through an f16 table (scatter in f32, cast back)."""
    table = rng.standard_normal((6, 3)).astype(np.float32)
    g = rlx.Graph("dG16")
    tt = g.input("t", table.shape)
    t16 = g.cast(tt, "f16")
    y = g.reduce_sum(g.cast(g.gather(t16, g.constant(np.array([4, 4, 0], np.int32))), "f32"))
    (d,) = g.grad(y, [tt])
    g.set_outputs([d])
    (got,) = rlx.compile(g).run({"t": table})
    want = np.zeros_like(table)
    np.add.at(want, [4, 4, 0], 1.0)
    np.testing.assert_array_equal(got, want)


def test_scatter_add_vjp(rng):
    target, upd = rng.standard_normal((3, 5)), rng.standard_normal((3, 4))
    idx = np.array([4, 0, 4, -2], np.int64)
    r = rng.standard_normal((3, 5))
    g, t = _graph("dS", target=target.shape, upd=upd.shape, r=r.shape)
    it = g.input("idx", idx.shape, "i64")
    y = g.reduce_sum(g.scatter_add(t["target"], it, t["upd"], axis=1) * t["r"])

    def oracle(target, upd, r, idx):
        out = target.copy()
        np.add.at(out, (slice(None), idx % 5), upd)
        return float((out * r).sum())
    check(g, y, {"target": t["target"], "upd": t["upd"]},
          {"target": target, "upd": upd, "r": r, "idx": idx}, oracle)


# ---- rope ---------------------------------------------------------------------------------------
def _rope_np(x, cos, sin, nr, inter, pos):
    """pos: [S] or [B, S] positions. NumPy rotation of the first nr dims."""
    half = nr // 2
    c = cos[pos]                        # [S, half] or [B, S, half]
    s = sin[pos]
    if x.ndim == 4 and c.ndim == 3:
        c, s = c[:, None], s[:, None]
    out = x.copy()
    if inter:
        x0, x1 = x[..., 0:nr:2], x[..., 1:nr:2]
        out[..., 0:nr:2] = x0 * c - x1 * s
        out[..., 1:nr:2] = x1 * c + x0 * s
    else:
        x0, x1 = x[..., :half], x[..., half:nr]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:nr] = x1 * c + x0 * s
    return out


@pytest.mark.parametrize("inter", [False, True])
@pytest.mark.parametrize("nr,off", [(6, 0), (4, 2)])
def test_rope_vjp_offset(rng, inter, nr, off):
    """x, cos and sin all get gradients; partial rotation (n_rot < D) passes the rest."""
    b, h, s, d, max_pos = 2, 2, 3, 6, 7
    x = rng.standard_normal((b, h, s, d))
    cos, sin = rng.standard_normal((max_pos, nr // 2)), rng.standard_normal((max_pos, nr // 2))
    r = rng.standard_normal(x.shape)
    g, t = _graph("dR", x=x.shape, cos=cos.shape, sin=sin.shape, r=r.shape)
    y = g.reduce_sum(g.rope(t["x"], t["cos"], t["sin"], n_rot=nr, interleaved=inter,
                            position_offset=off) * t["r"])
    pos = np.arange(off, off + s)
    check(g, y, {"x": t["x"], "cos": t["cos"], "sin": t["sin"]},
          {"x": x, "cos": cos, "sin": sin, "r": r},
          lambda x, cos, sin, r: float((_rope_np(x, cos, sin, nr, inter, pos) * r).sum()))


@pytest.mark.parametrize("per_row", [False, True])
def test_rope_vjp_positions(rng, per_row):
    """positions [S] or [B, S] (repeats accumulate into the same table row); 3-D x."""
    b, s, d, max_pos = 2, 4, 4, 5
    x = rng.standard_normal((b, s, d))
    cos, sin = rng.standard_normal((max_pos, 2)), rng.standard_normal((max_pos, 2))
    pos = np.array([[3, 0, 3, 1], [4, 4, 2, 0]] if per_row else [2, 0, 2, 4], np.int32)
    r = rng.standard_normal(x.shape)
    g, t = _graph("dRp", x=x.shape, cos=cos.shape, sin=sin.shape, r=r.shape)
    pt = g.input("pos", pos.shape, "i32")
    y = g.reduce_sum(g.rope(t["x"], t["cos"], t["sin"], positions=pt) * t["r"])
    check(g, y, {"x": t["x"], "cos": t["cos"], "sin": t["sin"]},
          {"x": x, "cos": cos, "sin": sin, "r": r, "pos": pos},
          lambda x, cos, sin, r, pos: float((_rope_np(x, cos, sin, d, False, pos) * r).sum()))


def test_topk_values_vjp(rng):
    x = rng.permutation(30).reshape(3, 2, 5).astype(np.float64) * 0.1   # distinct: no ties
    r = rng.standard_normal((2, 2, 5))
    g, t = _graph("dK", x=(3, 2, 5), r=(2, 2, 5))
    vals, _ = g.topk(t["x"], 2, axis=0)
    y = g.reduce_sum(vals * t["r"])
    check(g, y, {"x": t["x"]}, {"x": x, "r": r},
          lambda x, r: float((-np.sort(-x, axis=0)[:2] * r).sum()))


def test_kv_write_refuses_gradient():
    g = rlx.Graph("kv")
    cache = g.param("c", (1, 1, 4, 2))
    new = g.input("n", (1, 1, 1, 2))
    y = g.reduce_sum(g.kv_write(cache, new * 2.0, 0))
    with pytest.raises(ValueError, match="kv_write .* has no gradient: it writes a KV cache"):
        g.grad(y, [new])


def test_rope_kv_write_refuses_gradient():
    g = rlx.Graph("rkv")
    qkv = g.input("qkv", (1, 2, 12))
    cos, sin = g.constant(np.ones((4, 2), np.float32)), g.constant(np.zeros((4, 2), np.float32))
    kc, vc = g.param("k", (1, 1, 4, 4)), g.param("v", (1, 1, 4, 4))
    q, k, v = g.rope_kv_write(qkv, cos, sin, kc, vc, 0, num_heads=1, num_kv_heads=1)
    with pytest.raises(ValueError, match="rope_kv_write .* has no gradient"):
        g.grad(g.reduce_sum(q), [qkv])


def test_rope_vjp_constant_tables(rng):
    """The usual constant cos / sin tables: only dx is built (no table gradient nodes)."""
    x, r = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((1, 2, 3, 4))
    ang = np.arange(5)[:, None] * np.array([1.0, 0.1])
    g, t = _graph("dRc", x=x.shape, r=r.shape)
    cos = g.constant(np.cos(ang).astype(np.float32))
    sin = g.constant(np.sin(ang).astype(np.float32))
    y = g.reduce_sum(g.rope(t["x"], cos, sin, interleaved=True, position_offset=1) * t["r"])
    before = len(g.nodes)
    check(g, y, {"x": t["x"]}, {"x": x, "r": r},
          lambda x, r: float((_rope_np(x, np.cos(ang), np.sin(ang), 4, True, np.arange(1, 4))
                              * r).sum()))
    assert not any(n.op == "scatter_add" or n.op == "concat" for n in g.nodes[before:])
