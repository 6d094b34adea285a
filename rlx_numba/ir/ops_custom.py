"""Custom ops and custom VJPs: a user's own ``@cuda.jit`` kernel as a graph node, and a
graph-level function with a hand-written backward (jax.custom_vjp).

``rlx.custom_op(name, kernel, shape_fn, launch, vjp=None)`` makes a ``CustomOp``;
``g.custom(op, x, ...)`` puts one node of the generic op "custom" in the graph, its attrs
holding the CustomOp. The node owns a fresh buffer of the arena like any other (planned by
liveness), fuses with nothing, and lowers (runtime/lower_custom.py) to one kernel Step
``kernel[blocks, threads](out, *inputs)`` whose arguments are arena views, so GRAPH mode
captures it and the simulator runs it as it runs the project's own kernels. Its step shows
in ``exe.profile`` and traces as ``%<id> custom.<name>``, kernel ``custom <name>``.

What the kernel sees: each array with its tensor's shape (C order), in its *storage* dtype:
f32 float32, f16 float16, bf16 uint16 (its bit pattern: numba has no bf16), bool one byte,
i32 / i64 / u8 / i8 as themselves. A kernel must refer to ``numba.cuda`` as a module global
(``from numba import cuda`` at module level, after ``import rlx_numba``): the simulator swaps
that module, and a kernel that captured the real one would not run there.

``vjp(g, inputs, out, dy)`` builds the gradient with the Graph's builder methods (it may use
other custom ops): one Tensor (of that input's shape) or None per input. For a one-input op,
``vjp`` may also be another CustomOp: the gradient is then ``g.custom(vjp, dy, x)``. Without a vjp,
``g.grad`` raises ValueError naming the op when a gradient has to flow through it (and only
then).

``rlx.custom_vjp(fwd_fn, bwd_fn)`` returns ``f``; ``f(g, *args)`` builds ``fwd_fn(g, *args)
-> (out, residuals)`` as ordinary nodes and returns a "custom_vjp" node: a view of ``out``
(no kernel, no copy) whose inputs are ``out``, the Tensor args and the residual Tensors. Its
VJP gives nothing to ``out`` (so the forward nodes are not differentiated through it) and
``bwd_fn(g, residuals, dy)``'s gradients to the args.

Names: ``custom_op`` keeps a registry of names; a second ``custom_op`` of a registered name
with the same kernel replaces the entry (a changed shape_fn, launch or vjp); with another
kernel it raises, unless ``replace=True`` (a notebook cell run again makes a new kernel
object). Nodes already built keep the CustomOp they were built with.
"""
from __future__ import annotations

import math

import numpy as np

from . import dtypes as dt
from .autodiff import vjp
from .opdef import FRESH, STORAGE, VIEW, defop
from .ops import fmt

CUSTOM_OPS: dict[str, "CustomOp"] = {}   # name -> the CustomOp registered under it


def _kernel_types() -> tuple:
    """The classes of a ``@cuda.jit`` kernel: numba-cuda's dispatcher, and the simulator's
    kernel when the simulator is on."""
    types = []
    try:
        from numba.cuda.simulator.kernel import FakeCUDAKernel
        types.append(FakeCUDAKernel)
    except ImportError:     # pragma: no cover - numba-cuda always ships the simulator
        pass
    try:
        from numba.cuda.dispatcher import CUDADispatcher
        types.append(CUDADispatcher)
    except ImportError:     # pragma: no cover
        pass
    return tuple(types)


def _is_device_function(kernel) -> bool:
    if getattr(kernel, "_device", False):               # the simulator's
        return True
    opts = getattr(kernel, "targetoptions", None)
    return bool(isinstance(opts, dict) and opts.get("device"))


def _what(x) -> str:
    return type(x).__name__ if not callable(x) else getattr(x, "__qualname__", type(x).__name__)


