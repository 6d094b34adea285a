"""The executable: run() inputs and outputs, modes, device arrays, leaves as outputs."""
import numpy as np
import pytest
from numba import cuda

import rlx_numba as rlx
from conftest import run_graph


def _graph():
    g = rlx.Graph("small")
    x = g.input("x", (3, 5), "f32")
    s = g.param("s", (5,), "f32")
    y = g.exp(x) * s
    g.set_outputs([y])
    return g


def test_compile_with_and_repeated_runs(rng):
    g = _graph()
    exe = rlx.CudaExecutable.compile_with(g, rlx.CompileMode.JIT, rlx.ExecMode.STREAM)
    s = rng.standard_normal(5)                  # float64: converted by set_param
    exe.set_param("s", s)
    for _ in range(2):
        x = rng.standard_normal((3, 5)).astype(np.float32)
        (y,) = exe.run({"x": x})
        assert y.dtype == np.float32 and y.shape == (3, 5)
        np.testing.assert_allclose(y, np.exp(x) * s, rtol=1e-6)
    assert "small" in repr(exe) and exe.input_names == ["x"] and exe.param_names == ["s"]


@pytest.mark.parametrize("cm,em", [("aot", "stream"), ("jit", "eager"), (rlx.CompileMode.AOT,
                                                                        rlx.ExecMode.EAGER)])
def test_modes_give_same_result(rng, cm, em):
    g = _graph()
    x = rng.standard_normal((3, 5)).astype(np.float32)
    s = rng.standard_normal(5).astype(np.float32)
    exe = rlx.compile(g, compile_mode=cm, exec_mode=em)
    exe.set_param("s", s)
    np.testing.assert_allclose(exe.run({"x": x})[0], np.exp(x) * s, rtol=1e-6)


def test_eager_function(rng):
    x = rng.standard_normal((3, 5)).astype(np.float32)
    s = rng.standard_normal(5).astype(np.float32)
    (y,) = rlx.eager(_graph(), {"x": x}, params={"s": s})
    np.testing.assert_allclose(y, np.exp(x) * s, rtol=1e-6)


def test_device_inputs_and_outputs(rng):
    g = _graph()
    exe = rlx.compile(g)
    s = rng.standard_normal(5).astype(np.float32)
    exe.set_param("s", cuda.to_device(s))                 # device param, no host copy
    x1 = rng.standard_normal((3, 5)).astype(np.float32)
    x2 = rng.standard_normal((3, 5)).astype(np.float32)
    (dev,) = exe.run({"x": cuda.to_device(x1)}, outputs="device")
    (view,) = exe.run({"x": cuda.to_device(x1)}, outputs="view")
    np.testing.assert_allclose(dev.copy_to_host(), np.exp(x1) * s, rtol=1e-6)
    np.testing.assert_allclose(view.copy_to_host(), np.exp(x1) * s, rtol=1e-6)
    exe.run({"x": x2})
    # a "device" result is a copy; a "view" is the arena, overwritten by the next run
    np.testing.assert_allclose(dev.copy_to_host(), np.exp(x1) * s, rtol=1e-6)
    np.testing.assert_allclose(view.copy_to_host(), np.exp(x2) * s, rtol=1e-6)
    with pytest.raises(ValueError, match=r"input 'x': expected shape \[3, 5\], got \[5, 3\]"):
        exe.run({"x": cuda.to_device(x1.T.copy())})
    with pytest.raises(ValueError, match="input 'x': expected dtype f32"):
        exe.run({"x": cuda.to_device(x1.astype(np.float64))})


@pytest.mark.parametrize("mode", ["stream", "eager", "graph"])
def test_run_without_waiting(rng, mode):
    """run(wait=False) queues the run and returns the arena views unsynchronized: once the
    stream is synchronized they hold what run() gives."""
    exe = rlx.compile(_graph(), exec_mode=mode)
    s = rng.standard_normal(5).astype(np.float32)
    exe.set_param("s", s)
    x1 = rng.standard_normal((3, 5)).astype(np.float32)
    (want,) = exe.run({"x": x1})
    for x in (x1, cuda.to_device(x1)):            # host, then device input
        (view,) = exe.run({"x": x}, outputs="view", wait=False)
        exe.stream.synchronize()
        np.testing.assert_array_equal(view.copy_to_host(), want)
    for outputs in ("numpy", "device"):           # copies of the results: they must wait
        with pytest.raises(ValueError, match=f"run: wait=False needs outputs='view', got "
                                             f"outputs='{outputs}'"):
            exe.run({"x": x1}, outputs=outputs, wait=False)


