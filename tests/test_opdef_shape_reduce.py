"""The OpDefs of the shape, reduce, loss, random, sample, sort, scan, FFT and collective
families: each op declared once, in its family's module, with inference, memory kind and dtype
rule; Graph.bind checks a node from its definition alone; narrow is a view only of an aligned
contiguous slice."""
import numpy as np
import pytest

import rlx_numba as rlx
from rlx_numba.ir import opdef
from rlx_numba.memory import ALIGN
from rlx_numba.runtime import lower

FAMILIES = {
    "rlx_numba.ir.ops_shape": ("transpose", "narrow", "concat", "expand", "gather",
                               "scatter_add"),
    "rlx_numba.ir.ops_reduce": ("reduce", "argmax", "argmin", "cumsum"),
    "rlx_numba.ir.ops_loss": ("cross_entropy", "cross_entropy_bwd"),
    "rlx_numba.ir.ops_random": ("dropout", "random"),
    "rlx_numba.ir.ops_sample": ("topk", "topk_values", "sample"),
    "rlx_numba.ir.ops_sort": ("argsort",),
    "rlx_numba.ir.ops_scan": ("selective_scan", "selective_scan_grad"),
    "rlx_numba.ir.ops_fft": ("dft", "rdft", "irdft", "fft", "bluestein"),
    "rlx_numba.ir.ops_dist": ("all_reduce", "all_gather", "reduce_scatter", "broadcast",
                              "all_reduce_inplace"),
}


@pytest.mark.parametrize("module,ops", FAMILIES.items())
def test_declared_in_their_module(module, ops):
    for op in ops:
        d = opdef.OPS[op]
        assert d.owner == module, (op, d.owner)
        assert d.infer is not None and d.doc, op
        assert d.memory in opdef.MEMORY_KINDS and d.dtype_rule in opdef.DTYPE_RULES, op
        assert d.tiers, f"{op} has no lowering"


def test_memory_kinds():
    assert opdef.OPS["narrow"].memory == opdef.VIEW and opdef.OPS["narrow"].view_if is not None
    assert opdef.OPS["all_reduce_inplace"].memory == opdef.INPLACE
    views = {op for ops in FAMILIES.values() for op in ops
             if opdef.OPS[op].memory != opdef.FRESH}
    assert views == {"narrow", "all_reduce_inplace"}


def test_bind_builds_what_the_builders_build():
    g = rlx.Graph("b")
    x = g.input("x", (2, 3, 4))
    assert g.bind("transpose", [x], perm=(2, 0, 1)).shape == (4, 2, 3)
    assert g.bind("expand", [g.input("y", (3, 1))], shape=(2, 3, 5)).shape == (2, 3, 5)
    assert g.bind("concat", [x, x], axis=1).shape == (2, 6, 4)
    r = g.bind("reduce", [x], kind="sum", axes=(0, 2), keep_dim=True)
    assert (r.shape, str(r.dtype)) == ((1, 3, 1), "f32")
    idx = g.bind("topk", [x], k=2)
    vals = g.bind("topk_values", [x, idx], k=2)
    assert (idx.shape, str(idx.dtype), vals.shape) == ((2, 3, 2), "i64", (2, 3, 2))
    assert g.bind("random", [], shape=(5, 2), dist="normal", seed=3, stream=0).shape == (5, 2)
    assert g.bind("rdft", [x]).shape == (2, 3, 3, 2)
    assert g.bind("all_gather", [x], world=3, rank=1).shape == (3, 2, 3, 4)


@pytest.mark.parametrize("build, match", [
    (lambda g, x: g.bind("narrow", [x], axis=1, start=2, length=5),
     r"narrow: start 2 and length 5 must satisfy"),
    (lambda g, x: g.bind("transpose", [x], perm=(0, 0, 1)), r"transpose: perm \[0, 0, 1\] is not"),
    (lambda g, x: g.bind("expand", [x], shape=(3, 3, 4)), r"expand: cannot expand x \[2, 3, 4\]"),
    (lambda g, x: g.bind("argmax", [x], axes=(0, 1), keep_dim=False),
     r"argmax: axes \(0, 1\) must be one axis or all"),
    (lambda g, x: g.bind("topk_values", [x, g.bind("topk", [x], k=2)], k=3),
     r"topk_values: idx must be i64 \[2, 3, 3\]"),
    (lambda g, x: g.bind("reduce_scatter", [x], reduce="sum", world=3, rank=0),
     r"reduce_scatter: x must be \[world=3, \.\.\.\]"),
    (lambda g, x: g.bind("all_reduce", [x], reduce="mean", world=2, rank=0),
     r"all_reduce: op must be one of"),
    (lambda g, x: g.bind("fft", [g.narrow(x, 2, 0, 2)], inverse=False),
     r"fft: the Stockham kernels take a power-of-two length, got f32 \[2, 3, 2\]"),
    (lambda g, x: g.bind("irdft", [g.narrow(x, 2, 0, 2)], n=8),
     r"irdft: x must hold the n // 2 \+ 1 bins of n=8"),
    (lambda g, x: g.bind("random", [], shape=(2,), dist="uniform", seed=-1, stream=0),
     r"random: seed must be an int in \[0, 2\^64\)"),
    (lambda g, x: g.bind("dropout", [g.cast(x, "i32")], p=0.5, seed=0, stream=0),
     r"dropout: x must be f32"),
    (lambda g, x: g.bind("cross_entropy", [x, g.input("l", (2, 4), "i32")], ignore_index=-100,
                         label_smoothing=0.0),
     r"cross_entropy: labels must be i32 or i64 \[2, 3\]"),
    (lambda g, x: g.bind("argsort", [g.cast(x, "i64")], descending=False),
     r"argsort: x must be f32 or i32"),
])
def test_bind_checks_from_the_definition(build, match):
    g = rlx.Graph("e")
    x = g.input("x", (2, 3, 4))
    with pytest.raises(ValueError, match=match):
        build(g, x)


@pytest.mark.parametrize("shape, axis, start, length, dtype, view", [
    ((4, 64), 0, 1, 2, "f32", True),       # whole rows at 256 bytes
    ((4, 64), 0, 0, 4, "f32", True),
    ((4, 8), 0, 1, 2, "f32", False),       # whole rows at 32 bytes: not aligned
    ((4, 64), 1, 0, 8, "f32", False),      # strided: a part of every row
    ((1, 128), 1, 64, 32, "f32", True),    # one row, aligned offset
    ((1, 128), 1, 64, 32, "f16", False),   # one row, 128 bytes in
    ((8, 128), 0, 2, 3, "f16", True),      # 512 bytes in
])
def test_narrow_is_a_view_of_an_aligned_contiguous_slice(shape, axis, start, length, dtype,
                                                         view):
    g = rlx.Graph("n")
    y = g.narrow(g.input("x", shape, dtype), axis, start, length)
    assert lower.is_view(y.node, g) is view
    off, rows, width, stride = lower.narrow_layout(y.node, g)
    itemsize = np.dtype(np.float32 if dtype == "f32" else np.float16).itemsize
    assert view == (lower.narrow_contiguous(y.node, g) and off * itemsize % ALIGN == 0)
