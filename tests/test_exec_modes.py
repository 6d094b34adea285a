"""ExecMode.GRAPH and ExecMode.MULTISTREAM(n): outputs against NumPy and against STREAM, the
simulator fallback's log line, the compile-time capture audit, and the stream schedule
(every read/write conflict on arena bytes ordered by a stream or an event)."""
import logging

import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.runtime import cudagraph, lower
from rlx_numba.runtime.lower import CallStep, Step
from rlx_numba.runtime.schedule import assign_streams, dependencies, node_units

ON_GPU = not rlx.simulator_enabled()


# ---- the schedule, on random units (pure Python) -------------------------------------------------
def _overlap(xs, ys):
    return any(a < d and c < b for a, b in xs for c, d in ys)


def _hazards(reads, writes):
    """Every (earlier, later) pair that touches common bytes with at least one write."""
    return [(a, b) for b in range(len(reads)) for a in range(b)
            if _overlap(writes[a], reads[b]) or _overlap(reads[a], writes[b])
            or _overlap(writes[a], writes[b])]


def _ordered_before(sched):
    """Per unit, the set (a bit mask) of units certain to finish before it starts: earlier
    units of its stream, and what an event it waits on was recorded behind."""
    before, last = [], {}
    for u, s in enumerate(sched.stream):
        m = 0
        for p in ([last[s]] if s in last else []) + list(sched.waits[u]):
            assert p < u and (p == last.get(s) or sched.stream[p] != s)
            m |= before[p] | (1 << p)
        before.append(m)
        last[s] = u
    return before


def _check_schedule(sched, reads, writes, n):
    assert len(sched.stream) == len(reads) and all(0 <= s < n for s in sched.stream)
    before = _ordered_before(sched)
    for a, b in _hazards(reads, writes):
        assert before[b] >> a & 1, (f"units {a} (stream {sched.stream[a]}) and {b} (stream "
                                    f"{sched.stream[b]}) conflict and are not ordered")
    tails = {}
    for u, s in enumerate(sched.stream):
        tails[s] = u
    assert sorted(sched.joins) == sorted(t for s, t in tails.items() if s)   # all joined back
    assert set(sched.recorded) == {d for w in sched.waits for d in w} | set(sched.joins)


def _random_units(rng, count):
    # few distinct offsets so that ranges overlap partially, nest and coincide
    cuts = np.sort(rng.choice(np.arange(0, 4096, 64), size=9, replace=False))

    def ranges(k):
        out = []
        for _ in range(k):
            i, j = sorted(rng.choice(len(cuts), size=2, replace=False))
            out.append((int(cuts[i]), int(cuts[j])))
        return out
    reads = [ranges(int(rng.integers(0, 4))) for _ in range(count)]
    writes = [ranges(int(rng.integers(0, 3))) for _ in range(count)]
    return reads, writes


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_schedule_orders_every_conflict(rng, n):
    for _ in range(60):
        reads, writes = _random_units(rng, int(rng.integers(1, 40)))
        sched = assign_streams(reads, writes, n)
        _check_schedule(sched, reads, writes, n)
        if n == 1:
            assert sched.stream == [0] * len(reads) and not any(sched.waits) and not sched.joins


def test_dependencies_by_kind():
    # 0 writes A; 1 reads A (RAW); 2 reads A (reads do not conflict); 3 writes A (WAR on 1
    # and 2, WAW on 0); 4 writes B only; 5 reads half of A (RAW on 3 only: 0's write is
    # ordered before 3's); an empty range conflicts with nothing
    a, b = (0, 256), (256, 512)
    reads = [[], [a], [a], [], [(10, 10)], [(128, 256)]]
    writes = [[a], [], [], [a], [b], [(600, 600)]]
    assert dependencies(reads, writes) == [[], [0], [0], [0, 1, 2], [], [3]]


