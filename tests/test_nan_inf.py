"""NaN and Inf propagate as torch's CUDA kernels propagate them (issue 36): max / min
reductions and binary max / min carry a NaN; argmax / argmin and topk / sort take a NaN as the
largest value (the first NaN's index); a softmax / log_softmax row holding a NaN or a +inf is
all NaN, a -inf entry is 0 (-inf); norms of a row with a NaN or an infinity follow their
formulas (rms_norm: x * rsqrt(mean(x^2) + eps), so inf gives 0 * finite and NaN * inf);
sums and cumsum as IEEE addition. Oracles: float64 NumPy written here."""
import functools
import re

import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HOST, UNIT, f64
from rlx_numba.ir import dtypes as dt
from rlx_numba.kernels import rows
from rlx_numba.kernels.launch import default_geometry

NAN, INF = np.nan, np.inf
X = np.array([[1.0, NAN, 3.0, -2.0, 0.5, 7.0, -3.0],
              [2.0, 5.0, -INF, 4.0, 1.0, -1.5, 0.25],
              [INF, 1.0, 2.0, 0.0, -1.0, 6.0, 3.5],
              [1.0, 2.0, 3.0, 4.0, 5.0, -6.0, 0.75],
              [-INF, 0.5, NAN, INF, 1.0, 2.0, -0.5]], np.float32)
Y = np.roll(X[::-1], 2, axis=1)
EPS = 1e-5


def softmax(x):
    m = x.max(-1, keepdims=True)          # NaN-propagating, as the kernels' row max
    e = np.exp(x - m)
    return e / e.sum(-1, keepdims=True)


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def top2(x):
    """torch.topk(k=2): NaN above everything (rows here have no ties)."""
    key = np.where(np.isnan(x), INF, x)
    big = np.where(np.isnan(x), 1, 0)     # NaN before +inf
    idx = np.stack([np.lexsort((-key[r], -big[r]))[:2] for r in range(len(x))])
    return np.take_along_axis(x, idx, -1), idx


