"""Generated element-wise kernels.

An element-wise expression (one op, or later a fused chain) over k inputs becomes one
``@cuda.jit`` grid-stride kernel, written as a real .py file in the cache dir (so numba can
keep the compiled code on disk: ``load_kernel`` attaches kernels/cache.py's cache) and loaded.
Broadcasting is done in the kernel: every input is classed as ``full`` (same elements as the
output, index ``i``), ``scalar`` (index 0) or ``bcast`` (offset from the output index through
collapsed dims and strides), so no broadcast is ever materialised. Where half data moves, the
vector variant (``kernel_source``'s ``vec``) has a thread take 8 consecutive elements in
16-byte loads and stores (kernels/ptx.py); runtime/lower.py decides where that is legal.

Floats are computed in f32 (f16 / bf16 / fp8 widened on load, rounded on store), except f64,
which is computed in f64 throughout (the ``_f64`` functions of kernels/elementwise.py).

Expressions are nested tuples:
  ("in", k, dtype) | ("activation", kind, dtype, x) | ("binary", kind, dtype, a, b)
  | ("compare", kind, dtype, a, b) | ("where", None, dtype, c, a, b) | ("cast", None, dtype, x)
  | ("activation_grad", kind, dtype, grad, z)   (grad * kind'(z), for backward passes)
"""
from __future__ import annotations

import functools
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
from .cache import STATS, attach, cache_dir, log  # noqa: F401 - cache_dir: codegen's name too

_NUMBA_INT = {dt.I32: "int32", dt.I64: "int64", dt.U8: "uint8", dt.I8: "int8", dt.I16: "int16"}
_FP8 = {dt.F8E4M3: "f8e4m3", dt.F8E5M2: "f8e5m2"}    # ew.<name>_to_f32 / f32_to_<name>
_loaded: dict[str, object] = {}


# ---- expression -> Python source ------------------------------------------------------------
def _compute(d: dt.DType) -> dt.DType:
    """The dtype a value of ``d`` is held in inside a kernel: f64 for f64, f32 for the other
    floats (f16 / bf16 / fp8 widened on load), the integer itself otherwise."""
    return d if d == dt.F64 or not d.is_float else dt.F32


def _to(value: str, src: dt.DType, dst: dt.DType) -> str:
    """Convert a value held in src's compute form (f32 for floats, f64 for f64) to dst's."""
    if src == dst or _compute(src) == _compute(dst):
        return value
    if dst.is_float:   # (a cast from f64 to a narrower float rounds once: see _emit)
        return f"{_compute(dst).name.replace('f', 'float')}({value})"
    if dst == dt.BOOL:
        return f"({value} != 0)"
    if src.is_float and dst.itemsize <= 2:   # through int32, wrapping as PyTorch's casts do
        return f"{_NUMBA_INT[dst]}(ew.f2i32({value}))"
    if src.is_float:
        return f"ew.f2i{dst.itemsize * 8}({value})"
    return f"{_NUMBA_INT[dst]}({value})"


def _fn(kind: str, d: dt.DType) -> str:
    """The elementwise.py function of float op ``kind`` computing in d's compute form."""
    return f"ew.{kind}_f64" if d == dt.F64 else f"ew.{kind}"


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
        return f"{_fn(kind, d)}({_to(x, xd, d)})"
    if op == "binary":
        (a, ad), (b, bd) = args
        ct = dt.promote(ad, bd)
        if kind == "div" and not ct.is_float:
            ct = dt.F32
        suffix = ("_f64" if ct == dt.F64 and kind == "pow" else "" if ct.is_float
                  else "_b" if ct == dt.BOOL else "_i")
        return f"ew.{kind}{suffix}({_to(a, ad, ct)}, {_to(b, bd, ct)})"
    if op == "compare":
        (a, ad), (b, bd) = args
        ct = dt.promote(ad, bd)
        sym = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}[kind]
        return f"({_to(a, ad, ct)} {sym} {_to(b, bd, ct)})"
    if op == "activation_grad":
        (gr, gd), (z, zd) = args
        return f"{_fn(kind + '_grad', d)}({_to(gr, gd, d)}, {_to(z, zd, d)})"
    if op == "where":
        (c, _), (a, ad), (b, bd) = args
        return f"({_to(a, ad, d)} if {c} else {_to(b, bd, d)})"
    if op == "cast":
        (x, xd), = args
        if xd == dt.F64 and d.is_float and d.itemsize <= 2:   # f32 rounded to odd, then once
            x, xd = f"ew.f64_to_f32_odd({x})", dt.F32          # to d (not f32's nearest first)
        v = _to(x, xd, d)
        if d == dt.F16 and xd != dt.F16:   # round now, so later ops in a chain see f16 values
            return f"float32(float16({v}))"
        if d == dt.BF16 and xd != dt.BF16:
            return f"ew.round_bf16({v})"
        if d in _FP8 and xd != d:
            return f"ew.round_{_FP8[d]}({v})"
        return v
    raise ValueError(f"codegen: unknown expression op {op!r}")


