"""selective_scan against a NumPy recurrence (mamba_ssm's selective_scan_ref written out), its
gradients against finite differences, the last state, softplus, and the errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from gradcheck import check


def scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
             last=False):
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = np.log1p(np.exp(delta))
    x = np.zeros(u.shape[:2] + A.shape[1:])
    ys = []
    for t in range(u.shape[2]):
        x = (np.exp(delta[:, :, t, None] * A) * x
             + delta[:, :, t, None] * B[:, None, :, t] * u[:, :, t, None])
        ys.append((x * C[:, None, :, t]).sum(-1))
    y = np.stack(ys, -1)
    if D is not None:
        y = y + u * D[:, None]
    if z is not None:
        y = y * z / (1 + np.exp(-z))
    return (y, x) if last else y


def _inputs(rng, bt, dm, length, n):
    return dict(u=rng.standard_normal((bt, dm, length)),
                delta=rng.uniform(-1.0, 0.5, (bt, dm, length)),
                A=-rng.uniform(0.2, 1.5, (dm, n)),
                B=rng.standard_normal((bt, n, length)),
                C=rng.standard_normal((bt, n, length)),
                D=rng.standard_normal(dm), z=rng.standard_normal((bt, dm, length)),
                delta_bias=rng.uniform(-0.5, 0.5, dm))


@pytest.mark.parametrize("opts", [
    dict(),
    dict(D=True, z=True, delta_bias=True, delta_softplus=True),
    dict(D=True, delta_softplus=True),
])
@pytest.mark.parametrize("shape", [(2, 3, 7, 4), (1, 2, 1, 3), (1, 1, 9, 1)])
def test_selective_scan(rng, shape, opts):
    """Forward and last state against the recurrence; odd lengths cross the chunks."""
    feed = _inputs(rng, *shape)
    if not opts.get("delta_softplus"):
        feed["delta"] = np.abs(feed["delta"])
    names = ["u", "delta", "A", "B", "C"] + [k for k in ("D", "z", "delta_bias") if opts.get(k)]
    g = rlx.Graph("scan")
    t = {k: g.input(k, feed[k].shape) for k in names}
    y, last = g.selective_scan(*(t[k] for k in ("u", "delta", "A", "B", "C")),
                               D=t.get("D"), z=t.get("z"), delta_bias=t.get("delta_bias"),
                               delta_softplus=bool(opts.get("delta_softplus")),
                               return_last_state=True)
    g.set_outputs([y, last])
    got = run_graph(g, {k: feed[k].astype(np.float32) for k in names})
    want_y, want_last = scan_ref(**{k: feed[k] for k in names},
                                 delta_softplus=bool(opts.get("delta_softplus")), last=True)
    np.testing.assert_allclose(got[0], want_y, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want_last, rtol=1e-4, atol=1e-4)


def test_selective_scan_gradients(rng):
    """Every input's gradient, through y and the last state, against finite differences."""
    feed = _inputs(rng, 2, 3, 6, 2)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    g = rlx.Graph("scan_grad")
    t = {k: g.input(k, feed[k].shape) for k in names}
    y, last = g.selective_scan(*(t[k] for k in names[:5]), D=t["D"], z=t["z"],
                               delta_bias=t["delta_bias"], delta_softplus=True,
                               return_last_state=True)
    sy, sl = rng.standard_normal(y.shape), rng.standard_normal(last.shape)
    loss = g.add(g.reduce_sum(g.mul(y, g.constant(sy.astype(np.float32)))),
                 g.reduce_sum(g.mul(last, g.constant(sl.astype(np.float32)))))

    def oracle(**kw):
        yy, ll = scan_ref(**kw, delta_softplus=True, last=True)
        return float((yy * sy).sum() + (ll * sl).sum())
    check(g, loss, t, feed, oracle, rtol=1e-3, atol=1e-4)


def test_softplus(rng):
    x = np.array([-100.0, -20.0, -1.5, 0.0, 0.3, 19.0, 25.0, 100.0])
    g = rlx.Graph("sp")
    g.set_outputs([g.softplus(g.input("x", x.shape))])
    (got,) = run_graph(g, {"x": x.astype(np.float32)})
    np.testing.assert_allclose(got, np.logaddexp(0, x), rtol=1e-6, atol=1e-30)


