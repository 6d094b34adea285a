"""Element-wise fusion and epilogue folding (passes/fusion.py): fused == unfused == NumPy.

Each graph is compiled twice, with fusion (the default) and with RLX_NUMBA_FUSION=0; the
oracle is NumPy written here, computing every node in float64 and rounding it to the node's
dtype, as a stored tensor is.
"""
import math

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

BF16 = ml_dtypes.bfloat16
HOST = {"f32": np.float32, "f16": np.float16, "bf16": BF16, "i32": np.int32, "bool": np.bool_}
RANK = {"bool": 0, "i32": 1, "f16": 3, "bf16": 3, "f32": 4}


def compile_both(g, monkeypatch, **params):
    """(fused executable, unfused executable), params set on both."""
    exes = []
    for flag in ("1", "0"):
        monkeypatch.setenv("RLX_NUMBA_FUSION", flag)
        exe = rlx.compile(g)
        for k, v in params.items():
            exe.set_param(k, v)
        exes.append(exe)
    monkeypatch.delenv("RLX_NUMBA_FUSION")
    return exes


def kernels(exe):
    return [s for s in exe.steps if s.kernel_name.startswith("elementwise ")]


def erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def np_gelu(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def same(fused, unfused, tol):
    """Fused and unfused results: bit-equal in the simulator (same float32 operations); on a
    GPU the compiler may contract a fused a*b+c into an FMA, so within ``tol``."""
    for f, u in zip(fused, unfused):
        assert f.dtype == u.dtype and f.shape == u.shape
        floating = f.dtype.kind == "f" or f.dtype == BF16
        if floating:
            f, u = f.astype(np.float64), u.astype(np.float64)
        if ON_GPU and floating:
            np.testing.assert_allclose(f, u, **tol)
        else:
            np.testing.assert_array_equal(f, u)


# ---- a known graph -------------------------------------------------------------------------------
def test_gelu_of_affine_minus_y_is_one_kernel(rng, monkeypatch, tmp_path):
    g = rlx.Graph("known")
    x = g.input("x", (5, 7))
    w = g.input("w", (7,))            # broadcast along rows
    b = g.input("b", (5, 1))          # broadcast along columns
    y = g.input("y", (5, 7))
    out = g.gelu(x * w + b) - y
    g.set_outputs([out])
    nodes_before = [(n.op, n.inputs, n.shape) for n in g.nodes]
    fused, unfused = compile_both(g, monkeypatch)
    assert [(n.op, n.inputs, n.shape) for n in g.nodes] == nodes_before   # the graph is untouched
    assert len(fused.steps) == 1 and len(kernels(fused)) == 1
    assert len(unfused.steps) == 4 and len(kernels(unfused)) == 4
    ((root, members, src),) = fused.fused_regions
    assert root == out.id and members == [out.id - 3, out.id - 2, out.id - 1, out.id]
    assert "ew.gelu(" in src and "def kernel(out, in0, in1, in2, in3, n" in src
    assert "f32:full, f32:bcast, f32:bcast, f32:full" in src          # four leaves, two broadcast
    assert unfused.fused_regions == []
    feed = {"x": rng.standard_normal((5, 7)).astype(np.float32),
            "w": rng.standard_normal(7).astype(np.float32),
            "b": rng.standard_normal((5, 1)).astype(np.float32),
            "y": rng.standard_normal((5, 7)).astype(np.float32)}
    want = np_gelu(feed["x"].astype(np.float64) * feed["w"] + feed["b"]) - feed["y"]
    got_f, got_u = fused.run(feed), unfused.run(feed)
    np.testing.assert_allclose(got_f[0], want, rtol=1e-5, atol=1e-6)
    same(got_f, got_u, dict(rtol=1e-6, atol=1e-6))
    # the memory plan holds no intermediates; profile and trace see the one step
    rf, ru = fused.memory_report(), unfused.memory_report()
    assert rf["buffers"] == 5 and ru["buffers"] == 8 and rf["intermediate_bytes"] == 0
    assert ru["intermediate_bytes"] > 0 and rf["unshared_bytes"] < ru["unshared_bytes"]
    prof = fused.profile(feed)
    assert [r.name for r in prof] == [f"%{out.id} fused[{' '.join(f'%{m}' for m in members)}]"]


def test_off_switch_and_recompile(rng, monkeypatch):
    """RLX_NUMBA_FUSION=0 is read at compile time; the same graph compiles both ways."""
    g = rlx.Graph("switch")
    x = g.input("x", (3, 4))
    g.set_outputs([g.tanh(g.exp(x) * 2.0)])
    monkeypatch.setenv("RLX_NUMBA_FUSION", "0")
    assert len(rlx.compile(g).steps) == 3
    monkeypatch.setenv("RLX_NUMBA_FUSION", "1")
    exe = rlx.compile(g)
    assert len(exe.steps) == 1
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], np.tanh(np.exp(xv.astype(np.float64)) * 2),
                               rtol=1e-6)