def test_independent_chains_take_two_streams():
    # chains X (units 0, 2, 4) and Y (1, 3, 5) on disjoint bytes, interleaved; unit 6 reads both
    x, y, out = (0, 100), (100, 200), (200, 300)
    reads = [[], [], [x], [y], [x], [y], [x, y]]
    writes = [[x], [y], [x], [y], [x], [y], [out]]
    sched = assign_streams(reads, writes, 2)
    assert sched.stream[0::2][:3] == [sched.stream[0]] * 3
    assert sched.stream[1::2] == [sched.stream[1]] * 3 and sched.stream[0] != sched.stream[1]
    assert sched.waits[:6] == [[]] * 6 and len(sched.waits[6]) == 1   # one event for the join
    _check_schedule(sched, reads, writes, 2)
    assert assign_streams(reads, writes, 1).stream == [0] * 7


def test_assign_streams_rejects_zero():
    with pytest.raises(ValueError, match=r"assign_streams: n must be >= 1, got 0"):
        assign_streams([[]], [[]], 0)


# ---- random graphs, built alongside their NumPy values -------------------------------------------
def _ln(h, gamma, beta, eps=1e-5):
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return (h - mu) / np.sqrt(var + eps) * gamma + beta


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def random_graph(rng, rows=3, cols=5, hidden=4, chain=8):
    """(graph, inputs, params, numpy outputs): branching element-wise chains, a layer norm
    with a residual (and its residual sum), a matmul, a softmax and a row sum."""
    g = rlx.Graph("modes")
    x = g.input("x", (rows, cols), "f32")
    xv = rng.standard_normal((rows, cols)).astype(np.float32)
    params = {"gamma": rng.standard_normal(cols).astype(np.float32),
              "beta": rng.standard_normal(cols).astype(np.float32),
              "w": rng.standard_normal((cols, hidden)).astype(np.float32)}
    p = {k: g.param(k, v.shape, "f32") for k, v in params.items()}
    ts, vs = [x], [xv.astype(np.float64)]
    unary = {"tanh": np.tanh, "sin": np.sin, "sigmoid": lambda v: 1 / (1 + np.exp(-v))}
    binary = {"add": np.add, "mul": np.multiply, "sub": np.subtract}
    for _ in range(chain):
        if rng.random() < 0.5:
            k = rng.choice(sorted(unary))
            i = int(rng.integers(len(ts)))
            ts.append(g.activation(k, ts[i]))
            vs.append(unary[k](vs[i]))
        else:
            k = rng.choice(sorted(binary))
            i, j = (int(v) for v in rng.integers(len(ts), size=2))
            ts.append(g.binary(k, ts[i], ts[j]))
            vs.append(binary[k](vs[i], vs[j]))
    i, j = (int(v) for v in rng.integers(1, len(ts), size=2))
    h, s = g.layer_norm(ts[i], p["gamma"], p["beta"], residual=ts[j], return_residual=True)
    sv = vs[i] + vs[j]
    hv = _ln(sv, params["gamma"], params["beta"])
    m = g.matmul(h, p["w"])
    mv = hv @ params["w"]
    g.set_outputs([g.softmax(m), g.sum(m, axes=-1), s, ts[-1]])
    want = [_softmax(mv), mv.sum(-1), sv, vs[-1]]
    return g, {"x": xv}, params, want


def _run(g, params, mode, runs):
    exe = rlx.compile(g, exec_mode=mode)
    for k, v in params.items():
        exe.set_param(k, v)
    return exe, [exe.run(inp) for inp in runs]


MODES = [rlx.ExecMode.GRAPH, rlx.ExecMode.MULTISTREAM(2), "multistream(3)",
         rlx.ExecMode.MULTISTREAM(2, graph=True)]


@pytest.mark.parametrize("mode", MODES, ids=str)
def test_modes_match_numpy_and_stream(rng, mode):
    g, inputs, params, want = random_graph(rng)
    x2 = rng.standard_normal(inputs["x"].shape).astype(np.float32)
    _, ref = _run(g, params, "stream", [inputs, {"x": x2}])
    exe, got = _run(g, params, mode, [inputs, {"x": x2}, inputs])   # capture, replay, replay
    for y, w in zip(got[0], want):
        np.testing.assert_allclose(y, w, rtol=2e-5, atol=2e-5)
    for run, r in ((got[0], ref[0]), (got[1], ref[1]), (got[2], ref[0])):
        for y, w in zip(run, r):
            np.testing.assert_allclose(y, w, rtol=1e-6, atol=1e-7)
    assert (exe.runner is None) == (not ON_GPU) and exe.runner is exe._runner


