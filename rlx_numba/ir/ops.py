"""The leaves, the element-wise ops, the products and reshape: their OpDefs (ir/opdef.py),
and the shared helpers of every op's inference (broadcasting, axes, shapes).

Each ``infer_<op>(*inputs, **attrs)`` takes the input Tensors (``.shape``, ``.dtype``), checks
them, and returns ``(shape, dtype)`` or raises ValueError naming the op, the argument and the
shapes. ``Graph.bind`` calls them through the OpDefs; nothing else decides shapes.
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .opdef import EXACT, F32, LEAF, STORAGE, VIEW, defop

ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sqrt",
               "rsqrt", "neg", "abs", "sin", "cos", "tan", "atan", "round")
# activations that keep an integer input integer (the rest produce f32 from integers)
INT_PRESERVING = ("relu", "neg", "abs", "round")
BINARY = ("add", "sub", "mul", "div", "max", "min", "pow")
# activations with a gradient kernel (matmul_bias_activation_bwd); None is the identity
GRAD_ACTIVATIONS = (None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")


def fmt(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def broadcast_shapes(op: str, names: list[str], shapes: list[tuple]) -> tuple:
    """NumPy broadcasting of several shapes, with an error naming the op and operands."""
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        size = 1
        for s in shapes:
            d = s[i - rank + len(s)] if i - rank + len(s) >= 0 else 1
            if d != 1:
                if size not in (1, d):
                    parts = ", ".join(f"{n} {fmt(s)}" for n, s in zip(names, shapes))
                    raise ValueError(f"{op}: shapes do not broadcast: {parts} "
                                     f"(axis {i - rank} is {size} vs {d})")
                size = d
        out.append(size)
    return tuple(out)


def normalize_shape(op: str, arg: str, shape) -> tuple:
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise ValueError(f"{op}: {arg} must be a sequence of ints, got {shape!r}") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"{op}: {arg} {fmt(shape)} has a negative dimension")
    return shape


def infer_activation(x, kind: str):
    if kind not in ACTIVATIONS:
        raise ValueError(f"activation: unknown kind {kind!r}; expected one of {', '.join(ACTIVATIONS)}")
    if x.dtype == dt.BOOL:
        raise ValueError(f"activation {kind}: input x is bool {fmt(x.shape)}; cast it to a "
                         f"numeric dtype first")
    if x.dtype.is_int and kind not in INT_PRESERVING:
        return x.shape, dt.F32
    return x.shape, x.dtype


def result_dtype(a, b):
    """The dtype two operands give (dt.promote), where a weak scalar (Graph._operand: an f32
    constant of a Python float beside a half tensor) takes the other operand's float dtype."""
    weak = lambda t, o: (getattr(t, "node", None) is not None and t.node.attrs.get("weak")  # noqa: E731
                         and o.dtype.is_float)
    if weak(a, b):
        return b.dtype
    if weak(b, a):
        return a.dtype
    return dt.promote(a.dtype, b.dtype)


def infer_binary(a, b, kind: str):
    if kind not in BINARY:
        raise ValueError(f"binary: unknown kind {kind!r}; expected one of {', '.join(BINARY)}")
    shape = broadcast_shapes(kind, ["a", "b"], [a.shape, b.shape])
    out = result_dtype(a, b)
    if out == dt.BOOL and kind not in ("max", "min"):
        raise ValueError(f"{kind}: both operands are bool ({fmt(a.shape)}, {fmt(b.shape)}); "
                         f"cast one to a numeric dtype first")
    if kind == "div" and not out.is_float:
        out = dt.F32  # true division, like torch and numpy
    return shape, out


