"""c64 (complex64): the two views between a c64 tensor and its [..., 2] f32 pairs, and the
complex ops built on them (mixed into Graph).

A c64 tensor's memory is its interleaved (re, im) f32 pairs, so two VIEW nodes reinterpret
it without a kernel:
  "view_as_real"     c64 [...] -> f32 [..., 2]     (torch.view_as_real)
  "view_as_complex"  f32 [..., 2] -> c64 [...]     (torch.view_as_complex)
They, "cmatmul" and reshape are the only ops whose OpDef says ``c64=True`` (ir/opdef.py
raises for any other; leaves take any dtype). Every complex op here (complex, real, imag, conj, abs,
angle, + - * /, the FFTs in ir/ops_fft.py) is built at graph-build time from f32 ops on the
pairs between those two views: no element-wise kernel reads complex64. matmul is one node of
its own, "cmatmul" (cuBLAS Cgemm on a GPU, a numba kernel on complex64 otherwise).

Gradients: each view's VJP is the other view, so the gradient of a real loss L with respect
to a c64 z is the pair (dL/dRe z, dL/dIm z) read as complex: dL/dRe + i dL/dIm, torch's
convention (the conjugate Wirtinger derivative, doubled). The f32 ops' own VJPs then give
torch's formulas: mul's dy * conj(other), div's, matmul's dy b^H and a^H dy (written out:
the cmatmul node's conjugate-transpose flags), abs's dy * z / |z| (0 at z = 0, as torch's
sgn), angle's dy * i z / |z|^2 (0 at z = 0); abs and angle choose their denominators so that
no branch a where discards puts inf or NaN into the gradient.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes as dt
from .autodiff import sum_to, vjp
from .opdef import STORAGE, VIEW, defop
from .ops import broadcast_shapes, fmt

COMPLEX_BINARY = ("add", "sub", "mul", "div")


def _desc(t):
    return f"{t.dtype} {fmt(t.shape)}"


def infer_view_as_real(x):
    if x.dtype != dt.C64:
        raise ValueError(f"view_as_real: x must be c64, got {_desc(x)}")
    return tuple(x.shape) + (2,), dt.F32


def infer_view_as_complex(x):
    if x.dtype != dt.F32 or len(x.shape) < 1 or x.shape[-1] != 2:
        raise ValueError(f"view_as_complex: x must be f32 [..., 2] (re, im), got {_desc(x)}")
    return tuple(x.shape[:-1]), dt.C64


defop("view_as_real", infer_view_as_real, memory=VIEW, dtype_rule=STORAGE, c64=True,
      doc="a c64 tensor's memory as its f32 (re, im) pairs [..., 2] (torch.view_as_real)")
defop("view_as_complex", infer_view_as_complex, memory=VIEW, dtype_rule=STORAGE, c64=True,
      doc="f32 pairs [..., 2] (re, im) as a c64 tensor [...] (torch.view_as_complex)")


@vjp("view_as_real")
def _vjp_view_as_real(g, n, dy):
    return [g.view_as_complex(dy)]


@vjp("view_as_complex")
def _vjp_view_as_complex(g, n, dy):
    return [g.view_as_real(dy)]


def _pairs(g, t):
    """t as f32 pairs [..., 2]: a c64 tensor's view, a real tensor with a zero imaginary part."""
    if t.dtype == dt.C64:
        return g.view_as_real(t)
    col = g.reshape(_f32(g, t), tuple(t.shape) + (1,))
    return g.concat([col, g.mul(col, 0.0)], -1)


def _f32(g, t):
    return t if t.dtype == dt.F32 else g.cast(t, dt.F32)


def _part(g, p, k):
    """The real (k 0) or imaginary (k 1) parts [..., 1] of pairs p [..., 2]."""
    return g.narrow(p, -1, k, 1)


def _cmul(g, a, b):
    """a * b of pairs (broadcast)."""
    ar, ai, br, bi = _part(g, a, 0), _part(g, a, 1), _part(g, b, 0), _part(g, b, 1)
    return g.concat([ar * br - ai * bi, ar * bi + ai * br], -1)