def test_selective_scan_errors():
    g = rlx.Graph("e")
    u = g.input("u", (2, 3, 5))
    A = g.input("A", (3, 4))
    B = g.input("B", (2, 4, 5))
    cases = [
        (lambda: g.selective_scan(g.input("u2", (2, 3)), u, A, B, B), "u must be [batch, dim"),
        (lambda: g.selective_scan(u, u, g.input("A2", (4, 4)), B, B), "A must be [3, N]"),
        (lambda: g.selective_scan(u, u, A, g.input("B2", (2, 4, 6)), B), "B must be f32 [2, 4, 5]"),
        (lambda: g.selective_scan(u, u, A, B, B, D=g.input("D", (4,))), "D must be f32 [3]"),
        (lambda: g.selective_scan(u, g.input("d", (2, 3, 5), "i32"), A, B, B),
         "delta must be f32"),
    ]
    for make, msg in cases:
        with pytest.raises(ValueError) as e:
            make()
        assert msg in str(e.value) and str(e.value).startswith("selective_scan:"), str(e.value)


@pytest.mark.skipif(not ON_GPU, reason="a larger scan on the GPU")
def test_selective_scan_gpu_size(rng):
    feed = _inputs(rng, 2, 64, 300, 16)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    g = rlx.Graph("scan")
    t = {k: g.input(k, feed[k].shape) for k in names}
    y = g.selective_scan(*(t[k] for k in names[:5]), D=t["D"], z=t["z"],
                         delta_bias=t["delta_bias"], delta_softplus=True)
    g.set_outputs([y])
    (got,) = run_graph(g, {k: v.astype(np.float32) for k, v in feed.items()})
    np.testing.assert_allclose(got, scan_ref(**feed, delta_softplus=True), rtol=1e-3, atol=1e-3)


def test_selective_state_update_is_one_scan_step(rng):
    """The generation step from a state equals the scan over the sequence one step longer."""
    feed = _inputs(rng, 2, 3, 5, 4)
    names = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias"]
    g = rlx.Graph("step")
    t = {k: g.input(k, feed[k].shape) for k in names}
    state = g.input("state", (2, 3, 4))
    last = lambda a: g.reshape(g.narrow(a, 2, 4, 1), a.shape[:2])  # noqa: E731
    y, new = g.selective_state_update(state, last(t["u"]), last(t["delta"]), t["A"],
                                      last(t["B"]), last(t["C"]), D=t["D"], z=last(t["z"]),
                                      dt_bias=t["delta_bias"], dt_softplus=True)
    g.set_outputs([y, new])
    prefix = {k: (v[..., :4] if v.ndim == 3 else v) for k, v in feed.items()}
    _, st = scan_ref(**{k: prefix[k] for k in names}, delta_softplus=True, last=True)
    got = run_graph(g, {**{k: v.astype(np.float32) for k, v in feed.items()},
                        "state": st.astype(np.float32)})
    want_y, want_st = scan_ref(**feed, delta_softplus=True, last=True)
    np.testing.assert_allclose(got[0], want_y[..., 4], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[1], want_st, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"selective_state_update: B must be f32 \[2, 4\]"):
        g.selective_state_update(state, last(t["u"]), last(t["delta"]), t["A"], t["B"],
                                 last(t["C"]))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_selective_scan_half(rng, dtype):
    """Half operands (A kept f32, as Mamba's A_log): the recurrence in f32, y and the last
    state rounded once to the dtype. The state is a running sum over 23 steps: kept in half
    between steps it would drift by ~23 u, beyond the 4 u allowed here."""
    from halfref import assert_half_close, f64, rounded
    feed = _inputs(rng, 1, 3, 23, 4)
    feed["delta"] = np.abs(feed["delta"])
    half = {k: rounded(feed[k], dtype) for k in ("u", "delta", "B", "C", "D", "z")}
    g = rlx.Graph("scan")
    t = {k: g.input(k, v.shape, dtype) for k, v in half.items()}
    a = g.input("A", feed["A"].shape)
    y, last = g.selective_scan(t["u"], t["delta"], a, t["B"], t["C"], D=t["D"], z=t["z"],
                               return_last_state=True)
    assert str(y.dtype) == dtype and str(last.dtype) == dtype
    g.set_outputs([y, last])
    got = run_graph(g, dict(half, A=feed["A"].astype(np.float32)))
    wy, wl = scan_ref(*(f64(half[k]) if k in half else f64(feed[k].astype(np.float32))
                        for k in ("u", "delta", "A", "B", "C")), D=f64(half["D"]),
                      z=f64(half["z"]), last=True)
    # y: the D skip and the z gate are half element-wise ops after the scan, each rounding
    # (the sum y + D u may cancel: the bound is on the scale of the whole output)
    assert_half_close(got[0], wy, dtype, k=4, scale=np.abs(wy).max(), what="y")
    assert_half_close(got[1], wl, dtype, k=2, what="last state")
    with pytest.raises(ValueError, match=rf"selective_scan: B must be {dtype} like u"):
        g.selective_scan(t["u"], t["delta"], a, g.input("B32", (1, 4, 23)), t["C"])