def infer_gated(x, activation: str, interleaved: bool):
    """activation(gate) * up over the last axis's two halves (or its even / odd entries)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"gated: unknown activation {activation!r}; expected one of "
                         f"{', '.join(ACTIVATIONS)}")
    if not isinstance(interleaved, bool):
        raise ValueError(f"gated: interleaved must be a bool, got {interleaved!r}")
    if not x.dtype.is_float:
        raise ValueError(f"gated: x must be a float tensor, got {x.dtype} {fmt(x.shape)}")
    if len(x.shape) == 0 or x.shape[-1] % 2:
        raise ValueError(f"gated: x's last axis must have an even length (gate and up), got "
                         f"x {fmt(x.shape)}")
    return tuple(x.shape[:-1]) + (x.shape[-1] // 2,), x.dtype


def infer_compare(a, b, kind: str):
    if kind not in COMPARE:
        raise ValueError(f"compare: unknown kind {kind!r}; expected one of {', '.join(COMPARE)}")
    return broadcast_shapes(kind, ["a", "b"], [a.shape, b.shape]), dt.BOOL


def infer_where(cond, a, b):
    if cond.dtype != dt.BOOL:
        raise ValueError(f"where: cond must be bool, got {cond.dtype} {fmt(cond.shape)}")
    shape = broadcast_shapes("where", ["cond", "a", "b"], [cond.shape, a.shape, b.shape])
    return shape, result_dtype(a, b)


def infer_cast(x, to):
    return x.shape, dt.dtype(to)


def infer_reshape(x, shape, stop_gradient=False):
    shape = list(shape)
    n = math.prod(x.shape)
    if sum(1 for d in shape if d == -1) > 1:
        raise ValueError(f"reshape: at most one -1 allowed in shape {shape}")
    if any((not isinstance(d, int)) or d < -1 for d in shape):
        raise ValueError(f"reshape: shape {shape} must hold ints >= 0 (and one -1)")
    if -1 in shape:
        known = math.prod(d for d in shape if d != -1)
        if known == 0 or n % known:
            raise ValueError(f"reshape: cannot reshape x {fmt(x.shape)} ({n} elements) into {shape}")
        shape[shape.index(-1)] = n // known
    if math.prod(shape) != n:
        raise ValueError(f"reshape: cannot reshape x {fmt(x.shape)} ({n} elements) into "
                         f"{fmt(shape)} ({math.prod(shape)} elements)")
    return tuple(shape), x.dtype


PRODUCT_DTYPES = (dt.F32, dt.F16, dt.BF16, dt.F64)


def product_dtype(op, named) -> dt.DType:
    """The dtype of a product's float operands ``named`` [(arg, Tensor)]: f32, f16, bf16 or
    f64 (computed in f64: cuBLAS Dgemm), the same for all (torch's rule: no promotion inside a product; cast one first)."""
    for arg, t in named:
        if t.dtype not in PRODUCT_DTYPES:
            raise ValueError(f"{op}: {arg} must be f32, got {t.dtype} {fmt(t.shape)} (or f16 / "
                             f"bf16: every float operand of one dtype), or f64")
    (arg0, t0), *rest = named
    for arg, t in rest:
        if t.dtype != t0.dtype:
            raise ValueError(f"{op}: {arg0} and {arg} must have the same dtype, got {arg0} "
                             f"{t0.dtype} {fmt(t0.shape)} and {arg} {t.dtype} {fmt(t.shape)}; "
                             f"cast one of them first")
    return t0.dtype


def infer_matmul(a, b):
    for arg, t in (("a", a), ("b", b)):
        if len(t.shape) < 2:
            raise ValueError(f"matmul: {arg} must have rank >= 2 ([..., M, K] @ [..., K, N]), "
                             f"got {fmt(t.shape)}")
    out = product_dtype("matmul", [("a", a), ("b", b)])
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dimensions differ: a {fmt(a.shape)} has K={a.shape[-1]}, "
                         f"b {fmt(b.shape)} has K={b.shape[-2]}")
    batch = broadcast_shapes("matmul", ["a batch", "b batch"], [a.shape[:-2], b.shape[:-2]])
    return batch + (a.shape[-2], b.shape[-1]), out


def infer_linear(x, w, bias=None, activation=None, residual=None):
    if len(x.shape) < 1:
        raise ValueError(f"linear: x must have rank >= 1, got {fmt(x.shape)}")
    if len(w.shape) != 2:
        raise ValueError(f"linear: w must be [K, N], got {fmt(w.shape)}")
    out_dtype = product_dtype("linear", [("x", x), ("w", w)]
                               + [(n, t) for n, t in (("bias", bias), ("residual", residual))
                                  if t is not None])
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"linear: x {fmt(x.shape)} has K={x.shape[-1]} but w {fmt(w.shape)} "
                         f"has K={w.shape[0]}")
    if bias is not None:
        if tuple(bias.shape) != (w.shape[1],):
            raise ValueError(f"linear: bias must be [{w.shape[1]}] to match w {fmt(w.shape)}, "
                             f"got {fmt(bias.shape)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"linear: unknown activation {activation!r}; expected one of "
                         f"{', '.join(ACTIVATIONS)}")
    out = tuple(x.shape[:-1]) + (w.shape[1],)
    if residual is not None:
        if tuple(residual.shape) != out:
            raise ValueError(f"linear: residual must have the output's shape {fmt(out)} (x "
                             f"{fmt(x.shape)} @ w {fmt(w.shape)}), got {fmt(residual.shape)}")
    return out, out_dtype


