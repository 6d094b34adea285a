"""Graph, Node and the Tensor handle, with the builder methods of the public API."""
from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

from . import dtypes as dt
from . import ops
from .opdef import LEAF, OPS, opdef
from .autodiff import sum_to, vjp, zeros
from .ops import fmt
from .ops_attention import AttentionOps
from .ops_complex import ComplexOps, binary_c64, cast_c64, matmul_c64, unary_c64
from .ops_custom import CustomOps
from .ops_dist import DistOps
from .ops_control import ControlOps
from .ops_delta import DeltaOps
from .ops_einsum import EinsumOps
from .ops_fft import FftOps
from .ops_linalg import LinalgOps
from .ops_vision import ResampleOps, VisionOps
from .ops_loss import LossOps
from .ops_lowp import LowPrecisionOps
from .ops_moe import MoEOps
from .ops_norm import NormOps
from . import ops_optim  # noqa: F401  (declares optim_update: compile_train's update node)
from .ops_qat import QatOps
from .ops_quant import QuantOps
from .ops_random import RandomOps
from .ops_reduce import ReduceOps
from .ops_rope import RopeOps
from .ops_scan import ScanOps
from .ops_sample import SampleOps
from .ops_shape import ShapeOps
from .ops_sort import SortOps


@dataclass
class Node:
    id: int
    op: str                       # "input", "param", "constant", "activation", "binary", ...
    inputs: tuple                 # node ids
    shape: tuple
    dtype: dt.DType
    attrs: dict = field(default_factory=dict)
    name: str | None = None
    results: list = field(default_factory=list)   # ids of its further results (OpDef.results)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize


class Tensor:
    """A handle to one node's output. Supports + - * / @, unary -, and comparisons."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: "Graph", node_id: int):
        self.graph = graph
        self.id = node_id

    @property
    def node(self) -> Node:
        return self.graph.nodes[self.id]

    @property
    def shape(self) -> tuple:
        return self.node.shape

    @property
    def dtype(self) -> dt.DType:
        return self.node.dtype

    @property
    def ndim(self) -> int:
        return len(self.node.shape)

    def __repr__(self) -> str:
        n = self.node
        label = f" {n.name!r}" if n.name else ""
        return f"Tensor(%{n.id}{label} {n.dtype}{fmt(n.shape)})"

    __hash__ = object.__hash__

    def _bin(self, kind, other, swap=False):
        a, b = self, self.graph._operand(other, like=self, op=kind)
        return self.graph.binary(kind, b, a) if swap else self.graph.binary(kind, a, b)

    def _cmp(self, kind, other):
        return self.graph.compare(kind, self, self.graph._operand(other, like=self, op=kind))

    __add__ = lambda s, o: s._bin("add", o)
    __radd__ = lambda s, o: s._bin("add", o, swap=True)
    __sub__ = lambda s, o: s._bin("sub", o)
    __rsub__ = lambda s, o: s._bin("sub", o, swap=True)
    __mul__ = lambda s, o: s._bin("mul", o)
    __rmul__ = lambda s, o: s._bin("mul", o, swap=True)
    __truediv__ = lambda s, o: s._bin("div", o)
    __rtruediv__ = lambda s, o: s._bin("div", o, swap=True)
    __pow__ = lambda s, o: s._bin("pow", o)
    __rpow__ = lambda s, o: s._bin("pow", o, swap=True)
    __neg__ = lambda s: s.graph.activation("neg", s)
    __matmul__ = lambda s, o: s.graph.matmul(s, o)
    __rmatmul__ = lambda s, o: s.graph.matmul(o, s)
    __eq__ = lambda s, o: s._cmp("eq", o)
    __ne__ = lambda s, o: s._cmp("ne", o)
    __lt__ = lambda s, o: s._cmp("lt", o)
    __le__ = lambda s, o: s._cmp("le", o)
    __gt__ = lambda s, o: s._cmp("gt", o)
    __ge__ = lambda s, o: s._cmp("ge", o)

    def __bool__(self):
        raise TypeError("a graph Tensor has no truth value (it is computed when the graph runs)")


class Graph(ShapeOps, ReduceOps, NormOps, AttentionOps, RopeOps, SampleOps, LossOps, RandomOps,
            QuantOps, MoEOps, VisionOps, ResampleOps, ScanOps, FftOps, SortOps,
            DistOps, EinsumOps, ControlOps, DeltaOps, CustomOps, QatOps, LinalgOps,
            LowPrecisionOps, ComplexOps):
    """A graph of tensor ops, built node by node in topological order."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.nodes: list[Node] = []
        self.outputs: list[int] = []
        self._leaf_names: dict[str, int] = {}
        self.deterministic_grad = False   # inside grad(..., deterministic=True) (autodiff.py)

    def rewritten(self, expand, moved: dict | None = None) -> "Graph":
        """A copy of this graph in which each node that ``expand(g, node, inputs)`` returns a
        Tensor for (built on the copy ``g`` from the copies of its inputs) is replaced by it;
        the other nodes are copied as they are (names, attrs, outputs, order). ``moved``, when
        given, receives node id -> its Tensor in the copy. The compiler's rewrites
        (compiler.py) use it; the graph itself is never changed."""
        g = Graph(self.name)
        done: dict[int, Tensor] = {} if moved is None else moved
        for n in self.nodes:
            ins = [done[i] for i in n.inputs]
            t = expand(g, n, ins)
            if t is None:
                t = (g._leaf(n.op, n.name, n.shape, n.dtype) if n.op in ("input", "param") else
                     g._add(n.op, ins, n.shape, n.dtype, n.name, **n.attrs))
            done[n.id] = t
        if self.outputs:
            g.set_outputs([done[o] for o in self.outputs])
        return g

    def bind(self, op: str, inputs, **attrs):
        """A node of op ``op`` (its OpDef, ir/opdef.py) on ``inputs`` with ``attrs``: the
        definition's inference checks them and gives the results. Returns the Tensor, or a
        tuple of Tensors for an op with several results (its further results are nodes of
        the OpDef's ``results`` ops, which its kernel fills; in-place ones alias the input
        the OpDef names)."""
        d = opdef(op)
        if d.memory == LEAF:
            raise ValueError(f"bind: {op} is a leaf; build it with g.{op}(...)")
        inputs = [self.check(op, f"inputs[{i}]", t) for i, t in enumerate(inputs)]
        res = d.infer_results(inputs, attrs)
        if len(res) > 1 + len(d.results):
            raise ValueError(f"bind: {op}'s inference gave {len(res)} results, its OpDef "
                             f"declares {1 + len(d.results)}")
        main = self._add(op, inputs, *res[0], **attrs)
        if not d.results:
            return main
        outs = [main]
        for (shape, dtype), (rop, alias) in zip(res[1:], d.results):
            ins = (main,) if alias is None else (inputs[alias], main)
            outs.append(self._add(rop, ins, shape, dtype))
        return tuple(outs)

    def add_node(self, op, inputs, shape, dtype, name=None, /, **attrs) -> Tensor:
        """A node of op ``op`` whose result (shape, dtype) is given, not inferred: for code
        that copies nodes already checked (control-flow bodies inlined into the outer graph)."""
        return self._add(op, inputs, shape, dtype, name, **attrs)

    # ---- internals -----------------------------------------------------------------------
    def _add(self, op, inputs, shape, dtype, name=None, /, **attrs) -> Tensor:
        node = Node(len(self.nodes), op, tuple(t.id for t in inputs), tuple(shape), dtype, attrs, name)
        self.nodes.append(node)
        by = opdef(op).written_by
        if by is not None:           # a further result: its producer lists it
            self.nodes[node.inputs[by]].results.append(node.id)
        return Tensor(self, node.id)

    def check(self, op: str, arg: str, t) -> Tensor:
        """``t`` when it is a Tensor of this graph, else a ValueError naming the op and argument."""
        if not isinstance(t, Tensor):
            raise ValueError(f"{op}: {arg} must be a Tensor of this graph, got {type(t).__name__}")
        if t.graph is not self:
            raise ValueError(f"{op}: {arg} {t!r} belongs to graph {t.graph.name!r}, not {self.name!r}")
        return t

    def _operand(self, value, like: Tensor, op: str = "") -> Tensor:
        """A Tensor as is; a Python/NumPy scalar as a constant of PyTorch's weak-scalar dtype.
        A float beside an f16 / bf16 tensor stays an f32 constant marked weak: the op's result
        keeps the tensor's dtype (ops.result_dtype) and its f32 arithmetic sees the scalar
        unrounded, as torch's CUDA kernels do (``x - 1.42``: 1.42, not bf16's 1.421875)."""
        if isinstance(value, Tensor):
            return value
        if isinstance(value, np.ndarray):
            return self.constant(value)
        try:
            d = dt.scalar_dtype(value, like.dtype)
        except ValueError as e:
            raise ValueError(f"{op}: {e}" if op else str(e)) from None
        if d.is_float and d.itemsize == 2:
            t = self.constant(np.asarray(value, dtype=np.float32))
            t.node.attrs["weak"] = True
            return t
        return self.constant(np.asarray(value, dtype=d.host), d)   # (d: an f64 stays f64)

    def _leaf(self, kind, name, shape, dtype) -> Tensor:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind}: name must be a non-empty string, got {name!r}")
        if name in self._leaf_names:
            raise ValueError(f"{kind}: name {name!r} is already used by "
                             f"{self.nodes[self._leaf_names[name]].op} %{self._leaf_names[name]}")
        shape = ops.normalize_shape(kind, "shape", shape)
        t = self._add(kind, (), shape, dt.dtype(dtype), name)
        self._leaf_names[name] = t.id
        return t

    # ---- leaves ----------------------------------------------------------------------------
    def input(self, name: str, shape, dtype="f32") -> Tensor:
        """A tensor fed on every run()."""
        return self._leaf("input", name, shape, dtype)

    def param(self, name: str, shape, dtype="f32") -> Tensor:
        """A weight, set once with set_param()."""
        return self._leaf("param", name, shape, dtype)

    def constant(self, array, dtype=None) -> Tensor:
        """A constant baked into the graph (copied now), of ``dtype`` (default: the array's,
        except that NumPy's default float64 becomes f32 and complex128 c64: pass
        dtype="f64" to keep float64)."""
        arr = np.asarray(array)
        if dtype is not None:
            d = dt.dtype(dtype)
        else:  # float64 (NumPy's default) becomes f32, as before f64 existed: ask for
            # dtype="f64" to keep it (else a float64 array would make every op it meets f64);
            # complex128 (np.exp(1j * t)) becomes c64: there is no complex128
            d = (dt.F32 if arr.dtype == np.float64 else
                 dt.C64 if arr.dtype == np.complex128 else dt.dtype(arr.dtype))
        arr = np.array(arr, dtype=d.host, order="C", copy=True)
        return self._add("constant", (), arr.shape, d, value=arr)

    # ---- element-wise ----------------------------------------------------------------------
    def activation(self, kind: str, x: Tensor) -> Tensor:
        self.check(f"activation {kind}", "x", x)
        if x.dtype == dt.C64:        # abs and neg of a complex tensor (ir/ops_complex.py)
            return unary_c64(self, kind, x)
        return self.bind("activation", [x], kind=kind)

    def gated(self, x: Tensor, activation: str = "silu", interleaved: bool = False) -> Tensor:
        """activation(gate) * up, [..., 2n] -> [..., n] (SwiGLU with silu, GeGLU with gelu):
        gate and up are x's last axis's first and second halves, or with ``interleaved`` its
        even and odd entries (a packed gate/up weight with their rows interleaved, so a
        skinny product can apply it as its epilogue: passes/fusion.py)."""
        self.check("gated", "x", x)
        return self.bind("gated", [x], activation=activation, interleaved=interleaved)

    def _pair(self, op: str, kind: str, a, b) -> Tensor:
        """A two-operand node; either operand may be a Python scalar."""
        if not isinstance(a, Tensor) and isinstance(b, Tensor):
            a = self._operand(a, like=b, op=kind)
        self.check(kind, "a", a)
        b = self.check(kind, "b", self._operand(b, like=a, op=kind))
        if op == "binary" and dt.C64 in (a.dtype, b.dtype):   # built on f32 pairs
            return binary_c64(self, kind, a, b)
        return self.bind(op, [a, b], kind=kind)

    def binary(self, kind: str, a, b) -> Tensor:
        return self._pair("binary", kind, a, b)

    def compare(self, kind: str, a, b) -> Tensor:
        return self._pair("compare", kind, a, b)

    def where(self, cond: Tensor, a, b) -> Tensor:
        self.check("where", "cond", cond)
        like = a if isinstance(a, Tensor) else b if isinstance(b, Tensor) else cond
        a = self.check("where", "a", self._operand(a, like=like, op="where"))
        b = self.check("where", "b", self._operand(b, like=a, op="where"))
        return self.bind("where", [cond, a, b])

    def cast(self, x: Tensor, dtype) -> Tensor:
        self.check("cast", "x", x)
        if dt.dtype(dtype) == dt.C64:          # a zero imaginary part (ir/ops_complex.py)
            return cast_c64(self, x)
        return self.bind("cast", [x], to=dt.dtype(dtype))

    # ---- linear algebra ---------------------------------------------------------------------
    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        self.check("matmul", "a", a)
        self.check("matmul", "b", b)
        if dt.C64 in (a.dtype, b.dtype):       # four f32 products (ir/ops_complex.py)
            return matmul_c64(self, a, b)
        return self.bind("matmul", [a, b])

    def linear(self, x: Tensor, w: Tensor, bias: Tensor | None = None, activation=None,
               residual: Tensor | None = None) -> Tensor:
        """activation(x @ w + bias) + residual, w is [K, N]; the residual (x's leading shape
        and N, e.g. a transformer's skip connection) is added after the activation."""
        self.check("linear", "x", x)
        self.check("linear", "w", w)
        ins = [x, w]
        if bias is not None:
            ins.append(self.check("linear", "bias", bias))
        if residual is not None:
            ins.append(self.check("linear", "residual", residual))
        ops.infer_linear(x, w, bias, activation, residual)   # (its messages name bias / residual)
        return self.bind("linear", ins, activation=activation, has_bias=bias is not None,
                         has_residual=residual is not None)

    def matmul_bias_activation_bwd(self, grad: Tensor, a: Tensor, b: Tensor,
                                   bias: Tensor | None = None, activation=None):
        """The gradients of y = activation(a @ b + bias) (numr's GEMM-epilogue backward).

        grad is dL/dy [..., M, N], a [..., M, K], b [K, N], bias [N] or None; activation one of
        None, relu, gelu, gelu_tanh, silu, sigmoid, tanh. Returns (d_a [..., M, K], d_b [K, N],
        d_bias [N] or None). The pre-activation z is recomputed by one GEMM, grad * f'(z) is
        one element-wise kernel, then d_a = g' @ b^T and d_b = a^T @ g' are two GEMMs with the
        leading dims folded into the rows, so d_b and d_bias accumulate over the whole batch.
        The transposes reach cuBLAS as op flags (no copies)."""
        op = "matmul_bias_activation_bwd"
        named = (("grad", grad), ("a", a), ("b", b)) + ((("bias", bias),) if bias is not None else ())
        for arg, t in named:
            self.check(op, arg, t)
        # f32, or f16 / bf16 throughout: half products (f32 sums), half gradients
        half = ops.product_dtype(op, list(named))
        if activation not in ops.GRAD_ACTIVATIONS:
            raise ValueError(f"{op}: activation must be one of "
                             f"{', '.join(map(str, ops.GRAD_ACTIVATIONS))}, got {activation!r}")
        if len(b.shape) != 2:
            raise ValueError(f"{op}: b must be [K, N], got {ops.fmt(b.shape)}")
        k, n = b.shape
        if len(a.shape) < 2 or a.shape[-1] != k:
            raise ValueError(f"{op}: a must be [..., M, {k}] to match b {ops.fmt(b.shape)}, got "
                             f"{ops.fmt(a.shape)}")
        want = tuple(a.shape[:-1]) + (n,)
        if tuple(grad.shape) != want:
            raise ValueError(f"{op}: grad must be {ops.fmt(want)} (a {ops.fmt(a.shape)} @ b "
                             f"{ops.fmt(b.shape)}), got {ops.fmt(grad.shape)}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"{op}: bias must be [{n}], got {ops.fmt(bias.shape)}")
        rows = math.prod(a.shape[:-1])
        a2, g2 = self.reshape(a, (rows, k)), self.reshape(grad, (rows, n))
        gp = g2
        if activation is not None:
            z = self.linear(a2, b, bias)
            gp = self.bind("activation_grad", [g2, z], kind=activation)   # (f32: torch's
            # gelu_backward also computes in f32; rounded to the half type for the products)
        # d_bias summed in f32 (as torch's bias gradient; f64 in f64), then rounded to bias's
        # dtype
        acc = dt.compute_dtype(half)
        d_bias = (self.sum(gp if gp.dtype == acc else self.cast(gp, acc), 0)
                  if bias is not None else None)
        if d_bias is not None and half != acc:
            d_bias = self.cast(d_bias, half)
        if gp.dtype != half:
            gp = self.cast(gp, half)
        d_a = self.reshape(self.matmul(gp, self.transpose(b, (1, 0))), a.shape)
        d_b = self.matmul(self.transpose(a2, (1, 0)), gp)
        return d_a, d_b, d_bias

    # ---- shape -----------------------------------------------------------------------------
    def reshape(self, x: Tensor, shape) -> Tensor:
        self.check("reshape", "x", x)
        return self.bind("reshape", [x], shape=ops.infer_reshape(x, shape)[0])

    # ---- autodiff (ir/autodiff.py; each op's VJP sits next to its builder) ----------------------
    def grad(self, y: Tensor, wrt, seed=None, deterministic: bool = False):
        """dy/dwrt appended to this graph: one Tensor per wrt (a list for a list), zeros for
        a wrt y does not depend on; ``seed`` (y's shape) for a non-scalar y;
        ``deterministic``: repeated-index gradients (gather, rope positions) summed in index
        order, not by atomic adds: the same bits on every run."""
        from . import autodiff
        return autodiff.grad(self, y, wrt, seed, deterministic)

    def stop_gradient(self, x: Tensor) -> Tensor:
        """x to the forward pass (a view: no copy, no kernel), a constant to ``grad``."""
        self.check("stop_gradient", "x", x)
        return self.bind("reshape", [x], shape=x.shape, stop_gradient=True)

    def autocast(self, dtype, *, half_params: bool = False) -> "Graph":
        """A new graph: this one under torch.autocast's CUDA policy for ``dtype`` ("bf16" or
        "f16"): products in half, norms / softmax / losses / sums in f32 (ir/autocast.py).
        This graph is not changed."""
        from .autocast import autocast
        return autocast(self, dtype, half_params=half_params)

    def to_dtype(self, dtype) -> "Graph":
        """A new graph: this one as torch's ``model.to(dtype)`` makes it ("bf16" / "f16"):
        f32 params and constants in ``dtype``, f32 inputs cast as they enter, every op in its
        operands' dtype (ir/autocast.py). The models' ``dtype=`` uses it."""
        from .autocast import to_dtype
        return to_dtype(self, dtype)

    def leaf(self, name: str) -> Tensor | None:
        """The input or param named ``name``, or None."""
        nid = self._leaf_names.get(name)
        return None if nid is None else Tensor(self, nid)

    def copy(self) -> "Graph":
        """A copy with the same node ids (nodes and their attrs copied), which can grow
        without changing this graph."""
        g = copy.copy(self)
        g.nodes = [dataclasses.replace(n, attrs=dict(n.attrs), results=list(n.results))
                   for n in self.nodes]
        g.outputs = list(self.outputs)
        g._leaf_names = dict(self._leaf_names)
        return g

    def tensor(self, node_id: int) -> Tensor:
        """A handle on node ``node_id`` of this graph."""
        if not 0 <= node_id < len(self.nodes):
            raise ValueError(f"tensor: no node %{node_id} in graph {self.name!r}")
        return Tensor(self, node_id)

    # ---- outputs and printing ------------------------------------------------------------------
    def set_outputs(self, outputs) -> None:
        outs = list(outputs)
        if not outs:
            raise ValueError("set_outputs: a graph needs at least one output")
        for i, t in enumerate(outs):
            self.check("set_outputs", f"outputs[{i}]", t)
        self.outputs = [t.id for t in outs]

    def __str__(self) -> str:
        lines = [f"graph {self.name!r}: {len(self.nodes)} nodes, outputs "
                 + ", ".join(f"%{o}" for o in self.outputs)]
        for n in self.nodes:
            head = f"  %{n.id:<3} {n.dtype}{fmt(n.shape)}"
            if n.op in ("input", "param"):
                lines.append(f"{head} = {n.op} {n.name!r}")
                continue
            attrs = {k: (v.item() if v.size == 1 else f"<{v.size} values>")
                     if isinstance(v, np.ndarray) else v
                     for k, v in n.attrs.items() if k != "has_bias"
                     and not (k == "shape" and v == n.shape)}   # (printed in front)
            args = [f"%{i}" for i in n.inputs] + [f"{k}={v}" for k, v in attrs.items() if v is not None]
            lines.append(f"{head} = {n.op}({', '.join(args)})")
        return "\n".join(lines)

    __repr__ = __str__


def _method(factory, kind):
    def m(self, *args):
        return factory(self, kind, *args)
    m.__name__ = kind
    m.__doc__ = f"{factory.__name__}({kind!r}, ...)"
    return m


for _k in ops.ACTIVATIONS:
    setattr(Graph, _k, _method(Graph.activation, _k))
for _k in ops.BINARY:
    setattr(Graph, _k, _method(Graph.binary, _k))
for _k in ops.COMPARE:
    setattr(Graph, _k, _method(Graph.compare, _k))


# ---- VJPs of the ops built above (ir/autodiff.py) -----------------------------------------------
_ACT_GRAD = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")   # activation_grad kernels


def _in(g, n, k=0):
    return g.tensor(n.inputs[k])


def _in_f32(g, *ts):
    """The tensors in the dtype their gradients compute in: halves widened to f32, f32 and
    f64 as they are."""
    return [t if t.dtype in (dt.F32, dt.F64) else g.cast(t, dt.F32) for t in ts]


@vjp("activation")
def _vjp_activation(g, n, dy):
    """dy * f'(x): the activation_grad kernel where there is one, else f' composed; halves
    are differentiated in f32."""
    k = n.attrs["kind"]
    x, y = _in(g, n), g.tensor(n.id)
    if not x.dtype.is_float:
        return [None]
    dy, x, y = _in_f32(g, dy, x, y)
    if k in _ACT_GRAD:
        return [g.bind("activation_grad", [dy, x], kind=k)]
    one = 1.0
    d = {"exp": lambda: dy * y, "log": lambda: dy / x, "sqrt": lambda: dy * 0.5 / y,
         "rsqrt": lambda: dy * -0.5 * y / x, "neg": lambda: -dy,
         "abs": lambda: dy * (g.cast(g.gt(x, 0.0), dt.F32) - g.cast(g.lt(x, 0.0), dt.F32)),
         "sin": lambda: dy * g.cos(x), "cos": lambda: -dy * g.sin(x),
         "tan": lambda: dy * (y * y + one), "atan": lambda: dy / (x * x + one),
         "round": lambda: dy * 0.0}[k]()      # round: zero almost everywhere, as torch
    return [d]


@vjp("binary")
def _vjp_binary(g, n, dy):
    """Each operand's gradient summed back to its shape (broadcasting); max / min split the
    gradient evenly between equal operands and pow's exponent gradient is 0 where the base is
    0 and the exponent >= 0, as torch."""
    k = n.attrs["kind"]
    a, b = _in(g, n, 0), _in(g, n, 1)
    if not n.dtype.is_float:
        return [None, None]
    dy, af, bf = _in_f32(g, dy, a, b)
    if k == "add":
        da, db = dy, dy
    elif k == "sub":    # b's gradient: -dy summed to b's shape, negated after the sum (a
        da, db = dy, None   # broadcast b's sum is smaller than dy: no full-size neg pass)
    elif k == "mul":
        da, db = dy * bf, dy * af
    elif k == "div":
        da = dy / bf
        db = -da * af / bf
    elif k in ("max", "min"):
        win = g.gt(af, bf) if k == "max" else g.lt(af, bf)
        lose = g.lt(af, bf) if k == "max" else g.gt(af, bf)
        half = g.where(g.eq(af, bf), dy * 0.5, dy)
        da, db = g.where(lose, 0.0, half), g.where(win, 0.0, half)
    else:   # pow
        (y,) = _in_f32(g, g.tensor(n.id))
        da = dy * bf * g.pow(af, bf - 1.0)
        zero_base = g.min(g.eq(af, 0.0), g.ge(bf, 0.0))     # min of bools: and
        db = g.where(zero_base, 0.0, dy * y * g.log(af))
    return [sum_to(g, da, a.shape) if a.dtype.is_float else None,
            (-sum_to(g, dy, b.shape) if k == "sub" else sum_to(g, db, b.shape))
            if b.dtype.is_float else None]


@vjp("where")
def _vjp_where(g, n, dy):
    c, a, b = (_in(g, n, k) for k in range(3))
    return [None, sum_to(g, g.where(c, dy, 0.0), a.shape) if a.dtype.is_float else None,
            sum_to(g, g.where(c, 0.0, dy), b.shape) if b.dtype.is_float else None]


@vjp("cast")
def _vjp_cast(g, n, dy):
    x = _in(g, n)
    return [g.cast(dy, x.dtype) if x.dtype.is_float and dy.dtype != x.dtype else
            dy if x.dtype.is_float else None]


@vjp("reshape")
def _vjp_reshape(g, n, dy):
    if n.attrs.get("stop_gradient"):
        return [None]
    return [g.reshape(dy, _in(g, n).shape)]


def _mT(g, t):
    """t with its last two axes swapped (cuBLAS takes it as an op flag: no copy)."""
    r = len(t.shape)
    return g.transpose(t, tuple(range(r - 2)) + (r - 1, r - 2))


def _product_fwd(g, a, b, bias):
    """a @ b (+ bias), recomputed for an epilogue's backward."""
    if len(b.shape) == 2:
        return g.linear(a, b, bias)
    z = g.matmul(a, b)
    return z + bias if bias is not None else z


@vjp("matmul", "linear")
def _vjp_product(g, n, dy):
    """y = epilogue(a @ b + bias) + residual, for a plain matmul, linear, and the fused
    product nodes the fusion pass lowers (activation / has_bias / has_residual / gated
    attrs). With a 2-D b (a weight) the products go through matmul_bias_activation_bwd
    (leading dims folded into the rows, one GEMM each for d_a and d_b, and its
    activation_grad kernel where it has one); other activations and the gated epilogue are
    differentiated by their own VJPs on the recomputed pre-activation. A batched b gets
    batched products, each gradient summed back over the broadcast batch dims."""
    ins = [g.tensor(i) for i in n.inputs]
    a, b, rest = ins[0], ins[1], ins[2:]
    bias = rest.pop(0) if n.attrs.get("has_bias") else None
    res = rest.pop(0) if n.attrs.get("has_residual") else None
    act, gated = n.attrs.get("activation"), n.attrs.get("gated")
    # a half product's gradients are half products (f32 sums inside), as torch's
    dy = dy if dy.dtype == n.dtype else g.cast(dy, n.dtype)
    rnd = lambda t: t if t.dtype == n.dtype else g.cast(t, n.dtype)   # noqa: E731
    if math.prod(n.shape) == 0:
        return [zeros(g, t.shape) for t in (a, b, bias) if t is not None] + \
            ([dy] if res is not None else [])     # empty products: nothing to multiply
    flat = len(a.shape) == 1            # linear's x may be a vector
    a2 = g.reshape(a, (1,) + a.shape) if flat else a
    dz = g.reshape(dy, (1,) + dy.shape) if flat else dy
    kernel_act = None
    if gated is not None:    # the fold's gated epilogue is interleaved (passes/fusion.py)
        h = g.gated(_product_fwd(g, a2, b, bias), gated, interleaved=True)
        dz = rnd(_vjp_gated(g, h.node, dz)[0])
    elif act is not None:
        if len(b.shape) == 2 and act in _ACT_GRAD:
            kernel_act = act     # matmul_bias_activation_bwd recomputes z and applies f'
        else:
            h = g.activation(act, _product_fwd(g, a2, b, bias))
            dz = rnd(_vjp_activation(g, h.node, dz)[0])
    if len(b.shape) == 2:
        da, db, dbias = g.matmul_bias_activation_bwd(dz, a2, b, bias, kernel_act)
    else:
        da = sum_to(g, g.matmul(dz, _mT(g, b)), a2.shape)
        db = sum_to(g, g.matmul(_mT(g, a2), dz), b.shape)
        dbias = sum_to(g, dz, bias.shape) if bias is not None else None
    if flat:
        da = g.reshape(da, a.shape)
    return [da, db] + ([dbias] if bias is not None else []) + ([dy] if res is not None else [])


@vjp("gated")
def _vjp_gated(g, n, dy):
    """d gate = dy * up * f'(gate) (the activation's VJP), d up = dy * f(gate), written back
    to the halves or the even / odd entries of x's last axis."""
    x = _in(g, n)
    if not x.dtype.is_float:
        return [None]
    dy, xf = _in_f32(g, dy, x)
    act, m, lead = n.attrs["activation"], n.shape[-1], tuple(x.shape[:-1])
    if act in _ACT_GRAD:          # one kernel reading x in place, writing dx whole
        return [g.bind("gated_bwd", [dy, xf], activation=act,
                       interleaved=n.attrs["interleaved"])]
    if n.attrs["interleaved"]:
        x3 = g.reshape(xf, lead + (m, 2))
        gate, up = (g.reshape(g.narrow(x3, -1, k, 1), lead + (m,)) for k in (0, 1))
    else:
        gate, up = g.narrow(xf, -1, 0, m), g.narrow(xf, -1, m, m)
    h = g.activation(act, gate)
    d_gate = _vjp_activation(g, h.node, dy * up)[0]
    d_up = dy * h
    if n.attrs["interleaved"]:
        col = lead + (m, 1)
        return [g.reshape(g.concat([g.reshape(d_gate, col), g.reshape(d_up, col)], -1), x.shape)]
    return [g.concat([d_gate, d_up], -1)]