# ---- what is never interior ----------------------------------------------------------------------
def test_node_used_twice_is_a_leaf_read_once(rng, monkeypatch):
    g = rlx.Graph("twice")
    x = g.input("x", (3, 5))
    w = g.input("w", (3, 5))
    t = x * w                             # read by gelu and by the add: materialised
    out = g.gelu(t) + t
    g.set_outputs([out])
    fused, unfused = compile_both(g, monkeypatch)
    assert len(fused.steps) == 2 and len(unfused.steps) == 3
    regions = fused.fused_regions
    assert [(r, m) for r, m, _ in regions] == [(out.id, [out.id - 1, out.id])]
    assert t.id not in fused.fusion.interior
    assert "def kernel(out, in0, n)" in regions[0][2]      # t is one kernel input, read once
    xv, wv = (rng.standard_normal((3, 5)).astype(np.float32) for _ in range(2))
    tv = xv.astype(np.float64) * wv
    got = fused.run({"x": xv, "w": wv})
    np.testing.assert_allclose(got[0], np_gelu(tv) + tv, rtol=1e-5, atol=1e-6)
    same(got, unfused.run({"x": xv, "w": wv}), dict(rtol=1e-6, atol=1e-6))


def test_outputs_and_views_are_boundaries(rng, monkeypatch):
    g = rlx.Graph("bounds")
    x = g.input("x", (4, 3))
    h = g.exp(x) * 0.5                    # an output: materialised though read once more
    y = g.sin(h) + 1.0
    r = g.reshape(g.neg(x), (3, 4))       # neg is read by a view: materialised
    z = g.relu(r) * 3.0
    c = g.cast(g.abs(x), "f32")           # same-dtype cast: a view
    v = g.sqrt(c)
    g.set_outputs([h, y, z, v])
    fused, unfused = compile_both(g, monkeypatch)
    interior = fused.fusion.interior
    assert h.id not in interior and r.id not in interior and c.id not in interior
    assert r.node.inputs[0] not in interior and c.node.inputs[0] not in interior
    assert len(fused.steps) == 6 and len(unfused.steps) == 9
    xv = rng.standard_normal((4, 3)).astype(np.float32)
    x64 = xv.astype(np.float64)
    want = [np.exp(x64) * 0.5, np.sin(np.exp(x64) * 0.5) + 1, np.maximum(-x64, 0).reshape(3, 4) * 3,
            np.sqrt(np.abs(x64))]
    got = fused.run({"x": xv})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    same(got, unfused.run({"x": xv}), dict(rtol=1e-6, atol=1e-7))


def test_broadcast_interior_node_stays_materialised(rng, monkeypatch):
    """An element-wise node smaller than its reader's output (broadcast later) is a leaf."""
    g = rlx.Graph("small_interior")
    a = g.input("a", (6,))
    b = g.input("b", (5, 6))
    s = g.tanh(a) * 2.0                    # [6], read by a [5, 6] add
    out = g.sigmoid(s + b)
    g.set_outputs([out])
    fused, unfused = compile_both(g, monkeypatch)
    assert s.id not in fused.fusion.interior
    assert [m for _, m, _ in fused.fused_regions] == [[out.id - 1, out.id], [s.id - 2, s.id]]
    av = rng.standard_normal(6).astype(np.float32)
    bv = rng.standard_normal((5, 6)).astype(np.float32)
    want = 1 / (1 + np.exp(-(np.tanh(av.astype(np.float64)) * 2 + bv)))
    got = fused.run({"a": av, "b": bv})
    np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-7)
    same(got, unfused.run({"a": av, "b": bv}), dict(rtol=1e-6, atol=1e-7))


def test_size_caps_split_a_long_chain(rng, monkeypatch):
    """41 tanh then 20 adds of distinct [3] inputs: the last 15 adds reach the leaf cap (15
    inputs and the chain), the next region the member cap, the rest is a third kernel."""
    from rlx_numba.passes import fusion
    n_tanh, n_add = fusion.MAX_MEMBERS + 9, fusion.MAX_LEAVES + 4
    g = rlx.Graph("long")
    x = g.input("x", (2, 3))
    xv = rng.standard_normal((2, 3)).astype(np.float32)
    feed, ref, h = {"x": xv}, xv.astype(np.float64), x
    for _ in range(n_tanh):
        h, ref = g.tanh(h), np.tanh(ref)
    for k in range(n_add):
        feed[f"c{k}"] = rng.standard_normal(3).astype(np.float32)
        h, ref = h + g.input(f"c{k}", (3,)), ref + feed[f"c{k}"]
    g.set_outputs([h])
    fused, unfused = compile_both(g, monkeypatch)
    regions = fused.fused_regions
    rest = n_tanh + n_add - (fusion.MAX_LEAVES - 1) - fusion.MAX_MEMBERS
    assert [len(m) for _, m, _ in regions] == [fusion.MAX_LEAVES - 1, fusion.MAX_MEMBERS, rest]
    assert [len(fused.fusion.regions[r].leaves) for r, _, _ in regions] == [fusion.MAX_LEAVES, 6, 1]
    assert len(fused.steps) == 3 and len(unfused.steps) == n_tanh + n_add
    got = fused.run(feed)
    np.testing.assert_allclose(got[0], ref, rtol=1e-5, atol=1e-6)
    same(got, unfused.run(feed), dict(rtol=1e-6, atol=1e-6))