def _conj_pairs(g, p):
    return g.mul(p, g.constant(np.array([1.0, -1.0], np.float32)))


def _safe_abs(g, p):
    """|z| [..., 1] of pairs p, as hypot: m sqrt((re/m)^2 + (im/m)^2) with m = max(|re|, |im|),
    so |z|^2 never forms (in f32 it overflows past |z| ~ 1.8e19 and underflows below
    ~1e-19); an infinite part gives inf, even beside a NaN. At z = 0 the result and its slope are 0 (wheres feed
    the divisions and sqrt 1 there), as torch's sgn(0); the slope through m is 0 (the
    expression is |z| for any m > 0)."""
    ap = g.abs(p)
    m = g.reduce_max(ap, -1, keep_dim=True)
    zero = g.eq(m, 0.0)
    ms = g.where(zero, 1.0, m)
    q = p / ms
    r = ms * g.sqrt(g.where(zero, 1.0, g.reduce_sum(q * q, -1, keep_dim=True)))
    # an infinite part wins over a NaN one (hypot(inf, nan) = inf, as numpy and torch)
    inf = g.gt(g.reduce_max(g.where(g.eq(ap, math.inf), 1.0, 0.0), -1, keep_dim=True), 0.0)
    return g.where(zero, 0.0, g.where(inf, math.inf, r))


def _cdiv(g, a, b):
    """a / b of pairs by Smith's algorithm (numpy's, and torch's c10::complex): the ratio of
    b's smaller part to its larger keeps every intermediate within the operands' range, where
    a conj(b) / |b|^2 overflows past |b| ~ 1.8e19. b = 0 gives (Re a / 0, Im a / 0): inf or
    NaN, as numpy."""
    ar, ai, c, d = _part(g, a, 0), _part(g, a, 1), _part(g, b, 0), _part(g, b, 1)
    big = g.ge(g.abs(c), g.abs(d))
    rat = g.where(big, d / g.where(g.eq(c, 0.0), 1.0, c), c / g.where(g.eq(d, 0.0), 1.0, d))
    den = g.where(big, c + d * rat, d + c * rat)
    den = g.where(g.eq(g.abs(c) + g.abs(d), 0.0), 0.0, den)      # +0: a / 0's signs
    re = g.where(big, ar + ai * rat, ar * rat + ai)
    im = g.where(big, ai - ar * rat, ai * rat - ar)
    return g.concat([re / den, im / den], -1)


def binary_c64(g, kind, a, b):
    """``a kind b`` where an operand is c64 (Graph.binary sends it here): + - * / with torch's
    promotion (the other operand real or c64, broadcast; f64 raises: no complex128)."""
    if kind not in COMPLEX_BINARY:
        raise ValueError(f"{kind}: c64 operands take {', '.join(COMPLEX_BINARY)} only, got a "
                         f"{_desc(a)} and b {_desc(b)}")
    for arg, t in (("a", a), ("b", b)):
        if t.dtype == dt.F64:
            raise ValueError(f"{kind}: {arg} is f64 {fmt(t.shape)} beside a c64 operand (a "
                             f"{_desc(a)}, b {_desc(b)}): torch would give complex128, which "
                             f"rlx_numba does not have; cast it to f32 first")
    shape = broadcast_shapes(kind, ["a", "b"], [a.shape, b.shape])
    if kind in ("add", "sub"):
        p = getattr(g, kind)(_pairs(g, a), _pairs(g, b))
    elif b.dtype != dt.C64:           # a complex times / over a real: each part scaled
        r = g.reshape(_f32(g, b), tuple(b.shape) + (1,))
        p = getattr(g, kind)(g.view_as_real(a), r)
    elif kind == "mul":
        p = (g.mul(g.view_as_real(b), g.reshape(_f32(g, a), tuple(a.shape) + (1,)))
             if a.dtype != dt.C64 else _cmul(g, g.view_as_real(a), g.view_as_real(b)))
    else:
        p = _cdiv(g, _pairs(g, a), g.view_as_real(b))
    out = g.view_as_complex(p)
    assert out.shape == shape, (out.shape, shape)
    return out


