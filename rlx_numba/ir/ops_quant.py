"""Quantised weights: dequantize and dequant_matmul, their checks, builder methods (mixed into
Graph) and VJPs. Kernels: kernels/quant.py; lowering: runtime/lower_quant.py.

A packed weight stands for an f32 [N, K] matrix laid out like nn.Linear's (DESIGN.md):
  GGUF "q4_0" .. "q6_k"  w u8 [N, K / block * block bytes], the file's bytes as they are
  "int8"                 w i8 [N, K], value = q * scale
  "int4"                 w u8 [N, K / 2] (weight 2j in the low nibble), value = (q - zero) * scale
with int8 / int4 scales (and zeros, default 8) [N] (per channel) or [N, K / group_size].

``dequant_matmul(x, w, ...)`` is x [..., K] @ W^T -> [..., N] f32, accumulated in f32 with x as
it is (never rounded to half). With at most MAX_M rows of x it is one node, a GEMV that
dequantises in registers (decode: the packed bytes are all that is read); with more it is
``dequantize`` (an f32 [N, K] in the arena, its bytes reused once the product is done) and a
matmul (the GEMM tiers). On a GPU with cuBLAS that weight is written bf16 and the product runs
on bf16 tensor cores with f32 accumulation, x rounded to bf16 (runtime/lower_quant.py;
RLX_NUMBA_MATMUL_TIERS without 0 keeps it f32). The choice is made here, from the static shape, so the
graph shows which path runs. Gradients flow to x, and to int8 / int4 scales and zeros.
``dequant_grouped_matmul(x, w, expert_ids, ...)`` is the mixture-of-experts form: w [E, N,
packed K], out[i] = x[i] @ dequant(w[ids[i]])^T, a GEMV a row of x over its expert's packed
bytes (the same kernel, one launch) or, for many rows, the experts dequantised and
grouped_matmul (ops_moe.py).
"""
from __future__ import annotations

import math

from . import dtypes as dt
from .autodiff import vjp
from .opdef import F32_ONLY, defop
from .ops import fmt

# scheme -> (weights a block, bytes a block), ggml's block_q4_0 ... block_q6_K
GGUF = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24),
        "q8_0": (32, 34), "q2_k": (256, 84), "q3_k": (256, 110), "q4_k": (256, 144),
        "q5_k": (256, 176), "q6_k": (256, 210)}
INTS = ("int8", "int4")
SCHEMES = tuple(GGUF) + INTS
UNIT = 32                  # weights the kernels dequantise at a time (kernels/quant.py)
MAX_M = 16                 # rows of x the GEMV path takes (more: dequantize + a GEMM)


def _desc(t) -> str:
    return f"{t.dtype} {fmt(t.shape)}"


