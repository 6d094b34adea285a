"""Generated element-wise kernels.

An element-wise expression (one op, or later a fused chain) over k inputs becomes one
``@cuda.jit`` grid-stride kernel, written as a real .py file in the cache dir (so numba can
keep the compiled code on disk: ``load_kernel`` attaches kernels/cache.py's cache) and loaded.
Broadcasting is done in the kernel: every input is classed as ``full`` (same elements as the
output, index ``i``), ``scalar`` (index 0) or ``bcast`` (offset from the output index through
collapsed dims and strides), so no broadcast is ever materialised.

Expressions are nested tuples:
  ("in", k, dtype) | ("activation", kind, dtype, x) | ("binary", kind, dtype, a, b)
  | ("compare", kind, dtype, a, b) | ("where", None, dtype, c, a, b) | ("cast", None, dtype, x)
  | ("activation_grad", kind, dtype, grad, z)   (grad * kind'(z), for backward passes)
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import tempfile
import types
from pathlib import Path

from ..ir import dtypes as dt
from ..ir.ops import INT_PRESERVING
from . import elementwise
from .cache import STATS, attach, cache_dir  # noqa: F401 - cache_dir: codegen's name for it too

_NUMBA_INT = {dt.I32: "int32", dt.I64: "int64", dt.U8: "uint8", dt.I8: "int8"}
_loaded: dict[str, object] = {}


# ---- expression -> Python source ------------------------------------------------------------
def _to(value: str, src: dt.DType, dst: dt.DType) -> str:
    """Convert a value held in src's compute form (f32 for floats) to dst's compute form."""
    if src == dst or (src.is_float and dst.is_float):
        return value
    if dst.is_float:
        return f"float32({value})"
    if dst == dt.BOOL:
        return f"({value} != 0)"
    if src.is_float and dst.itemsize == 1:   # through int32, wrapping as PyTorch's casts do
        return f"{_NUMBA_INT[dst]}(ew.f2i32({value}))"
    if src.is_float:
        return f"ew.f2i{dst.itemsize * 8}({value})"
    return f"{_NUMBA_INT[dst]}({value})"


def _emit(e, loads: list[str]) -> str:
    op = e[0]
    if op == "in":
        return loads[e[1]]
    kind, d = e[1], e[2]
    args = [(_emit(a, loads), a[2]) for a in e[3:]]
    if op == "activation":
        (x, xd), = args
        if xd.is_int and kind in INT_PRESERVING:
            return f"ew.{kind}_i({x})"
        return f"ew.{kind}({_to(x, xd, dt.F32)})"
    if op == "binary":
        (a, ad), (b, bd) = args
        ct = dt.promote(ad, bd)
        if kind == "div" and not ct.is_float:
            ct = dt.F32
        suffix = "" if ct.is_float else ("_b" if ct == dt.BOOL else "_i")
        return f"ew.{kind}{suffix}({_to(a, ad, ct)}, {_to(b, bd, ct)})"
    if op == "compare":
        (a, ad), (b, bd) = args
        ct = dt.promote(ad, bd)
        sym = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[kind]
        return f"({_to(a, ad, ct)} {sym} {_to(b, bd, ct)})"
    if op == "activation_grad":
        (gr, gd), (z, zd) = args
        return f"ew.{kind}_grad({_to(gr, gd, dt.F32)}, {_to(z, zd, dt.F32)})"
    if op == "where":
        (c, _), (a, ad), (b, bd) = args
        return f"({_to(a, ad, d)} if {c} else {_to(b, bd, d)})"
    if op == "cast":
        (x, xd), = args
        v = _to(x, xd, d)
        if d == dt.F16 and xd != dt.F16:   # round now, so later ops in a chain see f16 values
            return f"float32(float16({v}))"
        if d == dt.BF16 and xd != dt.BF16:
            return f"ew.round_bf16({v})"
        return v
    raise ValueError(f"codegen: unknown expression op {op!r}")


def _load(name: str, d: dt.DType) -> str:
    if d == dt.F16:
        return f"float32({name})"
    if d == dt.BF16:
        return f"ew.bf16_to_f32({name})"
    return name


def _store(value: str, d: dt.DType) -> str:
    if d == dt.F16:
        return f"float16({value})"
    if d == dt.BF16:
        return f"ew.f32_to_bf16({value})"
    return value


UNROLL = 8  # elements per thread per loop trip: loads issued together keep more bytes in flight


def magic_divisor(d: int) -> tuple[int, int]:
    """(m, s) with r // d == (((r * m) >> 32) + r) >> s for every 0 <= r < 2**32 (the
    round-up method of Granlund and Montgomery, as PyTorch's IntDivider): a multiply-high,
    an add and a shift instead of a ~25-instruction integer division per element."""
    s = (d - 1).bit_length()
    return ((1 << 32) * ((1 << s) - d)) // d + 1, s


def kernel_source(expr, in_dtypes, modes, ndim: int, idx32: bool = True) -> str:
    """Python source of the kernel for this expression, input dtypes/modes and collapsed rank.

    With ``idx32`` (every index < 2**32) the broadcast offsets divide by the collapsed dims
    through precomputed magic numbers (``magic_divisor``); otherwise with int64 division.

    All index math is uint64 (every argument after the arrays is passed as np.uint64): numba
    adds a negative-index wraparound to every signed subscript, and signed // and % need sign
    fix-ups; unsigned indices need neither.

    The grid-stride loop handles UNROLL elements (i, i+step, ...) per trip: first every offset
    and load, then the math and the stores. Loads must come before stores explicitly because
    ``out`` may be an input too (in-place epilogues), so the compiler could not reorder them.
    """
    k = len(in_dtypes)
    bc = [j for j in range(k) if modes[j] == "bcast"]
    params = ["out"] + [f"in{j}" for j in range(k)] + ["n"]
    if bc:
        params += [f"{p}{a}" for a in range(1, ndim) for p in (("d", "m", "sh") if idx32 else ("d",))]
    params += [f"s{j}_{a}" for j in bc for a in range(ndim)]

    def element(u):
        """(index and load lines, store line) for element i + u*step, names suffixed _u."""
        idx = "i" if u == 0 else f"i{u}"
        pre = [] if u == 0 else [f"{idx} = i + uint64({u}) * step"]
        if bc and idx32:   # r < 2**32 and m < 2**32: the multiply is one mul.wide.u32
            pre.append(f"r = {idx}")
            for a in range(ndim - 1, 0, -1):
                pre.append(f"q = (((r * m{a}) >> U32) + r) >> sh{a}")
                pre.append(f"c{a} = r - q * d{a}")
                pre.append("r = q")
        elif bc:
            pre.append(f"r = {idx}")
            for a in range(ndim - 1, 0, -1):
                pre.append(f"c{a} = r % d{a}")
                pre.append(f"r = r // d{a}")
        if bc:
            for j in bc:
                terms = [f"c{a} * s{j}_{a}" for a in range(ndim - 1, 0, -1)] + [f"r * s{j}_0"]
                pre.append(f"o{j}_{u} = " + " + ".join(terms))
        where = {"full": idx, "scalar": "0"}
        names = []
        for j in range(k):
            names.append(f"v{j}_{u}")
            at = where.get(modes[j], f"o{j}_{u}")
            pre.append(f"v{j}_{u} = " + _load(f"in{j}[{at}]", in_dtypes[j]))
        return pre, f"out[{idx}] = {_store(_emit(expr, names), expr[2])}"

    parts = [element(u) for u in range(UNROLL)]
    unrolled = [line for pre, _ in parts for line in pre] + [st for _, st in parts]
    pre0, store0 = element(0)
    lines = [
        "# generated by rlx_numba.kernels.codegen; do not edit",
        f"# expr: {expr_repr(expr)}",
        f"# inputs: {', '.join(f'{d}:{mo}' for d, mo in zip(in_dtypes, modes))}; collapsed rank {ndim}",
        "from numba import cuda, float32, int8, int32, int64, uint8, uint64",
        "from numba.core.types import float16",
        "from rlx_numba.kernels import elementwise as ew",
        "",
        "U32 = uint64(32)",
        "",
        "@cuda.jit   # load_kernel attaches the disk cache (rlx_numba/kernels/cache.py)",
        f"def kernel({', '.join(params)}):",
        "    i = uint64(cuda.grid(1))",
        "    step = uint64(cuda.gridsize(1))",
        f"    while i + uint64({UNROLL - 1}) * step < n:",
        *("        " + s for s in unrolled),
        f"        i += uint64({UNROLL}) * step",
        "    while i < n:",
        *("        " + s for s in pre0 + [store0]),
        "        i += step",
        "",
    ]
    return "\n".join(lines)


def expr_repr(e) -> str:
    if e[0] == "in":
        return f"in{e[1]}:{e[2]}"
    inner = ", ".join(expr_repr(a) for a in e[3:])
    head = e[0] if e[1] is None else f"{e[0]}.{e[1]}"
    return f"{head}({inner})->{e[2]}"


# ---- source -> kernel (in memory, then on disk) ------------------------------------------
_DEPS = hashlib.sha256(Path(elementwise.__file__).read_bytes()
                       + Path(__file__).read_bytes()).hexdigest()[:8]


def load_kernel(source: str):
    """The kernel of this source, from its module ``<cache_dir>/kernels/ew_<hash>.py``: the
    file is reused when its content is exactly ``source``, else (missing, damaged, stale)
    written atomically (``STATS["py_written"]`` / ``["py_reused"]`` count both). The module
    runs from ``source`` itself, never from the file's or a .pyc's bytes; the file is there
    for numba's disk cache (attached here) and for reading."""
    key = "ew_" + hashlib.sha256((_DEPS + source).encode()).hexdigest()[:20]
    if key in _loaded:
        return _loaded[key]
    path = cache_dir() / "kernels" / f"{key}.py"
    try:
        same = path.read_bytes() == source.encode()
    except OSError:
        same = False
    if same:
        STATS["py_reused"] += 1
    else:
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent,
                                         suffix=".tmp", delete=False) as f:
            f.write(source)
        os.replace(f.name, path)
        STATS["py_written"] += 1
    mod = types.ModuleType(f"rlx_numba_generated.{key}")
    mod.__file__ = str(path)
    sys.modules[mod.__name__] = mod
    exec(compile(source, str(path), "exec"), mod.__dict__)   # noqa: S102 - our generated code
    _loaded[key] = attach(mod.kernel)
    return _loaded[key]