def test_simulator_fallback_is_logged_once(rng, caplog, monkeypatch):
    monkeypatch.setattr(cudagraph, "_said", set())
    g, inputs, params, _ = random_graph(rng, chain=2)
    with caplog.at_level(logging.INFO, logger="rlx_numba"):
        for mode in ("graph", rlx.ExecMode.GRAPH, "multistream(2)"):
            exe, _ = _run(g, params, mode, [inputs, inputs])
    said = [r for r in caplog.records if "runs as ExecMode.STREAM under the CUDA simulator"
            in r.getMessage()]
    if ON_GPU:
        assert said == [] and exe._runner is not None
    else:
        assert [r.getMessage().split()[0] for r in said] == ["ExecMode.GRAPH",
                                                             "ExecMode.MULTISTREAM(2)"]
        assert all(r.levelno == logging.WARNING and r.name == "rlx_numba" for r in said)


# ---- the Runner itself (on the simulator its streams and events are synchronous stand-ins) -----
def _arena_range(exe, a):
    """(lo, hi) bytes of device array ``a`` inside exe's arena, or None when outside it."""
    if hasattr(a, "__cuda_array_interface__"):
        ptr, base = a.__cuda_array_interface__["data"][0], exe.arena.__cuda_array_interface__["data"][0]
    else:
        ptr, base = a._ary.__array_interface__["data"][0], exe.arena._ary.__array_interface__["data"][0]
    lo = ptr - base
    return (lo, lo + a.size * a.dtype.itemsize) if 0 <= lo < exe.arena.size else None


def _arg_ranges(exe, steps):
    return [r for s in steps if isinstance(s, Step) for a in s.args
            if hasattr(a, "dtype") and hasattr(a, "size") and not isinstance(a, np.generic)
            for r in [_arena_range(exe, a)] if r is not None and r[1] > r[0]]


@pytest.mark.parametrize("streams", [2, 3])
def test_runner_schedules_real_graphs(rng, streams):
    g, inputs, params, want = random_graph(rng, chain=10)
    exe, _ = _run(g, params, "stream", [])
    units = node_units(exe)
    # every arena byte a kernel argument touches is in its node's reads or writes, and a node
    # writes its own result
    for nid, steps, reads, writes in units:
        b = exe.buffers[exe._root[nid]]
        assert (b.offset, b.offset + b.size) in writes
        for lo, hi in _arg_ranges(exe, steps):
            assert any(a <= lo and hi <= b_ for a, b_ in reads + writes), (nid, lo, hi)
    # the hazards seen from the kernels' own arguments (a write: the node's result or a
    # residual sum it fills) are all ordered by the schedule
    fills = {m.inputs[0]: m.id for m in exe.graph.nodes
             if m.op == "residual_sum" and m.id in exe._root}
    arg_reads, arg_writes = [], []
    for nid, steps, _, _ in units:
        own = [exe.buffers[exe._root[k]] for k in (nid, fills.get(nid)) if k is not None]
        rs, ws = [], []
        for lo, hi in _arg_ranges(exe, steps):
            mine = any(b.offset <= lo < b.offset + b.size for b in own)
            (ws if mine else rs).append((lo, hi))
        arg_reads.append(rs)
        arg_writes.append(ws)
    sched = assign_streams([u[2] for u in units], [u[3] for u in units], streams)
    _check_schedule(sched, arg_reads, arg_writes, streams)

    runner = cudagraph.Runner(exe, streams, graph=False)
    exe._runner = runner
    for _ in range(2):
        got = exe.run(inputs)
        for y, w in zip(got, want):
            np.testing.assert_allclose(y, w, rtol=2e-5, atol=2e-5)
    assert len(set(runner.schedule.stream)) > 1     # the branches did spread out
    launched = [lab for lab, _ in runner._labels if lab.startswith("step ")]
    assert launched == [f"step {s.name} ({s.kernel_name})" for s in exe.steps]


