"""matmul / linear on f16 and bf16 operands: f32 sums, the result rounded once to the operands'
dtype (torch semantics), against float64 NumPy on the same half-rounded inputs
(tests/halfref.py); shapes, batch broadcasting, absorbed transposes, every epilogue, a case
that half accumulation fails, the mixed-dtype errors, gradients, and (on a GPU) the cuBLASLt
and GemmEx tiers forced one at a time."""
import numpy as np
import pytest

import rlx_numba as rlx
from conftest import ON_GPU, run_graph
from halfref import HALVES, assert_half_close, f64, half_accumulated, rounded
from rlx_numba.ir.ops import ACTIVATIONS
from rlx_numba.runtime.lower_matmul import LT_HALF_ACTIVATIONS
from test_matmul import act_np

POSITIVE = ("log", "sqrt", "rsqrt")     # fed positive pre-activations (positive x, w, bias)


def data(rng, shape, d, positive=False):
    x = rng.uniform(0.1, 1.0, shape) if positive else rng.standard_normal(shape)
    return rounded(x, d)


def act64(kind, h):
    """The activation in float64 on the true domain (test_matmul's act_np shifts log / sqrt /
    rsqrt into theirs; here their inputs are positive already)."""
    if kind == "log":
        return np.log(h)
    if kind == "sqrt":
        return np.sqrt(h)
    if kind == "rsqrt":
        return 1 / np.sqrt(h)
    return act_np(kind, h) if kind else h


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("m,k,n", [(7, 19, 33), (1, 5, 3), (3, 1, 9)])
def test_matmul_half_shapes(rng, d, m, k, n):
    g = rlx.Graph("mmh")
    a, b = g.input("a", (m, k), d), g.input("b", (k, n), d)
    y = g.matmul(a, b)
    assert y.dtype == rlx.dtype(d)
    g.set_outputs([y])
    av, bv = data(rng, (m, k), d), data(rng, (k, n), d)
    (got,) = run_graph(g, {"a": av, "b": bv})
    assert_half_close(got, f64(av) @ f64(bv), d, what="matmul")


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("sa,sb", [((2, 1, 3, 5), (3, 5, 4)), ((1, 3, 5), (2, 5, 4)),
                                   ((4, 3, 5), (5, 4))])
def test_half_batch_broadcast(rng, d, sa, sb):
    g = rlx.Graph("bmmh")
    a, b = g.input("a", sa, d), g.input("b", sb, d)
    g.set_outputs([a @ b])
    av, bv = data(rng, sa, d), data(rng, sb, d)
    (got,) = run_graph(g, {"a": av, "b": bv})
    assert_half_close(got, np.matmul(f64(av), f64(bv)), d, what=f"{sa} @ {sb}")


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_half_transposed_operands_cost_no_copy(rng, d, ta, tb):
    g = rlx.Graph("mmTh")
    a = g.input("a", (2, 7, 3) if ta else (2, 3, 7), d)        # logical [2, 3, 7]
    b = g.input("b", (5, 7) if tb else (7, 5), d)              # logical [7, 5]
    at = g.transpose(a, (0, 2, 1)) if ta else a
    bt = g.transpose(b, (1, 0)) if tb else b
    g.set_outputs([g.matmul(at, bt)])
    exe = rlx.compile(g)
    assert not any("transpose" in s.kernel_name for s in exe.steps), [s.kernel_name for s in exe.steps]
    av, bv = data(rng, a.shape, d), data(rng, b.shape, d)
    (got,) = exe.run({"a": av, "b": bv})
    a64 = f64(av).transpose(0, 2, 1) if ta else f64(av)
    b64 = f64(bv).T if tb else f64(bv)
    assert_half_close(got, a64 @ b64, d, what="transposed")


