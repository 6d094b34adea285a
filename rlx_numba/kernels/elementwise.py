"""Element-wise device functions: the 17 activations (and six gradients), 7 binary ops, casts.

Float math is done in float32 (f16/bf16 values are widened on load and rounded on store);
integer ops stay integer. The kernels that call these are generated per expression by
``kernels/codegen.py`` (one grid-stride loop with the broadcast index math inlined), so each
function here is the single definition of its op.
"""
from numba import cuda, float32, int32, int64, uint16, uint32

from . import mathfn as m

_SQRT1_2 = float32(0.7071067811865476)
_SQRT_2_PI = float32(0.7978845608028654)
_HALF = float32(0.5)
_ONE = float32(1.0)
_ZERO = float32(0.0)


def _dev(f):
    return cuda.jit(device=True)(f)


# ---- float activations (float32 -> float32) --------------------------------------------------
@_dev
def gelu(x):  # exact, erf form
    return _HALF * x * (_ONE + m.erf(x * _SQRT1_2))


@_dev
def gelu_tanh(x):
    return _HALF * x * (_ONE + m.tanh(_SQRT_2_PI * (x + float32(0.044715) * x * x * x)))


@_dev
def silu(x):
    return x / (_ONE + m.exp(-x))


@_dev
def relu(x):
    return _ZERO if x < _ZERO else x  # NaN stays NaN, like torch


@_dev
def sigmoid(x):
    return _ONE / (_ONE + m.exp(-x))


@_dev
def tanh(x):
    return m.tanh(x)


@_dev
def exp(x):
    return m.exp(x)


@_dev
def log(x):
    return m.log(x)


@_dev
def sqrt(x):
    return m.sqrt(x)


@_dev
def rsqrt(x):
    return _ONE / m.sqrt(x)


@_dev
def neg(x):
    return -x


@_dev
def abs(x):  # noqa: A001 - the op's name
    return -x if x < _ZERO else x + _ZERO  # abs(-0.0) is 0.0


@_dev
def sin(x):
    return m.sin(x)


@_dev
def cos(x):
    return m.cos(x)


@_dev
def tan(x):
    return m.tan(x)


@_dev
def atan(x):
    return m.atan(x)


@_dev
def round(x):  # noqa: A001 - half to even, like numpy.round / torch.round
    return m.rint(x)


# ---- activation gradients: grad * f'(z), for the matmul epilogue backward ---------------------
_INV_SQRT_2PI = float32(0.3989422804014327)


@_dev
def relu_grad(g, z):
    return g if z > _ZERO else _ZERO


@_dev
def gelu_grad(g, z):   # d/dz z*Phi(z) = Phi(z) + z*phi(z)
    return g * (_HALF * (_ONE + m.erf(z * _SQRT1_2)) + z * _INV_SQRT_2PI * m.exp(-_HALF * z * z))


@_dev
def gelu_tanh_grad(g, z):
    u = _SQRT_2_PI * (z + float32(0.044715) * z * z * z)
    t = m.tanh(u)
    du = _SQRT_2_PI * (_ONE + float32(3.0 * 0.044715) * z * z)
    return g * (_HALF * (_ONE + t) + _HALF * z * (_ONE - t * t) * du)


@_dev
def silu_grad(g, z):
    s = _ONE / (_ONE + m.exp(-z))
    return g * s * (_ONE + z * (_ONE - s))


@_dev
def sigmoid_grad(g, z):
    s = _ONE / (_ONE + m.exp(-z))
    return g * s * (_ONE - s)


@_dev
def tanh_grad(g, z):
    t = m.tanh(z)
    return g * (_ONE - t * t)


# ---- integer activations (same type in and out) --------------------------------------------------
@_dev
def relu_i(x):
    return x - x if x < 0 else x


@_dev
def neg_i(x):
    return -x


@_dev
def abs_i(x):
    return -x if x < 0 else x


@_dev
def round_i(x):
    return x


# ---- binary ops ---------------------------------------------------------------------------
@_dev
def add(a, b):
    return a + b


@_dev
def sub(a, b):
    return a - b


@_dev
def mul(a, b):
    return a * b


@_dev
def div(a, b):
    return a / b


@_dev
def max(a, b):  # noqa: A001 - NaN-propagating, like torch.maximum
    return a if (a > b or a != a) else b


@_dev
def min(a, b):  # noqa: A001 - NaN-propagating, like torch.minimum
    return a if (a < b or a != a) else b


@_dev
def pow(a, b):  # noqa: A001
    return m.pow(a, b)


add_i, sub_i, mul_i, max_i, min_i = add, sub, mul, max, min


@_dev
def pow_i(a, b):
    """Integer power by squaring; a negative exponent gives 1/a**|b| truncated (0 unless |a|=1)."""
    if b < 0:
        if a == 1:
            return a
        if a == -1:
            return a if (b & 1) else -a
        return a - a
    r = a - a + 1
    while b > 0:
        if b & 1:
            r = r * a
        a = a * a
        b >>= 1
    return r


@_dev
def max_b(a, b):
    return a or b


@_dev
def min_b(a, b):
    return a and b


# ---- conversions -------------------------------------------------------------------------------
@_dev
def bf16_to_f32(u):
    """bf16 bit pattern (uint16) -> float32 (exact)."""
    return m.bits_f32(int32(uint32(u) << uint32(16)))


@_dev
def f32_to_bf16(x):
    """float32 -> bf16 bit pattern, round to nearest even; NaN stays a quiet NaN."""
    b = uint32(m.f32_bits(x))
    if (b & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16((b >> uint32(16)) | uint32(0x40))
    b = b + uint32(0x7FFF) + ((b >> uint32(16)) & uint32(1))
    return uint16(b >> uint32(16))


@_dev
def round_bf16(x):
    """float32 rounded to the nearest bf16 value, kept as float32."""
    return bf16_to_f32(f32_to_bf16(x))


@_dev
def f2i32(x):
    """float32 -> int32, truncating toward zero; saturates, NaN -> 0 (CUDA's cvt.rzi.sat)."""
    if x != x:
        return int32(0)
    if x >= float32(2147483648.0):
        return int32(2147483647)
    if x <= float32(-2147483648.0):
        return int32(-2147483648)
    return int32(x)


@_dev
def f2i64(x):
    """float32 -> int64, truncating toward zero; saturates, NaN -> 0."""
    if x != x:
        return int64(0)
    if x >= float32(9.223372036854775807e18):
        return int64(9223372036854775807)
    if x <= float32(-9.223372036854775808e18):
        return int64(-9223372036854775808)
    return int64(x)