def test_runner_rebuilds_after_set_param_half(rng):
    g = rlx.Graph("half")
    x = g.input("x", (3, 8), "f32")
    w = g.param("w", (8, 5), "f32")
    y = g.matmul(g.tanh(x), w)
    g.set_outputs([y, g.sin(x)])
    xv = rng.standard_normal((3, 8)).astype(np.float32)
    wv = rng.standard_normal((8, 5)).astype(np.float32)
    exe = rlx.compile(g)
    exe.set_param("w", wv)
    runner = cudagraph.Runner(exe, 2, graph=False)
    exe._runner = runner
    np.testing.assert_allclose(exe.run({"x": xv})[0], np.tanh(xv) @ wv, rtol=1e-5, atol=1e-5)
    first = runner._built_from
    exe.set_param_half("w", wv, "f16")
    wh = wv.astype(np.float16).astype(np.float64)
    y = exe.run({"x": xv})[0]
    a = np.tanh(xv)                  # tier 0 (cuBLAS) takes it as f16 too, tier 3 as it is
    tier0 = any(s.info.get("tier") == 0 for s in exe.steps)
    a = a.astype(np.float16).astype(np.float64) if tier0 else a.astype(np.float64)
    np.testing.assert_allclose(y, a @ wh, rtol=1e-4, atol=1e-4)
    assert not np.allclose(y, np.tanh(xv) @ wv, rtol=1e-5, atol=1e-5)   # the half weight counts
    assert runner._built_from is exe.steps and runner._built_from is not first


# ---- the capture audit ---------------------------------------------------------------------------
def test_graph_mode_rejects_a_step_with_a_host_array(monkeypatch):
    orig = lower.LOWERINGS["softmax"]

    def with_host_arg(exe, n):       # the softmax kernel reads x from a host array
        steps = orig(exe, n)
        s = steps[0]
        s.args = (s.args[0], np.asarray(s.args[1].copy_to_host()), *s.args[2:])
        return steps
    monkeypatch.setitem(lower.LOWERINGS, "softmax", with_host_arg)
    g = rlx.Graph("host")
    x = g.input("x", (2, 4), "f32")
    g.set_outputs([g.softmax(x)])
    for mode in ("graph", rlx.ExecMode.MULTISTREAM(2, graph=True)):
        with pytest.raises(ValueError, match=r"compile: ExecMode\.(GRAPH|MULTISTREAM\(2, graph=True\))"
                                             r": step %1 softmax \(rows_\w+.*\) cannot be captured "
                                             r"into a CUDA graph: kernel argument 1 is a ndarray, "
                                             r"not a device array or a scalar"):
            rlx.compile(g, exec_mode=mode)
    rlx.compile(g, exec_mode="multistream(2)")   # nothing captured, nothing to audit


def test_capture_problem_by_step_kind():
    ok = CallStep("%3 matmul", "cublasSgemm_v2", make=lambda stream: None)
    bad = CallStep("%4 matmul", "someLib", make=lambda stream: None,
                   info={"capture": "it allocates its workspace on each call"})
    assert cudagraph.capture_problem(ok) is None
    assert cudagraph.capture_problem(bad) == "library call: it allocates its workspace on each call"
    assert cudagraph.capture_problem(object()) == "unknown step type object"
    by_value = Step("%5 x", "k", None, (1,), (1,), (np.float32(1), 3, (np.uint64(2), 4.0)))
    assert cudagraph.capture_problem(by_value) is None
    listed = Step("%5 x", "k", None, (1,), (1,), ([1, 2],))
    assert cudagraph.capture_problem(listed).startswith("kernel argument 0 is a list")