# ---- dtypes --------------------------------------------------------------------------------------
def test_half_and_int32_intermediates_round_like_stored_tensors(rng, monkeypatch):
    """Interior f16/bf16 values are rounded and i32 values wrapped as if stored."""
    g = rlx.Graph("rounding")
    a = g.input("a", (4, 9), "f16")
    b = g.input("b", (4, 9), "f16")
    c = g.input("c", (9,), "bf16")
    i = g.input("i", (4, 9), "i32")
    j = g.input("j", (4, 1), "i32")
    h16 = (a + b) * a                       # f16 interior: rounded before the multiply
    hb = (c * c) + c                        # bf16 interior
    wrap = g.max(i * j, j) + i               # i * j overflows int32: the max sees it wrapped
    g.set_outputs([h16, hb, wrap, g.cast(wrap > 0, "f32") * h16])
    fused, unfused = compile_both(g, monkeypatch)
    assert len(fused.steps) == 4 and len(unfused.steps) == 10
    av, bv = (rng.uniform(-8, 8, (4, 9)).astype(np.float16) for _ in range(2))
    cv = rng.uniform(-3, 3, 9).astype(BF16)
    iv = rng.integers(-2**30, 2**30, (4, 9)).astype(np.int32)
    jv = rng.integers(2**3, 2**8, (4, 1)).astype(np.int32)
    feed = {"a": av, "b": bv, "c": cv, "i": iv, "j": jv}
    f16 = lambda v: np.asarray(v, np.float64).astype(np.float16)   # noqa: E731
    want16 = f16(f16(av.astype(np.float64) + bv) * av.astype(np.float64))
    c64 = cv.astype(np.float64)
    wantb = ((c64 * c64).astype(BF16).astype(np.float64) + c64).astype(BF16)
    ij = (iv.astype(np.int64) * jv).astype(np.int32)               # wraps
    wantw = (np.maximum(ij, jv).astype(np.int64) + iv).astype(np.int32)
    unwrapped = (np.maximum(iv.astype(np.int64) * jv, jv) + iv).astype(np.int32)
    assert (unwrapped != wantw).any()                                # the wrap matters here
    got = fused.run(feed)
    np.testing.assert_array_equal(got[0], want16)
    np.testing.assert_array_equal(got[1].astype(np.float64), wantb.astype(np.float64))
    np.testing.assert_array_equal(got[2], wantw)
    np.testing.assert_array_equal(got[3], (wantw > 0) * want16.astype(np.float32))
    same(got, unfused.run(feed), dict(rtol=1e-2, atol=1e-2))


_FLOAT_ACTS = {"tanh": np.tanh, "sigmoid": lambda v: 1 / (1 + np.exp(-v)), "gelu": np_gelu,
               "silu": lambda v: v / (1 + np.exp(-v)), "relu": lambda v: np.maximum(v, 0),
               "neg": np.negative, "abs": np.abs, "sin": np.sin, "atan": np.arctan}
_INT_ACTS = ("relu", "neg", "abs")
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum,
           "min": np.minimum}
_COMPARE = {"lt": np.less, "gt": np.greater, "ge": np.greater_equal, "ne": np.not_equal}


def _promote(a, b):
    if a == b:
        return a
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    return a if RANK[a] > RANK[b] else b


def _round(v, d):
    """float64 / int64 values stored as dtype d."""
    if d == "i32":
        return np.asarray(v).astype(np.int64).astype(np.int32)   # wraps
    return np.asarray(v).astype(HOST[d])


def _cast(v, src, d):
    if d == "bool":
        return v != 0
    if d == "i32" and src in ("f32", "f16", "bf16"):
        t = np.trunc(v.astype(np.float64))
        return np.clip(t, -2**31, 2**31 - 1).astype(np.int32)
    return v.astype(np.float64).astype(HOST[d]) if d != "i32" else v.astype(np.int32)


