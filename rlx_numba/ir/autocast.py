"""``Graph.autocast(dtype)``: a copy of a graph with torch.autocast's CUDA casting policy.

The user's graph is never changed: every node is rebuilt (``Graph.bind``) on a new graph, its
float operands cast first as its op's policy says, so the dtypes downstream follow from the
ops' own inference exactly as when a user writes the casts by hand. The policies are
torch.autocast's CUDA op lists, mapped onto this IR:

    lower     products run in the half dtype: matmul, linear, conv, conv_transpose, attention
              (every f32 / half operand cast, bias included; masks, indices and f64
              operands untouched: torch's autocast does not take float64)
    f32       half operands widened to f32: softmax, log_softmax, the norms, cross_entropy,
              sum / prod reductions, cumsum, and the activations torch lists (exp, log,
              rsqrt, tan) and pow
    promote   operands cast to the widest float dtype among them: concat, scatter_add
    (other)   the op runs in whatever dtype its operands have (element-wise, shape ops, ...)

So a residual stream that starts f32 stays f32 (f32 + bf16 promotes to f32, as in torch), a
product's output is half, and an op that cannot take a half operand raises ValueError at
build time naming itself and the dtype: nothing falls back to f32 silently.

One cast node is made per (tensor, dtype), however many consumers it has. With
``half_params=True`` (``compile(..., precision=)`` uses it for inference) a param every use of
which is cast to the half dtype becomes a param of that dtype instead (same name and shape):
``set_param`` rounds the f32 values once, and no cast runs per call.
"""
from __future__ import annotations

from . import dtypes as dt

LOWER, F32, PROMOTE = "lower", "f32", "promote"

_LOWER_OPS = {"matmul", "linear", "conv", "conv_transpose", "attention"}
_F32_OPS = {"softmax", "log_softmax", "layer_norm", "rms_norm", "cross_entropy", "cumsum"}
_F32_ACTIVATIONS = {"exp", "log", "rsqrt", "tan"}
_F32_REDUCTIONS = {"sum", "prod"}
_PROMOTE_OPS = {"concat", "scatter_add"}
# Gated DeltaNet's chunk inverse and state pass (ir/ops_delta.py) take f32 only, as
# transformers runs the delta rule in f32 whatever the model's dtype: under autocast they
# widen half operands (policy f32); in a converted model (to_dtype) they also compute in f32
# and hand the model's dtype on, as the norms do inside their kernels.
_F32_INSIDE_OPS = {"delta_state_scan", "unit_lower_inverse", "unit_lower_inverse_scaled"}

HALVES = (dt.F16, dt.BF16)


def policy(node) -> str | None:
    """The autocast policy of a node: "lower", "f32", "promote" or None (its operands' dtype)."""
    op, a = node.op, node.attrs
    if op in _LOWER_OPS:
        return LOWER
    if (op in _F32_OPS or op in _F32_INSIDE_OPS
            or (op == "activation" and a.get("kind") in _F32_ACTIVATIONS)
            or (op == "binary" and a.get("kind") == "pow")
            or (op == "reduce" and a.get("kind") in _F32_REDUCTIONS)):
        return F32
    if op in _PROMOTE_OPS:
        return PROMOTE
    return None


def autocast(graph, dtype, *, half_params: bool = False):
    """A new Graph: ``graph`` under autocast to ``dtype`` ("bf16" or "f16"); see the module
    docstring. ``graph`` is not changed."""
    return _rebuild(graph, _half("autocast", dtype), {n.id: policy(n) for n in graph.nodes},
                    half_params=half_params)


def to_dtype(graph, dtype):
    """A new Graph: ``graph`` as a model converted with torch's ``module.to(dtype)``: its f32
    params and float constants become ``dtype``, each f32 input is cast to ``dtype`` on the
    device as it enters (callers keep feeding f32), and every op runs in the dtype its
    operands now have (norms, softmax and losses compute in f32 inside their kernels and
    return ``dtype``). Explicit casts the graph makes stay as they are. ``graph`` is not
    changed."""
    return _rebuild(graph, _half("to_dtype", dtype), {}, convert=True)


def _half(what, dtype):
    d = dt.dtype(dtype)
    if d not in HALVES:
        raise ValueError(f"{what}: dtype must be bf16 or f16, got {d}")
    return d


def _rebuild(graph, d, pol, *, half_params=False, convert=False):
    from .graph import Graph
    g = Graph(graph.name)
    nodes = graph.nodes
    half_leaf = set()
    if half_params:
        uses: dict[int, list] = {}
        for n in nodes:
            for i in n.inputs:
                uses.setdefault(i, []).append(pol[n.id] == LOWER)
        half_leaf = {n.id for n in nodes if n.op == "param" and n.dtype == dt.F32
                     and uses.get(n.id) and all(uses[n.id])}
    new: dict[int, object] = {}
    casts: dict[tuple, object] = {}

    def cast(t, to):
        if t.dtype == to or not t.dtype.is_float:
            return t
        key = (t.id, to)
        if key not in casts:
            casts[key] = g.cast(t, to)
        return casts[key]

    for n in nodes:
        if n.id in new:                  # a further result, made with its producer
            continue
        f32 = n.dtype == dt.F32
        if n.op == "input":
            t = g.input(n.name, n.shape, n.dtype)
            new[n.id] = cast(t, d) if convert and f32 else t
            continue
        if n.op == "param":
            half = n.id in half_leaf or (convert and f32)
            new[n.id] = g.param(n.name, n.shape, d if half else n.dtype)
            continue
        if n.op == "constant":
            weak = n.attrs.get("weak", False)     # a Python float beside a half tensor stays so
            new[n.id] = g.constant(n.attrs["value"], d if convert and f32 and not weak else n.dtype)
            if weak:
                new[n.id].node.attrs["weak"] = True
            continue
        ins = [new[i] for i in n.inputs]
        p = pol.get(n.id)
        if p == LOWER:      # (torch's autocast leaves float64 alone: not eligible)
            ins = [t if t.dtype == dt.F64 else cast(t, d) for t in ins]
        elif p == F32:
            ins = [cast(t, dt.F32) if t.dtype in HALVES else t for t in ins]
        elif p == PROMOTE:
            floats = [t.dtype for t in ins if t.dtype.is_float]
            if floats:
                wide = floats[0]
                for f in floats[1:]:
                    wide = dt.promote(wide, f)
                ins = [cast(t, wide) for t in ins]
        inside = convert and n.op in _F32_INSIDE_OPS
        if inside:
            ins = [cast(t, dt.F32) if t.dtype in HALVES else t for t in ins]
        out = g.bind(n.op, ins, **n.attrs)
        outs = out if isinstance(out, tuple) else (out,)
        if inside:
            outs = tuple(g.cast(t, d) if t.dtype == dt.F32 else t for t in outs)
        for rid, t in zip([n.id, *n.results], outs):
            new[rid] = t
    if graph.outputs:
        g.set_outputs([new[o] for o in graph.outputs])
    return g
