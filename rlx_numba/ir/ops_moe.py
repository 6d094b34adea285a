"""Mixture-of-experts and adapter products: grouped_matmul and lora_matmul, their checks, the
builder methods (mixed into Graph) and VJPs. Kernels: kernels/grouped.py; lowering:
runtime/lower_grouped.py.

``grouped_matmul(x, w, expert_ids)`` is one node, out[i] = x[i] @ w[expert_ids[i]]; on the
device a routing kernel buckets the rows by expert (a stable counting sort, each expert's
segment padded to whole row tiles) and one tiled GEMM launch covers every expert, with nothing
read back to the host (so it can sit in a CUDA graph). The node carries ``trans_w`` (a
builder argument too): with it, out[i] = x[i] @ w[e_i]^T (w [E, N, K]), the product dx needs
and the layout of transformers' fused expert weights ([E, out, in]).
The weight gradient is its own node, ``grouped_matmul_wgrad(a, b, ids)`` -> [E, Ka, Nb] with
out[e] = sum over the rows i of expert e of a[i]^T b[i], summed in row order (no atomics: the
same bits every run). The three nodes' VJPs are each other, so gradients of gradients work.

``lora_matmul(x, w, a, b, scale)`` = x @ w + scale * (x @ a) @ b is built from ``linear``
nodes: the matmul tiers (cuBLAS on a GPU, set_param_half) and their VJPs apply as they are.
"""
from __future__ import annotations

import numbers

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32, F32_ONLY, defop
from .ops import fmt

ID_DTYPES = (dt.I32, dt.I64)


def _desc(t) -> str:
    return f"{t.dtype} {fmt(t.shape)}"


def check_grouped(x, w, ids, trans_w=False):
    """(M, K, E, N) of grouped_matmul's operands, or ValueError naming the argument. With
    ``trans_w`` w is [E, N, K]."""
    op = "grouped_matmul"
    for arg, t in (("x", x), ("w", w)):
        if not t.dtype.is_float:
            raise ValueError(f"{op}: {arg} must be a float tensor, got {_desc(t)}")
    if len(x.shape) != 2:
        raise ValueError(f"{op}: x must be 2-D [M, K], got {_desc(x)}")
    layout = "[E, N, K] (trans_w: one [N, K] matrix an expert)" if trans_w else \
        "[E, K, N] (one [K, N] matrix an expert)"
    if len(w.shape) != 3:
        raise ValueError(f"{op}: w must be 3-D {layout}, got {_desc(w)}")
    (m, k), e = x.shape, w.shape[0]
    wk, n = (w.shape[2], w.shape[1]) if trans_w else w.shape[1:]
    if k != wk:
        raise ValueError(f"{op}: x {fmt(x.shape)} has K={k} but w {fmt(w.shape)} has K={wk}"
                         + (" (trans_w: w is [E, N, K])" if trans_w else ""))
    if ids.dtype not in ID_DTYPES:
        raise ValueError(f"{op}: expert_ids must be i32 or i64, got {_desc(ids)}")
    if tuple(ids.shape) != (m,):
        raise ValueError(f"{op}: expert_ids must be [{m}] (one expert a row of x "
                         f"{fmt(x.shape)}), got {fmt(ids.shape)}")
    if e == 0 and m:
        raise ValueError(f"{op}: w {fmt(w.shape)} has no experts, so no expert id of x's {m} "
                         f"rows can be valid")
    return m, k, e, n


def check_lora(x, w, a, b, scale):
    """(K, N, r) of lora_matmul's operands, or ValueError naming the argument."""
    op = "lora_matmul"
    for arg, t in (("x", x), ("w", w), ("a", a), ("b", b)):
        if not t.dtype.is_float:
            raise ValueError(f"{op}: {arg} must be a float tensor, got {_desc(t)}")
    if not x.shape:
        raise ValueError(f"{op}: x must be [..., K], got a scalar {_desc(x)}")
    for arg, t, dims in (("w", w, "[K, N]"), ("a", a, "[K, r]"), ("b", b, "[r, N]")):
        if len(t.shape) != 2:
            raise ValueError(f"{op}: {arg} must be 2-D {dims}, got {_desc(t)}")
    k, n = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"{op}: x {fmt(x.shape)} has K={x.shape[-1]} but w {fmt(w.shape)} has "
                         f"K={k}")
    if a.shape[0] != k:
        raise ValueError(f"{op}: a must be [K={k}, r] to match w {fmt(w.shape)}, got "
                         f"{fmt(a.shape)}")
    r = a.shape[1]
    if tuple(b.shape) != (r, n):
        raise ValueError(f"{op}: b must be [r={r}, N={n}] to match a {fmt(a.shape)} and w "
                         f"{fmt(w.shape)}, got {fmt(b.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"{op}: scale must be a Python number, got {scale!r}")
    return k, n, r


def _f32_operands(op, **ts):
    for arg, t in ts.items():
        if t.dtype != dt.F32:
            raise ValueError(f"{op}: {arg} must be f32 (the builder casts halves), got {_desc(t)}")


def infer_grouped_matmul(x, w, ids, trans_w):
    """x and w of one float dtype (the builder casts a mix to f32), the result in it."""
    if not isinstance(trans_w, bool):
        raise ValueError(f"grouped_matmul: trans_w must be a bool, got {trans_w!r}")
    m, _, _, n = check_grouped(x, w, ids, trans_w)
    if x.dtype != w.dtype:
        raise ValueError(f"grouped_matmul: x and w must have one dtype (the builder casts a mix "
                         f"to f32), got x {_desc(x)} and w {_desc(w)}")
    return (m, n), x.dtype


def infer_grouped_matmul_wgrad(a, b, ids, experts):
    """out[e] = sum over the rows i of expert e of a[i]^T b[i]: [E, Ka, Nb]."""
    op = "grouped_matmul_wgrad"
    _f32_operands(op, a=a, b=b)
    if len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: a and b must be [M, Ka] and [M, Nb], got {_desc(a)} and "
                         f"{_desc(b)}")
    if ids.dtype not in ID_DTYPES or tuple(ids.shape) != (a.shape[0],):
        raise ValueError(f"{op}: expert_ids must be i32 / i64 [{a.shape[0]}], got {_desc(ids)}")
    if not isinstance(experts, int) or experts < 0:
        raise ValueError(f"{op}: experts must be an int >= 0, got {experts!r}")
    return (experts, a.shape[1], b.shape[1]), dt.F32


