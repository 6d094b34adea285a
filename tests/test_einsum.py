"""einsum and dot_general (ir/ops_einsum.py) against np.einsum in float64: transposes, batch
products, reductions, outer products, chains of operands; their gradients (the transpose,
reshape, matmul and reduce VJPs they are built from) against finite differences; bf16 with
a tolerance from the unit roundoff; every error with its message."""
import numpy as np
import pytest

import rlx_numba as rlx
from gradcheck import check
from halfref import UNIT, assert_half_close, rounded

CASES = [
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)]),      # attention scores (k op-T)
    ("bhqk,bhkd->bhqd", [(2, 3, 4, 6), (2, 3, 6, 5)]),
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("ji,jk->ik", [(4, 3), (4, 5)]),
    ("ij,kj->ik", [(3, 4), (5, 4)]),
    ("ij->ji", [(3, 4)]),                                     # a transpose
    ("ijk->", [(3, 4, 2)]),                                   # a full reduction
    ("ijk->ki", [(3, 4, 2)]),                                 # reduce and permute
    ("i,j->ij", [(3,), (4,)]),                                # outer product
    ("i,i->", [(7,), (7,)]),                                  # dot product
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]),               # a chain
    ("abc,cd->bd", [(2, 3, 4), (4, 5)]),                      # an index summed first
    ("ab,bc,ca->", [(2, 3), (3, 4), (4, 2)]),                 # a trace of a product
    ("bij,bjk->bki", [(2, 3, 4), (2, 4, 5)]),                 # output permuted
    (",ij->ij", [(), (2, 3)]),                                # a scalar operand
    ("ibj,kbi->bjk", [(3, 2, 4), (5, 2, 3)]),                 # batch in the middle
    ("abcd,dbe->ace", [(2, 3, 2, 4), (4, 3, 5)]),
]


def _run(spec, xs, dtype="f32"):
    g = rlx.Graph()
    ts = [g.input(f"x{i}", x.shape, dtype) for i, x in enumerate(xs)]
    g.set_outputs([g.einsum(spec, *ts)])
    exe = rlx.compile(g)
    return exe, exe.run({f"x{i}": x for i, x in enumerate(xs)})[0]


@pytest.mark.parametrize("spec,shapes", CASES)
def test_einsum_matches_numpy(rng, spec, shapes):
    xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    _, got = _run(spec, xs)
    want = np.einsum(spec, *[x.astype(np.float64) for x in xs])
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * max(1.0, np.abs(want).max()))


def test_attention_scores_need_no_transpose_kernel(rng):
    """bhqd,bhkd->bhqk: k's last two axes reach the product as an op-T flag, not a copy."""
    xs = [rng.standard_normal(s).astype(np.float32) for s in [(2, 3, 4, 5), (2, 3, 6, 5)]]
    exe, _ = _run("bhqd,bhkd->bhqk", xs)
    assert not [s for s in exe.steps if "transpose" in s.name]


@pytest.mark.parametrize("spec,shapes", [CASES[0], CASES[10], CASES[15], CASES[8]])
def test_einsum_gradients(rng, spec, shapes):
    xs = {f"x{i}": rng.standard_normal(s) for i, s in enumerate(shapes)}
    g = rlx.Graph()
    ts = {k: g.input(k, v.shape) for k, v in xs.items()}
    y = g.einsum(spec, *ts.values())
    seed = rng.standard_normal(y.shape)
    check(g, y, ts, xs, lambda **kw: np.einsum(spec, *kw.values()), seed=seed)


@pytest.mark.parametrize("dtype, k", [("bf16", 512), ("f16", 4096)])
def test_einsum_half_accumulates_in_f32(rng, dtype, k):
    """A k-term dot product of half values near 1 (a transposed operand, "ki"): summed in the
    half type, the partial sums past 256 (bf16, 8 bits) or 2048 (f16, 11 bits) would lose
    every added 1.0; in f32 the result is one rounding off."""
    a = rounded(1 + 0.01 * rng.standard_normal((k, 3)), dtype)
    b = rounded(1 + 0.01 * rng.standard_normal((k, 2)), dtype)
    _, got = _run("ki,kj->ij", [a, b], dtype)
    want = a.astype(np.float64).T @ b.astype(np.float64)
    assert_half_close(got, want, dtype, k=2.0)
    assert np.all(np.abs(got.astype(np.float64) - want) < 4 * UNIT[dtype] * np.abs(want))


def test_dot_general_matches_numpy(rng):
    """lax.dot_general: out = batch dims, a's free dims, b's free dims."""
    a = rng.standard_normal((3, 2, 4, 5)).astype(np.float32)     # batch 1, contract 2, free 0, 3
    b = rng.standard_normal((4, 6, 2)).astype(np.float32)        # batch 2, contract 0, free 1
    g = rlx.Graph()
    y = g.dot_general(g.input("a", a.shape), g.input("b", b.shape), ([2], [0]), ([1], [2]))
    assert y.shape == (2, 3, 5, 6)
    g.set_outputs([y])
    (got,) = rlx.compile(g).run({"a": a, "b": b})
    want = np.einsum("xbcy,cjb->bxyj", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("build,match", [
    (lambda g, a, b: g.einsum("ij,jk", a, b), r"einsum: spec must be a string with one '->'"),
    (lambda g, a, b: g.einsum("...j,jk->k", a, b), r"einsum: '\.\.\.' is not supported"),
    (lambda g, a, b: g.einsum("ij->ij", a, b), r"einsum: spec 'ij->ij' names 1 operands, got 2"),
    (lambda g, a, b: g.einsum("ii,jk->ik", a, b), r"einsum: operand 0's indices 'ii' repeat"),
    (lambda g, a, b: g.einsum("ijk,jk->ik", a, b), r"einsum: operand 0 has 3 indices 'ijk' but "
                                                   r"rank 2 \[3, 4\]"),
    (lambda g, a, b: g.einsum("ij,ik->jk", a, b), r"einsum: index 'i' has size 3 in one operand "
                                                  r"and 4 in operand 1 \[4, 5\]"),
    (lambda g, a, b: g.einsum("ij,jk->iz", a, b), r"einsum: output index 'z' is in no operand"),
    (lambda g, a, b: g.einsum("ij,jk->ii", a, b), r"einsum: output indices 'ii' must be distinct"),
    (lambda g, a, b: g.einsum("ij,jk->ik", a, g.cast(b, "bf16")),
     r"einsum: operands\[0\] and operands\[1\] must have the same dtype"),
    (lambda g, a, b: g.dot_general(a, b, ([1], [1]), ((), ())),
     r"dot_general: contracting dim 1 of a \[3, 4\] has size 4, dim 1 of b \[4, 5\] has 5"),
    (lambda g, a, b: g.dot_general(a, b, ([1], [0, 1]), ((), ())),
     r"dot_general: contracting names 1 dims of a but 2 of b"),
    (lambda g, a, b: g.dot_general(a, b, ([2], [0])), r"dot_general: contracting\[0\] \[2\] out "
                                                      r"of range for rank 2"),
    (lambda g, a, b: g.dot_general(a, b, [1]), r"dot_general: contracting must be a pair"),
    (lambda g, a, b: g.dot_general(a, b, ([1, 1], [0, 0])), r"dot_general: contracting\[0\] "
                                                            r"\[1, 1\] repeats an axis"),
])
def test_errors(build, match):
    g = rlx.Graph()
    a, b = g.input("a", (3, 4)), g.input("b", (4, 5))
    with pytest.raises(ValueError, match=match):
        build(g, a, b)
