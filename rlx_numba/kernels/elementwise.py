"""Element-wise device functions: the 17 activations (and six gradients), 7 binary ops, casts.

Float math is done in float32 (f16/bf16 values are widened on load and rounded on store),
f64 in float64 (the ``_f64`` set);
integer ops stay integer. The kernels that call these are generated per expression by
``kernels/codegen.py`` (one grid-stride loop with the broadcast index math inlined), so each
function here is the single definition of its op.
"""
from numba import cuda, float32, float64, int32, int64, uint8, uint16, uint32

from . import mathfn as m
from .launch import device

# ---- float activations, their gradients and pow: one definition for f32 and f64 ------------
# (f16 / bf16 data computes in f32). ``float_ops(kind)`` builds the set with constants and
# math (kernels/mathfn.py) of that precision, so an f64 kernel never rounds through float32.
_ACTS = ("gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "rsqrt",
         "neg", "abs", "sin", "cos", "tan", "atan", "round")
_GRADS = ("relu_grad", "gelu_grad", "gelu_tanh_grad", "silu_grad", "sigmoid_grad", "tanh_grad")


def float_ops(kind: str) -> dict:
    """name -> device function for ``kind`` "f32" or "f64": the 17 activations, the six
    activation gradients and pow."""
    ft = float64 if kind == "f64" else float32
    mf = m.for_kind(kind)
    m_exp, m_log, m_sqrt, m_tanh, m_erf = mf.exp, mf.log, mf.sqrt, mf.tanh, mf.erf
    m_sin, m_cos, m_tan, m_atan, m_pow, m_rint = mf.sin, mf.cos, mf.tan, mf.atan, mf.pow, mf.rint
    SQRT1_2, SQRT_2_PI = ft(0.7071067811865476), ft(0.7978845608028654)
    HALF, ONE, ZERO = ft(0.5), ft(1.0), ft(0.0)
    C3, C3X3 = ft(0.044715), ft(3.0 * 0.044715)
    INV_SQRT_2PI = ft(0.3989422804014327)

    @device
    def gelu(x):  # exact, erf form
        return HALF * x * (ONE + m_erf(x * SQRT1_2))

    @device
    def gelu_tanh(x):
        return HALF * x * (ONE + m_tanh(SQRT_2_PI * (x + C3 * x * x * x)))

    @device
    def silu(x):
        return x / (ONE + m_exp(-x))

    @device
    def relu(x):
        return ZERO if x < ZERO else x  # NaN stays NaN, like torch

    @device
    def sigmoid(x):
        return ONE / (ONE + m_exp(-x))

    @device
    def tanh(x):
        return m_tanh(x)

    @device
    def exp(x):
        return m_exp(x)

    @device
    def log(x):
        return m_log(x)

    @device
    def sqrt(x):
        return m_sqrt(x)

    @device
    def rsqrt(x):
        return ONE / m_sqrt(x)

    @device
    def neg(x):
        return -x

    @device
    def abs(x):  # noqa: A001 - the op's name
        return -x if x < ZERO else x + ZERO  # abs(-0.0) is 0.0

    @device
    def sin(x):
        return m_sin(x)

    @device
    def cos(x):
        return m_cos(x)

    @device
    def tan(x):
        return m_tan(x)

    @device
    def atan(x):
        return m_atan(x)

    @device
    def round(x):  # noqa: A001 - half to even, like numpy.round / torch.round
        return m_rint(x)

    # activation gradients: grad * f'(z), for the matmul epilogue backward
    @device
    def relu_grad(g, z):   # torch's threshold_backward: z <= 0 ? 0 : g, so g passes at a NaN
        return ZERO if z <= ZERO else g

    @device
    def gelu_grad(g, z):   # d/dz z*Phi(z) = Phi(z) + z*phi(z)
        return g * (HALF * (ONE + m_erf(z * SQRT1_2)) + z * INV_SQRT_2PI * m_exp(-HALF * z * z))

    @device
    def gelu_tanh_grad(g, z):
        u = SQRT_2_PI * (z + C3 * z * z * z)
        t = m_tanh(u)
        du = SQRT_2_PI * (ONE + C3X3 * z * z)
        return g * (HALF * (ONE + t) + HALF * z * (ONE - t * t) * du)

    @device
    def silu_grad(g, z):
        s = ONE / (ONE + m_exp(-z))
        return g * s * (ONE + z * (ONE - s))

    @device
    def sigmoid_grad(g, z):
        s = ONE / (ONE + m_exp(-z))
        return g * s * (ONE - s)

    @device
    def tanh_grad(g, z):
        t = m_tanh(z)
        return g * (ONE - t * t)

    @device
    def pow(a, b):  # noqa: A001
        return m_pow(a, b)

    loc = locals()
    return {k: loc[k] for k in _ACTS + _GRADS + ("pow",)}