class CustomOp:
    """A user's kernel registered as an op (``rlx.custom_op``); ``g.custom(op, ...)`` builds
    its node. Attributes: name, kernel, shape_fn, launch, vjp."""

    __slots__ = ("name", "kernel", "shape_fn", "launch", "vjp")

    def __init__(self, name, kernel, shape_fn, launch, vjp=None):
        self.name, self.kernel, self.shape_fn = name, kernel, shape_fn
        self.launch, self.vjp = launch, vjp

    def __repr__(self) -> str:
        k = getattr(getattr(self.kernel, "py_func", None), "__qualname__", None)
        return f"CustomOp({self.name!r}" + (f", kernel {k}" if k else "") + ")"

    # ---- what the node's inference, lowering and VJP call ----------------------------------
    def infer(self, inputs) -> tuple:
        """(out shape, DType) from shape_fn, checked; launch checked on the input shapes."""
        where = f"custom {self.name}"
        try:
            res = self.shape_fn(*inputs)
        except ValueError:
            raise
        except Exception as e:       # noqa: BLE001 - named, with the op
            raise ValueError(f"{where}: shape_fn raised {type(e).__name__}: {e}") from e
        if not (isinstance(res, (tuple, list)) and len(res) == 2) or isinstance(
                res[1], (int, np.integer)):    # (an out_shape alone, of two dims)
            raise ValueError(f"{where}: shape_fn must return (out_shape, dtype), got {res!r}")
        shape, dtype = res
        if isinstance(shape, (int, np.integer)) and not isinstance(shape, (bool, np.bool_)):
            shape = (shape,)
        if not isinstance(shape, (tuple, list)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
                and d >= 0 for d in shape):
            raise ValueError(f"{where}: shape_fn's out_shape must be a tuple of ints >= 0, got "
                             f"{shape!r}")
        try:
            d = dt.dtype(dtype)
        except ValueError as e:
            raise ValueError(f"{where}: shape_fn's dtype: {e}") from None
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) > 0:
            self.geometry([t.shape for t in inputs])
        return shape, d

    def geometry(self, shapes) -> tuple:
        """((blocks...), (threads...)) from launch(*input_shapes), checked."""
        where = f"custom {self.name}"
        try:
            res = self.launch(*[tuple(s) for s in shapes])
        except ValueError:
            raise
        except Exception as e:       # noqa: BLE001
            raise ValueError(f"{where}: launch raised {type(e).__name__}: {e}") from e
        if not (isinstance(res, (tuple, list)) and len(res) == 2):
            raise ValueError(f"{where}: launch must return (blocks, threads), got {res!r}")
        out = []
        for arg, v in zip(("blocks", "threads"), res):
            dims = (v,) if isinstance(v, (int, np.integer)) else v
            if not (isinstance(dims, (tuple, list)) and 1 <= len(dims) <= 3 and all(
                    isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
                    and x >= 1 for x in dims)):
                raise ValueError(f"{where}: launch's {arg} must be an int >= 1 or a tuple of "
                                 f"1 to 3 of them, got {v!r}")
            out.append(tuple(int(x) for x in dims))
        blocks, threads = out
        if math.prod(threads) > 1024 or any(t > m for t, m in zip(threads, (1024, 1024, 64))):
            raise ValueError(f"{where}: launch's threads {threads} exceed CUDA's block limits "
                             f"(at most 1024 threads, x and y <= 1024, z <= 64)")
        if any(b > m for b, m in zip(blocks, (2**31 - 1, 65535, 65535))):
            raise ValueError(f"{where}: launch's blocks {blocks} exceed CUDA's grid limits "
                             f"(x <= 2^31 - 1, y and z <= 65535)")
        return tuple(out)


def custom_op(name, kernel, shape_fn, launch, vjp=None, *, replace: bool = False) -> CustomOp:
    """Register ``kernel`` (a ``@cuda.jit`` kernel, launched ``kernel[blocks, threads](out,
    *inputs)``) as op ``name``: ``shape_fn(*input_tensors) -> (out_shape, dtype)``,
    ``launch(*input_shapes) -> (blocks, threads)``, ``vjp(g, inputs, out, dy)`` -> one
    Tensor or None per input (or None: not differentiable; or, for a one-input op, a
    CustomOp whose kernel maps (dy, x) to dx). The module docstring has the
    rest (storage dtypes, the simulator, names registered twice)."""
    if not isinstance(name, str) or not name or name != name.strip() or any(
            c.isspace() for c in name):
        raise ValueError(f"custom_op: name must be a non-empty str without spaces, got {name!r}")
    where = f"custom_op {name!r}"
    if not isinstance(kernel, _kernel_types()) or _is_device_function(kernel):
        why = ("a device function (cuda.jit(device=True)), not a kernel"
               if isinstance(kernel, _kernel_types()) else _what(kernel))
        raise ValueError(f"{where}: kernel must be a @cuda.jit kernel (a numba CUDA dispatcher), "
                         f"got {why}")
    for arg, f in (("shape_fn", shape_fn), ("launch", launch)):
        if not callable(f):
            raise ValueError(f"{where}: {arg} must be callable, got {_what(f)}")
    if vjp is not None and not callable(vjp) and not isinstance(vjp, CustomOp):
        raise ValueError(f"{where}: vjp must be callable, a CustomOp or None, got {_what(vjp)}")
    if not isinstance(replace, bool):
        raise ValueError(f"{where}: replace must be a bool, got {replace!r}")
    old = CUSTOM_OPS.get(name)
    if old is not None and old.kernel is not kernel and not replace:
        raise ValueError(f"{where}: the name is already registered with another kernel "
                         f"({old!r}); choose another name, or pass replace=True")
    op = CustomOp(name, kernel, shape_fn, launch, vjp)
    CUSTOM_OPS[name] = op
    return op