@pytest.mark.parametrize("d", HALVES)
def test_half_linear_folds_leading_dims_and_params(rng, d):
    """A 2-D weight folds x's leading dims into M (one GEMM); half params set with set_param."""
    g = rlx.Graph("linh")
    x = g.input("x", (2, 3, 9), d)
    w, c = g.param("w", (9, 5), d), g.param("c", (5,), d)
    g.set_outputs([g.linear(x, w, c)])
    exe = rlx.compile(g)
    assert sum("tier" in s.info for s in exe.steps) == 1      # one product, whichever tier
    xv, wv, cv = data(rng, (2, 3, 9), d), data(rng, (9, 5), d), data(rng, (5,), d)
    exe.set_param("w", wv)
    exe.set_param("c", cv)
    (got,) = exe.run({"x": xv})
    assert_half_close(got, f64(xv) @ f64(wv) + f64(cv), d, what="linear")


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("act", [None, *ACTIVATIONS])
def test_half_linear_every_activation_and_residual(rng, d, act):
    """activation(x @ w + bias) + residual: bias and residual in the operands' dtype, the
    epilogue in f32 and the result rounded once on every tier (lower_matmul's docstring): the
    numba tier's kernel, cuBLASLt where it fuses the whole epilogue, else the epilogue kernel
    over the f32 sums a cuBLAS tier wrote (rounding z = x @ w + bias to the dtype first would
    miss this bound by the activation's slope times u |z|: tan where it is steep, or a
    residual that cancels y)."""
    pos = act in POSITIVE
    g = rlx.Graph("epih")
    x, r = g.input("x", (3, 11), d), g.input("r", (3, 6), d)
    w, c = g.input("w", (11, 6), d), g.input("c", (6,), d)
    g.set_outputs([g.linear(x, w, c, activation=act), g.linear(x, w, c, activation=act, residual=r)])
    xv, wv, cv = (data(rng, s, d, pos) for s in ((3, 11), (11, 6), (6,)))
    rv = data(rng, (3, 6), d)
    y, yr = run_graph(g, {"x": xv, "w": wv, "c": cv, "r": rv})
    z = f64(xv) @ f64(wv) + f64(cv)
    assert_half_close(y, act64(act, z), d, scale=lt_rounds_first(act, xv, wv),
                      what=f"linear {act}")
    assert_half_close(yr, act64(act, z) + f64(rv), d, scale=lt_rounds_first(act, xv, wv),
                      what=f"linear {act} + residual")


def lt_rounds_first(act, xv, wv):
    """The bound's scale where a GPU runs the product on cuBLASLt with the epilogue fused (bias,
    relu, a residual as C): on an H200 Lt rounds the product to the half type before
    it adds the bias, as torch's addmm does (up to half an ulp of |x @ w|, which a bias that
    cancels it leaves); None (the default scale) where one rounding is the rule."""
    if not ON_GPU or act not in LT_HALF_ACTIVATIONS:
        return None
    return float(np.abs(f64(xv) @ f64(wv)).max())


@pytest.mark.parametrize("d", HALVES)
def test_half_accumulation(rng, d):
    """A K = 512 dot product of positive terms near 1: the sum grows to ~512, where an f16
    value's spacing is 0.25..0.5 and a bf16 one's 2..4, so a kernel keeping its running sum in
    half would round every one of the 512 additions at that spacing (bf16 stalls outright:
    adding ~1 to 256 rounds back to 256 half the time). The tolerance is two output roundings,
    2 u |y| (0.5 for f16, 4 for bf16 at y ~ 512); half accumulation misses it by far, which
    the test shows on the host before checking the kernel, which sums in f32."""
    k = 512
    av = rounded(rng.uniform(0.5, 1.5, (2, k)), d)
    bv = rounded(rng.uniform(0.5, 1.5, (k, 3)), d)
    want = f64(av) @ f64(bv)
    acc = half_accumulated(av, bv, d)              # a running sum kept in the half type
    with pytest.raises(AssertionError):
        assert_half_close(acc, want, d, what="half accumulation")
    g = rlx.Graph("acch")
    a, b = g.input("a", (2, k), d), g.input("b", (k, 3), d)
    g.set_outputs([g.matmul(a, b)])
    (got,) = run_graph(g, {"a": av, "b": bv})
    assert_half_close(got, want, d, what="f32 accumulation")


