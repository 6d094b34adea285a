"""g.cond, g.while_loop and g.scan (ir/ops_control.py) against NumPy loops written here, their
gradients against finite differences, in stream / graph / eager modes, and their errors
(a body that captures an outer tensor, mismatched branches and carries)."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check

T, B, H, I = 5, 2, 3, 4


def rnn_np(xs, h0, W, U, b, reverse=False):
    h, ys = h0, [None] * len(xs)
    for t in (range(len(xs) - 1, -1, -1) if reverse else range(len(xs))):
        h = np.tanh(h @ W + xs[t] @ U + b)
        ys[t] = h
    return h, np.stack(ys)


def cell(sub, h, w, u, b, x):
    hn = sub.activation("tanh", sub.matmul(h, w) + sub.matmul(x, u) + b)
    return [hn, w, u, b], [hn]


def rnn_graph(reverse=False):
    g = rlx.Graph()
    ts = {k: g.input(k, s) for k, s in (("xs", (T, B, I)), ("h0", (B, H)), ("W", (H, H)),
                                        ("U", (I, H)), ("b", (H,)))}
    (h, *_), (ys,) = g.scan(cell, [ts["h0"], ts["W"], ts["U"], ts["b"]], [ts["xs"]],
                            reverse=reverse)
    return g, ts, h, ys


def feed(rng):
    return {"xs": rng.standard_normal((T, B, I)), "h0": rng.standard_normal((B, H)),
            "W": 0.5 * rng.standard_normal((H, H)), "U": 0.5 * rng.standard_normal((I, H)),
            "b": rng.standard_normal(H)}


@pytest.mark.parametrize("mode", ["stream", "graph", "eager"])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_rnn_matches_numpy_loop(rng, mode, reverse):
    g, _, h, ys = rnn_graph(reverse)
    g.set_outputs([h, ys])
    exe = rlx.compile(g, exec_mode=mode)
    for _ in range(2):                      # inputs changed between runs
        f = feed(rng)
        got_h, got_ys = exe.run({k: v.astype(np.float32) for k, v in f.items()})
        want_h, want_ys = rnn_np(f["xs"], f["h0"], f["W"], f["U"], f["b"], reverse)
        np.testing.assert_allclose(got_h, want_h, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got_ys, want_ys, rtol=1e-5, atol=1e-5)


def test_scan_gradients(rng):
    """Through every step: the carries the unrolled scan saves, the weights passed through."""
    g, ts, _, ys = rnn_graph()
    check(g, ys, {k: ts[k] for k in ("h0", "W", "U", "xs")}, feed(rng),
          lambda xs, h0, W, U, b: rnn_np(xs, h0, W, U, b)[1], seed=rng.standard_normal((T, B, H)))


def test_scan_without_xs_and_empty():
    """length with no xs (a counter), and length 0 (init back, ys empty)."""
    g = rlx.Graph()
    c = g.input("c", (2,))
    (last,), (ys,) = g.scan(lambda s, c: ([c * 2.0], [c + 1.0]), [c], [], length=3)
    (same,), (none,) = g.scan(lambda s, c: ([c * 2.0], [c + 1.0]), [c], [], length=0)
    g.set_outputs([last, ys, same, none])
    cv = np.array([1.0, -0.5], np.float32)
    got = rlx.compile(g).run({"c": cv})
    np.testing.assert_allclose(got[0], cv * 8)
    np.testing.assert_allclose(got[1], np.stack([cv + 1, 2 * cv + 1, 4 * cv + 1]))
    np.testing.assert_allclose(got[2], cv)
    assert got[3].shape == (0, 2)


def halve_np(x, n, limit):
    while x > 1.0 and n < limit:
        x, n = x * 0.5, n + 1.0
    return x, n


@pytest.mark.parametrize("mode", ["stream", "graph"])
def test_while_loop_matches_python_loop(mode):
    """Trip counts that vary with the input, and one that hits max_iterations."""
    g = rlx.Graph()
    x, n = g.input("x", ()), g.input("n", ())
    out = g.while_loop(lambda s, x, n: x > 1.0, lambda s, x, n: [x * 0.5, n + 1.0], [x, n], 6)
    g.set_outputs(out)
    exe = rlx.compile(g, exec_mode=mode)
    for x0 in (0.5, 1.0, 13.0, 40.0, 1000.0):
        got = exe.run({"x": np.array(x0, np.float32), "n": np.array(0.0, np.float32)})
        want = halve_np(x0, 0.0, 6)
        assert (float(got[0]), float(got[1])) == want, x0


def test_while_loop_gradient(rng):
    """d/dx of x * 0.9 ** (trips) through the masked unroll, the trip count fixed by a."""
    g = rlx.Graph()
    x, a = g.input("x", (3,)), g.input("a", ())
    out = g.while_loop(lambda s, x, a: a > 0.0, lambda s, x, a: [x * 0.9 + 0.1, a - 1.0],
                       [x, a], 5)

    def oracle(x, a):
        for _ in range(5):
            if a > 0:
                x, a = x * 0.9 + 0.1, a - 1
        return x
    check(g, out[0], {"x": x}, {"x": rng.standard_normal(3), "a": np.array(3.0)}, oracle,
          seed=rng.standard_normal(3))


@pytest.mark.parametrize("pred", [True, False])
def test_cond_and_its_gradient(rng, pred):
    g = rlx.Graph()
    p, a, b = g.input("p", (), "bool"), g.input("a", (3,)), g.input("b", (3,))
    (y,) = g.cond(p, lambda s, a, b: [a * b], lambda s, a, b: [a - s.activation("exp", b)],
                  [a, b])
    f = {"a": rng.standard_normal(3), "b": rng.standard_normal(3), "p": np.array(pred)}
    check(g, y, {"a": a, "b": b}, f, lambda a, b, p: a * b if p else a - np.exp(b),
          seed=rng.standard_normal(3))


@pytest.mark.parametrize("build,match", [
    (lambda g, x, w: g.scan(lambda s, h: ([s.matmul(h, w)], []), [x], [], length=2),
     r"scan: fn uses a tensor of another graph .*pass the tensor in as one"),
    (lambda g, x, w: g.scan(lambda s, h: ([s.reduce_sum(h, [1])], []), [x], [], length=2),
     r"scan: fn's new carry \[f32 \[2\]\] differs from init \[f32 \[2, 2\]\]"),
    (lambda g, x, w: g.scan(lambda s, h, t: ([h], []), [x], [w, x]),
     r"scan: xs disagree on the leading axis"),
    (lambda g, x, w: g.scan(lambda s, h: ([h], []), [x], []), r"scan: length is needed"),
    (lambda g, x, w: g.scan(lambda s, h: [h], [x], [], length=1),
     r"scan: fn must return \(new_carry list, ys list\)"),
    (lambda g, x, w: g.scan(lambda s, h: ([h, h], []), [x], [], length=1),
     r"scan: fn returned 2 carries, init has 1"),
    (lambda g, x, w: g.scan(lambda s, h: ([h + s.param("q", (2, 2))], []), [x], [], length=1),
     r"scan: fn creates param 'q'"),
    (lambda g, x, w: g.cond(x, lambda s, a: [a], lambda s, a: [a], [x]),
     r"cond: pred must be a bool \(\) tensor, got f32 \[2, 2\]"),
    (lambda g, x, w: g.cond(g.input("p", (), "bool"), lambda s, a: [a],
                            lambda s, a: [s.reduce_sum(a, [0])], [x]),
     r"cond: true_fn returns \[f32 \[2, 2\]\] but false_fn returns \[f32 \[2\]\]"),
    (lambda g, x, w: g.while_loop(lambda s, a: a, lambda s, a: [a], [x], 3),
     r"while_loop: cond_fn must return one bool \(\) tensor, got \[f32 \[2, 2\]\]"),
    (lambda g, x, w: g.while_loop(lambda s, a: s.reduce_sum(a) > 0.0, lambda s, a: [a, a], [x], 3),
     r"while_loop: body_fn returns \[f32 \[2, 2\], f32 \[2, 2\]\] but the carry is \[f32 \[2, 2\]\]"),
    (lambda g, x, w: g.while_loop(lambda s, a: s.reduce_sum(a) > 0.0, lambda s, a: [a], [x], -1),
     r"while_loop: max_iterations must be a non-negative int, got -1"),
    (lambda g, x, w: g.while_loop(lambda s, a: s.reduce_sum(a) > 0.0, "f", [x], 2),
     r"while_loop: body_fn must be a callable"),
])
def test_errors(build, match):
    g = rlx.Graph()
    x, w = g.input("x", (2, 2)), g.input("w", (3, 2))
    with pytest.raises(ValueError, match=match):
        build(g, x, w)


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_scan_in_half_precision(rng, dtype):
    """The RNN scan with half inputs: each step's carry is a half tensor, so the oracle rounds
    h to the half type after every step and computes the step in float64 from it; the kernels'
    f32 math and the roundings of the step's half nodes stay within a few u of that."""
    from halfref import assert_half_close, rounded
    g = rlx.Graph()
    ts = {k: g.input(k, s, dtype) for k, s in (("xs", (T, B, I)), ("h0", (B, H)),
                                              ("W", (H, H)), ("U", (I, H)), ("b", (H,)))}
    (h, *_), (ys,) = g.scan(cell, [ts["h0"], ts["W"], ts["U"], ts["b"]], [ts["xs"]])
    g.set_outputs([h, ys])
    f = {k: rounded(v, dtype) for k, v in feed(rng).items()}
    got_h, got_ys = rlx.compile(g).run(f)
    x64 = {k: v.astype(np.float64) for k, v in f.items()}
    hh, want, pre = x64["h0"], [], 0.0
    for t in range(T):
        z = hh @ x64["W"] + x64["xs"][t] @ x64["U"] + x64["b"]
        pre = max(pre, np.abs(hh @ x64["W"]).max(), np.abs(z).max())
        hh = rounded(np.tanh(z), dtype).astype(np.float64)
        want.append(hh)
    # the products and their sum are half nodes too: their roundings are u of the
    # pre-activation's size, which tanh passes on with a slope <= 1
    assert_half_close(got_ys, np.stack(want), dtype, k=4.0, scale=pre)
    assert_half_close(got_h, want[-1], dtype, k=4.0, scale=pre)