@pytest.mark.parametrize("b", [1, 3])
def test_view_fed_back_as_the_next_input(rng, b):
    """A decode-style loop that never waits: each run's i64 output (t_next = argmax w[t]) is
    the next run's i32 [b, 1] input, read on the device as the i64's low words (a view with
    rows 8 bytes apart when b > 1: a 2-D copy), against the host loop."""
    g = rlx.Graph("chain")
    t = g.input("t", (b, 1), "i32")
    w = g.param("w", (7, 7), "f32")
    g.set_outputs([g.argmax(g.reshape(g.gather(w, t), (b, 7)), -1)])
    exe = rlx.compile(g)
    wv = rng.standard_normal((7, 7)).astype(np.float32)
    exe.set_param("w", wv)
    start = rng.integers(0, 7, (b, 1)).astype(np.int32)
    want, cur = [], start[:, 0]
    for _ in range(4):
        cur = wv[cur].argmax(-1)
        want.append(cur)
    feed, got = start, []
    for _ in range(4):
        (ids,) = exe.run({"t": feed}, outputs="view", wait=False)
        assert ids.dtype == np.int64
        got.append(ids.copy_to_host(stream=exe.stream))   # (waits for this run only)
        feed = ids.view(np.int32).reshape(b, 2)[:, :1]
    np.testing.assert_array_equal(np.stack(got), np.stack(want))
    if b > 1:      # elements that are not evenly spaced rows: no single 2-D copy reads them
        g2 = rlx.Graph("cols")
        g2.set_outputs([g2.neg(g2.input("x", (3, 2), "f32"))])
        exe2 = rlx.compile(g2)
        m = rng.standard_normal((3, 4)).astype(np.float32)
        (y,) = exe2.run({"x": cuda.to_device(m)[:, 1:3]})    # rows 16 bytes apart: one copy
        np.testing.assert_array_equal(y, -m[:, 1:3])
        with pytest.raises(ValueError, match="input 'x': device array must be C-contiguous"):
            # F-order (numba's device .T would copy to C order on a GPU: not a view)
            exe2.run({"x": cuda.to_device(np.asfortranarray(m))[:, 1:3]})

def test_leaves_as_outputs_and_lists(rng):
    g = rlx.Graph("leaves")
    x = g.input("x", (2, 3), "i32")
    p = g.param("p", (3,), "bf16")
    c = g.constant(np.array([[1.5, -2.0, 3.25]], np.float32))
    g.set_outputs([x, p, c, g.reshape(x, (3, 2)), g.cast(p, "f32")])
    exe = rlx.compile(g)
    import ml_dtypes
    pv = np.array([1.0, -0.5, 3.0], dtype=ml_dtypes.bfloat16)
    exe.set_param("p", pv)
    xv = [[1, 2, 3], [4, 5, 6]]                              # a nested list is accepted
    xo, po, co, ro, pf = exe.run({"x": xv})
    assert xo.dtype == np.int32 and (xo == np.array(xv)).all()
    assert po.dtype == ml_dtypes.bfloat16 and (po == pv).all()
    assert (co == c.node.attrs["value"]).all() and ro.shape == (3, 2)
    assert pf.dtype == np.float32 and (pf == pv.astype(np.float32)).all()


def test_scalar_and_empty_tensors(rng):
    g = rlx.Graph("odd")
    a = g.input("a", (), "f32")
    e = g.input("e", (0, 4), "f32")
    g.set_outputs([a * 2.0 + 1.0, g.exp(e) + a, g.relu(e)])
    out = run_graph(g, {"a": np.float32(1.5), "e": np.zeros((0, 4), np.float32)})
    assert out[0].shape == () and out[0] == 4.0
    assert out[1].shape == (0, 4) and out[2].shape == (0, 4)


def test_unused_nodes_are_not_run(rng):
    g = rlx.Graph("dce")
    x = g.input("x", (4,), "f32")
    g.log(x)             # dead
    g.set_outputs([g.abs(x)])
    exe = rlx.compile(g)
    assert len(exe.steps) == 1
    xs = rng.standard_normal(4).astype(np.float32)
    np.testing.assert_array_equal(exe.run({"x": xs})[0], np.abs(xs))