def _random_graph(rng, seed):
    """A random DAG of element-wise ops over odd broadcasting shapes and mixed dtypes; returns
    (graph, feed, outputs, oracle values, output has a half ancestor)."""
    g = rlx.Graph(f"random{seed}")
    leaves = [("a", (3, 7), "f32"), ("b", (7,), "f32"), ("c", (3, 1), "f32"), ("d", (1, 7), "f16"),
              ("e", (3, 7), "i32"), ("f", (7,), "bf16"), ("s", (1,), "f32")]
    ts, vals, dts, half = [], [], [], []
    feed = {}
    for name, shape, d in leaves:
        v = rng.integers(-4, 5, shape) if d == "i32" else rng.standard_normal(shape)
        v = v.astype(HOST[d])
        feed[name] = v
        ts.append(g.input(name, shape, d))
        vals.append(v)
        dts.append(d)
        half.append(d in ("f16", "bf16"))

    def pick(pred=lambda k: True, last=0.5):
        """The newest tensor (chains: fusable) with probability ``last``, else any."""
        ks = [k for k in range(len(ts)) if pred(k)]
        return ks[-1] if rng.random() < last else int(rng.choice(ks))

    for _ in range(18):
        r = rng.random()
        numeric = lambda k: dts[k] != "bool"   # noqa: E731
        if r < 0.25:
            k = pick(numeric)
            if dts[k] == "i32":
                kind = str(rng.choice(_INT_ACTS))
                t = g.activation(kind, ts[k])
                v = _round(_FLOAT_ACTS[kind](vals[k].astype(np.int64)), "i32")
                d = "i32"
            else:
                kind = str(rng.choice(list(_FLOAT_ACTS)))
                t = g.activation(kind, ts[k])
                d = dts[k]
                v = _round(_FLOAT_ACTS[kind](vals[k].astype(np.float64)), d)
            hf = half[k]
        elif r < 0.6:
            i, j = pick(numeric), pick(numeric, last=0)
            kind = str(rng.choice(list(_BINARY)))
            t = g.binary(kind, ts[i], ts[j])
            d = _promote(dts[i], dts[j])
            wide = np.int64 if d == "i32" else np.float64
            v = _round(_BINARY[kind](vals[i].astype(wide), vals[j].astype(wide)), d)
            hf = half[i] or half[j]
        elif r < 0.72:
            i, j = pick(numeric), pick(numeric)
            kind = str(rng.choice(list(_COMPARE)))
            t = g.compare(kind, ts[i], ts[j])
            v, d = _COMPARE[kind](vals[i].astype(np.float64), vals[j].astype(np.float64)), "bool"
            hf = half[i] or half[j]
        elif r < 0.85 and "bool" in dts:
            c = pick(lambda k: dts[k] == "bool")
            i, j = pick(numeric), pick(numeric)
            t = g.where(ts[c], ts[i], ts[j])
            d = _promote(dts[i], dts[j])
            v = np.where(vals[c], _cast(vals[i], dts[i], d), _cast(vals[j], dts[j], d))
            hf = half[c] or half[i] or half[j]
        else:
            k = pick()
            d = str(rng.choice([x for x in ("f32", "f16", "bf16", "i32") if x != dts[k]]))
            t = g.cast(ts[k], d)
            v = _cast(vals[k], dts[k], d)
            hf = half[k] or d in ("f16", "bf16")
        ts.append(t)
        vals.append(np.asarray(v).astype(HOST[d]) if d != "bool" else np.asarray(v))
        dts.append(d)
        half.append(hf)
    n_leaves = len(leaves)
    outs = sorted({len(ts) - 1} | {int(k) for k in rng.integers(n_leaves, len(ts), size=2)})
    g.set_outputs([ts[k] for k in outs])
    return g, feed, [vals[k] for k in outs], [half[k] for k in outs]


@pytest.mark.parametrize("seed", range(6))
def test_random_graphs_fused_equals_unfused_and_numpy(seed, monkeypatch):
    rng = np.random.default_rng(1000 + seed)
    g, feed, want, half = _random_graph(rng, seed)
    fused, unfused = compile_both(g, monkeypatch)
    assert fused.fused_regions, str(g)
    assert len(fused.steps) < len(unfused.steps)
    assert fused.memory_report()["buffers"] < unfused.memory_report()["buffers"]
    got = fused.run(feed)
    for o, w, h in zip(got, want, half):
        assert o.dtype == w.dtype, (o.dtype, w.dtype)
        if o.dtype.kind in "biu":
            np.testing.assert_array_equal(o, w)
        else:
            tol = 3e-2 if h else 1e-4
            np.testing.assert_allclose(o.astype(np.float64), w.astype(np.float64), rtol=tol,
                                       atol=tol)
    same(got, unfused.run(feed), dict(rtol=3e-2, atol=3e-2))


