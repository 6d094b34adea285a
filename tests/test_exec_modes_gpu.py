"""ExecMode.GRAPH / MULTISTREAM on a real GPU (skipped under the simulator, where both run as
STREAM): outputs against NumPy and STREAM on graphs with cuBLAS products, attention and
kv_write; params changed between replays; set_param_half re-captures; a step that cannot
be captured is named and leaves no stream capturing; a launch-overhead figure."""
import math
import time

import ml_dtypes
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.runtime import lower
from rlx_numba.runtime.lower import CallStep, Step

pytestmark = pytest.mark.skipif(rlx.simulator_enabled(), reason="needs a GPU (CUDA graphs, "
                                "concurrent streams)")

MODES = [rlx.ExecMode.GRAPH, rlx.ExecMode.MULTISTREAM(2), rlx.ExecMode.MULTISTREAM(3),
         rlx.ExecMode.MULTISTREAM(2, graph=True), rlx.ExecMode.MULTISTREAM(3, graph=True)]


def _compile(g, mode, params):
    exe = rlx.compile(g, exec_mode=mode)
    for k, v in params.items():
        exe.set_param(k, v)
    return exe


def _capturing(stream) -> bool:
    from cuda.bindings import driver as drv
    err, status = drv.cuStreamIsCapturing(drv.CUstream(int(stream)))
    assert err == drv.CUresult.CUDA_SUCCESS
    return status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE


# ---- a decoder-style graph: projections (cuBLAS), kv_write into param caches, attention ------------
B, H, MAX_S, D, S = 1, 2, 8, 16, 2


def _decoder():
    g = rlx.Graph("decoder")
    x = g.input("x", (B, H, S, D), "f32")
    pos = g.input("pos", (1,), "i32")
    p = {k: g.param(k, (D, D)) for k in ("wq", "wk", "wv", "wo")}
    kc, vc = g.param("kc", (B, H, MAX_S, D)), g.param("vc", (B, H, MAX_S, D))
    q, k, v = (g.matmul(x, p[w]) for w in ("wq", "wk", "wv"))
    k_all, v_all = g.kv_write(kc, k, pos), g.kv_write(vc, v, pos)
    keep = (g.constant(np.arange(MAX_S, dtype=np.int32)[None, :])
            <= pos + g.constant(np.arange(S, dtype=np.int32)[:, None]))   # [S, MAX_S]
    y = g.attention(q, k_all, v_all, mask=keep)
    out = g.matmul(g.gelu(y), p["wo"]) + x
    g.set_outputs([out, g.rms_norm(out, g.param("gamma", (D,)))])
    return g


