"""Scalar math for device code, one name for the GPU and the simulator.

On the GPU these are numba's ``math``/libdevice functions (float32 in, float32 out). In the
simulator kernels run as plain Python, where ``math.log(0.0)`` raises and ``math.exp(1e3)``
overflows with an exception; there they are NumPy float32 ufuncs with IEEE results (inf, nan)
and warnings silenced, so both modes give the same special values.

``F64`` holds the float64 set (f64 kernels, kernels/elementwise.py's ``float_ops("f64")``):
libdevice's double functions on the GPU, NumPy float64 ufuncs in the simulator. Nothing in
it rounds to float32 (the simulator's float32 set above would: it casts its arguments).
"""
import math
from types import SimpleNamespace

import numpy as np

from ..device import SIMULATOR
from .launch import inline

if not SIMULATOR:
    from numba.cuda import libdevice

    exp = math.exp
    # softmax weights exp(x), x <= 0: ex2.approx(x * log2 e), 2 instructions against expf's ~16;
    # relative error ~|x| * 6e-8 + 2^-22, far below f32 attention's tolerance
    fast_exp = libdevice.fast_expf
    exp2 = libdevice.exp2f            # ex2.approx (2 ulp): the tensor-core flash's softmax
    log = math.log
    sqrt = math.sqrt
    tanh = math.tanh
    erf = math.erf
    sin = math.sin
    cos = math.cos
    tan = math.tan
    atan = math.atan
    pow = math.pow
    rint = libdevice.rintf            # round half to even
    # numba types math.* by the argument: a float64 argument gets libdevice's double version
    F64 = SimpleNamespace(exp=math.exp, fast_exp=math.exp, log=math.log, sqrt=math.sqrt,
                          tanh=math.tanh, erf=math.erf, sin=math.sin, cos=math.cos,
                          tan=math.tan, atan=math.atan, pow=math.pow, rint=libdevice.rint)
    f32_bits = libdevice.float_as_int  # float32 -> its int32 bit pattern
    bits_f32 = libdevice.int_as_float  # int32 bit pattern -> float32
else:
    def _wrap(ufunc):
        def f(*args):
            with np.errstate(all="ignore"):
                return ufunc(*(np.float32(a) for a in args))
        f.__name__ = ufunc.__name__
        return f

    exp = _wrap(np.exp)
    fast_exp = exp
    exp2 = _wrap(np.exp2)
    log = _wrap(np.log)
    sqrt = _wrap(np.sqrt)
    tanh = _wrap(np.tanh)
    sin = _wrap(np.sin)
    cos = _wrap(np.cos)
    tan = _wrap(np.tan)
    atan = _wrap(np.arctan)
    pow = _wrap(np.power)
    rint = _wrap(np.rint)

    def erf(x):
        x = float(x)
        return np.float32(x if x != x else math.erf(x))

    def _wrap64(ufunc):
        def f(*args):
            with np.errstate(all="ignore"):
                return ufunc(*(np.float64(a) for a in args))
        f.__name__ = ufunc.__name__ + "_f64"
        return f

    def _erf64(x):
        x = float(x)
        return np.float64(x if x != x else math.erf(x))

    _exp64 = _wrap64(np.exp)
    F64 = SimpleNamespace(exp=_exp64, fast_exp=_exp64, log=_wrap64(np.log),
                          sqrt=_wrap64(np.sqrt), tanh=_wrap64(np.tanh), erf=_erf64,
                          sin=_wrap64(np.sin), cos=_wrap64(np.cos), tan=_wrap64(np.tan),
                          atan=_wrap64(np.arctan), pow=_wrap64(np.power),
                          rint=_wrap64(np.rint))

    def f32_bits(x):
        return np.float32(x).view(np.int32)

    def bits_f32(i):
        return np.int32(i).view(np.float32)


@inline
def max_nan(a, b):
    """max keeping a NaN, as torch's: the builtin max is fmaxf on a GPU, which returns the
    other operand (and Python's max, the simulator's, keeps a NaN only as its first)."""
    return a if (a > b or a != a) else b


F32 = SimpleNamespace(exp=exp, fast_exp=fast_exp, log=log, sqrt=sqrt, tanh=tanh, erf=erf,
                      sin=sin, cos=cos, tan=tan, atan=atan, pow=pow, rint=rint)


def for_kind(kind: str) -> SimpleNamespace:
    """The math set a kernel of compute kind ``kind`` uses: F64 for "f64", else F32 (f16 /
    bf16 data computes in f32)."""
    return F64 if kind == "f64" else F32