def normalize_axis(op: str, arg: str, axis, rank: int) -> int:
    """A possibly negative axis as 0..rank-1, or a ValueError naming the op."""
    if not isinstance(axis, (int,)) or isinstance(axis, bool):
        raise ValueError(f"{op}: {arg} must be an int, got {axis!r}")
    if not -rank <= axis < rank:
        raise ValueError(f"{op}: {arg} {axis} is out of range for rank {rank}")
    return axis % rank


def normalize_axes(op: str, arg: str, axes, rank: int) -> tuple:
    """An int or a sequence of ints as a sorted tuple of distinct non-negative axes."""
    if axes is None:
        return tuple(range(rank))
    seq = (axes,) if isinstance(axes, int) else tuple(axes)
    out = tuple(sorted(normalize_axis(op, arg, a, rank) for a in seq))
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: {arg} {axes!r} repeats an axis")
    return out


def infer_linear_node(x, w, *rest, activation=None, has_bias=False, has_residual=False):
    """infer_linear from a linear node's inputs [x, w, (bias), (residual)] and attrs."""
    rest = list(rest)
    bias = rest.pop(0) if has_bias else None
    residual = rest.pop(0) if has_residual else None
    return infer_linear(x, w, bias, activation, residual)


def infer_activation_grad(dy, x, kind):
    """dy * f'(x), the gradient kernel of an activation (GRAD_ACTIVATIONS)."""
    if kind not in GRAD_ACTIVATIONS or kind is None:
        raise ValueError(f"activation_grad: no gradient kernel for {kind!r}")
    if tuple(dy.shape) != tuple(x.shape):
        raise ValueError(f"activation_grad: dy {fmt(dy.shape)} and x {fmt(x.shape)} differ")
    return x.shape, dt.F64 if dt.F64 in (dy.dtype, x.dtype) else dt.F32


def infer_gated_bwd(dy, x, activation, interleaved):
    """The gradient of gated(x): x's shape."""
    shape, _ = infer_gated(x, activation, interleaved)
    if tuple(dy.shape) != shape:
        raise ValueError(f"gated_bwd: dy must be {fmt(shape)} (gated of x {fmt(x.shape)}), got "
                         f"{fmt(dy.shape)}")
    return x.shape, dt.F32


def _built_by_graph(*inputs, **attrs):
    raise ValueError("a leaf is built by g.input / g.param / g.constant, not bind")


def _built_by_fusion(*inputs, **attrs):
    raise ValueError("a fused region is built by the fusion pass (passes/fusion.py), not bind")


def _cast_aliases(node, graph) -> bool:
    return graph.nodes[node.inputs[0]].dtype == node.dtype


for _leaf in ("input", "param", "constant"):
    defop(_leaf, _built_by_graph, memory=LEAF, dtype_rule=STORAGE,
          doc="a run() input, a weight, or a constant baked into the graph")
defop("activation", infer_activation, elementwise=True, f64=True,
      doc="kind(x) for kind in ACTIVATIONS; integer inputs give f32 except relu/neg/abs/round")
defop("binary", infer_binary, elementwise=True, f64=True,
      doc="kind(a, b) with NumPy broadcasting and torch's promotion")
defop("compare", infer_compare, elementwise=True, dtype_rule=EXACT, f64=True, doc="a kind b -> bool")
defop("where", infer_where, elementwise=True, f64=True, doc="cond ? a : b, broadcast")
defop("cast", infer_cast, memory=VIEW, view_if=_cast_aliases, elementwise=True,
      dtype_rule=STORAGE, doc="a real conversion; a view when the dtype does not change")
defop("activation_grad", infer_activation_grad, elementwise=True, f64=True, doc="dy * kind'(x)")
defop("fused", _built_by_fusion, elementwise=True, f64=True,
      doc="an element-wise region fused into one generated kernel (passes/fusion.py)")
defop("gated", infer_gated, doc="activation(gate) * up over x's last axis's halves or pairs")
defop("gated_bwd", infer_gated_bwd, doc="gated's gradient in one kernel")
defop("matmul", infer_matmul, dtype_rule=F32, f64=True,
      doc="[..., M, K] @ [..., K, N], batch broadcast; f32 / f16 / bf16 operands of one dtype, "
          "f32 accumulation, the result in their dtype")
defop("linear", infer_linear_node, dtype_rule=F32, f64=True,
      doc="activation(x @ w + bias) + residual, w [K, N]; every operand of one float dtype")
defop("reshape", infer_reshape, memory=VIEW, dtype_rule=STORAGE, c64=True,
      doc="the same elements in a new shape (a view); stop_gradient=True is g.stop_gradient")
