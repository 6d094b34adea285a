"""Error cases: each raises the right exception type with a message that names what is wrong."""
import re

import numpy as np
import pytest

import rlx_numba as rlx


def _g(name="g"):
    return rlx.Graph(name)


# ---- builder ------------------------------------------------------------------------------
def test_unknown_activation_kind():
    g = _g()
    x = g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"activation: unknown kind 'swish'; expected one of gelu, "):
        g.activation("swish", x)


def test_unknown_binary_kind():
    g = _g()
    x = g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"binary: unknown kind 'mod'; expected one of add, sub"):
        g.binary("mod", x, x)


def test_unknown_compare_kind():
    g = _g()
    x = g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"compare: unknown kind 'lte'; expected one of eq, ne"):
        g.compare("lte", x, x)


@pytest.mark.parametrize("build,op", [
    (lambda g, a, b: g.add(a, b), "add"),
    (lambda g, a, b: g.binary("mul", a, b), "mul"),
    (lambda g, a, b: a - b, "sub"),
    (lambda g, a, b: g.lt(a, b), "lt"),
    (lambda g, a, b: a == b, "eq"),
    (lambda g, a, b: g.where(g.gt(a, 0.0), a, b), "where"),
])
def test_shapes_do_not_broadcast(build, op):
    g = _g()
    a = g.input("a", (3, 4), "f32")
    b = g.input("b", (5,), "f32")
    if op == "where":   # cond and a are [3, 4]; b is [5]
        msg = r"where: shapes do not broadcast: cond \[3, 4\], a \[3, 4\], b \[5\]"
    else:
        msg = rf"{op}: shapes do not broadcast: a \[3, 4\], b \[5\] \(axis -1 is 4 vs 5\)"
    with pytest.raises(ValueError, match=msg):
        build(g, a, b)


def test_shapes_do_not_broadcast_middle_axis():
    g = _g()
    a = g.input("a", (2, 3, 4), "f32")
    b = g.input("b", (2, 5, 4), "f32")
    with pytest.raises(ValueError, match=r"max: shapes do not broadcast: a \[2, 3, 4\], "
                                         r"b \[2, 5, 4\] \(axis -2 is 3 vs 5\)"):
        g.max(a, b)


def test_where_non_bool_cond():
    g = _g()
    c = g.input("c", (3,), "i32")
    x = g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"where: cond must be bool, got i32 \[3\]"):
        g.where(c, x, x)


@pytest.mark.parametrize("kind", ["relu", "exp", "neg", "round"])
def test_activation_on_bool(kind):
    g = _g()
    b = g.input("b", (2, 3), "bool")
    with pytest.raises(ValueError, match=rf"activation {kind}: input x is bool \[2, 3\]; cast it"):
        g.activation(kind, b)
    with pytest.raises(ValueError, match=rf"activation {kind}: input x is bool"):
        getattr(g, kind)(b)


def test_unary_minus_on_bool():
    g = _g()
    b = g.input("b", (2,), "bool")
    with pytest.raises(ValueError, match=r"activation neg: input x is bool \[2\]"):
        -b


@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div", "pow"])
def test_arithmetic_on_two_bools(kind):
    g = _g()
    a = g.input("a", (3,), "bool")
    b = g.input("b", (1,), "bool")
    with pytest.raises(ValueError, match=rf"{kind}: both operands are bool \(\[3\], \[1\]\); cast one"):
        g.binary(kind, a, b)


def test_bool_plus_python_bool():
    g = _g()
    a = g.input("a", (3,), "bool")
    with pytest.raises(ValueError, match=r"add: both operands are bool \(\[3\], \[\]\)"):
        a + True


def test_bad_python_operand():
    g = _g()
    x = g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"cannot use str 'a' as a tensor operand"):
        x + "a"


def test_tensor_has_no_truth_value():
    g = _g()
    x = g.input("x", (3,), "f32")
    with pytest.raises(TypeError, match=r"has no truth value"):
        if x < 1.0:
            pass


