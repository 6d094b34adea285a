"""The skinny-product kernel (matmul tier 3, kernels/gemv.py) through the public API, against
float64 NumPy: M up to 16, odd N and K (element loads) and 16-byte aligned K (vector loads,
split K), f32 / f16 / bf16 weights (x not rounded), bias,
activation and residual epilogues; M > 16 and a weight not stored [N, K] fall through to
another tier."""
from math import erf

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx

HALF = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}


def act_np(kind, v):
    if kind == "gelu":
        return 0.5 * v * (1 + np.vectorize(erf)(v / np.sqrt(2)))
    if kind == "gelu_tanh":
        return 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3)))
    if kind == "silu":
        return v / (1 + np.exp(-v))
    assert kind is None
    return v


def build(lead, k, n, bias, act, residual):
    """act(x @ w + b) + r, as linear() when there is no residual, else as a matmul chain that
    the fusion pass folds into the product's epilogue."""
    g = rlx.Graph("skinny")
    x = g.input("x", (*lead, k))
    w = g.param("w", (k, n))
    b = g.param("b", (n,)) if bias else None
    if residual:
        r = g.input("r", (*lead, n))
        h = x @ w
        if b is not None:
            h = h + b
        if act:
            h = g.activation(act, h)
        g.set_outputs([h + r])
    else:
        g.set_outputs([g.linear(x, w, b, activation=act)])
    return g


def set_weight(exe, wv, wdt):
    """Set param w (f32, or stored half); the weight the product sees, in float64."""
    if wdt == "f32":
        exe.set_param("w", wv)
        return wv.astype(np.float64)
    exe.set_param_half("w", wv, wdt)
    return wv.astype(HALF[wdt]).astype(np.float64)


def product_step(exe):
    (s,) = [s for s in exe.steps if "tier" in s.info]
    return s


CASES = [  # lead dims (M = their product), K, N, weight dtype, bias, activation, residual
    ((1,), 129, 37, "f32", True, None, False),       # element loads, K split in 3
    ((3,), 37, 129, "f16", True, "gelu", False),
    ((16,), 37, 37, "bf16", True, "silu", True),
    ((3,), 129, 37, "bf16", False, None, True),
    ((2, 3), 64, 37, "f32", True, "gelu_tanh", True),   # 16-byte vectors of 4 f32
    ((1,), 264, 9, "f16", False, None, False),       # vectors of 8 halves, K split in 2
    ((3,), 264, 9, "bf16", True, "gelu", False),
    ((16,), 129, 9, "f32", False, None, True),
]


@pytest.mark.parametrize("lead,k,n,wdt,bias,act,residual", CASES)
def test_skinny_matches_numpy(monkeypatch, rng, lead, k, n, wdt, bias, act, residual):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    exe = rlx.compile(build(lead, k, n, bias, act, residual))
    wv = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    bv = rng.standard_normal(n).astype(np.float32)
    w64 = set_weight(exe, wv, wdt)
    if bias:
        exe.set_param("b", bv)
    step = product_step(exe)
    assert step.info["tier"] == 3, (step.kernel_name, step.info["why"])
    assert step.kernel_name.startswith(f"numba gemv {wdt}")
    assert sum("tier" in s.info or "epilogue" in s.name for s in exe.steps) == 1   # all fused
    for _ in range(2):   # twice: the split-K tickets must be back at zero for the second run
        xv = rng.standard_normal((*lead, k)).astype(np.float32)
        rv = rng.standard_normal((*lead, n)).astype(np.float32)
        inputs = {"x": xv, "r": rv} if residual else {"x": xv}
        (got,) = exe.run(inputs)
        x64 = xv.astype(np.float64)      # x is not rounded, even with half weights
        want = x64 @ w64
        if bias:
            want = want + bv
        want = act_np(act, want)
        if residual:
            want = want + rv
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_split_k_is_planned():
    """Under the simulator the cases above cover both plans: K past one split's chunk is
    split across blocks (partials and the last block's combine), a short K not."""
    if not rlx.simulator_enabled():
        pytest.skip("the GPU's plan depends on its SM count")
    from rlx_numba.kernels import gemv
    assert gemv.plan(1, 37, 129, "f32", 1, 1)[5] == 3
    assert gemv.plan(1, 9, 264, "f16", 8, 1)[5] == 2
    assert gemv.plan(3, 129, 37, "f16", 1, 1)[5] == 1