# ---- broadcasting: shapes -> modes, collapsed dims and strides ------------------------------
def broadcast_layout(out_shape, in_shapes, in_strides=None):
    """Collapse the output's dims and give each input its mode and strides (in elements).

    ``in_strides[j]`` (optional, None entries for contiguous inputs): input j's own per-dim
    element strides, for a strided view (a narrow along an inner axis read in place); such an
    input is never "full" (it is read through its strides).

    Returns (modes, dims, strides): dims is the collapsed output shape, strides[j] the
    per-dim strides of input j over those dims (0 where it is broadcast).
    """
    rank = len(out_shape)
    given = list(in_strides) if in_strides is not None else [None] * len(in_shapes)
    strides = []
    for s, own in zip(in_shapes, given):
        pad = rank - len(s)
        s = (1,) * pad + tuple(s)
        own = (0,) * pad + tuple(own) if own is not None else None
        st, acc = [], 1
        for a in range(rank - 1, -1, -1):
            st.append(0 if s[a] == 1 else own[a] if own is not None else acc)
            acc *= s[a]
        strides.append(st[::-1])
    dims = []
    cols = [[] for _ in in_shapes]
    for a in range(rank):
        if out_shape[a] == 1:
            continue
        if dims and all(cols[j][-1] == strides[j][a] * out_shape[a] for j in range(len(in_shapes))):
            dims[-1] *= out_shape[a]   # merge with the previous dim: contiguous for every input
            for j in range(len(in_shapes)):
                cols[j][-1] = strides[j][a]
            continue
        dims.append(out_shape[a])
        for j in range(len(in_shapes)):
            cols[j].append(strides[j][a])
    n = math.prod(out_shape)
    modes = []
    for j in range(len(in_shapes)):
        if math.prod(in_shapes[j]) == n and given[j] is None:
            modes.append("full")
        elif all(c == 0 for c in cols[j]):
            modes.append("scalar")
        else:
            modes.append("bcast")
    return modes, tuple(dims) or (1,), cols