defop("grouped_matmul", infer_grouped_matmul, dtype_rule=F32,
      doc="out[i] = x[i] @ w[expert_ids[i]] (or its transpose), one routed tiled GEMM")
defop("grouped_matmul_wgrad", infer_grouped_matmul_wgrad, dtype_rule=F32_ONLY,
      doc="grouped_matmul's weight gradient: per expert the sum of its rows' a^T b, in row order")



def _f32(g, t):
    """t in f32 (a visible cast for a half operand of an op that computes in f32)."""
    return t if t.dtype == dt.F32 else g.cast(t, dt.F32)


def _grouped_operands(g, x, w):
    """grouped_matmul's x and w as its node takes them: one dtype as they are (f16 / bf16
    natively: loads widen to f32, f32 sums, the result rounded once to it, as torch); a mix
    of dtypes both cast to f32 (the promotion: an f32 result)."""
    return (x, w) if x.dtype == w.dtype else (_f32(g, x), _f32(g, w))

class MoEOps:
    """Builder methods; ``self`` is the Graph (``_f32``: NormOps')."""

    def grouped_matmul(self, x, w, expert_ids, trans_w: bool = False):
        """out[i] = x[i] @ w[expert_ids[i]]: x [M, K], w [E, K, N], expert_ids i32/i64 [M] ->
        [M, N] (mixture-of-experts expert products, module docstring). ``trans_w``: w is
        [E, N, K] (each expert's matrix [out, in], like nn.Linear and transformers' fused
        expert weights) and out[i] = x[i] @ w[expert_ids[i]]^T, read in place (no copy). Ids
        need not be sorted; experts may repeat or go unused (an unused one costs nothing).
        expert_ids fed to run() as host arrays are checked there (IndexError outside [0, E));
        a row whose in-graph or device-array id is out of range comes out as zeros. x and w
        of one dtype give a result in it (f16 / bf16: f32 sums rounded once, on tensor cores
        where matmul tier 5 is offered); a mix of dtypes is computed in f32, an f32 result."""
        op = "grouped_matmul"
        for arg, t in (("x", x), ("w", w), ("expert_ids", expert_ids)):
            self.check(op, arg, t)
        if not isinstance(trans_w, bool):
            raise ValueError(f"{op}: trans_w must be a bool, got {trans_w!r}")
        check_grouped(x, w, expert_ids, trans_w)   # on the arguments as given (halves too)
        return self.bind(op, _grouped_operands(self, x, w) + (expert_ids,), trans_w=trans_w)

    def lora_matmul(self, x, w, a, b, scale):
        """x @ w + scale * (x @ a) @ b: x [..., K], w [K, N], a [K, r], b [r, N], scale a
        Python number -> f32 [..., N]. The scale is applied to the narrow x @ a ([..., r]);
        the low-rank product is added in the base product's epilogue (linear's residual)."""
        op = "lora_matmul"
        for arg, t in (("x", x), ("w", w), ("a", a), ("b", b)):
            self.check(op, arg, t)
        check_lora(x, w, a, b, scale)
        x, w, a, b = (_f32(self, t) for t in (x, w, a, b))
        low = self.linear(self.linear(x, a) * float(scale), b)
        return self.linear(x, w, residual=low)


@vjp("grouped_matmul")
def _vjp_grouped_matmul(g, n, dy):
    """y[i] = x[i] @ W_e (W_e = w[e], or w[e]^T with trans_w): dx[i] = dy[i] @ W_e^T, the
    same node with trans_w flipped; dw[e] = sum over e's rows of x[i]^T dy[i] (dy[i]^T x[i]
    with trans_w, w[e] being [K, N] either way). The ids get none."""
    x, w, ids = (g.tensor(i) for i in n.inputs)
    trans = n.attrs["trans_w"]
    dx = g.bind("grouped_matmul", (dy, w, ids), trans_w=not trans)
    # the weight gradient computes in f32 (half operands cast, dw rounded back to w's dtype)
    xf, dyf = _f32(g, x), _f32(g, dy)
    dw = g.bind("grouped_matmul_wgrad", ((dyf, xf) if trans else (xf, dyf)) + (ids,),
                experts=w.shape[0])
    return [dx, dw if w.dtype == dt.F32 else g.cast(dw, w.dtype), None]


@vjp("grouped_matmul_wgrad")
def _vjp_grouped_wgrad(g, n, dy):
    """out[e] = sum a[i]^T b[i]: da[i] = b[i] @ dy[e]^T, db[i] = a[i] @ dy[e]."""
    a, b, ids = (g.tensor(i) for i in n.inputs)
    da = g.bind("grouped_matmul", (b, dy, ids), trans_w=True)
    db = g.bind("grouped_matmul", (a, dy, ids), trans_w=False)
    return [da, db, None]