def test_more_than_16_rows_fall_through(monkeypatch, rng):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    exe = rlx.compile(build((17,), 9, 5, True, None, False))
    wv = rng.standard_normal((9, 5)).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    exe.set_param("w", wv)
    exe.set_param("b", bv)
    step = product_step(exe)
    assert step.info["tier"] == 4
    assert any("M = 17 > 16" in w for w in step.info["why"])
    xv = rng.standard_normal((17, 9)).astype(np.float32)
    (got,) = exe.run({"x": xv})
    np.testing.assert_allclose(got, xv.astype(np.float64) @ wv + bv, rtol=2e-5, atol=2e-5)


def test_weight_not_stored_transposed_falls_through(monkeypatch, rng):
    """A weight also read by something other than a product is stored [K, N]: not tier 3."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    g = rlx.Graph("shared_w")
    x = g.input("x", (2, 7))
    w = g.param("w", (7, 5))
    g.set_outputs([x @ w, w * 2.0])
    exe = rlx.compile(g)
    wv = rng.standard_normal((7, 5)).astype(np.float32)
    exe.set_param("w", wv)
    assert product_step(exe).info["tier"] == 4
    xv = rng.standard_normal((2, 7)).astype(np.float32)
    got, _ = exe.run({"x": xv})
    np.testing.assert_allclose(got, xv.astype(np.float64) @ wv, rtol=2e-5, atol=2e-5)


def test_simulator_takes_tier_3_only_when_named(monkeypatch):
    if not rlx.simulator_enabled():
        pytest.skip("on a GPU tier 3 is timed against cuBLAS instead")
    monkeypatch.delenv("RLX_NUMBA_MATMUL_TIERS", raising=False)
    exe = rlx.compile(build((1,), 9, 5, False, None, False))
    step = product_step(exe)
    assert step.info["tier"] == 4
    assert any("only when RLX_NUMBA_MATMUL_TIERS names it" in w for w in step.info["why"])
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", " 4, 3")     # read as the other tiers are
    assert product_step(rlx.compile(build((1,), 9, 5, False, None, False))).info["tier"] == 3


def test_graph_mode_replays(monkeypatch, rng):
    """ExecMode GRAPH (STREAM under the simulator): replays with new inputs stay right, so the
    split-K scratch and tickets are bound once and reset by the kernel itself."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    g = build((3,), 129, 37, True, "gelu", False)
    exe = rlx.compile(g, exec_mode="graph")
    wv = (rng.standard_normal((129, 37)) / np.sqrt(129)).astype(np.float32)
    bv = rng.standard_normal(37).astype(np.float32)
    exe.set_param_half("w", wv, "bf16")
    exe.set_param("b", bv)
    assert product_step(exe).info["tier"] == 3
    w64 = wv.astype(ml_dtypes.bfloat16).astype(np.float64)
    for _ in range(3):
        xv = rng.standard_normal((3, 129)).astype(np.float32)
        (got,) = exe.run({"x": xv})
        want = act_np("gelu", xv.astype(np.float64) @ w64 + bv)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def _save_many(cache, start, barrier):
    import os
    os.environ["RLX_NUMBA_CACHE_DIR"] = cache
    from rlx_numba.runtime import lower_matmul as lm
    barrier.wait()                           # all at once
    for i in range(start, start + 25):
        lm._save_choice(f"k{i}", [1.0 + i, 2.0])


