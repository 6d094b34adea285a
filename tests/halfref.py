"""Half-precision oracles for the tests: inputs rounded to the dtype, float64 NumPy on those
rounded values, and tolerances from the unit roundoff.

A kernel that takes f16 / bf16 computes in f32 and rounds its result once, so against float64
math on the same rounded inputs its error is one rounding of the output (u |y|) plus the f32
arithmetic (about n u32 for an n-term reduction, negligible next to u). ``assert_half_close``
allows ``k`` output roundings; a kernel that accumulated in half instead would be off by about
n u |partial sums|, which the ``*_accumulation`` cases in each family make large.
"""
import ml_dtypes
import numpy as np

HOST = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
HALVES = ("f16", "bf16")
# unit roundoff: half an ulp of 1
UNIT = {"f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}
# a rounding's absolute floor: half the subnormals' spacing (u |y| is less than that there)
TINY = {"f32": 2.0 ** -150, "f16": 2.0 ** -25, "bf16": 2.0 ** -134}


def rounded(x, dtype) -> np.ndarray:
    """x rounded to ``dtype`` (nearest even), as the host array run() takes."""
    return np.asarray(x, np.float32).astype(HOST[dtype])


def f64(x) -> np.ndarray:
    return np.asarray(x).astype(np.float64)


def assert_half_close(got, want, dtype, *, k=2.0, scale=None, what=""):
    """|got - want| <= k (u (|want| + scale) + tiny) elementwise; ``scale`` (default: the
    largest |want|, times 2^-6) stands in for results that cancel to near zero, ``tiny`` is a
    subnormal result's rounding (TINY). ``got`` must already be in ``dtype``."""
    got = np.asarray(got)
    assert got.dtype == np.dtype(HOST[dtype]), f"{what}: dtype {got.dtype}, want {dtype}"
    want = f64(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, want {want.shape}"
    if scale is None:
        scale = float(np.max(np.abs(want), initial=0.0)) * 2.0 ** -6
    u = UNIT[dtype]
    err = np.abs(f64(got) - want)
    bound = k * (u * (np.abs(want) + scale) + TINY[dtype])
    bad = ~(err <= bound) & ~(np.isnan(want) & np.isnan(f64(got)))
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err - bound, -np.inf))), got.shape)
        raise AssertionError(
            f"{what} {dtype}: {int(bad.sum())} of {got.size} beyond {k} u; worst at {i}: got "
            f"{f64(got)[i]!r}, want {want[i]!r}, bound {bound[i]:.3g}")


def half_accumulated(a, b, dtype) -> np.ndarray:
    """a @ b as a kernel keeping its running sum in ``dtype`` would give it: each product
    added in f32 and the sum rounded back to the half type every step (what the tests'
    half-accumulation cases show failing their f32-accumulation tolerance)."""
    host = HOST[dtype]
    acc = np.zeros((a.shape[0], b.shape[1]), host)
    for q in range(a.shape[1]):
        acc = (acc.astype(np.float32) + f64(a[:, q:q + 1]).astype(np.float32)
               * f64(b[q:q + 1, :]).astype(np.float32)).astype(host)
    return acc
