"""The vector element-wise kernel (kernels/codegen.py's ``vec``, chosen by runtime/lower.py's
``vector_access``): a thread moves 8 f16/bf16 values in one 16-byte load or store.

Steps are built with ``elementwise_step`` on device arrays, as lowerings do, so each test
controls alignment, aliasing and which kernel runs (its ``info["vec"]``); the oracle is
float64 NumPy on the half-rounded inputs (tests/halfref.py), or bit patterns written here.
"""
import math

import numpy as np
import pytest
from numba import cuda

from halfref import HALVES, HOST, assert_half_close, f64, rounded
from rlx_numba.ir import dtypes as dt
from rlx_numba.runtime.lower import elementwise_step

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")
D = {"f16": dt.F16, "bf16": dt.BF16, "f32": dt.F32}


def _dev(host):
    """A device array of host data (bf16 as its uint16 bits, as the runtime stores it)."""
    h = np.ascontiguousarray(host)
    return cuda.to_device(h.view(np.uint16) if h.dtype == HOST["bf16"] else h)


def _host(dev, dtype):
    return dev.copy_to_host().view(HOST[dtype])


def _step(expr, out, shape, ins, in_shapes, in_dtypes):
    st = elementwise_step("%0 test", expr, out, shape, ins, in_shapes, [D[d] for d in in_dtypes])
    stream = cuda.stream()
    st.bind(stream, False)
    st()
    stream.synchronize()
    return st


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


@pytest.mark.parametrize("dtype", HALVES)
def test_unary(rng, dtype):
    x = rounded(rng.uniform(-4, 4, 72), dtype)
    out = cuda.device_array(72, np.uint16 if dtype == "bf16" else np.float16)
    st = _step(("activation", "gelu", D[dtype], ("in", 0, D[dtype])), out, (72,), [_dev(x)],
               [(72,)], [dtype])
    assert st.info["vec"] == ("ld",) and "ptx.ld4w(in0, b)" in st.info["source"]
    assert_half_close(_host(out, dtype), _gelu(f64(x)), dtype, k=1.5, what="gelu")


@pytest.mark.parametrize("dtype", HALVES)
def test_binary_broadcasts(rng, dtype):
    """A full input plus each kind of broadcast operand: per channel along a last dim of
    whole vectors (read once a vector), a row (16-byte loads at its own offsets), a scalar,
    and per channel over a last dim of 12 (8-element vectors cross rows: element loads)."""
    d = D[dtype]
    expr = ("binary", "add", d, ("in", 0, d), ("in", 1, d))
    x = rounded(rng.uniform(-4, 4, (3, 4, 16)), dtype)
    x12 = rounded(rng.uniform(-4, 4, (3, 4, 12)), dtype)
    cases = [("channel", x, (4, 1), "one"), ("row", x, (16,), "ld"), ("scalar", x, (1,), "one"),
             ("channel12", x12, (4, 1), "el")]
    for what, xv, bshape, kind in cases:
        b = rounded(rng.uniform(-4, 4, bshape), dtype)
        out = cuda.device_array(xv.size, np.uint16 if dtype == "bf16" else np.float16)
        st = _step(expr, out, xv.shape, [_dev(xv.reshape(-1)), _dev(b.reshape(-1))],
                   [xv.shape, bshape], [dtype, dtype])
        assert st.info["vec"] == ("ld", kind), what
        assert_half_close(_host(out, dtype).reshape(xv.shape), f64(xv) + f64(b), dtype, k=1,
                          what=what)


@pytest.mark.parametrize("dtype", HALVES)
def test_casts_inside_and_out(rng, dtype):
    """f32 data beside half data: cast(cast(x, f32) * y, half) reads y as two 16-byte f32
    loads; the lone casts store an f32 output as two 16-byte stores / read f32 input so."""
    d, f = D[dtype], dt.F32
    x = rounded(rng.uniform(-4, 4, 40), dtype)
    y = rng.uniform(-2, 2, 40).astype(np.float32)
    xd, yd = _dev(x), _dev(y)
    out = cuda.device_array(40, np.uint16 if dtype == "bf16" else np.float16)
    expr = ("cast", None, d, ("binary", "mul", f, ("cast", None, f, ("in", 0, d)), ("in", 1, f)))
    st = _step(expr, out, (40,), [xd, yd], [(40,), (40,)], [dtype, "f32"])
    assert st.info["vec"] == ("ld", "ld") and "ptx.ld4(in1, b + uint64(4))" in st.info["source"]
    assert_half_close(_host(out, dtype), f64(x) * f64(y), dtype, k=1, what="mixed")
    wide = cuda.device_array(40, np.float32)
    st = _step(("cast", None, f, ("in", 0, d)), wide, (40,), [xd], [(40,)], [dtype])
    assert st.info["vec"] == ("ld",) and "ptx.vst4(out, b + uint64(4)" in st.info["source"]
    np.testing.assert_array_equal(wide.copy_to_host(), x.astype(np.float32))
    st = _step(("cast", None, d, ("in", 0, f)), out, (40,), [yd], [(40,)], ["f32"])
    assert st.info["vec"] == ("ld",)
    np.testing.assert_array_equal(_host(out, dtype), y.astype(HOST[dtype]))