def test_verdict_file_survives_damage_and_concurrent_writers(tmp_path, monkeypatch):
    """tier_choices.json: odd contents are ignored (those shapes are timed again), and
    processes saving at once keep each other's verdicts."""
    import multiprocessing as mp

    from rlx_numba.runtime import lower_matmul as lm
    monkeypatch.setenv("RLX_NUMBA_CACHE_DIR", str(tmp_path))
    path = lm._choice_path()
    for text in ("[]", "not json", '{"a": [null, 1], "b": [1, "x"], "c": [1.5, 2.5]}'):
        path.write_text(text)
        assert lm._load_choices() == ({"c": [1.5, 2.5]} if "c" in text else {})
    path.unlink()
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    procs = [ctx.Process(target=_save_many, args=(str(tmp_path), 25 * j, barrier))
             for j in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert lm._load_choices() == {f"k{i}": [1.0 + i, 2.0] for i in range(100)}


def _gated_graph(lead, k, n2, bias):
    """gated(x @ w (+ b), silu, interleaved): what build_llama's MLP computes."""
    g = rlx.Graph("gated")
    x = g.input("x", (*lead, k))
    w = g.param("w", (k, n2))
    h = g.linear(x, w, g.param("b", (n2,)) if bias else None)
    g.set_outputs([g.gated(h, "silu", interleaved=True)])
    return g


@pytest.mark.parametrize("tiers,lead,k,n2,bias,wdt", [
    ("3,4", (1,), 129, 38, True, "f32"),     # element loads, K split over blocks
    ("3,4", (2, 3), 64, 18, False, "bf16"),  # vectors; 9 pairs: a block's last pair partial
    ("3,4", (16,), 37, 6, True, "f32"),
    ("4", (3,), 37, 10, True, "f32"),        # another tier: the product into a scratch, then
])                                           # the gated kernel
def test_gated_epilogue(monkeypatch, rng, tiers, lead, k, n2, bias, wdt):
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", tiers)
    exe = rlx.compile(_gated_graph(lead, k, n2, bias))
    wv = (rng.standard_normal((k, n2)) / np.sqrt(k)).astype(np.float32)
    bv = rng.standard_normal(n2).astype(np.float32)
    w64 = set_weight(exe, wv, wdt)
    if bias:
        exe.set_param("b", bv)
    step = product_step(exe)
    if tiers == "3,4":
        assert step.info["tier"] == 3 and "gated silu" in step.kernel_name
        assert len(exe.steps) == 1                    # no kernel of its own
    else:
        assert [s.name.split()[-1] for s in exe.steps][-1] == "gated"
    for _ in range(2):
        xv = rng.standard_normal((*lead, k)).astype(np.float32)
        (got,) = exe.run({"x": xv})
        h = xv.astype(np.float64) @ w64 + (bv if bias else 0)
        want = act_np("silu", h[..., 0::2]) * h[..., 1::2]
        assert got.shape == (*lead, n2 // 2)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_gated_epilogue_only_for_skinny_interleaved_products(monkeypatch, rng):
    """17 rows, the halves layout, or a product read twice: gated keeps its own kernel."""
    monkeypatch.setenv("RLX_NUMBA_MATMUL_TIERS", "3,4")
    g = rlx.Graph("no_fold")
    x, x2 = g.input("x", (17, 8)), g.input("x2", (2, 8))
    w = g.param("w", (8, 6))
    h2 = x2 @ w
    outs = [g.gated(x @ w, "silu", True), g.gated(x2 @ w, "silu", False), g.gated(h2, "silu", True), h2]
    g.set_outputs(outs)
    exe = rlx.compile(g)
    assert sum(s.name.split()[1] == "gated" for s in exe.steps) == 3
    wv = rng.standard_normal((8, 6)).astype(np.float32)
    exe.set_param("w", wv)
    xv, x2v = rng.standard_normal((17, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32)
    got = exe.run({"x": xv, "x2": x2v})
    for out, xin, inter in zip(got[:3], (xv, x2v, x2v), (True, False, True)):
        h = xin.astype(np.float64) @ wv
        a, b = (h[:, 0::2], h[:, 1::2]) if inter else (h[:, :3], h[:, 3:])
        np.testing.assert_allclose(out, act_np("silu", a) * b, rtol=2e-5, atol=2e-5)