def _mat(op, arg, t, h):
    """(rows, cols) of op(t): t's last two axes, swapped when ``h`` (conjugate transpose)."""
    if t.dtype != dt.C64:
        raise ValueError(f"{op}: {arg} must be c64, got {_desc(t)}")
    if len(t.shape) < 2:
        raise ValueError(f"{op}: {arg} must have rank >= 2 ([..., M, K] @ [..., K, N]), got "
                         f"{fmt(t.shape)}")
    r, c = t.shape[-2:]
    return (c, r) if h else (r, c)


def infer_cmatmul(a, b, ha=False, hb=False):
    """op(a) @ op(b), op the conjugate transpose of the last two axes where ``ha`` / ``hb``."""
    (m, k), (k2, n) = _mat("matmul", "a", a, ha), _mat("matmul", "b", b, hb)
    if k != k2:
        raise ValueError(f"matmul: inner dimensions differ: a {fmt(a.shape)} has K={k}, b "
                         f"{fmt(b.shape)} has K={k2}")
    batch = broadcast_shapes("matmul", ["a batch", "b batch"], [a.shape[:-2], b.shape[:-2]])
    return batch + (m, n), dt.C64


defop("cmatmul", infer_cmatmul, c64=True, tier_env="RLX_NUMBA_CMATMUL_TIERS",
      doc="c64 op(a) @ op(b) (op: conjugate transpose where ha / hb), batch broadcast: "
          "cuBLAS Cgemm on a GPU, a numba kernel otherwise (runtime/lower_complex.py)")


def _sum_to_c64(g, t, shape):
    """sum_to of a c64 gradient, on its pairs (the trailing 2 stays aligned)."""
    if tuple(t.shape) == tuple(shape):
        return t
    return g.view_as_complex(sum_to(g, g.view_as_real(t), tuple(shape) + (2,)))


@vjp("cmatmul")
def _vjp_cmatmul(g, n, dy):
    """y = A B with A = op(a), B = op(b): dA = dy B^H, dB = A^H dy (torch's), through the
    flags: no conjugate or transpose is materialised."""
    a, b = g.tensor(n.inputs[0]), g.tensor(n.inputs[1])
    ha, hb = n.attrs["ha"], n.attrs["hb"]
    mm = lambda x, y, hx, hy: g.bind("cmatmul", [x, y], ha=hx, hb=hy)   # noqa: E731
    da = mm(b, dy, hb, True) if ha else mm(dy, b, False, not hb)
    db = mm(dy, a, True, ha) if hb else mm(a, dy, not ha, False)
    return [_sum_to_c64(g, da, a.shape), _sum_to_c64(g, db, b.shape)]


def matmul_c64(g, a, b):
    """a @ b for c64 a and b (Graph.matmul sends c64 here): one "cmatmul" node."""
    if a.dtype != b.dtype:
        raise ValueError(f"matmul: a and b must have the same dtype, got a {_desc(a)} and b "
                         f"{_desc(b)}; cast the real one with g.complex(x, 0) or g.cast(x, "
                         f"'c64') first (torch does not promote inside a product either)")
    return g.bind("cmatmul", [a, b], ha=False, hb=False)


def unary_c64(g, kind, x):
    """activation ``kind`` of a c64 x (Graph.activation sends it here): abs (f32) and neg; any
    other kind raises (its OpDef takes no c64)."""
    if kind == "abs":
        return g.reshape(_safe_abs(g, g.view_as_real(x)), x.shape)
    if kind == "neg":
        return g.view_as_complex(g.activation("neg", g.view_as_real(x)))
    return g.bind("activation", [x], kind=kind)        # (raises, naming the op)