def _decoder_numpy(params, runs):
    kc, vc = params["kc"].astype(np.float64), params["vc"].astype(np.float64)
    outs = []
    for r in runs:
        x, t = r["x"].astype(np.float64), int(r["pos"][0])
        q, k, v = (x @ params[w] for w in ("wq", "wk", "wv"))
        kc[:, :, t:t + S], vc[:, :, t:t + S] = k, v
        s = q @ kc.transpose(0, 1, 3, 2) / np.sqrt(D)
        keep = np.arange(MAX_S)[None, :] <= t + np.arange(S)[:, None]
        s = np.where(keep, s, -np.inf)
        e = np.exp(s - s.max(-1, keepdims=True))
        y = (e / e.sum(-1, keepdims=True)) @ vc
        gelu = y * 0.5 * (1 + np.vectorize(math.erf)(y / np.sqrt(2)))
        out = gelu @ params["wo"] + x
        rms = out / np.sqrt((out ** 2).mean(-1, keepdims=True) + 1e-6) * params["gamma"]
        outs.append([out, rms])
    return outs


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_decoder_matches_numpy_and_stream(rng, mode):
    g = _decoder()
    params = {k: (rng.standard_normal((D, D)) / 4).astype(np.float32) for k in ("wq", "wk", "wv", "wo")}
    params["kc"] = rng.standard_normal((B, H, MAX_S, D)).astype(np.float32)   # garbage past pos
    params["vc"] = rng.standard_normal((B, H, MAX_S, D)).astype(np.float32)
    params["gamma"] = rng.standard_normal(D).astype(np.float32)
    runs = [{"x": rng.standard_normal((B, H, S, D)).astype(np.float32),
             "pos": np.array([t], np.int32)} for t in (0, 2, 4, 6)]
    want = _decoder_numpy(params, runs)
    ref_exe = _compile(g, "stream", params)
    exe = _compile(g, mode, params)
    for r, w in zip(runs, want):
        ref = ref_exe.run(r)
        got = exe.run(r)
        for y, yr, yw in zip(got, ref, w):
            np.testing.assert_allclose(yr, yw, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(y, yr, rtol=1e-5, atol=1e-6)
    runner = exe._runner
    if mode.kind == "graph":
        assert runner.captures == 1          # captured once, replayed for the other runs
        kernels = sum(isinstance(s, Step) for s in exe.steps)
        libs = sum(isinstance(s, CallStep) for s in exe.steps)
        assert runner.kernel_nodes >= kernels + libs, (runner.kernel_nodes, kernels, libs)
    if mode.streams > 1:
        assert len(set(runner.schedule.stream)) > 1   # q/k/v and the two writes spread out
    assert not _capturing(exe.stream)


def test_param_changes_between_replays(rng):
    g = rlx.Graph("lin")
    x = g.input("x", (5, 12), "f32")
    w, b = g.param("w", (12, 7)), g.param("b", (7,))
    g.set_outputs([g.linear(x, w, b, activation="relu")])
    xv = rng.standard_normal((5, 12)).astype(np.float32)
    exe = rlx.compile(g, exec_mode="graph")
    for i in range(4):
        wv = rng.standard_normal((12, 7)).astype(np.float32)
        bv = rng.standard_normal(7).astype(np.float32)
        exe.set_param("w", wv)
        exe.set_param("b", bv)
        np.testing.assert_allclose(exe.run({"x": xv})[0], np.maximum(xv @ wv + bv, 0),
                                   rtol=1e-5, atol=1e-5)
    assert exe._runner.captures == 1


@pytest.mark.parametrize("mode", [rlx.ExecMode.GRAPH, rlx.ExecMode.MULTISTREAM(2, graph=True)],
                         ids=str)
def test_set_param_half_recaptures(rng, mode):
    g = rlx.Graph("half")
    x = g.input("x", (4, 32), "f32")
    w, w2 = g.param("w", (32, 16)), g.param("w2", (32, 16))
    g.set_outputs([g.matmul(x, w), g.matmul(g.tanh(x), w2)])
    xv = rng.standard_normal((4, 32)).astype(np.float32)
    wv, w2v = (rng.standard_normal((32, 16)).astype(np.float32) for _ in range(2))
    exe = _compile(g, mode, {"w": wv, "w2": w2v})
    runner = exe._runner
    for _ in range(2):
        np.testing.assert_allclose(exe.run({"x": xv})[0], xv @ wv, rtol=1e-4, atol=1e-4)
    assert runner.captures == 1
    exe.set_param_half("w", wv, "bf16")
    def bf(a):
        return a.astype(ml_dtypes.bfloat16).astype(np.float64)
    for _ in range(2):
        y, y2 = exe.run({"x": xv})
        tier0 = any(s.info.get("tier") == 0 for s in exe.steps)   # x rounded too; tier 3: not
        np.testing.assert_allclose(y, (bf(xv) if tier0 else xv) @ bf(wv), rtol=1e-3, atol=1e-3)
        np.testing.assert_allclose(y2, np.tanh(xv) @ w2v, rtol=1e-4, atol=1e-4)
    assert runner.captures == 2
    assert not np.allclose(y, xv @ wv, rtol=1e-4, atol=1e-4)      # the bf16 product ran
    exe.set_param("w", wv)                                         # back to f32: again
    np.testing.assert_allclose(exe.run({"x": xv})[0], xv @ wv, rtol=1e-4, atol=1e-4)
    assert runner.captures == 3


def test_uncapturable_step_is_named_and_the_stream_released(rng, monkeypatch):
    orig = lower.LOWERINGS["softmax"]

    def with_sync(exe, n):    # a library step that syncs its stream: fine uncaptured only
        return orig(exe, n) + [CallStep(f"%{n.id} host sync", "stream.synchronize",
                                        make=lambda stream: stream.synchronize)]
    monkeypatch.setitem(lower.LOWERINGS, "softmax", with_sync)
    g = rlx.Graph("sync")
    x = g.input("x", (3, 6), "f32")
    g.set_outputs([g.softmax(g.exp(x))])
    xv = rng.standard_normal((3, 6)).astype(np.float32)
    for mode in ("graph", rlx.ExecMode.MULTISTREAM(2, graph=True)):
        exe = rlx.compile(g, exec_mode=mode)
        with pytest.raises(RuntimeError, match=r"(?s)run: ExecMode\.[^:]+: capturing 'sync' into a CUDA "
                                               r"graph failed: step %\d+ host sync "
                                               r"\(stream\.synchronize\) failed while being "
                                               r"captured: .*The streams are out of capture mode"):
            exe.run({"x": xv})
        assert not any(_capturing(s) for s in exe._runner.streams)
        e = np.exp(np.exp(xv) - np.exp(xv).max(-1, keepdims=True))
        np.testing.assert_allclose(rlx.compile(g).run({"x": xv})[0], e / e.sum(-1, keepdims=True),
                                   rtol=1e-5)   # the context is fine afterwards


def test_launch_overhead_figure(monkeypatch):
    """Information, not a bar: microseconds per run of a 50-step element-wise chain."""
    monkeypatch.setenv("RLX_NUMBA_FUSION", "0")     # keep the 50 steps apart
    g = rlx.Graph("chain50")
    y = g.input("x", (1024,), "f32")
    for i in range(50):
        y = g.sin(y) if i % 2 else g.tanh(y)
    g.set_outputs([y])
    xv = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    rows = []
    for mode in ("stream", "graph", "multistream(2)"):
        exe = rlx.compile(g, exec_mode=mode)
        assert len(exe.steps) == 50
        for _ in range(3):
            out = exe.run({"x": xv}, outputs="view")
        n = 300
        t0 = time.perf_counter()
        for _ in range(n):
            exe.run({"x": xv}, outputs="view")
        us = (time.perf_counter() - t0) / n * 1e6
        rows.append((mode, us))
        ref = xv.astype(np.float64)
        for i in range(50):
            ref = np.sin(ref) if i % 2 else np.tanh(ref)
        np.testing.assert_allclose(out[0].copy_to_host(), ref, rtol=1e-4, atol=1e-5)
    print("\nlaunch overhead, 50-step element-wise chain [1024] (input copy + sync included):")
    for mode, us in rows:
        print(f"  {mode:16s} {us:9.1f} us/run  {us / 50:6.2f} us/step")


def test_context_looked_up_once_a_compile_and_set_param(rng, monkeypatch):
    """compile(), set_param and the first GRAPH run's launch-list build and capture each run
    inside one scope of numba's CUDA context (device.in_cuda_context): the numba calls within
    (device-array views and copies, kernel set-up) find it attached to the thread instead of
    asking the driver under numba's lock (its _get_or_create_context_uncached) each time.
    Counted on this thread; outputs against NumPy as test_decoder_matches_numpy_and_stream."""
    import threading

    from numba.cuda.cudadrv import devices
    me, calls = threading.get_ident(), []
    real = devices._runtime._get_or_create_context_uncached
    monkeypatch.setattr(devices._runtime, "_get_or_create_context_uncached",
                        lambda devnum: (calls.append(1) if threading.get_ident() == me else None)
                        or real(devnum))
    params = {k: (rng.standard_normal((D, D)) / 4).astype(np.float32)
              for k in ("wq", "wk", "wv", "wo")}
    params["kc"] = np.zeros((B, H, MAX_S, D), np.float32)
    params["vc"] = np.zeros((B, H, MAX_S, D), np.float32)
    params["gamma"] = rng.standard_normal(D).astype(np.float32)
    exe = rlx.compile(_decoder(), exec_mode="graph")
    assert len(calls) == 1
    for k, v in params.items():
        exe.set_param(k, v)
    assert len(calls) == 1 + len(params)
    exe._runner._build()     # what the first run does first: every launch packed (before the
    # scopes: two lookups a kernel step in fast_launch, more a cuBLASLt plan)
    assert len(calls) == 2 + len(params)
    r = {"x": rng.standard_normal((B, H, S, D)).astype(np.float32), "pos": np.array([0], np.int32)}
    got = exe.run(r)
    assert exe._runner.captures == 1
    for y, w in zip(got, _decoder_numpy(params, [r])[0]):
        np.testing.assert_allclose(y, w, rtol=1e-4, atol=1e-4)