# ---- in-place writes -----------------------------------------------------------------------------
def test_read_before_kv_write_is_not_moved_after_it(rng, monkeypatch):
    """exp(cache) is built before a kv_write into the cache and read by a node after it: fused
    into that node it would read the new contents, so it stays materialised."""
    g = rlx.Graph("inplace")
    kc = g.param("cache", (1, 2, 5, 3))
    new = g.input("new", (1, 2, 1, 3))
    pos = g.input("pos", (1,), "i32")
    e = g.exp(kc)                                  # the old contents
    chain = g.tanh(new) * 2.0                      # read after the write too: no hazard
    k_all = g.kv_write(kc, new, pos)
    s = g.sum(k_all, (2, 3), keep_dim=True)        # [1, 2, 1, 1], after the write
    out = e * s + chain
    g.set_outputs([out])
    cv = rng.standard_normal((1, 2, 5, 3)).astype(np.float32)
    fused, unfused = compile_both(g, monkeypatch, cache=cv)
    assert e.id not in fused.fusion.interior
    assert [(r, m) for r, m, _ in fused.fused_regions] == [(out.id, [out.id - 1, out.id]),
                                                          (chain.id, [chain.id - 2, chain.id])]
    nv = rng.standard_normal((1, 2, 1, 3)).astype(np.float32)
    feed = {"new": nv, "pos": np.array([2], np.int32)}
    written = cv.astype(np.float64).copy()
    written[:, :, 2] = nv[:, :, 0]
    want = np.exp(cv.astype(np.float64)) * written.sum((2, 3), keepdims=True) + np.tanh(nv) * 2
    got = fused.run(feed)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-6)
    fused.set_param("cache", cv)                 # the write persisted: restore for a fair match
    same(fused.run(feed), unfused.run(feed), dict(rtol=1e-6, atol=1e-6))
    # without the hazard rule exp would be fused into the product and read the new cache
    from rlx_numba.passes import fusion
    monkeypatch.setattr(fusion, "_hazards", lambda *a: set())
    wrong = rlx.compile(g)
    wrong.set_param("cache", cv)
    assert e.id in wrong.fusion.interior
    assert not np.allclose(wrong.run(feed)[0], want, rtol=1e-3)


# ---- matmul epilogues ----------------------------------------------------------------------------
def _np_act(kind, v):
    return {None: v, "gelu": np_gelu(v), "relu": np.maximum(v, 0),
            "silu": v / (1 + np.exp(-v))}[kind]


@pytest.mark.parametrize("act,bias,residual,batched", [
    ("gelu", True, True, False), ("relu", True, False, True), (None, True, False, False),
    ("silu", False, True, False), (None, False, True, True), ("gelu", False, False, False)])
def test_matmul_epilogue_folds_into_the_product(rng, monkeypatch, act, bias, residual, batched):
    g = rlx.Graph("epilogue")
    xs = (2, 3, 9) if batched else (5, 9)
    x = g.input("x", xs)
    w = g.param("w", (2, 9, 6) if batched else (9, 6))
    b = g.param("b", (6,))
    r = g.input("r", xs[:-1] + (6,))
    h = x @ w
    h = h + b if bias else h
    h = g.activation(act, h) if act else h
    h = r + h if residual else h                  # either operand order
    g.set_outputs([h])
    wv = rng.standard_normal(w.shape).astype(np.float32)
    bv = rng.standard_normal(6).astype(np.float32)
    fused, unfused = compile_both(g, monkeypatch, w=wv, b=bv)
    (root, (kind, members)), = fused.fusion.folds.items()
    assert root == h.id and kind == "matmul epilogue"
    assert fused.fusion.nodes[h.id].op == "matmul" and fused.fused_regions == []
    assert set(members) - {h.id} <= fused.fusion.interior
    # the numba SGEMM (or cuBLAS) plus at most one epilogue kernel
    assert len(fused.steps) <= min(2, len(unfused.steps))
    xv = rng.standard_normal(xs).astype(np.float32)
    rv = rng.standard_normal(xs[:-1] + (6,)).astype(np.float32)
    ref = xv.astype(np.float64) @ wv + (bv if bias else 0)
    ref = _np_act(act, ref) + (rv if residual else 0)
    feed = {"x": xv, "r": rv}
    tol = dict(rtol=1e-5, atol=1e-5) if not ON_GPU else dict(rtol=1e-4, atol=1e-4)   # cuBLAS sums
    got = fused.run(feed)
    np.testing.assert_allclose(got[0], ref, **tol)
    np.testing.assert_allclose(got[0], unfused.run(feed)[0], **tol)
    # a half weight plans the folded product again: tier 0 on a GPU rounds x to bf16 too,
    # tier 3 and the simulator's f32 kernel over the rounded weight do not
    fused.set_param_half("w", wv, "bf16")
    wh = wv.astype(BF16).astype(np.float64)
    tier0 = any(s.info.get("tier") == 0 for s in fused.steps)
    xh = xv.astype(BF16).astype(np.float64) if tier0 else xv.astype(np.float64)
    ref_h = _np_act(act, xh @ wh + (bv if bias else 0)) + (rv if residual else 0)
    np.testing.assert_allclose(fused.run(feed)[0], ref_h, rtol=1e-4, atol=1e-4)