def infer_custom(*inputs, custom_op):
    if not isinstance(custom_op, CustomOp):
        raise ValueError(f"custom: custom_op must be a CustomOp (rlx.custom_op(...)), got "
                         f"{_what(custom_op)}")
    return custom_op.infer(inputs)


class VjpRule:
    """What a "custom_vjp" node keeps: bwd_fn, the number of args, which of them are Tensors
    (its inputs 1..), and the residuals' structure (their Tensors are its last inputs)."""

    __slots__ = ("bwd", "n_args", "tensor_args", "tree", "label")

    def __init__(self, bwd, n_args, tensor_args, tree, label):
        self.bwd, self.n_args, self.tensor_args = bwd, n_args, tuple(tensor_args)
        self.tree, self.label = tree, label

    def __repr__(self) -> str:
        return f"custom_vjp({self.label})"


def infer_custom_vjp(out, *rest, rule):
    """A view of ``out`` (input 0); the other inputs are the Tensor args and the residuals."""
    if not isinstance(rule, VjpRule):
        raise ValueError(f"custom_vjp: rule must be a VjpRule (rlx.custom_vjp), got "
                         f"{_what(rule)}")
    return out.shape, out.dtype


defop("custom", infer_custom, memory=FRESH, dtype_rule=STORAGE,
      doc="a user's @cuda.jit kernel (rlx.custom_op), launched kernel[blocks, threads](out, "
          "*inputs) on storage-dtype arrays")
defop("custom_vjp", infer_custom_vjp, memory=VIEW, dtype_rule=STORAGE,
      doc="rlx.custom_vjp's output: a view of the forward's result whose gradient is the "
          "user's bwd_fn")


# ---- residuals: any nest of lists / tuples / dicts, its Tensors as node inputs ------------------
def _flatten(x, leaves, is_tensor):
    if is_tensor(x):
        leaves.append(x)
        return ("t",)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_flatten(v, leaves, is_tensor) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _flatten(v, leaves, is_tensor)) for k, v in x.items()))
    return ("v", x)


def _unflatten(tree, leaves):
    kind = tree[0]
    if kind == "t":
        return next(leaves)
    if kind == "v":
        return tree[1]
    if kind == "dict":
        return {k: _unflatten(v, leaves) for k, v in tree[1]}
    vals = [_unflatten(v, leaves) for v in tree[1]]
    return tuple(vals) if kind == "tuple" else vals


def _check_grads(g, where, grads, targets):
    """``grads`` (a list / tuple with one entry per target, or one Tensor for one target)
    checked: each None or a Tensor of ``g`` with its target's shape."""
    from .graph import Tensor
    if isinstance(grads, Tensor) and len(targets) == 1:
        grads = [grads]
    if not isinstance(grads, (list, tuple)) or len(grads) != len(targets):
        n = len(grads) if isinstance(grads, (list, tuple)) else _what(grads)
        raise ValueError(f"{where} must return one Tensor or None per input ({len(targets)}), "
                         f"got {n}")
    out = []
    for k, (d, t) in enumerate(zip(grads, targets)):
        if d is None:
            out.append(None)
            continue
        if not isinstance(d, Tensor) or d.graph is not g:
            raise ValueError(f"{where}: gradient {k} must be a Tensor of this graph or None, "
                             f"got {_what(d) if not isinstance(d, Tensor) else repr(d)}")
        if tuple(d.shape) != tuple(t.shape):
            raise ValueError(f"{where}: gradient {k} has shape {fmt(d.shape)}, its input "
                             f"{t!r} {fmt(t.shape)}")
        if not d.dtype.is_float:
            raise ValueError(f"{where}: gradient {k} is {d.dtype}; gradients are float")
        out.append(d)
    return out


class CustomOps:
    """Builder methods; ``self`` is the Graph."""

    def custom(self, op, *inputs):
        """The node of custom op ``op`` (``rlx.custom_op``) on ``inputs`` (Tensors of this
        graph): shape and dtype from its shape_fn, launch geometry checked now."""
        if not isinstance(op, CustomOp):
            raise ValueError(f"custom: op must be a CustomOp made by rlx.custom_op(...), got "
                             f"{_what(op)}")
        if not inputs:
            raise ValueError(f"custom {op.name}: needs at least one input Tensor")
        for i, t in enumerate(inputs):
            self.check(f"custom {op.name}", f"inputs[{i}]", t)
        return self.bind("custom", list(inputs), custom_op=op)