def check_quant(op, w, scales, zeros, scheme, group_size, k=None):
    """(n, k, group size, scale groups a row) of a packed weight, or ValueError naming op, the
    argument and the shapes. ``k``: the K the caller's x has (checked against w's)."""
    if scheme not in SCHEMES:
        raise ValueError(f"{op}: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    if len(w.shape) != 2:
        raise ValueError(f"{op}: w must be 2-D [N, packed K] for {scheme}, got {_desc(w)}")
    n, cols = w.shape
    if scheme in GGUF:
        qk, bb = GGUF[scheme]
        if w.dtype != dt.U8:
            raise ValueError(f"{op}: a {scheme} w holds raw GGUF bytes, u8; got {_desc(w)}")
        if cols % bb:
            raise ValueError(f"{op}: a {scheme} row is whole {bb}-byte blocks; w {_desc(w)} has "
                             f"{cols} bytes a row")
        wk = cols // bb * qk
        if k is not None and k % qk:
            raise ValueError(f"{op}: K = {k} is not a multiple of {scheme}'s block of {qk} "
                             f"weights")
        if scales is not None or zeros is not None:
            raise ValueError(f"{op}: {scheme} keeps its scales inside the blocks; pass no "
                             f"scales or zeros")
        if group_size is not None:
            raise ValueError(f"{op}: group_size is for int8 / int4, not {scheme}")
        if k is not None and k != wk:
            raise ValueError(f"{op}: w {_desc(w)} is {wk} weights a row ({cols // bb} {scheme} "
                             f"blocks), x has K = {k}")
        return n, wk, wk, 1
    want = dt.I8 if scheme == "int8" else dt.U8
    if w.dtype != want:
        raise ValueError(f"{op}: an {scheme} w must be {want}, got {_desc(w)}")
    wk = cols if scheme == "int8" else 2 * cols
    if k is not None and k != wk:
        raise ValueError(f"{op}: w {_desc(w)} is {wk} {scheme} weights a row, x has K = {k}")
    if scales is None:
        raise ValueError(f"{op}: {scheme} needs scales ([N] or [N, K // group_size])")
    if zeros is not None and scheme == "int8":
        raise ValueError(f"{op}: int8 is symmetric (value = q * scale); pass no zeros")
    if group_size is None:
        gs, groups = wk, (n,) if len(scales.shape) == 1 else (n, 1)
    else:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"{op}: group_size must be a positive int, got {group_size!r}")
        if wk % group_size:
            raise ValueError(f"{op}: K = {wk} is not a multiple of group_size {group_size}")
        gs, groups = group_size, (n, wk // group_size)
    for arg, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            continue
        if tuple(t.shape) != groups:
            raise ValueError(f"{op}: {arg} must be {fmt(groups)} for w {_desc(w)} and "
                             f"group_size {group_size}, got {fmt(t.shape)}")
        if t.dtype == dt.BOOL or (arg == "scales" and not t.dtype.is_float):
            raise ValueError(f"{op}: {arg} must be {'float' if arg == 'scales' else 'numeric'}, "
                             f"got {_desc(t)}")
    return n, wk, gs, wk // gs


def units_ok(scheme, k, gs) -> bool:
    """Whether the unit kernels (kernels/quant.py) take this weight: GGUF always; int8 / int4
    when rows and groups are whole units of 32."""
    return scheme in GGUF or (k % UNIT == 0 and gs % UNIT == 0)


# ---- inference (ir/opdef.py): scales, zeros and x reach the nodes as f32 (the builders cast) ---
def _f32_operand(op, arg, t):
    if t is not None and t.dtype != dt.F32:
        raise ValueError(f"{op}: {arg} must be f32 (the builder casts it), got {_desc(t)}")


def _packed(op, ins, scheme, has_zeros):
    """(w, scales or None, zeros or None) of a node's packed-weight inputs [w, (scales),
    (zeros)]: scales for int8 / int4, zeros with has_zeros."""
    want = 1 + (scheme in INTS) + bool(has_zeros)
    if len(ins) != want:
        raise ValueError(f"{op}: a {scheme} weight is {want} inputs (w, scales, zeros as "
                         f"given), got {len(ins)}")
    w, rest = ins[0], list(ins[1:])
    scales = rest.pop(0) if scheme in INTS else None
    zeros = rest.pop(0) if has_zeros else None
    _f32_operand(op, "scales", scales)
    _f32_operand(op, "zeros", zeros)
    return w, scales, zeros


def infer_dequantize(w, *rest, scheme, group_size, has_zeros, gather):
    """The f32 [N, K] matrix, or [*rows.shape, K] of the rows given (an index input last)."""
    op = "dequantize"
    rest = list(rest)
    rows = rest.pop() if gather else None
    if scheme not in SCHEMES:
        raise ValueError(f"{op}: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    w, scales, zeros = _packed(op, [w] + rest, scheme, has_zeros)
    n, k, _, _ = check_quant(op, w, scales, zeros, scheme, group_size)
    if rows is None:
        return (n, k), dt.F32
    if rows.dtype not in (dt.I32, dt.I64):
        raise ValueError(f"{op}: rows must be i32 or i64 row indices, got {_desc(rows)}")
    return tuple(rows.shape) + (k,), dt.F32


def _units(op, scheme, k, gs):
    if not units_ok(scheme, k, gs):
        raise ValueError(f"{op}: the GEMV kernel takes whole units of {UNIT} (K = {k}, group "
                         f"size {gs}); dequantize and a matmul take the rest")


def infer_dequant_matmul(x, w, *rest, scheme, group_size, has_zeros):
    """x [..., K] @ W^T -> [..., N], one GEMV node (the builder's choice for few rows)."""
    op = "dequant_matmul"
    if not x.shape:
        raise ValueError(f"{op}: x must be an f32 tensor [..., K], got {_desc(x)}")
    _f32_operand(op, "x", x)
    if scheme not in SCHEMES:
        raise ValueError(f"{op}: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    w, scales, zeros = _packed(op, [w, *rest], scheme, has_zeros)
    n, k, gs, _ = check_quant(op, w, scales, zeros, scheme, group_size, x.shape[-1])
    _units(op, scheme, k, gs)
    return tuple(x.shape[:-1]) + (n,), dt.F32


def infer_dequant_grouped_matmul(x, w, *rest, scheme, group_size, has_zeros, experts):
    """x [M, K] and the experts' packed rows w [E * N, packed K] (scales / zeros likewise),
    expert_ids [M] last -> [M, N]."""
    op = "dequant_grouped_matmul"
    *rest, ids = rest
    if len(x.shape) != 2:
        raise ValueError(f"{op}: x must be an f32 tensor [M, K], got {_desc(x)}")
    _f32_operand(op, "x", x)
    if scheme not in SCHEMES:
        raise ValueError(f"{op}: unknown scheme {scheme!r}; expected one of {', '.join(SCHEMES)}")
    w, scales, zeros = _packed(op, [w, *rest], scheme, has_zeros)
    n, k, gs, _ = check_quant(op, w, scales, zeros, scheme, group_size, x.shape[1])
    if not isinstance(experts, int) or experts < 1 or n % experts:
        raise ValueError(f"{op}: experts must be a positive int dividing w's {n} rows, got "
                         f"{experts!r}")
    if ids.dtype not in (dt.I32, dt.I64) or tuple(ids.shape) != (x.shape[0],):
        raise ValueError(f"{op}: expert_ids must be i32 / i64 [{x.shape[0]}] (an expert a row "
                         f"of x {fmt(x.shape)}), got {_desc(ids)}")
    _units(op, scheme, k, gs)
    return (x.shape[0], n // experts), dt.F32


defop("dequantize", infer_dequantize, dtype_rule=F32_ONLY,
      doc="the f32 matrix a packed (GGUF / int8 / int4) weight stands for, or some of its rows")
defop("dequant_matmul", infer_dequant_matmul, dtype_rule=F32_ONLY,
      doc="x @ W^T for a packed W, dequantised in registers (a GEMV: few rows of x)")
defop("dequant_grouped_matmul", infer_dequant_grouped_matmul, dtype_rule=F32_ONLY,
      doc="x[i] @ W[ids[i]]^T over packed experts, a GEMV a row (few rows of x)")


class QuantOps:
    """Builder methods; ``self`` is the Graph."""

    def _quant_inputs(self, op, w, scales, zeros):
        ins = [self.check(op, "w", w)]
        for arg, t in (("scales", scales), ("zeros", zeros)):
            if t is not None:
                t = self.check(op, arg, t)
                ins.append(t if t.dtype == dt.F32 else self.cast(t, dt.F32))
        return ins

    def dequantize(self, w, scales=None, zeros=None, *, scheme: str, group_size=None,
                   rows=None):
        """The f32 [N, K] matrix a packed weight stands for (schemes: dequant_matmul); with
        ``rows`` (an i32 / i64 tensor of row indices), only those rows: [*rows.shape, K], an
        embedding lookup in a packed table (no gradient flows to the scales then)."""
        op = "dequantize"
        # (the checks on the arguments as given: the node sees scales and zeros cast to f32)
        check_quant(op, self.check(op, "w", w), scales, zeros, scheme, group_size)
        ins = self._quant_inputs(op, w, scales, zeros)
        if rows is not None:
            ins.append(self.check(op, "rows", rows))
        return self.bind(op, ins, scheme=scheme, group_size=group_size,
                         has_zeros=zeros is not None, gather=rows is not None)

    def dequant_matmul(self, x, w, scales=None, zeros=None, *, scheme: str, group_size=None):
        """x [..., K] @ W^T -> [..., N] f32 for a packed weight W [N, K] (module docstring;
        DESIGN.md): GGUF blocks, int8 or int4 with per-channel or per-group scales."""
        op = "dequant_matmul"
        self.check(op, "x", x)
        if not x.dtype.is_float or not x.shape:
            raise ValueError(f"{op}: x must be a float tensor [..., K], got {_desc(x)}")
        k = x.shape[-1]
        n, _, gs, _ = check_quant(op, self.check(op, "w", w), scales, zeros, scheme,
                                  group_size, k)
        xf = x if x.dtype == dt.F32 else self.cast(x, dt.F32)
        m = math.prod(x.shape[:-1])
        out_shape = tuple(x.shape[:-1]) + (n,)
        if m <= MAX_M and units_ok(scheme, k, gs):
            ins = [xf] + self._quant_inputs(op, w, scales, zeros)[1:]
            ins.insert(1, w)
            return self.bind(op, ins, scheme=scheme, group_size=group_size,
                             has_zeros=zeros is not None)
        wd = self.dequantize(w, scales, zeros, scheme=scheme, group_size=group_size)
        y = self.matmul(self.reshape(xf, (m, k)), self.transpose(wd))
        return self.reshape(y, out_shape)

    def dequant_grouped_matmul(self, x, w, expert_ids, scales=None, zeros=None, *, scheme: str,
                               group_size=None):
        """out[i] = x[i] @ dequant(w[expert_ids[i]])^T -> f32 [M, N]: x [M, K], w [E, N, packed
        K] (each expert a packed [N, K] weight of ``scheme``, as dequant_matmul's), scales /
        zeros [E, N] or [E, N, K // group_size], expert_ids i32 / i64 [M] (any order, repeats
        and unused experts). Up to max(MAX_M, E) rows it is one node: a GEMV a row over its
        expert's packed bytes, dequantised in registers (decode); with more, the experts are
        dequantised to f32 and grouped_matmul runs (prefill). Ids fed to run() as host arrays
        are checked there (IndexError outside [0, E)); an in-graph or device-array id out of
        range gives a row of zeros. Gradients flow to x only."""
        op = "dequant_grouped_matmul"
        for arg, t in (("x", x), ("w", w), ("expert_ids", expert_ids)):
            self.check(op, arg, t)
        if not x.dtype.is_float or len(x.shape) != 2:
            raise ValueError(f"{op}: x must be a float tensor [M, K], got {_desc(x)}")
        (m, k) = x.shape
        e, w2, s2, z2 = _experts_2d(self, op, w, scales, zeros)
        if e == 0:
            raise ValueError(f"{op}: w {_desc(w)} has no experts")
        try:
            n, _, gs, _ = check_quant(op, w2, s2, z2, scheme, group_size, k)
        except ValueError as err:
            raise ValueError(f"{err} (w {_desc(w)}: its {e} experts' rows read as one "
                             f"{fmt(w2.shape)} matrix)") from None
        n //= e
        if expert_ids.dtype not in (dt.I32, dt.I64) or tuple(expert_ids.shape) != (m,):
            raise ValueError(f"{op}: expert_ids must be i32 / i64 [{m}] (an expert a row of x "
                             f"{fmt(x.shape)}), got {_desc(expert_ids)}")
        xf = x if x.dtype == dt.F32 else self.cast(x, dt.F32)
        if m <= max(MAX_M, e) and units_ok(scheme, k, gs):
            ins = [xf] + self._quant_inputs(op, w2, s2, z2) + [expert_ids]
            return self.bind(op, ins, scheme=scheme, group_size=group_size,
                             has_zeros=zeros is not None, experts=e)
        wd = self.dequantize(w2, s2, z2, scheme=scheme, group_size=group_size)
        return self.grouped_matmul(xf, self.reshape(wd, (e, n, k)), expert_ids, trans_w=True)


def _experts_2d(g, op, w, scales, zeros):
    """(E, w, scales, zeros) with the experts' rows stacked: w [E, N, packed K] -> [E * N,
    packed K], scales / zeros [E, N(, groups)] -> [E * N(, groups)] (views)."""
    if len(w.shape) != 3:
        raise ValueError(f"{op}: w must be 3-D [E, N, packed K] (one packed [N, K] matrix an "
                         f"expert), got {_desc(w)}")
    e, n = w.shape[:2]
    out = [g.reshape(w, (e * n, w.shape[2]))]
    for arg, t in (("scales", scales), ("zeros", zeros)):
        if t is None:
            out.append(None)
            continue
        if len(t.shape) not in (2, 3) or tuple(t.shape[:2]) != (e, n):
            raise ValueError(f"{op}: {arg} must be [E={e}, N={n}] or [E, N, K // group_size] "
                             f"for w {_desc(w)}, got {fmt(t.shape)}")
        out.append(g.reshape(t, (e * n,) + tuple(t.shape[2:])))
    return (e, *out)


def _grad_params(g, node, dw_of):
    """Gradients of an int8 / int4 node's scales and zeros from dL/dW (``dw_of()``, [N, K]):
    dscale = sum over a group of dW * (q - zero), dzero = -sum of dW * scale."""
    a = node.attrs
    scheme, group_size = a["scheme"], a["group_size"]
    if scheme not in INTS:
        return []
    w_id, s_id = node.inputs[-2 - a["has_zeros"]], node.inputs[-1 - a["has_zeros"]]
    w, s = g.tensor(w_id), g.tensor(s_id)
    n, k = (w.shape[0], w.shape[1] if scheme == "int8" else 2 * w.shape[1])
    gs = k if group_size is None else group_size
    ng = k // gs
    dw = g.reshape(dw_of(), (n, ng, gs))
    ones = g.expand(g.constant(1.0), s.shape)
    zr = [g.tensor(node.inputs[-1])] if a["has_zeros"] else []
    centred = g.dequantize(w, ones, *zr, scheme=scheme, group_size=group_size)
    ds = g.reduce_sum(g.mul(dw, g.reshape(centred, (n, ng, gs))), 2)
    out = [g.reshape(ds, s.shape)]
    if a["has_zeros"]:
        dz = g.neg(g.mul(g.reduce_sum(dw, 2), g.reshape(s, (n, ng))))
        out.append(g.reshape(dz, s.shape))
    return out


def _weight(g, node, w_at=None, rest_end=None):
    """The f32 matrix a node's packed weight stands for (input ``w_at``; its scales / zeros
    after it, up to ``rest_end``)."""
    a = node.attrs
    w_at = (1 if node.op == "dequant_matmul" else 0) if w_at is None else w_at
    w = g.tensor(node.inputs[w_at])
    rest = [g.tensor(i) for i in node.inputs[w_at + 1:rest_end]]
    if a["scheme"] in GGUF:
        return g.dequantize(w, scheme=a["scheme"])
    return g.dequantize(w, *rest, scheme=a["scheme"], group_size=a["group_size"])


@vjp("dequant_matmul")
def _dequant_matmul_vjp(g, node, dy):
    x = g.tensor(node.inputs[0])
    k, n = x.shape[-1], node.shape[-1]
    m = math.prod(x.shape[:-1])
    dy2 = g.reshape(dy, (m, n))
    dx = g.reshape(g.matmul(dy2, _weight(g, node)), x.shape)
    params = _grad_params(g, node, lambda: g.matmul(g.transpose(dy2), g.reshape(x, (m, k))))
    return [dx, None] + params


@vjp("dequant_grouped_matmul")
def _dequant_grouped_matmul_vjp(g, node, dy):
    """dx[i] = dy[i] @ dequant(W_e) (grouped_matmul over the dequantised experts); none to
    the packed weight, its scales and zeros, or the ids."""
    x, w2 = g.tensor(node.inputs[0]), g.tensor(node.inputs[1])
    e, n, k = node.attrs["experts"], node.shape[1], x.shape[1]
    wd = g.reshape(_weight(g, node, w_at=1, rest_end=-1), (e, n, k))
    dx = g.grouped_matmul(dy, wd, g.tensor(node.inputs[-1]))
    return [dx] + [None] * (len(node.inputs) - 1)


@vjp("dequantize")
def _dequantize_vjp(g, node, dy):
    if node.attrs["gather"]:
        if node.attrs["scheme"] in INTS:
            raise ValueError(f"grad: dequantize %{node.id} with rows= has no gradient to its "
                             f"scales or zeros")
        return [None, None]
    return [None] + _grad_params(g, node, lambda: dy)