def test_mixed_dtypes_raise():
    g = rlx.Graph("mixh")
    a16, b16 = g.input("a", (2, 3), "f16"), g.input("b", (3, 4), "bf16")
    with pytest.raises(ValueError, match=r"matmul: a and b must have the same dtype, got a f16 "
                                         r"\[2, 3\] and b bf16 \[3, 4\]; cast one of them first"):
        g.matmul(a16, b16)
    x, w = g.input("x", (2, 3), "bf16"), g.input("w", (3, 4), "bf16")
    with pytest.raises(ValueError, match=r"linear: x and bias must have the same dtype, got x "
                                         r"bf16 \[2, 3\] and bias f32 \[4\]"):
        g.linear(x, w, g.input("c", (4,)))
    with pytest.raises(ValueError, match=r"linear: x and residual must have the same dtype, got "
                                         r"x bf16 \[2, 3\] and residual f16 \[2, 4\]"):
        g.linear(x, w, residual=g.input("r", (2, 4), "f16"))
    with pytest.raises(ValueError, match=r"matmul: a must be f32, got i32 \[2, 3\] \(or f16 / "
                                         r"bf16: every float operand of one dtype\)"):
        g.matmul(g.input("i", (2, 3), "i32"), g.input("j", (3, 2), "i32"))
    with pytest.raises(ValueError, match=r"matmul_bias_activation_bwd: grad and a must have the "
                                         r"same dtype, got grad f32 \[2, 4\] and a bf16 \[2, 3\]"):
        g.matmul_bias_activation_bwd(g.input("dy", (2, 4)), x, w)


@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("act,res", [(None, False), ("silu", True)])
def test_half_skinny_tier(rng, monkeypatch, d, act, res):
    """Tier 3 (kernels/gemv.py) on a half product: x, the weight (a half param, stored [N, K]),
    bias, residual and y in the one dtype, f32 sums, the epilogue rounded once."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3")
    m, k, n = 3, 40, 12
    g = rlx.Graph("skinnyh")
    x, r = g.input("x", (m, k), d), g.input("r", (m, n), d)
    w, c = g.param("w", (k, n), d), g.param("c", (n,), d)
    g.set_outputs([g.linear(x, w, c, activation=act, residual=r if res else None)])
    exe = rlx.compile(g)
    step = next(s for s in exe.steps if "tier" in s.info)
    assert step.info["tier"] == 3, step.info["why"]
    assert f"{d}x{d}" in step.kernel_name, step.kernel_name
    xv, wv, cv, rv = (data(rng, s, d) for s in ((m, k), (k, n), (n,), (m, n)))
    exe.set_param("w", wv)
    exe.set_param("c", cv)
    (got,) = exe.run({"x": xv, "r": rv})
    want = act64(act, f64(xv) @ f64(wv) + f64(cv)) + (f64(rv) if res else 0)
    assert_half_close(got, want, d, what=f"tier 3 {act}")


def test_half_skinny_tier_passed_over_with_a_reason(monkeypatch):
    """A half product tier 3 cannot take (its weight is an input stored [K, N]) says why."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3")
    g = rlx.Graph("skinnyh2")
    x, w = g.input("x", (2, 16), "bf16"), g.input("w", (16, 4), "bf16")
    g.set_outputs([g.linear(x, w)])
    step = next(s for s in rlx.compile(g).steps if "tier" in s.info)
    assert step.info["tier"] == 4
    assert any(w.startswith("tier 3: the weight is not a 2-D matrix stored [N, K]")
               for w in step.info["why"]), step.info["why"]


@pytest.mark.parametrize("d", HALVES)
def test_half_product_chains_keep_their_roundings(rng, d):
    """Element-wise ops written after a half product are not folded into it (the fold would
    skip the product's rounding to half): bias + relu in half round twice, as written, and a
    half product added to an f32 tensor (autocast's residual stream) is rounded first."""
    g = rlx.Graph("chainh")
    a, b = g.input("a", (5, 13), d), g.input("b", (13, 6), d)
    c, x = g.input("c", (6,), d), g.input("x", (5, 6))
    p = g.matmul(a, b)
    g.set_outputs([g.relu(p + c), g.matmul(a, b) + x])
    av, bv, cv = data(rng, (5, 13), d), data(rng, (13, 6), d), data(rng, (6,), d)
    xv = rng.standard_normal((5, 6)).astype(np.float32)
    y1, y2 = run_graph(g, {"a": av, "b": bv, "c": cv, "x": xv})
    p64 = f64(rounded(f64(av) @ f64(bv), d))         # the product, rounded to half
    assert_half_close(y1, np.maximum(f64(rounded(p64 + f64(cv), d)), 0), d, k=0.5,
                      what="relu(p + c)")
    assert y2.dtype == np.float32
    np.testing.assert_allclose(y2, p64 + xv, rtol=1e-6, atol=1e-6)