def custom_vjp(fwd_fn, bwd_fn):
    """jax.custom_vjp for graph functions: ``f = custom_vjp(fwd_fn, bwd_fn)``; ``f(g, *args)``
    builds ``fwd_fn(g, *args) -> (out, residuals)`` and returns ``out`` as a view whose
    gradient with respect to ``args`` is ``bwd_fn(g, residuals, dy)`` (one gradient or None
    per arg; non-Tensor args get theirs ignored, None by convention), instead of the forward
    nodes' own. ``residuals``: Tensors of ``g`` (any nest of lists / tuples / dicts, other
    values kept as they are) handed to bwd_fn."""
    for arg, fn in (("fwd_fn", fwd_fn), ("bwd_fn", bwd_fn)):
        if not callable(fn):
            raise ValueError(f"custom_vjp: {arg} must be callable, got {_what(fn)}")
    label = getattr(fwd_fn, "__qualname__", "fwd_fn")

    def f(g, *args):
        from .graph import Graph, Tensor
        if not isinstance(g, Graph):
            raise ValueError(f"custom_vjp {label}: the first argument must be the Graph, got "
                             f"{_what(g)}")
        for k, a in enumerate(args):
            if isinstance(a, Tensor):
                g.check(f"custom_vjp {label}", f"args[{k}]", a)
        res = fwd_fn(g, *args)
        if not (isinstance(res, (tuple, list)) and len(res) == 2):
            got = f"{len(res)} values" if isinstance(res, (tuple, list)) else _what(res)
            raise ValueError(f"custom_vjp {label}: fwd_fn must return (out, residuals), got "
                             f"{got}")
        out, residuals = res
        if not isinstance(out, Tensor):
            raise ValueError(f"custom_vjp {label}: fwd_fn's out must be one Tensor, got "
                             f"{_what(out)}")
        g.check(f"custom_vjp {label}", "out", out)
        leaves = []
        tree = _flatten(residuals, leaves, lambda x: isinstance(x, Tensor))
        for k, t in enumerate(leaves):
            g.check(f"custom_vjp {label}", f"residual {k}", t)
        tensor_args = [k for k, a in enumerate(args) if isinstance(a, Tensor)]
        return g.bind("custom_vjp", [out] + [args[k] for k in tensor_args] + leaves,
                      rule=VjpRule(bwd_fn, len(args), tensor_args, tree, label))

    f.__name__ = getattr(fwd_fn, "__name__", "custom_vjp")
    f.__qualname__ = f"custom_vjp({label})"
    f.__doc__ = getattr(fwd_fn, "__doc__", None)
    f.fwd, f.bwd = fwd_fn, bwd_fn
    return f


# ---- VJPs --------------------------------------------------------------------------------------
@vjp("custom")
def _vjp_custom(g, n, dy):
    op = n.attrs["custom_op"]
    if op.vjp is None:
        raise ValueError(f"grad: custom op {op.name!r} (%{n.id} {fmt(n.shape)}) has no vjp; pass "
                         f"vjp=fn(g, inputs, out, dy) to rlx.custom_op to differentiate through it")
    inputs = [g.tensor(i) for i in n.inputs]
    if isinstance(op.vjp, CustomOp):    # its kernel maps (dy, x) to dx of a one-input op
        if len(inputs) != 1:
            raise ValueError(f"grad: custom op {op.name!r} (%{n.id}) has {len(inputs)} inputs; "
                             f"its vjp {op.vjp!r} gives the gradient of a one-input op only; "
                             f"pass vjp=fn(g, inputs, out, dy) instead")
        grads = [g.custom(op.vjp, dy, inputs[0])]
    else:
        grads = op.vjp(g, inputs, g.tensor(n.id), dy)
    return _check_grads(g, f"custom {op.name}: vjp", grads, inputs)


@vjp("custom_vjp")
def _vjp_custom_vjp(g, n, dy):
    from .graph import Tensor
    rule = n.attrs["rule"]
    n_t = len(rule.tensor_args)
    arg_ids = n.inputs[1:1 + n_t]
    residuals = _unflatten(rule.tree, iter([g.tensor(i) for i in n.inputs[1 + n_t:]]))
    grads = rule.bwd(g, residuals, dy)
    if isinstance(grads, Tensor) and rule.n_args == 1:
        grads = [grads]
    if not isinstance(grads, (list, tuple)) or len(grads) != rule.n_args:
        got = len(grads) if isinstance(grads, (list, tuple)) else _what(grads)
        raise ValueError(f"custom_vjp {rule.label}: bwd_fn must return one gradient or None per "
                         f"arg ({rule.n_args}), got {got}")
    picked = _check_grads(g, f"custom_vjp {rule.label}: bwd_fn",
                          [grads[k] for k in rule.tensor_args], [g.tensor(i) for i in arg_ids])
    return [None] + picked + [None] * (len(n.inputs) - 1 - n_t)
