"""g.axial_rope2d against a float64 NumPy port of SAM 2's compute_axial_cis and
apply_rotary_enc (sam2/modeling/position_encoding.py), its gradient by finite differences,
bf16 from the unit roundoff, and its errors."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check
from halfref import assert_half_close, rounded


def sam2_axial(x, end_x, end_y, theta=10000.0):
    """SAM 2's code in NumPy complex128: freqs_cis [T, D/2] (x's then y's), x's pairs as
    complex numbers times it."""
    dim = x.shape[-1]
    fx = 1.0 / (theta ** (np.arange(0, dim, 4)[: dim // 4] / dim))
    fy = 1.0 / (theta ** (np.arange(0, dim, 4)[: dim // 4] / dim))
    t = np.arange(end_x * end_y, dtype=np.float64)
    t_x, t_y = t % end_x, np.floor(t / end_x)
    cis = np.concatenate([np.exp(1j * np.outer(t_x, fx)), np.exp(1j * np.outer(t_y, fy))], -1)
    xc = x.reshape(*x.shape[:-1], -1, 2)
    out = (xc[..., 0] + 1j * xc[..., 1]) * cis
    return np.stack([out.real, out.imag], -1).reshape(x.shape)


@pytest.mark.parametrize("shape,end_x,end_y,theta", [((2, 3, 12, 8), 4, 3, 10000.0),
                                                     ((1, 7, 12), 3, 4, 100.0)])
def test_axial_rope_matches_sam2(rng, shape, end_x, end_y, theta):
    shape = shape[:-2] + (end_x * end_y, shape[-1])
    x = rng.standard_normal(shape).astype(np.float32)
    g = rlx.Graph()
    y = g.axial_rope2d(g.input("x", shape), end_x, end_y, theta)
    g.set_outputs([y])
    (got,) = rlx.compile(g).run({"x": x})
    np.testing.assert_allclose(got, sam2_axial(x.astype(np.float64), end_x, end_y, theta),
                               rtol=1e-5, atol=1e-5)


def test_axial_rope_gradient(rng):
    x = rng.standard_normal((1, 2, 6, 8))
    g = rlx.Graph()
    xt = g.input("x", x.shape)
    y = g.axial_rope2d(xt, 3, 2)
    check(g, y, {"x": xt}, {"x": x}, lambda x: sam2_axial(x, 3, 2),
          seed=rng.standard_normal(x.shape))


def test_axial_rope_bf16(rng):
    x = rounded(rng.standard_normal((2, 2, 15, 12)), "bf16")
    g = rlx.Graph()
    g.set_outputs([g.axial_rope2d(g.input("x", x.shape, "bf16"), 5, 3)])
    (got,) = rlx.compile(g).run({"x": x})
    assert_half_close(got, sam2_axial(x.astype(np.float64), 5, 3), "bf16", k=2.0)


@pytest.mark.parametrize("args,match", [
    (((1, 2, 6, 8), 4, 2, 1e4), r"axial_rope2d: x must be \[B, H, T, D\] or \[B, T, D\] with "
                                r"T = end_x \* end_y = 8 and D a multiple of 4, got \[1, 2, 6, 8\]"),
    (((1, 2, 6, 6), 3, 2, 1e4), r"D a multiple of 4, got \[1, 2, 6, 6\]"),
    (((6, 8), 3, 2, 1e4), r"got \[6, 8\]"),
    (((1, 6, 8), 0, 2, 1e4), r"axial_rope2d: end_x must be a positive int, got 0"),
    (((1, 6, 8), 3, 2.0, 1e4), r"axial_rope2d: end_y must be a positive int, got 2.0"),
    (((1, 6, 8), 3, 2, -1.0), r"axial_rope2d: theta must be a positive number, got -1.0"),
])
def test_axial_rope_errors(args, match):
    g = rlx.Graph()
    shape, ex, ey, th = args
    with pytest.raises(ValueError, match=match):
        g.axial_rope2d(g.input("x", shape), ex, ey, th)