# the f32 set under the ops' names (ew.gelu, ...), the f64 set suffixed (ew.gelu_f64, ...)
globals().update(float_ops("f32"))
globals().update({k + "_f64": f for k, f in float_ops("f64").items()})


# ---- integer activations (same type in and out) --------------------------------------------------
@device
def relu_i(x):
    return x - x if x < 0 else x


@device
def neg_i(x):
    return -x


@device
def abs_i(x):
    return -x if x < 0 else x


@device
def round_i(x):
    return x


# ---- binary ops ---------------------------------------------------------------------------
@device
def add(a, b):
    return a + b


@device
def sub(a, b):
    return a - b


@device
def mul(a, b):
    return a * b


@device
def div(a, b):
    return a / b


@device
def max(a, b):  # noqa: A001 - NaN-propagating, like torch.maximum
    return a if (a > b or a != a) else b


@device
def min(a, b):  # noqa: A001 - NaN-propagating, like torch.minimum
    return a if (a < b or a != a) else b


add_i, sub_i, mul_i, max_i, min_i = add, sub, mul, max, min


@device
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


@device
def max_b(a, b):
    return a or b


@device
def min_b(a, b):
    return a and b


# ---- conversions -------------------------------------------------------------------------------
@device
def bf16_to_f32(u):
    """bf16 bit pattern (uint16) -> float32 (exact)."""
    return m.bits_f32(int32(uint32(u) << uint32(16)))


@device
def f32_to_bf16(x):
    """float32 -> bf16 bit pattern, round to nearest even; NaN stays a quiet NaN."""
    b = uint32(m.f32_bits(x))
    if (b & uint32(0x7FFFFFFF)) > uint32(0x7F800000):
        return uint16((b >> uint32(16)) | uint32(0x40))
    b = b + uint32(0x7FFF) + ((b >> uint32(16)) & uint32(1))
    return uint16(b >> uint32(16))


@device
def f64_to_f32_odd(x):
    """float64 -> float32 rounded to odd: x itself when it is a float32 (or NaN), else the
    neighbour of x with an odd last bit (beyond the largest float32: that float32, not inf).
    A later round to nearest even into f16 / bf16 / fp8 (each at least 2 bits narrower, bf16's
    subnormals 16 bits coarser than f32's) then equals rounding x once; rounding x to nearest
    float32 first could land on a tie of the narrow type and round again, an ulp off."""
    f = float32(x)
    if x != x or float64(f) == x:
        return f
    b = m.f32_bits(f)
    if (b & int32(1)) == int32(0):   # even: the other neighbour of x, one step toward it
        b = int32(b + int32(1)) if abs(float64(f)) < abs(x) else int32(b - int32(1))
    return m.bits_f32(b)


@device
def round_bf16(x):
    """float32 rounded to the nearest bf16 value, kept as float32."""
    return bf16_to_f32(f32_to_bf16(x))


# fp8 <-> f32 by bit manipulation, exactly as ml_dtypes (and torch's .to(float8_*)) convert:
# round to nearest even, no saturation -- e4m3fn (no infinities) gives NaN (0x7f) for NaN, inf
# and anything that rounds past 448; e5m2 overflows to inf (0x7c), NaN is 0x7e. The sign is kept.
@device
def f8e4m3_to_f32(u):
    """float8_e4m3fn byte -> float32 (exact): bias 7, 3 mantissa bits, 0x7f / 0xff NaN."""
    b = uint32(u)
    e = (b >> uint32(3)) & uint32(15)
    mant = b & uint32(7)
    sign = (b & uint32(0x80)) << uint32(24)
    if e == uint32(15) and mant == uint32(7):
        return m.bits_f32(int32(sign | uint32(0x7FC00000)))
    if e == uint32(0):       # subnormal: mant * 2^-9
        v = float32(mant) * float32(0.001953125)
        return -v if sign else v
    return m.bits_f32(int32(sign | ((e + uint32(120)) << uint32(23)) | (mant << uint32(20))))


