"""cross_entropy against a NumPy oracle of torch's rule (every attribute, ignored rows, label
smoothing) and its gradient against finite differences; dropout and random against the NumPy
twin of the Philox stream (kernels/random.py, itself checked on Random123's known answers),
their statistics, dropout's gradient, and the argument errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check
from rlx_numba.kernels import random as R


def ce_oracle(x, y, reduction="mean", ignore_index=-100, label_smoothing=0.0):
    """torch.nn.functional.cross_entropy (class indices, classes last), float64: the nll of
    log_softmax plus the label_smoothing term, both masked at ignored rows; mean divides by
    the number of rows not ignored."""
    c = x.shape[-1]
    mx = x.max(-1, keepdims=True)
    logp = x - (mx + np.log(np.exp(x - mx).sum(-1, keepdims=True)))
    keep = y != ignore_index
    nll = -np.take_along_axis(logp, np.where(keep, y, 0)[..., None].astype(np.int64), -1)[..., 0]
    smooth = -logp.sum(-1)
    nll, smooth = np.where(keep, nll, 0.0), np.where(keep, smooth, 0.0)
    eps = label_smoothing
    if eps == 0:                        # torch skips the term (-inf logits make it inf)
        smooth = np.zeros_like(smooth)
    if reduction == "none":
        return (1 - eps) * nll + eps / c * smooth
    if reduction == "sum":
        return (1 - eps) * nll.sum() + eps / c * smooth.sum()
    with np.errstate(invalid="ignore"):
        return ((1 - eps) * nll.sum() + eps / c * smooth.sum()) / keep.sum()


def _labels(rng, shape, c, ignore=-100, n_ignored=1):
    y = rng.integers(0, c, shape)
    flat = y.reshape(-1)
    flat[rng.choice(flat.size, n_ignored, replace=False)] = ignore
    return y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("eps", [0.0, 0.25])
def test_cross_entropy_forward_and_grad(rng, reduction, eps):
    x = rng.standard_normal((5, 7)) * 2
    y = _labels(rng, (5,), 7)
    g = rlx.Graph("ce")
    xt, yt = g.input("x", x.shape), g.input("y", y.shape, "i64")
    loss = g.cross_entropy(xt, yt, reduction=reduction, label_smoothing=eps)
    seed = rng.standard_normal((5,)) if reduction == "none" else None
    got = check(g, loss, {"x": xt}, {"x": x, "y": y},
                lambda x, y: ce_oracle(x, y, reduction, -100, eps), seed=seed)
    assert got[0].shape == (() if reduction != "none" else (5,))
    np.testing.assert_allclose(got[0], ce_oracle(x, y, reduction, -100, eps), rtol=1e-5,
                               atol=1e-6)
    ignored = y == -100
    assert np.all(got[1][ignored] == 0)       # ignored rows get no gradient


@pytest.mark.parametrize("dtype", ["i32", "i64"])
def test_cross_entropy_leading_dims_custom_ignore(rng, dtype):
    """logits [B, S, C] with labels [B, S]; ignore_index a valid class (those rows are
    skipped all the same), smoothing and mean over the rows that count."""
    x = rng.standard_normal((2, 3, 5))
    y = _labels(rng, (2, 3), 5, ignore=2, n_ignored=2).astype({"i32": np.int32, "i64": np.int64}[dtype])
    g = rlx.Graph("ce3")
    xt, yt = g.input("x", x.shape), g.input("y", y.shape, dtype)
    loss = g.cross_entropy(xt, yt, ignore_index=2, label_smoothing=0.1)
    check(g, loss, {"x": xt}, {"x": x, "y": y},
          lambda x, y: ce_oracle(x, y, "mean", 2, 0.1))


def test_cross_entropy_long_rows_and_masked_logits(rng):
    """A row longer than a block (several columns a thread) with -inf logits (masked
    classes) stays finite; the gradient there is 0."""
    x = rng.standard_normal((3, 41)).astype(np.float32)
    x[:, 5:9] = -np.inf
    y = np.array([0, 40, 12])
    g = rlx.Graph("celong")
    xt, yt = g.input("x", x.shape), g.input("y", y.shape, "i64")
    loss = g.cross_entropy(xt, yt, reduction="sum", label_smoothing=0.0)
    g.set_outputs([loss, g.grad(loss, xt)])
    got, dx = rlx.compile(g).run({"x": x, "y": y})
    assert np.isfinite(got)
    np.testing.assert_allclose(got, ce_oracle(x.astype(np.float64), y, "sum"), rtol=1e-5)
    xs = np.exp(x - x.max(-1, keepdims=True))
    want = xs / xs.sum(-1, keepdims=True)
    want[np.arange(3), y] -= 1
    np.testing.assert_allclose(dx, want, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered")    # the simulator's 0 / 0
def test_cross_entropy_single_row_and_all_ignored():
    """logits [C] with a scalar label; mean over no counted row is NaN (as torch)."""
    x = np.array([0.5, -1.0, 2.0], np.float32)
    g = rlx.Graph("ce1")
    xt, yt = g.input("x", (3,)), g.input("y", (), "i32")
    g.set_outputs([g.cross_entropy(xt, yt), g.cross_entropy(xt, yt, reduction="none")])
    exe = rlx.compile(g)
    mean, none = exe.run({"x": x, "y": np.array(2, np.int32)})
    np.testing.assert_allclose(mean, ce_oracle(x.astype(np.float64), np.array(2)), rtol=1e-6)
    assert none.shape == () and mean.shape == ()
    mean, none = exe.run({"x": x, "y": np.array(-100, np.int32)})
    assert np.isnan(mean) and none == 0


def test_cross_entropy_bad_labels():
    """A label outside [0, C) is a NaN row in the graph; fed from the host, IndexError."""
    x = np.zeros((2, 4), np.float32)
    g = rlx.Graph("cebad")
    xt = g.input("x", x.shape)
    bad = g.constant(np.array([1, 4], np.int64))
    g.set_outputs([g.cross_entropy(xt, bad, reduction="none")])
    out = rlx.compile(g).run({"x": x})[0]
    assert out[0] == pytest.approx(np.log(4)) and np.isnan(out[1])
    g = rlx.Graph("cebad2")
    xt, yt = g.input("x", x.shape), g.input("y", (2,), "i64")
    g.set_outputs([g.cross_entropy(xt, yt)])
    with pytest.raises(IndexError, match="cross_entropy .* holds index 4"):
        rlx.compile(g).run({"x": x, "y": np.array([0, 4])})


def test_cross_entropy_errors():
    g = rlx.Graph("ceerr")
    x, y = g.input("x", (4, 3)), g.input("y", (4,), "i64")
    with pytest.raises(ValueError, match="cross_entropy: labels must be class indices, i32 or i64, "
                                         "got f32"):
        g.cross_entropy(x, g.input("yf", (4,)))
    with pytest.raises(ValueError, match=r"labels must have logits' shape without the class "
                                         r"axis, \[4\]"):
        g.cross_entropy(x, g.input("y3", (3,), "i64"))
    with pytest.raises(ValueError, match="reduction must be one of mean, sum, none, got 'avg'"):
        g.cross_entropy(x, y, reduction="avg")
    with pytest.raises(ValueError, match=r"label_smoothing must be a number in \[0, 1\], got 1.5"):
        g.cross_entropy(x, y, label_smoothing=1.5)
    with pytest.raises(ValueError, match="ignore_index must be an int, got 0.5"):
        g.cross_entropy(x, y, ignore_index=0.5)
    with pytest.raises(ValueError, match="logits must be a float tensor, got i64"):
        g.cross_entropy(y, y)


# ---- Philox, dropout, random ------------------------------------------------------------------
M32 = 0xFFFFFFFF
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def test_philox_numpy_twin_known_answers():
    """Random123's kat_vectors for philox4x32_10, all at once (the twin broadcasts)."""
    ctr = np.array([k[0] for k in KAT], np.uint64)
    key = np.array([k[1] for k in KAT], np.uint64)
    got = np.stack(R.philox_np(*ctr.T, *key.T), 1)
    np.testing.assert_array_equal(got, np.array([k[2] for k in KAT], np.uint64))