def test_half_arena_holds_half_bytes():
    """The product's buffers are sized by the node dtype: a bf16 graph's arena is half the f32
    one's."""
    def arena(d):
        g = rlx.Graph("arena")
        x, w = g.input("x", (8, 32), d), g.input("w", (32, 64), d)
        g.set_outputs([g.linear(x, w)])
        return rlx.compile(g).memory_report()["arena_bytes"]
    assert arena("bf16") * 2 == arena("f32")


@pytest.mark.parametrize("d", HALVES)
def test_half_matmul_gradients(rng, d):
    """The gradients of a half product are half products (f32 sums, one rounding each):
    batched matmul and linear with bias and an activation, against float64 NumPy on the same
    rounded inputs and seed."""
    g = rlx.Graph("gradh")
    a, b = g.input("a", (2, 3, 5), d), g.input("b", (2, 5, 4), d)
    x, w, c = g.input("x", (2, 3, 5), d), g.input("w", (5, 4), d), g.input("c", (4,), d)
    dy = g.input("dy", (2, 3, 4), d)
    y1 = g.matmul(a, b)
    y2 = g.linear(x, w, c, activation="gelu_tanh")
    grads = g.grad(y1, [a, b], seed=dy) + g.grad(y2, [x, w, c], seed=dy)
    assert all(t.dtype == rlx.dtype(d) for t in grads)
    g.set_outputs(grads)
    vals = {n: data(rng, s, d) for n, s in (("a", (2, 3, 5)), ("b", (2, 5, 4)), ("x", (2, 3, 5)),
                                            ("w", (5, 4)), ("c", (4,)), ("dy", (2, 3, 4)))}
    da, db, dx, dw, dc = run_graph(g, vals)
    A, B, X, W, C, DY = (f64(vals[k]) for k in ("a", "b", "x", "w", "c", "dy"))
    # plain product: each gradient is one half product of rounded inputs, one rounding
    assert_half_close(da, DY @ B.transpose(0, 2, 1), d, what="d a")
    assert_half_close(db, A.transpose(0, 2, 1) @ DY, d, what="d b")
    z = X @ W + C
    t = np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3))
    dgelu = 0.5 * (1 + t) + 0.5 * z * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * z * z)
    gp = DY * dgelu
    # the epilogue's backward recomputes z in half and rounds dy * gelu'(z) to half before its
    # products (as torch's autocast backward): a few roundings of the terms, so the bound is
    # scaled by the largest gradient, not each entry
    for got, want, what in ((dx, gp @ W.T, "d x"), (dw, (X.reshape(-1, 5).T @ gp.reshape(-1, 4)), "d w"),
                            (dc, gp.sum((0, 1)), "d bias")):
        assert_half_close(got, want, d, k=4, scale=float(np.abs(want).max()), what=what)


# ---- the cuBLAS tiers, forced one at a time (a GPU) --------------------------------------------
gpu_only = pytest.mark.skipif(not ON_GPU, reason="cuBLAS / cuBLASLt run on a GPU only")


def _tiers_of(exe):
    return [s.info["tier"] for s in exe.steps if "tier" in s.info]


@gpu_only
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tier", [1, 2, 4])
@pytest.mark.parametrize("act,res", [(None, False), ("gelu_tanh", False), ("relu", False),
                                     (None, True), ("silu", True)])
