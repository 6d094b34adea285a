"""Differential fuzzer: seeded random graphs built through the public Graph API, run by
rlx_numba (every requested exec mode, two input sets, numpy and view outputs) and checked
against an independent NumPy evaluator written here.

    python -m tools.fuzz --n 200 --seed 0 [--modes stream,graph,eager]
                         [--dtypes f32,f16,bf16,f64,i32,c64] [--max-nodes 8] [--ops add,...]
                         [--only 17]          # rerun one graph of a seed (a finding's repro)

The evaluator computes every node in float64 from its inputs' already-rounded values and
rounds the result to the node's dtype (each kernel rounds its op's output once). Beside the
values it keeps, elementwise, the range [lo, hi] a correct kernel's result lies in:
rnd(pre - E) .. rnd(pre + E), where pre is the float64 value before the output rounding and
E bounds the kernel's distance from it before its rounding (the inputs' errors times the op's
sensitivity, plus the kernel's arithmetic: f32, or f64's for f64 results, so an f64 op that
computes in f32 is a finding). Rounding is monotonic, so exact inputs to a correctly
rounded op leave a single value (two near a rounding boundary): a result one ulp off is a
finding. Integer and bool results, comparisons, max/min and shape ops of exact inputs must
match bit for bit. Ops that are discontinuous (compare, round, float->int casts, argmax)
only take exact operands, and the generator keeps values in well-conditioned ranges
(denominators away from 0, log/sqrt of values >= 0.25, exp of values <= 4) so the bounds
stay tight. A finding prints the seed, the graph, the mode, the output and the error, and a
command that reruns just that graph; the exit status is 1 when there is one.

``--grads``: each graph whose nodes are all differentiable ops away from kinks (smooth
activations, + - * /, sum / mean, softmax, norms, products, einsum, attention, rope, conv,
avg pool, pad, scatter_add, cross_entropy, solve, inv, det, slogdet, triangular_solve, shape
ops, gathers) and whose outputs are f32 also gets ``g.grad`` of sum_k sum(out_k * W_k) (W_k
random) with respect to its f32 inputs, checked against central differences of that loss
through the same graph's forward run (which the evaluator above has checked), at a few
coordinates of each input.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

import rlx_numba as rlx

HOST = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16, "f64": np.float64,
        "i32": np.int32, "i64": np.int64, "bool": np.bool_, "c64": np.complex64}
FLOATS = ("f32", "f16", "bf16", "f64")
UNIT = {"f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8, "f64": 2.0 ** -53}  # roundoff
TINY = {"f32": 2.0 ** -149, "f16": 2.0 ** -24, "bf16": 2.0 ** -133,                # smallest
        "f64": 2.0 ** -1074}                                                      # subnormal
U32 = UNIT["f32"]


def cu(d):
    """The unit roundoff of the arithmetic a kernel producing dtype ``d`` does: f64's own, f32
    for every other (half kernels compute in f32)."""
    return UNIT["f64"] if d == "f64" else U32
RANK = {"bool": 0, "i32": 2, "i64": 3, "f16": 4, "bf16": 4, "f32": 5, "f64": 6}
LIMIT = 1e4          # values beyond this are not generated (f16 overflows at 65504)


class Finding(Exception):
    pass


# ---- dtype rules (written from DESIGN.md / torch, not read from rlx_numba) -----------------------
def promote(a, b):
    if a == b:
        return a
    if {a, b} == {"f16", "bf16"}:
        return "f32"
    return a if RANK[a] > RANK[b] else b


def rnd(x, d):
    """x (float64 / int / bool array) as the values of dtype d (float64, int64 or bool;
    complex128 for c64)."""
    x = np.asarray(x)
    if d == "c64":
        return x.astype(np.complex128).astype(np.complex64).astype(np.complex128)
    if d in FLOATS:
        return x.astype(np.float64).astype(HOST[d]).astype(np.float64)
    if d == "bool":
        return x.astype(bool)
    x = x.astype(np.int64)
    return x.astype(np.int32).astype(np.int64) if d == "i32" else x


def amax(vs):
    """max |v| over both input sets (0 for empty or bool; the modulus of complex values)."""
    return max((float(np.max(np.abs(v if np.iscomplexobj(v) else v.astype(np.float64)),
                              initial=0.0)) for v in vs), default=0.0)


# ---- the reference functions of the element-wise ops (float64) --------------------------------
_erf = np.vectorize(math.erf, otypes=[np.float64])
SQ2PI = math.sqrt(2.0 / math.pi)

UNARY = {
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "gelu_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(SQ2PI * (x + 0.044715 * x ** 3))),
    "silu": lambda x: x / (1.0 + np.exp(-x)),
    "relu": lambda x: np.maximum(x, 0),
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
    "tanh": np.tanh, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "neg": lambda x: -x, "abs": np.abs,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "atan": np.arctan,
    "round": np.round,            # half to even, as the op
}
# a bound on |f'(x)| over the operand's values (for the error bound)
SLOPE = {
    "gelu": lambda x: 1.13, "gelu_tanh": lambda x: 1.13, "silu": lambda x: 1.1,
    "relu": lambda x: 1.0, "sigmoid": lambda x: 0.25, "tanh": lambda x: 1.0,
    "exp": lambda x: float(np.exp(np.max(x))), "log": lambda x: 1.0 / float(np.min(x)),
    "sqrt": lambda x: 0.5 / math.sqrt(float(np.min(x))),
    "rsqrt": lambda x: 0.5 * float(np.min(x)) ** -1.5, "neg": lambda x: 1.0,
    "abs": lambda x: 1.0, "sin": lambda x: 1.0, "cos": lambda x: 1.0,
    "tan": lambda x: 1.0 + float(np.max(np.tan(x) ** 2)), "atan": lambda x: 1.0,
    "round": lambda x: 0.0,
}
INT_PRESERVING = ("relu", "neg", "abs", "round")
EXACT_UNARY = ("relu", "neg", "abs")          # no rounding: exact in, exact out
BINARY = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "max": np.maximum, "min": np.minimum, "pow": np.power,
}
COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
           "gt": np.greater, "ge": np.greater_equal}
OPERATOR = {"add": "__add__", "sub": "__sub__", "mul": "__mul__", "div": "__truediv__",
            "pow": "__pow__", "eq": "__eq__", "ne": "__ne__", "lt": "__lt__", "le": "__le__",
            "gt": "__gt__", "ge": "__ge__"}


@dataclass
class Val:
    """A tensor of the graph with its reference values (one per input set) and error bound."""
    t: object            # the rlx Tensor
    vs: list             # reference values, float64 / int64 / bool arrays, one per input set
    d: str               # expected dtype
    e: float = 0.0       # absolute error bound (0: exact)
    leaf: bool = False
    lo: list = None      # per input set, the range a correct result lies in (elementwise)
    hi: list = None
    special: bool = False  # holds NaN / inf (gen_specials): an output, never an operand

    def __post_init__(self):
        if self.lo is None:
            self.lo, self.hi = self.vs, self.vs

    @property
    def shape(self):
        return self.vs[0].shape

    @property
    def exact(self):
        return self.e == 0.0


@dataclass
class Scalar:
    """A Python scalar operand and the value the op sees (weak scalars: f32, unrounded)."""
    py: object
    d: str               # dtype of the constant it becomes
    weak: bool = False


@dataclass
class Config:
    dtypes: tuple = ("f32", "f16", "bf16", "f64", "i32", "c64")
    modes: tuple = ("stream", "graph", "eager")
    compile_mode: str = "jit"
    max_nodes: int = 8
    max_size: int = 120          # elements per tensor (the simulator runs a thread each)
    max_dim: int = 7             # dims are 1..max_dim
    zero_dims: float = 0.0       # the chance of a 0 in a leaf's shape (empty tensors)
    ops: tuple | None = None     # only these generators (None: all)
    grads: bool = False          # also check gradients of differentiable graphs (module doc)


class Builder:
    """Grows one random graph and its reference values side by side."""

    def __init__(self, rng, cfg: Config, name):
        self.rng, self.cfg = rng, cfg
        self.g = rlx.Graph(name)
        self.vals: list[Val] = []
        self.feeds = [{}, {}]         # run() inputs of the two input sets
        self.params = {}
        self.refused = Counter()      # op/dtype -> ValueErrors at build time
        self.n_ops = 0
        self.k = 0
        # c64 values are made and taken only by the generators that opt in (gen_complex and
        # the shape ops that move complex values)
        self.real_dtypes = tuple(d for d in cfg.dtypes if d != "c64") or ("f32",)

    # ---- leaves ------------------------------------------------------------------------------
    def shape(self, rank=None):
        r = self.rng
        rank = int(r.choice([0, 1, 2, 2, 3, 3, 4])) if rank is None else rank
        s, size = [], 1
        for _ in range(rank):      # each dim within what max_size leaves
            hi = max(1, min(self.cfg.max_dim, self.cfg.max_size // size))
            s.append(int(r.integers(1, hi + 1)) if r.random() >= self.cfg.zero_dims else 0)
            size *= max(s[-1], 1)
        r.shuffle(s)
        return tuple(s)

    def values(self, shape, d):
        r = self.rng
        if d == "c64":
            return rnd(self.values(shape, "f32") + 1j * self.values(shape, "f32"), d)
        if d in FLOATS:     # mostly uniform; some integers and halves (ties, round's
            u = r.random()  # half-to-even), some small or large magnitudes
            if u < 0.6:
                x = r.uniform(-2.0, 2.0, size=shape)
            elif u < 0.75:
                x = r.integers(-3, 4, size=shape).astype(np.float64)
            elif u < 0.85:
                x = r.integers(-6, 7, size=shape) * 0.5
            else:
                x = r.uniform(-2.0, 2.0, size=shape) * float(r.choice([1e-3, 30.0]))
            return rnd(x, d)
        if d == "bool":
            return r.random(size=shape) < 0.5
        return r.integers(-5, 6, size=shape).astype(np.int64)

    def leaf(self, shape=None, d=None, kind=None):
        """A new input (or a param / constant, set once for both input sets)."""
        shape = self.shape() if shape is None else tuple(shape)
        d = d or str(self.rng.choice(self.real_dtypes))
        kind = kind or str(self.rng.choice(["input"] * 6 + ["param", "constant"]))
        self.k += 1
        name = f"{'x' if kind == 'input' else 'p'}{self.k}"
        if kind == "input":
            vs = [self.values(shape, d), self.values(shape, d)]
            t = self.g.input(name, shape, d)
            for k in (0, 1):
                self.feeds[k][name] = vs[k].astype(HOST[d])
        elif kind == "param":      # set again before each run, with that run's values
            vs = [self.values(shape, d), self.values(shape, d)]
            t = self.g.param(name, shape, d)
            self.params[name] = [v.astype(HOST[d]) for v in vs]
        else:
            v = self.values(shape, d)
            vs = [v, v]
            t = self.g.constant(v.astype(HOST[d]), d)
        val = Val(t, vs, d, 0.0, leaf=True)
        self.vals.append(val)
        return val

    def indices(self, shape, lo, hi):
        """(an i32 / i64 input of ``shape``, its two input sets' values in [lo, hi)): indices
        fed to run()."""
        self.k += 1
        name = f"i{self.k}"
        vals = [self.rng.integers(lo, hi, size=shape) for _ in range(2)]
        t = self.g.input(name, shape, str(self.rng.choice(["i32", "i64"])))
        for k in (0, 1):
            self.feeds[k][name] = vals[k].astype(HOST[str(t.dtype)])
        return t, vals

    def pick(self, ok=lambda v: True, complex_ok=False, **new):
        """An existing value satisfying ``ok`` (mostly), else a new leaf made with ``new``;
        c64 values only where ``complex_ok``."""
        cands = [v for v in self.vals
                 if ok(v) and (complex_ok or v.d != "c64") and not v.special]
        if cands and self.rng.random() < 0.8:
            # prefer recent values: deeper graphs
            w = np.arange(1, len(cands) + 1, dtype=np.float64) ** 2
            return cands[int(self.rng.choice(len(cands), p=w / w.sum()))]
        v = self.leaf(**new)
        return v if ok(v) else None

    def partner_shape(self, shape):
        """A shape that broadcasts with ``shape`` (dims set to 1, its 1s grown, leading dims
        dropped or added)."""
        r = self.rng
        s = [(int(r.integers(2, 4)) if r.random() < 0.3 else 1) if d == 1 else   # 1 grows
             d if r.random() < 0.6 else 1 for d in shape]
        drop = int(r.integers(0, len(s) + 1)) if r.random() < 0.4 else 0
        s = s[drop:]
        if len(shape) <= len(s) < 4 and r.random() < 0.2:   # a new leading dim
            s = [int(r.integers(1, 4))] + s
        s = tuple(s)
        if math.prod(np.broadcast_shapes(s, shape)) > self.cfg.max_size:
            return tuple(shape)
        return s

    def partner(self, a, dtypes=None):
        """A second operand for a: an existing broadcastable value, a new leaf, or a scalar."""
        r = self.rng
        u = r.random()
        dtypes = dtypes or self.real_dtypes
        if u < 0.3:      # a Python scalar: float or int
            if r.random() < 0.6:
                return self.scalar(float(np.round(r.uniform(-2, 2), 3)), a.d)
            return self.scalar(int(r.integers(-3, 4)), a.d)
        def fits(v):
            try:
                return (v is not a or r.random() < 0.3) and v.d in dtypes and not v.special and \
                    math.prod(np.broadcast_shapes(v.shape, a.shape)) <= self.cfg.max_size
            except ValueError:
                return False
        if u < 0.6:
            cands = [v for v in self.vals if fits(v)]
            if cands:
                return cands[int(r.integers(len(cands)))]
        d = a.d if r.random() < 0.6 and a.d in dtypes else str(r.choice(dtypes))
        return self.leaf(self.partner_shape(a.shape), d)

    def scalar(self, py, like):
        """What Graph._operand makes of a Python scalar beside a ``like`` tensor."""
        if isinstance(py, float):
            if like in ("f16", "bf16"):
                return Scalar(py, "f32", weak=True)
            return Scalar(py, like if like in FLOATS else "f32")
        return Scalar(py, "i64" if like == "bool" else like)

    # ---- emitting a node -----------------------------------------------------------------------
    def emit(self, op, build, pre, d, e, tag, ulps=4, bounds=None):
        """Build one node (``build()`` through the public API) whose float64 values before
        the output rounding are ``pre`` (one array per input set). ``e`` bounds how far the
        kernel's value before its rounding may be from ``pre`` (the inputs' errors through the
        op, and the arithmetic at cu(d)), plus ``ulps`` units cu(d) of each element (f32's, or
        f64's for f64); a correct result lies in [rnd(pre - E), rnd(pre + E)] elementwise
        (rounding is monotonic), so exact inputs to a correctly rounded op leave one value
        (two only near a rounding boundary).
        ``bounds`` (lo, hi): given instead, for ops that only move values (shape ops).
        A ValueError from the builder (an op refusing a dtype) skips the candidate and is
        counted; a shape or dtype other than the reference's is a finding."""
        vs = [rnd(v, d) for v in pre]
        lo = hi = vs
        if d in FLOATS:
            if not all(np.all(np.isfinite(v)) for v in vs) or amax(vs) > LIMIT:
                return None           # out of the range the generator keeps to
            if bounds is not None:
                lo, hi = bounds
            elif e or ulps:
                E = [e + ulps * cu(d) * np.abs(v) for v in pre]
                lo = [rnd(v - w, d) for v, w in zip(pre, E)]
                hi = [rnd(v + w, d) for v, w in zip(pre, E)]
            e = max((float(np.max(np.maximum(h - v, v - l), initial=0.0))
                     for v, l, h in zip(vs, lo, hi)), default=0.0)
            if e > 0.25 * (amax(vs) + 1.0):
                return None           # too ill-conditioned to test tightly
        elif d == "c64":
            if not all(np.all(np.isfinite(v)) for v in vs) or amax(vs) > LIMIT:
                return None
            if bounds is not None:
                lo, hi = bounds
            else:     # each component within E of pre's, E from |pre|
                E = [e + ulps * U32 * np.abs(v) for v in pre]
                lo = [rnd(v.real - w, "f32") + 1j * rnd(v.imag - w, "f32") for v, w in zip(pre, E)]
                hi = [rnd(v.real + w, "f32") + 1j * rnd(v.imag + w, "f32") for v, w in zip(pre, E)]
            e = max((float(np.max(np.maximum(np.maximum(h.real - v.real, v.real - l.real),
                                              np.maximum(h.imag - v.imag, v.imag - l.imag)),
                                  initial=0.0)) for v, l, h in zip(vs, lo, hi)), default=0.0)
            if e > 0.25 * (amax(vs) + 1.0):
                return None
        elif d != "bool" and amax(vs) > 2 ** 30:
            return None
        return self.add_node(op, build, vs, d, e, tag, lo, hi)

    def add_node(self, op, build, vs, d, e, tag, lo, hi, special=False):
        """``build()`` the node whose reference values and bounds are given; None (counted)
        where the builder refuses with a ValueError."""
        try:
            t = build()
        except ValueError as ex:
            self.refused[f"{op}/{tag}: {str(ex)[:90]}"] += 1
            return None
        if tuple(t.shape) != vs[0].shape or str(t.dtype) != d:
            raise Finding(f"build {op} ({tag}): got {t.dtype}{list(t.shape)}, reference "
                          f"{d}{list(vs[0].shape)}")
        self.n_ops += 1
        v = Val(t, vs, d, float(e), lo=lo, hi=hi, special=special)
        self.vals.append(v)
        return v


def operand(b, x):
    """(graph operand, reference values, dtype, error, is-weak) of a Val or Scalar."""
    if isinstance(x, Val):
        return x.t, x.vs, x.d, x.e, False
    v = np.asarray(x.py, dtype=HOST[x.d] if not x.weak else np.float32)
    v = rnd(v, x.d)
    return x.py, [v, v], x.d, 0.0, x.weak


def result_dtype(da, wa, db, wb):
    if wa and db in FLOATS:
        return db
    if wb and da in FLOATS:
        return da
    return promote(da, db)


# ---- generators: each adds one op (or skips); the name is what --ops filters --------------------
def gen_unary(b):
    kind = str(b.rng.choice(list(UNARY)))
    x = b.pick(lambda v: v.d != "bool" or b.rng.random() < 0.05)
    if x is None:
        return
    if kind == "round" and not x.exact:
        return                        # discontinuous
    if kind in ("log", "sqrt", "rsqrt") and min(float(np.min(v, initial=1)) for v in x.vs) < 0.25:
        x = positive(b, x)
        if x is None:
            return
    if kind == "exp" and max(float(np.max(v, initial=0)) for v in x.vs) > 4:
        return
    if kind == "tan" and amax(x.vs) > 1.2:
        return
    d = x.d if (x.d in FLOATS or kind in INT_PRESERVING) else "f32"
    xs = [v.astype(np.float64) for v in x.vs]
    vs = [UNARY[kind](v) for v in xs]
    if kind in EXACT_UNARY or kind == "round":
        e, ulps = x.e, 0
    else:     # the input's error through the slope; f32 math (the argument's rounding too)
        slope = max(SLOPE[kind](v) if v.size else 0.0 for v in xs)
        e, ulps = slope * x.e + 2 * cu(d) * slope * amax(xs), 8
    how = b.rng.random()
    build = ((lambda: b.g.activation(kind, x.t)) if how < 0.5 else
             (lambda: -x.t) if kind == "neg" and how < 0.75 else
             (lambda: getattr(b.g, kind)(x.t)))
    return b.emit("activation", build, vs, d, e, f"{kind} {x.d}", ulps)


def positive(b, x):
    """abs(x) + 0.5: an operand for log / sqrt / pow bases / denominators."""
    a = gen_unary_fixed(b, "abs", x)
    if a is None:
        return None
    return binary(b, "add", a, b.scalar(0.5, a.d) if a.d in FLOATS else b.scalar(1, a.d))


def gen_unary_fixed(b, kind, x):
    d = x.d
    vs = [UNARY[kind](v) for v in x.vs]
    return b.emit("activation", lambda: b.g.activation(kind, x.t), vs, d, x.e, f"{kind} {d}", 0)


def binary(b, kind, a, c, swap=False):
    """a kind c (c a Val or Scalar); ``swap``: c kind a, written with the operator when c is a
    scalar (radd, rsub, ...)."""
    ta, va, da, ea, wa = operand(b, a)
    tc, vc, dc, ec, wc = operand(b, c)
    if swap:
        ta, va, da, ea, wa, tc, vc, dc, ec, wc = tc, vc, dc, ec, wc, ta, va, da, ea, wa
    d = result_dtype(da, wa, dc, wc)
    if kind == "div" and d not in FLOATS:
        d = "f32"
    fa = [v.astype(np.float64) for v in va]
    fc = [v.astype(np.float64) for v in vc]
    if d in FLOATS:
        vs = [BINARY[kind](x, y) for x, y in zip(fa, fc)]
    else:        # integer math, wrapping like the kernels' (values are small)
        vs = [BINARY[kind](x.astype(np.int64), y.astype(np.int64)) for x, y in zip(va, vc)]
    ma, mc = amax(va), amax(vc)
    if kind in ("add", "sub"):
        e = ea + ec
    elif kind == "mul":
        e = ea * mc + ec * ma + ea * ec
    elif kind == "div":
        lo = min(float(np.min(np.abs(v), initial=1)) for v in fc)
        e = ea / lo + ec * ma / lo ** 2
    elif kind in ("max", "min"):
        e = max(ea, ec)
    else:   # pow, base >= 0.25
        e = 0.0
        for x, y, z in zip(fa, fc, vs):
            if z.size:
                e = max(e, float(np.max(np.abs(y * z / x))) * ea
                        + float(np.max(np.abs(z * np.log(x)))) * ec)
    ulps = 0 if kind in ("max", "min") else 4
    if kind == "pow":   # powf: exp(b log a) in f32
        e += 4 * cu(d) * amax(vs) * (1 + amax([np.abs(y * np.log(x)) for x, y in zip(fa, fc)]))
        ulps = 8
    tag = f"{kind} {da}{'(weak)' if wa else ''},{dc}{'(weak)' if wc else ''}"
    u = b.rng.random()
    if kind in OPERATOR and u < 0.5:
        if not hasattr(ta, "graph"):     # scalar on the left: the reflected operator
            build = lambda: getattr(tc, OPERATOR[kind].replace("__", "__r", 1))(ta)  # noqa: E731
        else:
            build = lambda: getattr(ta, OPERATOR[kind])(tc)  # noqa: E731
    elif u < 0.75:
        build = lambda: b.g.binary(kind, ta, tc)  # noqa: E731
    else:
        build = lambda: getattr(b.g, kind)(ta, tc)  # noqa: E731
    return b.emit("binary", build, vs, d, e, tag, ulps)


def gen_binary(b):
    kind = str(b.rng.choice(list(BINARY)))
    a = b.pick(lambda v: v.d != "bool" or b.rng.random() < 0.3)   # bool promotes to a number
    if a is None:
        return
    c = b.partner(a)
    if kind in ("div", "pow") and "bool" in (a.d, getattr(c, "d", None)):
        return
    swap = isinstance(c, Scalar) and b.rng.random() < 0.5
    if kind == "div":   # denominator away from 0 (a, for scalar / a)
        if isinstance(c, Scalar) and not swap:
            c = b.scalar(1.5, a.d) if c.py == 0 else c
        else:
            den = a if swap else c
            if min(float(np.min(np.abs(v), initial=1)) for v in den.vs) < 0.25:
                den = positive(b, den)
            a, c = (den, c) if swap else (a, den)
    if kind == "pow":   # positive float base in [0.25, ..], a small exponent
        if a.d not in FLOATS:
            return
        if swap:        # scalar ** a: a positive scalar base, a bounded exponent
            c = b.scalar(float(b.rng.choice([0.5, 1.5, 2.0, 3.0])), a.d)
            if amax(a.vs) > 4:
                return
        else:
            if min(float(np.min(v, initial=1)) for v in a.vs) < 0.25 or amax(a.vs) > 4:
                a = positive(b, a)
            if isinstance(c, Scalar):
                c = b.scalar(float(b.rng.choice([2.0, 3.0, 0.5, -1.0, 1.5, -0.5])), a.d)
            elif amax(c.vs) > 2:
                return
    if a is None or c is None:
        return
    return binary(b, kind, a, c, swap=swap)


def gen_compare(b):
    kind = str(b.rng.choice(list(COMPARE)))
    a = b.pick(lambda v: v.exact)
    if a is None:
        return
    c = b.partner(a)
    if isinstance(c, Val) and not c.exact:
        return
    ta, va, da, _, wa = operand(b, a)
    tc, vc, dc, _, wc = operand(b, c)
    vs = [COMPARE[kind](x.astype(np.float64), y.astype(np.float64)) for x, y in zip(va, vc)]
    if b.rng.random() < 0.5:
        build = lambda: getattr(ta, OPERATOR[kind])(tc)  # noqa: E731
    else:
        build = lambda: b.g.compare(kind, ta, tc)  # noqa: E731
    return b.emit("compare", build, vs, "bool", 0.0, f"{kind} {da},{dc}", 0)


def gen_where(b):
    cond = b.pick(lambda v: v.d == "bool", d="bool")
    if cond is None:
        cond = gen_compare(b)
        if cond is None:
            return
    a = b.partner(cond, dtypes=b.real_dtypes)
    c = b.partner(cond if isinstance(a, Scalar) else a, dtypes=b.real_dtypes)
    if isinstance(a, Scalar) and isinstance(c, Scalar):
        return
    like = a if isinstance(a, Val) else c
    if isinstance(a, Scalar):
        a = b.scalar(a.py, like.d)
    if isinstance(c, Scalar):
        c = b.scalar(c.py, like.d)
    ta, va, da, ea, wa = operand(b, a)
    tc, vc, dc, ec, wc = operand(b, c)
    try:
        np.broadcast_shapes(cond.shape, va[0].shape, vc[0].shape)
    except ValueError:
        return
    d = result_dtype(da, wa, dc, wc)
    f = (lambda v: v.astype(np.float64)) if d in FLOATS else (lambda v: v)  # noqa: E731
    vs = [np.where(k, f(x), f(y)) for k, x, y in zip(cond.vs, va, vc)]
    return b.emit("where", lambda: b.g.where(cond.t, ta, tc), vs, d, max(ea, ec), f"{da},{dc}", 0)


def gen_cast(b):
    to = str(b.rng.choice(list(b.real_dtypes) + ["i64", "bool"]))
    x = b.pick()
    if x is None:
        return
    if x.d in FLOATS and to not in FLOATS and not x.exact:
        return                       # truncation is discontinuous
    xs = [v.astype(np.float64) for v in x.vs]
    if to == "bool":
        vs = [v != 0 for v in xs]
    elif to in FLOATS:
        vs = xs
    else:
        vs = [np.trunc(v) for v in xs]    # toward zero, like numpy / torch
    return b.emit("cast", lambda: b.g.cast(x.t, to), vs, to, x.e, f"{x.d}->{to}", 0)


def axes_arg(b, rank):
    """Random axes for a reduction: None, an int, or a tuple (negative axes mixed in)."""
    r = b.rng
    u = r.random()
    if u < 0.15 or rank == 0:
        return None if rank == 0 or r.random() < 0.7 else ()
    if u < 0.55:
        a = int(r.integers(rank))
        return a - rank if r.random() < 0.4 else a
    k = int(r.integers(1, rank + 1))
    ax = [int(a) for a in r.choice(rank, size=k, replace=False)]
    return tuple(a - rank if r.random() < 0.3 else a for a in ax)


def norm_axes(axes, rank):
    if axes is None:
        return tuple(range(rank))
    return tuple(sorted(a % rank for a in ((axes,) if isinstance(axes, int) else axes)))


def gen_reduce(b):
    kind = str(b.rng.choice(["sum", "mean", "max", "min", "prod"]))
    x = b.pick(lambda v: v.d != "bool")
    if x is None:
        return
    rank = len(x.shape)
    axes = axes_arg(b, rank)
    ax = norm_axes(axes, rank)
    keep = bool(b.rng.random() < 0.4)
    n = math.prod(x.shape[a] for a in ax)
    if kind == "prod" and (not x.exact or n > 6) or kind in ("max", "min") and n == 0:
        return                      # (max / min of nothing: the builder refuses it)
    if kind in ("sum", "prod"):
        d = x.d if x.d in FLOATS else "i64"
    elif kind == "mean":
        d = x.d if x.d in FLOATS else "f32"
    else:
        d = x.d
    fn = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[kind]
    src = [v.astype(np.float64) if d in FLOATS else v for v in x.vs]
    vs = [np.asarray(fn(v, axis=ax, keepdims=keep)) for v in src]
    ulps = 4
    if d not in FLOATS:
        e = 0.0
    elif kind in ("max", "min"):
        e, ulps = x.e, 0
    elif kind == "prod":
        e = 2 * n * cu(d) * amax(vs)
    else:       # any summation order in f32
        e = n * x.e + 2 * n * n * cu(d) * amax(src)
        if kind == "mean":
            e /= max(n, 1)
    how = b.rng.random()
    if how < 0.5:
        build = lambda: b.g.reduce(kind, x.t, axes, keep)  # noqa: E731
    else:
        build = lambda: getattr(b.g, f"reduce_{kind}")(x.t, axes, keep_dim=keep)  # noqa: E731
    return b.emit("reduce", build, vs, d, e, f"{kind} {x.d} axes={axes} keep={keep}", ulps)


def gen_argreduce(b):
    kind = str(b.rng.choice(["argmax", "argmin"]))
    x = b.pick(lambda v: v.exact and v.d != "bool")
    if x is None or not x.shape:
        return
    rank = len(x.shape)
    axis = None if b.rng.random() < 0.25 else int(b.rng.integers(-rank, rank))
    if (x.vs[0].size if axis is None else x.shape[axis]) == 0:
        return                      # (argmax of nothing: the builder refuses it)
    keep = bool(b.rng.random() < 0.4)
    fn = np.argmax if kind == "argmax" else np.argmin
    vs = [np.asarray(fn(v, axis=axis, keepdims=keep)) for v in x.vs]
    if axis is None and keep:
        vs = [v.reshape((1,) * rank) for v in vs]
    return b.emit(kind, lambda: getattr(b.g, kind)(x.t, axis, keep), vs, "i64", 0.0,
                  f"{x.d} axis={axis} keep={keep}", 0)


def gen_cumsum(b):
    x = b.pick(lambda v: v.d != "bool" and len(v.shape) >= 1)
    if x is None:
        return
    rank = len(x.shape)
    axis = int(b.rng.integers(-rank, rank))
    excl = bool(b.rng.random() < 0.3)
    d = x.d if x.d in FLOATS else "i64"
    src = [v.astype(np.float64) if d in FLOATS else v for v in x.vs]
    vs = []
    for v in src:
        c = np.cumsum(v, axis=axis)
        vs.append(c - v if excl else c)
    n = x.shape[axis]
    e = 0.0 if d not in FLOATS else n * x.e + 2 * n * n * cu(d) * amax(src)
    return b.emit("cumsum", lambda: b.g.cumsum(x.t, axis, exclusive=excl), vs, d, e,
                  f"{x.d} axis={axis} exclusive={excl}")


def gen_softmax(b):
    log = bool(b.rng.random() < 0.5)
    x = b.pick(lambda v: v.d in FLOATS and len(v.shape) >= 1, d=str(b.rng.choice(floats(b))))
    if x is None:
        return
    rank = len(x.shape)
    axis = int(b.rng.integers(-rank, rank))
    if x.shape[axis] == 0:
        return
    vs = []
    spread = 0.0
    for v in x.vs:
        z = v - np.max(v, axis=axis, keepdims=True)
        spread = max(spread, float(np.max(np.abs(z), initial=0)))
        lse = np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
        vs.append(z - lse if log else np.exp(z - lse))
    n = x.shape[axis]
    e = 2 * x.e + 8 * cu(x.d) * (n + spread) * (amax(vs) if not log else 1.0)
    op = "log_softmax" if log else "softmax"
    return b.emit(op, lambda: getattr(b.g, op)(x.t, axis), vs, x.d, e, f"{x.d} axis={axis}", 8)


def floats(b):
    return [d for d in b.cfg.dtypes if d in FLOATS] or ["f32"]


def gen_norm(b):
    kind = str(b.rng.choice(["layer_norm", "rms_norm"]))
    x = b.pick(lambda v: v.d in FLOATS and len(v.shape) >= 1, d=str(b.rng.choice(floats(b))))
    if x is None:
        return
    rank = len(x.shape)
    axis = int(b.rng.integers(-rank, rank))
    n = x.shape[axis]
    if n == 0:
        return
    pd = x.d if b.rng.random() < 0.5 else "f32"
    gamma = b.leaf((n,), pd, kind=str(b.rng.choice(["input", "param"])))
    beta = b.leaf((n,), pd) if b.rng.random() < 0.4 else None
    res = None
    if b.rng.random() < 0.3:
        res = b.pick(lambda v: v.d == x.d and v.shape == x.shape and v is not x,
                     shape=x.shape, d=x.d)
    eps = float(b.rng.choice([1e-5, 1e-6, 1e-3]))
    vs, worst = [], math.inf
    for k in range(2):
        h = rnd(x.vs[k] + (res.vs[k] if res is not None else 0.0), x.d)
        mean = np.mean(h, axis=axis, keepdims=True)
        if kind == "layer_norm":
            var = np.mean((h - mean) ** 2, axis=axis, keepdims=True)
            y = (h - mean) / np.sqrt(var + eps)
        else:
            var = np.mean(h * h, axis=axis, keepdims=True)
            y = h / np.sqrt(var + eps)
        shape = [1] * rank
        shape[axis] = n
        y = y * gamma.vs[k].reshape(shape) + (beta.vs[k].reshape(shape) if beta else 0.0)
        vs.append(y)
        worst = min(worst, float(np.min(var + eps, initial=np.inf)))
    eh = x.e + (res.e + 2 * UNIT[x.d] * amax([x.vs[0] + res.vs[0], x.vs[1] + res.vs[1]])
                if res is not None else 0.0)    # (h rounded to x's dtype)
    sens = amax(gamma.vs) / math.sqrt(worst) if math.isfinite(worst) else 0.0
    e = 3 * sens * (eh + 4 * n * cu(x.d) * (amax(x.vs) + (amax(res.vs) if res else 0)))
    e += 8 * cu(x.d) * amax(vs) * n
    fn = getattr(b.g, kind)
    both = res is not None and b.rng.random() < 0.5     # also the x + residual it computed
    pair = []

    def build():
        ys = fn(x.t, gamma.t, beta.t if beta else None, axis=axis, eps=eps,
                residual=res.t if res else None, return_residual=both)
        pair.extend(ys if both else [ys])
        return pair[0]
    y = b.emit(kind, build, vs, x.d, e, f"{x.d} gamma {pd} beta={beta is not None} "
               f"residual={res is not None} return_residual={both} axis={axis}")
    if y is not None and both:
        hs = [x.vs[k] + res.vs[k] for k in range(2)]
        b.emit(f"{kind}.residual_sum", lambda: pair[1], hs, x.d, x.e + res.e, x.d)
    return y


def product(v):
    """A half product's Val: its own result is checked rounded (its lo / hi), but a consumer
    the fusion pass folds into it as an epilogue (a bias, an activation, a residual, gated)
    reads the product's f32 sums unrounded -- the product rounds once, the epilogue included
    (runtime/lower_matmul.py) -- so what consumers inherit (``e``) allows the rounding not
    taken, u |z|."""
    if v is not None and v.d in ("f16", "bf16"):
        v.e += UNIT[v.d] * amax(v.vs)
    return v


def gen_matmul(b):
    a = b.pick(lambda v: v.d in FLOATS and len(v.shape) >= 2,
               shape=b.shape(int(b.rng.integers(2, 5))),
               d=str(b.rng.choice(floats(b))))
    if a is None:
        return
    r = b.rng
    k = a.shape[-1]
    nn = int(r.integers(1, 8))
    batch = b.partner_shape(a.shape[:-2]) if len(a.shape) > 2 else ()
    if len(a.shape) == 2 and r.random() < 0.3:
        batch = (int(r.integers(1, 4)),)
    bshape = tuple(batch) + (k, nn)
    if math.prod(bshape) > b.cfg.max_size:
        return
    bd = a.d if r.random() < 0.9 else str(r.choice(b.real_dtypes))
    c = b.pick(lambda v: v.shape == bshape and v.d == bd, shape=bshape, d=bd)
    if c is None:
        return
    try:
        oshape = np.broadcast_shapes(a.shape[:-2], c.shape[:-2]) + (a.shape[-2], nn)
    except ValueError:
        return
    if math.prod(oshape) > b.cfg.max_size:
        return
    vs = [np.matmul(x.astype(np.float64), y.astype(np.float64)) for x, y in zip(a.vs, c.vs)]
    ma, mc = amax(a.vs), amax(c.vs)
    e = k * (a.e * mc + c.e * ma) + 2 * k * cu(a.d) * ma * mc
    build = (lambda: a.t @ c.t) if r.random() < 0.5 else (lambda: b.g.matmul(a.t, c.t))
    return product(b.emit("matmul", build, vs, a.d, e,
                          f"{a.d}@{c.d} {list(a.shape)}@{list(c.shape)}"))


def gen_grouped(b):
    """grouped_matmul: out[i] = x[i] @ W_{ids[i]} (or W^T with trans_w, w [E, N, K]), ids
    fed to run() in [0, E) (unsorted, repeats, experts left empty), x and w of one float
    dtype; as a product, its consumers may read its sums unrounded (``product``)."""
    r = b.rng
    x = b.pick(lambda v: v.d in ("f32", "f16", "bf16") and len(v.shape) == 2,
               shape=(int(r.integers(1, 13)), int(r.integers(1, 9))),
               d=str(r.choice([d for d in floats(b) if d != "f64"] or ["f32"])))
    if x is None:
        return
    (m, k), e, nn = x.shape, int(r.integers(1, 5)), int(r.integers(1, 8))
    trans = bool(r.random() < 0.4)
    wshape = (e, nn, k) if trans else (e, k, nn)
    if math.prod(wshape) > b.cfg.max_size or m * nn > b.cfg.max_size:
        return
    w = b.pick(lambda v: v.shape == wshape and v.d == x.d, shape=wshape, d=x.d)
    if w is None:
        return
    it, ids = b.indices((m,), 0, e)

    def ref(xv, wv, iv):
        wv = wv.astype(np.float64)
        mats = np.swapaxes(wv, 1, 2) if trans else wv
        return np.einsum("mk,mkn->mn", xv.astype(np.float64), mats[iv])
    vs = [ref(xv, wv, iv) for xv, wv, iv in zip(x.vs, w.vs, ids)]
    ma, mw = amax(x.vs), amax(w.vs)
    err = k * (x.e * mw + w.e * ma) + 2 * k * cu(x.d) * ma * mw
    return product(b.emit("grouped_matmul",
                          lambda: b.g.grouped_matmul(x.t, w.t, it, trans_w=trans), vs, x.d,
                          err, f"{x.d} [{m}, {k}] over {e} experts{' (w^T)' if trans else ''}"))


def gen_attention(b):
    """attention of q [B, Hq, Sq, D], k / v [B, Hkv, Sk, D] (one float dtype; GQA), maybe
    causal (aligned to the keys' end), a sliding window, a bool mask broadcast from one of
    three shapes, softcap, a scale; a row that keeps no key is 0. Bound: the scores' error
    (inputs' errors and an f32 dot of D terms), through softmax (relative, twice the scores'
    error plus f32 sums) into O, plus P rounded to a half dtype for the P V product (the
    tensor-core kernels)."""
    r = b.rng
    d = str(r.choice(floats(b)))
    bb, hkv, grp = int(r.integers(1, 3)), int(r.integers(1, 3)), int(r.integers(1, 3))
    sq, sk, dd = int(r.integers(1, 6)), int(r.integers(1, 7)), int(r.integers(1, 9))
    hq = hkv * grp
    qs, ks = (bb, hq, sq, dd), (bb, hkv, sk, dd)
    if max(math.prod(qs), math.prod(ks), bb * hq * sq * sk) > b.cfg.max_size:
        return
    q = b.pick(lambda x: x.shape == qs and x.d == d, shape=qs, d=d)
    k = b.pick(lambda x: x.shape == ks and x.d == d, shape=ks, d=d)
    v = b.pick(lambda x: x.shape == ks and x.d == d, shape=ks, d=d)
    if q is None or k is None or v is None:
        return
    causal = bool(r.random() < 0.4)
    window = int(r.integers(1, sk + 1)) if r.random() < 0.2 else None
    softcap = float(r.choice([2.0, 5.0])) if r.random() < 0.2 else None
    scale = float(np.round(r.uniform(0.1, 1.0), 3)) if r.random() < 0.4 else None
    mask = None
    if r.random() < 0.25:
        mshape = [(bb, 1, 1, sk), (sq, sk), (bb, hq, sq, sk)][int(r.integers(3))]
        mask = b.leaf(mshape, "bool", kind="input")
    sc = 1.0 / math.sqrt(dd) if scale is None else scale
    pos = sk - sq + np.arange(sq)[:, None]
    j = np.arange(sk)[None, :]
    vs = []
    for i in range(2):
        kk, vv = (np.repeat(x.vs[i], grp, axis=1) for x in (k, v))
        u = q.vs[i] @ kk.transpose(0, 1, 3, 2) * sc
        s_ = softcap * np.tanh(u / softcap) if softcap is not None else u
        keep = np.ones(s_.shape, bool)
        if causal:
            keep &= j <= pos
        if window is not None:
            keep &= (j > pos - window) & (j <= pos)
        if mask is not None:
            keep &= mask.vs[i].astype(bool)
        z = np.where(keep, s_, -np.inf)
        mx = z.max(-1, keepdims=True)
        ex = np.where(keep, np.exp(z - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
        den = ex.sum(-1, keepdims=True)
        vs.append(np.where(den > 0, ex / np.where(den > 0, den, 1.0), 0.0) @ vv)
    mq, mk, mv = amax(q.vs), amax(k.vs), amax(v.vs)
    es = sc * dd * (q.e * mk + k.e * mq + 4 * cu(d) * mq * mk)
    spread = 2 * (softcap if softcap is not None else sc * dd * mq * mk)
    rel = 2 * es + 8 * cu(d) * (sk + spread)
    e = v.e + 2 * rel * mv + (2 * UNIT[d] * mv if d != "f32" else 0.0)
    kw = dict(causal=causal, window=window, softcap=softcap, scale=scale)
    if mask is not None:
        kw["mask"] = mask.t
    tag = (f"{d} q{list(qs)} k{list(ks)} causal={causal} window={window} softcap={softcap} "
           f"scale={scale} mask={None if mask is None else list(mask.shape)}")
    return b.emit("attention", lambda: b.g.attention(q.t, k.t, v.t, **kw), vs, d, e, tag, 8)


def gen_rope(b):
    """rope of x [B, H, S, D] (or [B, S, D]) with cos / sin tables [max_pos, n_rot / 2] (f32 or
    x's dtype), half-split or interleaved pairs, n_rot <= D, a position offset; rotated in f32."""
    r = b.rng
    x = b.pick(lambda v: v.d in FLOATS and len(v.shape) in (3, 4) and v.shape[-1] >= 2,
               shape=b.shape(int(r.choice([3, 4]))), d=str(r.choice(floats(b))))
    if x is None or x.shape[-1] < 2 or x.shape[-2] == 0:
        return
    dd, ss = x.shape[-1], x.shape[-2]
    n_rot = 2 * int(r.integers(1, dd // 2 + 1))
    half = n_rot // 2
    off = int(r.integers(0, 4))
    max_pos = off + ss + int(r.integers(0, 3))
    td = "f32" if r.random() < 0.6 else x.d
    ang = r.uniform(0, 2 * math.pi, size=(max_pos, half))

    def table(f):                  # real cos / sin tables (|entries| <= 1), constants
        v = rnd(f(ang), td)
        val = Val(b.g.constant(v.astype(HOST[td]), td), [v, v], td, 0.0, leaf=True)
        b.vals.append(val)
        return val
    cos, sin = table(np.cos), table(np.sin)
    inter = bool(r.random() < 0.4)
    c, sn = cos.vs[0][off:off + ss], sin.vs[0][off:off + ss]
    vs = []
    for xv in x.vs:
        y = xv.copy()
        if inter:
            x0, x1 = xv[..., 0:n_rot:2], xv[..., 1:n_rot:2]
            y[..., 0:n_rot:2], y[..., 1:n_rot:2] = x0 * c - x1 * sn, x1 * c + x0 * sn
        else:
            x0, x1 = xv[..., :half], xv[..., half:n_rot]
            y[..., :half], y[..., half:n_rot] = x0 * c - x1 * sn, x1 * c + x0 * sn
        vs.append(y)
    e = 2 * x.e + 6 * cu(x.d) * amax(x.vs)
    tag = f"{x.d} {list(x.shape)} n_rot={n_rot} interleaved={inter} offset={off} tables {td}"
    return b.emit("rope", lambda: b.g.rope(x.t, cos.t, sin.t, n_rot=n_rot, interleaved=inter,
                                           position_offset=off), vs, x.d, e, tag)


def _windows(xp, k, stride, dil):
    """xp [N, C, *S] -> [N, C, *O, *k]: each output position's (dilated, strided) window."""
    nd = len(k)
    sp = tuple(range(2, 2 + nd))
    w = np.lib.stride_tricks.sliding_window_view(xp, [dl * (kk - 1) + 1 for kk, dl in
                                                      zip(k, dil)], axis=sp)
    w = w[(Ellipsis,) + tuple(slice(None, None, dl) for dl in dil)]
    return w[(slice(None), slice(None)) + tuple(slice(None, None, st) for st in stride)]


def _conv_geometry(r, max_spatial):
    """(spatial rank, batch, groups, C in, C out, spatial sizes, kernel, stride, dilation,
    padding) of a random 1-d / 2-d convolution."""
    nd = int(r.integers(1, 3))
    n, groups = int(r.integers(1, 3)), int(r.integers(1, 3))
    cin, cout = groups * int(r.integers(1, 3)), groups * int(r.integers(1, 3))
    sp = [int(r.integers(1, max_spatial)) for _ in range(nd)]
    k = [int(r.integers(1, 4)) for _ in range(nd)]
    stride = [int(r.integers(1, 3)) for _ in range(nd)]
    dil = [int(r.integers(1, 3)) for _ in range(nd)]
    pad = [int(r.integers(0, 2)) for _ in range(nd)]
    return nd, n, groups, cin, cout, sp, k, stride, dil, pad


def gen_conv(b):
    """conv (1-d / 2-d; stride, padding per dim, dilation, groups, a bias, channels_last) of
    float x and w; reference: the windows times the filters in float64. Bound as a product of
    C / groups * prod(k) terms."""
    r = b.rng
    d = str(r.choice(floats(b)))
    nd, n, groups, cin, cout, sp, k, stride, dil, pad = _conv_geometry(r, 6)
    out = [(s_ + 2 * p_ - dl * (kk - 1) - 1) // st + 1
           for s_, p_, dl, kk, st in zip(sp, pad, dil, k, stride)]
    if min(out) < 1:
        return
    xs, ws = (n, cin, *sp), (cout, cin // groups, *k)
    if max(math.prod(xs), math.prod(ws), n * cout * math.prod(out)) > b.cfg.max_size:
        return
    cl = bool(r.random() < 0.25)
    perm = (0, *range(2, 2 + nd), 1)           # NC*S -> N*SC (and the filters' KRSC)
    inv = (0, nd + 1, *range(1, nd + 1))
    x = b.leaf(tuple(xs[i] for i in perm) if cl else xs, d)
    w = b.leaf(tuple(ws[i] for i in perm) if cl else ws, d, kind=str(r.choice(["param",
                                                                              "input"])))
    bias = b.leaf((cout,), d) if r.random() < 0.5 else None
    vs = []
    for i in range(2):
        xv, wv = (np.transpose(x.vs[i], inv), np.transpose(w.vs[i], inv)) if cl else \
            (x.vs[i], w.vs[i])
        xp = np.pad(xv, [(0, 0), (0, 0)] + [(p_, p_) for p_ in pad])
        win = _windows(xp, k, stride, dil)              # [N, C, *O, *k]
        cg, og = cin // groups, cout // groups
        parts = []
        for gi in range(groups):
            wg = win[:, gi * cg:(gi + 1) * cg]
            fg = wv[gi * og:(gi + 1) * og]
            parts.append(np.einsum(wg, [0, 1, *range(2, 2 + 2 * nd)],
                                   fg, [2 + 2 * nd, 1, *range(2 + nd, 2 + 2 * nd)],
                                   [0, 2 + 2 * nd, *range(2, 2 + nd)]))
        y = np.concatenate(parts, axis=1)
        vs.append(np.transpose(y, perm) if cl else y)
    kk = cin // groups * math.prod(k)
    mx, mw = amax(x.vs), amax(w.vs)
    e = kk * (x.e * mw + w.e * mx) + 2 * kk * cu(d) * mx * mw
    kw = dict(stride=stride, padding=pad, dilation=dil, groups=groups, channels_last=cl)
    tag = f"{d} x{list(x.shape)} w{list(w.shape)} {kw} bias={bias is not None}"
    build = lambda: b.g.conv(x.t, w.t, None if bias is None else bias.t, **kw)  # noqa: E731
    if bias is None:
        return b.emit("conv", build, vs, d, e, tag)
    # the bias is added to the product rounded to d (torch's cuDNN path adds it after the
    # convolution, in d), or inside the convolution's epilogue: a result within either
    bshape = (1,) * (1 + nd) + (cout,) if cl else (1, cout) + (1,) * nd
    lo, hi, pre = [], [], []
    for i in range(2):
        bv = bias.vs[i].reshape(bshape)
        pre.append(rnd(vs[i], d) + bv)
        cands = [rnd(rnd(vs[i] + sg * (e + 4 * cu(d) * np.abs(vs[i])), d) + sg * bias.e + bv, d)
                 for sg in (-1, 1)]
        cands += [rnd(vs[i] + bv + sg * (e + bias.e + 4 * cu(d) * np.abs(vs[i] + bv)), d)
                  for sg in (-1, 1)]
        lo.append(np.minimum.reduce(cands))
        hi.append(np.maximum.reduce(cands))
    return b.emit("conv", build, pre, d, e + bias.e, tag, 0, (lo, hi))


def gen_pool(b):
    """max / avg pool (1-d / 2-d; stride, padding <= half the window, dilation for max,
    ceil_mode, count_include_pad) over x [N, C, *S]; max moves values (exact), avg is a mean
    in f32."""
    r = b.rng
    kind = str(r.choice(["max", "avg"]))
    nd = int(r.integers(1, 3))
    x = b.pick(lambda v: v.d in FLOATS and len(v.shape) == nd + 2 and min(v.shape) >= 1,
               shape=(int(r.integers(1, 3)), int(r.integers(1, 3)),
                      *[int(r.integers(1, 6)) for _ in range(nd)]),
               d=str(r.choice(floats(b))))
    if x is None or min(x.shape) < 1 or math.prod(x.shape) > b.cfg.max_size:
        return
    sp = x.shape[2:]
    k = [int(r.integers(1, min(3, s_) + 1)) for s_ in sp]
    stride = [int(r.integers(1, 3)) for _ in range(nd)]
    dil = [int(r.integers(1, 3)) if kind == "max" else 1 for _ in range(nd)]
    pad = [int(r.integers(0, (dl * (kk - 1) + 1) // 2 + 1)) for kk, dl in zip(k, dil)]
    ceil = bool(r.random() < 0.3)
    cip = bool(r.random() < 0.5)
    out = []
    for s_, kk, st, dl, p_ in zip(sp, k, stride, dil, pad):
        span = s_ + 2 * p_ - dl * (kk - 1) - 1
        o = (span + (st - 1 if ceil else 0)) // st + 1
        if ceil and (o - 1) * st >= s_ + p_:    # the last window must start inside
            o -= 1
        out.append(o)
    if min(out) < 1:
        return
    vs, los, his = [], [], []
    for src, res in ((x.vs, vs), (x.lo, los), (x.hi, his)):
        for v in src:
            # pad enough on the high side for ceil_mode's last window
            hi_pad = [max(p_, (o - 1) * st + dl * (kk - 1) + 1 - s_ - p_)
                      for o, st, dl, kk, s_, p_ in zip(out, stride, dil, k, sp, pad)]
            fill = -np.inf if kind == "max" else 0.0
            widths = [(0, 0), (0, 0)] + [(p_, h_) for p_, h_ in zip(pad, hi_pad)]
            xp = np.pad(v, widths, constant_values=fill)
            win = _windows(xp, k, stride, dil)[(slice(None), slice(None)) +
                                               tuple(slice(0, o) for o in out)]
            axes = tuple(range(2 + nd, 2 + 2 * nd))
            if kind == "max":
                res.append(win.max(axis=axes))
            else:
                one = np.pad(np.ones(v.shape), widths)     # 1 inside the input
                inside = _windows(one, k, stride, dil)[(slice(None), slice(None)) +
                                                        tuple(slice(0, o) for o in out)]
                if cip:      # the window clipped to the padded input
                    padded = np.pad(np.ones(v.shape), [(0, 0), (0, 0)] +
                                    [(p_, p_) for p_ in pad], constant_values=1.0)
                    padded = np.pad(padded, [(0, 0), (0, 0)] +
                                    [(0, h_ - p_) for h_, p_ in zip(hi_pad, pad)])
                    cnt = _windows(padded, k, stride, dil)[(slice(None), slice(None)) +
                                                           tuple(slice(0, o) for o in out)]
                else:
                    cnt = inside
                res.append(win.sum(axis=axes) / cnt.sum(axis=axes))
    kw = dict(stride=stride, padding=pad, dilation=dil, ceil_mode=ceil, count_include_pad=cip)
    tag = f"{kind} {x.d} {list(x.shape)} k={k} {kw}"
    build = lambda: b.g.pool(x.t, kind, k, **kw)  # noqa: E731
    if kind == "max":
        return b.emit("pool", build, vs, x.d, x.e, tag, 0, ([rnd(v, x.d) for v in los],
                                                          [rnd(v, x.d) for v in his]))
    win_n = math.prod(k)
    return b.emit("pool", build, vs, x.d, x.e + 2 * win_n * cu(x.d) * amax(x.vs), tag)


def gen_pad(b):
    """pad (constant, maybe negative: a crop; reflect; replicate) over the last one or two
    axes: values move (bounds moved alike), the constant rounded to x's dtype."""
    r = b.rng
    x = b.pick(lambda v: len(v.shape) >= 1 and min(v.shape) >= 1 and v.d != "bool")
    if x is None or not x.shape or min(x.shape) < 1:
        return
    mode = str(r.choice(["constant", "constant", "reflect", "replicate"]))
    naxes = int(r.integers(1, min(2, len(x.shape)) + 1))
    pads = []
    for ax in range(naxes):
        size = x.shape[-1 - ax]
        if mode == "reflect":
            pads += [int(r.integers(0, size)), int(r.integers(0, size))]
        elif mode == "constant" and r.random() < 0.3 and size > 1:
            pads += [-int(r.integers(0, size // 2 + 1)), int(r.integers(0, 3))]
        else:
            pads += [int(r.integers(0, 3)), int(r.integers(0, 3))]
    value = float(np.round(r.uniform(-2, 2), 2)) if mode == "constant" and r.random() < 0.5 \
        else 0.0
    if x.d not in FLOATS:
        value = float(int(value))
    rank = len(x.shape)

    def f(v):
        widths = [(0, 0)] * rank
        out = v
        for ax in range(naxes):
            lo, hi = pads[2 * ax], pads[2 * ax + 1]
            a = rank - 1 - ax
            if lo < 0:
                out = np.take(out, range(-lo, out.shape[a]), axis=a)
                lo = 0
            if hi < 0:
                out = np.take(out, range(0, out.shape[a] + hi), axis=a)
                hi = 0
            widths[a] = (lo, hi)
        if mode == "constant":
            return np.pad(out, widths, constant_values=rnd(value, x.d))
        return np.pad(out, widths, mode="reflect" if mode == "reflect" else "edge")
    vs, bounds = via(f, x)
    if math.prod(vs[0].shape) > b.cfg.max_size or 0 in vs[0].shape:
        return
    tag = f"{x.d} {list(x.shape)} pads={pads} {mode} value={value}"
    return b.emit("pad", lambda: b.g.pad(x.t, pads, mode, value), vs, x.d, x.e, tag, 0, bounds)


def gen_sort(b):
    """sort / argsort / topk of exact values (floats or i32) along an axis: values and i64
    indices bit for bit (stable: ties keep their order; topk: ties to the smaller index)."""
    r = b.rng
    kind = str(r.choice(["sort", "argsort", "topk"]))
    x = b.pick(lambda v: v.exact and v.d in FLOATS + ("i32",) and len(v.shape) >= 1
               and min(v.shape) >= 1)
    if x is None or not x.shape or min(x.shape) < 1:
        return
    rank = len(x.shape)
    axis = int(r.integers(-rank, rank))
    n = x.shape[axis]
    desc = bool(r.random() < 0.5) if kind != "topk" else True
    kk = int(r.integers(1, n + 1))
    idx = [np.argsort(-v if desc else v, axis=axis, kind="stable") for v in x.vs]
    if kind == "topk":
        idx = [np.take(i, range(kk), axis=axis) for i in idx]
    vals = [np.take_along_axis(v, i, axis=axis) for v, i in zip(x.vs, idx)]
    tag = f"{kind} {x.d} {list(x.shape)} axis={axis} desc={desc}" + \
        (f" k={kk}" if kind == "topk" else "")
    if kind == "argsort":
        return b.emit("argsort", lambda: b.g.argsort(x.t, axis, desc), idx, "i64", 0.0, tag, 0)
    made = {}

    def build(which):
        if "res" not in made:
            made["res"] = (b.g.sort(x.t, axis, desc) if kind == "sort"
                           else b.g.topk(x.t, kk, axis))
        return made["res"][which]
    if b.emit(kind, lambda: build(0), vals, x.d, 0.0, tag, 0) is None:
        return
    return b.emit(kind, lambda: build(1), idx, "i64", 0.0, tag + " indices", 0)


LINEAR_ACTS = (None, "relu", "gelu", "gelu_tanh", "silu", "sigmoid", "tanh")


def gen_linear(b):
    x = b.pick(lambda v: v.d in FLOATS and len(v.shape) >= 1, d=str(b.rng.choice(floats(b))))
    if x is None:
        return
    r = b.rng
    k, nn = x.shape[-1], int(r.integers(1, 8))
    w = b.leaf((k, nn), x.d, kind=str(r.choice(["param", "input"])))
    bias = b.leaf((nn,), x.d) if r.random() < 0.6 else None
    oshape = x.shape[:-1] + (nn,)
    res = (b.pick(lambda v: v.shape == oshape and v.d == x.d, shape=oshape, d=x.d)
           if r.random() < 0.3 else None)
    act = LINEAR_ACTS[int(r.integers(len(LINEAR_ACTS)))]
    vs, zs, ps = [], [], []
    for i in range(2):
        z = np.matmul(x.vs[i][..., None, :], w.vs[i])[..., 0, :]
        ps.append(z)
        if bias is not None:
            z = z + bias.vs[i]
        zs.append(z)
        y = UNARY[act](z) if act else z
        vs.append(y + res.vs[i] if res is not None else y)
    mz = amax(zs)
    ez = k * x.e * amax(w.vs) + 2 * k * cu(x.d) * amax(x.vs) * amax(w.vs) + 4 * cu(x.d) * mz
    e = 1.13 * ez + 8 * cu(x.d) * (amax(vs) + mz) + (res.e if res else 0.0)
    if x.d != "f32" and (act in (None, "relu") and (bias is not None or act)
                         or res is not None):
        e += 1.13 * UNIT[x.d] * amax(ps)   # cuBLASLt's fused epilogue rounds the product to the
                                           # half type first, as torch's addmm does
    oshape = vs[0].shape
    if math.prod(oshape) > b.cfg.max_size:
        return
    build = lambda: b.g.linear(x.t, w.t, bias.t if bias else None, activation=act,  # noqa: E731
                               residual=res.t if res else None)
    return product(b.emit("linear", build, vs, x.d, e,
                          f"{x.d} act={act} bias={bias is not None} residual={res is not None}"))


def gen_gated(b):
    """activation(gate) * up over the last axis's halves (or its even / odd entries)."""
    x = b.pick(lambda v: v.d in FLOATS and len(v.shape) >= 1 and v.shape[-1] % 2 == 0,
               shape=b.shape(int(b.rng.integers(0, 3))) + (2 * int(b.rng.integers(1, 4)),),
               d=str(b.rng.choice(floats(b))))
    if x is None:
        return
    act = str(b.rng.choice(["silu", "gelu", "gelu_tanh", "relu", "sigmoid", "tanh"]))
    inter = bool(b.rng.random() < 0.4)
    m = x.shape[-1] // 2
    halves = [((v[..., 0::2], v[..., 1::2]) if inter else (v[..., :m], v[..., m:])) for v in x.vs]
    vs = [UNARY[act](gate) * up for gate, up in halves]
    slope = SLOPE[act](None)
    mg = amax([h[0] for h in halves])
    mu = amax([h[1] for h in halves])
    ma = amax([UNARY[act](h[0]) for h in halves])
    e = x.e * (slope * mu + ma) + 8 * cu(x.d) * (slope * mg * mu + ma * mu)
    return b.emit("gated", lambda: b.g.gated(x.t, act, inter), vs, x.d, e,
                  f"{x.d} {act} interleaved={inter}", 8)


# ---- shape ops: values pass through unchanged (views: reshape, narrow) -----------------------
def via(f, *xs):
    """f of the inputs' values, and (lo, hi) the same f of their bounds (an op that only
    moves values)."""
    vs = [f(*(x.vs[k] for x in xs)) for k in (0, 1)]
    return vs, ([f(*(x.lo[k] for x in xs)) for k in (0, 1)],
                [f(*(x.hi[k] for x in xs)) for k in (0, 1)])


def gen_reshape(b):
    x = b.pick(complex_ok=True)
    if x is None:
        return
    size = math.prod(x.shape)
    r = b.rng
    dims = [0] if size == 0 else []
    rest = size
    while rest > 1 and len(dims) < 4:    # a random factorization, ones sprinkled in
        divs = [d for d in range(2, rest + 1) if rest % d == 0]
        d = int(r.choice(divs))
        dims.append(d)
        rest //= d
    if rest > 1:
        dims[-1] *= rest
    while len(dims) < 4 and r.random() < 0.3:
        dims.insert(int(r.integers(len(dims) + 1)), 1)   # unsqueeze
    r.shuffle(dims)
    shape = tuple(dims)
    arg = list(shape)
    if arg and size and r.random() < 0.3:
        arg[int(r.integers(len(arg)))] = -1
    vs, bounds = via(lambda v: v.reshape(shape), x)
    return b.emit("reshape", lambda: b.g.reshape(x.t, arg), vs, x.d, x.e, f"{x.d} -> {arg}", 0,
                  bounds)


def gen_transpose(b):
    x = b.pick(lambda v: len(v.shape) >= 2)
    if x is None:
        return
    rank = len(x.shape)
    if b.rng.random() < 0.2:
        perm = None
        vs, bounds = via(np.transpose, x)
    else:
        p = [int(a) for a in b.rng.permutation(rank)]
        vs, bounds = via(lambda v: np.transpose(v, p), x)
        perm = [a - rank if b.rng.random() < 0.3 else a for a in p]
    return b.emit("transpose", lambda: b.g.transpose(x.t, perm), vs, x.d, x.e, f"{x.d} perm={perm}",
                  0, bounds)


def gen_narrow(b):
    x = b.pick(lambda v: len(v.shape) >= 1)
    if x is None:
        return
    rank = len(x.shape)
    axis = int(b.rng.integers(-rank, rank))
    dim = x.shape[axis]
    if dim == 0:
        return
    start = int(b.rng.integers(0, dim))
    length = int(b.rng.integers(1, dim - start + 1))
    sl = [slice(None)] * rank
    sl[axis] = slice(start, start + length)
    vs, bounds = via(lambda v: v[tuple(sl)], x)
    return b.emit("narrow", lambda: b.g.narrow(x.t, axis, start, length), vs, x.d, x.e,
                  f"{x.d} axis={axis} {start}:{start + length} of {dim}", 0, bounds)


def gen_concat(b):
    x = b.pick(lambda v: len(v.shape) >= 1)
    if x is None:
        return
    rank = len(x.shape)
    axis = int(b.rng.integers(-rank, rank))
    parts = [x]
    for _ in range(int(b.rng.integers(1, 3))):
        s = list(x.shape)
        s[axis] = int(b.rng.integers(1, 4))
        if math.prod(s) + sum(math.prod(p.shape) for p in parts) > b.cfg.max_size:
            break
        parts.append(b.pick(lambda v, s=tuple(s): v.shape == s and v.d == x.d, shape=s, d=x.d))
    if len(parts) < 2 and b.rng.random() < 0.7:
        return
    vs, bounds = via(lambda *ps: np.concatenate(ps, axis=axis), *parts)
    return b.emit("concat", lambda: b.g.concat([p.t for p in parts], axis), vs, x.d, 0.0,
                  f"{x.d} x{len(parts)} axis={axis}", 0, bounds)


def gen_expand(b):
    x = b.pick()
    if x is None:
        return
    r = b.rng
    shape = [int(r.integers(2, 5)) if d == 1 and r.random() < 0.7 else d for d in x.shape]
    while len(shape) < 4 and r.random() < 0.3:
        shape.insert(0, int(r.integers(1, 4)))
    if math.prod(shape) > b.cfg.max_size:
        return
    lead = len(shape) - len(x.shape)       # -1 keeps one of x's dims
    arg = [(-1 if (i >= lead and d == x.shape[i - lead] and r.random() < 0.3) else d)
           for i, d in enumerate(shape)]
    vs, bounds = via(lambda v: np.broadcast_to(v, shape).copy(), x)
    return b.emit("expand", lambda: b.g.expand(x.t, arg), vs, x.d, x.e, f"{x.d} -> {arg}", 0,
                  bounds)


def gen_gather(b):
    x = b.pick(lambda v: len(v.shape) >= 1)
    if x is None:
        return
    r = b.rng
    rank = len(x.shape)
    axis = int(r.integers(-rank, rank))
    dim = x.shape[axis]
    if dim == 0:
        return
    ishape = b.shape(int(r.integers(0, 3)))
    oshape = x.shape[:axis % rank] + ishape + x.shape[axis % rank + 1:]
    if math.prod(oshape) > b.cfg.max_size:
        return
    it, idx = b.indices(ishape, -dim, dim)          # negative ones wrap
    vs = [np.take(v, i % dim, axis=axis) for v, i in zip(x.vs, idx)]
    bounds = ([np.take(v, i % dim, axis=axis) for v, i in zip(x.lo, idx)],
              [np.take(v, i % dim, axis=axis) for v, i in zip(x.hi, idx)])
    return b.emit("gather", lambda: b.g.gather(x.t, it, axis), vs, x.d, x.e,
                  f"{x.d} axis={axis} indices {it.dtype}{list(ishape)}", 0, bounds)


def gen_scatter_add(b):
    """scatter_add of updates into a copy of target (f32, i32) at run()-fed indices (negative
    ones wrap, repeats accumulate), atomically or deterministically; ints bit for bit, f32
    within the sums' rounding (atomics add in any order)."""
    r = b.rng
    t = b.pick(lambda v: v.d in ("f32", "i32") and len(v.shape) >= 1 and min(v.shape) >= 1,
               d=str(r.choice(["f32", "i32"])))
    if t is None or not t.shape or min(t.shape) < 1:
        return
    rank = len(t.shape)
    axis = int(r.integers(-rank, rank))
    dim = t.shape[axis]
    m = int(r.integers(1, 2 * dim + 2))
    ushape = t.shape[:axis % rank] + (m,) + t.shape[axis % rank + 1:]
    if math.prod(ushape) > b.cfg.max_size:
        return
    u = b.pick(lambda v: v.shape == ushape and v.d == t.d, shape=ushape, d=t.d)
    if u is None:
        return
    it, idx = b.indices((m,), -dim, dim)
    det = bool(r.random() < 0.4)
    vs = []
    for k in range(2):
        out = np.moveaxis(t.vs[k].astype(np.float64 if t.d == "f32" else np.int64).copy(),
                          axis, 0)
        np.add.at(out, idx[k] % dim, np.moveaxis(u.vs[k], axis, 0))
        vs.append(np.moveaxis(out, 0, axis))
    if t.d == "i32":
        if amax(vs) > 2 ** 30:
            return
        e = 0.0
    else:       # each result sums its target and up to m updates, in some order
        e = t.e + m * u.e + 2 * (m + 1) * cu(t.d) * (amax(t.vs) + m * amax(u.vs))
    tag = f"{t.d} {list(t.shape)} axis={axis} {m} indices {it.dtype} deterministic={det}"
    return b.emit("scatter_add", lambda: b.g.scatter_add(t.t, it, u.t, axis, det), vs, t.d, e,
                  tag, 0)


EINSUMS = ("ij,jk->ik", "bij,bjk->bik", "ij->ji", "ij->i", "ijk->k", "i,j->ij", "ij,ij->i",
           "bhqd,bhkd->bhqk", "bij,jk->bik", "ijk,ikl->jl")


def gen_einsum(b):
    """einsum of one of EINSUMS (products, batch products, transposes, reductions, outer
    products) over float operands of one dtype, each index 1..4 long; bound as a product
    summing every index absent from the output."""
    r = b.rng
    spec = EINSUMS[int(r.integers(len(EINSUMS)))]
    d = str(r.choice(floats(b)))
    lhs, out = spec.split("->")
    # (letters in order of appearance: a set's order follows PYTHONHASHSEED, and the draws
    # must not, or --only rebuilds another graph than the run that found it)
    sizes = {c: int(r.integers(1, 5)) for c in dict.fromkeys(lhs.replace(",", ""))}
    shapes = [tuple(sizes[c] for c in term) for term in lhs.split(",")]
    oshape = tuple(sizes[c] for c in out)
    if max(math.prod(s_) for s_ in shapes + [oshape]) > b.cfg.max_size:
        return
    ops = []
    for sh in shapes:
        v = b.pick(lambda x, sh=sh: x.shape == sh and x.d == d, shape=sh, d=d)
        if v is None:
            return
        ops.append(v)
    vs = [np.einsum(spec, *(o.vs[k] for o in ops)) for k in range(2)]
    summed = math.prod(sizes[c] for c in set(lhs.replace(",", "")) - set(out))
    ms = [amax(o.vs) for o in ops]
    prod = math.prod(ms)
    e = summed * sum(o.e * prod / m_ if m_ else 0.0 for o, m_ in zip(ops, ms))
    e += 2 * summed * len(ops) * cu(d) * prod
    return product(b.emit("einsum", lambda: b.g.einsum(spec, *(o.t for o in ops)), vs, d, e,
                          f"{d} {spec} {[list(s_) for s_ in shapes]}"))


def gen_group_norm(b):
    """group_norm of x [N, C, *S] over groups of C / G channels and every position, with
    gamma / beta per channel (or none); bound as layer_norm's."""
    r = b.rng
    x = b.pick(lambda v: v.d in FLOATS and 2 <= len(v.shape) <= 4 and min(v.shape) >= 1,
               shape=b.shape(int(r.integers(2, 5))), d=str(r.choice(floats(b))))
    if x is None or len(x.shape) < 2 or min(x.shape) < 1:
        return
    c = x.shape[1]
    groups = int(r.choice([g_ for g_ in range(1, c + 1) if c % g_ == 0]))
    affine = bool(r.random() < 0.6)
    gamma = b.leaf((c,), x.d) if affine else None
    beta = b.leaf((c,), x.d) if affine and r.random() < 0.6 else None
    eps = float(r.choice([1e-5, 1e-3]))
    n_per = (c // groups) * math.prod(x.shape[2:])
    cs = (1, c) + (1,) * (len(x.shape) - 2)
    norm, worst = [], math.inf
    for k in range(2):
        h = x.vs[k].reshape(x.shape[0], groups, -1)
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        norm.append(((h - mean) / np.sqrt(var + eps)).reshape(x.shape))
        worst = min(worst, float(np.min(var + eps, initial=np.inf)))
    if amax(x.vs) > 1e3 * math.sqrt(worst):
        return          # a group's spread lost in its offset: f32 keeps few of its digits
    e = 3 / math.sqrt(worst) * (x.e + 4 * n_per * cu(x.d) * amax(x.vs)) + 8 * cu(x.d) * amax(norm) * n_per
    tag = f"{x.d} {list(x.shape)} groups={groups} affine={affine} beta={beta is not None}"
    build = lambda: b.g.group_norm(x.t, groups, gamma.t if gamma else None,  # noqa: E731
                                   beta.t if beta else None, eps)
    if not affine:
        return b.emit("group_norm", build, norm, x.d, e, tag)
    # with gamma / beta the op is layer_norm's kernel (its result rounded to x's dtype), then
    # the per-channel affine: two roundings in a half dtype, where torch's kernel rounds once
    # (up to an ulp apart; left as it is, see the issue-36 note)
    pre, lo, hi = [], [], []
    for k in range(2):
        gm = gamma.vs[k].reshape(cs)
        bt = beta.vs[k].reshape(cs) if beta else 0.0
        pre.append(rnd(norm[k], x.d) * gm + bt)
        ends = [rnd(rnd(norm[k] + sg * (e + 4 * cu(x.d) * np.abs(norm[k])), x.d) * gm + bt, x.d)
                for sg in (-1, 1)]
        slack = 4 * cu(x.d) * (np.abs(pre[-1]) + np.abs(gm)) + (beta.e if beta else 0.0)
        lo.append(rnd(np.minimum(*ends) - slack, x.d))
        hi.append(rnd(np.maximum(*ends) + slack, x.d))
    return b.emit("group_norm", build, pre, x.d, e, tag, 0, (lo, hi))


def gen_cross_entropy(b):
    """cross_entropy of float logits [..., C] against run()-fed labels (some ignore_index),
    reduction none / sum / mean, label smoothing; the log-sum-exp in f32."""
    r = b.rng
    x = b.pick(lambda v: v.d in FLOATS and 1 <= len(v.shape) <= 3 and min(v.shape) >= 1
               and v.shape[-1] >= 1, shape=b.shape(int(r.integers(1, 4))),
               d=str(r.choice(floats(b))))
    if x is None or not x.shape or min(x.shape) < 1:
        return
    c = x.shape[-1]
    lshape = x.shape[:-1]
    red = str(r.choice(["none", "sum", "mean"]))
    smooth = float(r.choice([0.0, 0.0, 0.1]))
    ignore = -100 if r.random() < 0.6 else int(r.integers(0, c))
    b.k += 1
    name = f"l{b.k}"
    labels = []
    for _ in range(2):
        lab = r.integers(0, c, size=lshape)
        lab = np.where(r.random(size=lshape) < 0.2, ignore, lab)
        if red == "mean" and lab.size and np.all(lab == ignore):
            lab.flat[0] = (ignore + 1) % c if ignore >= 0 else 0
        labels.append(lab)
    if red == "mean" and any(np.all(lab == ignore) for lab in labels):
        return                                  # (NaN: every row ignored)
    lt = b.g.input(name, lshape, str(r.choice(["i32", "i64"])))
    for k in (0, 1):
        b.feeds[k][name] = labels[k].astype(HOST[str(lt.dtype)])
    vs = []
    for k in range(2):
        z = x.vs[k]
        lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
        picked = np.take_along_axis(z, np.where(labels[k] == ignore, 0, labels[k])[..., None],
                                    -1)[..., 0]
        row = (1 - smooth) * (lse - picked) + smooth / c * (c * lse - z.sum(-1))
        keep = labels[k] != ignore
        row = np.where(keep, row, 0.0)
        vs.append(row if red == "none" else np.asarray(row.sum()) if red == "sum"
                  else np.asarray(row.sum() / keep.sum()))
    n = max(1, math.prod(lshape))
    spread = 2 * amax(x.vs)
    e = (2 * x.e + 8 * cu(x.d) * (c + spread + amax(x.vs))) * (n if red == "sum" else 1)
    e += 4 * n * cu(x.d) * amax(vs)
    return b.emit("cross_entropy", lambda: b.g.cross_entropy(
        x.t, lt, red, ignore, smooth), vs, x.d, e,
        f"{x.d} {list(x.shape)} {red} ignore={ignore} smoothing={smooth}")


def _cparts(lo, hi, f):
    """(lo, hi) of complex bounds moved by f, applied to each corner's parts: f of (re, im)
    pairs gives the new parts; the result's bounds are the corners' min / max."""
    corners = [f(a.real + 1j * c.imag) for a in (lo, hi) for c in (lo, hi)]
    re = [np.real(x) for x in corners]
    im = [np.imag(x) for x in corners]
    return (np.minimum.reduce(re) + 1j * np.minimum.reduce(im),
            np.maximum.reduce(re) + 1j * np.maximum.reduce(im))


def gen_complex(b):
    """c64 (only when --dtypes names it): complex(re, im) of f32 tensors, + - * / of c64
    tensors (or beside an f32 tensor or a Python float), real / imag / conj / neg (values
    move), abs (hypot) and angle (atan2, away from the branch cut and 0), a c64 matmul.
    Each component within its bound (f32 arithmetic, Smith's division)."""
    if "c64" not in b.cfg.dtypes:
        return
    r = b.rng
    kind = str(r.choice(["complex", "add", "sub", "mul", "div", "real", "imag", "conj", "neg",
                         "abs", "angle", "matmul"]))
    isc = lambda v: v.d == "c64"  # noqa: E731
    if kind == "complex":
        re = b.pick(lambda v: v.d == "f32", d="f32")
        if re is None:
            return
        im = b.pick(lambda v: v.d == "f32" and v.shape == re.shape, shape=re.shape, d="f32")
        if im is None:
            return
        vs = [a + 1j * c for a, c in zip(re.vs, im.vs)]
        bounds = ([a + 1j * c for a, c in zip(re.lo, im.lo)],
                  [a + 1j * c for a, c in zip(re.hi, im.hi)])
        return b.emit("complex", lambda: b.g.complex(re.t, im.t), vs, "c64", 0.0, "f32,f32", 0,
                      bounds)
    x = b.pick(isc, complex_ok=True, d="c64")
    if x is None:
        return
    if kind in ("real", "imag"):
        part = np.real if kind == "real" else np.imag
        return b.emit(kind, lambda: getattr(b.g, kind)(x.t), [part(v) for v in x.vs], "f32",
                      x.e, "c64", 0, ([part(v) for v in x.lo], [part(v) for v in x.hi]))
    if kind in ("conj", "neg"):
        f = np.conj if kind == "conj" else np.negative
        lohi = [_cparts(lo, hi, f) for lo, hi in zip(x.lo, x.hi)]
        build = (lambda: b.g.conj(x.t)) if kind == "conj" else (lambda: -x.t)
        return b.emit(kind, build, [f(v) for v in x.vs], "c64", x.e, "c64", 0,
                      ([a for a, _ in lohi], [c for _, c in lohi]))
    mag = [np.abs(v) for v in x.vs]
    if kind == "abs":
        return b.emit("abs", lambda: b.g.abs(x.t), mag, "f32",
                      1.5 * x.e + 2 * U32 * amax(mag), "c64")
    if kind == "angle":
        lowest = min(float(np.min(m_, initial=1.0)) for m_ in mag)
        near_cut = any(np.any((v.real < 0) & (np.abs(v.imag) <= 1e-3 + 2 * x.e)) for v in x.vs)
        if lowest < 0.25 or near_cut:
            return
        return b.emit("angle", lambda: b.g.angle(x.t), [np.angle(v) for v in x.vs], "f32",
                      1.5 * x.e / lowest + 4 * U32, "c64")
    if kind == "matmul":
        if len(x.shape) < 2:
            return
        k, nn = x.shape[-1], int(r.integers(1, 5))
        cshape = (k, nn)
        if math.prod(x.shape[:-1]) * nn > b.cfg.max_size or k * nn > b.cfg.max_size:
            return
        c = b.pick(lambda v: v.d == "c64" and v.shape == cshape, complex_ok=True, shape=cshape,
                   d="c64")
        if c is None:
            return
        ma, mc = amax(x.vs), amax(c.vs)
        e = k * (x.e * mc + c.e * ma) + 4 * k * U32 * ma * mc
        return b.emit("matmul", lambda: b.g.matmul(x.t, c.t), [a @ w for a, w in zip(x.vs, c.vs)],
                      "c64", e, f"c64 {list(x.shape)}@{list(cshape)}")
    # + - * /: the other operand c64 (same shape or broadcast), an f32 tensor, or a float
    u = r.random()
    if u < 0.5:
        c = b.pick(lambda v: v.d == "c64" and v.shape == x.shape, complex_ok=True,
                   shape=x.shape, d="c64")
        tag = "c64,c64"
    elif u < 0.75:
        c = b.pick(lambda v: v.d == "f32" and v.shape == x.shape, shape=x.shape, d="f32")
        tag = "c64,f32"
    else:
        py = float(np.round(r.uniform(0.5, 2.0) * r.choice([-1, 1]), 3))
        c, tag = Scalar(py, "f32"), f"c64,{py}"
    if c is None:
        return
    cv = [np.asarray(rnd(c.py, "f32"))] * 2 if isinstance(c, Scalar) else c.vs
    ce = 0.0 if isinstance(c, Scalar) else c.e
    ct = c.py if isinstance(c, Scalar) else c.t
    ma, mc = amax(x.vs), amax(cv)
    if kind == "div":
        lc = min(float(np.min(np.abs(v), initial=1.0)) for v in cv)
        if lc < 0.5:
            return
        e = 2 * (x.e + ce * ma / lc) / lc + 10 * U32 * ma / lc
    elif kind == "mul":
        e = x.e * mc + ce * ma + x.e * ce + 4 * U32 * ma * mc
    else:
        e = x.e + ce
    op = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}[kind]
    vs = [op(a, w) for a, w in zip(x.vs, cv)]
    gop = {"add": lambda: x.t + ct, "sub": lambda: x.t - ct, "mul": lambda: x.t * ct,
           "div": lambda: x.t / ct}[kind]
    return b.emit(kind, gop, vs, "c64", e, tag)


def gen_specials(b):
    """NaN and +-inf through max / min / sum / mean, argmax / argmin, softmax / log_softmax,
    layer_norm / rms_norm, cumsum, exp, relu and binary max / min, as torch's CUDA kernels
    carry them: max / min carry a NaN; argmax / argmin take the first NaN as the answer; a
    softmax row with a NaN or a +inf is all NaN (x - max is inf - inf); norms follow their
    formulas (rms_norm of a row with an inf: inf * 0 and finite * 0); sums are IEEE. A fresh input with about a fifth of its
    entries NaN / inf; NaN and inf results must match exactly, finite ones their bound. The
    result is an output, never another op's operand."""
    r = b.rng
    d = str(r.choice(floats(b)))
    if d == "f64":
        d = "f32"
    shape = b.shape(int(r.integers(1, 4)))
    if not shape or min(shape) < 1:
        return
    vs = []
    for _ in range(2):
        v = b.values(shape, d)
        u = r.random(size=shape)
        v = np.where(u < 0.07, np.nan, np.where(u < 0.14, np.inf, np.where(u < 0.2, -np.inf, v)))
        vs.append(v)
    b.k += 1
    name = f"s{b.k}"
    t = b.g.input(name, shape, d)
    for k in (0, 1):
        b.feeds[k][name] = vs[k].astype(HOST[d])
    rank = len(shape)
    axis = int(r.integers(-rank, rank))
    kind = str(r.choice(["max", "min", "sum", "mean", "argmax", "argmin", "softmax",
                         "log_softmax", "exp", "relu", "maximum", "minimum", "layer_norm",
                         "rms_norm", "cumsum"]))
    n = shape[axis]
    tag = f"{kind} {d} {list(shape)} axis={axis}"
    with np.errstate(all="ignore"):
        if kind in ("max", "min", "sum", "mean"):
            fn = {"max": np.max, "min": np.min, "sum": np.sum, "mean": np.mean}[kind]
            out = [np.asarray(fn(v, axis=axis)) for v in vs]
            e = 0.0 if kind in ("max", "min") else 2 * n * n * U32 * 2 * 2 * 30.0
            build = lambda: b.g.reduce(kind, t, [axis], False)  # noqa: E731
            od = d
        elif kind in ("argmax", "argmin"):
            out = []
            for v in vs:
                base = np.argmax(v, axis=axis) if kind == "argmax" else np.argmin(v, axis=axis)
                nan = np.isnan(v)
                out.append(np.where(nan.any(axis=axis), np.argmax(nan, axis=axis), base))
            build = lambda: getattr(b.g, kind)(t, axis, False)  # noqa: E731
            od, e = "i64", 0.0
        elif kind in ("softmax", "log_softmax"):
            out = []
            for v in vs:
                m = np.max(v, axis=axis, keepdims=True)
                z = v - m
                lse = np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
                out.append(z - lse if kind == "log_softmax" else np.exp(z - lse))
            build = lambda: getattr(b.g, kind)(t, axis)  # noqa: E731
            od, e = d, 8 * U32 * (n + 60.0)
        elif kind in ("layer_norm", "rms_norm"):     # their formulas, as torch's
            gam = rnd(r.uniform(0.5, 2.0, size=n), "f32")
            gt = b.g.constant(gam.astype(np.float32), "f32")
            shape_g = [1] * rank
            shape_g[axis] = n
            out = []
            for v in vs:
                if kind == "rms_norm":
                    y = v / np.sqrt(np.mean(v * v, axis=axis, keepdims=True) + 1e-5)
                else:
                    mu = np.mean(v, axis=axis, keepdims=True)
                    y = (v - mu) / np.sqrt(np.mean((v - mu) ** 2, axis=axis, keepdims=True)
                                           + 1e-5)
                out.append(y * gam.reshape(shape_g))
            fin = [o[np.isfinite(o)] for o in out]
            build = lambda: getattr(b.g, kind)(t, gt, axis=axis, eps=1e-5)  # noqa: E731
            od, e = d, 16 * n * U32 * (amax(fin) + 1.0) * 60.0
        elif kind == "cumsum":
            out = [np.cumsum(v, axis=axis) for v in vs]
            build = lambda: b.g.cumsum(t, axis)  # noqa: E731
            od, e = d, 2 * n * n * U32 * 60.0
        elif kind in ("exp", "relu"):
            fin = [np.where(np.isfinite(v), np.clip(v, -30, 4), v) for v in vs]
            for k in (0, 1):
                vs[k] = fin[k]
                b.feeds[k][name] = fin[k].astype(HOST[d])
            out = [np.exp(v) if kind == "exp" else np.maximum(v, 0.0) for v in vs]
            build = lambda: b.g.activation(kind, t)  # noqa: E731
            od, e = d, 0.0
        else:
            other = [b.values(shape, d) for _ in range(2)]
            b.k += 1
            oname = f"x{b.k}"
            ot = b.g.input(oname, shape, d)
            for k in (0, 1):
                b.feeds[k][oname] = other[k].astype(HOST[d])
            fn = np.maximum if kind == "maximum" else np.minimum     # both carry a NaN
            out = [fn(v, o) for v, o in zip(vs, other)]
            build = lambda: b.g.binary("max" if kind == "maximum" else "min", t, ot)  # noqa: E731
            od, e = d, 0.0
    pre, out = out, [rnd(o, od) for o in out]
    if od != "i64":
        lo, hi = [], []
        for p_, o in zip(pre, out):
            fin = np.isfinite(p_)
            w = np.where(fin, e + 8 * U32 * np.abs(np.where(fin, p_, 0.0)), 0.0)
            lo.append(np.where(fin, rnd(p_ - w, od), o))
            hi.append(np.where(fin, rnd(p_ + w, od), o))
    else:
        lo = hi = out
    return b.add_node("specials", build, out, od, e, tag, lo, hi, special=True)


def gen_linalg(b):
    """linalg_solve, inv, cholesky (lower / upper), det, slogdet and triangular_solve (upper /
    lower, left / right) of a fresh, well-conditioned batch of f32 or f64 matrices (diagonally
    dominant; symmetric positive definite for cholesky); references from np.linalg in
    float64, bounds from the conditioning (cond <= 3 by construction) at the arithmetic's
    unit roundoff, so f64 results are held to f64."""
    r = b.rng
    d = "f64" if "f64" in b.cfg.dtypes and r.random() < 0.5 else "f32"
    kind = str(r.choice(["solve", "inv", "cholesky", "det", "slogdet", "triangular"]))
    n = int(r.integers(1, 6))
    batch = tuple(int(x) for x in r.integers(1, 3, size=int(r.integers(0, 2))))
    shape = batch + (n, n)
    if math.prod(shape) > b.cfg.max_size:
        return
    u = cu(d)

    def matrices():
        m_ = r.uniform(-1, 1, size=shape) / max(n, 1)
        if kind == "cholesky":
            m_ = m_ @ np.swapaxes(m_, -1, -2) + np.eye(n)
        elif kind == "triangular":
            m_ = m_ + 2 * np.eye(n)
        else:
            m_ = m_ + 2 * np.eye(n) * np.sign(r.uniform(-1, 1, size=batch + (1, 1)))
        return rnd(m_, d)
    vs_a = [matrices(), matrices()]
    b.k += 1
    name = f"A{b.k}"
    at = b.g.input(name, shape, d)
    for k in (0, 1):
        b.feeds[k][name] = vs_a[k].astype(HOST[d])
    tag = f"{kind} {d} {list(shape)}"
    amx = max(amax(vs_a), 1.0)
    if kind in ("solve", "triangular"):
        upper, left = bool(r.random() < 0.5), bool(r.random() < 0.5 or kind == "solve")
        kk = int(r.integers(1, 4))
        bshape = batch + ((n, kk) if left else (kk, n))
        if math.prod(bshape) > b.cfg.max_size:
            return
        rhs = b.pick(lambda v: v.d == d and v.shape == bshape and v.exact, shape=bshape, d=d)
        if rhs is None:
            return
        vs = []
        for A, B in zip(vs_a, rhs.vs):
            if kind == "triangular":
                A = np.triu(A) if upper else np.tril(A)
            vs.append(np.linalg.solve(A, B) if left else
                      np.swapaxes(np.linalg.solve(np.swapaxes(A, -1, -2),
                                                  np.swapaxes(B, -1, -2)), -1, -2))
        e = 64 * n * u * (amax(vs) + amax(rhs.vs)) * 3
        build = ((lambda: b.g.linalg_solve(at, rhs.t)) if kind == "solve" else
                 (lambda: b.g.triangular_solve(at, rhs.t, upper=upper, left=left)))
        tag += f" upper={upper} left={left} rhs {list(bshape)}"
        return b.emit(kind, build, vs, d, e, tag, 8)
    if kind == "inv":
        vs = [np.linalg.inv(A) for A in vs_a]
        return b.emit("inv", lambda: b.g.inv(at), vs, d, 64 * n * u * amax(vs) * 3, tag, 8)
    if kind == "cholesky":
        upper = bool(r.random() < 0.5)
        vs = [np.linalg.cholesky(A) for A in vs_a]
        if upper:
            vs = [np.swapaxes(L, -1, -2) for L in vs]
        return b.emit("cholesky", lambda: b.g.cholesky(at, upper=upper), vs, d,
                      16 * n * u * amx, tag + f" upper={upper}", 8)
    if kind == "det":
        vs = [np.asarray(np.linalg.det(A)) for A in vs_a]
        return b.emit("det", lambda: b.g.det(at), vs, d, 16 * n * n * u * amax(vs), tag, 8)
    sign_ld = [np.linalg.slogdet(A) for A in vs_a]
    made = {}

    def build(which):
        if "res" not in made:
            made["res"] = b.g.slogdet(at)
        return made["res"][which]
    if b.emit("slogdet", lambda: build(0), [np.asarray(sl[0]) for sl in sign_ld], d, 0.0,
              tag + " sign", 0) is None:
        return None
    return b.emit("slogdet", lambda: build(1), [np.asarray(sl[1]) for sl in sign_ld], d,
                  16 * n * n * u, tag + " logabsdet", 8)


def gen_fft(b):
    """fft / ifft (c64, or f32 [..., n, 2] pairs; norm backward / ortho / forward), rfft of
    f32 and irfft (a given or default n) against np.fft in float64; bound: every output sums
    n products of f32 twiddles (generous: 8 n u of the sum of |x|, scaled by the norm)."""
    r = b.rng
    kind = str(r.choice(["fft", "ifft", "rfft", "irfft"]))
    norm = str(r.choice(["backward", "ortho", "forward"]))
    n = int(r.integers(1, 13))
    lead = tuple(int(x) for x in r.integers(1, 4, size=int(r.integers(0, 2))))
    pairs = kind in ("fft", "ifft") and ("c64" not in b.cfg.dtypes or r.random() < 0.5)
    inv = kind in ("ifft", "irfft")
    nf = n
    if kind == "irfft":
        m = int(r.integers(1, 8))
        n = int(r.integers(1, 13)) if r.random() < 0.5 else 2 * (m - 1) or 1
        given = n if r.random() < 0.5 or n != 2 * (m - 1) else None
        nf = n
        shape = lead + (m, 2)
    elif kind == "rfft":
        shape = lead + (n,)
    else:
        shape = lead + ((n, 2) if pairs else (n,))
    if math.prod(shape) * 2 > b.cfg.max_size:
        return
    d = "f32" if pairs or kind in ("rfft", "irfft") else "c64"
    x = b.pick(lambda v: v.d == d and v.shape == shape, complex_ok=True, shape=shape, d=d)
    if x is None:
        return
    scale = {"backward": 1.0 / nf if inv else 1.0, "forward": 1.0 if inv else 1.0 / nf,
             "ortho": 1.0 / math.sqrt(nf)}[norm]
    vs = []
    for v in x.vs:
        z = v[..., 0] + 1j * v[..., 1] if d == "f32" and kind != "rfft" else v
        if kind == "fft":
            y = np.fft.fft(z, axis=-1, norm=norm)
        elif kind == "ifft":
            y = np.fft.ifft(z, axis=-1, norm=norm)
        elif kind == "rfft":
            y = np.fft.rfft(z, axis=-1, norm=norm)
        else:
            y = np.fft.irfft(z, n=n, axis=-1, norm=norm)
        vs.append(np.stack([y.real, y.imag], -1) if kind == "rfft" or (pairs and kind != "irfft")
                  else y)
    od = "c64" if d == "c64" else "f32"
    e = (8 * nf * U32 + 2 * x.e) * nf * max(amax(x.vs), 1e-30) * scale * 2
    tag = f"{kind} {d} {list(shape)} norm={norm}" + (f" n={n}" if kind == "irfft" else "")
    if kind == "irfft":
        build = lambda: b.g.irfft(x.t, given, norm)  # noqa: E731
    elif kind == "rfft":
        build = lambda: b.g.rfft(x.t, norm)  # noqa: E731
    else:
        build = lambda: b.g.fft(x.t, inv, norm)  # noqa: E731
    return b.emit(kind, build, vs, od, e, tag, 8)


def gen_conv_transpose(b):
    """conv_transpose (1-d / 2-d; stride, padding, output_padding, dilation, groups, a bias):
    each input element scatters its filter; bound as conv's, Cin / groups * prod(k) terms."""
    r = b.rng
    d = str(r.choice(floats(b)))
    if d == "f64":
        d = "f32"
    nd, nb, groups, cin, cout, sp, k, stride, dil, pad = _conv_geometry(r, 5)
    opad = [int(r.integers(0, max(st, dl))) for st, dl in zip(stride, dil)]
    out = [(s_ - 1) * st - 2 * p_ + dl * (kk - 1) + op + 1
           for s_, st, p_, dl, kk, op in zip(sp, stride, pad, dil, k, opad)]
    if min(out) < 1:
        return
    xs, ws = (nb, cin, *sp), (cin, cout // groups, *k)
    if max(math.prod(xs), math.prod(ws), nb * cout * math.prod(out)) > b.cfg.max_size:
        return
    x = b.leaf(xs, d)
    w = b.leaf(ws, d, kind=str(r.choice(["param", "input"])))
    vs = []
    cg, og = cin // groups, cout // groups
    for i in range(2):
        y = np.zeros((nb, cout, *out))
        for idx in np.ndindex(*sp):
            for kidx in np.ndindex(*k):
                o = [ii * st - p_ + kk * dl for ii, st, p_, kk, dl in
                     zip(idx, stride, pad, kidx, dil)]
                if any(oo < 0 or oo >= ob for oo, ob in zip(o, out)):
                    continue
                for gi in range(groups):
                    xv = x.vs[i][(slice(None), slice(gi * cg, (gi + 1) * cg)) + idx]   # [N, cg]
                    wv = w.vs[i][(slice(gi * cg, (gi + 1) * cg), slice(None)) + kidx]  # [cg, og]
                    y[(slice(None), slice(gi * og, (gi + 1) * og)) + tuple(o)] += xv @ wv
        vs.append(y)
    kk = cg * math.prod(k)
    mx, mw = amax(x.vs), amax(w.vs)
    e = kk * (x.e * mw + w.e * mx) + 2 * kk * U32 * mx * mw
    kw = dict(stride=stride, padding=pad, output_padding=opad, dilation=dil, groups=groups)
    return b.emit("conv_transpose", lambda: b.g.conv_transpose(x.t, w.t, None, **kw), vs, d, e,
                  f"{d} x{list(xs)} w{list(ws)} {kw}")


def gen_batch_norm(b):
    """Inference batch_norm over x [N, C, *S] with running mean / var (positive) and maybe
    gamma / beta, per channel, in one rounding."""
    r = b.rng
    x = b.pick(lambda v: v.d in FLOATS and v.d != "f64" and 2 <= len(v.shape) <= 4
               and min(v.shape) >= 1, shape=b.shape(int(r.integers(2, 5))),
               d=str(r.choice([f for f in floats(b) if f != "f64"] or ["f32"])))
    if x is None or len(x.shape) < 2 or min(x.shape) < 1:
        return
    c = x.shape[1]
    mean = b.leaf((c,), "f32")
    var = b.leaf((c,), "f32", kind="constant")
    varv = rnd(np.abs(var.vs[0]) + 0.25, "f32")
    var.vs = [varv, varv]
    var.lo = var.hi = var.vs
    var.t = b.g.constant(varv.astype(np.float32), "f32")
    gamma = b.leaf((c,), "f32") if r.random() < 0.6 else None
    beta = b.leaf((c,), "f32") if r.random() < 0.6 else None
    eps = float(r.choice([1e-5, 1e-3]))
    cs = (1, c) + (1,) * (len(x.shape) - 2)
    vs = []
    for k in range(2):
        y = (x.vs[k] - mean.vs[k].reshape(cs)) / np.sqrt(varv.reshape(cs) + eps)
        if gamma is not None:
            y = y * gamma.vs[k].reshape(cs)
        if beta is not None:
            y = y + beta.vs[k].reshape(cs)
        vs.append(y)
    mg = amax(gamma.vs) if gamma else 1.0
    rs = 1 / math.sqrt(float(varv.min()) + eps)
    e = mg * rs * (x.e + mean.e + 8 * U32 * (amax(x.vs) + amax(mean.vs))) + 8 * U32 * amax(vs)
    tag = f"{x.d} {list(x.shape)} gamma={gamma is not None} beta={beta is not None} eps={eps}"
    return b.emit("batch_norm", lambda: b.g.batch_norm(
        x.t, mean.t, var.t, gamma.t if gamma else None, beta.t if beta else None, eps),
        vs, x.d, e, tag)


def _image(b, max_spatial):
    """An f32 / f16 / bf16 image [N, C, *S] of 1 or 2 spatial dims (an existing value or a
    new leaf, spatial dims below ``max_spatial``), or None."""
    r = b.rng
    nd = int(r.integers(1, 3))
    x = b.pick(lambda v: v.d in FLOATS and v.d != "f64" and len(v.shape) == nd + 2
               and min(v.shape) >= 1,
               shape=(int(r.integers(1, 3)), int(r.integers(1, 3)),
                      *[int(r.integers(1, max_spatial)) for _ in range(nd)]),
               d=str(r.choice([f for f in floats(b) if f != "f64"] or ["f32"])))
    return None if x is None or min(x.shape) < 1 else x


def gen_adaptive_pool(b):
    """adaptive_avg_pool (1-d / 2-d, None keeps a dim, channels_last): window o of a dim is
    [floor(o S / O), ceil((o + 1) S / O)), a mean in f32."""
    r = b.rng
    x = _image(b, 7)
    if x is None:
        return
    nd = len(x.shape) - 2
    cl = bool(r.random() < 0.25)
    sp = x.shape[1:-1] if cl else x.shape[2:]
    osz = [None if r.random() < 0.15 else int(r.integers(1, s_ + 3)) for s_ in sp]
    outs = [s_ if o is None else o for s_, o in zip(sp, osz)]
    vs = []
    for v in x.vs:
        z = np.moveaxis(v, -1, 1) if cl else v
        for j, (s_, o_) in enumerate(zip(sp, outs)):
            ax = 2 + j
            parts = [np.take(z, range((o * s_) // o_, -(-((o + 1) * s_) // o_)), axis=ax)
                     .mean(axis=ax, keepdims=True) for o in range(o_)]
            z = np.concatenate(parts, axis=ax)
        vs.append(np.moveaxis(z, 1, -1) if cl else z)
    win = math.prod(-(-s_ // o_) + 1 for s_, o_ in zip(sp, outs))
    e = x.e + 2 * win * U32 * amax(x.vs)
    size = osz[0] if nd == 1 and r.random() < 0.5 else tuple(osz)
    return b.emit("adaptive_avg_pool", lambda: b.g.adaptive_avg_pool(x.t, size, channels_last=cl),
                  vs, x.d, e, f"{x.d} {list(x.shape)} output_size={size} channels_last={cl}")


def _resize_src(n_in, n_out, align, factor, linear):
    """torch's upsample source positions of one axis (its float32 index math): nearest: an
    index; linear: (i0, i1, lambda)."""
    f = np.float32
    if align:
        sc = f((n_in - 1) / (n_out - 1)) if n_out > 1 else f(0.0)
    else:
        sc = f(1.0 / factor) if factor else f(n_in / n_out)
    out = []
    for o in range(n_out):
        if not linear:
            out.append(min(int(np.floor(f(o) * sc)), n_in - 1))
            continue
        src = f(o) * sc if align else max(f(sc * (f(o) + f(0.5)) - f(0.5)), f(0.0))
        i0 = min(int(src), n_in - 1)
        out.append((i0, min(i0 + 1, n_in - 1), float(f(src - f(i0)))))
    return out


def gen_resize(b):
    """resize (nearest, linear / bilinear; size or scale_factor; align_corners) over 1-2
    spatial dims of x [N, C, *S], against torch's index math written here."""
    r = b.rng
    x = _image(b, 6)
    if x is None:
        return
    nd = len(x.shape) - 2
    linear = bool(r.random() < 0.6)
    mode = ("linear" if nd == 1 else "bilinear") if linear else "nearest"
    align = bool(r.random() < 0.4) if linear else None
    sp = x.shape[2:]
    if r.random() < 0.5:
        factor = float(r.choice([0.5, 1.5, 2.0, 3.0]))
        outs = [int(np.floor(s_ * factor)) for s_ in sp]
        kw = dict(scale_factor=factor)
    else:
        factor = None
        outs = [int(r.integers(1, 8)) for _ in sp]
        kw = dict(size=outs[0] if nd == 1 else tuple(outs))
    if min(outs) < 1 or x.shape[0] * x.shape[1] * math.prod(outs) > b.cfg.max_size:
        return
    vs = []
    for v in x.vs:
        z = v
        for j, (s_, o_) in enumerate(zip(sp, outs)):
            ax = 2 + j
            src = _resize_src(s_, o_, bool(align), factor, linear)
            if linear:
                parts = [np.take(z, [i0], ax) * (1 - lam) + np.take(z, [i1], ax) * lam
                         for i0, i1, lam in src]
            else:
                parts = [np.take(z, [i0], ax) for i0 in src]
            z = np.concatenate(parts, axis=ax)
        vs.append(z)
    e = x.e + 8 * U32 * amax(x.vs)
    tag = f"{x.d} {list(x.shape)} {mode} {kw} align_corners={align}"
    return b.emit("resize", lambda: b.g.resize(x.t, mode=mode, align_corners=align, **kw), vs,
                  x.d, e, tag)


def gen_dot_general(b):
    """dot_general (lax's): contract some dims of a and b, batch others, in the order lax
    puts the result (batch, a's free dims, b's free dims)."""
    r = b.rng
    d = str(r.choice(floats(b)))
    nb, nc = int(r.integers(0, 2)), int(r.integers(1, 3))
    na, nbf = int(r.integers(0, 2)), int(r.integers(0, 2))
    sizes = [int(r.integers(1, 4)) for _ in range(nb + nc + na + nbf)]
    bs, cs = sizes[:nb], sizes[nb:nb + nc]
    fa, fb = sizes[nb + nc:nb + nc + na], sizes[nb + nc + na:]
    # a's dims: batch, contract, free in a random order; b's likewise
    a_roles = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + \
        [("f", i) for i in range(na)]
    b_roles = [("b", i) for i in range(nb)] + [("c", i) for i in range(nc)] + \
        [("g", i) for i in range(nbf)]
    a_roles = [a_roles[i] for i in r.permutation(len(a_roles))]
    b_roles = [b_roles[i] for i in r.permutation(len(b_roles))]
    size = {"b": bs, "c": cs, "f": fa, "g": fb}
    ashape = tuple(size[k][i] for k, i in a_roles)
    bshape = tuple(size[k][i] for k, i in b_roles)
    oshape = tuple(bs) + tuple(fa) + tuple(fb)
    if max(math.prod(ashape), math.prod(bshape), math.prod(oshape)) > b.cfg.max_size:
        return
    xa = b.pick(lambda v: v.d == d and v.shape == ashape, shape=ashape, d=d)
    xb = b.pick(lambda v: v.d == d and v.shape == bshape, shape=bshape, d=d)
    if xa is None or xb is None:
        return
    contracting = (tuple(a_roles.index(("c", i)) for i in range(nc)),
                   tuple(b_roles.index(("c", i)) for i in range(nc)))
    batch = (tuple(a_roles.index(("b", i)) for i in range(nb)),
             tuple(b_roles.index(("b", i)) for i in range(nb)))
    letters = "abcdefghij"
    la = "".join(letters[{"b": 0, "c": 2, "f": 4, "g": 6}[k] + i] for k, i in a_roles)
    lb = "".join(letters[{"b": 0, "c": 2, "f": 4, "g": 6}[k] + i] for k, i in b_roles)
    lo = "".join(letters[i] for i in range(nb)) + "".join(letters[4 + i] for i in range(na)) + \
        "".join(letters[6 + i] for i in range(nbf))
    vs = [np.einsum(f"{la},{lb}->{lo}", p, q) for p, q in zip(xa.vs, xb.vs)]
    kk = math.prod(cs)
    ma, mb = amax(xa.vs), amax(xb.vs)
    e = kk * (xa.e * mb + xb.e * ma) + 2 * kk * cu(d) * ma * mb
    return product(b.emit("dot_general", lambda: b.g.dot_general(xa.t, xb.t, contracting,
                                                                  batch), vs, d, e,
                          f"{d} {list(ashape)} x {list(bshape)} contract={contracting} "
                          f"batch={batch}"))


GENERATORS = {
    "unary": gen_unary, "binary": gen_binary, "compare": gen_compare, "where": gen_where,
    "cast": gen_cast, "reduce": gen_reduce, "argreduce": gen_argreduce, "cumsum": gen_cumsum,
    "softmax": gen_softmax, "norm": gen_norm, "gated": gen_gated, "matmul": gen_matmul,
    "grouped": gen_grouped,
    "linear": gen_linear, "attention": gen_attention, "rope": gen_rope, "conv": gen_conv,
    "pool": gen_pool, "pad": gen_pad, "sort": gen_sort, "scatter_add": gen_scatter_add,
    "einsum": gen_einsum, "group_norm": gen_group_norm, "cross_entropy": gen_cross_entropy,
    "complex": gen_complex, "specials": gen_specials, "linalg": gen_linalg, "fft": gen_fft,
    "conv_transpose": gen_conv_transpose, "batch_norm": gen_batch_norm,
    "adaptive_pool": gen_adaptive_pool, "resize": gen_resize, "dot_general": gen_dot_general,
    "reshape": gen_reshape, "transpose": gen_transpose, "narrow": gen_narrow,
    "concat": gen_concat, "expand": gen_expand, "gather": gen_gather,
}
WEIGHT = {"unary": 3, "binary": 4, "reshape": 2, "narrow": 2, "reduce": 2}


def build(seed, gi, cfg: Config):
    """Graph ``gi`` of ``seed``: the Builder with its graph, feeds and outputs chosen."""
    rng = np.random.default_rng([seed, gi])
    b = Builder(rng, cfg, f"fuzz_{seed}_{gi}")
    names = [n for n in GENERATORS if cfg.ops is None or n in cfg.ops]
    w = np.array([WEIGHT.get(n, 1) for n in names], np.float64)
    target = int(rng.integers(1, cfg.max_nodes + 1))
    b.leaf(kind="input")
    tries = 0
    while b.n_ops < target and tries < 30 * target:
        tries += 1
        GENERATORS[names[int(rng.choice(len(names), p=w / w.sum()))]](b)
    nodes = [v for v in b.vals if not v.leaf]
    if not nodes:
        return b, []
    # outputs: the last node and a random subset of the others (intermediates, views, and
    # now and then a leaf or one node twice)
    outs = [nodes[-1]] + [v for v in nodes[:-1] if v.special or rng.random() < 0.35]
    if rng.random() < 0.1:
        outs.append(b.vals[int(rng.integers(len(b.vals)))])
    if rng.random() < 0.05:
        outs.append(outs[0])
    rng.shuffle(outs)
    b.g.set_outputs([v.t for v in outs])
    return b, outs


# ---- running and comparing -------------------------------------------------------------------
def to_host(x, d):
    """A run() result as a host array of dtype d (view outputs: device arrays, bf16 as bits)."""
    if hasattr(x, "copy_to_host"):
        x = x.copy_to_host()
        if d == "bf16":
            if x.dtype != np.uint16:
                raise Finding(f"view output: bf16 came back as {x.dtype}, want uint16 bits")
            x = x.view(ml_dtypes.bfloat16)
    return x


def compare(got, v: Val, k):
    """None, or what is wrong with ``got`` for the reference of input set ``k``."""
    want = v.vs[k]
    if got.dtype != np.dtype(HOST[v.d]):
        return f"dtype {got.dtype}, want {np.dtype(HOST[v.d])}"
    if got.shape != want.shape:
        return f"shape {got.shape}, want {want.shape}"
    if v.d == "c64":
        g = got.astype(np.complex128)
        for part in ("real", "imag"):
            what = _outside(getattr(g, part), getattr(want, part), getattr(v.lo[k], part),
                            getattr(v.hi[k], part))
            if what:
                return f"{part} parts: {what}"
        return None
    if v.d not in FLOATS:
        bad = got.astype(want.dtype) != want
        if bad.any():
            i = np.unravel_index(int(np.argmax(bad)), bad.shape) if bad.ndim else ()
            return (f"{int(bad.sum())} of {bad.size} differ; at {i}: got {got[i]!r}, "
                    f"want {want[i]!r}")
        return None
    return _outside(got.astype(np.float64), want, v.lo[k], v.hi[k])


def _outside(g64, want, lo, hi):
    """None, or how many of ``g64`` lie outside [lo, hi] (NaN where want is NaN passes)."""
    same_special = (np.isnan(g64) & np.isnan(want)) | (g64 == want)
    bad = ~((g64 >= lo) & (g64 <= hi)) & ~same_special
    if bad.any():
        err = np.abs(g64 - want)
        i = np.unravel_index(int(np.argmax(np.where(bad, np.nan_to_num(err, nan=np.inf), -1))),
                             bad.shape) if bad.ndim else ()
        return (f"{int(bad.sum())} of {bad.size} outside their bounds; max error "
                f"{float(np.max(np.where(bad, err, 0))):.3g}; at {i}: got {g64[i]!r}, want "
                f"{want[i]!r}, allowed [{lo[i]!r}, {hi[i]!r}]")
    return None


@dataclass
class Report:
    graphs: int = 0
    nodes: int = 0
    runs: int = 0
    findings: list = field(default_factory=list)
    refused: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    grad_graphs: int = 0         # graphs whose gradients were checked (--grads)


def repro(seed, gi, cfg):
    return (f"python -m tools.fuzz --seed {seed} --only {gi} --dtypes {','.join(cfg.dtypes)} "
            f"--max-nodes {cfg.max_nodes} --max-size {cfg.max_size} --max-dim {cfg.max_dim} "
            f"--modes {','.join(cfg.modes)}"
            + (f" --zero-dims {cfg.zero_dims}" if cfg.zero_dims else "")
            + (f" --compile-mode {cfg.compile_mode}" if cfg.compile_mode != "jit" else "")
            + (f" --ops {','.join(cfg.ops)}" if cfg.ops else "")
            + (" --grads" if cfg.grads else ""))


def _failure() -> str:
    """The exception being handled: its type and message on the finding's first line (what a
    grep of a long run shows), then the traceback."""
    e = sys.exc_info()[1]
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n{traceback.format_exc()}"


def fuzz_one(seed, gi, cfg: Config, rep: Report, out=print):
    def finding(what, g=None):
        msg = (f"FINDING seed={seed} graph={gi}: {what}\n  reproduce: {repro(seed, gi, cfg)}\n"
               + (str(g) if g is not None else ""))
        rep.findings.append(msg)
        out(msg)
    try:
        b, outs = build(seed, gi, cfg)
    except Finding as ex:
        finding(str(ex))
        return
    except Exception:
        finding("unexpected exception while building: " + _failure())
        return
    rep.refused.update(b.refused)
    if not outs:
        return
    rep.graphs += 1
    rep.nodes += b.n_ops
    for n in b.g.nodes:
        rep.ops[n.op] += 1
    for mode in cfg.modes:
        try:
            exe = rlx.compile(b.g, compile_mode=cfg.compile_mode, exec_mode=mode)
        except Exception:
            finding(f"mode={mode}: compile failed: {_failure()}", b.g)
            continue
        # two runs with different inputs and params (set_param before each): numpy outputs,
        # then the arena views; in the first mode a third, back on the first inputs, with
        # fresh device copies (stale state)
        runs = ((0, "numpy"), (1, "view")) + (((0, "device"),) if mode == cfg.modes[0] else ())
        for k, kind in runs:
            try:
                for name, arrs in b.params.items():
                    exe.set_param(name, arrs[k])
                res = exe.run(b.feeds[k], outputs=kind)
                res = [to_host(x, v.d) for x, v in zip(res, outs)]
            except Exception:
                finding(f"mode={mode} run={k} outputs={kind}: run failed: {_failure()}", b.g)
                break
            rep.runs += 1
            for j, (got, v) in enumerate(zip(res, outs)):
                what = compare(np.asarray(got), v, k)
                if what:
                    finding(f"mode={mode} run={k} outputs={kind} output #{j} (%{v.t.id} "
                            f"{v.d}{list(v.shape)}, error bound {v.e:.3g}): {what}", b.g)
    if cfg.grads and differentiable(b.g) and all(v.d == "f32" for v in outs):
        try:
            what = grad_check(b, outs, cfg)
        except Exception:
            what = f"gradient check failed: {_failure()}"
        if what is not None:
            rep.grad_graphs += 1
        if what:
            finding(what, b.g)


# ---- gradients -------------------------------------------------------------------------------
SMOOTH = {   # op -> the attribute and values with a derivative everywhere the generators go
    "activation": ("kind", {"gelu", "gelu_tanh", "silu", "sigmoid", "tanh", "exp", "log",
                            "sqrt", "rsqrt", "neg", "sin", "cos", "tan", "atan"}),
    "binary": ("kind", {"add", "sub", "mul", "div"}),
    "reduce": ("kind", {"sum", "mean"}),
    "linear": ("activation", {None, "gelu", "gelu_tanh", "silu", "sigmoid", "tanh"}),
    "gated": ("activation", {"gelu", "gelu_tanh", "silu", "sigmoid", "tanh"}),
    "pool": ("kind", {"avg"}),
}
SHAPE_OPS = {"input", "param", "constant", "reshape", "transpose", "narrow", "concat", "expand",
             "gather", "softmax", "log_softmax", "layer_norm", "rms_norm", "matmul",
             "residual_sum", "cumsum", "attention", "rope", "conv", "resample", "channel_affine",
             "scatter_add", "cross_entropy", "lu_solve", "trsm", "slogdet", "conv_transpose"}
# (not cholesky: its gradient is the symmetric one torch gives, for a symmetric A, which
# central differences of one entry at a time do not measure)


def differentiable(g) -> bool:
    """Every node of ``g`` differentiable wherever the generators put values (no kinks,
    steps or integer results besides gather indices)."""
    for n in g.nodes:
        if n.op in SMOOTH:
            attr, ok = SMOOTH[n.op]
            if n.attrs.get(attr) not in ok:
                return False
        elif n.op not in SHAPE_OPS:
            return False
    return True


def grad_check(b, outs, cfg, coords: int = 3):
    """None (nothing to check: no f32 input), "" (the gradients agree), or a finding: dL/dx
    from g.grad against (L(x + h) - L(x - h)) / 2h at ``coords`` entries of each f32 input,
    L = sum_k sum(out_k * W_k), in f32 through the compiled forward; a coordinate where the
    differences at h and h / 2 disagree is skipped (curvature or f32 noise at that scale), and
    the tolerance includes the differences' resolution (16 ulps of the f32 loss over 2h)."""
    g = b.g
    rng = np.random.default_rng(len(g.nodes))
    names = [n for n, a in b.feeds[0].items() if a.dtype == np.float32 and a.size]
    if not names:
        return None
    loss = None
    for v in outs:
        w = g.constant(rng.standard_normal(v.shape).astype(np.float32))
        term = g.reduce_sum(v.t * w) if v.shape else v.t * w
        loss = term if loss is None else loss + term
    ins = {n.name: g.tensor(n.id) for n in g.nodes if n.op == "input"}
    grads = g.grad(loss, [ins[n] for n in names])
    g.set_outputs([loss] + list(grads))
    exe = rlx.compile(g)
    for name, arrs in b.params.items():
        exe.set_param(name, arrs[0])
    feed = {k: v.copy() for k, v in b.feeds[0].items()}
    got = exe.run(feed)
    for name, dx in zip(names, got[1:]):
        x = feed[name]
        scale = float(np.max(np.abs(dx), initial=0.0)) + 1e-3
        for idx in rng.choice(x.size, min(coords, x.size), replace=False):
            i = np.unravel_index(int(idx), x.shape)
            x0, an = x[i], float(dx[i])
            fd, noise = [], 0.0
            for h in (np.float32(1e-2 * max(1.0, abs(float(x0)))),
                      np.float32(5e-3 * max(1.0, abs(float(x0))))):
                x[i] = x0 + h
                lp = float(exe.run(feed)[0])
                x[i] = x0 - h
                lm = float(exe.run(feed)[0])
                x[i] = x0
                step = float(x0 + h) - float(x0 - h)
                fd.append((lp - lm) / step)
                # the f32 loss is known to a few ulps: the differences' own resolution
                noise = max(noise, 16 * float(np.spacing(np.float32(max(abs(lp), abs(lm)))))
                            / step)
            tol = 3e-2 * (abs(an) + scale) + noise
            # two step sizes that disagree: too curved (or too noisy in f32) to judge there
            if abs(fd[0] - fd[1]) <= tol / 3 and not abs(fd[1] - an) <= tol:
                return (f"gradient of input {name!r} at {i}: g.grad gives {an:.6g}, central "
                        f"differences {fd[1]:.6g} (and {fd[0]:.6g} at twice the step; largest "
                        f"|grad| {scale:.3g})")
    return ""


def _print(msg):
    print(msg, flush=True)


def fuzz(n, seed, cfg: Config, only=None, out=_print, seconds=None) -> Report:
    """Graphs 0 .. n - 1 of ``seed`` (or graph ``only``); with ``seconds``, no graph starts
    after that long (the first always runs; a time-boxed slice still reports what it
    checked)."""
    rep = Report()
    t0 = time.time()
    for gi in ([only] if only is not None else range(n)):
        fuzz_one(seed, gi, cfg, rep, out)
        if seconds is not None and time.time() - t0 > seconds:
            break
    return rep


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tools.fuzz", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=50, help="graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="stream,graph,eager",
                   help="exec modes, comma-separated: stream, graph, eager, multistream(n)")
    p.add_argument("--dtypes", default="f32,f16,bf16,f64,i32,c64")
    p.add_argument("--max-nodes", type=int, default=8)
    p.add_argument("--compile-mode", default="jit", choices=("jit", "aot"))
    p.add_argument("--max-size", type=int, default=120, help="elements per tensor at most")
    p.add_argument("--max-dim", type=int, default=7, help="dims are 1..MAX_DIM")
    p.add_argument("--zero-dims", type=float, default=0.0, help="chance of a 0 dim in a leaf")
    p.add_argument("--ops", default=None, help=f"generators to use, of {','.join(GENERATORS)}")
    p.add_argument("--only", type=int, default=None, help="run graph ONLY of the seed")
    p.add_argument("--print-graphs", action="store_true")
    p.add_argument("--grads", action="store_true",
                   help="also check gradients of differentiable f32 graphs (module doc)")
    p.add_argument("--seconds", type=float, default=None,
                   help="start no graph after this many seconds (the summary counts those run)")
    a = p.parse_args(argv)
    cfg = Config(dtypes=tuple(a.dtypes.split(",")), modes=tuple(a.modes.split(",")),
                 max_nodes=a.max_nodes, max_size=a.max_size, max_dim=a.max_dim,
                 zero_dims=a.zero_dims, compile_mode=a.compile_mode,
                 ops=tuple(a.ops.split(",")) if a.ops else None, grads=a.grads)
    for d in cfg.dtypes:
        if d not in ("f32", "f16", "bf16", "f64", "i32", "c64"):
            p.error(f"--dtypes: {d!r} is not one of f32, f16, bf16, f64, i32, c64")
    for o in cfg.ops or ():
        if o not in GENERATORS:
            p.error(f"--ops: unknown generator {o!r}")
    if a.print_graphs and a.only is not None:
        b, _ = build(a.seed, a.only, cfg)
        print(b.g)
    t0 = time.time()
    rep = fuzz(a.n, a.seed, cfg, only=a.only, seconds=a.seconds)
    dt = time.time() - t0
    print(f"fuzz: {rep.graphs} graphs, {rep.nodes} ops, {rep.runs} runs, modes "
          f"{','.join(cfg.modes)}, {dt:.1f} s; {len(rep.findings)} finding(s)"
          + (f"; gradients checked on {rep.grad_graphs} graphs" if cfg.grads else ""))
    print("ops built: " + ", ".join(f"{k} {v}" for k, v in sorted(rep.ops.items())))
    if rep.refused:
        print("refused at build time (ValueError, skipped):")
        for k, v in rep.refused.most_common():
            print(f"  {v:4d}  {k}")
    return 1 if rep.findings else 0


if __name__ == "__main__":
    sys.exit(main())