def close(got, want, dtype, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, what
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN places")
    fin = np.isfinite(want)
    np.testing.assert_array_equal(got[~fin & ~np.isnan(want)], want[~fin & ~np.isnan(want)],
                                  err_msg=f"{what}: infinities")
    tol = 4 * UNIT[dtype] if dtype != "f32" else 1e-5
    np.testing.assert_allclose(got[fin], want[fin], rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_nan_and_inf_propagate_as_torch(dtype):
    x = X.astype(HOST[dtype]).astype(np.float64)
    y = Y.astype(HOST[dtype]).astype(np.float64)
    g = rlx.Graph()
    a, b = g.input("x", X.shape, dtype), g.input("y", Y.shape, dtype)
    gam = g.constant(np.linspace(0.5, 2.0, X.shape[1]).astype(np.float32), dtype)
    gv = np.linspace(0.5, 2.0, X.shape[1])
    with np.errstate(all="ignore"):
        mean = x.mean(-1, keepdims=True)
        cases = {
            "reduce_max": (g.reduce_max(a, [1]), x.max(1)),
            "reduce_min": (g.reduce_min(a, [1]), x.min(1)),
            "reduce_sum": (g.reduce_sum(a, [1]), x.sum(1)),
            "reduce_mean": (g.reduce_mean(a, [1]), x.mean(1)),
            "max": (g.binary("max", a, b), np.maximum(x, y)),
            "min": (g.binary("min", a, b), np.minimum(x, y)),
            "relu": (g.activation("relu", a), np.where(np.isnan(x), x, np.maximum(x, 0))),
            "cumsum": (g.cumsum(a, 1), np.cumsum(x, 1)),
            "softmax": (g.softmax(a, -1), softmax(x)),
            "log_softmax": (g.log_softmax(a, -1), log_softmax(x)),
            "rms_norm": (g.rms_norm(a, gam, eps=EPS),
                         x * (1 / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)) * gv),
            "layer_norm": (g.layer_norm(a, gam, eps=EPS),
                           (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + EPS) * gv),
        }
    vals, idx = top2(x)
    tk = g.topk(a, 2, -1)
    exact = {"argmax": (g.argmax(a, 1), np.argmax(x, 1)),     # NumPy's: the first NaN
             "argmin": (g.argmin(a, 1), np.argmin(x, 1)),
             "topk values": (tk[0], vals), "topk indices": (tk[1], idx)}
    if dtype == "f32":
        s = g.sort(a, 1, descending=True)
        exact["sort"] = (s[0] if isinstance(s, tuple) else s,
                         np.take_along_axis(x, np.stack([np.lexsort((-np.where(np.isnan(r), INF, r),
                                                                     -np.isnan(r).astype(int))) for r in x]), 1))
    g.set_outputs([t for t, _ in cases.values()] + [t for t, _ in exact.values()])
    got = rlx.compile(g).run({"x": X.astype(HOST[dtype]), "y": Y.astype(HOST[dtype])})
    for (name, (_, want)), gv_ in zip(list(cases.items()) + list(exact.items()), got):
        if name in exact and np.asarray(gv_).dtype.kind in "iu":
            np.testing.assert_array_equal(gv_, want, err_msg=name)
        elif name in exact:
            close(gv_, want, dtype, name)
        else:
            close(gv_, want.astype(HOST[dtype]) if dtype != "f32" else want, dtype, name)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_softmax_over_a_middle_axis_carries_inf_and_nan(dtype):
    """softmax / log_softmax over an axis that is not the last (the column kernel, an online
    max and sum): a column holding +inf is all NaN, as torch's x - max = inf - inf makes it
    (the kernel had kept the sum at 1 and given 0 beside the NaN; the fuzzer's specials
    generator found it), a NaN column is all NaN, a -inf entry is 0 (-inf)."""
    xt = np.transpose(X, (1, 0))[:, :, None] * np.array([1.0, 0.5], np.float32)   # [7, 5, 2]
    x = xt.astype(HOST[dtype]).astype(np.float64)
    g = rlx.Graph()
    a = g.input("x", xt.shape, dtype)
    g.set_outputs([g.softmax(a, 0), g.log_softmax(a, 0)])
    got = rlx.compile(g).run({"x": xt.astype(HOST[dtype])})
    move = lambda f: np.moveaxis(f(np.moveaxis(x, 0, -1)), -1, 0)   # noqa: E731
    with np.errstate(all="ignore"):
        for gv_, want, name in zip(got, (move(softmax), move(log_softmax)),
                                   ("softmax", "log_softmax")):
            close(gv_, want, dtype, name)
    assert np.isnan(np.asarray(got[0], np.float64)[:, 2]).all()     # X's row 2 holds +inf


# ---- norms and softmax on every kernel path, with the GPU's builtin max (issue: layer_norm
# over axis 0 gave +-inf on an H200 where torch gives NaN) ---------------------------------------
def _fmax(a, b):
    """The builtin max as numba lowers it for floats on a GPU (fmaxf / fmax): a NaN operand
    gives the other one, where Python's max(nan, 0) keeps the NaN."""
    return b if a != a else a if b != b else (a if a >= b else b)


@pytest.fixture
def gpu_max(monkeypatch):
    """In the simulator, rows.py's kernels see the GPU's max (a kernel runs there as Python with
    its module's globals), so a NaN the GPU would drop is dropped here too. On a GPU nothing is
    patched: the compiled kernels already use fmaxf."""
    if rlx.simulator_enabled():
        monkeypatch.setattr(rows, "max", _fmax, raising=False)


def _groups_with_specials(length):
    """[6, length] f32: the groups (values normalised together) hold a +inf (last place), a
    -inf, a NaN, both infinities, an inf in the first place (the shifted sums' shift), and
    nothing special."""
    base = (np.arange(6 * length, dtype=np.float32).reshape(6, length) % 7 - 3) * 0.5
    base[0, -1] = INF
    base[1, length // 2] = -INF
    base[2, 1] = NAN
    base[3, 0], base[3, -1] = -INF, INF
    base[4, 0] = INF
    return base


def _ln(h, gam, bet, eps):
    d = h - h.mean(-1, keepdims=True)
    y = d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * gam
    return y if bet is None else y + bet


def _rms(h, gam, bet, eps):
    y = h * (1 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)) * gam
    return y if bet is None else y + bet


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("path", ["cols", "rows_reg", "rows_loop"])
def test_norms_and_softmax_carry_inf_and_nan_on_every_path(dtype, path, gpu_max):
    """A group holding an infinity has mean +-inf and x - mean = inf - inf (or a NaN var):
    every output of layer_norm is NaN, as torch's; a NaN group is NaN; rms_norm follows
    h * rsqrt(mean(h^2) + eps) (inf * 0 = NaN, finite * 0 = 0); softmax / log_softmax as
    above. Each path of kernels/rows.py: the column kernel (axis 0), a row in registers and
    a row streamed in chunks (the GPU's shifted sums, whose variance clamp was the builtin
    max: fmaxf turned the NaN variance into 0, leaving +-inf where torch has NaN), with beta
    and a fused residual."""
    geo = default_geometry("rows")
    length = {"cols": 6, "rows_reg": 7, "rows_loop": geo.max_g * rows.VPT_MAX + 8}[path]
    if path == "rows_loop":
        assert rows.row_plan(length, False) is None and rows.row_plan(length, True) is None
    grp = _groups_with_specials(length)
    res = ((np.arange(grp.size, dtype=np.float32).reshape(grp.shape) % 5) - 2) * 0.25
    if path == "cols":   # [length, 3, 2], normalised over axis 0
        to_x = lambda a: np.moveaxis(a.reshape(3, 2, length), -1, 0)   # noqa: E731
        axis = 0
    else:
        to_x = lambda a: a                                              # noqa: E731
        axis = -1
    from_x = lambda a: np.moveaxis(a, 0, -1).reshape(6, length) if axis == 0 else a  # noqa: E731
    host = HOST[dtype]
    xv, rv = to_x(grp).astype(host), to_x(res).astype(host)
    gv = np.linspace(0.5, 2.0, length).astype(host)
    bv = np.linspace(-1.0, 1.0, length).astype(host)
    g = rlx.Graph()
    a, r = g.input("x", xv.shape, dtype), g.input("r", xv.shape, dtype)
    gam, bet = g.constant(gv, dtype), g.constant(bv, dtype)
    outs = {"layer_norm": g.layer_norm(a, gam, axis=axis, eps=EPS),
            "layer_norm beta residual": g.layer_norm(a, gam, bet, axis=axis, eps=EPS, residual=r),
            "rms_norm beta residual": g.rms_norm(a, gam, bet, axis=axis, eps=EPS, residual=r),
            "softmax": g.softmax(a, axis),
            "log_softmax": g.log_softmax(a, axis)}
    g.set_outputs(list(outs.values()))
    got = rlx.compile(g).run({"x": xv, "r": rv})
    x64, g64, b64 = f64(from_x(xv)), f64(gv), f64(bv)
    h64 = f64((x64 + f64(from_x(rv))).astype(host))    # h rounded to the dtype, as stored
    with np.errstate(all="ignore"):
        wants = {"layer_norm": _ln(x64, g64, None, EPS),
                 "layer_norm beta residual": _ln(h64, g64, b64, EPS),
                 "rms_norm beta residual": _rms(h64, g64, b64, EPS),
                 "softmax": softmax(x64), "log_softmax": log_softmax(x64)}
    for (name, want), out in zip(wants.items(), got):
        out = from_x(np.asarray(out))
        close(out, want.astype(host) if dtype != "f32" else want, dtype, f"{path} {name}")
    assert np.isnan(f64(from_x(np.asarray(got[0])))[:5]).all()   # every special group: all NaN


def test_layer_norm_grad_carries_inf_and_nan(gpu_max):
    """norm_bwd's statistics clamp their variance too: a group holding an infinity gets a NaN
    dx (rstd is NaN) and makes d gamma NaN, over axis 0 (one thread a column) and the last axis
    (threads a row); other groups match the closed form dx = rstd (gdy - mean(gdy) -
    xhat mean(gdy xhat)), gdy = dy * gamma."""
    grp = _groups_with_specials(6)
    gv = np.linspace(0.5, 2.0, 6).astype(np.float32)
    dyv = ((np.arange(36, dtype=np.float32).reshape(6, 6) % 4) - 1.5) * 0.5
    g64, dy64, x64 = f64(gv), f64(dyv), f64(grp)
    with np.errstate(all="ignore"):
        d = x64 - x64.mean(-1, keepdims=True)
        rstd = 1 / np.sqrt((d * d).mean(-1, keepdims=True) + EPS)
        xh, gdy = d * rstd, dy64 * g64
        dx = rstd * (gdy - gdy.mean(-1, keepdims=True) - xh * (gdy * xh).mean(-1, keepdims=True))
        dgam = (dy64 * xh).sum(0)
    for axis, to_x in ((0, lambda a: np.ascontiguousarray(a.T)), (-1, lambda a: a)):
        g = rlx.Graph()
        x, gam = g.input("x", (6, 6)), g.param("g", (6,))
        y = g.layer_norm(x, gam, axis=axis, eps=EPS)
        g.set_outputs(g.grad(y, [x, gam], seed=g.constant(to_x(dyv))))
        exe = rlx.compile(g)
        exe.set_param("g", gv)
        got_dx, got_dg = exe.run({"x": to_x(grp)})
        close(to_x(np.asarray(got_dx)), dx, "f32", f"dx axis {axis}")
        close(got_dg, dgam, "f32", f"d gamma axis {axis}")


# ---- the split decode attention kernel (an H200-found class: a NaN score became an output of 0)
@pytest.mark.parametrize("plan", ["one block", "two splits", "nine splits"])
@pytest.mark.parametrize("where", ["q", "k", "k inf"])
def test_decode_attention_carries_nan_as_torch(where, plan, monkeypatch):
    """A NaN in a query or a key (or a key of infinities: inf - inf scores) makes the scores of
    the query heads reading it NaN, and torch's attention gives NaN there; the other kv head's
    queries are untouched. The decode kernel merged its warps' (and splits') running maxima
    with the builtin max (fmaxf on a GPU drops a NaN) and wrote 0 where the softmax sum was
    not > 0, so a NaN row came out as zeros. Each merge path: one block, two splits (one
    combine round) and nine (more than the combine loads at once); the builtin max made
    GPU-like for the kernels' module."""
    from rlx_numba.kernels import attention as A
    if rlx.simulator_enabled():
        monkeypatch.setattr(A, "max", _fmax, raising=False)
    chunk = {"one block": None, "two splits": 8, "nine splits": 4}[plan]
    b, hq, hkv, sq, sk, d = 1, 4, 2, 1, 36 if chunk == 4 else 9, 16
    if chunk:
        monkeypatch.setattr(A, "decode_plan", lambda b, hkv, sk, sm, nw=None: (-(-sk // chunk),
                                                                               chunk))
    rng = np.random.default_rng(7)
    q = rng.standard_normal((b, hq, sq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, sk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, sk, d)).astype(np.float32)
    if where == "q":
        q[0, 1, 0, 2] = NAN
    elif where == "k":
        k[0, 0, 3, 5] = NAN
    else:
        k[0, 0, 3, :] = INF
    assert A.decode_rows(hq // hkv, sq, d) is not None
    g = rlx.Graph()
    Q, K, V = g.input("q", q.shape), g.input("k", k.shape), g.input("v", v.shape)
    g.set_outputs([g.attention(Q, K, V)])
    (got,) = rlx.compile(g).run({"q": q, "k": k, "v": v})
    kk, vv = (np.repeat(f64(t), hq // hkv, 1) for t in (k, v))
    with np.errstate(all="ignore"):
        s = f64(q) @ kk.transpose(0, 1, 3, 2) / np.sqrt(d)
        p = np.exp(s - s.max(-1, keepdims=True))
        want = p / p.sum(-1, keepdims=True) @ vv
    nan = np.isnan(want)
    assert nan.any() and (np.isnan(got) == nan).all()
    np.testing.assert_allclose(got[~nan], want[~nan], rtol=1e-5, atol=1e-6)


# ---- the numba linear-algebra kernels (tier 1): a NaN matrix of a batch --------------------
@pytest.mark.parametrize("op", ["qr", "svd", "eigh"])
def test_linalg_kernels_carry_a_nan_matrix(op, monkeypatch):
    """A NaN in one matrix of a batch makes every output of that matrix hold a NaN, as
    LAPACK's and torch's do, and leaves the others right: the kernels' pivots and scales
    were maxima by the builtin max (fmaxf on a GPU drops a NaN), and svd took a column whose
    largest |entry| was not > 0 for a zero one, so a NaN column gave a singular value of 0.
    The builtin max made GPU-like for the kernels' module."""
    from rlx_numba.kernels import linalg as L
    if rlx.simulator_enabled():
        monkeypatch.setattr(L, "max", _fmax, raising=False)
    monkeypatch.setenv("RLX_NUMBA_LINALG_TIERS", "1")
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 5, 4)).astype(np.float32)
    if op == "eigh":
        a = (a[:, :4] @ a[:, :4].transpose(0, 2, 1)).astype(np.float32)
    a[1, 3, 0] = NAN                           # below the diagonal of the first column
    g = rlx.Graph()
    x = g.input("a", a.shape)
    outs = list(getattr(g, op)(x))
    g.set_outputs(outs)
    got = rlx.compile(g).run({"a": a})
    for o in got:
        nan = np.isnan(o).reshape(3, -1).any(1)
        assert nan.tolist() == [False, True, False], op
    good = [0, 2]
    if op == "qr":
        q, r = got
        rebuilt = q[good] @ r[good]
    elif op == "svd":
        u, s, vh = got
        rebuilt = u[good] * s[good][:, None, :] @ vh[good]
    else:
        w, v = got
        rebuilt = v[good] * w[good][:, None, :] @ v[good].transpose(0, 2, 1)
    np.testing.assert_allclose(rebuilt, a[good], rtol=1e-4, atol=1e-4 * np.abs(a[good]).max())


# ---- the audit of every NaN / Inf compare (issue 36's class, the builtin max / min above): each
# op on each of its kernel paths, with the GPU's builtin max and min patched into the modules its
# kernels read them from, against a NumPy oracle of torch's rule ------------------------------
def _fmin(a, b):
    """The builtin min as numba lowers it for floats on a GPU (fminf / fmin): a NaN operand
    gives the other one."""
    return b if a != a else a if b != b else (a if a <= b else b)


def _any_args(f):
    """f over two or more arguments (host code of a patched module calls min(a, b, c))."""
    return lambda a, b, *more: functools.reduce(f, more, f(a, b))


@pytest.fixture
def gpu_minmax(monkeypatch):
    """patch(*modules): in the simulator, those modules' kernels see the GPU's builtin max and
    min (fmaxf / fminf, which drop a NaN). Nothing is patched on a GPU."""
    def patch(*modules):
        if rlx.simulator_enabled():
            for mod in modules:
                monkeypatch.setattr(mod, "max", _any_args(_fmax), raising=False)
                monkeypatch.setattr(mod, "min", _any_args(_fmin), raising=False)
    return patch


def _specials(shape, axis, seed=5, start=0):
    """f32 data whose lines along ``axis`` hold: a NaN first, a NaN last, two NaNs and a +inf,
    +inf and -inf, only -inf, a +inf, -0.0 beside 0.0, nothing special (one a line, cycling
    from case ``start``)."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    v = np.moveaxis(x, axis, -1)            # a view: writing it writes x
    n = v.shape[-1]
    lines = v.reshape(-1, n)
    for i, line in enumerate(lines):
        case = (i + start) % 8
        if case == 0:
            line[0] = NAN
        elif case == 1:
            line[-1] = NAN
        elif case == 2:
            line[[1, n // 2]] = NAN
            line[n - 2] = INF
        elif case == 3:
            line[n // 3], line[-1] = INF, -INF
        elif case == 4:
            line[:] = -INF
        elif case == 5:
            line[n // 2] = INF
        elif case == 6:
            line[:2] = (-0.0, 0.0)
    v[...] = lines.reshape(v.shape)
    return x


def _bare_builtin(src):
    """The builtin max / min calls in generated source (ew.max and ew.min are not builtins)."""
    return re.findall(r"(?<![\w.])(?:max|min)\(", src)


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "f64"])
def test_maximum_minimum_clamp_relu_family_carry_nan(dtype):
    """torch.maximum / minimum carry a NaN from either operand; clamp (max then min with
    scalars: ONNX Clip's, hardtanh's and fake_quantize's form), relu6 keep a NaN; relu(NaN)
    is NaN; inf and -0.0 as IEEE. The generated element-wise kernels (the vector path for the
    halves: 64 elements) call elementwise.py's max / min (compare and select), never the
    builtin (fmaxf on a GPU): nothing to patch, the source is checked instead."""
    from rlx_numba.kernels import codegen
    host = np.float64 if dtype == "f64" else HOST[dtype]
    xv = _specials((4, 16), 1).astype(host)
    yv = np.roll(_specials((4, 16), 1, seed=6), 3).astype(host)
    x, y = f64(xv), f64(yv)
    g = rlx.Graph()
    a, b = g.input("x", xv.shape, dtype), g.input("y", yv.shape, dtype)
    outs = {"max": (g.max(a, b), np.maximum(x, y)), "max swapped": (g.max(b, a), np.maximum(y, x)),
            "min": (g.min(a, b), np.minimum(x, y)), "min swapped": (g.min(b, a), np.minimum(y, x)),
            "clamp": (g.min(g.max(a, -1.0), 1.0), np.minimum(np.maximum(x, -1.0), 1.0)),
            "relu6": (g.min(g.relu(a), 6.0), np.minimum(np.where(np.isnan(x), x,
                                                                  np.maximum(x, 0.0)), 6.0)),
            "relu": (g.relu(a), np.where(np.isnan(x), x, np.maximum(x, 0.0))),
            "max NaN bound": (g.max(a, float("nan")), np.full_like(x, NAN))}
    g.set_outputs([t for t, _ in outs.values()])
    got = rlx.compile(g).run({"x": xv, "y": yv})
    for (name, (_, want)), out in zip(outs.items(), got):
        np.testing.assert_array_equal(f64(out), f64(want.astype(host)), err_msg=f"{dtype} {name}")
    f = dt.F32
    expr = ("binary", "max", f, ("in", 0, f), ("binary", "min", f, ("in", 1, f), ("in", 0, f)))
    src = codegen.kernel_source(expr, [f, f], ["full", "full"], 1)
    assert "ew.max(" in src and "ew.min(" in src and not _bare_builtin(src)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_relu_grad_passes_dy_where_x_is_nan(dtype):
    """torch's relu backward is threshold_backward(dy, relu(x), 0): ``y <= 0 ? 0 : dy``, so dy
    passes where x (and y) is NaN; 0 at x <= 0 (-0.0 and 0 included), dy above. The
    activation_grad kernel had ``dy if x > 0 else 0``: 0 at a NaN."""
    xv = _specials((3, 9), 1).astype(HOST[dtype])
    dyv = (np.arange(27, dtype=np.float32).reshape(3, 9) % 5 - 1.5).astype(HOST[dtype])
    g = rlx.Graph()
    a = g.input("x", xv.shape, dtype)
    (dx,) = g.grad(g.relu(a), [a], seed=g.constant(dyv.astype(np.float32), dtype))
    g.set_outputs([dx])
    (got,) = rlx.compile(g).run({"x": xv})
    x = f64(xv)
    want = np.where(x <= 0, 0.0, f64(dyv))          # NaN <= 0 is false: dy
    assert np.isnan(x).any()
    np.testing.assert_array_equal(f64(got), want)


# shape, axis, first special case, the kernels it takes in the simulator's geometry
REDUCE_PATHS = {"rows": ((8, 7), 1, 0),                 # a thread a row
                "rows grouped": ((8, 130), 1, 0),       # 4 threads a row (scan: 2)
                "row segments": ((2, 600), 1, 1),       # 2 segments a row, then their partials;
                                                        # scan: 8 threads a row
                "cols split": ((40, 8), 0, 0)}          # 8 x 2 threads, r in 2 chunks


@pytest.mark.parametrize("path", list(REDUCE_PATHS))
def test_reductions_argmax_and_cumsum_carry_nan_on_every_path(path, gpu_minmax):
    """reduce max / min are NaN where the reduced line holds one (and +-inf, -0.0 as IEEE
    max); argmax / argmin give the first NaN's index (else the first extreme; all -inf: 0);
    cumsum turns NaN from the first NaN or the first inf - inf on. Each path of
    kernels/reduce.py, a NaN in a later segment or chunk than the line's extreme included."""
    from rlx_numba.kernels import reduce as R, warp as W
    from rlx_numba.kernels.launch import col_geometry, row_geometry
    from rlx_numba.runtime.lower_reduce import scan_geometry
    gpu_minmax(R, W)
    shape, axis, start = REDUCE_PATHS[path]
    if rlx.simulator_enabled():   # the simulator's geometry (a GPU's takes its own paths)
        if axis == 1:
            assert row_geometry(*shape)[3] == (2 if path == "row segments" else 1)
            assert (row_geometry(*shape)[0] > 1) == (path != "rows")
            assert (scan_geometry(*shape)[0] > 1) == (path != "rows")
        else:
            assert col_geometry(1, *shape)[4] == 2 and col_geometry(1, *shape)[1] > 1
    xv = _specials(shape, axis, start=start)
    x = f64(xv)
    g = rlx.Graph()
    a = g.input("x", shape)
    g.set_outputs([g.reduce_max(a, [axis]), g.reduce_min(a, [axis]), g.argmax(a, axis),
                   g.argmin(a, axis), g.cumsum(a, axis)])
    mx, mn, amx, amn, cs = rlx.compile(g).run({"x": xv})
    np.testing.assert_array_equal(mx, np.max(x, axis), err_msg=f"{path} reduce_max")
    np.testing.assert_array_equal(mn, np.min(x, axis), err_msg=f"{path} reduce_min")
    np.testing.assert_array_equal(amx, np.argmax(x, axis), err_msg=f"{path} argmax")
    np.testing.assert_array_equal(amn, np.argmin(x, axis), err_msg=f"{path} argmin")
    want = np.cumsum(x, axis)
    np.testing.assert_array_equal(np.isnan(cs), np.isnan(want), err_msg=f"{path} cumsum NaN")
    inf = np.isinf(want)
    np.testing.assert_array_equal(cs[inf], want[inf], err_msg=f"{path} cumsum inf")
    fin = np.isfinite(want)
    np.testing.assert_allclose(cs[fin], want[fin], rtol=1e-4, atol=2e-3, err_msg=path)


def _negative_nans(x):
    """x with the NaNs of its odd columns given the sign bit (-NaN, as x - x of inf can be):
    a NaN is a NaN whatever its sign."""
    x = x.copy()
    u = x.view(np.uint32)
    odd = (np.arange(x.shape[-1]) % 2 == 1) & np.isnan(x)
    u[odd] |= np.uint32(0x80000000)
    return x


def _order(row, descending):
    """torch's stable sort order of a row: NaN above +inf (after it ascending, first
    descending), -0.0 tying with 0.0, ties by index."""
    nan = [v != v for v in row]
    if descending:
        return sorted(range(len(row)), key=lambda i: (not nan[i], 0.0 if nan[i] else -row[i], i))
    return sorted(range(len(row)), key=lambda i: (nan[i], 0.0 if nan[i] else row[i], i))


TOPK_PATHS = {"small": ((8, 9), 0), "one block a row": ((8, 40), 0),
              "two stages": ((2, 600), 2)}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("path", list(TOPK_PATHS))
def test_topk_takes_nan_as_largest_on_every_path(path, dtype, gpu_minmax):
    """torch.topk: NaN (of either sign) above +inf, several NaNs by index, then descending
    values, ties (-0.0 with 0.0) to the smaller index. Each plan of runtime/lower_sample.py:
    a thread a row, a block a row, segment candidates then a block a row (the NaNs and the
    +inf in different segments)."""
    from rlx_numba.kernels import sample as S, warp as W
    from rlx_numba.runtime.lower_sample import topk_plan
    gpu_minmax(S, W)
    shape, start = TOPK_PATHS[path]
    k = 5
    assert not rlx.simulator_enabled() or topk_plan(shape[0], shape[1], k)["mode"] == {
        "small": "small", "one block a row": "one"}.get(path, "two")   # (the simulator's plan)
    xv = _negative_nans(_specials(shape, 1, start=start)).astype(HOST[dtype])
    x = f64(xv)
    g = rlx.Graph()
    a = g.input("x", shape, dtype)
    vals, idx = g.topk(a, k, -1)
    g.set_outputs([vals, idx])
    got_v, got_i = rlx.compile(g).run({"x": xv})
    want_i = np.array([_order(list(r), True)[:k] for r in x])
    np.testing.assert_array_equal(got_i, want_i, err_msg=f"{path} {dtype} indices")
    np.testing.assert_array_equal(f64(got_v), np.take_along_axis(x, want_i, 1),
                                  err_msg=f"{path} {dtype} values")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_sort_orders_nan_as_torch_across_tiles(dtype, gpu_minmax):
    """torch.sort(stable=True): NaN (of either sign) after +inf ascending and first
    descending, -0.0 tying with 0.0, ties in index order; rows of 21 take three tiles of 8
    (the simulator's) and two merge passes."""
    from rlx_numba.kernels import sort as K, warp as W
    gpu_minmax(K, W)
    rng = np.random.default_rng(11)
    xv = np.round(rng.standard_normal((3, 21)), 1).astype(np.float32)   # (rounded: ties)
    xv[0, [2, 9, 17]] = NAN
    xv[0, [5, 12, 3, 14, 7, 19]] = (INF, -INF, -0.0, 0.0, 1.5, 1.5)
    xv[1, :] = -INF
    xv[1, [0, 20, 8]] = (INF, NAN, NAN)
    xv = _negative_nans(xv).astype(HOST[dtype])
    assert np.signbit(xv[0, 9]) and np.isnan(xv[0, 9])
    x = f64(xv)
    g = rlx.Graph()
    a = g.input("x", xv.shape, dtype)
    up, down = g.sort(a, 1), g.sort(a, 1, descending=True)
    g.set_outputs([up[0], up[1], down[0], down[1]])
    got = rlx.compile(g).run({"x": xv})
    for (vals, idx), desc in ((got[:2], False), (got[2:], True)):
        want = np.array([_order(list(r), desc) for r in x])
        np.testing.assert_array_equal(idx, want, err_msg=f"{dtype} descending={desc}")
        np.testing.assert_array_equal(f64(vals), np.take_along_axis(x, want, 1))


def _pool_image():
    """[1, 2, 7, 7] f32 for 3x3 windows, stride 2, padding 1: channel 0 has NaNs at (1, 1)
    and (1, 2) (windows (0, 0) and (1, 0) hold one, (0, 1) and (1, 1) both) and a +inf and
    a -inf sharing window (2, 2); channel 1 a -inf block (window (3, 3) holds only -inf), a
    +inf, a -0.0 beside 0.0."""
    x = np.round(np.random.default_rng(3).standard_normal((1, 2, 7, 7)), 1).astype(np.float32)
    x[0, 0, 1, 1:3] = NAN
    x[0, 0, 4, 4], x[0, 0, 5, 5] = INF, -INF
    x[0, 1, 4:, 4:] = -INF
    x[0, 1, 0, 6] = INF
    x[0, 1, 2, 2:4] = (-0.0, 0.0)
    return x


def _max_pool_torch(x, k, s, p):
    """torch's max_pool2d (DilatedMaxPool2d.cu): each window in row-major order, ``v > max or
    isnan(v)`` takes v (so the LAST NaN of a window wins), the index starting at the window's
    first element; (out, flat indices into the [H, W] plane)."""
    n, c, h, w = x.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    out, idx = np.empty((n, c, oh, ow)), np.empty((n, c, oh, ow), np.int64)
    for b, ch, i, j in np.ndindex(n, c, oh, ow):
        rs = [r for r in range(i * s - p, i * s - p + k) if 0 <= r < h]
        cs = [q for q in range(j * s - p, j * s - p + k) if 0 <= q < w]
        best, at = -INF, rs[0] * w + cs[0]
        for r in rs:
            for q in cs:
                v = x[b, ch, r, q]
                if v > best or np.isnan(v):
                    best, at = v, r * w + q
        out[b, ch, i, j], idx[b, ch, i, j] = best, at
    return out, idx


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("layout", ["nchw", "nhwc"])
def test_max_pool_and_its_grad_follow_torch_nan(layout, dtype, gpu_minmax):
    """max pool: a window holding a NaN gives NaN, one of only -inf gives -inf; the gradient
    goes where torch's index points: the window's last NaN (torch takes any NaN it meets, so a
    later NaN replaces an earlier one), else its first largest value, else (all -inf) its
    first element. Both layouts (channels last: its own forward kernel, the gradient between
    transposes)."""
    from rlx_numba.kernels import conv as C, pool as P
    gpu_minmax(P, C)
    x = f64(_pool_image().astype(HOST[dtype]))
    want, idx = _max_pool_torch(x, 3, 2, 1)
    dyv = (np.arange(want.size) % 4 + 1).astype(np.float32).reshape(want.shape)   # exact sums
    dx = np.zeros(x.shape)
    for b, ch, i, j in np.ndindex(*want.shape):
        dx[b, ch].flat[idx[b, ch, i, j]] += dyv[b, ch, i, j]
    cl = layout == "nhwc"
    def to(t):
        return np.ascontiguousarray(np.moveaxis(t, 1, -1)) if cl else t

    def back(t):
        return np.moveaxis(t, -1, 1) if cl else t
    xv = to(x).astype(HOST[dtype])
    g = rlx.Graph()
    a = g.input("x", xv.shape, dtype)
    y = g.pool(a, "max", 3, 2, 1, channels_last=cl)
    (gx,) = g.grad(y, [a], seed=g.constant(to(dyv), dtype))
    g.set_outputs([y, gx])
    got_y, got_dx = rlx.compile(g).run({"x": xv})
    assert np.isnan(want[0, 0, :2, :2]).all() and want[0, 1, 3, 3] == -INF
    np.testing.assert_array_equal(f64(back(got_y)), want, err_msg=f"{layout} {dtype} pool")
    np.testing.assert_array_equal(f64(back(got_dx)), dx, err_msg=f"{layout} {dtype} grad")


def test_avg_and_adaptive_pools_carry_inf_and_nan(gpu_minmax):
    """avg pool (both divisors) and adaptive_avg_pool (the resample tables, and a global pool:
    a mean) are sums as IEEE adds them: a window with +inf is +inf, with +inf and -inf or a NaN
    NaN; the zero-weight taps of the resample never multiply an inf."""
    from rlx_numba.kernels import conv as C, pool as P, resample as RS
    gpu_minmax(P, C, RS)
    x = _pool_image()
    x64 = f64(x)
    pad = np.pad(x64, ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=np.nan)
    wins = np.lib.stride_tricks.sliding_window_view(pad, (3, 3), (2, 3))[:, :, ::2, ::2]
    live = ~np.isnan(np.lib.stride_tricks.sliding_window_view(
        np.pad(np.zeros((7, 7)), 1, constant_values=np.nan), (3, 3))[::2, ::2])
    with np.errstate(invalid="ignore"):
        sums = np.where(live, wins, 0.0).sum((-2, -1))   # (the padding's NaN is not live)
        avg_pad, avg_in = sums / 9.0, sums / live.sum((-2, -1))

        def adaptive(t, o):
            n = t.shape[-1]
            rng_ = [(i * n // o, -(-(i + 1) * n // o)) for i in range(o)]
            return np.array([[t[..., r0:r1, c0:c1].mean((-2, -1)) for c0, c1 in rng_]
                             for r0, r1 in rng_]).transpose(2, 3, 0, 1)
        ad3, ad1 = adaptive(x64, 3), x64.mean((-2, -1), keepdims=True)
    g = rlx.Graph()
    a = g.input("x", x.shape)
    g.set_outputs([g.pool(a, "avg", 3, 2, 1), g.pool(a, "avg", 3, 2, 1, count_include_pad=False),
                   g.adaptive_avg_pool(a, 3), g.adaptive_avg_pool(a, 1)])
    got = rlx.compile(g).run({"x": x})
    for out, want, name in zip(got, (avg_pad, avg_in, ad3, ad1),
                               ("avg", "avg excluding pad", "adaptive 3x3", "adaptive 1x1")):
        assert np.isnan(want).any() and np.isinf(want).any() or name == "adaptive 1x1", name
        close(out, want, "f32", name)


def _ce_rows():
    """[9, 37] logits and labels (the simulator's 16 threads a row: columns 3 and 19, 0, 16
    and 32 are one thread's): a NaN; a +inf; two +inf in one thread; -inf at the label; -inf
    elsewhere (one thread's three); only -inf; nothing special; a NaN and a plain row whose
    label is ignore_index (-100)."""
    x = np.round(np.random.default_rng(9).standard_normal((9, 37)), 2).astype(np.float32)
    x[0, 5] = NAN
    x[1, 3] = INF
    x[2, [3, 19]] = INF
    x[3, 7] = -INF
    x[4, [0, 16, 32]] = -INF
    x[5, :] = -INF
    x[7, 10] = NAN
    return x, np.array([2, 3, 0, 7, 1, 4, 36, -100, -100], np.int64)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_with_nan_and_inf_logits_as_torch(eps, dtype, gpu_minmax):
    """torch's cross_entropy is log_softmax then nll_loss (and the smoothing term): a row with
    a NaN, a +inf or only -inf has a NaN log_softmax, so a NaN loss; -inf at the label gives
    +inf, -inf elsewhere nothing (with smoothing: +inf, as sum(-log p) is). The gradient is
    log_softmax's backward, dy' - exp(log p) sum(dy'): NaN on a NaN row, and on an ignored row
    (dy' = 0) 0 - exp(NaN) * 0 = NaN where log p is NaN, else 0. The kernel wrote 0 on every
    ignored row."""
    from rlx_numba.kernels import loss as L, warp as W
    gpu_minmax(L, W)
    xv, y = _ce_rows()
    xv = xv.astype(HOST[dtype])
    x, c = f64(xv), xv.shape[1]
    dyv = np.linspace(0.5, 2.0, 9).astype(np.float32)
    with np.errstate(all="ignore"):
        mx = x.max(-1, keepdims=True)
        logp = x - mx - np.log(np.exp(x - mx).sum(-1, keepdims=True))
        keep = y != -100
        onehot = np.eye(c)[np.where(keep, y, 0)] * keep[:, None]
        want = -(1 - eps) * np.take_along_axis(logp, np.where(keep, y, 0)[:, None], 1)[:, 0]
        if eps:
            want = want - eps / c * np.where(keep, logp.sum(-1), 0.0)
        want = np.where(keep, want, 0.0)
        d_logp = -f64(dyv)[:, None] * ((1 - eps) * onehot + eps / c * keep[:, None])
        want_dx = d_logp - np.exp(logp) * d_logp.sum(-1, keepdims=True)
    g = rlx.Graph()
    a, lab = g.input("x", xv.shape, dtype), g.input("y", (9,), "i64")
    loss = g.cross_entropy(a, lab, reduction="none", label_smoothing=eps)
    (dx,) = g.grad(loss, [a], seed=g.constant(dyv, dtype))
    g.set_outputs([loss, dx])
    got, got_dx = rlx.compile(g).run({"x": xv, "y": y})
    assert np.isnan(want[[0, 1, 2, 5]]).all() and want[3] == INF
    assert np.isfinite(want[4]) == (eps == 0)
    assert np.isnan(want_dx[7]).all() and (want_dx[8] == 0).all()
    close(got, want.astype(HOST[dtype]) if dtype != "f32" else want, dtype, f"loss eps={eps}")
    close(got_dx, want_dx, dtype, f"dx eps={eps}")


@pytest.mark.parametrize("deterministic", [False, True])
def test_scatter_add_sums_inf_and_nan_as_ieee(deterministic):
    """scatter_add (torch.index_add): +inf and -inf meeting in a row give NaN, a NaN update
    or target stays NaN, an inf stays inf; atomics and the ordered kernel alike."""
    t = np.arange(15, dtype=np.float32).reshape(5, 3)
    t[0, 2], t[2, 1] = -INF, NAN
    idx = np.array([1, 3, 1, -1, 3, 0], np.int64)                  # -1: row 4
    upd = np.ones((6, 3), np.float32)
    upd[0, 0], upd[2, 0] = INF, -INF                               # row 1: inf - inf
    upd[1, 1] = NAN                                                # row 3
    upd[5, 2], upd[3, 0] = INF, INF                                # row 0: -inf + inf; row 4
    want = f64(t)
    np.add.at(want, idx % 5, f64(upd))
    g = rlx.Graph()
    a, i, u = g.input("t", t.shape), g.input("i", idx.shape, "i64"), g.input("u", upd.shape)
    g.set_outputs([g.scatter_add(a, i, u, 0, deterministic=deterministic)])
    (got,) = rlx.compile(g).run({"t": t, "i": idx, "u": upd})
    assert np.isnan(want[[0, 1, 2, 3], [2, 0, 1, 1]]).all() and want[4, 0] == INF
    np.testing.assert_array_equal(f64(got), want)


@pytest.mark.parametrize("case", ["sgd clip NaN", "sgd clip inf", "adam amsgrad NaN"])
def test_optimizer_step_with_a_nan_or_inf_grad_as_torch(case, gpu_minmax):
    """torch.nn.utils.clip_grad_norm_ then the step: a NaN gradient makes the total norm and
    the clip coefficient NaN (clamp(NaN, max=1) is NaN), so every param of the step turns NaN;
    an inf gradient makes the coefficient 0, so that element becomes inf * 0 = NaN and the
    rest do not move. Adam (amsgrad: max(max_sq, v) keeps the NaN) turns the NaN grad's
    element NaN and no other."""
    from rlx_numba.kernels import optim as O, warp as W
    gpu_minmax(O, W)
    w0 = np.linspace(-1.0, 1.0, 5).astype(np.float32)
    b0 = np.array([0.5, -0.25, 2.0], np.float32)
    e = np.array([0.3, -0.7, 1.1, 0.2, -0.4], np.float32)
    e[2] = INF if "inf" in case else NAN
    g = rlx.Graph()
    ein = g.input("e", (5,))
    w, b = g.param("w", (5,)), g.param("b", (3,))
    loss = g.reduce_sum(w * ein) + g.reduce_sum(w * w) * 0.5 + g.reduce_sum(b * b) * 0.5
    g.set_outputs([loss])
    sgd = case.startswith("sgd")
    opt = rlx.optim.SGD(lr=0.1) if sgd else rlx.optim.Adam(lr=0.1, amsgrad=True)
    tr = rlx.compile_train(g, loss, opt, clip_grad_norm=1.0 if sgd else None)
    tr.set_param("w", w0)
    tr.set_param("b", b0)
    tr.step({"e": e})
    grads = {"w": f64(e) + f64(w0), "b": f64(b0)}
    with np.errstate(all="ignore"):
        if sgd:
            total = np.sqrt(sum((gr ** 2).sum() for gr in grads.values()))
            coef = np.minimum(1.0 / (total + 1e-6), 1.0)          # torch.clamp: NaN stays
            want = {"w": f64(w0) - 0.1 * grads["w"] * coef, "b": f64(b0) - 0.1 * grads["b"] * coef}
        else:                              # step 1: m = 0.1 g, v = 1e-3 g^2, amsgrad's max
            want = {k: f64(p) - 0.1 / 0.1 * (0.1 * grads[k]) /
                    (np.sqrt(np.maximum(0.0, 1e-3 * grads[k] ** 2)) / np.sqrt(1e-3) + 1e-8)
                    for k, p in (("w", w0), ("b", b0))}
    nan_w = np.isnan(want["w"])
    assert nan_w[2] and (nan_w.all() if case == "sgd clip NaN" else nan_w.sum() == 1)
    for k in ("w", "b"):
        close(tr.get_param(k), want[k], "f32", f"{case} {k}")


SAMPLE_PATHS = {"small": (20, {}), "block a row": (40, {}), "top_k": (40, {"top_k": 3}),
                "top_p": (40, {"top_p": 0.9}), "segments": (1100, {})}


@pytest.mark.parametrize("path", list(SAMPLE_PATHS))
def test_sample_never_draws_nan_and_takes_an_inf(path, gpu_minmax):
    """sample's rule (ir/ops_sample.py; torch.multinomial refuses such rows): a NaN logit is
    never drawn, a row of NaNs gives 0, a +inf logit takes all the mass (exp(v - max) is 1
    there, 0 elsewhere), -inf logits none. Each plan of runtime/lower_sample.py, three seeds."""
    from rlx_numba.kernels import sample as S, warp as W
    from rlx_numba.runtime.lower_sample import _segments
    gpu_minmax(S, W)
    n, kw = SAMPLE_PATHS[path]
    if rlx.simulator_enabled():                      # (the simulator's plan)
        assert (_segments(4, n, 1)[0] >= 2) == (path == "segments")
    x = np.full((4, n), NAN, np.float32)
    x[0, [3, n - 2]] = (1.0, 0.5)                    # two tokens among NaNs
    x[2] = np.linspace(-5.0, -4.0, n)
    x[2, ::3] = NAN
    x[2, 7] = INF                                    # the only token with mass
    x[3] = -INF
    x[3, [5, 6]] = (0.25, NAN)                       # the only finite token
    x = _negative_nans(x)
    g = rlx.Graph()
    a, s = g.input("x", x.shape), g.input("seed", (1,), "i64")
    g.set_outputs([g.sample(a, seed=s, **kw)])
    exe = rlx.compile(g)
    for seed in (0, 1, 12345):
        (got,) = exe.run({"x": x, "seed": np.array([seed], np.int64)})
        assert got[0] in (3, n - 2) and got[1] == 0 and got[2] == 7 and got[3] == 5, (seed, got)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_linear_epilogues_carry_nan_and_inf(dtype):
    """linear's fused epilogue as torch's separate ops: relu(NaN) is NaN, relu(-inf) 0,
    gelu_tanh(-inf) = 0.5 * -inf * (1 + tanh(-inf)) is NaN (torch's formula), +inf stays; on a
    GPU the product and its bias + activation run in cuBLASLt's epilogue (tier 1), whose NaN
    rule is NVIDIA's, in the simulator in the numba GEMM's; the relu gradient passes dy at the
    NaNs (torch's threshold_backward)."""
    rng = np.random.default_rng(4)
    xv = np.round(rng.standard_normal((5, 8)), 2).astype(np.float32)
    xv[1, 3], xv[3, 0] = NAN, INF
    wv = np.round(rng.standard_normal((8, 6)), 2).astype(np.float32)
    wv[0] = np.where(wv[0] == 0, 0.5, wv[0])                     # row 3: +-inf in every column
    bv = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    xv, wv, bv = (t.astype(HOST[dtype]) for t in (xv, wv, bv))
    with np.errstate(all="ignore"):
        z = f64(xv) @ f64(wv) + f64(bv)
        relu = np.where(np.isnan(z), z, np.maximum(z, 0.0))
        gelu = 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
    g = rlx.Graph()
    x, w = g.input("x", xv.shape, dtype), g.input("w", wv.shape, dtype)
    b = g.input("b", (6,), dtype)
    yr = g.linear(x, w, b, activation="relu")
    yg = g.linear(x, w, b, activation="gelu_tanh")
    (dz,) = g.grad(yr, [b], seed=g.constant(np.ones(yr.shape, np.float32), dtype))
    g.set_outputs([yr, yg, dz])
    got_r, got_g, got_db = rlx.compile(g).run({"x": xv, "w": wv, "b": bv})
    assert np.isnan(relu[1]).all() and (relu[3] == 0).any() and np.isinf(relu[3]).any()
    assert np.isnan(gelu[3]).any()
    close(got_r, relu, dtype, f"{dtype} linear relu")
    close(got_g, gelu, dtype, f"{dtype} linear gelu_tanh")
    close(got_db, np.where(z <= 0, 0.0, 1.0).sum(0), dtype, f"{dtype} d bias")   # NaN: 1