def test_gpu_tier_linear(rng, monkeypatch, d, tier, act, res):
    """256 x 512 x 384 linear with bias on each tier: cuBLASLt fuses bias (+ relu, or a
    residual as C) with D in the half type; where it does not fuse the whole epilogue
    (gelu_tanh, silu + residual), and every epilogue on tier 2, the library writes
    its f32 sums into the node's arena scratch, as tier 4 does, and the element-wise kernel
    rounds once."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", str(tier))
    m, k, n = 256, 512, 384
    g = rlx.Graph("gpuh")
    x, w, c = g.input("x", (m, k), d), g.param("w", (k, n), d), g.param("c", (n,), d)
    r = g.input("r", (m, n), d) if res else None
    y = g.linear(x, w, c, activation=act, residual=r)
    g.set_outputs([y])
    exe = rlx.compile(g)
    assert _tiers_of(exe) == [tier], [(s.kernel_name, s.info.get("why")) for s in exe.steps]
    xv, wv, cv = data(rng, (m, k), d), data(rng, (k, n), d), data(rng, (n,), d)
    rv = data(rng, (m, n), d)
    exe.set_param("w", wv)
    exe.set_param("c", cv)
    (got,) = exe.run({"x": xv, "r": rv} if res else {"x": xv})
    want = act64(act, f64(xv) @ f64(wv) + f64(cv)) + (f64(rv) if res else 0)
    # k = 4: cuBLASLt's fused bias is added to the product rounded to half (lt_rounds_first)
    assert_half_close(got, want, d, k=4, what=f"tier {tier} {act} residual={res}")
    names = " ".join(s.kernel_name for s in exe.steps)
    fused_all = tier == 1 and act in LT_HALF_ACTIVATIONS and not (act and res)
    epilogues = [s.kernel_name for s in exe.steps if s.name.endswith("epilogue")]
    assert len(epilogues) == (not fused_all), names
    assert all("in0:f32" in e for e in epilogues), epilogues      # it reads the f32 sums
    assert list(exe.plan.scratch) == ([] if fused_all else [y.id]), names
    if tier in (1, 2):
        call = "cublasLt" if tier == 1 else "cublasGemmEx"
        assert f"{call} {d}{'' if fused_all else '->f32'}" in names, names


@gpu_only
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("sa,sb", [((6, 64, 96), (6, 96, 80)), ((3, 1, 64, 96), (4, 96, 80)),
                                   ((6, 64, 96), (96, 80))])
def test_gpu_batched_half(rng, monkeypatch, d, sa, sb):
    """Batched half products on tier 2: strided (GemmStridedBatchedEx), broadcast with no single
    stride (GemmBatchedEx's pointer arrays), and a 2-D weight folded into M."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "2")
    g = rlx.Graph("gpubh")
    a, b = g.input("a", sa, d), g.input("b", sb, d)
    g.set_outputs([a @ b])
    exe = rlx.compile(g)
    assert _tiers_of(exe) == [2]
    av, bv = data(rng, sa, d), data(rng, sb, d)
    (got,) = exe.run({"a": av, "b": bv})
    assert_half_close(got, np.matmul(f64(av), f64(bv)), d, what=f"{sa} @ {sb}")
    names = " ".join(s.kernel_name for s in exe.steps)
    want = {((3, 1, 64, 96), (4, 96, 80)): "cublasGemmBatchedEx",
            ((6, 64, 96), (96, 80)): "cublasGemmEx"}.get((sa, sb), "cublasGemmStridedBatchedEx")
    assert want in names, names


@gpu_only
@pytest.mark.parametrize("d", HALVES)
def test_gpu_default_ladder_half_uses_cublas(rng, d):
    """With no restriction an unbatched half product takes cuBLASLt (tensor cores, f32 sums)."""
    g = rlx.Graph("gpudh")
    x, w = g.input("x", (64, 256), d), g.input("w", (256, 128), d)
    g.set_outputs([g.linear(x, w)])
    exe = rlx.compile(g)
    assert _tiers_of(exe) == [1]
    xv, wv = data(rng, (64, 256), d), data(rng, (256, 128), d)
    (got,) = exe.run({"x": xv, "w": wv})
    assert_half_close(got, f64(xv) @ f64(wv), d)


@pytest.mark.parametrize("d", HALVES)
def test_half_epilogue_scratch_is_in_the_arena(rng, monkeypatch, d):
    """A half product whose epilogue the numba tier leaves to the element-wise kernel writes
    its f32 sums into arena bytes the memory plan gives the node (live at its step alone:
    Plan.scratch), not into a device array of its own; the kernel rounds once. An f32 graph,
    and a half product with no epilogue, get none."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "4")    # the numba tier (a GPU's too)
    m, k, n = 5, 23, 7
    g = rlx.Graph("scratchh")
    x, r = g.input("x", (m, k), d), g.input("r", (m, n), d)
    w, c = g.input("w", (k, n), d), g.input("c", (n,), d)
    y1 = g.linear(x, w, c, activation="gelu", residual=r)
    y2 = g.matmul(x, w)
    g.set_outputs([y1, y2])
    exe = rlx.compile(g)
    assert {i: b.nbytes for i, b in exe.plan.scratch.items()} == {y1.id: 4 * m * n}
    owned = [a for arrays in exe.program.ctx.owned.values() for a in arrays]
    assert not any(a.dtype == np.float32 and a.size == m * n for a in owned), owned
    b = exe.plan.scratch[y1.id]
    assert b.offset + b.size <= exe.memory_report()["arena_bytes"]
    feed = {"x": data(rng, (m, k), d), "r": data(rng, (m, n), d),
            "w": data(rng, (k, n), d), "c": data(rng, (n,), d)}
    got1, got2 = exe.run(feed)
    X, R, W, C = (f64(feed[q]) for q in ("x", "r", "w", "c"))
    assert_half_close(got1, act64("gelu", X @ W + C) + R, d, what="gelu + residual")
    assert_half_close(got2, X @ W, d, what="plain")
    g32 = rlx.Graph("scratch32")
    x32, w32 = g32.input("x", (m, k)), g32.input("w", (k, n))
    g32.set_outputs([g32.linear(x32, w32, g32.input("c", (n,)), activation="gelu")])
    assert rlx.compile(g32).plan.scratch == {}


@pytest.mark.parametrize("d", HALVES)
def test_half_empty_sum_epilogue(rng, d):
    """K = 0: the product is zeros (exact in the half type), written in place, then the
    epilogue: gelu(bias) + residual, rounded once."""
    g = rlx.Graph("emptyh")
    x, w = g.input("x", (3, 0), d), g.input("w", (0, 5), d)
    c, r = g.input("c", (5,), d), g.input("r", (3, 5), d)
    g.set_outputs([g.linear(x, w, c, activation="gelu", residual=r)])
    exe = rlx.compile(g)
    assert exe.plan.scratch == {}
    cv, rv = data(rng, (5,), d), data(rng, (3, 5), d)
    (got,) = exe.run({"x": np.zeros((3, 0), cv.dtype), "w": np.zeros((0, 5), cv.dtype),
                      "c": cv, "r": rv})
    assert_half_close(got, act64("gelu", np.broadcast_to(f64(cv), (3, 5))) + f64(rv), d,
                      what="empty sum")


@gpu_only
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("res", [False, True])
def test_gpu_lt_exact_gelu_reads_f32_sums(rng, d, res):
    """Exact gelu (BERT's, ViT's MLP): cuBLASLt has only the tanh form, so it writes x @ w in
    f32 (nothing fused) into the arena scratch the plan gave the node, and the element-wise
    kernel adds the bias, applies gelu (+ residual) and rounds once."""
    m, k, n = 256, 384, 1536
    g = rlx.Graph("gpugelu")
    x, w, c = g.input("x", (m, k), d), g.param("w", (k, n), d), g.param("c", (n,), d)
    r = g.input("r", (m, n), d) if res else None
    y = g.linear(x, w, c, activation="gelu", residual=r)
    g.set_outputs([y])
    exe = rlx.compile(g)
    assert {i: b.nbytes for i, b in exe.plan.scratch.items()} == {y.id: 4 * m * n}
    assert _tiers_of(exe) == [1], [(s.kernel_name, s.info.get("why")) for s in exe.steps]
    lt, epi = exe.steps
    assert lt.kernel_name.startswith(f"cublasLt {d}->f32 "), lt.kernel_name
    assert "in0:f32" in epi.kernel_name and "gelu" in epi.kernel_name, epi.kernel_name
    xv, wv, cv, rv = (data(rng, s_, d) for s_ in ((m, k), (k, n), (n,), (m, n)))
    exe.set_param("w", wv)
    exe.set_param("c", cv)
    (got,) = exe.run({"x": xv, "r": rv} if res else {"x": xv})
    want = act64("gelu", f64(xv) @ f64(wv) + f64(cv)) + (f64(rv) if res else 0)
    assert_half_close(got, want, d, k=1.0, what=f"Lt {d} sums + gelu")


@gpu_only
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("xs,ws,bias", [((4, 48, 11), (11, 4), True),    # the fuzzer's
                                        ((192, 11), (11, 4), False),
                                        ((16, 8192), (8192, 64), True),  # split-K shapes
                                        ((8, 16384), (16384, 32), False)])
def test_gpu_half_product_rounds_once(rng, d, xs, ws, bias):
    """A half linear on the default ladder rounds once to within half an ulp of float64 (k =
    1), whichever tier and algorithm it takes (long K invites split-K, whose partials must be
    summed in f32); with a bias fused by cuBLASLt, the product is rounded first as in torch's
    addmm (the fuzzer's bf16 [4, 48, 11] @ [11, 4] + bias: 94 of 768 values beyond one
    rounding on an H200, all within half an ulp of the product)."""
    g = rlx.Graph("gpuonce")
    x, w = g.input("x", xs, d), g.param("w", ws, d)
    c = g.param("c", (ws[1],), d) if bias else None
    g.set_outputs([g.linear(x, w, c)])
    exe = rlx.compile(g)
    steps = [(s.kernel_name, s.info.get("why")) for s in exe.steps]
    xv, wv, cv = data(rng, xs, d), data(rng, ws, d) / np.sqrt(ws[0]), data(rng, (ws[1],), d)
    wv = rounded(wv, d)
    exe.set_param("w", wv)
    if bias:
        exe.set_param("c", cv)
    (got,) = exe.run({"x": xv})
    want = f64(xv) @ f64(wv) + (f64(cv) if bias else 0)
    lt_bias = any(n.startswith(f"cublasLt {d}+bias") for n, _ in steps)
    assert_half_close(got, want, d, k=1.0, scale=lt_rounds_first(None, xv, wv) if lt_bias else None,
                      what=f"{xs} @ {ws} bias={bias} {steps}")


# ---- the cuBLAS tiers' roundings, in the simulator: cuBLAS emulated ---------------------------
class _EmulatedCublas:
    """cuBLAS / cuBLASLt for the simulator (whose device arrays live on the host): each call the
    lowering plans computes its product exactly (float64, then the epilogue cuBLASLt fuses) and
    rounds it once to its C / D type, as the library does with f32 sums; the plans it saw are
    kept (``calls``) for the tests to read which type each product writes."""
    TYPES = {0: np.float32, 2: np.float16, 14: None}     # R_32F, R_16F, R_16BF

    def __init__(self, monkeypatch):
        import ml_dtypes
        from rlx_numba import cublas
        from rlx_numba.cublas import gemm
        from rlx_numba.runtime import lower_matmul
        self.TYPES = {**self.TYPES, 14: ml_dtypes.bfloat16}
        self.calls = []
        monkeypatch.setattr(lower_matmul, "SIMULATOR", False)   # the cuBLAS tiers are planned
        monkeypatch.setattr(cublas, "available", lambda: (True, ""))
        monkeypatch.setattr(gemm, "lt_plan", self.lt_plan)
        monkeypatch.setattr(gemm, "gemm_ex_plan", self.gemm_ex_plan)

    def view(self, ptr, code, shape):
        import ctypes
        t = np.dtype(self.TYPES[code])
        raw = (ctypes.c_char * (t.itemsize * int(np.prod(shape)))).from_address(ptr)
        return np.frombuffer(raw, t).reshape(shape)

    def operands(self, cm, a_ptr, a_code, b_ptr, b_code):
        """Our A [M, K] and B [K, N] (row-major) as float64 from cuBLAS's column-major terms
        (gemm.colmajor: its A is our B, its B our A)."""
        m, n, k = cm.n, cm.m, cm.k
        a = self.view(a_ptr, a_code, (k, m) if cm.opb else (m, k)).astype(np.float64)
        b = self.view(b_ptr, b_code, (n, k) if cm.opa else (k, n)).astype(np.float64)
        return (a.T if cm.opb else a), (b.T if cm.opa else b)

    def lt_plan(self, stream, cm, a_ptr, b_ptr, d_ptr, *, tf32, bias_ptr=None, activation=None,
                residual_ptr=None, in_type, out_type):
        self.calls.append(("lt", out_type, bias_ptr is not None, activation,
                           residual_ptr is not None))

        def run():
            a, b = self.operands(cm, a_ptr, in_type, b_ptr, in_type)
            z = a @ b
            if bias_ptr is not None:
                z = z + self.view(bias_ptr, out_type, (cm.m,)).astype(np.float64)
            if residual_ptr is not None:
                z = z + self.view(residual_ptr, out_type, z.shape).astype(np.float64)
            z = act64(activation, z)
            self.view(d_ptr, out_type, z.shape)[...] = z.astype(self.TYPES[out_type])
        return run

    def gemm_ex_plan(self, stream, cm, a_ptr, a_type, b_ptr, b_type, c_ptr, *, c_type, batch=1,
                     stride_a=0, stride_b=0, ptr_arrays=None):
        assert ptr_arrays is None, "not emulated"
        self.calls.append(("ex", c_type))
        size = {a_type: np.dtype(self.TYPES[a_type]).itemsize}[b_type]

        def run():
            for i in range(batch):
                a, b = self.operands(cm, a_ptr + i * stride_a * size, a_type,
                                     b_ptr + i * stride_b * size, b_type)
                ci = np.dtype(self.TYPES[c_type]).itemsize * i * cm.m * cm.n
                self.view(c_ptr + ci, c_type, (cm.n, cm.m))[...] = (a @ b).astype(
                    self.TYPES[c_type])
        return run


@pytest.mark.skipif(ON_GPU, reason="emulates cuBLAS in the simulator (the GPU runs the library)")
@pytest.mark.parametrize("d", HALVES)
@pytest.mark.parametrize("tier", [1, 2])
def test_cublas_tiers_round_half_epilogues_once(rng, monkeypatch, d, tier):
    """A half product whose epilogue cuBLASLt fuses whole (bias with none / relu, a residual
    with no activation) writes D of its type from the library; any other (gelu_tanh, an
    activation cuBLASLt lacks, a residual after an activation, every epilogue on tier 2, a
    batched product) has the library write its f32 sums into the arena scratch the plan gave
    the node and the epilogue kernel round once: every output within one rounding of float64
    (a steep tan and a residual that cancels make a product rounded to half first miss it by
    many ulps). cuBLAS is emulated: exact sums, one rounding to the call's C / D type."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", f"{tier},4")
    emu = _EmulatedCublas(monkeypatch)
    m, k, n = 12, 9, 16
    g = rlx.Graph("cublash")
    x, r = g.input("x", (m, k), d), g.input("r", (m, n), d)
    w, c = g.input("w", (k, n), d), g.input("c", (n,), d)
    a3, b3, r3 = (g.input(q, s_, d) for q, s_ in (("a3", (2, m, k)), ("b3", (2, k, n)),
                                                ("r3", (2, m, n))))
    cases = [(None, False), ("gelu_tanh", False), (None, True), ("relu", True), ("tan", False),
             ("neg", True), ("silu", False)]
    ys = [g.linear(x, w, c, activation=act, residual=r if res else None) for act, res in cases]
    plain = g.linear(x, w)
    batched = g.matmul(a3, b3) + r3     # folded into the product: a residual epilogue
    g.set_outputs(ys + [plain, batched])
    exe = rlx.compile(g)
    # scratches: every product with an epilogue a kernel applies (on tier 1 not the two
    # cuBLASLt fuses: cases 0 and 2), 4 bytes an element; none for the plain product
    split = [i for i, (act, res) in enumerate(cases) if tier == 2 or i not in (0, 2)]
    assert sorted(exe.plan.scratch) == sorted([ys[i].id for i in split] + [batched.id])
    assert all(exe.plan.scratch[y.id].nbytes == 4 * m * n for y in (ys[i] for i in split))
    codes = {"f16": 2, "bf16": 14}
    half_d = [c_ for c_ in emu.calls if c_[1] == codes[d]]
    if tier == 1:   # the two cuBLASLt fuses, and the plain product, write D of the half type
        assert sorted(half_d, key=str) == sorted(
            [("lt", codes[d], True, None, False), ("lt", codes[d], True, None, True),
             ("lt", codes[d], False, None, False)], key=str)
        assert ("lt", 0, False, None, False) in emu.calls     # the others: f32, nothing fused
    else:
        assert half_d == [("ex", codes[d])]                   # the plain product alone
    epilogues = [s_.kernel_name for s_ in exe.steps if s_.name.endswith("epilogue")]
    assert len(epilogues) == len(split) + 1 and all("in0:f32" in e for e in epilogues), epilogues
    feed = {q: data(rng, v.shape, d) for q, v in (("x", x), ("r", r), ("w", w), ("c", c),
                                                  ("a3", a3), ("b3", b3), ("r3", r3))}
    got = exe.run(feed)
    X, R, W, C = (f64(feed[q]) for q in ("x", "r", "w", "c"))
    z = X @ W + C
    for (act, res), y in zip(cases, got):
        want = act64(act, z) + (R if res else 0)
        assert_half_close(y, want, d, k=1.0, what=f"tier {tier} {act} residual={res}")
    assert_half_close(got[-2], X @ W, d, k=1.0, what="plain")
    assert_half_close(got[-1], f64(feed["a3"]) @ f64(feed["b3"]) + f64(feed["r3"]), d, k=1.0,
                      what="batched + residual")