def _mask(n, p, seed, stream):
    return R.uniform_np(n, seed, stream) >= np.float32(p)


def test_dropout_matches_philox_twin(rng):
    """Two dropouts with one seed: streams 0 and 1, each x * mask / (1 - p) bit for bit;
    a seed above 2^32 uses both key words."""
    x = rng.standard_normal((3, 7)).astype(np.float32)
    g = rlx.Graph("drop")
    xt = g.input("x", x.shape)
    a, b = g.dropout(xt, 0.3, seed=5), g.dropout(xt, 0.3, seed=5)
    c = g.dropout(xt, 0.6, seed=2**40 + 9)
    g.set_outputs([a, b, c])
    got = rlx.compile(g).run({"x": x})
    for out, p, seed, stream in zip(got, (0.3, 0.3, 0.6), (5, 5, 2**40 + 9), (0, 1, 2)):
        m = _mask(x.size, p, seed, stream).reshape(x.shape)
        np.testing.assert_array_equal(out, np.where(m, x * np.float32(1 / (1 - p)), 0))
    assert not np.array_equal(got[0], got[1])


def test_dropout_seed_tensor_and_extremes(rng):
    x = rng.standard_normal((5, 3)).astype(np.float32)
    g = rlx.Graph("drops")
    xt, st = g.input("x", x.shape), g.input("s", (1,), "i32")
    assert g.dropout(xt, 0.0, seed=3) is xt            # p = 0: x itself, no node
    d, z = g.dropout(xt, 0.5, seed=st), g.dropout(xt, 1.0)
    g.set_outputs([d, z])
    exe = rlx.compile(g)
    for s in (0, 11):
        got, zeros = exe.run({"x": x, "s": np.array([s], np.int32)})
        np.testing.assert_array_equal(got, np.where(_mask(15, 0.5, s, 0).reshape(5, 3), 2 * x, 0))
        np.testing.assert_array_equal(zeros, 0)