def test_matmul_epilogue_not_folded_when_not_exactly_linear(rng, monkeypatch):
    g = rlx.Graph("nofold")
    x = g.input("x", (4, 5))
    w = g.input("w", (5, 3))
    r = g.input("r", (4, 3))
    y = g.input("y", (4, 3))
    m1 = x @ w
    a = g.relu(m1 + r)                       # residual before the activation: not linear's order
    m2 = x @ w
    b = g.gelu(m2 + g.input("b", (3,))) - y  # more than the epilogue in the region
    m3 = x @ w
    c = g.tanh(m3) + m3                      # the product read twice
    g.set_outputs([a, b, c])
    fused, unfused = compile_both(g, monkeypatch)
    assert fused.fusion.folds == {}
    assert {r_ for r_, _, _ in fused.fused_regions} == {a.id, b.id, c.id}
    assert len(fused.steps) == 6 and len(unfused.steps) == 10
    xv = rng.standard_normal((4, 5)).astype(np.float32)
    wv = rng.standard_normal((5, 3)).astype(np.float32)
    rv, yv = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(2))
    bv = rng.standard_normal(3).astype(np.float32)
    mm = xv.astype(np.float64) @ wv
    want = [np.maximum(mm + rv, 0), np_gelu(mm + bv) - yv, np.tanh(mm) + mm]
    feed = {"x": xv, "w": wv, "r": rv, "y": yv, "b": bv}
    got = fused.run(feed)
    for o, w_ in zip(got, want):
        np.testing.assert_allclose(o, w_, rtol=1e-5, atol=1e-5)
    same(got, unfused.run(feed), dict(rtol=1e-6, atol=1e-6))


def test_sum_of_two_products_folds_one_of_them(rng, monkeypatch):
    """x @ w + h @ u (an LSTM gate): one product takes the add as its residual, once."""
    g = rlx.Graph("two_products")
    x, h = g.input("x", (3, 5)), g.input("h", (3, 4))
    w, u = g.input("w", (5, 6)), g.input("u", (4, 6))
    y = x @ w + h @ u
    g.set_outputs([y, g.softmax(y)])
    fused, unfused = compile_both(g, monkeypatch)
    assert len(fused.fusion.folds) == 1
    feed = {k: rng.standard_normal(s_).astype(np.float32)
            for k, s_ in (("x", (3, 5)), ("h", (3, 4)), ("w", (5, 6)), ("u", (4, 6)))}
    want = feed["x"].astype(np.float64) @ feed["w"] + feed["h"].astype(np.float64) @ feed["u"]
    got = fused.run(feed)
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    same(got, unfused.run(feed), dict(rtol=1e-6, atol=1e-6))


# ---- residual + norm -----------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_residual_add_folds_into_the_norm(rng, monkeypatch, op):
    g = rlx.Graph("prenorm")
    x = g.input("x", (3, 5, 17))
    r = g.input("r", (3, 5, 17))
    gamma = g.param("gamma", (17,))
    beta = g.param("beta", (17,))
    y = getattr(g, op)(x + r, gamma, beta)
    g.set_outputs([y])
    gv, bv = (rng.standard_normal(17).astype(np.float32) for _ in range(2))
    fused, unfused = compile_both(g, monkeypatch, gamma=gv, beta=bv)
    assert fused.fusion.folds == {y.id: ("norm residual", (y.id - 1, y.id))}
    assert len(fused.steps) == 1 and len(unfused.steps) == 2
    assert fused.memory_report()["buffers"] == unfused.memory_report()["buffers"] - 1
    xv, rv = (rng.standard_normal((3, 5, 17)).astype(np.float32) for _ in range(2))
    h = xv.astype(np.float64) + rv
    if op == "layer_norm":
        want = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5) * gv + bv
    else:
        want = h / np.sqrt((h * h).mean(-1, keepdims=True) + 1e-6) * gv + bv
    got = fused.run({"x": xv, "r": rv})
    np.testing.assert_allclose(got[0], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[0], unfused.run({"x": xv, "r": rv})[0], rtol=1e-6, atol=1e-6)


