"""Reverse-mode autodiff: ``g.grad(y, wrt, seed=None)`` appends the backward nodes to the same
graph, so compile, fusion, the memory plan and GRAPH mode see one graph.

Each differentiable op registers its vector-Jacobian product next to its definition with
``@vjp("op")``: ``fn(g, node, dy) -> [d input 0, d input 1, ...]`` (Tensors, or None for an
input with no gradient), built from the Graph's builder methods; ``node`` is the forward
Node, ``g.tensor(i)`` a handle on any node (its inputs, its output). ``grad`` walks the nodes
between ``wrt`` and ``y`` in reverse order, asks each for its VJP and sums the contributions
to a node read more than once. An op without a VJP raises ValueError naming it, but only when
a gradient has to flow through it.

``deterministic=True``: the VJPs that scatter-add (gather, rope with a positions tensor)
use scatter_add's ordered kernel instead of atomic adds, so repeated indices sum in index
order and the gradients are the same bits on every run (torch.use_deterministic_algorithms).

Integer and bool tensors carry no gradient (a ``wrt`` of such a dtype raises ValueError); a
``wrt`` that ``y`` does not depend on gets zeros; ``g.stop_gradient(x)`` is ``x`` to the
forward pass (a view, no kernel) and a constant to the backward one.
"""
from __future__ import annotations

import numpy as np

from collections.abc import MutableMapping

from . import dtypes as dt
from .opdef import OPS, opdef
from .ops import fmt


class VjpTable(MutableMapping):
    """op name -> its VJP, read from and written to the OpDefs (one place holds a VJP)."""

    def __getitem__(self, op):
        fn = OPS[op].vjp if op in OPS else None
        if fn is None:
            raise KeyError(op)
        return fn

    def __setitem__(self, op, fn):
        opdef(op).vjp = fn

    def __delitem__(self, op):
        self[op]        # KeyError when it has none
        OPS[op].vjp = None

    def __iter__(self):
        return (n for n, d in OPS.items() if d.vjp is not None)

    def __len__(self):
        return sum(1 for _ in self)


VJPS = VjpTable()


def vjp(*ops):
    """Register ``fn(g, node, dy) -> list of input gradients`` as the VJP of ``ops`` (their
    OpDef's ``vjp``; once each)."""
    def register(fn):
        for op in ops:
            d = opdef(op)
            if d.vjp is not None:
                raise ValueError(f"vjp: op {op} already has a VJP ({d.vjp.__qualname__})")
            d.vjp = fn
        return fn
    return register


def differentiable(dtype) -> bool:
    return dtype.is_float or dtype.is_complex


def sum_to(g, t, shape):
    """``t`` summed over the axes broadcasting added or stretched, back to ``shape`` (the
    gradient of a broadcast input)."""
    shape = tuple(shape)
    if tuple(t.shape) == shape:
        return t
    lead = len(t.shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape)
                                      if d == 1 and t.shape[lead + i] != 1)
    if axes:
        t = g.reduce_sum(t, axes)
    return g.reshape(t, shape) if tuple(t.shape) != shape else t


def scatter_grad(g, target, indices, updates, axis):
    """g.scatter_add for a VJP: ordered (deterministic) inside grad(..., deterministic=True)."""
    return g.scatter_add(target, indices, updates, axis,
                         deterministic=g.deterministic_grad)


def zeros(g, shape, dtype=dt.F32):
    """A zero tensor of ``shape`` (one scalar constant, broadcast: no big constant baked)."""
    if dtype.is_complex:     # (expand moves no c64: zero pairs, viewed)
        return g.view_as_complex(zeros(g, tuple(shape) + (2,)))
    z = g.constant(np.zeros((), dtype.host), dtype)
    return g.expand(z, shape) if tuple(shape) else z