def test_graph_printing_and_handles():
    g = rlx.Graph("p")
    x = g.input("x", (2, 3), "f16")
    y = g.gelu(x)
    g.set_outputs([y])
    text = str(g)
    assert "graph 'p'" in text and "input 'x'" in text and "activation(%0, kind=gelu)" in text
    assert "f16[2, 3]" in text
    assert y.shape == (2, 3) and y.dtype == rlx.dtype("f16") and y.ndim == 2
    assert "Tensor(%1 f16[2, 3])" == repr(y)
    with pytest.raises(TypeError, match="no truth value"):
        bool(x > 0)


def test_matmul_batch_broadcast(rng):
    g = rlx.Graph("mm")
    a = g.input("a", (2, 1, 3, 5), "f32")
    b = g.input("b", (3, 5, 7), "f32")
    c = g.input("c", (17, 33), "f32")
    d = g.input("d", (33, 20), "f32")
    g.set_outputs([a @ b, g.matmul(c, d)])
    av, bv = rng.standard_normal((2, 1, 3, 5)), rng.standard_normal((3, 5, 7))
    cv, dv = rng.standard_normal((17, 33)), rng.standard_normal((33, 20))
    feed = {k: v.astype(np.float32) for k, v in dict(a=av, b=bv, c=cv, d=dv).items()}
    ab, cd = run_graph(g, feed)
    assert ab.shape == (2, 3, 3, 7)
    np.testing.assert_allclose(ab, av @ bv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(cd, cv @ dv, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("act,bias", [(None, True), ("relu", False), ("gelu_tanh", True), ("silu", True)])
def test_linear(rng, act, bias):
    g = rlx.Graph("lin")
    x = g.input("x", (2, 3, 9), "f32")
    w = g.param("w", (9, 5), "f32")
    b = g.param("b", (5,), "f32") if bias else None
    g.set_outputs([g.linear(x, w, b, activation=act)])
    xv = rng.standard_normal((2, 3, 9)).astype(np.float32)
    wv = rng.standard_normal((9, 5)).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    ref = xv.astype(np.float64) @ wv + (bv if bias else 0)
    ref = {None: ref, "relu": np.maximum(ref, 0), "silu": ref / (1 + np.exp(-ref)),
           "gelu_tanh": 0.5 * ref * (1 + np.tanh(np.sqrt(2 / np.pi) * (ref + 0.044715 * ref ** 3)))}[act]
    (y,) = run_graph(g, {"x": xv}, {"w": wv, **({"b": bv} if bias else {})})
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_linear_with_zero_k():
    g = rlx.Graph("k0")
    x = g.input("x", (3, 0), "f32")
    w = g.param("w", (0, 4), "f32")
    b = g.param("b", (4,), "f32")
    g.set_outputs([g.linear(x, w, b, activation="sigmoid")])
    bv = np.array([0.0, 1.0, -1.0, 2.0], np.float32)
    (y,) = run_graph(g, {"x": np.zeros((3, 0), np.float32)}, {"w": np.zeros((0, 4)), "b": bv})
    np.testing.assert_allclose(y, np.broadcast_to(1 / (1 + np.exp(-bv)), (3, 4)), rtol=1e-6)


@pytest.mark.skipif(rlx.simulator_enabled(), reason="CUDA Array Interface needs a GPU")
def test_foreign_device_arrays_as_inputs(rng):
    torch = pytest.importorskip("torch")
    g = _graph()
    exe = rlx.compile(g)
    s = rng.standard_normal(5).astype(np.float32)
    x = rng.standard_normal((3, 5)).astype(np.float32)
    exe.set_param("s", torch.from_numpy(s).cuda())
    (y,) = exe.run({"x": torch.from_numpy(x).cuda()})
    np.testing.assert_allclose(y, np.exp(x) * s, rtol=1e-6)
    with pytest.raises(ValueError, match="C-contiguous"):
        exe.run({"x": torch.from_numpy(x.T.copy()).cuda().T})


def test_graph_growing_after_compile_does_not_change_the_executable(rng):
    g = _graph()
    exe = rlx.compile(g)
    x = g.input("late", (2,), "f32")
    g.set_outputs([g.neg(x)])
    exe.set_param("s", np.ones(5, np.float32))
    xv = rng.standard_normal((3, 5)).astype(np.float32)
    (y,) = exe.run({"x": xv})
    np.testing.assert_allclose(y, np.exp(xv), rtol=1e-6)


def _profiled_graph():
    g = rlx.Graph("prof")
    x = g.input("x", (8, 16))
    w = g.param("w", (16, 4))
    g.set_outputs([g.softmax(g.linear(x, w, activation="relu") * 2.0)])
    return g


def test_profile_one_row_per_step(rng):
    exe = rlx.compile(_profiled_graph())
    exe.set_param("w", rng.standard_normal((16, 4)).astype(np.float32))
    prof = exe.profile({"x": rng.standard_normal((8, 16)).astype(np.float32)})
    assert [r.name for r in prof] == [s.name for s in exe.steps]
    assert all(r.ms >= 0 for r in prof) and prof.total_ms > 0
    mm = [r for r in prof if "tier" in r.info]
    assert len(mm) == 1 and mm[0].info["flops"] == 2 * 8 * 16 * 4 and mm[0].tflops > 0
    text = str(prof)
    assert text.startswith("prof on ") and all(s.name in text for s in exe.steps)
    with pytest.raises(ValueError, match=r"run: missing input\(s\) 'x'"):
        exe.profile({})


def test_trace_env_writes_one_event_per_step(rng, tmp_path, monkeypatch):
    import json
    path = tmp_path / "trace.json"
    monkeypatch.setenv("RLX_NUMBA_TRACE", str(path))
    exe = rlx.compile(_profiled_graph())
    wv = rng.standard_normal((16, 4)).astype(np.float32)
    xv = rng.standard_normal((8, 16)).astype(np.float32)
    exe.set_param("w", wv)
    (y,) = exe.run({"x": xv})
    h = np.maximum(xv.astype(np.float64) @ wv, 0) * 2
    e = np.exp(h - h.max(-1, keepdims=True))
    np.testing.assert_allclose(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    assert [ev["name"] for ev in events] == [s.name for s in exe.steps]
    assert all(ev["ph"] == "X" and ev["dur"] >= 0 and "kernel" in ev["args"] for ev in events)
    assert all(b["ts"] >= a["ts"] for a, b in zip(events, events[1:]))


def test_executables_sharing_a_kernel_keep_their_own_launch_geometry():
    """Two executables launch the same attention kernel with different grids (batch 2 and 1):
    running the second must not change how the first launches (the simulator's
    kernel[grid, block] configures the shared kernel object itself)."""
    rng = np.random.default_rng(5)

    def build(b):
        g = rlx.Graph(f"attn{b}")
        q, k, v = (g.input(n, (b, 2, 9, 4)) for n in "qkv")
        g.set_outputs([g.attention(q, k, v)])
        return rlx.compile(g)

    def want(f):
        s = np.einsum("bhqd,bhkd->bhqk", f["q"].astype(np.float64), f["k"]) / 2.0
        p = np.exp(s - s.max(-1, keepdims=True))
        return np.einsum("bhqk,bhkd->bhqd", p / p.sum(-1, keepdims=True), f["v"])
    feeds = [{n: rng.standard_normal((2, 2, 9, 4)).astype(np.float32) for n in "qkv"}
             for _ in range(2)]
    big = build(2)
    big.run(feeds[0])
    small = build(1)
    assert small.steps[0].grid != big.steps[0].grid
    small.run({n: x[:1] for n, x in feeds[0].items()})
    (out,) = big.run(feeds[1])          # new inputs: a batch left out would keep old values
    np.testing.assert_allclose(out, want(feeds[1]), rtol=1e-4, atol=1e-5)


def test_step_with_dynamic_shared_memory():
    """A Step's ``shared`` bytes reach the launch (cuda.shared.array(0, ...) in the kernel);
    past 48 KiB the GPU path also opts the kernel in (cuFuncSetAttribute)."""
    from numba import float32        # (cuda: the module's, which the simulator swaps in)

    from rlx_numba.runtime.lower import Step

    @cuda.jit
    def reverse_doubled(out, x):
        sm = cuda.shared.array(0, float32)
        i = cuda.threadIdx.x
        sm[i] = x[i] * 2
        cuda.syncthreads()
        out[i] = sm[cuda.blockDim.x - 1 - i]

    x = cuda.to_device(np.arange(8, dtype=np.float32))
    out = cuda.device_array(8, np.float32)
    step = Step("%0 test", "reverse", reverse_doubled, (1,), (8,), (out, x), shared=8 * 4)
    stream = cuda.stream()
    step.bind(stream, False)
    step()
    stream.synchronize()
    np.testing.assert_array_equal(out.copy_to_host(), np.arange(8)[::-1] * 2)