def test_matmul_rank_below_2():
    g = _g()
    v = g.input("v", (4,), "f32")
    m = g.input("m", (4, 5), "f32")
    with pytest.raises(ValueError, match=r"matmul: a must have rank >= 2 .* got \[4\]"):
        g.matmul(v, m)
    with pytest.raises(ValueError, match=r"matmul: b must have rank >= 2 .* got \[4\]"):
        g.matmul(g.input("m2", (5, 4), "f32"), v)
    with pytest.raises(ValueError, match=r"matmul: a must have rank >= 2"):
        v @ m


def test_matmul_inner_dim_mismatch():
    g = _g()
    a = g.input("a", (2, 3), "f32")
    b = g.input("b", (4, 5), "f32")
    with pytest.raises(ValueError, match=r"matmul: inner dimensions differ: a \[2, 3\] has K=3, "
                                         r"b \[4, 5\] has K=4"):
        a @ b


def test_matmul_batch_dims_do_not_broadcast():
    g = _g()
    a = g.input("a", (2, 3, 4), "f32")
    b = g.input("b", (3, 4, 5), "f32")
    with pytest.raises(ValueError, match=r"matmul: shapes do not broadcast: a batch \[2\], "
                                         r"b batch \[3\]"):
        g.matmul(a, b)


def test_matmul_non_f32():
    g = _g()
    a = g.input("a", (2, 3), "i32")
    b = g.input("b", (3, 5), "f32")
    with pytest.raises(ValueError, match=r"matmul: a must be f32, got i32 \[2, 3\]"):
        g.matmul(a, b)


def test_linear_bad_shapes():
    g = _g()
    x = g.input("x", (4, 8), "f32")
    w = g.param("w", (8, 16), "f32")
    with pytest.raises(ValueError, match=r"linear: w must be \[K, N\], got \[8\]"):
        g.linear(x, g.param("w1", (8,), "f32"))
    with pytest.raises(ValueError, match=r"linear: x \[4, 8\] has K=8 but w \[6, 16\] has K=6"):
        g.linear(x, g.param("w2", (6, 16), "f32"))
    with pytest.raises(ValueError, match=r"linear: bias must be \[16\] to match w \[8, 16\], "
                                         r"got \[8\]"):
        g.linear(x, w, g.param("b1", (8,), "f32"))
    with pytest.raises(ValueError, match=r"linear: bias must be \[16\] to match w \[8, 16\], "
                                         r"got \[1, 16\]"):
        g.linear(x, w, g.param("b2", (1, 16), "f32"))
    with pytest.raises(ValueError, match=r"linear: unknown activation 'swish'"):
        g.linear(x, w, activation="swish")
    with pytest.raises(ValueError, match=r"linear: x must have rank >= 1, got \[\]"):
        g.linear(g.input("s", (), "f32"), w)


def test_reshape_errors():
    g = _g()
    x = g.input("x", (2, 3), "f32")
    with pytest.raises(ValueError, match=r"reshape: cannot reshape x \[2, 3\] \(6 elements\) "
                                         r"into \[4\] \(4 elements\)"):
        g.reshape(x, (4,))
    with pytest.raises(ValueError, match=r"reshape: cannot reshape x \[2, 3\] \(6 elements\) "
                                         r"into \[4, -1\]"):
        g.reshape(x, (4, -1))
    with pytest.raises(ValueError, match=r"reshape: at most one -1 allowed in shape \[-1, -1\]"):
        g.reshape(x, (-1, -1))
    with pytest.raises(ValueError, match=r"reshape: shape \[2, -3\] must hold ints"):
        g.reshape(x, (2, -3))


@pytest.mark.parametrize("bad", ["f128", "float128", "uint16", "half", ""])   # (f64 exists)
def test_unknown_dtype_string(bad):
    g = _g()
    with pytest.raises(ValueError, match=rf"unknown dtype {re.escape(repr(bad))}; expected one "
                                         rf"of f32, f16, bf16, i32, i64, u8, i8, bool"):
        g.input("x", (3,), bad)
    x = g.input("y", (3,), "f32")
    with pytest.raises(ValueError, match=rf"unknown dtype {re.escape(repr(bad))}"):
        g.cast(x, bad)
    with pytest.raises(ValueError, match=rf"unknown dtype {re.escape(repr(bad))}"):
        g.param("p", (3,), bad)


