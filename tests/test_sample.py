"""topk and sample against oracles written here in NumPy / plain Python.

topk: random rows of 1 to 5000 with k = 1, 3, ..., n (every kernel path: a thread per row,
one or two stages, sorting in shared or global memory), ties, NaN/inf/-0.0, every axis
(negative too), f16/bf16, values bit for bit and indices.

sample: Philox4x32-10 against Random123's known answers (in the kernel and in the Python
oracle), then the exact token of every row against an oracle that draws with the same Philox
uniform (rows whose uniform lies within 1e-5 of a CDF step or whose top_p cut is that close
are skipped: float rounding may go either way there), greedy == argmax, determinism, seeds as
ints and as run() inputs, a chi-square test of the frequencies of many draws from one small
vocabulary, NaN/inf logits, and the errors."""
import math

import ml_dtypes
import numpy as np
import pytest
from conftest import ON_GPU, run_graph
from numba import cuda  # after conftest, which imports rlx_numba (GPU or simulator) first

import rlx_numba as rlx
from rlx_numba.kernels import sample as sample_kernels

BF16 = ml_dtypes.bfloat16
M32 = 0xFFFFFFFF


# ---- oracles ---------------------------------------------------------------------------------
def topk_oracle(x, k, axis=-1):
    """(values, indices): descending, ties to the smaller index, NaN above every number
    (several: by index), -0.0 == 0.0."""
    xm = np.moveaxis(x, axis, -1)
    f = xm.astype(np.float64)
    nan = np.isnan(f)
    idx = np.broadcast_to(np.arange(f.shape[-1]), f.shape)
    order = np.lexsort((idx, -np.where(nan, 0.0, f), ~nan))[..., :k]   # last key is primary
    vals = np.take_along_axis(xm, order, -1)
    return np.moveaxis(vals, -1, axis), np.moveaxis(order, -1, axis)