def test_norm_residual_add_is_peeled_off_its_region(rng, monkeypatch):
    """norm(P + r) with P fused into the add: P gets its own kernel and the add folds into the
    norm (as many steps); a P that is a matmul's epilogue then folds into the product too.
    With both operands fused into the add, nothing changes."""
    g = rlx.Graph("peel")
    x = g.input("x", (3, 8))
    r = g.input("r", (3, 8))
    w = g.input("w", (8, 8))
    b = g.input("b", (8,))
    gamma = g.param("gamma", (8,))
    p1 = g.exp(x) * 2.0
    y1 = g.layer_norm(p1 + r, gamma)
    p2 = (x @ w + b) + r                      # a linear with bias and residual
    y2 = g.rms_norm(p2 + x, gamma)
    y3 = g.rms_norm(g.tanh(x) + g.sin(r), gamma)
    m4 = x @ w                                # the norm, not the product, takes the residual
    y4 = g.layer_norm(m4 + r, gamma)
    m5 = x @ w
    y5 = g.layer_norm(g.relu(m5 + b) + r, gamma)
    g.set_outputs([y1, y2, y3, y4, y5])
    gv = rng.standard_normal(8).astype(np.float32)
    fused, unfused = compile_both(g, monkeypatch, gamma=gv)
    assert fused.fusion.folds == {y1.id: ("norm residual", (y1.id - 1, y1.id)),
                                  p2.id: ("matmul epilogue", (p2.id - 2, p2.id - 1, p2.id)),
                                  y2.id: ("norm residual", (y2.id - 1, y2.id)),
                                  y4.id: ("norm residual", (y4.id - 1, y4.id)),
                                  y5.id - 2: ("matmul epilogue", (m5.id, y5.id - 3, y5.id - 2)),
                                  y5.id: ("norm residual", (y5.id - 1, y5.id))}
    y3_add = y3.node.inputs[0]
    assert [(r_, m) for r_, m, _ in fused.fused_regions] == [
        (y3_add, [y3_add - 2, y3_add - 1, y3_add]), (p1.id, [p1.id - 2, p1.id])]
    # p1: 1 + norm; p2: GEMM + epilogue (one Lt call on a GPU) + norm; y3: 1 + norm;
    # y4: GEMM + norm; y5: GEMM + epilogue (one Lt call on a GPU) + norm
    assert len(fused.steps) <= 12 and len(unfused.steps) == 21
    xv, rv = (rng.standard_normal((3, 8)).astype(np.float32) for _ in range(2))
    wv = rng.standard_normal((8, 8)).astype(np.float32)
    bv = rng.standard_normal(8).astype(np.float32)
    x64 = xv.astype(np.float64)
    rms = lambda v: v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * gv   # noqa: E731
    ln = lambda v: (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5) * gv
    want = [ln(np.exp(x64) * 2 + rv),
            rms(x64 @ wv + bv + rv + x64), rms(np.tanh(x64) + np.sin(rv)),
            ln(x64 @ wv + rv), ln(np.maximum(x64 @ wv + bv, 0) + rv)]
    feed = {"x": xv, "r": rv, "w": wv, "b": bv}
    got = fused.run(feed)
    tol = dict(rtol=1e-5, atol=1e-5) if not ON_GPU else dict(rtol=1e-4, atol=1e-4)
    for o, w_ in zip(got, want):
        np.testing.assert_allclose(o, w_, **tol)
    for o, u in zip(got, unfused.run(feed)):
        np.testing.assert_allclose(o, u, **tol)


def test_norm_residual_not_folded_for_broadcast_or_shared_add(rng, monkeypatch):
    g = rlx.Graph("noprenorm")
    x = g.input("x", (4, 8))
    bias = g.input("bias", (8,))
    gamma = g.param("gamma", (8,))
    h1 = x + bias                            # broadcast: not a residual
    y1 = g.rms_norm(h1, gamma)
    h2 = g.exp(x) + g.sin(x)                 # both operands fused into the add
    y2 = g.layer_norm(h2, gamma)
    h3 = x + bias * 0.0 + x                  # read by the norm and kept as an output
    y3 = g.rms_norm(h3, gamma)
    g.set_outputs([y1, y2, y3, h3])
    gv = rng.standard_normal(8).astype(np.float32)
    fused, unfused = compile_both(g, monkeypatch, gamma=gv)
    assert fused.fusion.folds == {}
    xv = rng.standard_normal((4, 8)).astype(np.float32)
    bv = rng.standard_normal(8).astype(np.float32)
    x64 = xv.astype(np.float64)
    rms = lambda v: v / np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6) * gv   # noqa: E731
    ln = lambda v: (v - v.mean(-1, keepdims=True)) / np.sqrt(v.var(-1, keepdims=True) + 1e-5) * gv
    want = [rms(x64 + bv), ln(np.exp(x64) + np.sin(x64)), rms(2 * x64), 2 * x64]
    got = fused.run({"x": xv, "bias": bv})
    for o, w_ in zip(got, want):
        np.testing.assert_allclose(o, w_, rtol=1e-5, atol=1e-5)
    same(got, unfused.run({"x": xv, "bias": bv}), dict(rtol=1e-6, atol=1e-6))