def grad(g, y, wrt, seed=None, deterministic=False):
    """The gradients of ``y`` (a scalar, or any shape with ``seed`` of y's shape: the
    vector of the vector-Jacobian product) with respect to each tensor of ``wrt`` (a
    Tensor, or a list of them: a list back), appended to ``g``; ``deterministic``: the
    same bits on every run (the module docstring)."""
    if not isinstance(deterministic, bool):
        raise ValueError(f"grad: deterministic must be a bool, got {deterministic!r}")
    g.deterministic_grad = deterministic
    try:
        return _grad(g, y, wrt, seed)
    finally:
        g.deterministic_grad = False


def _grad(g, y, wrt, seed):
    single = not isinstance(wrt, (list, tuple))
    targets = [wrt] if single else list(wrt)
    g.check("grad", "y", y)
    for i, w in enumerate(targets):
        g.check("grad", f"wrt[{i}]", w)
        if not differentiable(w.dtype):
            raise ValueError(f"grad: wrt[{i}] {w!r} is {w.dtype} {fmt(w.shape)}; only float "
                             f"tensors have gradients")
    if not differentiable(y.dtype):
        raise ValueError(f"grad: y {y!r} is {y.dtype} {fmt(y.shape)}; only a float y has "
                         f"gradients")
    if seed is None:
        if y.dtype.is_complex:
            raise ValueError(f"grad: y {y!r} is c64; a gradient without seed= needs a real y "
                             f"(torch: only real scalar outputs); pass seed= or take e.g. "
                             f"g.abs / g.real of it")
        if int(np.prod(y.shape)) != 1:
            raise ValueError(f"grad: y {y!r} has shape {fmt(y.shape)}, not a scalar; pass seed= "
                             f"(dL/dy, of y's shape) for a non-scalar y")
        seed = g.constant(np.ones(y.shape, y.dtype.host), y.dtype)
    else:
        if not hasattr(seed, "node"):
            seed = g.constant(np.asarray(seed, y.dtype.host).reshape(y.shape), y.dtype)
        g.check("grad", "seed", seed)
        if tuple(seed.shape) != tuple(y.shape):
            raise ValueError(f"grad: seed has shape {fmt(seed.shape)}, y {fmt(y.shape)}")
    nodes = g.nodes
    # the nodes a gradient flows through: reachable from a wrt and reaching y
    from_wrt = {w.id for w in targets}
    for n in nodes[min(from_wrt):y.id + 1]:
        if n.id not in from_wrt and any(i in from_wrt for i in n.inputs) and differentiable(n.dtype):
            from_wrt.add(n.id)
    relevant = set()
    if y.id in from_wrt:
        relevant.add(y.id)
        for n in reversed(nodes[:y.id + 1]):
            if n.id in relevant:
                relevant.update(i for i in n.inputs if i in from_wrt)
    adj = {y.id: seed}
    for n in reversed(nodes[:y.id + 1]):
        dy = adj.pop(n.id, None) if n.id not in from_wrt or n.id not in {w.id for w in targets} else adj.get(n.id)
        if dy is None or n.id not in relevant or not n.inputs:
            continue
        if not any(i in relevant for i in n.inputs):
            continue
        fn = opdef(n.op).vjp
        if fn is None:
            raise ValueError(f"grad: op {n.op} (%{n.id} {fmt(n.shape)}) has no gradient")
        grads = fn(g, n, dy)
        for i, d in zip(n.inputs, grads):
            if d is None or i not in relevant:
                continue
            if tuple(d.shape) != tuple(nodes[i].shape):
                raise AssertionError(f"VJP of {n.op} gave {fmt(d.shape)} for input %{i} "
                                     f"{fmt(nodes[i].shape)}")
            if d.dtype != nodes[i].dtype:
                d = g.cast(d, nodes[i].dtype)
            adj[i] = adj[i] + d if i in adj else d
    out = [adj.get(w.id) if w.id in adj else zeros(g, w.shape, w.dtype) for w in targets]
    return out[0] if single else out
