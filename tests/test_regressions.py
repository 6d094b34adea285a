"""Regression tests for defects found outside the team (issue 36's outside differential fuzzer):
each case failed on main before its fix."""
import numpy as np
import pytest

import rlx_numba as rlx
from halfref import HALVES, HOST, rounded


@pytest.mark.parametrize("outputs", ["numpy", "device", "view"])
def test_zero_size_output_keeps_its_shape(outputs):
    """A zero-size output (a narrow of length 0) came back with shape (0,) for device and
    view outputs."""
    g = rlx.Graph()
    x = g.input("x", (2, 4, 3))
    g.set_outputs([g.narrow(x, 1, 1, 0), x * 2])
    exe = rlx.compile(g)
    xv = np.arange(24, dtype=np.float32).reshape(2, 4, 3)
    empty, twice = exe.run({"x": xv}, outputs=outputs)
    assert empty.shape == (2, 0, 3)
    got = twice if outputs == "numpy" else twice.copy_to_host()
    np.testing.assert_array_equal(got, 2 * xv)


@pytest.mark.parametrize("dtype", HALVES)
def test_python_float_beside_half_is_not_rounded_first(rng, dtype):
    """x op 1.42 with x f16 / bf16: the result has x's dtype, the arithmetic runs in f32 with
    the scalar unrounded (torch's CUDA kernels), so the one rounding is the result's. With
    the scalar rounded to bf16 first (1.421875), bf16 1.5078125 - 1.42 gave 0.0859375, not
    torch's 0.087890625."""
    s = 1.42
    xv = rounded(rng.uniform(-3, 3, 37), dtype)
    if dtype == "bf16":
        xv[0] = 1.5078125
    g = rlx.Graph()
    x = g.input("x", xv.shape, dtype)
    outs = [x - s, s - x, x * s, x / s, s / x, x + s, g.binary("max", x, s), x < s]
    g.set_outputs(outs)
    assert all(o.dtype == rlx.dtype(dtype) for o in outs[:-1])
    got = rlx.compile(g).run({"x": xv})
    x32, s32 = xv.astype(np.float32), np.float32(s)      # the kernels' f32 arithmetic
    want = [x32 - s32, s32 - x32, x32 * s32, x32 / s32, s32 / x32, x32 + s32,
            np.maximum(x32, s32)]
    for k, (gv, wv) in enumerate(zip(got[:-1], want)):
        np.testing.assert_array_equal(gv, wv.astype(HOST[dtype]), err_msg=f"output {k}")
    np.testing.assert_array_equal(got[-1], x32 < s32)
    if dtype == "bf16":
        assert float(got[0][0]) == 0.087890625


def test_list_input_is_not_truncated():
    """A Python list of floats for an i32 input ran truncated ([0.7, 1.9] as [0, 1]) while the
    same values as a NumPy array were refused; integers that do not fit are refused too."""
    g = rlx.Graph()
    t = g.input("t", (2,), "i32")
    g.set_outputs([t * 2])
    exe = rlx.compile(g)
    np.testing.assert_array_equal(exe.run({"t": [3, -4]})[0], [6, -8])
    with pytest.raises(ValueError, match=r"run: input 't' \(i32 \[2\]\): got list \[0.7, 1.9\] "
                                         r"\(float64\)"):
        exe.run({"t": [0.7, 1.9]})
    with pytest.raises(ValueError, match=r"run: input 't' \(i32 \[2\]\): values 1 \.\. "
                                         r"4294967296 do not fit i32"):
        exe.run({"t": [1, 2 ** 32]})


def test_non_array_input_names_the_input():
    """exe.run({"x": "hello"}) raised NumPy's 'could not convert string to float' without
    naming the input."""
    g = rlx.Graph()
    x = g.input("x", (2,))
    g.set_outputs([x + 1])
    exe = rlx.compile(g)
    with pytest.raises(ValueError, match=r"run: input 'x' \(f32 \[2\]\): got str 'hello'"):
        exe.run({"x": "hello"})
    with pytest.raises(ValueError, match=r"run: input 'x' \(f32 \[2\]\): cannot read list"):
        exe.run({"x": [[1.0], [2.0, 3.0]]})
    np.testing.assert_array_equal(exe.run({"x": [1, 2.5]})[0], [2, 3.5])   # numbers are fine