def cast_c64(g, x):
    """x as c64 (Graph.cast to c64): a real x gets a zero imaginary part."""
    if x.dtype == dt.C64:
        return x
    if x.dtype == dt.F64:
        raise ValueError(f"cast: x is {_desc(x)}; f64 to c64 would round it to f32: cast it to "
                         f"f32 first")
    return g.view_as_complex(_pairs(g, x))


class ComplexOps:
    """Builder methods; ``self`` is the Graph."""

    def view_as_real(self, x):
        """torch.view_as_real: a c64 [...] as f32 [..., 2] (re, im), no copy."""
        self.check("view_as_real", "x", x)
        return self.bind("view_as_real", [x])

    def view_as_complex(self, x):
        """torch.view_as_complex: f32 [..., 2] (re, im) as c64 [...], no copy."""
        self.check("view_as_complex", "x", x)
        return self.bind("view_as_complex", [x])

    def complex(self, re, im):
        """torch.complex: re + i im, c64 (re and im real, f32 or narrower; broadcast)."""
        op = "complex"
        self.check(op, "re", re)
        self.check(op, "im", im)
        for arg, t in (("re", re), ("im", im)):
            if not (t.dtype.is_float or t.dtype.is_int) or t.dtype == dt.F64:
                raise ValueError(f"{op}: {arg} must be a real f32 (or f16 / bf16 / integer) "
                                 f"tensor, got {_desc(t)}")
        shape = broadcast_shapes(op, ["re", "im"], [re.shape, im.shape])
        cols = []
        for t in (re, im):
            t = _f32(self, t)
            if tuple(t.shape) != shape:
                t = self.expand(t, shape)
            cols.append(self.reshape(t, shape + (1,)))
        return self.view_as_complex(self.concat(cols, -1))

    def _complex_part(self, op, z, k):
        self.check(op, "z", z)
        if z.dtype != dt.C64:
            raise ValueError(f"{op}: z must be c64, got {_desc(z)}")
        return self.reshape(_part(self, self.view_as_real(z), k), z.shape)

    def real(self, z):
        """torch.real: the real part of a c64 z (f32); a real z as it is."""
        if getattr(z, "dtype", None) is not None and z.dtype != dt.C64:
            return self.check("real", "z", z)
        return self._complex_part("real", z, 0)

    def imag(self, z):
        """torch.imag: the imaginary part of a c64 z (f32); a real z raises, as torch."""
        return self._complex_part("imag", z, 1)

    def conj(self, z):
        """torch.conj: re - i im (a copy); a real z as it is."""
        self.check("conj", "z", z)
        if z.dtype != dt.C64:
            return z
        return self.view_as_complex(_conj_pairs(self, self.view_as_real(z)))

    def angle(self, z):
        """torch.angle: atan2(im, re) of a c64 z (f32, in (-pi, pi], 0 at 0); of a real z, pi
        where it is negative, else 0. As 2 atan(tan(angle / 2)) with tan(angle / 2) = im /
        (|z| + re) where re >= 0, (|z| - re) / im where re < 0: neither cancels."""
        op = "angle"
        self.check(op, "z", z)
        if z.dtype != dt.C64:
            if not (z.dtype.is_float or z.dtype.is_int):
                raise ValueError(f"{op}: z must be numeric, got {_desc(z)}")
            return self.where(self.lt(z, 0), math.pi, 0.0)
        p = self.view_as_real(z)
        re, im, r = _part(self, p, 0), _part(self, p, 1), _safe_abs(self, p)
        d1 = r + re                    # 0 where re >= 0 only at z = 0: angle 0, slope 0
        at0 = self.eq(d1, 0.0)
        a1 = 2.0 * self.atan(self.where(at0, 0.0, im) / self.where(at0, 1.0, d1))
        flat = self.eq(im, 0.0)
        a2 = 2.0 * self.atan((r - re) / self.where(flat, 1.0, im))
        ang = self.where(self.ge(re, 0.0), a1, self.where(flat, math.pi, a2))
        return self.reshape(ang, z.shape)