def test_numpy_dtype_without_rlx_dtype():
    g = _g()
    with pytest.raises(ValueError, match=r"NumPy dtype uint32 has no rlx_numba dtype"):
        g.input("x", (3,), np.uint32)
    with pytest.raises(ValueError, match=r"NumPy dtype uint16 has no rlx_numba dtype"):
        g.constant(np.zeros(3, np.uint16) + 1)


def test_bad_shapes_of_leaves():
    g = _g()
    with pytest.raises(ValueError, match=r"input: shape \[3, -1\] has a negative dimension"):
        g.input("x", (3, -1), "f32")
    with pytest.raises(ValueError, match=r"param: shape must be a sequence of ints, got 5"):
        g.param("w", 5, "f32")
    with pytest.raises(ValueError, match=r"input: name must be a non-empty string, got ''"):
        g.input("", (3,), "f32")


def test_duplicate_names():
    g = _g()
    g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"input: name 'x' is already used by input %0"):
        g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"param: name 'x' is already used by input %0"):
        g.param("x", (4,), "f32")
    g.param("w", (3,), "f32")
    with pytest.raises(ValueError, match=r"input: name 'w' is already used by param %1"):
        g.input("w", (3,), "f32")


def test_tensor_from_another_graph():
    g1, g2 = _g("one"), _g("two")
    a = g1.input("a", (3,), "f32")
    b = g2.input("b", (3,), "f32")
    belongs = r"belongs to graph 'one', not 'two'"
    with pytest.raises(ValueError, match=r"add: a Tensor\(%0 'a' f32\[3\]\) " + belongs):
        g2.add(a, b)
    with pytest.raises(ValueError, match=r"add: b Tensor\(%0 'a' f32\[3\]\) " + belongs):
        b + a
    with pytest.raises(ValueError, match=r"activation relu: x .*" + belongs):
        g2.relu(a)
    with pytest.raises(ValueError, match=r"cast: x .*" + belongs):
        g2.cast(a, "f16")
    with pytest.raises(ValueError, match=r"matmul: a .*" + belongs):
        g2.matmul(g1.input("m", (2, 3), "f32"), g2.input("n", (3, 2), "f32"))
    with pytest.raises(ValueError, match=r"where: cond .*" + belongs):
        g2.where(g1.input("c", (3,), "bool"), b, b)
    with pytest.raises(ValueError, match=r"set_outputs: outputs\[1\] .*" + belongs):
        g2.set_outputs([b, a])
    with pytest.raises(ValueError, match=r"add: cannot use list \[1.0, 2.0\] as a tensor operand"):
        g2.add(b, [1.0, 2.0])


def test_set_outputs_empty():
    g = _g()
    g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"set_outputs: a graph needs at least one output"):
        g.set_outputs([])


def test_compile_without_outputs():
    g = _g("nothing")
    g.input("x", (3,), "f32")
    with pytest.raises(ValueError, match=r"compile: graph 'nothing' has no outputs; call "
                                         r"set_outputs\(\)"):
        rlx.compile(g)


# ---- executable ---------------------------------------------------------------------------
def _exe(name="run"):
    g = _g(name)
    x = g.input("x", (2, 3), "f32")
    i = g.input("i", (3,), "i32")
    w = g.param("w", (2, 3), "f32")
    g.set_outputs([x * w + i])
    return rlx.compile(g)


def test_set_param_errors():
    exe = _exe()
    with pytest.raises(ValueError, match=r"set_param: graph 'run' has no param 'v' "
                                         r"\(params: w\)"):
        exe.set_param("v", np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"set_param 'w': expected shape \[2, 3\], got \[3, 2\]"):
        exe.set_param("w", np.ones((3, 2), np.float32))
    with pytest.raises(ValueError, match=r"set_param 'w': expected shape \[2, 3\], got \[6\]"):
        exe.set_param("w", np.ones(6, np.float32))
    with pytest.raises(ValueError, match=r"set_param 'w': dtype complex64 cannot be converted "
                                         r"to the param's f32 \(shape \[2, 3\]\)"):
        exe.set_param("w", np.ones((2, 3), np.complex64))
    with pytest.raises(ValueError, match=r"set_param 'w': dtype <U1 cannot be converted"):
        exe.set_param("w", np.full((2, 3), "a"))