# ---- residual epilogues: linear(...) + r, a half matmul + r ---------------------------------
@pytest.mark.parametrize("d", ["f32", "f16", "bf16"])
def test_linear_residual_add_folds_into_the_product(rng, monkeypatch, d):
    """linear(x, w, c) + r, gelu-linear + r and (half) matmul + r, r and the add of the
    product's dtype: the product with residual=r (cuBLASLt's C, beta = 1, where there is no
    activation), the add's kernel gone. A half result is rounded once where the graph as written
    rounds twice, so the oracle is float64 over the half inputs with one rounding (k = 2
    allows the simulator's f32 sums); the unfolded half graph is within one more rounding."""
    from halfref import assert_half_close, rounded
    g = rlx.Graph("linres")
    x, r = g.input("x", (3, 37), d), g.input("r", (3, 6), d)
    w, c = g.input("w", (37, 6), d), g.input("c", (6,), d)
    y1 = g.linear(x, w, c) + r
    y2 = r + g.linear(x, w, c, activation="gelu")        # either operand order
    y3 = g.matmul(x, w) + r
    g.set_outputs([y1, y2, y3])
    fused, unfused = compile_both(g, monkeypatch)
    prods = [t.node.inputs[0] if t is not y2 else t.node.inputs[1] for t in (y1, y2, y3)]
    want_folds = {t.id: ("residual epilogue", (p, t.id)) for t, p in zip((y1, y2, y3), prods)}
    if d == "f32":      # an f32 matmul + r is a matmul epilogue (passes/fusion.py, as before)
        want_folds[y3.id] = ("matmul epilogue", (prods[2], y3.id))
    assert fused.fusion.folds == want_folds
    # each add's kernel is gone; the simulator's matmul + r takes an epilogue kernel instead
    # (its numba SGEMM fuses nothing), a GPU's cuBLASLt none
    assert len(fused.steps) == len(unfused.steps) - (3 if ON_GPU else 2)
    assert not any(s.name.endswith("binary.add") for s in fused.steps)
    feed = {k: rounded(rng.standard_normal(s_), d) for k, s_ in
            (("x", (3, 37)), ("r", (3, 6)), ("w", (37, 6)), ("c", (6,)))}
    X, R, W, C = (feed[k].astype(np.float64) for k in ("x", "r", "w", "c"))
    want = [X @ W + C + R, np_gelu(X @ W + C) + R, X @ W + R]
    got, ref = fused.run(feed), unfused.run(feed)
    for o, u, w_, name in zip(got, ref, want, ("linear + r", "r + gelu-linear", "matmul + r")):
        if d == "f32":
            np.testing.assert_allclose(o, w_, rtol=1e-5, atol=1e-5)
        else:
            assert_half_close(o, w_, d, k=2, what=f"folded {name}")
            assert_half_close(u, w_, d, k=3, what=f"unfolded {name}")


def test_residual_add_not_folded_with_promotion_or_a_shared_product(rng, monkeypatch):
    """No fold when the add promotes (bf16 product + f32 r: autocast's residual stream), when
    r broadcasts, or when the product has another reader."""
    g = rlx.Graph("noresfold")
    x, w = g.input("x", (3, 8), "bf16"), g.input("w", (8, 4), "bf16")
    r32, rb = g.input("r", (3, 4)), g.input("rb", (4,), "bf16")
    y1 = g.linear(x, w) + r32
    y2 = g.linear(x, w) + rb
    p = g.linear(x, w)
    y3 = p + g.input("r3", (3, 4), "bf16")
    g.set_outputs([y1, y2, y3, p])
    fused = rlx.compile(g)
    assert fused.fusion.folds == {}
    assert y1.dtype == rlx.dtype("f32")


def test_half_vit_and_bert_layer_step_counts(monkeypatch):
    """The element-wise kernels of a tiny two-layer ViT (bf16) and BERT (f16) as the models
    compile them (Graph.to_dtype of the f32 graph): a ViT's residual adds x + o_proj(...) and
    x + mlp(...) ride in their products (three of them: the last one is the final norm's
    residual), so 46 steps became 43 (f32: 44 -> 41). BERT's adds are its norms' residuals
    already: 29 steps, one gelu epilogue a layer (on a GPU cuBLASLt writes the product + bias
    in f16 and that kernel runs in place on it)."""
    # the simulator's tiers on a GPU too (cuBLASLt, cuDNN attention and convolutions plan
    # other step counts)
    for var, tiers in (("MATMUL", "4"), ("ATTENTION", "2"), ("CONV", "2")):
        monkeypatch.setenv(f"RLX_NUMBA_{var}_TIERS", tiers)
    from rlx_numba.models import BertConfig, ViTConfig
    from rlx_numba.models.bert import build_bert
    from rlx_numba.models.executables import in_dtype
    from rlx_numba.models.vision import build_vit
    cfg = ViTConfig(image_size=8, patch_size=4, hidden_dim=8, num_layers=2, num_heads=2,
                    mlp_dim=12, num_classes=5)
    vit = {d: rlx.compile(in_dtype(build_vit(cfg, 2), d)) for d in ("bf16", "f32")}
    assert len(vit["bf16"].steps) == 43 and len(vit["f32"].steps) == 41
    folds = [k for k, _ in vit["bf16"].fusion.folds.values()]
    assert folds.count("residual epilogue") == 3, vit["bf16"].fusion.folds
    bcfg = BertConfig(vocab_size=41, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                      intermediate_size=44, max_position_embeddings=24, type_vocab_size=2,
                      layer_norm_eps=1e-12)
    bert = rlx.compile(in_dtype(build_bert(bcfg, 2, 7, pooling=("mean",), normalize=True), "f16"))
    assert len(bert.steps) == 29
    gelu = [s for s in bert.steps if "activation.gelu" in s.kernel_name]
    assert len(gelu) == 1 and gelu[0].name.endswith("linear epilogue")