def _load(name: str, d: dt.DType) -> str:
    if d == dt.F16:
        return f"float32({name})"
    if d == dt.BF16:
        return f"ew.bf16_to_f32({name})"
    if d in _FP8:
        return f"ew.{_FP8[d]}_to_f32({name})"
    return name


def _store(value: str, d: dt.DType) -> str:
    if d == dt.F16:
        return f"float16({value})"
    if d == dt.BF16:
        return f"ew.f32_to_bf16({value})"
    if d in _FP8:
        return f"ew.f32_to_{_FP8[d]}({value})"
    return value


UNROLL = 8  # elements per thread per loop trip: loads issued together keep more bytes in flight
VEC = 8     # elements per thread per trip of the vector kernel: 16 bytes of f16/bf16
# how the vector kernel reads an input: "ld" / "vld" VEC elements in 16-byte loads (read-only
# .nc, or plain where the input may alias the output), "one" a single element for all VEC
# (a scalar, or a broadcast along the last dim), "el" element by element
VEC_KINDS = ("ld", "vld", "one", "el")


def magic_divisor(d: int) -> tuple[int, int]:
    """(m, s) with r // d == (((r * m) >> 32) + r) >> s for every 0 <= r < 2**32 (the
    round-up method of Granlund and Montgomery, as PyTorch's IntDivider): a multiply-high,
    an add and a shift instead of a ~25-instruction integer division per element."""
    s = (d - 1).bit_length()
    return ((1 << 32) * ((1 << s) - d)) // d + 1, s


def _offsets(idx: str, u, js, ndim: int, idx32: bool) -> list[str]:
    """Lines giving o{j}_{u}, the offset of output element ``idx`` in each bcast input j."""
    if not js:
        return []
    pre = [f"r = {idx}"]
    for a in range(ndim - 1, 0, -1):
        if idx32:   # r < 2**32 and m < 2**32: the multiply is one mul.wide.u32
            pre += [f"q = (((r * m{a}) >> U32) + r) >> sh{a}", f"c{a} = r - q * d{a}", "r = q"]
        else:
            pre += [f"c{a} = r % d{a}", f"r = r // d{a}"]
    for j in js:
        terms = [f"c{a} * s{j}_{a}" for a in range(ndim - 1, 0, -1)] + [f"r * s{j}_0"]
        pre.append(f"o{j}_{u} = " + " + ".join(terms))
    return pre