@pytest.mark.parametrize("dtype", HALVES)
def test_in_place(rng, dtype):
    """out is input 0 too (an in-place epilogue): plain loads for it, not the read-only
    path, and each vector is read before it is written."""
    d = D[dtype]
    x = rounded(rng.uniform(-4, 4, 48), dtype)
    r = rounded(rng.uniform(-4, 4, 48), dtype)
    xd = _dev(x)
    expr = ("activation", "relu", d, ("binary", "add", d, ("in", 0, d), ("in", 1, d)))
    st = _step(expr, xd, (48,), [xd, _dev(r)], [(48,), (48,)], [dtype, dtype])
    assert st.info["vec"] == ("vld", "ld") and "ptx.vld4w(in0, b)" in st.info["source"]
    assert_half_close(_host(xd, dtype), np.maximum(f64(x) + f64(r), 0.0), dtype, k=1)


@pytest.mark.parametrize("dtype", HALVES)
def test_tail_and_fallbacks(rng, dtype):
    """43 elements: 5 vectors and a tail of 3 one a thread. A view one element into its
    buffer (input or output: 2 bytes off 16-byte alignment) and f32-only data take the
    scalar kernel."""
    d = D[dtype]
    expr = ("activation", "neg", d, ("in", 0, d))
    x = rounded(rng.uniform(-4, 4, 44), dtype)
    xd = _dev(x)
    out = cuda.device_array(44, np.uint16 if dtype == "bf16" else np.float16)
    st = _step(expr, out, (43,), [xd], [(43,)], [dtype])
    assert st.info["vec"] == ("ld",) and st.kernel_name.endswith(" vec8")
    np.testing.assert_array_equal(_host(out, dtype)[:43], -x[:43])
    st = _step(expr, out, (43,), [xd[1:]], [(43,)], [dtype])
    assert st.info["vec"] is None and "ptx." not in st.info["source"]
    np.testing.assert_array_equal(_host(out, dtype)[:43], -x[1:])
    st = _step(expr, out[1:], (43,), [xd], [(43,)], [dtype])
    assert st.info["vec"] is None
    np.testing.assert_array_equal(_host(out, dtype)[1:], -x[:43])
    f = dt.F32
    y = cuda.to_device(np.arange(16, dtype=np.float32))
    st = _step(("activation", "neg", f, ("in", 0, f)), y, (16,), [y], [(16,)], ["f32"])
    assert st.info["vec"] is None
    np.testing.assert_array_equal(y.copy_to_host(), -np.arange(16, dtype=np.float32))


def _bf16_rne(x32):
    """float32 -> bf16 bits, round to nearest even (NaN: quiet)."""
    b = np.asarray(x32, np.float32).view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x32), ((b >> 16) | 0x40).astype(np.uint16), r)


# f32 values whose rounding is a tie or an edge: ties go to the even neighbour in both
# dtypes (f16: 1 + 2^-11, 1 + 3 2^-11, 2049, 2051, subnormal ties 2^-25, 3 2^-25; bf16:
# 1 + 2^-8, 1 + 3 2^-8, 257, 259), overflow to inf (65520 in f16; the tie 2^128 - 2^119 in bf16)
EDGES = np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2049, 2051, 2.0 ** -25, 3 * 2.0 ** -25,
                  1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 257, 259, -257, 65519.99, 65520,
                  np.float32(3.3961776e38), 0.0, -0.0, np.inf, -np.inf, np.nan, 1.0 / 3,
                  -1e-30, 1e-30, 65504, -(2.0 ** -24)], np.float32)