# ---- mode values and spellings -------------------------------------------------------------------
def test_mode_spellings():
    assert str(rlx.ExecMode.MULTISTREAM(3)) == "MULTISTREAM(3)"
    assert str(rlx.ExecMode.MULTISTREAM(2, graph=True)) == "MULTISTREAM(2, graph=True)"
    assert rlx.ExecMode.MULTISTREAM(1, graph=True).kind == "graph"
    assert str(rlx.ExecMode.GRAPH) == "GRAPH"
    g = rlx.Graph("tiny")
    g.set_outputs([g.exp(g.input("x", (3,), "f32"))])
    for spelling, want in (("graph", rlx.ExecMode.GRAPH), ("MULTISTREAM", rlx.ExecMode.MULTISTREAM(2)),
                           ("multistream(4)", rlx.ExecMode.MULTISTREAM(4))):
        exe = rlx.compile(g, exec_mode=spelling)
        assert exe.exec_mode == want and str(want) in repr(exe)
        np.testing.assert_allclose(exe.run({"x": np.zeros(3, np.float32)})[0], np.ones(3))
    with pytest.raises(ValueError, match=r"ExecMode.MULTISTREAM: n must be a positive int, got '2'"):
        rlx.ExecMode.MULTISTREAM("2")


@pytest.mark.parametrize("mode", ["stream", "eager", *MODES], ids=str)
def test_executable_freed_without_the_cycle_collector(rng, mode):
    """Dropping the last reference frees an executable (and its arena) at once: no step,
    runner or library-call plan refers back to it, and the kernels its run() compiled do
    not either (numba-cuda keeps the frames of its latest compile: lower._compile).
    Products with an epilogue (cuBLASLt on a GPU), half weights and attention included."""
    import gc
    import weakref
    g = rlx.Graph("freed")
    x = g.input("x", (3, 5))
    w, b = g.param("w", (5, 4)), g.param("b", (4,))
    h = g.gelu(x @ w + b)
    q = g.reshape(h, (1, 1, 3, 4))
    g.set_outputs([g.attention(q, q, q, causal=True), g.linear(h, g.param("u", (4, 4)), b)])
    xv = rng.standard_normal((3, 5)).astype(np.float32)

    def use(exe):
        for name, shape in (("w", (5, 4)), ("b", (4,)), ("u", (4, 4))):
            exe.set_param(name, rng.standard_normal(shape).astype(np.float32))
        exe.run({"x": xv})
        exe.run({"x": xv})                       # GRAPH: captured, then replayed
        exe.set_param_half("u", rng.standard_normal((4, 4)).astype(np.float32), "bf16")
        exe.run({"x": xv})

    was = gc.isenabled()
    gc.disable()
    try:
        exe = rlx.compile(g, exec_mode=mode)
        use(exe)
        ref = weakref.ref(exe)
        del exe
        assert ref() is None
    finally:
        if was:
            gc.enable()


def test_replanning_products_does_not_accumulate_device_arrays(rng):
    """set_param_half / set_param re-plan the products of a weight; the small device arrays
    the old steps owned (batch offsets, pointer tables) go with them. The weight broadcasts
    over a batch dim, so no single batch stride exists and the plan owns device arrays on a
    GPU (cuBLAS pointer tables) as in the simulator (batch offsets)."""
    g = rlx.Graph("replan")
    x = g.input("x", (2, 2, 3, 5))
    w = g.param("w", (2, 1, 5, 4))
    g.set_outputs([g.matmul(x, w)])
    exe = rlx.compile(g)
    wv = rng.standard_normal((2, 1, 5, 4)).astype(np.float32)
    exe.set_param("w", wv)

    def owned():
        return len(exe._extra) + sum(len(v) for v in exe._owned.values())
    before = owned()
    assert before > 0
    for _ in range(3):
        exe.set_param_half("w", wv, "f16")
        exe.set_param("w", wv)
    assert owned() == before
    xv = rng.standard_normal((2, 2, 3, 5)).astype(np.float32)
    (y,) = exe.run({"x": xv})
    np.testing.assert_allclose(y, np.matmul(xv, wv), rtol=1e-5, atol=1e-5)