def _vector_trip(expr, in_dtypes, modes, ndim, idx32, vec) -> list[str]:
    """One trip of the vector kernel: elements b .. b + VEC - 1 (b a multiple of VEC), every
    offset and load first, then the math, then the stores (``out`` may be an input)."""
    k = len(in_dtypes)
    bc = [j for j in range(k) if modes[j] == "bcast"]
    el = [j for j in bc if vec[j] == "el"]
    pre = _offsets("b", 0, bc, ndim, idx32)          # element b's offsets in every bcast input
    for e in range(1, VEC):                           # the other elements' where read one by one
        if el:
            pre.append(f"b{e} = b + uint64({e})")
        pre += _offsets(f"b{e}", e, el, ndim, idx32)
    names = [[f"x{j}_{e}" for e in range(VEC)] for j in range(k)]
    for j in range(k):
        d, x = in_dtypes[j], names[j]
        full = modes[j] == "full"
        if modes[j] == "scalar" or vec[j] == "one":
            names[j] = [f"x{j}"] * VEC
            pre.append(f"x{j} = " + _load(f"in{j}[{'0' if modes[j] == 'scalar' else f'o{j}_0'}]", d))
        elif vec[j] == "el":
            for e in range(VEC):
                at = ("b" if e == 0 else f"b + uint64({e})") if full else f"o{j}_{e}"
                pre.append(f"{x[e]} = " + _load(f"in{j}[{at}]", d))
        else:
            at = "b" if full else f"o{j}_0"
            if d == dt.F32:
                ld = "ld4" if vec[j] == "ld" else "vld4"
                pre.append(f"{', '.join(x[:4])} = ptx.{ld}(in{j}, {at})")
                pre.append(f"{', '.join(x[4:])} = ptx.{ld}(in{j}, {at} + uint64(4))")
                continue
            ws = [f"w{j}_{q}" for q in range(VEC // 2)]
            pre.append(f"{', '.join(ws)} = ptx.{'ld4w' if vec[j] == 'ld' else 'vld4w'}(in{j}, {at})")
            for q, w in enumerate(ws):   # a word holds elements 2q (low half) and 2q + 1
                if d == dt.F16:
                    pre.append(f"{x[2 * q]}, {x[2 * q + 1]} = ptx.h2f({w})")
                else:
                    pre.append(f"{x[2 * q]} = ew.bf16_to_f32({w} & M16)")
                    pre.append(f"{x[2 * q + 1]} = ew.bf16_to_f32({w} >> U16)")
    ys = [f"y{e}" for e in range(VEC)]
    math_ = [f"{ys[e]} = " + _emit(expr, [names[j][e] for j in range(k)]) for e in range(VEC)]
    d = expr[2]
    if d == dt.F16:
        pairs = [f"ptx.f2h2(float32({ys[2 * q]}), float32({ys[2 * q + 1]}))" for q in range(VEC // 2)]
        stores = [f"ptx.st4w(out, b, {', '.join(pairs)})"]
    elif d == dt.BF16:
        pairs = [f"(uint32(ew.f32_to_bf16(float32({ys[2 * q]})))"
                 f" | (uint32(ew.f32_to_bf16(float32({ys[2 * q + 1]}))) << U16))" for q in range(VEC // 2)]
        stores = [f"ptx.st4w(out, b, {', '.join(pairs)})"]
    elif d == dt.F32:
        stores = [f"ptx.vst4(out, b, {', '.join(ys[:4])})",
                  f"ptx.vst4(out, b + uint64(4), {', '.join(ys[4:])})"]
    else:
        stores = [f"out[{'b' if e == 0 else f'b + uint64({e})'}] = {_store(ys[e], d)}"
                  for e in range(VEC)]
    return pre + math_ + stores


def kernel_source(expr, in_dtypes, modes, ndim: int, idx32: bool = True, vec=None) -> str:
    """_kernel_source's text, made once a process for each distinct set of arguments (a
    model's layers ask for the same few kernels: SmolLM2-135M's prefill and decode graphs,
    125 asks for 7 sources, 35 ms of codegen a process on the dev host)."""
    return _kernel_source(expr, tuple(in_dtypes), tuple(modes), int(ndim), bool(idx32),
                          None if vec is None else tuple(vec))


@functools.lru_cache(maxsize=1024)
def _kernel_source(expr, in_dtypes, modes, ndim: int, idx32: bool, vec) -> str:
    """Python source of the kernel for this expression, input dtypes/modes and collapsed rank.

    With ``idx32`` (every index < 2**32) the broadcast offsets divide by the collapsed dims
    through precomputed magic numbers (``magic_divisor``); otherwise with int64 division.

    All index math is uint64 (every argument after the arrays is passed as np.uint64): numba
    adds a negative-index wraparound to every signed subscript, and signed // and % need sign
    fix-ups; unsigned indices need neither.

    The grid-stride loop handles UNROLL elements (i, i+step, ...) per trip: first every offset
    and load, then the math, then the stores. Loads must come before stores explicitly because
    ``out`` may be an input too (in-place epilogues), so the compiler could not reorder them.

    ``vec`` (a VEC_KINDS entry per input; None: the scalar kernel above) makes the vector
    kernel: a thread takes VEC consecutive elements a trip, stores a f16/bf16/f32 output in
    16-byte stores and reads each input as ``vec`` says; the last n % VEC elements follow
    one a thread. The caller checks that it is legal: every array accessed 16 bytes at a
    time is 16-byte aligned, and an "ld"/"vld" bcast input has rows of whole vectors.
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
        pre += _offsets(idx, u, bc, ndim, idx32)
        where = {"full": idx, "scalar": "0"}
        names = []
        for j in range(k):
            names.append(f"v{j}_{u}")
            at = where.get(modes[j], f"o{j}_{u}")
            pre.append(f"v{j}_{u} = " + _load(f"in{j}[{at}]", in_dtypes[j]))
        return pre, f"out[{idx}] = {_store(_emit(expr, names), expr[2])}"

    pre0, store0 = element(0)
    if vec is None:
        parts = [element(u) for u in range(UNROLL)]
        unrolled = [line for pre, _ in parts for line in pre] + [st for _, st in parts]
        body = [
            "    i = uint64(cuda.grid(1))",
            "    step = uint64(cuda.gridsize(1))",
            f"    while i + uint64({UNROLL - 1}) * step < n:",
            *("        " + s for s in unrolled),
            f"        i += uint64({UNROLL}) * step",
        ]
    else:
        assert len(vec) == k and set(vec) <= set(VEC_KINDS), vec
        body = [
            "    v = uint64(cuda.grid(1))",
            "    step = uint64(cuda.gridsize(1))",
            f"    nv = n // uint64({VEC})",
            "    while v < nv:",
            f"        b = v * uint64({VEC})",
            *("        " + s for s in _vector_trip(expr, in_dtypes, modes, ndim, idx32, vec)),
            "        v += step",
            f"    i = nv * uint64({VEC}) + uint64(cuda.grid(1))   # the tail",
        ]
    lines = [
        "# generated by rlx_numba.kernels.codegen; do not edit",
        f"# expr: {expr_repr(expr)}",
        f"# inputs: {', '.join(f'{d}:{mo}' for d, mo in zip(in_dtypes, modes))}; collapsed rank {ndim}",
        *([f"# vector: {VEC} elements a thread; inputs read {', '.join(vec)}"] if vec else []),
        "from numba import cuda, float32, float64, int8, int16, int32, int64, uint8, uint32, uint64",
        "from numba.core.types import float16",
        "from rlx_numba.kernels import elementwise as ew",
        *(["from rlx_numba.kernels import ptx"] if vec else []),
        "",
        "U32 = uint64(32)",
        *(["U16 = uint32(16)", "M16 = uint32(0xFFFF)"] if vec else []),
        "",
        "@cuda.jit   # load_kernel attaches the disk cache (rlx_numba/kernels/cache.py)",
        f"def kernel({', '.join(params)}):",
        *body,
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


def _unlink_quietly(name) -> None:
    if name is not None:
        try:
            os.unlink(name)
        except OSError:
            pass


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
        tmp = None
        try:
            with tempfile.NamedTemporaryFile("w", encoding="utf-8", dir=path.parent,
                                             suffix=".tmp", delete=False) as f:
                tmp = f.name
                f.write(source)
            os.replace(tmp, path)
            STATS["py_written"] += 1
        except OSError as e:   # a full or read-only cache: this kernel runs uncached
            _unlink_quietly(tmp)
            log.warning("rlx_numba: could not write the kernel source %s (%s): it runs "
                        "without the disk cache", path, e)
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
