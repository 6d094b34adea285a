"""Gradients of a graph against central finite differences of a float64 NumPy oracle."""
import numpy as np

import rlx_numba as rlx


def numeric_grad(f, feed: dict, name: str, eps: float = 1e-6) -> np.ndarray:
    """d f(**feed) / d feed[name] by central differences, in float64."""
    x = feed[name]
    out = np.zeros(x.shape, np.float64)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + eps
        hi = f(**feed)
        x[i] = old - eps
        lo = f(**feed)
        x[i] = old
        out[i] = (hi - lo) / (2 * eps)
    return out


def check(g, y, wrt: dict, feed: dict, oracle, rtol=2e-4, atol=2e-5, seed=None):
    """Append grad(y, wrt) to g, run it on ``feed`` (f32), and compare y with ``oracle`` and
    each gradient with the finite differences of ``oracle`` (a float64 function of the feed
    returning a scalar: sum(y * seed) when ``seed`` is given)."""
    names = list(wrt)
    grads = g.grad(y, [wrt[k] for k in names], seed=None if seed is None else g.constant(seed))
    g.set_outputs([y, *grads])
    got = rlx.compile(g).run({k: v.astype(np.float32) if v.dtype.kind == "f" else v
                              for k, v in feed.items()})
    f64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feed.items()}
    f = oracle if seed is None else (lambda **kw: float((oracle(**kw) * seed).sum()))
    if seed is None:
        np.testing.assert_allclose(got[0], oracle(**f64), rtol=1e-4, atol=1e-5, err_msg="forward")
    for k, dg in zip(names, got[1:]):
        want = numeric_grad(f, f64, k)
        assert dg.shape == want.shape, (k, dg.shape, want.shape)
        np.testing.assert_allclose(dg, want, rtol=rtol, atol=atol * max(1.0, np.abs(want).max()),
                                   err_msg=f"d/d{k}")
    return got