def philox4x32_10(ctr, key):
    """Random123's philox4x32_10 from the paper's description, on Python ints."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & M32, (p0 >> 32) ^ c3 ^ k1, p0 & M32
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return c0, c1, c2, c3


# Random123 tests/kat_vectors, the philox4x32 10 lines: counter, key, expected
KAT = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
       ((M32,) * 4, (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]


def row_uniform(row, seed):
    """The documented draw of a row: Philox word 0 at counter (row, 0, 0, 0), key = seed."""
    s = seed % 2**64
    return philox4x32_10((row & M32, row >> 32, 0, 0), (s & M32, s >> 32))[0] / 2**32


def sample_oracle(logits, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """(ids, margins) in float64: softmax(logits / T); top_k largest (ties: smaller index);
    top_p: the shortest prefix (by probability, then index) whose mass reaches top_p of the
    top_k mass; the first token in index order whose running kept mass exceeds u * total.
    margin: distance of the draw (and of the top_p cut) to the nearest boundary, relative."""
    v = logits.shape[-1]
    x = logits.reshape(-1, v).astype(np.float64)
    ids = np.zeros(len(x), np.int64)
    margins = np.full(len(x), np.inf)
    for r, row in enumerate(x):
        nan = np.isnan(row)
        if nan.all():
            continue                                   # id 0
        mx = row[~nan].max()
        with np.errstate(invalid="ignore", over="ignore"):
            w = np.exp((row - mx) / temperature)
        w[row == mx] = 1.0
        w[nan] = 0.0
        order = np.lexsort((np.arange(v), -np.where(nan, -np.inf, row), nan))   # NaN last
        kept = order[:top_k] if 0 < top_k < v else order
        if top_p < 1:
            cum = np.cumsum(w[kept])
            cut = top_p * cum[-1]
            j = int(np.searchsorted(cum, cut))         # first prefix whose mass reaches it
            margins[r] = min(abs(cum[j] - cut), abs(cut - cum[j - 1]) if j else np.inf) / cum[-1]
            kept = kept[:j + 1]
        wk = np.zeros(v)
        wk[kept] = w[kept]
        cdf = np.cumsum(wk)
        t = row_uniform(r, seed) * cdf[-1]
        i = int(np.searchsorted(cdf, t, side="right"))
        lo = cdf[i - 1] if i else 0.0
        margins[r] = min(margins[r], (cdf[i] - t) / cdf[-1], (t - lo) / cdf[-1])
        ids[r] = i
    return ids.reshape(logits.shape[:-1]), margins.reshape(logits.shape[:-1])


def _topk_run(x, k, axis=-1, dtype=None):
    g = rlx.Graph("topk_test")
    v, i = g.topk(g.input("x", x.shape, dtype or rlx.dtype(x.dtype)), k, axis)
    g.set_outputs([v, i])
    return run_graph(g, {"x": x})


def _check_topk(x, k, axis=-1, dtype=None):
    v, i = _topk_run(x, k, axis, dtype)
    rv, ri = topk_oracle(x, k, axis)
    assert i.dtype == np.int64 and v.dtype == x.dtype and v.shape == rv.shape
    np.testing.assert_array_equal(i, ri)
    bits = {2: np.uint16, 4: np.uint32}[x.dtype.itemsize]
    np.testing.assert_array_equal(v.view(bits), rv.view(bits))   # the elements themselves


def _sample_run(logits, dtype=None, **kw):
    g = rlx.Graph("sample_test")
    g.set_outputs([g.sample(g.input("x", logits.shape, dtype or rlx.dtype(logits.dtype)), **kw)])
    (ids,) = run_graph(g, {"x": logits})
    return ids


def _check_sample(logits, min_checked=0.8, **kw):
    ids = _sample_run(logits, **kw)
    ref, margin = sample_oracle(logits.astype(np.float64), **kw)
    assert ids.dtype == np.int64 and ids.shape == logits.shape[:-1]
    ok = margin > 1e-5
    assert ok.mean() >= min_checked, margin
    np.testing.assert_array_equal(ids[ok], ref[ok])
    return ids


# ---- topk ------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows,n,k", [
    (3, 1, 1), (4, 7, 1), (4, 7, 3), (4, 7, 7),        # a thread per row
    (3, 1000, 1), (2, 1000, 3),                         # two stages (segments, then candidates)
    (1, 1000, 1000),                                    # one stage, sorted in global memory
    (2, 300, 50),                                       # one stage, sorted in shared memory
    (1, 5000, 1), (2, 5000, 3),
    (1, 5000, 300),                                     # unstaged source, global sort
] + ([(2, 5000, 5000), (3, 131072, 64), (2, 40000, 2500)] if ON_GPU else []))
def test_topk_random(rng, rows, n, k):
    _check_topk(rng.standard_normal((rows, n)).astype(np.float32), k)


@pytest.mark.parametrize("rows,n,k", [(5, 9, 4), (3, 1000, 3), (2, 1000, 700), (2, 2000, 10)])
def test_topk_ties(rng, rows, n, k):
    # few distinct values: the k-th value is shared by many, so the index bits decide
    _check_topk(rng.integers(-2, 3, (rows, n)).astype(np.float32), k)


def test_topk_all_equal():
    x = np.full((2, 600), 1.5, np.float32)
    _, i = _topk_run(x, 5)
    np.testing.assert_array_equal(i, [[0, 1, 2, 3, 4]] * 2)
    _check_topk(np.zeros((3, 20), np.float32), 20)


@pytest.mark.parametrize("n,k", [(12, 5), (200, 9)])
def test_topk_nan_inf_zero(rng, n, k):
    x = rng.standard_normal((3, n)).astype(np.float32)
    x[0, [2, 7, 9]] = np.nan                       # NaNs first, by index
    x[0, 3] = np.inf
    x[1, :] = -np.inf
    x[1, [4, 6]] = [np.nan, -np.nan]
    x[2, :] = np.where(np.arange(n) % 2, -0.0, 0.0)   # -0.0 == 0.0: by index
    x[2, 5] = np.float32(1e-38)
    _check_topk(x, k)
    v, i = _topk_run(x, k)
    assert list(i[0, :4]) == [2, 7, 9, 3] and np.isnan(v[0, :3]).all() and v[0, 3] == np.inf
    assert list(i[1, :3]) == [4, 6, 0]
    assert list(i[2, :3]) == [5, 0, 1]


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -2, -3])
def test_topk_axes(rng, axis):
    x = rng.standard_normal((3, 40, 5)).astype(np.float32)
    _check_topk(x, 3, axis)


def test_topk_1d_and_k_equal_n(rng):
    _check_topk(rng.standard_normal(33).astype(np.float32), 33)
    _check_topk(rng.standard_normal(33).astype(np.float32), 2, axis=0)


@pytest.mark.parametrize("host,name", [(np.float16, "f16"), (BF16, "bf16")])
def test_topk_half(rng, host, name):
    x = (rng.standard_normal((3, 200)) * 4).astype(host)   # half rounding makes ties
    _check_topk(x, 7, dtype=name)
    _check_topk(x[:, :9], 4, dtype=name)
    _check_topk(np.ascontiguousarray(x[:, :40].T), 2, axis=0, dtype=name)   # via a transpose


def test_topk_i32(rng):
    """i32 (as torch.topk): full range, many ties (to the smaller index), a middle axis."""
    x = rng.integers(-2**31, 2**31 - 1, (3, 40, 2), dtype=np.int64).astype(np.int32)
    x[0, :5, 0] = [2**31 - 1, -2**31, 7, 7, 2**31 - 1]
    x[1, :, 1] = 3                                            # all ties
    _check_topk(x, 6, axis=1)
    _check_topk(x[:, :, 0].copy(), 40)


# ---- Philox ----------------------------------------------------------------------------------
def test_philox_known_answers_python_oracle():
    for ctr, key, want in KAT:
        assert philox4x32_10(ctr, key) == want


def test_philox_known_answers_kernel():
    ctr = np.array([c for c, _, _ in KAT], np.uint64)
    key = np.array([k for _, k, _ in KAT], np.uint64)
    out = cuda.to_device(np.zeros((len(KAT), 4), np.uint64))
    sample_kernels.philox_kernel[1, 16](out, cuda.to_device(ctr), cuda.to_device(key),
                                        np.uint64(len(KAT)))
    np.testing.assert_array_equal(out.copy_to_host(), np.array([w for _, _, w in KAT]))


# ---- sample: the exact draws -----------------------------------------------------------------
SMALL_CASES = [{}, {"top_k": 3}, {"top_p": 0.6}, {"top_k": 5, "top_p": 0.8},
               {"temperature": 0.5, "seed": 3},
               {"temperature": 3.0, "top_p": 0.9, "seed": 2**40 + 1}]


@pytest.mark.parametrize("kw", SMALL_CASES)
def test_sample_exact_short_rows(rng, kw):      # a thread per row
    _check_sample((rng.standard_normal((3, 4, 8)) * 2).astype(np.float32), **kw)


@pytest.mark.parametrize("shape,kw", [
    ((2, 3, 40), {}),
    ((2, 3, 40), {"top_p": 0.7, "seed": 11}),
    ((5, 100), {"temperature": 0.7, "top_k": 10, "seed": -1}),
    ((4, 300), {"top_k": 20, "top_p": 0.8, "seed": 5}),
    ((3, 1000), {"top_k": 5, "seed": 7}),           # top_k through two topk stages
    ((2, 1000), {"temperature": 2.0, "seed": 9}),   # no filter: segments, then the pick
    ((1, 3000), {"seed": 13}),
])
def test_sample_exact_long_rows(rng, shape, kw):   # a block per row
    _check_sample((rng.standard_normal(shape) * 3).astype(np.float32), **kw)


def test_sample_paths_agree(rng, monkeypatch):
    """Weights are exact fixed-point integers: the segmented path (segment maxima and masses,
    then a block per row) and the block-per-row path draw the very same tokens."""
    from rlx_numba.runtime import lower_sample
    x = (rng.standard_normal((3, 1500)) * 2).astype(np.float32)
    g = rlx.Graph("paths")
    g.set_outputs([g.sample(g.input("x", x.shape, "f32"), temperature=1.3, seed=21)])
    # the segment plan depends on the device (SM count): force three segments of 512
    monkeypatch.setattr(lower_sample, "_segments", lambda rows, n, k: (3, 512))
    exe = rlx.compile(g)
    assert any("sample_pick" in s.kernel_name for s in exe.steps)
    monkeypatch.setattr(lower_sample, "_segments", lambda rows, n, k: (1, n))
    exe1 = rlx.compile(g)
    assert any("sample_rows" in s.kernel_name for s in exe1.steps)
    np.testing.assert_array_equal(exe.run({"x": x})[0], exe1.run({"x": x})[0])


def test_top_p_keeps_the_head():
    # probabilities 0.2 0.4 0.1 0.3: top_p 0.65 keeps 0.4 and 0.3; 0.75 adds 0.2; never 0.1
    for pos in ([0, 1, 2, 3], [5, 11, 23, 37]):    # a thread per row; a block per row
        row = np.full(pos[-1] + 1, -np.inf, np.float32)
        row[pos] = np.log([0.2, 0.4, 0.1, 0.3])
        rows = np.tile(row, (24 if len(row) <= 32 else 10, 1))
        assert set(_sample_run(rows, top_p=0.65, seed=8)) == {pos[1], pos[3]}
        assert set(_sample_run(rows, top_p=0.75, seed=8)) == {pos[0], pos[1], pos[3]}


@pytest.mark.parametrize("host,name", [(np.float16, "f16"), (BF16, "bf16")])
def test_sample_half(rng, host, name):
    x = (rng.standard_normal((4, 50)) * 2).astype(host)
    ids = _sample_run(x, dtype=name, top_k=8, seed=4)
    ref, margin = sample_oracle(x.astype(np.float64), top_k=8, seed=4)
    np.testing.assert_array_equal(ids[margin > 1e-5], ref[margin > 1e-5])


def test_greedy_is_argmax(rng):
    x = rng.integers(-3, 3, (6, 50)).astype(np.float32)   # ties: the first index wins
    x8 = x[:, :8]
    for logits in (x, x8):
        ref = np.argmax(logits, -1)
        np.testing.assert_array_equal(_sample_run(logits, temperature=0.0), ref)
        np.testing.assert_array_equal(_sample_run(logits, temperature=0.7, top_k=1, seed=3), ref)
    g = rlx.Graph("greedy")
    s = g.sample(g.input("x", (2, 5), "f32"), temperature=0)
    assert s.node.op == "argmax" and s.shape == (2,)


def test_sample_determinism_and_seeds(rng):
    x = rng.standard_normal((64, 8)).astype(np.float32) * 0.1   # close to uniform
    g = rlx.Graph("det")
    xi = g.input("x", x.shape, "f32")
    g.set_outputs([g.sample(xi, seed=1), g.sample(xi, seed=2)])
    exe1, exe2 = rlx.compile(g), rlx.compile(g)
    a1, b1 = exe1.run({"x": x})
    a2, b2 = exe1.run({"x": x})
    a3, b3 = exe2.run({"x": x})
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(a1, a3)
    np.testing.assert_array_equal(b1, b3)
    assert (a1 != b1).sum() > 32          # independent draws agree 1/8 of the time


@pytest.mark.parametrize("dtype,shape", [("i64", ()), ("i32", (1,))])
def test_seed_tensor(rng, dtype, shape):
    x = rng.standard_normal((16, 8)).astype(np.float32)
    g = rlx.Graph("seeded")
    seed = g.input("seed", shape, dtype)
    g.set_outputs([g.sample(g.input("x", x.shape, "f32"), top_p=0.9, seed=seed)])
    exe = rlx.compile(g)
    host = np.int64 if dtype == "i64" else np.int32
    seen = []
    for s in (0, 12345, -7, 2**31 - 1):
        (ids,) = exe.run({"x": x, "seed": np.full(shape, s, host)})
        ref, margin = sample_oracle(x, top_p=0.9, seed=s)
        np.testing.assert_array_equal(ids[margin > 1e-5], ref[margin > 1e-5])
        np.testing.assert_array_equal(ids, _sample_run(x, top_p=0.9, seed=s))   # == int seed
        seen.append(ids)
    assert any((seen[0] != s).any() for s in seen[1:])


# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.mark.parametrize("kw", [{"temperature": 0.8}, {"top_k": 5, "seed": 1},
                                {"top_p": 0.75, "seed": 2}, {"top_k": 6, "top_p": 0.9, "seed": 3}])
def test_sample_frequencies(kw):
    """N identical rows are N independent draws (each row has its own Philox counter)."""
    n = 1500
    row = np.array([1.0, 2.5, 0.2, 2.0, -1.0, 0.7, 1.5, -0.3], np.float32)
    ids = _sample_run(np.tile(row, (n, 1)), **kw)
    t = kw.get("temperature", 1.0)
    p = np.exp((row - row.max()) / t)
    order = np.argsort(-row, kind="stable")
    keep = order[:kw["top_k"]] if "top_k" in kw else order
    if "top_p" in kw:
        cum = np.cumsum(p[keep]) / p[keep].sum()
        keep = keep[:int(np.searchsorted(cum, kw["top_p"])) + 1]
    q = np.zeros(8)
    q[keep] = p[keep] / p[keep].sum()
    counts = np.bincount(ids, minlength=8)
    assert counts[q == 0].sum() == 0, (counts, q)      # filtered tokens never appear
    exp = q[q > 0] * n
    chi2 = ((counts[q > 0] - exp) ** 2 / exp).sum()
    assert chi2 < CHI2_999[len(exp) - 1], (chi2, counts, exp)


@pytest.mark.parametrize("v", [8, 40])
def test_sample_nan_inf(rng, v):
    x = rng.standard_normal((6, v)).astype(np.float32)
    x[0, ::2] = np.nan                      # never drawn
    x[1, :] = np.nan                        # nothing to draw: 0
    x[2, :] = -np.inf
    x[2, 5] = 0.0                           # the only token with weight
    x[3, [1, 6]] = np.inf                   # +inf: those two, uniformly
    x[4, :] = -np.inf                       # all -inf: uniform
    x[5, :] = x[5, 3]                       # all equal: uniform
    ids = _sample_run(x, seed=5)
    ref, margin = sample_oracle(x, seed=5)
    np.testing.assert_array_equal(ids[margin > 1e-5], ref[margin > 1e-5])
    assert ids[0] % 2 == 1 and ids[1] == 0 and ids[2] == 5 and ids[3] in (1, 6)
    ids = _sample_run(x, seed=5, top_k=3, top_p=0.5)
    assert ids[0] % 2 == 1 and ids[1] == 0 and ids[2] == 5 and ids[3] in (1, 6)


def test_sample_shapes():
    g = rlx.Graph("shapes")
    s1 = g.sample(g.input("a", (7,), "f32"))
    s3 = g.sample(g.input("b", (2, 3, 9), "f32"), top_k=100)   # top_k >= n: no filter
    s0 = g.sample(g.input("c", (4, 1), "f32"))                  # one token
    assert s1.shape == () and s3.shape == (2, 3) and s0.shape == (4,)
    assert s3.node.attrs["top_k"] == 0
    g.set_outputs([s1, s3, s0])
    a, b, c = run_graph(g, {"a": np.zeros(7, np.float32), "b": np.zeros((2, 3, 9), np.float32),
                            "c": np.zeros((4, 1), np.float32)})
    assert a.shape == () and 0 <= a < 7 and b.shape == (2, 3) and (c == 0).all()


# ---- errors ----------------------------------------------------------------------------------
def _g():
    g = rlx.Graph("e")
    return g, g.input("x", (3, 10), "f32")


@pytest.mark.parametrize("build,msg", [
    (lambda g, x: g.topk(x, 0), (r"topk: k must be in \[1, 10\] \(x \[3, 10\] has 10 elements "
                                 r"along axis 1\), got k=0")),
    (lambda g, x: g.topk(x, 11), r"topk: k must be in \[1, 10\] .*got k=11"),
    (lambda g, x: g.topk(x, 4, axis=0), (r"topk: k must be in \[1, 3\] \(x \[3, 10\] has 3 "
                                         r"elements along axis 0\), got k=4")),
    (lambda g, x: g.topk(x, 2.0), r"topk: k must be an int, got 2.0"),
    (lambda g, x: g.topk(x, True), r"topk: k must be an int, got True"),
    (lambda g, x: g.topk(x, 2, axis=2), r"topk: axis 2 is out of range for rank 2"),
    (lambda g, x: g.topk(g.input("i", (3, 4), "i64"), 2),
     r"topk: x must be f32, f16, bf16 or i32, got i64 \[3, 4\]"),
    (lambda g, x: g.topk(g.input("s", (), "f32"), 1), r"topk: x must have rank >= 1, got a scalar"),
    (lambda g, x: g.topk(np.ones(3), 1), r"topk: x must be a Tensor of this graph, got ndarray"),
    (lambda g, x: g.sample(x, temperature=-1.0),
     r"sample: temperature must be a finite number >= 0 \(0 means greedy\), got -1.0"),
    (lambda g, x: g.sample(x, temperature=math.nan), r"sample: temperature must be .*got nan"),
    (lambda g, x: g.sample(x, top_k=-1), r"sample: top_k must be an int >= 0 .*got -1"),
    (lambda g, x: g.sample(x, top_k=2.5), r"sample: top_k must be an int >= 0 .*got 2.5"),
    (lambda g, x: g.sample(x, top_p=0.0), r"sample: top_p must be a number in \(0, 1\] .*got 0.0"),
    (lambda g, x: g.sample(x, top_p=1.5), r"sample: top_p must be a number in \(0, 1\] .*got 1.5"),
    (lambda g, x: g.sample(x, seed=1.5), (r"sample: seed must be an int or an i32/i64 Tensor "
                                          r"of shape \[\] or \[1\], got float")),
    (lambda g, x: g.sample(x, seed=2**64), r"sample: seed must fit in 64 bits"),
    (lambda g, x: g.sample(x, seed=g.input("s", (2,), "i64")),
     r"sample: a seed tensor must be i32 or i64 of shape \[\] or \[1\], got i64 \[2\]"),
    (lambda g, x: g.sample(x, seed=g.input("s", (), "f32")),
     r"sample: a seed tensor must be i32 or i64 .*got f32 \[\]"),
    (lambda g, x: g.sample(g.input("i", (3, 4), "i64")),
     r"sample: logits must be a float tensor \(f32, f16 or bf16\), got i64 \[3, 4\]"),
    (lambda g, x: g.sample(g.input("z", (3, 0), "f32")),
     r"sample: logits \[3, 0\] has an empty last axis"),
    (lambda g, x: g.sample(rlx.Graph("other").input("y", (2, 3), "f32")),
     r"sample: logits .* belongs to graph 'other', not 'e'"),
])
def test_errors(build, msg):
    g, x = _g()
    with pytest.raises(ValueError, match=msg):
        build(g, x)
