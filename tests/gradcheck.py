"""Gradients of a graph against central finite differences of a float64 NumPy oracle."""
import numpy as np

import rlx_numba as rlx


def numeric_grad(f, feed: dict, name: str, eps: float = 1e-6, at=None) -> np.ndarray:
    """d f(**feed) / d feed[name] by central differences, in float64 (NaN except at the
    indices ``at`` when given)."""
    x = feed[name]
    out = np.zeros(x.shape, np.float64)
    if at is not None:
        out[:] = np.nan
    for i in (np.ndindex(x.shape) if at is None else at):
        old = x[i]
        x[i] = old + eps
        hi = f(**feed)
        x[i] = old - eps
        lo = f(**feed)
        x[i] = old
        out[i] = (hi - lo) / (2 * eps)
    return out


def check(g, y, wrt: dict, feed: dict, oracle, rtol=2e-4, atol=2e-5, seed=None, sample=None):
    """Append grad(y, wrt) to g, run it on ``feed`` (f32), and compare y with ``oracle`` and
    each gradient with the finite differences of ``oracle`` (a float64 function of the feed
    returning a scalar: sum(y * seed) when ``seed`` is given). ``sample``: only that many
    random elements of each gradient (inputs too large to difference every element), plus
    the derivative along two random directions (every element weighs in)."""
    names = list(wrt)
    grads = g.grad(y, [wrt[k] for k in names], seed=None if seed is None else g.constant(seed))
    g.set_outputs([y, *grads])
    got = rlx.compile(g).run({k: v.astype(np.float32) if v.dtype.kind == "f" else v
                              for k, v in feed.items()})
    f64 = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feed.items()}
    f = oracle if seed is None else (lambda **kw: float((oracle(**kw) * seed).sum()))
    if seed is None:
        np.testing.assert_allclose(got[0], oracle(**f64), rtol=1e-4, atol=1e-5, err_msg="forward")
    pick = np.random.default_rng(0)
    for k, dg in zip(names, got[1:]):
        x = f64[k]
        at = None if sample is None else \
            [np.unravel_index(i, x.shape) for i in pick.choice(x.size, sample, replace=False)]
        want = numeric_grad(f, f64, k, at=at)
        assert dg.shape == want.shape, (k, dg.shape, want.shape)
        if sample is not None:
            for _ in range(2):
                r, eps, x0 = pick.standard_normal(x.shape), 1e-6, x.copy()
                f64[k] = x0 + eps * r
                hi = f(**f64)
                f64[k] = x0 - eps * r
                lo = f(**f64)
                f64[k] = x0
                fd, dot = (hi - lo) / (2 * eps), float((dg.astype(np.float64) * r).sum())
                typical = np.linalg.norm(dg) * np.linalg.norm(r) / np.sqrt(x.size)
                assert abs(dot - fd) <= rtol * (abs(fd) + typical), (k, dot, fd)
            keep = ~np.isnan(want)
            dg, want = dg[keep], want[keep]
        np.testing.assert_allclose(dg, want, rtol=rtol, atol=atol * max(1.0, np.abs(want).max()),
                                   err_msg=f"d/d{k}")
    return got