def test_dropout_mask_statistics():
    """Over 4001 elements the kept share is 1 - p within 4 standard deviations, and the
    mean of the output is the input's (inverted dropout keeps the expectation)."""
    n, p = 4001, 0.3
    g = rlx.Graph("dstat")
    xt = g.input("x", (n,))
    g.set_outputs([g.dropout(xt, p, seed=123)])
    (out,) = rlx.compile(g).run({"x": np.ones(n, np.float32)})
    kept = (out != 0).mean()
    assert abs(kept - (1 - p)) < 4 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_allclose(out[out != 0], 1 / (1 - p), rtol=1e-6)
    assert abs(out.mean() - 1) < 4 * np.sqrt(p / (1 - p) / n)


def test_dropout_gradient(rng):
    """dx = dy * mask / (1 - p) with the forward's mask, also through a seed tensor."""
    x, r = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    g = rlx.Graph("ddrop")
    xt, rt, st = g.input("x", x.shape), g.input("r", r.shape), g.input("s", (), "i64")
    y = g.reduce_sum(g.dropout(g.dropout(xt, 0.25, seed=st) * rt, 0.4, seed=st))
    m0 = _mask(20, 0.25, 77, 0).reshape(4, 5) / 0.75
    m1 = _mask(20, 0.4, 77, 1).reshape(4, 5) / 0.6
    check(g, y, {"x": xt, "r": rt}, {"x": x, "r": r, "s": np.array(77, np.int64)},
          lambda x, r, s: float((x * m0 * r * m1).sum()))


def test_random_matches_twin_and_statistics():
    g = rlx.Graph("rand")
    u = g.random((3, 5), seed=9)
    s = g.input("s", (1,), "i64")
    z = g.random((2001,), "normal", seed=s)
    big = g.random((4000,), "uniform", seed=1)
    g.set_outputs([u, z, big])
    got_u, got_z, got_big = rlx.compile(g).run({"s": np.array([2**63 - 5], np.int64)})
    assert got_u.dtype == np.float32 and got_u.shape == (3, 5)
    np.testing.assert_array_equal(got_u.reshape(-1), R.uniform_np(15, 9, 0))
    np.testing.assert_allclose(got_z, R.normal_np(2001, 2**63 - 5, 1), rtol=1e-5, atol=1e-5)
    assert 0 <= got_big.min() and got_big.max() < 1
    assert abs(got_big.mean() - 0.5) < 4 * np.sqrt(1 / 12 / 4000)
    assert abs(got_z.mean()) < 4 / np.sqrt(2001) and abs(got_z.std() - 1) < 0.08


def test_random_dropout_errors():
    g = rlx.Graph("rerr")
    x = g.input("x", (3,))
    with pytest.raises(ValueError, match=r"dropout: p must be a number in \[0, 1\], got 1.2"):
        g.dropout(x, 1.2)
    with pytest.raises(ValueError, match="dropout: x must be a float tensor, got i32"):
        g.dropout(g.input("i", (3,), "i32"), 0.1)
    with pytest.raises(ValueError, match=r"dropout: a seed tensor must be i32 or i64 of shape "
                                         r"\[\] or \[1\], got i64 \[2\]"):
        g.dropout(x, 0.1, seed=g.input("s", (2,), "i64"))
    with pytest.raises(ValueError, match="random: dist must be one of uniform, normal, got 'gauss'"):
        g.random((2,), "gauss")
    with pytest.raises(ValueError, match="random: seed must be an int or an i32/i64 Tensor"):
        g.random((2,), seed=1.5)
    with pytest.raises(ValueError, match=r"random: shape \[2, -1\] has a negative dimension"):
        g.random((2, -1))
