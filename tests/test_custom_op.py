"""Custom ops (rlx.custom_op / g.custom) and custom VJPs (rlx.custom_vjp): a user's @cuda.jit
kernel inside compiled graphs in every exec mode against NumPy, its gradient against finite
differences, the storage dtypes its kernel sees, and every error with its message."""
import math
import re

import numpy as np
import pytest
from numba import cuda   # a module global, as the simulator requires (after rlx_numba below)

import rlx_numba as rlx
from rlx_numba.ir import dtypes as dt
from rlx_numba.runtime import cudagraph
from rlx_numba.runtime.lower import Step

from gradcheck import check, numeric_grad


# ---- the user's kernels (module level: numba.cuda a module global) ------------------------------
@cuda.jit
def quick_gelu_kernel(out, x):
    """x * sigmoid(1.702 x) for 2-D arrays (one thread an element, flat index over out)."""
    i = cuda.grid(1)
    if i < out.size:
        r, c = i // out.shape[1], i % out.shape[1]
        v = x[r, c]
        out[r, c] = v / (1.0 + math.exp(-1.702 * v))


@cuda.jit
def quick_gelu_grad_kernel(out, dy, x):
    """dy * d/dx [x sigmoid(1.702 x)] for 2-D arrays."""
    i = cuda.grid(1)
    if i < out.size:
        r, c = i // out.shape[1], i % out.shape[1]
        v = x[r, c]
        s = 1.0 / (1.0 + math.exp(-1.702 * v))
        out[r, c] = dy[r, c] * (s + 1.702 * v * s * (1.0 - s))


@cuda.jit
def add_row_kernel(out, x, bias):
    """out [M, N] = x [M, N] + 2 * bias [N]: the kernel broadcasts bias over the rows."""
    r, c = cuda.grid(2)
    if r < out.shape[0] and c < out.shape[1]:
        out[r, c] = x[r, c] + 2.0 * bias[c]


@cuda.jit
def half_scale_kernel(out, x):
    """f16 in, f16 out, f32 math: out = 3 x + 0.5 (1-D)."""
    i = cuda.grid(1)
    if i < out.size:
        out[i] = np.float16(np.float32(x[i]) * np.float32(3.0) + np.float32(0.5))


@cuda.jit
def reverse_bits_kernel(out, x):
    """bf16 storage is uint16 bits: out[i] = x[n - 1 - i], bit for bit (1-D)."""
    i = cuda.grid(1)
    n = out.size
    if i < n:
        out[i] = x[n - 1 - i]


@cuda.jit
def row_sum_kernel(out, x):
    """out [M] = sum of x [M, N] along its rows: one thread a row."""
    r = cuda.grid(1)
    if r < out.shape[0]:
        acc = 0.0
        for c in range(x.shape[1]):
            acc += x[r, c]
        out[r] = acc


@cuda.jit
def copy_kernel(out, x):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = x[i]


@cuda.jit(device=True)
def a_device_function(x):
    return x


