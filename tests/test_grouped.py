"""grouped_matmul (mixture-of-experts products) and lora_matmul against NumPy oracles written
here (a Python loop over the rows), their gradients against NumPy closed forms and finite
differences, the routing's edge cases (unused and repeated experts, unsorted ids, an expert
spanning several row tiles, ids changing between runs, out-of-range ids) and the argument
errors."""
import numpy as np
import pytest
from numba import cuda

import rlx_numba as rlx
from rlx_numba.kernels import grouped as G
from gradcheck import check

M, K, N, E = 13, 19, 11, 5
# unsorted; expert 1 unused, expert 3 on 9 of the 13 rows (more than a simulator row tile)
IDS = np.array([4, 0, 3, 3, 3, 3, 3, 2, 3, 3, 4, 3, 3])


def grouped_oracle(x, w, ids):
    x, w = x.astype(np.float64), w.astype(np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    for i in range(x.shape[0]):
        out[i] = x[i] @ w[ids[i]]
    return out


def grouped_grad_oracle(x, w, ids, dy):
    """dx[i] = dy[i] @ w[e_i]^T; dw[e] = sum over the rows i of e of outer(x[i], dy[i])."""
    x, w, dy = x.astype(np.float64), w.astype(np.float64), dy.astype(np.float64)
    dx, dw = np.zeros(x.shape), np.zeros(w.shape)
    for i in range(x.shape[0]):
        dx[i] = dy[i] @ w[ids[i]].T
        dw[ids[i]] += np.outer(x[i], dy[i])
    return dx, dw


def _close(got, want, tol=1e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


def _data(rng, m=M, k=K, n=N, e=E):
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((e, k, n)).astype(np.float32))


@pytest.mark.parametrize("id_dtype", ["i32", "i64"])
def test_grouped_matmul_forward_and_grad(rng, id_dtype):
    """w a param; ids fed to run(); dx and dw (the unused expert's is zero) and a second run
    of the same executable giving the same bits (no atomics anywhere)."""
    x, w = _data(rng)
    ids = IDS.astype(np.int32 if id_dtype == "i32" else np.int64)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    g = rlx.Graph("moe")
    xt, wt = g.input("x", x.shape), g.param("w", w.shape)
    it = g.input("ids", ids.shape, id_dtype)
    y = g.grouped_matmul(xt, wt, it)
    assert y.shape == (M, N) and str(y.dtype) == "f32"
    dx, dw = g.grad(y, [xt, wt], seed=g.constant(dy))
    g.set_outputs([y, dx, dw])
    exe = rlx.compile(g)
    exe.set_param("w", w)
    got = exe.run({"x": x, "ids": ids})
    want_dx, want_dw = grouped_grad_oracle(x, w, ids, dy)
    _close(got[0], grouped_oracle(x, w, ids))
    _close(got[1], want_dx)
    _close(got[2], want_dw)
    assert np.all(got[2][1] == 0)
    for a, b in zip(got, exe.run({"x": x, "ids": ids})):
        np.testing.assert_array_equal(a, b)


def test_grouped_matmul_ids_change_between_runs(rng):
    """The routing runs on the device every run (nothing baked at compile time, no host
    sync: GRAPH mode can capture it): different ids, then fewer row tiles than before, then
    every row on the expert that was unused."""
    x, w = _data(rng)
    g = rlx.Graph("moe_runs")
    it = g.input("ids", (M,), "i64")
    g.set_outputs([g.grouped_matmul(g.input("x", x.shape), g.param("w", w.shape), it)])
    exe = rlx.compile(g, exec_mode="graph")
    exe.set_param("w", w)
    for ids in (IDS, rng.integers(0, E, M), np.full(M, 1)):
        (y,) = exe.run({"x": x, "ids": ids})
        _close(y, grouped_oracle(x, w, ids))


def test_grouped_matmul_computed_weight_half_x_and_finite_differences(rng):
    """w computed in the graph (any tensor, not only a param), x fed as f16; gradients of a
    scalar loss against finite differences of the float64 oracle (2 experts, one unused)."""
    m, k, n, e = 6, 5, 3, 3
    x = rng.standard_normal((m, k))
    w = rng.standard_normal((e, k, n))
    ids = np.array([2, 0, 2, 2, 0, 2])
    g = rlx.Graph("moe_fd")
    xt, wt = g.input("x", x.shape), g.input("w", w.shape)
    loss = g.reduce_sum(g.tanh(g.grouped_matmul(xt, wt * 2.0, g.input("ids", (m,), "i64"))))
    check(g, loss, {"x": xt, "w": wt}, {"x": x, "w": w, "ids": ids},
          lambda x, w, ids: np.tanh(grouped_oracle(x, 2 * w, ids)).sum())

    xh = rng.standard_normal((m, k)).astype(np.float16)
    g = rlx.Graph("moe_half")
    g.set_outputs([g.grouped_matmul(g.input("x", x.shape, "f16"), g.constant(w), g.constant(ids))])
    (y,) = rlx.compile(g).run({"x": xh})
    _close(y, grouped_oracle(xh.astype(np.float64), w.astype(np.float32), ids))


def test_grouped_matmul_second_order(rng):
    """The weight gradient's own VJP: L2 = sum(dw * C) with dw = d sum(y * s) / dw, so
    dL2/dx[i] = C[e_i] @ s[i] and dL2/ds[i] = C[e_i]^T x[i]."""
    x, w = _data(rng)
    s = rng.standard_normal((M, N)).astype(np.float32)
    c = rng.standard_normal((E, K, N)).astype(np.float32)
    g = rlx.Graph("moe2")
    xt, st, wt = g.input("x", x.shape), g.input("s", s.shape), g.input("w", w.shape)
    (dw,) = g.grad(g.reduce_sum(g.grouped_matmul(xt, wt, g.constant(IDS)) * st), [wt])
    dx2, ds2 = g.grad(g.reduce_sum(dw * g.constant(c)), [xt, st])
    g.set_outputs([dw, dx2, ds2])
    got = rlx.compile(g).run({"x": x, "s": s, "w": w})
    _close(got[0], grouped_grad_oracle(x, w, IDS, s)[1])
    _close(got[1], np.stack([c[e].astype(np.float64) @ s[i] for i, e in enumerate(IDS)]))
    _close(got[2], np.stack([c[e].astype(np.float64).T @ x[i] for i, e in enumerate(IDS)]))


def test_grouped_matmul_out_of_range_ids(rng):
    """Host-array ids outside [0, E): IndexError from run(); device-array ids are not
    checked (that would need a sync): the kernels write nothing out of bounds and those rows
    come out as zeros, the others as usual, and the weight gradient skips them."""
    x, w = _data(rng)
    dy = rng.standard_normal((M, N)).astype(np.float32)
    g = rlx.Graph("moe_bad")
    xt, wt, it = g.input("x", x.shape), g.input("w", w.shape), g.input("ids", (M,), "i32")
    y = g.grouped_matmul(xt, wt, it)
    (dw,) = g.grad(y, [wt], seed=g.constant(dy))
    g.set_outputs([y, dw])
    exe = rlx.compile(g)
    bad = IDS.astype(np.int32)
    bad[[2, 7]] = [E, -1]
    with pytest.raises(IndexError, match=r"grouped_matmul %\d+ \(expert_ids of 5 experts\): "
                       r"input 'ids' holds index 5 at \[2\], out of range \[0, 4\]"):
        exe.run({"x": x, "w": w, "ids": bad})
    _close(exe.run({"x": x, "w": w, "ids": IDS.astype(np.int32)})[0], grouped_oracle(x, w, IDS))
    y, dw = exe.run({"x": x, "w": w, "ids": cuda.to_device(bad)})    # (the rows held values)
    ok = np.ones(M, bool)
    ok[[2, 7]] = False
    want = grouped_oracle(x, w, np.where(ok, bad, 0))
    want[~ok] = 0
    _close(y, want)
    _close(dw, grouped_grad_oracle(x[ok], w, bad[ok], dy[ok])[1])


def test_grouped_matmul_no_rows_and_no_k(rng):
    """K = 0: every row is zeros; M = 0: an empty output and a zero weight gradient."""
    g = rlx.Graph("moe_empty")
    ids = g.constant(np.array([1, 0, 1]))
    y0 = g.grouped_matmul(g.constant(np.zeros((3, 0), np.float32)),
                          g.constant(np.zeros((2, 0, 4), np.float32)), ids)
    xt, wt = g.input("x", (0, 3)), g.input("w", (2, 3, 4))
    y1 = g.grouped_matmul(xt, wt, g.constant(np.zeros(0, np.int64)))
    (dw,) = g.grad(g.reduce_sum(y1), [wt])
    g.set_outputs([y0, y1, dw])
    got = rlx.compile(g).run({"x": np.zeros((0, 3), np.float32),
                              "w": rng.standard_normal((2, 3, 4)).astype(np.float32)})
    np.testing.assert_array_equal(got[0], np.zeros((3, 4)))
    assert got[1].shape == (0, 4)
    np.testing.assert_array_equal(got[2], np.zeros((2, 3, 4)))


def test_route_kernel_is_a_stable_padded_counting_sort(rng):
    """The routing tables against NumPy's stable argsort: more experts than the routing
    block has threads (its scan carries across chunks of experts), several chunks of rows,
    unused experts, and an out-of-range id (routed nowhere, its output row zeroed)."""
    m, e, n_out = 40, G.ROUTE_T + 4, 3
    ids = rng.integers(0, e - 6, m).astype(np.int32)    # the last 6 experts unused
    ids[5] = e
    nchunks, ch, max_tiles = G.route_plan(m, e)
    assert nchunks > 1
    bufs = [cuda.to_device(np.zeros(size, np.int32))
            for size in (nchunks * e, e + 1, e, max_tiles, max_tiles * G.BM)]
    out = cuda.to_device(np.ones(m * n_out, np.float32))
    G.route_kernel[(1,), (G.ROUTE_T,)](cuda.to_device(ids), m, e, ch, nchunks, *bufs, out, n_out)
    _, start, count, tile_expert, rows = (b.copy_to_host() for b in bufs)
    np.testing.assert_array_equal(count, np.bincount(ids[ids < e], minlength=e))
    padded = -(-count // G.BM) * G.BM
    np.testing.assert_array_equal(start, np.concatenate([[0], np.cumsum(padded)]))
    assert start[e] // G.BM <= max_tiles
    for x in range(e):
        seg = rows[start[x]:start[x] + padded[x]]
        np.testing.assert_array_equal(seg[:count[x]], np.flatnonzero(ids == x))   # row order
        assert np.all(seg[count[x]:] == -1)
        assert np.all(tile_expert[start[x] // G.BM:start[x + 1] // G.BM] == x)
    want_out = np.ones((m, n_out))
    want_out[5] = 0
    np.testing.assert_array_equal(out.copy_to_host().reshape(m, n_out), want_out)


def test_grouped_matmul_errors():
    g = rlx.Graph("moe_err")
    x, w, ids = g.input("x", (4, 6)), g.param("w", (3, 6, 5)), g.input("ids", (4,), "i32")
    cases = [
        ((g.input("x3", (2, 2, 6)), w, ids), r"grouped_matmul: x must be 2-D \[M, K\], got "
                                             r"f32 \[2, 2, 6\]"),
        ((x, g.param("w2", (6, 5)), ids), r"grouped_matmul: w must be 3-D \[E, K, N\].*got "
                                          r"f32 \[6, 5\]"),
        ((x, g.param("w7", (3, 7, 5)), ids), r"grouped_matmul: x \[4, 6\] has K=6 but w "
                                             r"\[3, 7, 5\] has K=7"),
        ((x, w, g.input("i5", (5,), "i32")), r"grouped_matmul: expert_ids must be \[4\] "
                                             r"\(one expert a row of x \[4, 6\]\), got \[5\]"),
        ((x, w, g.input("i2", (4, 1), "i64")), r"expert_ids must be \[4\] .*got \[4, 1\]"),
        ((x, w, g.input("if", (4,), "f32")), r"grouped_matmul: expert_ids must be i32 or i64, "
                                             r"got f32 \[4\]"),
        ((g.input("xi", (4, 6), "i32"), w, ids), r"grouped_matmul: x must be a float tensor, "
                                                 r"got i32 \[4, 6\]"),
        ((x, g.param("wi", (3, 6, 5), "i64"), ids), r"grouped_matmul: w must be a float "
                                                    r"tensor, got i64 \[3, 6, 5\]"),
        ((x, g.param("w0", (0, 6, 5)), ids), r"grouped_matmul: w \[0, 6, 5\] has no experts"),
        ((x, np.zeros((3, 6, 5)), ids), r"grouped_matmul: w must be a Tensor of this graph, "
                                        r"got ndarray"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            g.grouped_matmul(*args)


def lora_oracle(x, w, a, b, scale):
    return x @ w + scale * (x @ a) @ b


def test_lora_matmul_forward_and_grad(rng):
    """x [2, 3, K] (leading dims), every operand differentiated against finite differences;
    built from linear nodes (the matmul tiers, the residual fold)."""
    k, n, r, scale = 7, 5, 2, 0.75
    feed = {"x": rng.standard_normal((2, 3, k)), "w": rng.standard_normal((k, n)),
            "a": rng.standard_normal((k, r)), "b": rng.standard_normal((r, n))}
    g = rlx.Graph("lora")
    ts = {name: g.input(name, v.shape) for name, v in feed.items()}
    y = g.lora_matmul(ts["x"], ts["w"], ts["a"], ts["b"], scale)
    assert y.shape == (2, 3, n)
    assert [nd.op for nd in g.nodes].count("linear") == 3
    seed = rng.standard_normal(y.shape)
    check(g, y, ts, feed, lambda x, w, a, b: lora_oracle(x, w, a, b, scale), seed=seed)
    g = rlx.Graph("lora_fwd")      # the forward alone, a 1-D x and params
    x1 = rng.standard_normal(k).astype(np.float32)
    names = ("w", "a", "b")
    g.set_outputs([g.lora_matmul(g.input("x", (k,)), *(g.param(s, feed[s].shape) for s in names),
                                 -2)])
    exe = rlx.compile(g)
    for s in names:
        exe.set_param(s, feed[s].astype(np.float32))
    (y1,) = exe.run({"x": x1})
    _close(y1, lora_oracle(x1.astype(np.float64), feed["w"], feed["a"], feed["b"], -2.0))


def test_lora_matmul_errors():
    g = rlx.Graph("lora_err")
    x, w = g.input("x", (3, 6)), g.param("w", (6, 4))
    a, b = g.param("a", (6, 2)), g.param("b", (2, 4))
    cases = [
        ((x, g.param("w3", (1, 6, 4)), a, b, 1.0), r"lora_matmul: w must be 2-D \[K, N\], got "
                                                   r"f32 \[1, 6, 4\]"),
        ((x, g.param("w5", (5, 4)), a, b, 1.0), r"lora_matmul: x \[3, 6\] has K=6 but w "
                                                r"\[5, 4\] has K=5"),
        ((x, w, g.param("a5", (5, 2)), b, 1.0), r"lora_matmul: a must be \[K=6, r\] to match "
                                                r"w \[6, 4\], got \[5, 2\]"),
        ((x, w, a, g.param("b3", (3, 4)), 1.0), r"lora_matmul: b must be \[r=2, N=4\] to match "
                                                r"a \[6, 2\] and w \[6, 4\], got \[3, 4\]"),
        ((x, w, a, g.param("b1", (4,)), 1.0), r"lora_matmul: b must be 2-D \[r, N\], got "
                                              r"f32 \[4\]"),
        ((x, w, a, b, "2"), r"lora_matmul: scale must be a Python number, got '2'"),
        ((x, w, a, b, True), r"lora_matmul: scale must be a Python number, got True"),
        ((g.input("xi", (3, 6), "i64"), w, a, b, 1.0), r"lora_matmul: x must be a float "
                                                       r"tensor, got i64 \[3, 6\]"),
        ((g.input("x0", (), "f32"), w, a, b, 1.0), r"lora_matmul: x must be \[\.\.\., K\], "
                                                   r"got a scalar f32 \[\]"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            g.lora_matmul(*args)