@pytest.mark.parametrize("dtype", HALVES)
def test_rounding_and_special_values(dtype):
    """Bit for bit: f32 -> half rounds to nearest even, as NumPy's float16 / the bf16 RNE
    above; half -> half keeps NaN (a NaN), +-inf, -0.0 and subnormals."""
    d = D[dtype]
    n = len(EDGES)
    out = cuda.device_array(n, np.uint16 if dtype == "bf16" else np.float16)
    st = _step(("cast", None, d, ("in", 0, dt.F32)), out, (n,), [_dev(EDGES)], [(n,)], ["f32"])
    assert st.info["vec"] == ("ld",)
    got = out.copy_to_host().view(np.uint16)
    want = EDGES.astype(np.float16).view(np.uint16) if dtype == "f16" else _bf16_rne(EDGES)
    nan = np.isnan(EDGES)
    np.testing.assert_array_equal(np.isnan(got.view(HOST[dtype])), nan)
    np.testing.assert_array_equal(got[~nan], want[~nan])
    bits = np.concatenate([got, [0x8000, 0x0001, 0x8001, 0x7C00 if dtype == "f16" else 0x7F80]])
    bits = bits.astype(np.uint16)
    back = cuda.device_array(len(bits), out.dtype)
    st = _step(("in", 0, d), back, (len(bits),), [_dev(bits.view(HOST[dtype]))], [(len(bits),)],
               [dtype])
    assert st.info["vec"] == ("ld",)
    rt = back.copy_to_host().view(np.uint16)
    isnan = np.isnan(bits.view(HOST[dtype]))
    np.testing.assert_array_equal(np.isnan(rt.view(HOST[dtype])), isnan)
    np.testing.assert_array_equal(rt[~isnan], bits[~isnan])


@pytest.mark.parametrize("dtype", HALVES)
def test_gated_halves_read_as_vectors(rng, dtype):
    """gated's gate and up are strided inputs over x; with halves of whole vectors (16) at
    aligned offsets they are read 16 bytes at a time too."""
    import rlx_numba as rlx
    g = rlx.Graph("gated")
    g.set_outputs([g.gated(g.input("x", (3, 32), dtype), "silu", False)])
    exe = rlx.compile(g)
    x = rounded(rng.uniform(-4, 4, (3, 32)), dtype)
    (got,) = exe.run({"x": x})
    (st,) = [s for s in exe.steps if s.kernel_name.startswith("elementwise ")]
    assert st.info["vec"] == ("ld", "ld"), st.info["vec"]
    a, b = f64(x[:, :16]), f64(x[:, 16:])
    silu = f64(rounded(a / (1 + np.exp(-a)), dtype))   # the op rounds silu(gate) first
    # k 3: the output's rounding, and silu's (an f32 silu next to the tie may round the
    # other way than the float64 one: one ulp)
    assert_half_close(got, silu * b, dtype, k=3)


def test_kernel_source_made_once_for_equal_arguments():
    """kernel_source keeps each text it made: lists and tuples of the same dtypes, modes and
    vector kinds give the text made the first time (the same object), equal to a fresh
    generation; any argument that differs gives its own text."""
    from rlx_numba.kernels import codegen
    expr = ("binary", "add", dt.F16, ("in", 0, dt.F16), ("in", 1, dt.F16))
    args = ([dt.F16, dt.F16], ["full", "bcast"], 2, True, ["ld", "one"])
    first = codegen.kernel_source(expr, *args)
    again = codegen.kernel_source(expr, *(tuple(a) if isinstance(a, list) else a for a in args))
    assert again is first
    assert first == codegen._kernel_source.__wrapped__(expr, (dt.F16, dt.F16), ("full", "bcast"),
                                                      2, True, ("ld", "one"))
    others = {codegen.kernel_source(expr, [dt.F16, dt.F16], ["full", "bcast"], 2, False,
                                    ["ld", "one"]),
              codegen.kernel_source(expr, [dt.F16, dt.F16], ["full", "bcast"], 3, True,
                                    ["ld", "one"]),
              codegen.kernel_source(expr, [dt.F16, dt.F16], ["full", "bcast"], 2, True, None),
              codegen.kernel_source(expr[:2] + (dt.F32,) + expr[3:], [dt.F16, dt.F16],
                                    ["full", "bcast"], 2, True, ["ld", "one"])}
    assert len(others) == 4 and first not in others