def _grid(n, threads=32):
    return (-(-n // threads),), (threads,)


def _qgelu_np(x):
    return x / (1.0 + np.exp(-1.702 * x))


def _qgelu_vjp_graph(g, inputs, out, dy):
    """The true derivative, built from graph ops."""
    (x,) = inputs
    s = g.sigmoid(x * 1.702)
    return [dy * (s + x * 1.702 * s * (1.0 - s))]


def _qgelu_op(name, vjp=None):
    return rlx.custom_op(name, quick_gelu_kernel, lambda x: (x.shape, x.dtype),
                         lambda s: _grid(math.prod(s)), vjp=vjp)


# ---- in a compiled graph, every exec mode ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["stream", "graph", "eager", "multistream(2)"])
def test_fused_activation_between_other_ops_matches_numpy(mode, rng):
    op = _qgelu_op("quick_gelu_modes")
    g = rlx.Graph("cg")
    x, w = g.input("x", (5, 3)), g.param("w", (3, 7))
    y = g.custom(op, g.matmul(x, w) * 2.0)
    assert (y.shape, y.dtype) == ((5, 7), dt.F32)
    g.set_outputs([g.reduce("sum", y + 1.0, (1,))])
    xv = rng.standard_normal((5, 3)).astype(np.float32)
    wv = rng.standard_normal((3, 7)).astype(np.float32)
    exe = rlx.compile(g, exec_mode=mode)
    exe.set_param("w", wv)
    for _ in range(2):      # a second run reuses the bound step
        (out,) = exe.run({"x": xv})
        want = (_qgelu_np(2.0 * (xv.astype(np.float64) @ wv)) + 1.0).sum(1)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rlx.eager(g, {"x": xv}, {"w": wv})[0], want, rtol=1e-5, atol=1e-5)


def test_step_is_a_capturable_kernel_launch_in_the_arena_and_profiled(rng):
    op = _qgelu_op("quick_gelu_step")
    g = rlx.Graph("st")
    x = g.input("x", (4, 9))
    y = g.custom(op, x * 3.0)
    g.set_outputs([y - 1.0])
    exe = rlx.compile(g, exec_mode="graph")
    steps = [s for s in exe.steps if s.kernel_name == "custom quick_gelu_step"]
    assert len(steps) == 1
    s = steps[0]
    assert isinstance(s, Step) and s.kernel is quick_gelu_kernel
    assert s.name == f"%{y.id} custom.quick_gelu_step"
    assert (s.grid, s.block) == ((2,), (32,))
    assert [a.shape for a in s.args] == [(4, 9), (4, 9)]      # out, then the inputs, shaped
    assert cudagraph.capture_problem(s) is None
    assert y.id in exe.buffers                  # its own arena buffer, planned by liveness
    # it fuses with nothing: the ops before and after it stay kernels of their own
    names = [t.name for t in exe.steps]
    assert names.index(s.name) not in (0, len(names) - 1) and len(names) == 3, names
    xv = rng.standard_normal((4, 9)).astype(np.float32)
    prof = exe.profile({"x": xv})
    row = next(r for r in prof if r.kernel == "custom quick_gelu_step")
    assert row.name == s.name
    assert "custom.quick_gelu_step" in str(prof)
    np.testing.assert_allclose(exe.run({"x": xv})[0], _qgelu_np(3.0 * xv) - 1.0, rtol=1e-5,
                               atol=1e-6)


def test_trace_names_the_step(rng, tmp_path, monkeypatch):
    op = _qgelu_op("quick_gelu_trace")
    g = rlx.Graph("tc")
    x = g.input("x", (2, 5))
    y = g.custom(op, x)
    g.set_outputs([y])
    exe = rlx.compile(g)
    path = tmp_path / "trace.json"
    monkeypatch.setenv("RLX_NUMBA_TRACE", str(path))
    xv = rng.standard_normal((2, 5)).astype(np.float32)
    np.testing.assert_allclose(exe.run({"x": xv})[0], _qgelu_np(xv), rtol=1e-5, atol=1e-6)
    text = path.read_text()
    assert f"%{y.id} custom.quick_gelu_trace" in text and "custom quick_gelu_trace" in text


def test_two_inputs_broadcast_by_the_kernel_2d_grid(rng):
    op = rlx.custom_op("add_row", add_row_kernel, lambda x, b: (x.shape, "f32"),
                       lambda xs, bs: ((-(-xs[0] // 4), -(-xs[1] // 8)), (4, 8)))
    g = rlx.Graph("br")
    x, b = g.input("x", (6, 11)), g.input("b", (11,))
    g.set_outputs([g.custom(op, x, b)])
    xv = rng.standard_normal((6, 11)).astype(np.float32)
    bv = rng.standard_normal(11).astype(np.float32)
    (out,) = rlx.compile(g).run({"x": xv, "b": bv})
    np.testing.assert_allclose(out, xv + 2.0 * bv, rtol=1e-6, atol=1e-6)


def test_output_of_another_shape_and_a_reduction(rng):
    op = rlx.custom_op("row_sum", row_sum_kernel, lambda x: ((x.shape[0],), x.dtype),
                       lambda s: _grid(s[0]))
    g = rlx.Graph("rs")
    x = g.input("x", (7, 5))
    y = g.custom(op, g.exp(x))
    assert y.shape == (7,)
    g.set_outputs([y])
    xv = rng.standard_normal((7, 5)).astype(np.float32)
    np.testing.assert_allclose(rlx.compile(g).run({"x": xv})[0], np.exp(xv).sum(1), rtol=1e-5)


def test_f16_input_and_output(rng):
    op = rlx.custom_op("half_scale", half_scale_kernel, lambda x: (x.shape, x.dtype),
                       lambda s: _grid(s[0]))
    g = rlx.Graph("h")
    x = g.input("x", (37,), "f16")
    y = g.custom(op, x)
    assert y.dtype == dt.F16
    g.set_outputs([y])
    xv = rng.standard_normal(37).astype(np.float16)
    (out,) = rlx.compile(g).run({"x": xv})
    assert out.dtype == np.float16
    want = (xv.astype(np.float32) * 3.0 + 0.5).astype(np.float16)
    np.testing.assert_array_equal(out, want)


def test_bf16_tensors_are_uint16_bits_in_the_kernel(rng):
    seen = []

    def shape_fn(x):
        seen.append(x.dtype)
        return x.shape, x.dtype

    op = rlx.custom_op("reverse_bits", reverse_bits_kernel, shape_fn, lambda s: _grid(s[0]))
    g = rlx.Graph("bf")
    x = g.input("x", (13,), "bf16")
    g.set_outputs([g.custom(op, x)])
    assert seen == [dt.BF16]
    exe = rlx.compile(g)
    (s,) = [t for t in exe.steps if t.kernel_name == "custom reverse_bits"]
    assert all(a.dtype == np.uint16 for a in s.args)
    xv = rng.standard_normal(13).astype(dt.BF16.host)
    (out,) = exe.run({"x": xv})
    assert out.dtype == dt.BF16.host
    np.testing.assert_array_equal(out.view(np.uint16), xv[::-1].view(np.uint16))


def test_empty_output_runs_nothing():
    calls = []

    def launch(s):
        calls.append(s)
        return _grid(max(1, s[0]))

    op = rlx.custom_op("copy_empty", copy_kernel, lambda x: (x.shape, x.dtype), launch)
    g = rlx.Graph("e")
    x = g.input("x", (0,))
    g.set_outputs([g.custom(op, x)])
    exe = rlx.compile(g)
    assert not [s for s in exe.steps if s.kernel_name == "custom copy_empty"]
    assert exe.run({"x": np.zeros(0, np.float32)})[0].shape == (0,)
    assert calls == []


def test_precision_bf16_copy_rebuilds_the_node(rng):
    op = rlx.custom_op("copy_prec", copy_kernel, lambda x: (x.shape, x.dtype),
                       lambda s: _grid(s[0]))
    g = rlx.Graph("p")
    x, w = g.input("x", (3, 4)), g.param("w", (4, 5))
    y = g.custom(op, g.reshape(g.matmul(x, w), (15,)))
    g.set_outputs([y])
    exe = rlx.compile(g, precision="bf16")       # the product's result is bf16: so is y
    (s,) = [t for t in exe.steps if t.kernel_name == "custom copy_prec"]
    assert s.args[0].dtype == np.uint16
    xv = rng.standard_normal((3, 4)).astype(np.float32)
    wv = rng.standard_normal((4, 5)).astype(np.float32)
    exe.set_param("w", wv)
    out = exe.run({"x": xv})[0].astype(np.float32)
    np.testing.assert_allclose(out, (xv @ wv).reshape(-1), rtol=2e-2, atol=2e-2)
    assert y.dtype == dt.F32                     # the user's graph is not changed


# ---- autodiff ---------------------------------------------------------------------------------------
def test_vjp_as_graph_code_against_finite_differences(rng):
    op = _qgelu_op("quick_gelu_vjp", vjp=_qgelu_vjp_graph)
    g = rlx.Graph("gd")
    x, w = g.input("x", (3, 4)), g.input("w", (4, 5))
    loss = g.reduce("sum", g.custom(op, g.matmul(x, w)) * g.constant(np.linspace(-1, 2, 5)), (0, 1))
    feed = {"x": rng.standard_normal((3, 4)), "w": rng.standard_normal((4, 5))}
    c = np.linspace(-1, 2, 5)
    check(g, loss, {"x": x, "w": w}, feed, lambda x, w: (_qgelu_np(x @ w) * c).sum(),
          rtol=1e-3, atol=1e-4)


def test_vjp_given_as_another_custom_op(rng):
    grad_op = rlx.custom_op("quick_gelu_grad", quick_gelu_grad_kernel,
                            lambda dy, x: (x.shape, x.dtype),
                            lambda ds, xs: _grid(math.prod(xs)))
    op = _qgelu_op("quick_gelu_vjp_op",
                   vjp=lambda g, ins, out, dy: [g.custom(grad_op, dy, ins[0])])
    g = rlx.Graph("gk")
    x = g.input("x", (4, 6))
    loss = g.reduce("sum", g.custom(op, x) * g.custom(op, x), (0, 1))
    feed = {"x": rng.standard_normal((4, 6))}
    got = check(g, loss, {"x": x}, feed, lambda x: (_qgelu_np(x) ** 2).sum(), rtol=1e-3,
                atol=1e-4)
    assert len(got) == 2


def test_vjp_is_a_custom_op_itself(rng):
    grad_op = rlx.custom_op("quick_gelu_grad_direct", quick_gelu_grad_kernel,
                            lambda dy, x: (x.shape, x.dtype), lambda ds, xs: _grid(math.prod(xs)))
    op = _qgelu_op("quick_gelu_direct", vjp=grad_op)
    g = rlx.Graph("gd2")
    x = g.input("x", (3, 7))
    loss = g.reduce("sum", g.custom(op, x) * g.constant(np.linspace(-2, 1, 7)), (0, 1))
    check(g, loss, {"x": x}, {"x": rng.standard_normal((3, 7))},
          lambda x: (_qgelu_np(x) * np.linspace(-2, 1, 7)).sum(), rtol=1e-3, atol=1e-4)
    two = rlx.custom_op("add_row_direct", add_row_kernel, lambda x, b: (x.shape, "f32"),
                        lambda xs, bs: ((-(-xs[0] // 4), -(-xs[1] // 8)), (4, 8)), vjp=grad_op)
    h = rlx.Graph("two")
    a, b = h.input("a", (2, 8)), h.input("b", (8,))
    y = h.custom(two, a, b)
    with pytest.raises(ValueError, match=re.escape(
            f"grad: custom op 'add_row_direct' (%{y.id}) has 2 inputs; its vjp "
            "CustomOp('quick_gelu_grad_direct', kernel quick_gelu_grad_kernel) gives the "
            "gradient of a one-input op only; pass vjp=fn(g, inputs, out, dy) instead")):
        h.grad(h.reduce("sum", y, (0, 1)), a)


def test_no_vjp_raises_only_when_a_gradient_flows_through(rng):
    op = _qgelu_op("quick_gelu_novjp")
    g = rlx.Graph("nv")
    x, w = g.input("x", (2, 3)), g.input("w", (2, 3))
    y = g.custom(op, x)
    loss = g.reduce("sum", y * w, (0, 1))
    dw = g.grad(loss, w)                          # nothing flows through the custom node
    g.set_outputs([dw])
    xv = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(rlx.compile(g).run({"x": xv, "w": xv})[0], _qgelu_np(xv),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=re.escape(
            f"grad: custom op 'quick_gelu_novjp' (%{y.id} [2, 3]) has no vjp; pass "
            "vjp=fn(g, inputs, out, dy) to rlx.custom_op to differentiate through it")):
        g.grad(loss, x)


def test_vjp_result_errors():
    g = rlx.Graph("ve")
    x = g.input("x", (2, 3))
    h = rlx.Graph("other")
    for vjp, msg in [
        (lambda g, ins, out, dy: [dy, dy], "custom vjp_bad: vjp must return one Tensor or None "
                                           "per input (1), got 2"),
        (lambda g, ins, out, dy: 3.0, "custom vjp_bad: vjp must return one Tensor or None per "
                                      "input (1), got float"),
        (lambda g, ins, out, dy: [g.reduce("sum", dy, (0,))],
         "custom vjp_bad: vjp: gradient 0 has shape [3], its input Tensor(%0 'x' f32[2, 3]) "
         "[2, 3]"),
        (lambda g, ins, out, dy: [h.input("z", (2, 3))],
         "custom vjp_bad: vjp: gradient 0 must be a Tensor of this graph or None, got "
         "Tensor(%0 'z' f32[2, 3])"),
    ]:
        op = rlx.custom_op("vjp_bad", copy_kernel, lambda x: (x.shape, x.dtype),
                           lambda s: _grid(math.prod(s)), vjp=vjp, replace=True)
        loss = g.reduce("sum", g.custom(op, x), (0, 1))
        with pytest.raises(ValueError, match=re.escape(msg)):
            g.grad(loss, x)
    # a single Tensor for a one-input op, and None, are accepted
    op = rlx.custom_op("vjp_bad", copy_kernel, lambda x: (x.shape, x.dtype),
                       lambda s: _grid(math.prod(s)), vjp=lambda g, ins, out, dy: dy * 2.0,
                       replace=True)
    assert g.grad(g.reduce("sum", g.custom(op, x), (0, 1)), x).shape == (2, 3)
    op = rlx.custom_op("vjp_bad", copy_kernel, lambda x: (x.shape, x.dtype),
                       lambda s: _grid(math.prod(s)), vjp=lambda g, ins, out, dy: [None],
                       replace=True)
    assert g.grad(g.reduce("sum", g.custom(op, x), (0, 1)), x).shape == (2, 3)   # zeros


# ---- errors ----------------------------------------------------------------------------------------
def _shape(x):
    return x.shape, x.dtype


def _launch(s):
    return _grid(math.prod(s))


@pytest.mark.parametrize("args, msg", [
    (("", copy_kernel, _shape, _launch), "custom_op: name must be a non-empty str without "
                                         "spaces, got ''"),
    ((3, copy_kernel, _shape, _launch), "custom_op: name must be a non-empty str without "
                                        "spaces, got 3"),
    (("my op", copy_kernel, _shape, _launch), "custom_op: name must be a non-empty str "
                                              "without spaces, got 'my op'"),
    (("k", _shape, _shape, _launch), "custom_op 'k': kernel must be a @cuda.jit kernel (a numba "
                                     "CUDA dispatcher), got _shape"),
    (("k", None, _shape, _launch), "custom_op 'k': kernel must be a @cuda.jit kernel (a numba "
                                   "CUDA dispatcher), got NoneType"),
    (("k", a_device_function, _shape, _launch), "custom_op 'k': kernel must be a @cuda.jit "
                                                "kernel (a numba CUDA dispatcher), got a device "
                                                "function (cuda.jit(device=True)), not a kernel"),
    (("k", copy_kernel, (3,), _launch), "custom_op 'k': shape_fn must be callable, got tuple"),
    (("k", copy_kernel, _shape, 128), "custom_op 'k': launch must be callable, got int"),
    (("k", copy_kernel, _shape, _launch, "grad"), "custom_op 'k': vjp must be callable, a "
                                                  "CustomOp or None, got str"),
])
def test_custom_op_argument_errors(args, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        rlx.custom_op(*args)


def test_a_name_registered_twice():
    a = rlx.custom_op("twice", copy_kernel, _shape, _launch)
    b = rlx.custom_op("twice", copy_kernel, _shape, _launch, vjp=_qgelu_vjp_graph)  # same kernel
    assert b.vjp is _qgelu_vjp_graph and a.vjp is None
    with pytest.raises(ValueError, match=re.escape(
            "custom_op 'twice': the name is already registered with another kernel "
            "(CustomOp('twice', kernel copy_kernel)); choose another name, or pass "
            "replace=True")):
        rlx.custom_op("twice", row_sum_kernel, _shape, _launch)
    c = rlx.custom_op("twice", row_sum_kernel, _shape, _launch, replace=True)
    assert c.kernel is row_sum_kernel and repr(c) == "CustomOp('twice', kernel row_sum_kernel)"
    # a graph built with the old op keeps it
    g = rlx.Graph("t")
    y = g.custom(b, g.input("x", (3,)))
    assert y.node.attrs["custom_op"] is b


@pytest.mark.parametrize("shape_fn, msg", [
    (lambda x: x.shape, "custom sf: shape_fn must return (out_shape, dtype), got (2, 3)"),
    (lambda x: ((2, -1), "f32"), "custom sf: shape_fn's out_shape must be a tuple of ints >= 0, "
                                 "got (2, -1)"),
    (lambda x: ((2, 1.5), "f32"), "custom sf: shape_fn's out_shape must be a tuple of ints >= "
                                  "0, got (2, 1.5)"),
    (lambda x: ("ab", "f32"), "custom sf: shape_fn's out_shape must be a tuple of ints >= 0, got "
                              "'ab'"),
    (lambda x: ((2,), "f99"), "custom sf: shape_fn's dtype: unknown dtype 'f99'; expected one "
                              "of f32"),
    (lambda x: x.nope, "custom sf: shape_fn raised AttributeError: 'Tensor' object has no "
                       "attribute 'nope'"),
])
def test_shape_fn_errors(shape_fn, msg):
    op = rlx.custom_op("sf", copy_kernel, shape_fn, _launch, replace=True)
    g = rlx.Graph("s")
    with pytest.raises(ValueError, match=re.escape(msg)):
        g.custom(op, g.input("x", (2, 3)))


def test_shape_fn_may_raise_its_own_value_error_and_take_an_int_shape():
    def shape_fn(x):
        if len(x.shape) != 1:
            raise ValueError(f"flip: x must be 1-D, got {x.shape}")
        return x.shape[0], "f32"

    op = rlx.custom_op("flip", reverse_bits_kernel, shape_fn, _launch)
    g = rlx.Graph("f")
    assert g.custom(op, g.input("v", (5,))).shape == (5,)
    with pytest.raises(ValueError, match=re.escape("flip: x must be 1-D, got (2, 3)")):
        g.custom(op, g.input("x", (2, 3)))


@pytest.mark.parametrize("launch, msg", [
    (lambda s: 4, "custom ln: launch must return (blocks, threads), got 4"),
    (lambda s: (0, 32), "custom ln: launch's blocks must be an int >= 1 or a tuple of 1 to 3 of "
                        "them, got 0"),
    (lambda s: ((1, 1, 1, 1), 32), "custom ln: launch's blocks must be an int >= 1 or a tuple of "
                                   "1 to 3 of them, got (1, 1, 1, 1)"),
    (lambda s: (1, 32.0), "custom ln: launch's threads must be an int >= 1 or a tuple of 1 to 3 "
                          "of them, got 32.0"),
    (lambda s: (1, (64, 32)), "custom ln: launch's threads (64, 32) exceed CUDA's block limits "
                              "(at most 1024 threads, x and y <= 1024, z <= 64)"),
    (lambda s: (1, (1, 1, 128)), "custom ln: launch's threads (1, 1, 128) exceed CUDA's block "
                                 "limits"),
    (lambda s: ((1, 70000), 32), "custom ln: launch's blocks (1, 70000) exceed CUDA's grid limits "
                                 "(x <= 2^31 - 1, y and z <= 65535)"),
    (lambda a, b: (1, 32), "custom ln: launch raised TypeError:"),
])
def test_launch_errors_at_build_time(launch, msg):
    op = rlx.custom_op("ln", copy_kernel, _shape, launch, replace=True)
    g = rlx.Graph("l")
    with pytest.raises(ValueError, match=re.escape(msg)):
        g.custom(op, g.input("x", (6,)))


def test_custom_builder_errors():
    op = rlx.custom_op("copy_b", copy_kernel, _shape, _launch)
    g, h = rlx.Graph("a"), rlx.Graph("b")
    x, z = g.input("x", (3,)), h.input("z", (3,))
    with pytest.raises(ValueError, match=re.escape(
            "custom: op must be a CustomOp made by rlx.custom_op(...), got str")):
        g.custom("copy_b", x)
    with pytest.raises(ValueError, match=re.escape("custom copy_b: needs at least one input "
                                                   "Tensor")):
        g.custom(op)
    with pytest.raises(ValueError, match=re.escape(
            "custom copy_b: inputs[1] must be a Tensor of this graph, got ndarray")):
        g.custom(op, x, np.ones(3))
    with pytest.raises(ValueError, match=re.escape(
            "custom copy_b: inputs[0] Tensor(%0 'z' f32[3]) belongs to graph 'b', not 'a'")):
        g.custom(op, z)


# ---- custom_vjp ------------------------------------------------------------------------------------
def _round_fwd(g, x):
    return g.round(x), None


def _ste_bwd(g, res, dy):
    return [dy]                    # straight-through: the identity, not round's zero gradient


def test_custom_vjp_straight_through_estimator_uses_bwd(rng):
    ste_round = rlx.custom_vjp(_round_fwd, _ste_bwd)
    g = rlx.Graph("ste")
    x = g.input("x", (3, 5))
    c = rng.standard_normal((3, 5)).astype(np.float32)
    y = ste_round(g, x * 4.0)
    loss = g.reduce("sum", y * g.constant(c), (0, 1))
    dx = g.grad(loss, x)
    g.set_outputs([y, dx])
    xv = rng.standard_normal((3, 5)).astype(np.float32)
    for mode in ("stream", "graph"):
        yv, dxv = rlx.compile(g, exec_mode=mode).run({"x": xv})
        np.testing.assert_array_equal(yv, np.round(4.0 * xv))
        np.testing.assert_allclose(dxv, 4.0 * c, rtol=1e-6)     # round's own gradient is 0
    # the forward nodes themselves are not differentiated: plain round gives zeros
    g2 = rlx.Graph("plain")
    x2 = g2.input("x", (3, 5))
    dx2 = g2.grad(g2.reduce("sum", g2.round(x2 * 4.0) * g2.constant(c), (0, 1)), x2)
    g2.set_outputs([dx2])
    np.testing.assert_array_equal(rlx.compile(g2).run({"x": xv})[0], 0.0)


def test_custom_vjp_true_gradient_with_residuals_against_finite_differences(rng):
    def fwd(g, x, w, scale):
        h = g.tanh(x * w)
        return h * scale, {"h": h, "pair": (x, w), "scale": scale}

    def bwd(g, res, dy):
        h, (x, w), s = res["h"], res["pair"], res["scale"]
        d = dy * s * (1.0 - h * h)
        return [d * w, g.reduce("sum", d * x, (0,)), None]

    f = rlx.custom_vjp(fwd, bwd)
    g = rlx.Graph("cv")
    x, w = g.input("x", (4, 3)), g.input("w", (3,))
    loss = g.reduce("sum", f(g, x, w, 1.5) ** 2.0, (0, 1))
    feed = {"x": rng.standard_normal((4, 3)), "w": rng.standard_normal(3)}
    check(g, loss, {"x": x, "w": w}, feed,
          lambda x, w: ((np.tanh(x * w) * 1.5) ** 2).sum(), rtol=1e-3, atol=1e-4)


def test_custom_vjp_none_gradient_and_a_custom_op_inside(rng):
    op = _qgelu_op("quick_gelu_in_vjp")          # no vjp of its own: bwd_fn supplies it

    def fwd(g, x, b):
        return g.custom(op, x + b), (x + b,)

    def bwd(g, res, dy):
        (z,) = res
        return _qgelu_vjp_graph(g, [z], None, dy) + [None]

    f = rlx.custom_vjp(fwd, bwd)
    g = rlx.Graph("cv2")
    x, b = g.input("x", (2, 5)), g.input("b", (5,))
    loss = g.reduce("sum", f(g, x, b), (0, 1))
    dx, db = g.grad(loss, [x, b])
    g.set_outputs([dx, db])
    xv = rng.standard_normal((2, 5)).astype(np.float32)
    bv = rng.standard_normal(5).astype(np.float32)
    dxv, dbv = rlx.compile(g).run({"x": xv, "b": bv})
    f64 = lambda x: _qgelu_np(x + bv.astype(np.float64)).sum()   # noqa: E731
    want = numeric_grad(f64, {"x": xv.astype(np.float64)}, "x")
    np.testing.assert_allclose(dxv, want, rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(dbv, 0.0)       # bwd_fn said None: no gradient


def test_custom_vjp_output_is_a_view_without_a_kernel(rng):
    f = rlx.custom_vjp(_round_fwd, _ste_bwd)
    g = rlx.Graph("v")
    x = g.input("x", (6,))
    y = f(g, x)
    assert (y.node.op, y.shape, y.dtype) == ("custom_vjp", (6,), dt.F32)
    g.set_outputs([y])
    exe = rlx.compile(g)
    assert len(exe.steps) == 1                    # round's kernel only
    xv = (rng.standard_normal(6) * 3).astype(np.float32)
    np.testing.assert_array_equal(exe.run({"x": xv})[0], np.round(xv))


def test_custom_vjp_errors():
    g, h = rlx.Graph("e"), rlx.Graph("other")
    x = g.input("x", (3,))
    with pytest.raises(ValueError, match=re.escape("custom_vjp: fwd_fn must be callable, got "
                                                   "int")):
        rlx.custom_vjp(1, _ste_bwd)
    with pytest.raises(ValueError, match=re.escape("custom_vjp: bwd_fn must be callable, got "
                                                   "NoneType")):
        rlx.custom_vjp(_round_fwd, None)
    f = rlx.custom_vjp(_round_fwd, _ste_bwd)
    with pytest.raises(ValueError, match=re.escape(
            "custom_vjp _round_fwd: the first argument must be the Graph, got Tensor")):
        f(x)
    with pytest.raises(ValueError, match=re.escape(
            "custom_vjp _round_fwd: args[0] Tensor(%0 'z' f32[3]) belongs to graph 'other', "
            "not 'e'")):
        f(g, h.input("z", (3,)))

    def fwd_one(g, x):
        return g.round(x)
    with pytest.raises(ValueError, match=re.escape(
            "custom_vjp test_custom_vjp_errors.<locals>.fwd_one: fwd_fn must return (out, "
            "residuals), got Tensor")):
        rlx.custom_vjp(fwd_one, _ste_bwd)(g, x)

    def fwd_list(g, x):
        return [x, x], None
    with pytest.raises(ValueError, match=re.escape("fwd_fn's out must be one Tensor, got list")):
        rlx.custom_vjp(fwd_list, _ste_bwd)(g, x)

    def fwd_foreign_res(g, x):
        return g.round(x), [h.input("r", (3,))]
    with pytest.raises(ValueError, match=re.escape(
            "residual 0 Tensor(%1 'r' f32[3]) belongs to graph 'other', not 'e'")):
        rlx.custom_vjp(fwd_foreign_res, _ste_bwd)(g, x)

    for bwd, msg in [
        (lambda g, r, dy: [dy, dy], "custom_vjp _round_fwd: bwd_fn must return one gradient or "
                                    "None per arg (1), got 2"),
        (lambda g, r, dy: "dx", "custom_vjp _round_fwd: bwd_fn must return one gradient or None "
                                "per arg (1), got str"),
        (lambda g, r, dy: [g.reduce("sum", dy, (0,))],
         "custom_vjp _round_fwd: bwd_fn: gradient 0 has shape [], its input Tensor(%0 'x' "
         "f32[3]) [3]"),
    ]:
        y = rlx.custom_vjp(_round_fwd, bwd)(g, x)
        with pytest.raises(ValueError, match=re.escape(msg)):
            g.grad(g.reduce("sum", y, (0,)), x)


# ---- printing, AOT, training ------------------------------------------------------------------------
def test_graph_prints_the_custom_nodes():
    op = rlx.custom_op("copy_print", copy_kernel, _shape, _launch)
    f = rlx.custom_vjp(_round_fwd, _ste_bwd)
    g = rlx.Graph("pr")
    x = g.input("x", (4,))
    f(g, g.custom(op, x))
    text = str(g)
    assert "%1   f32[4] = custom(%0, custom_op=CustomOp('copy_print', kernel copy_kernel))" in text
    assert "%3   f32[4] = custom_vjp(%2, %1, rule=custom_vjp(_round_fwd))" in text


def test_aot_compile_and_a_train_step_through_the_custom_op(rng):
    op = _qgelu_op("quick_gelu_train", vjp=_qgelu_vjp_graph)
    g = rlx.Graph("tr")
    x, t, w = g.input("x", (6, 3)), g.input("t", (6, 4)), g.param("w", (3, 4))
    err = g.custom(op, g.matmul(x, w)) - t
    loss = g.reduce("mean", err * err, (0, 1))
    g.set_outputs([loss])
    xv = rng.standard_normal((6, 3)).astype(np.float32)
    tv = rng.standard_normal((6, 4)).astype(np.float32)
    wv = rng.standard_normal((3, 4)).astype(np.float32)
    exe = rlx.compile(g, compile_mode="aot")
    exe.set_param("w", wv)
    x64, t64, w64 = (a.astype(np.float64) for a in (xv, tv, wv))
    z = x64 @ w64
    want_loss = ((_qgelu_np(z) - t64) ** 2).mean()
    np.testing.assert_allclose(exe.run({"x": xv, "t": tv})[0], want_loss, rtol=1e-5)
    tr = rlx.compile_train(g, loss, rlx.optim.SGD(lr=0.1))
    tr.set_param("w", wv)
    np.testing.assert_allclose(tr.step({"x": xv, "t": tv}), want_loss, rtol=1e-5)
    s = 1.0 / (1.0 + np.exp(-1.702 * z))
    dz = 2.0 * (_qgelu_np(z) - t64) / z.size * (s + 1.702 * z * s * (1.0 - s))
    np.testing.assert_allclose(tr.get_param("w"), w64 - 0.1 * x64.T @ dz, rtol=1e-4, atol=1e-6)


def test_inside_a_scan_body_with_its_vjp(rng):
    """The body's custom node is inlined into the outer graph once a step (ops_control)."""
    flip = rlx.custom_op("flip_scan", reverse_bits_kernel, _shape, lambda s: _grid(s[0]),
                         vjp=lambda g, ins, out, dy: [g.custom(flip, dy)])

    def body(sub, h, x_t):
        h2 = sub.custom(flip, h) * 0.5 + x_t
        return [h2], [h2]

    g = rlx.Graph("sc")
    h0, xs = g.input("h0", (5,)), g.input("xs", (3, 5))
    (h_last,), (ys,) = g.scan(body, [h0], [xs])
    w = rng.standard_normal((3, 5)).astype(np.float32)
    loss = g.reduce("sum", ys * g.constant(w), (0, 1))
    dh0 = g.grad(loss, h0)
    g.set_outputs([h_last, ys, dh0])
    hv = rng.standard_normal(5).astype(np.float32)
    xv = rng.standard_normal((3, 5)).astype(np.float32)
    got = rlx.compile(g, exec_mode="graph").run({"h0": hv, "xs": xv})

    def f(h0, xs):
        h, out = h0, []
        for t in range(3):
            h = h[::-1] * 0.5 + xs[t]
            out.append(h)
        return h, np.stack(out)

    h_want, ys_want = f(hv.astype(np.float64), xv.astype(np.float64))
    np.testing.assert_allclose(got[0], h_want, rtol=1e-6)
    np.testing.assert_allclose(got[1], ys_want, rtol=1e-6)
    want = numeric_grad(lambda h0, xs: float((f(h0, xs)[1] * w).sum()),
                        {"h0": hv.astype(np.float64), "xs": xv.astype(np.float64)}, "h0")
    np.testing.assert_allclose(got[2], want, rtol=1e-4, atol=1e-5)