@device
def f32_to_f8e4m3(x):
    """float32 -> float8_e4m3fn byte (see above)."""
    b = uint32(m.f32_bits(x))
    sign = (b >> uint32(24)) & uint32(0x80)
    a = b & uint32(0x7FFFFFFF)
    if a >= uint32(0x43F00000):              # >= 480 (the first value past 448), inf, NaN
        return uint8(sign | uint32(0x7F))
    if a < uint32(0x3C800000):               # below 2^-6: a subnormal, mant * 2^-9
        return uint8(sign | uint32(m.rint(m.bits_f32(int32(a)) * float32(512.0))))
    r = (a + uint32(0x7FFFF) + ((a >> uint32(20)) & uint32(1))) >> uint32(20)
    return uint8(sign | (r - uint32(960)))   # (127 - 7) << 3; 464 rounds to 448, above to 0x7f


@device
def round_f8e4m3(x):
    """float32 rounded to the nearest e4m3fn value, kept as float32."""
    return f8e4m3_to_f32(f32_to_f8e4m3(x))


@device
def f8e5m2_to_f32(u):
    """float8_e5m2 byte -> float32 (exact): bias 15, 2 mantissa bits, IEEE inf and NaN."""
    b = uint32(u)
    e = (b >> uint32(2)) & uint32(31)
    mant = b & uint32(3)
    sign = (b & uint32(0x80)) << uint32(24)
    if e == uint32(31):
        return m.bits_f32(int32(sign | uint32(0x7F800000) | (mant << uint32(21))))
    if e == uint32(0):       # subnormal: mant * 2^-16
        v = float32(mant) * float32(1.52587890625e-05)
        return -v if sign else v
    return m.bits_f32(int32(sign | ((e + uint32(112)) << uint32(23)) | (mant << uint32(21))))


@device
def f32_to_f8e5m2(x):
    """float32 -> float8_e5m2 byte (see above)."""
    b = uint32(m.f32_bits(x))
    sign = (b >> uint32(24)) & uint32(0x80)
    a = b & uint32(0x7FFFFFFF)
    if a > uint32(0x7F800000):
        return uint8(sign | uint32(0x7E))
    if a >= uint32(0x47700000):              # >= 61440, half way to 65536: rounds to inf
        return uint8(sign | uint32(0x7C))
    if a < uint32(0x38800000):               # below 2^-14: a subnormal, mant * 2^-16
        return uint8(sign | uint32(m.rint(m.bits_f32(int32(a)) * float32(65536.0))))
    r = (a + uint32(0xFFFFF) + ((a >> uint32(21)) & uint32(1))) >> uint32(21)
    return uint8(sign | (r - uint32(448)))   # (127 - 15) << 2


@device
def round_f8e5m2(x):
    """float32 rounded to the nearest e5m2 value, kept as float32."""
    return f8e5m2_to_f32(f32_to_f8e5m2(x))


@device
def f2i32(x):
    """float32 -> int32, truncating toward zero; saturates, NaN -> 0 (CUDA's cvt.rzi.sat)."""
    if x != x:
        return int32(0)
    if x >= float32(2147483648.0):
        return int32(2147483647)
    if x <= float32(-2147483648.0):
        return int32(-2147483648)
    return int32(x)


@device
def f2i64(x):
    """float32 -> int64, truncating toward zero; saturates, NaN -> 0."""
    if x != x:
        return int64(0)
    if x >= float32(9.223372036854775807e18):
        return int64(9223372036854775807)
    if x <= float32(-9.223372036854775808e18):
        return int64(-9223372036854775808)
    return int64(x)