def test_set_param_int_param_rejects_float():
    g = _g("ip")
    p = g.param("p", (3,), "i32")
    g.set_outputs([p + 1])
    exe = rlx.compile(g)
    with pytest.raises(ValueError, match=r"set_param 'p': dtype float32 cannot be converted to "
                                         r"the param's i32"):
        exe.set_param("p", np.ones(3, np.float32))


def test_run_input_errors():
    exe = _exe()
    x = np.ones((2, 3), np.float32)
    i = np.ones(3, np.int32)
    with pytest.raises(ValueError, match=r"run: param\(s\) never set: w; call set_param\(\) first"):
        exe.run({"x": x, "i": i})
    exe.set_param("w", np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"run: unknown input\(s\) 'y'; graph 'run' takes x, i"):
        exe.run({"x": x, "i": i, "y": x})
    with pytest.raises(ValueError, match=r"run: missing input\(s\) 'i'"):
        exe.run({"x": x})
    with pytest.raises(ValueError, match=r"run: missing input\(s\) 'x', 'i'"):
        exe.run()
    with pytest.raises(ValueError, match=r"run: input 'x' must be f32 \(float32\), got float64; "
                                         r"convert it with .astype\(\)"):
        exe.run({"x": x.astype(np.float64), "i": i})
    with pytest.raises(ValueError, match=r"run: input 'i' must be i32 \(int32\), got int64"):
        exe.run({"x": x, "i": i.astype(np.int64)})
    with pytest.raises(ValueError, match=r"run: input 'x' must have shape \[2, 3\], got \[3, 2\]"):
        exe.run({"x": x.T.copy(), "i": i})
    with pytest.raises(ValueError, match=r"run: input 'i' must have shape \[3\], got \[1, 3\]"):
        exe.run({"x": x, "i": i[None]})
    with pytest.raises(ValueError, match=r"run: outputs must be 'numpy', 'device' or 'view', "
                                         r"got 'host'"):
        exe.run({"x": x, "i": i}, outputs="host")
    (y,) = exe.run({"x": x, "i": i})          # and it still runs after all that
    np.testing.assert_array_equal(y, np.full((2, 3), 2.0, np.float32))


def test_eager_missing_params():
    g = _g("e")
    x = g.input("x", (3,), "f32")
    w = g.param("w", (3,), "f32")
    v = g.param("v", (3,), "f32")
    g.set_outputs([x * w * v])
    with pytest.raises(ValueError, match=r"run: param\(s\) never set: v, w"):
        rlx.eager(g, {"x": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match=r"run: param\(s\) never set: v;"):
        rlx.eager(g, {"x": np.ones(3, np.float32)}, params={"w": np.ones(3, np.float32)})


# ---- modes --------------------------------------------------------------------------------
def _tiny():
    g = _g("tiny")
    x = g.input("x", (3,), "f32")
    g.set_outputs([g.exp(x)])
    return g


def test_bad_mode_strings():
    with pytest.raises(ValueError, match=r"compile: unknown compile_mode 'fast'; expected 'jit' "
                                         r"or 'aot'"):
        rlx.compile(_tiny(), compile_mode="fast")
    with pytest.raises(ValueError, match=r"compile: unknown exec_mode 'turbo'; expected stream, "
                                         r"eager, graph or multistream\(n\)"):
        rlx.compile(_tiny(), exec_mode="turbo")
    with pytest.raises(ValueError, match=r"ExecMode.MULTISTREAM: n must be a positive int, got 0"):
        rlx.ExecMode.MULTISTREAM(0)
    with pytest.raises(ValueError, match=r"ExecMode.MULTISTREAM: n must be a positive int, got 0"):
        rlx.compile(_tiny(), exec_mode="multistream(0)")


def test_bad_multistream_count_string():
    with pytest.raises(ValueError, match=r"compile: exec_mode 'multistream\(two\)': the stream "
                                         r"count must be an int"):
        rlx.compile(_tiny(), exec_mode="multistream(two)")


def test_good_mode_strings_still_compile():
    # the valid spellings, so the error tests above are not passing for the wrong reason
    for cm, em in (("jit", "stream"), ("AOT", "eager"), ("Jit", "STREAM")):
        exe = rlx.compile(_tiny(), compile_mode=cm, exec_mode=em)
        np.testing.assert_allclose(exe.run({"x": np.zeros(3, np.float32)})[0], np.ones(3))
